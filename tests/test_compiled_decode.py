"""generate()'s compiled decode on M3PagedCache, on the CPU: the decode step traces as one
graph (``fullgraph=True``, no recompilation from one step to the next) and gives the
tokens of the eager step; the host's slot count comes back after compiled steps; and
capacity is refused before anything is written.

The compile backend here is dynamo's "eager" one: it checks exactly what the CUDA graph
needs from this package (one graph, no guard on a value that changes per step) without a
C++ toolchain. tests/test_cuda_graph.py runs the real thing (inductor, CUDA graphs) on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import AutoModelForCausalLM, CompileConfig

from m3_hf_attention import M3PagedCache
from model_utils import PAD, greedy, random_prompt, save_tiny_text_model

BATCH, PROMPT, STEPS, PAGE = 2, 60, 8, 16
FP8 = getattr(torch, "float8_e4m3fn", None)
CACHES = {
    "model_dtype": {},
    "fp8_index": dict(index_key_dtype=FP8),
    "fp8_index_and_kv": dict(index_key_dtype=FP8, kv_cache_dtype=FP8, k_scale=0.02, v_scale=0.03),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-compile")
    save_tiny_text_model(path, seed=5)
    # transformers' default experts loop reads on the host which experts a token hit (a graph
    # break); batched_mm is what generate() switches to for decoding on a GPU.
    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="m3_sparse", experts_implementation="batched_mm"
    ).eval()


def _left_padded(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([random_prompt(PROMPT, g) for _ in range(BATCH)])
    mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
    ids[1, :7], mask[1, :7] = PAD, 0
    feed = torch.stack([random_prompt(BATCH, g) for _ in range(STEPS)])[..., None]  # [STEPS, B, 1]
    return ids, mask, feed


def _decode(model, cache_kwargs, compiled: bool):
    """Prefill eagerly, then STEPS decode steps fed the same tokens: [STEPS, B, vocab] logits."""
    ids, mask, feed = _left_padded(0)
    cache = M3PagedCache(model.config, BATCH, PROMPT + STEPS, page_size=PAGE, **cache_kwargs)

    def step(token, pos, new_mask):
        return model(
            input_ids=token, position_ids=pos, attention_mask=new_mask, past_key_values=cache, use_cache=True
        ).logits[:, -1]

    run = torch.compile(step, fullgraph=True, backend="eager") if compiled else step
    out = []
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        pos = mask.sum(-1, keepdim=True)
        # The mask generate() hands a compiled step: the new token's column only.
        new_mask = torch.ones(BATCH, 1, dtype=torch.long)
        for i in range(STEPS):
            out.append(run(feed[i], pos + i, new_mask).clone())
    return torch.stack(out), cache


@pytest.mark.parametrize("kind", list(CACHES))
def test_decode_step_is_one_graph_with_the_eager_result(model, kind):
    if FP8 is None and kind != "model_dtype":
        pytest.skip("no float8 in this torch")
    eager, eager_cache = _decode(model, CACHES[kind], compiled=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled, cache = _decode(model, CACHES[kind], compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    # Compiled steps advance the device count only; the host copy is read back on use.
    assert cache._host_slots is None
    assert cache.get_seq_length() == PROMPT + STEPS == eager_cache.get_seq_length()
    assert torch.equal(cache.sequence_lengths(), eager_cache.sequence_lengths())
    assert cache.sequence_lengths().tolist() == [PROMPT + STEPS, PROMPT - 7 + STEPS]


@pytest.mark.parametrize("padded", [True, False], ids=["left_padded", "no_padding"])
def test_generate_compiles_the_decode_step(model, padded):
    ids, mask, _ = _left_padded(1)
    if not padded:
        # From transformers 5.18 generate() drops an all-ones mask: the step gets none.
        ids, mask = ids[:1], torch.ones_like(mask[:1])
    eager = greedy(model, ids, mask, new_tokens=10, disable_compile=True)
    config = CompileConfig(backend="eager", fullgraph=True)
    config._compile_all_devices = True  # generate() compiles on accelerators only by default
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = greedy(model, ids, mask, new_tokens=10, compile_config=config)
    assert hasattr(model, "_compiled_call"), "generate() did not compile the decode step"
    assert torch.equal(compiled, eager)


def _state(cache):
    tensors = []
    for layer in cache.layers:
        tensors += [t for t in (layer.keys, layer.values, layer.index_keys, layer.index_scales) if t is not None]
        tensors += [layer.seq_lens, layer.step_kv_lens, layer.pending, layer.slots]
    return [t.clone() for t in tensors]


def test_generate_refuses_before_writing_when_the_cache_is_too_small(model):
    ids, mask, _ = _left_padded(2)
    cache = M3PagedCache(model.config, BATCH, PROMPT + 4, page_size=PAGE)
    with torch.no_grad():  # allocate the pools, with a prompt that fits
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    cache.reset()
    before = _state(cache)
    with pytest.raises(ValueError, match=rf"needs up to {PROMPT + 5} tokens .* max_cache_len={PROMPT + 4}; nothing"):
        greedy(model, ids, mask, new_tokens=6, past_key_values=cache)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(cache)))
    assert cache.get_seq_length() == 0
    # The same cache then serves a request that fits, with the tokens of a fresh cache.
    got = greedy(model, ids, mask, new_tokens=5, past_key_values=cache, disable_compile=True)
    want = greedy(model, ids, mask, new_tokens=5, disable_compile=True)
    assert torch.equal(got, want)


def test_compiled_step_past_the_table_writes_no_page_of_a_sequence(model):
    """A compiled step is not checked on the host. Fed past the end of its block table, a
    row writes to the scratch page: its own pages (and every other) stay as they were."""
    ids, mask, feed = _left_padded(3)
    capacity = 4 * PAGE  # the table ends exactly at max_cache_len
    cache = M3PagedCache(model.config, BATCH, capacity, page_size=PAGE)

    def step(token, pos):
        return model(input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True).logits

    run = torch.compile(step, fullgraph=True, backend="eager")
    pos = mask.sum(-1, keepdim=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for i in range(capacity - PROMPT):  # row 0 fills its table
            run(feed[i], pos + i)
        pages = cache.block_tables[0].long()
        before = [(layer.keys[pages].clone(), layer.values[pages].clone()) for layer in cache.layers]
        run(feed[0], pos + capacity - PROMPT)  # row 0 one past its table
    for layer, (k, v) in zip(cache.layers, before):
        assert torch.equal(layer.keys[pages], k) and torch.equal(layer.values[pages], v)
    # The eager path refuses such a step outright.
    with pytest.raises(ValueError, match="overflow"):
        with torch.no_grad():
            step(feed[1], pos + capacity - PROMPT + 1)
