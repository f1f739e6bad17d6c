"""KV-outer in query slices (a workspace budget smaller than the partials of all rows),
at the edges test_kvouter_chunks.py does not reach. Cutting the query rows into slices
must give the unsliced result whatever the batch holds:

* ``causal=False``: a bidirectional row sees every key of its sequence, so a slice may
  not shorten a sequence's key range (only causal rows never see the keys of rows cut
  off after them);
* a sequence whose rows all lie before the slice keeps its batch slot with no rows; its
  length must stay a valid one (not grow past the block table);
* left-padded rows (more queries than cached tokens, negative positions): a slice of
  them must not get a negative length.
"""

from __future__ import annotations

import pytest
import torch

import m3_sparse
from kernel_test_utils import TOLERANCES, assert_close, gen, make_batch, randn, random_selection
from m3_sparse.reference import sparse_attention_ref

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

CASES = {
    # (seqs [(kv_len, q_len)], causal, extra block-table columns)
    "bidirectional": ([(70, 9), (40, 5)], False, 1),
    "sequence before the slice": ([(6, 1), (12, 12)], True, 0),
    "left-padded rows": ([(1, 4), (20, 3)], True, 1),
}


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("rows_per_slice", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sliced_equals_oracle(monkeypatch, case, impl, rows_per_slice):
    monkeypatch.setenv("M3_SPARSE_IMPL", impl)
    seqs, causal, extra_cols = CASES[case]
    hq, hkv, d, topk, block, page = 4, 2, 16, 3, 16, 16
    g = gen(40 + rows_per_slice)
    batch = make_batch(g, seqs, page, extra_cols=extra_cols)
    q = randn(g, batch.num_tokens, hq, d)
    k, v = batch.kv_cache(g, hkv, d), batch.kv_cache(g, hkv, d)
    sel = random_selection(g, batch, hkv, topk, block, causal=causal)
    per_row = hkv * topk * (hq // hkv) * (d * q.element_size() + 8)
    args = [t.to(DEVICE) for t in (q, k, v, sel, batch.block_tables)]
    kw = {"cu_seqlens_q": batch.cu_seqlens_q.to(DEVICE), "used_kv_lens": batch.used_kv_lens.to(DEVICE)}
    out, lse = m3_sparse.kvouter_attention(
        *args, **kw, block_size=block, causal=causal, return_lse=True, max_workspace_bytes=rows_per_slice * per_row
    )
    ref, ref_lse = sparse_attention_ref(
        q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, causal, block
    )
    assert_close("out", ref, out.cpu(), TOLERANCES[torch.float32])
    assert_close("lse", ref_lse, lse.cpu(), TOLERANCES[torch.float32])
