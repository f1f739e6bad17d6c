"""While a history holds no more blocks than the top-k keeps, every query selects every
block it sees: the sparse layer is dense causal attention, run as such (no index scores,
no KV-outer), with the result of the sparse kernels."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import m3_hf_attention
from m3_hf_attention import M3PagedCache
from m3_hf_attention._kernel import kernel_module
from model_utils import BLOCK, TOPK, random_prompt, save_tiny_text_model, spy_op_calls

# The loaded module itself: m3_hf_attention.integration forwards reads, and a test patches it.
integration = kernel_module("hf.attention")
kernel = m3_hf_attention.load_kernel()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-short")
    save_tiny_text_model(path, seed=7)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse").eval()


@pytest.fixture
def calls(monkeypatch):
    seen = []
    spy_op_calls(kernel.api, monkeypatch, lambda name, kw: seen.append(name))
    return seen


def test_every_block_selected_bound():
    assert integration.every_block_selected(TOPK * BLOCK, TOPK, BLOCK)
    assert not integration.every_block_selected(TOPK * BLOCK + 1, TOPK, BLOCK)
    assert integration.every_block_selected(1, 1, BLOCK)


@torch.no_grad()
def test_short_prefill_and_decode_run_dense_and_match_sparse_kernels(model, calls, monkeypatch):
    ids = random_prompt(TOPK * BLOCK - 2, torch.Generator().manual_seed(1))[None]
    steps = torch.randint(3, 150, (1, 6), generator=torch.Generator().manual_seed(2))

    def run():
        cache = M3PagedCache(model.config, 1, TOPK * BLOCK + 8, page_size=16)
        logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
        for i in range(steps.shape[1]):
            logits.append(model(input_ids=steps[:, i : i + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        return torch.stack(logits)

    fast = run()
    sparse_layers = sum(t == "minimax_m3_sparse" for t in model.config.layer_types)
    # Prefill and the first decode step stay within TOPK blocks: only dense attention runs.
    first = calls[: 2 * len(model.config.layer_types)]
    assert first == ["dense_paged_attention"] * len(first)
    # Past TOPK * BLOCK tokens the index branch and the sparse kernel take over.
    assert calls.count("index_topk") == calls.count("sparse_attention") > 0
    assert calls.count("index_topk") == sparse_layers * (steps.shape[1] - 2)

    monkeypatch.setattr(integration, "every_block_selected", lambda *a: False)
    before = len(calls)
    slow = run()
    # Now the prefill and every step run the index branch and the sparse kernels.
    assert calls[before:].count("index_topk") == sparse_layers * (steps.shape[1] + 1)
    torch.testing.assert_close(fast, slow, atol=2e-4, rtol=0)
