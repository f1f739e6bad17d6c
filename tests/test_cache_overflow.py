"""An update that would overflow M3PagedCache loses nothing: it raises before any
write (K/V, index keys, lengths), and the cache then carries on as if the failed call
had never been made."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from m3_hf_attention import M3PagedCache
from model_utils import random_prompt, save_tiny_text_model

PROMPT, CAPACITY = 40, 48


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-overflow")
    save_tiny_text_model(path, seed=4)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse").eval()


def state(cache):
    out = []
    for layer in cache.layers:
        out += [layer.keys, layer.values, layer.seq_lens, layer.step_kv_lens]
        out += [t for t in (layer.index_keys, layer.index_scales, layer.pending) if t is not None]
    return [t.clone() for t in out] + [[layer.slots_used for layer in cache.layers]]


@pytest.mark.parametrize("index_key_dtype", [None, "fp8"], ids=["model_dtype_index", "fp8_index"])
@torch.no_grad()
def test_overflow_loses_nothing(model, index_key_dtype):
    index_key_dtype = torch.float8_e4m3fn if index_key_dtype == "fp8" else None
    g = torch.Generator().manual_seed(0)
    prompt = random_prompt(PROMPT, g)[None]
    more = random_prompt(CAPACITY - PROMPT, g)[None]

    def fresh():
        return M3PagedCache(model.config, 1, CAPACITY, page_size=16, index_key_dtype=index_key_dtype)

    cache = fresh()
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    before = state(cache)
    with pytest.raises(ValueError, match=f"max_cache_len={CAPACITY}; nothing was written"):
        model(input_ids=torch.cat([more, more[:, :1]], 1), past_key_values=cache, use_cache=True)
    after = state(cache)
    for i, (a, b) in enumerate(zip(before, after)):
        assert (a == b) if isinstance(a, list) else torch.equal(a, b), f"state item {i} changed"

    # The cache fills up to its capacity exactly, with the logits of a cache that never overflowed.
    got = model(input_ids=more, past_key_values=cache, use_cache=True).logits
    ref_cache = fresh()
    model(input_ids=prompt, past_key_values=ref_cache, use_cache=True)
    want = model(input_ids=more, past_key_values=ref_cache, use_cache=True).logits
    assert torch.equal(got, want)
    assert cache.sequence_lengths().tolist() == [CAPACITY]
