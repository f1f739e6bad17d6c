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

from ..core.args import IndexArgs, is_tensor_scale
from ..core.layout import gather_tokens, key_extent, token_positions

# Bound the working set: (queries per chunk) x (keys per chunk) token scores.
QUERY_CHUNK = 64
KEY_CHUNK = 2048


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


def index_topk_torch(args: IndexArgs) -> torch.Tensor:
    """The torch implementation of ``index_topk`` (CPU path and oracle for the kernels).

    With an fp8 cache the gathered keys are dequantized (``codes.float() * scale``)
    and scored in fp32 against the unquantized queries; ``fp8_dot`` is the kernels' option
    and changes nothing here.
    """
    index_q, index_k_cache, block_tables = args.index_q, args.index_k_cache, args.block_tables
    cu_seqlens_q, used_kv_lens, index_k_scale = args.cu_seqlens_q, args.used_kv_lens, args.index_k_scale
    topk, block_size, local_blocks = args.topk, args.block_size, args.local_blocks
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
