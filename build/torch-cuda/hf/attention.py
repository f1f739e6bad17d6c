"""transformers integration of ``attn_implementation="m3_sparse"``.

Data flow for one sparse layer of ``MiniMaxM3VLAttention`` (transformers' own module):

0. :func:`attention_forward` (the attention module's forward while this package is
   loaded) checks that an :class:`M3PagedCache` fits the model and hands its layer to the
   attention function (``m3_paged_layer``), then runs transformers' own forward:
1. ``cache.update(k, v)``: :class:`M3PagedCache` writes K/V into its pages
   and returns the page pools;
2. ``self.indexer(...)``: while ``m3_sparse`` is active the indexer's forward is
   :func:`indexer_forward`: same projections, norms and rotary embedding (``index_prep``,
   one launch on CUDA), then the index keys go to the paged index cache and
   ``m3_sparse.index_topk`` selects the blocks (no ``[Sq, Sk]`` score tensor);
3. the attention interface, :func:`m3_sparse_attention`, runs
   ``m3_sparse.sparse_attention`` on the pages (the decode kernel or KV-outer, chosen from
   the step's query length), and ``dense_paged_attention`` for full-attention layers,
   for sparse layers whose history every query selects whole, and, bidirectional, for
   the vision tower. A causal dense prefill into an empty cache with no padding reads the
   new K/V as written instead of the pages, on torch's fused sdpa where the dense op would
   run its Triton kernel (``api.sdpa_prefill_reason``).

Padding: before the layers run, the wrapped ``create_causal_mask`` hands the forward
pass's 2-D padding mask to the paged cache (``M3PagedCache.begin_step``), which places
each sequence's new tokens; the mask function passes the same 2-D mask on (never a 4-D
mask), which only the path without a paged cache reads.

Under ``torch.compile`` (``generate()``'s compiled decode) the ops are called as their
custom ops (``custom_ops``: one opaque graph node each), and nothing here reads a host
value that changes from step to step.
"""

from __future__ import annotations

import torch
from transformers.generation import utils as generation
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, create_masks_for_generate
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

from .. import api
from ..core.args import tensor_meta
from ..core.validate import debug_enabled
from . import compat, serving, tp
from .calls import call_op as _op
from .calls import on_input_device as _on_input_device
from .cache import M3PagedCache, M3PagedLayer, new_token_layout
from .impl import ATTN_IMPLEMENTATION, uses_m3_sparse
from .mask import create_causal_mask, m3_sparse_mask, step_mask

EPHEMERAL_PAGE_SIZE = 64
# Eager steps over a paged cache, decode and prefill, run the attention ops (and the index
# top-k) through plans kept on the cache (api.plan_*): checked, dispatched and set up once per
# call shape, then run by every layer of that kind (a prefill's sparse layers, a decode step's
# at every step). Kept plans hold stand-ins of their call's tensors (``release``), never a
# prefill's buffers. False calls the ops directly (benchmarks compare both).
PLANNED = True
MAX_PLANS = 32
# Plans of steps of at most this many new tokens per sequence (decode) keep their launches'
# scratch buffers between runs; longer steps' plans (prefill, whose shapes later steps rarely
# share) make them at each run, so no prefill's workspace outlives its forward pass.
SCRATCH_KEPT_MAX_QUERIES = 16

# A second copy of this module (another kernel build loaded side by side) must not wrap
# the patched functions again: the originals are kept on the patches.
_ORIGINAL_INDEXER_FORWARD = getattr(m3.MiniMaxM3VLIndexer.forward, "m3_sparse_original", m3.MiniMaxM3VLIndexer.forward)
_ORIGINAL_ATTENTION_FORWARD = getattr(
    m3.MiniMaxM3VLAttention.forward, "m3_sparse_original", m3.MiniMaxM3VLAttention.forward
)


def is_active(config) -> bool:
    return uses_m3_sparse(config)


