"""Which implementation an op runs: the Triton kernels on CUDA tensors, the torch
stages elsewhere. ``M3_SPARSE_IMPL=torch`` or ``=triton`` pins one explicitly (the
Triton kernels run on the CPU only under ``TRITON_INTERPRET=1``); the choice is
never changed behind the caller's back after that."""

from __future__ import annotations

import os

import torch

IMPLS = ("auto", "torch", "triton")
INDEX_MAX_TOPK = 32  # slots of the running top-k list the Triton index kernel keeps in registers


def requested_impl() -> str:
    impl = os.environ.get("M3_SPARSE_IMPL", "auto").strip().lower() or "auto"
    if impl not in IMPLS:
        raise ValueError(f"M3_SPARSE_IMPL: expected one of {IMPLS}, got {impl!r}")
    return impl


def use_triton(t, unsupported: str | None = None) -> bool:
    """Whether to run the Triton kernel for tensor ``t``.

    ``unsupported``: why the kernel cannot take these shapes (None if it can). In the
    automatic mode such a call runs the torch code, which takes every valid shape;
    with ``M3_SPARSE_IMPL=triton`` it raises instead.
    """
    if not isinstance(t, torch.Tensor):
        return False  # the torch path's validation names the bad argument
    impl = requested_impl()
    if impl == "torch":
        return False
    if impl == "triton":
        if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "M3_SPARSE_IMPL=triton: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU), "
                f"got tensors on {t.device}"
            )
        if unsupported is not None:
            raise ValueError(f"M3_SPARSE_IMPL=triton: {unsupported}")
        return True
    return t.device.type == "cuda" and unsupported is None


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kvouter_unsupported(
    q: torch.Tensor, k_cache: torch.Tensor, block_size: int, v_cache: torch.Tensor | None = None
) -> str | None:
    if not isinstance(block_size, int):
        return None
    if not _is_pow2(block_size) or block_size < 16:
        return f"the Triton KV-outer kernel needs block_size a power of two >= 16, got {block_size}"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t is not None and t.stride(-1) != 1:
            return f"the Triton KV-outer kernel needs {name} with a contiguous head dim (stride 1), got stride {t.stride(-1)}"
    return None


def dense_unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            return f"the Triton dense kernel needs {name} with a contiguous head dim (stride 1), got stride {t.stride(-1)}"
    return None


def index_unsupported(index_q: torch.Tensor, index_k_cache: torch.Tensor, topk: int, block_size: int) -> str | None:
    if not isinstance(topk, int) or not isinstance(block_size, int):
        return None  # invalid arguments: the kernel's own validation names them
    page_size, d = index_k_cache.shape[1], index_q.shape[2]
    if topk > INDEX_MAX_TOPK:
        return f"the Triton index kernel supports topk <= {INDEX_MAX_TOPK}, got {topk}"
    if not _is_pow2(block_size) or (block_size % page_size and page_size % block_size):
        return f"the Triton index kernel needs block_size a power of two dividing or multiple of page_size, got {block_size}"
    if not _is_pow2(d) or not 16 <= d <= 256:
        return f"the Triton index kernel needs a power-of-two index head dim in [16, 256], got {d}"
    return None
