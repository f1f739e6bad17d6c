"""A causal dense prefill into an empty cache with no padding reads the new K/V as written,
on torch's fused sdpa kernels (``dense/attention_sdpa.py``), where the dense op would run its
Triton kernel (``api.sdpa_prefill_reason`` asks ``dispatch.sdpa_prefill_reason``). On the CPU
dispatch never sends a call there; these tests force it and compare with the paged path (the
oracle), then check that no other step takes it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import m3_hf_attention
from m3_hf_attention import M3PagedCache
from m3_hf_attention._kernel import kernel_module
from model_utils import BLOCK, CACHE_KEYWORD, TOPK, left_padded_batch, random_prompt, save_tiny_text_model

dispatch = kernel_module("dispatch")
attention_sdpa = kernel_module("dense.attention_sdpa")
kernel = m3_hf_attention.load_kernel()
LOGIT_ATOL = 2e-4  # fp32; sdpa and the paged path sum the same keys in another order


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-sdpa")
    save_tiny_text_model(path, seed=3)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse").eval()


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Dispatch sends every call it is asked about to sdpa; the list records the calls that
    ran there (query length each)."""
    seen = []
    real = kernel.api.causal_prefill_sdpa

    def spy(q, k, v, scale):
        seen.append(q.shape[2])
        return real(q, k, v, scale)

    monkeypatch.setattr(dispatch, "sdpa_prefill_reason", lambda *args: None)
    monkeypatch.setattr(kernel.api, "causal_prefill_sdpa", spy)
    return seen


def run_steps(model, ids, steps, attention_mask=None, **cache_kwargs):
    """Prefill ``ids`` into a fresh paged cache, then feed ``steps`` one token at a time:
    the last position's logits of each forward pass, stacked."""
    cache = M3PagedCache(model.config, ids.shape[0], ids.shape[1] + steps.shape[1] + 8, page_size=16, **cache_kwargs)
    out = [model(input_ids=ids, attention_mask=attention_mask, **{CACHE_KEYWORD: cache}, use_cache=True).logits[:, -1]]
    mask = attention_mask
    for i in range(steps.shape[1]):
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out.append(model(input_ids=steps[:, i : i + 1], attention_mask=mask, **{CACHE_KEYWORD: cache},
                         use_cache=True).logits[:, -1])
    return torch.stack(out)


def dense_layers(model, prompt_len: int) -> int:
    """Layers whose prefill of ``prompt_len`` tokens runs dense attention."""
    short = prompt_len <= TOPK * BLOCK
    return sum(t != "minimax_m3_sparse" or short for t in model.config.layer_types)


@torch.no_grad()
@pytest.mark.parametrize("length", [40, TOPK * BLOCK + 37])
def test_prefill_on_sdpa_matches_the_pages(model, sdpa_calls, length):
    g = torch.Generator().manual_seed(length)
    ids = random_prompt(length, g)[None].repeat(2, 1)
    ids[1] = random_prompt(length, g)
    steps = torch.randint(3, 150, (2, 3), generator=g)
    routed = run_steps(model, ids, steps)
    # The full layers' prefill (and the sparse layers' while they are dense) ran on sdpa;
    # the decode steps, whose keys are the cache's, never did.
    assert sdpa_calls == [length] * dense_layers(model, length)
    sdpa_calls.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "sdpa_prefill_reason", lambda *args: "off")
        paged = run_steps(model, ids, steps)
    assert sdpa_calls == []
    torch.testing.assert_close(routed, paged, atol=LOGIT_ATOL, rtol=0)


@torch.no_grad()
def test_a_history_padding_or_fp8_pages_keep_the_pages(model, sdpa_calls):
    g = torch.Generator().manual_seed(5)
    ids, mask, _ = left_padded_batch([30, 44], g)
    run_steps(model, ids, torch.randint(3, 150, (2, 2), generator=g), attention_mask=mask)
    assert sdpa_calls == []  # left padding: keys are not the new tokens alone
    ids = random_prompt(30, g)[None]
    run_steps(model, ids, torch.randint(3, 150, (1, 2), generator=g), kv_cache_dtype=torch.float8_e4m3fn)
    assert sdpa_calls == []  # fp8 pages: the attention reads what the pages hold
    cache = M3PagedCache(model.config, 1, 80, page_size=16)
    for chunk in (ids[:, :20], ids[:, 20:]):  # a second chunk has a history
        model(input_ids=chunk, **{CACHE_KEYWORD: cache}, use_cache=True)
    assert sdpa_calls == [20] * dense_layers(model, 20)


