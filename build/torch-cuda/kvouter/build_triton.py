"""Triton KV-outer index builder: a deterministic counting sort of the selections.

Same contract and the same arrays, bit for bit, as :func:`build.build_kvouter_index`
(the oracle): entries sorted by segment ``g * NBg + seq * max_blocks + block``, then by token;
``slot_of`` the reverse map; a repeated id in a (token, kv head) row keeps its first slot.

A sort over all ``Tq * Hkv * topk`` entries costs milliseconds and a dozen launches; here
the sort key is known to be (segment, token) with tokens already in order, so three passes
over fixed-size tiles suffice:

1. ``_chunk_rank_kernel``: the tokens of each sequence are cut into chunks of ``C``; per
   (chunk, kv head) program the chunk's entries are sorted by (block, token) (a bitonic
   network), so every entry's rank among the chunk's earlier tokens that chose the same
   block is its distance from the first of them, and the last of them writes the chunk's
   count for that block.
2. ``_chunk_scan_kernel``: per (kv head, sequence, block range) an exclusive scan of the
   counts over the sequence's chunks (in place, ``SCAN_CHUNKS`` chunks per step) and the
   segment totals.
3. ``_scatter_kernel``: entry = segment offset + chunk prefix + rank; writes the entry
   arrays and turns the ranks in ``slot_of`` into entry ids.

Between passes 2 and 3, ``_segment_prefix_kernel`` turns the totals into the segment
offsets; a KV-outer call (``BuildLaunch.run_with_tiles``) has the same pass write the
scheduler's tile prefix too. Every size comes from shapes on the host; the chunk -> sequence
map is computed inside the kernels from ``cu_seqlens_q``, so nothing is read back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl
import torch

from ..core.launch import contiguous, int32_parts, launch_kernel, next_pow2, seq_block
from ..core.validate import check_positive_int
from .build import KVOuterIndex, validate_build

# Entries per chunk tile (tokens x padded top-k); the rank pass sorts them, the count matrix
# has (Tq / C + B) * Hkv * max_blocks int32 cells.
CHUNK_ENTRIES = 512
# Cells of the count matrix before the chunks grow (256 MiB of int32).
MAX_COUNT_CELLS = 1 << 26
# The chunk tile stays in registers: it grows to at most this many entries (256 tokens at
# top-16, enough for a 512K-token prompt over a 512K-token table within MAX_COUNT_CELLS).
MAX_CHUNK_ENTRIES = 4096
SCAN_BLOCKS = 32  # blocks per program of the scan pass
SCAN_CHUNKS = 64  # chunks per step of the scan pass
PREFIX_SEGMENTS = 1024  # segments per step of the prefix pass
# The rank and scatter passes unroll their loops over a row's slots up to this (padded) top-k;
# wider rows loop at run time (a full unroll of hundreds of slots takes minutes to compile).
UNROLL_TOPK = 64
# Sort keys (block, token, slot) are int32 below this, int64 past it.
KEY32_LIMIT = 2**31 - 1


@triton.jit
def _seq_chunks(cu_ptr, batch, C: tl.constexpr, BB: tl.constexpr):
    """Per sequence slot b < BB: (first token, end token, first chunk, end chunk)."""
    offs_b = tl.arange(0, BB)
    b_ok = offs_b < batch
    lo = tl.load(cu_ptr + offs_b, mask=b_ok, other=0)
    hi = tl.load(cu_ptr + offs_b + 1, mask=b_ok, other=0)
    n = tl.where(b_ok, tl.maximum(hi - lo + C - 1, 0) // C, 0)
    end = tl.cumsum(n, 0)
    return lo, hi, end - n, end


@triton.jit
def _locate_chunk(cu_ptr, chunk, batch, C: tl.constexpr, BB: tl.constexpr):
    """(sequence, first token, end token) of chunk id ``chunk``; past the last chunk the
    sequence is ``batch`` and the token range empty."""
    lo, hi, first, end = _seq_chunks(cu_ptr, batch, C, BB)
    offs_b = tl.arange(0, BB)
    seq = tl.sum(((end <= chunk) & (offs_b < batch)).to(tl.int32), 0)
    here = offs_b == seq
    tok0 = tl.sum(tl.where(here, lo + (chunk - first) * C, 0), 0)
    tok_end = tl.minimum(tl.sum(tl.where(here, hi, 0), 0), tok0 + C)
    return seq, tok0, tok_end


@triton.jit
def _chunk_selection(
    sel_ptr, tok0, tok_end, g, s_t, s_g, s_r, topk, C: tl.constexpr, TK: tl.constexpr, UNROLL: tl.constexpr
):
    """The chunk's selections [C, TK] and which of them are live (in range, >= 0, and the
    first slot of their id in the row)."""
    offs_t = tl.arange(0, C)
    offs_r = tl.arange(0, TK)
    tok = tok0 + offs_t  # [C]
    t_ok = tok < tok_end
    ok = t_ok[:, None] & (offs_r < topk)[None, :]  # [C, TK]
    p_row = sel_ptr + tok.to(tl.int64) * s_t + g * s_g  # [C]
    b_sel = tl.load(p_row[:, None] + offs_r[None, :] * s_r, mask=ok, other=-1)  # [C, TK]
    b_live = ok & (b_sel >= 0)
    if UNROLL:
        for r2 in tl.static_range(TK):
            # Past topk: the last slot again, which only ever matches itself or earlier slots.
            b_col = tl.load(p_row + tl.minimum(r2, topk - 1) * s_r, mask=t_ok, other=-1)  # [C]
            b_live &= ~((b_sel == b_col[:, None]) & (offs_r[None, :] > r2))
    else:
        for r2 in range(0, topk):
            b_col = tl.load(p_row + r2 * s_r, mask=t_ok, other=-1)  # [C]
            b_live &= ~((b_sel == b_col[:, None]) & (offs_r[None, :] > r2))
    return tok, b_sel, b_live


@triton.jit
def _program_chunk(
    sel_ptr, cu_ptr, batch, topk, s_t, s_g, s_r, C: tl.constexpr, TK: tl.constexpr, BB: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """What a program of the rank and scatter passes works on: its chunk id and KV head (the
    grid's two axes), the chunk's sequence, first token and tokens [C], and its selections
    with their liveness (``_chunk_selection``)."""
    chunk = tl.program_id(0)
    g = tl.program_id(1)
    seq, tok0, tok_end = _locate_chunk(cu_ptr, chunk, batch, C, BB)
    tok, b_sel, b_live = _chunk_selection(sel_ptr, tok0, tok_end, g, s_t, s_g, s_r, topk, C, TK, UNROLL)
    return chunk, g, seq, tok0, tok, b_sel, b_live


@triton.jit
def _max_op(a, b):
    return tl.maximum(a, b)


@triton.jit
def _bitonic_sort(x, N: tl.constexpr, LOG_N: tl.constexpr):
    """Ascending sort of a [N] tensor: a bitonic network whose compare-and-swap steps fetch the
    partner with ``tl.gather``. (Not ``tl.sort``: the interpreter runs its reductions one
    element at a time, which made the CPU tests of everything that builds an index several
    times slower.)"""
    idx = tl.arange(0, N)
    for s in tl.static_range(1, LOG_N + 1):  # bitonic runs of 2^s
        for jj in tl.static_range(s):
            j = s - 1 - jj  # partner distance 2^j
            partner = tl.gather(x, idx ^ (1 << j), 0)  # [N]
            ascending = ((idx >> s) & 1) == 0
            lower = ((idx >> j) & 1) == 0
            x = tl.where(lower == ascending, tl.minimum(x, partner), tl.maximum(x, partner))
    return x


@triton.jit(do_not_specialize=["batch", "max_blocks"])  # counts (core.launch: specializations)
def _chunk_rank_kernel(
    sel_ptr,
    cu_ptr,
    slot_ptr,
    cnt_ptr,
    batch,
    hkv,
    topk,
    max_blocks,
    s_t,
    s_g,
    s_r,
    C: tl.constexpr,
    TK: tl.constexpr,
    BB: tl.constexpr,
    UNROLL: tl.constexpr,
    KEY64: tl.constexpr,
):
    chunk, g, _, tok0, _, b_sel, b_live = _program_chunk(sel_ptr, cu_ptr, batch, topk, s_t, s_g, s_r, C, TK, BB, UNROLL)
    N: tl.constexpr = C * TK
    LOG_N: tl.constexpr = N.bit_length() - 1
    offs_t = tl.arange(0, C)
    offs_r = tl.arange(0, TK)
    # One sort of the chunk's entries by (block, token) replaces comparing every entry with
    # every row of the chunk; the slot rides in the low bits so each sorted entry knows where
    # its rank goes. Dead entries sort last.
    if KEY64:
        b_key = (b_sel.to(tl.int64) * C + offs_t[:, None]) * TK + offs_r[None, :]  # [C, TK]
        dead = 9223372036854775807
    else:
        b_key = (b_sel * C + offs_t[:, None]) * TK + offs_r[None, :]  # [C, TK]
        dead = 2147483647
    s_key = _bitonic_sort(tl.reshape(tl.where(b_live, b_key, dead), [N]), N, LOG_N)  # [N]
    live = s_key < dead
    s_blk = s_key // N  # [N], in the key's type: dead entries' quotient is no block id
    s_tok = ((s_key // TK) % C).to(tl.int32)
    s_slot = (s_key % TK).to(tl.int32)
    idx = tl.arange(0, N)
    prev_blk = tl.gather(s_blk, tl.maximum(idx - 1, 0), 0)
    next_blk = tl.gather(s_blk, tl.minimum(idx + 1, N - 1), 0)
    # A block's entries are adjacent after the sort: rank = distance from the first of them.
    run_start = tl.associative_scan(tl.where((idx == 0) | (prev_blk != s_blk), idx, 0), 0, _max_op)
    rank = idx - run_start
    last = live & ((idx == N - 1) | (next_blk != s_blk))

    p_slot = slot_ptr + ((tok0 + s_tok).to(tl.int64) * hkv + g) * topk + s_slot  # [N]
    tl.store(p_slot, rank, mask=live)
    # The chunk's last entry of a block is the one writer of that block's count.
    p_cnt = cnt_ptr + (chunk.to(tl.int64) * hkv + g) * max_blocks + s_blk  # [N]
    tl.store(p_cnt, rank + 1, mask=last)


@triton.jit(do_not_specialize=["batch", "max_blocks"])  # counts (core.launch: specializations)
def _chunk_scan_kernel(
    cu_ptr,
    cnt_ptr,
    tot_ptr,
    batch,
    hkv,
    max_blocks,
    C: tl.constexpr,
    BB: tl.constexpr,
    BLK: tl.constexpr,
    U: tl.constexpr,
):
    pid_b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    _, _, first, end = _seq_chunks(cu_ptr, batch, C, BB)
    offs_b = tl.arange(0, BB)
    c_lo = tl.sum(tl.where(offs_b == s, first, 0), 0)
    c_hi = tl.sum(tl.where(offs_b == s, end, 0), 0)
    offs = pid_b * BLK + tl.arange(0, BLK)
    offs_u = tl.arange(0, U)
    ok = offs < max_blocks
    row = hkv * max_blocks  # cells between one chunk's counts and the next one's
    b_run = tl.zeros([BLK], dtype=tl.int32)
    # U chunks per step, scanned inside the tile: a long prompt has thousands of chunks, and
    # one dependent load-and-store step per chunk would leave the pass waiting on memory.
    for c0 in range(c_lo, c_hi, U):
        c = c0 + offs_u  # [U]
        m = (c < c_hi)[:, None] & ok[None, :]  # [U, BLK]
        p_cnt = cnt_ptr + (c.to(tl.int64) * row + g * max_blocks)[:, None] + offs[None, :]  # [U, BLK]
        b_cnt = tl.load(p_cnt, mask=m, other=0)
        b_inc = tl.cumsum(b_cnt, 0)  # [U, BLK]
        tl.store(p_cnt, b_run[None, :] + b_inc - b_cnt, mask=m)
        b_run += tl.sum(b_cnt, 0)
    seg = (g * batch + s).to(tl.int64) * max_blocks + offs
    tl.store(tot_ptr + seg, b_run, mask=ok)


@triton.jit(do_not_specialize=["num_segments"])  # a count (core.launch: specializations)
def _segment_prefix_kernel(
    src_ptr,
    off_ptr,
    tile_ptr,
    num_segments,
    tile_q,
    FROM_OFFSETS: tl.constexpr,
    TILES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: exclusive prefixes over the segments, index ``num_segments`` holding the
    sum. ``src``: the segments' entry counts, whose prefix goes to ``off`` (the segment
    offsets); or with FROM_OFFSETS the offsets themselves (``off`` is not written). With
    TILES, ``tile`` gets the prefix of the segments' tile counts, ceil(entries / tile_q).

    A single program, as the segments are few (Hkv x the blocks of every sequence: 256 at
    8K, 32K at 1M tokens): one launch where torch needs a fill, a cumsum and the tile
    arithmetic."""
    offs = tl.arange(0, BLOCK)
    first = offs == 0
    if not FROM_OFFSETS:
        tl.store(off_ptr + offs, tl.zeros([BLOCK], tl.int32), mask=first)
    if TILES:
        tl.store(tile_ptr + offs, tl.zeros([BLOCK], tl.int32), mask=first)
    carry_e = tl.zeros([BLOCK], tl.int32)  # [BLOCK], every lane the sum so far
    carry_t = tl.zeros([BLOCK], tl.int32)
    for s0 in range(0, num_segments, BLOCK):
        s = s0 + offs  # [BLOCK]
        ok = s < num_segments
        if FROM_OFFSETS:
            b_n = tl.load(src_ptr + s + 1, mask=ok, other=0) - tl.load(src_ptr + s, mask=ok, other=0)
        else:
            b_n = tl.load(src_ptr + s, mask=ok, other=0)
            tl.store(off_ptr + s + 1, carry_e + tl.cumsum(b_n, 0), mask=ok)
            carry_e += tl.sum(b_n, 0)
        if TILES:
            b_t = (b_n + tile_q - 1) // tile_q
            tl.store(tile_ptr + s + 1, carry_t + tl.cumsum(b_t, 0), mask=ok)
            carry_t += tl.sum(b_t, 0)


def segment_prefix(src: torch.Tensor, off: torch.Tensor | None, tile: torch.Tensor | None, tile_q: int = 0) -> None:
    """Launch ``_segment_prefix_kernel``: ``off`` given, ``src`` holds the segments' entry
    counts; else ``src`` holds their offsets. ``tile`` given: the tile prefix for tiles of
    ``tile_q`` entries. All int32 and contiguous; ``off`` / ``tile`` one longer than the
    segments."""
    from_offsets = off is None
    num_segments = src.shape[0] - 1 if from_offsets else src.shape[0]
    launch_kernel(
        _segment_prefix_kernel, (1,),
        src, src if from_offsets else off, src if tile is None else tile, num_segments, max(tile_q, 1),
        FROM_OFFSETS=from_offsets, TILES=tile is not None,
        BLOCK=PREFIX_SEGMENTS, num_warps=4,  # one block for every length (core.launch: specializations)
    )  # fmt: skip


@triton.jit(do_not_specialize=["batch", "max_blocks"])  # counts (core.launch: specializations)
def _scatter_kernel(
    sel_ptr,
    cu_ptr,
    cnt_ptr,
    seg_off_ptr,
    slot_ptr,
    e_tok_ptr,
    e_rank_ptr,
    e_seg_ptr,
    batch,
    hkv,
    topk,
    max_blocks,
    s_t,
    s_g,
    s_r,
    C: tl.constexpr,
    TK: tl.constexpr,
    BB: tl.constexpr,
    UNROLL: tl.constexpr,
):
    chunk, g, seq, _, tok, b_sel, b_live = _program_chunk(
        sel_ptr, cu_ptr, batch, topk, s_t, s_g, s_r, C, TK, BB, UNROLL
    )
    offs_r = tl.arange(0, TK)
    b_blk = tl.where(b_live, b_sel, 0)
    p_slot = slot_ptr + (tok[:, None].to(tl.int64) * hkv + g) * topk + offs_r[None, :]  # [C, TK]
    b_rank = tl.load(p_slot, mask=b_live, other=0)
    b_seg = (g * batch + seq).to(tl.int64) * max_blocks + b_blk  # [C, TK]
    b_prefix = tl.load(cnt_ptr + (chunk.to(tl.int64) * hkv + g) * max_blocks + b_blk, mask=b_live, other=0)
    b_entry = tl.load(seg_off_ptr + b_seg, mask=b_live, other=0) + b_prefix + b_rank  # [C, TK]
    tl.store(p_slot, b_entry, mask=b_live)
    p_e = b_entry.to(tl.int64)
    tl.store(e_tok_ptr + p_e, tl.broadcast_to(tok[:, None], [C, TK]), mask=b_live)
    tl.store(e_rank_ptr + p_e, tl.broadcast_to(offs_r[None, :], [C, TK]), mask=b_live)
    tl.store(e_seg_ptr + p_e, b_seg.to(tl.int32), mask=b_live)


def chunk_tokens_for(num_tokens: int, batch: int, hkv: int, topk: int, max_blocks: int) -> int:
    """Tokens per chunk: ``CHUNK_ENTRIES`` entries, doubled while the count matrix would
    exceed ``MAX_COUNT_CELLS`` (long prompts over wide block tables), up to
    ``MAX_CHUNK_ENTRIES`` (past that the matrix may exceed the cap)."""
    tk = next_pow2(topk)
    chunk = max(1, CHUNK_ENTRIES // tk)
    while chunk * tk < MAX_CHUNK_ENTRIES and (-(-num_tokens // chunk) + batch) * hkv * max_blocks > MAX_COUNT_CELLS:
        chunk *= 2
    return chunk


@dataclass(frozen=True)
class BuildLaunch:
    """The index build of one call shape, worked out once (host arithmetic only): a prefill
    plan runs it in every sparse layer. ``run`` allocates the index and issues the passes."""

    num_tokens: int
    hkv: int
    topk: int
    batch: int
    max_blocks: int
    chunk: int  # tokens per chunk, a power of two

    @property
    def num_segments(self) -> int:
        return self.hkv * self.batch * self.max_blocks

    @property
    def capacity(self) -> int:
        return self.num_tokens * self.hkv * self.topk

    @functools.cached_property
    def _settings(self) -> tuple:
        tk = next_pow2(self.topk)
        max_chunks = -(-self.num_tokens // self.chunk) + self.batch  # each sequence wastes at most one partial chunk
        blk = SCAN_BLOCKS  # not fewer for short histories: one compile for every length
        common = dict(C=self.chunk, TK=tk, BB=seq_block(self.batch), UNROLL=tk <= UNROLL_TOPK, num_warps=4)
        rank = dict(common, KEY64=self.max_blocks * self.chunk * tk >= KEY32_LIMIT)
        scan = dict(C=self.chunk, BB=common["BB"], BLK=blk, U=SCAN_CHUNKS, num_warps=4)
        grids = ((max_chunks, self.hkv), (triton.cdiv(self.max_blocks, blk), self.hkv, self.batch))
        return max_chunks, grids, rank, scan, common

    def run(self, selected: torch.Tensor, cu_seqlens_q: torch.Tensor) -> KVOuterIndex:
        """The index of ``selected`` [Tq, Hkv, topk] (this launch's shape) over the sequences
        of ``cu_seqlens_q`` (int32 or int64; not checked here)."""
        return self._run(selected, cu_seqlens_q, 0)[0]

    def run_with_tiles(self, selected: torch.Tensor, cu_seqlens_q: torch.Tensor, tile_q: int):
        """(``run``'s index, the scheduler's tile prefix [num_segments + 1] int32 for tiles of
        ``tile_q`` entries): the pass that writes the segment offsets writes it too, where the
        scheduler alone would spend five torch calls on it (``ScheduleLaunch.run`` takes it
        as ``tile_base``)."""
        check_positive_int("tile_q", tile_q)
        return self._run(selected, cu_seqlens_q, tile_q)

    def _run(self, selected, cu_seqlens_q, tile_q: int) -> tuple[KVOuterIndex, torch.Tensor | None]:
        hkv, topk, max_blocks, batch = self.hkv, self.topk, self.max_blocks, self.batch
        num_segments, cap, device = self.num_segments, self.capacity, selected.device
        # Rows 0-2: entry token / rank / segment, row 3: slot_of; -1 wherever nothing lands.
        arrays = torch.full((4, cap), -1, dtype=torch.int32, device=device)
        # The prefix pass writes every cell of the offsets (and of the tile prefix), the scan
        # pass every total.
        tiles = num_segments + 1 if tile_q else 0
        seg_offsets, tile_base, totals = int32_parts(device, num_segments + 1, tiles, num_segments)
        tile_base = tile_base if tile_q else None
        index = KVOuterIndex(
            seg_offsets=seg_offsets, entry_token=arrays[0], entry_rank=arrays[1], entry_segment=arrays[2],
            slot_of=arrays[3].view(self.num_tokens, hkv, topk), num_kv_heads=hkv, max_blocks=max_blocks,
            num_global_blocks=batch * max_blocks,
        )
        if cap == 0 or batch == 0:
            for t in (seg_offsets, tile_base):
                if t is not None:
                    t.zero_()
            return index, tile_base
        # int32 offsets (the entry count is checked below 2^31): every loop bound is one type.
        (cu,) = contiguous(cu_seqlens_q.to(torch.int32))
        max_chunks, (rank_grid, scan_grid), rank, scan, common = self._settings
        counts = torch.zeros(max_chunks * hkv * max_blocks, dtype=torch.int32, device=device)
        strides = selected.stride()
        launch_kernel(
            _chunk_rank_kernel, rank_grid, selected, cu, index.slot_of, counts, batch, hkv, topk, max_blocks, *strides,
            **rank,
        )
        launch_kernel(_chunk_scan_kernel, scan_grid, cu, counts, totals, batch, hkv, max_blocks, **scan)
        segment_prefix(totals, seg_offsets, tile_base, tile_q)
        launch_kernel(
            _scatter_kernel, rank_grid,
            selected, cu, counts, seg_offsets, index.slot_of, index.entry_token, index.entry_rank, index.entry_segment,
            batch, hkv, topk, max_blocks, *strides, **common,
        )  # fmt: skip
        return index, tile_base


def build_launch(num_tokens: int, hkv: int, topk: int, batch: int, max_blocks: int, chunk_tokens: int | None = None):
    """The :class:`BuildLaunch` of selections ``[num_tokens, hkv, topk]`` over ``batch``
    sequences of ``max_blocks`` blocks; ``chunk_tokens`` (a power of two) overrides the
    chunk length. Raises where int32 entry ids cannot number the call."""
    num_segments = hkv * batch * max_blocks
    cap = num_tokens * hkv * topk
    if max(cap, num_segments + 1, num_tokens * topk) >= 2**31:
        raise ValueError(
            f"selected {(num_tokens, hkv, topk)} with {num_segments} segments: int32 entry ids need "
            "Tq * Hkv * topk and the segment count below 2**31"
        )
    chunk = chunk_tokens or chunk_tokens_for(num_tokens, batch, hkv, topk, max_blocks)
    return BuildLaunch(num_tokens, hkv, topk, batch, max_blocks, chunk)


def build_kvouter_index_triton(
    selected: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    max_blocks: int,
    batch_size: int | None = None,
    chunk_tokens: int | None = None,
) -> KVOuterIndex:
    """:func:`build.build_kvouter_index` in three Triton passes; same arrays.

    ``cu_seqlens_q`` must start at 0 and end at ``selected.shape[0]`` (checked with the other
    values on the CPU or under ``M3_SPARSE_DEBUG=1``). ``chunk_tokens`` (a power of two)
    overrides the chunk length.
    """
    batch = validate_build(selected, cu_seqlens_q, max_blocks, batch_size)
    if batch != cu_seqlens_q.shape[0] - 1:
        raise ValueError(f"batch_size={batch}: expected cu_seqlens_q.shape[0] - 1 = {cu_seqlens_q.shape[0] - 1}")
    if chunk_tokens is not None:
        check_positive_int("chunk_tokens", chunk_tokens)
        if chunk_tokens & (chunk_tokens - 1):
            raise ValueError(f"chunk_tokens: expected a power of two, got {chunk_tokens}")
    return build_launch(*selected.shape, batch, max_blocks, chunk_tokens).run(selected, cu_seqlens_q)


__all__ = ["BuildLaunch", "build_kvouter_index_triton", "build_launch", "chunk_tokens_for", "segment_prefix"]
