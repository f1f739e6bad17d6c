"""KV-outer attention stage: raw (unnormalized) partials for every index entry.

Entry ``e`` = (token t, kv head g, block of sequence s). Its partial covers the G
query heads of group g of token t against the keys of that block that t may see:

    m[e, h] = max_j s_j,  l[e, h] = sum_j exp(s_j - m),  o[e, h] = sum_j exp(s_j - m) v_j

with ``s_j = scale * <q[t, g*G + h], k_j>``. A row that sees no key, and every
unused entry, stores ``m = -inf, l = 0, o = 0``.

float8_e4m3fn partials (fp8 caches only) store ``o / l`` instead, in V's stored units
(without its scale): a convex combination of fp8 values, so within +-448 and never
rescaled. They halve the partials' bytes, the stage's largest traffic; the combine
weights them by ``l`` and applies V's scale. Rows are stored in entry order,
which is the tile order of the schedule, so the GPU kernel writes each tile with
one contiguous store.
"""

from __future__ import annotations

import torch

from ..core.args import AttnArgs
from ..core.launch import fp8_flags
from ..core.layout import token_positions
from ..core.quant import E4M3_MAX
from ..core.validate import check_kv, check_pages, check_partial_dtype, check_positive_int, check_scale
from .build import KVOuterIndex

ENTRY_CHUNK = 512


