"""What the Gluon kernels (``kvouter/partials_gluon_sm90.py``, ``index/topk_gluon_sm90.py``) take from Triton,
imported once, and whether this installation and GPU can run them."""

from __future__ import annotations

import functools

import torch

from .launch import GLUON_CAPABILITY, device_capability, device_index, interpreting, sm_name

try:  # Gluon ships with Triton >= 3.5; its Hopper API is what the kernels need.
    from triton.experimental import gluon  # noqa: F401
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

    sync_threads = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")
    HAVE_GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

# Gluon changes between Triton releases; other versions keep the tl kernels rather than
# fail to compile on every call.
TESTED_TRITON = ("3.6.",)


def triton_version() -> str:
    import triton

    return triton.__version__


def platform_reason(device_index: int) -> str | None:
    """The checks that depend only on the installation and the GPU (asked on every decode
    step, so answered once per capability): None, or why the Gluon kernels cannot run on
    CUDA device ``device_index``."""
    return capability_reason(device_capability(device_index))


@functools.lru_cache(maxsize=None)
def capability_reason(capability: tuple[int, int]) -> str | None:
    """:func:`platform_reason` for a GPU of this compute capability (``core.launch``'s helper
    answers it, ``M3_SPARSE_CAPABILITY`` included)."""
    if tuple(capability) != GLUON_CAPABILITY:
        return f"needs sm_90 (wgmma and TMA as compiled here), this GPU is {sm_name(capability)}"
    if not HAVE_GLUON:
        return "this Triton has no Gluon Hopper API"
    if not triton_version().startswith(TESTED_TRITON):
        return f"written for Triton {' / '.join(v + 'x' for v in TESTED_TRITON)}, found {triton_version()}"
    if torch.version.hip is not None:
        return "needs CUDA, not ROCm"
    return None


def device_reason(t: torch.Tensor) -> str | None:
    """None, or why the Gluon kernels cannot run on ``t``'s device: they need a real CUDA
    device (the interpreter runs no Gluon) with :func:`platform_reason`'s installation."""
    if interpreting() or t.device.type != "cuda":
        return "needs a CUDA device (not the interpreter)"
    return platform_reason(device_index(t.device))
