"""Public entry points of the ``m3_sparse`` kernel package.

Each entry point validates its arguments (shapes, dtypes, devices, and on the CPU
or with ``M3_SPARSE_DEBUG=1`` the values of ids, lengths and page tables), then
runs the stages. Nothing here copies device data to the host.
"""

from __future__ import annotations

import torch

from ._validate import (
    INDEX_DTYPES,
    check_dim,
    check_kv,
    check_positive_int,
    check_scale,
    check_selected_values,
    check_tensor,
    check_varlen,
)
from ._dispatch import kvouter_unsupported, requested_impl, use_triton
from .combine import combine
from .dense_attention import dense_paged_attention_torch
from .kvouter_attention import kvouter_partials
from .kvouter_index import build_kvouter_index

def validate_kvouter(
    q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, page_size, block_size
):
    """Checks of :func:`kvouter_attention` (shared with the Triton path). Returns
    (batch size, blocks per sequence, softmax scale)."""
    check_kv(q, k_cache, v_cache, page_size)
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
    scale = check_scale(softmax_scale, q.shape[2])
    return batch, max_blocks, scale


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention, KV-outer.

    q: [Tq, Hq, D] token-major; k_cache/v_cache: [pages, Hkv, page_size, D];
    selected: [Tq, Hkv, topk] block ids (``-1`` = empty slot; a repeated id counts once);
    block_tables: [B, max_pages]; cu_seqlens_q: [B + 1]; used_kv_lens: [B] cached tokens
    per sequence including the new queries, which are the last ones (right aligned).
    Returns (out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] fp32 or None); a query with no
    visible key outputs zeros and lse = -inf.

    CUDA tensors run the Triton partials and combine kernels (``triton_kvouter``),
    others the torch stages.
    """
    batch, max_blocks, scale = validate_kvouter(
        q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, page_size, block_size
    )
    if use_triton(q, kvouter_unsupported(q, k_cache, block_size)):
        from .triton_kvouter import run_kvouter_triton

        return run_kvouter_triton(
            q,
            k_cache,
            v_cache,
            selected,
            block_tables,
            cu_seqlens_q=cu_seqlens_q,
            used_kv_lens=used_kv_lens,
            softmax_scale=scale,
            causal=causal,
            block_size=block_size,
            return_lse=return_lse,
            batch=batch,
            max_blocks=max_blocks,
        )
    index = build_kvouter_index(selected, cu_seqlens_q=cu_seqlens_q, max_blocks=max_blocks, batch_size=batch)
    # The torch stage computes every entry directly; a GPU kernel runs them as the schedule's tiles.
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
    check_kv(q, k_cache, v_cache, None)
    check_varlen(
        cu_seqlens_q,
        used_kv_lens,
        block_tables,
        num_tokens=q.shape[0],
        page_size=k_cache.shape[2],
        num_pages=k_cache.shape[0],
        device=q.device,
    )
    scale = check_scale(softmax_scale, q.shape[2])
    # The Triton dense kernel is not yet measured on a GPU, so only an explicit
    # M3_SPARSE_IMPL=triton selects it; the automatic choice stays on the torch code.
    if requested_impl() == "triton" and use_triton(q):
        from .triton_dense_attention import dense_paged_attention_triton

        return dense_paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            cu_seqlens_q=cu_seqlens_q,
            used_kv_lens=used_kv_lens,
            softmax_scale=scale,
            causal=causal,
            return_lse=return_lse,
        )
    return dense_paged_attention_torch(
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        softmax_scale=scale,
        causal=causal,
        return_lse=return_lse,
    )


__all__ = ["kvouter_attention", "dense_paged_attention"]
