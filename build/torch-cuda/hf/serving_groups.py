"""``paged|m3_sparse`` in the continuous-batching cache of transformers 5.17 (before the 5.18
allocators; ``compat.CB_ALLOCATORS``).

That cache groups layers by ``config.layer_types`` (``group_layers_by_attn_type``: one group
per type, ``gcd`` layers per group) and allocates a block (``block_size`` tokens) to a group
at once, for all its layers. Each layer of a group owns ``key_cache[j]`` / ``value_cache[j]``
``[(num_blocks + 2) * block_size, Hkv, D]``, token-major: slot ``block * block_size + offset``.
Block ``num_blocks`` is the read trash (zeros, never written), block ``num_blocks + 1`` the write
trash. Types other than full and sliding attention are refused ("Invalid group type"), so M3's
sparse type is grouped as full attention here (:func:`_group_layers`): a sparse layer keeps
every token's K/V, and all layers share one block table. Each sparse layer keeps its index keys
in a pool of its own, ``[(num_blocks + 2) * block_size, Di]``, indexed by the same slots as its
K/V: they live in the blocks the manager allocates, are freed with them and shared with them
by prefix caching (an index key, like K/V, depends only on the tokens up to it).
``PagedAttentionMemoryHandler`` sizes the cache from the per-token K/V bytes of all layers and
what an eager or sdpa step allocates; :class:`_MemoryHandler` counts the index keys too and
reserves what m3_sparse allocates instead. ``PagedAttentionCache.copy_cache`` copies a forked
request's blocks in K/V; :func:`_copy_cache` copies their index keys too. :func:`_mark_complete`
keeps the manager alive when a request is cancelled while a step holds it.
"""

from __future__ import annotations

import copy

import torch
from transformers.generation.continuous_batching import cache as cb_cache

from .serving_layout import (
    CB_IMPLEMENTATION, SPARSE_LAYER_TYPE, PoolsByCache, page_size_for, runs_m3_sparse, sparse_step_bytes,
    step_bytes_per_cache_token,
)

_ORIGINAL_GROUP_LAYERS = getattr(
    cb_cache.group_layers_by_attn_type, "m3_sparse_original", cb_cache.group_layers_by_attn_type
)
_ORIGINAL_MEMORY_HANDLER = getattr(
    cb_cache.PagedAttentionMemoryHandler, "m3_sparse_original", cb_cache.PagedAttentionMemoryHandler
)
_ORIGINAL_COPY_CACHE = getattr(
    cb_cache.PagedAttentionCache.copy_cache, "m3_sparse_original", cb_cache.PagedAttentionCache.copy_cache
)
_ORIGINAL_MARK_COMPLETE = getattr(
    cb_cache.PagedAttentionCache.mark_shareable_blocks_as_complete, "m3_sparse_original",
    cb_cache.PagedAttentionCache.mark_shareable_blocks_as_complete,
)


def _group_layers(config):
    """``group_layers_by_attn_type`` with M3's sparse layers grouped as full attention (they
    keep every token's K/V), for models running ``paged|m3_sparse``."""
    types = getattr(config, "layer_types", None)
    if runs_m3_sparse(config) and types and SPARSE_LAYER_TYPE in types:
        config = copy.copy(config)
        config.layer_types = ["full_attention" if t == SPARSE_LAYER_TYPE else t for t in types]
    return _ORIGINAL_GROUP_LAYERS(config)


_group_layers.m3_sparse_original = _ORIGINAL_GROUP_LAYERS


