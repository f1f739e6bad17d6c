"""``paged|m3_sparse`` under transformers' continuous batching (``generate_batch``,
``init_continuous_batching``) on the CPU: every request's greedy tokens equal its own
``generate()`` with ``m3_sparse`` (fp32), whatever else shares its steps: prompts of
different lengths, prompts cut into several prefill chunks, requests joining mid-run,
requests waiting for pages. The step layout built from transformers' keywords is checked
against its own cache bookkeeping, padded steps included, on either cache design
(transformers 5.17's layer groups, 5.18's allocators: ``serving.cache_design``), and so are the
index keys a served request leaves in the pool, token by token at its pages and slots."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.requests import RequestState
from transformers.generation.continuous_batching.scheduler import Scheduler
from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

import m3_hf_attention
from model_utils import BLOCK, PAD, TOPK, random_prompt, randomize_norms, save_tiny_text_model, text_config, vl_config

serving = m3_hf_attention.integration.serving
compat = serving.compat
ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "m3-hf-attention/m3-sparse"
NEW_TOKENS = 10
CB_BLOCK = 16  # tokens per block of the manager's cache: pages of 16 for the kernels
CHUNK = 64  # max_batch_tokens: longer prompts are prefilled in several steps


def gen_config(new_tokens: int = NEW_TOKENS) -> GenerationConfig:
    # No EOS: every request runs its full length in both paths.
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=PAD)


def page_config(tokens_per_page: int, **kwargs) -> ContinuousBatchingConfig:
    """A ContinuousBatchingConfig of ``tokens_per_page`` tokens per page (``block_size`` up to
    transformers 5.17, ``page_size`` later)."""
    return ContinuousBatchingConfig(**{compat.CB_PAGE_SIZE_FIELD: tokens_per_page}, **kwargs)


def cb_config(num_blocks: int = 64) -> ContinuousBatchingConfig:
    return page_config(CB_BLOCK, num_blocks=num_blocks, max_batch_tokens=CHUNK)


def prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [random_prompt(n, g).tolist() for n in lengths]


def reference(model, prompt, new_tokens=NEW_TOKENS) -> list[int]:
    """The request alone through generate() on m3_sparse."""
    out = model.generate(torch.tensor([prompt], device=model.device), generation_config=gen_config(new_tokens))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-cb")
    save_tiny_text_model(path, seed=0)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse").eval()


@pytest.fixture
def steps(monkeypatch):
    """Every step continuous batching ran: (new tokens per request, kv length per request,
    whether it came through the decode fast path's block table)."""
    seen = []
    build = serving.build_step

    def spy(cache, kwargs, num_tokens):
        step = build(cache, kwargs, num_tokens)
        cu = step.cu_seqlens_q[:-1].tolist()
        fast = kwargs.get("block_table") is not None
        seen.append(([b - a for a, b in zip(cu, cu[1:])], step.kv_lens[:-1].tolist(), fast))
        return step

    monkeypatch.setattr(serving, "build_step", spy)
    return seen


def run_batch(model, batch, num_blocks=64, new_tokens=NEW_TOKENS) -> list[list[int]]:
    out = model.generate_batch(
        batch, generation_config=gen_config(new_tokens), continuous_batching_config=cb_config(num_blocks), warmup=False
    )
    results = list(out.values())
    assert [r.error for r in results] == [None] * len(batch)
    return [r.generated_tokens for r in results]


def test_mixed_lengths_equal_generate(model, steps):
    batch = prompts([5, 20, 45, 70, 131])
    assert run_batch(model, batch) == [reference(model, p) for p in batch]
    assert model.config._attn_implementation == "m3_sparse"  # the manager switched to paged| and back
    # What the comparison covered: a prompt over several chunks (a step with history and
    # several new tokens), steps mixing prefill chunks with decode rows, and histories
    # longer than the top-k keeps (the selection drops blocks).
    chunked = any(q > 1 and kv > q for qs, kvs, _ in steps for q, kv in zip(qs, kvs))
    mixed = any(1 in qs and max(qs) > 1 for qs, _, _ in steps)
    sparse = max(kv for _, kvs, _ in steps for kv in kvs) > 2 * TOPK * BLOCK
    # Decode-only steps come through transformers' decode fast path (block tables, no read index).
    fast = [qs for qs, _, block_table in steps if block_table]
    assert fast and all(set(qs) == {1} for qs in fast)
    assert chunked and mixed and sparse


def test_paged_name_at_load(checkpoint, model):
    """Loading with ``paged|m3_sparse``: up to transformers 5.18 that is continuous batching's
    name, which a plain forward refuses; from 5.19 from_pretrained drops the prefix. Either way
    the model serves."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.19+: "The `paged|` prefix is no longer needed"
        paged = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="paged|m3_sparse").eval()
    assert paged.config._attn_implementation == ("paged|m3_sparse" if compat.CB_PAGED_NAMES else "m3_sparse")
    batch = prompts([33, 90], seed=1)
    assert run_batch(paged, batch) == [reference(model, p) for p in batch]
    if compat.CB_PAGED_NAMES:
        with pytest.raises(ValueError, match="continuous batching"):
            paged(torch.tensor([batch[0]]))


def test_requests_join_mid_run(model, steps):
    first, *later = prompts([60, 24, 75], seed=2)
    manager = model.init_continuous_batching(generation_config=gen_config(24), continuous_batching_config=cb_config())
    manager.start()
    try:
        manager.add_request(first, request_id="first", max_new_tokens=24, streaming=True)
        # Join once the first request decodes.
        deadline = time.monotonic() + 60
        while True:
            out = manager.get_result(request_id="first", timeout=1)
            if out is not None and len(out.generated_tokens) >= 2:
                break
            assert time.monotonic() < deadline, "the first request produced no tokens"
        for i, p in enumerate(later):
            manager.add_request(p, request_id=f"later{i}", max_new_tokens=NEW_TOKENS)
        results = finished_results(manager, 3)
    finally:
        manager.stop(block=True, timeout=30)
    assert [results[k].error for k in results] == [None] * 3
    assert results["first"].generated_tokens == reference(model, first, 24)
    for i, p in enumerate(later):
        assert results[f"later{i}"].generated_tokens == reference(model, p)
    # The later requests were prefilled beside the first one's decode rows.
    assert any(1 in qs and max(qs) > 1 and len(qs) > 1 for qs, _, _ in steps)


def finished_results(manager, count: int) -> dict:
    """The manager's next ``count`` finished results, by request id (60 s at most for each)."""
    results = {}
    while len(results) < count:
        out = manager.get_result(timeout=60)
        assert out is not None, "no result within 60 s"
        if out.is_finished():
            results[out.request_id] = out
    return results


def test_prefix_cache_reuses_index_keys(model, steps):
    """A request whose prompt starts with a finished request's blocks (transformers' prefix
    cache) skips computing them: its sparse layers read the index keys the first request
    wrote into those blocks, and its tokens still equal its own generate()."""
    prefix, tail_a, tail_b = prompts([48, 20, 15], seed=5)
    first, second = prefix + tail_a, prefix + tail_b
    manager = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=cb_config())
    manager.start()
    try:
        results = []
        for i, p in enumerate((first, second)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=NEW_TOKENS)
            out = manager.get_result(request_id=f"r{i}", timeout=60)
            assert out is not None and out.is_finished() and out.error is None
            results.append(out.generated_tokens)
            if i == 0:
                done = len(steps)
    finally:
        manager.stop(block=True, timeout=30)
    assert results == [reference(model, first), reference(model, second)]
    (q,), (kv,), _ = steps[done]  # the second request's first step
    assert (kv - q, kv) == (len(prefix), len(second))  # the prefix: three whole blocks, reused


