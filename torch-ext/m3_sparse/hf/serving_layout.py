"""One continuous-batching step of ``paged|m3_sparse`` in the kernels' terms: page tables, key
lengths and the cache slot of every new token, built on the device from the keywords
transformers' manager passes the model.

Both cache designs (``serving_groups`` for transformers 5.17, ``serving_allocator`` for 5.18
and later) describe a token's place in the manager's cache by an integer **slot**, as the
manager's ``write_index`` / ``read_index`` do, and both keep the identity this module relies on:
a request's block-table entry ``e`` (``fill_block_table``) holds the tokens of slots
``e * P .. e * P + P - 1`` in order, ``P`` being the cache's tokens per page (block). The
kernels read pages of ``page_size`` tokens (:func:`page_size_for`, a divisor of ``P``), so a
kernel page starts at the slot of its first token; each layer group of the cache
(:class:`PoolGroup`) turns such slots into page ids of its pools.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from .. import api
from ..core.validate import SUPPORTED_PAGE_SIZES
from . import compat
from .impl import ATTN_IMPLEMENTATION, names_m3_sparse

# M3's layer type of its sparse-attention layers (``config.layer_types``).
SPARSE_LAYER_TYPE = "minimax_m3_sparse"
CB_IMPLEMENTATION = compat.cb_attn_implementation(ATTN_IMPLEMENTATION)


def runs_m3_sparse(config) -> bool:
    """Whether ``config`` runs m3_sparse under a name continuous batching gives it on some
    release (``compat.cb_attn_implementation``): ``m3_sparse`` or a hub string of this package,
    with or without ``paged|``, or this package's serving name."""
    impl = getattr(config, "_attn_implementation", None)
    return isinstance(impl, str) and (impl == compat.CB_SERVING_NAME or names_m3_sparse(impl.removeprefix("paged|")))


def sparse_step_bytes(config, dtype: torch.dtype) -> int:
    """Bytes ``paged|m3_sparse`` allocates per batch token at a sparse layer's peak beyond the
    hidden states, query projection and new K/V that transformers' attention peak counts, and
    instead of its ``[M, N + M]`` mask and K/V read back from the cache (the kernels read the
    pools in place; nothing grows with the cache): KV-outer's partials, index and copy of q
    (``api.kvouter_bytes_per_row``, partials in the activation dtype), the attention output
    ``[T, Hq, D]``, the index branch's queries and key ``[T, Hi * Di + Di]`` and its selection
    ``[T, Hi, topk]`` int32. It errs high: the config's heads where tensor parallelism gives a
    rank fewer, and partials counted for every row where a long step runs them in slices.
    Each cache design's memory handler (``serving_groups``, ``serving_allocator``) reserves it."""
    hq, hkv, d, topk = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.index_topk_blocks
    hi, di, size = config.index_n_heads, config.index_head_dim, dtype.itemsize
    output = hq * d * size
    index_branch = (hi * di + di) * size + hi * topk * torch.int32.itemsize
    return api.kvouter_bytes_per_row(hq, hkv, d, topk, dtype) + output + index_branch


def page_size_for(tokens_per_page: int) -> int:
    """The kernels' page size for a continuous-batching cache of ``tokens_per_page`` tokens per
    page: the largest supported size that divides it (a cache page is then whole kernel pages)."""
    for size in sorted(SUPPORTED_PAGE_SIZES, reverse=True):
        if tokens_per_page % size == 0:
            return size
    raise ValueError(
        f"{CB_IMPLEMENTATION}: a continuous-batching cache of {tokens_per_page} tokens per page is not a multiple of "
        f"a page size the kernels take {SUPPORTED_PAGE_SIZES}; set ContinuousBatchingConfig's page size (block_size "
        "up to transformers 5.17) to a multiple of 16, such as 256 (the default) or 128."
    )


