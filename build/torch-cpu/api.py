"""The public ops of ``m3_sparse``: check the arguments once, plan, dispatch.

Each op builds its argument object (``core.validate``: shapes, dtypes, devices, and on the
CPU or with ``M3_SPARSE_DEBUG=1`` the values of ids, lengths and page tables), asks
``dispatch`` which implementation runs, and hands the object to it. Nothing here copies
device data to the host. The attention ops share one parameter list
(``_attention_parameters``); :func:`attention_op` gives each op the part that applies to it
and checks a call into its ``AttnArgs`` before the op's body runs.

Layouts: queries are token-major ``[Tq, H, D]``; K/V caches are page pools
``[pages, Hkv, page_size, D]`` with ``block_tables [B, max_pages]``; ``cu_seqlens_q [B + 1]``
and ``used_kv_lens [B]`` (tokens cached per sequence, the new queries included: they are
the last ones, right aligned) describe the varlen batch (``core.layout``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging

import torch

from . import dispatch
# Raised where a GPU cannot run a call (its compute capability); re-exported by the package.
from .dispatch import UnsupportedGPUError  # noqa: F401
from .core.args import AttnArgs, IndexArgs, released, tensor_meta
from .core.launch import StreamBuffers, compile_ahead, compile_ahead_on, rows_bucket
from .core.layout import chunk_varlen, token_positions, token_seq_ids
from .core.validate import attention_args, check_key_rows, check_positive_int, check_tensor, index_args
from .decode.attention import sparse_decode_attention_torch
from .decode.plan import DEFAULT_CONFIG as DECODE_DEFAULTS
from .decode.plan import DecodeConfig
from .dense.attention import dense_paged_attention_torch
from .dense.attention_sdpa import causal_prefill_sdpa  # noqa: F401 - the integration's, with sdpa_prefill_reason
from .dense.plan import DEFAULT_CONFIG as DENSE_DEFAULTS
from .dense.plan import DenseConfig
from .index.plan import DEFAULT_CONFIG as INDEX_DEFAULTS
from .index.plan import IndexConfig
from .index.prep import index_prep_torch
from .index.topk import index_topk_torch
from .kvouter.build import build_kvouter_index
from .kvouter.combine import combine_torch, merge_scale
from .kvouter.partials import partials_args, partials_torch
from .kvouter.plan import DEFAULT_CONFIG as KVOUTER_DEFAULTS
from .kvouter.plan import KVOuterConfig, default_tile_q

_log = logging.getLogger("m3_sparse")

# The GPU launchers (``*_triton``, ``*_gluon_sm90``) import Triton, which a CPU install need not
# have: each GPU path below imports its launchers when it first runs.


def _attention_parameters(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    max_seqlen_q: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    page_size: int | None = None,
    block_size: int = 128,
    return_lse: bool = False,
    q_scale: float | torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    partial_dtype: torch.dtype | None = None,
):
    """The parameters the attention ops share, written once: each op takes those that apply
    to it (:func:`attention_op`). Never called."""


_SHARED = tuple(inspect.signature(_attention_parameters).parameters.values())
_SPARSE_ONLY = ("selected", "page_size", "block_size", "partial_dtype")


def attention_op(*, without: tuple[str, ...] = ()):
    """Make ``body(args, *, <own keywords>)`` a public attention op.

    The op's signature is the shared parameters less ``without``, then ``body``'s own
    keyword-only parameters (``config``, ...). A call is bound to that signature, checked
    once into an :class:`AttnArgs` (sparse unless ``selected`` is left out) and handed to
    ``body`` with the own keywords.
    """

    def wrap(body):
        body_sig = inspect.signature(body)
        own = tuple(body_sig.parameters.values())[1:]
        sig = inspect.Signature(
            [p for p in _SHARED if p.name not in without] + list(own), return_annotation=body_sig.return_annotation
        )
        params = sig.parameters.values()
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        defaults = {p.name: p.default for p in params if p.default is not p.empty}
        names, own_names = sig.parameters.keys(), tuple(p.name for p in own)
        sparse = "selected" not in without
        # An op that launches kernels compiles its first calls' kernels ahead (a plan maker launches none).
        ahead = not body.__name__.startswith("plan_")

        @functools.wraps(body)
        def op(*args, **kwargs):
            # Bound by hand: ``sig.bind`` is slow for a call every layer makes at every step.
            by_position = dict(zip(positional, args))
            given = {**defaults, **by_position, **kwargs}
            if len(args) > len(positional) or given.keys() != names or not by_position.keys().isdisjoint(kwargs):
                sig.bind(*args, **kwargs)  # raises the TypeError
            own_kwargs = {name: given.pop(name) for name in own_names}
            checked = attention_args(**given, sparse=sparse)
            if not ahead:
                return body(checked, **own_kwargs)
            key = lambda: (body.__name__, checked.ahead_key, *own_kwargs.items())  # noqa: E731
            return compile_ahead(key, checked.q.device, body, checked, **own_kwargs)

        op.__signature__ = sig
        return op

    return wrap


# --------------------------------------------------------------------------- index branch
def index_prep(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    impl: str = "auto",
    k_out: torch.Tensor | None = None,
    k_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The index queries and key of M3's index branch, normed and rotated: per-head RMSNorm
    with a ``1 + weight`` gain, then the rotary embedding of the first ``R`` dims (halves
    rotated), rounded to the inputs' dtype where the model rounds (``index/prep.py``).

    q: [B, S, Hi, D] and k: [B, S, D], the projections; q_weight / k_weight: [D] norm
    weights; cos / sin: [B or 1, S, R] (R even, at most D) in the inputs' dtype.
    Returns (q, k) of the same shapes, contiguous. On CUDA one Triton launch
    (``index/prep_triton.py``); ``impl`` pins "torch" or "triton" as for the other ops.

    ``k_out`` [N, D] (k's dtype, unit last stride) with ``k_rows`` [B * S] (int32 / int64,
    rows in ``[0, N)``): the key of token ``(b, s)`` is written to row ``k_rows[b * S + s]``
    of ``k_out`` instead (an index-key page pool seen as rows), and ``(q, k_out)`` is
    returned.
    """
    check_tensor("q", q, ndim=4)
    device, (batch, seq, _, d) = q.device, q.shape
    for name, t, shape in (("k", k, (batch, seq, d)), ("q_weight", q_weight, (d,)), ("k_weight", k_weight, (d,))):
        check_tensor(name, t, device=device)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=3, dtypes=(q.dtype,), device=device)
        if t.shape[0] not in (1, batch) or t.shape[1] != seq or t.shape[2] % 2 or t.shape[2] > d:
            raise ValueError(
                f"{name}: expected shape [1 or {batch}, {seq}, R] with R even and at most {d}, got {tuple(t.shape)}"
            )
    if k.dtype != q.dtype:
        raise ValueError(f"k: expected q's dtype {q.dtype}, got {k.dtype}")
    if (k_out is None) != (k_rows is None):
        raise ValueError("k_out and k_rows: pass both (write the keys into rows of k_out) or neither")
    if k_out is not None:
        check_key_rows(k_out, k_rows, batch * seq, d, k.dtype, device)
    if dispatch.use_triton(q, dispatch.prep_unsupported(q, k, cos, sin), impl):
        from .index import prep_triton

        key = lambda: ("index_prep", q.dtype, tuple(q.shape[2:]), tuple(cos.shape[2:]), k_out is not None,  # noqa: E731
                       rows_bucket(seq))
        return compile_ahead(
            key, device, prep_triton.index_prep_triton, q, k, q_weight, k_weight, cos, sin, eps, k_out, k_rows
        )
    q, k = index_prep_torch(q, k, q_weight, k_weight, cos, sin, eps)
    if k_out is None:
        return q, k
    return q, k_out.index_copy_(0, k_rows, k.reshape(-1, d))


