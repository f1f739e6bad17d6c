"""fp8 K/V pages in M3PagedCache: e4m3 codes of k / k_scale and v / v_scale, read by the
attention ops with those scales.

The model's logits with an fp8 cache must stay close to the model-dtype cache's (the only
difference is the e4m3 rounding of K and V), whatever the scales: a path that dropped a scale
would be off by that factor. Runs on the CPU reference path, and on CUDA through the Triton
kernels.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

import m3_hf_attention  # noqa: F401  registers m3_sparse
from m3_hf_attention import M3PagedCache
from model_utils import random_prompt, text_config

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNKS = ((0, 45), (45, 46), (46, 47), (47, 48))  # a prefill longer than top-k x block, then decode steps


def logits_with(model, seq, **cache_kwargs):
    cache = M3PagedCache(model.config, 1, 64, page_size=16, **cache_kwargs)
    with torch.no_grad():
        out = [model(input_ids=seq[:, a:b], past_key_values=cache, use_cache=True).logits[0] for a, b in CHUNKS]
    return torch.cat(out).float(), cache


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    return MiniMaxM3VLForCausalLM._from_config(text_config(), attn_implementation="m3_sparse").to(DEVICE, dtype).eval()


@pytest.mark.parametrize("coarse", [(1, 1), (3, 1), (1, 5)], ids=["calibrated", "coarse-k", "coarse-v"])
def test_fp8_pages_follow_the_model_dtype_cache(model, coarse):
    g = torch.Generator().manual_seed(1)
    seq = random_prompt(CHUNKS[-1][1], g)[None].to(DEVICE)
    ref, ref_cache = logits_with(model, seq)
    # Calibrated scales map the largest stored |k| and |v| onto e4m3's largest value; coarser
    # ones (x3, x5: not powers of two, which would only shift exponents) push small values
    # towards e4m3's subnormals but must still work.
    amax = [max(float(getattr(x, name).abs().max()) for x in ref_cache.layers) for name in ("keys", "values")]
    k_scale, v_scale = (a / 448.0 * c for a, c in zip(amax, coarse))
    got, cache = logits_with(model, seq, kv_cache_dtype=FP8, k_scale=k_scale, v_scale=v_scale)
    layer = cache.layers[0]
    assert layer.keys.dtype == FP8 and layer.values.dtype == FP8
    assert layer.kv_scale_args() == {"k_scale": k_scale, "v_scale": v_scale}
    assert torch.isfinite(got).all()
    rel = float((got - ref).norm() / ref.norm())
    # e4m3 keeps 3 mantissa bits (up to 2^-4 relative rounding) on K and V, through three
    # layers of a random model: about 6% here; a dropped or doubled scale is off by O(1).
    assert rel < 0.12, f"fp8 K/V cache: relative RMS error of the logits {rel:.3f}"
    # The pages hold codes of k / k_scale and v / v_scale: dequantized, they give back what the
    # model-dtype cache stores, within e4m3's rounding.
    for name, scale in (("keys", k_scale), ("values", v_scale)):
        for mine, theirs in zip(cache.layers, ref_cache.layers):
            want = getattr(theirs, name).float()
            back = getattr(mine, name).float() * scale
            err = float((back - want).norm() / want.norm())
            # one scale for every layer: a layer of smaller values keeps fewer mantissa bits (3-9% here)
            assert err < 0.15, f"{name}: dequantized pages off by {err:.3f} (relative RMS)"


def test_e4m3_partials_in_the_prefill(model):
    # A prompt past the decode kernel's row bound, so the sparse layers' prefill runs KV-outer,
    # whose partials partial_dtype stores in e4m3. Then one decode step.
    g = torch.Generator().manual_seed(2)
    seq = random_prompt(301, g)[None].to(DEVICE)

    def run(**cache_kwargs):
        cache = M3PagedCache(model.config, 1, 320, page_size=16, **cache_kwargs)
        with torch.no_grad():
            out = [
                model(input_ids=seq[:, a:b], past_key_values=cache, use_cache=True).logits[0]
                for a, b in ((0, 300), (300, 301))
            ]
        return torch.cat(out).float(), cache

    ref, ref_cache = run()
    k_scale, v_scale = (
        max(float(getattr(x, n).abs().max()) for x in ref_cache.layers) / 448.0 for n in ("keys", "values")
    )
    pages, _ = run(kv_cache_dtype=FP8, k_scale=k_scale, v_scale=v_scale)
    got, cache = run(kv_cache_dtype=FP8, k_scale=k_scale, v_scale=v_scale, partial_dtype=FP8)
    assert cache.partial_dtype == FP8 and torch.isfinite(got).all()
    # The option reaches the op: e4m3 partials round differently from model-dtype ones.
    assert not torch.equal(got, pages)
    rel = float((got - ref).norm() / ref.norm())
    # fp8 pages alone cost about 6% on this model (above); e4m3 partials add a little.
    assert rel < 0.12, f"fp8 K/V with e4m3 partials: relative RMS error of the logits {rel:.3f}"


def test_scale_mismatch_shows():
    # Reading the same codes with the wrong scale is far off: the check above can fail.
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM._from_config(text_config(), attn_implementation="m3_sparse").eval()
    g = torch.Generator().manual_seed(1)
    seq = random_prompt(CHUNKS[-1][1], g)[None]
    ref, _ = logits_with(model, seq)
    got, cache = logits_with(model, seq, kv_cache_dtype=FP8, k_scale=0.05, v_scale=0.05)
    cache.v_scale = 0.5  # the pages hold v / 0.05; read them as v / 0.5
    with torch.no_grad():
        wrong = model(input_ids=seq[:, -1:], past_key_values=cache, use_cache=True).logits[0].float()
    right_last = got[-1:]
    assert float((wrong - right_last).norm() / right_last.norm()) > 0.12


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kv_cache_dtype=torch.float16), "kv_cache_dtype: expected None"),
        (dict(k_scale=0.5), "k_scale: a scale of fp8 K/V pages"),
        (dict(kv_cache_dtype=FP8, v_scale=0.0), "v_scale: expected a positive finite float"),
        (dict(kv_cache_dtype=FP8, k_scale=float("inf")), "k_scale: expected a positive finite float"),
        (dict(kv_cache_dtype=FP8, k_scale=True), "k_scale: expected a positive finite float"),
        (dict(partial_dtype=FP8), "partial_dtype: e4m3 partials are stored in V's fp8 units"),
        (dict(kv_cache_dtype=FP8, partial_dtype=torch.bfloat16), "partial_dtype: expected None"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        M3PagedCache(text_config(), 1, 64, **kwargs)
