"""The continuous-batching manager's memory estimate (transformers' ``PagedAttentionMemoryHandler``,
which sizes the page pool from the free memory) for a model running ``paged|m3_sparse``: no
attention mask and no K/V read back from the cache are reserved (the kernels read the pools in
place), what m3_sparse allocates per batch token is (KV-outer's partials above all), so the pool
comes out larger than under sdpa; every other implementation keeps transformers' figures
bitwise. On either handler (transformers 5.17's polynomial over activation peaks, 5.18's bytes
per batch and per cache token); on a GPU, the peak of a real prefill step stays within what the
handler reserved for it."""

from __future__ import annotations

import math
import time

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.continuous_batching import cache as cb_cache

import m3_hf_attention
from model_utils import random_prompt, save_tiny_text_model, text_config
from test_continuous_batching import gen_config, manager_cache, page_config

serving = m3_hf_attention.integration.serving
compat = serving.compat
M3 = serving.CB_IMPLEMENTATION
OTHERS = ("paged|sdpa", "paged|eager", "paged|flash_attention_2")
TOKENS_PER_PAGE = 32
MAX_BATCH_TOKENS = 256
AVAILABLE = 1 << 30  # the free memory every pool below is sized from


def stock_handler_class():
    """transformers' own handler class, which the installed one keeps."""
    return cb_cache.PagedAttentionMemoryHandler.m3_sparse_original


@pytest.fixture(scope="module")
def geometry() -> dict:
    """From transformers 5.18, the sector geometry the manager's cache hands its handler (the same
    allocators whatever the implementation); 5.17's handler takes layer groups instead."""
    if not compat.CB_ALLOCATORS:
        return {}
    cache, config = manager_cache(TOKENS_PER_PAGE), text_config()
    # transformers' whole-model block (K/V of every layer, fp32), read only to convert num_blocks (unset here).
    block = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * TOKENS_PER_PAGE * 4
    return dict(
        bytes_per_sector=cache.bytes_per_sector, tokens_per_sector=cache.tokens_per_sector, bytes_per_block=block,
        attn_types=list(cache.cache_allocators),
    )


def handler(impl: str, geometry: dict, dtype=torch.float32, cls=None, max_requests: int | None = None):
    """The manager's memory handler (by default the installed class) for the tiny text model
    under ``impl``, with ``MAX_BATCH_TOKENS`` per step, ``max_requests`` request rows (default
    transformers') and the pool left to the free memory. transformers 5.17 groups M3's three
    layers as one full-attention group."""
    config = text_config()
    config._attn_implementation = impl
    cfg = page_config(
        TOKENS_PER_PAGE, max_batch_tokens=MAX_BATCH_TOKENS, max_memory_percent=1.0, max_requests_per_batch=max_requests
    )
    cls = cls or cb_cache.PagedAttentionMemoryHandler
    if not compat.CB_ALLOCATORS:
        return cls(config, cfg, dtype, ["full_attention"], len(config.layer_types))
    return cls(config, cfg, dtype, **geometry)


def batch_token_bytes(h) -> int:
    """What ``h`` reserves per batch token: from 5.18 ``bytes_per_batch_token``; in 5.17 the
    coefficient of M of its largest activation peak."""
    if compat.CB_ALLOCATORS:
        return h.bytes_per_batch_token
    return max(h._equation_coefficients(peak)[0] for peak in h.activation_peak.values())


def attention_peak_bytes(h) -> int:
    """What ``h`` reserves per batch token at the attention peak: from 5.18 all of
    ``bytes_per_batch_token`` (one figure for every peak); in 5.17 the coefficient of M of its
    attention peak (the LM head's may be larger, but never coincides with it)."""
    if compat.CB_ALLOCATORS:
        return h.bytes_per_batch_token
    return h._equation_coefficients(h.activation_peak["attention"])[0]


