"""Logits and greedy tokens of transformers' own attention implementations on a tiny M3
checkpoint, saved with ``torch.save``; run once with and once without ``import
m3_hf_attention`` by tests/test_import_isolation.py.

    python stock_outputs.py CHECKPOINT OUT {plain,imported}
"""

import sys

import torch
from transformers import AutoModelForCausalLM, StaticCache

from model_utils import PAD, left_padded_batch

checkpoint, out, mode = sys.argv[1:4]
if mode == "imported":
    import m3_hf_attention  # noqa: F401  (the import under test)
elif mode != "plain":
    raise SystemExit(f"mode: expected 'plain' or 'imported', got {mode!r}")

torch.manual_seed(0)
ids, mask, _ = left_padded_batch([37, 52, 29], torch.Generator().manual_seed(7))
results = {}
for impl in ("sdpa", "eager"):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=impl, dtype=torch.float32).eval()
    with torch.no_grad():
        results[f"{impl}/logits"] = model(input_ids=ids, attention_mask=mask).logits
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD,
                  return_dict_in_generate=True, output_logits=True)
    for name, extra in (("dynamic", {}), ("chunked", {"prefill_chunk_size": 16})):
        gen = model.generate(**common, **extra)
        results[f"{impl}/{name}/tokens"] = gen.sequences
        results[f"{impl}/{name}/logits"] = torch.stack(gen.logits)
    static = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 12)
    results[f"{impl}/static/tokens"] = model.generate(
        **{**common, "return_dict_in_generate": False, "output_logits": False}, past_key_values=static
    )
torch.save(results, out)
