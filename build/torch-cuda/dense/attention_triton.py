"""Triton dense attention over the paged K/V cache (FlashAttention-style forward), and
M3's sparse attention on the same tiles (query-outer over each tile's selected blocks).

Same contract as :func:`attention.dense_paged_attention_torch` (that torch
version is the oracle): ``out [Tq, Hq, D]`` in q's dtype, ``lse [Hq, Tq]`` fp32 or
None; a row that sees no key (negative position, or an empty cache) gives zeros and
an lse of -inf.

One program per (query tile of one sequence, kv head):

* GQA head packing: row ``i * GP + h`` of the tile is head ``g * G + h`` of the
  tile's i-th token (GP = G rounded up to a power of two), so the G query heads
  sharing kv head ``g`` read each K/V tile once;
* keys stream in tiles of BLOCK_N through the block table, one table entry per key,
  so BLOCK_N may be smaller than a page (several tiles per page) or larger (one tile
  spans several pages) without a special case. Where a key tile lies inside one page
  (``page_size % BLOCK_N == 0``, contiguous caches, D a power of two; sm_90 and newer),
  it is instead one TMA box of the caches seen as ``[pages * Hkv * page_size, D]``: the
  copy engine moves the whole tile on one table read, which took M3's prefill at 128K
  from 1.28x to 1.07x of cuDNN's time on the H200 (docs/PERF.md, "Dense paged
  attention"). A box also brings in a page's slots past the sequence end, which may
  hold anything: masked scores drop their keys and their V rows are zeroed;
* online softmax in base 2, fp32 accumulation; only key tiles past the tile's
  smallest visible limit pay for the per-row mask.

**Sparse calls** (``SPARSE``, :func:`api.qouter_attention`): the same tiles run M3's
block-sparse attention query-outer. A tile's tokens are neighbours, and neighbouring
queries mostly choose the same blocks, so the program walks the union of its tokens'
selected blocks (each once: empty slots, repeated ids and blocks past the tile's last
visible key dropped) instead of every key; a row keeps a block's keys only if its own
token chose the block, up to its causal limit. Nothing leaves the program but the output:
no partials go through memory, as they do in KV-outer, at the price of the work the union
adds over each row's own blocks (none when the tile's tokens agree; when they share
nothing, as much as the dense kernel's over the tile's history, which bounds it). Key tiles
divide the block size, so a tile lies in one block. The splits (below) share out the
union's blocks.

The grid is sized from host-known shapes: sequence ``b``'s tiles are numbered from
``cu_seqlens_q[b] // TM + b``, which never overlaps the next sequence's numbering,
so ``Tq // TM + B`` programs cover every tile; a program finds its sequence by a
binary search over ``cu_seqlens_q`` on the device and leaves if its tile holds no
row. Nothing is read back to the host.

Decode batches have few tiles (one token each), too few programs to keep every SM
reading keys: the keys are then split over a third grid axis. Split ``s`` of ``S`` takes
an equal contiguous share of the tile's key tiles (counted on the device from its
limit), writes its raw (m, l, o) to an fp32 workspace in the layout of the decode
kernel's splits, and ``core.split_merge.merge_splits`` merges them by their max.
``S`` comes from shapes only (``default_num_splits``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..core.args import AttnArgs
from ..core.interpreter import dot
from ..core.launch import (
    StreamBuffers, contiguous, device_capability, device_index, interpreting, launch_kernel, next_pow2, seq_vector,
    tl_dtype,
)
from ..core.online_softmax import fold_fp8_scales, online_softmax_step
from ..core.split_merge import merge_splits, split_workspaces
from ..core.validate import attention_args
from .plan import DEFAULT_CONFIG, DenseConfig, plan, shape_reason

try:  # host-side tensor descriptors (the TMA path); older Triton releases keep gathered loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None

LOG2E = 1.4426950408889634



@triton.jit
def attend_key_tile(
    acc, m_i, l_i, b_q, k_ptr, v_ptr, bt_row_ptr, start_n, hi, lim, kv_head_off_k, kv_head_off_v,
    stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, offs_n, offs_d, d_ok,
    BN: tl.constexpr, PS: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, WIDEN_K: tl.constexpr,
    PV_DT: tl.constexpr, k_desc, v_desc, kv_head, HKV: tl.constexpr, TMA: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BN)."""
    k_pos = start_n + offs_n
    if TMA:
        # The tile lies in one page (PS % BN == 0) and start_n < hi, so its table entry is real.
        page = tl.load(bt_row_ptr + start_n // PS)
        # Tables and lengths may be int64 tensors; TMA coordinates are 32-bit, and the
        # launcher checked that every cache row has an int32 index.
        row = ((page * HKV + kv_head) * PS + start_n % PS).to(tl.int32)
        b_k = k_desc.load([row, 0])  # [BN, BD]
        b_v = v_desc.load([row, 0])  # [BN, BD]
        if MASK:
            # Slots at or past `hi` in the tile's page may hold anything (NaN too): 0 * NaN.
            b_v = tl.where((k_pos < hi)[:, None], b_v, 0.0)
    else:
        if MASK:
            # Keys at or past `hi` may sit behind table entries that hold garbage.
            k_ok = k_pos < hi
            page = tl.load(bt_row_ptr + k_pos // PS, mask=k_ok, other=0).to(tl.int64)
            kv_mask = k_ok[:, None] & d_ok[None, :]
        else:
            page = tl.load(bt_row_ptr + k_pos // PS).to(tl.int64)
            kv_mask = d_ok[None, :]
        slot = (k_pos % PS).to(tl.int64)
        p_k = k_ptr + (page * stride_kp + kv_head_off_k + slot * stride_ks)[:, None] + offs_d[None, :]
        p_v = v_ptr + (page * stride_vp + kv_head_off_v + slot * stride_vs)[:, None] + offs_d[None, :]
        b_k = tl.load(p_k, mask=kv_mask, other=0.0)  # [BN, BD]
        b_v = tl.load(p_v, mask=kv_mask, other=0.0)  # [BN, BD]
    if WIDEN_K:
        b_k = b_k.to(b_q.dtype)  # fp8 keys against a float q
    b_s = dot(b_q, tl.trans(b_k), PREC) * qk_scale  # [BM, BN], log2 units
    if MASK:
        b_s = tl.where(k_pos[None, :] < lim[:, None], b_s, float("-inf"))
    return online_softmax_step(acc, m_i, l_i, b_s, b_v, PREC, PV_DT)


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "stride_bt"])  # counts, a width (core.launch: specializations)
def _dense_paged_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cu_ptr,
    kvlen_ptr,
    o_ptr,
    lse_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_ks,
    stride_vp,
    stride_vh,
    stride_vs,
    stride_bt,
    stride_ot,
    stride_oh,
    l_ptr,
    num_tokens,
    num_seqs,
    qk_scale,
    scale_ptr,
    k_desc,
    v_desc,
    sel_ptr,
    stride_st,
    stride_sg,
    stride_sk,
    topk,
    G: tl.constexpr,
    GP: tl.constexpr,
    TM: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    PS: tl.constexpr,
    CAUSAL: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    SEARCH: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    PREC: tl.constexpr,
    FINAL: tl.constexpr,
    Q_FP8: tl.constexpr,
    KV_FP8: tl.constexpr,
    WIDEN_K: tl.constexpr,
    PV_DT: tl.constexpr,
    HKV: tl.constexpr,
    TMA: tl.constexpr,
    SPARSE: tl.constexpr,
    BS: tl.constexpr,
    TOPK_P2: tl.constexpr,
):
    BM: tl.constexpr = TM * GP
    pid = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    # fp8 inputs: the q and k scales fold into the softmax scale, v's into the output.
    qk_scale = fold_fp8_scales(qk_scale, scale_ptr, Q_FP8, KV_FP8)

    # The sequence that owns this tile number: the largest b with cu[b] // TM + b <= pid (a
    # first tile number, increasing in b), counted over whole vectors of cu as in the decode
    # kernel, SEARCH sequences a step. One sequence (SEARCH = 0) needs no search.
    seq = pid * 0
    if SEARCH > 0:
        offs_b = tl.arange(0, SEARCH)
        for i in tl.static_range(SEARCH_STEPS):
            b = i * SEARCH + offs_b
            b_ok = b < num_seqs
            first_tile = tl.where(b_ok, tl.load(cu_ptr + b, mask=b_ok, other=0) // TM + b, pid + 1)
            seq += tl.sum((first_tile <= pid).to(tl.int32), 0)
        seq -= 1
    q_beg = tl.load(cu_ptr + seq)
    q_end = tl.load(cu_ptr + seq + 1)
    q_start = q_beg + (pid - (q_beg // TM + seq)) * TM
    # The grid is an upper bound: tile numbers past a sequence's rows own nothing.
    if q_start >= q_end:
        return

    kv_len = tl.load(kvlen_ptr + seq)
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    tok = q_start + offs_m // GP
    r_head = offs_m % GP
    row_ok = (tok < q_end) & (r_head < G)
    head = g * G + r_head
    # Queries are the last tokens of their sequence: position = kv_len - q_end + token.
    pos = kv_len - q_end + tok
    if CAUSAL:
        lim = pos + 1
    else:
        lim = tl.zeros_like(pos) + kv_len
    # Keys [0, lim) are visible; rows before the first key and padding rows see none.
    lim = tl.where(row_ok & (pos >= 0), lim, 0)
    hi = tl.max(lim, 0)

    p_q = q_ptr + (tok.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh)[:, None] + offs_d[None, :]
    b_q = tl.load(p_q, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]

    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off_k = g.to(tl.int64) * stride_kh
    kv_head_off_v = g.to(tl.int64) * stride_vh
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    if SPARSE:
        # The tile's selected ids as one list, slot s of token q_start + i at i * TOPK_P2 + s.
        # An id is kept where its block starts below the tile's last visible key and no
        # earlier entry of the list holds it: the kept ids are the tile's union of blocks,
        # each once, numbered 0 .. n_union - 1 in list order.
        offs_u = tl.arange(0, TM * TOPK_P2)
        u_tok = q_start + offs_u // TOPK_P2
        u_ids = tl.load(
            sel_ptr + u_tok.to(tl.int64) * stride_st + g * stride_sg + (offs_u % TOPK_P2) * stride_sk,
            mask=(u_tok < q_end) & (offs_u % TOPK_P2 < topk), other=-1,
        ).to(tl.int32)  # [TM * TOPK_P2]
        # (Compared in blocks: an id far out of range would overflow id * BS.)
        u_keep = (u_ids >= 0) & (u_ids < (hi + BS - 1) // BS)
        u_seen = (u_ids[:, None] == u_ids[None, :]) & (offs_u[None, :] < offs_u[:, None])  # [TM*TOPK_P2]^2
        u_keep = u_keep & (tl.max(u_seen.to(tl.int32), 1) == 0)
        u_rank = tl.where(u_keep, tl.cumsum(u_keep.to(tl.int32), 0) - 1, -1)
        n_union = tl.sum(u_keep.to(tl.int32), 0)
        # Each row's own selection: a row attends a block of the union only if its token chose it.
        offs_s = tl.arange(0, TOPK_P2)
        r_ids = tl.load(
            sel_ptr + tok.to(tl.int64)[:, None] * stride_st + g * stride_sg + offs_s[None, :] * stride_sk,
            mask=row_ok[:, None] & (offs_s < topk)[None, :], other=-1,
        ).to(tl.int32)  # [BM, TOPK_P2]
        # This split's share of the union's blocks.
        per_split = (n_union + num_splits - 1) // num_splits
        u_lo = split * per_split
        u_hi = tl.minimum(u_lo + per_split, n_union)
        for u in range(u_lo, u_hi):
            blk = tl.max(tl.where(u_rank == u, u_ids, -1), 0)
            chose = tl.max((r_ids == blk).to(tl.int32), 1) > 0  # [BM]
            # Rows that did not choose the block see none of its keys, the others its keys up
            # to their limit (and none of the next block's, where a key tile runs past it).
            b_lo = blk * BS
            b_lim = tl.where(chose, tl.minimum(lim, b_lo + BS), 0)  # [BM]
            b_hi = tl.max(b_lim, 0)
            for start_n in range(b_lo, b_hi, BN):
                acc, m_i, l_i = attend_key_tile(
                    acc, m_i, l_i, b_q, k_ptr, v_ptr, bt_row_ptr, start_n, b_hi, b_lim, kv_head_off_k,
                    kv_head_off_v, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, offs_n, offs_d, d_ok,
                    BN, PS, True, PREC, WIDEN_K, PV_DT, k_desc, v_desc, g, HKV, TMA,
                )
    else:
        lim_min = tl.min(tl.where(row_ok, lim, 2147483647), 0)
        # Keys below every row's limit need no mask (and are all < kv_len: real pages).
        n_full = (lim_min // BN) * BN
        # This split's share of the key tiles [0, cdiv(hi, BN)).
        per_split = ((hi + BN - 1) // BN + num_splits - 1) // num_splits
        k_lo = split * per_split * BN
        k_hi = tl.minimum(k_lo + per_split * BN, hi)
        for start_n in range(k_lo, tl.minimum(n_full, k_hi), BN):
            acc, m_i, l_i = attend_key_tile(
                acc, m_i, l_i, b_q, k_ptr, v_ptr, bt_row_ptr, start_n, hi, lim, kv_head_off_k, kv_head_off_v,
                stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, offs_n, offs_d, d_ok,
                BN, PS, False, PREC, WIDEN_K, PV_DT, k_desc, v_desc, g, HKV, TMA,
            )
        for start_n in range(tl.maximum(n_full, k_lo), k_hi, BN):
            acc, m_i, l_i = attend_key_tile(
                acc, m_i, l_i, b_q, k_ptr, v_ptr, bt_row_ptr, start_n, hi, lim, kv_head_off_k, kv_head_off_v,
                stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, offs_n, offs_d, d_ok,
                BN, PS, True, PREC, WIDEN_K, PV_DT, k_desc, v_desc, g, HKV, TMA,
            )

    if KV_FP8:
        acc = acc * tl.load(scale_ptr + 2)
    if FINAL:
        empty = l_i == 0.0
        b_o = acc / tl.where(empty, 1.0, l_i)[:, None]  # [BM, BD]
        b_o = tl.where(empty[:, None], 0.0, b_o)
        p_o = o_ptr + (tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh)[:, None] + offs_d[None, :]
        tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if RETURN_LSE:
            b_lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
            tl.store(lse_ptr + head.to(tl.int64) * num_tokens + tok, b_lse, mask=row_ok)
    else:
        # Workspace rows ((token * Hkv + g) * S + split) * G + r, as the decode kernel's splits;
        # m stays in log2 units. A split past the keys stores m = -inf, l = 0.
        ws_row = ((tok.to(tl.int64) * tl.num_programs(1) + g) * num_splits + split) * G + r_head  # [BM]
        tl.store(o_ptr + ws_row[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + ws_row, m_i, mask=row_ok)
        tl.store(l_ptr + ws_row, l_i, mask=row_ok)


def tma_unusable(k_cache: torch.Tensor, v_cache: torch.Tensor, bn: int, bd: int) -> str | None:
    """Why the key tiles cannot be TMA boxes of the caches seen as ``[rows, D]``
    (None: they can). A box must lie in one page, cover the whole head dim and start on
    a 16-byte aligned, int32-addressable row; the copy engine exists from sm_90 on."""
    pages, hkv, page_size, d = k_cache.shape
    if TensorDescriptor is None:
        return f"this Triton ({triton.__version__}) has no host-side tensor descriptors"
    if k_cache.device.type == "cuda" and not interpreting():
        major = device_capability(device_index(k_cache.device))[0]
        if major < 9:
            return f"TMA needs compute capability 9.0 or newer, this device has {major}.x"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "k_cache and v_cache must be contiguous"
    if page_size % bn:
        return f"page_size ({page_size}) must be a multiple of block_n ({bn})"
    if bd != d or bn > 256 or d > 256:
        return f"head dim ({d}) must be a power of two and, like block_n ({bn}), at most 256"
    if (d * k_cache.element_size()) % 16 or any(t.data_ptr() % 16 for t in (k_cache, v_cache)):
        return "cache rows must start on 16-byte boundaries"
    if pages * hkv * page_size == 0:
        return "an empty page pool"
    if pages * hkv * page_size >= 2**31:
        return f"the caches hold {pages * hkv * page_size} rows; TMA coordinates are int32"
    return None


def qouter_attention_triton(
    q, k_cache, v_cache, selected, block_tables, *, cu_seqlens_q, used_kv_lens, softmax_scale=None, causal=True,
    block_size=128, return_lse=False, max_seqlen_q=None, config: DenseConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``qouter_attention`` on the Triton kernel whatever the device (the interpreter on the
    CPU), float inputs, with the launch choices of ``config`` (kernel tests)."""
    args = attention_args(
        q, k_cache, v_cache, block_tables, cu_seqlens_q=cu_seqlens_q, used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, selected=selected, block_size=block_size,
        allow_fp8=False, max_seqlen_q=max_seqlen_q,
    )
    return run_dense_triton(args, config or DEFAULT_CONFIG)


def dense_paged_attention_triton(
    q, k_cache, v_cache, block_tables, *, cu_seqlens_q, used_kv_lens, softmax_scale=None, causal=True,
    return_lse=False, max_seqlen_q=None, config: DenseConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dense_paged_attention`` on the Triton kernel whatever the device (the interpreter on
    the CPU), float inputs, with the launch choices of ``config`` (kernel tests)."""
    args = attention_args(
        q, k_cache, v_cache, block_tables, cu_seqlens_q=cu_seqlens_q, used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, sparse=False, allow_fp8=False,
        max_seqlen_q=max_seqlen_q,
    )
    return run_dense_triton(args, config or DEFAULT_CONFIG)


def run_dense_triton(args: AttnArgs, cfg: DenseConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The dense kernel (and the split merge) on a checked call, sparse where ``args`` has a
    selection. Returns (out [Tq, Hq, D] in ``args.out_dtype``, lse [Hq, Tq] fp32 or None). ``args.max_seqlen_q`` (an upper bound is
    enough) only shrinks the query tile for decode-like batches; launch choices never change
    results beyond rounding."""
    return DenseLaunch(args, cfg or DEFAULT_CONFIG).run(args.q, args.k_cache, args.v_cache, args.selected)


def _search(batch: int) -> dict:
    """The kernel's constants for finding a tile's sequence among ``batch`` (none for one)."""
    chunk, steps = seq_vector(batch) if batch > 1 else (0, 0)
    return dict(SEARCH=chunk, SEARCH_STEPS=steps)


class DenseLaunch:
    """The dense kernel's launch for one checked call, planned once (tiles, split count, the
    TMA choice, the kernel's constants, the metadata as the kernel reads it). :meth:`run`
    launches it for q and caches of the call's shapes, strides and dtypes: a decode step's
    full-attention layers make the same call on their own pools."""

    DESCRIPTORS_KEPT = 64  # pools whose descriptors a launch keeps (one pair per layer)

    def __init__(self, args: AttnArgs, cfg: DenseConfig = DEFAULT_CONFIG):
        why = shape_reason(args)
        if why is not None:
            raise ValueError(why)
        self.args, self.cfg = args, cfg
        self.block_tables, self.cu_seqlens_q, self.used_kv_lens = contiguous(
            args.block_tables, args.cu_seqlens_q, args.used_kv_lens
        )
        num_tokens, batch = args.num_tokens, args.batch
        self.sparse = args.selected is not None
        self.topk = topk = args.selected.shape[2] if self.sparse else 0
        self.empty = num_tokens == 0 or batch <= 0 or (self.sparse and topk == 0)
        if self.empty:
            return
        p = self.plan = plan(args, cfg)
        self.final = p.num_splits == 1
        why_not = tma_unusable(args.k_cache, args.v_cache, p.bn, p.bd)
        if cfg.use_tma and why_not:
            raise ValueError(f"use_tma=True: the K/V pages cannot be loaded as TMA boxes here: {why_not}")
        self.tma = why_not is None and cfg.use_tma is not False
        self._descriptors: dict = {}
        if not self.final:  # the splits' raw (o, m, l), reused from run to run
            rows = num_tokens * args.hkv * p.num_splits * args.group
            self.scratch = StreamBuffers(functools.partial(split_workspaces, rows, args.d))
        self.grid = (num_tokens // p.tm + batch, args.hkv, p.num_splits)
        self.ints = (num_tokens, batch)
        self.scale = float(args.softmax_scale) * LOG2E
        self.constants = dict(
            G=args.group, GP=p.gp, TM=p.tm, D=args.d, BD=p.bd, BN=p.bn, PS=args.page_size,
            CAUSAL=bool(args.causal), RETURN_LSE=bool(args.return_lse), **_search(batch),
            PREC="ieee" if args.q.dtype == torch.float32 else None,
            FINAL=self.final, Q_FP8=args.q_fp8, KV_FP8=args.kv_fp8, WIDEN_K=args.kv_fp8 and not args.q_fp8,
            PV_DT=tl_dtype(args.out_dtype), HKV=args.hkv,
            SPARSE=self.sparse, BS=args.block_size if self.sparse else 1, TOPK_P2=max(2, next_pow2(topk)),
            num_warps=p.num_warps, num_stages=p.num_stages,
        )

    def _tma_pair(self, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """(k, v) descriptors of these pools seen as ``[rows, D]``, or None where a run loads
        them gathered. Kept per pair of pool addresses: a kept descriptor holds its pool, so
        an address names one live pool, and the planned shapes and strides are the run's."""
        if not self.tma:
            return None
        key = (k_cache.data_ptr(), v_cache.data_ptr())
        pair = self._descriptors.get(key)
        if pair is None:
            if (key[0] | key[1]) % 16:
                # Views at an odd offset: the planned pools were aligned, these are not.
                if self.cfg.use_tma:
                    raise ValueError("use_tma=True: the K/V pages cannot be loaded as TMA boxes here: cache rows "
                                     "must start on 16-byte boundaries")
                return None
            if len(self._descriptors) >= self.DESCRIPTORS_KEPT:
                self._descriptors.clear()
            d, p = self.args.d, self.plan
            pair = self._descriptors[key] = (
                TensorDescriptor.from_tensor(k_cache.view(-1, d), [p.bn, p.bd]),
                TensorDescriptor.from_tensor(v_cache.view(-1, d), [p.bn, p.bd]),
            )
        return pair

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, selected: torch.Tensor | None = None):
        """(out, lse) of the planned call with these tensors (the caller's shapes, strides and
        dtypes are the planned call's: ``api.PlannedDenseAttention`` and ``api.PlannedAttention``
        check them); ``selected`` for a sparse call, and only for one."""
        args = self.args
        if (selected is not None) != self.sparse:
            raise ValueError(
                "a sparse launch runs with a selection, a dense one without: "
                f"planned {'with' if self.sparse else 'without'}, run {'with' if selected is not None else 'without'}"
            )
        out, lse = args.new_outputs(no_keys=self.sparse and self.topk == 0)
        if self.empty:
            return out, lse
        if self.final:
            o_buf, m_buf, l_buf = out, (lse if lse is not None else out), out
        else:
            o_buf, m_buf, l_buf = self.scratch.get(q.device)
        pair = self._tma_pair(k_cache, v_cache)
        k_desc, v_desc = pair if pair is not None else (k_cache, k_cache)  # placeholders without TMA
        block_tables = self.block_tables
        launch_kernel(
            _dense_paged_attn_kernel, self.grid,
            q, k_cache, v_cache, block_tables, self.cu_seqlens_q, self.used_kv_lens, o_buf, m_buf,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            l_buf, *self.ints, self.scale,
            args.scales if args.scales is not None else l_buf,
            k_desc, v_desc,
            *((selected, *selected.stride()) if self.sparse else (block_tables, 0, 0, 0)), self.topk,
            TMA=pair is not None, **self.constants,
        )
        if not self.final:
            merge_splits(o_buf, m_buf, l_buf, out, lse, self.plan.num_splits, args.group)
        return out, lse
