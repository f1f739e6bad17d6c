"""The custom-op wrappers: same results as the functions, sound fake implementations
(torch.library.opcheck), and torch.compile(fullgraph=True) through them."""

from __future__ import annotations

import pytest
import torch

import m3_sparse
from kernel_test_utils import decode_bound, gen, make_batch, randn, random_selection, sparse_branches


@pytest.fixture(autouse=True)
def torch_impl(monkeypatch):
    # Exact equality with the functions needs both sides on the same implementation.
    monkeypatch.setenv("M3_SPARSE_IMPL", "torch")


def _problem(seed=0, seqs=((40, 3), (70, 70), (9, 2))):
    g = gen(seed)
    batch = make_batch(g, list(seqs), 16)
    q = randn(g, batch.num_tokens, 4, 16)
    k, v = batch.kv_cache(g, 2, 16), batch.kv_cache(g, 2, 16)
    iq = randn(g, batch.num_tokens, 2, 16)
    ik = randn(g, k.shape[0], 16, 16)
    sel = random_selection(g, batch, 2, 3, 16, empty_frac=0.2, dup_frac=0.1)
    return batch, q, k, v, iq, ik, sel


def test_ops_match_functions():
    batch, q, k, v, iq, ik, sel = _problem()
    kw = batch.kwargs()
    ops = m3_sparse.ops
    got = ops.index_topk(iq, ik, batch.block_tables, kw["cu_seqlens_q"], kw["used_kv_lens"], None, 3, 16, 1, -1, False)
    want = m3_sparse.index_topk(iq, ik, batch.block_tables, **kw, topk=3, block_size=16)
    assert torch.equal(got, want)
    out, lse = ops.kvouter_attention(q, k, v, sel, batch.block_tables, kw["cu_seqlens_q"], kw["used_kv_lens"], 0.25, True, 16)
    ref_out, ref_lse = m3_sparse.kvouter_attention(
        q, k, v, sel, batch.block_tables, **kw, softmax_scale=0.25, block_size=16, return_lse=True
    )
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    out, lse = ops.dense_paged_attention(q, k, v, batch.block_tables, kw["cu_seqlens_q"], kw["used_kv_lens"], 0.25, True)
    ref_out, ref_lse = m3_sparse.dense_paged_attention(q, k, v, batch.block_tables, **kw, softmax_scale=0.25, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    out, lse = ops.sparse_decode_attention(
        q, k, v, sel, batch.block_tables, kw["cu_seqlens_q"], kw["used_kv_lens"], 0.25, True, 16
    )
    ref_out, ref_lse = m3_sparse.sparse_decode_attention(
        q, k, v, sel, batch.block_tables, **kw, softmax_scale=0.25, block_size=16, return_lse=True
    )
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("past", [0, 1], ids=["at the bound", "past the bound"])
def test_dispatching_op_matches_the_function(past, monkeypatch):
    """The dispatching op runs the branch the function runs: decode with a sequence of as
    many query rows as the bound, KV-outer with one row more."""
    bound = decode_bound(4, 2, 16, torch.float32)
    rows = bound + past
    batch, q, k, v, _, _, sel = _problem(3, seqs=((rows + 20, rows), (9, 2)))
    kw = batch.kwargs()
    ran = sparse_branches(monkeypatch)
    out, lse = m3_sparse.ops.sparse_attention(
        q, k, v, sel, batch.block_tables, kw["cu_seqlens_q"], kw["used_kv_lens"], rows, 0.25, True, 16
    )
    ref_out, ref_lse = m3_sparse.sparse_attention(
        q, k, v, sel, batch.block_tables, **kw, max_seqlen_q=rows, softmax_scale=0.25, block_size=16, return_lse=True
    )
    assert ran == 2 * ["kvouter" if past else "decode"]
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_opcheck():
    batch, q, k, v, iq, ik, sel = _problem(1)
    kw = batch.kwargs()
    cu, kv, bt = kw["cu_seqlens_q"], kw["used_kv_lens"], batch.block_tables
    # The ops take no gradients; the schema, fake and dispatch checks are what matter here.
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(m3_sparse.ops.index_topk, (iq, ik, bt, cu, kv, None, 3, 16, 1, -1, False), test_utils=tests)
    torch.library.opcheck(m3_sparse.ops.kvouter_attention, (q, k, v, sel, bt, cu, kv, 0.25, True, 16), test_utils=tests)
    torch.library.opcheck(m3_sparse.ops.dense_paged_attention, (q, k, v, bt, cu, kv, 0.25, False), test_utils=tests)
    torch.library.opcheck(
        m3_sparse.ops.sparse_decode_attention, (q, k, v, sel, bt, cu, kv, 0.25, True, 16), test_utils=tests
    )
    torch.library.opcheck(m3_sparse.ops.sparse_attention, (q, k, v, sel, bt, cu, kv, 70, 0.25, True, 16), test_utils=tests)


def test_compile_fullgraph_through_the_ops():
    batch, q, k, v, iq, ik, _ = _problem(2)
    kw = batch.kwargs()
    cu, kv, bt = kw["cu_seqlens_q"], kw["used_kv_lens"], batch.block_tables
    ops = m3_sparse.ops

    def sparse_layer(q, iq):
        selected = ops.index_topk(iq, ik, bt, cu, kv, None, 3, 16, 1, -1, False)
        out, _ = ops.kvouter_attention(q * 1.5, k, v, selected, bt, cu, kv, 0.25, True, 16)
        return out.sum(-1)

    compiled = torch.compile(sparse_layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, iq), sparse_layer(q, iq), rtol=0, atol=0)
