"""Tiny random MiniMax M3 models where sparsity bites: prompts are much longer than
top-k blocks x block size, so the selection really drops blocks."""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version
from transformers.models.minimax_m3_vl import (
    MiniMaxM3VLConfig,
    MiniMaxM3VLForCausalLM,
    MiniMaxM3VLTextConfig,
    MiniMaxM3VLVisionConfig,
)

# The keyword generate() and the models take a cache under: transformers 5.24 renamed
# ``past_key_values`` to ``cache`` (the old name is accepted, with a warning, until 5.40).
# The package has it as m3_hf_attention.CACHE_KEYWORD; this module must not import the
# package: tests/scripts/stock_outputs.py uses it in a process that never imports it.
CACHE_KEYWORD = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"

PAD = 0
VOCAB = 160
BLOCK = 8
TOPK = 3


def text_config(**overrides) -> MiniMaxM3VLTextConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        dense_intermediate_size=64,
        shared_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        rotary_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=BLOCK,
        index_topk_blocks=TOPK,
        index_local_blocks=1,
        layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "dense"],
        max_position_embeddings=4096,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return MiniMaxM3VLTextConfig(**kwargs)


def vl_config(**text_overrides) -> MiniMaxM3VLConfig:
    vision = MiniMaxM3VLVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        image_size=32,
    )
    return MiniMaxM3VLConfig(
        text_config=text_config(**text_overrides).to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=VOCAB - 2,
        video_token_index=VOCAB - 1,
        projector_hidden_size=64,
    )


def randomize_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """transformers initializes RMSNorm weights to zero (a 1 + w gain); random gains make
    the index scores and attention less uniform, so selections differ between queries."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def save_tiny_text_model(path, seed: int = 0, **overrides) -> MiniMaxM3VLTextConfig:
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(text_config(**overrides)).eval()
    randomize_norms(model, seed)
    model.save_pretrained(path)
    return model.config


def random_prompt(length: int, generator: torch.Generator) -> torch.Tensor:
    # Real tokens only: never the pad id nor the special image ids.
    return torch.randint(3, VOCAB - 2, (length,), generator=generator)


def left_padded_batch(lengths, generator: torch.Generator):
    """Random prompts of ``lengths`` tokens, left padded to the longest: (ids, mask, rows),
    ``rows`` the unpadded prompts."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows = []
    for i, n in enumerate(lengths):
        rows.append(random_prompt(n, generator))
        ids[i, width - n :] = rows[-1]
        mask[i, width - n :] = 1
    return ids, mask, rows


def greedy(model, input_ids, attention_mask=None, new_tokens=30, **kwargs):
    return model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        suppress_tokens=[PAD],
        **kwargs,
    )


def spy_op_calls(api, monkeypatch, record) -> None:
    """Call ``record(name, kwargs)`` for every ``index_topk``, ``sparse_attention`` and
    ``dense_paged_attention`` call of ``api`` (a loaded kernel's), whether the integration
    calls the op or runs a plan of it (eager steps): ``kwargs`` then holds the run's
    tensors and the plan's options."""
    for name in ("index_topk", "sparse_attention", "dense_paged_attention"):
        real = getattr(api, name)

        def op_spy(*args, _real=real, _name=name, **kwargs):
            record(_name, kwargs)
            return _real(*args, **kwargs)

        monkeypatch.setattr(api, name, op_spy)
    run_topk = api.PlannedIndexTopk.run

    def topk_spy(self, index_q, index_k_cache, index_k_scale=None):
        record("index_topk", {"index_q": index_q, "index_k_cache": index_k_cache, "index_k_scale": index_k_scale,
                              "fp8_dot": self.args.fp8_dot})
        return run_topk(self, index_q, index_k_cache, index_k_scale)

    run_attention = api.PlannedAttention.run

    def attention_spy(self, q, k_cache, v_cache, selected):
        record("sparse_attention", {"q": q, "k_cache": k_cache, "v_cache": v_cache, "selected": selected})
        return run_attention(self, q, k_cache, v_cache, selected)

    run_dense = api.PlannedDenseAttention.run

    def dense_spy(self, q, k_cache, v_cache):
        record("dense_paged_attention", {"q": q, "k_cache": k_cache, "v_cache": v_cache})
        return run_dense(self, q, k_cache, v_cache)

    monkeypatch.setattr(api.PlannedIndexTopk, "run", topk_spy)
    monkeypatch.setattr(api.PlannedAttention, "run", attention_spy)
    monkeypatch.setattr(api.PlannedDenseAttention, "run", dense_spy)