def test_forked_requests_keep_their_index_keys(model):
    """num_return_sequences: the manager forks a request once its prompt is in, and the children
    share its complete blocks and get copies of its last one, whose index keys must come along
    (transformers 5.17 copies K/V only; from 5.18 a sparse block's bytes hold them). With top-1
    sampling every child's tokens equal the prompt's greedy generate()."""
    prompt = prompts([70], seed=6)[0]  # four complete blocks of 16 and a partial one
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1, num_return_sequences=2,
                              eos_token_id=-1, pad_token_id=PAD)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config())
    manager.start()
    try:
        manager.add_request(prompt, request_id="r", max_new_tokens=NEW_TOKENS)
        results = finished_results(manager, 2)
    finally:
        manager.stop(block=True, timeout=30)
    assert len(results) == 2 and [r.error for r in results.values()] == [None, None]
    want = reference(model, prompt)
    assert [r.generated_tokens for r in results.values()] == [want, want]


def test_requests_wait_for_pages(model, steps):
    # 10 blocks of 16 = 160 token slots: each request fits alone (<= 81 tokens), not all three at once.
    batch = prompts([70, 70, 45], seed=3)
    assert run_batch(model, batch, num_blocks=10) == [reference(model, p) for p in batch]
    held = [sum(kvs) for _, kvs, _ in steps]
    # Requests shared the pool (one holds at most 81 slots) and it never held more than 160,
    # fewer than the 218 the three need at once. (transformers 5.17 and 5.25 fill it to within
    # a block. 5.18-5.24 turn num_blocks into bytes as blocks of K/V alone, so the sparse
    # layers' index keys leave them a smaller pool.)
    assert max(len(p) + NEW_TOKENS + 1 for p in batch) < max(held) <= 160 < sum(len(p) + NEW_TOKENS + 1 for p in batch)


def test_request_larger_than_the_pool_is_refused(model):
    # 4 blocks of 16 = 64 token slots: the 100-token prompt can never fit. transformers'
    # scheduler fails that request with an error; the one that fits is served as alone.
    big, small = prompts([100, 20], seed=5)
    out = model.generate_batch(
        [big, small], generation_config=gen_config(), continuous_batching_config=cb_config(4), warmup=False
    )
    first, second = (out[k] for k in sorted(out))  # req_0, req_1: the order they were given
    assert first.error and "No requests can be scheduled" in first.error and first.generated_tokens == []
    assert second.error is None and second.generated_tokens == reference(model, small)


