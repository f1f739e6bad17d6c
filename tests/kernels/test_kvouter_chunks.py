"""KV-outer in query slices: a workspace budget smaller than the prompt's partials splits
the query rows, and the result must not depend on where the cuts fall (they cut through
sequences, land on sequence edges, leave sequences with no rows in a slice)."""

from __future__ import annotations

import pytest
import torch

import m3_sparse
from kernel_test_utils import TOLERANCES, assert_close, gen, make_batch, poisoned_allocations, randn, random_selection
from m3_sparse.dispatch import chunk_tokens
from m3_sparse.core.layout import chunk_varlen, token_positions
from m3_sparse.reference import sparse_attention_ref

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
IMPLS = ["torch", "triton"]  # triton: the GPU, or the CPU interpreter (tests/conftest.py)


def test_chunk_varlen_keeps_every_row_at_its_position():
    g = gen(1)
    q_lens = [5, 0, 9, 1, 7]
    kv_lens = torch.tensor([40, 3, 9, 30, 100], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    seq, pos = token_positions(cu, kv_lens, total)
    for _ in range(20):
        t0 = int(torch.randint(0, total, (1,), generator=g))
        t1 = int(torch.randint(t0 + 1, total + 1, (1,), generator=g))
        cu_c, kv_c = chunk_varlen(cu, kv_lens, t0, t1)
        assert cu_c.dtype == cu.dtype and kv_c.dtype == kv_lens.dtype
        assert int(cu_c[0]) == 0 and int(cu_c[-1]) == t1 - t0
        seq_c, pos_c = token_positions(cu_c, kv_c, t1 - t0)
        assert torch.equal(seq_c, seq[t0:t1]) and torch.equal(pos_c, pos[t0:t1])


def test_chunk_tokens_budget():
    per_token = 4 * 16 * 16 * (128 * 2 + 8)
    assert chunk_tokens(131072, 64, 16, 128, 2, 4 << 30) == (4 << 30) // per_token
    assert chunk_tokens(100, 64, 16, 128, 2, 4 << 30) == 100
    assert chunk_tokens(100, 64, 16, 128, 2, 1) == 1  # always progress


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows_per_chunk", [1, 3, 7, 16])
def test_chunked_equals_oracle_and_unchunked(monkeypatch, impl, rows_per_chunk):
    monkeypatch.setenv("M3_SPARSE_IMPL", impl)
    hq, hkv, d, topk, block, page = 4, 2, 16, 3, 16, 16
    g = gen(10 + rows_per_chunk)
    # A sequence shorter than a block, one with a single query, one with many.
    batch = make_batch(g, [(9, 4), (70, 1), (120, 11)], page)
    dtype = torch.float32
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k, v = batch.kv_cache(g, hkv, d, dtype), batch.kv_cache(g, hkv, d, dtype)
    sel = random_selection(g, batch, hkv, topk, block)
    per_token = hkv * topk * (hq // hkv) * (d * q.element_size() + 8)
    args = [t.to(DEVICE) for t in (q, k, v, sel, batch.block_tables)]
    kw = {"cu_seqlens_q": batch.cu_seqlens_q.to(DEVICE), "used_kv_lens": batch.used_kv_lens.to(DEVICE)}
    with poisoned_allocations():
        out, lse = m3_sparse.kvouter_attention(
            *args, **kw, block_size=block, return_lse=True, max_workspace_bytes=rows_per_chunk * per_token
        )
    whole, whole_lse = m3_sparse.kvouter_attention(*args, **kw, block_size=block, return_lse=True)
    ref, ref_lse = sparse_attention_ref(
        q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, True, block
    )
    assert_close("out", ref, out.cpu(), TOLERANCES[dtype])
    assert_close("lse", ref_lse, lse.cpu(), TOLERANCES[dtype])
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)


def test_workspace_budget_must_be_positive():
    g = gen(3)
    batch = make_batch(g, [(20, 2)], 16)
    q = randn(g, 2, 2, 16)
    k, v = batch.kv_cache(g, 1, 16), batch.kv_cache(g, 1, 16)
    sel = random_selection(g, batch, 1, 1, 16)
    with pytest.raises(ValueError, match="max_workspace_bytes"):
        m3_sparse.kvouter_attention(
            q, k, v, sel, batch.block_tables, **batch.kwargs(), block_size=16, max_workspace_bytes=0
        )
