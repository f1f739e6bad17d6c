"""Index branch: block selection of MiniMax sparse attention over a paged index-key cache.

For query token ``t`` at position ``p`` and index head ``h``: token scores
``s[j] = <iq[t, h], ik[j]>`` for ``j <= p``, block scores ``S[b] = max_j s[j]``
over the visible tokens of block ``b``, the ``local_blocks`` blocks ending at
``L = p // block_size`` are forced, the remaining slots go to the best blocks
before them (ties to the lower block id), unused slots are ``-1``.

This torch implementation streams over key chunks, so its memory is
``O(query_chunk x (key_chunk x D + blocks))`` whatever the sequence length:
the ``[Tq, Tk]`` score matrix is never formed.

fp8 index keys: an ``index_k_cache`` of ``torch.float8_e4m3fn`` holds e4m3 codes,
and ``index_k_scale`` their fp32 dequantization scale, either per token
(``[pages, page_size]``) or one for the whole cache (one element); the selection is
the one of the keys ``cache.float() * scale``. A per-tensor scale multiplies every
score of a row by the same positive factor, so it never changes a ranking and the
GPU kernel does not read it (one multiply per score less than per-token scales).
"""

from __future__ import annotations

import torch

import math

from ._validate import (
    FLOAT_DTYPES,
    SUPPORTED_PAGE_SIZES,
    check_dim,
    check_positive_int,
    check_tensor,
    check_varlen,
    value_checks_enabled,
)
from ._dispatch import index_unsupported, use_triton
from .layout import gather_tokens, key_extent, token_positions

# Bound the working set: (queries per chunk) x (keys per chunk) token scores.
QUERY_CHUNK = 64
KEY_CHUNK = 2048
# e4m3fn only: it is what Hopper's fp8 tensor cores take (e4m3fnuz is AMD's encoding),
# and its 3 mantissa bits are enough for ranking while e5m2's 2 are not.
# Hopper's fp8 MMA reduces over at least 32 elements.
FP8_DOT_MIN_DIM = 32
FP8_INDEX_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)


def is_tensor_scale(index_k_scale) -> bool:
    """True for a per-tensor scale (one element), False for per-token scales."""
    return isinstance(index_k_scale, torch.Tensor) and index_k_scale.dim() <= 1 and index_k_scale.numel() == 1


def check_index_k_scale(index_k_cache: torch.Tensor, index_k_scale) -> None:
    """An fp8 cache needs its fp32 scale, per token ``[pages, page_size]`` or per
    tensor (one element); any other cache must come without one (a stray scale would
    otherwise be silently ignored)."""
    if index_k_cache.dtype in FP8_INDEX_DTYPES:
        want = f"per-token {tuple(index_k_cache.shape[:2])} ([pages, page_size]) or per-tensor (1,) or ()"
        if index_k_scale is None:
            raise ValueError(
                "index_k_scale: required with an fp8 (float8_e4m3fn) index_k_cache: pass its fp32 "
                f"dequantization scale, {want}"
            )
        check_tensor("index_k_scale", index_k_scale, dtypes=(torch.float32,), device=index_k_cache.device)
        if not is_tensor_scale(index_k_scale) and tuple(index_k_scale.shape) != tuple(index_k_cache.shape[:2]):
            raise ValueError(f"index_k_scale: expected shape {want}, got {tuple(index_k_scale.shape)}")
        if is_tensor_scale(index_k_scale) and value_checks_enabled(index_k_scale):
            # The GPU kernel never reads a per-tensor scale: only a positive finite one
            # leaves the ranking (and so the torch path's result) unchanged.
            v = float(index_k_scale.reshape(()))
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"index_k_scale: a per-tensor scale must be positive and finite, got {v}")
    elif index_k_scale is not None:
        raise ValueError(
            "index_k_scale: only an fp8 (float8_e4m3fn) index_k_cache takes a scale; index_k_cache is "
            f"{str(index_k_cache.dtype).replace('torch.', '')}"
        )