def test_add_request_refuses_a_request_larger_than_the_cache(model):
    """A cache of 4 blocks of 16: 64 token slots for one request on every release (from 5.18
    counted in the whole sectors each allocator takes; 5.18 to 5.24's own block count says 80,
    and a request of 80 would stop the manager). A request that can never fit (prompt +
    max_new_tokens over what the cache holds) is refused with a ValueError before it is queued,
    and the manager serves on: a request of exactly 64 (prompt + max_new_tokens) gets its own
    tokens, and so does one beside it."""
    manager = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=cb_config(4))
    manager.start()
    try:
        pool = serving._pool_tokens(manager)
        assert pool == 64
        fits, beside = prompts([pool - NEW_TOKENS, 20], seed=6)
        for prompt_len, new in ((pool + 36, NEW_TOKENS), (pool - 4, 5), (20, pool - 19)):
            with pytest.raises(ValueError, match=rf"needs up to {prompt_len + new} cache slots .* holds \({pool} tokens\)"):
                manager.add_request(prompts([prompt_len], seed=7)[0], max_new_tokens=new)
        with pytest.raises(ValueError, match=rf"needs up to {pool + 1} cache slots"):  # the config's max_new_tokens
            manager.add_request(prompts([pool + 1 - NEW_TOKENS], seed=7)[0])
        manager.add_request(fits, request_id="fits", max_new_tokens=NEW_TOKENS)
        results = finished_results(manager, 1)
        manager.add_request(beside, request_id="beside", max_new_tokens=NEW_TOKENS)
        results |= finished_results(manager, 1)
        assert manager.is_running()
    finally:
        manager.stop(block=True, timeout=30)
    assert [results[k].error for k in ("fits", "beside")] == [None, None]
    assert results["fits"].generated_tokens == reference(model, fits)
    assert results["beside"].generated_tokens == reference(model, beside)


def test_multimodal_model_given_text(tmp_path):
    torch.manual_seed(0)
    vl = MiniMaxM3SparseForConditionalGeneration(vl_config()).eval()
    randomize_norms(vl)
    vl.save_pretrained(tmp_path)
    vl = MiniMaxM3SparseForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="m3_sparse").eval()
    batch = prompts([20, 70], seed=4)
    assert run_batch(vl, batch) == [reference(vl, p) for p in batch]


@pytest.mark.parametrize("suffix", ["", ":m3_sparse_attention"], ids=["repo", "repo:function"])
def test_hub_string(checkpoint, model, suffix):
    """A model loaded with the kernel's hub string (without importing m3_hf_attention) serves
    through generate_batch: the manager's ``paged|`` + hub string runs this attention."""
    impl = REPO_ID + suffix
    served = compat.cb_attn_implementation(impl)
    env = dict(os.environ, LOCAL_KERNELS=f"{REPO_ID}={ROOT}", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "hub_string_serve.py"), str(checkpoint), impl, served],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["attn_implementation"] == impl and not got["imported_m3_hf_attention"]
    if served != impl:  # paged| + the hub string up to 5.18, this package's serving name in 5.19-5.23: no mask
        assert got["served_attention"].endswith("hf.serving.paged_m3_sparse_attention")
        assert got["served_mask"] is None or got["served_mask"].endswith("hf.serving.no_mask")
    else:  # the hub string itself: the kernel's attention, which hands serving steps on (no mask is built)
        assert got["served_attention"].endswith("hf.attention.m3_sparse_attention")
    assert got["errors"] == [None, None]
    assert got["generated"] == [reference(model, p, 8) for p in got["prompts"]]


# ---------------------------------------------------------------------------------------
# the step layout against transformers' own bookkeeping
# ---------------------------------------------------------------------------------------
HKV, HEAD_DIM, INDEX_DIM = 2, 16, 16  # model_utils.text_config's K/V heads, head dim, index head dim
LAYERS = text_config().layer_types  # sparse, full, sparse


def manager_cache(tokens_per_page=32, num_blocks=12) -> PagedAttentionCache:
    """The cache the manager builds for the tiny text model under paged|m3_sparse (fp32, CPU)."""
    config = text_config()
    config._attn_implementation = serving.CB_IMPLEMENTATION
    cfg = page_config(
        tokens_per_page, num_blocks=num_blocks, max_batch_tokens=64, max_blocks_per_request=8, max_memory_percent=0.5
    )
    kwargs = dict(
        config=config, continuous_batching_config=cfg, device=torch.device("cpu"),
        distributed_helper=DistributedHelper(None, None), dtype=torch.float32,
    )
    if "tp_plan" in inspect.signature(PagedAttentionCache).parameters:  # transformers 5.17 takes the plan here
        kwargs["tp_plan"] = {}
    return PagedAttentionCache(**kwargs)


