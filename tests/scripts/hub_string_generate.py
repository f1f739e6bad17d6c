"""Run by tests/test_hub_string.py in a fresh process: load the tiny M3 model with the kernel
named as a hub string (resolved offline through LOCAL_KERNELS), never importing
m3_hf_attention, and generate a left-padded batch. Prints one JSON line."""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from model_utils import greedy, random_prompt

path, impl, device = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl).eval().to(device)
lengths = [70, 33]
width = max(lengths)
g = torch.Generator().manual_seed(4)
ids = torch.zeros(len(lengths), width, dtype=torch.long)
mask = torch.zeros_like(ids)
for i, n in enumerate(lengths):
    ids[i, width - n :] = random_prompt(n, g)
    mask[i, width - n :] = 1
out = greedy(model, ids.to(device), mask.to(device), new_tokens=8, return_dict_in_generate=True)
mask_fn = ALL_MASK_ATTENTION_FUNCTIONS.get(model.config._attn_implementation)
print(
    json.dumps(
        {
            "attn_implementation": model.config._attn_implementation,
            "imported_m3_hf_attention": "m3_hf_attention" in sys.modules,
            "cache": type(out.past_key_values).__name__,
            "cache_module": type(out.past_key_values).__module__,
            "mask_function": f"{mask_fn.__module__}.{mask_fn.__name__}",
            "prompt": ids.tolist(),
            "mask": mask.tolist(),
            "generated": out.sequences[:, width:].tolist(),
        }
    )
)
