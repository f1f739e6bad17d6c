"""A static, paged KV cache for MiniMax M3 models (a transformers ``Cache``).

Every layer stores K and V as page pools ``[num_pages, kv_heads, page_size, head_dim]``;
sparse layers also store their index keys as ``[num_pages, page_size, index_head_dim]``
(optionally as float8 e4m3 codes with a per-token fp32 scale ``[num_pages, page_size]``, or
with one fixed scale for the pool).
All layers share one block table ``[batch, pages_per_seq]`` and track the number of
tokens of each sequence on the device, so sequences of different lengths live in one
batch without holes: a right-padded prompt writes its pad tokens past the sequence's
end, and the next step overwrites them.

The cache is compileable: ``generate()`` compiles its decode step and replays it as a CUDA
graph, as it does for transformers' ``StaticCache``. Everything a step changes lives in
device buffers at fixed addresses (lengths, the slot count, the pages); nothing on the host
has to advance per step. The host keeps a copy of the slot count while steps run eagerly,
and reads the device count back (one synchronization) on the first eager use after
compiled steps.

Capacity: an eager update checks on the host, from the number of token slots fed so far
(an upper bound of every sequence's length), so an overflowing update raises before
anything is written and without a device synchronization. Compiled steps are checked once
per ``generate()`` call, before the prompt is written (``check_generation``); a compiled
step past the end of the table writes to a scratch page and never out of bounds.

Padding: the model's ``create_causal_mask`` (wrapped by this package) hands each forward
pass's padding mask to :meth:`M3PagedCache.begin_step`; the layers read the layout of the
step's new tokens from there.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.quant import quantize_rows, to_e4m3
from ..core.validate import debug_enabled
from .impl import uses_m3_sparse

SPARSE_LAYER_TYPE = "minimax_m3_sparse"
# One page per index block (128 tokens, the KV-outer block), and the page flash-attn-4 loads
# as one TMA box: the faster model prefill with flash-attn-4, for a slower Triton dense prefill
# without it (docs/PERF.md, "Dense paged attention").
DEFAULT_PAGE_SIZE = 128
FP8_INDEX_DTYPE = getattr(torch, "float8_e4m3fn", None)
# Step lengths whose cu_seqlens_q an eager cache keeps (M3PagedCache._cu_seqlens).
MAX_KEPT_CU_SEQLENS = 64



def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization of index keys ``[..., Di]``: (codes, fp32 scales ``[...]``)
    with ``keys ~= codes.float() * scales[..., None]`` (``core.quant.quantize_rows``)."""
    return quantize_rows(keys)


def new_token_layout(mask: torch.Tensor | None, batch: int, q_len: int, device):
    """(leading pads, real tokens) among each sequence's ``q_len`` new tokens, both [B] int64.

    ``mask`` is a 2-D padding mask ``[B, >= q_len]`` whose last ``q_len`` columns are the
    new tokens (``None``: every token is real). The new tokens of a row must be
    ``[pad]*lead + [real]*n + [pad]*rest``: left and right padding both work; a pad between
    real tokens is rejected (checked where reading the mask is free: on the CPU or with
    ``M3_SPARSE_DEBUG=1``, and never while tracing for ``torch.compile``).
    """
    if mask is None:
        full = torch.full((batch,), q_len, dtype=torch.int64, device=device)
        return torch.zeros_like(full), full
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < q_len:
        raise ValueError(
            f"attention_mask: expected a 2-D padding mask [batch={batch}, >= {q_len} tokens] whose last {q_len} "
            f"columns are the new tokens, got shape {tuple(mask.shape)}"
        )
    new = mask[:, -q_len:].to(device=device, dtype=torch.bool)
    n = new.sum(-1)
    lead = torch.where(n > 0, new.to(torch.int8).argmax(-1), q_len).to(torch.int64)
    if not torch.compiler.is_compiling() and (new.device.type == "cpu" or debug_enabled()):
        idx = torch.arange(q_len, device=new.device)
        expected = (idx[None, :] >= lead[:, None]) & (idx[None, :] < (lead + n)[:, None])
        if not bool((expected == new).all()):
            raise ValueError(
                "M3PagedCache: the new tokens of a row have padding between real tokens; expected left or right "
                "padding only"
            )
    return lead, n


