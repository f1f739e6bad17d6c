"""Bad input at the transformers boundary: clear errors, nothing written."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from m3_hf_attention import M3PagedCache, m3_sparse_attention
from model_utils import greedy, random_prompt, save_tiny_text_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-errors")
    save_tiny_text_model(path, seed=0)
    return path


@pytest.fixture(scope="module")
def sparse(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse").eval()


def test_paged_cache_refuses_other_implementations(checkpoint):
    dense = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    cache = M3PagedCache(dense.config, 1, 32, page_size=16)
    with pytest.raises(ValueError, match="only attn_implementation='m3_sparse' can read"):
        with torch.no_grad():
            dense(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)


def test_attention_rejects_4d_mask_and_training_dropout(sparse):
    attn = sparse.model.layers[1].self_attn
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="2-D padding mask"):
        m3_sparse_attention(attn, q, k, k, torch.zeros(1, 1, 4, 4))
    attn.train()
    try:
        with pytest.raises(ValueError, match="dropout"):
            m3_sparse_attention(attn, q, k, k, None, dropout=0.1)
    finally:
        attn.eval()


def test_dynamic_cache_with_padding_in_history_is_rejected(sparse):
    ids = torch.tensor([[0, 0, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    cache = DynamicCache(config=sparse.config)
    with torch.no_grad():
        sparse(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="M3PagedCache"):
            sparse(
                input_ids=torch.tensor([[9]]),
                attention_mask=torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1),
                past_key_values=cache,
                use_cache=True,
            )


def test_dynamic_cache_without_padding_matches_paged(sparse):
    ids = random_prompt(60, torch.Generator().manual_seed(0))[None]
    paged = greedy(sparse, ids, new_tokens=8)
    dynamic = greedy(sparse, ids, new_tokens=8, past_key_values=DynamicCache(config=sparse.config))
    assert paged.tolist() == dynamic.tolist()


def test_static_cache_request_gets_a_paged_cache(sparse):
    ids = random_prompt(40, torch.Generator().manual_seed(1))[None]
    out = greedy(sparse, ids, new_tokens=4, cache_implementation="static", return_dict_in_generate=True)
    assert isinstance(out.past_key_values, M3PagedCache)
    assert out.sequences.tolist() == greedy(sparse, ids, new_tokens=4).tolist()


def test_kernel_validation_reaches_the_user(sparse):
    """A selection out of range is named in the error (checked at the kernel boundary)."""
    import m3_hf_attention

    kernel = m3_hf_attention.load_kernel()
    q = torch.randn(4, 8, 16)
    k = torch.randn(2, 2, 16, 16)
    sel = torch.full((4, 2, 3), 7, dtype=torch.int32)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    kv = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="selected: block id 7 out of range"):
        kernel.kvouter_attention(q, k, k, sel, tables, cu_seqlens_q=cu, used_kv_lens=kv, block_size=8)
