"""Host-side plan of the index kernels: launch choices (``IndexConfig``), the tiling of a
call (``IndexPlan``, from shapes only) and what the kernels cannot take. No Triton here, so
the package imports where only the torch path runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.args import IndexArgs
from ..core.launch import contiguous, interpreting, num_sms

# Slots of the running top-k list the kernel keeps in registers.
MAX_TOPK = 32
# A row tile holds at most this many (token, head) rows; prefill uses it, decode
# uses the smallest power of two >= the rows of one sequence (>= 16 for tl.dot).
PREFILL_BM = 128
# Programs to aim for when splitting key ranges: several per multiprocessor so
# that enough loads are in flight to keep HBM busy, and many waves so that the
# last, partly filled wave costs little.
PROGRAMS_PER_SM = 8
# A split scores at least this many key chunks (its fixed cost: the query tile,
# the table reads and the merge's share).
MIN_CHUNKS_PER_SPLIT = 2
# Most key-range splits of one row tile (the split merge keeps their top lists in a workspace).
MAX_KEY_SPLITS = 128
# With fp8 keys and the fp8 dot, row tiles up to this height (decode) are scored
# key-major (K @ Q^T: the key tile is the MMA's M), with a deeper key pipeline: faster for
# fp8 keys with the fp8 dot only (docs/PERF.md, index branch in decode).
KEY_MAJOR_MAX_BM = 32
KEY_MAJOR_STAGES = 6
ENGINES = ("auto", "tma", "triton")


@dataclass(frozen=True)
class IndexConfig:
    """Launch choices of the index kernels; None picks the tuned default.

    ``engine``: which prefill kernel runs a call the Gluon kernel (``topk_gluon_sm90``) takes:
    "auto" picks it only where it measured faster (fp8 keys under one scale with the fp8
    dot; docs/PERF.md, index branch), "triton" keeps the tl kernel, "tma" requires the
    Gluon one. ``block_k`` / ``num_warps`` / ``num_stages`` / ``maxnreg`` are settings of
    the tl kernel, so giving one keeps it.
    """

    impl: str = "auto"  # "torch" / "triton" pin the implementation (else M3_SPARSE_IMPL decides)
    engine: str = "auto"
    block_m: int | None = None
    block_k: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    key_major: bool | None = None
    maxnreg: int | None = None

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine: one of {ENGINES}, got {self.engine!r}")

    @property
    def tl_settings(self) -> bool:
        return any(x is not None for x in (self.block_k, self.num_warps, self.num_stages, self.maxnreg))


DEFAULT_CONFIG = IndexConfig()


@dataclass(frozen=True)
class IndexPlan:
    """Tiling of one call (host ints only: from shapes, never from device values)."""

    bm: int  # rows (token x head) per tile
    bk: int  # keys per score tile
    ch: int  # keys per chunk: max(bk, block_size)
    num_splits: int
    key_major: bool
    dot_fp32: bool  # exact fp32 products (mixed or fp32 inputs)
    k_cast: bool  # fp8 keys widened to the query dtype before the dot
    tiles: int  # row tiles in the grid (an upper bound; programs without one exit)

    @property
    def final(self) -> bool:
        return self.num_splits == 1


def shape_reason(index_q: torch.Tensor, index_k_cache: torch.Tensor, topk: int, block_size: int) -> str | None:
    """Why the kernel cannot take these shapes (None when it can)."""
    page_size, d = index_k_cache.shape[1], index_q.shape[2]
    if topk > MAX_TOPK:
        return f"the Triton index kernel supports topk <= {MAX_TOPK}, got {topk}"
    if block_size & (block_size - 1) or (block_size % page_size and page_size % block_size):
        return f"the Triton index kernel needs block_size a power of two dividing or multiple of page_size, got {block_size}"
    if d & (d - 1) or not 16 <= d <= 256:
        return f"the Triton index kernel needs a power-of-two index head dim in [16, 256], got {d}"
    return None


def plan(args: IndexArgs, cfg: IndexConfig = DEFAULT_CONFIG) -> IndexPlan:
    """The tiling of ``args`` (pure: shapes, dtypes and the SM count)."""
    num_tokens, heads, dim = args.index_q.shape
    batch = args.used_kv_lens.shape[0]
    page_size = args.index_k_cache.shape[1]
    q_dtype, k_dtype = args.index_q.dtype, args.index_k_cache.dtype
    fp8 = args.fp8
    fp8_dot = bool(fp8 and args.fp8_dot)
    k_cast = fp8 and not fp8_dot
    # Mixed or fp32 inputs: exact fp32 products (a tf32 dot would reorder near-ties that
    # the fp32 contract keeps apart).
    dot_fp32 = (q_dtype != k_dtype and not fp8) or k_dtype == torch.float32 or (k_cast and q_dtype == torch.float32)
    max_q = args.max_seqlen_q if args.max_seqlen_q is not None else -(-num_tokens // max(batch, 1))
    rows = max(1, int(max_q)) * heads
    bm = cfg.block_m or (16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else PREFILL_BM)
    bk = cfg.block_k or (128 if dim <= 128 else 64)
    if dot_fp32 and not cfg.block_k and not interpreting():
        bk = 64  # fp32 tiles: keep the shared-memory stage within bounds
    ch = max(bk, args.block_size)
    key_major = cfg.key_major if cfg.key_major is not None else fp8_dot and bm <= KEY_MAJOR_MAX_BM
    key_major = bool(key_major) and ch // args.block_size == 1
    num_splits = cfg.num_splits
    if num_splits is None:
        # Enough programs to fill the GPU; the real tile count is about
        # max(rows / BM, sequences with queries).
        est = max(-(-num_tokens * heads // bm), min(batch, num_tokens), 1)
        target = PROGRAMS_PER_SM * num_sms(args.index_q.device, cpu_default=2)
        cap_chunks = -(-args.block_tables.shape[1] * page_size // ch)
        most = max(1, min(cap_chunks // MIN_CHUNKS_PER_SPLIT, MAX_KEY_SPLITS))
        num_splits = 1 if est >= target else min(-(-target // est), most)
    return IndexPlan(
        bm=bm, bk=bk, ch=ch, num_splits=num_splits, key_major=key_major, dot_fp32=dot_fp32,
        k_cast=k_cast and not dot_fp32, tiles=(num_tokens * heads) // bm + batch,
    )


def metadata(args: IndexArgs):
    """(index_q, index_k_cache, per-token scales or None, block tables, cu_seqlens_q, used_kv_lens)
    as the kernels read them: unit inner strides, int32 metadata."""
    bt, cu, kv = contiguous(args.block_tables, args.cu_seqlens_q, args.used_kv_lens)
    cu, kv, bt = (t if t.dtype == torch.int32 else t.to(torch.int32) for t in (cu, kv, bt))
    k = args.index_k_cache if args.index_k_cache.stride(2) == 1 else args.index_k_cache.contiguous()
    scale = args.index_k_scale if args.token_scales else None
    if scale is not None and scale.stride(1) != 1:
        scale = scale.contiguous()
    return args.index_q.contiguous(), k, scale, bt, cu, kv