def _in_graph() -> bool:
    """Whether the code runs for a graph that will be replayed: traced by ``torch.compile``
    or captured by a CUDA graph (nothing here may then read the device from the host)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _normal_tensors():
    """A context in which new tensors are normal tensors even under ``torch.inference_mode``:
    the cache's buffers are written in place by later passes, which may run outside it
    (inference tensors refuse that), as generate() does after an inference-mode prefill."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def _mark_static(*tensors: torch.Tensor | None) -> None:
    """Tell ``torch.compile`` that these buffers keep their address: a compiled step then
    reads and updates them in place instead of copying them into its CUDA graph. (Not
    allowed while tracing; buffers are allocated by eager calls.)"""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_static_address(t)


class M3PagedLayer(CacheLayerMixin):
    """One layer of :class:`M3PagedCache`: its page pools. The lengths and the current
    step's token positions are the cache's, shared by every layer (``seq_lens``,
    ``step_kv_lens``, ... read them on this layer's device)."""

    is_compileable = True
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
        self._flats: list[tuple[torch.Tensor, bool, torch.Tensor]] = []  # (pool, inference mode, flat view): _flat

    # -- shape bookkeeping -------------------------------------------------------------
    @property
    def cache(self) -> "M3PagedCache":
        cache = self._cache()
        if cache is None:
            raise RuntimeError("M3PagedLayer outlived its M3PagedCache")
        return cache

    def _state(self, name: str) -> torch.Tensor | None:
        return self.cache.state_on(self.keys.device if self.is_initialized else None, name)

    @property
    def block_tables(self) -> torch.Tensor:
        if not self.is_initialized:
            return self.cache.block_tables
        return self.cache.block_tables_on(self.keys.device)

    @property
    def seq_lens(self) -> torch.Tensor | None:
        """[B] int32: tokens committed per sequence before the current step."""
        return self._state("seq_lens")

    @property
    def step_kv_lens(self) -> torch.Tensor | None:
        """[B] int32: tokens the current step's queries see per sequence (themselves included)."""
        return self._state("step_kv_lens")

    @property
    def pending(self) -> torch.Tensor | None:
        """[B] int32: real tokens of the current step, committed when the next one begins."""
        return self._state("pending")

    @property
    def step_cu_seqlens(self) -> torch.Tensor:
        """[B + 1] int32: ``cu_seqlens_q`` of the current step (``q_len`` queries per sequence)."""
        return self._state("cu")

    def step_metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block tables, ``cu_seqlens_q``, kv lengths) of the current step on this layer's
        device: the batch metadata of the ops it calls, looked up once per step and device
        (two ops per sparse layer, one per full layer, at every step)."""
        step = self.cache._step
        if step is None or not self.is_initialized or torch.compiler.is_compiling():
            return self.block_tables, self.step_cu_seqlens, self.step_kv_lens
        device = self.keys.device
        found = step["metadata"].get(device)
        if found is None:
            found = step["metadata"][device] = (self.block_tables, self.step_cu_seqlens, self.step_kv_lens)
        return found

    @property
    def slots(self) -> torch.Tensor | None:
        return self._state("slots")

    @property
    def slots_used(self) -> int:
        return self.cache.slots_used

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
        with _normal_tensors():
            self.keys = torch.zeros(shape, dtype=kv_dtype, device=device)
            self.values = torch.zeros(shape, dtype=kv_dtype, device=device)
            self._heads = torch.arange(hkv, device=device)  # the head index of an eager K/V write
            if self.is_sparse:
                index_dtype = cache.index_key_dtype or dtype
                self.index_keys = torch.zeros(
                    cache.num_pages + 1, cache.page_size, cache.index_head_dim, dtype=index_dtype, device=device
                )
                if cache.index_k_scale is not None:
                    # One fixed scale for the whole pool: the index kernel never needs to read it.
                    self.index_scales = torch.full((1,), cache.index_k_scale, dtype=torch.float32, device=device)
                elif cache.index_key_dtype is not None:
                    self.index_scales = torch.zeros(
                        cache.num_pages + 1, cache.page_size, dtype=torch.float32, device=device
                    )
        _mark_static(self.keys, self.values, self.index_keys, self.index_scales)  # what a compiled step reads
        self.is_initialized = True

    # -- writes ------------------------------------------------------------------------
    def _check_new(self, name: str, shape: tuple, device, heads: int | None, dim: int | None) -> None:
        cache = self.cache
        if len(shape) != 4:
            raise ValueError(f"{name}: expected [batch, heads, seq, head_dim], got shape {shape}")
        if shape[0] != cache.max_batch:
            raise ValueError(f"{name}: the cache was built for batch {cache.max_batch}, got batch {shape[0]}")
        if heads is not None and shape[1] != heads:
            raise ValueError(f"{name}: expected {heads} heads, got shape {shape}")
        if dim is not None and shape[3] != dim:
            raise ValueError(f"{name}: expected head_dim {dim}, got shape {shape}")
        if device != self.keys.device:
            raise ValueError(f"{name}: expected a tensor on {self.keys.device}, got one on {device}")

    def _write(self, pool: torch.Tensor, states: torch.Tensor, scale: float | None = None) -> None:
        """Scatter the step's new tokens ``states [B, H, S, ...]`` into ``pool`` at the step's
        (page, slot) of each token (and head)."""
        # fp8 K/V, or fp8 index keys with one scale: e4m3 codes of states / scale, saturated
        # at e4m3's largest value.
        if scale is not None:
            states = to_e4m3(states, scale)
        # K/V [pages, H, page_size, D] from [B, H, S, D]; index keys [pages, page_size, D] or
        # their scales [pages, page_size] from one shared head [B, 1, S, D] / [B, 1, S].
        kv = pool.dim() == 4
        values = states.transpose(1, 2) if kv else states[:, 0]  # [B, S, H, D] / [B, S, D] / [B, S]
        if torch.compiler.is_compiling():
            # Indices into the pool's own dimensions, not a view of it: a compiled step then
            # scatters in place. Through a view, inductor rebuilt the whole pool and copied it
            # back on every write (docs/perf-log/2026-12-03.md).
            page, slot = self._state("page"), self._state("slot")
            if kv:
                # The head index made in the graph rather than read from the layer (_heads):
                # one tensor fewer for torch.compile to check on every call of the step.
                heads = torch.arange(pool.shape[1], device=pool.device)
                index = (page[..., None], heads, slot[..., None])
            else:
                index = (page, slot)
            pool.index_put_(index, values.to(pool.dtype))
            return
        # Eager: one row index per token (and head) into the pool seen as rows of D values,
        # computed once per step for every layer. index_copy_ costs the host far less than
        # index_put_'s broadcast of three index tensors, once per layer and step.
        rows = self._rows(pool.shape[1] if kv else 0)
        flat = self._flat(pool)
        values = values.reshape(-1, *flat.shape[1:]).to(pool.dtype)
        if pool.element_size() == 1:  # fp8: index_copy_ takes no float8 dtype; the bytes are the same
            values = values.view(torch.uint8)
        flat.index_copy_(0, rows, values)

    def _flat(self, pool: torch.Tensor) -> torch.Tensor:
        """``pool`` seen as rows of its last dim (fp8 pools as bytes), made once per pool (and
        inference mode): a view costs host time, and every layer writes three or four pools
        at every step."""
        inference = torch.is_inference_mode_enabled()
        for seen, seen_inference, flat in self._flats:
            if seen is pool and seen_inference == inference:
                return flat
        # Made with grad mode on: torch refuses in-place writes with grad mode on to a view
        # made under no_grad (generate() runs under no_grad; a plain forward may not).
        with torch.enable_grad():
            flat = pool.view(-1, *pool.shape[3 if pool.dim() == 4 else 2:])
            if pool.element_size() == 1:
                flat = flat.view(torch.uint8)
        self._flats.append((pool, inference, flat))
        return flat

    def _rows(self, heads: int) -> torch.Tensor:
        """Flat row of each new token in a pool of ``heads`` heads ([pages, H, page_size, D]
        seen as ``[-1, D]``, token-major then head, as ``_write`` lays out the values), or with
        ``heads=0`` in the index-key pool ([pages, page_size, D]) and its scales; cached for
        the step."""
        cached = self.cache._step["rows"]
        key = (heads, self.keys.device)
        rows = cached.get(key)
        if rows is None:
            page, slot = self._state("page"), self._state("slot")  # [B, S]
            page_size = self.cache.page_size
            if heads:
                rows = (page[..., None] * heads + self._heads) * page_size + slot[..., None]  # [B, S, H]
            else:
                rows = page * page_size + slot
            rows = cached[key] = rows.reshape(-1)
        return rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        self._check_new("key_states", tuple(key_states.shape), key_states.device, heads, dim)
        if value_states.shape != key_states.shape:
            raise ValueError(
                f"value_states: expected the shape of key_states {tuple(key_states.shape)}, got {tuple(value_states.shape)}"
            )
        self.cache._join_step(self, key_states.shape[2])
        fp8 = self.cache.kv_cache_dtype is not None
        self._write(self.keys, key_states, self.cache.k_scale if fp8 else None)
        self._write(self.values, value_states, self.cache.v_scale if fp8 else None)
        new_kv = self.cache._step["new_kv"]
        if new_kv is not None and key_states.dtype == self.keys.dtype:  # what the pages hold, unrounded
            new_kv[self.layer_idx] = (key_states, value_states)
        return self.keys, self.values

    def take_new_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's K/V as written, ``[B, Hkv, S, D]`` each, when the step began on an
        empty cache with no padding and the pages hold them in their own dtype (not fp8, not
        rounded to another float type): then they are every key of the step's attention, in
        order (None otherwise). Handed out once, so a layer's new K/V live no longer than its
        attention."""
        step = self.cache._step
        return None if step is None or step["new_kv"] is None else step["new_kv"].pop(self.layer_idx, None)

    def kv_scale_args(self) -> dict:
        """The dequantization scales the attention ops need for this layer's pools ({} unless
        the cache stores fp8 K/V)."""
        cache = self.cache
        if cache.kv_cache_dtype is None:
            return {}
        return {"k_scale": cache.k_scale, "v_scale": cache.v_scale}

    def update_index(self, index_keys: torch.Tensor) -> torch.Tensor:
        """Write this step's index keys [B, 1, S, Di] next to the K/V written by :meth:`update`."""
        self._claim_index_write(tuple(index_keys.shape), index_keys.device)
        if self.index_scales is None:
            self._write(self.index_keys, index_keys)
        elif self.cache.index_k_scale is not None:
            self._write(self.index_keys, index_keys, self.cache.index_k_scale)
        else:
            codes, scales = quantize_index_keys(index_keys)  # [B, 1, S, Di], [B, 1, S]
            # Same (page, slot) for codes and scales: leading pads land on the scratch page for both.
            self._write(self.index_keys, codes)
            self._write(self.index_scales, scales)
        return self.index_keys

    def index_key_rows(self, batch: int, q_len: int, dim: int, device) -> tuple:
        """Where this step's index keys go when the kernel that makes them writes them too
        (``api.index_prep``'s ``k_out`` and ``k_rows``): the index-key pool seen as rows
        ``[N, Di]`` and each new token's row ``[B * q_len]``, after the checks of
        :meth:`update_index`, which the write then stands for. ``(None, None)`` where
        update_index must write: fp8 pools (quantized on the way) and compiled steps (they
        scatter on the pool's own dimensions)."""
        if self.index_scales is not None or torch.compiler.is_compiling():
            return None, None
        self._claim_index_write((batch, 1, q_len, dim), device)
        return self._flat(self.index_keys), self._rows(0)

    def _claim_index_write(self, shape: tuple, device) -> None:
        """Check a write of index keys of ``shape`` [B, 1, S, Di] into this step and mark it done."""
        if not self.is_sparse:
            raise ValueError(f"layer {self.layer_idx} is not a sparse layer: it keeps no index keys")
        step = self.cache._step
        if not self.is_initialized or step is None or not step["updated"][self.layer_idx]:
            raise RuntimeError("update_index called before update: K/V of the step must be written first")
        self._check_new("index_keys", shape, device, 1, self.index_keys.shape[2])
        if shape[2] != step["q_len"]:
            raise ValueError(f"index_keys: expected {step['q_len']} new tokens (the K/V of this step), got {shape[2]}")
        if step["indexed"][self.layer_idx]:
            raise RuntimeError(f"index keys of layer {self.layer_idx} were already written for this step")
        # Marked before the write: a write that fails leaves the forward pass failed, and the
        # next pass begins a new step.
        step["indexed"][self.layer_idx] = True

    # -- queries -------------------------------------------------------------------------
    def get_seq_length(self) -> int | torch.Tensor:
        return self.cache.get_seq_length()

    def get_max_length(self) -> int:
        return self.cache.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The m3_sparse mask function hands on the padding of the step's new tokens only: the
        # history needs no mask (pads are never stored), and a width that does not grow with
        # the history keeps the compiled decode step's inputs at one shape.
        return query_length, 0

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

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "M3PagedLayer: the lengths are the cache's; crop the whole cache (M3PagedCache.crop) instead"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("M3PagedCache does not support beam search reordering")