def index_topk(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    used_kv_lens: torch.Tensor,
    topk: int,
    block_size: int = 128,
    local_blocks: int = 1,
    max_seqlen_q: int | None = None,
    index_k_scale: torch.Tensor | None = None,
    fp8_dot: bool = False,
    config: IndexConfig | None = None,
) -> torch.Tensor:
    """Select ``topk`` key blocks per (query token, index head).

    index_q: [Tq, Hi, Di] token-major index queries (already normed and rotated);
    index_k_cache: [pages, page_size, Di] the single shared index-key head, paged
    (bf16/fp16/fp32, or float8_e4m3fn codes with ``index_k_scale``).
    Returns ``selected`` [Tq, Hi, topk] int32, ``-1`` in unused slots: the ``local_blocks``
    blocks ending at the query's own block, then the best earlier blocks by max-pooled
    score (ties to the lower id). ``max_seqlen_q`` (host int, optional) only tunes the
    GPU kernel's tiling.

    index_k_scale: fp32, required with an fp8 ``index_k_cache`` and rejected otherwise:
    per token, ``[pages, page_size]``, or per tensor, one element (every key times the same
    positive finite scale; the GPU kernel then skips the per-score multiply: faster, same
    ranking). fp8_dot: fp8 caches only, read by the kernels alone: the query rows are
    quantized to e4m3 as well so the scores run on the fp8 tensor cores (faster prefill,
    noisier ranking); the torch path always scores the exact query against the
    dequantized keys. ``config``: launch choices (``IndexConfig``).
    """
    args = index_args(
        index_q, index_k_cache, block_tables, cu_seqlens_q=cu_seqlens_q, used_kv_lens=used_kv_lens, topk=topk,
        block_size=block_size, local_blocks=local_blocks, max_seqlen_q=max_seqlen_q, index_k_scale=index_k_scale,
        fp8_dot=fp8_dot,
    )
    cfg = config or INDEX_DEFAULTS
    return compile_ahead(lambda: ("index_topk", args.ahead_key, cfg), args.index_q.device, _index_topk, args, cfg)


