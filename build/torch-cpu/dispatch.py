"""Which implementation runs a call: the one place that chooses.

* torch or Triton: the Triton kernels on CUDA tensors, the torch stages elsewhere.
  ``M3_SPARSE_IMPL=torch`` / ``=triton`` (or a config's ``impl``) pins one; the Triton
  kernels run on the CPU only under ``TRITON_INTERPRET=1``. A pinned choice is never
  changed behind the caller's back: a call the kernel cannot take raises instead.
* which GPUs: any CUDA GPU of compute capability 8.0 or newer runs the Triton ``tl``
  kernels; the Gluon kernels run on sm_90 only, TMA key tiles from sm_90 on, fp8 inputs
  (e4m3 caches, queries, partials, index keys, the fp8 dot) from sm_89 on, flash-attn-4 on
  sm_90 / sm_100 (``dense/attention_fa4.py``). A GPU below 8.0, or fp8 inputs on an
  sm_80 / sm_86 / sm_87, raise :class:`UnsupportedGPUError` unless the torch code is pinned
  (``gpu_unsupported``). The capability comes from ``core.launch.device_capability``, which
  ``M3_SPARSE_CAPABILITY`` overrides for tests.
* the dense op's third kernel, flash-attn-4, wherever it is installed and takes the call
  (``dense_kernel``); ``M3_SPARSE_DENSE_IMPL`` (or ``DenseConfig.impl``) pins one of the
  three for that op alone. A prefill with no history whose new K/V the integration holds
  contiguous runs on torch's fused sdpa where the op would run its Triton kernel
  (``sdpa_prefill_reason``).
* per kernel, why it cannot take a call (``*_unsupported``), and on sm_90 which of two
  kernels of a stage runs (``index_engine``, ``partials_engine``);
* the decode / KV-outer crossover of ``sparse_attention`` (``decode_max_queries``), and
  which sequences of a call that runs KV-outer the decode kernel takes out of it
  (``mixed_decode_rows``); past the decode bound, KV-outer or the query-outer tile kernel
  (``runs_qouter``, ``M3_SPARSE_PREFILL``);
* the workspace slices of a long KV-outer call (``chunk_tokens``).

Every choice reads host-side facts only (shapes, dtypes, the device's capability), so a
captured CUDA graph keeps it and nothing here synchronizes with the GPU.
"""

from __future__ import annotations

import os

import torch

from .core.args import AttnArgs, IndexArgs
from .core.launch import (
    FP8_CAPABILITY, MIN_CAPABILITY, device_capability, device_index, interpreting, shared_memory, sm_name,
)
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


class UnsupportedGPUError(RuntimeError):
    """No kernel of this package runs the call on its GPU: compute capability below 8.0, or
    fp8 inputs below 8.9. Raised unless the torch code is pinned (it runs anywhere, but on a
    model far slower than the kernels: the automatic mode does not fall back to it)."""


class GPURefusal(str):
    """A reason from ``*_unsupported`` that no implementation but the torch code can take
    the call on this GPU: ``use_triton`` raises it as an :class:`UnsupportedGPUError` where
    an ordinary reason would send an automatic call to the torch code."""


def gpu_unsupported(t: torch.Tensor, fp8: bool = False) -> GPURefusal | None:
    """Why the GPU kernels cannot serve a call on ``t``'s GPU at all (None if they can, and
    for tensors off CUDA or under the interpreter). ``fp8``: the call has e4m3 inputs."""
    if t.device.type != "cuda" or interpreting():
        return None
    capability = device_capability(device_index(t.device))
    if capability < MIN_CAPABILITY:
        return GPURefusal(
            f"the m3_sparse kernels need an NVIDIA GPU of compute capability 8.0 or newer (sm_80 and up: "
            f"bf16 tensor cores), {t.device} is {sm_name(capability)}; impl='torch' (M3_SPARSE_IMPL=torch) "
            "runs the much slower torch code on it"
        )
    if fp8 and capability < FP8_CAPABILITY:
        return GPURefusal(
            f"float8_e4m3fn inputs (fp8 caches, index keys or queries) need a GPU with fp8 tensor cores, "
            f"compute capability 8.9 or newer (sm_89, sm_90, sm_100, sm_120); {t.device} is {sm_name(capability)}, "
            "for which Triton has no e4m3 type. Keep the caches in bfloat16 or float16 on this GPU, or pin "
            "impl='torch' (M3_SPARSE_IMPL=torch) for the much slower torch code"
        )
    return None


