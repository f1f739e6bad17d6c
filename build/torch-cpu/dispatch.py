"""Which implementation runs a call: the one place that chooses.

* torch or Triton: the Triton kernels on CUDA tensors, the torch stages elsewhere.
  ``M3_SPARSE_IMPL=torch`` / ``=triton`` (or a config's ``impl``) pins one; the Triton
  kernels run on the CPU only under ``TRITON_INTERPRET=1``. A pinned choice is never
  changed behind the caller's back: a call the kernel cannot take raises instead.
* the dense op's third kernel, flash-attn-4, wherever it is installed and takes the call
  (``dense_kernel``); ``M3_SPARSE_DENSE_IMPL`` (or ``DenseConfig.impl``) pins one of the
  three for that op alone.
* per kernel, why it cannot take a call (``*_unsupported``), and on sm_90 which of two
  kernels of a stage runs (``index_engine``, ``partials_engine``);
* the decode / KV-outer crossover of ``sparse_attention`` (``decode_max_queries``);
* the workspace slices of a long KV-outer call (``chunk_tokens``).

Every choice reads host-side facts only (shapes, dtypes, the device's capability), so a
captured CUDA graph keeps it and nothing here synchronizes with the GPU.
"""

from __future__ import annotations

import os

import torch

from .core.args import AttnArgs, IndexArgs
from .core.launch import interpreting
from .decode import plan as decode_plan
from .dense import attention_fa4 as dense_fa4
from .dense import plan as dense_plan
from .index import plan as index_plan
from .index import topk_gluon_sm90 as index_gluon
from .kvouter import partials_gluon_sm90 as partials_gluon
from .kvouter import plan as kvouter_plan

IMPLS = ("auto", "torch", "triton")


def requested_impl(impl: str = "auto") -> str:
    """``impl`` when it pins one, else ``M3_SPARSE_IMPL`` (default "auto")."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    env = os.environ.get("M3_SPARSE_IMPL", "auto").strip().lower() or "auto"
    if env not in IMPLS:
        raise ValueError(f"M3_SPARSE_IMPL: expected one of {IMPLS}, got {env!r}")
    return env


def use_triton(t: torch.Tensor, unsupported: str | None = None, impl: str = "auto") -> bool:
    """Whether to run the Triton kernel for tensor ``t``.

    ``unsupported``: why the kernel cannot take the call (None if it can). In the
    automatic mode such a call runs the torch code, which takes every valid call;
    pinned to Triton it raises instead.
    """
    chosen = requested_impl(impl)
    if chosen == "torch":
        return False
    if chosen == "triton":
        asked = "impl='triton'" if impl == "triton" else "M3_SPARSE_IMPL=triton"
        if t.device.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"{asked}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU), "
                f"got tensors on {t.device}"
            )
        if unsupported is not None:
            raise ValueError(f"{asked}: {unsupported}")
        return True
    return t.device.type == "cuda" and unsupported is None


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# --------------------------------------------------------------------------- index branch
PREP_MAX_DIM = 256  # the prep kernel holds a token's heads x head dim in registers


def prep_unsupported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the index-prep kernel cannot take a checked call (None if it can)."""
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"index_prep kernel: q dtype {q.dtype} (bfloat16, float16 or float32)"
    if q.shape[3] > PREP_MAX_DIM or q.shape[2] * q.shape[3] > 64 * 128:
        return f"index_prep kernel: {q.shape[2]} heads x head dim {q.shape[3]} do not fit one program"
    for name, t in (("q", q), ("k", k)):
        if t.stride(-1) != 1 or (t.shape[1] > 1 and t.stride(0) != t.shape[1] * t.stride(1)):
            return f"index_prep kernel: {name} must be contiguous over (batch, tokens) with a unit last stride"
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        return "index_prep kernel: cos and sin need the same strides and a unit last stride"
    return None


def index_unsupported(args: IndexArgs) -> str | None:
    return index_plan.shape_reason(args.index_q, args.index_k_cache, args.topk, args.block_size)


