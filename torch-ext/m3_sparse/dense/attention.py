"""Dense causal attention over a paged K/V cache (full-attention layers, and any
sparse query whose visible blocks are all selected).

Streams key chunks with an online softmax, so memory stays
``O(query_chunk x key_chunk)`` per head instead of ``O(Tq x Tk)``.
"""

from __future__ import annotations

import torch

from ..core.args import AttnArgs
from ..core.layout import key_extent, token_positions

QUERY_CHUNK = 32
KEY_CHUNK = 1024


def dense_paged_attention_torch(args: AttnArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch path on a checked call. fp8 inputs are dequantized with ``args.scales``
    (q, k, v) and P is rounded to ``out_dtype`` before P @ V, as the kernel does."""
    q, k_cache, v_cache, block_tables = args.q, args.k_cache, args.v_cache, args.block_tables
    cu_seqlens_q, used_kv_lens, scales, out_dtype = args.cu_seqlens_q, args.used_kv_lens, args.scales, args.out_dtype
    softmax_scale, causal = args.softmax_scale, args.causal
    num_tokens, hq, d = q.shape
    hkv, page_size, group = args.hkv, args.page_size, args.group
    device = q.device
    sq, sk, sv = (None, None, None) if scales is None else scales.to(device=device, dtype=torch.float32).unbind()
    out, lse = args.new_outputs()
    if num_tokens == 0:
        return out, lse
    seq_all, pos_all = token_positions(cu_seqlens_q, used_kv_lens, num_tokens)
    kv = used_kv_lens.to(torch.int64)
    bt = block_tables.to(torch.int64)
    capacity = key_extent(used_kv_lens, block_tables.shape[1] * page_size)
    for q0 in range(0, num_tokens, QUERY_CHUNK):
        q1 = min(q0 + QUERY_CHUNK, num_tokens)
        seq, pos = seq_all[q0:q1], pos_all[q0:q1]
        # keys [0, limit) are visible; a row at a negative position sees none
        limit = torch.where(pos < 0, 0, pos + 1 if causal else kv[seq])
        b_q = q[q0:q1].float().view(q1 - q0, hkv, group, d)  # [C, Hkv, G, D]
        if scales is not None:
            b_q = b_q * sq
        m = torch.full((q1 - q0, hkv, group), float("-inf"), device=device)
        l = torch.zeros(q1 - q0, hkv, group, device=device)
        acc = torch.zeros(q1 - q0, hkv, group, d, device=device)
        for k0 in range(0, capacity, KEY_CHUNK):
            k1 = min(k0 + KEY_CHUNK, capacity)
            kpos = torch.arange(k0, k1, device=device)
            visible = kpos[None, :] < limit[:, None]  # [C, Kc]
            # Never dereference table entries past a sequence's pages; zero invisible slots.
            page = torch.where(visible, bt[seq[:, None], kpos[None, :] // page_size], 0)
            slot = (kpos % page_size)[None, :].expand_as(page)
            k = k_cache.permute(0, 2, 1, 3)[page, slot].float().masked_fill(~visible[..., None, None], 0.0)
            v = v_cache.permute(0, 2, 1, 3)[page, slot].float().masked_fill(~visible[..., None, None], 0.0)
            if scales is not None:
                k, v = k * sk, v * sv
            s = torch.einsum("chgd,ckhd->chgk", b_q, k) * softmax_scale
            s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp(m - safe)
            p = torch.exp(s - safe[..., None])
            l = l * alpha + p.sum(-1)
            if scales is not None:
                p = p.to(out_dtype).float()
            acc = acc * alpha[..., None] + torch.einsum("chgk,ckhd->chgd", p, v)
            m = m_new
        empty = m == float("-inf")
        o = acc / torch.where(empty, 1.0, l)[..., None]
        out[q0:q1] = o.masked_fill(empty[..., None], 0.0).reshape(q1 - q0, hq, d).to(out_dtype)
        if lse is not None:
            row = torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, l)))
            lse[:, q0:q1] = row.reshape(q1 - q0, hq).transpose(0, 1)
    return out, lse
