"""Query-outer sparse attention over each tile's union of selected blocks (the dense kernel's
sparse mode, ``api.qouter_attention``) against the float64 oracle
(``reference.sparse_attention_ref``), on fresh random inputs.

Prefill-shaped varlen batches (whole prompts, chunks over a history, rows before the first
key, an empty sequence) over shuffled paged caches, page sizes below, equal to and above
the block size, and three kinds of selection: messy random ones (-1 slots, repeated ids,
rows that select nothing), ones where a tile's tokens agree (the union is one token's
blocks) and ones where they share nothing but the local block (the union is most of the
history). Without a CUDA device the kernel runs in Triton's interpreter at tiny shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton picks the interpreter when a kernel is decorated: this must precede the
    # first import of the kernel module (it is re-decorated below if it came too late).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import m3_sparse  # noqa: E402
from kernel_test_utils import (  # noqa: E402
    TOLERANCES,
    assert_close,
    gen,
    is_poisoned,
    kernel_module,
    make_batch,
    poisoned_allocations,
    randn,
    random_selection,
    spy,
)
from m3_sparse import dispatch  # noqa: E402
from m3_sparse.core.validate import attention_args  # noqa: E402
from m3_sparse.dense import plan as dplan  # noqa: E402
from m3_sparse.reference import sparse_attention_ref  # noqa: E402

tda = kernel_module("m3_sparse.dense.attention_triton")

DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
LSE_TOL = TOLERANCES[torch.float32]

# (kv_len, q_len): a whole prompt, a chunk over a history, a sequence shorter than a block,
# rows before the first key (q_len > kv_len), an empty sequence, one decode row.
PREFILL = [(75, 75), (90, 21), (9, 9), (3, 6), (0, 0), (50, 1)]


def _alike_selection(g, batch, heads, topk, block_size):
    """Every token of a sequence chooses the same earlier blocks plus its own local block:
    a tile's union is about one token's selection."""
    sel = torch.full((batch.num_tokens, heads, topk), -1, dtype=torch.int32)
    for b, t, p in batch.tokens():
        if p < 0:
            continue
        last = p // block_size
        for h in range(heads):
            shared = torch.randperm(max(1, batch.kv_lens[b] // block_size), generator=gen(1000 * b + h))
            ids = [last] + [int(x) for x in shared.tolist() if x < last][: topk - 1]
            sel[t, h, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return sel


def _disjoint_selection(g, batch, heads, topk, block_size):
    """Neighbouring tokens share only their local block: each token takes its earlier blocks
    from a different place (rotated by its position), so a tile's union spans most of its
    history."""
    sel = torch.full((batch.num_tokens, heads, topk), -1, dtype=torch.int32)
    for _, t, p in batch.tokens():
        if p < 0:
            continue
        last = p // block_size
        for h in range(heads):
            ids = [last] + [(p + h + i) % last for i in range(min(topk - 1, last))] if last else [last]
            sel[t, h, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return sel


SELECTIONS = {"random": None, "alike": _alike_selection, "disjoint": _disjoint_selection}


def _setup(seed, seqs, page_size, block_size, hq, hkv, d, topk, dtype, *, causal=True, kind="random"):
    g = gen(seed)
    batch = make_batch(g, seqs, page_size)
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k = batch.kv_cache(g, hkv, d, dtype)
    v = batch.kv_cache(g, hkv, d, dtype)
    make = SELECTIONS[kind]
    if make is None:
        sel = random_selection(g, batch, hkv, topk, block_size, causal=causal)
    else:
        sel = make(g, batch, hkv, topk, block_size)
    return batch, q, k, v, sel


def _run(batch, q, k, v, sel, block_size, *, causal=True, scale=None, return_lse=True, max_seqlen_q=None, **launch):
    qd, kd, vd, sd, bt, cu, kv = (
        x.to(DEVICE) for x in (q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    )
    with poisoned_allocations():
        out, lse = tda.qouter_attention_triton(
            qd, kd, vd, sd, bt, cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=scale, causal=causal,
            block_size=block_size, return_lse=return_lse, max_seqlen_q=max_seqlen_q,
            config=dplan.DenseConfig(**launch),
        )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not is_poisoned(out).any(), "output elements never written"
    if return_lse:
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
        assert not is_poisoned(lse).any(), "lse elements never written"
    else:
        assert lse is None
    return out, lse


def _check(name, batch, q, k, v, sel, block_size, out, lse, dtype, *, causal=True, scale=None):
    ref_out, ref_lse = sparse_attention_ref(
        q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, scale, causal, block_size
    )
    assert_close(f"{name} out", ref_out, out.cpu(), TOLERANCES[dtype])
    if lse is not None:
        assert_close(f"{name} lse", ref_lse, lse.cpu(), LSE_TOL)


# --------------------------------------------------------------------------- against the oracle

CASES = [
    # page, block, hq, hkv, topk, dtype, block_n, num_splits
    (16, 16, 8, 2, 4, torch.float32, None, None),  # block = page
    (16, 32, 8, 2, 4, torch.bfloat16, None, None),  # block > page: a key tile gathers two pages
    (32, 16, 16, 1, 3, torch.float16, None, 1),  # block < page, topk not a power of two
    (64, 32, 16, 4, 8, torch.float32, 16, 3),  # two key tiles per block, uneven splits of the union
    (16, 16, 4, 4, 6, torch.float32, 32, None),  # G = 1; key tiles wider than a block (cut at its end)
]


@pytest.mark.parametrize("kind", list(SELECTIONS))
@pytest.mark.parametrize("page_size,block_size,hq,hkv,topk,dtype,block_n,num_splits", CASES)
def test_qouter_matches_reference(page_size, block_size, hq, hkv, topk, dtype, block_n, num_splits, kind):
    batch, q, k, v, sel = _setup(7, PREFILL, page_size, block_size, hq, hkv, 32, topk, dtype, kind=kind)
    out, lse = _run(batch, q, k, v, sel, block_size, scale=0.3, block_n=block_n, num_splits=num_splits)
    _check("qouter", batch, q, k, v, sel, block_size, out, lse, dtype, scale=0.3)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_bidirectional(num_splits):
    seqs = [(40, 40), (70, 12), (0, 0), (20, 5)]
    batch, q, k, v, sel = _setup(11, seqs, 16, 16, 8, 2, 32, 5, torch.float32, causal=False)
    out, lse = _run(batch, q, k, v, sel, 16, causal=False, num_splits=num_splits)
    _check("bidirectional", batch, q, k, v, sel, 16, out, lse, torch.float32, causal=False)


def test_strided_q_without_lse_and_max_seqlen_q():
    batch, q, k, v, sel = _setup(3, PREFILL, 16, 16, 8, 2, 32, 4, torch.float32)
    wide = randn(gen(4), q.shape[0], q.shape[1], 48)
    wide[..., :32] = q
    qs = wide[..., :32]  # a strided view: the kernel reads q's strides
    out, lse = _run(batch, qs, k, v, sel, 16, return_lse=False, max_seqlen_q=max(batch.q_lens))
    _check("strided", batch, q, k, v, sel, 16, out, None, torch.float32)


def test_selection_of_nothing_and_out_of_range_ids():
    """Rows that select nothing get zeros and lse -inf; ids of blocks past a row's keys (or
    past the sequence) are never read."""
    batch, q, k, v, sel = _setup(5, [(60, 20), (33, 33)], 16, 16, 8, 2, 32, 4, torch.float32)
    sel[::3] = -1
    sel[1::5, :, 0] = batch.capacity // 16 - 1  # the table's last block: past both sequences' keys
    out, lse = _run(batch, q, k, v, sel, 16)
    _check("edges", batch, q, k, v, sel, 16, out, lse, torch.float32)
    assert (out[::3] == 0).all() and (lse[:, ::3] == float("-inf")).all()


def test_zero_topk():
    batch, q, k, v, sel = _setup(6, [(30, 4)], 16, 16, 8, 2, 32, 4, torch.float32)
    out, lse = _run(batch, q, k, v, sel[:, :, :0], 16)
    assert (out == 0).all() and (lse == float("-inf")).all()


# --------------------------------------------------------------------------- plan and dispatch


def test_sparse_tiles_cap_the_union_slots():
    # M3's shapes: 16 heads per kv head, top-16: 8 tokens (128 rows, 128 slots) per tile.
    assert dplan.union_tile_tokens(8, 16, 16) == 8
    # A wide top-k takes fewer tokens, but never fewer than 16 rows.
    assert dplan.union_tile_tokens(32, 4, 64) == 4
    assert dplan.union_tile_tokens(128, 1, 64) == 16
    # Key tiles divide the block size.
    assert dplan.union_block_n(64, 128) == 64
    assert dplan.union_block_n(64, 48) == 16
    assert dplan.union_block_n(128, 32) == 32


def _args(hq, hkv, topk, block_size, page_size=16, dtype=torch.float32):
    g = gen(0)
    batch = make_batch(g, [(40, 8)], page_size)
    q = randn(g, batch.num_tokens, hq, 32, dtype=dtype)
    k = batch.kv_cache(g, hkv, 32, dtype)
    sel = torch.zeros(batch.num_tokens, hkv, topk, dtype=torch.int32)
    return attention_args(
        q, k, k, batch.block_tables, cu_seqlens_q=batch.cu_seqlens_q, used_kv_lens=batch.used_kv_lens,
        softmax_scale=None, causal=True, return_lse=True, selected=sel, block_size=block_size, page_size=page_size,
    )


def test_shapes_the_kernel_refuses():
    assert dplan.shape_reason(_args(8, 2, 4, 16)) is None
    assert "multiple of 16" in dplan.shape_reason(_args(8, 2, 4, 24))
    assert "selection slots" in dplan.shape_reason(_args(4, 4, 64, 16))


def test_m3_shapes_plan():
    args = _args(64, 4, 16, 128, page_size=64, dtype=torch.bfloat16)
    p = dplan.plan(args.replace(max_seqlen_q=8192), dplan.DEFAULT_CONFIG)
    assert (p.tm, p.gp, p.bn) == (8, 16, 64)


def test_a_launch_runs_with_its_kind_of_call():
    batch, q, k, v, sel = _setup(2, [(40, 8)], 16, 16, 8, 2, 32, 4, torch.float32)
    args = attention_args(
        q, k, v, batch.block_tables, cu_seqlens_q=batch.cu_seqlens_q, used_kv_lens=batch.used_kv_lens,
        softmax_scale=None, causal=True, return_lse=True, selected=sel, block_size=16,
    )
    launch = tda.DenseLaunch(args)
    with pytest.raises(ValueError, match="planned with, run without"):
        launch.run(q, k, v)


def test_prefill_kernel_choice(monkeypatch):
    args = _args(8, 2, 4, 16)
    monkeypatch.delenv("M3_SPARSE_PREFILL", raising=False)
    assert not dispatch.runs_qouter(args)  # auto keeps KV-outer, the faster of the two where measured
    monkeypatch.setenv("M3_SPARSE_PREFILL", "qouter")
    assert dispatch.runs_qouter(args)
    monkeypatch.setenv("M3_SPARSE_PREFILL", "kvouter")
    assert not dispatch.runs_qouter(args)
    monkeypatch.setenv("M3_SPARSE_PREFILL", "query-outer")
    with pytest.raises(ValueError, match="M3_SPARSE_PREFILL: expected one of"):
        dispatch.runs_qouter(args)


def test_sparse_attention_runs_qouter_when_asked(monkeypatch):
    """``sparse_attention`` past the decode bound takes the query-outer kernel under
    ``M3_SPARSE_PREFILL=qouter`` (the Triton kernel, pinned; the interpreter on the CPU), and
    its plan runs the same launch; the results are the oracle's either way."""
    monkeypatch.setenv("M3_SPARSE_PREFILL", "qouter")
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    seqs = [(300, 300), (150, 140)]
    batch, q, k, v, sel = _setup(8, seqs, 16, 16, 8, 2, 32, 4, torch.float32, kind="alike")
    qd, kd, vd, sd, bt, cu, kv = (
        x.to(DEVICE) for x in (q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    )
    seen = []
    spy(monkeypatch, tda.DenseLaunch, "run", seen.append)
    kw = dict(cu_seqlens_q=cu, used_kv_lens=kv, block_size=16, return_lse=True)
    out, lse = m3_sparse.sparse_attention(qd, kd, vd, sd, bt, **kw)
    assert len(seen) == 1, "sparse_attention did not run the query-outer kernel"
    _check("sparse_attention", batch, q, k, v, sel, 16, out, lse, torch.float32)
    plan = m3_sparse.plan_sparse_attention(qd, kd, vd, sd, bt, **kw)
    out2, lse2 = plan.run(qd, kd, vd, sd)
    assert len(seen) == 2
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(lse2, lse, rtol=0, atol=0)


def test_custom_op_matches_the_api():
    batch, q, k, v, sel = _setup(9, [(40, 12), (20, 20)], 16, 16, 8, 2, 32, 4, torch.float32)
    args = (q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    out, lse = m3_sparse.ops.qouter_attention(*args, 0, 0.25, True, 16)
    ref_out, ref_lse = m3_sparse.qouter_attention(
        *args[:5], cu_seqlens_q=args[5], used_kv_lens=args[6], softmax_scale=0.25, block_size=16, return_lse=True
    )
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_fa4_pin_is_refused():
    batch, q, k, v, sel = _setup(9, [(40, 12)], 16, 16, 8, 2, 32, 4, torch.float32)
    with pytest.raises(ValueError, match="flash-attn-4, which has no block-sparse attention"):
        m3_sparse.qouter_attention(
            q, k, v, sel, batch.block_tables, **batch.kwargs(), block_size=16, config=dplan.DenseConfig(impl="fa4")
        )


# --------------------------------------------------------------------------- M3 sizes (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="M3-sized shapes need a CUDA device")
@pytest.mark.parametrize("kind", ["random", "alike"])
@pytest.mark.parametrize("use_tma", [None, False])
def test_m3_shapes(kind, use_tma):
    """64 query heads over 4 kv heads, head dim 128, blocks of 128, top-16, pages of 64,
    bf16: a 2K prompt and a 1K chunk over a 3K history, against the torch path (the oracle
    is too slow here)."""
    seqs = [(2048, 2048), (3072, 1024)]
    batch, q, k, v, sel = _setup(21, seqs, 64, 128, 64, 4, 128, 16, torch.bfloat16, kind=kind)
    qd, kd, vd, sd, bt, cu, kv = (
        x.cuda() for x in (q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    )
    kw = dict(cu_seqlens_q=cu, used_kv_lens=kv, block_size=128, return_lse=True)
    out, lse = m3_sparse.qouter_attention(qd, kd, vd, sd, bt, **kw, config=dplan.DenseConfig(use_tma=use_tma))
    ref_out, ref_lse = m3_sparse.sparse_decode_attention(
        qd, kd, vd, sd, bt, **kw, config=m3_sparse.DecodeConfig(impl="torch")
    )
    assert_close("m3 out", ref_out.float(), out.float(), TOLERANCES[torch.bfloat16])
    assert_close("m3 lse", ref_lse, lse, LSE_TOL)
