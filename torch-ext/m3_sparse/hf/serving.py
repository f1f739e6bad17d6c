"""``paged|m3_sparse``: M3 under transformers' continuous batching (``generate_batch``,
``init_continuous_batching``), plugged into its manager and scheduler as they are.

How transformers serves a model (``generation/continuous_batching/``), and where this package
plugs in:

* **The name** (``compat.cb_attn_implementation``). Up to 5.18 the manager switches a model
  loaded with ``X`` to ``paged|X`` (``switch_to_cb_friendly_attn``, undone by ``stop()``), so
  ``m3_sparse`` becomes ``paged|m3_sparse``, registered here with
  :func:`paged_m3_sparse_attention` and no mask function, so ``create_causal_mask`` builds no
  ``[Tq, Tk]`` mask. From 5.19 the switch refuses implementations it does not know;
  :func:`_switch_to_cb_friendly_attn` switches a model running m3_sparse itself: in 5.19-5.23 to
  ``m3_sparse_serving`` (registered like ``paged|m3_sparse``: those releases would compose a
  packed-sequence mask from the step's ``position_ids``), from 5.24 to nothing, since
  ``create_causal_mask`` builds no mask for the manager's cache; the attention function then
  hands a call with a serving layer to :func:`paged_m3_sparse_attention`.
* **The cache.** The manager builds one ``PagedAttentionCache`` from the text config. How M3's
  sparse layers keep their index keys in it, beside K/V slot for slot, depends on its design:
  ``serving_groups`` (5.17: layer groups; the index keys in pools of their own) and
  ``serving_allocator`` (5.18 and later: an allocator registered for the sparse layer type,
  whose pages hold the index keys). Both show the cache to the kernels as layer groups of page
  pools (``serving_layout.CachePools``).
* **Each step.** ``ContinuousBatchingIOs.get_model_kwargs`` hands the model one packed row:
  ``input_ids`` / ``position_ids`` ``[1, T]`` (every scheduled request's new tokens, prefill
  chunks and decode rows mixed, in request order), ``cu_seq_lens_q`` ``[R + 1]``,
  ``cu_seq_lens_k`` (past plus new tokens per request; from 5.18 a dict by layer type),
  ``max_length_q`` / ``max_length_k`` (host ints; ``max_seqlen_*`` up to 5.18), ``cache``,
  ``write_index`` / ``read_index`` (one int64 tensor per layer group: the cache slot of every
  new token, and of every history token of every request in order, the new ones included;
  ``read_index`` empty when no request has a history), ``block_table`` and
  ``use_cache=False``. The model passes these keywords through every layer to the attention
  module, where ``attention_forward`` (``hf/attention.py``) swaps the cache for this step's
  :class:`ServingLayer`: the module's ``cache.update(k, v, layer_idx)`` writes K/V at the new
  tokens' slots and returns the pools, the indexer writes its index keys and selects blocks
  with ``index_topk`` (:func:`select_blocks`), and :func:`paged_m3_sparse_attention` attends
  with ``sparse_attention`` (the decode kernel or KV-outer from ``max_length_q``; in a step
  with a prefill chunk, KV-outer for the chunks and the decode kernel for the decode rows), or
  ``dense_paged_attention`` for full-attention layers, on views of the manager's own cache.
* **The decode fast path.** When every request brings one token (and ``max_blocks_per_request
  > 0``), ``block_table`` ``[groups, R, max_blocks_per_request]`` (``-1`` past a request's
  blocks) replaces the indices: ``write_index`` / ``read_index`` are then stale and must not
  be read, and ``max_length_q`` / ``max_length_k`` are 1. transformers offers it to flash
  attention only; :func:`_resolve_config` keeps it for ``m3_sparse``.
* **Static shapes.** With CUDA graphs or ``torch.compile`` the step is padded: ``T`` grows past
  ``cu_seq_lens_q[-1]`` (padding tokens write to the write trash), extra requests of length 0
  fill ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and ``max_length_k`` is rounded up; a graph is
  captured per padded shape and replayed, so nothing here may read the device from the host.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref

import torch
from transformers.generation.continuous_batching import continuous_api as cb_api
from transformers.generation.continuous_batching import initialization as cb_init
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from . import compat
from .calls import call_op
from .impl import ATTN_IMPLEMENTATION, names_m3_sparse
from .serving_layout import CB_IMPLEMENTATION, SPARSE_LAYER_TYPE, ServingStep, runs_m3_sparse
from .serving_layout import build_step as _build_step

if compat.CB_ALLOCATORS:
    from . import serving_allocator as cache_design
else:
    from . import serving_groups as cache_design

__all__ = [
    "CB_IMPLEMENTATION",
    "SPARSE_LAYER_TYPE",
    "ServingLayer",
    "ServingStep",
    "build_step",
    "cache_design",
    "claim",
    "layer_for",
    "paged_m3_sparse_attention",
    "register",
    "select_blocks",
    "serving_layer",
    "uses_paged_m3_sparse",
]

PAGED = "paged|"

_ORIGINAL_RESOLVE_CONFIG = getattr(
    cb_api.resolve_continuous_batching_config, "m3_sparse_original", cb_api.resolve_continuous_batching_config
)
_ORIGINAL_ADD_REQUEST = getattr(
    cb_api.ContinuousBatchingManager.add_request, "m3_sparse_original", cb_api.ContinuousBatchingManager.add_request
)
_ORIGINAL_ADD_REQUESTS = getattr(
    cb_api.ContinuousBatchingManager.add_requests, "m3_sparse_original", cb_api.ContinuousBatchingManager.add_requests
)
_ORIGINAL_SWITCH = getattr(
    cb_api.ContinuousBatchingManager.switch_to_cb_friendly_attn,
    "m3_sparse_original",
    cb_api.ContinuousBatchingManager.switch_to_cb_friendly_attn,
)


def uses_paged_m3_sparse(config) -> bool:
    """Whether ``config`` runs ``paged|m3_sparse``, or ``paged|`` + a hub string of this package
    (the name continuous batching gives a model loaded with the hub string up to 5.18)."""
    impl = getattr(config, "_attn_implementation", None)
    return isinstance(impl, str) and impl.startswith(PAGED) and names_m3_sparse(impl[len(PAGED):])


def serving_layer(module: torch.nn.Module, cache, kwargs: dict, num_tokens: int) -> ServingLayer | None:
    """The :class:`ServingLayer` of attention ``module`` when its call (its ``cache`` and
    keywords) runs a continuous-batching step of m3_sparse, else None: the manager's cache is
    there (``compat.cb_manager_cache``) and the model runs m3_sparse under a name continuous
    batching gives it (``serving_layout.runs_m3_sparse``)."""
    manager = compat.cb_manager_cache(cache, kwargs)
    if not isinstance(manager, PagedAttentionCache) or not runs_m3_sparse(module.config):
        return None
    return layer_for(module, kwargs, num_tokens, manager)


def claim(impl: str) -> None:
    """Make ``impl`` (from :func:`uses_paged_m3_sparse`) run this module's attention and no mask.
    For ``paged|`` + a hub string, transformers registers its flash-attention paged wrapper and
    the sdpa mask function when it switches the model; the model's ``create_causal_mask``
    (wrapped in ``mask.py``) calls this before the first step builds a mask."""
    if ALL_ATTENTION_FUNCTIONS.get(impl) is not paged_m3_sparse_attention:
        AttentionInterface.register(impl, paged_m3_sparse_attention)
        AttentionMaskInterface.register(impl, no_mask)


def no_mask(*args, **kwargs) -> None:
    """Mask function of ``paged|`` hub strings: the step's layout comes from the manager's
    keywords, never from a ``[T, T]`` mask."""
    return None


def build_step(cache: PagedAttentionCache, kwargs: dict, num_tokens: int) -> ServingStep:
    """The :class:`ServingStep` of the keywords continuous batching passed the model with
    ``cache`` (``serving_layout.build_step`` on the cache's page pools)."""
    return _build_step(cache_design.pools_of(cache), kwargs, num_tokens)


class ServingLayer:
    """One attention layer's view of the step: what the M3 attention module calls its cache
    (``update``) and what the indexer and the attention function read."""

    def __init__(self, cache: PagedAttentionCache, step: ServingStep, layer_idx: int):
        pools = cache_design.pools_of(cache)
        group = pools.group_of(layer_idx)
        self.cache, self.step, self.layer_idx = cache, step, layer_idx
        self.group, self.group_step = pools.groups[group], step.groups[group]

    @property
    def kv_tables(self) -> torch.Tensor:
        """Page ids ``[R + 1, W]`` of each request's history in the layer's K/V pools."""
        return self.group_step.kv_tables

    @property
    def index_tables(self) -> torch.Tensor:
        """Page ids ``[R + 1, W]`` of each request's history in the layer's index-key pool."""
        return self.group_step.index_tables

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None, **kwargs):
        """Write the new K/V ``[1, Hkv, T, D]`` at the step's slots; return the pools as the
        kernels read them, ``[pages, Hkv, P, D]`` views of the manager's cache. The module calls
        ``update(k, v, layer_idx)``, from 5.24 with its keywords as ``kwargs=``, which the pools
        do not need."""
        keys, values = (x[0].transpose(0, 1) for x in (key_states, value_states))
        self.group.write_kv(self.layer_idx, keys, values, self.group_step.slots)
        return self.group.kv_pools(self.layer_idx)

    def update_index(self, index_keys: torch.Tensor) -> torch.Tensor:
        """Write the new index keys ``[T, Di]`` at the step's slots; return the pool as pages
        ``[pages, P, Di]``."""
        self.group.write_index_keys(self.layer_idx, index_keys, self.group_step.slots)
        return self.group.index_pool(self.layer_idx, index_keys.shape[-1])


