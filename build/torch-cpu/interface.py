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
    check_partial_dtype,
    check_selected_values,
    default_out_dtype,
    check_quant,
    check_tensor,
    check_varlen,
)
from ._dispatch import dense_unsupported, kvouter_unsupported, use_triton
from .combine import combine, merge_scale
from .dense_attention import dense_paged_attention_torch
from .kvouter_attention import kvouter_partials
from .kvouter_index import build_kvouter_index
from .layout import chunk_varlen, token_positions

def validate_kvouter(
    q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, page_size, block_size,
    *, allow_fp8=False,
):
    """Checks of :func:`kvouter_attention` (shared with the decode op and the kernels'
    composed entry points; ``allow_fp8`` for the public ops, which take fp8 inputs).
    Returns (batch size, blocks per sequence, softmax scale)."""
    check_kv(q, k_cache, v_cache, page_size, allow_fp8=allow_fp8)
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
    max_workspace_bytes: int | None = None,
    q_scale: float | torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    partial_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention, KV-outer.

    q: [Tq, Hq, D] token-major; k_cache/v_cache: [pages, Hkv, page_size, D];
    selected: [Tq, Hkv, topk] block ids (``-1`` = empty slot; a repeated id counts once);
    block_tables: [B, max_pages]; cu_seqlens_q: [B + 1]; used_kv_lens: [B] cached tokens
    per sequence including the new queries, which are the last ones (right aligned).
    Returns (out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] fp32 or None); a query with no
    visible key outputs zeros and lse = -inf.

    CUDA tensors run the Triton stages (index builder, scheduler, partials, combine:
    ``triton_kvouter``), others the torch stages. The partial buffer is bounded by ``max_workspace_bytes``
    (default ``DEFAULT_WORKSPACE_BYTES``, 4 GiB): more query rows than fit run in
    slices of rows, so memory stays linear in the prompt with a fixed constant.

    fp8: the caches may be float8_e4m3fn (both), q float8_e4m3fn or any float dtype, each
    fp8 tensor with a per-tensor dequantization scale ``q_scale`` / ``k_scale`` /
    ``v_scale`` (``real = stored * scale``; a float or a one-element tensor on the device;
    default 1). Q @ K^T runs on the fp8 values (fp8 tensor cores when q is fp8 too), P @ V
    in ``out_dtype`` (default bfloat16 for an fp8 q, else q's dtype), which is also the
    dtype of the output.

    ``partial_dtype``: the dtype of the partials between the attention and combine stages,
    ``out_dtype`` by default. With fp8 caches, ``torch.float8_e4m3fn`` stores them normalized
    (O / l in V's units) in half the bytes: the largest traffic of the op, at a larger
    error (docs/PERF.md, "e4m3 partials").
    """
    batch, max_blocks, scale = validate_kvouter(
        q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, page_size, block_size,
        allow_fp8=True,
    )
    scales, out_dtype = check_quant(q, k_cache, q_scale, k_scale, v_scale, out_dtype)
    partial_dtype = check_partial_dtype(partial_dtype, v_cache, out_dtype)
    if max_workspace_bytes is not None:
        check_positive_int("max_workspace_bytes", max_workspace_bytes)
    num_tokens, hq, d = q.shape
    triton = use_triton(q, kvouter_unsupported(q, k_cache, block_size, v_cache))
    budget = DEFAULT_WORKSPACE_BYTES if max_workspace_bytes is None else max_workspace_bytes
    slots = selected.shape[1] * selected.shape[2]
    chunk = chunk_tokens(num_tokens, slots, hq // k_cache.shape[1], d, partial_dtype.itemsize, budget)
    stage_args = dict(
        softmax_scale=scale,
        causal=causal,
        block_size=block_size,
        return_lse=return_lse,
        batch=batch,
        max_blocks=max_blocks,
        scales=scales,
        out_dtype=out_dtype,
        partial_dtype=partial_dtype,
    )
    if chunk >= num_tokens:
        run = _kvouter_triton if triton else _kvouter_torch
        return run(q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, **stage_args)
    # Partials grow with the query rows (Tq * Hkv * topk * G * (2D + 8) bytes, 35 GB (33 GiB) for
    # 128K tokens of M3): run the query rows in slices that fit the workspace budget.
    out = torch.empty(num_tokens, hq, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(hq, num_tokens, dtype=torch.float32, device=q.device) if return_lse else None
    if not causal:
        # A bidirectional row sees its whole sequence, so a slice keeps every kv length;
        # the rows placed before the first key (which see nothing) are emptied instead.
        _, positions = token_positions(cu_seqlens_q, used_kv_lens, num_tokens)
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        cu_c, kv_c = chunk_varlen(cu_seqlens_q, used_kv_lens, t0, t1)
        sel_c = selected[t0:t1]
        if not causal:
            kv_c = used_kv_lens
            sel_c = sel_c.masked_fill((positions[t0:t1] < 0)[:, None, None], -1)
        args = (q[t0:t1], k_cache, v_cache, sel_c, block_tables, cu_c, kv_c)
        lse_c = lse[:, t0:t1] if lse is not None else None
        if triton:
            _kvouter_triton(*args, **stage_args, out=out[t0:t1], lse=lse_c)
        else:
            o_c, l_c = _kvouter_torch(*args, **stage_args)
            out[t0:t1] = o_c
            if lse_c is not None:
                lse_c.copy_(l_c)
    return out, lse


# Partial-buffer budget of one KV-outer call; longer prompts run in query slices.
DEFAULT_WORKSPACE_BYTES = 4 << 30


def chunk_tokens(num_tokens: int, slots: int, group: int, d: int, elem_bytes: int, budget: int) -> int:
    """Query rows per KV-outer slice: the partials of one row (``slots`` = Hkv * topk
    entries of G rows of D values plus fp32 m and l) times the rows stay within
    ``budget`` bytes, at least one row."""
    per_token = max(1, slots * group * (d * elem_bytes + 8))
    return max(1, min(max(num_tokens, 1), budget // per_token))


def _kvouter_triton(
    q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, *, out=None, lse=None, **stage_args
):
    from .triton_kvouter import run_kvouter_triton

    return run_kvouter_triton(
        q,
        k_cache,
        v_cache,
        selected,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        out=out,
        lse=lse,
        **stage_args,
    )


def _kvouter_torch(
    q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, *, softmax_scale, causal, block_size,
    return_lse, batch, max_blocks, scales=None, out_dtype=None, partial_dtype=None,
):
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
        softmax_scale=softmax_scale,
        causal=causal,
        block_size=block_size,
        scales=scales,
        out_dtype=out_dtype,
        partial_dtype=partial_dtype,
    )
    return combine(
        partial_o, partial_m, partial_l, index.slot_of, out_dtype=out_dtype, return_lse=return_lse,
        o_scale=merge_scale(partial_o, scales),
    )


# Query rows per sequence up to which the query-outer decode kernel beats KV-outer
# (H200, Hq 64 / Hkv 4 / D 128, top-16 of 128-key blocks; docs/PERF.md, decode crossover).
# With the TMA partials kernel (sm_90): at 64 rows decode takes 0.60-0.94x KV-outer's time,
# at 96 rows 0.70-0.73x for one sequence and 1.03-1.05x for 8 or 32, at 128 rows 1.03-1.17x,
# at 256 rows 1.17-1.53x. (Measured on bf16 inputs. A bf16 q over fp8 pages takes the same
# bound: its TMA partials run within 5% of bf16's at 128K; its crossover was not measured.)
DECODE_MAX_QUERIES = 96
# Where KV-outer runs the tl partials kernel (other GPUs, shapes the TMA kernel does not
# take): at 256 rows decode took 0.87-1.09x its time, at 1024 rows 1.45-1.66x.
DECODE_MAX_QUERIES_TL = 256


def decode_max_queries(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
                       out_dtype: torch.dtype | None = None) -> int:
    """The row bound of ``sparse_attention`` for these inputs (host-side: shapes, dtypes and
    the device's capability): the KV-outer partials kernel that would run decides it."""
    from .triton_kvouter import default_tile_q, tma_reason

    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.ndim != 4 or not k_cache.shape[1]:
        return DECODE_MAX_QUERIES_TL  # the op that runs names what is wrong with them
    fp8 = torch.float8_e4m3fn
    if out_dtype is None and q.dtype == fp8:
        out_dtype = torch.bfloat16  # check_quant's default
    # fp8 inputs come with scales (check_quant makes them); only their presence matters here.
    scales = True if fp8 in (q.dtype, k_cache.dtype) else None
    why = tma_reason(q, k_cache, v_cache, block_size, out_dtype, scales, default_tile_q(q.shape[1] // k_cache.shape[1]), 0)
    return DECODE_MAX_QUERIES if why is None else DECODE_MAX_QUERIES_TL


def sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    max_seqlen_q: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    page_size: int | None = None,
    block_size: int = 128,
    return_lse: bool = False,
    q_scale: float | torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    partial_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention with the kernel chosen from host-known shapes: the
    query-outer decode kernel (:func:`sparse_decode_attention`) while sequences bring at
    most ``DECODE_MAX_QUERIES`` query rows each, where few queries share a block, else
    KV-outer (:func:`kvouter_attention`). Same arguments and results as both.

    ``max_seqlen_q``: an upper bound of the query rows of one sequence (a host int; the
    number of query tokens ``Tq`` stands in when it is not given). Never read from the
    device, so the choice costs no sync and a captured graph keeps it. ``partial_dtype``
    applies where KV-outer runs (the decode kernel merges its splits in registers); both
    branches check it the same way.
    """
    rows = q.shape[0] if max_seqlen_q is None else min(int(max_seqlen_q), q.shape[0])
    kwargs = dict(
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale,
        causal=causal,
        page_size=page_size,
        block_size=block_size,
        return_lse=return_lse,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        out_dtype=out_dtype,
    )
    if rows <= decode_max_queries(q, k_cache, v_cache, block_size, out_dtype):
        from .decode_attention import sparse_decode_attention

        if partial_dtype is not None and isinstance(q, torch.Tensor) and isinstance(v_cache, torch.Tensor):
            check_partial_dtype(partial_dtype, v_cache, out_dtype or default_out_dtype(q.dtype))
        return sparse_decode_attention(q, k_cache, v_cache, selected, block_tables, **kwargs)
    return kvouter_attention(q, k_cache, v_cache, selected, block_tables, **kwargs, partial_dtype=partial_dtype)


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
    q_scale: float | torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense attention over a paged K/V cache, same layouts (and fp8 options) as
    :func:`kvouter_attention`."""
    check_kv(q, k_cache, v_cache, None, allow_fp8=True)
    scales, out_dtype = check_quant(q, k_cache, q_scale, k_scale, v_scale, out_dtype)
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
    if use_triton(q, dense_unsupported(q, k_cache, v_cache)):
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
            scales=scales,
            out_dtype=out_dtype,
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
        scales=scales,
        out_dtype=out_dtype,
    )


__all__ = ["dense_paged_attention", "kvouter_attention", "sparse_attention"]
