"""Sparse attention for decode: query-outer, each query token reads its own selected blocks.

Same arguments and results as :func:`api.kvouter_attention`. KV-outer reads a
selected block once for all the queries that chose it, which wins when many queries
share blocks (prefill); with a few new tokens per sequence there is little to share,
and reading each token's blocks directly skips the index build, the schedule and
the partial traffic. CUDA tensors run the Triton kernel (``attention_triton.py``),
others the torch version below, which is also that kernel's oracle.

The torch version gathers every token's selected blocks at once: memory
``O(tokens x Hkv x topk x block_size x D)``, bounded by running the tokens in chunks.
"""

from __future__ import annotations

import torch

from ..core.args import AttnArgs
from ..core.layout import repeated_slots, token_positions

# Bytes of gathered K/V (fp32) and scores one torch chunk of tokens may hold.
TORCH_CHUNK_BYTES = 256 << 20


def sparse_decode_attention_torch(args: AttnArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch path on a checked call. Computes in fp32; fp8 inputs are dequantized with
    ``args.scales`` (q, k, v) and P is rounded to ``out_dtype`` before P @ V, as the kernel
    does."""
    q, k_cache, v_cache, selected, block_tables = args.q, args.k_cache, args.v_cache, args.selected, args.block_tables
    cu_seqlens_q, used_kv_lens, scales, out_dtype = args.cu_seqlens_q, args.used_kv_lens, args.scales, args.out_dtype
    softmax_scale, causal, block_size = args.softmax_scale, args.causal, args.block_size
    sq, sk, sv = (None, None, None) if scales is None else scales.to(device=q.device, dtype=torch.float32).unbind()
    num_tokens, hq, d = q.shape
    _, hkv, page_size, _ = k_cache.shape
    topk = selected.shape[2]
    group = hq // hkv
    device = q.device
    out, lse = args.new_outputs(no_keys=topk == 0)
    if num_tokens == 0 or topk == 0:
        return out, lse
    seq_all, pos_all = token_positions(cu_seqlens_q, used_kv_lens, num_tokens)
    kv = used_kv_lens.to(torch.int64)
    bt = block_tables.to(torch.int64)
    capacity = max(1, bt.shape[1] * page_size)
    keys = hkv * topk * block_size
    per_token = keys * (2 * d * 4 + group * 8 + 40)  # K, V in fp32; scores, weights; index tensors
    chunk = max(1, TORCH_CHUNK_BYTES // max(1, per_token))
    offs_b = torch.arange(block_size, device=device)
    heads = torch.arange(hkv, device=device)[None, :, None, None]
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        n = t1 - t0
        seq, pos = seq_all[t0:t1], pos_all[t0:t1]
        # Last visible key; a token before its sequence's first key sees nothing.
        lim = torch.where(pos < 0, -1, pos if causal else kv[seq] - 1)  # [C]
        sel = selected[t0:t1].to(torch.int64)  # [C, Hkv, K]
        # A repeated id counts once: keep its first slot.
        repeat = repeated_slots(sel)
        kpos = sel.clamp(min=0)[..., None] * block_size + offs_b  # [C, Hkv, K, Bs]
        visible = ((sel >= 0) & ~repeat)[..., None] & (kpos <= lim[:, None, None, None])
        # Never dereference table entries past a sequence's keys; zero what invisible
        # slots hold (it may be NaN) so that a weight of 0 cannot meet NaN.
        kpos_c = kpos.clamp(max=capacity - 1)
        page = torch.where(visible, bt[seq[:, None, None, None], kpos_c // page_size], 0)
        slot = kpos_c % page_size
        hide = ~visible[..., None]
        k = k_cache[page, heads, slot].float().masked_fill(hide, 0.0).flatten(2, 3)  # [C, Hkv, K*Bs, D]
        v = v_cache[page, heads, slot].float().masked_fill(hide, 0.0).flatten(2, 3)  # [C, Hkv, K*Bs, D]
        b_q = q[t0:t1].float().view(n, hkv, group, d)
        if scales is not None:
            b_q, k, v = b_q * sq, k * sk, v * sv
        s = torch.einsum("chgd,chkd->chgk", b_q, k) * softmax_scale  # [C, Hkv, G, K*Bs]
        s = s.masked_fill(~visible.flatten(2, 3)[:, :, None, :], float("-inf"))
        m = s.amax(-1)  # [C, Hkv, G]
        empty = m == float("-inf")
        p = torch.exp(s - torch.where(empty, 0.0, m)[..., None])
        l = p.sum(-1)
        if scales is not None:
            p = p.to(out_dtype).float()
        o = torch.einsum("chgk,chkd->chgd", p, v) / torch.where(empty, 1.0, l)[..., None]
        out[t0:t1] = o.reshape(n, hq, d).to(out_dtype)
        if lse is not None:
            row = torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, l)))
            lse[:, t0:t1] = row.reshape(n, hq).transpose(0, 1)
    return out, lse


__all__ = ["sparse_decode_attention_torch"]
