"""The multimodal model a real M3 checkpoint loads as: its vision tower and full-attention
layers call the same attention implementation without an indexer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForImageTextToText
from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLModel

import m3_hf_attention
from model_utils import PAD, VOCAB, randomize_norms, random_prompt, vl_config

LOGIT_ATOL = 2e-4
GRID = (1, 4, 4)  # t, h, w patches: 16 patches -> 4 image tokens after the 2x2 merge


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-vl")
    torch.manual_seed(0)
    model = MiniMaxM3SparseForConditionalGeneration(vl_config()).eval()
    randomize_norms(model, 0)
    model.save_pretrained(path)
    return path


def image_inputs(seed: int, text_len: int = 70):
    g = torch.Generator().manual_seed(seed)
    cfg = vl_config()
    v = cfg.vision_config
    patches = GRID[0] * GRID[1] * GRID[2]
    pixel_values = torch.randn(patches, v.num_channels * v.temporal_patch_size * v.patch_size**2, generator=g)
    n_image_tokens = patches // v.spatial_merge_size**2
    ids = random_prompt(text_len, g)
    ids[10 : 10 + n_image_tokens] = cfg.image_token_id
    return dict(input_ids=ids[None], pixel_values=pixel_values, image_grid_thw=torch.tensor([GRID]))


def test_auto_classes_resolve(checkpoint):
    assert isinstance(AutoModel.from_pretrained(checkpoint, attn_implementation="m3_sparse"), MiniMaxM3VLModel)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, attn_implementation="m3_sparse")
    assert isinstance(model, MiniMaxM3SparseForConditionalGeneration)
    assert model.config.vision_config._attn_implementation == "m3_sparse"
    assert model.config.text_config._attn_implementation == "m3_sparse"


def test_vision_tower_runs_bidirectional_through_m3_sparse(checkpoint, monkeypatch):
    sparse = AutoModel.from_pretrained(checkpoint, attn_implementation="m3_sparse").eval()
    dense = AutoModel.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    calls = []
    original = m3_hf_attention.integration.m3_sparse_attention

    def spy(module, *args, **kwargs):
        calls.append((type(module).__name__, getattr(module, "is_causal", True), kwargs.get("block_indices") is not None))
        return original(module, *args, **kwargs)

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "m3_sparse", spy)
    inputs = image_inputs(1)
    with torch.no_grad():
        a = sparse.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        b = dense.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    torch.testing.assert_close(a, b, atol=LOGIT_ATOL, rtol=0)
    assert calls and all(name == "MiniMaxM3VLVisionAttention" and not causal for name, causal, _ in calls)


def test_image_text_logits_and_generate_match_sdpa(checkpoint):
    sparse = AutoModelForImageTextToText.from_pretrained(checkpoint, attn_implementation="m3_sparse").eval()
    dense = AutoModelForImageTextToText.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    inputs = image_inputs(2)
    with torch.no_grad():
        a = sparse(**inputs).logits
        b = dense(**inputs).logits
    torch.testing.assert_close(a, b, atol=LOGIT_ATOL, rtol=0)
    kwargs = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, suppress_tokens=[PAD, VOCAB - 2, VOCAB - 1])
    out_a = sparse.generate(**inputs, **kwargs, return_dict_in_generate=True)
    out_b = dense.generate(**inputs, **kwargs)
    assert out_a.sequences.tolist() == out_b.tolist()
    assert isinstance(out_a.past_key_values, m3_hf_attention.M3PagedCache)
