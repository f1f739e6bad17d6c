"""Naive oracles: one query token at a time, float64, straight from the definition.

They share no code with the implementations they check (only the layout
convention), and are meant for small test shapes.
"""

from __future__ import annotations

import math

import torch


def _seq_rows(cu_seqlens_q, used_kv_lens):
    cu = [int(x) for x in cu_seqlens_q.cpu()]
    kv = [int(x) for x in used_kv_lens.cpu()]
    for b in range(len(kv)):
        n = cu[b + 1] - cu[b]
        for i in range(n):
            yield b, cu[b] + i, kv[b] - n + i, kv[b]


def _read(cache_row_fn, block_tables, b, positions, page_size):
    pages = [int(block_tables[b, j // page_size]) for j in positions]
    return [cache_row_fn(p, j % page_size) for p, j in zip(pages, positions)]


def index_topk_ref(
    index_q, index_k_cache, block_tables, cu_seqlens_q, used_kv_lens, topk, block_size=128, local_blocks=1
):
    """Returns (selected [Tq, Hi, topk] int32 with valid ids sorted ascending, then -1;
    block_scores: dict token -> [Hi, L+1] float64 scores of its visible blocks)."""
    num_tokens, heads, _ = index_q.shape
    page_size = index_k_cache.shape[1]
    sel = torch.full((num_tokens, heads, topk), -1, dtype=torch.int32)
    scores_out = {}
    for b, t, p, _ in _seq_rows(cu_seqlens_q, used_kv_lens):
        if p < 0:  # a row before the sequence's first token sees nothing
            continue
        keys = torch.stack(
            _read(lambda pg, s: index_k_cache[pg, s], block_tables, b, range(p + 1), page_size)
        ).double()  # [p+1, Di]
        last = p // block_size
        s = index_q[t].double().cpu() @ keys.cpu().T  # [Hi, p+1]
        block_scores = torch.stack(
            [s[:, blk * block_size : min((blk + 1) * block_size, p + 1)].amax(-1) for blk in range(last + 1)], -1
        )
        scores_out[t] = block_scores
        for h in range(heads):
            forced = [blk for blk in range(last, last - local_blocks, -1) if blk >= 0]
            rest = [blk for blk in range(last + 1) if blk not in forced]
            rest.sort(key=lambda blk: (-float(block_scores[h, blk]), blk))
            chosen = sorted(forced + rest[: max(0, topk - len(forced))])
            sel[t, h, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return sel, scores_out


def sparse_attention_ref(
    q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale=None, causal=True,
    block_size=128,
):
    """Returns (out [Tq, Hq, D] float64, lse [Hq, Tq] float64)."""
    num_tokens, hq, d = q.shape
    hkv, page_size = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = torch.zeros(num_tokens, hq, d, dtype=torch.float64)
    lse = torch.full((hq, num_tokens), float("-inf"), dtype=torch.float64)
    for b, t, p, kv_len in _seq_rows(cu_seqlens_q, used_kv_lens):
        limit = p + 1 if causal else kv_len
        if p < 0:
            continue
        for g in range(hkv):
            blocks = sorted({int(x) for x in selected[t, g].cpu() if int(x) >= 0})
            positions = [j for blk in blocks for j in range(blk * block_size, (blk + 1) * block_size) if j < limit]
            if not positions:
                continue
            k = torch.stack(_read(lambda pg, s: k_cache[pg, g, s], block_tables, b, positions, page_size)).double()
            v = torch.stack(_read(lambda pg, s: v_cache[pg, g, s], block_tables, b, positions, page_size)).double()
            for h in range(g * group, (g + 1) * group):
                s = (k.cpu() @ q[t, h].double().cpu()) * scale
                w = torch.softmax(s, 0)
                out[t, h] = w @ v.cpu()
                lse[h, t] = torch.logsumexp(s, 0)
    return out, lse


def dense_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale=None, causal=True):
    """Dense (all blocks) attention oracle over the paged cache."""
    page_size = k_cache.shape[2]
    max_blocks = block_tables.shape[1]
    sel = torch.arange(max_blocks, dtype=torch.int32)[None, None, :].expand(q.shape[0], k_cache.shape[1], -1)
    return sparse_attention_ref(
        q, k_cache, v_cache, sel, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, causal, block_size=page_size
    )
