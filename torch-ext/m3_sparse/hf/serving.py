"""``attn_implementation="paged|m3_sparse"``: M3 under transformers' continuous batching.

How transformers (5.17, ``generation/continuous_batching/``) serves with a ``paged|X``
attention, which this module plugs into without changing its manager or scheduler:

* **Switching.** ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` turns a model loaded
  with ``X`` into ``paged|X`` (``set_attn_implementation``, restored on ``stop()``); M3 does
  not claim flash-attention support, so ``m3_sparse`` becomes ``paged|m3_sparse``, which must
  be a key of ``AttentionInterface`` (``register`` below). ``paged|m3_sparse`` has no mask
  function, so ``create_causal_mask`` returns ``None`` and nothing ``[Tq, Tk]`` is built
  (``attn_mask_is_needed`` asks for a 4-D mask for ``paged|eager`` / ``paged|sdpa`` only).
* **The cache.** ``_create_batch_processor`` builds one ``PagedAttentionCache`` from the text
  config: layers are grouped by ``config.layer_types`` (``group_layers_by_attn_type``), one
  group per type and ``gcd`` layers per group; a block (``block_size`` tokens, 256 by default)
  is allocated to a group at once, for all its layers. Each layer of a group owns
  ``key_cache[j]`` / ``value_cache[j]`` ``[(num_blocks + 2) * block_size, Hkv, D]``, token-major:
  token slot ``block * block_size + offset``. Block ``num_blocks`` is the read trash (zeros,
  never written), block ``num_blocks + 1`` the write trash (padding tokens write there). Types
  other than full / sliding attention are refused (``cache.py``: "Invalid group type"), so
  the M3 sparse type is grouped as full attention here (``_group_layers``): a sparse layer
  keeps every token's K/V, and all layers then share one block table.
  ``num_blocks`` and ``max_batch_tokens`` come from ``PagedAttentionMemoryHandler``: the
  free device memory times ``max_memory_percent`` (0.8 / 0.9 by default), less activation
  peaks, over the per-token K/V bytes of all layers (``page_size``: ``Hkv * D`` per layer,
  K or V), which ``_MemoryHandler`` grows by the sparse layers' index keys.
* **Each step.** ``ContinuousBatchingIOs.get_model_kwargs`` hands the model one packed row:
  ``input_ids`` / ``position_ids`` ``[1, T]`` (every scheduled request's new tokens, prefill
  chunks and decode rows mixed, in request order), ``cu_seq_lens_q`` ``[R + 1]``,
  ``cu_seq_lens_k`` ``[R + 1]`` (past plus new tokens per request), ``max_seqlen_q`` /
  ``max_seqlen_k`` (host ints), ``cache``, ``write_index`` / ``read_index`` (a list with one
  int64 tensor per group: the cache slot of every new token, and of every history token of
  every request in order, the new ones included; ``read_index`` is empty when no request has
  a history), ``block_table`` and ``use_cache=False``, no ``past_key_values``. The model passes
  these keywords through every layer to the attention function, which receives
  ``query [1, Hq, T, D]``, the new ``key`` / ``value [1, Hkv, T, D]`` and must write them itself
  (``paged|sdpa`` calls ``cache.update``, which gathers the whole history through
  ``read_index``).
* **The decode fast path.** When every request brings one token (and ``max_blocks_per_request
  > 0``), ``block_table`` ``[groups, R, max_blocks_per_request]`` (block ids, ``-1`` past a
  request's blocks) replaces the indices: ``write_index`` / ``read_index`` are then stale and
  must not be read, and ``max_seqlen_q`` / ``max_seqlen_k`` are 1.
* **Static shapes.** With CUDA graphs or ``torch.compile`` the step is padded: ``T`` grows past
  ``cu_seq_lens_q[-1]`` (padding tokens write to the write trash), extra requests of length 0
  fill ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and ``max_seqlen_k`` is rounded up; a graph is
  captured per padded shape and replayed, so nothing here may read the device from the host.

What this module adds: per step, one :class:`ServingStep` (the requests' page tables in pages
of ``page_size`` tokens, the largest size of the kernels that divides ``block_size``; kv
lengths; the cache slot of every new token), built on the device from those keywords. Each
sparse layer keeps its index keys in a pool of its own, ``[(num_blocks + 2) * block_size,
Di]``, indexed by the same cache slots as its K/V: index keys live in the blocks the manager
allocates, are freed with them and shared with them by prefix caching (an index key, like
K/V, depends only on the tokens up to it). A layer writes its K/V and index keys at the new
tokens' slots, selects blocks with ``index_topk`` and attends with ``sparse_attention`` (the
decode kernel or KV-outer from ``max_seqlen_q``), full-attention layers with
``dense_paged_attention``, all on views of transformers' own pools.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import continuous_api as cb_api
from transformers.generation.continuous_batching import initialization as cb_init
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..core.validate import SUPPORTED_PAGE_SIZES
from .calls import call_op
from .impl import ATTN_IMPLEMENTATION, names_m3_sparse

PAGED = "paged|"
CB_IMPLEMENTATION = f"{PAGED}{ATTN_IMPLEMENTATION}"
SPARSE_LAYER_TYPE = "minimax_m3_sparse"

_ORIGINAL_GROUP_LAYERS = getattr(
    cb_cache.group_layers_by_attn_type, "m3_sparse_original", cb_cache.group_layers_by_attn_type
)

_ORIGINAL_RESOLVE_CONFIG = getattr(
    cb_api.resolve_continuous_batching_config, "m3_sparse_original", cb_api.resolve_continuous_batching_config
)

_ORIGINAL_MEMORY_HANDLER = getattr(
    cb_cache.PagedAttentionMemoryHandler, "m3_sparse_original", cb_cache.PagedAttentionMemoryHandler
)


def uses_paged_m3_sparse(config) -> bool:
    """Whether ``config`` runs ``paged|m3_sparse``, or ``paged|`` + a hub string of this package
    (the name continuous batching gives a model loaded with the hub string)."""
    impl = getattr(config, "_attn_implementation", None)
    return isinstance(impl, str) and impl.startswith(PAGED) and names_m3_sparse(impl[len(PAGED):])


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


def _group_layers(config):
    """``group_layers_by_attn_type`` with M3's sparse layers grouped as full attention (they
    keep every token's K/V), for models running ``paged|m3_sparse``."""
    types = getattr(config, "layer_types", None)
    if uses_paged_m3_sparse(config) and types and SPARSE_LAYER_TYPE in types:
        config = copy.copy(config)
        config.layer_types = ["full_attention" if t == SPARSE_LAYER_TYPE else t for t in types]
    return _ORIGINAL_GROUP_LAYERS(config)


