"""Triton KV-outer scheduler: emit the tiles of every segment and the programs' tile ranges.

Same contract and the same arrays, bit for bit, as :func:`schedule.schedule` (the oracle).
The prefix of the tile counts per segment comes from the index build's prefix pass
(``BuildLaunch.run_with_tiles``), or from the same kernel over the segment offsets. One
launch then writes every tile: one program per segment writes that segment's tiles (so a
block chosen by all queries is just a longer run), trailing programs blank the unused tail,
and program 0 writes ``num_tiles`` and the balanced split ``program_tiles[p] = p *
num_tiles // P``.
Nothing is read back: the tail's extent is device data, handled by masks over the
host-sized ``max_tiles``.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
import torch

from ..core.launch import int32_parts, launch_kernel, next_pow2
from ..core.validate import check_positive_int
from .build import KVOuterIndex
from .build_triton import segment_prefix
from .schedule import Schedule, max_tiles_for

EMIT_TILES = 128  # tiles written per step of a segment's loop / per tail program


@triton.jit(do_not_specialize=["num_segments", "max_tiles", "num_programs"])  # counts (core.launch: specializations)
def _emit_tiles_kernel(
    seg_off_ptr,
    tile_base_ptr,
    tile_seg_ptr,
    tile_start_ptr,
    tile_end_ptr,
    num_tiles_ptr,
    prog_ptr,
    num_segments,
    max_tiles,
    tile_q,
    num_programs,
    BT: tl.constexpr,
    BP: tl.constexpr,
):
    pid = tl.program_id(0)
    num_tiles = tl.load(tile_base_ptr + num_segments)
    offs = tl.arange(0, BT)
    if pid < num_segments:
        lo = tl.load(seg_off_ptr + pid)
        hi = tl.load(seg_off_ptr + pid + 1)
        base = tl.load(tile_base_ptr + pid)
        n = tl.load(tile_base_ptr + pid + 1) - base
        for j0 in range(0, n, BT):
            j = j0 + offs  # [BT]
            ok = j < n
            start = lo + j * tile_q
            tl.store(tile_seg_ptr + base + j, tl.full([BT], 0, tl.int32) + pid, mask=ok)
            tl.store(tile_start_ptr + base + j, start, mask=ok)
            tl.store(tile_end_ptr + base + j, tl.minimum(start + tile_q, hi), mask=ok)
    else:
        t = (pid - num_segments) * BT + offs  # [BT]
        ok = (t >= num_tiles) & (t < max_tiles)
        tl.store(tile_seg_ptr + t, tl.full([BT], -1, tl.int32), mask=ok)
        tl.store(tile_start_ptr + t, tl.zeros([BT], tl.int32), mask=ok)
        tl.store(tile_end_ptr + t, tl.zeros([BT], tl.int32), mask=ok)
    if pid == 0:
        p = tl.arange(0, BP)
        split = (p.to(tl.int64) * num_tiles) // num_programs
        tl.store(prog_ptr + p, split.to(tl.int32), mask=p <= num_programs)
        tl.store(num_tiles_ptr, num_tiles.to(tl.int32))


@dataclass(frozen=True)
class ScheduleLaunch:
    """The scheduler's launch for an index of ``capacity`` entries over ``num_segments``
    segments, worked out once (host arithmetic only)."""

    capacity: int
    num_segments: int
    tile_q: int
    num_programs: int

    @property
    def max_tiles(self) -> int:
        return max(1, max_tiles_for(self.capacity, self.num_segments, self.tile_q))

    def run(self, index: KVOuterIndex, tile_base: torch.Tensor | None = None) -> Schedule:
        """The schedule of ``index`` (of this launch's sizes). ``tile_base``: the prefix of
        the segments' tile counts for this launch's ``tile_q`` (tile_base[s] = first tile of
        segment s), as ``BuildLaunch.run_with_tiles`` writes it; else made here from the
        segment offsets."""
        offs, max_tiles = index.seg_offsets, self.max_tiles
        tile_q, num_programs, num_segments = self.tile_q, self.num_programs, self.num_segments
        # Every cell is written: by the prefix pass, or by the kernel below (the unused tail
        # of the tile arrays blanked by its trailing programs).
        own_prefix = 0 if tile_base is not None else num_segments + 1
        parts = int32_parts(offs.device, max_tiles, max_tiles, max_tiles, 1, num_programs + 1, own_prefix)
        tile_segment, tile_start, tile_end, num_tiles, program_tiles = parts[:5]
        if tile_base is None:
            tile_base = parts[5]
            segment_prefix(offs, None, tile_base, tile_q)
        launch_kernel(
            _emit_tiles_kernel, (num_segments + -(-max_tiles // EMIT_TILES),),
            offs, tile_base, tile_segment, tile_start, tile_end, num_tiles, program_tiles,
            num_segments, max_tiles, tile_q, num_programs,
            BT=EMIT_TILES, BP=next_pow2(num_programs + 1), num_warps=4,
        )  # fmt: skip
        return Schedule(
            tile_segment=tile_segment, tile_start=tile_start, tile_end=tile_end, num_tiles=num_tiles,
            program_tiles=program_tiles, tile_q=tile_q,
        )


def schedule_triton(index: KVOuterIndex, *, tile_q: int, num_programs: int) -> Schedule:
    """:func:`schedule.schedule` with the tiles written by one Triton launch; same arrays."""
    if not isinstance(index, KVOuterIndex):
        raise TypeError(f"index: expected a KVOuterIndex from build_kvouter_index, got {type(index).__name__}")
    check_positive_int("tile_q", tile_q)
    check_positive_int("num_programs", num_programs)
    return ScheduleLaunch(index.capacity, index.num_segments, tile_q, num_programs).run(index)


__all__ = ["ScheduleLaunch", "schedule_triton"]
