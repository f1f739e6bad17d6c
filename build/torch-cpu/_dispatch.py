"""Which implementation an op runs: the Triton kernels on CUDA tensors, the torch
stages elsewhere. ``M3_SPARSE_IMPL=torch`` or ``=triton`` pins one explicitly (the
Triton kernels run on the CPU only under ``TRITON_INTERPRET=1``); the choice is
never changed behind the caller's back after that."""

from __future__ import annotations

import os

import torch

IMPLS = ("auto", "torch", "triton")


def requested_impl() -> str:
    impl = os.environ.get("M3_SPARSE_IMPL", "auto").strip().lower() or "auto"
    if impl not in IMPLS:
        raise ValueError(f"M3_SPARSE_IMPL: expected one of {IMPLS}, got {impl!r}")
    return impl


def use_triton(t) -> bool:
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
        return True
    return t.device.type == "cuda"
