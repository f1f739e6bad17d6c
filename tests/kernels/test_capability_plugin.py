"""The GPU suite acting as another GPU: ``capability_plugin`` reports a test stopped by the
package's refusal of that GPU as skipped (only under ``M3_SPARSE_CAPABILITY``), and
``scripts/gpu_check.sh``'s ``CAPABILITY`` knob sets the override and loads the plugin. Run
here on a throwaway suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

SUITE = '''
import pytest

class UnsupportedGPUError(RuntimeError):  # the package's refusal, matched by name
    pass

@pytest.mark.gpu
def test_refused():
    raise UnsupportedGPUError("float8_e4m3fn inputs need compute capability 8.9 or newer")

@pytest.mark.gpu
def test_refused_while_compiling():
    try:
        raise UnsupportedGPUError("sm_80")
    except UnsupportedGPUError as e:
        raise RuntimeError("torch.compile wrapped it") from e

@pytest.mark.gpu
def test_broken():
    assert 1 == 2

@pytest.mark.gpu
def test_fine():
    pass
'''


def run_suite(tmp_path: Path, capability: str | None) -> str:
    (tmp_path / "test_probe.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "M3_SPARSE_CAPABILITY"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    if capability:
        env["M3_SPARSE_CAPABILITY"] = capability
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "capability_plugin", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    return done.stdout


def test_refusals_skip_with_their_reason_when_acting_as_another_gpu(tmp_path):
    out = run_suite(tmp_path, "8.0")
    assert "1 failed, 1 passed, 2 skipped" in out, out[-3000:]
    assert "acting as compute capability 8.0: float8_e4m3fn inputs need compute capability 8.9" in out, out[-3000:]


def test_refusals_fail_on_the_real_gpu(tmp_path):
    out = run_suite(tmp_path, None)
    assert "3 failed, 1 passed" in out, out[-3000:]


def test_gpu_check_acts_as_the_capability_asked(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "M3_SPARSE_CAPABILITY"}
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, PYTEST_WORKERS="0", TEST_ARGS=str(suite),
               CAPABILITY="8.9")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout
    assert done.returncode == 1, out  # test_broken still fails
    assert "| tests | failed (rc 1): 1 passed, 1 failed, 2 skipped |" in out, out
    assert "acting as compute capability 8.9: M3_SPARSE_CAPABILITY=8.9" in out, out
    assert (tmp_path / "out" / "gpu_check" / "sm_89" / "tests.log").is_file()
    env["CAPABILITY"] = "sm_89"
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "CAPABILITY must be a compute capability as major.minor" in bad.stderr


@pytest.mark.parametrize("chain", ["cause", "context"])
def test_a_refusal_is_found_behind_a_wrapper(chain):
    from capability_plugin import gpu_refusal

    class UnsupportedGPUError(RuntimeError):
        pass

    inner = UnsupportedGPUError("sm_86")
    outer = RuntimeError("wrapped")
    setattr(outer, f"__{chain}__", inner)
    assert gpu_refusal(outer) is inner
    assert gpu_refusal(RuntimeError("other")) is None
