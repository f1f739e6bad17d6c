"""Host-side plan of the decode kernel: launch choices (``DecodeConfig``), the split count
(from shapes only) and what the kernel cannot take. No Triton here, so the package imports
where only the torch path runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.args import AttnArgs
from ..core.launch import MAX_SPLITS, next_pow2, num_sms, shared_memory

# Widest head dim the kernel takes (its accumulator tile lives in registers).
MAX_HEAD_DIM = 256
# Most selection slots per row: each program compares every slot with every other (topk^2
# values in registers) to drop repeated ids.
MAX_TOPK = 64


@dataclass(frozen=True)
class DecodeConfig:
    """Launch choices of the decode kernel; None picks the default. They never change
    results beyond rounding.

    ``block_n``: keys per chunk (capped at the block size); ``programs_per_sm``: the
    programs the split count aims for (one, from the H200 sweep in docs/PERF.md);
    ``min_chunks_per_split``: the fewest key chunks a split may get (each
    program pays a fixed cost: finding its sequence, the selection row, the table entries,
    q, and a partial written and merged); ``fused_merge``: the last split of each (token,
    kv head) merges the splits in the same launch (else a second kernel does:
    ``core.split_merge``); ``num_splits``: splits per (token, kv head).
    """

    impl: str = "auto"  # "torch" / "triton" pin the implementation (else M3_SPARSE_IMPL decides)
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int = 3
    programs_per_sm: int = 1
    min_chunks_per_split: int = 2
    fused_merge: bool = True
    num_splits: int | None = None


DEFAULT_CONFIG = DecodeConfig()
BLOCK_N = 64
# Shared memory the K/V pipeline buffers may take: 160 KB of the H100 / H200's 227 KB per
# block; on a GPU with less (99 KB on sm_86 / sm_89 / sm_120), its limit less SMEM_HEADROOM
# for what else the kernel keeps there (the query tile, the merge; 12 KB for fp32 tiles on
# sm_89, tests/kernels/test_gpu_compile.py).
SMEM_BUDGET = 160 * 1024
SMEM_HEADROOM = 32 * 1024
# Smallest M of an MMA tile: the head group is padded to at least this many rows.
MIN_ROWS = 16


@dataclass(frozen=True)
class DecodePlan:
    """Tiling of one call (host ints only)."""

    bn: int  # keys per chunk
    bd: int  # head-dim tile
    rp: int  # rows of a program's tile: the head group, padded
    num_splits: int  # programs per (token, kv head)
    num_warps: int
    num_stages: int
    merge: bool  # the last split merges in the same launch

    @property
    def final(self) -> bool:
        return self.num_splits == 1


def smem_budget(device: torch.device) -> int:
    """Bytes of shared memory the K/V pipeline may take on ``device``."""
    return min(SMEM_BUDGET, shared_memory(device) - SMEM_HEADROOM)


def chunk_keys(block_size: int, block_n: int | None = None) -> int:
    """Keys per chunk: ``block_n`` (default ``BLOCK_N``) capped at the block size."""
    bn = BLOCK_N if block_n is None else int(block_n)
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_n: expected a power of two >= 16, got {bn}")
    return min(bn, block_size)


def default_num_splits(
    num_tokens: int, num_kv_heads: int, topk: int, block_size: int, device: torch.device, block_n: int | None = None,
    cfg: DecodeConfig = DEFAULT_CONFIG,
) -> int:
    """Splits per (token, kv head), from shapes only: a power of two that brings the
    grid to about ``programs_per_sm`` programs per SM, with at least
    ``min_chunks_per_split`` key chunks of a full row of selections per split."""
    pairs = max(1, num_tokens * num_kv_heads)
    target = num_sms(device, cpu_default=4) * cfg.programs_per_sm
    if pairs >= target:
        return 1
    units = topk * (block_size // chunk_keys(block_size, block_n))
    most = max(1, min(MAX_SPLITS, units // max(1, cfg.min_chunks_per_split)))
    return max(1, min(next_pow2(-(-target // pairs)), most))


def shape_reason(args: AttnArgs) -> str | None:
    """Why the kernel cannot take this call's shapes (None when it can)."""
    bs = args.block_size
    if bs < 16 or bs & (bs - 1):
        return f"the Triton decode kernel needs block_size a power of two >= 16, got {bs}"
    for name, t in (("q", args.q), ("k_cache", args.k_cache), ("v_cache", args.v_cache)):
        if t.stride(-1) != 1:
            return f"the Triton decode kernel needs {name} with a contiguous head dim (stride 1), got stride {t.stride(-1)}"
    if args.d > MAX_HEAD_DIM:
        return f"the Triton decode kernel supports head dims up to {MAX_HEAD_DIM}, got {args.d}"
    if args.selected.shape[2] > MAX_TOPK:
        return f"the Triton decode kernel supports topk up to {MAX_TOPK}, got {args.selected.shape[2]}"
    return None


def plan(args: AttnArgs, cfg: DecodeConfig = DEFAULT_CONFIG, rows: int | None = None) -> DecodePlan:
    """The tiling of ``args`` (pure: shapes, dtypes and the SM count). ``rows``: the query
    rows the splits are sized for (default: all of the call's)."""
    bn = chunk_keys(args.block_size, cfg.block_n)
    # An fp8 MMA reduces over at least 32 elements: pad the head-dim tile (masked) to 32.
    bd = max(32 if args.q_fp8 else 16, next_pow2(args.d))
    if cfg.block_n is None:
        # The pipeline keeps num_stages - 1 K and V chunks in shared memory: halve the
        # chunk for wide heads and fp32 until they fit.
        budget = smem_budget(args.q.device)
        while bn > 16 and max(1, cfg.num_stages - 1) * 2 * bn * bd * args.q.element_size() > budget:
            bn //= 2
    num_splits = cfg.num_splits
    if num_splits is None:
        num_splits = default_num_splits(
            args.num_tokens if rows is None else rows, args.hkv, args.selected.shape[2], args.block_size, args.q.device, bn, cfg
        )
    num_splits = int(num_splits)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 1..{MAX_SPLITS}, got {num_splits}")
    rp = max(MIN_ROWS, next_pow2(args.group))
    return DecodePlan(
        bn=bn, bd=bd, rp=rp, num_splits=num_splits, num_warps=cfg.num_warps or (8 if rp >= 128 else 4),
        num_stages=cfg.num_stages, merge=num_splits > 1 and bool(cfg.fused_merge),
    )
