"""Host-side plan of the KV-outer stages: launch choices (``KVOuterConfig``), the schedule's
shape and what the ``tl`` partials kernel cannot take. No Triton here, so the package
imports where only the torch path runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.args import AttnArgs
from ..core.launch import next_pow2, num_sms

# Largest tile of the tl kernel: TQ tokens x GP heads rows.
TILE_ROWS = 128


@dataclass(frozen=True)
class KVOuterConfig:
    """Launch choices of the KV-outer stages; None picks the tuned default.

    ``engine``: the partials kernel: "tma" (``partials_gluon_sm90``: TMA query ring and
    stores, sm_90 only), "triton" (``partials_triton``, the ``tl`` kernel: any GPU and the
    interpreter), "auto" takes "tma" where it applies and no ``tl`` setting is given.
    ``tile_q`` (tokens per tile) and ``num_programs`` (persistent grid) shape the schedule;
    ``num_warps`` / ``num_stages`` / ``maxnreg`` are settings of the ``tl`` kernel.
    ``workspace_bytes``: the partial-buffer budget of one call (longer prompts run in query
    slices; ``dispatch.DEFAULT_WORKSPACE_BYTES`` when None).

    The defaults were tuned on the H200 at N = 32K (docs/PERF.md, KV-outer): with the K/V
    block resident per run of tiles, 64-row tiles with one warpgroup (two programs per SM)
    beat 128-row tiles with two warpgroups, and one pipeline stage edged out two and three.
    With 4 programs per SM only two are resident at a time: the slices stay contiguous and
    balanced, the hardware starts the next program as one ends.
    """

    impl: str = "auto"  # "torch" / "triton" pin the implementation (else M3_SPARSE_IMPL decides)
    engine: str = "auto"
    tile_q: int | None = None
    num_programs: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    maxnreg: int | None = None
    workspace_bytes: int | None = None
    tile_rows: int = 64
    programs_per_sm: int = 4

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine: one of {ENGINES}, got {self.engine!r}")

    @property
    def tl_settings(self) -> bool:
        return any(x is not None for x in (self.num_warps, self.num_stages, self.maxnreg))


ENGINES = ("auto", "tma", "triton")
DEFAULT_CONFIG = KVOuterConfig()


def group_pad(group: int) -> int:
    return next_pow2(group)


def default_tile_q(group: int, cfg: KVOuterConfig = DEFAULT_CONFIG) -> int:
    """Tokens per tile: enough to fill ``cfg.tile_rows`` rows with GP heads each."""
    return cfg.tile_q or max(1, cfg.tile_rows // group_pad(group))


def default_num_programs(device: torch.device, cfg: KVOuterConfig = DEFAULT_CONFIG) -> int:
    """A persistent grid of ``cfg.programs_per_sm`` programs per SM (host-known: no device read)."""
    return cfg.num_programs or num_sms(device, cpu_default=1) * cfg.programs_per_sm


# What the tl partials kernel keeps in shared memory besides its K/V block and query tile:
# nothing at M3's shapes and for fp32, 2 KB for a 16-wide head (measured for sm_80 to sm_120
# by tests/kernels/test_gpu_compile.py, which also checks every variant against the limit).
SMEM_SLACK = 2 * 1024


def resident_bytes(args: AttnArgs, tile_q: int) -> int:
    """Shared memory the ``tl`` partials kernel holds for a call: the K/V block it keeps
    resident for a run of tiles (K in the dtype of Q @ K^T, q's when e4m3 K is widened; V in
    P @ V's, the output's for e4m3 V) and one query tile, plus ``SMEM_SLACK``."""
    gp = group_pad(args.group)
    tq = next_pow2(max(tile_q, -(-16 // gp)))
    bd = max(32 if args.q_fp8 else 16, next_pow2(args.d))
    k_bytes = 1 if args.q_fp8 else args.q.element_size()
    v_bytes = args.out_dtype.itemsize if args.kv_fp8 else args.v_cache.element_size()
    return args.block_size * bd * (k_bytes + v_bytes) + tq * gp * bd * args.q.element_size() + SMEM_SLACK


def shared_memory_reason(args: AttnArgs, limit: int, cfg: KVOuterConfig = DEFAULT_CONFIG) -> str | None:
    """Why the ``tl`` partials kernel cannot hold this call's block in ``limit`` bytes of
    shared memory (None when it can): fp32 q, or a wide head, on a 99 KB GPU."""
    need = resident_bytes(args, default_tile_q(args.group, cfg))
    if need <= limit:
        return None
    return (
        f"the Triton KV-outer kernel keeps a block of {args.block_size} keys and values (head dim {args.d}, "
        f"q {str(args.q.dtype).replace('torch.', '')}) resident in shared memory, about {need} bytes; this GPU "
        f"allows {limit} per block"
    )


def tile_rows_reason(args: AttnArgs, tile_q: int) -> str | None:
    """Why the ``tl`` kernel cannot take tiles of ``tile_q`` tokens (None when it can)."""
    bs = args.block_size
    if bs < 16 or bs & (bs - 1):
        return f"block_size: the Triton kernel needs a power of two >= 16, got {bs}"
    if args.q.stride(2) != 1 or args.k_cache.stride(3) != 1 or args.v_cache.stride(3) != 1:
        return "q/k_cache/v_cache: the head dim must be contiguous (stride 1)"
    gp = group_pad(args.group)
    if next_pow2(max(tile_q, -(-16 // gp))) * gp > 2 * TILE_ROWS:
        return f"tile_q = {tile_q}: at most {max(1, 2 * TILE_ROWS // gp)} tokens per tile for G = {args.group}"
    return None