# ---------------------------------------------------------------------------------------
# layout helpers
# ---------------------------------------------------------------------------------------
def _pages_from_contiguous(x: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, S, D] -> page pool [B * W, H, page_size, D] and block tables [B, W] (a copy)."""
    b, h, s, d = x.shape
    w = max(1, -(-s // page_size))
    x = torch.nn.functional.pad(x, (0, 0, 0, w * page_size - s))
    pool = x.view(b, h, w, page_size, d).permute(0, 2, 1, 3, 4).reshape(b * w, h, page_size, d)
    tables = torch.arange(b * w, dtype=torch.int32, device=x.device).view(b, w)
    return pool.contiguous(), tables


def _check_no_holes(attention_mask: torch.Tensor | None, q_len: int) -> None:
    """A contiguous (non-paged) cache cannot skip padding inside the history."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[-1] == q_len:
        return
    if attention_mask.device.type != "cpu" and not debug_enabled():
        return
    if not bool(attention_mask.all()):
        raise ValueError(
            "m3_sparse: a padded batch with a cache other than M3PagedCache leaves padding inside the key history, "
            "which this path cannot skip. Pass an m3_hf_attention.M3PagedCache as the model's cache (generate() does "
            "so by default with attn_implementation='m3_sparse')."
        )


def _contiguous_pages(x: torch.Tensor, q_len: int, page_size: int, mask: torch.Tensor | None):
    """Pages of a contiguous history [B, H, Sk, D] without a paged cache.

    Leading pads of the new tokens are dropped by shifting each row left (the rows
    then stay right aligned on ``Sk - lead``); padding inside an older history cannot
    be dropped this way and is rejected by :func:`_check_no_holes`.
    """
    batch, sk = x.shape[0], x.shape[2]
    if mask is not None and tuple(mask.shape) != (batch, sk):
        mask = None  # not this history's mask (another cache's): no leading pads to drop
    lead, _ = new_token_layout(mask, batch, q_len, x.device)
    if sk == q_len:
        src = (torch.arange(sk, device=x.device)[None, :] + lead[:, None]).clamp(max=sk - 1)
        x = x.gather(2, src[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
    pool, tables = _pages_from_contiguous(x, page_size)
    kv_lens = (sk - lead).to(torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=x.device) * q_len
    return pool, tables, cu, kv_lens


# ---------------------------------------------------------------------------------------
# short histories: every block selected
# ---------------------------------------------------------------------------------------
def every_block_selected(slots: "int | M3PagedLayer", topk: int, block_size: int) -> bool:
    """Whether a history of at most ``slots`` tokens per sequence (a host-side bound, or
    a paged layer's ``slots_used``, read only when the answer can be used) has
    no more blocks than the top-k keeps: every query then selects every block it can see,
    so the sparse layer is exactly dense causal attention and the scores need not run.

    Never in a compiled step or while a CUDA graph is being captured: replays of the step
    go on past the history length seen when it was made, and the sparse kernels are right
    at every length.
    """
    if torch.compiler.is_compiling():
        return False
    if isinstance(slots, M3PagedLayer):
        # Asked before slots_used: after compiled steps, its first read copies a count back.
        return not _capturing() and -(-slots.slots_used // block_size) <= topk
    # A long history first: the answer of every decode step past the first blocks.
    return -(-slots // block_size) <= topk and not _capturing()


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _plan(layer: M3PagedLayer, key: tuple, metadata: tuple, make, q_len: int):
    """The plan under ``key`` on ``layer``'s cache, made by ``make()`` (and released, see
    ``SCRATCH_KEPT_MAX_QUERIES``) when there is none or when its batch metadata are not this
    call's ``metadata`` tensors (block tables, cu_seqlens_q, kv lengths: a step of another
    length, another device's copies); ``q_len``: the step's new tokens per sequence."""
    plans = layer.cache.plans
    plan = plans.get(key)
    if plan is not None:
        args = plan.args
        tables, cu, kv_lens = metadata
        if args.block_tables is tables and args.cu_seqlens_q is cu and args.used_kv_lens is kv_lens:
            return plan
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plan = plans[key] = make().release(keep_scratch=q_len <= SCRATCH_KEPT_MAX_QUERIES)
    return plan


def _plan_for(layer: M3PagedLayer, op: str, tensors: tuple, options: tuple, metadata: tuple, make, q_len: int):
    """The plan of ``op`` for tensors like these (their shapes, strides, dtypes and devices)
    and these ``options``, kept on the layer's cache (:func:`_plan`)."""
    return _plan(layer, (op, *map(tensor_meta, tensors), *options), metadata, make, q_len)


def _run_plan(layer: M3PagedLayer, op: str, tensors: tuple, options: tuple, metadata: tuple, make, q_len: int):
    """``plan.run(*tensors)`` of :func:`_plan_for`'s plan."""
    return _plan_for(layer, op, tensors, options, metadata, make, q_len).run(*tensors)


def _planned(layer: M3PagedLayer | None) -> bool:
    """Whether this call runs through a plan: an eager step over a paged cache."""
    return PLANNED and layer is not None and not torch.compiler.is_compiling() and not _capturing()


def _first_blocks(batch, heads, q_len, topk, slots, block_size, device) -> torch.Tensor:
    """The selection such a layer makes, ``[B, heads, S, topk]``: blocks ``0 ..`` of the
    history, ``-1`` past its last block (blocks after a query's own hold no key it sees)."""
    ids = torch.arange(topk, dtype=torch.int32, device=device)
    ids = torch.where(ids < -(-slots // block_size), ids, -1)
    return ids.expand(batch, heads, q_len, topk)


# ---------------------------------------------------------------------------------------
# index branch
# ---------------------------------------------------------------------------------------
@_on_input_device
def indexer_forward(self, hidden_states, position_embeddings, cache, position_ids):
    """``MiniMaxM3VLIndexer.forward`` while ``m3_sparse`` is active.

    Returns block indices ``[B, index_heads, Sq, topk]`` (``-1`` padded) like the stock
    indexer, computed by ``m3_sparse.index_topk`` over the paged index-key cache (fp8
    codes and their scales, per token or one for the pool, when the cache was built with
    ``index_key_dtype=torch.float8_e4m3fn``).
    """
    # With an M3PagedCache, attention_forward's layer_for has checked that the model runs m3_sparse.
    layer = cache.layers[self.layer_idx] if isinstance(cache, M3PagedCache) else None
    serving_layer = layer is None and isinstance(cache, serving.ServingLayer)
    if layer is None and not (serving_layer or is_active(self.config)):
        return _ORIGINAL_INDEXER_FORWARD(self, hidden_states, position_embeddings, cache, position_ids)
    batch, q_len, _ = hidden_states.shape
    cos, sin = position_embeddings
    # An eager step's index keys go straight from the kernel into their pages (fp8 pools
    # and compiled steps: update_index below).
    k_out, k_rows = (
        layer.index_key_rows(batch, q_len, self.head_dim, hidden_states.device) if layer is not None else (None, None)
    )
    # The stock indexer's norms and rotary embedding, in one launch on CUDA (api.index_prep);
    # a compiled step keeps them as torch operations, which inductor fuses by itself.
    idx_q, idx_k = api.index_prep(
        self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim),
        self.k_proj(hidden_states).view(batch, q_len, self.head_dim),
        self.q_norm.weight,
        self.k_norm.weight,
        cos[..., : self.head_dim],
        sin[..., : self.head_dim],
        eps=self.q_norm.eps,
        impl="torch" if torch.compiler.is_compiling() else "auto",
        k_out=k_out,
        k_rows=k_rows,
    )  # [B, S, Hi, Di], [B, S, Di] (the pool's rows with k_out)
    if serving_layer:  # continuous batching: one packed row of every request's new tokens
        return serving.select_blocks(self, idx_q, idx_k, cache)
    heads = idx_q.shape[2]  # this rank's index heads under tensor parallelism (m3_hf_attention.tp)

    fp8_args = {}
    if layer is not None:
        # update_index takes the cache's layout of new states, [B, 1, S, Di].
        pool = layer.index_keys if k_out is not None else layer.update_index(idx_k[:, None])
        if every_block_selected(layer, self.topk_blocks, self.block_size):
            return _first_blocks(batch, heads, q_len, self.topk_blocks, layer.slots_used, self.block_size, idx_q.device)
        tables, cu, kv_lens = layer.step_metadata()
        if layer.index_scales is not None:
            # Only fp8 caches pass these, so a kernel build that predates them still
            # serves every other cache.
            fp8_args = {"index_k_scale": layer.index_scales, "fp8_dot": cache.index_fp8_dot}
    else:
        history = idx_k[:, None]  # [B, 1, S, Di]: a cache's layout of new states
        if cache is not None:
            history = cache.layers[self.layer_idx].update_index(history)  # stock contiguous layer
        if every_block_selected(history.shape[2], self.topk_blocks, self.block_size):
            return _first_blocks(batch, heads, q_len, self.topk_blocks, history.shape[2], self.block_size, idx_q.device)
        _check_no_holes(step_mask(), q_len)
        pool, tables, cu, kv_lens = _contiguous_pages(history, q_len, EPHEMERAL_PAGE_SIZE, step_mask())
        pool = pool[:, 0]  # one shared index-key head
    topk_args = dict(
        index_q=idx_q.reshape(batch * q_len, heads, self.head_dim),
        index_k_cache=pool,
        block_tables=tables,
        cu_seqlens_q=cu,
        used_kv_lens=kv_lens,
        topk=self.topk_blocks,
        block_size=self.block_size,
        local_blocks=self.local_blocks,
        max_seqlen_q=q_len,
        **fp8_args,
    )
    if _planned(layer):
        selected = _run_plan(
            layer, "index_topk", (topk_args["index_q"], pool, fp8_args.get("index_k_scale")),
            (self.topk_blocks, self.block_size, self.local_blocks, q_len, bool(fp8_args.get("fp8_dot"))),
            (tables, cu, kv_lens), lambda: api.plan_index_topk(**topk_args), q_len,
        )
    else:
        selected = _op("index_topk", **topk_args)
    return selected.view(batch, q_len, heads, self.topk_blocks).permute(0, 2, 1, 3)


indexer_forward.m3_sparse_original = _ORIGINAL_INDEXER_FORWARD


# ---------------------------------------------------------------------------------------
# attention interface
# ---------------------------------------------------------------------------------------
@_on_input_device
def m3_sparse_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    block_indices: torch.Tensor | None = None,
    m3_paged_layer: M3PagedLayer | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention interface of ``m3_sparse``: query [B, Hq, S, D] -> (out [B, S, Hq, D], None).

    ``key``/``value`` are either the page pools of ``m3_paged_layer`` (the layer of an
    :class:`M3PagedCache`, passed by :func:`attention_forward`) or contiguous
    ``[B, Hkv, Sk, D]`` tensors (no cache, or another cache class).
    """
    if kwargs.get("m3_serving_layer") is not None:
        # A continuous-batching step under the model's own name (transformers 5.24+).
        return serving.paged_m3_sparse_attention(
            module, query, key, value, attention_mask, dropout, scaling, block_indices, **kwargs
        )
    if dropout and module.training:
        raise ValueError("m3_sparse: attention dropout is not supported (inference kernels)")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"m3_sparse: expected a 2-D padding mask from the m3_sparse mask function, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    batch, hq, q_len, d = query.shape
    causal = getattr(module, "is_causal", True)
    q = query.transpose(1, 2).reshape(batch * q_len, hq, d)

    layer = m3_paged_layer
    if layer is not None:
        if key is not layer.keys or value is not layer.values:
            raise ValueError("m3_sparse: key and value are not the page pools of the cache layer passed with them")
        k_pool, v_pool = key, value
        tables, cu, kv_lens = layer.step_metadata()
        new_kv = layer.take_new_kv()
    else:
        # Keys of the new tokens alone (eager: a compiled forward keeps its ops opaque).
        fresh = attention_mask is None and key.shape[2] == q_len and not torch.compiler.is_compiling()
        new_kv = (key, value) if fresh else None
        if not causal and attention_mask is not None:
            raise ValueError("m3_sparse: bidirectional attention takes no padding mask")
        if causal:
            if attention_mask is not None and attention_mask.shape[-1] != key.shape[2]:
                raise ValueError(
                    f"m3_sparse: the key history holds {key.shape[2]} slots but the padding mask covers "
                    f"{attention_mask.shape[-1]} tokens (a static cache?). Use m3_hf_attention.M3PagedCache, the "
                    "paged static cache m3_sparse reads directly."
                )
            _check_no_holes(attention_mask, q_len)
        k_pool, tables, cu, kv_lens = _contiguous_pages(key, q_len, EPHEMERAL_PAGE_SIZE, attention_mask)
        v_pool, _, _, _ = _contiguous_pages(value, q_len, EPHEMERAL_PAGE_SIZE, attention_mask)

    fp8 = layer.kv_scale_args() if layer is not None else {}
    # Passed only when set, like the scales, so a kernel build that predates it serves the rest.
    partial_dtype = layer.cache.partial_dtype if layer is not None else None
    partials = {"partial_dtype": partial_dtype} if partial_dtype is not None else {}
    # What the sparse and the dense op both take.
    paged = dict(
        q=q, k_cache=k_pool, v_cache=v_pool, block_tables=tables, cu_seqlens_q=cu, used_kv_lens=kv_lens,
        softmax_scale=scaling, causal=causal, **fp8,
    )
    block_size = module.config.index_block_size if block_indices is not None else None
    if block_indices is not None and not every_block_selected(
        layer if layer is not None else key.shape[2], block_indices.shape[-1], block_size
    ):
        bi = block_indices.permute(0, 2, 1, 3).reshape(batch * q_len, block_indices.shape[1], -1)
        sparse = dict(paged, selected=bi, max_seqlen_q=q_len, block_size=block_size, **partials)
        if _planned(layer):
            out, _ = _run_plan(
                layer, "sparse_attention", (q, k_pool, v_pool, bi),
                (scaling, causal, block_size, partial_dtype, tuple(fp8.values())),
                (tables, cu, kv_lens), lambda: api.plan_sparse_attention(**sparse), q_len,
            )
        else:
            out, _ = _op("sparse_attention", **sparse)
    else:
        # A plan is made once a step: every dense layer asks the sdpa route of its kernel,
        # which the plan chose when it checked the call.
        plan = _plan_for(
            layer, "dense_paged_attention", (q, k_pool, v_pool), (scaling, causal, tuple(fp8.values())),
            (tables, cu, kv_lens), lambda: api.plan_dense_paged_attention(**paged), q_len,
        ) if _planned(layer) else None
        kernel = plan.kernel if plan is not None else None
        if causal and new_kv is not None and api.sdpa_prefill_reason(query, new_kv[0], kernel=kernel, **paged) is None:
            return api.causal_prefill_sdpa(query, *new_kv, scaling), None
        out, _ = plan.run(q, k_pool, v_pool) if plan is not None else _op("dense_paged_attention", **paged)
    return out.view(batch, q_len, hq, d), None


# Marks the function for uses_m3_sparse(): transformers registers a hub kernel's attention
# function under the hub string ("org/m3-sparse:m3_sparse_attention").
m3_sparse_attention.is_m3_sparse_attention = True


def attention_forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs):
    """``MiniMaxM3VLAttention.forward`` while this package is loaded: transformers' own
    forward, told which paged layer serves it. With an :class:`M3PagedCache` it first checks
    that the cache fits this model (a ``ValueError`` that names the mismatch), then passes
    the cache layer on to the attention function as ``m3_paged_layer`` (transformers hands
    extra keywords through to the attention interface). Any other cache, or none, under any
    other attention implementation reaches transformers' forward as it was passed (the
    cache positionally: ``compat.pop_cache``)."""
    cache = compat.pop_cache(args, kwargs)
    if isinstance(cache, M3PagedCache):
        kwargs["m3_paged_layer"] = cache.layer_for(self.layer_idx, self.config, self.indexer is not None)
    elif (layer := serving.serving_layer(self, cache, kwargs, hidden_states.shape[1])) is not None:
        # Continuous batching: the step's serving layer writes K/V and index keys into the manager's cache.
        cache = kwargs["m3_serving_layer"] = layer
    return _ORIGINAL_ATTENTION_FORWARD(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)


attention_forward.m3_sparse_original = _ORIGINAL_ATTENTION_FORWARD


# ---------------------------------------------------------------------------------------
# generate(): a paged cache by default
# ---------------------------------------------------------------------------------------
def _check_left_padded(attention_mask: torch.Tensor | None) -> None:
    """generate() reads each row's next token from the last position, so a right-padded
    prompt would continue from a pad: refuse it (one host read per generate() call)."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[-1] == 0:
        return
    if not bool(attention_mask[:, -1].all()):
        raise ValueError(
            "m3_sparse: generate() got a right-padded prompt (a row whose last position is padding); its next "
            "token would follow a pad. Pad on the left: tokenizer.padding_side = 'left'."
        )


def _prepare_cache_for_generation(original):
    def prepare(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        if not is_active(self.config.get_text_config(decoder=True)):
            return original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        _check_left_padded(model_kwargs.get("attention_mask"))
        user_cache = compat.generation_cache(model_kwargs)
        if isinstance(user_cache, M3PagedCache):
            user_cache.check_generation(max_cache_length)
        if (
            user_cache is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation in (None, "static")
        ):
            rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) * batch_size
            length = max(max_cache_length, generation_config.max_cache_len or 0)
            # Layers spread over devices (device_map, offloading): each allocates its pages on
            # the device its K/V arrive on.
            spread = len({p.device for p in self.parameters()}) > 1
            cache = M3PagedCache(self.config, rows, length, device=None if spread else self.device, dtype=self.dtype)
            if spread:
                # generate() compiles (and graph-captures) a step on one device only.
                cache.compileable = False
            compat.set_generation_cache(model_kwargs, cache)
            return None
        return original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)

    prepare.__wrapped__ = original
    return prepare


def _prefill(original):
    """generate()'s prefill with an :class:`M3PagedCache`: chunked prefills
    (``prefill_chunk_size``) run their chunks eagerly, as a one-pass prefill runs. transformers
    would run each chunk through the compiled forward that it builds for decode steps, and on
    CUDA that compiled prefill crashed (2026-12-04, docs/perf-log/2026-12-04.md); the decode
    steps are compiled as before."""

    def prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        if generation_config.prefill_chunk_size is None or not isinstance(
            compat.generation_cache(model_kwargs), M3PagedCache
        ):
            return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
        eager = generation_config.disable_compile
        generation_config.disable_compile = True  # read only by the compile decision of this call's prefill
        try:
            return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
        finally:
            generation_config.disable_compile = eager

    prefill.__wrapped__ = original
    return prefill


def _create_masks_for_generate(self, config, inputs_embeds, attention_mask, *args, **kwargs):
    """The mask generate() hands a model whose cache is compileable. With an
    :class:`M3PagedCache` under m3_sparse: the padding of the step's new tokens only
    (``[B, q_len]``), so a compiled decode step sees one input shape at every length, or
    ``None`` for a batch without padding; otherwise transformers' own
    ``create_masks_for_generate``, called as it was."""
    cache = compat.mask_cache((config, inputs_embeds, attention_mask, *args), kwargs)
    if isinstance(cache, M3PagedCache) and is_active(config.get_text_config(decoder=True)):
        if attention_mask is None:
            # From 5.18 generate() drops an all-ones mask. transformers' own function would
            # then hand the model a dict of masks, and the model skips ``create_causal_mask``,
            # where the paged cache begins its step: the decode step would not compile.
            return None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            # A fresh tensor: a slice would carry the full mask's row stride, which grows every step.
            return attention_mask[:, -inputs_embeds.shape[1]:].clone(memory_format=torch.contiguous_format)
    return create_masks_for_generate(config, inputs_embeds, attention_mask, *args, **kwargs)


def _deferred_stop_check(base):
    """transformers' ``DeferredStopCheck``, used on CUDA with an :class:`M3PagedCache` too.

    generate()'s sampling loop reads on the host, every step, whether all rows have
    finished: the host waits for the step's kernels before it prepares the next step, so a
    batch-1 step costs its GPU time plus most of the loop's host time. transformers 5.17 can
    read that flag one step late instead (``DeferredStopCheck``: the next step is queued
    while the last one runs, and the one step run past a stop is undone with the cache's
    ``crop``), but turns it on for MPS only. The paged cache undoes a step exactly
    (:meth:`M3PagedCache.crop`), so generate() defers the check for it on CUDA (docs/PERF.md,
    "generate() end to end"); every other cache keeps transformers' choice. ``base`` is the
    class in place (a second kernel build loaded side by side extends the first one's)."""

    class DeferredStopCheck(base):
        """With the paged cache, the prefill's token is read at once, as transformers'
        per-step check reads it: a streamer shows it before the first decode step, which
        records a CUDA graph for a new cache (tens of ms), is issued. The deferred reads
        start with the next token. Other caches: transformers' class unchanged."""

        def __init__(self, input_ids, max_length, cache, cache_is_returned, streamer=None):
            super().__init__(input_ids, max_length, cache, cache_is_returned, streamer)
            self.paged = isinstance(cache, M3PagedCache)
            self.deferring = not self.paged

        @staticmethod
        def is_supported(device, cache, cache_is_returned, is_assistant):
            if isinstance(cache, M3PagedCache) and device.type == "cuda" and not is_assistant:
                return True
            return base.is_supported(device, cache, cache_is_returned, is_assistant=is_assistant)

        def __call__(self, unfinished_sequences, tokens, length):
            if self.deferring:
                return super().__call__(unfinished_sequences, tokens, length)
            self.deferring = True  # the next call is the deferred check's first
            stop = generation.StopCheck.__call__(self, unfinished_sequences, tokens, length)
            return stop or (self.max_length is not None and length >= self.max_length)

        def finish(self):
            if self.paged and self.is_first_step:  # stopped at the prefill's token: nothing ran past it or is held
                return 0
            return super().finish()

    DeferredStopCheck.m3_sparse_base = base
    return DeferredStopCheck


_REGISTERED = False


def register() -> None:
    """Register ``attn_implementation="m3_sparse"`` (attention and mask functions) with transformers
    and route the M3 indexer through the paged ``index_topk`` while it is active. Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    AttentionInterface.register(ATTN_IMPLEMENTATION, m3_sparse_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, m3_sparse_mask)
    m3.MiniMaxM3VLIndexer.forward = indexer_forward
    m3.MiniMaxM3VLAttention.forward = attention_forward
    m3.create_causal_mask = create_causal_mask
    for cls in (m3.MiniMaxM3VLForCausalLM, m3.MiniMaxM3SparseForConditionalGeneration):
        cls._prepare_cache_for_generation = _prepare_cache_for_generation(cls._prepare_cache_for_generation)
        cls._prefill = _prefill(cls._prefill)
        cls.create_masks_for_generate = _create_masks_for_generate
    generation.DeferredStopCheck = _deferred_stop_check(generation.DeferredStopCheck)
    tp.register()
    serving.register()
    _REGISTERED = True


__all__ = [
    "ATTN_IMPLEMENTATION",
    "M3PagedCache",
    "indexer_forward",
    "m3_sparse_attention",
    "m3_sparse_mask",
    "register",
    "ALL_ATTENTION_FUNCTIONS",
    "ALL_MASK_ATTENTION_FUNCTIONS",
]