class M3PagedCache(Cache):
    """Static paged cache for MiniMax M3 (``attn_implementation="m3_sparse"``).

    Args:
        config: the model config (``MiniMaxM3VLConfig`` or its text config).
        batch_size: number of sequences.
        max_cache_len: tokens each sequence may hold (prompt, padding and generated tokens).
        page_size: tokens per page: 16, 32, 64 or 128 (default 128, see DEFAULT_PAGE_SIZE).
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
        if self.device is not None:
            _mark_static(self.block_tables)
        self._block_table_copies: dict[torch.device, torch.Tensor] = {}
        # Whether generate() may compile the decode step (see is_compileable).
        self.compileable = True
        self._lengths: dict | None = None  # the length buffers (begin_step)
        self._step: dict | None = None  # the current step (begin_step)
        self._host_slots: int | None = 0  # slots_used on the host; None after compiled steps
        self._cus: dict[tuple, torch.Tensor] = {}  # cu_seqlens_q of eager steps: _cu_seqlens
        # The ops' plans (api.plan_*) of eager decode steps, made by the attention
        # integration once per call shape and run by every layer of a kind (hf/attention.py).
        self.plans: dict[tuple, object] = {}
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
            _mark_static(self.block_tables)

    def block_tables_on(self, device: torch.device) -> torch.Tensor:
        """The block tables on ``device`` (a copy made once per device; they never change)."""
        if self.block_tables.device == device:
            return self.block_tables
        if device not in self._block_table_copies:
            self._block_table_copies[device] = self.block_tables.to(device)
            _mark_static(self._block_table_copies[device])
        return self._block_table_copies[device]

    # -- one forward pass ----------------------------------------------------------------
    # Lengths live in fixed device buffers on the cache's first device (``_lengths``), updated
    # in place, so a step captured in a CUDA graph keeps advancing them on every replay. A
    # step (``_step``) holds what every layer's write needs: each new token's (page, slot)
    # and the step's cu_seqlens, computed once per forward pass, with copies for layers on
    # other devices (device_map) and the flat rows of eager writes made on first use.
    _STATE = ("seq_lens", "step_kv_lens", "pending", "slots")

    def begin_step(self, attention_mask: torch.Tensor | None, q_len: int, device=None, config=None) -> None:
        """Begin a forward pass of ``q_len`` new tokens per sequence: commit the last step,
        check capacity, and place the new tokens. ``attention_mask`` is the pass's 2-D padding
        mask (``[B, >= q_len]``, the new tokens last; ``None``: no padding). Called by the
        model's ``create_causal_mask`` (wrapped by this package) before the layers run, with
        the model's (text) ``config``, checked first (:meth:`check_model`) so that the
        step's layers need not check it again (:meth:`layer_for`); a layer updated outside
        a model forward begins a step with no padding by itself.

        Eager calls check capacity on the host and raise before anything changes; a compiled
        step does not (see :meth:`check_generation`) and sends positions past the block table
        to the scratch page."""
        if config is not None:
            self.check_model(config)  # before the step changes anything
        if device is None:
            device = attention_mask.device if attention_mask is not None else self.block_tables.device
        if not torch.compiler.is_compiling():
            self._reserve(q_len)
        # An eager step into an empty cache with no padding: every sequence's keys are its new
        # tokens', which the layers keep for the attention (``M3PagedLayer.take_new_kv``).
        empty = attention_mask is None and not _in_graph() and self._host_slots == 0
        lead, real = new_token_layout(attention_mask, self.max_batch, q_len, device)
        n = self._lengths_on(device)
        device = n["seq_lens"].device
        lead, real = lead.to(device), real.to(device)
        seq = n["seq_lens"]
        seq += n["pending"]  # commit the last step (its trailing pads are overwritten now)
        tables = self.block_tables_on(device)
        capacity = tables.shape[1] * self.page_size
        # Token i of row b goes to position seq[b] + i - lead[b]; leading pads and positions
        # past the table (a compiled step is not checked on the host) go to the scratch page.
        i = torch.arange(q_len, device=device)
        pos = seq.to(torch.int64)[:, None] + i[None, :] - lead[:, None]  # [B, S]
        scratch = (i[None, :] < lead[:, None]) | (pos >= capacity)
        safe = pos.clamp(min=0, max=capacity - 1)
        page = torch.where(scratch, self.num_pages, tables.to(torch.int64).gather(1, safe // self.page_size))
        slot = torch.where(scratch, i[None, :] % self.page_size, safe % self.page_size)
        # Rows are right aligned on this length: real token i of row b sits at seq + i - lead,
        # trailing pads after the real tokens.
        n["step_kv_lens"].copy_((seq + q_len - lead).clamp(max=capacity))
        n["pending"].copy_(real)
        n["slots"].add_(q_len)
        # A traced or captured step must not keep the host count (replays advance only the
        # device count): it forgets it, and the next eager read copies the device count back.
        self._host_slots = None if _in_graph() else self._host_slots + q_len
        cu = self._cu_seqlens(device, q_len)
        layers = len(self.layers)
        self._step = {
            "q_len": q_len, "device": device, "page": page, "slot": slot, "cu": cu, "copies": {}, "rows": {},
            "metadata": {}, "new_kv": {} if empty else None,
            "updated": [False] * layers, "indexed": [False] * layers,
            "config": None if config is None else (config, getattr(config, "_attn_implementation", None)),
        }

    def _cu_seqlens(self, device: torch.device, q_len: int) -> torch.Tensor:
        """``cu_seqlens_q`` of a step of ``q_len`` tokens per sequence: made once per length
        for eager steps, so the ops' plans made for one step serve the next (``plans``)."""
        if _in_graph():
            return torch.arange(self.max_batch + 1, dtype=torch.int32, device=device) * q_len
        cu = self._cus.get((device, q_len))
        if cu is None:
            if len(self._cus) >= MAX_KEPT_CU_SEQLENS:  # prompts of many lengths through one cache
                self._cus.clear()
            with _normal_tensors():
                cu = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device) * q_len
            self._cus[(device, q_len)] = cu
        return cu

    def _lengths_on(self, device: torch.device) -> dict:
        """The length buffers, allocated on ``device`` by the first step."""
        n = self._lengths
        if n is None:
            self._place(device)
            with _normal_tensors():
                seq = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
                n = {"seq_lens": seq, "step_kv_lens": torch.zeros_like(seq), "pending": torch.zeros_like(seq),
                     "slots": torch.zeros((), dtype=torch.int64, device=device)}
            _mark_static(*n.values())
            self._lengths = n
        return n

    def _join_step(self, layer: M3PagedLayer, q_len: int) -> None:
        """``layer`` writes its K/V for the current step (a new step when there is none
        for it: the first update outside a model forward, or the layer's second one)."""
        step = self._step
        if step is None or step["q_len"] != q_len or step["updated"][layer.layer_idx]:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    "M3PagedCache: a compiled step must begin with cache.begin_step() (the model's forward does so)"
                )
            self.begin_step(None, q_len, device=layer.keys.device)
            step = self._step
        step["updated"][layer.layer_idx] = True

    def state_on(self, device: torch.device | None, name: str) -> torch.Tensor | None:
        """A length buffer (``seq_lens``, ``step_kv_lens``, ``pending``, ``slots``) or a value of
        the current step (``page``, ``slot``, ``cu``) on ``device`` (None: the cache's own);
        None before the first step."""
        n = self._lengths
        if n is None:
            return None
        step = self._step
        value = n[name] if name in self._STATE else step[name] if step is not None else None
        if value is None or device is None or value.device == device:
            return value
        if step is None:
            return value.to(device)
        # Another device (device_map): one copy per step.
        copies = step["copies"]
        if (device, name) not in copies:
            copies[(device, name)] = value.to(device)
        return copies[(device, name)]

    @property
    def slots_used(self) -> int:
        """Token slots fed per sequence so far (prompt, padding and generated tokens): every
        sequence's length is at most this. A host int; after compiled steps, which advance
        only the device count, the first read copies it back (one synchronization)."""
        if self._host_slots is None:
            self._host_slots = int(self._lengths["slots"])
        return self._host_slots

    def check_model(self, config) -> None:
        """Raise a ``ValueError`` unless the cache was built for a model with this (text)
        ``config``: as many layers, sparse where it has sparse layers. Run before a forward
        pass changes anything (``create_causal_mask``, wrapped by this package)."""
        n = getattr(config, "num_hidden_layers", len(self.layers))
        if n != len(self.layers):
            raise ValueError(
                f"M3PagedCache was built for a model with {len(self.layers)} layers; this model has {n} "
                "(num_hidden_layers). Build the cache from this model's config."
            )
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        for i, layer in enumerate(self.layers):
            self._check_kind(i, types[i] == SPARSE_LAYER_TYPE)

    def _check_kind(self, layer_idx: int, is_sparse: bool) -> None:
        if self.layers[layer_idx].is_sparse != is_sparse:
            kind = lambda sparse: "a sparse (minimax_m3_sparse)" if sparse else "a full-attention"  # noqa: E731
            raise ValueError(
                f"M3PagedCache: layer {layer_idx} was built as {kind(not is_sparse)} layer, but this model's layer "
                f"{layer_idx} is {kind(is_sparse)} layer. Build the cache from this model's config."
            )

    def layer_for(self, layer_idx: int, config, is_sparse: bool) -> M3PagedLayer:
        """The layer that serves attention layer ``layer_idx`` of a model with ``config``
        (its text config), after checking that the model runs m3_sparse and that the layer
        fits it. A step begun with the model's config (:meth:`begin_step`) checked the whole
        model: its layers only check that they come with that config object, still on the
        same attention implementation."""
        step = self._step
        impl = getattr(config, "_attn_implementation", None)
        checked = step["config"] if step is not None else None
        if checked is not None and checked[0] is config and checked[1] == impl and layer_idx < len(self.layers):
            return self.layers[layer_idx]
        if not uses_m3_sparse(config):
            raise ValueError(
                f"M3PagedCache holds paged K/V that only attn_implementation='m3_sparse' can read; the model "
                f"runs {impl!r}. Load it with attn_implementation='m3_sparse' (after import m3_hf_attention), or "
                "the m3-sparse hub kernel's attention function."
            )
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"M3PagedCache was built for a model with {len(self.layers)} layers; this model asks for layer "
                f"{layer_idx}. Build the cache from this model's config."
            )
        self._check_kind(layer_idx, is_sparse)
        return self.layers[layer_idx]

    def check_generation(self, total_tokens: int) -> None:
        """Before ``generate()`` writes anything: the cache must be empty (a new prompt) and
        hold ``total_tokens`` per sequence (prompt width plus new tokens). Compiled decode
        steps are not checked one by one; this is their capacity check."""
        held = self.get_seq_length()
        if held:
            raise ValueError(
                f"M3PagedCache already holds {held} token slots per sequence from earlier calls; generate() starts a "
                "new prompt on an empty cache. Call cache.reset() first (or build a new cache)."
            )
        if total_tokens > self.max_cache_len:
            raise ValueError(
                f"M3PagedCache overflow: generate() needs up to {total_tokens} tokens per sequence (prompt and "
                f"max_new_tokens), more than max_cache_len={self.max_cache_len}; nothing was written. Build the cache "
                "with a larger max_cache_len."
            )

    def _reserve(self, new_tokens: int) -> None:
        if self.slots_used + new_tokens > self.max_cache_len:
            raise ValueError(
                f"M3PagedCache overflow: the cache holds up to {self.slots_used} tokens per sequence and "
                f"{new_tokens} more would exceed max_cache_len={self.max_cache_len}; nothing was written. "
                "Build the cache with a larger max_cache_len."
            )

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate()`` may compile the decode step and replay it as a CUDA graph
        (on CUDA, unless ``disable_compile=True``). True unless ``compileable`` was set to
        False, as generate() does for the cache it builds for a model spread over devices."""
        return self.compileable

    def layer(self, layer_idx: int) -> M3PagedLayer:
        return self.layers[layer_idx]

    def sequence_lengths(self, layer_idx: int = 0) -> torch.Tensor:
        """Tokens stored per sequence (device tensor [batch], int32)."""
        return self.layers[layer_idx].committed_lengths()

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Token slots fed per sequence (every layer holds the same). While ``torch.compile``
        traces a step or a CUDA graph captures one: the device count (a 0-d tensor, as
        transformers' ``StaticLayer`` returns), so the graph does not depend on a host value
        that changes every step."""
        if _in_graph():
            return self._lengths["slots"] if self._lengths is not None else 0
        return self.slots_used

    def reset(self) -> None:
        """Empty the cache (every page zeroed, every length 0) for a new prompt."""
        super().reset()
        if self._lengths is not None:
            for t in self._lengths.values():
                t.zero_()
        self._step = None
        self._host_slots = 0

    @property
    def is_croppable(self) -> bool:
        """:meth:`crop` puts the lengths back as they were, so generate() may run one step
        past a stop and undo it (its deferred stop check on CUDA, ``hf/attention.py``)."""
        return True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of every sequence, as if the steps that
        fed them had not run (transformers' convention: a negative count; 0 does nothing; a
        positive value is the older form, the number of token slots to keep). Only the
        lengths change, on the device and in place (a CUDA graph's buffers stay where they
        are); what the removed tokens wrote stays in the pages past the new lengths, where
        nothing reads it and the next tokens overwrite it. A sequence with fewer tokens than
        removed is left empty. Raises ``ValueError``, changing nothing, for a count of more
        tokens than the cache was fed."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise ValueError(f"crop: expected an int (minus the tokens to remove), got {tokens_to_remove!r}")
        if tokens_to_remove == 0:
            return
        held = self.slots_used  # after compiled steps: one read of the device count
        remove = held - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        if remove <= 0:
            return  # the older form asked to keep at least what the cache holds
        if remove > held:
            raise ValueError(
                f"crop({tokens_to_remove}): the cache was fed {held} token slots per sequence; it cannot remove {remove}"
            )
        n = self._lengths
        kept = (n["seq_lens"] + n["pending"] - remove).clamp_(min=0)
        n["seq_lens"].copy_(kept)  # committed: no step is open after a crop
        n["step_kv_lens"].copy_(kept)
        n["pending"].zero_()
        n["slots"].sub_(remove)
        self._host_slots = held - remove
        self._step = None

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
