"""The GPU reliability scripts' own logic, on the CPU: compute-sanitizer summaries are
parsed right (a missed error count would report a dirty run as clean), the sanitizer's
cases reach the kernels they name, the long-run stability verdict flags growth, the
m3_sparse / sdpa agreement sweep and diagnosis run end to end, and the result files the
scripts share (benchmarks/common.py) are strict JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "reliability" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MEMCHECK_CLEAN = """========= COMPUTE-SANITIZER
case kvouter: 9 runs, 0 mismatches, 3.1 s
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_DIRTY = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 2 bytes
=========     at _kvouter_partials_kernel+0x1a30
=========     by thread (3,0,0) in block (17,0,0)
=========     Address 0x7f3a00000000 is out of bounds
========= ERROR SUMMARY: 12 errors
"""

RACECHECK = """========= COMPUTE-SANITIZER
========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)
========= ERROR SUMMARY: 1 error
"""


def test_sanitizer_summaries_are_parsed():
    san = load("sanitize")
    assert san.parse_log(MEMCHECK_CLEAN)["errors"] == 0
    assert san.parse_log(MEMCHECK_DIRTY)["errors"] == 12
    race = san.parse_log(RACECHECK)
    assert (race["errors"], race["race_errors"], race["race_warnings"]) == (1, 1, 2)
    # A run that died before its summary has no count at all (reported as a failure).
    assert san.parse_log("========= COMPUTE-SANITIZER\nSegmentation fault\n")["errors"] is None


def test_every_kernel_family_has_a_case():
    san = load("sanitize")
    assert {"index_prefill", "index_decode", "index_fp8", "kvouter", "dense", "decode_attention"} <= set(san.CASES)


def test_long_run_stability_verdict():
    lr = load("long_run")
    mib = 2**20
    flat = [(0, 0.0, 900 * mib, 5000 * mib)] + [(s, 0.0, 100 * mib + 8 * s, 120 * mib) for s in range(100, 2001, 100)]
    assert lr.stability(flat, 2000, cuda=True)["stable"] is True
    leak = [(0, 0.0, 900 * mib, 5000 * mib)] + [(s, 0.0, 100 * mib + s * 4096, 120 * mib) for s in range(100, 2001, 100)]
    assert lr.stability(leak, 2000, cuda=True)["stable"] is False
    peak = [(0, 0.0, 900 * mib, 5000 * mib)] + [(s, 0.0, 100 * mib, 120 * mib + s * 4096) for s in range(100, 2001, 100)]
    assert lr.stability(peak, 2000, cuda=True)["stable"] is False


def test_long_run_reserved_memory_and_settle_steps():
    """Reserved memory may grow by two allocator segments after the settle steps, not more;
    growth before them (compilation, graph recording) does not count."""
    lr = load("long_run")
    mib = 2**20

    def samples(reserved):
        return [(0, 0.0, 900 * mib, 5000 * mib, 6000 * mib)] + [
            (s, 0.0, 100 * mib, 120 * mib, reserved(s)) for s in range(10, 2001, 10)]

    within = lr.stability(samples(lambda s: 200 * mib + (s >= 1000) * 40 * mib), 2000, cuda=True)
    assert within["stable"] is True and within["reserved_growth_bytes"] == 40 * mib
    grows = lr.stability(samples(lambda s: 200 * mib + s * 64 * 1024), 2000, cuda=True)
    assert grows["stable"] is False
    early = samples(lambda s: 200 * mib + (s >= 30) * 500 * mib)
    assert lr.stability(early, 2000, cuda=True, settle=1)["stable"] is False
    settled = lr.stability(early, 2000, cuda=True, settle=30)
    assert settled["stable"] is True and settled["from_step"] == 30


def test_long_run_divergence_tells_a_near_tie():
    """Two runs that agree through step 2 and pick different tokens at step 3: a near-tie
    when each run's margin is within the runs' logit difference so far, not otherwise."""
    import types

    import torch

    lr = load("long_run")
    base = torch.tensor([[5.0, 1.0, 0.0], [0.0, 4.0, 1.0], [1.0, 0.0, 3.0], [2.0, 2.01, 0.0]])
    noisy = base + torch.tensor([0.0, 0.0, 0.05])  # 0.05 of rounding difference in every step
    noisy[3] = torch.tensor([2.02, 2.0, 0.05])
    run = lambda logits: {"probe": types.SimpleNamespace(logits=logits), "tokens": logits.argmax(-1)}  # noqa: E731
    d = lr.divergence(run(base), run(noisy), lr.first_difference(base.argmax(-1), noisy.argmax(-1)))
    assert d["step"] == 3 and d["tokens"] == (1, 0) and d["near_tie"]
    assert d["margins"] == pytest.approx((0.01, 0.02)) and d["rounding_difference"] == pytest.approx(0.05)
    noisy[3] = torch.tensor([3.0, 2.0, 0.05])  # eager's margin 1.0: far beyond the runs' difference
    d = lr.divergence(run(base), run(noisy), 3)
    assert not d["near_tie"]


def test_long_run_quick_compiled_mode_on_the_cpu(tmp_path):
    """The CPU smoke run in compiled mode: generate() compiles nothing on the CPU, so the run
    must fail on that check alone (memory flat, fresh-cache run identical, the eager run
    compared)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "reliability" / "long_run.py"), "--quick", "--prompt-len", "200",
         "--steps", "24", "--sample-every", "4", "--settle-steps", "4", "--decode", "compiled", "--compare-eager",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "long_run.json").read_text())
    assert result["compiled_ok"] is False and result["ok"] is False
    assert result["run_a"]["compiled_calls"] == 0
    assert result["same_tokens"] and result["same_logits"]
    for run in ("run_a", "run_b"):
        assert result[run]["stability"]["stable"] is True, result[run]["stability"]
        assert result[run]["stability"]["from_step"] == 4
    assert result["eager_comparison"]["first_token_difference"] is None
    assert "generate() did not compile" in proc.stdout


