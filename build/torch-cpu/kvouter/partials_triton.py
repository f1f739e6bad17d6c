"""Triton KV-outer attention stage: raw partials of every index entry, driven by a Schedule.

Same contract as :func:`partials.kvouter_partials` (that torch version is
the oracle): ``partial_o [E, G, D]`` in q's dtype, ``partial_m/partial_l [E, G]``
fp32; a row that sees no key and every unused entry (past ``seg_offsets[-1]``)
holds ``m = -inf, l = 0, o = 0``.

One persistent program per slice ``[program_tiles[p], program_tiles[p + 1])`` of
the schedule. Per tile (one segment = kv head g, sequence, block; up to TQ
consecutive entries of it):

* the K/V block is read through the block table (a block may span pages or share one),
  once per run of the segment's tiles in the slice;
* the tile's queries are gathered head-packed: row ``i * GP + h`` is head
  ``g * G + h`` of the i-th entry's token, so TQ tokens x G heads fill one
  MMA tile of ``TQ * GP`` rows (GP = G rounded up to a power of two);
* one softmax step over the block: no running max, no rescale;
* the rows ``e * G + h`` of the tile's entries are consecutive rows of the
  partial buffer, so the tile's output is one contiguous store.

Partial offsets are 64-bit: at 32K+ tokens the buffer holds more than 2^31 elements.

fp8 (e4m3) inputs: Q @ K^T runs on the stored fp8 values (an fp8 x fp8 MMA when q is fp8,
else K widened to q's dtype) and the dequantization scales fold into the softmax scale.
P @ V runs in the output dtype with V widened in registers (exact for e4m3), then times
v_scale: fp8 halves the K/V bytes read, while P keeps the output dtype's precision instead of e4m3's
three mantissa bits, and V needs no K-major copy for an fp8 MMA. float8_e4m3fn partials
(``partial_dtype``) store the normalized rows O / l in V's units instead (the combine applies
v_scale), which halves the bytes of the partials, written here and read again by the combine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.args import AttnArgs
from ..core.interpreter import dot, to_e4m3
from ..core.launch import contiguous, interpreting, launch_kernel, next_pow2, tl_dtype
from ..core.online_softmax import fold_fp8_scales
from .build import KVOuterIndex
from .partials import empty_partials
from .plan import DEFAULT_CONFIG, KVOuterConfig, group_pad, tile_rows_reason
from .schedule import Schedule

LOG2E = 1.4426950408889634

# Rows of the unused tail that one program clears per step.
FILL_ROWS = 64


@triton.jit
def _segment_meta(
    bt_ptr, cu_ptr, kvlen_ptr, seg, live, nbg, max_blocks, stride_bt, offs_n, BS: tl.constexpr, PS: tl.constexpr,
):
    """Block, per-key pages [BS], kv length and position base of a segment (nothing read
    unless ``live``)."""
    gb = seg % nbg
    seq = gb // max_blocks
    blk = gb - seq * max_blocks
    kv_len = tl.load(kvlen_ptr + seq, mask=live, other=0)
    # Queries are the last tokens of their sequence: pos = kv_len - q_end + token.
    pos_base = kv_len - tl.load(cu_ptr + seq + 1, mask=live, other=0)
    k_pos = blk * BS + offs_n
    page = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + k_pos // PS, mask=k_pos < kv_len, other=0).to(tl.int64)
    return blk, page, kv_len, pos_base


@triton.jit
def _load_kv(
    k_ptr, v_ptr, g, blk, page, kv_len, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
    offs_d, offs_n, q_dt: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr, WIDEN_K: tl.constexpr,
):
    """The K/V block of a segment through its pages, in the dtypes the two dots take."""
    k_pos = blk * BS + offs_n
    slot = k_pos % PS
    kv_mask = (k_pos < kv_len)[:, None] & (offs_d < D)[None, :]
    # K is loaded as K^T so that the dot takes it as is: with a transpose at the dot, a
    # software-pipelined loop over query tiles kept the shared-memory copy of K inside it
    # (V's was hoisted).
    p_kt = k_ptr + (page * stride_kp + g * stride_kh + slot * stride_ks)[None, :] + offs_d[:, None]
    p_v = v_ptr + (page * stride_vp + g * stride_vh + slot * stride_vs)[:, None] + offs_d[None, :]
    b_kt = tl.load(p_kt, mask=tl.trans(kv_mask), other=0.0)  # [BD, BS]
    b_v = tl.load(p_v, mask=kv_mask, other=0.0)  # [BS, BD]
    if WIDEN_K:
        b_kt = b_kt.to(q_dt)  # fp8 keys against a float q
    return b_kt, b_v


@triton.jit
def _attend_rows(
    q_ptr, po_ptr, pm_ptr, pl_ptr, b_kt, b_v,
    g, blk, e0, e1, tok, kv_len, pos_base,
    stride_qt, stride_qh, qk_scale, v_scale, r_tok, r_head, offs_d, offs_n,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr, KV_FP8: tl.constexpr,
    PV_DT: tl.constexpr, NORM: tl.constexpr,
):
    """One tile against a loaded K/V block: gather its queries, one softmax step, store."""
    d_ok = offs_d < D
    e_row = e0 + r_tok
    row_ok = (e_row < e1) & (r_head < G)
    p_q = q_ptr + (tok.to(tl.int64) * stride_qt + (g * G + r_head).to(tl.int64) * stride_qh)[:, None] + offs_d[None, :]
    b_q = tl.load(p_q, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
    b_s = dot(b_q, b_kt, PREC) * qk_scale  # [BM, BS], log2 units
    # Last visible key position per row; -1 for rows that see nothing.
    row_pos = pos_base + tok
    if CAUSAL:
        lim = tl.minimum(row_pos, kv_len - 1)
    else:
        lim = tl.zeros_like(row_pos) + (kv_len - 1)
    lim = tl.where(row_ok & (row_pos >= 0), lim, -1)
    # Only the local block (or the sequence's last, partial block) needs the mask.
    lim_min = tl.min(tl.where(row_ok, lim, 2147483647), 0)
    if blk * BS + BS - 1 > lim_min:
        k_pos = blk * BS + offs_n
        b_s = tl.where(k_pos[None, :] <= lim[:, None], b_s, float("-inf"))
    b_m = tl.max(b_s, 1)  # [BM]
    m_safe = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_p = tl.exp2(b_s - m_safe[:, None])  # [BM, BS]
    b_l = tl.sum(b_p, 1)  # [BM]
    b_o = dot(b_p.to(PV_DT), b_v.to(PV_DT), PREC)  # [BM, BD]
    if NORM:
        # Normalized rows in V's stored units. bf16 rounding of P can lift one a hair past V's
        # largest value: the e4m3 conversion saturates at +-448.
        b_o = to_e4m3(b_o / tl.where(b_l == 0.0, 1.0, b_l)[:, None])
    elif KV_FP8:
        b_o = b_o * v_scale

    # Rows e * G + h of consecutive entries are consecutive rows of the buffer.
    o_row = e_row.to(tl.int64) * G + r_head
    p_o = po_ptr + o_row[:, None] * D + offs_d[None, :]
    tl.store(p_o, b_o.to(po_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(pm_ptr + o_row, b_m * 0.6931471805599453, mask=row_ok)
    tl.store(pl_ptr + o_row, b_l, mask=row_ok)


# Lengths and counts (core.launch: specializations): a serving step's table width follows its
# longest request, and its segment counts its rows.
@triton.jit(do_not_specialize=["stride_bt", "num_segments", "nbg", "max_blocks", "capacity_rows", "num_programs"])
def _kvouter_partials_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cu_ptr,
    kvlen_ptr,
    entry_token_ptr,
    seg_offsets_ptr,
    tile_seg_ptr,
    tile_start_ptr,
    tile_end_ptr,
    prog_tiles_ptr,
    po_ptr,
    pm_ptr,
    pl_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_ks,
    stride_vp,
    stride_vh,
    stride_vs,
    stride_bt,
    num_segments,
    nbg,
    max_blocks,
    capacity_rows,
    num_programs,
    tile_q,
    qk_scale,
    scale_ptr,
    G: tl.constexpr,
    GP: tl.constexpr,
    TQ: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
    PS: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
    FILL: tl.constexpr,
    Q_FP8: tl.constexpr,
    KV_FP8: tl.constexpr,
    WIDEN_K: tl.constexpr,
    PV_DT: tl.constexpr,
    NORM: tl.constexpr,
):
    BM: tl.constexpr = TQ * GP
    pid = tl.program_id(0)
    # Dequantization scales (q, k, v) of fp8 inputs, read on the device.
    qk_scale = fold_fp8_scales(qk_scale, scale_ptr, Q_FP8, KV_FP8)
    v_scale = 1.0
    if KV_FP8:
        v_scale = tl.load(scale_ptr + 2)
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_n = tl.arange(0, BS)
    r_tok = offs_m // GP
    r_head = offs_m % GP
    d_ok = offs_d < D

    t_lo = tl.load(prog_tiles_ptr + pid)
    t_hi = tl.load(prog_tiles_ptr + pid + 1)
    # Resident K/V: a slice holds runs of consecutive tiles of one segment (thousands of
    # tiles per segment at long prompts), so each run loads its K/V block once and
    # streams the runs' query tiles past it. The inner loop's loads (entry tokens, then
    # the gathered queries) follow from its induction variable alone, so num_stages > 1
    # can pipeline them, and the loop-invariant K/V operands stay in shared memory.
    tile = t_lo
    while tile < t_hi:
        seg = tl.load(tile_seg_ptr + tile)
        e_first = tl.load(tile_start_ptr + tile)
        seg_end = tl.load(seg_offsets_ptr + seg + 1)
        run = tl.minimum(t_hi - tile, (seg_end - e_first + tile_q - 1) // tile_q)
        g = seg // nbg
        blk, page, kv_len, pos_base = _segment_meta(
            bt_ptr, cu_ptr, kvlen_ptr, seg, run > 0, nbg, max_blocks, stride_bt, offs_n, BS, PS
        )
        b_kt, b_v = _load_kv(
            k_ptr, v_ptr, g, blk, page, kv_len,
            stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
            offs_d, offs_n, q_ptr.dtype.element_ty, D, BS, PS, WIDEN_K,
        )
        for i in range(0, run):
            e0 = e_first + i * tile_q
            e1 = tl.minimum(e0 + tile_q, seg_end)
            e_row = e0 + r_tok
            tok = tl.load(entry_token_ptr + e_row, mask=e_row < e1, other=0)
            _attend_rows(
                q_ptr, po_ptr, pm_ptr, pl_ptr, b_kt, b_v, g, blk, e0, e1, tok, kv_len, pos_base,
                stride_qt, stride_qh, qk_scale, v_scale, r_tok, r_head, offs_d, offs_n,
                G, D, BS, CAUSAL, PREC, KV_FP8, PV_DT, NORM,
            )
        tile += run

    # Unused entries (past seg_offsets[-1]) belong to no tile: the programs clear them
    # grid-strided so the buffer never holds garbage.
    used = tl.load(seg_offsets_ptr + num_segments).to(tl.int64)
    row0 = used * G
    n_rows = capacity_rows - row0
    offs_f = tl.arange(0, FILL)
    b_zero = tl.zeros([FILL, BD], dtype=po_ptr.dtype.element_ty)
    n_chunks = ((n_rows + FILL - 1) // FILL).to(tl.int32)
    for c in range(pid, n_chunks, num_programs):
        rows = row0 + c * FILL + offs_f  # c * FILL < E * G < 2^31
        ok = rows < row0 + n_rows
        tl.store(po_ptr + rows[:, None] * D + offs_d[None, :], b_zero, mask=ok[:, None] & d_ok[None, :])
        tl.store(pm_ptr + rows, tl.full([FILL], float("-inf"), tl.float32), mask=ok)
        tl.store(pl_ptr + rows, tl.zeros([FILL], tl.float32), mask=ok)


def kvouter_partials_tl(
    args: AttnArgs, index: KVOuterIndex, sched: Schedule, cfg: KVOuterConfig = DEFAULT_CONFIG
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``tl`` kernel over the schedule's tiles. Returns (partial_o [E, G, D] in
    ``args.partial_dtype``, partial_m [E, G] fp32, partial_l [E, G] fp32)."""
    why = tile_rows_reason(args, sched.tile_q)
    if why is not None:
        raise ValueError(why)
    q, k_cache, v_cache = args.q, args.k_cache, args.v_cache
    block_tables, cu_seqlens_q, used_kv_lens = contiguous(args.block_tables, args.cu_seqlens_q, args.used_kv_lens)
    group, d = args.group, args.d
    gp = group_pad(group)
    cap = index.capacity
    tq = next_pow2(max(sched.tile_q, -(-16 // gp)))
    partial_o, partial_m, partial_l = empty_partials(cap, group, d, args.partial_dtype, q.device)
    if cap == 0:
        return partial_o, partial_m, partial_l
    # An fp8 MMA reduces over at least 32 elements: pad the head dim's tile (masked) to 32.
    bd = max(32 if args.q_fp8 else 16, next_pow2(d))
    num_warps = cfg.num_warps or (4 if tq * gp <= cfg.tile_rows else 8)
    num_stages = cfg.num_stages or 1
    extra = {} if cfg.maxnreg is None or interpreting() else {"maxnreg": cfg.maxnreg}
    launch_kernel(
        _kvouter_partials_kernel, (sched.num_programs,),
        q, k_cache, v_cache, block_tables, cu_seqlens_q, used_kv_lens,
        index.entry_token, index.seg_offsets,
        sched.tile_segment, sched.tile_start, sched.tile_end, sched.program_tiles,
        partial_o, partial_m, partial_l,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        index.num_segments, index.num_global_blocks, index.max_blocks, cap * group,
        sched.num_programs, sched.tile_q,
        float(args.softmax_scale) * LOG2E,
        args.scales if args.scales is not None else partial_m,
        G=group, GP=gp, TQ=tq, D=d, BD=bd, BS=args.block_size, PS=args.page_size,
        CAUSAL=args.causal,
        PREC="ieee" if q.dtype == torch.float32 else None,
        FILL=FILL_ROWS,
        Q_FP8=args.q_fp8, KV_FP8=args.kv_fp8, WIDEN_K=args.kv_fp8 and not args.q_fp8,
        PV_DT=tl_dtype(args.out_dtype), NORM=args.normalized_partials,
        num_warps=num_warps, num_stages=num_stages, **extra,
    )
    return partial_o, partial_m, partial_l
