"""pytest plugin for the GPU suite acting as another GPU (``scripts/gpu_check.sh`` loads it
with ``CAPABILITY=8.0`` and the like; by hand: ``M3_SPARSE_CAPABILITY=8.0 PYTHONPATH=tests/kernels
python -m pytest -p capability_plugin -m gpu tests``).

With ``M3_SPARSE_CAPABILITY`` set, dispatch chooses as a GPU of that capability would
(``core/launch.py``), so a test of something that GPU lacks is stopped by the package's own
refusal: an ``UnsupportedGPUError`` (fp8 inputs below sm_89). Such a test is reported as
skipped, with the refusal as the reason: the GPU acted as has no such path to test. Any other
failure stays a failure, and without the variable the plugin does nothing. Tests that check a
Hopper-only path themselves (the Gluon kernels, TMA, flash-attn-4) ask the same
``device_capability`` and skip on their own.
"""

from __future__ import annotations

import os

import pytest

CAPABILITY_ENV = "M3_SPARSE_CAPABILITY"  # core.launch.CAPABILITY_ENV (not imported: build/ or torch-ext/)
REFUSAL = "UnsupportedGPUError"  # dispatch.UnsupportedGPUError, by name: the tests load the kernel both ways


def gpu_refusal(exc: BaseException | None) -> BaseException | None:
    """The package's refusal of this GPU in ``exc`` or what caused it (torch.compile wraps
    errors raised while it traces), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ == REFUSAL for cls in type(exc).__mro__):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    # tryfirst: the outermost wrapper, so the suite's own report rules see the failure, not the skip.
    outcome = yield
    forced = os.environ.get(CAPABILITY_ENV)
    if not forced or call.excinfo is None or call.when == "teardown":
        return
    refusal = gpu_refusal(call.excinfo.value)
    if refusal is None:
        return
    report = outcome.get_result()
    report.outcome = "skipped"
    line = item.location[1] or 0
    report.longrepr = (str(item.path), line + 1, f"Skipped: acting as compute capability {forced}: {refusal}")
