"""KV-outer on the GPU kernels, its four stages' launches worked out once for a call shape.

``KVOuterLaunch`` holds what the host derives from a call's shapes (the index build's chunks
and grids, the schedule's sizes, the partials kernel chosen by ``dispatch``); ``run`` then
allocates the stages' buffers and issues their kernels. A one-off call makes one and runs it
once (``api.kvouter_attention``); a plan (``api.PlannedAttention``) keeps it, so every sparse
layer of a prefill pays only the allocations and launches.
"""

from __future__ import annotations

import torch

from ..core.args import AttnArgs
from . import partials_gluon_sm90, partials_triton
from .build_triton import build_launch
from .combine import merge_scale
from .combine_triton import combine_triton
from .plan import KVOuterConfig, default_num_programs, default_tile_q
from .schedule_triton import ScheduleLaunch

ENGINES = ("tma", "triton")


class KVOuterLaunch:
    """The stages of a checked sparse call ``args`` (``selected`` given) on the kernels, with
    the partials on ``engine`` ("tma": the sm_90 Gluon kernel, "triton": the ``tl`` kernel;
    ``dispatch.partials_engine`` decides)."""

    def __init__(self, args: AttnArgs, cfg: KVOuterConfig, engine: str):
        if engine not in ENGINES:
            raise ValueError(f"engine: one of {ENGINES}, got {engine!r}")
        num_tokens, hkv, topk = args.selected.shape
        self.args, self.cfg, self.engine = args, cfg, engine
        self.build = build_launch(num_tokens, hkv, topk, args.batch, args.max_blocks)
        self.schedule = ScheduleLaunch(
            self.build.capacity, self.build.num_segments, default_tile_q(args.group, cfg),
            default_num_programs(args.q.device, cfg),
        )

    def run(self, q, k_cache, v_cache, selected, out=None, lse=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out [Tq, Hq, D], lse [Hq, Tq] or None) for these tensors (the planned call's
        shapes, strides and dtypes; its block tables, ``cu_seqlens_q`` and kv lengths), written
        into ``out`` / ``lse`` where given (views into larger buffers, as the sliced driver
        passes)."""
        args = self.args.replace(q=q, k_cache=k_cache, v_cache=v_cache, selected=selected)
        index, tile_base = self.build.run_with_tiles(selected, args.cu_seqlens_q, self.schedule.tile_q)
        sched = self.schedule.run(index, tile_base)
        parts = run_partials(args, index, sched, self.cfg, self.engine)
        return combine_triton(
            *parts, index.slot_of, out_dtype=args.out_dtype, return_lse=args.return_lse, out=out, lse=lse,
            o_scale=merge_scale(parts[0], args.scales),
        )


def run_partials(args: AttnArgs, index, sched, cfg: KVOuterConfig, engine: str) -> tuple[torch.Tensor, ...]:
    """The partials stage of a checked call over ``index`` and ``sched`` on ``engine``'s kernel
    (``partial_o``, ``partial_m``, ``partial_l``)."""
    if engine == "tma":
        return partials_gluon_sm90.kvouter_partials_tma(args, index, sched)
    return partials_triton.kvouter_partials_tl(args, index, sched, cfg)


__all__ = ["KVOuterLaunch", "run_partials"]