def _index_topk(args: IndexArgs, cfg: IndexConfig) -> torch.Tensor:
    return PlannedIndexTopk(args, cfg).planned_call()


def plan_index_topk(*args, **kwargs) -> PlannedIndexTopk:
    """:func:`index_topk`'s checks, kernel choice and launch set-up, once: the returned
    plan's ``run(index_q, index_k_cache, index_k_scale=None)`` answers what ``index_topk``
    would for index queries and a key pool (and its scales) of these shapes, strides and
    dtypes, with this call's block tables, ``cu_seqlens_q`` and ``used_kv_lens`` (read in
    place at every run: contiguous int32 tensors, updated in place between runs, as a paged
    cache does). The layers of a decode step make the same call on their own pools: plan
    once per step, run per layer. Same arguments as :func:`index_topk`."""
    bound = _INDEX_TOPK.bind(*args, **kwargs)
    bound.apply_defaults()
    params = dict(bound.arguments)
    config = params.pop("config")
    checked = index_args(**params)
    _check_plan_metadata(checked.block_tables, checked.cu_seqlens_q, checked.used_kv_lens)
    return PlannedIndexTopk(checked, config or INDEX_DEFAULTS)


_INDEX_TOPK = inspect.signature(index_topk)
plan_index_topk.__signature__ = _INDEX_TOPK.replace(return_annotation="PlannedIndexTopk")


def _check_plan_metadata(*tensors: torch.Tensor) -> None:
    """A plan reads the batch's metadata in place at every run, so it takes no copy of them."""
    for name, t in zip(("block_tables", "cu_seqlens_q", "used_kv_lens"), tensors):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(
                f"{name}: a plan reads it in place at every run and needs a contiguous int32 tensor, got "
                f"{str(t.dtype).replace('torch.', '')} with strides {t.stride()}"
            )


def _check_like(planned: tuple, given: tuple) -> None:
    """Each run tensor has the planned call's shape, strides, dtype and device (``tensor_meta``)."""
    for (name, want), t in zip(planned, given):
        if (t is None and want is not None) or (t is not None and not isinstance(t, torch.Tensor)):
            raise ValueError(f"{name}: expected a tensor like the planned call's, got {type(t).__name__}")
        got = tensor_meta(t)
        if got != want:
            raise ValueError(f"{name}: the plan was made for {_shown(want)}; got {_shown(got)}")


def _shown(meta: tuple | None) -> str:
    return "None" if meta is None else f"shape {tuple(meta[0])}, strides {meta[1]}, {meta[2]} on {meta[3]}"


class _Plan:
    """An op's checked call (``args``), its kernel chosen and its launch set up. A subclass's
    ``run`` takes tensors in the place of the call's ``RUN_TENSORS``, checks them against the
    planned ones (``_check_like``) and hands them to its ``_call``."""

    RUN_TENSORS: tuple[str, ...] = ()

    @functools.cached_property
    def _metas(self) -> tuple:
        # Made on the first run: an op call, which builds a plan for one call, never needs them.
        return tuple((name, tensor_meta(getattr(self.args, name))) for name in self.RUN_TENSORS)

    def planned_call(self):
        """The result of the call the plan was made from."""
        return self._call(*(getattr(self.args, name) for name in self.RUN_TENSORS))

    def release(self, keep_scratch: bool = True) -> "_Plan":
        """Let go of the planned call's run tensors (a prefill's queries and selections): the
        plan and its launch keep stand-ins of their shapes, dtypes and devices, and every run
        brings its own tensors. A plan kept across calls then holds no buffer of the call's
        size. ``keep_scratch=False``: its launch's scratch buffers (split workspaces, arrival
        counts) are made at every run, as an op call makes them, rather than kept between
        runs. ``planned_call`` has nothing to run after this. Returns the plan."""
        self._metas, self._ahead_key  # noqa: B018 - made from the real tensors first
        self.args = released(self.args, self.RUN_TENSORS)
        launch = getattr(self, "_launch", None)
        if launch is not None:
            launch.args = released(launch.args, self.RUN_TENSORS)
            if not keep_scratch:
                for buffers in vars(launch).values():
                    if isinstance(buffers, StreamBuffers):
                        buffers.stop_keeping()
        return self

    @functools.cached_property
    def _ahead_key(self) -> tuple:
        return type(self).__name__, self.args.ahead_key

    # Whether runs go through compile_ahead, read at the plan's first run rather than at every
    # run: a decode step runs one plan in each of its layers.
    _passes_on: bool | None = None

    def _ahead_call(self, *tensors):
        """``_call`` of a run, its kernels compiled ahead on the plan's first runs (``compile_ahead``)."""
        if self._passes_on is None:
            self._passes_on = compile_ahead_on(tensors[0].device)
        if not self._passes_on:
            return self._call(*tensors)
        return compile_ahead(self._ahead_key, tensors[0].device, self._call, *tensors)