# The step being run, per manager cache.
_STEPS: "weakref.WeakKeyDictionary[PagedAttentionCache, ServingStep]" = weakref.WeakKeyDictionary()


def layer_for(module: torch.nn.Module, kwargs: dict, num_tokens: int, cache=None) -> ServingLayer:
    """The :class:`ServingLayer` of attention ``module`` for the step described by the
    continuous-batching ``kwargs`` and the manager's ``cache`` (by default the ``cache`` keyword,
    as up to 5.23). The first layer builds the step; the others reuse it (a graph capture reruns
    the first layer, so the step is captured with it)."""
    cache = kwargs.get("cache") if cache is None else cache
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(
            f"{CB_IMPLEMENTATION} runs under transformers' continuous batching (generate_batch, "
            "init_continuous_batching), which passes its paged cache to every layer; for generate() load the model "
            f"with attn_implementation='{ATTN_IMPLEMENTATION}'."
        )
    step = _STEPS.get(cache)
    if module.layer_idx == 0 or step is None or step.write_index is not kwargs.get("write_index"):
        step = _STEPS[cache] = build_step(cache, kwargs, num_tokens)
    return ServingLayer(cache, step, module.layer_idx)


# ---------------------------------------------------------------------------------------
# the index branch and the attention function
# ---------------------------------------------------------------------------------------
def select_blocks(indexer, idx_q: torch.Tensor, idx_k: torch.Tensor, layer: ServingLayer) -> torch.Tensor:
    """Block selection of the packed step: idx_q ``[1, T, Hi, Di]``, idx_k ``[1, T, Di]`` ->
    ``[1, Hi, T, topk]`` (``-1`` in unused slots), like the stock indexer's output."""
    _, tokens, heads, dim = idx_q.shape
    step = layer.step
    selected = call_op(
        "index_topk",
        index_q=idx_q.reshape(tokens, heads, dim),
        index_k_cache=layer.update_index(idx_k[0]),
        block_tables=layer.index_tables,
        cu_seqlens_q=step.cu_seqlens_q,
        used_kv_lens=step.kv_lens,
        topk=indexer.topk_blocks,
        block_size=indexer.block_size,
        local_blocks=indexer.local_blocks,
        max_seqlen_q=step.max_seqlen_q,
    )
    return selected.view(1, tokens, heads, indexer.topk_blocks).permute(0, 2, 1, 3)