def validate_partials(q, k_cache, v_cache, index, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, block_size):
    """Checks of :func:`kvouter_partials`; returns the batch size."""
    check_kv(q, k_cache, v_cache, None, allow_fp8=True)
    if not isinstance(index, KVOuterIndex):
        raise TypeError(f"index: expected a KVOuterIndex from build_kvouter_index, got {type(index).__name__}")
    expected = (q.shape[0], k_cache.shape[1])
    if tuple(index.slot_of.shape[:2]) != expected:
        raise ValueError(
            f"index: built for {tuple(index.slot_of.shape[:2])} (tokens, kv heads), expected {expected} "
            "from q and k_cache"
        )
    if index.slot_of.device != q.device:
        raise ValueError(f"index: expected tensors on {q.device}, got {index.slot_of.device}")
    check_positive_int("block_size", block_size)
    if softmax_scale is None:
        raise ValueError("softmax_scale: expected a positive finite float, got None")
    check_scale(softmax_scale, q.shape[2])
    batch = check_pages(q, k_cache, block_tables, cu_seqlens_q, used_kv_lens)
    max_blocks = -(-block_tables.shape[1] * k_cache.shape[2] // block_size)
    if index.max_blocks != max_blocks:
        raise ValueError(
            f"index: built with max_blocks={index.max_blocks}, expected {max_blocks} "
            "(block table capacity / block_size)"
        )
    return batch


def empty_partials(capacity: int, group: int, d: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """The stage's outputs, uninitialized: partial_o [E, G, D] in ``dtype``, partial_m and
    partial_l [E, G] fp32 (every implementation writes all of them, unused entries too)."""
    return (
        torch.empty(capacity, group, d, dtype=dtype, device=device),
        torch.empty(capacity, group, dtype=torch.float32, device=device),
        torch.empty(capacity, group, dtype=torch.float32, device=device),
    )


def kvouter_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: KVOuterIndex,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    block_size: int = 128,
    scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    partial_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (partial_o [E, G, D] in ``partial_dtype``, partial_m [E, G] fp32,
    partial_l [E, G] fp32).

    ``scales``: fp32 [3] dequantization scales of q, k, v (fp8 inputs; see
    ``core.validate.check_quant``), or None. ``out_dtype`` (default q's) is the dtype P @ V
    runs in; as on the GPU, P is rounded to it before P @ V when the inputs are fp8.
    ``partial_dtype``: ``out_dtype`` (the default) or float8_e4m3fn with fp8 caches
    (normalized rows, see the module doc).
    """
    args = partials_args(
        q, k_cache, v_cache, index, block_tables, cu_seqlens_q=cu_seqlens_q, used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale, causal=causal, block_size=block_size, scales=scales, out_dtype=out_dtype,
        partial_dtype=partial_dtype,
    )
    return partials_torch(args, index)


def partials_args(
    q, k_cache, v_cache, index, block_tables, *, cu_seqlens_q, used_kv_lens, softmax_scale, causal, block_size,
    scales, out_dtype, partial_dtype,
) -> AttnArgs:
    """The checked argument object of a partials stage over a given ``index`` (the torch stage
    here, the GPU kernels through ``api.kvouter_partials_gpu``)."""
    batch = validate_partials(
        q, k_cache, v_cache, index, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, block_size
    )
    _, _, out_dtype = fp8_flags(q, k_cache, scales, out_dtype, "kvouter_attention")
    return AttnArgs(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens, batch=batch, softmax_scale=float(softmax_scale), causal=bool(causal),
        return_lse=False, scales=scales, out_dtype=out_dtype, block_size=block_size, max_blocks=index.max_blocks,
        partial_dtype=check_partial_dtype(partial_dtype, v_cache, out_dtype),
    )


def partials_torch(args: AttnArgs, index: KVOuterIndex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kvouter_partials` on a checked call (the torch path of ``kvouter_attention``)."""
    q, k_cache, v_cache, block_tables = args.q, args.k_cache, args.v_cache, args.block_tables
    cu_seqlens_q, used_kv_lens, scales = args.cu_seqlens_q, args.used_kv_lens, args.scales
    softmax_scale, causal, block_size = args.softmax_scale, args.causal, args.block_size
    out_dtype, partial_dtype = args.out_dtype, args.partial_dtype
    normalized = args.normalized_partials
    num_tokens, d, page_size, group = args.num_tokens, args.d, args.page_size, args.group
    cap = index.capacity
    device = q.device
    partial_o, partial_m, partial_l = empty_partials(cap, group, d, partial_dtype, device)
    sq, sk, sv = (None, None, None) if scales is None else scales.to(device=device, dtype=torch.float32).unbind()
    if cap == 0:
        return partial_o, partial_m, partial_l
    _, pos_all = token_positions(cu_seqlens_q, used_kv_lens, num_tokens)
    kv = used_kv_lens.to(torch.int64)
    bt = block_tables.to(torch.int64)
    nbg = index.num_global_blocks
    offs_b = torch.arange(block_size, device=device)
    capacity_tokens = block_tables.shape[1] * page_size
    for e0 in range(0, cap, ENTRY_CHUNK):
        e1 = min(e0 + ENTRY_CHUNK, cap)
        tok = index.entry_token[e0:e1].to(torch.int64)
        segm = index.entry_segment[e0:e1].to(torch.int64)
        live = tok >= 0
        tok_c, seg_c = tok.clamp(min=0), segm.clamp(min=0)
        g = seg_c // nbg
        gblock = seg_c % nbg
        seq = gblock // index.max_blocks
        blk = gblock % index.max_blocks
        kpos = blk[:, None] * block_size + offs_b[None, :]  # [C, B]
        # A row before its sequence's first token (negative position) sees nothing.
        visible = (kpos < kv[seq][:, None]) & (live & (pos_all[tok_c] >= 0))[:, None]
        if causal:
            visible &= kpos <= pos_all[tok_c][:, None]
        kpos_c = kpos.clamp(max=capacity_tokens - 1)
        # Table entries past a sequence's pages may hold anything: never dereference them,
        # and zero what an invisible slot holds (it may be NaN) so p = 0 cannot meet NaN.
        page = torch.where(visible, bt[seq[:, None], kpos_c // page_size], 0)
        slot = kpos_c % page_size
        k = k_cache[page, g[:, None], slot].float().masked_fill(~visible[..., None], 0.0)  # [C, B, D]
        v = v_cache[page, g[:, None], slot].float().masked_fill(~visible[..., None], 0.0)  # [C, B, D]
        heads = g[:, None] * group + torch.arange(group, device=device)[None, :]
        b_q = q[tok_c[:, None], heads].float()  # [C, G, D]
        if scales is not None:
            b_q, k = b_q * sq, k * sk
            if not normalized:
                v = v * sv
        s = torch.einsum("cgd,cbd->cgb", b_q, k) * softmax_scale  # [C, G, B]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        m = s.amax(-1)  # [C, G]
        empty = m == float("-inf")
        p = torch.exp(s - torch.where(empty, 0.0, m)[..., None])  # [C, G, B]
        l = p.sum(-1)
        if scales is not None:
            p = p.to(out_dtype).float()
        o = torch.einsum("cgb,cbd->cgd", p, v)  # [C, G, D]
        if normalized:
            o = (o / torch.where(empty, 1.0, l)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
        partial_o[e0:e1] = o.to(partial_dtype)
        partial_m[e0:e1] = m
        partial_l[e0:e1] = l
    return partial_o, partial_m, partial_l
