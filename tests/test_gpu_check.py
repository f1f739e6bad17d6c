"""scripts/gpu_check.sh exits non-zero when a GPU test fails or the suite times out, and
prints the suite's counts: run here on a throwaway suite in place of the GPU suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"

SUITE = '''
import time
import pytest

@pytest.mark.gpu
def test_kernel_matches():
    assert True

@pytest.mark.gpu
def test_kernel_broken():
    assert {broken} == 0

def test_slow():
    time.sleep({sleep})
'''


def run_check(tmp_path: Path, *, broken: int, sleep: float = 0.0, timeout: int = 120):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_suite.py").write_text(SUITE.format(broken=broken, sleep=sleep))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "PYTEST_WORKERS": "0",
           "TEST_ARGS": str(suite), "TEST_TIMEOUT": str(timeout)}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout


@pytest.mark.parametrize("broken, rc, counts", [(0, 0, "3 passed, 0 failed"), (1, 1, "2 passed, 1 failed")])
def test_exit_status_and_counts_follow_the_suite(tmp_path, broken, rc, counts):
    code, out = run_check(tmp_path, broken=broken)
    assert code == rc, out
    assert f"| tests | {'ok' if rc == 0 else 'failed (rc 1)'}: {counts}, 0 skipped |" in out


def test_a_suite_past_its_time_limit_fails(tmp_path):
    code, out = run_check(tmp_path, broken=0, sleep=30, timeout=3)
    assert code == 1 and "| tests | timed out after 3s" in out, out