@torch.no_grad()
def test_without_a_cache_the_keys_are_the_new_tokens(model, sdpa_calls):
    ids = random_prompt(50, torch.Generator().manual_seed(6))[None]
    routed = model(input_ids=ids, use_cache=False).logits
    assert sdpa_calls == [50] * dense_layers(model, 50)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "sdpa_prefill_reason", lambda *args: "off")
        torch.testing.assert_close(routed, model(input_ids=ids, use_cache=False).logits, atol=LOGIT_ATOL, rtol=0)


def test_dispatch_reasons_on_the_cpu():
    q, k = torch.randn(1, 8, 16, 64, dtype=torch.bfloat16), torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    cfg = kernel.api.DENSE_DEFAULTS
    assert dispatch.sdpa_prefill_reason(q, k, "fa4", cfg, False) == "the dense op runs 'fa4'"
    assert dispatch.sdpa_prefill_reason(q, k, "torch", cfg, False) == "the dense op runs 'torch'"
    assert dispatch.sdpa_prefill_reason(q, k, "triton", cfg, False) == "not on CUDA"


@pytest.mark.gpu
def test_dispatch_reasons_on_cuda():
    q = torch.randn(1, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
    cfg = kernel.api.DENSE_DEFAULTS
    assert dispatch.sdpa_prefill_reason(q, q[:, :2], "triton", cfg, True) == "fp8 pages: the attention reads what they hold"
    assert dispatch.sdpa_prefill_reason(q.float(), q[:, :2].float(), "triton", cfg, False).endswith("(measured: bf16)")


def test_dispatch_keeps_a_pinned_dense_kernel(monkeypatch):
    q, k = torch.randn(1, 8, 16, 64), torch.randn(1, 2, 16, 64)
    monkeypatch.setenv("M3_SPARSE_DENSE_IMPL", "triton")
    assert dispatch.sdpa_prefill_reason(q, k, "triton", kernel.api.DENSE_DEFAULTS, False) == "the dense kernel is pinned"


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(64, 4, 128), (8, 8, 64)])
def test_sdpa_prefill_on_cuda_matches_the_dense_op(hq, hkv, d):
    """On a GPU: dispatch takes an unpinned bf16 prefill, and its output is the dense op's
    over the same keys in pages, within bf16's tolerance."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, page = 2, 1500, 64
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    assert dispatch.sdpa_prefill_reason(q, k, "triton", kernel.api.DENSE_DEFAULTS, False) is None
    out = attention_sdpa.causal_prefill_sdpa(q, k, v, d**-0.5)  # [B, S, Hq, D]
    pages = -(-s // page)
    pool_k = torch.zeros(b * pages, hkv, page, d, device="cuda", dtype=torch.bfloat16)
    pool_v = torch.zeros_like(pool_k)
    for i in range(b):
        for name, pool, x in (("k", pool_k, k), ("v", pool_v, v)):
            padded = torch.zeros(hkv, pages * page, d, device="cuda", dtype=torch.bfloat16)
            padded[:, :s] = x[i]
            pool[i * pages : (i + 1) * pages] = padded.view(hkv, pages, page, d).transpose(0, 1)
    tables = torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
    lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
    ref, _ = kernel.api.dense_paged_attention(
        q=q.transpose(1, 2).reshape(b * s, hq, d), k_cache=pool_k, v_cache=pool_v, block_tables=tables,
        cu_seqlens_q=cu, used_kv_lens=lens, softmax_scale=d**-0.5, causal=True)
    torch.testing.assert_close(out.reshape(b * s, hq, d).float(), ref.float(), atol=2e-2, rtol=2e-2)
