"""One M3PagedCache serves forward passes under every autograd mode in turn: generate()
runs under no_grad, a user's own forward may run with grad mode on or under inference
mode, and the cache's eager writes (K/V, index keys) work in each, with the logits of a
cache that saw only no_grad passes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from m3_hf_attention import M3PagedCache
from model_utils import random_prompt, save_tiny_text_model

MODES = {
    "no_grad": torch.no_grad,
    "grad": torch.enable_grad,
    "inference": torch.inference_mode,
}


@pytest.mark.parametrize(
    "order, early",
    [
        (["no_grad", "grad", "inference", "grad", "no_grad", "inference"], False),
        # Pages allocated and first written under inference mode.
        (["inference", "grad", "no_grad", "inference", "grad"], False),
        # Pages allocated ahead (outside inference mode), first written under inference mode.
        (["inference", "grad", "no_grad", "inference", "grad"], True),
    ],
    ids=["no_grad_first", "inference_first", "inference_first_early_pages"],
)
def test_cache_writes_under_each_grad_mode_in_turn(tmp_path, order, early):
    save_tiny_text_model(tmp_path, seed=9)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="m3_sparse").eval()
    cfg = model.config
    g = torch.Generator().manual_seed(9)
    prompt = random_prompt(30, g)[None]
    steps = random_prompt(5, g)[None]

    def run(modes):
        cache = M3PagedCache(cfg, 1, 40, page_size=16)
        if early:
            cache.early_initialization(1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
        logits = []
        for i, mode in enumerate(modes):
            ids = prompt if i == 0 else steps[:, i - 1 : i]
            with MODES[mode]():
                logits.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits.detach().clone())
        return logits

    got = run(order)
    want = run(["no_grad"] * len(order))
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"pass {i} ({order[i]})"
