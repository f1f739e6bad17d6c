"""Which implementation runs: Triton on CUDA when the kernel takes the shapes, torch
otherwise; an explicit M3_SPARSE_IMPL is obeyed or refused, never swapped."""

from __future__ import annotations

import pytest
import torch

import m3_sparse
from m3_sparse import dispatch as _dispatch
from m3_sparse.core.args import AttnArgs
from kernel_test_utils import (
    TOLERANCES,
    assert_close,
    decode_bound,
    gen,
    make_batch,
    randn,
    random_selection,
    sparse_branches,
)
from m3_sparse.reference import sparse_attention_ref


def test_auto_runs_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("M3_SPARSE_IMPL", raising=False)
    assert not _dispatch.use_triton(torch.zeros(1))


def test_unknown_impl_is_refused(monkeypatch):
    monkeypatch.setenv("M3_SPARSE_IMPL", "cuda-graph")
    with pytest.raises(ValueError, match="M3_SPARSE_IMPL"):
        _dispatch.use_triton(torch.zeros(1))


def test_explicit_triton_refuses_unsupported_shapes(monkeypatch):
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    # On the GPU where there is one; else the CPU interpreter (conftest) stands in for it.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = gen(5)
    batch = make_batch(g, [(40, 3)], 16)
    kw = {name: t.to(dev) for name, t in batch.kwargs().items()}
    tables = batch.block_tables.to(dev)
    q = randn(g, batch.num_tokens, 4, 8).to(dev)
    k = batch.kv_cache(g, 2, 8).to(dev)
    sel = random_selection(g, batch, 2, 3, 8, empty_frac=0.0, dup_frac=0.0).to(dev)
    with pytest.raises(ValueError, match="block_size a power of two >= 16, got 8"):
        m3_sparse.kvouter_attention(q, k, k, sel, tables, **kw, block_size=8)
    iq = randn(g, batch.num_tokens, 2, 8).to(dev)
    ik = randn(g, k.shape[0], 16, 8).to(dev)
    with pytest.raises(ValueError, match="index head dim in \\[16, 256\\], got 8"):
        m3_sparse.index_topk(iq, ik, tables, **kw, topk=2, block_size=16)


@pytest.mark.gpu
def test_auto_on_cuda_takes_torch_for_shapes_the_kernel_lacks(monkeypatch):
    monkeypatch.delenv("M3_SPARSE_IMPL", raising=False)
    q = torch.zeros(4, 4, 8, device="cuda")
    k = torch.zeros(2, 2, 16, 8, device="cuda")
    for block_size, triton in ((8, False), (16, True)):
        args = AttnArgs(q=q, k_cache=k, v_cache=k, block_tables=None, cu_seqlens_q=None, used_kv_lens=None, batch=1,
                        softmax_scale=1.0, causal=True, return_lse=False, scales=None, out_dtype=q.dtype,
                        block_size=block_size)
        assert _dispatch.use_triton(q, _dispatch.kvouter_unsupported(args)) == triton