def use_triton(t: torch.Tensor, unsupported: str | None = None, impl: str = "auto") -> bool:
    """Whether to run the Triton kernel for tensor ``t``.

    ``unsupported``: why the kernel cannot take the call (None if it can). In the
    automatic mode such a call runs the torch code, which takes every valid call;
    pinned to Triton it raises instead. A GPU the kernels cannot serve at all (below 8.0,
    or a :class:`GPURefusal`) raises :class:`UnsupportedGPUError` unless torch is pinned.
    """
    chosen = requested_impl(impl)
    if chosen == "torch":
        return False
    refusal = unsupported if isinstance(unsupported, GPURefusal) else gpu_unsupported(t)
    if refusal is not None:
        raise UnsupportedGPUError(refusal)
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
    return gpu_unsupported(args.index_q, args.fp8) or index_plan.shape_reason(
        args.index_q, args.index_k_cache, args.topk, args.block_size
    )


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
def _attention_fp8(args: AttnArgs) -> bool:
    """Whether an attention call has e4m3 inputs (q, caches, or partials, which need e4m3 caches)."""
    return args.q_fp8 or args.kv_fp8


def kvouter_unsupported(args: AttnArgs) -> str | None:
    refusal = gpu_unsupported(args.q, _attention_fp8(args))
    if refusal is not None:
        return refusal
    if not _is_pow2(args.block_size) or args.block_size < 16:
        return f"the Triton KV-outer kernel needs block_size a power of two >= 16, got {args.block_size}"
    for name, t in (("q", args.q), ("k_cache", args.k_cache), ("v_cache", args.v_cache)):
        if t.stride(-1) != 1:
            return f"the Triton KV-outer kernel needs {name} with a contiguous head dim (stride 1), got stride {t.stride(-1)}"
    return _kvouter_memory_reason(args)


def _kvouter_memory_reason(args: AttnArgs) -> str | None:
    """Why KV-outer's tl kernel cannot hold this call's block in the GPU's shared memory (the
    interpreter has no such limit)."""
    if args.q.device.type != "cuda" or interpreting():
        return None
    return kvouter_plan.shared_memory_reason(args, shared_memory(args.q.device))


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
    return gpu_unsupported(args.q, _attention_fp8(args)) or decode_plan.shape_reason(args)


def dense_unsupported(args: AttnArgs) -> str | None:
    return gpu_unsupported(args.q, _attention_fp8(args)) or dense_plan.shape_reason(args)


# The query-outer tile kernel is the dense kernel's sparse mode (its shape reasons cover both).
qouter_unsupported = dense_unsupported


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


def sdpa_prefill_reason(q: torch.Tensor, k: torch.Tensor, kernel: str, cfg: dense_plan.DenseConfig,
                        kv_fp8: bool) -> str | None:
    """Why a causal dense prefill with no history and no padding, whose new K/V are at hand
    as contiguous ``[B, Hkv, S, D]`` tensors, does not run on torch's fused sdpa kernels
    (``dense/attention_sdpa.py``) instead of ``kernel``, the dense op's choice for the same
    call over the pages; None when it does.

    It does where the op would run its Triton kernel unpinned: on CUDA, without
    flash-attn-4 taking the call (its prefill beats cuDNN), bf16 or fp16 pages, and a fused
    sdpa kernel (cuDNN, flash or memory-efficient, never the math path's ``[Hq, S, S]``
    scores) that takes these shapes. cuDNN on contiguous K/V beat the Triton kernel on the
    pages at 32K and 128K (docs/PERF.md, "Dense paged attention"). Host facts only."""
    if kernel != "triton":
        return f"the dense op runs {kernel!r}"
    if requested_dense_impl(cfg.impl)[0] != "auto":
        return "the dense kernel is pinned"
    if q.device.type != "cuda" or interpreting():
        return "not on CUDA"
    if kv_fp8:
        return "fp8 pages: the attention reads what they hold"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype:
        return f"{q.dtype} queries and {k.dtype} keys (measured: bf16)"
    from torch.backends import cuda as backends

    params = backends.SDPAParams(q, k, k, None, 0.0, True, q.shape[1] != k.shape[1])
    checks = ("can_use_cudnn_attention", "can_use_flash_attention", "can_use_efficient_attention")
    if not any(getattr(backends, check, lambda *_: False)(params, False) for check in checks):
        return "no fused sdpa kernel takes these shapes"
    return None


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
    ``args.max_seqlen_q`` (or the query count) rows per sequence at most the bound, or a
    call whose block KV-outer cannot hold in this GPU's shared memory."""
    rows = args.rows_per_seq
    if rows <= min(DECODE_MAX_QUERIES, DECODE_MAX_QUERIES_TL):
        return True  # within either bound (decode steps): which partials kernel would run does not matter
    if rows <= decode_max_queries(args.q, args.k_cache, args.v_cache, args.block_size, args.out_dtype):
        return True
    # Where KV-outer's block does not fit the GPU's shared memory (fp32 on a 99 KB GPU) the
    # decode kernel, which streams each block in chunks, runs the call rather than torch.
    return _kvouter_memory_reason(args) is not None and decode_unsupported(args) is None