def paged_m3_sparse_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    block_indices: torch.Tensor | None = None,
    m3_serving_layer: ServingLayer | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of a continuous-batching step: query ``[1, Hq, T, D]`` (the packed step) ->
    (out ``[1, T, Hq, D]``, None). ``key`` / ``value`` are the pools the layer's
    :class:`ServingLayer` returned; sparse layers pass their ``block_indices``."""
    if m3_serving_layer is None:
        raise ValueError(
            f"{CB_IMPLEMENTATION} was called outside the M3 attention module under continuous batching (no serving "
            f"layer); for generate() load the model with attn_implementation='{ATTN_IMPLEMENTATION}'."
        )
    if dropout and module.training:
        raise ValueError(f"{CB_IMPLEMENTATION}: attention dropout is not supported (inference kernels)")
    _, hq, tokens, d = query.shape
    step = m3_serving_layer.step
    common = dict(
        q=query[0].transpose(0, 1),
        k_cache=key,
        v_cache=value,
        block_tables=m3_serving_layer.kv_tables,
        cu_seqlens_q=step.cu_seqlens_q,
        used_kv_lens=step.kv_lens,
        softmax_scale=scaling,
        causal=True,
        max_seqlen_q=step.max_seqlen_q,
    )
    if block_indices is not None:
        selected = block_indices[0].permute(1, 0, 2)  # [T, Hkv, topk]
        out, _ = call_op("sparse_attention", selected=selected, block_size=module.config.index_block_size, **common)
    else:
        out, _ = call_op("dense_paged_attention", **common)
    return out.view(1, tokens, hq, d), None


# ---------------------------------------------------------------------------------------
# the manager's configuration and attention switch
# ---------------------------------------------------------------------------------------
def _resolve_config(config, cb_config, workload_hints, has_logit_processors, **kwargs):
    """``resolve_continuous_batching_config`` for ``m3_sparse``: transformers' own steps
    (``initialization.py``), told two facts its checks only know of flash attention:

    * the decode fast path works: :func:`build_step` reads the manager's ``block_table``, so
      ``max_blocks_per_request`` keeps its value (the user's, the workload hints', else enough
      blocks for ``max_position_embeddings``) instead of dropping to 0, which would make every
      decode step rebuild the read index of all history tokens on the host;
    * no attention mask is needed: CUDA graphs and asynchronous batching are on by default
      on CUDA, and the varlen path is not compiled by default (host-side ``max_length_*`` vary),
      as for flash attention.

    Explicit settings of ``ContinuousBatchingConfig`` are kept, as transformers keeps them.
    ``kwargs``: the ``device`` transformers passes from 5.21."""
    if not runs_m3_sparse(config):
        return _ORIGINAL_RESOLVE_CONFIG(config, cb_config, workload_hints, has_logit_processors, **kwargs)
    cb_config = copy.deepcopy(cb_config)
    graphs_requested = any([cb_config.q_padding_interval_size, cb_config.kv_padding_interval_size])
    cb_init.resolve_using_hints(cb_config, workload_hints)
    positions = getattr(config, "max_position_embeddings", None)
    if cb_config.max_blocks_per_request is None and positions:
        # Without hints (init_continuous_batching), a table wide enough for any request the
        # model can take: transformers' fallback (32 blocks) would send every longer request's
        # decode rows back to the read index. A table row costs 4 bytes per block.
        blocks = -(-positions // compat.cb_tokens_per_page(cb_config)) + 1
        cb_config.max_blocks_per_request = blocks + blocks % 2
    cb_init.resolve_without_hints(cb_config)
    cb_init.resolve_compile_configs(
        cb_config=cb_config,
        fallback_compile_config=getattr(config, "compile_config", None),
        is_flash_attn=True,
        decode_fast_path_available=cb_config.max_blocks_per_request > 0,
    )
    cb_init.decide_use_cuda_graphs(
        cb_config=cb_config, is_attn_mask_needed=False, cuda_graph_requested=graphs_requested
    )
    cb_init.decide_use_async_batching(cb_config=cb_config, is_attn_mask_needed=False)
    compat.cb_resolve_memory_percent(cb_config, has_logit_processors, kwargs.get("device"))
    compat.cb_check_bounds(cb_config)
    return cb_config


_resolve_config.m3_sparse_original = _ORIGINAL_RESOLVE_CONFIG


def _switch_to_cb_friendly_attn(self, model, *args, **kwargs):
    """``ContinuousBatchingManager.switch_to_cb_friendly_attn`` from 5.19, which keeps a model's
    implementation (eager becomes ``paged|eager``) but refuses all but ``paged|eager``, ``sdpa``
    and flash attention. A model running m3_sparse is switched as transformers' switch would,
    to ``compat.cb_attn_implementation`` (this package's serving name, without a mask function,
    in 5.19-5.23; from 5.24 the name it has: the manager's cache tells its attention a serving
    step from generate()'s), and ``stop()`` switches it back; any other model goes through
    transformers' switch."""
    if not runs_m3_sparse(model.config):
        return _ORIGINAL_SWITCH(self, model, *args, **kwargs)
    impl = model.config._attn_implementation
    target = compat.cb_attn_implementation(impl)
    if target != impl:
        model.set_attn_implementation(target)
        self._original_attn_impl = impl
    return None


_switch_to_cb_friendly_attn.m3_sparse_original = _ORIGINAL_SWITCH

# How long add_request waits for a just-started manager's worker to build its cache.
CACHE_WAIT_S = 30.0


def _pool_tokens(manager) -> int | None:
    """Tokens one request can hold in ``manager``'s cache; None when it has no cache to ask
    (its worker not started). A worker that is starting builds the cache first thing: wait."""
    deadline = time.monotonic() + CACHE_WAIT_S
    while getattr(manager, "batch_processor", None) is None:
        if not manager.is_running() or time.monotonic() > deadline:
            return None
        time.sleep(0.005)
    return compat.cb_pool_tokens(manager.batch_processor.cache, manager.continuous_batching_config)


_IN_BATCH = threading.local()  # add_request called by add_requests (generate_batch)


def _add_request(self, input_ids, request_id=None, max_new_tokens=None, *args, **kwargs):
    """``ContinuousBatchingManager.add_request`` for a model running m3_sparse: a request that can
    never fit the cache (prompt plus ``max_new_tokens`` over what an empty cache holds) is
    refused with a ``ValueError`` before it is queued. Taken, it would make the scheduler stop
    the manager ("No requests can be scheduled") with every request it held;
    ``transformers serve`` answers the ValueError with a 400 and keeps serving. A request of
    ``add_requests`` (``generate_batch``) is queued as before: there the scheduler fails that
    request alone, and ``generate_batch`` would turn a raise into no results at all."""
    if runs_m3_sparse(self.model.config) and not getattr(_IN_BATCH, "on", False):
        new = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        need = len(input_ids) + (new or 0)
        pool = _pool_tokens(self)
        if pool is not None and need > pool:
            raise ValueError(
                f"{CB_IMPLEMENTATION}: this request needs up to {need} cache slots ({len(input_ids)} prompt tokens + "
                f"max_new_tokens {new or 0}), more than the continuous-batching cache holds ({pool} tokens). "
                "Shorten the prompt or max_new_tokens, or give the cache more pages (num_blocks, --cb-num-blocks); "
                "nothing was queued."
            )
    return _ORIGINAL_ADD_REQUEST(self, input_ids, request_id, max_new_tokens, *args, **kwargs)


_add_request.m3_sparse_original = _ORIGINAL_ADD_REQUEST


def _add_requests(self, *args, **kwargs):
    _IN_BATCH.on = True
    try:
        return _ORIGINAL_ADD_REQUESTS(self, *args, **kwargs)
    finally:
        _IN_BATCH.on = False


_add_requests.m3_sparse_original = _ORIGINAL_ADD_REQUESTS

_REGISTERED = False


def register() -> None:
    """Serve m3_sparse under transformers' continuous batching: its name there (``paged|m3_sparse``
    up to 5.18, ``m3_sparse_serving`` in 5.19-5.23, registered with :func:`paged_m3_sparse_attention`;
    from 5.19 the manager's switch, :func:`_switch_to_cb_friendly_attn`), the cache design's hooks
    (:mod:`.serving_groups` or :mod:`.serving_allocator`), the configuration with the decode
    fast path and without a mask (:func:`_resolve_config`), and the refusal of a request larger
    than the cache (:func:`_add_request`). Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    if CB_IMPLEMENTATION != ATTN_IMPLEMENTATION:  # up to 5.23: a serving name of its own
        AttentionInterface.register(CB_IMPLEMENTATION, paged_m3_sparse_attention)
    if not compat.CB_PAGED_NAMES:
        cb_api.ContinuousBatchingManager.switch_to_cb_friendly_attn = _switch_to_cb_friendly_attn
    cb_api.resolve_continuous_batching_config = _resolve_config
    cb_api.ContinuousBatchingManager.add_request = _add_request
    cb_api.ContinuousBatchingManager.add_requests = _add_requests
    cache_design.install()
    _REGISTERED = True