def validate_index_topk(
    index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens, topk, block_size, local_blocks, index_k_scale=None
):
    check_tensor("index_q", index_q, ndim=3, dtypes=FLOAT_DTYPES)
    device = index_q.device
    check_tensor("index_k_cache", index_k_cache, ndim=3, dtypes=FLOAT_DTYPES + FP8_INDEX_DTYPES, device=device)
    check_dim("index_k_cache", index_k_cache, 2, index_q.shape[2], "index head dim (index_q.shape[2])")
    check_index_k_scale(index_k_cache, index_k_scale)
    if index_k_cache.shape[1] not in SUPPORTED_PAGE_SIZES:
        raise ValueError(
            f"index_k_cache: page size {index_k_cache.shape[1]} is not supported; expected one of {SUPPORTED_PAGE_SIZES}"
        )
    check_positive_int("topk", topk)
    check_positive_int("block_size", block_size)
    if not isinstance(local_blocks, int) or isinstance(local_blocks, bool) or not 0 <= local_blocks <= topk:
        raise ValueError(f"local_blocks: expected an int in [0, topk={topk}], got {local_blocks!r}")
    check_varlen(
        cu_seqlens_q,
        used_kv_lens,
        block_tables,
        num_tokens=index_q.shape[0],
        page_size=index_k_cache.shape[1],
        num_pages=index_k_cache.shape[0],
        device=device,
    )


def select_blocks(block_scores: torch.Tensor, last_block: torch.Tensor, topk: int, local_blocks: int) -> torch.Tensor:
    """Apply the selection rule to finished block scores.

    block_scores: [T, H, NB] fp32 (entries of blocks > last_block are ignored);
    last_block: [T] int64, the query's own block. Returns [T, H, topk] int32.
    """
    nb = block_scores.shape[-1]
    blocks = torch.arange(nb, device=block_scores.device)
    last = last_block[:, None, None]
    forced = (blocks <= last) & (blocks > last - local_blocks)
    future = blocks > last
    s = block_scores.masked_fill(future, float("-inf")).masked_fill(forced, float("inf"))
    k = min(topk, nb)
    # A stable descending sort breaks equal scores towards the lower block id.
    order = torch.sort(s, dim=-1, descending=True, stable=True)
    ids = order.indices[..., :k].to(torch.int32)
    ids = ids.masked_fill(order.values[..., :k] == float("-inf"), -1)
    if k < topk:
        ids = torch.nn.functional.pad(ids, (0, topk - k), value=-1)
    return ids


def index_topk(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    topk: int,
    block_size: int = 128,
    local_blocks: int = 1,
    max_seqlen_q: int | None = None,
    index_k_scale: torch.Tensor | None = None,
    fp8_dot: bool = False,
) -> torch.Tensor:
    """Select ``topk`` key blocks per (query token, index head).

    index_q: [Tq, Hi, Di] token-major index queries (already normed and rotated);
    index_k_cache: [pages, page_size, Di] the single shared index-key head, paged
    (bf16/fp16/fp32, or float8_e4m3fn codes with ``index_k_scale``);
    block_tables: [B, max_pages] int; cu_seqlens_q: [B + 1] int; used_kv_lens: [B] int
    (cached tokens per sequence, the new queries included, right aligned).
    Returns ``selected`` [Tq, Hi, topk] int32, ``-1`` in unused slots.
    ``max_seqlen_q`` (host int, optional) only tunes the GPU kernel's tiling.

    index_k_scale: fp32, required with an fp8 ``index_k_cache`` and rejected otherwise:
    per token, ``[pages, page_size]`` (key ``j`` is ``index_k_cache[j].float() *
    index_k_scale[j]``), or per tensor, one element (every key times the same positive
    finite scale; the GPU kernel then skips the per-score multiply: faster, same ranking).
    fp8_dot: fp8 caches only, and only the Triton path reads it: the query rows are
    quantized to e4m3 as well so the scores run on the fp8 tensor cores (faster
    prefill, noisier ranking). The torch path always scores the exact query
    against the dequantized keys.

    CUDA tensors run the Triton kernels (``triton_index_topk``), others this torch code.
    """
    if not isinstance(fp8_dot, bool):
        raise ValueError(f"fp8_dot: expected a bool, got {fp8_dot!r}")
    if isinstance(index_k_cache, torch.Tensor):
        # Checked here, before dispatch, so both paths reject the same pairings.
        check_index_k_scale(index_k_cache, index_k_scale)
        if fp8_dot and index_k_cache.dtype not in FP8_INDEX_DTYPES:
            raise ValueError(
                "fp8_dot: only applies to an fp8 (float8_e4m3fn) index_k_cache; index_k_cache is "
                f"{str(index_k_cache.dtype).replace('torch.', '')}"
            )
        if fp8_dot and isinstance(index_q, torch.Tensor) and index_q.dim() == 3 and index_q.shape[2] < FP8_DOT_MIN_DIM:
            raise ValueError(
                f"fp8_dot: the fp8 tensor-core dot needs an index head dim of at least {FP8_DOT_MIN_DIM}, got "
                f"{index_q.shape[2]}; use fp8_dot=False (fp32 scores of the fp8 keys)"
            )
    if isinstance(index_q, torch.Tensor) and isinstance(index_k_cache, torch.Tensor) and index_q.dim() == 3 \
            and index_k_cache.dim() == 3 and use_triton(index_q, index_unsupported(index_q, index_k_cache, topk, block_size)):
        from .triton_index_topk import index_topk_triton

        return index_topk_triton(
            index_q,
            index_k_cache,
            block_tables,
            cu_seqlens_q=cu_seqlens_q,
            used_kv_lens=used_kv_lens,
            topk=topk,
            block_size=block_size,
            local_blocks=local_blocks,
            max_seqlen_q=max_seqlen_q,
            index_k_scale=index_k_scale,
            fp8_dot=fp8_dot,
        )
    return index_topk_torch(
        index_q,
        index_k_cache,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        topk=topk,
        block_size=block_size,
        local_blocks=local_blocks,
        index_k_scale=index_k_scale,
    )


