"""benchmarks/bench_first_call.py on the CPU: each configuration runs in its own process with
empty compile caches, and its first call's split adds up to the call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_splits_each_first_call(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_first_call.py"), "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_first_call.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["dense", "m3_sparse", "m3_sparse-ahead"]
    for r in rows:
        assert r["status"] == "ok" and len(r["tokens"]) == 4, r
        assert r["kernels"] == [] and r["compiles"] == 0  # the interpreter compiles nothing
        for call in (r["first"], r["warm"]):
            parts = sum(call[k] for k in ("triton", "inductor", "graphs", "flash_attn_4", "other"))
            assert call["s"] > 0 and abs(parts - call["s"]) < 1e-6 and call["other"] >= 0, call
    # The same greedy tokens whether the kernels compile ahead or not.
    assert rows[1]["tokens"] == rows[2]["tokens"]
    assert "| m3_sparse-ahead |" in (tmp_path / "bench_first_call.md").read_text()


def test_a_compile_is_named_by_its_kernel():
    """Each Triton compile is logged under its kernel's name: a JIT function's ``__name__``
    (what ``triton.compiler.compile`` gets as ``src.fn``), else the source's ``name``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_first_call

    class JitSource:
        def __init__(self, fn):
            self.fn = fn

    def _kvouter_partials_kernel():
        pass

    class IRSource:
        name = "_combine_kernel"

    assert bench_first_call.kernel_name(JitSource(_kvouter_partials_kernel)) == "_kvouter_partials_kernel"
    assert bench_first_call.kernel_name(IRSource()) == "_combine_kernel"
    assert bench_first_call.kernel_name(None) == "NoneType"
