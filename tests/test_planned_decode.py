"""Eager steps over an ``M3PagedCache``, prefill and decode, run the layers' ops through plans kept on the
cache (``api.plan_index_topk`` / ``api.plan_sparse_attention`` for the sparse layers,
``api.plan_dense_paged_attention`` for the full-attention ones; made once per call shape and
run by every layer of that kind at every step): the logits are the op calls' exactly, for a
left-padded batch and fp8 caches, and the plans are made once, not per layer or step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import m3_hf_attention
from m3_hf_attention import M3PagedCache
from m3_hf_attention._kernel import kernel_module
from model_utils import BLOCK, TOPK, left_padded_batch, random_prompt, save_tiny_text_model

integration = kernel_module("hf.attention")  # the loaded module, whose settings the tests change
kernel = m3_hf_attention.load_kernel()
FP8 = torch.float8_e4m3fn
STEPS = 8
PLANS = ("plan_dense_paged_attention", "plan_index_topk", "plan_sparse_attention")
CACHES = {
    "bf16_model_dtype": {},
    "fp8_index_keys": {"index_key_dtype": FP8},
    "fp8_index_one_scale": {"index_key_dtype": FP8, "index_k_scale": 0.02},
    "fp8_kv": {"kv_cache_dtype": FP8, "k_scale": 0.05, "v_scale": 0.05},
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-plans")
    save_tiny_text_model(path, seed=21)
    return path


@pytest.fixture(scope="module")
def model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="m3_sparse").eval()


@pytest.fixture
def plans_made(monkeypatch):
    made = []
    for name in PLANS:
        real = getattr(kernel.api, name)
        monkeypatch.setattr(kernel.api, name, lambda *a, _real=real, _name=name, **kw: made.append(_name) or _real(*a, **kw))
    return made


@torch.no_grad()
def _decode(model, cache, ids, mask, steps):
    """Logits of a prefill and ``steps`` one-token steps fed with random tokens."""
    g = torch.Generator().manual_seed(3)
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    logits = [out]
    for _ in range(steps):
        token = random_prompt(ids.shape[0], g)[:, None].to(ids.device)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        logits.append(model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("options", CACHES.values(), ids=CACHES.keys())
def test_planned_steps_give_the_op_calls_logits(model, plans_made, monkeypatch, options):
    _planned_against_ops(model, plans_made, monkeypatch, options)


@pytest.mark.gpu
@pytest.mark.parametrize("options", CACHES.values(), ids=CACHES.keys())
def test_planned_steps_give_the_op_calls_logits_on_cuda(model_path, plans_made, monkeypatch, options):
    """The same on the GPU kernels (bf16 model): a plan launches what the op launches."""
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="m3_sparse", dtype=torch.bfloat16)
    _planned_against_ops(model.eval().cuda(), plans_made, monkeypatch, options)


def _planned_against_ops(model, plans_made, monkeypatch, options):
    # Prompts past TOPK blocks, so the decode steps run the index branch and the sparse kernel.
    ids, mask, _ = left_padded_batch([TOPK * BLOCK + 5, TOPK * BLOCK - 3, TOPK * BLOCK + 11], torch.Generator().manual_seed(4))
    ids, mask = ids.to(model.device), mask.to(model.device)
    width = ids.shape[1] + STEPS
    cache = M3PagedCache(model.config, ids.shape[0], width, page_size=16, **options)
    planned = _decode(model, cache, ids, mask, STEPS)
    # One plan per op for every layer: one set for the prefill, one for every decode step.
    assert sorted(plans_made) == sorted(PLANS * 2)
    assert len(cache.plans) == 2 * len(PLANS)

    cache.reset()
    again = _decode(model, cache, ids, mask, STEPS)
    assert len(plans_made) == 2 * len(PLANS)  # a reset cache keeps its plans: the same tensors, updated in place
    torch.testing.assert_close(again, planned, atol=0, rtol=0)

    monkeypatch.setattr(integration, "PLANNED", False)  # every call through the ops
    direct = _decode(model, M3PagedCache(model.config, ids.shape[0], width, page_size=16, **options), ids, mask, STEPS)
    assert len(plans_made) == 2 * len(PLANS)
    torch.testing.assert_close(planned, direct, atol=0, rtol=0)


def test_plans_follow_the_step_length(model, plans_made, monkeypatch):
    """Steps of another length have other cu_seqlens: their own plans, and the decode
    steps' plans are still right afterwards."""
    ids = random_prompt(TOPK * BLOCK + 9, torch.Generator().manual_seed(5))[None]
    cache = M3PagedCache(model.config, 1, ids.shape[1] + 16, page_size=16)
    reference = M3PagedCache(model.config, 1, ids.shape[1] + 16, page_size=16)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        model(input_ids=ids, past_key_values=reference, use_cache=True)
        for n in (1, 3, 1, 2):
            chunk = random_prompt(n, torch.Generator().manual_seed(10 + n))[None]
            got = model(input_ids=chunk, past_key_values=cache, use_cache=True).logits
            with monkeypatch.context() as ops_only:
                ops_only.setattr(integration, "PLANNED", False)
                want = model(input_ids=chunk, past_key_values=reference, use_cache=True).logits
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    # One set per prefill (both caches) and per step length (1, 3, 2).
    assert len(plans_made) == len(PLANS) * 5


def test_a_plan_is_remade_when_the_metadata_tensors_change(model):
    """A plan reads its own metadata tensors: a call with others (a layer on another device
    reads per-step copies) gets a new plan under the same key."""
    cache = M3PagedCache(model.config, 1, 64, page_size=16)
    layer = cache.layer(0)
    made = []

    def make(metadata):
        tables, cu, kv_lens = metadata
        made.append(metadata)
        args = type("Args", (), dict(block_tables=tables, cu_seqlens_q=cu, used_kv_lens=kv_lens))
        plan = type("Plan", (), {"args": args, "release": lambda self, keep_scratch: self})
        return plan()

    first = tuple(torch.zeros(2, dtype=torch.int32) for _ in range(3))
    other = (first[0], torch.zeros(2, dtype=torch.int32), first[2])
    for metadata in (first, first, other, other, first):
        integration._plan(layer, ("key",), metadata, lambda m=metadata: make(m), 1)
    assert made == [first, other, first]