# Past the decode bound, ``sparse_attention`` runs KV-outer or the query-outer tile kernel
# (``api.qouter_attention``). The tile kernel moves no partials through memory but does the
# work of its tile's union of blocks, which depends on how alike neighbouring tokens choose:
# data the host never reads. ``M3_SPARSE_PREFILL`` picks one; "auto" keeps KV-outer for every
# call: measured against it (benchmarks/bench_kvouter.py times both; docs/PERF.md), the tile
# kernel was faster at no size or selection pattern, since every row computes its tile's union.
PREFILL_KERNELS = ("auto", "kvouter", "qouter")


def requested_prefill() -> str:
    """``M3_SPARSE_PREFILL`` (default "auto"), checked."""
    env = os.environ.get("M3_SPARSE_PREFILL", "auto").strip().lower() or "auto"
    if env not in PREFILL_KERNELS:
        raise ValueError(f"M3_SPARSE_PREFILL: expected one of {PREFILL_KERNELS}, got {env!r}")
    return env


def runs_qouter(args: AttnArgs) -> bool:
    """Whether ``sparse_attention`` runs a call past the decode bound (``runs_decode`` is
    False) on the query-outer tile kernel rather than KV-outer: where ``M3_SPARSE_PREFILL=qouter``
    asks for it. On CUDA a call the kernel cannot take then raises why (a pinned choice is
    never changed behind the caller's back); off CUDA the torch code runs either way."""
    if requested_prefill() != "qouter":
        return False
    if args.q.device.type == "cuda" and requested_impl() != "torch":
        why = qouter_unsupported(args)
        if why is not None and not isinstance(why, GPURefusal):  # a refusal raises at the launch
            raise ValueError(f"M3_SPARSE_PREFILL=qouter: {why}")
    return True


# Query rows of a sequence up to which the decode kernel runs it when other sequences of the
# same call run KV-outer: the decode rows of a serving step, beside its prefill chunks. Each
# sequence gets this many programs per kv head and split, most of them empty (a decode row is
# one token), so the bound stays small; longer short sequences stay with KV-outer.
MIXED_DECODE_ROWS = 4


def mixed_decode_rows(args: AttnArgs) -> int:
    """For a ``sparse_attention`` call that runs KV-outer (``runs_decode`` is False): the
    query rows per sequence up to which a sequence runs the decode kernel instead
    (``MIXED_DECODE_ROWS``), or 0 where every row runs KV-outer: a call of one sequence, one
    the decode kernel cannot take, or one the torch code runs (it computes each row on its
    own whichever way)."""
    if args.batch < 2 or decode_unsupported(args) is not None:
        return 0
    return MIXED_DECODE_ROWS if use_triton(args.q, kvouter_unsupported(args)) else 0


# --------------------------------------------------------------------------- workspace slices
# Partial-buffer budget of one KV-outer call; longer prompts run in query slices.
DEFAULT_WORKSPACE_BYTES = 4 << 30


def partial_bytes_per_row(slots: int, group: int, d: int, elem_bytes: int) -> int:
    """Bytes of KV-outer partials one query row takes: ``slots`` = Hkv * topk entries, each
    of G query heads with D values of ``elem_bytes`` plus fp32 m and l."""
    return slots * group * (d * elem_bytes + 8)


def chunk_tokens(num_tokens: int, slots: int, group: int, d: int, elem_bytes: int, budget: int) -> int:
    """Query rows per KV-outer slice: the partials of one row (``partial_bytes_per_row``)
    times the rows stay within ``budget`` bytes, at least one row."""
    per_token = max(1, partial_bytes_per_row(slots, group, d, elem_bytes))
    return max(1, min(max(num_tokens, 1), budget // per_token))


def kvouter_slices(args: AttnArgs, budget: int | None) -> int:
    """Query rows per slice of a KV-outer call under ``budget`` bytes of partials."""
    budget = DEFAULT_WORKSPACE_BYTES if budget is None else budget
    slots = args.selected.shape[1] * args.selected.shape[2]
    return chunk_tokens(args.num_tokens, slots, args.group, args.d, args.partial_dtype.itemsize, budget)
