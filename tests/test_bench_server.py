"""benchmarks/bench_server.py on the CPU: guidellm drives m3-serve (the toy M3-shaped model) and
its dense twin; each run's figures come back from guidellm's own report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("guidellm")
ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_reports_each_server_under_guidellm(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--quick", "--out", str(tmp_path),
           "--seconds", "3", "--sweep-size", "2", "--concurrency", "2", "--new-tokens", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_server.json").read_text())["rows"]
    assert {(r["config"], r["strategy"]) for r in rows} >= {
        (c, s) for c in ("m3_sparse", "dense") for s in ("synchronous", "concurrent")
    }
    for r in rows:
        assert r["errored"] == 0, r
        if r["strategy"] in ("synchronous", "concurrent"):
            assert r["requests"] > 0 and r["output_tok_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"], r
            assert 0 <= r["goodput_share"] <= 1 and r["goodput_requests_s"] <= r["requests_s"] * 1.5, r
    # Every request generated all its tokens: the checkpoints have no end-of-sequence token.
    report = json.loads((tmp_path / "guidellm-m3_sparse-sf-concurrent.json").read_text())
    done = report["benchmarks"][0]["requests"]["successful"]
    assert done and all(r["output_tokens"] == 4 for r in done)
    assert "| sf | m3_sparse | concurrent |" in (tmp_path / "bench_server.md").read_text()
