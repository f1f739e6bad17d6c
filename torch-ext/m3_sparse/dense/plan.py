"""Host-side plan of the dense kernel: launch choices (``DenseConfig``), tile sizes and the
split count (from shapes only), and what the kernel cannot take. No Triton here, so the
package imports where only the torch path runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.args import AttnArgs
from ..core.launch import MAX_SPLITS, next_pow2, num_sms, shared_memory

# Rows per tile (tokens x padded heads) and keys per tile; BLOCK_M is a cap, a
# decode batch gets fewer tokens per tile (see tile_tokens). 128 x 64 tiles with 4 warps
# and 2 stages won the H200 sweep on M3's prefill (docs/PERF.md, "Dense paged attention").
# fp32 q (the FMA dot, spilling heavily at either size: ptxas for sm_90 puts 94 KB of
# spill stores in the 128-row tile, 54 KB in the 64-row one) was not timed; it keeps 64.
BLOCK_M = 128
BLOCK_M_FP32 = 64
BLOCK_N = 64
# Decode-sized tiles (a few tokens' heads) stream twice the keys per step where a page holds
# whole 128-key tiles: the loop over a long context is memory-bound, and its fixed cost per
# tile is what BLOCK_N amortizes (measured on the H200: docs/PERF.md, "Dense paged attention").
BLOCK_N_DECODE = 128
DECODE_ROWS = 64


@dataclass(frozen=True)
class DenseConfig:
    """Launch choices of the dense kernel; None picks the default. They never change results
    beyond rounding.

    ``block_m`` / ``block_n``: query rows and keys per tile (``block_n`` a power of two >= 16,
    it need not divide the page size); ``num_splits`` (1..``MAX_SPLITS``) splits every tile's
    keys, by default from the shapes: ``programs_per_sm`` programs per SM with at least
    ``min_key_tiles`` key tiles per split; ``use_tma``: load each key tile as one TMA box of
    its page (None: wherever ``tma_unusable`` finds no obstacle; True: required, a
    ValueError says why not; False: gathered pointer loads).
    """

    # "torch" / "triton" / "fa4" (flash-attn-4) pin the kernel; "auto": M3_SPARSE_DENSE_IMPL,
    # else M3_SPARSE_IMPL, else the measured choice (dispatch.dense_kernel).
    impl: str = "auto"
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int = 2
    num_splits: int | None = None
    use_tma: bool | None = None
    programs_per_sm: int = 4
    min_key_tiles: int = 8


DEFAULT_CONFIG = DenseConfig()


@dataclass(frozen=True)
class DensePlan:
    """Tiling of one call (host ints only)."""

    gp: int  # the head group, padded to a power of two
    tm: int  # tokens per query tile (tm * gp rows)
    bn: int  # keys per tile
    bd: int  # head-dim tile
    num_splits: int  # key splits per (query tile, kv head)
    num_warps: int
    num_stages: int


def default_num_warps(rows: int, block_d: int) -> int:
    """Four warps up to a 128 x 128 fp32 accumulator (a 128-row tile with 4 warps beat 8
    by 16-30% on the H200), eight beyond it (256 rows with 4 warps ran 3.3x slower)."""
    return 8 if rows * block_d > 128 * 128 else 4


def default_block_m(q_dtype: torch.dtype) -> int:
    return BLOCK_M_FP32 if q_dtype == torch.float32 else BLOCK_M


def default_block_n(rows: int, page_size: int, q_dtype: torch.dtype) -> int:
    """Keys per tile: BLOCK_N_DECODE for a tile of at most DECODE_ROWS rows when a page holds
    whole tiles of it (so the TMA path keeps one box per tile) and q is not fp32 (whose FMA
    dot already spills at 64 keys), else BLOCK_N."""
    if rows <= DECODE_ROWS and page_size % BLOCK_N_DECODE == 0 and q_dtype != torch.float32:
        return BLOCK_N_DECODE
    return BLOCK_N


def tile_bytes(args: AttnArgs, rows: int, bn: int, bd: int, num_stages: int) -> int:
    """Shared memory a tile of ``rows`` query rows and ``bn`` keys takes at most: the key and
    value tiles of ``num_stages`` pipeline stages (K in the dtype of Q @ K^T, q's where e4m3
    K is widened under a float q; V in P @ V's, the output's for e4m3 V) and the query tile
    (in shared memory where the keys come as TMA boxes). An upper bound of what Triton
    allocated for every variant compiled in tests/kernels/test_gpu_compile.py."""
    k_bytes = 1 if args.q_fp8 else args.q.element_size()
    v_bytes = args.out_dtype.itemsize if args.kv_fp8 else args.v_cache.element_size()
    return max(1, num_stages) * bn * bd * (k_bytes + v_bytes) + rows * bd * args.q.element_size()


def tile_tokens(group_pad: int, max_q: int, block_m: int) -> int:
    """Tokens per tile: up to block_m rows, no more tokens than a sequence can have,
    and at least 16 rows (the smallest MMA M)."""
    tm = min(max(1, block_m // group_pad), next_pow2(max(1, max_q)))
    return max(tm, next_pow2(-(-16 // group_pad)))


def default_num_splits(
    num_tokens: int, batch: int, num_kv_heads: int, tile_tokens: int, capacity: int, device, block_n: int = BLOCK_N,
    cfg: DenseConfig | None = None,
) -> int:
    """Key splits per (query tile, kv head), from shapes only: 1 when the query tiles fill
    the GPU (prefill), else a power of two up to ``MAX_SPLITS`` that brings the programs
    to ``cfg.programs_per_sm`` per SM, keeping ``cfg.min_key_tiles`` key tiles of the
    block-table capacity per split."""
    cfg = cfg or DEFAULT_CONFIG
    tiles = max(-(-num_tokens // tile_tokens), min(batch, num_tokens), 1)
    programs = tiles * num_kv_heads
    target = num_sms(device, cpu_default=4) * cfg.programs_per_sm
    if programs >= target:
        return 1
    most = max(1, min(MAX_SPLITS, -(-capacity // block_n) // cfg.min_key_tiles))
    return max(1, min(next_pow2(-(-target // programs)), 1 << (most.bit_length() - 1)))


# A sparse call (query-outer over each tile's union of selected blocks, ``api.qouter_attention``)
# compares each of the tile's selection slots with every other to drop repeated ids:
# (tokens x topk)^2 values in registers. Its tiles take at most UNION_SLOTS slots (fewer
# tokens for a wide top-k) and never more than MAX_UNION_SLOTS (where 16 rows, the smallest
# MMA tile, bring more; such a call is refused).
UNION_SLOTS = 128
MAX_UNION_SLOTS = 512


def union_tile_tokens(tm: int, group_pad: int, topk: int) -> int:
    """Tokens per tile of a sparse call: ``tm`` capped so that the tile's selection slots stay
    within UNION_SLOTS, yet at least 16 rows."""
    cap = max(1, UNION_SLOTS // max(2, next_pow2(topk)))
    return max(min(tm, cap), next_pow2(-(-16 // group_pad)))


def union_block_n(bn: int, block_size: int) -> int:
    """Keys per tile of a sparse call: the largest power of two up to ``bn`` that divides the
    block size, so that a key tile lies in one block (whose rows are those that chose it)."""
    while bn > 16 and block_size % bn:
        bn //= 2
    return bn


def shape_reason(args: AttnArgs) -> str | None:
    """Why the kernel cannot take this call (None when it can)."""
    for name, t in (("q", args.q), ("k_cache", args.k_cache), ("v_cache", args.v_cache)):
        if t.stride(-1) != 1:
            return f"the Triton dense kernel needs {name} with a contiguous head dim (stride 1), got stride {t.stride(-1)}"
    if args.selected is not None:
        if args.block_size % 16:
            return f"the query-outer sparse kernel needs a block_size that is a multiple of 16, got {args.block_size}"
        topk = args.selected.shape[2]
        tm = union_tile_tokens(1, next_pow2(args.group), topk)
        if tm * max(2, next_pow2(topk)) > MAX_UNION_SLOTS:
            return (
                f"the query-outer sparse kernel takes at most {MAX_UNION_SLOTS} selection slots per tile; "
                f"{tm} tokens (16 rows at {args.group} heads per kv head) x topk {topk} need more"
            )
    return None


def plan(args: AttnArgs, cfg: DenseConfig = DEFAULT_CONFIG) -> DensePlan:
    """The tiling of ``args`` (pure: shapes, dtypes and the SM count)."""
    gp = next_pow2(args.group)
    block_m = default_block_m(args.q.dtype) if cfg.block_m is None else int(cfg.block_m)
    tm = tile_tokens(gp, args.rows_per_seq, block_m)
    sparse = args.selected is not None
    if sparse:
        tm = union_tile_tokens(tm, gp, args.selected.shape[2])
    bn = default_block_n(tm * gp, args.page_size, args.q.dtype) if cfg.block_n is None else int(cfg.block_n)
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_n: the Triton kernel needs a power of two >= 16, got {bn}")
    if sparse and cfg.block_n is None:
        bn = union_block_n(bn, args.block_size)
    # An fp8 MMA reduces over at least 32 elements: pad the head-dim tile (masked) to 32.
    bd = max(32 if args.q_fp8 else 16, next_pow2(args.d))
    if cfg.block_n is None:
        # Halve the key tile until its stages fit the GPU's shared memory (fp32 and wide
        # heads on a 99 KB GPU; a page still holds whole tiles, so TMA boxes stay usable).
        limit = shared_memory(args.q.device)
        while bn > 16 and tile_bytes(args, tm * gp, bn, bd, cfg.num_stages) > limit:
            bn //= 2
    num_splits = cfg.num_splits
    if num_splits is None:
        capacity = args.block_tables.shape[1] * args.page_size
        if sparse:  # a row attends at most topk blocks
            capacity = min(capacity, args.selected.shape[2] * args.block_size)
        num_splits = default_num_splits(args.num_tokens, args.batch, args.hkv, tm, capacity, args.q.device, bn, cfg)
    num_splits = int(num_splits)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 1..{MAX_SPLITS}, got {num_splits}")
    return DensePlan(
        gp=gp, tm=tm, bn=bn, bd=bd, num_splits=num_splits,
        num_warps=cfg.num_warps or default_num_warps(tm * gp, bd), num_stages=cfg.num_stages,
    )


# flash-attn-4 runs one program per (128 packed query rows, kv head) of a sequence and does
# not split the keys on sm_90 (it refuses num_splits > 1 there). On the H200 it beat the Triton
# kernel and cuDNN in prefill, and was never faster than the Triton kernel, which splits the
# keys, on decode rows (one token's 16 heads in a 128-row tile); docs/PERF.md, "Dense paged
# attention". So it takes calls whose sequences fill its tiles and whose grid fills most SMs.
FA4_ROWS = 128
FA4_MIN_SM_FRACTION = 0.75


def fa4_programs(args: AttnArgs) -> int:
    """flash-attn-4's grid for this call on sm_90 (GQA heads packed into its 128-row tiles)."""
    return args.batch * args.hkv * -(-(args.rows_per_seq * args.group) // FA4_ROWS)


def prefers_fa4(args: AttnArgs) -> bool:
    """Whether an unpinned CUDA call that flash-attn-4 can take should run it rather than the
    Triton kernel (shapes only): a sequence's rows fill one of its tiles, and its grid fills
    most of the GPU."""
    return (
        args.rows_per_seq * args.group >= FA4_ROWS
        and fa4_programs(args) >= FA4_MIN_SM_FRACTION * num_sms(args.q.device, cpu_default=4)
    )
