"""Triton KV-outer attention stage: raw partials of every index entry, driven by a Schedule.

Same contract as :func:`kvouter_attention.kvouter_partials` (that torch version is
the oracle): ``partial_o [E, G, D]`` in q's dtype, ``partial_m/partial_l [E, G]``
fp32; a row that sees no key and every unused entry (past ``seg_offsets[-1]``)
holds ``m = -inf, l = 0, o = 0``.

One persistent program per slice ``[program_tiles[p], program_tiles[p + 1])`` of
the schedule. Per tile (one segment = kv head g, sequence, block; up to TQ
consecutive entries of it):

* the K/V block is read through the block table (a block may span pages or share one),
  once per run of the segment's tiles in the slice (``loop="resident"``, the default);
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

from ._launch import contiguous, fp8_flags, interpreting, next_pow2, num_sms, tl_dtype
from ._validate import check_partial_dtype
from .combine import merge_scale
from .kvouter_attention import empty_partials
from .kvouter_index import KVOuterIndex
from .scheduler import Schedule
from .triton_kvouter_index import build_kvouter_index_triton
from .triton_scheduler import schedule_triton

LOG2E = 1.4426950408889634

# Largest tile: TQ tokens x GP heads rows.
TILE_ROWS = 128
# Launch settings of the partials kernel, tuned on the H200 at N = 32K (docs/PERF.md, KV-outer;
# the benchmark's --tune overrides them): rows per tile, warps, software-pipelining
# depth, persistent programs per SM, register cap, loop form (LOOPS). With the K/V block
# resident per run of tiles, 64-row tiles with one warpgroup (255 registers, 80 KB shared
# memory: two programs per SM) beat 128-row tiles with two warpgroups by 22%, and one
# pipeline stage edged out two and three. With 4 programs per SM only two are resident at
# a time: the slices stay contiguous and balanced, the hardware starts the next program as
# one ends.
ATTN_CONFIG = {
    "engine": "auto",
    "tile_rows": 64,
    "num_warps": 4,
    "num_stages": 1,
    "programs_per_sm": 4,
    "maxnreg": None,
    "loop": "resident",
}
# Kernels of the stage: "tma" (gluon_kvouter: TMA query ring and stores, sm_90 only), "triton"
# (this module's kernel, any GPU and the interpreter); "auto" takes "tma" where it applies
# (gluon_kvouter.unsupported_reason) and no tl launch setting was asked for.
ENGINES = ("auto", "tma", "triton")
# How a program walks its slice of tiles: "staged" (metadata from the induction variable,
# left to the software pipeliner), "prefetch" (metadata run two tiles ahead by hand) or
# "resident" (one K/V load per run of a segment's tiles, query tiles streamed past it).
LOOPS = {"staged": 0, "prefetch": 1, "resident": 2}
# Rows of the unused tail that one program clears per step.
FILL_ROWS = 64


def group_pad(group: int) -> int:
    return next_pow2(group)


def default_tile_q(group: int) -> int:
    """Tokens per tile: enough to fill ATTN_CONFIG["tile_rows"] rows with GP heads each."""
    return max(1, ATTN_CONFIG["tile_rows"] // group_pad(group))


def default_num_programs(device: torch.device) -> int:
    """A persistent grid of one program per SM (host-known: no device read)."""
    return num_sms(device, cpu_default=1) * ATTN_CONFIG["programs_per_sm"]


@triton.jit
def _tile_level1(tile_seg_ptr, tile_start_ptr, tile_end_ptr, tile, t_hi):
    """(segment, first entry, end entry) of a tile; an empty range past the slice."""
    live = tile < t_hi
    seg = tl.load(tile_seg_ptr + tile, mask=live, other=0)
    e0 = tl.load(tile_start_ptr + tile, mask=live, other=0)
    e1 = tl.load(tile_end_ptr + tile, mask=live, other=0)
    return seg, e0, e1


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
def _tile_level2(
    entry_token_ptr, bt_ptr, cu_ptr, kvlen_ptr, seg, e0, e1, nbg, max_blocks, stride_bt,
    r_tok, offs_n,
    G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
):
    """Per-row tokens [BM], per-key pages [BS], kv length and position base of a tile."""
    _, page, kv_len, pos_base = _segment_meta(
        bt_ptr, cu_ptr, kvlen_ptr, seg, e1 > e0, nbg, max_blocks, stride_bt, offs_n, BS, PS
    )
    e_row = e0 + r_tok
    tok = tl.load(entry_token_ptr + e_row, mask=e_row < e1, other=0)
    return tok, page, kv_len, pos_base


@triton.jit
def _load_kv(
    k_ptr, v_ptr, g, blk, page, kv_len, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
    offs_d, offs_n, q_dt: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr, UPCAST: tl.constexpr, WIDEN_K: tl.constexpr,
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
    if UPCAST:
        b_kt = b_kt.to(tl.float32)
    elif WIDEN_K:
        b_kt = b_kt.to(q_dt)  # fp8 keys against a float q
    return b_kt, b_v


@triton.jit
def _snap_e4m3(x):
    """``x`` (within +-448) rounded to the e4m3 grid in fp32, ties away from zero. Triton's
    interpreter (3.9) converts fp32 to e4m3 wrongly when rounding carries into the exponent
    (1.97 -> 1.0); values already on the grid convert exactly."""
    ax = tl.abs(x)
    step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(ax, 1e-30))), -6.0) - 3.0)  # 3 mantissa bits
    r = tl.floor(ax / step + 0.5) * step
    return tl.where(x < 0, -r, r)


@triton.jit
def _attend_rows(
    q_ptr, po_ptr, pm_ptr, pl_ptr, b_kt, b_v,
    g, blk, e0, e1, tok, kv_len, pos_base,
    stride_qt, stride_qh, qk_scale, v_scale, r_tok, r_head, offs_d, offs_n,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
    PV_DT: tl.constexpr, NORM: tl.constexpr,
):
    """One tile against a loaded K/V block: gather its queries, one softmax step, store."""
    d_ok = offs_d < D
    e_row = e0 + r_tok
    row_ok = (e_row < e1) & (r_head < G)
    p_q = q_ptr + (tok.to(tl.int64) * stride_qt + (g * G + r_head).to(tl.int64) * stride_qh)[:, None] + offs_d[None, :]
    b_q = tl.load(p_q, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
    if UPCAST:
        b_q = b_q.to(tl.float32)
    b_s = tl.dot(b_q, b_kt, input_precision=PREC) * qk_scale  # [BM, BS], log2 units
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
    if UPCAST:
        b_o = tl.dot(b_p.to(PV_DT).to(tl.float32), b_v.to(tl.float32), input_precision=PREC)  # [BM, BD]
    else:
        b_o = tl.dot(b_p.to(PV_DT), b_v.to(PV_DT), input_precision=PREC)  # [BM, BD]
    if NORM:
        # Normalized rows in V's stored units. bf16 rounding of P can lift one a hair past V's
        # largest value: the GPU's e4m3 conversion saturates at +-448 (cvt.rn.satfinite);
        # the interpreter's does not, and rounds wrongly, so there the kernel does both.
        b_o = b_o / tl.where(b_l == 0.0, 1.0, b_l)[:, None]
        if UPCAST:  # the interpreter
            b_o = _snap_e4m3(tl.clamp(b_o, -448.0, 448.0))
    elif KV_FP8:
        b_o = b_o * v_scale

    # Rows e * G + h of consecutive entries are consecutive rows of the buffer.
    o_row = e_row.to(tl.int64) * G + r_head
    p_o = po_ptr + o_row[:, None] * D + offs_d[None, :]
    tl.store(p_o, b_o.to(po_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(pm_ptr + o_row, b_m * 0.6931471805599453, mask=row_ok)
    tl.store(pl_ptr + o_row, b_l, mask=row_ok)


@triton.jit
def _tile_attend(
    q_ptr, k_ptr, v_ptr, po_ptr, pm_ptr, pl_ptr,
    seg, e0, e1, tok, page, kv_len, pos_base,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
    nbg, max_blocks, qk_scale, v_scale, r_tok, r_head, offs_d, offs_n,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, WIDEN_K: tl.constexpr, KV_FP8: tl.constexpr,
    PV_DT: tl.constexpr, NORM: tl.constexpr,
):
    """One tile, its K/V block read for it alone."""
    g = seg // nbg
    blk = seg % nbg % max_blocks
    b_kt, b_v = _load_kv(
        k_ptr, v_ptr, g, blk, page, kv_len, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
        offs_d, offs_n, q_ptr.dtype.element_ty, D, BS, PS, UPCAST, WIDEN_K,
    )
    _attend_rows(
        q_ptr, po_ptr, pm_ptr, pl_ptr, b_kt, b_v, g, blk, e0, e1, tok, kv_len, pos_base,
        stride_qt, stride_qh, qk_scale, v_scale, r_tok, r_head, offs_d, offs_n,
        G, D, BS, CAUSAL, PREC, UPCAST, KV_FP8, PV_DT, NORM,
    )


@triton.jit
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
    UPCAST: tl.constexpr,
    LOOP: tl.constexpr,
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
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(scale_ptr + 1)
        v_scale = tl.load(scale_ptr + 2)
    if Q_FP8:
        qk_scale = qk_scale * tl.load(scale_ptr)
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_n = tl.arange(0, BS)
    r_tok = offs_m // GP
    r_head = offs_m % GP
    d_ok = offs_d < D

    t_lo = tl.load(prog_tiles_ptr + pid)
    t_hi = tl.load(prog_tiles_ptr + pid + 1)
    if LOOP == 1:
        # Tile metadata is a chain of dependent loads (tile -> segment -> block table,
        # lengths, tokens). Run it two tiles ahead, so every load a tile issues has an
        # address known when the tile starts: level 1 (segment, entry range) for tile
        # i + 2, level 2 (tokens, pages, lengths) for tile i + 1.
        seg, e0, e1 = _tile_level1(tile_seg_ptr, tile_start_ptr, tile_end_ptr, t_lo, t_hi)
        tok, page, kv_len, pos_base = _tile_level2(
            entry_token_ptr, bt_ptr, cu_ptr, kvlen_ptr, seg, e0, e1, nbg, max_blocks, stride_bt,
            r_tok, offs_n, G, GP, BS, PS,
        )
        n_seg, n_e0, n_e1 = _tile_level1(tile_seg_ptr, tile_start_ptr, tile_end_ptr, t_lo + 1, t_hi)
        for tile in range(t_lo, t_hi):
            nn_seg, nn_e0, nn_e1 = _tile_level1(tile_seg_ptr, tile_start_ptr, tile_end_ptr, tile + 2, t_hi)
            n_tok, n_page, n_kv_len, n_pos_base = _tile_level2(
                entry_token_ptr, bt_ptr, cu_ptr, kvlen_ptr, n_seg, n_e0, n_e1, nbg, max_blocks, stride_bt,
                r_tok, offs_n, G, GP, BS, PS,
            )
            _tile_attend(
                q_ptr, k_ptr, v_ptr, po_ptr, pm_ptr, pl_ptr,
                seg, e0, e1, tok, page, kv_len, pos_base,
                stride_qt, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
                nbg, max_blocks, qk_scale, v_scale, r_tok, r_head, offs_d, offs_n,
                G, D, BS, PS, CAUSAL, PREC, UPCAST, WIDEN_K, KV_FP8, PV_DT, NORM,
            )
            seg, e0, e1 = n_seg, n_e0, n_e1
            tok, page, kv_len, pos_base = n_tok, n_page, n_kv_len, n_pos_base
            n_seg, n_e0, n_e1 = nn_seg, nn_e0, nn_e1
    elif LOOP == 2:
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
                offs_d, offs_n, q_ptr.dtype.element_ty, D, BS, PS, UPCAST, WIDEN_K,
            )
            for i in range(0, run):
                e0 = e_first + i * tile_q
                e1 = tl.minimum(e0 + tile_q, seg_end)
                e_row = e0 + r_tok
                tok = tl.load(entry_token_ptr + e_row, mask=e_row < e1, other=0)
                _attend_rows(
                    q_ptr, po_ptr, pm_ptr, pl_ptr, b_kt, b_v, g, blk, e0, e1, tok, kv_len, pos_base,
                    stride_qt, stride_qh, qk_scale, v_scale, r_tok, r_head, offs_d, offs_n,
                    G, D, BS, CAUSAL, PREC, UPCAST, KV_FP8, PV_DT, NORM,
                )
            tile += run
    else:
        # Everything derived from the induction variable: Triton's software pipeliner
        # (num_stages) may then stage the dependent loads across iterations itself.
        for tile in range(t_lo, t_hi):
            seg, e0, e1 = _tile_level1(tile_seg_ptr, tile_start_ptr, tile_end_ptr, tile, t_hi)
            tok, page, kv_len, pos_base = _tile_level2(
                entry_token_ptr, bt_ptr, cu_ptr, kvlen_ptr, seg, e0, e1, nbg, max_blocks, stride_bt,
                r_tok, offs_n, G, GP, BS, PS,
            )
            _tile_attend(
                q_ptr, k_ptr, v_ptr, po_ptr, pm_ptr, pl_ptr,
                seg, e0, e1, tok, page, kv_len, pos_base,
                stride_qt, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
                nbg, max_blocks, qk_scale, v_scale, r_tok, r_head, offs_d, offs_n,
                G, D, BS, PS, CAUSAL, PREC, UPCAST, WIDEN_K, KV_FP8, PV_DT, NORM,
            )

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


def tma_reason(
    q, k_cache, v_cache, block_size, out_dtype, scales, tile_q, partial_rows, engine=None, tl_settings=False,
    partial_dtype=None,
) -> str | None:
    """Why the partials of such a call would not run the TMA kernel under ``engine`` (default
    ``ATTN_CONFIG["engine"]``), or None when they would: the one place that decides, for the
    launcher and for ``interface.decode_max_queries``."""
    engine = ATTN_CONFIG["engine"] if engine is None else engine
    if engine not in ENGINES:
        raise ValueError(f"engine: one of {ENGINES}, got {engine!r}")
    if engine == "triton":
        return "engine='triton'"
    if tl_settings:
        return "num_warps / num_stages / maxnreg / loop set the 'triton' kernel"
    from .gluon_kvouter import unsupported_reason

    return unsupported_reason(q, k_cache, v_cache, block_size, out_dtype, scales, tile_q, partial_rows, partial_dtype)


def kvouter_partials_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: KVOuterIndex,
    sched: Schedule,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    block_size: int = 128,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    loop: str | None = None,
    scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    engine: str | None = None,
    partial_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (partial_o [E, G, D] in ``partial_dtype``, partial_m [E, G] fp32, partial_l
    [E, G] fp32). ``scales``: fp32 [3] (q, k, v) for fp8 inputs (``_validate.check_quant``);
    ``out_dtype`` (default q's): P @ V's dtype; ``partial_dtype``: ``out_dtype`` (default) or
    float8_e4m3fn with fp8 caches (normalized rows, ``kvouter_attention.kvouter_partials``).

    ``engine`` (default ``ATTN_CONFIG["engine"]``): see ENGINES. ``"tma"`` on a call the TMA
    kernel cannot run raises a ValueError that says why; ``num_warps`` / ``num_stages`` /
    ``maxnreg`` / ``loop`` are settings of the ``"triton"`` kernel and make ``"auto"`` pick it.

    ``sched`` must come from ``schedule(index, tile_q=..., num_programs=...)``; its
    ``tile_q`` may be anything up to ``2 * TILE_ROWS // GP`` (smaller tiles are padded).
    ``block_size`` must be a power of two >= 16 (an MMA dimension).
    """
    block_tables, cu_seqlens_q, used_kv_lens = contiguous(block_tables, cu_seqlens_q, used_kv_lens)
    num_tokens, hq, d = q.shape
    hkv = k_cache.shape[1]
    page_size = k_cache.shape[2]
    group = hq // hkv
    gp = group_pad(group)
    cap = index.capacity
    device = q.device
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size: the Triton kernel needs a power of two >= 16, got {block_size}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q/k_cache/v_cache: the head dim must be contiguous (stride 1)")
    tq = next_pow2(max(sched.tile_q, -(-16 // gp)))
    if tq * gp > 2 * TILE_ROWS:
        raise ValueError(f"sched.tile_q = {sched.tile_q}: at most {max(1, 2 * TILE_ROWS // gp)} tokens per tile for G = {group}")
    engine = ATTN_CONFIG["engine"] if engine is None else engine
    tl_settings = (num_warps, num_stages, maxnreg, loop) != (None, None, None, None)
    q_fp8, kv_fp8, out_dtype = fp8_flags(q, k_cache, scales, out_dtype, "kvouter_attention")
    partial_dtype = check_partial_dtype(partial_dtype, v_cache, out_dtype)
    why = tma_reason(
        q, k_cache, v_cache, block_size, out_dtype, scales, sched.tile_q, cap * group, engine, tl_settings, partial_dtype
    )
    if why is None:
        from .gluon_kvouter import kvouter_partials_tma

        return kvouter_partials_tma(
            q, k_cache, v_cache, index, sched, block_tables, cu_seqlens_q=cu_seqlens_q,
            used_kv_lens=used_kv_lens, softmax_scale=softmax_scale, causal=causal, block_size=block_size,
            scales=scales, out_dtype=out_dtype, partial_dtype=partial_dtype,
        )
    if engine == "tma":
        raise ValueError(f"engine='tma': {why}")
    partial_o, partial_m, partial_l = empty_partials(cap, group, d, partial_dtype, device)
    if cap == 0:
        return partial_o, partial_m, partial_l
    # An fp8 MMA reduces over at least 32 elements: pad the head dim's tile (masked) to 32.
    bd = max(32 if q_fp8 else 16, next_pow2(d))
    if num_warps is None:
        num_warps = ATTN_CONFIG["num_warps"] if tq * gp == ATTN_CONFIG["tile_rows"] else (8 if tq * gp >= 128 else 4)
    if num_stages is None:
        num_stages = ATTN_CONFIG["num_stages"]
    if maxnreg is None:
        maxnreg = ATTN_CONFIG["maxnreg"]
    if loop is None:
        loop = ATTN_CONFIG["loop"]
    if loop not in LOOPS:
        raise ValueError(f"loop: one of {sorted(LOOPS)}, got {loop!r}")
    extra = {} if maxnreg is None or interpreting() else {"maxnreg": maxnreg}
    # Triton's interpreter (3.9) computes bf16 dots wrongly; fp32 dots of the same
    # rounded operands give the GPU kernel's result. (It also rounds to e4m3 wrongly, which
    # the same flag works around for e4m3 partials.)
    upcast = interpreting() and (torch.bfloat16 in (q.dtype, out_dtype) or partial_dtype != out_dtype)
    grid = (sched.num_programs,)
    _kvouter_partials_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        used_kv_lens,
        index.entry_token,
        index.seg_offsets,
        sched.tile_segment,
        sched.tile_start,
        sched.tile_end,
        sched.program_tiles,
        partial_o,
        partial_m,
        partial_l,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        index.num_segments,
        index.num_global_blocks,
        index.max_blocks,
        cap * group,
        sched.num_programs,
        sched.tile_q,
        float(softmax_scale) * LOG2E,
        scales if scales is not None else partial_m,
        G=group,
        GP=gp,
        TQ=tq,
        D=d,
        BD=bd,
        BS=block_size,
        PS=page_size,
        CAUSAL=bool(causal),
        PREC="ieee" if q.dtype == torch.float32 or upcast else None,
        UPCAST=upcast,
        LOOP=LOOPS[loop],
        FILL=FILL_ROWS,
        Q_FP8=q_fp8,
        KV_FP8=kv_fp8,
        WIDEN_K=kv_fp8 and not q_fp8 and not upcast,
        PV_DT=tl_dtype(out_dtype),
        NORM=partial_dtype != out_dtype,
        num_warps=num_warps,
        num_stages=num_stages,
        **extra,
    )
    return partial_o, partial_m, partial_l


def kvouter_attention_triton(
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
    block_size: int = 128,
    return_lse: bool = False,
    tile_q: int | None = None,
    num_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention, KV-outer, Triton stages: same arguments and results as
    ``interface.kvouter_attention``, every stage in Triton (index builder, scheduler, partials, combine).

    A repeated id in one (token, kv head) row counts once (the index builder drops it).
    """
    from .interface import validate_kvouter

    batch, max_blocks, scale = validate_kvouter(
        q, k_cache, v_cache, selected, block_tables, cu_seqlens_q, used_kv_lens, softmax_scale, None, block_size
    )
    return run_kvouter_triton(
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
        max_blocks=max_blocks,
        tile_q=tile_q,
        num_programs=num_programs,
    )


def run_kvouter_triton(
    q, k_cache, v_cache, selected, block_tables, *, cu_seqlens_q, used_kv_lens, softmax_scale, causal, block_size,
    return_lse, batch, max_blocks, tile_q=None, num_programs=None, out=None, lse=None, scales=None, out_dtype=None,
    partial_dtype=None,
):
    """The stages of :func:`kvouter_attention_triton` on arguments already checked by
    ``interface.validate_kvouter`` (whose batch size, blocks per sequence and scale it takes)."""
    from .triton_combine import combine_triton

    group = q.shape[1] // k_cache.shape[1]
    if tile_q is None:
        tile_q = default_tile_q(group)
    if num_programs is None:
        num_programs = default_num_programs(q.device)
    index = build_kvouter_index_triton(selected, cu_seqlens_q=cu_seqlens_q, max_blocks=max_blocks, batch_size=batch)
    sched = schedule_triton(index, tile_q=tile_q, num_programs=num_programs)
    partial_o, partial_m, partial_l = kvouter_partials_triton(
        q,
        k_cache,
        v_cache,
        index,
        sched,
        block_tables,
        cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale,
        causal=causal,
        block_size=block_size,
        scales=scales,
        out_dtype=out_dtype,
        partial_dtype=partial_dtype,
    )
    return combine_triton(
        partial_o, partial_m, partial_l, index.slot_of, out_dtype=out_dtype or q.dtype, return_lse=return_lse, out=out,
        lse=lse, o_scale=merge_scale(partial_o, scales),
    )
