"""KV-outer with e4m3 partials (``partial_dtype=torch.float8_e4m3fn``, fp8 caches only): the
attention stage stores each partial normalized (O / l, in V's stored units, within +-448) in
fp8 and the combine weights it by l and applies V's scale.

Oracles: the float64 reference on the dequantized inputs (the whole op), and the torch stages
with the same ``partial_dtype`` (the Triton and TMA kernels, stage by stage). Without a CUDA
device the Triton kernels run in the interpreter at small shapes; with one they also run at
M3's shapes (G = 16, D = 128, 128-key blocks), where sm_90 takes the TMA kernel.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import m3_sparse  # noqa: E402
from kernel_test_utils import (  # noqa: E402
    TOLERANCES,
    assert_close,
    decode_bound,
    fp8_lse_tol,
    fp8_mma,
    gen,
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
from m3_sparse import api, dispatch  # noqa: E402
from m3_sparse.kvouter.plan import KVOuterConfig  # noqa: E402
from m3_sparse.reference import sparse_attention_ref  # noqa: E402

tkv = kernel_module("m3_sparse.kvouter.partials_triton")

from m3_sparse.kvouter import plan as kplan  # noqa: E402
tcomb = kernel_module("m3_sparse.kvouter.combine_triton")

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
SCALE = 0.25
# An e4m3 value carries 3 mantissa bits: rounding a partial row costs up to 2^-4 of it, about
# 2.5% relative RMS per element once the top-k partials of a row are merged (2.6% measured on
# these inputs, where the oracle sees the fp8 values exactly); bf16 partials cost 0.3%. The
# bound is twice that. A dropped l weight, v_scale or clamp moves the output by 20% or more.
PARTIAL_TOL = 0.05
# Kernel against the torch stage with the same partial dtype: both round the same rows, so
# they differ only where accumulation order moves a row across an e4m3 rounding boundary.
STAGE_TOL = 0.04
LSE_TOL = TOLERANCES[torch.float32]
# The row sums l themselves, against exact fp32 scores: the same narrow accumulation moves
# each score by a few 1e-3 at D = 128, and l by 5.5e-4 relative RMS (H200, M3 shapes). A
# key masked wrongly moves a row's l by its whole weight, typically several percent.
L_TOL_FP8_MMA = 2e-3


def l_tol(q: torch.Tensor) -> float:
    return L_TOL_FP8_MMA if fp8_mma(q.dtype == FP8) else LSE_TOL


SEQS = [(150, 150), (70, 9), (33, 1), (0, 2), (129, 4)]


def problem(seed, seqs=SEQS, page_size=16, hq=8, hkv=2, d=32, topk=4, block_size=16, causal=True):
    g = gen(seed)
    batch = make_batch(g, seqs, page_size)
    q = randn(g, batch.num_tokens, hq, d)
    k = batch.kv_cache(g, hkv, d)
    v = batch.kv_cache(g, hkv, d)
    sel = random_selection(g, batch, hkv, topk, block_size, causal=causal)
    (q8, qs), (k8, ks), (v8, vs) = quantize_e4m3(q), quantize_e4m3(k), quantize_e4m3(v)
    return batch, sel, (q8, k8, v8), (qs, ks, vs)


def run_op(batch, sel, qkv, scales, impl, monkeypatch, *, op="kvouter", block_size=16, causal=True, **kw):
    monkeypatch.setenv("M3_SPARSE_IMPL", impl)
    q, k, v = (x.to(DEVICE) for x in qkv)
    fn = m3_sparse.kvouter_attention
    if op == "sparse":
        fn = lambda *a, **k_: m3_sparse.sparse_attention(*a, max_seqlen_q=4096, **k_)  # noqa: E731
    with poisoned_allocations():
        out, lse = fn(
            q, k, v, sel.to(DEVICE), batch.block_tables.to(DEVICE),
            cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE), used_kv_lens=batch.used_kv_lens.to(DEVICE),
            softmax_scale=SCALE, causal=causal, block_size=block_size, return_lse=True,
            q_scale=scales[0] if q.dtype == FP8 else None, k_scale=scales[1], v_scale=scales[2],
            partial_dtype=FP8, **kw,
        )  # fmt: skip
    assert out.dtype == kw.get("out_dtype", BF16)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    return out.cpu(), lse.cpu()


def oracle(batch, sel, qkv, scales, causal=True, block_size=16, fp8_q=True):
    q, k, v = qkv
    q_ref = q.float() * scales[0] if fp8_q else q.float()
    return sparse_attention_ref(
        q_ref, k.float() * scales[1], v.float() * scales[2], sel, batch.block_tables, batch.cu_seqlens_q,
        batch.used_kv_lens, SCALE, causal, block_size,
    )  # fmt: skip


@pytest.mark.parametrize("op", ["kvouter", "sparse"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("fp8_q", [True, False], ids=["q8", "q16"])
def test_matches_the_oracle(op, impl, causal, fp8_q, monkeypatch):
    # "sparse": sparse_attention over a sequence past the decode bound, which takes KV-outer.
    q_dtype = FP8 if fp8_q else BF16
    seqs = SEQS if op == "kvouter" else kvouter_seqs(decode_bound(8, 2, 32, q_dtype, FP8, device=DEVICE))
    batch, sel, qkv, scales = problem(40 + 2 * causal + fp8_q + 4 * (op == "sparse"), seqs=seqs, causal=causal)
    if not fp8_q:
        qkv = (qkv[0].float().mul(scales[0]).to(BF16),) + qkv[1:]
    ran, stored = sparse_branches(monkeypatch), partial_dtypes(monkeypatch)
    out, lse = run_op(batch, sel, qkv, scales, impl, monkeypatch, op=op, causal=causal)
    assert ran == ["kvouter"] and stored == [FP8], f"ran {ran}, partials stored as {stored}"
    ref_o, ref_lse = oracle(batch, sel, qkv, scales, causal, fp8_q=fp8_q)
    assert_close("out", ref_o, out, PARTIAL_TOL)
    assert_close("lse", ref_lse, lse, fp8_lse_tol(qkv[0], impl))


# Query rows per slice in the sliced run: 40 rows' e4m3 partials (Hkv * topk entries of G rows
# of D one-byte values, plus fp32 m and l, at problem()'s shapes with topk = 3). SEQS' 382 rows
# run in 10 slices, which end inside sequences and span the ends of sequences. (Each slice
# launches every stage: in the interpreter, slices of a few rows cost minutes.)
SLICE_ROWS = 40
SLICE_BUDGET = SLICE_ROWS * 2 * 3 * (8 // 2) * (32 + 8)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_slices_fp16_output_and_tensor_scales(impl, monkeypatch):
    # A workspace budget small enough that the rows run in slices (the budget counts one
    # byte per partial value now), an fp16 output, scales as device tensors.
    batch, sel, qkv, scales = problem(51, page_size=64, topk=3)
    t_scales = tuple(torch.tensor([s], device=DEVICE) for s in scales)
    stored = partial_dtypes(monkeypatch)
    out, lse = run_op(
        batch, sel, qkv, t_scales, impl, monkeypatch, out_dtype=torch.float16, max_workspace_bytes=SLICE_BUDGET
    )
    assert len(stored) > 1 and set(stored) == {FP8}, f"partials of the slices stored as {stored}"
    # Were the budget read as two bytes a value, twice the slices would run.
    assert len(stored) == -(-batch.num_tokens // SLICE_ROWS), f"{batch.num_tokens} rows ran in {len(stored)} slices"
    ref_o, ref_lse = oracle(batch, sel, qkv, scales)
    assert_close("out", ref_o, out, PARTIAL_TOL)
    assert_close("lse", ref_lse, lse, fp8_lse_tol(qkv[0], impl))


def test_workspace_rows_count_one_byte_per_value():
    from m3_sparse.dispatch import chunk_tokens

    # Twice the rows of bf16 partials fit the same budget, up to the fp32 m and l.
    bf16_rows = chunk_tokens(10**6, 64, 16, 128, 2, 1 << 30)
    fp8_rows = chunk_tokens(10**6, 64, 16, 128, 1, 1 << 30)
    assert fp8_rows == (1 << 30) // (64 * 16 * (128 + 8)) and fp8_rows > 1.8 * bf16_rows


def _stages(batch, sel, qkv, scales, block_size=16, causal=True, tile_q=None, engine=None):
    q, k, v, sel_d, bt = (x.to(DEVICE) for x in (*qkv, sel, batch.block_tables))
    kw = dict(cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE), used_kv_lens=batch.used_kv_lens.to(DEVICE))
    group = q.shape[1] // k.shape[1]
    index = m3_sparse.build_kvouter_index(sel_d, cu_seqlens_q=kw["cu_seqlens_q"], max_blocks=-(-batch.capacity // block_size))
    sched = m3_sparse.schedule(index, tile_q=tile_q or kplan.default_tile_q(group), num_programs=7)
    s = torch.tensor(scales, dtype=torch.float32, device=DEVICE)
    common = dict(**kw, softmax_scale=SCALE, causal=causal, block_size=block_size, scales=s, out_dtype=BF16, partial_dtype=FP8)
    ref = m3_sparse.kvouter_partials(q, k, v, index, bt, **common)
    with poisoned_allocations():
        got = api.kvouter_partials_gpu(q, k, v, index, sched, bt, **common, config=KVOuterConfig(engine=engine or "auto"))
    return index, s, ref, got


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_partials_kernel_matches_the_torch_stage(causal):
    batch, sel, qkv, scales = problem(60 + causal, causal=causal)
    index, s, ref, got = _stages(batch, sel, qkv, scales, causal=causal)
    po, pm, pl = got
    assert po.dtype == FP8 and ref[0].dtype == FP8
    assert not torch.isnan(po.float()).any() and not torch.isnan(pm).any() and not torch.isnan(pl).any()
    assert po.float().abs().max() <= 448
    # Unused entries and rows that see no key: m = -inf, l = 0, o = 0.
    dead = ref[1] == float("-inf")
    assert dead.any() and torch.equal(pm == float("-inf"), dead)
    assert torch.all(pl[dead] == 0) and torch.all(po.float()[dead] == 0)
    assert_close("partial_o", ref[0].float(), po.float(), STAGE_TOL)
    assert_close("partial_l", ref[2], pl, l_tol(qkv[0]))
    # The stages composed: the combine applies V's scale.
    out, lse = tcomb.combine_triton(po, pm, pl, index.slot_of, out_dtype=BF16, return_lse=True, o_scale=s[2:])
    ref_o, ref_lse = oracle(batch, sel, qkv, scales, causal)
    assert_close("out", ref_o, out.cpu(), PARTIAL_TOL)
    assert_close("lse", ref_lse, lse.cpu(), fp8_lse_tol(qkv[0], "triton"))


def _normalized_partials(g, num_tokens, hkv, group, topk, d):
    """Random fp8 rows within +-448 with stats, and a reverse map with empty slots, a row
    without partials and a row whose only partial saw no key."""
    entries = num_tokens * hkv * topk
    po = (randn(g, entries, group, d) * 120).clamp(-448, 448).to(FP8)
    pm = randn(g, entries, group) * 3
    pl = torch.rand(entries, group, generator=g) * 40 + 0.5
    empty = torch.rand(entries, group, generator=g) < 0.1
    pm, pl = pm.masked_fill(empty, float("-inf")), pl.masked_fill(empty, 0.0)
    po = po.float().masked_fill(empty[..., None], 0).to(FP8)
    slot_of = torch.randperm(entries, generator=g).view(num_tokens, hkv, topk).to(torch.int32)
    slot_of = slot_of.masked_fill(torch.rand(slot_of.shape, generator=g) < 0.25, -1)
    slot_of[0] = -1
    slot_of[1, :, 1:] = -1
    e = slot_of[1, :, 0].long()
    pm[e], pl[e] = float("-inf"), 0.0
    return po, pm, pl, slot_of


@pytest.mark.parametrize("group,topk,d", [(4, 8, 16), (16, 16, 32), (12, 5, 16)])
@pytest.mark.parametrize("return_lse", [True, False])
def test_combine_of_normalized_partials(group, topk, d, return_lse):
    g = gen(70 + group + topk)
    po, pm, pl, slot_of = (x.to(DEVICE) for x in _normalized_partials(g, 29, 2, group, topk, d))
    o_scale = torch.tensor([0.013], device=DEVICE)
    with poisoned_allocations():
        out, lse = tcomb.combine_triton(po, pm, pl, slot_of, return_lse=return_lse, o_scale=o_scale)
    ref_o, ref_lse = m3_sparse.combine(po, pm, pl, slot_of, return_lse=True, o_scale=o_scale)
    assert out.dtype == BF16 and ref_o.dtype == BF16  # the default output of fp8 partials
    assert not torch.isnan(out.float()).any() and torch.all(out[0] == 0)
    # The reference merge written out: weights l * exp(m - M), times V's scale.
    sl = slot_of.long().cpu()
    m = pm.cpu()[sl.clamp(min=0)].masked_fill((sl < 0)[..., None], float("-inf"))  # [T, Hkv, K, G]
    w = torch.exp(m - m.amax(2, keepdim=True).clamp(min=-1e30)) * pl.cpu()[sl.clamp(min=0)]
    w = w.masked_fill(torch.isnan(w), 0.0)
    o = po.cpu().float()[sl.clamp(min=0)]  # [T, Hkv, K, G, D]
    by_hand = (w[..., None] * o).sum(2) / w.sum(2).clamp(min=1e-30)[..., None] * 0.013
    by_hand = by_hand.flatten(1, 2)
    assert_close("combine reference", by_hand, ref_o.cpu().float(), TOLERANCES[BF16])
    assert_close("combine out", ref_o.cpu().float(), out.cpu().float(), TOLERANCES[BF16])
    if return_lse:
        assert torch.all(lse[:, 0] == float("-inf")) and torch.all(lse[:, 1] == float("-inf"))
        assert_close("combine lse", ref_lse.cpu(), lse.cpu(), LSE_TOL)


@pytest.mark.parametrize("impl", ["torch", "triton", pytest.param("triton-tl", marks=pytest.mark.gpu)])
def test_rows_at_the_largest_value_saturate_not_overflow(impl, monkeypatch):
    # Every V value is +-448 (e4m3's largest): O / l is 448 times sum(round(p)) / sum(p),
    # which bf16 rounding of P pushes past 448 in about half the rows. Each path must store
    # 448 there (e4m3 has no infinity: a cast that does not saturate yields NaN or, in
    # Triton's interpreter, a wrapped exponent). "triton-tl": the tl kernel where sm_90
    # would take the TMA one.
    if impl == "triton-tl":
        monkeypatch.setattr(dispatch, "partials_engine", lambda *a, **k: "triton")
        impl = "triton"
    batch, sel, qkv, scales = problem(80)
    q8, k8, v8 = qkv
    sign = torch.where(torch.arange(v8.shape[-1]) % 2 == 0, 1.0, -1.0)
    v8 = (torch.full(v8.shape, 448.0) * sign).to(FP8)
    out, _ = run_op(batch, sel, (q8, k8, v8), scales, impl, monkeypatch)
    ref_o, _ = oracle(batch, sel, (q8, k8, v8), scales)
    seen = ref_o.abs().amax(-1) > 0
    assert seen.any()
    assert_close("out", ref_o[seen], out.float()[seen], 2 * TOLERANCES[BF16])


# Drawn cases: on CUDA they include shapes the TMA kernel takes (G 8 / 16, D 64 / 128, blocks
# of 64 / 128 keys, fp8 q).
PROPERTY_EXAMPLES = 30 if HAS_CUDA else 10


@st.composite
def fp8_cases(draw):
    rows = 150 if HAS_CUDA else 24
    seqs = []
    for _ in range(draw(st.integers(1, 3))):
        kv = draw(st.integers(1, 300))
        seqs.append((kv, draw(st.integers(1, min(kv, rows)))))
    return {
        "seed": draw(st.integers(0, 2**32 - 1)),
        "seqs": seqs,
        "page_size": draw(st.sampled_from([16, 32, 64, 128] if HAS_CUDA else [16, 32, 64])),
        "block_size": draw(st.sampled_from([16, 64, 128] if HAS_CUDA else [16, 32, 64])),
        "topk": draw(st.integers(1, 6)),
        "hkv": draw(st.sampled_from([1, 2])),
        "group": draw(st.sampled_from([1, 8, 16] if HAS_CUDA else [1, 4, 8])),
        "d": draw(st.sampled_from([32, 64, 128] if HAS_CUDA else [16, 32])),
        "causal": draw(st.booleans()),
        "fp8_q": draw(st.booleans()),
    }


@settings(max_examples=PROPERTY_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=fp8_cases())
def test_error_stays_within_the_e4m3_rounding_of_each_row(c):
    """Elementwise: an output is a weighted mean of its partial rows, each rounded to e4m3 (at
    most 2^-4 of its value, or half a subnormal step), so its error is at most about 2^-4 of
    the same mean of |V| (attention over |V|), plus bf16's rounding of P and of the output:
    a bound no cancellation between rows can break. Rows that see no key are exactly 0."""
    batch, sel, (q8, k8, v8), (qs, ks, vs) = problem(
        c["seed"], seqs=c["seqs"], page_size=c["page_size"], hq=c["hkv"] * c["group"], hkv=c["hkv"], d=c["d"],
        topk=c["topk"], block_size=c["block_size"], causal=c["causal"],
    )  # fmt: skip
    q_in = q8 if c["fp8_q"] else (q8.float() * qs).to(BF16)
    with pytest.MonkeyPatch.context() as mp:
        out, lse = run_op(batch, sel, (q_in, k8, v8), (qs, ks, vs), "triton", mp, block_size=c["block_size"],
                          causal=c["causal"])  # fmt: skip
    ref_o, ref_lse = oracle(batch, sel, (q_in, k8, v8), (qs, ks, vs), c["causal"], c["block_size"], c["fp8_q"])
    abs_o, _ = oracle(batch, sel, (q_in, k8, v8.float().abs().to(FP8)), (qs, ks, vs), c["causal"], c["block_size"],
                      c["fp8_q"])  # fmt: skip
    bound = 0.08 * abs_o + 2e-3 * vs
    excess = (out.float() - ref_o).abs() - bound
    assert excess.max() <= 0, f"error past the e4m3 bound by {float(excess.max()):.3g} at {int(excess.argmax())}"
    empty = (ref_lse == float("-inf")).T  # [Tq, Hq]
    assert torch.all(out[empty] == 0)
    # An lse error d scales every weight by e^d, so below |lse| = 1 the bound is absolute: a
    # drawn row with one key has an lse of a single score (0.004 once), which fp32 sums of D
    # products cannot match to a relative 1e-5.
    assert torch.equal(torch.isfinite(lse), ~empty.T), "rows that see no key must have lse = -inf"
    fin = ~empty.T
    err = float((lse[fin].double() - ref_lse[fin].double()).pow(2).mean().sqrt()) if fin.any() else 0.0
    scale = max(1.0, float(ref_lse[fin].double().pow(2).mean().sqrt())) if fin.any() else 1.0
    assert err <= fp8_lse_tol(q_in) * scale, f"lse: RMS error {err:.3g} past {fp8_lse_tol(q_in):.1e} x {scale:.3g}"


def bad_calls():
    batch, sel, (q8, k8, v8), (qs, ks, vs) = problem(1)
    bt = batch.block_tables
    base = dict(cu_seqlens_q=batch.cu_seqlens_q, used_kv_lens=batch.used_kv_lens, block_size=16)
    q16, k16, v16 = (x.float().to(BF16) for x in (q8, k8, v8))
    return [
        ((q16, k16, v16, sel, bt), {"partial_dtype": FP8}, "partial_dtype=float8_e4m3fn: needs float8_e4m3fn caches"),
        ((q8, k8, v8, sel, bt), {"partial_dtype": torch.int8}, r"partial_dtype: expected None, the output dtype \(bfloat16\)"),
        ((q8, k8, v8, sel, bt), {"partial_dtype": torch.float16}, r"partial_dtype: expected None, the output dtype"),
        ((q16, k16, v16, sel, bt), {"partial_dtype": torch.float32}, r"partial_dtype: expected None, the output dtype"),
    ], base


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("op", ["kvouter", "sparse_kvouter", "sparse_decode"])
def test_errors(op, case):
    calls, base = bad_calls()
    args, kw, match = calls[case]
    fn = {
        "kvouter": m3_sparse.kvouter_attention,
        "sparse_kvouter": lambda *a, **k: m3_sparse.sparse_attention(*a, max_seqlen_q=4096, **k),
        "sparse_decode": lambda *a, **k: m3_sparse.sparse_attention(*a, max_seqlen_q=1, **k),
    }[op]
    with pytest.raises(ValueError, match=match):
        fn(*args, **base, **kw)


def test_stage_and_combine_errors():
    batch, sel, (q8, k8, v8), scales = problem(2)
    po, pm, pl, slot_of = _normalized_partials(gen(3), 5, 2, 4, 4, 16)
    with pytest.raises(ValueError, match="o_scale: expected one float32 value"):
        m3_sparse.combine(po, pm, pl, slot_of, o_scale=torch.ones(2))
    with pytest.raises(ValueError, match="o_scale: expected dtype in"):
        m3_sparse.combine(po, pm, pl, slot_of, o_scale=torch.ones(1, dtype=torch.float64))
    # The Triton combine checks it the same way, before its launch.
    with pytest.raises(ValueError, match="o_scale: expected one float32 value"):
        tcomb.combine_triton(po, pm, pl, slot_of, o_scale=torch.ones(2))
    with pytest.raises(ValueError, match="o_scale: expected dtype in"):
        tcomb.combine_triton(po, pm, pl, slot_of, o_scale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="out_dtype: expected one of"):
        m3_sparse.combine(po, pm, pl, slot_of, out_dtype=FP8)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=batch.cu_seqlens_q, max_blocks=-(-batch.capacity // 16))
    q16, k16, v16 = (x.float().to(BF16) for x in (q8, k8, v8))
    with pytest.raises(ValueError, match="needs float8_e4m3fn caches"):
        m3_sparse.kvouter_partials(
            q16, k16, v16, index, batch.block_tables, cu_seqlens_q=batch.cu_seqlens_q,
            used_kv_lens=batch.used_kv_lens, softmax_scale=SCALE, block_size=16, partial_dtype=FP8,
        )  # fmt: skip


def test_custom_ops_take_the_partial_dtype():
    batch, sel, (q8, k8, v8), scales = problem(4)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(x) for x in (q8, k8, v8, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)]
        out, lse = m3_sparse.ops.kvouter_attention(*args, SCALE, True, 16, None, None, None, torch.float16, FP8)
        out2, _ = m3_sparse.ops.sparse_attention(*args, 4096, SCALE, True, 16, None, None, None, None, FP8)
    assert out.dtype == torch.float16 and out2.dtype == BF16 and out.shape == q8.shape
    # And eagerly, through the op's real implementation.
    s = [torch.tensor([x]) for x in scales]
    got, _ = m3_sparse.ops.kvouter_attention(q8, k8, v8, sel, batch.block_tables, batch.cu_seqlens_q,
                                             batch.used_kv_lens, SCALE, True, 16, *s, None, FP8)  # fmt: skip
    ref_o, _ = oracle(batch, sel, (q8, k8, v8), scales)
    assert_close("op out", ref_o, got, PARTIAL_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["auto", "triton"])
@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_m3_shapes_on_cuda(engine, page_size, causal):
    # G = 16, D = 128, 128-key blocks: the TMA kernel on sm_90 under "auto".
    seqs = [(1500, 1500), (700, 333), (260, 1)]
    batch, sel, qkv, scales = problem(
        90 + page_size + causal, seqs=seqs, page_size=page_size, hq=32, hkv=2, d=128, topk=8, block_size=128,
        causal=causal,
    )  # fmt: skip
    index, s, ref, got = _stages(batch, sel, qkv, scales, block_size=128, causal=causal, engine=engine)
    dead = ref[1] == float("-inf")
    assert torch.equal(got[1] == float("-inf"), dead)
    assert torch.all(got[0].float()[dead] == 0) and not torch.isnan(got[0].float()).any()
    assert_close("partial_o", ref[0].float(), got[0].float(), STAGE_TOL)
    assert_close("partial_l", ref[2], got[2], l_tol(qkv[0]))
    out, _ = tcomb.combine_triton(*got, index.slot_of, out_dtype=BF16, o_scale=s[2:])
    ref_o, _ = oracle(batch, sel, qkv, scales, causal, block_size=128)
    assert_close("out", ref_o, out.cpu(), PARTIAL_TOL)
