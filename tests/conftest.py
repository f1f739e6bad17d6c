"""Suite-wide setup: the Triton interpreter on a CPU machine, derandomized hypothesis, and the
one rule for GPU tests.

Without a GPU, Triton kernels run only in Triton's interpreter, which is picked when a kernel
is decorated: it is chosen here, before any test module imports the kernel package. Releases
whose interpreter cannot run the kernels stop the suite here, with what to install.

GPU tests carry the ``gpu`` marker and are always collected; without CUDA this hook skips them,
so ``pytest -m gpu`` is the GPU suite on a GPU machine and lists every GPU test on a CPU one.
Device queries (capability, device count) belong in the test body or a fixture, never at
import time, so that the tests stay collectable on a CPU. An unmarked test whose skip names
CUDA or a GPU is an error: it would vanish from the GPU suite.

The model, integration and hub tests also run on the oldest supported transformers, kernels
and huggingface_hub: ``scripts/test.sh``'s second pass runs ``pytest -m both_ends`` there.
This conftest gives the ``both_ends`` marker to every test except those of the modules in
``NEWEST_ONLY`` and of ``tests/kernels/`` modules that import nothing of the range.
"""

import ast
import functools
import os
import re
from importlib import metadata
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from packaging.version import Version


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run the kernels with these releases, or None.

    Triton before 3.7 turns a run-time loop bound (``range(lo, hi)`` over values computed
    from the program id) into an int with ``int()`` of a one-element array, which numpy 2.4
    and later refuse: every kernel with such a loop would fail with a TypeError inside the
    interpreter. torch 2.11's CUDA wheels pin triton 3.6."""
    if Version(triton_version).release < (3, 7) and Version(numpy_version).release >= (2, 4):
        return (
            f"the CPU tests run the Triton kernels in Triton's interpreter, and triton {triton_version}'s "
            f"interpreter fails on numpy {numpy_version} (it converts one-element arrays with int(), which "
            "numpy refuses from 2.4). Install numpy<2.4 (pip install 'numpy<2.4') or triton>=3.7, or run the "
            "suite on a GPU."
        )
    return None


HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        _problem = interpreter_problem(metadata.version("triton"), metadata.version("numpy"))
    except metadata.PackageNotFoundError:
        _problem = None  # no triton: the kernel package's own import says what is missing
    if _problem:
        raise pytest.UsageError(_problem)

# Every property test draws the same examples on every run and keeps no example database;
# a test's own @settings overrides only what it names.
settings.register_profile("m3", derandomize=True, database=None, deadline=None)
settings.load_profile("m3")

# What ties a test module to the transformers / kernels / huggingface_hub releases installed.
RANGE_IMPORTS = ("transformers", "kernels", "kernels_data", "huggingface_hub", "m3_hf_attention", "model_utils", "m3_sparse.hf")
# Test modules that run on the newest supported releases only, each with why it need not run
# twice. They import none of RANGE_IMPORTS (tests/test_suite_rules.py checks).
NEWEST_ONLY = {
    "test_bench_server.py": "the benchmark's plumbing over guidellm (the server on both ends: test_serve*.py)",
    "test_ci_scripts.py": "the test scripts' own logic, over a fake pip and pytest",
    "test_docs.py": "the docs against docs/figures.json and their length limits",
    "test_gpu_check.py": "scripts/gpu_check.sh's exit codes, over a throwaway suite",
    "test_mutations.py": "the suite's power to catch planted bugs, which no release changes",
    "test_suite_rules.py": "the rules of the suite itself",
}
TESTS_DIR = Path(__file__).resolve().parent


def range_imports(source: str) -> list[str]:
    """The entries of RANGE_IMPORTS that this source imports, at any depth (function bodies too)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return sorted({root for n in names for root in RANGE_IMPORTS if n == root or n.startswith(root + ".")})


@functools.lru_cache(maxsize=None)
def runs_on_both_ends(path: Path) -> bool:
    """Whether the tests of this module also run in the oldest pass (the ``both_ends`` marker):
    every module but NEWEST_ONLY's, except that the ops' tests in tests/kernels/ run once
    unless they import something of the range (one compares with transformers' own modules)."""
    path = path.resolve()
    if path.name in NEWEST_ONLY:
        return False
    if TESTS_DIR / "kernels" in path.parents:
        return bool(range_imports(path.read_text()))
    return True


def pytest_itemcollected(item):
    if runs_on_both_ends(item.path):
        item.add_marker(pytest.mark.both_ends)


NO_CUDA = "needs a CUDA device (marker gpu: run `pytest -m gpu` on a GPU machine)"
# Skip reasons that say a test needs a GPU (or is too slow without one).
GPU_REASON = re.compile(r"CUDA|GPU|interpreter|second device", re.IGNORECASE)


def _unmarked_gpu_skip(item: pytest.Item) -> str | None:
    if item.get_closest_marker("gpu") is not None:
        return None
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if GPU_REASON.search(reason):
            return reason
    return None


def pytest_collection_modifyitems(config, items):
    unmarked = [f"{item.nodeid} (skipif: {why!r})" for item in items if (why := _unmarked_gpu_skip(item))]
    if unmarked:
        raise pytest.UsageError(
            "tests that skip without a GPU must carry the gpu marker (the conftest skips them):\n  "
            + "\n  ".join(unmarked)
        )
    if HAS_CUDA:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A ``pytest.skip`` in the body of an unmarked test that names a GPU fails instead."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or item.get_closest_marker("gpu") is not None:
        return
    if not isinstance(report.longrepr, tuple):
        return
    reason = report.longrepr[2]
    if GPU_REASON.search(reason):
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped ({reason}) without the gpu marker: mark it gpu"
