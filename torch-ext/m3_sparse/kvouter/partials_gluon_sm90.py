"""KV-outer partials on Hopper (sm_90) with TMA copies, written in Gluon.

Same contract and schedule as :func:`partials_triton.kvouter_partials_tl` (whose
``tl`` kernel stays the path off sm_90 and under the interpreter; the torch
``partials.kvouter_partials`` is the oracle of both).

Why a second kernel: the ``tl`` kernel gathers each tile's queries with per-thread
loads and stores its partials from registers, so every tile is a serial chain of
address math, a load round trip, two MMAs and stores, and two programs per SM are
all that hides it (docs/PERF.md, "What limited the per-tile kernel"). Here:

* a query tile is TQ boxes of ``[G, D]`` (one token's G heads of one KV head are
  contiguous rows of ``q`` viewed as ``[T * Hq, D]``), copied by TMA into a
  two-slot shared-memory ring two tiles ahead of their MMA;
* the loop is software-pipelined by one tile: P @ V of tile t and then Q K^T of tile
  t + 1 are issued asynchronously, and tile t's partials are stored while that Q K^T
  runs (a tile that starts a new run recomputes its scores after the K/V reload);
* the tile metadata runs further ahead (tokens three tiles, entry ranges four), so no
  load waits on a load of the same iteration; every thread holds a tile's tokens, so
  picking a box's token needs no cross-warp step;
* the K/V block stays in shared memory for a run of the segment's tiles (one TMA
  box per page it spans);
* the tile's partial rows ``e * G + h`` are consecutive, so a full tile leaves in one
  TMA store of ``[TQ * G, D]`` rows and a short one in one ``[G, D]`` store per entry.

fp8 (e4m3) q, K and V (with their dequantization scales): Q K^T is an fp8 MMA on the stored
values, the scales fold into the softmax scale and the output; V is widened to the output
dtype (bf16 / fp16) in shared memory once per run, so P @ V keeps P's precision. The
partials are in the output dtype, or e4m3 (``partial_dtype``): the normalized rows O / l in
V's units, staged and stored as fp8 (half the bytes; the combine applies V's scale).

A bf16 / fp16 q over e4m3 caches (a model's q over fp8 pages) widens K as well as V once
per run, so Q K^T is the MMA of q's dtype. Both fp8 blocks land in V's widened buffer,
whose bytes they fill exactly, which keeps shared memory at the bf16 kernel's size.

Supported (``unsupported_reason`` says why a call does not qualify): Triton 3.6 (the Gluon
API this kernel is written and tested against), sm_90 CUDA; bf16 / fp16 q, K, V and partials;
e4m3 q, K, V with a bf16 / fp16 output; bf16 / fp16 q over e4m3 K, V with the output in q's
dtype; with e4m3 K and V, partials in the output dtype or in e4m3; G a power of two in
[8, 64] (one tile = 64 rows = 64 / G tokens), D 64 or 128, blocks of 64 or 128 keys, pages of
at least 16; q and the caches ``[pages, Hkv, page, D]`` contiguous; metadata int32 or int64.
"""

from __future__ import annotations

import functools

import torch

from ..core.gluon import HAVE_GLUON, TESTED_TRITON, device_reason, triton_version  # noqa: F401

if HAVE_GLUON:
    from ..core.gluon import TensorDescriptor, gl, gluon, mbarrier, tma
    from ..core.gluon import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    from ..core.gluon import sync_threads as _sync_threads

from ..core.args import AttnArgs
from ..core.launch import contiguous, launch_kernel
from .build import KVOuterIndex
from .partials import empty_partials
from .schedule import Schedule

LOG2E = 1.4426950408889634
TILE_ROWS = 64
FILL_ROWS = 64
NUM_WARPS = 4


