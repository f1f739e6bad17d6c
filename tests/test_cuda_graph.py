"""A decode step of an M3 model on the paged cache: no host synchronization inside it,
and captured once in a CUDA graph it replays step after step with the results of eager
steps (the cache's lengths advance on the device, in fixed buffers)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from m3_hf_attention import M3PagedCache
from model_utils import VOCAB, random_prompt, save_tiny_text_model

pytestmark = pytest.mark.gpu

BATCH, PROMPT, STEPS, PAGE = 3, 100, 12, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("graph_model")
    # Block 16: the Triton index and KV-outer kernels take it (block 8 would run torch).
    save_tiny_text_model(path, seed=11, index_block_size=16, index_topk_blocks=3)
    # The stock experts loop reads which experts were hit on the host; batched_mm does not.
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="m3_sparse", dtype=torch.float32, experts_implementation="batched_mm"
    )
    return model.cuda().eval()


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.stack([random_prompt(PROMPT, g) for _ in range(BATCH)]).cuda()
    feed = torch.randint(3, VOCAB - 2, (STEPS, BATCH, 1), generator=g).cuda()
    return prompt, feed


def _cache(model, index_key_dtype=None, **kv):
    return M3PagedCache(
        model.config, BATCH, PROMPT + STEPS + 4, page_size=PAGE, device="cuda", index_key_dtype=index_key_dtype, **kv
    )


def _step(model, cache, ids, pos):
    return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]


@pytest.mark.parametrize("fp8", [False, True, "kv"], ids=["bf16_index", "fp8_index", "fp8_index_and_kv"])
@torch.no_grad()
def test_decode_step_replays_in_a_cuda_graph(model, fp8):
    index_dtype = torch.float8_e4m3fn if fp8 else None
    kv = dict(kv_cache_dtype=torch.float8_e4m3fn, k_scale=0.02, v_scale=0.03) if fp8 == "kv" else {}
    prompt, feed = _inputs(3)
    pos = torch.empty(BATCH, 1, dtype=torch.long, device="cuda")

    eager = _cache(model, index_dtype, **kv)
    model(input_ids=prompt, past_key_values=eager, use_cache=True)
    ref = []
    for i in range(STEPS):
        pos.fill_(PROMPT + i)
        ref.append(_step(model, eager, feed[i], pos).clone())

    cache = _cache(model, index_dtype, **kv)
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    ids = feed[0].clone()
    pos.fill_(PROMPT)
    # Step 0 runs eagerly on a side stream (compiles the kernels, as capture requires).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = _step(model, cache, ids, pos).clone()
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(first, ref[0], rtol=0, atol=0)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = _step(model, cache, ids, pos)
    # Capture records without running: the device state is still after step 0.
    for i in range(1, STEPS):
        ids.copy_(feed[i])
        pos.fill_(PROMPT + i)
        graph.replay()
        torch.testing.assert_close(logits, ref[i], rtol=1e-6, atol=1e-6, msg=lambda m: f"step {i}: {m}")
    lengths = cache.sequence_lengths(0)
    assert lengths.tolist() == [PROMPT + STEPS] * BATCH


@torch.no_grad()
def test_decode_step_does_not_synchronize(model):
    prompt, feed = _inputs(4)
    cache = _cache(model)
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    pos = torch.full((BATCH, 1), PROMPT, dtype=torch.long, device="cuda")
    _step(model, cache, feed[0], pos)  # compile outside the check
    pos.fill_(PROMPT + 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(model, cache, feed[1], pos)
    finally:
        torch.cuda.set_sync_debug_mode("default")
