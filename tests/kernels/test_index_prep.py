"""index_prep: the index branch's norm and rotary embedding in one launch.

The torch path must equal transformers' own modules bit for bit (it replaces them in the
indexer); the Triton kernel (the interpreter on a CPU) must give the torch path's values:
exactly in bf16 (it rounds where the model rounds), within fp32 rounding in fp32 (its sum
of squares runs in another order)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

import m3_sparse

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _inputs(seed, batch, seq, heads, d, r, dtype, cos_batch=None):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, seq, heads, d, generator=g) * 3).to(dtype)
    k = (torch.randn(batch, seq, d, generator=g) * 3).to(dtype)
    qw, kw = torch.randn(d, generator=g) * 0.5, torch.randn(d, generator=g) * 0.5
    angles = torch.rand(cos_batch or batch, seq, r // 2, generator=g) * 1000
    emb = torch.cat([angles, angles], -1)
    return q, k, qw, kw, emb.cos().to(dtype), emb.sin().to(dtype)


def _transformers(q, k, qw, kw, cos, sin):
    qn, kn = m3.MiniMaxM3VLRMSNorm(q.shape[-1], EPS), m3.MiniMaxM3VLRMSNorm(q.shape[-1], EPS)
    qn.weight.data, kn.weight.data = qw.clone(), kw.clone()
    rq, rk = m3.apply_rotary_pos_emb(qn(q).transpose(1, 2), kn(k)[:, None], cos, sin)
    return rq.transpose(1, 2), rk[:, 0]


SHAPES = [  # batch, tokens, heads, head dim, rotary dim
    (1, 1, 4, 32, 16),  # a decode step
    (2, 7, 3, 32, 32),  # ragged heads, the whole head rotated
    (3, 5, 2, 48, 16),  # a head dim that is not a power of two
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_path_is_transformers_bit_for_bit(shape, dtype):
    inputs = _inputs(1, *shape, dtype)
    q, k = m3_sparse.index_prep(*inputs, eps=EPS, impl="torch")
    rq, rk = _transformers(*inputs)
    assert torch.equal(q, rq) and torch.equal(k, rk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("cos_batch", [None, 1], ids=["cos_per_row", "cos_shared"])
def test_kernel_matches_the_torch_path(shape, dtype, cos_batch):
    inputs = [t.to(DEV) for t in _inputs(2, *shape, dtype, cos_batch=cos_batch)]
    q, k = m3_sparse.index_prep(*inputs, eps=EPS, impl="triton")
    rq, rk = m3_sparse.index_prep(*inputs, eps=EPS, impl="torch")
    if dtype == torch.bfloat16:
        # Only the sum of squares may differ (order), by an fp32 ulp: it moves a bf16
        # rounding in rare elements by one bf16 ulp at most.
        for got, want in ((q, rq), (k, rk)):
            diff = (got.float() - want.float()).abs()
            ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=torch.finfo(dtype).tiny)
            assert (diff <= 2 * ulp).all() and (diff > 0).float().mean() <= 0.01
    else:
        torch.testing.assert_close(q, rq, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(k, rk, rtol=2e-6, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_at_m3_shapes_on_the_gpu():
    inputs = [t.cuda() for t in _inputs(3, 2, 300, 4, 128, 64, torch.bfloat16)]
    q, k = m3_sparse.index_prep(*inputs, eps=EPS)
    rq, rk = _transformers(*inputs)
    for got, want in ((q, rq), (k, rk)):
        diff = (got.float() - want.float()).abs()
        assert (diff <= 2 * torch.finfo(torch.bfloat16).eps * want.float().abs()).all()


def test_bad_arguments_are_refused():
    q, k, qw, kw, cos, sin = _inputs(4, 2, 3, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match=r"k: expected shape \(2, 3, 16\)"):
        m3_sparse.index_prep(q, k[:, :2], qw, kw, cos, sin, eps=EPS)
    with pytest.raises(ValueError, match="R even and at most 16"):
        m3_sparse.index_prep(q, k, qw, kw, cos[..., :7], sin[..., :7], eps=EPS)
    with pytest.raises(ValueError, match="cos: expected dtype"):
        m3_sparse.index_prep(q, k, qw, kw, cos.double(), sin, eps=EPS)


def test_a_layout_the_kernel_cannot_take_runs_torch_or_is_refused_when_pinned():
    q, k, qw, kw, cos, sin = [t.to(DEV) for t in _inputs(5, 2, 3, 2, 16, 8, torch.float32)]
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # tokens outer: not (batch, tokens)
    want = m3_sparse.index_prep(q, k, qw, kw, cos, sin, eps=EPS, impl="torch")
    got = m3_sparse.index_prep(strided, k, qw, kw, cos, sin, eps=EPS)
    assert torch.equal(got[0], want[0])
    with pytest.raises(ValueError, match="contiguous over \\(batch, tokens\\)"):
        m3_sparse.index_prep(strided, k, qw, kw, cos, sin, eps=EPS, impl="triton")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keys_written_into_rows_of_a_pool(impl, dtype):
    """``k_out`` / ``k_rows``: each token's key lands in its row of a pool (a paged cache seen
    as rows), every other row keeps its value, and q is what the plain call gives."""
    batch, seq, heads, d, r = 2, 3, 2, 32, 16
    q, k, qw, kw, cos, sin = [t.to(DEV) for t in _inputs(6, batch, seq, heads, d, r, dtype)]
    pool = torch.randn(17, d, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEV)
    rows = torch.tensor([9, 0, 16, 4, 11, 5], device=DEV)  # scattered, first and last row included
    before = pool.clone()
    got_q, got_k = m3_sparse.index_prep(q, k, qw, kw, cos, sin, eps=EPS, impl=impl, k_out=pool, k_rows=rows)
    want_q, want_k = m3_sparse.index_prep(q, k, qw, kw, cos, sin, eps=EPS, impl=impl)
    assert got_k is pool
    assert torch.equal(got_q, want_q)
    assert torch.equal(pool[rows], want_k.reshape(-1, d))
    untouched = torch.ones(17, dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_bad_key_rows_are_refused_and_nothing_is_written():
    q, k, qw, kw, cos, sin = _inputs(8, 2, 3, 2, 16, 8, torch.float32)
    pool = torch.randn(10, 16)
    before = pool.clone()
    rows = torch.arange(6)
    cases = [
        (dict(k_out=pool), "pass both"),
        (dict(k_rows=rows), "pass both"),
        (dict(k_out=pool.double(), k_rows=rows), "k_out: expected dtype"),
        (dict(k_out=pool[:, :8], k_rows=rows), r"k_out: expected \[rows, 16\]"),
        (dict(k_out=pool, k_rows=rows[:5]), r"one row per token \(6\)"),
        (dict(k_out=pool, k_rows=rows.float()), "k_rows: expected dtype"),
        (dict(k_out=pool, k_rows=rows + 5), r"rows in \[0, 10\)"),
        (dict(k_out=pool, k_rows=rows - 1), r"rows in \[0, 10\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            m3_sparse.index_prep(q, k, qw, kw, cos, sin, eps=EPS, **kwargs)
    assert torch.equal(pool, before)
