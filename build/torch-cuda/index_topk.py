"""Index branch: block selection of MiniMax sparse attention over a paged index-key cache.

For query token ``t`` at position ``p`` and index head ``h``: token scores
``s[j] = <iq[t, h], ik[j]>`` for ``j <= p``, block scores ``S[b] = max_j s[j]``
over the visible tokens of block ``b``, the ``local_blocks`` blocks ending at
``L = p // block_size`` are forced, the remaining slots go to the best blocks
before them (ties to the lower block id), unused slots are ``-1``.

This torch implementation streams over key chunks, so its memory is
``O(query_chunk x (key_chunk x D + blocks))`` whatever the sequence length:
the ``[Tq, Tk]`` score matrix is never formed.
"""

from __future__ import annotations

import torch

from ._validate import FLOAT_DTYPES, SUPPORTED_PAGE_SIZES, check_dim, check_positive_int, check_tensor, check_varlen
from ._dispatch import index_unsupported, use_triton
from .layout import gather_tokens, key_extent, token_positions

# Bound the working set: (queries per chunk) x (keys per chunk) token scores.
QUERY_CHUNK = 64
KEY_CHUNK = 2048


def validate_index_topk(index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens, topk, block_size, local_blocks):
    check_tensor("index_q", index_q, ndim=3, dtypes=FLOAT_DTYPES)
    device = index_q.device
    check_tensor("index_k_cache", index_k_cache, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_dim("index_k_cache", index_k_cache, 2, index_q.shape[2], "index head dim (index_q.shape[2])")
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
) -> torch.Tensor:
    """Select ``topk`` key blocks per (query token, index head).

    index_q: [Tq, Hi, Di] token-major index queries (already normed and rotated);
    index_k_cache: [pages, page_size, Di] the single shared index-key head, paged;
    block_tables: [B, max_pages] int; cu_seqlens_q: [B + 1] int; used_kv_lens: [B] int
    (cached tokens per sequence, the new queries included, right aligned).
    Returns ``selected`` [Tq, Hi, topk] int32, ``-1`` in unused slots.
    ``max_seqlen_q`` (host int, optional) only tunes the GPU kernel's tiling.

    CUDA tensors run the Triton kernels (``triton_index_topk``), others this torch code.
    """
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
) -> torch.Tensor:
    """The torch implementation of :func:`index_topk` (CPU path and oracle for the kernels)."""
    validate_index_topk(index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens, topk, block_size, local_blocks)
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
            keys = gather_tokens(index_k_cache, block_tables, seq[:, None].expand_as(safe), safe, page_size)
            s = torch.einsum("qhd,qkd->qhk", iq, keys.float())  # [Cq, Hi, Kc]
            s = s.masked_fill(~visible[:, None, :], float("-inf"))
            nbc = (k1 - k0) // block_size
            scores[:, :, k0 // block_size : k0 // block_size + nbc] = s.view(q1 - q0, heads, nbc, block_size).amax(-1)
        out[q0:q1] = select_blocks(scores, pos // block_size, topk, local_blocks)
    return out
