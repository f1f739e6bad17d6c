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
"""

import os
import re
from importlib import metadata

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
