"""fp8 (e4m3) index keys: quantization, selection against the unquantized keys, the
paged cache option and its plumbing through the model, and the Triton path.

Swap tolerance (derived, not tuned). ``quantize_index_keys`` rounds ``k / s`` (``s =
amax|k| / 448``) to e4m3: 3 mantissa bits, so a normal code is off by at most 2^-4 of
its value, and a subnormal one (below 2^-6) by at most half the subnormal step 2^-9.
Hence per element ``|k' - k| <= 2^-4 |k| + 2^-10 s``, and for a query ``q``

    |<q, k'> - <q, k>| <= E(q, k) = 2^-4 <|q|, |k|> + 2^-10 s ||q||_1.

A block score is a max over keys, so it moves by at most the largest ``E`` of the
block's visible keys, ``E_b``. If fp8 selects block ``a`` where the exact keys select
``b``, then ``S'[a] >= S'[b]``, so ``S[b] - S[a] <= E_a + E_b``: any swap wider than
that (plus fp32 rounding, ``FP32_SLACK`` relative) is a bug, and is counted as one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from m3_hf_attention import M3PagedCache, load_kernel
from m3_hf_attention.cache import quantize_index_keys
from model_utils import greedy, random_prompt, save_tiny_text_model, spy_op_calls

FP8 = torch.float8_e4m3fn
# The Triton tests run on the GPU where there is one, else in the CPU interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa, relative
E4M3_SUB_ABS = 2.0**-10  # half the subnormal step 2^-9, in units of the scale
# Both paths score in fp32: D products of relative error 2^-24 each, far below this.
FP32_SLACK = 1e-5


@pytest.fixture(autouse=True)
def _few_threads():
    # Tiny ops: intra-op threads only spin on a 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def paged_keys(g, kv_lens, page, dim):
    """Random index keys of varied per-token magnitude, laid out under a shuffled block
    table. Returns (fp32 cache [pages, page, dim], block tables [B, W] int32)."""
    need = [-(-kv // page) for kv in kv_lens]
    pages = sum(need) + 2
    order = torch.randperm(pages, generator=g)
    width = max(need) + 1
    tables = torch.randint(0, pages, (len(kv_lens), width), generator=g, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[nxt : nxt + n].to(torch.int32)
        nxt += n
    # A per-token gain makes the scale matter: ignoring it would rescale whole keys.
    gain = torch.exp(0.7 * torch.randn(pages, page, 1, generator=g))
    return torch.randn(pages, page, dim, generator=g) * gain, tables


def varlen(q_lens, kv_lens):
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0).to(torch.int32)
    return cu, torch.tensor(kv_lens, dtype=torch.int32)


def canon(sel):
    big = torch.iinfo(torch.int32).max
    s = torch.where(sel < 0, big, sel).sort(-1).values
    return torch.where(s == big, -1, s)


def logical_keys(cache, tables, b, kv, page):
    j = torch.arange(kv)
    return cache[tables[b, j // page].long(), j % page]


def block_scores(q, keys, pos, block):
    """[H, L + 1] float64 block maxima of the rows of q [H, D] over keys[: pos + 1]."""
    s = q.double() @ keys[: pos + 1].double().T
    nb = pos // block + 1
    s = torch.nn.functional.pad(s, (0, nb * block - (pos + 1)), value=float("-inf"))
    return s.view(q.shape[0], nb, block).amax(-1)


def swapped_pairs(out, ref):
    """(extra, missing) block ids of one row: chosen only by out / only by ref."""
    o = {x for x in out.tolist() if x >= 0}
    r = {x for x in ref.tolist() if x >= 0}
    return sorted(o - r), sorted(r - o)


def run_index(kernel, iq, cache, tables, cu, kv, topk, block, **kw):
    return kernel.index_topk(
        iq, cache, tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=topk, block_size=block, **kw
    )


# ---------------------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------------------
def test_quantization_round_trip_error_bounded():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(512, 128, generator=g) * torch.exp(2.0 * torch.randn(512, 1, generator=g))
    keys[0] = 0.0  # an all-zero key (the scratch page and fresh pages hold these)
    keys[1] *= 1e-30  # a tiny key keeps its relative precision: the scale follows its amax
    keys[2, :] = 1e-3
    keys[2, 0] = 1e3  # one outlier pushes the rest of the token into e4m3 subnormals
    codes, scales = quantize_index_keys(keys)
    assert codes.dtype == FP8 and scales.dtype == torch.float32 and scales.shape == (512,)
    assert bool((scales > 0).all()) and bool(torch.isfinite(codes.float()).all())
    deq = codes.float() * scales[:, None]
    err = (deq - keys).abs()
    bound = E4M3_REL * keys.abs() + E4M3_SUB_ABS * scales[:, None]
    assert bool((err <= bound * (1 + 1e-6)).all()), f"worst err/bound {float((err / bound).max()):.3f}"
    assert float(deq[0].abs().max()) == 0.0
    # Every token's largest element maps to the top of the e4m3 range.
    assert torch.equal(codes[3:].float().abs().amax(-1), torch.full((509,), 448.0))
    normal = keys.abs() >= 2.0**-6 * scales[:, None]
    rel = (err / keys.abs())[normal]
    assert float(rel.max()) <= E4M3_REL * (1 + 1e-6)
    assert float(rel.max()) > 2.0**-6, "the codes look unrounded: are they really e4m3?"


# ---------------------------------------------------------------------------------------
# index_topk with fp8 keys
# ---------------------------------------------------------------------------------------
def test_fp8_selection_vs_exact_keys(monkeypatch):
    """Torch path: fp8 keys select what the exact fp32 keys select, except swaps
    within the derived tolerance; it also equals the selection over the dequantized
    keys stored in fp32 (the same numbers)."""
    monkeypatch.setenv("M3_SPARSE_IMPL", "torch")
    kernel = load_kernel()
    g = torch.Generator().manual_seed(1)
    page, dim, heads, block, topk = 16, 128, 4, 16, 8
    kv_lens, q_lens = [900, 400, 37], [48, 1, 37]
    cache, tables = paged_keys(g, kv_lens, page, dim)
    cu, kv = varlen(q_lens, kv_lens)
    iq = torch.randn(sum(q_lens), heads, dim, generator=g)
    codes, scales = quantize_index_keys(cache)

    ref = canon(run_index(kernel, iq, cache, tables, cu, kv, topk, block))
    out = canon(run_index(kernel, iq, codes, tables, cu, kv, topk, block, index_k_scale=scales))
    deq = codes.float() * scales[..., None]
    assert torch.equal(out, canon(run_index(kernel, iq, deq, tables, cu, kv, topk, block)))

    rows_differ = swaps = 0
    gaps, tols, bad = [], [], []
    t = 0
    for b, (kvb, n) in enumerate(zip(kv_lens, q_lens)):
        keys = logical_keys(cache, tables, b, kvb, page)
        sc = logical_keys(scales[..., None], tables, b, kvb, page)[:, 0]
        for i in range(n):
            pos = kvb - n + i
            q = iq[t]
            S = block_scores(q, keys, pos, block)  # [H, nb] exact
            # Per-key bound E, then its max per block.
            e = E4M3_REL * (q.abs().double() @ keys[: pos + 1].abs().double().T)
            e = e + E4M3_SUB_ABS * sc[: pos + 1].double()[None, :] * q.abs().sum(-1).double()[:, None]
            e = e * (1 + FP32_SLACK) + FP32_SLACK * (q.abs().double() @ keys[: pos + 1].abs().double().T)
            nb = S.shape[1]
            E = torch.nn.functional.pad(e, (0, nb * block - (pos + 1))).view(heads, nb, block).amax(-1)
            for h in range(heads):
                extra, missing = swapped_pairs(out[t, h], ref[t, h])
                if not extra and not missing:
                    continue
                rows_differ += 1
                swaps += len(extra)
                sd = float(S[h, : max(1, pos // block)].std()) if pos // block > 1 else 1.0
                if len(extra) != len(missing):
                    bad.append(f"token {t} head {h}: {len(extra)} extra vs {len(missing)} missing ids")
                for a in extra:
                    for m in missing:
                        gap, tol = float(S[h, m] - S[h, a]), float(E[h, a] + E[h, m])
                        gaps.append(gap / sd)
                        tols.append(tol / sd)
                        if gap > tol:
                            bad.append(f"token {t} head {h}: block {a} replaced {m}, gap {gap:.4g} > tol {tol:.4g}")
            t += 1
    rows = out.shape[0] * heads
    gaps_t = torch.tensor(gaps) if gaps else torch.zeros(1)
    tols_t = torch.tensor(tols) if tols else torch.zeros(1)
    # Reported, in units of the row's block-score standard deviation.
    print(
        f"\nfp8 vs fp32 keys: {rows_differ}/{rows} rows differ, {swaps} swapped blocks, "
        f"gap/sd median {float(gaps_t.median()):.3f} max {float(gaps_t.max()):.3f}, "
        f"tolerance/sd median {float(tols_t.median()):.3f}"
    )
    assert not bad, f"{len(bad)} swap(s) beyond the quantization tolerance; first: {bad[0]}"
    # Most rows keep their exact selection; a wholesale change would mean a broken path.
    assert rows_differ <= rows // 4, f"{rows_differ}/{rows} rows differ"


def test_fp8_argument_errors():
    kernel = load_kernel()
    g = torch.Generator().manual_seed(2)
    cache, tables = paged_keys(g, [40], 16, 16)
    cu, kv = varlen([3], [40])
    iq = torch.randn(3, 2, 16, generator=g)
    codes, scales = quantize_index_keys(cache)
    ok = dict(topk=2, block=16)
    with pytest.raises(ValueError, match="index_k_scale: required"):
        run_index(kernel, iq, codes, tables, cu, kv, **ok)
    with pytest.raises(ValueError, match="index_k_scale: only an fp8"):
        run_index(kernel, iq, cache, tables, cu, kv, **ok, index_k_scale=scales)
    with pytest.raises(ValueError, match="index_k_scale: expected shape"):
        run_index(kernel, iq, codes, tables, cu, kv, **ok, index_k_scale=scales[:, :8])
    with pytest.raises(ValueError, match="index_k_scale: expected dtype"):
        run_index(kernel, iq, codes, tables, cu, kv, **ok, index_k_scale=scales.half())
    with pytest.raises(ValueError, match="index_k_scale: expected shape"):
        run_index(kernel, iq, codes, tables, cu, kv, **ok, index_k_scale=scales[..., None])
    with pytest.raises(ValueError, match=r"index_k_scale: expected shape .*per-tensor \(1,\)"):
        run_index(kernel, iq, codes, tables, cu, kv, **ok, index_k_scale=torch.ones(2))
    with pytest.raises(ValueError, match="index_k_scale: expected dtype"):
        run_index(kernel, iq, codes, tables, cu, kv, **ok, index_k_scale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="index_k_scale: expected a torch.Tensor"):
        run_index(kernel, iq, codes, tables, cu, kv, **ok, index_k_scale=0.5)
    with pytest.raises(ValueError, match="index_k_scale: only an fp8"):
        run_index(kernel, iq, cache, tables, cu, kv, **ok, index_k_scale=torch.ones(1))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="index_k_scale: a per-tensor scale must be positive and finite"):
            run_index(kernel, iq, codes, tables, cu, kv, **ok, index_k_scale=torch.full((1,), bad))
    with pytest.raises(ValueError, match="index_k_scale: expected a tensor on cpu"):
        run_index(kernel, iq, codes, tables, cu, kv, **ok, index_k_scale=scales.to("meta"))
    with pytest.raises(ValueError, match="fp8_dot: only applies"):
        run_index(kernel, iq, cache, tables, cu, kv, **ok, fp8_dot=True)
    with pytest.raises(ValueError, match="fp8_dot: expected a bool"):
        run_index(kernel, iq, codes, tables, cu, kv, **ok, index_k_scale=scales, fp8_dot=1)
    with pytest.raises(ValueError, match="index_k_cache: expected dtype"):
        run_index(kernel, iq, cache.to(torch.float8_e5m2), tables, cu, kv, **ok)


@pytest.mark.parametrize("page", [16, 32])
def test_triton_fp8_equals_torch_fp8(monkeypatch, page):
    """The Triton kernel (CPU interpreter here) on the same codes and scales selects
    what the torch path selects; only blocks whose dequantized scores are equal up to
    fp32 rounding (the two paths sum in a different order) may swap."""
    kernel = load_kernel()
    g = torch.Generator().manual_seed(3)
    dim, heads, block, topk = 32, 2, 16, 4
    kv_lens, q_lens = [200, 130], [6, 1]
    cache, tables = paged_keys(g, kv_lens, page, dim)
    cu, kv = varlen(q_lens, kv_lens)
    iq = torch.randn(sum(q_lens), heads, dim, generator=g)
    codes, scales = quantize_index_keys(cache)
    args = [t.to(DEV) for t in (iq, codes, tables, cu, kv)]
    monkeypatch.setenv("M3_SPARSE_IMPL", "torch")
    ref = canon(run_index(kernel, *args, topk, block, index_k_scale=scales.to(DEV)).cpu())
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    out = canon(run_index(kernel, *args, topk, block, index_k_scale=scales.to(DEV)).cpu())
    deq = codes.float() * scales[..., None]
    t = 0
    for b, (kvb, n) in enumerate(zip(kv_lens, q_lens)):
        keys = logical_keys(deq, tables, b, kvb, page)
        for i in range(n):
            S = block_scores(iq[t], keys, kvb - n + i, block)
            for h in range(heads):
                extra, missing = swapped_pairs(out[t, h], ref[t, h])
                assert len(extra) == len(missing)
                for a in extra:
                    for m in missing:
                        sa, sm = float(S[h, a]), float(S[h, m])
                        assert abs(sa - sm) <= 1e-4 * (1 + max(abs(sa), abs(sm))), (t, h, a, m, sa, sm)
            t += 1


@pytest.mark.parametrize("shape", [(1,), ()])
def test_per_tensor_scale_is_a_filled_per_token_scale(monkeypatch, shape):
    """One scale for the cache (shape (1,) or ()) selects exactly what the same value
    given per token selects, on the torch path and on the Triton path (which never reads
    a per-tensor scale)."""
    kernel = load_kernel()
    g = torch.Generator().manual_seed(6)
    dim, heads, block, topk, page = 32, 2, 16, 4, 16
    kv_lens, q_lens = [150, 70], [5, 2]
    cache, tables = paged_keys(g, kv_lens, page, dim)
    cu, kv = varlen(q_lens, kv_lens)
    iq = torch.randn(sum(q_lens), heads, dim, generator=g)
    s = float(cache.abs().max()) / 448.0
    codes = (cache / s).clamp(-448, 448).to(FP8)
    one = torch.full(shape, s)
    filled = torch.full(codes.shape[:2], s)
    args = [t.to(DEV) for t in (iq, codes, tables, cu, kv)]
    monkeypatch.setenv("M3_SPARSE_IMPL", "torch")
    ref = run_index(kernel, *args, topk, block, index_k_scale=filled.to(DEV)).cpu()
    assert torch.equal(run_index(kernel, *args, topk, block, index_k_scale=one.to(DEV)).cpu(), ref)
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    tri_filled = canon(run_index(kernel, *args, topk, block, index_k_scale=filled.to(DEV)).cpu())
    tri_one = canon(run_index(kernel, *args, topk, block, index_k_scale=one.to(DEV)).cpu())
    # Scores differ only by the factor s, applied or not, so only fp32 near-ties can differ.
    assert float((tri_one != tri_filled).any(-1).float().mean()) <= 0.05
    assert float((tri_one != canon(ref)).any(-1).float().mean()) <= 0.05


# ---------------------------------------------------------------------------------------
# the cache option and the model
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sparse_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-fp8")
    save_tiny_text_model(path, seed=0)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse").eval()


def test_cache_rejects_bad_options(sparse_model):
    cfg = sparse_model.config
    for bad in (torch.float16, torch.bfloat16, torch.float8_e5m2, "fp8"):
        with pytest.raises(ValueError, match="index_key_dtype"):
            M3PagedCache(cfg, 1, 64, index_key_dtype=bad)
    with pytest.raises(ValueError, match="index_fp8_dot: needs"):
        M3PagedCache(cfg, 1, 64, index_fp8_dot=True)
    with pytest.raises(ValueError, match="index_fp8_dot: expected a bool"):
        M3PagedCache(cfg, 1, 64, index_key_dtype=FP8, index_fp8_dot="yes")
    with pytest.raises(ValueError, match="index_k_scale: a scale of fp8 index keys"):
        M3PagedCache(cfg, 1, 64, index_k_scale=0.1)
    for bad in (0.0, -1.0, float("nan"), True, "0.1", 1e39, 1e-40):
        with pytest.raises(ValueError, match="index_k_scale: expected a positive finite float32"):
            M3PagedCache(cfg, 1, 64, index_key_dtype=FP8, index_k_scale=bad)


def test_cache_stores_quantized_keys_where_the_plain_cache_stores_keys(sparse_model):
    """One prefill (left padded, so the scratch page is used too) into a plain and an
    fp8 cache: the first sparse layer's fp8 pool dequantizes to the plain pool within
    the e4m3 bound, slot for slot. (Its index keys come straight from the embeddings;
    a later layer's depend on earlier selections, which fp8 may change.)"""
    g = torch.Generator().manual_seed(4)
    ids = torch.zeros(2, 50, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = random_prompt(50, g), 1
    ids[1, 10:], mask[1, 10:] = random_prompt(40, g), 1
    caches = {}
    for name, dtype in (("plain", None), ("fp8", FP8)):
        caches[name] = M3PagedCache(sparse_model.config, 2, 64, page_size=16, index_key_dtype=dtype)
        with torch.no_grad():
            sparse_model(input_ids=ids, attention_mask=mask, past_key_values=caches[name], use_cache=True)
    plain, fp8 = caches["plain"].layer(0), caches["fp8"].layer(0)
    deq = fp8.index_keys.float() * fp8.index_scales[..., None]
    bound = E4M3_REL * plain.index_keys.abs() + E4M3_SUB_ABS * fp8.index_scales[..., None]
    assert bool(((deq - plain.index_keys).abs() <= bound * (1 + 1e-6)).all())
    tiny = torch.finfo(torch.float32).tiny
    for layer_idx in (0, 2):
        fp8 = caches["fp8"].layer(layer_idx)
        assert fp8.index_keys.dtype == FP8 and fp8.index_scales.shape == fp8.index_keys.shape[:2]
        assert fp8.index_scales.dtype == torch.float32
        # The 10 leading pads (zero embeddings, so zero keys) went to the scratch page,
        # with the smallest scale rather than 0; the 90 real tokens fill the range.
        assert torch.equal(fp8.index_scales[-1, :10], torch.full((10,), tiny))
        real = fp8.index_scales > tiny
        assert int(real.sum()) == 50 + 40
        assert torch.equal(fp8.index_keys.float().abs().amax(-1)[real], torch.full((90,), 448.0))
    assert caches["fp8"].layer(1).index_scales is None  # full-attention layer: no index keys
    caches["fp8"].reset()
    layer = caches["fp8"].layer(0)
    assert not bool(layer.index_scales.any()) and not bool(layer.index_keys.float().any())


def test_cache_with_one_index_scale(sparse_model, monkeypatch):
    """index_k_scale: codes are k / scale saturated at 448, the pool keeps one scale (which
    a reset leaves alone), every index call gets it, and generation runs."""
    g = torch.Generator().manual_seed(7)
    ids = random_prompt(40, g)[None]
    plain = M3PagedCache(sparse_model.config, 1, 48, page_size=16)
    with torch.no_grad():
        sparse_model(input_ids=ids, past_key_values=plain, use_cache=True)
    keys = plain.layer(0).index_keys.float()
    scale = float(keys.abs().max()) / 600.0  # the largest keys saturate at 448
    cache = M3PagedCache(sparse_model.config, 1, 48, page_size=16, index_key_dtype=FP8, index_k_scale=scale)
    with torch.no_grad():
        sparse_model(input_ids=ids, past_key_values=cache, use_cache=True)
    layer = cache.layer(0)
    assert layer.index_scales.shape == (1,) and float(layer.index_scales) == pytest.approx(scale)
    want = (keys / scale).clamp(-448, 448).to(FP8)
    assert torch.equal(layer.index_keys.float(), want.float())
    assert bool((layer.index_keys.float().abs() == 448).any())
    cache.reset()
    assert float(cache.layer(0).index_scales) == pytest.approx(scale)
    kernel = load_kernel()
    seen = []
    spy_op_calls(
        kernel.api, monkeypatch, lambda name, kw: name == "index_topk" and seen.append(kw.get("index_k_scale"))
    )
    cache = M3PagedCache(sparse_model.config, 1, 48, index_key_dtype=FP8, index_k_scale=scale)
    out = greedy(sparse_model, ids, new_tokens=4, past_key_values=cache)
    assert out.shape == (1, 44) and len(seen) == 2 * 4
    assert all(s is cache.layer(i).index_scales for s, i in zip(seen, [0, 2] * 4))


def test_generate_with_fp8_index_cache(sparse_model, monkeypatch):
    g = torch.Generator().manual_seed(5)
    ids = random_prompt(70, g)[None]
    new = 8
    cache = M3PagedCache(sparse_model.config, 1, 70 + new, index_key_dtype=FP8)
    kernel = load_kernel()
    seen = []
    spy_op_calls(
        kernel.api, monkeypatch,
        lambda name, kw: name == "index_topk" and seen.append((kw.get("index_k_scale"), kw.get("fp8_dot"))),
    )
    out = greedy(sparse_model, ids, new_tokens=new, past_key_values=cache)
    assert out.shape == (1, 70 + new)
    # Two sparse layers, one call each per step; every call gets its layer's scale pool.
    assert len(seen) == 2 * new
    pools = {id(cache.layer(i).index_scales) for i in (0, 2)}
    assert all(id(s) in pools and dot is False for s, dot in seen)
    layer = cache.layer(0)
    assert layer.index_keys.dtype == FP8
    bf16_bytes = layer.index_keys.numel() * torch.tensor([], dtype=torch.bfloat16).element_size()
    assert layer.index_keys.nbytes * 2 == bf16_bytes
    # The scale adds 4 bytes per token against the 2 * Di bytes saved.
    assert layer.index_scales.nbytes == layer.index_keys.shape[0] * layer.index_keys.shape[1] * 4
    plain = greedy(sparse_model, ids, new_tokens=new)
    agree = sum(int(a == b) for a, b in zip(out[0, 70:].tolist(), plain[0, 70:].tolist()))
    print(f"\nfp8 index cache: {agree}/{new} generated tokens equal to the model-dtype cache's")


def test_model_fp8_dot_reaches_the_triton_kernel(tmp_path, monkeypatch):
    """index_fp8_dot is handed to the kernel, and the Triton path (interpreter) runs the
    model with fp8 index keys; without fp8_dot its logits equal the torch path's."""
    # Index head dim 32: the smallest the fp8 tensor-core dot takes.
    save_tiny_text_model(tmp_path, seed=3, index_block_size=16, index_topk_blocks=2, index_head_dim=32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="m3_sparse").eval().to(DEV)
    ids = random_prompt(70, torch.Generator().manual_seed(6))[None].to(DEV)
    kernel = load_kernel()
    seen = []
    spy_op_calls(kernel.api, monkeypatch, lambda name, kw: name == "index_topk" and seen.append(kw.get("fp8_dot")))

    def logits(impl, dot=False):
        monkeypatch.setenv("M3_SPARSE_IMPL", impl)
        cache = M3PagedCache(
            model.config, 1, 72, page_size=16, device=DEV, index_key_dtype=FP8, index_fp8_dot=dot
        )
        with torch.no_grad():
            return model(input_ids=ids, past_key_values=cache, use_cache=True).logits

    torch.testing.assert_close(logits("triton"), logits("torch"), atol=2e-4, rtol=0)
    dot = logits("triton", dot=True)
    assert bool(torch.isfinite(dot).all())
    assert seen == [False] * 4 + [True] * 2


def test_fp8_dot_needs_index_head_dim_32(tmp_path):
    """The fp8 MMA reduces over >= 32 elements: a smaller index head dim is refused by the
    op and by the cache option, on every device, instead of failing to compile on a GPU."""
    kernel = load_kernel()
    g = torch.Generator().manual_seed(0)
    cache, tables = paged_keys(g, [40], 16, 16)
    cu, kv = varlen([3], [40])
    codes, scales = quantize_index_keys(cache)
    iq = torch.randn(3, 2, 16, generator=g)
    with pytest.raises(ValueError, match="fp8_dot: the fp8 tensor-core dot needs an index head dim of at least 32, got 16"):
        run_index(kernel, iq, codes, tables, cu, kv, 2, 16, index_k_scale=scales, fp8_dot=True)
    config = save_tiny_text_model(tmp_path, seed=0)  # index_head_dim 16
    with pytest.raises(ValueError, match="index_fp8_dot: the fp8 tensor-core dot needs an index head dim of at least 32"):
        M3PagedCache(config, 1, 64, page_size=16, index_key_dtype=FP8, index_fp8_dot=True)
