"""The dense op's flash-attn-4 path: which kernel runs a call, the page-tail kernel, the
argument plumbing, and (on a GPU with flash-attn-4) its results against the float64 oracle.

On the CPU the tail kernel runs in Triton's interpreter, and the plumbing runs against a
stand-in for ``flash_attn_varlen_func`` written from flash-attn-4's documented contract
(its own layout ``[pages, page_size, Hkv, D]``, int32 tables, ``seqused_k``, causal masks
aligned to the end of the keys, lse ``[Hq, Tq]``), so a wrong view or argument fails
without a GPU. The ``gpu`` tests run flash-attn-4 itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernel_test_utils import TOLERANCES, assert_close, gen, kernel_module, make_batch, randn  # noqa: E402
import m3_sparse  # noqa: E402
from m3_sparse import DenseConfig  # noqa: E402
from m3_sparse.core.validate import attention_args  # noqa: E402
from m3_sparse.dense import attention_fa4  # noqa: E402
from m3_sparse.dense.tails import clear_page_tails_torch  # noqa: E402
from m3_sparse.reference import dense_attention_ref  # noqa: E402

tails_triton = kernel_module("m3_sparse.dense.tails_triton")

DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
SCALE = 0.3
NAN = float("nan")
# (kv_len, q_len): chunked prefill, full prefill, decode rows, a page-aligned length, an
# empty sequence, rows before the first key, a query-less sequence.
RAGGED = [(37, 5), (21, 21), (23, 1), (32, 1), (0, 0), (3, 7), (70, 0), (130, 2)]


def _fa4_ready() -> str | None:
    if not HAS_CUDA:
        return "needs a CUDA device"
    from m3_sparse.core.launch import device_capability  # M3_SPARSE_CAPABILITY when acting as another GPU

    if device_capability(torch.cuda.current_device())[0] not in attention_fa4.ARCHS:
        return "flash-attn-4 runs on sm_90 / sm_100 here"
    if attention_fa4.varlen_function() is None:
        return "flash-attn-4 is not installed"
    return None


needs_fa4 = pytest.mark.skipif(_fa4_ready() is not None, reason=str(_fa4_ready()))


def _problem(seed, seqs, page_size, hq, hkv, d, dtype, garbage=NAN, pad=-1):
    g = gen(seed)
    batch = make_batch(g, seqs, page_size, pad=pad)
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k = batch.kv_cache(g, hkv, d, dtype, garbage=garbage)
    v = batch.kv_cache(g, hkv, d, dtype, garbage=garbage)
    return batch, q, k, v


def _args(batch, q, k, v, causal=True, device=DEVICE):
    return attention_args(
        q.to(device), k.to(device), v.to(device), batch.block_tables.to(device),
        cu_seqlens_q=batch.cu_seqlens_q.to(device), used_kv_lens=batch.used_kv_lens.to(device),
        softmax_scale=SCALE, causal=causal, return_lse=True, sparse=False, max_seqlen_q=max(batch.q_lens),
    )


# --------------------------------------------------------------------------- the choice
def _as_cuda(args, monkeypatch, major):
    """``args`` with q standing in for a CUDA tensor on an sm_{major}0 GPU (host facts only)."""
    monkeypatch.setattr(attention_fa4, "device_capability", lambda index: (major, 0))
    monkeypatch.setattr(attention_fa4, "device_index", lambda device: 0)
    fake_q = type("Q", (), {})()
    for name in ("dtype", "shape", "stride", "data_ptr", "element_size"):
        setattr(fake_q, name, getattr(args.q, name))
    fake_q.device = type("T", (), {"type": "cuda"})()
    return args.replace(q=fake_q)


def test_pinned_fa4_that_cannot_run_raises(monkeypatch):
    batch, q, k, v = _problem(1, [(20, 3)], 16, 8, 2, 32, torch.float32, garbage=1.0)
    call = dict(cu_seqlens_q=batch.cu_seqlens_q, used_kv_lens=batch.used_kv_lens)
    with pytest.raises(ValueError, match=r"impl='fa4': flash-attn-4 runs on CUDA tensors"):
        m3_sparse.dense_paged_attention(q, k, v, batch.block_tables, **call, config=DenseConfig(impl="fa4"))
    monkeypatch.setenv("M3_SPARSE_DENSE_IMPL", "fa4")
    with pytest.raises(ValueError, match=r"M3_SPARSE_DENSE_IMPL=fa4: flash-attn-4 runs on CUDA tensors"):
        m3_sparse.dense_paged_attention_kernel(q, k, v, batch.block_tables, **call)
    monkeypatch.setenv("M3_SPARSE_DENSE_IMPL", "flash")
    with pytest.raises(ValueError, match=r"M3_SPARSE_DENSE_IMPL: expected one of"):
        m3_sparse.dense_paged_attention(q, k, v, batch.block_tables, **call)
    monkeypatch.setenv("M3_SPARSE_DENSE_IMPL", "torch")
    assert m3_sparse.dense_paged_attention_kernel(q, k, v, batch.block_tables, **call) == "torch"
    with pytest.raises(ValueError, match=r"impl: expected one of"):
        m3_sparse.dense_paged_attention_kernel(q, k, v, batch.block_tables, **call, config=DenseConfig(impl="fa3"))


def test_cpu_calls_run_torch_unpinned():
    batch, q, k, v = _problem(2, [(20, 3)], 16, 8, 2, 32, torch.bfloat16, garbage=1.0)
    kernel = m3_sparse.dense_paged_attention_kernel(
        q, k, v, batch.block_tables, cu_seqlens_q=batch.cu_seqlens_q, used_kv_lens=batch.used_kv_lens
    )
    assert kernel == "torch"


def test_reasons_name_what_flash_attn_4_does_not_take(monkeypatch):
    batch, q, k, v = _problem(3, [(20, 3)], 16, 8, 2, 32, torch.bfloat16, garbage=1.0)
    args = _args(batch, q, k, v, device=torch.device("cpu"))
    assert "CUDA tensors" in attention_fa4.unsupported_reason(args)
    # The device-independent rules, on stand-ins for CUDA calls.
    monkeypatch.setattr(attention_fa4, "varlen_function", lambda: None)
    assert "not installed" in attention_fa4.unsupported_reason(_as_cuda(args, monkeypatch, 9))
    monkeypatch.setattr(attention_fa4, "varlen_function", lambda: object())
    assert "sm_120" in attention_fa4.unsupported_reason(_as_cuda(args, monkeypatch, 12))
    fp32 = args.replace(q=args.q.float(), k_cache=args.k_cache.float())
    assert "bfloat16 or float16" in attention_fa4.unsupported_reason(_as_cuda(fp32, monkeypatch, 9))
    base = _as_cuda(args, monkeypatch, 9)
    assert attention_fa4.unsupported_reason(base) is None
    # A misaligned pool would be copied whole by flash-attn-4 on every call: refused.
    odd = torch.empty(args.k_cache.numel() + 1, dtype=args.k_cache.dtype)[1:].view(args.k_cache.shape)
    assert "16-byte aligned" in attention_fa4.unsupported_reason(base.replace(k_cache=odd))


def test_fa4_rule_wants_a_full_grid(monkeypatch):
    from m3_sparse.dense import plan as dense_plan

    monkeypatch.setattr(dense_plan, "num_sms", lambda device, cpu_default: 132)
    prefill = _args(*_problem(4, [(600, 600)], 16, 64, 4, 32, torch.bfloat16, garbage=1.0), device=torch.device("cpu"))
    assert dense_plan.fa4_programs(prefill) == 4 * (600 * 16 // 128) and dense_plan.prefers_fa4(prefill)
    # Decode rows go to the Triton kernel however large the batch (measured faster there).
    decode = _args(*_problem(4, [(40, 1)] * 160, 16, 64, 4, 32, torch.bfloat16, garbage=1.0), device=torch.device("cpu"))
    assert dense_plan.fa4_programs(decode) == 640 and not dense_plan.prefers_fa4(decode)
    # Rows that fill a tile, but too few programs for the GPU.
    small = _args(*_problem(4, [(40, 8)] * 8, 16, 64, 4, 32, torch.bfloat16, garbage=1.0), device=torch.device("cpu"))
    assert dense_plan.fa4_programs(small) == 32 and not dense_plan.prefers_fa4(small)
    wide = _args(*_problem(4, [(40, 8)] * 32, 16, 64, 4, 32, torch.bfloat16, garbage=1.0), device=torch.device("cpu"))
    assert dense_plan.fa4_programs(wide) == 128 and dense_plan.prefers_fa4(wide)


# --------------------------------------------------------------------------- page tails
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_clear_page_tails_matches_torch(page_size, index_dtype):
    seqs = [(37, 1), (32, 1), (0, 0), (1, 1), (70, 2), (15, 1)]
    batch, _, k, v = _problem(page_size, seqs, page_size, 4, 2, 24, torch.bfloat16, garbage=NAN)
    tables, lens = batch.block_tables.to(index_dtype), batch.used_kv_lens.to(index_dtype)
    want_k, want_v = k.clone(), v.clone()
    clear_page_tails_torch(want_k, want_v, tables, lens)
    got_k, got_v = k.to(DEVICE), v.to(DEVICE)
    tails_triton.clear_page_tails(got_k, got_v, tables.to(DEVICE), lens.to(DEVICE))
    for want, got in ((want_k, got_k.cpu()), (want_v, got_v.cpu())):
        assert torch.equal(torch.isnan(want), torch.isnan(got))
        assert torch.equal(want.nan_to_num(7.0), got.nan_to_num(7.0))
    # The oracle itself: tails are zero, every token and every other page as it was.
    for b, n in enumerate(batch.kv_lens):
        if n % page_size:
            page = int(batch.block_tables[b, (n - 1) // page_size])
            assert torch.all(want_k[page, :, n % page_size :] == 0)
            assert torch.equal(want_k[page, :, : n % page_size], k[page, :, : n % page_size])
    untouched = torch.ones(k.shape[0], dtype=torch.bool)
    for b, n in enumerate(batch.kv_lens):
        if n % page_size:
            untouched[int(batch.block_tables[b, (n - 1) // page_size])] = False
    assert torch.equal(want_k[untouched].nan_to_num(7.0), k[untouched].nan_to_num(7.0))


# --------------------------------------------------------------------------- plumbing
def _contract_fa4(q, k, v, *, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, softmax_scale, causal, return_lse,
                  q_descale=None, k_descale=None, v_descale=None):
    """flash-attn-4's varlen paged forward in plain torch and its own layout: k / v
    ``[pages, page_size, Hkv, D]``, int32 metadata, rows aligned to the end of the keys under
    ``causal``, every row seeing every key without it (also rows before the sequence's first
    key, as measured on the H200). A row that sees no key gets zeros and a non-finite lse
    (+inf here: the code under test must not rely on its sign). fp8 (its ``_flash_attn_fwd``):
    q, k and v all e4m3, each with float32 descales ``[B, Hkv]`` that multiply its values,
    bfloat16 out. Returns (out, lse [Hq, Tq])."""
    for t in (cu_seqlens_q, seqused_k, page_table):
        assert t.dtype == torch.int32
    pages, page_size, hkv, d = k.shape
    hq = q.shape[1]
    fp8 = v.dtype == torch.float8_e4m3fn
    assert q.dtype == k.dtype == v.dtype
    descales = (q_descale, k_descale, v_descale)
    if fp8:
        for t in descales:
            assert t.dtype == torch.float32 and t.shape == (seqused_k.shape[0], hkv) and t.is_contiguous()
    else:
        assert descales == (None, None, None)
    out = torch.zeros(q.shape, dtype=torch.bfloat16 if fp8 else q.dtype)
    lse = torch.full((hq, q.shape[0]), float("inf"))
    cu = cu_seqlens_q.tolist()
    assert max_seqlen_q >= max(b - a for a, b in zip(cu, cu[1:]))
    for b, n in enumerate(seqused_k.tolist()):
        rows = range(cu[b], cu[b + 1])
        if not rows or n == 0:
            continue
        ids = page_table[b, : -(-n // page_size)].long()
        keys = k[ids].reshape(-1, hkv, d)[:n].float()  # [n, Hkv, D]
        vals = v[ids].reshape(-1, hkv, d)[:n].float()
        qq = q[cu[b] : cu[b + 1]].float().view(len(rows), hkv, hq // hkv, d)
        if fp8:
            qq = qq * q_descale[b][None, :, None, None]
            keys, vals = keys * k_descale[b][None, :, None], vals * v_descale[b][None, :, None]
        s = torch.einsum("rhgd,nhd->rhgn", qq, keys) * softmax_scale
        if causal:
            last = torch.arange(len(rows)) + n - len(rows)  # each row's last visible key
            s = s.masked_fill((torch.arange(n)[None, :] > last[:, None])[:, None, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        seen = torch.isfinite(m)
        p = torch.exp(s - torch.where(seen, m, 0.0))
        l = p.sum(-1, keepdim=True)
        o = torch.einsum("rhgn,nhd->rhgd", p, vals) / torch.where(seen, l, 1.0)
        out[cu[b] : cu[b + 1]] = o.reshape(len(rows), hq, d).to(out.dtype)
        row_lse = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("inf"))
        lse[:, cu[b] : cu[b + 1]] = row_lse.reshape(len(rows), hq).T
    return out, (lse if return_lse else None)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_plumbing_against_the_measured_contract(monkeypatch, causal):
    seqs = [(37, 5), (21, 21), (23, 1), (32, 1), (3, 7), (0, 2), (130, 2)]
    batch, q, k, v = _problem(11, seqs, 16, 8, 2, 32, torch.float32, garbage=NAN)
    pool_k, pool_v = k.clone(), v.clone()
    seen = {}

    def fake(q_, k_, v_, **kw):
        # The pools go in as views of the caller's storage, never copies.
        seen["k_is_view"] = k_.data_ptr() == pool_k.data_ptr() and k_.shape == (k.shape[0], 16, 2, 32)
        seen["v_is_view"] = v_.data_ptr() == pool_v.data_ptr()
        return _contract_fa4(q_, k_, v_, **kw)

    monkeypatch.setattr(attention_fa4, "varlen_function", lambda: fake)
    args = attention_args(
        q, pool_k, pool_v, batch.block_tables.long(), cu_seqlens_q=batch.cu_seqlens_q.long(),
        used_kv_lens=batch.used_kv_lens.long(), softmax_scale=SCALE, causal=causal, return_lse=True, sparse=False,
    )
    out, lse = attention_fa4.run_dense_fa4(args)
    assert seen == {"k_is_view": True, "v_is_view": True}
    ref_o, ref_lse = dense_attention_ref(q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, SCALE, causal)
    assert_close("out vs oracle", ref_o, out, TOLERANCES[torch.float32])
    assert_close("lse vs oracle", ref_lse, lse, TOLERANCES[torch.float32])


FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.02  # distinct, so a swapped descale shows


def _fp8_args(seed, seqs, q_dtype=torch.bfloat16, causal=True, device=torch.device("cpu"), **kw):
    """An fp8-cache call (q in ``q_dtype``), its pools and batch."""
    batch, q, k, v = _problem(seed, seqs, 16, 8, 2, 32, torch.float32, garbage=NAN)
    k8, v8 = (k / K_SCALE).to(FP8), (v / V_SCALE).to(FP8)
    q_scale = {} if q_dtype != FP8 else {"q_scale": 0.03}
    qq = (q / 0.03).to(FP8) if q_dtype == FP8 else q.to(q_dtype)
    args = attention_args(
        qq.to(device), k8.to(device), v8.to(device), batch.block_tables.to(device),
        cu_seqlens_q=batch.cu_seqlens_q.to(device), used_kv_lens=batch.used_kv_lens.to(device), softmax_scale=SCALE,
        causal=causal, return_lse=True, sparse=False, k_scale=K_SCALE, v_scale=V_SCALE, **q_scale, **kw,
    )
    return batch, args


def test_fp8_reasons(monkeypatch):
    _, args = _fp8_args(5, [(20, 3)])
    monkeypatch.setattr(attention_fa4, "fp8_function", lambda: object())
    assert "sm_100 only, this GPU is sm_90" in attention_fa4.unsupported_reason(_as_cuda(args, monkeypatch, 9))
    assert attention_fa4.unsupported_reason(_as_cuda(args, monkeypatch, 10)) is None
    _, fp8_q = _fp8_args(5, [(20, 3)], q_dtype=FP8)
    assert attention_fa4.unsupported_reason(_as_cuda(fp8_q, monkeypatch, 10)) is None
    _, f32_out = _fp8_args(5, [(20, 3)], out_dtype=torch.float32)
    assert "write bfloat16" in attention_fa4.unsupported_reason(_as_cuda(f32_out, monkeypatch, 10))
    _, f32_q = _fp8_args(5, [(20, 3)], q_dtype=torch.float32)
    assert "float8_e4m3fn q, got q torch.float32" in attention_fa4.unsupported_reason(_as_cuda(f32_q, monkeypatch, 10))
    monkeypatch.setattr(attention_fa4, "fp8_function", lambda: None)
    assert "not installed" in attention_fa4.unsupported_reason(_as_cuda(args, monkeypatch, 10))


def test_fp8_goes_to_fa4_only_when_pinned(monkeypatch):
    from m3_sparse import dispatch
    from m3_sparse.dense import plan as dense_plan

    _, args = _fp8_args(6, [(300, 300)])
    monkeypatch.setattr(attention_fa4, "fp8_function", lambda: object())
    monkeypatch.setattr(dense_plan, "prefers_fa4", lambda a: True)
    monkeypatch.setattr(dispatch, "use_triton", lambda *a: True)
    cuda_args = _as_cuda(args, monkeypatch, 10)
    assert dispatch.dense_kernel(cuda_args, DenseConfig()) == "triton"
    assert dispatch.dense_kernel(cuda_args, DenseConfig(impl="fa4")) == "fa4"


def test_quantize_q_stays_in_range():
    _, args = _fp8_args(7, [(40, 9), (17, 17)])
    q8, scale = attention_fa4.quantize_q(args)
    assert q8.dtype == FP8 and scale.dtype == torch.float32 and scale.ndim == 0
    back = q8.float() * scale
    assert torch.isfinite(back).all()
    assert float(q8.float().abs().max()) <= attention_fa4.E4M3_MAX
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, plus the smallest step near 0.
    err = (back - args.q.float()).abs()
    assert bool((err <= args.q.float().abs() / 16 + scale * 2**-9).all())
    _, given = _fp8_args(7, [(40, 9)], q_dtype=FP8)
    q8, scale = attention_fa4.quantize_q(given)
    assert q8 is given.q and float(scale) == pytest.approx(0.03)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8], ids=["bf16_q", "fp8_q"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fp8_plumbing_against_the_contract(monkeypatch, q_dtype, causal):
    seqs = [(37, 5), (21, 21), (23, 1), (0, 2), (3, 7), (130, 2)]
    batch, args = _fp8_args(12, seqs, q_dtype=q_dtype, causal=causal)
    def fake(q_, k_, v_, **kw):  # _flash_attn_fwd returns (out, lse, and more)
        return (*_contract_fa4(q_, k_, v_, **kw), None)

    monkeypatch.setattr(attention_fa4, "fp8_function", lambda: fake)
    out, lse = attention_fa4.run_dense_fa4(args)
    assert out.dtype == torch.bfloat16
    # The oracle on the values flash-attn-4 is given: q as quantized here, K / V dequantized.
    q8, q_scale = attention_fa4.quantize_q(args)
    k, v = args.k_cache.float() * K_SCALE, args.v_cache.float() * V_SCALE
    ref_o, ref_lse = dense_attention_ref(q8.float() * q_scale, k, v, batch.block_tables, batch.cu_seqlens_q,
                                         batch.used_kv_lens, SCALE, causal)
    assert_close("out vs oracle", ref_o, out, TOLERANCES[torch.bfloat16])
    assert_close("lse vs oracle", ref_lse, lse, TOLERANCES[torch.float32])


# --------------------------------------------------------------------------- flash-attn-4
def _fa4_call(batch, q, k, v, causal, **kw):
    return m3_sparse.dense_paged_attention(
        q, k, v, batch.block_tables.to(DEVICE), cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE),
        used_kv_lens=batch.used_kv_lens.to(DEVICE), softmax_scale=SCALE, causal=causal, return_lse=True,
        config=DenseConfig(impl="fa4"), **kw,
    )


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("hq,hkv,d", [(64, 4, 128), (16, 2, 64)], ids=["m3", "gqa8-d64"])
def test_fa4_matches_oracle_with_nan_in_unused_slots(hq, hkv, d, page_size, causal, dtype):
    seqs = [(s * page_size // 16, n) for s, n in ((37, 5), (21, 21), (23, 1), (32, 1))] + [(0, 0), (3, 7), (70, 0), (130, 2)]
    batch, q, k, v = _problem(hq + d + page_size + int(causal), seqs, page_size, hq, hkv, d, dtype)
    qd, kd, vd = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    out, lse = _fa4_call(batch, qd, kd, vd, causal, max_seqlen_q=max(batch.q_lens))
    ref_o, ref_lse = dense_attention_ref(q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, SCALE, causal)
    assert_close("out vs oracle", ref_o, out.cpu(), TOLERANCES[dtype])
    assert_close("lse vs oracle", ref_lse, lse.cpu(), TOLERANCES[torch.float32])
    dead = ref_lse.transpose(0, 1) == float("-inf")
    assert torch.all(out.cpu()[dead] == 0)
    # Only the tails changed in the caches (to zeros); every token is as it was.
    want_k, want_v = k.clone(), v.clone()
    clear_page_tails_torch(want_k, want_v, batch.block_tables, batch.used_kv_lens)
    assert torch.equal(want_k.nan_to_num(7.0), kd.cpu().nan_to_num(7.0))
    assert torch.equal(want_v.nan_to_num(7.0), vd.cpu().nan_to_num(7.0))


@pytest.mark.gpu
@needs_fa4
def test_fa4_is_the_default_where_it_runs():
    def kernel(seqs, dtype=torch.bfloat16):
        batch, q, k, v = _problem(5, seqs, 128, 64, 4, 128, dtype)
        return m3_sparse.dense_paged_attention_kernel(
            q.cuda(), k.cuda(), v.cuda(), batch.block_tables.cuda(), cu_seqlens_q=batch.cu_seqlens_q.cuda(),
            used_kv_lens=batch.used_kv_lens.cuda(), max_seqlen_q=max(batch.q_lens),
        )

    assert kernel([(2000, 2000), (300, 40)]) == "fa4"  # a prefill fills the GPU
    assert kernel([(300, 1), (40, 1)]) == "triton"  # a small decode batch: the Triton kernel splits keys
    assert kernel([(2000, 2000)], torch.float32) == "triton"  # fp32: not flash-attn-4's


@pytest.mark.gpu
@needs_fa4
def test_fa4_in_a_cuda_graph_follows_a_decode_step():
    """Recorded before each sequence's last token is in the cache (its slot holds NaN),
    replayed after the token is written and the lengths grow by one, as a decode step."""
    seqs = [(300, 1), (40, 1), (129, 1), (1000, 1)]
    batch, q, k, v = _problem(9, seqs, 128, 64, 4, 128, torch.bfloat16)
    last = [(int(batch.block_tables[b, (n - 1) // 128]), (n - 1) % 128) for b, n in enumerate(batch.kv_lens)]
    tokens = [(k[p, :, s].clone(), v[p, :, s].clone()) for p, s in last]
    qd, kd, vd = q.cuda(), k.cuda(), v.cuda()
    for p, s in last:
        kd[p, :, s], vd[p, :, s] = NAN, NAN
    bt, cu, lens = batch.block_tables.cuda(), batch.cu_seqlens_q.cuda(), batch.used_kv_lens.cuda() - 1

    def step():
        return m3_sparse.dense_paged_attention(
            qd, kd, vd, bt, cu_seqlens_q=cu, used_kv_lens=lens, softmax_scale=SCALE, return_lse=True,
            max_seqlen_q=1, config=DenseConfig(impl="fa4"),
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for (p, s), (tk, tv) in zip(last, tokens):
        kd[p, :, s], vd[p, :, s] = tk.cuda(), tv.cuda()
    lens += 1
    graph.replay()
    torch.cuda.synchronize()
    ref_o, ref_lse = dense_attention_ref(
        q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, SCALE, True
    )
    assert_close("out vs oracle", ref_o, out.cpu(), TOLERANCES[torch.bfloat16])
    assert_close("lse vs oracle", ref_lse, lse.cpu(), TOLERANCES[torch.float32])


@pytest.mark.gpu
def test_fp8_path_compiles_for_sm100(tmp_path):
    """flash-attn-4's fp8 forward for this package's fp8-cache calls, compiled for sm_100a
    (Blackwell) without running it (no sm_100 GPU here): the PTX targets sm_100a and runs its
    QK and PV products on fp8 tensor cores."""
    if attention_fa4.fp8_function() is None:
        pytest.skip("flash-attn-4 is not installed")
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ, CUTE_DSL_ARCH="sm_100a", FLASH_ATTENTION_ARCH="sm_100", FLASH_ATTENTION_NUM_SMS="148",
        CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_NO_CACHE="1",
        PYTHONPATH=os.pathsep.join([str(root / "torch-ext"), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run([sys.executable, str(root / "tests" / "scripts" / "fa4_compile_sm100.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "prefill_bf16_q": {"out": [[8192, 64, 128], "torch.bfloat16"], "lse": [64, 8192]},
        "decode_fp8_q": {"out": [[8, 64, 128], "torch.bfloat16"], "lse": [64, 8]},
    }
    ptx = [p.read_text(errors="replace") for p in tmp_path.rglob("*.ptx")]
    assert ptx, f"no PTX written under {tmp_path}: {sorted(map(str, tmp_path.rglob('*')))[:10]}"
    assert all(".target sm_100a" in text for text in ptx)
    assert all("kind::f8f6f4" in text for text in ptx)