class PlannedIndexTopk(_Plan):
    """:func:`index_topk` on a checked call, its kernel chosen and its launch set up
    (:func:`plan_index_topk`)."""

    RUN_TENSORS = ("index_q", "index_k_cache", "index_k_scale")

    def __init__(self, args: IndexArgs, cfg: IndexConfig):
        self.args = args
        self._launch = None  # the tl kernel's launch, set up once
        self._run = index_topk_torch  # else a function of the call's args
        if dispatch.use_triton(args.index_q, dispatch.index_unsupported(args), cfg.impl):
            from .index import plan as index_plan
            from .index import topk_gluon_sm90, topk_triton

            plan = index_plan.plan(args, cfg)
            if args.index_q.shape[0] and args.used_kv_lens.shape[0] and dispatch.index_engine(args, cfg, plan) == "tma":
                self._run = topk_gluon_sm90.index_topk_tma
            else:
                self._launch = topk_triton.TopkLaunch(args, plan, cfg)

    def run(self, index_q: torch.Tensor, index_k_cache: torch.Tensor, index_k_scale=None) -> torch.Tensor:
        """``selected`` [Tq, Hi, topk] for these tensors (like the planned call's)."""
        _check_like(self._metas, (index_q, index_k_cache, index_k_scale))
        return self._ahead_call(index_q, index_k_cache, index_k_scale)

    def _call(self, index_q, index_k_cache, index_k_scale) -> torch.Tensor:
        if self._launch is not None:
            return self._launch.run(index_q, index_k_cache, index_k_scale)
        args = self.args
        if index_q is not args.index_q or index_k_cache is not args.index_k_cache:
            args = dataclasses.replace(args, index_q=index_q, index_k_cache=index_k_cache, index_k_scale=index_k_scale)
        return self._run(args)


