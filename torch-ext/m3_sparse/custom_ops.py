"""The public ops as ``torch.library`` custom ops with fake (meta) implementations.

Registered under this build's namespace (``_ops.NAMESPACE``), so ``torch.compile``
traces a call as one opaque node whose output shapes come from the fake
implementation: the ops' host-side validation and Python loops never reach the
graph, and ``fullgraph=True`` compiles code that calls them.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from ._ops import NAMESPACE
from ._validate import default_out_dtype
from .decode_attention import sparse_decode_attention
from .index_topk import index_topk
from .interface import dense_paged_attention, kvouter_attention, sparse_attention


def _fake_attention(q: torch.Tensor, out_dtype: torch.dtype | None):
    """(out, lse) of an attention op: out in ``out_dtype`` (default q's, bfloat16 for an fp8 q)."""
    if out_dtype is None:
        out_dtype = default_out_dtype(q.dtype)
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@custom_op(f"{NAMESPACE}::index_topk", mutates_args=())
def index_topk_op(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    index_k_scale: torch.Tensor | None,
    topk: int,
    block_size: int,
    local_blocks: int,
    max_seqlen_q: int,
    fp8_dot: bool,
) -> torch.Tensor:
    extra = {} if index_k_scale is None else {"index_k_scale": index_k_scale, "fp8_dot": fp8_dot}
    return index_topk(
        index_q,
        index_k_cache,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        topk=topk,
        block_size=block_size,
        local_blocks=local_blocks,
        max_seqlen_q=max_seqlen_q if max_seqlen_q > 0 else None,
        **extra,
    )


@index_topk_op.register_fake
def _(index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens, index_k_scale, topk, block_size, local_blocks, max_seqlen_q, fp8_dot):
    return index_q.new_empty((index_q.shape[0], index_q.shape[1], topk), dtype=torch.int32)


@custom_op(f"{NAMESPACE}::kvouter_attention", mutates_args=())
def kvouter_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    block_size: int,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    partial_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = kvouter_attention(
        q,
        k_cache,
        v_cache,
        selected,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale,
        causal=causal,
        block_size=block_size,
        return_lse=True,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        out_dtype=out_dtype,
        partial_dtype=partial_dtype,
    )
    return out, lse


@kvouter_attention_op.register_fake
def _(q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, causal, block_size,
      q_scale=None, k_scale=None, v_scale=None, out_dtype=None, partial_dtype=None):
    return _fake_attention(q, out_dtype)


@custom_op(f"{NAMESPACE}::sparse_decode_attention", mutates_args=())
def sparse_decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    block_size: int,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_decode_attention(
        q,
        k_cache,
        v_cache,
        selected,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale,
        causal=causal,
        block_size=block_size,
        return_lse=True,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        out_dtype=out_dtype,
    )


@sparse_decode_attention_op.register_fake
def _(q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, causal, block_size,
      q_scale=None, k_scale=None, v_scale=None, out_dtype=None):
    return _fake_attention(q, out_dtype)


@custom_op(f"{NAMESPACE}::sparse_attention", mutates_args=())
def sparse_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
    block_size: int,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    partial_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_attention(
        q,
        k_cache,
        v_cache,
        selected,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        max_seqlen_q=max_seqlen_q if max_seqlen_q > 0 else None,
        softmax_scale=softmax_scale,
        causal=causal,
        block_size=block_size,
        return_lse=True,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        out_dtype=out_dtype,
        partial_dtype=partial_dtype,
    )


@sparse_attention_op.register_fake
def _(q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, max_seqlen_q, softmax_scale, causal,
      block_size, q_scale=None, k_scale=None, v_scale=None, out_dtype=None, partial_dtype=None):
    return _fake_attention(q, out_dtype)


@custom_op(f"{NAMESPACE}::dense_paged_attention", mutates_args=())
def dense_paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = dense_paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale,
        causal=causal,
        return_lse=True,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        out_dtype=out_dtype,
    )
    return out, lse


@dense_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, causal,
      q_scale=None, k_scale=None, v_scale=None, out_dtype=None):
    return _fake_attention(q, out_dtype)
