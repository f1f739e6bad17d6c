"""Sparse attention for decode: query-outer, each query token reads its own selected blocks.

Same arguments and results as :func:`interface.kvouter_attention`. KV-outer reads a
selected block once for all the queries that chose it, which wins when many queries
share blocks (prefill); with a few new tokens per sequence there is little to share,
and reading each token's blocks directly skips the index build, the schedule and
the partial traffic. CUDA tensors run the Triton kernel (``triton_decode.py``),
others the torch version below, which is also that kernel's oracle.

The torch version gathers every token's selected blocks at once: memory
``O(tokens x Hkv x topk x block_size x D)``, bounded by running the tokens in chunks.
"""

from __future__ import annotations

import torch

from ._dispatch import kvouter_unsupported, use_triton
from ._validate import check_quant
from .interface import validate_kvouter
from .layout import repeated_slots, token_positions

# Bytes of gathered K/V (fp32) and scores one torch chunk of tokens may hold.
TORCH_CHUNK_BYTES = 256 << 20
# Widest head dim the Triton kernel takes (its accumulator tile lives in registers).
MAX_TRITON_HEAD_DIM = 256
# Most selection slots per row the Triton kernel takes: each program compares every
# slot with every other (topk^2 values in registers) to drop repeated ids.
MAX_TRITON_TOPK = 64


def decode_unsupported(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, selected: torch.Tensor, block_size
) -> str | None:
    """Why the Triton decode kernel cannot take these shapes (None if it can)."""
    why = kvouter_unsupported(q, k_cache, block_size, v_cache)
    if why is not None:
        return why.replace("KV-outer", "decode")
    if v_cache.stride(3) != 1:
        return "the Triton decode kernel needs a contiguous head dim (stride 1)"
    if q.shape[2] > MAX_TRITON_HEAD_DIM:
        return f"the Triton decode kernel supports head dims up to {MAX_TRITON_HEAD_DIM}, got {q.shape[2]}"
    if selected.shape[2] > MAX_TRITON_TOPK:
        return f"the Triton decode kernel supports topk up to {MAX_TRITON_TOPK}, got {selected.shape[2]}"
    return None


def sparse_decode_attention(
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
    q_scale: float | torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention, query-outer (for decode and short chunks).

    q: [Tq, Hq, D] token-major; k_cache/v_cache: [pages, Hkv, page_size, D];
    selected: [Tq, Hkv, topk] block ids (``-1`` = empty slot; a repeated id counts once);
    block_tables: [B, max_pages]; cu_seqlens_q: [B + 1]; used_kv_lens: [B] cached tokens
    per sequence including the new queries, which are the last ones (right aligned).
    Returns (out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] fp32 or None); a query with no
    visible key outputs zeros and lse = -inf.

    fp8 caches (and q) with per-tensor scales and ``out_dtype``: as in ``kvouter_attention``.

    Nothing is read back to the host on CUDA tensors, so a call can be captured in a
    CUDA graph.
    """
    batch, _, scale = validate_kvouter(
        q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, page_size, block_size,
        allow_fp8=True,
    )
    scales, out_dtype = check_quant(q, k_cache, q_scale, k_scale, v_scale, out_dtype)
    if use_triton(q, decode_unsupported(q, k_cache, v_cache, selected, block_size)):
        from .triton_decode import run_decode_triton

        return run_decode_triton(
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
            scales=scales,
            out_dtype=out_dtype,
        )
    return sparse_decode_attention_torch(
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
        scales=scales,
        out_dtype=out_dtype,
    )


def sparse_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    block_size: int,
    return_lse: bool,
    scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain torch version on arguments already checked (``softmax_scale`` resolved).
    Computes in fp32; fp8 inputs are dequantized with ``scales`` (fp32 [3]: q, k, v) and P
    is rounded to ``out_dtype`` before P @ V, as the kernel does."""
    out_dtype = out_dtype or q.dtype
    sq, sk, sv = (None, None, None) if scales is None else scales.to(device=q.device, dtype=torch.float32).unbind()
    num_tokens, hq, d = q.shape
    _, hkv, page_size, _ = k_cache.shape
    topk = selected.shape[2]
    group = hq // hkv
    device = q.device
    out = torch.empty(num_tokens, hq, d, dtype=out_dtype, device=device)
    lse = torch.empty(hq, num_tokens, dtype=torch.float32, device=device) if return_lse else None
    if num_tokens == 0:
        return out, lse
    if topk == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
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


__all__ = ["sparse_decode_attention", "sparse_decode_attention_torch", "decode_unsupported"]
