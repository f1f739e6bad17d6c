"""A static, paged KV cache for MiniMax M3 models (a transformers ``Cache``).

Every layer stores K and V as page pools ``[num_pages, kv_heads, page_size, head_dim]``;
sparse layers also store their index keys as ``[num_pages, page_size, index_head_dim]``
(optionally as float8 e4m3 codes with a per-token fp32 scale ``[num_pages, page_size]``, or
with one fixed scale for the pool).
All layers share one block table ``[batch, pages_per_seq]`` and track the number of
tokens of each sequence on the device, so sequences of different lengths live in one
batch without holes: a right-padded prompt writes its pad tokens past the sequence's
end, and the next step overwrites them.

Capacity is checked on the host from the number of token slots fed so far (an upper
bound of every sequence's length), so an overflowing update raises before anything
is written and without a device synchronization.
"""

from __future__ import annotations

import math
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.quant import quantize_rows, to_e4m3
from .mask import ATTN_IMPLEMENTATION, new_token_layout, step_mask, uses_m3_sparse

SPARSE_LAYER_TYPE = "minimax_m3_sparse"
DEFAULT_PAGE_SIZE = 64
FP8_INDEX_DTYPE = getattr(torch, "float8_e4m3fn", None)

# id(page pool) -> layer, so the attention function can tell that the K/V it was
# handed are the pools of a paged layer (identity is verified on lookup).
_POOL_OWNERS: dict[int, weakref.ref] = {}


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization of index keys ``[..., Di]``: (codes, fp32 scales ``[...]``)
    with ``keys ~= codes.float() * scales[..., None]`` (``core.quant.quantize_rows``)."""
    return quantize_rows(keys)


def paged_layer_of(key: torch.Tensor) -> "M3PagedLayer | None":
    ref = _POOL_OWNERS.get(id(key))
    layer = ref() if ref is not None else None
    if layer is not None and layer.keys is key:
        return layer
    return None


class M3PagedLayer(CacheLayerMixin):
    """One layer of :class:`M3PagedCache`."""

    is_compileable = False
    is_sliding = False
    supports_early_init = True

    def __init__(self, cache: "M3PagedCache", layer_idx: int, is_sparse: bool):
        super().__init__()
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.is_sparse = is_sparse
        self.index_keys: torch.Tensor | None = None
        # fp8 index keys: fp32 [pages + 1, page_size] per token, or [1] with one scale for the pool.
        self.index_scales: torch.Tensor | None = None
        self.seq_lens: torch.Tensor | None = None  # [B] int32 committed tokens per sequence
        self.step_kv_lens: torch.Tensor | None = None  # [B] int32 tokens visible to the current step
        self.pending: torch.Tensor | None = None  # [B] int32 tokens the current step will commit
        self.step_len = 0
        self.index_written = False
        self.slots_used = 0

    # -- shape bookkeeping -------------------------------------------------------------
    @property
    def cache(self) -> "M3PagedCache":
        cache = self._cache()
        if cache is None:
            raise RuntimeError("M3PagedLayer outlived its M3PagedCache")
        return cache

    @property
    def block_tables(self) -> torch.Tensor:
        if self.seq_lens is None:
            return self.cache.block_tables
        return self.cache.block_tables_on(self.seq_lens.device)

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    @property
    def batch_size(self) -> int:
        return self.cache.max_batch

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cache = self.cache
        _, hkv, _, d = key_states.shape
        dtype = cache.dtype or key_states.dtype
        device = cache.device or key_states.device
        cache._place(device)
        # One page past the pool takes the writes of leading pad tokens; no block table names it.
        shape = (cache.num_pages + 1, hkv, cache.page_size, d)
        kv_dtype = cache.kv_cache_dtype or dtype
        self.keys = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.values = torch.zeros(shape, dtype=kv_dtype, device=device)
        if self.is_sparse:
            index_dtype = cache.index_key_dtype or dtype
            self.index_keys = torch.zeros(
                cache.num_pages + 1, cache.page_size, cache.index_head_dim, dtype=index_dtype, device=device
            )
            if cache.index_k_scale is not None:
                # One fixed scale for the whole pool: the index kernel never needs to read it.
                self.index_scales = torch.full((1,), cache.index_k_scale, dtype=torch.float32, device=device)
            elif cache.index_key_dtype is not None:
                self.index_scales = torch.zeros(cache.num_pages + 1, cache.page_size, dtype=torch.float32, device=device)
        # Length state lives in fixed buffers updated in place, so a step captured in a
        # CUDA graph keeps advancing it on every replay.
        self.seq_lens = torch.zeros(cache.max_batch, dtype=torch.int32, device=device)
        self.step_kv_lens = torch.zeros_like(self.seq_lens)
        self.pending = torch.zeros_like(self.seq_lens)
        self.is_initialized = True
        _POOL_OWNERS[id(self.keys)] = weakref.ref(self)

    # -- writes ------------------------------------------------------------------------
    def _check_new(self, name: str, states: torch.Tensor, heads: int | None, dim: int | None) -> None:
        cache = self.cache
        if states.dim() != 4:
            raise ValueError(f"{name}: expected [batch, heads, seq, head_dim], got shape {tuple(states.shape)}")
        if states.shape[0] != cache.max_batch:
            raise ValueError(
                f"{name}: the cache was built for batch {cache.max_batch}, got batch {states.shape[0]}"
            )
        if heads is not None and states.shape[1] != heads:
            raise ValueError(f"{name}: expected {heads} heads, got shape {tuple(states.shape)}")
        if dim is not None and states.shape[3] != dim:
            raise ValueError(f"{name}: expected head_dim {dim}, got shape {tuple(states.shape)}")
        if states.device != self.keys.device:
            raise ValueError(f"{name}: expected a tensor on {self.keys.device}, got one on {states.device}")

    def _locate(self, q_len: int, lead: torch.Tensor) -> None:
        """Page and slot of each new token: token ``i`` of row ``b`` goes to position
        ``seq_lens[b] + i - lead[b]``; leading pads go to the scratch page."""
        device = self.seq_lens.device
        i = torch.arange(q_len, device=device)
        pos = self.seq_lens.to(torch.int64)[:, None] + i[None, :] - lead[:, None]  # [B, S]
        is_pad = i[None, :] < lead[:, None]
        # The host-side capacity check does not run when a captured step replays: a
        # position past the table then goes to the scratch page instead of out of bounds.
        is_pad |= pos >= self.block_tables.shape[1] * self.page_size
        safe = pos.clamp(min=0, max=self.block_tables.shape[1] * self.page_size - 1)
        page = self.block_tables.to(torch.int64).gather(1, safe // self.page_size)
        self._step_page = torch.where(is_pad, self.cache.num_pages, page)
        self._step_slot = torch.where(is_pad, i[None, :] % self.page_size, safe % self.page_size)

    def _write(self, pool: torch.Tensor, states: torch.Tensor, scale: float | None = None) -> None:
        page, slot = self._step_page, self._step_slot
        # fp8 K/V, or fp8 index keys with one scale: e4m3 codes of states / scale, saturated
        # at e4m3's largest value.
        if scale is not None:
            states = to_e4m3(states, scale)
        if pool.dim() == 4:  # K/V: [pages, H, page_size, D]
            pool.permute(0, 2, 1, 3).index_put_((page, slot), states.transpose(1, 2).to(pool.dtype))
        else:  # index keys: [pages, page_size, D], one shared head
            pool.index_put_((page, slot), states[:, 0].to(pool.dtype))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_new("key_states", key_states, self.keys.shape[1], self.keys.shape[3])
        if value_states.shape != key_states.shape:
            raise ValueError(
                f"value_states: expected the shape of key_states {tuple(key_states.shape)}, got {tuple(value_states.shape)}"
            )
        s = key_states.shape[2]
        self.cache._reserve(self, s)
        lead, real = new_token_layout(
            step_mask(), key_states.shape[0], self.slots_used + s, s, self.seq_lens.device
        )
        self.seq_lens += self.pending
        self._locate(s, lead)
        fp8 = self.cache.kv_cache_dtype is not None
        self._write(self.keys, key_states, self.cache.k_scale if fp8 else None)
        self._write(self.values, value_states, self.cache.v_scale if fp8 else None)
        self.step_len = s
        # Rows are right aligned on this length: real token i of row b sits at
        # seq_lens + i - lead, trailing pads after the real tokens (overwritten next step).
        self.step_kv_lens.copy_((self.seq_lens + s - lead).clamp(max=self.block_tables.shape[1] * self.page_size))
        self.pending.copy_(real)
        self.index_written = False
        self.slots_used += s
        return self.keys, self.values

    def kv_scale_args(self) -> dict:
        """The dequantization scales the attention ops need for this layer's pools ({} unless
        the cache stores fp8 K/V)."""
        cache = self.cache
        if cache.kv_cache_dtype is None:
            return {}
        return {"k_scale": cache.k_scale, "v_scale": cache.v_scale}

    def update_index(self, index_keys: torch.Tensor) -> torch.Tensor:
        """Write this step's index keys [B, 1, S, Di] next to the K/V written by :meth:`update`."""
        if not self.is_sparse:
            raise ValueError(f"layer {self.layer_idx} is not a sparse layer: it keeps no index keys")
        if not self.is_initialized:
            raise RuntimeError("update_index called before update: K/V of the step must be written first")
        self._check_new("index_keys", index_keys, 1, self.index_keys.shape[2])
        if index_keys.shape[2] != self.step_len:
            raise ValueError(
                f"index_keys: expected {self.step_len} new tokens (the K/V of this step), got {index_keys.shape[2]}"
            )
        if self.index_written:
            raise RuntimeError(f"index keys of layer {self.layer_idx} were already written for this step")
        if self.index_scales is None:
            self._write(self.index_keys, index_keys)
        elif self.cache.index_k_scale is not None:
            self._write(self.index_keys, index_keys, self.cache.index_k_scale)
        else:
            codes, scales = quantize_index_keys(index_keys[:, 0])
            # Same (page, slot) for codes and scales: leading pads land on the scratch page for both.
            self.index_keys.index_put_((self._step_page, self._step_slot), codes)
            self.index_scales.index_put_((self._step_page, self._step_slot), scales)
        self.index_written = True
        return self.index_keys

    # -- queries -------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.slots_used

    def get_max_length(self) -> int:
        return self.cache.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots_used + query_length, 0

    def committed_lengths(self) -> torch.Tensor:
        """Tokens stored per sequence once the current step is committed. [B] int32 on the device."""
        if self.seq_lens is None:
            raise RuntimeError("the cache layer holds nothing yet")
        return self.seq_lens + self.pending

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            if self.index_keys is not None:
                self.index_keys.zero_()
            if self.index_scales is not None and self.cache.index_k_scale is None:
                self.index_scales.zero_()
            self.seq_lens.zero_()
            self.step_kv_lens.zero_()
            self.pending.zero_()
        self.step_len = 0
        self.slots_used = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("M3PagedCache does not support crop(); build a new cache or call reset()")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("M3PagedCache does not support beam search reordering")