def pool_size(h) -> int:
    """The pool ``h`` gives for ``MAX_BATCH_TOKENS``: sectors (5.18+) or blocks (5.17)."""
    if compat.CB_ALLOCATORS:
        return h.infer_max_batch_tokens_and_num_sectors()[1]
    return h.infer_max_batch_tokens_and_num_blocks()[1]


def figures(h) -> tuple:
    """Every figure ``h`` sizes the pool from, and the pool itself."""
    m, n = MAX_BATCH_TOKENS, 100
    if compat.CB_ALLOCATORS:
        return (
            h.bytes_per_batch_token, h.bytes_per_cache_token, h.bytes_per_cache_sector, h.fixed_overhead_bytes,
            h.attention_mask_bytes(m, n), h.compute_memory_footprint(m, n), pool_size(h),
        )
    coefficients = {name: h._equation_coefficients(peak) for name, peak in h.activation_peak.items()}
    return coefficients, h.page_size, h.compute_memory_footprint(m, n), pool_size(h)


@pytest.fixture
def free_memory(monkeypatch):
    """``AVAILABLE`` bytes free on the device, whatever the machine has."""
    monkeypatch.setattr(cb_cache, "get_device_and_memory_breakdown", lambda: (torch.device("cpu"), AVAILABLE, 0, 0))


def step_bytes(tables: int) -> int:
    """Per cache token, what a step whose history spans the pool allocates, rounded up: rows of
    ``max_requests_per_batch`` (transformers' fallback, 1024, here) plus one, ``tables`` page
    tables of an int32 per kernel page (of ``TOKENS_PER_PAGE`` tokens: the kernels take pages of
    32) and KV-outer's segments, four int32 per kv head and key block. From 5.18 the tables are
    a K/V one per allocator (full attention, M3's sparse layers) and the sparse layers' index
    one; in 5.17 the one group's, whose index keys sit beside K/V."""
    config, rows = text_config(), 1024 + 1
    segments = rows * config.num_key_value_heads / config.index_block_size
    return math.ceil(tables * rows * 4 / TOKENS_PER_PAGE + 16 * segments)


