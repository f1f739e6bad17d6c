"""Suite-wide setup: the Triton interpreter on a CPU machine, derandomized hypothesis, and the
one rule for GPU tests.

Without a GPU, Triton kernels run only in Triton's interpreter, which is picked when a kernel
is decorated: it is chosen here, before any test module imports the kernel package.

GPU tests carry the ``gpu`` marker and are always collected; without CUDA this hook skips them,
so ``pytest -m gpu`` is the GPU suite on a GPU machine and lists every GPU test on a CPU one.
Device queries (capability, device count) belong in the test body or a fixture, never at
import time, so that the tests stay collectable on a CPU. An unmarked test whose skip names
CUDA or a GPU is an error: it would vanish from the GPU suite.
"""

import os
import re

import pytest
import torch
from hypothesis import settings

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