def index_topk_torch(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    topk: int,
    block_size: int = 128,
    local_blocks: int = 1,
    index_k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch implementation of :func:`index_topk` (CPU path and oracle for the kernels).

    With an fp8 cache the gathered keys are dequantized (``codes.float() * scale``)
    and scored in fp32 against the unquantized queries.
    """
    validate_index_topk(
        index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens, topk, block_size, local_blocks,
        index_k_scale=index_k_scale,
    )
    num_tokens, heads, _ = index_q.shape
    page_size = index_k_cache.shape[1]
    capacity = key_extent(used_kv_lens, block_tables.shape[1] * page_size)
    num_blocks = -(-capacity // block_size)
    out = torch.empty(num_tokens, heads, topk, dtype=torch.int32, device=index_q.device)
    if num_tokens == 0:
        return out
    seq_all, pos_all = token_positions(cu_seqlens_q, used_kv_lens, num_tokens)
    key_chunk = max(block_size, (KEY_CHUNK // block_size) * block_size)
    for q0 in range(0, num_tokens, QUERY_CHUNK):
        q1 = min(q0 + QUERY_CHUNK, num_tokens)
        seq, pos = seq_all[q0:q1], pos_all[q0:q1]
        iq = index_q[q0:q1].float()  # [Cq, Hi, Di]
        scores = torch.full((q1 - q0, heads, num_blocks), float("-inf"), device=iq.device)
        for k0 in range(0, num_blocks * block_size, key_chunk):
            k1 = min(k0 + key_chunk, num_blocks * block_size)
            kpos = torch.arange(k0, k1, device=iq.device)
            visible = kpos[None, :] <= pos[:, None]  # [Cq, Kc]
            safe = torch.minimum(kpos[None, :].expand_as(visible), pos[:, None])
            rows = seq[:, None].expand_as(safe)
            keys = gather_tokens(index_k_cache, block_tables, rows, safe, page_size).float()
            if index_k_scale is not None and is_tensor_scale(index_k_scale):
                keys = keys * index_k_scale.reshape(())
            elif index_k_scale is not None:
                keys = keys * gather_tokens(index_k_scale, block_tables, rows, safe, page_size)[..., None]
            s = torch.einsum("qhd,qkd->qhk", iq, keys)  # [Cq, Hi, Kc]
            s = s.masked_fill(~visible[:, None, :], float("-inf"))
            nbc = (k1 - k0) // block_size
            scores[:, :, k0 // block_size : k0 // block_size + nbc] = s.view(q1 - q0, heads, nbc, block_size).amax(-1)
        out[q0:q1] = select_blocks(scores, pos // block_size, topk, local_blocks)
    return out