def test_no_mask_nor_read_back_is_reserved(geometry, free_memory):
    """Beside the pages themselves (in 5.17 K/V and the index keys; from 5.18 a sector's bytes,
    ``test_sparse_pages_hold_index_keys``), a cache token costs transformers' read index
    (int64 per layer group, one copy per IO set) and its share of a step's page tables and
    KV-outer segments (``step_bytes``), and no
    byte goes to an ``[M, N + M]`` mask; under sdpa the same handler reserves both."""
    sparse = handler(M3, geometry)
    read_index = sparse.io_multiplier * sparse.num_groups * 8
    if compat.CB_ALLOCATORS:
        assert sparse.bytes_per_cache_token == read_index + step_bytes(tables=3)
        assert sparse.attention_mask_bytes(MAX_BATCH_TOKENS, 100) == 0
        sdpa = handler("paged|sdpa", geometry)
        assert sdpa.bytes_per_cache_token > read_index and sdpa.attention_mask_bytes(MAX_BATCH_TOKENS, 100) > 0
        return
    # The pages: the group's K and V tensors, over which the sparse layers' index keys are spread
    # (rounded up to one element per tensor).
    size = sparse.cache_dtype.itemsize
    pages = 2 * sparse.group_size * sparse.page_size * size
    config = text_config()
    kv = 2 * sparse.group_size * config.num_key_value_heads * config.head_dim
    index_keys = config.layer_types.count(serving.SPARSE_LAYER_TYPE) * config.index_head_dim
    assert (kv + index_keys) * size <= pages <= (kv + index_keys + 2 * sparse.group_size) * size
    for name, peak in sparse.activation_peak.items():
        _, per_cache_token, per_mn, per_mm = sparse._equation_coefficients(peak)
        assert (per_cache_token, per_mn, per_mm) == (pages + read_index + step_bytes(tables=1), 0, 0), name
    sdpa = handler("paged|sdpa", geometry)
    _, per_cache_token, per_mn, _ = sdpa._equation_coefficients(sdpa.activation_peak["attention"])
    sdpa_pages = 2 * sdpa.group_size * sdpa.page_size * sdpa.cache_dtype.itemsize
    assert per_cache_token > sdpa_pages + read_index and per_mn > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_what_m3_sparse_allocates_per_batch_token_is_reserved(geometry, free_memory, dtype):
    """Per batch token at the attention peak the handler reserves, beyond transformers' own
    figure without the K/V read-back, at least KV-outer's partials (one o [D] in the activation
    dtype, m and l fp32 per kv head, top-k slot and query head of the group), index (4 int32
    per entry) and q copy ([Hq, D], the TMA partials kernel's of a transposed q), the attention
    output [Hq, D] and the index branch's queries and key."""
    config = text_config()
    hq, hkv, d, topk = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.index_topk_blocks
    size = dtype.itemsize
    partials = hkv * topk * (hq // hkv) * (d * size + 4 + 4)
    kvouter_index = hkv * topk * 4 * 4
    output = hq * d * size
    index_branch = (config.index_n_heads * config.index_head_dim + config.index_head_dim) * size
    stock = handler(M3, geometry, dtype, cls=stock_handler_class())
    if compat.CB_ALLOCATORS:
        stock.kv_heads_at_peak = 0  # the read-back, which from 5.18 is charged per batch token too
    extra = attention_peak_bytes(handler(M3, geometry, dtype)) - attention_peak_bytes(stock)
    assert extra >= partials + kvouter_index + hq * d * size + output + index_branch


def test_pool_is_larger_than_under_sdpa(geometry, free_memory):
    """The same model, free memory, step size and request rows give m3_sparse a larger pool than
    sdpa, though its pages also hold the index keys and its steps reserve the KV-outer partials
    and, per cache token, page tables and segments for each request row. This model's K/V are so
    small (768 bytes a token) that at transformers' 1024 rows the segments (4100 bytes a token)
    outweigh sdpa's read-back (1152); at M3's shapes (64 query heads over 4 KV heads of 128,
    key blocks of 128) they are 513 bytes a token against a read-back of 33 KiB."""
    sizes = {impl: pool_size(handler(impl, geometry, max_requests=64)) for impl in ("paged|sdpa", M3)}
    assert sizes[M3] > sizes["paged|sdpa"] > 0
    sizes = {impl: pool_size(handler(impl, geometry)) for impl in ("paged|sdpa", M3)}
    assert 0 < sizes[M3] < sizes["paged|sdpa"]
    sparse = handler(M3, geometry)
    assert sparse.compute_memory_footprint(MAX_BATCH_TOKENS, sizes[M3]) <= AVAILABLE


@pytest.mark.parametrize("impl", OTHERS)
def test_other_implementations_keep_transformers_figures(geometry, free_memory, impl):
    """Only a model running m3_sparse is sized differently: under any other implementation the
    installed handler gives the figures of transformers' own class, bitwise."""
    installed = handler(impl, geometry)
    stock = handler(impl, geometry, cls=stock_handler_class())
    assert type(installed) is not type(stock)
    assert figures(installed) == figures(stock)


# ---------------------------------------------------------------------------------------
# GPU: a real prefill step against the reservation
# ---------------------------------------------------------------------------------------
# M3's attention shapes on one of four tensor-parallel ranks (16 query heads over one KV head,
# head dim 128, top-16 blocks, index head dim 128) at a tiny hidden size and vocabulary.
GPU_SHAPES = dict(
    hidden_size=256, num_attention_heads=16, num_key_value_heads=1, head_dim=128, rotary_dim=64, index_n_heads=1,
    index_head_dim=128, index_block_size=16, index_topk_blocks=16,
)
GPU_BATCH_TOKENS = 2048
# transformers' estimate counts one copy of the hidden states and of the query projection; the
# module's norms and rotary embedding keep a few more query-sized copies alive (8 MiB each here),
# and the MoE its routing and expert rows, against 132 MiB of partials alone.
SLACK = 64 << 20


def gpu_model_and_handlers(path, monkeypatch):
    """The tiny model at ``GPU_SHAPES`` on the GPU (bf16), and the list the manager's memory
    handlers go to as they are made, each with the memory allocated once it has sized the pool
    (``allocated_before_cache``: the cache tensor is allocated after)."""
    save_tiny_text_model(path, seed=4, **GPU_SHAPES)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse", dtype=torch.bfloat16)
    handlers = []

    class Recorded(cb_cache.PagedAttentionMemoryHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            torch.cuda.synchronize()
            self.allocated_before_cache = torch.cuda.memory_allocated()
            handlers.append(self)

    monkeypatch.setattr(cb_cache, "PagedAttentionMemoryHandler", Recorded)
    return model.cuda().eval(), handlers


@pytest.mark.gpu
def test_prefill_step_stays_within_the_reservation(tmp_path, monkeypatch):
    model, handlers = gpu_model_and_handlers(tmp_path, monkeypatch)
    cfg = page_config(16, num_blocks=512, max_batch_tokens=GPU_BATCH_TOKENS, use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=gen_config(1), continuous_batching_config=cfg)
    manager.start()
    g = torch.Generator().manual_seed(0)
    try:
        deadline = time.monotonic() + 120
        while getattr(manager, "batch_processor", None) is None:
            assert time.monotonic() < deadline, "the manager built no cache within 120 s"
            time.sleep(0.01)
        # A short request first: kernels compiled, library workspaces allocated.
        manager.add_request(random_prompt(64, g).tolist(), request_id="warm", max_new_tokens=1)
        warm = manager.get_result(request_id="warm", timeout=300)
        assert warm is not None and warm.error is None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        manager.add_request(random_prompt(GPU_BATCH_TOKENS, g).tolist(), request_id="full", max_new_tokens=1)
        out = manager.get_result(request_id="full", timeout=300)
        torch.cuda.synchronize()
        added = torch.cuda.max_memory_allocated() - before
        max_batch_tokens = manager.batch_processor.cache.max_batch_tokens
    finally:
        manager.stop(block=True, timeout=30)
    assert out is not None and out.error is None
    (h,) = handlers
    assert max_batch_tokens == GPU_BATCH_TOKENS
    reserved = batch_token_bytes(h) * GPU_BATCH_TOKENS
    assert added <= reserved + SLACK, (
        f"a {GPU_BATCH_TOKENS}-token prefill step added {added / 2**20:.1f} MiB, the handler reserved "
        f"{reserved / 2**20:.1f} MiB (+ {SLACK >> 20} MiB slack)"
    )
    # The step ran whole through KV-outer: its partials alone were allocated.
    s = GPU_SHAPES
    group = s["num_attention_heads"] // s["num_key_value_heads"]
    partials = s["num_key_value_heads"] * s["index_topk_blocks"] * group * (s["head_dim"] * 2 + 8)
    assert added >= GPU_BATCH_TOKENS * partials


@pytest.mark.gpu
@pytest.mark.skipif(not compat.CB_ALLOCATORS, reason="the cache tensor of transformers 5.18 and later")
def test_graphed_steps_stay_within_the_reservation(tmp_path, monkeypatch):
    """With CUDA graphs (the manager's default on CUDA, and the server's) the manager warms up
    and captures its steps at the largest sizes into one private pool. Everything the process
    allocates beyond the cache tensor, from the handler's sizing to the end of a full prefill
    step, stays within what the handler reserved for a step. A pool sized from the free memory
    leaves only ``1 - max_memory_percent`` of it besides: a step that outgrows the reservation
    by more fails its warm-up and then a request."""
    model, handlers = gpu_model_and_handlers(tmp_path, monkeypatch)
    cfg = page_config(16, num_blocks=512, max_batch_tokens=GPU_BATCH_TOKENS, use_cuda_graph=True)
    torch.cuda.reset_peak_memory_stats()
    manager = model.init_continuous_batching(generation_config=gen_config(2), continuous_batching_config=cfg)
    manager.start()
    g = torch.Generator().manual_seed(1)
    try:
        ids = {f"r{n}": n for n in (GPU_BATCH_TOKENS, 700, 64)}
        for rid, n in ids.items():
            manager.add_request(random_prompt(n, g).tolist(), request_id=rid, max_new_tokens=2)
        outs = [manager.get_result(request_id=rid, timeout=300) for rid in ids]
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        cache_bytes = manager.batch_processor.cache.cache_tensor.nbytes
    finally:
        manager.stop(block=True, timeout=30)
    assert all(out is not None and out.error is None for out in outs), [getattr(o, "error", None) for o in outs]
    (h,) = handlers
    added = peak - h.allocated_before_cache - cache_bytes
    reserved = batch_token_bytes(h) * GPU_BATCH_TOKENS
    assert added <= reserved + SLACK, (
        f"with CUDA graphs, steps of up to {GPU_BATCH_TOKENS} tokens added {added / 2**20:.1f} MiB beside the "
        f"cache, the handler reserved {reserved / 2**20:.1f} MiB (+ {SLACK >> 20} MiB slack)"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not compat.CB_ALLOCATORS, reason="the cache tensor and the handler's footprint of 5.18 and later")
def test_a_pool_sized_from_the_free_memory_warms_up_and_serves(tmp_path, monkeypatch):
    """What ``transformers serve`` does: a pool sized from the free memory (a quarter of it here,
    so that other tests may share the GPU), CUDA graphs, and the manager warmed up before it
    starts. The warm-up runs its largest step with ``max_length_k`` at the whole pool, so the
    step's page tables span it: every warm-up step runs (transformers logs and goes on where
    one fails), a request then gets its tokens, and the process's peak stays within the
    handler's whole footprint (pool, page tables, steps)."""
    import logging

    from transformers.generation.continuous_batching.utils import WorkloadHints

    model, handlers = gpu_model_and_handlers(tmp_path, monkeypatch)
    failures = []

    class Failures(logging.Handler):
        def emit(self, record):
            if "Failed to warm up" in record.getMessage():
                failures.append(record.getMessage())

    watcher = Failures()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_logger.addHandler(watcher)
    cfg = page_config(256, max_batch_tokens=GPU_BATCH_TOKENS, max_memory_percent=0.25)
    torch.cuda.reset_peak_memory_stats()
    manager = model.init_continuous_batching(
        generation_config=gen_config(2), continuous_batching_config=cfg,
        workload_hints=WorkloadHints(max_prompt_length=model.config.max_position_embeddings),
    )
    try:
        manager.warmup()
        manager.start()
        g = torch.Generator().manual_seed(2)
        manager.add_request(random_prompt(GPU_BATCH_TOKENS, g).tolist(), request_id="full", max_new_tokens=2)
        out = manager.get_result(request_id="full", timeout=300)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        cache = manager.batch_processor.cache
        sectors, max_tokens_read = cache.num_sectors, cache.max_tokens_read
    finally:
        manager.stop(block=True, timeout=30)
        cb_logger.removeHandler(watcher)
    assert failures == []
    assert out is not None and out.error is None
    (h,) = handlers
    # The warm-up's step was as wide as the pool: tables of a million entries or more.
    assert max_tokens_read // 128 * 1025 >= 1 << 20
    footprint = h.compute_memory_footprint(GPU_BATCH_TOKENS, sectors)
    added = peak - h.allocated_before_cache
    assert added <= footprint + SLACK, (
        f"{added / 2**20:.1f} MiB allocated from the handler's sizing to the end of a full step, the handler's "
        f"footprint is {footprint / 2**20:.1f} MiB (+ {SLACK >> 20} MiB slack)"
    )
