"""Run by tests/test_continuous_batching.py in a fresh process: load the tiny M3 model with the
kernel named as a hub string (resolved offline through LOCAL_KERNELS), never importing
m3_hf_attention, and serve prompts with generate_batch. Arguments: the checkpoint, the hub
string, and the attention implementation continuous batching runs the model under on this
transformers (``paged|`` + the hub string up to 5.18, this package's serving name in 5.19-5.23,
the hub string itself from 5.24). Prints one JSON line."""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from model_utils import PAD, random_prompt

path, impl, served = sys.argv[1:4]
# Tokens per cache page: ``block_size`` up to transformers 5.17, ``page_size`` from 5.18.
page_key = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ else "block_size"
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl).eval()
g = torch.Generator().manual_seed(9)
prompts = [random_prompt(n, g).tolist() for n in (30, 90)]
out = model.generate_batch(
    prompts,
    generation_config=GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=PAD),
    continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, **{page_key: 16}, max_batch_tokens=64),
    warmup=False,
)
name = lambda fn: f"{fn.__module__}.{fn.__name__}"  # noqa: E731
served_mask = served in ALL_MASK_ATTENTION_FUNCTIONS  # 5.19-5.23's serving name has none
print(
    json.dumps(
        {
            "attn_implementation": model.config._attn_implementation,
            "imported_m3_hf_attention": "m3_hf_attention" in sys.modules,
            "served_attention": name(ALL_ATTENTION_FUNCTIONS[served]),
            "served_mask": name(ALL_MASK_ATTENTION_FUNCTIONS[served]) if served_mask else None,
            "prompts": prompts,
            "errors": [r.error for r in out.values()],
            "generated": [r.generated_tokens for r in out.values()],
        }
    )
)
