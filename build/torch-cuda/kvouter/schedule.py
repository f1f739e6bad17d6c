"""KV-outer scheduler: cut every segment's entry list into query tiles and hand each
program of a persistent grid one contiguous, balanced run of tiles.

A segment (one kv head x one block) selected by many tokens becomes many tiles,
so a block chosen by every query is spread over many programs. All outputs have
sizes fixed by the input shapes; the number of real tiles stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.validate import check_positive_int
from .build import KVOuterIndex


@dataclass
class Schedule:
    tile_segment: torch.Tensor  # [max_tiles] int32, -1 past num_tiles
    tile_start: torch.Tensor  # [max_tiles] int32 first entry of the tile
    tile_end: torch.Tensor  # [max_tiles] int32 one past its last entry
    num_tiles: torch.Tensor  # [1] int32
    program_tiles: torch.Tensor  # [num_programs + 1] int32: program p runs tiles [pt[p], pt[p+1])
    tile_q: int

    @property
    def max_tiles(self) -> int:
        return self.tile_segment.shape[0]

    @property
    def num_programs(self) -> int:
        return self.program_tiles.shape[0] - 1


def max_tiles_for(capacity: int, num_segments: int, tile_q: int) -> int:
    # Each non-empty segment wastes at most one partial tile.
    return capacity // tile_q + min(num_segments, capacity)


def schedule(index: KVOuterIndex, *, tile_q: int, num_programs: int) -> Schedule:
    """Tile every segment into runs of at most ``tile_q`` entries and split the tiles
    evenly (by count, in order) over ``num_programs`` programs."""
    if not isinstance(index, KVOuterIndex):
        raise TypeError(f"index: expected a KVOuterIndex from build_kvouter_index, got {type(index).__name__}")
    check_positive_int("tile_q", tile_q)
    check_positive_int("num_programs", num_programs)
    device = index.seg_offsets.device
    offs = index.seg_offsets.to(torch.int64)
    counts = offs[1:] - offs[:-1]
    tiles_per_seg = (counts + tile_q - 1) // tile_q
    tile_base = torch.zeros(index.num_segments + 1, dtype=torch.int64, device=device)
    tile_base[1:] = torch.cumsum(tiles_per_seg, 0)
    num_tiles = tile_base[-1]

    max_tiles = max(1, max_tiles_for(index.capacity, index.num_segments, tile_q))
    t = torch.arange(max_tiles, device=device)
    seg = torch.searchsorted(tile_base[1:], t, right=True).clamp(max=max(index.num_segments - 1, 0))
    live = t < num_tiles
    start = offs[seg] + (t - tile_base[seg]) * tile_q
    end = torch.minimum(start + tile_q, offs[seg + 1])
    tile_segment = torch.where(live, seg, -1).to(torch.int32)
    tile_start = torch.where(live, start, 0).to(torch.int32)
    tile_end = torch.where(live, end, 0).to(torch.int32)

    p = torch.arange(num_programs + 1, device=device)
    program_tiles = (p * num_tiles) // num_programs
    return Schedule(
        tile_segment=tile_segment,
        tile_start=tile_start,
        tile_end=tile_end,
        num_tiles=num_tiles.reshape(1).to(torch.int32),
        program_tiles=program_tiles.to(torch.int32),
        tile_q=tile_q,
    )
