"""Public entry points of the ``m3_sparse`` kernel package.

Each entry point validates its arguments (shapes, dtypes, devices, and on the CPU
or with ``M3_SPARSE_DEBUG=1`` the values of ids, lengths and page tables), then
runs the stages. Nothing here copies device data to the host.
"""

from __future__ import annotations

import math

import torch

from ._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_positive_int,
    check_selected_values,
    check_tensor,
    check_varlen,
)
from .combine import combine
from .dense_attention import dense_paged_attention_torch
from .kvouter_attention import kvouter_partials
from .kvouter_index import build_kvouter_index
from .scheduler import schedule

SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
DEFAULT_TILE_Q = 128
DEFAULT_NUM_PROGRAMS = 132


def _check_kv(q, k_cache, v_cache, page_size):
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)} "
            f"([pages, kv_heads, page_size, head_dim]), got {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"k_cache/v_cache: expected the dtype of q ({q.dtype}), got {k_cache.dtype} and {v_cache.dtype}"
        )
    check_dim("k_cache", k_cache, 3, q.shape[2], "head dim (q.shape[2])")
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"q/k_cache: the number of query heads ({hq}) must be a multiple of the number of KV heads ({hkv})"
        )
    if page_size is not None and k_cache.shape[2] != page_size:
        raise ValueError(f"page_size: expected k_cache.shape[2] = {page_size}, got shape {tuple(k_cache.shape)}")
    if k_cache.shape[2] not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"k_cache: page size {k_cache.shape[2]} is not supported; expected one of {SUPPORTED_PAGE_SIZES}")


def _scale(softmax_scale, d):
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale!r}")
    return float(softmax_scale)


def kvouter_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    page_size: int | None = None,
    block_size: int = 128,
    return_lse: bool = False,
    tile_q: int = DEFAULT_TILE_Q,
    num_programs: int = DEFAULT_NUM_PROGRAMS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention, KV-outer.

    q: [Tq, Hq, D] token-major; k_cache/v_cache: [pages, Hkv, page_size, D];
    selected: [Tq, Hkv, topk] block ids (``-1`` = empty slot; a repeated id counts once);
    block_tables: [B, max_pages]; cu_seqlens_q: [B + 1]; used_kv_lens: [B] cached tokens
    per sequence including the new queries, which are the last ones (right aligned).
    Returns (out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] fp32 or None); a query with no
    visible key outputs zeros and lse = -inf.
    """
    _check_kv(q, k_cache, v_cache, page_size)
    page_size = k_cache.shape[2]
    check_positive_int("block_size", block_size)
    check_tensor("selected", selected, ndim=3, dtypes=INDEX_DTYPES, device=q.device)
    check_dim("selected", selected, 0, q.shape[0], "query tokens (q.shape[0])")
    check_dim("selected", selected, 1, k_cache.shape[1], "KV heads (k_cache.shape[1])")
    batch = check_varlen(
        cu_seqlens_q,
        used_kv_lens,
        block_tables,
        num_tokens=q.shape[0],
        page_size=page_size,
        num_pages=k_cache.shape[0],
        device=q.device,
    )
    max_blocks = -(-block_tables.shape[1] * page_size // block_size)
    check_selected_values(selected, max_blocks)
    scale = _scale(softmax_scale, q.shape[2])
    index = build_kvouter_index(selected, cu_seqlens_q=cu_seqlens_q, max_blocks=max_blocks, batch_size=batch)
    # The torch stage executes every entry; the schedule is what a persistent grid runs.
    partial_o, partial_m, partial_l = kvouter_partials(
        q,
        k_cache,
        v_cache,
        index,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        softmax_scale=scale,
        causal=causal,
        block_size=block_size,
    )
    return combine(partial_o, partial_m, partial_l, index.slot_of, out_dtype=q.dtype, return_lse=return_lse)


def dense_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense attention over a paged K/V cache, same layouts as :func:`kvouter_attention`."""
    _check_kv(q, k_cache, v_cache, None)
    check_varlen(
        cu_seqlens_q,
        used_kv_lens,
        block_tables,
        num_tokens=q.shape[0],
        page_size=k_cache.shape[2],
        num_pages=k_cache.shape[0],
        device=q.device,
    )
    return dense_paged_attention_torch(
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        softmax_scale=_scale(softmax_scale, q.shape[2]),
        causal=causal,
        return_lse=return_lse,
    )


__all__ = ["kvouter_attention", "dense_paged_attention", "build_kvouter_index", "schedule", "kvouter_partials", "combine"]