_group_layers.m3_sparse_original = _ORIGINAL_GROUP_LAYERS


class _MemoryHandler(_ORIGINAL_MEMORY_HANDLER):
    """transformers' sizing of the cache (``max_memory_percent`` of the free memory), with the
    index keys of the sparse layers counted in each token's bytes: they are spread over the
    ``2 * group_size`` cache tensors that ``page_size`` (elements per tensor and token) stands for,
    rounded up. The activation terms that read ``page_size`` grow with it: the estimate errs
    towards a smaller pool."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        types = getattr(config, "layer_types", None) or []
        sparse = sum(t == SPARSE_LAYER_TYPE for t in types)
        if uses_paged_m3_sparse(config) and sparse:
            self.page_size += -(-sparse * config.index_head_dim // (2 * self.group_size))


_MemoryHandler.m3_sparse_original = _ORIGINAL_MEMORY_HANDLER


def _resolve_config(config, cb_config, workload_hints, has_logit_processors):
    """``resolve_continuous_batching_config`` for ``paged|m3_sparse``: transformers' own steps
    (``initialization.py``), told two facts its checks only know of flash attention:

    * the decode fast path works: :func:`build_step` reads the manager's ``block_table``, so
      ``max_blocks_per_request`` keeps its value (the user's, the workload hints', else enough
      blocks for ``max_position_embeddings``) instead of dropping to 0, which would make every
      decode step rebuild the read index of all history tokens on the host;
    * no attention mask is needed: CUDA graphs and asynchronous batching are on by default
      on CUDA, and the varlen path is not compiled by default (host-side ``max_seqlen_*`` vary),
      as for flash attention.

    Explicit settings of ``ContinuousBatchingConfig`` are kept, as transformers keeps them."""
    if not uses_paged_m3_sparse(config):
        return _ORIGINAL_RESOLVE_CONFIG(config, cb_config, workload_hints, has_logit_processors)
    cb_config = copy.deepcopy(cb_config)
    graphs_requested = any([cb_config.q_padding_interval_size, cb_config.kv_padding_interval_size])
    cb_init.resolve_using_hints(cb_config, workload_hints)
    positions = getattr(config, "max_position_embeddings", None)
    if cb_config.max_blocks_per_request is None and positions:
        # Without hints (init_continuous_batching), a table wide enough for any request the
        # model can take: transformers' fallback (32 blocks) would send every longer request's
        # decode rows back to the read index. A table row costs 4 bytes per block.
        blocks = -(-positions // cb_config.block_size) + 1
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
    cb_init.resolve_max_memory_percent(cb_config=cb_config, has_logit_processors=has_logit_processors)
    return cb_config


_resolve_config.m3_sparse_original = _ORIGINAL_RESOLVE_CONFIG


def page_size_for(block_size: int) -> int:
    """The kernels' page size for a continuous-batching cache of ``block_size`` tokens per
    block: the largest supported size that divides it (a block is then whole pages)."""
    for size in sorted(SUPPORTED_PAGE_SIZES, reverse=True):
        if block_size % size == 0:
            return size
    raise ValueError(
        f"{CB_IMPLEMENTATION}: ContinuousBatchingConfig(block_size={block_size}) is not a multiple of a page size "
        f"the kernels take {SUPPORTED_PAGE_SIZES}; use a block size such as 256 (the default) or 128."
    )


# ---------------------------------------------------------------------------------------
# one step's layout
# ---------------------------------------------------------------------------------------
@dataclass
class ServingStep:
    """The packed step of every layer, in the kernels' terms. ``R`` requests plus one
    trailing sequence with no key that owns the padding tokens past ``cu_seq_lens_q[-1]``
    (none without padding): the ops need every query row inside ``cu_seqlens_q``.

    block_tables [R + 1, W] int32: page ids (pages of ``page_size`` tokens);
    cu_seqlens_q [R + 2] int32; kv_lens [R + 1] int32 (history plus new tokens);
    slots [T] int64: the cache slot each new token writes to.
    """

    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    slots: torch.Tensor
    page_size: int
    max_seqlen_q: int
    write_index: list | None  # the step's keyword (kept to tell steps apart, never read)


def _pages_from_slots(slots, starts, kv_lens, width: int, page_size: int) -> torch.Tensor:
    """Page tables [R, width] from the cache slots of each request's tokens in order
    (request ``r``'s start at ``starts[r]``): page ``w`` holds tokens ``w*P ..``, all in one
    block, so its id is the slot of its first token over ``P``. Pages past a request's
    tokens read 0 (never dereferenced)."""
    first = torch.arange(width, device=slots.device, dtype=torch.int64) * page_size  # [W]
    where = (starts.to(torch.int64)[:, None] + first[None, :]).clamp(max=max(slots.numel() - 1, 0))
    pages = slots[where] // page_size if slots.numel() else torch.zeros_like(where)
    return torch.where(first[None, :] < kv_lens[:, None], pages, 0).to(torch.int32)


def _pages_from_blocks(blocks: torch.Tensor, pages_per_block: int) -> torch.Tensor:
    """Page tables [R, MB * pages_per_block] from block tables [R, MB] (``-1`` = no block)."""
    sub = torch.arange(pages_per_block, device=blocks.device, dtype=torch.int64)
    pages = blocks.to(torch.int64).clamp(min=0)[:, :, None] * pages_per_block + sub
    return pages.reshape(blocks.shape[0], -1).to(torch.int32)


def _decode_slots(tables, cu_q, kv_lens, num_tokens: int, page_size: int, trash: int) -> torch.Tensor:
    """Cache slot of every new token from the page tables (the decode fast path passes no
    write index): token ``i`` of a request with ``n`` new tokens sits at ``kv_len - n + i``;
    padding tokens go to the write trash."""
    cu = cu_q.to(torch.int64)
    t = torch.arange(num_tokens, device=cu.device, dtype=torch.int64)
    req = torch.searchsorted(cu[1:], t, right=True)  # [T], R for padding tokens
    real = req < kv_lens.shape[0]
    r = req.clamp(max=kv_lens.shape[0] - 1)
    pos = (kv_lens.to(torch.int64)[r] - (cu[r + 1] - t)).clamp(min=0)
    page = tables.to(torch.int64)[r, pos // page_size]
    return torch.where(real, page * page_size + pos % page_size, trash)


def build_step(cache: PagedAttentionCache, kwargs: dict, num_tokens: int) -> ServingStep:
    """The :class:`ServingStep` of the keywords continuous batching passed the model, built
    on the device (no host read, so a captured graph replays it)."""
    if cache.num_groups != 1:
        raise ValueError(
            f"{CB_IMPLEMENTATION}: expected one layer group in the continuous-batching cache (all M3 layers keep "
            f"every token), got {cache.num_groups}"
        )
    page_size = page_size_for(cache.block_size)
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = kwargs["cu_seq_lens_k"]
    if isinstance(cu_k, dict):
        cu_k = cu_k["full_attention"]
    kv_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    block_table = kwargs.get("block_table")
    if block_table is not None:
        tables = _pages_from_blocks(block_table[0], cache.block_size // page_size)
        slots = _decode_slots(tables, cu_q, kv_lens, num_tokens, page_size, cache.write_trash_index)
    else:
        max_k = kwargs["max_seqlen_k"]
        max_k = max_k["full_attention"] if isinstance(max_k, dict) else max_k
        slots = kwargs["write_index"][0]
        read = kwargs["read_index"][0]
        # With no history to read (fresh prompts only) the written slots are the whole history.
        history = read if read.numel() else slots
        tables = _pages_from_slots(history, cu_k[:-1], kv_lens, max(1, -(-int(max_k) // page_size)), page_size)
    device = tables.device
    end = torch.full((1,), num_tokens, dtype=cu_q.dtype, device=device)
    return ServingStep(
        block_tables=torch.cat([tables, torch.zeros_like(tables[:1])]),
        cu_seqlens_q=torch.cat([cu_q, end]).to(torch.int32),
        kv_lens=torch.cat([kv_lens, torch.zeros_like(kv_lens[:1])]),
        slots=slots[:num_tokens].to(torch.int64),
        page_size=page_size,
        max_seqlen_q=int(kwargs["max_seqlen_q"]),
        write_index=kwargs.get("write_index"),
    )


# ---------------------------------------------------------------------------------------
# per cache: the index-key pools and the current step
# ---------------------------------------------------------------------------------------
class _CacheState:
    """What one continuous-batching cache carries for ``paged|m3_sparse``."""

    def __init__(self):
        self.index_keys: dict[int, torch.Tensor] = {}
        self.step: ServingStep | None = None


_STATES: "weakref.WeakKeyDictionary[PagedAttentionCache, _CacheState]" = weakref.WeakKeyDictionary()


def _state(cache: PagedAttentionCache) -> _CacheState:
    state = _STATES.get(cache)
    if state is None:
        state = _STATES[cache] = _CacheState()
    return state


def index_key_pool(cache: PagedAttentionCache, layer_idx: int, head_dim: int) -> torch.Tensor:
    """Layer ``layer_idx``'s index keys ``[(num_blocks + 2) * block_size, Di]``, slot for slot
    beside its K/V (zeros until written: the read-trash block stays zero)."""
    pools = _state(cache).index_keys
    pool = pools.get(layer_idx)
    if pool is None:
        slots = cache.key_cache[0].shape[0]
        pool = pools[layer_idx] = torch.zeros(slots, head_dim, dtype=cache.dtype, device=cache.key_cache[0].device)
        torch._dynamo.mark_static_address(pool)
    return pool


class ServingLayer:
    """One attention layer's view of the step: what the M3 attention module calls
    ``past_key_values`` (``update``) and what the indexer and the attention function read."""

    def __init__(self, cache: PagedAttentionCache, step: ServingStep, layer_idx: int):
        self.cache, self.step, self.layer_idx = cache, step, layer_idx

    def _pool(self, flat: torch.Tensor) -> torch.Tensor:
        """A token-major pool ``[slots, ...]`` as pages ``[pages, P, ...]``."""
        return flat.view(-1, self.step.page_size, *flat.shape[1:])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None):
        """Write the new K/V ``[1, Hkv, T, D]`` at the step's slots; return the pools as the
        kernels read them, ``[pages, Hkv, P, D]`` views of transformers' storage."""
        _, j = self.cache.layer_index_to_group_indices[self.layer_idx]
        pools = []
        for flat, new in ((self.cache.key_cache[j], key_states), (self.cache.value_cache[j], value_states)):
            flat.index_copy_(0, self.step.slots, new[0].transpose(0, 1).to(flat.dtype))
            pools.append(self._pool(flat).permute(0, 2, 1, 3))
        return tuple(pools)

    def update_index(self, index_keys: torch.Tensor) -> torch.Tensor:
        """Write the new index keys ``[T, Di]`` at the step's slots; return the pool as
        pages ``[pages, P, Di]``."""
        flat = index_key_pool(self.cache, self.layer_idx, index_keys.shape[-1])
        flat.index_copy_(0, self.step.slots, index_keys.to(flat.dtype))
        return self._pool(flat)


def layer_for(module: torch.nn.Module, kwargs: dict, num_tokens: int) -> ServingLayer:
    """The :class:`ServingLayer` of attention ``module`` for the step described by the
    continuous-batching ``kwargs``. The first layer builds the step; the others reuse it
    (a graph capture reruns the first layer, so the step is captured with it)."""
    cache = kwargs.get("cache")
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(
            f"{CB_IMPLEMENTATION} runs under transformers' continuous batching (generate_batch, "
            "init_continuous_batching), which passes its paged cache to every layer; for generate() load the model "
            f"with attn_implementation='{ATTN_IMPLEMENTATION}'."
        )
    state = _state(cache)
    step = state.step
    if module.layer_idx == 0 or step is None or step.write_index is not kwargs.get("write_index"):
        step = state.step = build_step(cache, kwargs, num_tokens)
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
        block_tables=step.block_tables,
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
    """Attention interface of ``paged|m3_sparse``: query ``[1, Hq, T, D]`` (the packed step) ->
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
        block_tables=step.block_tables,
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


_REGISTERED = False


def register() -> None:
    """Register ``paged|m3_sparse`` with transformers; in its continuous-batching cache, group
    M3's sparse layers as full attention and count their index keys in the sizing; resolve its
    configuration with the decode fast path and without a mask (:func:`_resolve_config`).
    Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    AttentionInterface.register(CB_IMPLEMENTATION, paged_m3_sparse_attention)
    cb_cache.group_layers_by_attn_type = _group_layers
    cb_cache.PagedAttentionMemoryHandler = _MemoryHandler
    cb_api.resolve_continuous_batching_config = _resolve_config
    _REGISTERED = True
