"""Rules of the test suite itself: every test is collected on every machine, and GPU tests are
the ``gpu``-marked ones, which the conftest skips (with a reason) where there is no CUDA.

A test defined under a module-level ``if`` (``if HAS_CUDA:``) is invisible where the condition
is false, so neither ``pytest -m gpu --collect-only`` on a CPU nor a count of skips shows it."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def conditional_tests(source: str) -> list[str]:
    """``line name`` of each test function defined inside a module-level compound statement."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            found += [
                f"{n.lineno} {n.name}"
                for n in ast.walk(node)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
            ]
    return found


def test_no_test_is_defined_conditionally():
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 30, "the scan found too few test files"
    bad = [f"{f.relative_to(TESTS)}:{t}" for f in files for t in conditional_tests(f.read_text())]
    assert not bad, "tests defined under a module-level condition (mark them gpu instead):\n" + "\n".join(bad)


def test_the_scan_sees_a_conditional_test():
    source = "import torch\nif torch.cuda.is_available():\n    def test_hidden():\n        pass\n"
    assert conditional_tests(source) == ["3 test_hidden"]


PROBE = '''
import pytest

@pytest.mark.gpu
def test_marked():
    assert False, "a gpu test ran without CUDA"

def test_unmarked_body_skip():
    pytest.skip("needs a CUDA device")

def test_unrelated_skip():
    pytest.skip("nothing to do with a device")
'''

UNMARKED_SKIPIF = '''
import pytest

@pytest.mark.skipif(True, reason="M3 sizes need the GPU")
def test_hidden_from_the_gpu_suite():
    pass
'''


def _pytest_in(folder: Path, test_file: str) -> subprocess.CompletedProcess:
    """The suite's conftest over one probe file, CUDA hidden (the rule a CPU machine sees)."""
    shutil.copy(TESTS / "conftest.py", folder / "conftest.py")
    (folder / "test_probe.py").write_text(test_file)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", "-m", "", str(folder)],
        capture_output=True, text=True, env=env, cwd=folder, timeout=300,
    )  # fmt: skip


def test_the_conftest_skips_gpu_tests_and_fails_unmarked_ones(tmp_path):
    res = _pytest_in(tmp_path, PROBE)
    out = res.stdout
    assert "1 failed, 2 skipped" in out, out[-3000:]
    assert "needs a CUDA device (marker gpu" in out, out[-3000:]
    assert "test_unmarked_body_skip" in out and "without the gpu marker" in out, out[-3000:]


def test_an_unmarked_gpu_skipif_stops_the_run(tmp_path):
    res = _pytest_in(tmp_path, UNMARKED_SKIPIF)
    assert res.returncode != 0
    text = res.stdout + res.stderr
    assert "must carry the gpu marker" in text and "test_hidden_from_the_gpu_suite" in text, text[-3000:]


def _conftest_module():
    """The suite's conftest.py as a module of its own (test modules cannot import it by name)."""
    spec = importlib.util.spec_from_file_location("m3_suite_conftest", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_interpreter_that_cannot_run_the_kernels_is_named():
    problem = _conftest_module().interpreter_problem
    message = problem("3.6.0", "2.4.6")
    assert message is not None
    assert "triton 3.6.0" in message and "numpy 2.4.6" in message
    assert "numpy<2.4" in message and "triton>=3.7" in message
    assert problem("3.6.0", "2.5.2") is not None
    # Either release on its good side runs the kernels.
    assert problem("3.6.0", "2.3.5") is None
    assert problem("3.7.0", "2.4.6") is None
    assert problem("3.9.0", "2.5.2") is None


def test_the_import_scan_sees_nested_and_from_imports():
    range_imports = _conftest_module().range_imports
    source = "import torch\ndef f():\n    from transformers import AutoModel\nfrom m3_sparse import hf\nimport m3_sparse\n"
    assert range_imports(source) == ["m3_sparse.hf", "transformers"]
    assert range_imports("import m3_sparse\nfrom m3_sparse.api import index_topk\nimport kernels_test\n") == []


def test_only_modules_that_touch_no_release_of_the_range_run_once():
    """The oldest pass (``pytest -m both_ends``) leaves out NEWEST_ONLY and the tests/kernels/
    modules that import nothing of the range; a module there that imported transformers,
    kernels, huggingface_hub or the integration would never be tested on the oldest releases."""
    conftest = _conftest_module()
    newest_only = [TESTS / name for name in conftest.NEWEST_ONLY]
    missing = [p.name for p in newest_only if not p.is_file()]
    assert not missing, f"NEWEST_ONLY names modules that do not exist: {missing}"
    bad = {p.name: found for p in newest_only if (found := conftest.range_imports(p.read_text()))}
    assert not bad, f"NEWEST_ONLY modules import what the range changes (let them run on both ends): {bad}"
    assert not any(conftest.runs_on_both_ends(p) for p in newest_only)
    kernel_tests = sorted((TESTS / "kernels").glob("test_*.py"))
    once = [p.name for p in kernel_tests if not conftest.runs_on_both_ends(p)]
    assert len(once) > 20, "the scan found too few kernel test modules that run once"
    # The index prep is checked against transformers' own modules, which changed between releases.
    assert conftest.runs_on_both_ends(TESTS / "kernels" / "test_index_prep.py")
    for name in ("test_model.py", "test_hub_string.py", "test_example.py", "test_continuous_batching.py"):
        assert conftest.runs_on_both_ends(TESTS / name), name
