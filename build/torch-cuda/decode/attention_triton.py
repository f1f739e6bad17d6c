"""Triton sparse decode attention: query-outer, the selected blocks split over programs.

Same contract as :func:`api.sparse_decode_attention` (and
``kvouter_attention``): ``out [Tq, Hq, D]`` in q's dtype, ``lse [Hq, Tq]`` fp32 or
None; a query that sees no key gets zeros and lse = -inf.

KV-outer loads each selected block once for every query that chose it, which pays
off when many queries share blocks (prefill). In decode a sequence has 1..16 new
tokens, so there is little to share and the index build, schedule and partial
traffic of KV-outer cost more than they save. Here each program owns one
(token, kv head, split):

* the G query heads of the token that share kv head ``g`` are the rows of one tile
  (padded to at least 16 rows, the smallest MMA M), so a K/V chunk is read once for
  the whole group;
* the token's selected ids are read as one vector; empty slots (-1), blocks wholly
  past the token's last visible key and repeated ids (a slot equal to an earlier
  slot) are dropped;
* the work is the chunks of BN keys of the kept blocks that hold a visible key,
  numbered in slot order; split ``s`` of ``S`` takes an equal contiguous share,
  counted on the device, so the splits stay balanced whatever the number of empty
  slots and the position inside the local block;
* each chunk is read straight from the paged cache through the block table: when a
  chunk fits in a page, all the table entries the program needs are read before
  its loop (so no load in the loop waits on another load), else one entry per key;
* online softmax in base 2 with fp32 accumulation; only keys past the token's
  limit (its position when causal, the kv length otherwise) are masked.

With one split the program writes the normalised output and lse itself. With
several it writes its raw (m, l, o) in fp32 to a workspace ``[Tq * Hkv * S, G]``,
and the splits are merged by their max: ``M = max m_s``, ``a_s = 2^(m_s - M)``,
``out = sum a_s o_s / sum a_s l_s``. By default the split that finishes last for
its (token, kv head) (an arrival count per pair) does the merge in the same launch;
``fused_merge=False`` leaves it to ``core.split_merge``, a second launch.

The split count comes from shapes only (enough programs to cover the GPU a few
times over); no device value is read on the host, so a call can be captured in a
CUDA graph.

**Short rows of a mixed call** (``rows_per_seq``): a step that mixes prefill chunks with
decode rows runs KV-outer for the chunks, and this kernel for the sequences of at most
``R`` query rows, writing into KV-outer's outputs. The grid's first axis is then
``(sequence, row)`` pairs, ``B * R`` of them, rather than the tokens: a program knows its
sequence without a search, and the prefill rows cost no program at all. A program whose
sequence has more than ``R`` rows, or fewer than its row, writes nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ..core.args import AttnArgs
from ..core.interpreter import dot
from ..core.launch import StreamBuffers, contiguous, launch_kernel, next_pow2, seq_vector, tl_dtype
from ..core.online_softmax import fold_fp8_scales, online_softmax_step
from ..core.split_merge import merge_splits, split_workspaces
from ..core.validate import attention_args, value_checks_enabled
from .plan import DEFAULT_CONFIG, DecodeConfig, plan, shape_reason

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "stride_bt"])  # counts, a width (core.launch: specializations)
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    sel_ptr,
    bt_ptr,
    cu_ptr,
    kvlen_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    lse_ptr,
    cnt_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_ks,
    stride_vp,
    stride_vh,
    stride_vs,
    stride_st,
    stride_sg,
    stride_sk,
    stride_bt,
    stride_ot,
    stride_oh,
    num_tokens,
    num_seqs,
    topk,
    table_keys,
    qk_scale,
    scale_ptr,
    G: tl.constexpr,
    RP: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
    PS: tl.constexpr,
    TOPK_P2: tl.constexpr,
    CAUSAL: tl.constexpr,
    FINAL: tl.constexpr,
    MERGE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    SEQ_CHUNK: tl.constexpr,
    SEQ_STEPS: tl.constexpr,
    ROWS: tl.constexpr,
    PREC: tl.constexpr,
    Q_FP8: tl.constexpr,
    KV_FP8: tl.constexpr,
    WIDEN_K: tl.constexpr,
    PV_DT: tl.constexpr,
):
    """One (token, kv head, split), or with ROWS > 0 one (sequence, row, kv head, split).
    FINAL (a single split): ``o_ptr`` is the output and ``m_ptr`` the lse [Hq, Tq]; else
    o/m/l are the split workspace, and with MERGE the split that finishes last for its
    (token, kv head) merges all of them into ``out_ptr`` / ``lse_ptr`` (``cnt_ptr``: int32
    arrival counts, one per program of the first two grid axes, zero on entry; the merging
    split sets its pair's count back to zero).
    fp8 inputs: the q and k scales fold into qk_scale, V is widened to PV_DT (the
    output dtype) for P @ V. Workspace rows and arrival counts are numbered by the grid's
    first axis (the token, or the (sequence, row) pair)."""
    CPB: tl.constexpr = BS // BN  # key chunks per block
    ONE_PAGE: tl.constexpr = BN <= PS  # a chunk never straddles pages (both powers of two)
    PPB: tl.constexpr = BS // PS if BS > PS else 1  # pages per block
    w = tl.program_id(0)  # the workspace's and the arrival counts' row
    g = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    qk_scale = fold_fp8_scales(qk_scale, scale_ptr, Q_FP8, KV_FP8)

    if ROWS > 0:
        # Row w % ROWS of sequence w // ROWS, live if that sequence has at most ROWS rows
        # (else KV-outer owns them) and at least this one.
        seq = w // ROWS
        q_lo = tl.load(cu_ptr + seq).to(tl.int32)
        q_hi = tl.load(cu_ptr + seq + 1).to(tl.int32)
        t = q_lo + w % ROWS
        live = (q_hi - q_lo <= ROWS) & (t < q_hi)
        # A program that is not live reads no selection slot (so it has no key chunk to load)
        # and no head row: every load of q and store of a result is masked by the rows.
        # (Counts rather than a mask and-ed with `live`: the interpreter widens that to int32.)
        n_slots = tl.where(live, topk, 0)
        n_rows = tl.where(live, G, 0)
    else:
        # The sequence of token t = how many sequence ends cu[1..B] are <= t. Counted over
        # whole vectors of cu (one load for a decode batch) rather than a binary search,
        # whose log2(B) dependent loads would each wait a full memory latency. Unrolled: a
        # runtime loop here keeps Triton from pipelining the main loop's loads.
        t = w
        offs_b = tl.arange(0, SEQ_CHUNK)
        seq = t * 0
        for i in tl.static_range(SEQ_STEPS):
            b_i = i * SEQ_CHUNK + offs_b
            b_end = tl.load(cu_ptr + 1 + b_i, mask=b_i < num_seqs, other=2147483647)
            seq += tl.sum((b_end <= t).to(tl.int32), 0)
        q_hi = tl.load(cu_ptr + seq + 1).to(tl.int32)
        n_slots = topk
        n_rows = G
    kv_len = tl.load(kvlen_ptr + seq).to(tl.int32)
    # Queries are the last tokens of their sequence: position = kv_len - q_end + t.
    pos = kv_len - q_hi + t
    if CAUSAL:
        lim = tl.minimum(pos, kv_len - 1)
    else:
        lim = kv_len - 1
    # Last visible key; a token before its sequence's first key sees nothing.
    lim = tl.where(pos >= 0, lim, -1)

    offs_k = tl.arange(0, TOPK_P2)
    p_sel = sel_ptr + t.to(tl.int64) * stride_st + g * stride_sg + offs_k * stride_sk
    b_ids = tl.load(p_sel, mask=offs_k < n_slots, other=-1).to(tl.int32)  # [TOPK_P2]
    b_ok = (b_ids >= 0) & (b_ids * BS <= lim)
    # A repeated id counts once: only its first slot is kept.
    b_same = (b_ids[:, None] == b_ids[None, :]) & (offs_k[None, :] < offs_k[:, None])  # [TOPK_P2, TOPK_P2]
    b_ok = b_ok & (tl.max(b_same.to(tl.int32), 1) == 0)
    # Key chunks of each kept block that hold a visible key (the local block's tail
    # past the position holds none), numbered in slot order: slot k owns chunks
    # [b_c0[k], b_c0[k] + b_nch[k]).
    b_nch = tl.where(b_ok, tl.minimum((lim - b_ids * BS) // BN + 1, CPB), 0)  # [TOPK_P2]
    b_c0 = tl.cumsum(b_nch, 0) - b_nch
    n_units = tl.sum(b_nch, 0)
    per_split = (n_units + num_splits - 1) // num_splits
    u_lo = split * per_split
    u_hi = tl.minimum(u_lo + per_split, n_units)

    offs_r = tl.arange(0, RP)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    row_ok = offs_r < n_rows
    head = g * G + offs_r
    p_q = q_ptr + t.to(tl.int64) * stride_qt + head.to(tl.int64)[:, None] * stride_qh + offs_d[None, :]
    b_q = tl.load(p_q, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [RP, BD]

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if ONE_PAGE:
        # Every table entry the loop needs, read up front: [slot, page of the block].
        # The loop then issues no load whose address waits on another load. The mask
        # only keeps the reads inside the table row, so these loads wait on the
        # selections and the sequence but not on its kv length (one memory latency
        # less before the first K/V bytes); entries of pages past the last visible
        # key may hold anything and are never used to address K/V.
        offs_p = tl.arange(0, PPB)
        b_first = b_ids[:, None] * BS + offs_p[None, :] * PS  # [TOPK_P2, PPB] first key of each page
        # (The id bound first, so that b_first cannot overflow for an id far out of range.)
        b_in = (b_ids >= 0) & (b_ids < (table_keys + BS - 1) // BS)  # [TOPK_P2]
        b_pages = tl.load(bt_row + b_first // PS, mask=b_in[:, None] & (b_first < table_keys), other=0)
    k_head = k_ptr + g.to(tl.int64) * stride_kh
    v_head = v_ptr + g.to(tl.int64) * stride_vh
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, BD], tl.float32)
    for u in range(u_lo, u_hi):
        b_this = (u >= b_c0) & (u < b_c0 + b_nch)  # [TOPK_P2] the slot that owns chunk u
        blk = tl.max(tl.where(b_this, b_ids, -1), 0)
        c = u - tl.max(tl.where(b_this, b_c0, 0), 0)  # chunk within the block
        n0 = blk * BS + c * BN
        k_pos = n0 + offs_n
        k_ok = k_pos <= lim
        if ONE_PAGE:
            b_pick = b_this[:, None] & (offs_p[None, :] == (c * BN) // PS)  # [TOPK_P2, PPB]
            page = tl.max(tl.max(tl.where(b_pick, b_pages, 0), 1), 0).to(tl.int64)
        else:
            # A chunk spans pages: one table entry per key.
            page = tl.load(bt_row + k_pos // PS, mask=k_ok, other=0).to(tl.int64)  # [BN]
        slot = (k_pos % PS).to(tl.int64)
        off_k = page * stride_kp + slot * stride_ks  # [BN]
        off_v = page * stride_vp + slot * stride_vs  # [BN]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        b_k = tl.load(k_head + off_k[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
        b_v = tl.load(v_head + off_v[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
        if WIDEN_K:
            b_k = b_k.to(b_q.dtype)  # fp8 keys against a float q
        b_s = dot(b_q, tl.trans(b_k), PREC) * qk_scale  # [RP, BN], log2 units
        b_s = tl.where(k_ok[None, :], b_s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, b_s, b_v, PREC, PV_DT)
    if KV_FP8:
        acc = acc * tl.load(scale_ptr + 2)

    if FINAL:
        empty = l_i == 0.0
        b_o = acc / tl.where(empty, 1.0, l_i)[:, None]  # [RP, BD]
        p_o = o_ptr + t.to(tl.int64) * stride_ot + head.to(tl.int64)[:, None] * stride_oh + offs_d[None, :]
        tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if RETURN_LSE:
            b_lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
            tl.store(m_ptr + head.to(tl.int64) * num_tokens + t, b_lse, mask=row_ok)
    else:
        # Workspace rows ((w * Hkv + g) * S + split) * G + r: one contiguous G x D run.
        pair = w.to(tl.int64) * tl.num_programs(1) + g
        ws_row = (pair * num_splits + split) * G + offs_r
        tl.store(o_ptr + ws_row[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(m_ptr + ws_row, m_i, mask=row_ok)
        tl.store(l_ptr + ws_row, l_i, mask=row_ok)
        if MERGE:
            # Replaces the merge kernel. The barrier orders every thread's stores
            # before the release of the count; the split that sees
            # S - 1 earlier arrivals reads all S partials back (past L1: they were
            # written on other SMs) in split order, so the result does not depend on
            # which split came last.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                row0 = pair * num_splits * G + offs_r  # [RP]
                b_mx = tl.full([RP], float("-inf"), tl.float32)
                for s in range(num_splits):
                    b_m = tl.load(m_ptr + row0 + s * G, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                    b_mx = tl.maximum(b_mx, b_m)
                empty = b_mx == float("-inf")
                m_safe = tl.where(empty, 0.0, b_mx)
                b_l = tl.zeros([RP], tl.float32)
                b_acc = tl.zeros([RP, BD], tl.float32)
                for s in range(num_splits):
                    row = row0 + s * G
                    b_m = tl.load(m_ptr + row, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                    b_ls = tl.load(l_ptr + row, mask=row_ok, other=0.0, cache_modifier=".cg")
                    b_o = tl.load(
                        o_ptr + row[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0,
                        cache_modifier=".cg",
                    )  # [RP, BD]
                    b_a = tl.exp2(b_m - m_safe)  # [RP]; 0 for a split that saw no key
                    b_l += b_a * b_ls
                    b_acc += b_a[:, None] * b_o
                b_out = b_acc / tl.where(empty, 1.0, b_l)[:, None]
                p_out = out_ptr + t.to(tl.int64) * stride_ot + head.to(tl.int64)[:, None] * stride_oh + offs_d[None, :]
                tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
                if RETURN_LSE:
                    b_lse = tl.where(
                        empty, float("-inf"), (b_mx + tl.log2(tl.where(empty, 1.0, b_l))) * 0.6931471805599453
                    )
                    tl.store(lse_ptr + head.to(tl.int64) * num_tokens + t, b_lse, mask=row_ok)
                # Every split of the pair has arrived: the count can start the next
                # launch at zero, so a caller may keep one count buffer for all calls.
                tl.store(cnt_ptr + pair, 0)


def run_decode_triton(args: AttnArgs, cfg: DecodeConfig = DEFAULT_CONFIG, arrival_counts=None):
    """The decode kernels on a checked call. Returns (out [Tq, Hq, D], lse [Hq, Tq] or None).

    ``arrival_counts``: an int32 buffer of at least ``Tq * Hkv`` zeros on q's device that
    the in-place merge uses instead of zeroing a new one per call (one memset less in a
    captured step); the kernel leaves it zero again. Calls that share it must run in
    stream order."""
    return DecodeLaunch(args, cfg).run(args.q, args.k_cache, args.v_cache, args.selected, arrival_counts)


class DecodeLaunch:
    """The decode kernel's launch for one checked call, planned once (split count, tiles,
    the kernel's constants, the metadata as the kernel reads it). :meth:`run` launches it
    for tensors of the call's shapes, strides and dtypes: a decode step's sparse layers
    make the same call on their own pools, queries and selections.

    ``rows_per_seq`` (``R`` > 0): only the rows of sequences of at most ``R`` query rows
    are computed, written into the outputs :meth:`run` is given; the other rows keep what
    those held (the short rows of a mixed call, see the module docstring)."""

    def __init__(self, args: AttnArgs, cfg: DecodeConfig = DEFAULT_CONFIG, rows_per_seq: int = 0):
        why = shape_reason(args)
        if why is not None:
            raise ValueError(why)
        if rows_per_seq < 0:
            raise ValueError(f"rows_per_seq: expected >= 0 (0: every row), got {rows_per_seq}")
        self.args = args
        self.rows_per_seq = rows_per_seq
        self.block_tables, self.cu_seqlens_q, self.used_kv_lens = contiguous(
            args.block_tables, args.cu_seqlens_q, args.used_kv_lens
        )
        num_tokens, batch, topk = args.num_tokens, args.batch, args.selected.shape[2]
        self.empty = num_tokens == 0 or batch == 0 or topk == 0
        if self.empty:
            return
        # Programs of the grid's first axis: the tokens, or (sequence, row) pairs. With
        # short rows the splits are sized for one row per sequence (a decode step's).
        programs = batch * rows_per_seq if rows_per_seq else num_tokens
        p = plan(args, cfg, rows=batch if rows_per_seq else None)
        if rows_per_seq and not p.final:
            # The merge kernel finds a workspace row's token from its number, which here
            # counts (sequence, row) pairs: the splits merge in the launch instead.
            p = dataclasses.replace(p, merge=True)
        self.plan = p
        self.grid = (programs, args.hkv, p.num_splits)
        self.pairs = programs * args.hkv
        self.ws_rows = self.pairs * p.num_splits * args.group
        seq_chunk, seq_steps = seq_vector(batch)
        self.ints = (num_tokens, batch, topk, self.block_tables.shape[1] * args.page_size)
        self.scale = float(args.softmax_scale) * LOG2E
        self.constants = dict(
            G=args.group, RP=p.rp, D=args.d, BD=p.bd, BS=args.block_size, BN=p.bn, PS=args.page_size,
            TOPK_P2=max(2, next_pow2(topk)),
            CAUSAL=args.causal, FINAL=p.final, MERGE=p.merge, RETURN_LSE=args.return_lse,
            SEQ_CHUNK=seq_chunk, SEQ_STEPS=seq_steps, ROWS=rows_per_seq,
            PREC="ieee" if args.q.dtype == torch.float32 else None,
            Q_FP8=args.q_fp8, KV_FP8=args.kv_fp8, WIDEN_K=args.kv_fp8 and not args.q_fp8,
            PV_DT=tl_dtype(args.out_dtype),
            num_warps=p.num_warps, num_stages=p.num_stages,
        )
        if not p.final:
            # Made from plain values: a launch an op call drops frees them at once (StreamBuffers).
            self.scratch = StreamBuffers(functools.partial(split_workspaces, self.ws_rows, args.d))
            if p.merge:  # zeros, which every launch leaves zero
                self.counts = StreamBuffers(functools.partial(_zero_counts, self.pairs))

    def run(self, q, k_cache, v_cache, selected, arrival_counts=None, out=None, lse=None):
        """(out, lse) of the planned call with these tensors (the caller's shapes, strides and
        dtypes are the planned call's: ``api.PlannedAttention`` checks them). ``out`` /
        ``lse``: outputs to write into (the call's shapes and dtypes, ``lse`` only if the
        call returns it), else new ones; a launch with ``rows_per_seq`` needs them."""
        args = self.args
        if out is None:
            if self.rows_per_seq:
                raise ValueError("a decode launch of short rows writes into given outputs: pass out (and lse)")
            out, lse = args.new_outputs(no_keys=args.selected.shape[2] == 0)
        if self.empty:
            return out, lse
        p, device = self.plan, q.device
        if arrival_counts is not None:
            arrival_counts = _check_counts(arrival_counts, self.pairs, device)
        counts = None
        if p.final:
            o_buf, m_buf, l_buf = out, (lse if lse is not None else out), out
        else:
            o_buf, m_buf, l_buf = self.scratch.get(device)
            if p.merge:
                counts = arrival_counts if arrival_counts is not None else self.counts.get(device)
        block_tables = self.block_tables
        launch_kernel(
            _decode_split_kernel, self.grid,
            q, k_cache, v_cache, selected, block_tables, self.cu_seqlens_q, self.used_kv_lens,
            o_buf, m_buf, l_buf, out,
            lse if lse is not None else out,
            counts if counts is not None else m_buf,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            selected.stride(0), selected.stride(1), selected.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            *self.ints,
            self.scale,
            args.scales if args.scales is not None else l_buf,
            **self.constants,
        )
        if not p.final and not p.merge:
            merge_splits(o_buf, m_buf, l_buf, out, lse, p.num_splits, args.group)
        return out, lse


def _zero_counts(n: int, device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


def _check_counts(counts, needed: int, device) -> torch.Tensor:
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32:
        raise ValueError(f"arrival_counts: expected an int32 tensor, got {getattr(counts, 'dtype', type(counts))}")
    if counts.device != device:
        raise ValueError(f"arrival_counts: expected a tensor on {device}, got {counts.device}")
    if not counts.is_contiguous() or counts.numel() < needed:
        raise ValueError(
            f"arrival_counts: expected a contiguous tensor of at least {needed} elements (tokens x kv heads), "
            f"got shape {tuple(counts.shape)}"
        )
    if value_checks_enabled(counts) and bool(counts[:needed].any()):
        # A count left nonzero would make a pair merge early (on unwritten partials) or never.
        raise ValueError("arrival_counts: expected zeros (each launch leaves them zero), got nonzero counts")
    return counts


def sparse_decode_attention_triton(
    q, k_cache, v_cache, selected, block_tables, *, cu_seqlens_q, used_kv_lens, softmax_scale=None, causal=True,
    page_size=None, block_size=128, return_lse=False, config: DecodeConfig = DEFAULT_CONFIG, arrival_counts=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sparse_decode_attention`` on the Triton kernel whatever the device (the interpreter
    on the CPU), float inputs, with the launch choices of ``config`` (kernel tests)."""
    args = attention_args(
        q, k_cache, v_cache, block_tables, cu_seqlens_q=cu_seqlens_q, used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, page_size=page_size, selected=selected,
        block_size=block_size, allow_fp8=False,
    )
    return run_decode_triton(args, config, arrival_counts)
