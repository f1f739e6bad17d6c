"""Attention on fp8 (e4m3) inputs: q and/or the K/V caches in float8_e4m3fn with per-tensor
dequantization scales, output (and KV-outer partials) in bf16/fp16, for every attention op:
``kvouter_attention``, ``sparse_decode_attention``, ``sparse_attention`` (both branches of
its dispatch) and ``dense_paged_attention``.

The oracle is the float64 reference on the dequantized inputs (``x.float() * scale``), so
only the implementation's own rounding counts: P rounded to the partial dtype before P @ V,
partials and output stored in bf16/fp16. Both implementations run: the torch stages and the
Triton kernels (natively on CUDA, in Triton's interpreter on the CPU).
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import m3_sparse  # noqa: E402
from kernel_test_utils import (  # noqa: E402
    TOLERANCES,
    assert_close,
    decode_bound,
    fp8_lse_tol,
    gen,
    is_poisoned,
    kernel_module,
    kvouter_seqs,
    make_batch,
    partial_dtypes,
    poisoned_allocations,
    quantize_e4m3,
    randn,
    random_selection,
    sparse_branches,
)
from m3_sparse.reference import dense_attention_ref, sparse_attention_ref  # noqa: E402

for _name in ("kvouter.partials_triton", "kvouter.combine_triton", "decode.attention_triton", "dense.attention_triton"):
    kernel_module(f"m3_sparse.{_name}")

FP8 = torch.float8_e4m3fn
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
SCALE = 0.25
LSE_TOL = TOLERANCES[torch.float32]
# The oracle sees the dequantized values exactly; P @ V in bf16 and bf16 partials add a few
# bf16 roundings on top of a plain bf16 run.
FP8_TOL = {torch.bfloat16: 2 * TOLERANCES[torch.bfloat16], torch.float16: 2 * TOLERANCES[torch.float16]}
SEQS = [(150, 150), (70, 9), (33, 1), (0, 2), (129, 4)]


def problem(seed, page_size=16, hq=8, hkv=2, d=32, topk=4, block_size=16, causal=True, seqs=SEQS):
    g = gen(seed)
    batch = make_batch(g, seqs, page_size)
    q = randn(g, batch.num_tokens, hq, d)
    k = batch.kv_cache(g, hkv, d)
    v = batch.kv_cache(g, hkv, d)
    sel = random_selection(g, batch, hkv, topk, block_size, causal=causal)
    return batch, q, k, v, sel


OPS = {
    "kvouter": lambda *a, **kw: m3_sparse.kvouter_attention(*a, **kw),
    "decode": lambda *a, **kw: m3_sparse.sparse_decode_attention(*a, **kw),
    # max_seqlen_q below every sequence's rows: the decode branch; above: KV-outer, over a batch
    # with a sequence past the decode bound (problem_seqs).
    "sparse_decode": lambda *a, **kw: m3_sparse.sparse_attention(*a, max_seqlen_q=1, **kw),
    "sparse_kvouter": lambda *a, **kw: m3_sparse.sparse_attention(*a, max_seqlen_q=4096, **kw),
    "dense": lambda q, k, v, sel, bt, block_size, **kw: m3_sparse.dense_paged_attention(q, k, v, bt, **kw),
    "qouter": lambda *a, **kw: m3_sparse.qouter_attention(*a, **kw),
}
SPARSE_BRANCH = {"sparse_decode": "decode", "sparse_kvouter": "kvouter"}


def problem_seqs(op, q_dtype, page_size=16):
    """SEQS, or for "sparse_kvouter" a batch with one sequence past the decode bound of such
    inputs (SEQS alone runs the decode kernel)."""
    if op != "sparse_kvouter":
        return SEQS
    return kvouter_seqs(decode_bound(8, 2, 32, q_dtype, FP8, page_size=page_size, device=DEVICE))


def run(batch, q, k, v, sel, impl, monkeypatch, block_size=16, causal=True, op="kvouter", **kw):
    monkeypatch.setenv("M3_SPARSE_IMPL", impl)
    args = [x.to(DEVICE) for x in (q, k, v, sel, batch.block_tables)]
    if op != "kvouter":
        kw.pop("max_workspace_bytes", None)
    ran = sparse_branches(monkeypatch)
    with poisoned_allocations():
        out, lse = OPS[op](
            *args,
            cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE),
            used_kv_lens=batch.used_kv_lens.to(DEVICE),
            softmax_scale=SCALE,
            causal=causal,
            block_size=block_size,
            return_lse=True,
            **kw,
        )
    assert not is_poisoned(out).any() and not is_poisoned(lse).any()
    assert op not in SPARSE_BRANCH or ran == [SPARSE_BRANCH[op]], f"{op} ran {ran}"
    return out.cpu(), lse.cpu()


def oracle(batch, q, k, v, sel, causal=True, block_size=16, op="kvouter"):
    if op == "dense":
        return dense_attention_ref(q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, SCALE, causal)
    return sparse_attention_ref(
        q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, SCALE, causal, block_size
    )


IMPLS = ["torch", "triton"]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("fp8_q", [True, False], ids=["q8", "q16"])
def test_fp8_caches(op, impl, causal, fp8_q, monkeypatch):
    seed = 3 + int(causal) + 2 * int(fp8_q) + 4 * list(OPS).index(op)
    batch, q, k, v, sel = problem(seed, causal=causal, seqs=problem_seqs(op, FP8 if fp8_q else torch.bfloat16))
    k8, ks = quantize_e4m3(k)
    v8, vs = quantize_e4m3(v)
    if fp8_q:
        q_in, qs = quantize_e4m3(q)
        q_ref = q_in.float() * qs
        extra = {"q_scale": qs}
    else:
        q_in, q_ref, extra = q.to(torch.bfloat16), q.to(torch.bfloat16).float(), {}
    out, lse = run(batch, q_in, k8, v8, sel, impl, monkeypatch, causal=causal, op=op, k_scale=ks, v_scale=vs, **extra)
    assert out.dtype == torch.bfloat16
    ref_o, ref_lse = oracle(batch, q_ref, k8.float() * ks, v8.float() * vs, sel, causal, op=op)
    assert_close("out", ref_o, out, FP8_TOL[torch.bfloat16])
    assert_close("lse", ref_lse, lse, fp8_lse_tol(q_in, impl))


# Query rows per slice in the sliced KV-outer runs: 40 rows' partials (Hkv * topk entries of G
# rows of D fp16 values, plus fp32 m and l, at problem()'s shapes with topk = 3) as the workspace
# budget. SEQS' 382 rows then run in 10 slices, which end inside sequences and span the ends of
# sequences, the empty one included. (Each slice is a launch of every stage: in the interpreter,
# slices of a few rows cost minutes.)
SLICE_ROWS = 40
SLICE_BUDGET = SLICE_ROWS * 2 * 3 * (8 // 2) * (32 * 2 + 8)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("impl", IMPLS)
def test_tensor_scales_fp16_output_and_slices(op, impl, monkeypatch):
    # Scales as one-element device tensors (what a quantizer computes without a sync), an
    # fp16 output, and a workspace budget small enough that the rows run in slices.
    batch, q, k, v, sel = problem(11, page_size=64, topk=3, seqs=problem_seqs(op, FP8, page_size=64))
    q8, qs = quantize_e4m3(q)
    k8, ks = quantize_e4m3(k)
    v8, vs = quantize_e4m3(v)
    scales = {n: torch.tensor([s], dtype=torch.float32, device=DEVICE) for n, s in (("q", qs), ("k", ks), ("v", vs))}
    slices = partial_dtypes(monkeypatch)
    out, lse = run(
        batch, q8, k8, v8, sel, impl, monkeypatch, op=op,
        q_scale=scales["q"], k_scale=scales["k"].view(()), v_scale=scales["v"],
        out_dtype=torch.float16, max_workspace_bytes=SLICE_BUDGET,
    )  # fmt: skip
    if op == "kvouter":
        assert len(slices) == -(-batch.num_tokens // SLICE_ROWS) >= 4, f"{batch.num_tokens} rows ran in {len(slices)} slices"
    assert out.dtype == torch.float16
    ref_o, ref_lse = oracle(batch, q8.float() * qs, k8.float() * ks, v8.float() * vs, sel, op=op)
    assert_close("out", ref_o, out, FP8_TOL[torch.float16])
    assert_close("lse", ref_lse, lse, fp8_lse_tol(q8, impl))


@pytest.mark.parametrize("op", ["kvouter", "decode", "dense"])
def test_torch_and_triton_agree(op, monkeypatch):
    batch, q, k, v, sel = problem(5)
    q8, qs = quantize_e4m3(q)
    k8, ks = quantize_e4m3(k)
    v8, vs = quantize_e4m3(v)
    kw = dict(q_scale=qs, k_scale=ks, v_scale=vs, op=op)
    o_t, l_t = run(batch, q8, k8, v8, sel, "torch", monkeypatch, **kw)
    o_k, l_k = run(batch, q8, k8, v8, sel, "triton", monkeypatch, **kw)
    assert_close("triton vs torch", o_t.float(), o_k.float(), 2 * FP8_TOL[torch.bfloat16])
    assert_close("lse triton vs torch", l_t, l_k, fp8_lse_tol(q8))


def test_default_scales_are_one(monkeypatch):
    batch, q, k, v, sel = problem(8)
    q8, k8, v8 = (x.clamp(-8, 8).to(FP8) for x in (q, k, v))  # garbage slots saturate: never read
    out, lse = run(batch, q8, k8, v8, sel, "torch", monkeypatch)
    ref_o, ref_lse = oracle(batch, q8.float(), k8.float(), v8.float(), sel)
    assert_close("out", ref_o, out, FP8_TOL[torch.bfloat16])
    assert_close("lse", ref_lse, lse, LSE_TOL)


def test_custom_op_fake_has_the_output_dtype():
    batch, q, k, v, sel = problem(2)
    q8, k8, v8 = (x.clamp(-8, 8).to(FP8) for x in (q, k, v))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(x) for x in (q8, k8, v8, sel, batch.block_tables, batch.cu_seqlens_q,
                                              batch.used_kv_lens)]  # fmt: skip
        outs = [
            m3_sparse.ops.kvouter_attention(*args, SCALE, True, 16, None, None, None, torch.float16),
            m3_sparse.ops.sparse_decode_attention(*args, SCALE, True, 16, None, None, None, torch.float16),
            m3_sparse.ops.sparse_attention(*args, 1, SCALE, True, 16, None, None, None, torch.float16),
            m3_sparse.ops.dense_paged_attention(*args[:3], *args[4:], SCALE, True, None, None, None, torch.float16),
            m3_sparse.ops.kvouter_attention(*args, SCALE, True, 16),  # fp8 q, no out_dtype: bfloat16
        ]
    for i, (out, lse) in enumerate(outs):
        assert out.dtype == (torch.bfloat16 if i == 4 else torch.float16) and out.shape == q.shape
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32


def bad_calls():
    batch, q, k, v, sel = problem(1)
    q8, k8, v8 = (x.clamp(-8, 8).to(FP8) for x in (q, k, v))
    bf = torch.bfloat16
    base = dict(cu_seqlens_q=batch.cu_seqlens_q, used_kv_lens=batch.used_kv_lens, block_size=16)
    bt = batch.block_tables
    return [
        ((q8, k.to(bf), v.to(bf), sel, bt), {}, "q is float8_e4m3fn: k_cache and v_cache must be float8_e4m3fn too"),
        ((q.to(bf), k8, v.to(bf), sel, bt), {}, "k_cache and v_cache must both be float8_e4m3fn"),
        ((q.to(bf), k.to(bf), v.to(bf), sel, bt), {"k_scale": 0.5}, "k_scale: a dequantization scale of float8"),
        ((q.to(bf), k8, v8, sel, bt), {"q_scale": 0.5}, "q_scale: a dequantization scale of float8"),
        ((q8, k8, v8, sel, bt), {"q_scale": -1.0}, "q_scale: expected a positive finite float"),
        ((q8, k8, v8, sel, bt), {"k_scale": float("nan")}, "k_scale: expected a positive finite float"),
        ((q8, k8, v8, sel, bt), {"v_scale": torch.ones(2)}, "v_scale: expected one value"),
        ((q8, k8, v8, sel, bt), {"v_scale": torch.ones(1, dtype=torch.int32)}, "v_scale: expected a floating"),
        ((q8, k8, v8, sel, bt), {"out_dtype": torch.int8}, "out_dtype: expected one of"),
        ((q.to(bf), k.to(bf), v.to(bf), sel, bt), {"out_dtype": torch.float16}, "out_dtype: only fp8 inputs"),
    ], base


@pytest.mark.parametrize("case", range(10))
def test_errors(case):
    calls, base = bad_calls()
    args, kw, match = calls[case]
    with pytest.raises(ValueError, match=match):
        m3_sparse.kvouter_attention(*args, **base, **kw)


@pytest.mark.parametrize("case", range(10))
@pytest.mark.parametrize("op", ["decode", "sparse_decode", "dense"])
def test_errors_of_the_other_ops(op, case):
    calls, base = bad_calls()
    args, kw, match = calls[case]
    with pytest.raises(ValueError, match=match):
        OPS[op](*args, **base, **kw)


def test_composed_triton_entry_points_name_fp8():
    # The launch-tuning entry points of the kernels take bf16/fp16/fp32 only, and say where
    # fp8 goes.
    batch, q, k, v, sel = problem(4)
    q8, k8, v8 = (x.clamp(-8, 8).to(FP8) for x in (q, k, v))
    kw = dict(cu_seqlens_q=batch.cu_seqlens_q, used_kv_lens=batch.used_kv_lens, block_size=16)
    from m3_sparse.decode.attention_triton import sparse_decode_attention_triton
    from m3_sparse.dense.attention_triton import dense_paged_attention_triton

    with pytest.raises(ValueError, match="float8_e4m3fn.*kvouter_attention"):
        sparse_decode_attention_triton(q8, k8, v8, sel, batch.block_tables, **kw)
    kw.pop("block_size")
    with pytest.raises(ValueError, match="float8_e4m3fn.*dense_paged_attention"):
        dense_paged_attention_triton(q8, k8, v8, batch.block_tables, **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_q_with_a_head_dim_below_the_fp8_mma_depth(impl, monkeypatch):
    # D = 16 < 32 (the K of an fp8 MMA): the kernel pads the head-dim tile, masked.
    batch, q, k, v, sel = problem(21, d=16)
    q8, qs = quantize_e4m3(q)
    k8, ks = quantize_e4m3(k)
    v8, vs = quantize_e4m3(v)
    out, lse = run(batch, q8, k8, v8, sel, impl, monkeypatch, q_scale=qs, k_scale=ks, v_scale=vs)
    ref_o, ref_lse = oracle(batch, q8.float() * qs, k8.float() * ks, v8.float() * vs, sel)
    assert_close("out", ref_o, out, FP8_TOL[torch.bfloat16])
    assert_close("lse", ref_lse, lse, fp8_lse_tol(q8, impl))