@pytest.mark.parametrize(
    "longest,max_seqlen_q,want",
    [
        ("bound", None, "kvouter"),  # no max_seqlen_q: the token count (past the bound) stands in
        ("bound", "bound", "decode"),
        ("bound", "bound + 1", "kvouter"),  # a looser upper bound than needed
        ("bound + 1", "bound + 1", "kvouter"),
        ("half", "half", "decode"),  # two such sequences: more rows than the bound together
        ("half", None, "kvouter"),
    ],
)
def test_sparse_attention_picks_the_kernel_from_the_row_bound(longest, max_seqlen_q, want, monkeypatch):
    """Query-outer decode while each sequence brings at most decode_max_queries() rows, KV-outer
    beyond: the bound crossed from both sides, the rows per sequence from the host
    (max_seqlen_q, else the token count). Each call against the oracle."""
    monkeypatch.delenv("M3_SPARSE_IMPL", raising=False)  # the CPU runs both branches in torch
    limit = decode_bound(4, 2, 16, torch.float32)
    assert limit == _dispatch.DECODE_MAX_QUERIES_TL  # G = 2: KV-outer runs the tl kernel
    rows = {None: None, "bound": limit, "bound + 1": limit + 1, "half": limit // 2 + 1}
    n = rows[longest]
    seqs = [(n + 8, n), (n + 4, n)] if longest == "half" else [(n + 30, n), (40, 3)]
    g = gen(8)
    batch = make_batch(g, seqs, 16)
    assert batch.num_tokens > limit
    q = randn(g, batch.num_tokens, 4, 16)
    k, v = batch.kv_cache(g, 2, 16), batch.kv_cache(g, 2, 16)
    sel = random_selection(g, batch, 2, 3, 16)
    args = (q, k, v, sel, batch.block_tables)
    ran = sparse_branches(monkeypatch)
    out, lse = m3_sparse.sparse_attention(
        *args, **batch.kwargs(), block_size=16, max_seqlen_q=rows[max_seqlen_q], return_lse=True
    )
    assert ran == [want]
    ref = sparse_attention_ref(*args, batch.cu_seqlens_q, batch.used_kv_lens, None, True, 16)
    assert_close("out", ref[0], out, TOLERANCES[torch.float32])
    assert_close("lse", ref[1], lse, TOLERANCES[torch.float32])


def test_decode_row_bound_follows_the_kvouter_kernel(monkeypatch):
    """96 rows where KV-outer runs the TMA partials kernel (sm_90, its shapes), 256 where it
    runs the tl kernel: each bound was measured against its own KV-outer."""
    from m3_sparse.core.launch import device_capability
    from m3_sparse.kvouter import partials_gluon_sm90 as gluon_kvouter

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.empty(3, 64, 128, dtype=torch.bfloat16, device=dev)
    k = torch.empty(2, 4, 128, 128, dtype=torch.bfloat16, device=dev)
    tma = gluon_kvouter.unsupported_reason(q, k, k, 128, None, None, 4, 0) is None
    # The capability dispatch sees (M3_SPARSE_CAPABILITY when the suite acts as another GPU).
    hopper = dev == "cuda" and device_capability(torch.cuda.current_device()) == (9, 0)
    assert tma == (hopper and gluon_kvouter.HAVE_GLUON
                   and gluon_kvouter.triton_version().startswith(gluon_kvouter.TESTED_TRITON))
    want = _dispatch.DECODE_MAX_QUERIES if tma else _dispatch.DECODE_MAX_QUERIES_TL
    assert _dispatch.decode_max_queries(q, k, k, 128) == want
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    assert _dispatch.decode_max_queries(q8, k8, k8, 128) == want  # bf16 partials by default
    assert _dispatch.decode_max_queries(q, k8, k8, 128) == want  # a float q over fp8 caches
    assert _dispatch.decode_max_queries(q[:, :16], k, k, 128) == _dispatch.DECODE_MAX_QUERIES_TL  # G = 4
    assert _dispatch.decode_max_queries(q[0], k, k, 128) == _dispatch.DECODE_MAX_QUERIES_TL  # the op will refuse it
    # The tl kernel asked for by a config: the TMA kernel is not considered.
    tl_only = m3_sparse.KVOuterConfig(engine="triton")
    assert _dispatch.tma_partials_reason(q, k, k, 128, None, None, 4, 0, cfg=tl_only) == "engine='triton'"


def test_a_kvouter_call_leaves_its_short_sequences_to_the_decode_kernel(monkeypatch):
    """A call past the decode bound whose other sequences bring at most MIXED_DECODE_ROWS rows
    (a serving step: prefill chunks beside decode rows): KV-outer gets the long sequences'
    selections only (the short ones' emptied), the decode kernel writes the short ones' rows,
    and every row matches the oracle, the rows that see nothing included."""
    from m3_sparse import api
    from m3_sparse.decode import attention_triton as decode_triton

    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")  # the kernels, in the interpreter on a CPU
    rows = _dispatch.MIXED_DECODE_ROWS
    bound = rows + 6
    monkeypatch.setattr(_dispatch, "DECODE_MAX_QUERIES", bound)
    monkeypatch.setattr(_dispatch, "DECODE_MAX_QUERIES_TL", bound)
    # Decode rows, short chunks at and past the row bound, a long chunk, a sequence with no
    # key, one with no rows.
    seqs = [(33, 1), (60, bound + 3), (9, rows), (70, rows + 1), (5, 2), (0, 2), (12, 0), (40, 1)]
    g = gen(31)
    batch = make_batch(g, seqs, 16)
    q = randn(g, batch.num_tokens, 4, 16)
    k, v = batch.kv_cache(g, 2, 16), batch.kv_cache(g, 2, 16)
    sel = random_selection(g, batch, 2, 3, 16)
    given = []
    real_kvouter = api._kvouter
    monkeypatch.setattr(api, "_kvouter", lambda args, *rest: given.append(args.selected) or real_kvouter(args, *rest))
    launches = []
    real_run = decode_triton.DecodeLaunch.run
    monkeypatch.setattr(decode_triton.DecodeLaunch, "run",
                        lambda self, *a, **kw: launches.append(self.rows_per_seq) or real_run(self, *a, **kw))
    args = (q, k, v, sel, batch.block_tables)
    out, lse = m3_sparse.sparse_attention(*args, **batch.kwargs(), block_size=16, max_seqlen_q=bound + 3,
                                          return_lse=True)
    short = torch.tensor([n <= rows for _, n in seqs for _ in range(n)])
    assert launches == [rows] and len(given) == 1
    assert torch.all(given[0][short] == -1), "KV-outer was given a short sequence's selections"
    assert torch.equal(given[0][~short], sel[~short])
    ref = sparse_attention_ref(*args, batch.cu_seqlens_q, batch.used_kv_lens, None, True, 16)
    assert_close("out", ref[0], out, TOLERANCES[torch.float32])
    assert_close("lse", ref[1], lse, TOLERANCES[torch.float32])


@pytest.mark.parametrize("case", ["one_sequence", "torch", "decode_cannot"])
def test_a_kvouter_call_keeps_every_row_where_the_split_buys_nothing(case, monkeypatch):
    """No decode rows are taken out of a call of one sequence, of the torch code (each row is
    computed on its own either way), or of a call the decode kernel cannot take (top-k past
    its limit)."""
    monkeypatch.setenv("M3_SPARSE_IMPL", "torch" if case == "torch" else "triton")
    topk = 80 if case == "decode_cannot" else 3
    seqs = [(40, 20)] if case == "one_sequence" else [(40, 20), (9, 1)]
    g = gen(32)
    batch = make_batch(g, seqs, 16)
    q = randn(g, batch.num_tokens, 4, 16)
    k = batch.kv_cache(g, 2, 16)
    sel = random_selection(g, batch, 2, topk, 16)
    args = AttnArgs(q=q, k_cache=k, v_cache=k, block_tables=batch.block_tables, cu_seqlens_q=batch.cu_seqlens_q,
                    used_kv_lens=batch.used_kv_lens, batch=len(seqs), softmax_scale=1.0, causal=True,
                    return_lse=False, scales=None, out_dtype=q.dtype, selected=sel, block_size=16)
    assert _dispatch.mixed_decode_rows(args) == 0
    # What changes it: a second sequence and a top-k the decode kernel takes (the Triton code).
    two = args.replace(batch=2, selected=sel[..., :3])
    assert _dispatch.mixed_decode_rows(two) == (0 if case == "torch" else _dispatch.MIXED_DECODE_ROWS)