# --------------------------------------------------------------------------- KV-outer
@attention_op(without=("max_seqlen_q",))
def kvouter_attention(
    args: AttnArgs, *, max_workspace_bytes: int | None = None, config: KVOuterConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention, KV-outer.

    selected: [Tq, Hkv, topk] block ids of ``block_size`` keys (``-1`` = empty slot; a
    repeated id counts once). Returns (out [Tq, Hq, D], lse [Hq, Tq] fp32 or None); a query
    with no visible key outputs zeros and lse = -inf.

    CUDA tensors run the Triton stages (index builder, scheduler, partials, combine), others
    the torch stages. The partial buffer is bounded by ``max_workspace_bytes`` (default
    ``dispatch.DEFAULT_WORKSPACE_BYTES``, 4 GiB): more query rows than fit run in slices of
    rows, so memory stays linear in the prompt with a fixed constant.

    fp8: the caches may be float8_e4m3fn (both), q float8_e4m3fn or any float dtype, each
    fp8 tensor with a per-tensor dequantization scale ``q_scale`` / ``k_scale`` /
    ``v_scale`` (``real = stored * scale``; a float or a one-element tensor on the device;
    default 1). Q @ K^T runs on the fp8 values, P @ V in ``out_dtype`` (default bfloat16 for
    an fp8 q, else q's dtype), which is also the dtype of the output.

    ``partial_dtype``: the dtype of the partials between the attention and combine stages,
    ``out_dtype`` by default. With fp8 caches, ``torch.float8_e4m3fn`` stores them normalized
    (O / l in V's units) in half the bytes: the largest traffic of the op, at a larger
    error (docs/PERF.md, "e4m3 partials"). ``config``: launch choices (``KVOuterConfig``).
    """
    cfg = config or KVOUTER_DEFAULTS
    budget = max_workspace_bytes if max_workspace_bytes is not None else cfg.workspace_bytes
    if budget is not None:
        check_positive_int("max_workspace_bytes", budget)
    return _kvouter(args, cfg, budget)


def _kvouter(args: AttnArgs, cfg: KVOuterConfig, budget: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    run = _kvouter_triton if dispatch.use_triton(args.q, dispatch.kvouter_unsupported(args), cfg.impl) else _kvouter_torch
    rows = dispatch.kvouter_slices(args, budget)
    if rows >= args.num_tokens:
        return run(args, cfg)
    # Partials grow with the query rows (Tq * Hkv * topk * G * (2D + 8) bytes, 35 GB (33 GiB)
    # for 128K tokens of M3): run the query rows in slices that fit the workspace budget.
    out, lse = args.new_outputs()
    if not args.causal:
        # A bidirectional row sees its whole sequence, so a slice keeps every kv length;
        # the rows placed before the first key (which see nothing) are emptied instead.
        _, positions = token_positions(args.cu_seqlens_q, args.used_kv_lens, args.num_tokens)
    for t0 in range(0, args.num_tokens, rows):
        t1 = min(args.num_tokens, t0 + rows)
        cu_c, kv_c = chunk_varlen(args.cu_seqlens_q, args.used_kv_lens, t0, t1)
        sel_c = args.selected[t0:t1]
        if not args.causal:
            kv_c = args.used_kv_lens
            sel_c = sel_c.masked_fill((positions[t0:t1] < 0)[:, None, None], -1)
        run(args.rows(t0, t1, cu_c, kv_c, sel_c), cfg, out[t0:t1], lse[:, t0:t1] if lse is not None else None)
    return out, lse


def _kvouter_torch(args: AttnArgs, cfg: KVOuterConfig, out=None, lse=None):
    index = build_kvouter_index(
        args.selected, cu_seqlens_q=args.cu_seqlens_q, max_blocks=args.max_blocks, batch_size=args.batch
    )
    # The torch stage computes every entry directly; a GPU kernel runs them as the schedule's tiles.
    po, pm, pl = partials_torch(args, index)
    return combine_torch(po, pm, pl, index.slot_of, args.out_dtype, args.return_lse, merge_scale(po, args.scales), out, lse)


def _kvouter_triton(args: AttnArgs, cfg: KVOuterConfig, out=None, lse=None):
    return _kvouter_launch(args, cfg).run(args.q, args.k_cache, args.v_cache, args.selected, out, lse)


def _kvouter_launch(args: AttnArgs, cfg: KVOuterConfig):
    """KV-outer's launches for a call the kernels run in one piece (no slices)."""
    from .kvouter.pipeline_triton import KVOuterLaunch

    engine = dispatch.partials_engine(args, cfg, default_tile_q(args.group, cfg), args.selected.numel())
    return KVOuterLaunch(args, cfg, engine)


def _partials_gpu(args: AttnArgs, index, sched, cfg: KVOuterConfig):
    from .kvouter.pipeline_triton import run_partials

    return run_partials(args, index, sched, cfg, dispatch.partials_engine(args, cfg, sched.tile_q, index.capacity))


def kvouter_partials_gpu(
    q, k_cache, v_cache, index, sched, block_tables, *, cu_seqlens_q, used_kv_lens, softmax_scale, causal=True,
    block_size=128, scales=None, out_dtype=None, partial_dtype=None, config: KVOuterConfig | None = None,
):
    """The partials stage on the GPU kernels (the interpreter on the CPU), over a given index
    and schedule: same arguments and results as ``kvouter_partials``, the kernel chosen by
    ``config.engine`` (kernel tests and benchmarks)."""
    args = partials_args(
        q, k_cache, v_cache, index, block_tables, cu_seqlens_q=cu_seqlens_q, used_kv_lens=used_kv_lens,
        softmax_scale=softmax_scale, causal=causal, block_size=block_size, scales=scales, out_dtype=out_dtype,
        partial_dtype=partial_dtype,
    )
    return _partials_gpu(args, index, sched, config or KVOUTER_DEFAULTS)


def kvouter_bytes_per_row(num_heads: int, num_kv_heads: int, head_dim: int, topk: int, dtype: torch.dtype) -> int:
    """Bytes a KV-outer call on the kernels allocates per query row beside its output (host
    arithmetic, for sizing memory pools): the partials, one o ``[D]`` in ``dtype`` (the partial
    dtype) and fp32 m and l per (kv head, top-k slot, query head of the group), the index, 4
    int32 per (kv head, slot), and the copy of a q row ``[Hq, D]`` (in ``dtype``) that the TMA
    partials kernel makes of a transposed q (a model's batch-1 q). A call past
    ``dispatch.DEFAULT_WORKSPACE_BYTES`` of partials runs in slices: this is then an upper bound."""
    slots = num_kv_heads * topk
    index = 4 * torch.int32.itemsize * slots
    q_copy = num_heads * head_dim * dtype.itemsize
    return dispatch.partial_bytes_per_row(slots, num_heads // num_kv_heads, head_dim, dtype.itemsize) + index + q_copy


def kvouter_bytes_per_segment() -> int:
    """Bytes a KV-outer call on the kernels allocates at once per segment, a (sequence, kv
    head, key block) of the block tables' width (host arithmetic, for sizing memory pools):
    the index build's offsets, totals and per-chunk counts (a row per sequence, and one per
    chunk of a long call: two int32 counted), or after it the offsets and the schedule's tile
    bases. Segments are ``batch * Hkv * width * page_size / block_size``, whatever the
    sequences hold."""
    return 4 * torch.int32.itemsize


# --------------------------------------------------------------------------- decode
@attention_op(without=("max_seqlen_q", "partial_dtype"))
def sparse_decode_attention(
    args: AttnArgs, *, config: DecodeConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention, query-outer (decode and short chunks): each query token reads
    its own selected blocks. Same arguments and results as :func:`kvouter_attention`.

    KV-outer reads a selected block once for all the queries that chose it, which wins when
    many queries share blocks (prefill); with a few new tokens per sequence there is little
    to share, and reading each token's blocks directly skips the index build, the schedule
    and the partial traffic. Nothing is read back to the host on CUDA tensors, so a call can
    be captured in a CUDA graph. ``config``: launch choices (``DecodeConfig``).
    """
    return _decode(args, config or DECODE_DEFAULTS)


def _decode(args: AttnArgs, cfg: DecodeConfig):
    launch = _decode_launch(args, cfg)
    if launch is not None:
        return launch.run(args.q, args.k_cache, args.v_cache, args.selected)
    return sparse_decode_attention_torch(args)


def _decode_launch(args: AttnArgs, cfg: DecodeConfig):
    """The decode kernel's launch for a call it runs (``DecodeLaunch``); None where the torch
    path runs it."""
    if not dispatch.use_triton(args.q, dispatch.decode_unsupported(args), cfg.impl):
        return None
    from .decode import attention_triton as decode_triton

    return decode_triton.DecodeLaunch(args, cfg)


# --------------------------------------------------------------------------- query-outer tiles
@attention_op(without=("partial_dtype",))
def qouter_attention(
    args: AttnArgs, *, config: DenseConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention, query-outer over tiles of neighbouring query tokens: each
    tile (its tokens' heads of one kv head, 128 rows at M3's shapes) reads the union of its
    tokens' selected blocks once, and a row keeps the keys of the blocks its own token chose.
    Same arguments and results as :func:`kvouter_attention`.

    No partials go through memory, as they do in KV-outer; the price is the work the union
    adds over each row's own blocks: none where neighbouring tokens choose alike, at most
    the dense kernel's over the tile's history where they share nothing. It runs on the
    dense kernel's tiles (``dense/attention_triton.py``; ``config``: its launch choices,
    ``DenseConfig``) on CUDA tensors, the torch code elsewhere. ``max_seqlen_q`` (host int,
    optional) only tunes the tile.
    """
    return _qouter(args, config or DENSE_DEFAULTS)


def _qouter(args: AttnArgs, cfg: DenseConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    launch = _qouter_launch(args, cfg)
    if launch is not None:
        return launch.run(args.q, args.k_cache, args.v_cache, args.selected)
    return sparse_decode_attention_torch(args)


def _qouter_launch(args: AttnArgs, cfg: DenseConfig):
    """The query-outer kernel's launch for a call it runs (``DenseLaunch`` of a sparse call);
    None where the torch path runs it."""
    if cfg.impl == "fa4":
        raise ValueError("qouter_attention: impl='fa4' pins flash-attn-4, which has no block-sparse attention")
    if not dispatch.use_triton(args.q, dispatch.qouter_unsupported(args), cfg.impl):
        return None
    from .dense import attention_triton as dense_triton

    return dense_triton.DenseLaunch(args, cfg)


@attention_op()
def sparse_attention(args: AttnArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse attention with the kernel chosen from host-known shapes: the
    query-outer decode kernel (:func:`sparse_decode_attention`) while sequences bring at
    most ``dispatch.decode_max_queries`` query rows each, where few queries share a block,
    else KV-outer (:func:`kvouter_attention`). Same arguments and results as both.

    In a KV-outer call of several sequences on the kernels, the sequences of at most
    ``dispatch.MIXED_DECODE_ROWS`` rows (a serving step's decode rows beside its prefill
    chunks) run the decode kernel (:func:`_mixed`). Past the decode bound,
    ``M3_SPARSE_PREFILL=qouter`` runs :func:`qouter_attention` instead of KV-outer
    (``dispatch.runs_qouter``).

    ``max_seqlen_q``: an upper bound of the query rows of one sequence (a host int; the
    number of query tokens ``Tq`` stands in when it is not given). Never read from the
    device, so the choice costs no sync and a captured graph keeps it. ``partial_dtype``
    applies where KV-outer runs (the decode kernel merges its splits in registers); both
    branches check it the same way.
    """
    return _sparse(args)


def _sparse(args: AttnArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    if dispatch.runs_decode(args):
        return _decode(args, DECODE_DEFAULTS)
    if dispatch.runs_qouter(args):
        return _qouter(args, DENSE_DEFAULTS)
    rows = dispatch.mixed_decode_rows(args)
    if rows:
        return _mixed(args, rows)
    return _kvouter(args, KVOUTER_DEFAULTS, None)


def _mixed(args: AttnArgs, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A KV-outer call whose sequences of at most ``rows`` query rows (decode rows beside
    prefill chunks) run the decode kernel: KV-outer over the others (the short ones'
    selections emptied, so they add no entries, partials or tiles, and come out as rows
    that see nothing), then the decode kernel writes the short rows into its outputs."""
    # Rows past the last sequence (a padded step's) count as the last sequence's: they see
    # nothing either way.
    seq = token_seq_ids(args.cu_seqlens_q, args.num_tokens).clamp(max=args.batch - 1)  # [Tq]
    q_lens = args.cu_seqlens_q[1:] - args.cu_seqlens_q[:-1]  # [B]
    short = (q_lens <= rows)[seq]  # [Tq] the rows the decode kernel takes
    long_rows = args.replace(selected=args.selected.masked_fill(short[:, None, None], -1))
    out, lse = _kvouter(long_rows, KVOUTER_DEFAULTS, None)
    from .decode import attention_triton as decode_triton

    launch = decode_triton.DecodeLaunch(args, DECODE_DEFAULTS, rows_per_seq=rows)
    return launch.run(args.q, args.k_cache, args.v_cache, args.selected, out=out, lse=lse)


@attention_op()
def plan_sparse_attention(args: AttnArgs) -> PlannedAttention:
    """:func:`sparse_attention`'s checks and kernel choice, and the decode kernel's launch
    set-up, once: the returned plan's ``run(q, k_cache, v_cache, selected)`` answers what
    ``sparse_attention`` would for tensors of these shapes, strides and dtypes, with this
    call's block tables, ``cu_seqlens_q`` and ``used_kv_lens`` (read in place at every run:
    contiguous int32 tensors, updated in place between runs, as a paged cache does). A
    decode step's sparse layers make the same call on their own pools: plan once, run per
    layer. Same arguments as :func:`sparse_attention`."""
    _check_plan_metadata(args.block_tables, args.cu_seqlens_q, args.used_kv_lens)
    return PlannedAttention(args)


class PlannedAttention(_Plan):
    """:func:`sparse_attention` on a checked call, the decode kernel's launch set up where it
    runs the call (:func:`plan_sparse_attention`)."""

    RUN_TENSORS = ("q", "k_cache", "v_cache", "selected")

    def __init__(self, args: AttnArgs):
        self.args = args
        # The decode, query-outer or KV-outer kernels' launch where _sparse runs it, else the
        # call goes to _sparse (the torch code, a mixed step, a KV-outer call in slices).
        self._launch = (
            _decode_launch(args, DECODE_DEFAULTS) if dispatch.runs_decode(args)
            else _qouter_launch(args, DENSE_DEFAULTS) if dispatch.runs_qouter(args)
            else _kvouter_plan_launch(args)
        )

    def run(self, q, k_cache, v_cache, selected) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out [Tq, Hq, D], lse [Hq, Tq] or None) for these tensors (like the planned call's)."""
        _check_like(self._metas, (q, k_cache, v_cache, selected))
        return self._ahead_call(q, k_cache, v_cache, selected)

    def _call(self, q, k_cache, v_cache, selected) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._launch is not None:
            return self._launch.run(q, k_cache, v_cache, selected)
        return _sparse(self.args.replace(q=q, k_cache=k_cache, v_cache=v_cache, selected=selected))


def _kvouter_plan_launch(args: AttnArgs):
    """KV-outer's launches where ``_sparse`` would run this call on them in one piece; None for
    a mixed step, the torch code or a call in workspace slices."""
    if dispatch.mixed_decode_rows(args) or dispatch.kvouter_slices(args, KVOUTER_DEFAULTS.workspace_bytes) < args.num_tokens:
        return None
    if not dispatch.use_triton(args.q, dispatch.kvouter_unsupported(args), KVOUTER_DEFAULTS.impl):
        return None
    return _kvouter_launch(args, KVOUTER_DEFAULTS)


# --------------------------------------------------------------------------- dense
@attention_op(without=_SPARSE_ONLY)
def dense_paged_attention(args: AttnArgs, *, config: DenseConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense attention over a paged K/V cache (full-attention layers, the vision tower with
    ``causal=False``), same layouts and fp8 options as :func:`kvouter_attention`.
    ``max_seqlen_q`` (host int, optional) only tunes the GPU kernel's query tile.

    Three kernels (:func:`dense_paged_attention_kernel` says which one runs a call, the
    ``m3_sparse`` logger at DEBUG level names it on each call): flash-attn-4 where it is
    installed and takes the call, the Triton kernel on other CUDA calls, torch elsewhere;
    ``config.impl`` or ``M3_SPARSE_DENSE_IMPL`` pins one. On flash-attn-4 the slots past
    each sequence's length in its last page are set to zero first (it reads whole pages)."""
    return PlannedDenseAttention(args, config or DENSE_DEFAULTS).planned_call()


@attention_op(without=_SPARSE_ONLY)
def plan_dense_paged_attention(args: AttnArgs, *, config: DenseConfig | None = None) -> PlannedDenseAttention:
    """:func:`dense_paged_attention`'s checks, kernel choice and launch set-up, once: the
    returned plan's ``run(q, k_cache, v_cache)`` answers what ``dense_paged_attention``
    would for tensors of these shapes, strides and dtypes, with this call's block tables,
    ``cu_seqlens_q`` and ``used_kv_lens`` (read in place at every run: contiguous int32
    tensors, updated in place between runs, as a paged cache does). A decode step's
    full-attention layers make the same call on their own pools: plan once, run per layer.
    Same arguments as :func:`dense_paged_attention`."""
    _check_plan_metadata(args.block_tables, args.cu_seqlens_q, args.used_kv_lens)
    return PlannedDenseAttention(args, config or DENSE_DEFAULTS)


class PlannedDenseAttention(_Plan):
    """:func:`dense_paged_attention` on a checked call, its kernel chosen and, for the Triton
    kernel, its launch set up (:func:`plan_dense_paged_attention`)."""

    RUN_TENSORS = ("q", "k_cache", "v_cache")

    def __init__(self, args: AttnArgs, cfg: DenseConfig):
        self.args = args
        self.kernel = dispatch.dense_kernel(args, cfg)
        if _log.isEnabledFor(logging.DEBUG):  # each op call plans its call
            _log.debug("dense_paged_attention: %s kernel, %d query rows, %d sequences, page %d",
                       self.kernel, args.num_tokens, args.batch, args.page_size)
        self._launch = None  # the Triton kernel's launch, set up once
        if self.kernel == "triton":
            from .dense import attention_triton as dense_triton

            self._launch = dense_triton.DenseLaunch(args, cfg)

    def run(self, q, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out [Tq, Hq, D], lse [Hq, Tq] or None) for these tensors (like the planned call's)."""
        _check_like(self._metas, (q, k_cache, v_cache))
        return self._ahead_call(q, k_cache, v_cache)

    def _call(self, q, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._launch is not None:
            return self._launch.run(q, k_cache, v_cache)
        args = self.args
        if q is not args.q or k_cache is not args.k_cache or v_cache is not args.v_cache:
            args = args.replace(q=q, k_cache=k_cache, v_cache=v_cache)
        if self.kernel == "fa4":
            from .dense import attention_fa4 as dense_fa4

            return dense_fa4.run_dense_fa4(args)
        return dense_paged_attention_torch(args)


@attention_op(without=_SPARSE_ONLY)
def dense_paged_attention_kernel(args: AttnArgs, *, config: DenseConfig | None = None) -> str:
    """Which kernel :func:`dense_paged_attention` runs for these arguments: "fa4", "triton"
    or "torch" (host facts only; raises where the op would, for a pinned kernel that
    cannot run the call)."""
    return dispatch.dense_kernel(args, config or DENSE_DEFAULTS)


def sdpa_prefill_reason(new_q: torch.Tensor, new_k: torch.Tensor, kernel: str | None = None, **paged) -> str | None:
    """Why :func:`causal_prefill_sdpa` does not run a causal dense prefill with no history and
    no padding (``dispatch.sdpa_prefill_reason``), None when it does. ``new_q`` [B, Hq, S, D]
    and ``new_k`` [B, Hkv, S, D] are the step's own; ``paged``: :func:`dense_paged_attention`'s
    arguments for the same call over the pages, whose kernel it would replace; ``kernel``:
    that kernel where a plan of the call already chose it (``PlannedDenseAttention.kernel``),
    else :func:`dense_paged_attention_kernel` checks the call and chooses it here."""
    kernel = kernel or dense_paged_attention_kernel(**paged)
    kv_fp8 = paged["k_cache"].dtype == torch.float8_e4m3fn
    return dispatch.sdpa_prefill_reason(new_q, new_k, kernel, DENSE_DEFAULTS, kv_fp8)


__all__ = [
    "DecodeConfig",
    "DenseConfig",
    "IndexConfig",
    "KVOuterConfig",
    "PlannedAttention",
    "PlannedDenseAttention",
    "PlannedIndexTopk",
    "dense_paged_attention",
    "dense_paged_attention_kernel",
    "index_prep",
    "index_topk",
    "kvouter_attention",
    "plan_dense_paged_attention",
    "plan_index_topk",
    "plan_sparse_attention",
    "sparse_attention",
    "sparse_decode_attention",
]