class M3PagedCache(Cache):
    """Static paged cache for MiniMax M3 (``attn_implementation="m3_sparse"``).

    Args:
        config: the model config (``MiniMaxM3VLConfig`` or its text config).
        batch_size: number of sequences.
        max_cache_len: tokens each sequence may hold (prompt, padding and generated tokens).
        page_size: tokens per page: 16, 32, 64 or 128 (the GPU benchmarks use 64 and 128).
        device, dtype: where and how to store; by default each layer takes them from its first
            update, so the layers of a device_map model keep their pages on their own devices.
        block_tables: optional ``[batch_size, ceil(max_cache_len / page_size)]`` page ids into a
            pool of ``num_pages`` pages (default: each sequence owns a contiguous run of pages).
        num_pages: size of the page pool when ``block_tables`` is given.
        index_key_dtype: storage of the sparse layers' index keys. ``None`` (default) keeps the
            model dtype; ``torch.float8_e4m3fn`` stores e4m3 codes plus a per-token fp32 scale
            (``amax(|k|) / 448``), quantized on write: the index-key pool takes half the bytes of a
            bf16 one (plus 4 bytes per token of scale) and the index branch reads half as much.
            The ranking uses the dequantized keys, so near-equal blocks may swap.
        index_k_scale: with fp8 index keys, one fixed fp32 scale for every index key
            (positive float) instead of a per-token one: codes are ``k / index_k_scale``
            saturated at +-448, no scale is stored per token, and the GPU index kernel
            skips a multiply per score (a per-tensor scale cannot change a ranking), which makes
            the fp8-dot index faster in prefill and decode (docs/PERF.md). Choose it so that
            ``|k| / index_k_scale`` stays within 448 (index keys are RMS-normed, so their range is
            known from the norm weights). Default None: per-token scales.
        index_fp8_dot: with fp8 index keys, also quantize the index queries to e4m3 inside the
            GPU (Triton) index kernel so its scores run on the fp8 tensor cores: faster prefill,
            noisier ranking. The CPU (torch) path ignores it. Default False.
        kv_cache_dtype: storage of every layer's K/V pages. ``None`` (default) keeps the model
            dtype; ``torch.float8_e4m3fn`` stores e4m3 codes of ``k / k_scale`` and ``v / v_scale``
            (saturated at +-448): half the bytes of bf16 pages, and the attention kernels read
            half as much (they take the scales and compute in the model dtype).
        k_scale, v_scale: the fixed per-tensor scales of fp8 K/V (positive floats, default 1.0;
            only with ``kv_cache_dtype=torch.float8_e4m3fn``). Choose them so that
            ``|k| / k_scale`` stays within 448.
        partial_dtype: with fp8 K/V, ``torch.float8_e4m3fn`` makes the sparse layers' KV-outer
            prefill store its partials normalized in e4m3 (``kvouter_attention``'s
            ``partial_dtype``): half the bytes of its largest traffic, at a larger error.
            Default None: partials in the model dtype.
    """

    def __init__(
        self,
        config,
        batch_size: int,
        max_cache_len: int,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        block_tables: torch.Tensor | None = None,
        num_pages: int | None = None,
        index_key_dtype: torch.dtype | None = None,
        index_fp8_dot: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        index_k_scale: float | None = None,
        partial_dtype: torch.dtype | None = None,
    ):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        for name, value in (("batch_size", batch_size), ("max_cache_len", max_cache_len), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if page_size not in (16, 32, 64, 128):
            raise ValueError(f"page_size: expected one of (16, 32, 64, 128), got {page_size}")
        if index_key_dtype is not None and (FP8_INDEX_DTYPE is None or index_key_dtype != FP8_INDEX_DTYPE):
            raise ValueError(
                "index_key_dtype: expected None (store index keys in the model dtype) or torch.float8_e4m3fn, "
                f"got {index_key_dtype!r}"
            )
        if not isinstance(index_fp8_dot, bool):
            raise ValueError(f"index_fp8_dot: expected a bool, got {index_fp8_dot!r}")
        if index_fp8_dot and index_key_dtype is None:
            raise ValueError("index_fp8_dot: needs index_key_dtype=torch.float8_e4m3fn (fp8 index keys)")
        if index_fp8_dot and 0 < getattr(text, "index_head_dim", 0) < 32:
            raise ValueError(
                "index_fp8_dot: the fp8 tensor-core dot needs an index head dim of at least 32, the model's is "
                f"{text.index_head_dim}"
            )
        if kv_cache_dtype is not None and (FP8_INDEX_DTYPE is None or kv_cache_dtype != FP8_INDEX_DTYPE):
            raise ValueError(
                "kv_cache_dtype: expected None (store K/V in the model dtype) or torch.float8_e4m3fn, "
                f"got {kv_cache_dtype!r}"
            )
        if index_k_scale is not None:
            if index_key_dtype is None:
                raise ValueError(
                    "index_k_scale: a scale of fp8 index keys; pass index_key_dtype=torch.float8_e4m3fn too"
                )
            fp32 = torch.finfo(torch.float32)
            if isinstance(index_k_scale, bool) or not isinstance(index_k_scale, (int, float)) \
                    or not math.isfinite(index_k_scale) or not fp32.tiny <= index_k_scale <= fp32.max:
                raise ValueError(
                    f"index_k_scale: expected a positive finite float32 value (in [{fp32.tiny:.3g}, {fp32.max:.3g}]), "
                    f"got {index_k_scale!r}"
                )
        if partial_dtype is not None:
            if FP8_INDEX_DTYPE is None or partial_dtype != FP8_INDEX_DTYPE:
                raise ValueError(
                    f"partial_dtype: expected None (the model dtype) or torch.float8_e4m3fn, got {partial_dtype!r}"
                )
            if kv_cache_dtype is None:
                raise ValueError(
                    "partial_dtype: e4m3 partials are stored in V's fp8 units; pass kv_cache_dtype=torch.float8_e4m3fn too"
                )
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None:
                continue
            if kv_cache_dtype is None:
                raise ValueError(f"{name}: a scale of fp8 K/V pages; pass kv_cache_dtype=torch.float8_e4m3fn too")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
                raise ValueError(f"{name}: expected a positive finite float, got {scale!r}")
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        self._text_config = text
        self.max_batch = batch_size
        self._max_cache_len = max_cache_len
        self.page_size = page_size
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype
        self.index_key_dtype = index_key_dtype
        self.index_fp8_dot = index_fp8_dot
        self.index_k_scale = float(index_k_scale) if index_k_scale is not None else None
        self.kv_cache_dtype = kv_cache_dtype
        self.k_scale = float(k_scale) if k_scale is not None else 1.0
        self.v_scale = float(v_scale) if v_scale is not None else 1.0
        self.partial_dtype = partial_dtype
        self.index_head_dim = getattr(text, "index_head_dim", 0)
        self.pages_per_seq = -(-max_cache_len // page_size)
        if block_tables is None:
            if num_pages is not None and num_pages < batch_size * self.pages_per_seq:
                raise ValueError(
                    f"num_pages: {num_pages} pages cannot hold {batch_size} sequences x {self.pages_per_seq} pages"
                )
            self.num_pages = num_pages or batch_size * self.pages_per_seq
            block_tables = torch.arange(batch_size * self.pages_per_seq, dtype=torch.int32).view(
                batch_size, self.pages_per_seq
            )
        else:
            self.num_pages = self._check_block_tables(block_tables, num_pages)
            block_tables = block_tables.to(torch.int32)
        self.block_tables = block_tables if self.device is None else block_tables.to(self.device)
        self._block_table_copies: dict[torch.device, torch.Tensor] = {}
        layers = [
            M3PagedLayer(self, i, layer_types[i] == SPARSE_LAYER_TYPE) for i in range(text.num_hidden_layers)
        ]
        super().__init__(layers=layers)

    def _check_block_tables(self, block_tables: torch.Tensor, num_pages: int | None) -> int:
        if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
            raise ValueError(f"block_tables: expected a 2-D tensor [batch, pages_per_seq], got {block_tables!r}")
        if block_tables.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"block_tables: expected an int32/int64 tensor, got {block_tables.dtype}")
        expected = (self.max_batch, self.pages_per_seq)
        if tuple(block_tables.shape) != expected:
            raise ValueError(
                f"block_tables: expected shape {expected} (batch_size, ceil(max_cache_len / page_size)), "
                f"got {tuple(block_tables.shape)}"
            )
        if num_pages is None:
            raise ValueError("num_pages: required with block_tables (the size of the page pool)")
        flat = block_tables.detach().to("cpu", torch.int64).flatten()
        if bool((flat < 0).any()) or bool((flat >= num_pages).any()):
            raise ValueError(f"block_tables: page ids must lie in [0, num_pages={num_pages}), got {flat.tolist()}")
        if flat.unique().numel() != flat.numel():
            raise ValueError("block_tables: a page is shared by two table slots; each slot needs its own page")
        return num_pages

    def _place(self, device: torch.device) -> None:
        # The first layer to allocate brings the block tables to its device; a layer
        # placed elsewhere (device_map) reads its own copy, see block_tables_on.
        if self.block_tables.device != device and not any(layer.is_initialized for layer in self.layers):
            self.block_tables = self.block_tables.to(device)

    def block_tables_on(self, device: torch.device) -> torch.Tensor:
        """The block tables on ``device`` (a copy made once per device; they never change)."""
        if self.block_tables.device == device:
            return self.block_tables
        if device not in self._block_table_copies:
            self._block_table_copies[device] = self.block_tables.to(device)
        return self._block_table_copies[device]

    def _reserve(self, layer: M3PagedLayer, new_tokens: int) -> None:
        impl = getattr(self._text_config, "_attn_implementation", None)
        if not uses_m3_sparse(self._text_config):
            raise ValueError(
                f"M3PagedCache holds paged K/V that only attn_implementation='m3_sparse' can read; the model "
                f"runs {impl!r}. Load it with attn_implementation='m3_sparse' (after import m3_hf_attention), or the m3-sparse hub kernel's attention function."
            )
        if layer.slots_used + new_tokens > self.max_cache_len:
            raise ValueError(
                f"M3PagedCache overflow: layer {layer.layer_idx} holds up to {layer.slots_used} tokens per sequence "
                f"and {new_tokens} more would exceed max_cache_len={self.max_cache_len}; nothing was written. "
                "Build the cache with a larger max_cache_len."
            )

    def layer(self, layer_idx: int) -> M3PagedLayer:
        return self.layers[layer_idx]

    def sequence_lengths(self, layer_idx: int = 0) -> torch.Tensor:
        """Tokens stored per sequence (device tensor [batch], int32)."""
        return self.layers[layer_idx].committed_lengths()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._max_cache_len

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    @property
    def batch_size(self) -> int:
        return self.max_batch

    def __repr__(self) -> str:
        return (
            f"M3PagedCache(batch={self.max_batch}, max_cache_len={self.max_cache_len}, page_size={self.page_size}, "
            f"num_pages={self.num_pages}, layers={len(self.layers)}"
            + (f", index_key_dtype={self.index_key_dtype}" if self.index_key_dtype is not None else "")
            + (f", index_k_scale={self.index_k_scale}" if self.index_k_scale is not None else "")
            + (", index_fp8_dot=True" if self.index_fp8_dot else "")
            + ")"
        )
