"""The kernels a model's own calls would take on an sm_90 GPU, checked on the CPU: the sparse
layers' KV-outer calls, with the tensors the integration passes (their shapes, strides and
dtypes), meet every rule of the TMA partials kernel but the device's. A model's batch-1 q is a
transposed view, which the kernel's rule once refused, so that a model's prompt ran the slower
tl kernel while the module benchmarks timed the TMA one."""

from __future__ import annotations

import pytest
import torch

import m3_hf_attention  # noqa: F401  (registers m3_sparse)
from m3_hf_attention._kernel import kernel_module
from model_utils import greedy, left_padded_batch, random_prompt, spy_op_calls, text_config
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

# The smallest shapes the TMA partials kernel takes: a GQA group of 8, D = 64, key blocks of 64.
BLOCK = 64
TOPK = 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = text_config(
        num_attention_heads=16, num_key_value_heads=2, head_dim=64, rotary_dim=16,
        index_block_size=BLOCK, index_topk_blocks=TOPK,
    )
    m = MiniMaxM3VLForCausalLM(config).to(torch.bfloat16).eval()  # the TMA kernel takes bf16 / fp16 / e4m3
    m.set_attn_implementation("m3_sparse")
    return m


def kvouter_calls(model, monkeypatch, ids, mask=None) -> list[dict]:
    """The ``sparse_attention`` calls past the decode bound (KV-outer's) of a generate() of one
    token: the prompt's, on the paged cache that generate() makes."""
    api, dispatch = kernel_module("api"), kernel_module("dispatch")
    calls = []
    spy_op_calls(api, monkeypatch, lambda name, kw: calls.append(kw) if name == "sparse_attention" else None)
    greedy(model, ids, mask, new_tokens=1)
    bound = dispatch.DECODE_MAX_QUERIES
    return [kw for kw in calls if kw["q"].shape[0] // ids.shape[0] > bound]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_prompts_kvouter_calls_meet_the_tma_kernels_rule(model, monkeypatch, batch):
    dispatch, gluon_partials = kernel_module("dispatch"), kernel_module("kvouter.partials_gluon_sm90")
    plan = kernel_module("kvouter.plan")
    g = torch.Generator().manual_seed(batch)
    if batch == 1:
        ids, mask = random_prompt(300, g)[None], None
    else:
        ids, mask, _ = left_padded_batch([300, 260], g)
    calls = kvouter_calls(model, monkeypatch, ids, mask)
    assert len(calls) == 2  # the model's two sparse layers
    if batch == 1:
        assert not calls[0]["q"].is_contiguous()  # the layout this test is about
    monkeypatch.setattr(gluon_partials, "device_reason", lambda t: None)  # act as an sm_90 GPU
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for kw in calls:
        assert kw["q"].dtype == kw["k_cache"].dtype == torch.bfloat16
        why = dispatch.tma_partials_reason(
            kw["q"], kw["k_cache"], kw["v_cache"], BLOCK, None, None, plan.default_tile_q(group), 0
        )
        assert why is None, why