def index_engine(args: IndexArgs, cfg: index_plan.IndexConfig, plan: index_plan.IndexPlan) -> str:
    """"tma" (the Gluon kernel, sm_90) or "triton" (the tl kernel) for a planned call.
    ``engine="auto"`` takes the Gluon kernel only where it measured faster: fp8 keys under
    one scale with the fp8 dot (docs/PERF.md, index branch)."""
    if cfg.engine == "triton":
        why = "engine='triton'"
    elif cfg.tl_settings:
        why = "launch settings of the tl kernel given"
    elif cfg.engine == "auto" and not (args.fp8_dot and not args.token_scales):
        why = "engine='auto' keeps the tl kernel for bf16 / fp16 keys and per-token fp8 scales (it is faster there)"
    else:
        why = index_gluon.unsupported_reason(
            args.index_q, args.index_k_cache, block_size=args.block_size, fp8_dot=args.fp8_dot,
            token_scales=args.index_k_scale if args.token_scales else None, bm=plan.bm,
            num_splits=plan.num_splits, key_major=plan.key_major,
        )
    if why is None:
        return "tma"
    if cfg.engine == "tma":
        raise ValueError(f"engine='tma': the Gluon index kernel does not run this call: {why}")
    return "triton"


# --------------------------------------------------------------------------- sparse attention
def kvouter_unsupported(args: AttnArgs) -> str | None:
    if not _is_pow2(args.block_size) or args.block_size < 16:
        return f"the Triton KV-outer kernel needs block_size a power of two >= 16, got {args.block_size}"
    for name, t in (("q", args.q), ("k_cache", args.k_cache), ("v_cache", args.v_cache)):
        if t.stride(-1) != 1:
            return f"the Triton KV-outer kernel needs {name} with a contiguous head dim (stride 1), got stride {t.stride(-1)}"
    return None


def tma_partials_reason(
    q, k_cache, v_cache, block_size, out_dtype, scales, tile_q, partial_rows, partial_dtype=None,
    cfg: kvouter_plan.KVOuterConfig = kvouter_plan.DEFAULT_CONFIG,
) -> str | None:
    """Why the partials of such a call would not run the TMA kernel under ``cfg`` (None when
    they would): the one rule, for the launch and for ``decode_max_queries``."""
    if cfg.engine == "triton":
        return "engine='triton'"
    if cfg.tl_settings:
        return "num_warps / num_stages / maxnreg set the 'triton' kernel"
    return partials_gluon.unsupported_reason(
        q, k_cache, v_cache, block_size, out_dtype, scales, tile_q, partial_rows, partial_dtype
    )


def partials_engine(args: AttnArgs, cfg: kvouter_plan.KVOuterConfig, tile_q: int, capacity: int) -> str:
    """"tma" or "triton": the kernel that runs the KV-outer partials of a call whose index
    holds ``capacity`` entries. ``engine="tma"`` on a call it cannot take raises why."""
    why = tma_partials_reason(
        args.q, args.k_cache, args.v_cache, args.block_size, args.out_dtype, args.scales, tile_q,
        capacity * args.group, args.partial_dtype, cfg,
    )
    if why is None:
        return "tma"
    if cfg.engine == "tma":
        raise ValueError(f"engine='tma': {why}")
    return "triton"


def decode_unsupported(args: AttnArgs) -> str | None:
    return decode_plan.shape_reason(args)


def dense_unsupported(args: AttnArgs) -> str | None:
    return dense_plan.shape_reason(args)


DENSE_IMPLS = IMPLS + ("fa4",)