class PoolGroup(Protocol):
    """A layer group of the manager's cache (its layers share one block table), as the kernels
    read it: pools of ``page_size``-token pages and the page ids of its slots."""

    tokens_per_page: int
    write_trash_index: int  # the slot padding tokens write to (never read)
    # Whether the manager's read index of this group holds one slot per cache page of each
    # request's tokens (the page's first token), else one per token.
    reads_per_page: bool

    def page_tables(self, first_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Slots of the first tokens of kernel pages -> page ids (int32, same shape) of the K/V
        pools and of the index-key pools (None: the group holds no index keys)."""

    def write_kv(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write a layer's new K/V ``[T, Hkv, D]`` at ``slots [T]``."""

    def kv_pools(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V pools ``[pages, Hkv, page_size, D]`` (views of the cache)."""

    def write_index_keys(self, layer_idx: int, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Write a sparse layer's new index keys ``[T, Di]`` at ``slots [T]``."""

    def index_pool(self, layer_idx: int, head_dim: int) -> torch.Tensor:
        """A sparse layer's index-key pool ``[pages, page_size, Di]``."""


class CachePools(Protocol):
    """The manager's cache as layer groups (one design module per cache design)."""

    page_size: int
    groups: list[PoolGroup]

    def group_of(self, layer_idx: int) -> int:
        ...


@dataclass
class GroupStep:
    """A layer group's part of a step: ``slots [T]`` int64, the cache slot of each new token
    (the group's write trash for padding tokens); ``kv_tables`` / ``index_tables [R + 1, W]``
    int32, the page ids of each request's history in the group's pools (``index_tables``
    None for a group without index keys)."""

    slots: torch.Tensor
    kv_tables: torch.Tensor
    index_tables: torch.Tensor | None


@dataclass
class ServingStep:
    """The packed step of every layer, in the kernels' terms. ``R`` requests plus one
    trailing sequence with no key that owns the padding tokens past ``cu_seq_lens_q[-1]``
    (none without padding): the ops need every query row inside ``cu_seqlens_q``.

    cu_seqlens_q [R + 2] int32; kv_lens [R + 1] int32 (history plus new tokens, the same in
    every group: every M3 layer keeps every token); groups: by group index.
    """

    groups: dict[int, GroupStep]
    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    page_size: int
    max_seqlen_q: int
    write_index: list | None  # the step's keyword (kept to tell steps apart, never read)


def _key_lengths(kwargs: dict) -> torch.Tensor:
    """``cu_seq_lens_k`` ``[R + 1]``: a tensor, or a dict by layer type whose entries are equal
    here (every M3 layer type keeps every token)."""
    cu_k = kwargs["cu_seq_lens_k"]
    return next(iter(cu_k.values())) if isinstance(cu_k, dict) else cu_k


# A step's page tables are ``[R + 1, W]`` int32: R the manager's request rows (a fixed
# number, ``max_requests_per_batch``, for its CUDA graphs) and W the kernel pages of the step's
# longest history as the manager states it (``max_length_k``), which its warm-up sets to the
# whole pool. KV-outer's segments follow the same rows and width. Both are what the memory
# handler reserves per cache token (:func:`step_bytes_per_cache_token`). The tables are built
# ``TABLE_BUILD_ENTRIES`` entries at a time, so the int64 temporaries of a build stay within
# ``TABLE_BUILD_BYTES`` whatever W is (one slice of a step of a few thousand tokens a row).
TABLE_BUILD_ENTRIES = 1 << 21
TABLE_BUILD_BYTES = TABLE_BUILD_ENTRIES * 64  # a slice's temporaries: seven int64 and a bool per entry, at most


def step_bytes_per_cache_token(config, cb_config, tables: int) -> int:
    """Bytes per token of the pool, rounded up, that a step under ``cb_config`` allocates for
    a history as long as the pool: ``tables`` page tables of ``R + 1`` rows of kernel pages and,
    where the model has sparse layers, KV-outer's segments (``api.kvouter_bytes_per_segment``)
    of ``R + 1`` rows of key blocks per kv head."""
    rows = compat.cb_max_requests(cb_config) + 1
    page_size = page_size_for(compat.cb_tokens_per_page(cb_config))
    tables_bytes = tables * rows * torch.int32.itemsize / page_size
    segment_bytes = 0.0
    if SPARSE_LAYER_TYPE in (getattr(config, "layer_types", None) or ()):
        per_row = config.num_key_value_heads / config.index_block_size
        segment_bytes = api.kvouter_bytes_per_segment() * rows * per_row
    return math.ceil(tables_bytes + segment_bytes)


def _first_slots_from_history(history, starts, kv_lens, width: int, page_size: int) -> torch.Tensor:
    """``[R, width]``: the slot of the first token of each request's kernel pages, read from the
    slots of its tokens in order (request ``r``'s start at ``starts[r]``). Pages past a
    request's tokens read slot 0 (never dereferenced)."""
    first = torch.arange(width, device=history.device, dtype=torch.int64) * page_size  # [W]
    where = (starts.to(torch.int64)[:, None] + first[None, :]).clamp(max=max(history.numel() - 1, 0))
    slots = history[where] if history.numel() else torch.zeros_like(where)
    return torch.where(first[None, :] < kv_lens[:, None], slots, 0)


def _page_starts(kv_lens: torch.Tensor, tokens_per_page: int) -> torch.Tensor:
    """``[R]`` int64: where each request's cache pages start in a read index of one slot per
    cache page of ``tokens_per_page`` tokens (request ``r``'s after the pages of those before it)."""
    counts = (kv_lens.to(torch.int64) + tokens_per_page - 1) // tokens_per_page
    return torch.cumsum(counts, 0) - counts


def _first_slots_from_pages(pages, starts, kv_lens, tokens_per_page: int, width: int, page_size: int) -> torch.Tensor:
    """``[R, width]`` like :func:`_first_slots_from_history`, from the first slots of each
    request's cache pages of ``tokens_per_page`` tokens (request ``r``'s from ``starts[r]``,
    :func:`_page_starts`; ``pages`` is not empty)."""
    first = torch.arange(width, device=pages.device, dtype=torch.int64) * page_size  # [W] tokens
    where = (starts[:, None] + first[None, :] // tokens_per_page).clamp(max=pages.numel() - 1)
    slots = pages[where] + first[None, :] % tokens_per_page
    return torch.where(first[None, :] < kv_lens.to(torch.int64)[:, None], slots, 0)


def _first_slots_from_blocks(entries: torch.Tensor, tokens_per_page: int, page_size: int) -> torch.Tensor:
    """``[R, MB * tokens_per_page / page_size]`` from block tables ``[R, MB]`` (``-1`` = none):
    entry ``e`` holds slots ``e * tokens_per_page ..`` in order."""
    sub = torch.arange(tokens_per_page // page_size, device=entries.device, dtype=torch.int64) * page_size
    slots = entries.to(torch.int64).clamp(min=0)[:, :, None] * tokens_per_page + sub
    return slots.reshape(entries.shape[0], -1)


def _new_token_slots(first, cu_q, kv_lens, num_tokens: int, page_size: int, trash: int) -> torch.Tensor:
    """Cache slot of every new token from the first-slot tables (the decode fast path passes no
    write index): token ``i`` of a request with ``n`` new tokens sits at ``kv_len - n + i``;
    padding tokens go to the write trash."""
    cu = cu_q.to(torch.int64)
    t = torch.arange(num_tokens, device=cu.device, dtype=torch.int64)
    req = torch.searchsorted(cu[1:], t, right=True)  # [T], R for padding tokens
    real = req < kv_lens.shape[0]
    r = req.clamp(max=kv_lens.shape[0] - 1)
    pos = (kv_lens.to(torch.int64)[r] - (cu[r + 1] - t)).clamp(min=0)
    return torch.where(real, first[r, pos // page_size] + pos % page_size, trash)


def _page_tables(group: "PoolGroup", first_slots, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The group's K/V and index page tables ``[rows + 1, width]`` (the last row, the trailing
    sequence's, zeros; one table for both where the index keys sit slot for slot beside K/V),
    from ``first_slots(r)``, the first-slot table of the rows of slice ``r``, taken
    ``TABLE_BUILD_ENTRIES`` entries at a time."""
    step = max(1, TABLE_BUILD_ENTRIES // max(width, 1))
    if rows <= step:  # one slice (every step but the widest): a copy with the trailing row
        kv, index = group.page_tables(first_slots(slice(0, rows)))
        kv_tables = _with_trailing_row(kv)
        return kv_tables, kv_tables if index is kv else _with_trailing_row(index)
    kv_tables = index_tables = None
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        kv, index = group.page_tables(first_slots(slice(r0, r1)))
        if kv_tables is None:
            kv_tables = kv.new_zeros(rows + 1, width)
            index_tables = kv_tables if index is kv else None if index is None else index.new_zeros(rows + 1, width)
        kv_tables[r0:r1] = kv
        if index is not None and index is not kv:
            index_tables[r0:r1] = index
    return kv_tables, index_tables


def _with_trailing_row(tables: torch.Tensor | None) -> torch.Tensor | None:
    """Page tables with a row of zeros for the trailing sequence (the padding tokens')."""
    return None if tables is None else torch.cat([tables, torch.zeros_like(tables[:1])])


def build_step(pools: CachePools, kwargs: dict, num_tokens: int) -> ServingStep:
    """The :class:`ServingStep` of the keywords continuous batching passed the model, built on
    the device (no host read, so a captured graph replays it)."""
    page_size = pools.page_size
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = _key_lengths(kwargs)
    kv_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    rows = kv_lens.shape[0]
    max_q, max_k = compat.cb_step_max_lengths(kwargs)
    max_k = next(iter(max_k.values())) if isinstance(max_k, dict) else max_k  # equal for every layer type here
    block_table = kwargs.get("block_table")
    groups = {}
    for g, group in enumerate(pools.groups):
        tpp = group.tokens_per_page
        if block_table is not None:
            # The decode fast path: block tables (as wide as max_blocks_per_request), no indices.
            first = _first_slots_from_blocks(block_table[g], tpp, page_size)
            slots = _new_token_slots(first, cu_q, kv_lens, num_tokens, page_size, group.write_trash_index)
            width = first.shape[1]

            def first_slots(r: slice, first=first):
                return first[r]
        else:
            slots = kwargs["write_index"][g][:num_tokens]
            read = kwargs["read_index"][g]
            width = max(1, -(-int(max_k) // page_size))
            if read.numel() and group.reads_per_page:
                starts = _page_starts(kv_lens, tpp)

                def first_slots(r: slice, read=read, starts=starts, tpp=tpp, width=width):
                    return _first_slots_from_pages(read, starts[r], kv_lens[r], tpp, width, page_size)
            else:
                # With no history to read (fresh prompts only) the written slots are the whole history.
                history = read if read.numel() else slots

                def first_slots(r: slice, history=history, width=width):
                    return _first_slots_from_history(history, cu_k[:-1][r], kv_lens[r], width, page_size)
        kv_tables, index_tables = _page_tables(group, first_slots, rows, width)
        groups[g] = GroupStep(slots=slots.to(torch.int64), kv_tables=kv_tables, index_tables=index_tables)
    end = torch.full((1,), num_tokens, dtype=cu_q.dtype, device=cu_q.device)
    return ServingStep(
        groups=groups,
        cu_seqlens_q=torch.cat([cu_q, end]).to(torch.int32),
        kv_lens=torch.cat([kv_lens, torch.zeros_like(kv_lens[:1])]),
        page_size=page_size,
        max_seqlen_q=int(max_q),
        write_index=kwargs.get("write_index"),
    )


class PoolsByCache:
    """The page pools a cache design (``make``) shows the kernels for each of the manager's
    caches, made on first use and kept as long as that cache lives. Called with a cache: its
    pools; ``get``: its pools if they were made, else None."""

    def __init__(self, make):
        self._make = make
        self._pools = weakref.WeakKeyDictionary()

    def __call__(self, cache):
        pools = self._pools.get(cache)
        if pools is None:
            pools = self._pools[cache] = self._make(cache)
        return pools

    def get(self, cache):
        return self._pools.get(cache)