def give_room(cache, rid: str, held: int, tokens: int) -> None:
    """Allocate what request ``rid``, holding ``held`` tokens, needs for ``tokens`` more, with the
    cache's own allocation call (5.17: blocks across its layer groups; 5.18: sectors and blocks
    of every allocator, from a request state)."""
    if not compat.CB_ALLOCATORS:
        size = cache.block_size
        assert cache.allocate_blocks(-(-(held + tokens) // size) - -(-held // size), rid, 0) is not None
        return
    state = RequestState(request_id=rid, initial_tokens=[])
    state.position_offset = held
    assert cache.can_store_request_tokens(state, tokens)


def pools_of(cache):
    return serving.cache_design.pools_of(cache)


def token_slots(cache, rid: str, length: int) -> list[list[int]]:
    """The slots of request ``rid``'s first ``length`` tokens in each layer group, in order, from
    the cache's own bookkeeping: the write index of those tokens (the read index has one entry
    per page under paged|m3_sparse from 5.18, one per token on 5.17)."""
    slots = [[] for _ in pools_of(cache).groups]
    cache.extend_read_and_write_indices(rid, 0, length, None, slots)
    return slots


def step_keywords(cache, requests, *, decode: bool, pad_to: int = 0, fake: int = 0):
    """The keywords ContinuousBatchingIOs builds for ``requests`` [(id, past, new)]: the
    varlen form (write / read indices) or the decode fast path (block tables); ``pad_to``
    query tokens and ``fake`` empty requests as with CUDA graphs. Also returns the slots of
    every token of each request in order (:func:`token_slots`) and the write indices, unpadded,
    of each layer group."""
    groups = len(pools_of(cache).groups)
    cu_q, cu_k, write, read = [0], [0], [[] for _ in range(groups)], [[] for _ in range(groups)]
    history = [[] for _ in range(groups)]
    table = torch.full((groups, len(requests) + fake, 8), -1, dtype=torch.int32)
    for i, (rid, past, new) in enumerate(requests):
        cu_q.append(cu_q[-1] + new)
        cu_k.append(cu_k[-1] + past + new)
        cache.extend_read_and_write_indices(rid, past, new, read, write)
        cache.fill_block_table(rid, past, new, table[:, i])
        for g, slots in enumerate(token_slots(cache, rid, past + new)):
            history[g] += slots
    tokens = max(pad_to, cu_q[-1])
    padded_write = [w + [g.write_trash_index] * (tokens - cu_q[-1]) for w, g in zip(write, pools_of(cache).groups)]
    cu_q += [cu_q[-1]] * fake
    cu_k += [cu_k[-1]] * fake
    as_int = lambda v, dtype=torch.int32: torch.tensor(v, dtype=dtype)  # noqa: E731
    kwargs = dict(
        cu_seq_lens_q=as_int(cu_q), cu_seq_lens_k=as_int(cu_k), max_length_q=max(n for *_, n in requests),
        max_length_k=max(p + n for _, p, n in requests), cache=cache,
    )
    if decode:
        stale = [as_int([], torch.int64)] * groups
        kwargs.update(block_table=table, write_index=stale, read_index=stale)
    else:
        kwargs.update(
            block_table=None, write_index=[as_int(w, torch.int64) for w in padded_write],
            read_index=[as_int(r, torch.int64) for r in read],
        )
    return kwargs, history, write


def fill_random(cache, seed=0) -> None:
    """Random values in every K, V and index-key slot of the cache."""
    g = torch.Generator().manual_seed(seed)
    if compat.CB_ALLOCATORS:
        cache.cache_tensor.view(torch.float32).normal_(generator=g)
        return
    for t in cache.key_cache + cache.value_cache:
        t.normal_(generator=g)
    for layer, kind in enumerate(LAYERS):
        if kind == serving.SPARSE_LAYER_TYPE:
            pools_of(cache).groups[0].index_pool(layer, INDEX_DIM).normal_(generator=g)


def slot_reads(cache, layer: int, slots: torch.Tensor):
    """What the cache holds for ``layer`` at ``slots``: K and V ``[N, Hkv, D]`` as transformers
    reads them (5.17: its ``key_cache`` / ``value_cache``; 5.18: the layer's allocator's
    ``update`` with a read index), and the index keys ``[N, Di]`` of a sparse layer at the same
    slots (None for a full-attention layer)."""
    sparse = LAYERS[layer] == serving.SPARSE_LAYER_TYPE
    if not compat.CB_ALLOCATORS:
        _, j = cache.layer_index_to_group_indices[layer]
        index_keys = pools_of(cache).groups[0].index_pool(layer, INDEX_DIM).reshape(-1, INDEX_DIM)
        return cache.key_cache[j][slots], cache.value_cache[j][slots], index_keys[slots] if sparse else None
    allocator = cache.layer_to_allocator[layer]
    none = compat.cb_allocator_states(torch.zeros(0, HKV, HEAD_DIM))
    keys, values = allocator.update(none, none, layer, slots, slots[:0])
    return keys, values, allocator.read_index_keys(layer, slots) if sparse else None


def kernel_reads(step, cache, layer: int, req: int, length: int):
    """What the kernels read for request ``req``'s first ``length`` tokens of ``layer``: K, V
    and (sparse layers) index keys through the step's page tables and the group's pools."""
    pools = pools_of(cache)
    g = pools.group_of(layer)
    group, tables = pools.groups[g], step.groups[g]
    pos = torch.arange(length)
    page, slot = pos // step.page_size, pos % step.page_size
    k_pool, v_pool = group.kv_pools(layer)
    kv_pages = tables.kv_tables[req, page].long()
    index_keys = None
    if LAYERS[layer] == serving.SPARSE_LAYER_TYPE:
        index_keys = group.index_pool(layer, INDEX_DIM)[tables.index_tables[req, page].long(), slot]
    return k_pool[kv_pages, :, slot], v_pool[kv_pages, :, slot], index_keys


def test_config_keeps_the_decode_fast_path():
    """paged|m3_sparse resolves like flash attention: the decode fast path stays on (the
    block table is what build_step reads) and no mask is needed (CUDA graphs by default on
    CUDA); explicit settings stay as given; other implementations resolve as before."""
    resolve = continuous_api.resolve_continuous_batching_config
    # transformers passes the model's device from 5.21 (and warns without it).
    device = {"device": torch.device("cpu")} if compat.transformers_at_least(5, 21) else {}
    config = text_config()
    config._attn_implementation = serving.CB_IMPLEMENTATION
    resolved = resolve(config, page_config(32), None, False, **device)
    # Wide enough for the longest request the model takes.
    assert resolved.max_blocks_per_request * 32 >= config.max_position_embeddings
    assert resolved.use_cuda_graph == (torch.cuda.is_available(),) * 2
    explicit = resolve(config, ContinuousBatchingConfig(max_blocks_per_request=0, use_cuda_graph=False), None, False,
                       **device)
    assert explicit.max_blocks_per_request == 0 and explicit.use_cuda_graph == (False, False)
    # Other implementations resolve as before (5.18 refuses M3's layer types for them there).
    config._attn_implementation = "sdpa"

    def outcome(fn):
        try:
            return fn(config, page_config(32), None, False, **device)
        except ValueError as exc:
            return str(exc)

    assert outcome(resolve) == outcome(resolve.m3_sparse_original)


@pytest.mark.skipif(not compat.CB_ALLOCATORS, reason="the allocators of transformers 5.18 and later; 5.17's cache: "
                    "test_serving_memory.py::test_no_mask_nor_read_back_is_reserved")
def test_sparse_pages_hold_index_keys():
    """From transformers 5.18 M3's sparse layers get their own allocator, whose page holds a
    layer's K, V and index keys: the manager's sizing (bytes per block), forks and prefix
    sharing count and carry the index keys with K/V. Its pages tile the cache tensor: adding 1
    through every (layer, slot) of K, V and index keys turns every element to exactly 1."""
    cache = manager_cache(32, num_blocks=6)
    sparse = cache.cache_allocators[serving.SPARSE_LAYER_TYPE]
    full = cache.cache_allocators["full_attention"]
    assert (sparse.layer_indices, full.layer_indices) == ([0, 2], [1])
    assert sparse.bytes_per_block == 2 * 32 * (2 * HKV * HEAD_DIM + INDEX_DIM) * 4  # two pages of K, V, index keys
    assert full.bytes_per_block == 32 * 2 * HKV * HEAD_DIM * 4
    flat = cache.cache_tensor.view(torch.float32)
    flat.zero_()
    blocks = cache.cache_tensor.numel() // sparse.bytes_per_block
    slots = (torch.arange(blocks)[:, None] * sparse.block_physical_stride + torch.arange(32)).reshape(-1)
    none = torch.zeros(0, HKV, HEAD_DIM)
    for layer in sparse.layer_indices:
        keys, values = sparse.update(none, none, layer, slots, slots[:0])
        sparse.update(keys + 1, values + 1, layer, slots[:0], slots)
        sparse.write_index_keys(layer, sparse.read_index_keys(layer, slots) + 1, slots)
    assert torch.equal(flat, torch.ones_like(flat))


@pytest.mark.skipif(not compat.CB_ALLOCATORS, reason="the allocators of transformers 5.18 and later")
def test_read_index_holds_one_slot_per_page():
    """transformers lists every history token of every request in a step's read index, once per
    allocator, on the host. Under paged|m3_sparse both allocators list each page's first slot
    instead (the kernels read the pools in place). Any other model's full-attention layers get
    transformers' own allocator class."""
    cache = manager_cache(32)
    give_room(cache, "a", 0, 32)
    give_room(cache, "b", 0, 32)
    give_room(cache, "a", 32, 2 * 32)  # a's pages are not contiguous
    read, write = [[], []], [[], []]
    cache.extend_read_and_write_indices("a", 40, 30, read, write)  # 70 tokens: 3 pages
    per_token = token_slots(cache, "a", 70)
    assert [len(r) for r in read] == [3, 3]
    assert read == [slots[::32] for slots in per_token]
    assert write == [slots[40:] for slots in per_token]
    design = serving.cache_design
    assert type(cache.cache_allocators["full_attention"]) is design.M3FullCacheAllocator
    assert type(cache.cache_allocators[serving.SPARSE_LAYER_TYPE]) is design.M3SparseCacheAllocator
    config = text_config()
    config._attn_implementation = "sdpa"
    other = cb_cache.ATTN_TYPE_TO_ALLOCATOR["full_attention"](
        index=0, layer_indices=[1], config=config, num_key_value_heads=HKV, cache_dtype=torch.float32, page_size=32,
        allow_block_sharing=True,
    )
    assert type(other) is design.FullAttentionCacheAllocator


@pytest.mark.skipif(not compat.CB_ALLOCATORS, reason="the allocators of transformers 5.18 and later")
def test_decode_table_rows_follow_the_blocks():
    """On the decode fast path every request's row of the block table is written at every step,
    once per allocator. Under paged|m3_sparse each allocator keeps a request's row and copies it
    until the request's blocks change; the rows always equal what transformers' own allocator
    writes: after new blocks, after a block is swapped in place (prefix caching swaps a complete
    block for an identical cached one), and for a request freed and added again."""
    cache = manager_cache(32)
    allocators = list(cache.cache_allocators.values())
    width = 8

    def rows(rid, own=False):
        table = torch.full((len(allocators), width), -1, dtype=torch.int32)
        if own:  # transformers' allocator in the place of m3_sparse's
            for a in allocators:
                serving.cache_design.FullAttentionCacheAllocator.fill_block_table(a, rid, 0, 1, table[a.index])
        else:
            cache.fill_block_table(rid, 0, 1, table)
        return table

    def kept(rid):
        return [vars(a)["_kept_rows"].get(rid) for a in allocators]

    give_room(cache, "a", 0, 40)
    give_room(cache, "b", 0, 32)
    give_room(cache, "a", 40, 40)  # a's third page comes after b's: not contiguous
    first = rows("a")
    assert torch.equal(first, rows("a", own=True)) and (first[:, :3] >= 0).all() and (first[:, 3:] == -1).all()
    entries = [k[1] for k in kept("a")]
    assert torch.equal(rows("a"), first) and all(k[1] is e for k, e in zip(kept("a"), entries))  # copied, not made
    give_room(cache, "a", 80, 20)  # a fourth page
    assert torch.equal(rows("a"), rows("a", own=True)) and (rows("a")[:, 3] >= 0).all()
    for a in allocators:  # a complete block swapped in place for another (b's first)
        a.block_table["a"][1] = a.block_table["b"][0]
    assert torch.equal(rows("a"), rows("a", own=True)) and torch.equal(rows("a")[:, 1], rows("b")[:, 0])
    cache.free_blocks("a")
    assert kept("a") == [None] * len(allocators) and kept("b") != [None] * len(allocators)
    give_room(cache, "b", 32, 32)
    give_room(cache, "a", 0, 20)  # the same id again, on other blocks
    assert torch.equal(rows("a"), rows("a", own=True)) and (rows("a")[:, 1:] == -1).all()
    # Rows whose tables went some other way than free_blocks are swept once they pile up.
    sparse = cache.cache_allocators[serving.SPARSE_LAYER_TYPE]
    stale = vars(sparse)["_kept_rows"]
    for i in range(2 * len(sparse.block_table) + serving.cache_design.KEPT_ROWS_SLACK):
        stale[f"gone{i}"] = ([], torch.zeros(0, dtype=torch.int32))
    give_room(cache, "a", 20, 32)  # a's second page: its row is made again, and the sweep runs
    assert torch.equal(rows("a"), rows("a", own=True))
    assert set(stale) == {"a", "b"}


def test_a_request_cancelled_in_flight_keeps_the_manager_alive():
    """Under async batching (the default with CUDA graphs) the manager prepares step N + 1, which
    frees the tables of requests cancelled by their clients, while step N runs; step N's update
    then marks the blocks its requests completed, a cancelled one's too (its status is still
    decoding). transformers' own code raises KeyError there, which stops the server; under
    m3_sparse the cancelled request is skipped, and the others' blocks are marked as before
    (5.17: the cache's ``mark_shareable_blocks_as_complete``; 5.18: each allocator's
    ``mark_complete_blocks``, which hashes them)."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    cache = manager_cache(32)
    tokens = [int(t) for t in torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(3))]
    states = {}
    for rid in ("cancelled", "kept"):
        give_room(cache, rid, 0, 64)
        states[rid] = RequestState(request_id=rid, initial_tokens=tokens)
        states[rid].status = RequestStatus.DECODING
    design = serving.cache_design
    if compat.CB_ALLOCATORS:
        completed = {name: 2 for name in cache.cache_allocators}

        def mark(state):
            cache.mark_complete_blocks(state, completed)

        def own_mark(state):  # transformers' allocator in the place of m3_sparse's
            for allocator in cache.cache_allocators.values():
                design.FullAttentionCacheAllocator.mark_complete_blocks(allocator, state.request_id, tokens, 2)

        def marked():
            return [dict(a.ledger.block_to_hash) for a in cache.cache_allocators.values()]
    else:
        def mark(state):
            cache.mark_shareable_blocks_as_complete(state, 2)

        def own_mark(state):
            design._mark_complete.m3_sparse_original(cache, state, 2)

        def marked():
            return [sorted(b.id for b in cache._block_manager._id_to_block.values() if b.is_complete)]

    cache.free_blocks("cancelled")  # what clearing the cancelled requests does, before step N's update
    before = marked()
    mark(states["cancelled"])
    assert marked() == before
    with pytest.raises(KeyError):
        own_mark(states["cancelled"])
    mark(states["kept"])
    assert marked() != before  # the kept request's two complete blocks


@pytest.mark.parametrize("tokens_per_page", [32, 48], ids=["pages32", "pages48"])
@pytest.mark.parametrize("path", ["varlen", "decode", "decode-padded"])
def test_kernel_view_matches_cache_reads(tokens_per_page, path):
    """Through the step's page tables and each layer group's pools, the kernels read exactly
    what transformers' cache holds for every request (at its read index): K, V and the index
    keys of every layer. The new tokens write to the slots of the write index (the decode fast
    path passes none: they come from the block tables), padding tokens to the write trash. A
    page of 48 tokens is three kernel pages of 16; a request's blocks need not be contiguous."""
    size = tokens_per_page
    cache = manager_cache(size)
    for rid, held, blocks in (("a", 0, 2), ("b", 0, 1), ("a", 2, 1), ("c", 0, 2)):
        give_room(cache, rid, held * size, blocks * size)
    if path == "varlen":
        requests = [("a", 2 * size + 6, 9), ("b", 0, 20), ("c", size + 8, 1)]
    else:
        requests = [("a", 2 * size + 14, 1), ("b", 5, 1), ("c", size + 8, 1)]
    padding = dict(pad_to=8, fake=2) if path == "decode-padded" else {}
    kwargs, history, write = step_keywords(cache, requests, decode=path != "varlen", **padding)
    real = sum(n for *_, n in requests)
    tokens = max(real, padding.get("pad_to", 0))
    step = serving.build_step(cache, kwargs, tokens)
    assert step.page_size == (32 if size == 32 else 16)
    fake = padding.get("fake", 0)
    assert step.kv_lens.tolist() == [p + n for _, p, n in requests] + [0] * (fake + 1)
    assert step.cu_seqlens_q[-1] == tokens and step.max_seqlen_q == max(n for *_, n in requests)
    pools = pools_of(cache)
    for g, group in enumerate(pools.groups):
        assert step.groups[g].slots.tolist() == write[g] + [group.write_trash_index] * (tokens - real)
    fill_random(cache)
    for layer in range(len(LAYERS)):
        start = 0
        for r, (_, past, new) in enumerate(requests):
            slots = torch.tensor(history[pools.group_of(layer)][start: start + past + new])
            start += past + new
            for got, want in zip(kernel_reads(step, cache, layer, r, past + new), slot_reads(cache, layer, slots)):
                assert (got is None) == (want is None)
                assert got is None or torch.equal(got, want)


@pytest.mark.parametrize("path", ["varlen", "decode-padded"])
def test_page_tables_built_in_slices(path, monkeypatch):
    """A step's page tables are built a slice of rows at a time (``TABLE_BUILD_ENTRIES``), so
    that a step as wide as the pool (the manager's warm-up) keeps its temporaries bounded: one
    row per slice gives exactly the tables of one slice for all, the trailing row zeros, and a
    group whose index keys sit beside K/V (5.17) one table for both."""
    size = 32
    cache = manager_cache(size)
    for rid, held, blocks in (("a", 0, 2), ("b", 0, 1), ("a", 2, 1), ("c", 0, 2)):
        give_room(cache, rid, held * size, blocks * size)
    if path == "varlen":
        requests, padding = [("a", 2 * size + 6, 9), ("b", 0, 20), ("c", size + 8, 1)], {}
    else:
        requests, padding = [("a", 2 * size + 14, 1), ("b", 5, 1), ("c", size + 8, 1)], dict(pad_to=8, fake=2)
    kwargs, _, _ = step_keywords(cache, requests, decode=path != "varlen", **padding)
    tokens = max(sum(n for *_, n in requests), padding.get("pad_to", 0))
    whole = serving.build_step(cache, kwargs, tokens)
    layout = sys.modules[serving.__name__.rpartition(".")[0] + ".serving_layout"]
    monkeypatch.setattr(layout, "TABLE_BUILD_ENTRIES", 1)
    sliced = serving.build_step(cache, kwargs, tokens)
    for g, step in whole.groups.items():
        for name in ("kv_tables", "index_tables"):
            want, got = getattr(step, name), getattr(sliced.groups[g], name)
            assert (want is None) == (got is None)
            if want is not None:
                assert want.dtype == torch.int32 and want.shape[0] == len(requests) + padding.get("fake", 0) + 1
                assert torch.equal(got, want) and not want[-1].any()
        if not compat.CB_ALLOCATORS:
            assert sliced.groups[g].index_tables is sliced.groups[g].kv_tables


def test_padding_tokens_leave_real_rows_alone():
    """A padded varlen step (CUDA graphs): the padding tokens belong to the trailing
    sequence with no key, and the real rows' selection and attention do not change."""
    cache = manager_cache()
    give_room(cache, "a", 0, 3 * 32)
    give_room(cache, "b", 0, 32)
    requests = [("a", 60, 7), ("b", 0, 12)]
    fill_random(cache, seed=5)
    pools = pools_of(cache)
    group = pools.groups[pools.group_of(0)]  # a sparse layer
    pool_k, pool_v = group.kv_pools(0)
    pool_i = group.index_pool(0, INDEX_DIM)
    kernel = m3_hf_attention.load_kernel()
    outs = []
    for pad_to in (19, 32):
        kwargs, _, _ = step_keywords(cache, requests, decode=False, pad_to=pad_to)
        step = serving.build_step(cache, kwargs, pad_to)
        tables = step.groups[pools.group_of(0)]
        q = torch.randn(pad_to, 8, HEAD_DIM, generator=torch.Generator().manual_seed(6))
        iq = torch.randn(pad_to, 2, INDEX_DIM, generator=torch.Generator().manual_seed(7))
        lengths = dict(cu_seqlens_q=step.cu_seqlens_q, used_kv_lens=step.kv_lens, max_seqlen_q=step.max_seqlen_q)
        sel = kernel.index_topk(iq, pool_i, tables.index_tables, topk=TOPK, block_size=BLOCK, **lengths)
        out, _ = kernel.sparse_attention(q, pool_k, pool_v, sel, tables.kv_tables, block_size=BLOCK, **lengths)
        assert bool((sel[19:] == -1).all()) and bool((out[19:] == 0).all())
        outs.append((sel[:19], out[:19]))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------
# the index keys a served request leaves in the pool
# ---------------------------------------------------------------------------------------
SPARSE_LAYERS = [i for i, kind in enumerate(LAYERS) if kind == serving.SPARSE_LAYER_TYPE]
# A key read back from the pool against the key a plain forward of the request computes: equal
# in the first layer; later, the layers before ran other kernels on other step shapes, so the
# two differ by rounding (up to 2e-6 here), while another token's key differs by about 1.
KEY_ATOL = 1e-4


def pooled_index_keys(cache, rid: str, length: int) -> dict:
    """What the kernels read as request ``rid``'s index keys, token by token, at the slots the
    cache's own bookkeeping gives its first ``length`` tokens: by sparse layer, (keys
    ``[length, Di]``, and per token a description of where they were read)."""
    pools = pools_of(cache)
    read = token_slots(cache, rid, length)
    held = {}
    for layer in SPARSE_LAYERS:
        g = pools.group_of(layer)
        group, slots = pools.groups[g], torch.tensor(read[g])
        offset = slots % pools.page_size
        _, pages = group.page_tables(slots - offset)
        keys = group.index_pool(layer, INDEX_DIM)[pages.long(), offset].clone()
        size = group.tokens_per_page
        where = [
            f"slot {s} (cache page {s // size} slot {s % size}, kernel page {p} slot {o})"
            for s, p, o in zip(slots.tolist(), pages.tolist(), offset.tolist())
        ]
        held[layer] = (keys, where)
    return held


def computed_index_keys(model, tokens: list[int]) -> dict:
    """The index keys ``[len(tokens), Di]`` of every sparse layer, as a plain forward of
    ``tokens`` alone (no cache) computes them: the indexer's ``index_prep`` output."""
    attention = sys.modules[serving.__package__ + ".attention"]
    prep, current, keys = attention.api.index_prep, [None], {}

    def spy(*args, **kwargs):
        q, k = prep(*args, **kwargs)
        keys[current[0]] = k[0].clone()
        return q, k

    hooks = [
        model.model.layers[i].self_attn.indexer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        for i in SPARSE_LAYERS
    ]
    attention.api.index_prep = spy
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]), use_cache=False)
    finally:
        attention.api.index_prep = prep
        for h in hooks:
            h.remove()
    return keys