class _MemoryHandler(_ORIGINAL_MEMORY_HANDLER):
    """transformers' sizing of the cache (``max_memory_percent`` of the free memory) for a model
    running m3_sparse (others get transformers' own):

    * the index keys of the sparse layers counted in each token's bytes: they are spread over
      the ``2 * group_size`` cache tensors that ``page_size`` (elements per tensor and token)
      stands for, rounded up. The new K/V of the attention peak, which read ``page_size``, grow
      with it: the estimate errs towards a smaller pool;
    * no attention mask (the ``M * N`` and ``M * M`` terms) and no K/V read back from the cache
      (the attention peak's ``delta_n``): the kernels read the pools in place;
    * what m3_sparse allocates per batch token instead (``sparse_step_bytes``), added
      to the attention peak's ``delta_m``;
    * per cache token, at every peak (a step keeps them to its end), what a step with the
      pool's whole history allocates (``step_bytes_per_cache_token``): the group's page table,
      one for K/V and the index keys beside them, and KV-outer's segments. This handler has no
      fixed term for the temporaries of the table's build (``TABLE_BUILD_BYTES``): they are
      left to the memory ``max_memory_percent`` keeps free.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.m3_sparse = runs_m3_sparse(config)
        if not self.m3_sparse:
            return
        types = getattr(config, "layer_types", None) or []
        sparse = sum(t == SPARSE_LAYER_TYPE for t in types)
        if sparse:
            self.page_size += -(-sparse * config.index_head_dim // (2 * self.group_size))
        self.num_attention_masks = 0
        self.sparse_step_bytes = sparse_step_bytes(config, self.activation_dtype)
        self.step_cache_token_bytes = step_bytes_per_cache_token(config, self.cb_config, self.num_groups)

    @property
    def activation_peak(self) -> dict[str, tuple[int, ...]]:
        peaks = super().activation_peak
        if self.m3_sparse:
            delta_m, _, delta_mm, delta_mn = peaks["attention"]
            peaks["attention"] = (delta_m + self.sparse_step_bytes, 0, delta_mm, delta_mn)
            for name, (delta_m, delta_n, delta_mm, delta_mn) in peaks.items():
                peaks[name] = (delta_m, delta_n + self.step_cache_token_bytes, delta_mm, delta_mn)
        return peaks


_MemoryHandler.m3_sparse_original = _ORIGINAL_MEMORY_HANDLER


class _Group:
    """The one layer group: token-major pools, so a kernel page of ``page_size`` tokens starts
    at a slot that is a multiple of ``page_size`` and its id is that slot over ``page_size``."""

    reads_per_page = False  # 5.17's read index: every token's slot

    def __init__(self, cache: cb_cache.PagedAttentionCache, page_size: int):
        self.cache, self.page_size = cache, page_size
        self.tokens_per_page = cache.block_size
        self.write_trash_index = cache.write_trash_index
        self.index_keys: dict[int, torch.Tensor] = {}

    def page_tables(self, first_slots):
        pages = (first_slots // self.page_size).to(torch.int32)
        return pages, pages  # the index keys sit slot for slot beside K/V

    def _flat(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, j = self.cache.layer_index_to_group_indices[layer_idx]
        return self.cache.key_cache[j], self.cache.value_cache[j]

    def _pages(self, flat: torch.Tensor) -> torch.Tensor:
        """A token-major pool ``[slots, ...]`` as pages ``[pages, page_size, ...]``."""
        return flat.view(-1, self.page_size, *flat.shape[1:])

    def write_kv(self, layer_idx, keys, values, slots):
        for flat, new in zip(self._flat(layer_idx), (keys, values)):
            flat.index_copy_(0, slots, new.to(flat.dtype))

    def kv_pools(self, layer_idx):
        return tuple(self._pages(flat).permute(0, 2, 1, 3) for flat in self._flat(layer_idx))

    def _index_flat(self, layer_idx: int, head_dim: int) -> torch.Tensor:
        """Layer ``layer_idx``'s index keys ``[(num_blocks + 2) * block_size, Di]``, slot for
        slot beside its K/V (zeros until written: the read-trash block stays zero)."""
        pool = self.index_keys.get(layer_idx)
        if pool is None:
            keys = self.cache.key_cache[0]
            pool = torch.zeros(keys.shape[0], head_dim, dtype=keys.dtype, device=keys.device)
            self.index_keys[layer_idx] = pool
            torch._dynamo.mark_static_address(pool)
        return pool

    def write_index_keys(self, layer_idx, keys, slots):
        flat = self._index_flat(layer_idx, keys.shape[-1])
        flat.index_copy_(0, slots, keys.to(flat.dtype))

    def index_pool(self, layer_idx, head_dim):
        return self._pages(self._index_flat(layer_idx, head_dim))

    def copy_blocks(self, source: list[int], forked: list[int]) -> None:
        """Copy the index keys of blocks ``source`` to blocks ``forked`` (a fork's copies)."""
        device = self.cache.key_cache[0].device
        src, dst = (torch.tensor(ids, device=device, dtype=torch.int64) for ids in (source, forked))
        for flat in self.index_keys.values():
            blocks = flat.view(-1, self.tokens_per_page, flat.shape[-1])
            blocks[dst] = blocks[src]


class Pools:
    """The cache as the kernels read it: one layer group."""

    def __init__(self, cache: cb_cache.PagedAttentionCache):
        if cache.num_groups != 1:
            raise ValueError(
                f"{CB_IMPLEMENTATION}: expected one layer group in the continuous-batching cache (all M3 layers keep "
                f"every token), got {cache.num_groups}"
            )
        self.page_size = page_size_for(cache.block_size)
        self.groups = [_Group(cache, self.page_size)]

    def group_of(self, layer_idx: int) -> int:
        return 0


pools_of = PoolsByCache(Pools)


def _copy_cache(self, list_source_blocks, list_forked_blocks):
    """``PagedAttentionCache.copy_cache``, which copies a forked request's last blocks (its
    children share the complete ones) in the K/V tensors it knows of, then the same blocks of
    the index keys: a child would otherwise select its blocks from keys never written there."""
    _ORIGINAL_COPY_CACHE(self, list_source_blocks, list_forked_blocks)
    pools = pools_of.get(self)
    if pools is not None:
        pools.groups[0].copy_blocks(list_source_blocks, list_forked_blocks)


_copy_cache.m3_sparse_original = _ORIGINAL_COPY_CACHE


def _mark_complete(self, state, num_complete_blocks: int) -> None:
    """``PagedAttentionCache.mark_shareable_blocks_as_complete``, which for a model running
    m3_sparse skips a request cancelled while a step that holds it was in flight: under async
    batching, preparing the next step frees its block table before this step's update marks its
    blocks, and the lookup's KeyError would stop the manager (5.18's allocators:
    ``serving_allocator._CancelledInFlight``)."""
    if runs_m3_sparse(self.config) and any(state.request_id not in cm.block_table for cm in self.group_cache_managers):
        return None
    return _ORIGINAL_MARK_COMPLETE(self, state, num_complete_blocks)


_mark_complete.m3_sparse_original = _ORIGINAL_MARK_COMPLETE


def install() -> None:
    """Group M3's sparse layers as full attention in the manager's cache, count their index keys
    in its sizing, copy them with K/V when a request forks, and keep the manager alive when a
    request is cancelled in flight."""
    cb_cache.group_layers_by_attn_type = _group_layers
    cb_cache.PagedAttentionMemoryHandler = _MemoryHandler
    cb_cache.PagedAttentionCache.copy_cache = _copy_cache
    cb_cache.PagedAttentionCache.mark_shareable_blocks_as_complete = _mark_complete
