"""M3PagedCache says what is wrong when it is used with the wrong model or the wrong
input: a ValueError naming the mismatch, raised before anything is written."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from m3_hf_attention import M3PagedCache
from model_utils import PAD, greedy, random_prompt, save_tiny_text_model, text_config

PROMPT = 40


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-guards")
    save_tiny_text_model(path, seed=6)
    return path


@pytest.fixture(scope="module")
def model(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse").eval()


def _prompt(seed=0, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([random_prompt(PROMPT, g) for _ in range(batch)])


def test_a_cache_of_a_model_with_fewer_layers(model):
    other = text_config(num_hidden_layers=2, layer_types=["minimax_m3_sparse", "full_attention"],
                        mlp_layer_types=["dense", "dense"])
    cache = M3PagedCache(other, 1, 64)
    with pytest.raises(ValueError, match=r"built for a model with 2 layers; this model has 3"):
        with torch.no_grad():
            model(input_ids=_prompt(), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and not any(layer.is_initialized for layer in cache.layers)


def test_a_cache_whose_sparse_layers_differ(model):
    other = text_config(layer_types=["full_attention", "full_attention", "minimax_m3_sparse"])
    cache = M3PagedCache(other, 1, 64)
    with pytest.raises(ValueError, match=r"layer 0 was built as a full-attention layer, but this model's layer 0 is a sparse"):
        with torch.no_grad():
            model(input_ids=_prompt(), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and not any(layer.is_initialized for layer in cache.layers)


def test_a_model_on_another_attention_implementation(path, model):
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    cache = M3PagedCache(model.config, 1, 64)
    with pytest.raises(ValueError, match=r"only attn_implementation='m3_sparse' can read; the model runs 'sdpa'"):
        with torch.no_grad():
            sdpa(input_ids=_prompt(), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0


def test_a_model_switched_to_another_implementation_after_a_step(path):
    """The layers after a step's first skip the checks only for the config object that step
    checked and only while it still names m3_sparse."""
    switched = AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse").eval()
    cache = M3PagedCache(switched.config, 1, 64)
    with torch.no_grad():
        switched(input_ids=_prompt(), past_key_values=cache, use_cache=True)
        held = cache.get_seq_length()
        switched.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match=r"only attn_implementation='m3_sparse' can read; the model runs 'sdpa'"):
            switched(input_ids=_prompt()[:, :1], past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == held


def test_generate_on_a_filled_cache_asks_for_reset(model):
    prompt = _prompt(1)
    cache = M3PagedCache(model.config, 1, PROMPT + 8)
    first = greedy(model, prompt, new_tokens=4, past_key_values=cache, disable_compile=True)
    other = _prompt(2)
    with pytest.raises(ValueError, match=r"already holds 43 token slots .* Call cache.reset\(\)"):
        greedy(model, other, new_tokens=4, past_key_values=cache, disable_compile=True)
    cache.reset()
    again = greedy(model, other, new_tokens=4, past_key_values=cache, disable_compile=True)
    assert torch.equal(again, greedy(model, other, new_tokens=4, disable_compile=True))
    assert not torch.equal(again, first)


def test_generate_refuses_right_padding(model):
    prompt = _prompt(3, batch=2)
    mask = torch.ones_like(prompt)
    prompt[1, -3:], mask[1, -3:] = PAD, 0
    with pytest.raises(ValueError, match=r"right-padded prompt .*tokenizer.padding_side = 'left'"):
        greedy(model, prompt, mask, new_tokens=2, disable_compile=True)
