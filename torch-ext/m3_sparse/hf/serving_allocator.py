"""``paged|m3_sparse`` in the continuous-batching cache of transformers 5.18 and later
(``compat.CB_ALLOCATORS``).

That cache (``generation/continuous_batching/cache.py``) is one byte tensor cut into sectors;
each layer type of ``config.layer_types`` gets the allocator class that
``cache.ATTN_TYPE_TO_ALLOCATOR`` names for it, which takes sectors as it needs them and cuts
them into blocks of one page per layer of its type (``page_size`` tokens per page). M3's
full-attention layers get transformers' ``FullAttentionCacheAllocator`` (as
:class:`M3FullCacheAllocator`, below); its sparse layers
(``minimax_m3_sparse``) get :class:`M3SparseCacheAllocator`, registered here, whose page holds
a layer's K, V **and index keys** for the same tokens. So the index keys live beside K/V slot
for slot: in the blocks the manager allocates, freed, forked and shared by prefix caching with
them (an index key, like K/V, depends only on the tokens up to it), and counted in the sizing
(``bytes_per_block``). A request has one block table per allocator.

What transformers' manager needs beside the registry, and gets here (:func:`install`):
``ContinuousBatchingIOs`` keeps the key lengths of full and sliding attention only (rows of one
input tensor); the sparse type reads the full-attention row (:func:`_setup_static_tensors`):
its layers keep every token, so their key lengths are the same. ``PagedAttentionMemoryHandler``
reserves what an eager or sdpa step allocates beside the cache; :class:`_MemoryHandler`
reserves what m3_sparse allocates instead. On 5.18, ``group_layers_by_attn_type`` takes the
registry's types too (:func:`_group_layers`). Both allocators of an m3_sparse model give the
manager read indices of one slot per page instead of one per token (:class:`_PageReads`): the
full-attention type is registered as :class:`M3FullCacheAllocator`, which is transformers'
own class for every other model. A request cancelled while a step that holds it is in flight
(async batching) keeps the manager alive (:class:`_CancelledInFlight`). A decode step copies
each request's kept row of the block table instead of building it again (:class:`_KeptTableRows`).
"""

from __future__ import annotations

from math import gcd

import torch
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import input_outputs as cb_io
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from . import compat
from .serving_layout import (
    CB_IMPLEMENTATION, SPARSE_LAYER_TYPE, TABLE_BUILD_BYTES, PoolsByCache, page_size_for, runs_m3_sparse,
    sparse_step_bytes, step_bytes_per_cache_token,
)

FULL_LAYER_TYPE = "full_attention"  # FullAttentionCacheAllocator's layer type (its registry key)
KEPT_ROWS_SLACK = 64  # kept decode-table rows allowed beyond twice the live tables before a sweep
_INT32_MAX = 2**31 - 1


