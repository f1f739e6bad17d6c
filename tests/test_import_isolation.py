"""``import m3_hf_attention`` changes nothing for transformers' own attention implementations:
``sdpa`` and ``eager`` give bitwise the same logits and tokens (one pass, generate() with the
dynamic cache, with a chunked prefill, with a static cache) in a process that imported the
package as in one that never did. Each side runs in a fresh interpreter, since this test
process has long imported the package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_utils import save_tiny_text_model

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "stock_outputs.py"


def _outputs(checkpoint: Path, out: Path, mode: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU: bitwise comparisons need one deterministic device
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(checkpoint), str(out), mode],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{mode} run failed:\n{proc.stderr[-4000:]}"
    return torch.load(out)


def test_stock_attention_unchanged_by_import(tmp_path):
    checkpoint = tmp_path / "tiny-m3"
    save_tiny_text_model(checkpoint, seed=3)
    plain = _outputs(checkpoint, tmp_path / "plain.pt", "plain")
    imported = _outputs(checkpoint, tmp_path / "imported.pt", "imported")
    assert sorted(plain) == sorted(imported)
    assert len(plain) == 12  # 2 implementations x (one pass; dynamic and chunked: tokens, logits; static)
    for name, expected in plain.items():
        got = imported[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got, expected), f"{name}: max abs difference {(got.double() - expected.double()).abs().max()}"

