"""``attn_implementation="<org>/m3-sparse"``: transformers loads the kernel through ``kernels``
(offline here: LOCAL_KERNELS maps the repo id to this source tree) and runs the whole
integration from it, without ``import m3_hf_attention``: the paged cache by default, the
m3_sparse mask function, and the same tokens as the package path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_utils import greedy, save_tiny_text_model

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "m3-hf-attention/m3-sparse"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-hub")
    save_tiny_text_model(path, seed=2)
    return path


def _run(checkpoint, impl):
    env = dict(os.environ)
    env["LOCAL_KERNELS"] = f"{REPO_ID}={ROOT}"
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "hub_string_generate.py"), str(checkpoint), impl, DEVICE],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("suffix", ["", ":m3_sparse_attention"], ids=["repo", "repo:function"])
def test_hub_string_generates_like_the_package(checkpoint, suffix):
    got = _run(checkpoint, REPO_ID + suffix)
    assert got["attn_implementation"] == REPO_ID + suffix
    assert not got["imported_m3_hf_attention"]
    assert got["cache"] == "M3PagedCache" and got["cache_module"].endswith(".hf.cache")
    # transformers pairs a hub attention function with its own mask function; ours replaces it.
    assert got["mask_function"].endswith("hf.mask.m3_sparse_mask")

    import m3_hf_attention  # noqa: F401  (the package path, in this process)

    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse").eval().to(DEVICE)
    ids = torch.tensor(got["prompt"], device=DEVICE)
    mask = torch.tensor(got["mask"], device=DEVICE)
    ref = greedy(model, ids, mask, new_tokens=8)
    assert ref[:, ids.shape[1] :].tolist() == got["generated"]