def unsupported_reason(
    q, k_cache, v_cache, block_size, out_dtype, scales, tile_q, partial_rows, partial_dtype=None
) -> str | None:
    """None when the TMA kernel runs this call, else why not (``engine="auto"`` keeps the
    ``tl`` kernel then). Shape and dtype checks come before the device ones."""
    fp8 = torch.float8_e4m3fn
    dtypes = f"{q.dtype} / {k_cache.dtype} / {v_cache.dtype}"
    kv_ok = k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, fp8)
    if q.dtype not in (torch.bfloat16, torch.float16, fp8) or not kv_ok:
        return f"needs q, K and V all bf16, all fp16 or all float8_e4m3fn, or a bf16 / fp16 q over float8_e4m3fn K and V, got {dtypes}"
    if q.dtype == fp8:
        if scales is None or out_dtype not in (torch.bfloat16, torch.float16):
            return "fp8 inputs need their scales and a bf16 or fp16 output"
    elif k_cache.dtype == fp8:
        if scales is None or (out_dtype is not None and out_dtype != q.dtype):
            return "fp8 K and V need their scales, and partials in q's dtype"
    elif scales is not None or (out_dtype is not None and out_dtype != q.dtype):
        return "partials in q's dtype, no fp8 scales"
    if partial_dtype not in (None, out_dtype) and k_cache.dtype != fp8:
        return f"{partial_dtype} partials need float8_e4m3fn K and V"
    hq, d = q.shape[1], q.shape[2]
    hkv, page = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if group < 8 or group > TILE_ROWS or group & (group - 1):
        return f"needs a power-of-two GQA group in [8, {TILE_ROWS}], got {group}"
    if tile_q > TILE_ROWS // group:
        return f"tiles of at most {TILE_ROWS // group} tokens for G = {group}, got tile_q = {tile_q}"
    if d not in (64, 128):
        return f"head dim 64 or 128, got {d}"
    if block_size not in (64, 128) or page & (page - 1) or page < 16:
        return f"blocks of 64 or 128 keys and power-of-two pages of at least 16, got block {block_size}, page {page}"
    if k_cache.shape[0] == 0:
        return "an empty page pool"
    # TMA coordinates are 32-bit rows.
    if max(partial_rows, q.shape[0] * hq, k_cache.shape[0] * hkv * page) >= 2**31:
        return "more than 2^31 rows in q, the caches or the partials"
    # q may have any strides: kvouter_partials_tma copies one that is not contiguous.
    if q.stride(-1) != 1:
        return f"q with a contiguous head dim (stride 1), got stride {q.stride(-1)}"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "contiguous caches"
    why = device_reason(q)
    if why is not None:
        return why
    if any(t.data_ptr() % 16 for t in (q, k_cache, v_cache) if t.is_contiguous()):
        return "16-byte aligned q and caches"
    return None


