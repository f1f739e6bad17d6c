"""``paged|m3_sparse`` under transformers' continuous batching (``generate_batch``,
``init_continuous_batching``) on the CPU: every request's greedy tokens equal its own
``generate()`` with ``m3_sparse`` (fp32), whatever else shares its steps: prompts of
different lengths, prompts cut into several prefill chunks, requests joining mid-run,
requests waiting for pages. The step layout built from transformers' keywords is checked
against its own cache bookkeeping, padded steps included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

import m3_hf_attention
from model_utils import BLOCK, PAD, TOPK, random_prompt, randomize_norms, save_tiny_text_model, text_config, vl_config

serving = m3_hf_attention.integration.serving
ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "m3-hf-attention/m3-sparse"
NEW_TOKENS = 10
CB_BLOCK = 16  # tokens per block of the manager's cache: pages of 16 for the kernels
CHUNK = 64  # max_batch_tokens: longer prompts are prefilled in several steps


def gen_config(new_tokens: int = NEW_TOKENS) -> GenerationConfig:
    # No EOS: every request runs its full length in both paths.
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=PAD)


def cb_config(num_blocks: int = 64) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(num_blocks=num_blocks, block_size=CB_BLOCK, max_batch_tokens=CHUNK)


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
    paged = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="paged|m3_sparse").eval()
    batch = prompts([33, 90], seed=1)
    assert run_batch(paged, batch) == [reference(model, p) for p in batch]
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
        results = {}
        while len(results) < 3:
            out = manager.get_result(timeout=60)
            assert out is not None, "no result within 60 s"
            if out.is_finished():
                results[out.request_id] = out
    finally:
        manager.stop(block=True, timeout=30)
    assert [results[k].error for k in results] == [None] * 3
    assert results["first"].generated_tokens == reference(model, first, 24)
    for i, p in enumerate(later):
        assert results[f"later{i}"].generated_tokens == reference(model, p)
    # The later requests were prefilled beside the first one's decode rows.
    assert any(1 in qs and max(qs) > 1 and len(qs) > 1 for qs, _, _ in steps)


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


def test_requests_wait_for_pages(model, steps):
    # 10 blocks of 16 = 160 token slots: each request fits alone (<= 81 tokens), not all three at once.
    batch = prompts([70, 70, 45], seed=3)
    assert run_batch(model, batch, num_blocks=10) == [reference(model, p) for p in batch]
    held = [sum(kvs) for _, kvs, _ in steps]
    # The pool ran full (within a block) and never over; the three need 218 slots at once.
    assert 160 - CB_BLOCK < max(held) <= 160 < sum(len(p) + NEW_TOKENS + 1 for p in batch)


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
    env = dict(os.environ, LOCAL_KERNELS=f"{REPO_ID}={ROOT}", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "hub_string_serve.py"), str(checkpoint), impl],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["attn_implementation"] == impl and not got["imported_m3_hf_attention"]
    assert got["served_attention"].endswith("hf.serving.paged_m3_sparse_attention")
    assert got["served_mask"].endswith("hf.serving.no_mask")
    assert got["errors"] == [None, None]
    assert got["generated"] == [reference(model, p, 8) for p in got["prompts"]]


# ---------------------------------------------------------------------------------------
# the step layout against transformers' own bookkeeping
# ---------------------------------------------------------------------------------------
def manager_cache(num_blocks=12, block_size=32) -> PagedAttentionCache:
    config = text_config()
    config._attn_implementation = serving.CB_IMPLEMENTATION
    cfg = ContinuousBatchingConfig(num_blocks=num_blocks, block_size=block_size, max_batch_tokens=64)
    return PagedAttentionCache(
        config, cfg, torch.device("cpu"), DistributedHelper(None, None), {}, dtype=torch.float32
    )


def step_keywords(cache, requests, *, decode: bool, pad_to: int = 0, fake: int = 0) -> dict:
    """The keywords ContinuousBatchingIOs builds for ``requests`` [(id, past, new)]: the
    varlen form (write / read indices) or the decode fast path (block table); ``pad_to``
    query tokens and ``fake`` empty requests as with CUDA graphs."""
    cu_q, cu_k, write, read = [0], [0], [[]], [[]]
    table = torch.full((1, len(requests) + fake, 8), -1, dtype=torch.int32)
    for i, (rid, past, new) in enumerate(requests):
        cu_q.append(cu_q[-1] + new)
        cu_k.append(cu_k[-1] + past + new)
        cache.extend_read_and_write_indices(rid, past, new, read, write)
        cache.fill_block_table(rid, past, new, table[:, i])
    tokens = max(pad_to, cu_q[-1])
    write[0] += [cache.write_trash_index] * (tokens - cu_q[-1])
    cu_q += [cu_q[-1]] * fake
    cu_k += [cu_k[-1]] * fake
    as_int = lambda v, dtype=torch.int32: torch.tensor(v, dtype=dtype)  # noqa: E731
    kwargs = dict(
        cu_seq_lens_q=as_int(cu_q), cu_seq_lens_k=as_int(cu_k), max_seqlen_q=max(n for *_, n in requests),
        max_seqlen_k=max(p + n for _, p, n in requests), cache=cache,
    )
    if decode:
        return dict(kwargs, block_table=table, write_index=[as_int([], torch.int64)], read_index=[as_int([], torch.int64)])
    return dict(kwargs, block_table=None, write_index=[as_int(write[0], torch.int64)], read_index=[as_int(read[0], torch.int64)])


def history_slots(step, req, length):
    """The cache slots of request ``req``'s first ``length`` tokens, read through its page table."""
    pos = torch.arange(length)
    return step.block_tables[req, pos // step.page_size].long() * step.page_size + pos % step.page_size


def test_config_keeps_the_decode_fast_path():
    """paged|m3_sparse resolves like flash attention: the decode fast path stays on (the
    block table is what build_step reads) and no mask is needed (CUDA graphs by default on
    CUDA); explicit settings stay as given; other implementations resolve as before."""
    resolve = continuous_api.resolve_continuous_batching_config
    config = text_config()
    config._attn_implementation = serving.CB_IMPLEMENTATION
    resolved = resolve(config, ContinuousBatchingConfig(block_size=32), None, False)
    # Wide enough for the longest request the model takes.
    assert resolved.max_blocks_per_request * 32 >= config.max_position_embeddings
    assert resolved.use_cuda_graph == (torch.cuda.is_available(),) * 2
    explicit = resolve(config, ContinuousBatchingConfig(max_blocks_per_request=0, use_cuda_graph=False), None, False)
    assert explicit.max_blocks_per_request == 0 and explicit.use_cuda_graph == (False, False)
    config._attn_implementation = "paged|sdpa"
    assert resolve(config, ContinuousBatchingConfig(block_size=32), None, False).max_blocks_per_request == 0


def test_pool_sizing_counts_index_keys():
    """The manager's memory estimate of the pool, per token slot, grows by at least the
    sparse layers' index keys (2 sparse layers x 16 fp32 values here)."""
    config = text_config()
    cfg = ContinuousBatchingConfig(block_size=32, max_memory_percent=0.5)
    footprint = {}
    for impl in ("paged|sdpa", serving.CB_IMPLEMENTATION):
        config._attn_implementation = impl
        handler = cb_cache.PagedAttentionMemoryHandler(config, cfg, torch.float32, ["full_attention"], 3)
        footprint[impl] = handler.compute_memory_footprint(256, 100) - handler.compute_memory_footprint(256, 0)
    per_slot = (footprint[serving.CB_IMPLEMENTATION] - footprint["paged|sdpa"]) / (100 * 32)
    assert 2 * 16 * 4 <= per_slot <= 2 * (2 * 16 * 4)


def test_step_layout_matches_cache_indices():
    cache = manager_cache()
    # Block 0 and 1 to "a", 2 to "b", 3 to "a": a request's blocks need not be contiguous.
    for rid, n in (("a", 2), ("b", 1), ("a", 1), ("c", 2)):
        assert cache.allocate_blocks(n, rid, 0) is not None
    requests = [("a", 70, 9), ("b", 0, 20), ("c", 40, 1)]
    kwargs = step_keywords(cache, requests, decode=False)
    step = serving.build_step(cache, kwargs, kwargs["write_index"][0].numel())
    assert step.page_size == 32
    read, write = [], []
    for rid, past, new in requests:
        cache.extend_read_and_write_indices(rid, past, new, [read], [write])
    assert step.slots.tolist() == write
    offsets = [0, 79, 99]
    for r, (_, past, new) in enumerate(requests):
        assert history_slots(step, r, past + new).tolist() == read[offsets[r]: offsets[r] + past + new]
    assert step.kv_lens.tolist() == [79, 20, 41, 0]
    assert step.cu_seqlens_q.tolist() == [0, 9, 29, 30, 30]


@pytest.mark.parametrize("pad", [False, True])
def test_decode_fast_path_layout_matches_varlen(pad):
    cache = manager_cache()
    for rid, n in (("a", 3), ("b", 1), ("c", 2)):
        assert cache.allocate_blocks(n, rid, 0) is not None
    requests = [("a", 70, 1), ("b", 5, 1), ("c", 40, 1)]
    varlen = step_keywords(cache, requests, decode=False)
    padded = dict(pad_to=8, fake=2) if pad else {}
    decode = step_keywords(cache, requests, decode=True, **padded)
    tokens = 8 if pad else 3
    a = serving.build_step(cache, varlen, 3)
    b = serving.build_step(cache, decode, tokens)
    assert b.slots[:3].tolist() == a.slots.tolist()
    assert b.slots[3:].tolist() == [cache.write_trash_index] * (tokens - 3)
    for r, (_, past, new) in enumerate(requests):
        assert history_slots(b, r, past + new).tolist() == history_slots(a, r, past + new).tolist()
    assert b.kv_lens.tolist() == [71, 6, 41] + [0] * (2 if pad else 0) + [0]
    assert b.cu_seqlens_q[-1] == tokens


def test_padding_tokens_leave_real_rows_alone():
    """A padded varlen step (CUDA graphs): the padding tokens belong to the trailing
    sequence with no key, and the real rows' selection and attention do not change."""
    cache = manager_cache()
    for rid, n in (("a", 3), ("b", 1)):
        assert cache.allocate_blocks(n, rid, 0) is not None
    requests = [("a", 60, 7), ("b", 0, 12)]
    g = torch.Generator().manual_seed(5)
    pool_k = torch.randn(cache.key_cache[0].shape[0] // 32, 2, 32, 16, generator=g)
    pool_v, pool_i = torch.randn(pool_k.shape, generator=g), torch.randn(pool_k.shape[0], 32, 16, generator=g)
    outs = []
    for pad_to in (19, 32):
        kwargs = step_keywords(cache, requests, decode=False, pad_to=pad_to)
        step = serving.build_step(cache, kwargs, pad_to)
        q = torch.randn(pad_to, 8, 16, generator=torch.Generator().manual_seed(6))
        iq = torch.randn(pad_to, 2, 16, generator=torch.Generator().manual_seed(7))
        layout = dict(block_tables=step.block_tables, cu_seqlens_q=step.cu_seqlens_q, used_kv_lens=step.kv_lens)
        sel = m3_hf_attention.load_kernel().index_topk(
            iq, pool_i, topk=TOPK, block_size=BLOCK, max_seqlen_q=step.max_seqlen_q, **layout
        )
        out, _ = m3_hf_attention.load_kernel().sparse_attention(
            q, pool_k, pool_v, sel, block_size=BLOCK, max_seqlen_q=step.max_seqlen_q, **layout
        )
        assert bool((sel[19:] == -1).all()) and bool((out[19:] == 0).all())
        outs.append((sel[:19], out[:19]))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=0, rtol=0)


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