def requested_dense_impl(impl: str = "auto") -> tuple[str, str]:
    """(the dense op's pinned kernel or "auto", who asked for it): ``impl`` when it pins
    one, else ``M3_SPARSE_DENSE_IMPL``, else ``M3_SPARSE_IMPL``."""
    if impl not in DENSE_IMPLS:
        raise ValueError(f"impl: expected one of {DENSE_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl, f"impl={impl!r}"
    env = os.environ.get("M3_SPARSE_DENSE_IMPL", "auto").strip().lower() or "auto"
    if env not in DENSE_IMPLS:
        raise ValueError(f"M3_SPARSE_DENSE_IMPL: expected one of {DENSE_IMPLS}, got {env!r}")
    if env != "auto":
        return env, f"M3_SPARSE_DENSE_IMPL={env}"
    chosen = requested_impl()
    return chosen, f"M3_SPARSE_IMPL={chosen}"


def dense_kernel(args: AttnArgs, cfg: dense_plan.DenseConfig) -> str:
    """The kernel that runs a dense call: "fa4", "triton" or "torch".

    Unpinned, on CUDA: flash-attn-4 where it takes the call and ``dense_plan.prefers_fa4``
    (a measured rule) picks it, else the Triton kernel where it takes the call, else torch.
    fp8 caches go to flash-attn-4 only when pinned: its fp8 path (sm_100) is compiled in the
    tests but has not run on hardware. Pinned to "fa4", a call flash-attn-4 cannot run (not
    installed, fp8 on sm_90, another GPU) raises the reason; "triton" and "torch" behave as
    ``use_triton`` says."""
    chosen, asked = requested_dense_impl(cfg.impl)
    if chosen == "fa4":
        why = dense_fa4.unsupported_reason(args)
        if why is not None:
            raise ValueError(f"{asked}: {why}")
        return "fa4"
    if (
        chosen == "auto"
        and args.q.device.type == "cuda"
        and not args.kv_fp8
        and dense_plan.prefers_fa4(args)
        and dense_fa4.unsupported_reason(args) is None
    ):
        return "fa4"
    return "triton" if use_triton(args.q, dense_unsupported(args), chosen) else "torch"


# Query rows per sequence up to which the query-outer decode kernel beats KV-outer, measured
# on the H200 at M3's shapes against each partials kernel (docs/PERF.md, "Decode / KV-outer
# crossover"): where KV-outer runs the TMA partials kernel (sm_90) ...
DECODE_MAX_QUERIES = 96
# ... and where it runs the tl kernel (other GPUs, shapes the TMA kernel does not take).
# A bf16 q over fp8 pages takes the bf16 bound; its own crossover was not measured.
DECODE_MAX_QUERIES_TL = 256


def decode_max_queries(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
                       out_dtype: torch.dtype | None = None) -> int:
    """The row bound of ``sparse_attention`` for these inputs (host-side: shapes, dtypes and
    the device's capability): the KV-outer partials kernel that would run decides it."""
    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.ndim != 4 or not k_cache.shape[1]:
        return DECODE_MAX_QUERIES_TL  # the op that runs names what is wrong with them
    fp8 = torch.float8_e4m3fn
    if out_dtype is None and q.dtype == fp8:
        out_dtype = torch.bfloat16  # check_quant's default
    # fp8 inputs come with scales (check_quant makes them); only their presence matters here.
    scales = True if fp8 in (q.dtype, k_cache.dtype) else None
    tile_q = kvouter_plan.default_tile_q(q.shape[1] // k_cache.shape[1])
    why = tma_partials_reason(q, k_cache, v_cache, block_size, out_dtype, scales, tile_q, 0)
    return DECODE_MAX_QUERIES if why is None else DECODE_MAX_QUERIES_TL


def runs_decode(args: AttnArgs) -> bool:
    """Whether ``sparse_attention`` runs the decode kernel (else KV-outer) for this call:
    ``args.max_seqlen_q`` (or the query count) rows per sequence at most the bound."""
    rows = args.rows_per_seq
    if rows <= min(DECODE_MAX_QUERIES, DECODE_MAX_QUERIES_TL):
        return True  # within either bound (decode steps): which partials kernel would run does not matter
    return rows <= decode_max_queries(args.q, args.k_cache, args.v_cache, args.block_size, args.out_dtype)


# --------------------------------------------------------------------------- workspace slices
# Partial-buffer budget of one KV-outer call; longer prompts run in query slices.
DEFAULT_WORKSPACE_BYTES = 4 << 30


def chunk_tokens(num_tokens: int, slots: int, group: int, d: int, elem_bytes: int, budget: int) -> int:
    """Query rows per KV-outer slice: the partials of one row (``slots`` = Hkv * topk
    entries of G rows of D values plus fp32 m and l) times the rows stay within
    ``budget`` bytes, at least one row."""
    per_token = max(1, slots * group * (d * elem_bytes + 8))
    return max(1, min(max(num_tokens, 1), budget // per_token))


def kvouter_slices(args: AttnArgs, budget: int | None) -> int:
    """Query rows per slice of a KV-outer call under ``budget`` bytes of partials."""
    budget = DEFAULT_WORKSPACE_BYTES if budget is None else budget
    slots = args.selected.shape[1] * args.selected.shape[2]
    return chunk_tokens(args.num_tokens, slots, args.group, args.d, args.partial_dtype.itemsize, budget)
