"""A decode step of an M3 model on the paged cache: no host synchronization inside it,
and captured once in a CUDA graph it replays step after step with the results of eager
steps (the cache's lengths advance on the device, in fixed buffers); generate() compiles
it by default (inductor, CUDA graphs) and gives the eager tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, CompileConfig

from m3_hf_attention import M3PagedCache
from model_utils import PAD, VOCAB, greedy, random_prompt, save_tiny_text_model

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


CACHES = {
    "bf16_index": {},
    "fp8_index": dict(index_key_dtype=torch.float8_e4m3fn),
    "fp8_index_and_kv": dict(
        index_key_dtype=torch.float8_e4m3fn, kv_cache_dtype=torch.float8_e4m3fn, k_scale=0.02, v_scale=0.03
    ),
}


def _left_padded_prompt(seed):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.stack([random_prompt(PROMPT, g) for _ in range(BATCH)])
    mask = torch.ones_like(prompt)
    for row, pads in enumerate((0, 9, 30)[:BATCH]):
        prompt[row, :pads], mask[row, :pads] = PAD, 0
    return prompt.cuda(), mask.cuda()


@pytest.mark.parametrize("kind", list(CACHES))
@torch.no_grad()
def test_generate_compiles_decode_with_the_eager_tokens(model, kind):
    """generate()'s default on CUDA: the decode step compiled and replayed as a CUDA graph,
    120 steps of a left-padded batch, token for token the eager decode."""
    prompt, mask = _left_padded_prompt(5)
    steps = 120

    def run(**kwargs):
        cache = M3PagedCache(model.config, BATCH, PROMPT + steps, page_size=PAGE, device="cuda", **CACHES[kind])
        return greedy(model, prompt, mask, new_tokens=steps, past_key_values=cache, **kwargs)

    eager = run(disable_compile=True)
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    compiled = run()
    assert hasattr(model, "_compiled_call"), "generate() did not compile the decode step"
    assert torch.equal(compiled, eager)


@torch.no_grad()
def test_generate_chunked_prefill_with_the_one_pass_tokens(model):
    """generate(prefill_chunk_size=16) on CUDA, the decode compiled: the tokens of a one-pass
    prefill, for a left-padded batch whose most padded row (30 pads) starts with a chunk of
    padding only; later chunks run the sparse kernels over a history (fp32, so a difference
    is a fault, not a near tie)."""
    prompt, mask = _left_padded_prompt(7)
    steps = 30

    def run(**kwargs):
        cache = M3PagedCache(model.config, BATCH, PROMPT + steps, page_size=PAGE, device="cuda")
        return greedy(model, prompt, mask, new_tokens=steps, past_key_values=cache, **kwargs)

    assert torch.equal(run(prefill_chunk_size=16), run())


def _early_eos(new: torch.Tensor, stop_all: bool) -> tuple[list[int], int] | None:
    """EOS ids that end row 0 at its 5th new token (and, with ``stop_all``, every other row on
    a token of its own), and the width of the sequences generate() then returns; None when
    these tokens do not make that plan (a row that never stops, or with ``stop_all`` one
    that does not stop before the last step)."""
    ids = [int(new[0, 4])]
    if stop_all:
        ids += [int(new[row, 6 + row]) for row in range(1, new.shape[0])]
    ends = []
    for row in new.tolist():
        hits = [i for i, t in enumerate(row) if t in ids]
        ends.append(hits[0] + 1 if hits else None)
    if ends[0] != 5 or (None in ends) != (not stop_all) or (stop_all and max(ends) >= new.shape[1]):
        return None
    return ids, new.shape[1] if None in ends else max(ends)


@pytest.mark.parametrize("stop_all", [False, True], ids=["row0_stops", "all_stop"])
@torch.no_grad()
def test_compiled_generate_defers_its_stop_check(model, monkeypatch, stop_all):
    """generate()'s compiled decode on CUDA reads the stop flag one step late (transformers'
    DeferredStopCheck, on for the paged cache): the sequences and the cache's lengths of the
    loop that checks every step, with rows that stop early, the step run past the stop
    undone (M3PagedCache.crop)."""
    from transformers.generation import utils as generation

    steps = 20

    def run(eos):
        cache = M3PagedCache(model.config, BATCH, PROMPT + steps, page_size=PAGE, device="cuda")
        out = model.generate(input_ids=prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                             do_sample=False, pad_token_id=PAD, eos_token_id=eos, suppress_tokens=[PAD])
        return out, cache.sequence_lengths().tolist(), cache.slots_used

    for seed in range(8, 40):  # prompts until one whose tokens make the plan
        prompt, mask = _left_padded_prompt(seed)
        plan = _early_eos(run(None)[0][:, PROMPT:], stop_all)
        if plan is not None:
            break
    assert plan is not None, "no prompt made the planned early stops"
    eos, width = plan
    made = []
    real_init = generation.StopCheck.__init__

    def spy(self, *args, **kwargs):
        made.append(type(self).__name__)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(generation.StopCheck, "__init__", spy)
    deferred = run(eos)
    monkeypatch.setattr(generation, "DeferredStopCheck", generation.DeferredStopCheck.m3_sparse_base)
    checked = run(eos)
    assert made == ["DeferredStopCheck", "StopCheck"]
    assert torch.equal(deferred[0], checked[0]) and deferred[1:] == checked[1:]
    assert checked[0].shape[1] == PROMPT + width
    assert (checked[0][0, PROMPT + 5:] == PAD).all()  # row 0 stopped at its EOS


@torch.no_grad()
def test_compiled_decode_step_does_not_synchronize(model):
    prompt, mask = _left_padded_prompt(6)
    cache = M3PagedCache(model.config, BATCH, PROMPT + 16, page_size=PAGE, device="cuda")
    model(input_ids=prompt, attention_mask=mask, past_key_values=cache, use_cache=True)
    step = torch.compile(model.__call__, **CompileConfig().to_dict())  # what generate() compiles
    ids = torch.full((BATCH, 1), 5, dtype=torch.long, device="cuda")
    pos = mask.sum(-1, keepdim=True)
    new = torch.ones(BATCH, 1, dtype=torch.long, device="cuda")
    for i in range(3):  # compile, record the graph, first replay
        step(input_ids=ids, position_ids=pos + i, attention_mask=new, past_key_values=cache, use_cache=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3, 8):
            step(input_ids=ids, position_ids=pos + i, attention_mask=new, past_key_values=cache, use_cache=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.sequence_lengths().tolist() == (mask.sum(-1) + 8).tolist()


# At most this many kernel launches per sparse layer beyond the dense twin's layer in an eager
# decode step (the dense twin: the same model with every layer full attention on transformers'
# sdpa and StaticCache).
EXTRA_LAUNCHES_PER_SPARSE_LAYER = 20
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _decode_step_launches(model, cache, prompt) -> int:
    """Kernel launches of one eager decode step after the prompt (warm: a step before it)."""
    from torch.profiler import ProfilerActivity, profile

    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    pos = torch.full((prompt.shape[0], 1), prompt.shape[1], dtype=torch.long, device="cuda")
    model(input_ids=prompt[:, -1:], position_ids=pos, past_key_values=cache, use_cache=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(input_ids=prompt[:, -1:], position_ids=pos + 1, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name in _LAUNCHES)


@torch.no_grad()
def test_eager_decode_step_launches_few_kernels_per_sparse_layer(tmp_path):
    from transformers import StaticCache

    # The 12-layer pattern of the M3-shaped benchmark model (sssf x 3).
    layer_types = (["minimax_m3_sparse"] * 3 + ["full_attention"]) * 3
    n = len(layer_types)
    common = dict(index_block_size=16, index_topk_blocks=3, mlp_layer_types=["dense"] * n, num_hidden_layers=n)
    save_tiny_text_model(tmp_path / "sparse", seed=12, layer_types=layer_types, **common)
    save_tiny_text_model(tmp_path / "dense", seed=12, layer_types=["full_attention"] * n, **common)
    sparse = AutoModelForCausalLM.from_pretrained(tmp_path / "sparse", attn_implementation="m3_sparse", dtype=torch.bfloat16)
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", attn_implementation="sdpa", dtype=torch.bfloat16)
    sparse, dense = sparse.cuda().eval(), dense.cuda().eval()
    g = torch.Generator().manual_seed(12)
    prompt = torch.stack([random_prompt(PROMPT, g) for _ in range(BATCH)]).cuda()
    got = _decode_step_launches(sparse, M3PagedCache(sparse.config, BATCH, PROMPT + 4, device="cuda"), prompt)
    base = _decode_step_launches(dense, StaticCache(config=dense.config, max_cache_len=PROMPT + 4), prompt)
    extra = (got - base) / layer_types.count("minimax_m3_sparse")
    assert extra <= EXTRA_LAUNCHES_PER_SPARSE_LAYER, (
        f"{got} launches per eager decode step against the dense twin's {base}: {extra:.1f} per sparse layer"
    )