class _PageReads:
    """Read indices of one slot per cache page (a page's first token), not one per token.

    transformers builds a step's read index as a Python list of every history token of every
    request, per allocator, then copies it to the device: tens of milliseconds a step with a
    long history, and the manager does it again for each allocator. m3_sparse reads no K/V back
    through it (the kernels read the pools in place); the step only needs where each page of a
    request starts (``serving_layout.build_step``, ``reads_per_page``)."""

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        table = self.block_table.get(request_id)
        if table is None:
            raise ValueError(f"No block table found for request {request_id}")
        pages = -(-(past_length + query_length) // self.tokens_per_page)
        stride = self.block_physical_stride
        return [entry * stride for entry in table[:pages]]


class _CancelledInFlight:
    """Blocks of a request cancelled while a step that holds it was in flight are not hashed.

    Under async batching (transformers' default with CUDA graphs) the manager prepares step
    N + 1 while step N runs: preparing it drops the requests a client cancelled and frees their
    block tables, then step N's update registers the hashes of the blocks each of its requests
    completed, cancelled ones included (their status is still decoding or prefilling). The base
    allocator then looks up a table that is gone, and the KeyError kills the manager's loop,
    which stops the server. A request whose table is gone has nothing left to hash."""

    def mark_complete_blocks(self, request_id: str, *args, **kwargs) -> None:
        if request_id not in self.block_table:
            return
        super().mark_complete_blocks(request_id, *args, **kwargs)


class _KeptTableRows:
    """A request's row of the decode fast path's block table, made when its blocks change.

    On the decode fast path the manager writes every request's row of the kernels' block table
    at every step, once per allocator (two for M3), building it from the request's block list
    with ``torch.tensor`` and a multiply: with a dozen requests, most of a decode step's host
    preparation (docs/perf-log/2026-12-06.md). A request's blocks change once a page of tokens
    (or when a complete block is swapped for an identical cached one), so the row is made then
    and copied at the other steps; a request's kept row goes when its blocks are freed."""

    def fill_block_table(self, request_id: str, past_length: int, query_length: int, block_table: torch.Tensor) -> None:
        block_ids = self.block_table[request_id]
        rows = vars(self).setdefault("_kept_rows", {})
        kept = rows.get(request_id)
        if kept is None or kept[0] != block_ids or kept[1].dtype != block_table.dtype:
            stride = self.block_physical_stride // self.tokens_per_page
            entries = torch.tensor(block_ids, dtype=block_table.dtype) * stride
            kept = rows[request_id] = (list(block_ids), entries)
            if len(rows) > 2 * len(self.block_table) + KEPT_ROWS_SLACK:
                # Rows of requests whose tables went without free_blocks (none of transformers'
                # paths does that today): a long-running server's memory stays flat regardless.
                for gone in [r for r in rows if r not in self.block_table]:
                    del rows[gone]
        block_table[: len(block_ids)].copy_(kept[1], non_blocking=True)

    def free_blocks(self, request_id: str, *args, **kwargs) -> None:
        vars(self).get("_kept_rows", {}).pop(request_id, None)
        super().free_blocks(request_id, *args, **kwargs)


class M3FullCacheAllocator(_PageReads, _CancelledInFlight, _KeptTableRows, FullAttentionCacheAllocator):
    """transformers' ``FullAttentionCacheAllocator`` with :class:`_PageReads`,
    :class:`_CancelledInFlight` and :class:`_KeptTableRows`, for the full-attention layers of
    a model that runs m3_sparse. Registered for the full-attention
    type, it makes transformers' own class for every other model (the instance is exactly
    what transformers would have made)."""

    def __new__(cls, *args, **kwargs):
        # transformers passes every argument by keyword; the config is the second parameter.
        if not runs_m3_sparse(kwargs["config"] if "config" in kwargs else args[1]):
            return FullAttentionCacheAllocator(*args, **kwargs)
        return super().__new__(cls)


class M3SparseCacheAllocator(_PageReads, _CancelledInFlight, _KeptTableRows, FullAttentionCacheAllocator):
    """Cache allocator of M3's sparse-attention layers: a page holds one layer's keys, values and
    index keys of ``P`` tokens, ``[K: P x Hkv x D | V: P x Hkv x D | index keys: P x Di]``, and a
    block holds one page per sparse layer, in ``layer_indices`` order.

    Blocks, tables and indices work as in ``FullAttentionCacheAllocator``, which it extends
    (``rows_per_token = 1``: a slot counts tokens): block ``b``'s table entry is ``b * L`` (``L``
    sparse layers) and its token ``t`` has slot ``b * L * P + t``. So a table entry ``e`` holds
    slots ``e * P`` to ``e * P + P - 1``, and each layer's page of it starts ``e * page_numel``
    elements after that layer's page of block 0: slot ``s``'s keys start
    ``(s // P) * page_numel + (s % P) * Hkv * D`` elements after the layer's first keys, its index
    key ``(s // P) * page_numel + (s % P) * Di`` after the layer's first index key. The kernels
    read pages of ``p`` tokens (``p`` divides ``P``) through strided views whose page stride
    divides both a page's elements and a run of ``p`` tokens' keys (index keys): their gcd, so
    every such run is a page of the view.
    """

    layer_type = SPARSE_LAYER_TYPE
    supports_block_sharing = True
    supports_block_table = True
    rows_per_token = 1

    def __init__(self, index, config, num_key_value_heads, cache_dtype, page_size, layer_indices, allow_block_sharing):
        self.head_dim = config.head_dim
        self.index_head_dim = config.index_head_dim
        self.num_key_value_heads = num_key_value_heads
        self.cache_dtype = cache_dtype
        self.kv_numel = num_key_value_heads * self.head_dim  # one token's keys (or values)
        self.page_numel = page_size * (2 * self.kv_numel + self.index_head_dim)
        self._before_cache_tensor_init(
            index=index,
            layer_indices=layer_indices,
            tokens_per_page=page_size,
            bytes_per_page=self.page_numel * cache_dtype.itemsize,
            allow_block_sharing=allow_block_sharing,
        )

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        """Views of the cache tensor (the two trash sectors included): per layer, its keys,
        values and index keys by (table entry, token), ``[entries, P, Hkv, D]`` and
        ``[entries, P, Di]``."""
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)  # block copies (forks)
        typed = cache_tensor.view(self.cache_dtype)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, typed, pool)
        blocks = cache_tensor.numel() // self.bytes_per_block
        # Entries b * L of every block; the ones between them are never used.
        self.num_entries = (blocks - 1) * self.pages_per_block + 1
        p, kv, di = self.tokens_per_page, self.kv_numel, self.index_head_dim
        self._token_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for i, layer_idx in enumerate(self.layer_indices):
            base = i * self.page_numel
            kv_shape, kv_strides = (self.num_entries, p, self.num_key_value_heads, self.head_dim), (
                self.page_numel, kv, self.head_dim, 1,
            )
            self._token_views[layer_idx] = (
                typed.as_strided(kv_shape, kv_strides, base),
                typed.as_strided(kv_shape, kv_strides, base + p * kv),
                typed.as_strided((self.num_entries, p, di), (self.page_numel, di, 1), base + 2 * p * kv),
            )
        self._kernel_pools: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def _locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots -> (table entry, token in the page), the indices of the token views."""
        return slots // self.tokens_per_page, slots % self.tokens_per_page

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """``CacheAllocator.update``: write the new K/V ``[T, Hkv, D]`` (5.18: ``[1, Hkv, T, D]``,
        transposed here as transformers' own allocators did) at ``write_index``, then read back
        the keys and values at ``read_index`` (the new states themselves when it is empty)."""
        if key_states.dim() == 4:
            key_states, value_states = (x[0].transpose(0, 1) for x in (key_states, value_states))
        keys, values, _ = self._token_views[layer_idx]
        at = self._locate(write_index)
        keys.index_put_(at, key_states)
        values.index_put_(at, value_states)
        if read_index.numel() == 0:
            return key_states, value_states
        at = self._locate(read_index)
        return keys[at], values[at]

    def get_cache_for_block_table(self, layer_idx):
        """A layer's K and V pages ``[entries, P, Hkv, D]``, indexed by this allocator's table
        entries."""
        keys, values, _ = self._token_views[layer_idx]
        return keys, values

    def write_index_keys(self, layer_idx: int, keys: torch.Tensor, write_index: torch.Tensor) -> None:
        """Write a layer's new index keys ``[T, Di]`` at ``write_index``."""
        self._token_views[layer_idx][2].index_put_(self._locate(write_index), keys)

    def read_index_keys(self, layer_idx: int, read_index: torch.Tensor) -> torch.Tensor:
        """A layer's index keys ``[N, Di]`` at ``read_index``."""
        return self._token_views[layer_idx][2][self._locate(read_index)]

    # The kernels' view: pages of ``page_size`` tokens (a divisor of tokens_per_page).
    def _page_stride(self, run_numel: int) -> int:
        return gcd(self.page_numel, run_numel)

    def kernel_page_ids(self, first_slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of the first tokens of kernel pages -> page ids of the K/V pools and of the
        index-key pools (int32)."""
        entry, token = self._locate(first_slots)
        ids = []
        for width in (self.kv_numel, self.index_head_dim):
            offset = entry * self.page_numel + token * width
            ids.append((offset // self._page_stride(page_size * width)).to(torch.int32))
        return ids[0], ids[1]

    def kernel_pools(self, layer_idx: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's K and V pools ``[pages, Hkv, page_size, D]`` and index-key pool
        ``[pages, page_size, Di]``: strided views whose page ``n`` starts ``n`` page strides into
        the layer's first page (most of them straddle tokens of two runs and are never named by a
        table)."""
        key = (layer_idx, page_size)
        pools = self._kernel_pools.get(key)
        if pools is None:
            keys, values, index_keys = self._token_views[layer_idx]
            last_entry = (self.num_entries - 1) * self.page_numel
            tail = self.tokens_per_page - page_size  # the last run's first token in its page
            stride = self._page_stride(page_size * self.kv_numel)
            pages = (last_entry + tail * self.kv_numel) // stride + 1
            shape = (pages, self.num_key_value_heads, page_size, self.head_dim)
            strides = (stride, self.head_dim, self.kv_numel, 1)
            k_pool = keys.as_strided(shape, strides, keys.storage_offset())
            v_pool = values.as_strided(shape, strides, values.storage_offset())
            i_stride = self._page_stride(page_size * self.index_head_dim)
            i_pages = (last_entry + tail * self.index_head_dim) // i_stride + 1
            i_pool = index_keys.as_strided(
                (i_pages, page_size, self.index_head_dim), (i_stride, self.index_head_dim, 1),
                index_keys.storage_offset(),
            )
            if max(pages, i_pages) > _INT32_MAX:
                raise ValueError(
                    f"{CB_IMPLEMENTATION}: the cache's pages of {page_size} tokens would need page ids past int32 "
                    f"({max(pages, i_pages)}); use a smaller cache (num_blocks, max_memory_percent)"
                )
            pools = self._kernel_pools[key] = (k_pool, v_pool, i_pool)
        return pools


def _write_kv(allocator, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Write a layer's new K/V ``[T, Hkv, D]`` through its allocator's own ``update``, with an
    empty read index: the write-only path, which reads nothing back."""
    no_reads = slots[:0]
    allocator.update(compat.cb_allocator_states(keys), compat.cb_allocator_states(values), layer_idx, no_reads, slots)


class _FullGroup:
    """transformers' ``FullAttentionCacheAllocator``: per layer, its keys are rows of one
    token-major view (``get_cache_for_block_table``) where slot ``s`` is row ``s``, so a kernel
    page of ``page_size`` rows has id ``s // page_size``."""

    reads_per_page = True

    def __init__(self, allocator: FullAttentionCacheAllocator, page_size: int):
        self.allocator, self.page_size = allocator, page_size
        self.tokens_per_page = allocator.tokens_per_page
        self.write_trash_index = allocator.write_trash_index
        self._pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def page_tables(self, first_slots):
        return (first_slots // self.page_size).to(torch.int32), None

    def write_kv(self, layer_idx, keys, values, slots):
        _write_kv(self.allocator, layer_idx, keys, values, slots)

    def kv_pools(self, layer_idx):
        pools = self._pools.get(layer_idx)
        if pools is None:
            pages = self.allocator.get_cache_for_block_table(layer_idx)  # [pages, P, Hkv, D] each, contiguous
            pools = self._pools[layer_idx] = tuple(
                x.view(-1, self.page_size, *x.shape[2:]).permute(0, 2, 1, 3) for x in pages
            )
        return pools

    def write_index_keys(self, layer_idx, keys, slots):
        raise ValueError(f"{CB_IMPLEMENTATION}: layer {layer_idx} is a full-attention layer, which has no index keys")

    def index_pool(self, layer_idx, head_dim):
        raise ValueError(f"{CB_IMPLEMENTATION}: layer {layer_idx} is a full-attention layer, which has no index keys")


class _SparseGroup:
    """:class:`M3SparseCacheAllocator`'s layers."""

    reads_per_page = True

    def __init__(self, allocator: M3SparseCacheAllocator, page_size: int):
        self.allocator, self.page_size = allocator, page_size
        self.tokens_per_page = allocator.tokens_per_page
        self.write_trash_index = allocator.write_trash_index

    def page_tables(self, first_slots):
        return self.allocator.kernel_page_ids(first_slots, self.page_size)

    def write_kv(self, layer_idx, keys, values, slots):
        _write_kv(self.allocator, layer_idx, keys, values, slots)

    def kv_pools(self, layer_idx):
        return self.allocator.kernel_pools(layer_idx, self.page_size)[:2]

    def write_index_keys(self, layer_idx, keys, slots):
        self.allocator.write_index_keys(layer_idx, keys, slots)

    def index_pool(self, layer_idx, head_dim):
        return self.allocator.kernel_pools(layer_idx, self.page_size)[2]


class Pools:
    """The manager's cache as the kernels read it: one group per allocator (in the order of the
    manager's block tables and indices), full attention or M3's sparse layers."""

    def __init__(self, cache: cb_cache.PagedAttentionCache):
        allocators = sorted(cache.cache_allocators.values(), key=lambda a: a.index)
        sizes = {a.tokens_per_page for a in allocators}
        if len(sizes) != 1:
            raise ValueError(f"{CB_IMPLEMENTATION}: expected one page size for every layer type, got {sorted(sizes)}")
        self.page_size = page_size_for(sizes.pop())
        self.groups = []
        for allocator in allocators:
            if type(allocator) is M3SparseCacheAllocator:
                self.groups.append(_SparseGroup(allocator, self.page_size))
            elif type(allocator) is M3FullCacheAllocator:
                self.groups.append(_FullGroup(allocator, self.page_size))
            else:
                raise ValueError(
                    f"{CB_IMPLEMENTATION} serves full-attention and M3 sparse layers; the continuous-batching cache "
                    f"gave layers {allocator.layer_indices} a {type(allocator).__name__}"
                )
        self._groups = {layer: a.index for a in allocators for layer in a.layer_indices}

    def group_of(self, layer_idx: int) -> int:
        return self._groups[layer_idx]


pools_of = PoolsByCache(Pools)


# ---------------------------------------------------------------------------------------
# what transformers' manager needs beside the registry
# ---------------------------------------------------------------------------------------
_ORIGINAL_SETUP_STATIC_TENSORS = getattr(
    cb_io.ContinuousBatchingIOs._setup_static_tensors, "m3_sparse_original",
    cb_io.ContinuousBatchingIOs._setup_static_tensors,
)
_ORIGINAL_GROUP_LAYERS = getattr(
    cb_cache.group_layers_by_attn_type, "m3_sparse_original", cb_cache.group_layers_by_attn_type
)
_ORIGINAL_MEMORY_HANDLER = getattr(
    cb_cache.PagedAttentionMemoryHandler, "m3_sparse_original", cb_cache.PagedAttentionMemoryHandler
)


def _setup_static_tensors(self, *args, **kwargs):
    """``ContinuousBatchingIOs._setup_static_tensors``, then the sparse layer type's key lengths:
    the IOs keep ``cumulative_seqlens_k`` for full and sliding attention only, as rows of the
    input tensor they copy to the device in one transfer, and fail on another type of the cache.
    M3's sparse layers keep every token, like full attention, so their key lengths are the
    full-attention row (the same row transformers gives full attention, when no layer is)."""
    _ORIGINAL_SETUP_STATIC_TENSORS(self, *args, **kwargs)
    seqlens = self.cumulative_seqlens_k
    if SPARSE_LAYER_TYPE in self.cache.cache_allocators and SPARSE_LAYER_TYPE not in seqlens:
        full = seqlens.get(FULL_LAYER_TYPE)
        if full is None:
            full = self._bulk_input_tensor[4, : self.max_requests_per_batch + 1]
        seqlens[SPARSE_LAYER_TYPE] = full


_setup_static_tensors.m3_sparse_original = _ORIGINAL_SETUP_STATIC_TENSORS


def _group_layers(config):
    """``group_layers_by_attn_type`` of 5.18, which checked a fixed set of types, taking M3's
    sparse layers as the registry's (as 5.19 does for every registered type)."""
    types = getattr(config, "layer_types", None)
    if not types or SPARSE_LAYER_TYPE not in types:
        return _ORIGINAL_GROUP_LAYERS(config)
    groups: dict[str, list[int]] = {}
    for layer, layer_type in enumerate(types):
        if layer_type not in cb_cache.ATTN_TYPE_TO_ALLOCATOR:
            raise ValueError(f"Invalid layer type: {layer_type}")
        groups.setdefault(layer_type, []).append(layer)
    return groups


_group_layers.m3_sparse_original = _ORIGINAL_GROUP_LAYERS


class _MemoryHandler(_ORIGINAL_MEMORY_HANDLER):
    """transformers' sizing of the cache (``max_memory_percent`` of the free memory), for a model
    running m3_sparse without what only an eager or sdpa step allocates: the attention masks
    (``num_attention_masks``) and the K/V read back from the cache with the KV heads repeated to
    the query heads (``kv_heads_at_peak``: per batch token at the attention peak and per cache
    token), since the kernels read the pools in place. What m3_sparse allocates per batch token
    instead (``sparse_step_bytes``) is added to transformers' figure, whose largest
    peak may be the LM head's, which never coincides with it: the estimate errs towards a
    smaller pool. Per cache token, what a step with the pool's whole history allocates
    (``step_bytes_per_cache_token``: a K/V page table per allocator, one for the sparse layers'
    index keys, KV-outer's segments), and once the temporaries of the tables' build
    (``TABLE_BUILD_BYTES``). Other models get transformers' figures."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.sparse_step_bytes = self.step_cache_token_bytes = self.table_build_bytes = 0
        if runs_m3_sparse(config):
            self.num_attention_masks = 0
            self.kv_heads_at_peak = 0
            self.sparse_step_bytes = sparse_step_bytes(config, self.activation_dtype)
            tables = self.num_groups + (SPARSE_LAYER_TYPE in (getattr(config, "layer_types", None) or ()))
            self.step_cache_token_bytes = step_bytes_per_cache_token(config, self.cb_config, tables)
            self.table_build_bytes = TABLE_BUILD_BYTES

    @property
    def bytes_per_batch_token(self) -> int:
        return super().bytes_per_batch_token + self.sparse_step_bytes

    @property
    def bytes_per_cache_token(self) -> int:
        return super().bytes_per_cache_token + self.step_cache_token_bytes

    @property
    def fixed_overhead_bytes(self) -> int:
        return super().fixed_overhead_bytes + self.table_build_bytes


_MemoryHandler.m3_sparse_original = _ORIGINAL_MEMORY_HANDLER


def install() -> None:
    """Register :class:`M3SparseCacheAllocator` for M3's sparse layer type, let the manager's
    inputs carry that type's key lengths and size the cache for what m3_sparse allocates."""
    cb_cache.ATTN_TYPE_TO_ALLOCATOR[SPARSE_LAYER_TYPE] = M3SparseCacheAllocator
    cb_cache.ATTN_TYPE_TO_ALLOCATOR[FULL_LAYER_TYPE] = M3FullCacheAllocator
    cb_io.ContinuousBatchingIOs._setup_static_tensors = _setup_static_tensors
    cb_cache.PagedAttentionMemoryHandler = _MemoryHandler
    if not compat.CB_GROUPS_FROM_REGISTRY:
        cb_cache.group_layers_by_attn_type = _group_layers
