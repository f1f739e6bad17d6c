"""The model path through the Triton kernels (index top-k, KV-outer partials, combine):
on a GPU they are the default; on the CPU they run in Triton's interpreter when
M3_SPARSE_IMPL=triton pins them, so CI exercises the same kernels end to end."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from m3_hf_attention import M3PagedCache
from m3_hf_attention._kernel import kernel_module
from m3_hf_attention.compare import assert_prefill_matches_sdpa
from model_utils import greedy, random_prompt, save_tiny_text_model

BLOCK = 16  # the Triton kernels take power-of-two blocks of at least 16 keys


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-triton")
    save_tiny_text_model(path, seed=3, index_block_size=BLOCK, index_topk_blocks=2)
    sparse = AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse").eval()
    dense = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return sparse.to(device), dense.to(device), device


def test_triton_path_matches_torch_path_and_sdpa(models, monkeypatch):
    sparse, dense, device = models
    g = torch.Generator().manual_seed(0)
    lengths = [75, 40]
    width = max(lengths)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = random_prompt(n, g)
        mask[i, width - n :] = 1
    ids, mask = ids.to(device), mask.to(device)
    assert width > 2 * 2 * BLOCK  # the prompt drops blocks

    def run(impl):
        monkeypatch.setenv("M3_SPARSE_IMPL", impl)
        cache = M3PagedCache(sparse.config, 2, width + 4, page_size=16)
        with torch.no_grad():
            return sparse(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits

    triton_logits = []

    def run_triton():
        triton_logits.append(run("triton"))
        return triton_logits[-1]

    rows = [ids[i, width - n :] for i, n in enumerate(lengths)]
    assert_prefill_matches_sdpa(sparse, run_triton, dense, rows, tol=2e-4)
    torch_logits = run("torch")
    for i, n in enumerate(lengths):
        rows = slice(width - n, width)
        torch.testing.assert_close(triton_logits[0][i, rows], torch_logits[i, rows], atol=2e-4, rtol=0)


def test_triton_path_generate_matches_sdpa(models, monkeypatch):
    sparse, dense, device = models
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    ids = random_prompt(70, torch.Generator().manual_seed(1))[None].to(device)
    assert greedy(sparse, ids, new_tokens=6).tolist() == greedy(dense, ids, new_tokens=6).tolist()


def test_query_outer_prefill_matches_kvouter(models, monkeypatch):
    """``M3_SPARSE_PREFILL=qouter``: the model's prefill runs its sparse layers on the
    query-outer tile kernel (the dense kernel's sparse mode) and gives KV-outer's logits."""
    sparse, _, device = models
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    # The decode kernel's bound lowered below the prompt, so that its prefill runs past it at
    # a length the interpreter runs quickly.
    dispatch = kernel_module("dispatch")
    monkeypatch.setattr(dispatch, "DECODE_MAX_QUERIES", 32)
    monkeypatch.setattr(dispatch, "DECODE_MAX_QUERIES_TL", 32)
    ids = random_prompt(70, torch.Generator().manual_seed(2))[None].to(device)
    dense_triton = kernel_module("dense.attention_triton")
    sparse_runs = []
    real_run = dense_triton.DenseLaunch.run

    def run(self, *args, **kwargs):
        sparse_runs.append(self.sparse)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(dense_triton.DenseLaunch, "run", run)

    def logits(prefill):
        monkeypatch.setenv("M3_SPARSE_PREFILL", prefill)
        cache = M3PagedCache(sparse.config, 1, ids.shape[1] + 4, page_size=16)
        with torch.no_grad():
            return sparse(input_ids=ids, past_key_values=cache, use_cache=True).logits

    kvouter = logits("kvouter")
    assert True not in sparse_runs
    qouter = logits("qouter")
    assert sparse_runs.count(True) == sum(t == "minimax_m3_sparse" for t in sparse.config.layer_types)
    torch.testing.assert_close(qouter, kvouter, atol=2e-4, rtol=0)