def test_served_index_keys_sit_at_their_tokens_slots(model, monkeypatch, steps):
    """After serving requests of different lengths (several pages each, prompts prefilled in
    chunks beside other requests' decode rows, then decode steps of the fast path), each
    request's pages hold, at the slot of each of its tokens and in every sparse layer, that
    token's index key. Read as each request finishes, before its blocks are freed (and maybe
    handed to another request)."""
    batch = prompts([5, 29, 70, 131], seed=9)
    new_tokens = 6
    held = {}
    finish = Scheduler.finish_request

    def finish_request(self, request_id):
        state = self.active_requests.get(request_id)
        if state is not None:
            held[request_id] = (state.position_offset, pooled_index_keys(self.cache, request_id, state.position_offset))
        finish(self, request_id)

    monkeypatch.setattr(Scheduler, "finish_request", finish_request)
    out = model.generate_batch(
        batch, generation_config=gen_config(new_tokens), continuous_batching_config=cb_config(), warmup=False
    )
    assert [r.error for r in out.values()] == [None] * len(batch) and sorted(held) == sorted(out)
    # What the run covered: a prefill chunk after a history, steps mixing prefill with decode
    # rows, decode steps through the block tables.
    assert any(q > 1 and kv > q for qs, kvs, _ in steps for q, kv in zip(qs, kvs))
    assert any(1 in qs and max(qs) > 1 for qs, _, _ in steps) and any(fast for *_, fast in steps)
    for rid, result in out.items():
        length, by_layer = held[rid]
        # Every token but the last generated one went through the model, into the pool.
        tokens = result.prompt_ids + result.generated_tokens[:-1]
        assert length == len(tokens) == len(result.prompt_ids) + new_tokens - 1
        want = computed_index_keys(model, tokens)
        for layer, (got, where) in by_layer.items():
            off = (got[:, None] - want[layer][None]).abs().amax(-1)  # [held token, computed token]
            wrong = torch.nonzero(off.diagonal() > KEY_ATOL).flatten().tolist()
            if wrong:
                t = wrong[0]
                nearest = int(off[t].argmin())
                raise AssertionError(
                    f"request {rid} ({len(result.prompt_ids)}-token prompt), layer {layer}, token {t}: {where[t]} "
                    f"holds a key {float(off[t, t]):.3g} off token {t}'s; nearest: token {nearest}'s "
                    f"({float(off[t, nearest]):.3g} off). {len(wrong)} of {length} tokens wrong, first {wrong[:8]}"
                )


# ---------------------------------------------------------------------------------------
# GPU: the Triton kernels inside the manager's CUDA graphs
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_graphs_equal_generate(tmp_path):
    # Block 16: the Triton index and KV-outer kernels take it. The stock experts loop reads
    # which experts were hit on the host; batched_mm does not (graph capture).
    save_tiny_text_model(tmp_path, seed=11, index_block_size=16, index_topk_blocks=3)
    gpu = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="m3_sparse", dtype=torch.float32, experts_implementation="batched_mm"
    ).cuda().eval()
    batch = prompts([5, 40, 100, 150], seed=8)
    expected = [reference(gpu, p) for p in batch]
    cfg = ContinuousBatchingConfig(num_blocks=64, block_size=CB_BLOCK, max_batch_tokens=CHUNK, use_cuda_graph=True)
    out = gpu.generate_batch(batch, generation_config=gen_config(), continuous_batching_config=cfg, warmup=True)
    results = list(out.values())
    assert [r.error for r in results] == [None] * len(batch)
    assert [r.generated_tokens for r in results] == expected