if HAVE_GLUON:

    @gluon.jit
    def _tile_range(tile_seg_ptr, tile_start_ptr, tile_end_ptr, tile, t_hi):
        """(segment, first entry, end entry) of a tile; an empty range past the slice."""
        live = tile < t_hi
        seg = gl.load(tile_seg_ptr + tile, mask=live, other=0).to(gl.int32)
        e0 = gl.load(tile_start_ptr + tile, mask=live, other=0).to(gl.int32)
        e1 = gl.load(tile_end_ptr + tile, mask=live, other=0).to(gl.int32)
        return seg, e0, e1

    @gluon.jit
    def _tile_tokens(entry_token_ptr, e0, e1, offs_t):
        """The tokens [TQ] of a tile's entries (0 past its end)."""
        return gl.load(entry_token_ptr + e0 + offs_t, mask=e0 + offs_t < e1, other=0).to(gl.int32)

    @gluon.jit
    def _issue_q(q_desc, q_slot, bar, seg, toks, offs_t, live, nbg, hq,
                 G: gl.constexpr, TQ: gl.constexpr, D: gl.constexpr):
        """TMA copies of a tile's TQ query boxes [G, D] into one ring slot. The boxes of absent
        entries copy token 0's queries, whose rows are never stored, so that the byte count
        the barrier expects is a constant."""
        g = seg // nbg
        mbarrier.expect(bar, TQ * G * D * q_desc.dtype.primitive_bitwidth // 8, pred=live)
        for i in gl.static_range(TQ):
            tok = gl.sum(gl.where(offs_t == i, toks, 0), axis=0)
            tma.async_copy_global_to_shared(q_desc, [tok * hq + g * G, 0], bar, q_slot.slice(i * G, G), pred=live)

    @gluon.jit
    def _stage_v(v_in, v_smem, blk, kv_len, BS: gl.constexpr, D: gl.constexpr, ot: gl.constexpr, layout: gl.constexpr,
                 ALIASED: gl.constexpr = False):
        """V block as P @ V takes it: rows past the sequence zeroed, in P @ V's dtype ``ot``.
        ``ALIASED``: ``v_in`` lies inside ``v_smem``, so every warp reads before any writes."""
        b_v = v_in.load(layout)  # [BS, D]
        v_rows = blk * BS + gl.arange(0, BS, layout=gl.SliceLayout(1, layout))
        b_v = gl.where((v_rows < kv_len)[:, None], b_v.to(ot), gl.zeros([BS, D], ot, layout))
        if ALIASED:
            _sync_threads()
        v_smem.store(b_v)
        fence_async_shared()
        _sync_threads()

    # The same lengths and counts as the tl kernel's (core.launch: specializations).
    @gluon.jit(do_not_specialize=["stride_bt", "num_segments", "nbg", "max_blocks", "capacity_rows", "num_programs"])
    def _kvouter_partials_tma_kernel(
        q_desc, k_desc, v_desc, o_desc, o1_desc,
        po_ptr, pm_ptr, pl_ptr,
        bt_ptr, cu_ptr, kvlen_ptr, entry_token_ptr, seg_offsets_ptr,
        tile_seg_ptr, tile_start_ptr, tile_end_ptr, prog_tiles_ptr,
        stride_bt, num_segments, nbg, max_blocks, capacity_rows, num_programs, hq, hkv,
        qk_scale, scale_ptr,
        G: gl.constexpr, TQ: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, PS: gl.constexpr,
        PB: gl.constexpr, CAUSAL: gl.constexpr, FILL: gl.constexpr, Q_FP8: gl.constexpr, KV_FP8: gl.constexpr,
        WIDEN_K: gl.constexpr, PV_DT: gl.constexpr, PV_LAYOUT: gl.constexpr, NORM: gl.constexpr,
    ):
        BM: gl.constexpr = TQ * G
        dt: gl.constexpr = q_desc.dtype  # q as stored, and Q K^T's operands (WIDEN_K: K widened to it)
        kvt: gl.constexpr = k_desc.dtype  # K and V as stored
        ot: gl.constexpr = o_desc.dtype  # the partials
        pid = gl.program_id(0)
        v_scale = 1.0
        if KV_FP8:
            qk_scale = qk_scale * gl.load(scale_ptr + 1)
            v_scale = gl.load(scale_ptr + 2)
        if Q_FP8:
            qk_scale = qk_scale * gl.load(scale_ptr)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BS, 256 // dt.primitive_bitwidth]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        # Every thread holds a tile's TQ tokens, so picking one for a TMA coordinate is a
        # reduction inside the thread (no shuffles, no barrier between warps).
        tok_layout: gl.constexpr = gl.BlockedLayout([TQ], [32], [4], [0])
        fill_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        v_reg_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

        # Shared memory: K and V blocks [BS, D], a two-slot query ring [2, BM, D], the output
        # staging tile [BM, D]: 112 KB at BS = D = 128 in bf16 (96 KB in fp8, with V's
        # copy as stored; 88 KB with e4m3 partials), so two programs fit on an SM. With a
        # float q over fp8 caches both fp8 blocks land in V's widened buffer, whose bytes
        # they fill exactly (112 KB, 104 KB with e4m3 partials).
        q_smem = gl.allocate_shared_memory(dt, [2, BM, D], q_desc.layout)
        v_smem = gl.allocate_shared_memory(PV_DT, [BS, D], PV_LAYOUT)
        if WIDEN_K:
            k_smem = gl.allocate_shared_memory(dt, [BS, D], q_desc.layout)
            kv_in = v_smem._reinterpret(kvt, [2 * BS, D], k_desc.layout)
            k_in = kv_in.slice(0, BS)
            v_in = kv_in.slice(BS, BS)
        else:
            k_smem = gl.allocate_shared_memory(dt, [BS, D], k_desc.layout)
            k_in = k_smem
            if KV_FP8:
                v_in = gl.allocate_shared_memory(kvt, [BS, D], v_desc.layout)
            else:
                v_in = v_smem
        o_smem = gl.allocate_shared_memory(ot, [BM, D], o_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bars.index(0), count=1)
        mbarrier.init(q_bars.index(1), count=1)
        mbarrier.init(kv_bar, count=1)
        fence_async_shared()

        offs_t = gl.arange(0, TQ, layout=tok_layout)
        offs_r = gl.arange(0, BM, layout=row_layout)
        offs_n = gl.arange(0, BS, layout=col_layout)
        r_tok = offs_r // G

        t_lo = gl.load(prog_tiles_ptr + pid)
        t_hi = gl.load(prog_tiles_ptr + pid + 1)

        # The loop is software-pipelined by one tile: iteration t runs tile t's softmax, starts
        # its P @ V and then tile t + 1's Q K^T, and stores tile t's partials while that Q K^T
        # runs; tile t + 1's scores are the loop-carried b_s. A tile that starts a new run
        # (other K/V) gets its Q K^T again, after the reload, at the top of its iteration
        # (have_s = 0), and so does the first one.
        # Queries: tile t + 2's copies are issued at the top of iteration t, into the slot
        # tile t's Q K^T has just finished with. Metadata: tokens three tiles ahead, entry
        # ranges four ahead, so no load in the loop waits on a load of the same iteration.
        a_seg, a_e0, a_e1 = _tile_range(tile_seg_ptr, tile_start_ptr, tile_end_ptr, t_lo, t_hi)
        a_toks = _tile_tokens(entry_token_ptr, a_e0, a_e1, offs_t)
        b_seg, b_e0, b_e1 = _tile_range(tile_seg_ptr, tile_start_ptr, tile_end_ptr, t_lo + 1, t_hi)
        b_toks = _tile_tokens(entry_token_ptr, b_e0, b_e1, offs_t)
        c_seg, c_e0, c_e1 = _tile_range(tile_seg_ptr, tile_start_ptr, tile_end_ptr, t_lo + 2, t_hi)
        c_toks = _tile_tokens(entry_token_ptr, c_e0, c_e1, offs_t)
        d_seg, d_e0, d_e1 = _tile_range(tile_seg_ptr, tile_start_ptr, tile_end_ptr, t_lo + 3, t_hi)
        _issue_q(q_desc, q_smem.index(0), q_bars.index(0), a_seg, a_toks, offs_t, t_lo < t_hi, nbg, hq, G, TQ, D)
        _issue_q(q_desc, q_smem.index(1), q_bars.index(1), b_seg, b_toks, offs_t, t_lo + 1 < t_hi, nbg, hq, G, TQ, D)

        cur_seg = -1
        kv_phase = 0
        blk = 0
        kv_len = 0
        pos_base = 0
        have_s = 0
        b_s = gl.zeros([BM, BS], gl.float32, s_layout)
        for t in range(t_lo, t_hi):
            j = t - t_lo
            slot = j % 2
            g = a_seg // nbg
            if have_s == 0:
                if a_seg != cur_seg:
                    # A new run: its K/V block, one box per page it spans (absent pages read
                    # page 0, their keys are masked and their values zeroed below). Every
                    # warp's MMAs on the old block have been waited for.
                    _sync_threads()
                    gb = a_seg % nbg
                    seq = gb // max_blocks
                    blk = gb - seq * max_blocks
                    # Lengths and pages may be int64 tensors; TMA coordinates are 32-bit (the
                    # launcher bounds every row index below 2^31).
                    kv_len = gl.load(kvlen_ptr + seq).to(gl.int32)
                    pos_base = kv_len - gl.load(cu_ptr + seq + 1).to(gl.int32)
                    mbarrier.expect(kv_bar, 2 * BS * D * kvt.primitive_bitwidth // 8)
                    for p in gl.static_range(BS // PB):
                        k_pos = blk * BS + p * PB
                        page = gl.load(bt_ptr + seq.to(gl.int64) * stride_bt + k_pos // PS, mask=k_pos < kv_len, other=0).to(gl.int32)
                        page = gl.where(page < 0, 0, page)
                        row = (page * hkv + g) * PS + k_pos % PS
                        tma.async_copy_global_to_shared(k_desc, [row, 0], kv_bar, k_in.slice(p * PB, PB))
                        tma.async_copy_global_to_shared(v_desc, [row, 0], kv_bar, v_in.slice(p * PB, PB))
                    mbarrier.wait(kv_bar, kv_phase)
                    kv_phase ^= 1
                    # Keys past the sequence are masked, but 0 * (stale V) must not be NaN; fp8
                    # K and V are widened once per run (e4m3 -> bf16 / fp16 is exact).
                    if WIDEN_K:
                        k_smem.store(k_in.load(v_reg_layout).to(dt))
                        _stage_v(v_in, v_smem, blk, kv_len, BS, D, PV_DT, v_reg_layout, ALIASED=True)
                    elif KV_FP8:
                        _stage_v(v_in, v_smem, blk, kv_len, BS, D, PV_DT, v_reg_layout)
                    elif blk * BS + BS > kv_len:
                        _stage_v(v_in, v_smem, blk, kv_len, BS, D, PV_DT, v_reg_layout)
                    cur_seg = a_seg
                mbarrier.wait(q_bars.index(slot), (j // 2) & 1)
                b_s = warpgroup_mma(q_smem.index(slot), k_smem.permute((1, 0)), gl.zeros([BM, BS], gl.float32, s_layout),
                                    use_acc=False)
            # Tile t's slot is free once every warp's Q K^T on it is done: tile t + 2's copies.
            _sync_threads()
            _issue_q(q_desc, q_smem.index(slot), q_bars.index(slot), c_seg, c_toks, offs_t, t + 2 < t_hi, nbg, hq, G, TQ, D)
            d_toks = _tile_tokens(entry_token_ptr, d_e0, d_e1, offs_t)
            e_seg, e_e0, e_e1 = _tile_range(tile_seg_ptr, tile_start_ptr, tile_end_ptr, t + 4, t_hi)

            b_s = b_s * qk_scale  # [BM, BS], log2 units
            n_ent = a_e1 - a_e0
            row_ok = r_tok < n_ent
            # Only a block reaching past the earliest row's last visible key needs the mask; a
            # row before the sequence's first key (negative position) sees none, causal or not.
            tok_first = gl.min(gl.where(offs_t < n_ent, a_toks, 2147483647), axis=0)
            lim_first = kv_len - 1
            if CAUSAL:
                lim_first = gl.minimum(pos_base + tok_first, kv_len - 1)
            lim_first = gl.where(pos_base + tok_first >= 0, lim_first, -1)
            if blk * BS + BS - 1 > lim_first:
                tok_r = gl.load(entry_token_ptr + a_e0 + r_tok, mask=row_ok, other=0).to(gl.int32)  # [BM]
                row_pos = pos_base + tok_r
                if CAUSAL:
                    lim = gl.minimum(row_pos, kv_len - 1)
                else:
                    lim = gl.zeros_like(row_pos) + (kv_len - 1)
                lim = gl.where(row_ok & (row_pos >= 0), lim, -1)
                k_pos = blk * BS + offs_n
                b_s = gl.where(k_pos[None, :] <= lim[:, None], b_s, float("-inf"))
            b_m = gl.max(b_s, axis=1)  # [BM]
            m_safe = gl.where(b_m == float("-inf"), 0.0, b_m)
            b_p = gl.exp2(b_s - m_safe[:, None])  # [BM, BS]
            b_l = gl.sum(b_p, axis=1)  # [BM]
            p_op = gl.convert_layout(b_p.to(PV_DT), p_layout)
            o_acc = warpgroup_mma(p_op, v_smem, gl.zeros([BM, D], gl.float32, o_layout), use_acc=False, is_async=True)
            # Tile t + 1's scores on the resident K. When tile t + 1 starts a new run (or there
            # is none) they are discarded and its iteration recomputes them; with no tile
            # t + 1 the slot holds no copy in flight and nothing is waited for. (Skipping the
            # discarded product needs a branch around the asynchronous MMA, which made the
            # compiler spill; it runs beside the tile's stores and the next run's K/V load.)
            nslot = (j + 1) % 2
            mbarrier.wait(q_bars.index(nslot), ((j + 1) // 2) & 1, pred=t + 1 < t_hi)
            s_acc = warpgroup_mma(q_smem.index(nslot), k_smem.permute((1, 0)), gl.zeros([BM, BS], gl.float32, s_layout),
                                  use_acc=False, is_async=True)
            b_o, p_op = warpgroup_mma_wait(1, deps=[o_acc, p_op])  # [BM, D]; P @ V done, Q K^T may run
            if NORM:
                # O / l in V's units. bf16 rounding of P can lift a row a hair past V's largest
                # value; the e4m3 conversion saturates at +-448 (cvt.rn.satfinite), so no clamp.
                inv_l = gl.convert_layout(1.0 / gl.where(b_l == 0.0, 1.0, b_l), gl.SliceLayout(1, o_layout))
                b_o = b_o * inv_l[:, None]
            elif KV_FP8:
                b_o = b_o * v_scale

            tma.store_wait(0)
            _sync_threads()
            o_smem.store(b_o.to(ot))
            fence_async_shared()
            _sync_threads()
            if n_ent == TQ:
                tma.async_copy_shared_to_global(o_desc, [a_e0 * G, 0], o_smem)
            else:
                for i in gl.static_range(TQ):
                    if i < n_ent:
                        tma.async_copy_shared_to_global(o1_desc, [(a_e0 + i) * G, 0], o_smem.slice(i * G, G))
            # The row stats once the partials' store is on its way (the staging fence does not
            # order them). Rows e * G + h of the tile's entries are rows a_e0 * G + r.
            o_row = a_e0.to(gl.int64) * G + offs_r
            gl.store(pm_ptr + o_row, b_m * 0.6931471805599453, mask=row_ok)
            gl.store(pl_ptr + o_row, b_l, mask=row_ok)
            b_s = warpgroup_mma_wait(0, deps=[s_acc])
            have_s = ((t + 1 < t_hi) & (b_seg == cur_seg)).to(gl.int32)

            a_seg, a_e0, a_e1, a_toks = b_seg, b_e0, b_e1, b_toks
            b_seg, b_e0, b_e1, b_toks = c_seg, c_e0, c_e1, c_toks
            c_seg, c_e0, c_e1, c_toks = d_seg, d_e0, d_e1, d_toks
            d_seg, d_e0, d_e1 = e_seg, e_e0, e_e1
        tma.store_wait(0)
        mbarrier.invalidate(q_bars.index(0))
        mbarrier.invalidate(q_bars.index(1))
        mbarrier.invalidate(kv_bar)

        # Unused entries (past seg_offsets[-1]) belong to no tile: cleared grid-strided.
        used = gl.load(seg_offsets_ptr + num_segments).to(gl.int64)
        row0 = used * G
        n_rows = capacity_rows - row0
        offs_f = gl.arange(0, FILL, layout=gl.SliceLayout(1, fill_layout))
        offs_fd = gl.arange(0, D, layout=gl.SliceLayout(0, fill_layout))
        offs_f1 = gl.arange(0, FILL, layout=vec_layout)
        b_zero = gl.zeros([FILL, D], ot, fill_layout)
        n_chunks = ((n_rows + FILL - 1) // FILL).to(gl.int32)
        for c in range(pid, n_chunks, num_programs):
            rows = row0 + c * FILL + offs_f
            gl.store(po_ptr + rows[:, None] * D + offs_fd[None, :], b_zero, mask=(rows < capacity_rows)[:, None])
            rows1 = row0 + c * FILL + offs_f1
            ok1 = rows1 < capacity_rows
            gl.store(pm_ptr + rows1, gl.full([FILL], float("-inf"), gl.float32, vec_layout), mask=ok1)
            gl.store(pl_ptr + rows1, gl.zeros([FILL], gl.float32, vec_layout), mask=ok1)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16} if HAVE_GLUON else {}


@functools.lru_cache(maxsize=None)
def _smem_layout(dtype: torch.dtype, d: int):
    # The widest swizzle a row of D elements fills (64-byte rows: D = 64 in fp8).
    bits = torch.finfo(dtype).bits
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, d * bits // 8), element_bitwidth=bits, rank=2)


def kvouter_partials_tma(args: AttnArgs, index: KVOuterIndex, sched: Schedule) -> tuple[torch.Tensor, ...]:
    """The partials of ``partials_triton.kvouter_partials_tl`` on a call that
    ``unsupported_reason`` accepts (the caller checked it)."""
    q, k_cache, v_cache, scales = args.q, args.k_cache, args.v_cache, args.scales
    block_size, causal, softmax_scale = args.block_size, args.causal, args.softmax_scale
    out_dtype, partial_dtype = args.out_dtype, args.partial_dtype
    block_tables, cu_seqlens_q, used_kv_lens = contiguous(args.block_tables, args.cu_seqlens_q, args.used_kv_lens)
    num_tokens, hq, d = q.shape
    num_pages, hkv, page_size, _ = k_cache.shape
    group = hq // hkv
    tq = TILE_ROWS // group
    cap = index.capacity
    q_fp8, kv_fp8 = args.q_fp8, args.kv_fp8
    partial_o, partial_m, partial_l = empty_partials(cap, group, d, partial_dtype, q.device)
    if cap == 0:
        return partial_o, partial_m, partial_l
    layout, kv_layout, o_layout = _smem_layout(q.dtype, d), _smem_layout(k_cache.dtype, d), _smem_layout(partial_dtype, d)
    pb = min(block_size, page_size)
    # The q descriptor reads a (token, kv head)'s G query heads as G consecutive rows. A model's
    # batch-1 q is a transposed view ([T, Hq, D], heads T*D apart), copied here; a long
    # prompt's KV-outer runs in query slices, so the copy holds one slice's rows.
    q2 = q.contiguous().view(num_tokens * hq, d)
    k2 = k_cache.view(num_pages * hkv * page_size, d)
    v2 = v_cache.view(num_pages * hkv * page_size, d)
    o2 = partial_o.view(cap * group, d)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [group, d], layout)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [pb, d], kv_layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [pb, d], kv_layout)
    o_desc = TensorDescriptor(o2, list(o2.shape), list(o2.stride()), [tq * group, d], o_layout)
    o1_desc = TensorDescriptor(o2, list(o2.shape), list(o2.stride()), [group, d], o_layout)
    launch_kernel(
        _kvouter_partials_tma_kernel, (sched.num_programs,), q_desc, k_desc, v_desc, o_desc, o1_desc,
        partial_o, partial_m, partial_l,
        block_tables, cu_seqlens_q, used_kv_lens, index.entry_token, index.seg_offsets,
        sched.tile_segment, sched.tile_start, sched.tile_end, sched.program_tiles,
        block_tables.stride(0), index.num_segments, index.num_global_blocks, index.max_blocks,
        cap * group, sched.num_programs, hq, hkv,
        float(softmax_scale) * LOG2E, scales if kv_fp8 else partial_m,
        G=group, TQ=tq, D=d, BS=block_size, PS=page_size, PB=pb, CAUSAL=bool(causal), FILL=FILL_ROWS,
        Q_FP8=q_fp8, KV_FP8=kv_fp8, WIDEN_K=kv_fp8 and not q_fp8,
        PV_DT=_GL_DTYPES[out_dtype], PV_LAYOUT=_smem_layout(out_dtype, d), NORM=partial_dtype != out_dtype,
        num_warps=NUM_WARPS,
    )
    return partial_o, partial_m, partial_l

