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
            assert call["compile"].keys() == {"phases", "inductor_kernels", "calls_captured", "graphs"}, call
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


def test_a_call_s_compile_account_counts_what_it_compiled():
    """``compile_state`` before and after a call: the frames dynamo captured, their graphs and
    the phases' seconds that call added (a backend that generates no kernels here)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_first_call
    import torch

    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x.sin() + 1).cos(), backend="aot_eager")
    before = bench_first_call.compile_state()
    fn(torch.randn(8))
    added = bench_first_call.compile_delta(before, bench_first_call.compile_state())
    assert added["graphs"] == 1 and added["calls_captured"] >= 3 and added["inductor_kernels"] == 0, added
    assert added["phases"] and all(t >= 0.005 for t in added["phases"].values()), added
    again = bench_first_call.compile_state()
    fn(torch.randn(8))  # warm: nothing more
    assert bench_first_call.compile_delta(again, bench_first_call.compile_state())["graphs"] == 0


def test_the_compile_table_lists_the_phases_that_differ_most_from_dense():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_first_call

    def row(config, phases, kernels):
        first = {"compile": {"phases": phases, "inductor_kernels": kernels, "calls_captured": 10 * kernels, "graphs": 2}}
        return {"config": config, "status": "ok", "first": first}

    n = bench_first_call.PHASES_SHOWN + 2
    phases = {f"p{i:02d}": 1.0 for i in range(n)}
    # m3_sparse's phase i takes i / 10 s more than dense's (less for odd i); one phase is its own.
    m3 = {name: 1.0 + (-1) ** i * i / 10 for i, name in enumerate(phases)} | {"only_m3": 0.55}
    table = bench_first_call.compile_table([row("dense", phases, 4), row("m3_sparse", m3, 7)])
    lines = table.splitlines()
    assert lines[0] == "| phase | dense | m3_sparse |"
    shown = [ln.split(" | ")[0].removeprefix("| ") for ln in lines[2:2 + bench_first_call.PHASES_SHOWN]]
    want = sorted([*phases, "only_m3"], key=lambda p: -(0.55 if p == "only_m3" else int(p[1:]) / 10))
    assert shown == want[:bench_first_call.PHASES_SHOWN], shown  # the largest gaps, either sign
    assert "| kernels inductor generated | 4 | 7 |" in table and "| calls dynamo captured | 40 | 70 |" in table
    assert bench_first_call.compile_table([row("m3_sparse", m3, 7)]) is None  # nothing to compare with
    failed = {"config": "dense", "status": "failed"}
    assert bench_first_call.compile_table([failed, row("m3_sparse", m3, 7)]) is None
