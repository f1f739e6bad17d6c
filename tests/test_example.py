"""examples/generate.py end to end, as a user runs it: a subprocess on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "generate.py"
TIMEOUT_S = 600


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # The random model is built locally; a hub request would be a bug.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    # Shared by the runs of this module, so that only the first one builds the model.
    return tmp_path_factory.mktemp("example-work")


def test_help():
    proc = _run("--help")
    assert proc.returncode == 0, _explain(proc)
    for option in ("--model", "--prompt", "--prompt-tokens", "--max-new-tokens", "--batch-size", "--device",
                   "--dtype", "--compare-sdpa", "--seed", "--work-dir"):
        assert option in proc.stdout, f"{option} missing from --help\n{proc.stdout}"


def test_generate_matches_sdpa(work_dir):
    proc = _run("--max-new-tokens", "8", "--compare-sdpa", "--work-dir", str(work_dir), "--device", "cpu")
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    assert "compare-sdpa: AGREE" in out, _explain(proc)
    assert "row 0: generated tokens identical (8 tokens)" in out, _explain(proc)
    assert "prefill logits close" in out, _explain(proc)
    assert "prefill:" in out and "tokens/s" in out, _explain(proc)
    assert (work_dir / "tiny-m3" / "config.json").is_file()


def test_left_padded_batch_matches_sdpa(work_dir):
    # Rows of different lengths: the batch is left padded, each row checked against an unpadded sdpa run.
    proc = _run(
        "--batch-size", "2", "--prompt-tokens", "96", "--max-new-tokens", "4",
        "--compare-sdpa", "--work-dir", str(work_dir), "--device", "cpu",
    )
    assert proc.returncode == 0, _explain(proc)
    assert "lengths [96, 84]" in proc.stdout, _explain(proc)
    assert proc.stdout.count("generated tokens identical (4 tokens)") == 2, _explain(proc)
    assert "compare-sdpa: AGREE" in proc.stdout, _explain(proc)


def test_disagreement_exits_1(work_dir):
    # A zero logit tolerance cannot be met by two float implementations: the failure path must be loud.
    proc = _run(
        "--prompt", "hello sparse attention", "--max-new-tokens", "2", "--compare-sdpa", "--logit-tol", "0",
        "--work-dir", str(work_dir), "--device", "cpu",
    )
    assert proc.returncode == 1, _explain(proc)
    assert "compare-sdpa: DISAGREE" in proc.stdout, _explain(proc)
    assert "m3_sparse and sdpa disagree" in proc.stderr, _explain(proc)
