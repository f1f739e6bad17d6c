"""The CPU runs the GPU's branches of the bf16 and fp8 kernels.

Triton's interpreter computes two constructs unlike the GPU (``core/interpreter.py``): a dot of
bf16 operands and the rounding of fp32 to e4m3. The kernels take a stand-in for those two
alone, so every other line of a branch runs here as on the GPU: fp8 keys widened to q's
dtype and scaled (``WIDEN_K``: a bf16 model over an fp8 KV cache), bf16 storage with fp32
accumulation, normalized e4m3 partials (``NORM``), the index kernel's widened keys (``K_CAST``)
and its e4m3 queries (``FP8_DOT``).

Each test asserts which branch its launch took (the kernel's constexprs, read by a pre-run
hook), so a launcher that stops choosing it fails here. The stand-ins are checked against
torch here; on a GPU the same tests check the hardware's dot and conversion instead, and the
GPU suite covers the rest of those paths at M3's shapes (``test_fp8_partials.py::
test_m3_shapes_on_cuda``, ``test_triton_kvouter.py::test_partials_tma_float_q_over_fp8_caches``).
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import m3_sparse  # noqa: E402
from kernel_test_utils import (  # noqa: E402
    TOLERANCES,
    assert_close,
    fp8_lse_tol,
    gen,
    kernel_module,
    make_batch,
    quantize_e4m3,
    randn,
    random_selection,
)
from m3_sparse import api  # noqa: E402
from m3_sparse.core.interpreter import dot, to_e4m3  # noqa: E402
from m3_sparse.kvouter import plan as kplan  # noqa: E402
from m3_sparse.reference import dense_attention_ref, index_topk_ref, sparse_attention_ref  # noqa: E402

tkv = kernel_module("m3_sparse.kvouter.partials_triton")
tcomb = kernel_module("m3_sparse.kvouter.combine_triton")
tdec = kernel_module("m3_sparse.decode.attention_triton")
tdense = kernel_module("m3_sparse.dense.attention_triton")
tix = kernel_module("m3_sparse.index.topk_triton")

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
SCALE = 0.25
SEQS = [(70, 9), (33, 1), (0, 2), (129, 4)]
# fp32 scores of exact products: the lse holds to fp32's bound; the output is stored in bf16
# after P @ V in bf16 (two bf16 roundings).
LSE_TOL = TOLERANCES[torch.float32]
OUT_TOL = 2 * TOLERANCES[BF16]


@contextlib.contextmanager
def launches(kernel):
    """The keyword arguments (the constexprs) of each launch of ``kernel`` while active."""
    seen = []

    def hook(*args, **kwargs):
        seen.append(kwargs)

    kernel.pre_run_hooks.append(hook)
    try:
        yield seen
    finally:
        kernel.pre_run_hooks.remove(hook)


def took(seen, **branch):
    """Every launch recorded in ``seen`` ran ``branch`` (and there was one)."""
    assert seen, "the kernel was never launched"
    for kw in seen:
        got = {k: kw[k] for k in branch}
        assert got == branch, f"the launch took {got}, expected {branch}"


# --------------------------------------------------------------------------- the stand-ins


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, WIDEN_B: tl.constexpr):
    om = tl.arange(0, M)
    on = tl.arange(0, N)
    ok = tl.arange(0, K)
    a = tl.load(a_ptr + om[:, None] * K + ok[None, :])  # [M, K]
    b = tl.load(b_ptr + ok[:, None] * N + on[None, :])  # [K, N]
    if WIDEN_B:
        b = b.to(a.dtype)
    tl.store(c_ptr + om[:, None] * N + on[None, :], dot(a, b, None))


@pytest.mark.parametrize("b_dtype", [BF16, FP8], ids=["bf16", "fp8-widened"])
def test_dot_of_bf16_operands_is_exact_products_in_fp32(b_dtype):
    g = gen(1)
    a = (randn(g, 32, 64) * 3).to(BF16)
    b = (randn(g, 64, 32) * 3).to(b_dtype)
    c = torch.empty(32, 32, device=DEVICE)
    _dot_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), c, 32, 32, 64, b_dtype == FP8)
    ref = a.double() @ b.double()
    # Exact products summed in fp32: a few fp32 units of the row's magnitude.
    assert_close("dot", ref, c.cpu(), 1e-6)


@triton.jit
def _e4m3_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, to_e4m3(tl.load(x_ptr + offs)))


def e4m3_probe_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties), one fp32 step either
    side of each midpoint, values past +-448 and random values over the whole range."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = codes[torch.isfinite(codes)].unique()  # sorted, -448 .. 448
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    big = torch.tensor([448.5, 455.0, 463.9, 464.0, 470.0, 1.0e4, 3.0e38])
    rand = torch.randn(1024, generator=gen(2)) * torch.exp2(torch.randint(-12, 9, (1024,), generator=gen(3)).float())
    x = torch.cat([grid, mid, near, big, -big, rand])
    n = triton.next_power_of_2(x.numel())
    return torch.cat([x, torch.zeros(n - x.numel())])


def test_e4m3_conversion_rounds_to_nearest_even_and_saturates():
    x = e4m3_probe_values()
    y = torch.empty(x.numel(), dtype=FP8, device=DEVICE)
    _e4m3_kernel[(1,)](x.to(DEVICE), y, x.numel())
    ref = x.clamp(-448, 448).to(FP8)
    got = y.cpu()
    bad = got.float() != ref.float()
    assert not bad.any(), (
        f"{int(bad.sum())} values convert unlike torch's e4m3 rounding; first: {float(x[bad][0])!r} -> "
        f"{float(got[bad][0])} (expected {float(ref[bad][0])})"
    )


# --------------------------------------------------------------------------- widened fp8 keys


def problem(seed, hq=4, hkv=2, d=32, topk=3, page_size=16, block_size=16):
    g = gen(seed)
    batch = make_batch(g, SEQS, page_size)
    q = randn(g, batch.num_tokens, hq, d).to(BF16)
    k8, ks = quantize_e4m3(batch.kv_cache(g, hkv, d))
    v8, vs = quantize_e4m3(batch.kv_cache(g, hkv, d))
    sel = random_selection(g, batch, hkv, topk, block_size)
    return batch, q, (k8, ks), (v8, vs), sel


WIDENED = {
    # op: (its kernel, the call); KV-outer on its tl kernel (sm_90 would take the TMA one).
    "kvouter": (lambda: tkv._kvouter_partials_kernel,
                functools.partial(m3_sparse.kvouter_attention, config=m3_sparse.KVOuterConfig(engine="triton"))),
    "decode": (lambda: tdec._decode_split_kernel, m3_sparse.sparse_decode_attention),
    "dense": (lambda: tdense._dense_paged_attn_kernel, m3_sparse.dense_paged_attention),
}


@pytest.mark.parametrize("op", list(WIDENED))
def test_widened_fp8_keys_against_a_bf16_q(op, monkeypatch):
    """A bf16 model over an fp8 cache: the kernels widen the e4m3 keys to bf16 and fold k_scale
    into the softmax scale. A key scale off by any factor moves the lse far past its bound."""
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    batch, q, (k8, ks), (v8, vs), sel = problem(11 + list(WIDENED).index(op))
    kernel, fn = WIDENED[op]
    kw = dict(cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE), used_kv_lens=batch.used_kv_lens.to(DEVICE),
              softmax_scale=SCALE, return_lse=True, k_scale=ks, v_scale=vs)  # fmt: skip
    args = [q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE)]
    if op != "dense":
        args.append(sel.to(DEVICE))
        kw["block_size"] = 16
    with launches(kernel()) as seen:
        out, lse = fn(*args, batch.block_tables.to(DEVICE), **kw)
    took(seen, WIDEN_K=True, KV_FP8=True, Q_FP8=False)
    k_ref, v_ref = k8.float() * ks, v8.float() * vs
    common = (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, SCALE, True)
    if op == "dense":
        ref_o, ref_lse = dense_attention_ref(q.float(), k_ref, v_ref, *common)
    else:
        ref_o, ref_lse = sparse_attention_ref(q.float(), k_ref, v_ref, sel, *common, 16)
    assert out.dtype == BF16
    assert_close("lse", ref_lse, lse.cpu(), LSE_TOL)
    assert_close("out", ref_o, out.cpu(), OUT_TOL)


# --------------------------------------------------------------------------- e4m3 partials


def e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at each element's magnitude."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=2.0**-6))) - 3)


@pytest.mark.parametrize("fp8_q", [False, True], ids=["bf16-q", "fp8-q"])
def test_e4m3_partials_round_like_the_torch_stage(fp8_q):
    """The partials kernel stores each row O / l rounded to e4m3 (``NORM``). Against the torch
    stage, which rounds the same rows in torch: most codes are equal (94% here; 50% if a
    mantissa bit were lost), and the others at most one e4m3 step apart beyond what P's bf16
    rounding moves a row (2^-7 of the same row over |V|: a value that cancels down to a few
    steps moves by more than one). Then the combine applies l and V's scale: the whole op
    against the float64 oracle."""
    g = gen(21 + fp8_q)
    batch = make_batch(g, [(150, 24), (70, 9), (129, 4)], 16)
    q = randn(g, batch.num_tokens, 8, 32)
    (q8, qs), (k8, ks), (v8, vs) = (quantize_e4m3(x) for x in (q, batch.kv_cache(g, 2, 32), batch.kv_cache(g, 2, 32)))
    sel = random_selection(g, batch, 2, 4, 16)
    q_in = q8 if fp8_q else (q8.float() * qs).to(BF16)
    d = DEVICE
    cu, kv = batch.cu_seqlens_q.to(d), batch.used_kv_lens.to(d)
    index = m3_sparse.build_kvouter_index(sel.to(d), cu_seqlens_q=cu, max_blocks=-(-batch.capacity // 16))
    sched = m3_sparse.schedule(index, tile_q=kplan.default_tile_q(4), num_programs=5)
    # (q's scale is 1 unless q is fp8, as the public ops make it.)
    scales = torch.tensor([qs if fp8_q else 1.0, ks, vs], dtype=torch.float32, device=d)
    common = dict(cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=SCALE, block_size=16, scales=scales,
                  out_dtype=BF16, partial_dtype=FP8)  # fmt: skip
    qkv = (q_in.to(d), k8.to(d), v8.to(d))
    ref_o, ref_m, _ = m3_sparse.kvouter_partials(*qkv, index, batch.block_tables.to(d), **common)
    abs_o, _, _ = m3_sparse.kvouter_partials(*qkv[:2], qkv[2].float().abs().to(FP8), index, batch.block_tables.to(d),
                                             **common)  # fmt: skip
    with launches(tkv._kvouter_partials_kernel) as seen:
        po, pm, pl = api.kvouter_partials_gpu(*qkv, index, sched, batch.block_tables.to(d), **common,
                                              config=kplan.KVOuterConfig(engine="triton"))  # fmt: skip
    took(seen, NORM=True, WIDEN_K=not fp8_q, Q_FP8=fp8_q)
    live = torch.isfinite(ref_m.cpu())
    assert live.sum() > 100 and torch.equal(torch.isfinite(pm.cpu()), live)
    ref, got, mag = (x.cpu().float()[live] for x in (ref_o, po, abs_o))
    excess = (got - ref).abs() - e4m3_step(torch.maximum(ref.abs(), got.abs())) - 2.0**-7 * mag
    assert float(excess.max()) <= 0, f"a partial is {float(excess.max()):.3g} past one e4m3 step from the torch stage's"
    same = float((got == ref).float().mean())
    assert same >= 0.85, f"only {same:.1%} of the partial codes equal the torch stage's"
    out, lse = tcomb.combine_triton(po, pm, pl, index.slot_of, out_dtype=BF16, return_lse=True, o_scale=scales[2:])
    q_ref = q_in.float() * scales[0].item()
    oracle_o, oracle_lse = sparse_attention_ref(
        q_ref, k8.float() * ks, v8.float() * vs, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens,
        SCALE, True, 16,
    )  # fmt: skip
    # e4m3 partials cost ~2.6% relative RMS (test_fp8_partials.py, PARTIAL_TOL).
    assert_close("out", oracle_o, out.cpu(), 0.05)
    assert_close("lse", oracle_lse, lse.cpu(), fp8_lse_tol(q_in))


# --------------------------------------------------------------------------- index kernel


@pytest.mark.parametrize("fp8_dot", [False, True], ids=["widened", "fp8-dot"])
def test_index_kernel_over_fp8_keys_runs_the_gpu_branch(fp8_dot, monkeypatch):
    """bf16 index queries over an fp8 index cache: the keys widened to bf16 (``K_CAST``), or the
    query rows quantized to e4m3 for the fp8 dot (``FP8_DOT``), as on the GPU. The selection is
    the float64 oracle's on the same numbers (per-token key scales), up to ties within the
    dot's precision."""
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    g = gen(31 + fp8_dot)
    batch = make_batch(g, [(300, 40), (200, 3)], 32)
    topk, block_size = 4, 32
    q = randn(g, batch.num_tokens, 2, 32).to(BF16)
    keys = batch.index_cache(g, 32, garbage=0.0)
    k_scale = (keys.abs().amax(-1) / 448).clamp(min=1e-6)  # per token [pages, page_size]
    k8 = (keys / k_scale[..., None]).to(FP8)
    meta = [x.to(DEVICE) for x in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)]
    with launches(tix._index_topk_kernel) as seen:
        sel = m3_sparse.index_topk(
            q.to(DEVICE), k8.to(DEVICE), meta[0], cu_seqlens_q=meta[1], used_kv_lens=meta[2], topk=topk,
            block_size=block_size, index_k_scale=k_scale.to(DEVICE), fp8_dot=fp8_dot,
            config=m3_sparse.IndexConfig(engine="triton"),
        )  # fmt: skip
    took(seen, K_CAST=not fp8_dot, FP8_DOT=fp8_dot, DOT_FP32=False)
    # The kernel ranks e4m3 query rows with the fp8 dot (a positive row factor ranks the same).
    qf = q.float()
    if fp8_dot:
        qf = (qf * (448 / qf.abs().amax(-1, keepdim=True))).clamp(-448, 448).to(FP8).float()
    ref, scores = index_topk_ref(
        qf, k8.float() * k_scale[..., None], batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, topk,
        block_size,
    )  # fmt: skip
    # Exact products summed in fp32; Hopper's fp8 MMA sums in fewer bits (test_triton_index_topk.py).
    tol = 1e-2 if HAS_CUDA and fp8_dot else 1e-5
    got = sel.cpu()
    for t, h in (got.sort(-1).values != ref.sort(-1).values).any(-1).nonzero().tolist():
        extra = sorted(set(got[t, h].tolist()) - set(ref[t, h].tolist()))
        missing = sorted(set(ref[t, h].tolist()) - set(got[t, h].tolist()))
        s = scores[t][h]
        gap = float(s[missing].max() - s[extra].min()) if extra and missing and -1 not in extra + missing else 1e9
        assert len(extra) == len(missing) and gap <= tol * (1 + float(s.abs().max())), (
            f"token {t} head {h}: selected {sorted(got[t, h].tolist())}, oracle {sorted(ref[t, h].tolist())}"
        )