def test_first_finding_is_kept():
    san = load("sanitize")
    first = san.parse_log(MEMCHECK_DIRTY)["first_finding"]
    assert first.splitlines()[0].endswith("Invalid __global__ read of size 2 bytes")
    assert "_kvouter_partials_kernel" in first
    assert san.parse_log(MEMCHECK_CLEAN)["first_finding"] is None


def test_sanitize_pins_each_op_through_its_config():
    """The cases choose torch or Triton (and KV-outer's partials kernel) by the ops' configs:
    every op named must have its config class, and the choice must reach the call."""
    san = load("sanitize")
    import m3_sparse

    def op(name):
        def call(*args, config=None, **kwargs):
            return config

        call.__name__ = name
        return call

    for name, cls in san.OP_CONFIGS.items():
        assert callable(getattr(m3_sparse, name))
        for impl in ("torch", "triton"):
            config = san.with_impl(impl, op(name))
            assert isinstance(config, getattr(m3_sparse, cls)) and config.impl == impl
    assert san.with_impl("triton", op("index_topk"), config_settings={"num_splits": 3}).num_splits == 3
    san.KVOUTER_ENGINE = "triton"
    assert san.with_impl("triton", op("kvouter_attention")).engine == "triton"
    assert san.with_impl("torch", op("kvouter_attention")).engine == "auto"


def test_results_are_strict_json(tmp_path):
    """Every script's JSON goes through common.write_json: NaN / inf (a failed variant)
    become null, so the files load anywhere; Results rows carry the run's environment."""
    import json
    import math

    spec = importlib.util.spec_from_file_location("common", ROOT / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    results = common.Results("bench_x", tmp_path)
    results.add("case", float("nan"), what="variant", sizes={"n": 8}, baseline="other", baseline_ms=2.0,
                err=math.inf, shape=(1, 2))
    path = results.write()
    assert path == tmp_path / "bench_x.json"
    (row,) = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert row["ms"] is None and row["metrics"] == {"err": None, "shape": [1, 2]}
    for key in ("bench", "case", "sizes", "baseline", "baseline_ms", "device", "torch", "triton", "date", "command"):
        assert key in row
    assert common.result_path(tmp_path / "mem.json", "bench_memory") == tmp_path / "mem.json"


def test_sdpa_agreement_sweep_and_diagnosis(tmp_path, capsys):
    agreement = load("sdpa_agreement")
    assert agreement.seeds("0-2,5") == [0, 1, 2, 5]
    small = ["--device", "cpu", "--work-dir", str(tmp_path), "--prompt-tokens", "80", "--batch-sizes", "2",
             "--max-new-tokens", "2"]
    assert agreement.main([*small, "--seeds", "0-1", "--out", str(tmp_path / "sweep")]) == 0
    assert "rows: 4 agree, 0 near-tie, 0 disagree" in capsys.readouterr().out
    rows = json.loads((tmp_path / "sweep" / "sdpa_agreement.json").read_text())["rows"]
    assert [(r["seed"], r["verdicts"]) for r in rows] == [(0, ["agree", "agree"]), (1, ["agree", "agree"])]

    assert agreement.main([*small, "--seeds", "0", "--diagnose", "--torch-impl", "--out", str(tmp_path / "diag")]) == 0
    out = capsys.readouterr().out
    assert out.count("no selection differs from sdpa's") == 2, out
    assert out.count("--compare-sdpa's verdict: agree") == 2, out
    assert "M3_SPARSE_IMPL=torch: 0 selections differ" in out, out
