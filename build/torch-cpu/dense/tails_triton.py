"""Triton kernel of ``tails.clear_page_tails_torch``: zero the slots past each sequence's
length in its last page, of K and V, in one launch.

One program per (sequence, kv head): it reads the sequence's length and one block-table
entry on the device and stores zeros to ``page_size - used % page_size`` rows of its head
(none when the length is a multiple of the page size). The grid comes from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.launch import launch_kernel, next_pow2


@triton.jit
def _clear_page_tails_kernel(
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    stride_kp,
    stride_kh,
    stride_ks,
    stride_vp,
    stride_vh,
    stride_vs,
    stride_tb,
    PS: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    tail = n % PS
    if n > 0 and tail > 0:
        page = tl.load(tables_ptr + b.to(tl.int64) * stride_tb + (n - 1) // PS).to(tl.int64)
        offs_s = tl.arange(0, BS)  # [BS] slots of the page
        offs_d = tl.arange(0, BD)  # [BD]
        keep = (offs_s[:, None] >= tail) & (offs_s[:, None] < PS) & (offs_d[None, :] < D)  # [BS, BD]
        p_k = k_ptr + page * stride_kp + h * stride_kh + offs_s[:, None] * stride_ks + offs_d[None, :]
        p_v = v_ptr + page * stride_vp + h * stride_vh + offs_s[:, None] * stride_vs + offs_d[None, :]
        tl.store(p_k, tl.zeros([BS, BD], k_ptr.dtype.element_ty), mask=keep)
        tl.store(p_v, tl.zeros([BS, BD], v_ptr.dtype.element_ty), mask=keep)


def clear_page_tails(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, used_kv_lens: torch.Tensor
) -> None:
    """``tails.clear_page_tails_torch`` on the GPU (or the interpreter): caches
    ``[pages, Hkv, page_size, D]`` with a unit last stride; tables and lengths int32 or
    int64, contiguous along the table row."""
    batch = used_kv_lens.shape[0]
    _, hkv, page_size, d = k_cache.shape
    if batch == 0 or page_size == 0:
        return
    launch_kernel(
        _clear_page_tails_kernel, (batch, hkv),
        k_cache, v_cache, block_tables, used_kv_lens,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        PS=page_size, D=d, BS=next_pow2(page_size), BD=next_pow2(d),
        num_warps=4,
    )
