"""The GPU reliability scripts' own logic, on the CPU: compute-sanitizer summaries are
parsed right (a missed error count would report a dirty run as clean), and the
long-run stability verdict flags growth."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
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


def test_first_finding_is_kept():
    san = load("sanitize")
    first = san.parse_log(MEMCHECK_DIRTY)["first_finding"]
    assert first.splitlines()[0].endswith("Invalid __global__ read of size 2 bytes")
    assert "_kvouter_partials_kernel" in first
    assert san.parse_log(MEMCHECK_CLEAN)["first_finding"] is None
