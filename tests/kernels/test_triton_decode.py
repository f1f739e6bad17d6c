"""Sparse decode attention (query-outer, blocks split over programs): the Triton kernel and
the torch version against the float64 oracle, on fresh random inputs.

Decode-shaped batches: several sequences of 1..16 new tokens over ragged cached lengths
(some shorter than a block, some with more queries than keys), paged caches under
shuffled block tables, page sizes 16/32/64 with blocks smaller, equal and larger,
selections with -1 slots, repeated ids and rows that select nothing.

Without a CUDA device the kernel runs in Triton's interpreter at tiny shapes; with one
it runs natively, plus M3-sized shapes and a CUDA-graph capture.
"""

from __future__ import annotations

import math
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
    kernel_module,
    assert_close,
    gen,
    is_poisoned,
    make_batch,
    poisoned_allocations,
    randn,
    random_selection,
)
from m3_sparse.decode.attention_triton import DecodeConfig  # noqa: E402
from m3_sparse.reference import sparse_attention_ref  # noqa: E402


tdec = kernel_module("m3_sparse.decode.attention_triton")


from m3_sparse.decode import plan as decplan  # noqa: E402

DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
LSE_TOL = TOLERANCES[torch.float32]

# (kv_len, q_len): decode steps of 1..16 tokens over ragged caches, a sequence shorter
# than one block, one whose first queries precede its first key, an empty sequence.
DECODE_SEQS = [(45, 1), (9, 3), (130, 8), (3, 4), (0, 0)]


def _to(*xs):
    return [x.to(DEVICE) for x in xs]


def _setup(seed, seqs, page_size, block_size, hq, hkv, d, topk, dtype, *, causal=True, pad="pool", **sel_kwargs):
    g = gen(seed)
    batch = make_batch(g, seqs, page_size, pad=pad)
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k = batch.kv_cache(g, hkv, d, dtype)
    v = batch.kv_cache(g, hkv, d, dtype)
    sel = random_selection(g, batch, hkv, topk, block_size, causal=causal, **sel_kwargs)
    return batch, q, k, v, sel


def decode_torch(*args, **kw):
    """The torch path of ``sparse_decode_attention`` whatever the device."""
    return m3_sparse.sparse_decode_attention(*args, **kw, config=DecodeConfig(impl="torch"))


def _oracle(batch, q, k, v, sel, block_size, causal=True, scale=None):
    return sparse_attention_ref(
        q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, scale, causal, block_size
    )


def _run_triton(batch, q, k, v, sel, block_size, *, causal=True, scale=None, return_lse=True, arrival_counts=None,
                **launch):
    qd, kd, vd, sd, bt, cu, kv = _to(q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    with poisoned_allocations():
        out, lse = tdec.sparse_decode_attention_triton(
            qd, kd, vd, sd, bt, cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=scale, causal=causal,
            block_size=block_size, return_lse=return_lse, config=decplan.DecodeConfig(**launch),
            arrival_counts=arrival_counts,
        )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not is_poisoned(out).any(), "output elements never written"
    if return_lse:
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
        assert not is_poisoned(lse).any(), "lse elements never written"
    else:
        assert lse is None
    return out, lse


def _check(name, ref, out, lse, dtype):
    ref_out, ref_lse = ref
    assert_close(f"{name} out", ref_out, out, TOLERANCES[dtype])
    if lse is not None:
        assert_close(f"{name} lse", ref_lse, lse, LSE_TOL)


# --------------------------------------------------------------------------- against the oracle

CASES = [
    # page, block, hq, hkv, topk, dtype, num_splits, block_n
    (16, 16, 4, 4, 4, torch.float32, None, None),  # G = 1, block = page
    (16, 32, 8, 2, 4, torch.bfloat16, 2, None),  # block > page: a chunk gathers two pages
    (16, 64, 16, 1, 4, torch.float32, 3, 16),  # block = 4 pages, chunks of one page
    (32, 16, 16, 4, 1, torch.float16, 1, None),  # block < page, topk 1, one split
    (64, 32, 16, 1, 16, torch.bfloat16, None, 16),  # G = 16, topk 16, two chunks per block
    (32, 64, 8, 2, 16, torch.float16, 5, 32),  # uneven splits
]


@pytest.mark.parametrize("page_size,block_size,hq,hkv,topk,dtype,num_splits,block_n", CASES)
def test_decode_matches_reference(page_size, block_size, hq, hkv, topk, dtype, num_splits, block_n):
    seed = page_size * 7 + block_size + hq + topk
    batch, q, k, v, sel = _setup(seed, DECODE_SEQS, page_size, block_size, hq, hkv, 16, topk, dtype)
    ref = _oracle(batch, q, k, v, sel, block_size)
    out, lse = _run_triton(batch, q, k, v, sel, block_size, num_splits=num_splits, block_n=block_n)
    _check("triton", ref, out, lse, dtype)
    # Rows that see nothing (a query before its first key, an all-empty selection).
    none = ref[1] == float("-inf")
    assert none.any(), "test setup: want rows that see no key"
    assert torch.all(out.cpu().transpose(0, 1)[none] == 0)


def test_sequence_search_over_several_vectors(monkeypatch):
    """A program finds its token's sequence counting over vectors of cu_seqlens_q
    (core.launch.seq_vector); vectors of two sequences make that three steps here."""
    from m3_sparse.core import launch

    monkeypatch.setattr(launch, "SEQ_VECTOR_MIN", 2)
    monkeypatch.setattr(launch, "SEQ_VECTOR_MAX", 2)
    batch, q, k, v, sel = _setup(5, DECODE_SEQS, 16, 32, 8, 2, 16, 4, torch.float32)
    out, lse = _run_triton(batch, q, k, v, sel, 32, num_splits=2)
    _check("triton", _oracle(batch, q, k, v, sel, 32), out, lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_version_matches_reference(dtype):
    batch, q, k, v, sel = _setup(11, DECODE_SEQS, 16, 32, 8, 2, 16, 6, dtype)
    with poisoned_allocations():
        out, lse = decode_torch(
            q, k, v, sel, batch.block_tables, **batch.kwargs(), softmax_scale=0.25, causal=True, block_size=32,
            return_lse=True,
        )
    _check("torch", _oracle(batch, q, k, v, sel, 32, scale=0.25), out, lse, dtype)


def test_non_causal_sees_the_whole_sequence():
    # Non-causal selections may hold blocks after a query's position.
    batch, q, k, v, sel = _setup(21, [(50, 3), (20, 2), (33, 1)], 16, 16, 8, 2, 16, 4, torch.float32, causal=False)
    ref = _oracle(batch, q, k, v, sel, 16, causal=False)
    out, lse = _run_triton(batch, q, k, v, sel, 16, causal=False, num_splits=2)
    _check("triton", ref, out, lse, torch.float32)
    out_t, lse_t = decode_torch(
        q, k, v, sel, batch.block_tables, **batch.kwargs(), softmax_scale=16**-0.5, causal=False, block_size=16,
        return_lse=True,
    )
    _check("torch", ref, out_t, lse_t, torch.float32)


def test_causal_cuts_blocks_past_the_position():
    """Selections that name blocks after the query (or past the sequence): only keys up
    to the query's position count."""
    g = gen(33)
    batch = make_batch(g, [(70, 4), (40, 2)], 16, extra_cols=3)
    q = randn(g, batch.num_tokens, 4, 16)
    k, v = batch.kv_cache(g, 1, 16), batch.kv_cache(g, 1, 16)
    max_blocks = batch.capacity // 16
    sel = torch.randint(0, max_blocks, (batch.num_tokens, 1, 6), generator=g, dtype=torch.int32)
    ref = _oracle(batch, q, k, v, sel, 16)
    out, lse = _run_triton(batch, q, k, v, sel, 16, num_splits=3)
    _check("triton", ref, out, lse, torch.float32)


def test_split_counts_agree():
    """The split count changes the merge order only: fp32 results agree to rounding."""
    # A speculative-decode step: 16 new tokens of one sequence.
    batch, q, k, v, sel = _setup(41, [(100, 16)], 16, 32, 4, 1, 16, 4, torch.float32)
    outs = [_run_triton(batch, q, k, v, sel, 32, num_splits=s) for s in (1, 3, 12)]
    for o, l in outs[1:]:
        assert_close("out vs one split", outs[0][0], o, 1e-6)
        assert_close("lse vs one split", outs[0][1], l, 1e-6)
    _check("triton", _oracle(batch, q, k, v, sel, 32), *outs[-1], torch.float32)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_merge_in_place_equals_merge_kernel(num_splits):
    """The last split merging in the launch and the second merge kernel do the same
    arithmetic in the same split order; both match the oracle, also on rows that see
    nothing and with a split count that leaves some splits without work."""
    batch, q, k, v, sel = _setup(91 + num_splits, DECODE_SEQS, 16, 32, 16, 2, 16, 4, torch.bfloat16)
    fused = _run_triton(batch, q, k, v, sel, 32, num_splits=num_splits, fused_merge=True)
    second = _run_triton(batch, q, k, v, sel, 32, num_splits=num_splits, fused_merge=False)
    assert_close("out, in place vs merge kernel", second[0].float(), fused[0].float(), 1e-6)
    assert_close("lse, in place vs merge kernel", second[1], fused[1], 1e-6)
    _check("triton", _oracle(batch, q, k, v, sel, 32), *fused, torch.bfloat16)


def test_kept_arrival_counts_are_left_zero():
    """A count buffer kept by the caller: each launch leaves it zero, so repeated calls
    (and a call with another split count) get the result of a fresh buffer."""
    batch, q, k, v, sel = _setup(97, DECODE_SEQS, 16, 32, 16, 2, 16, 4, torch.bfloat16)
    counts = torch.zeros(q.shape[0] * 2 + 5, dtype=torch.int32, device=DEVICE)
    fresh = _run_triton(batch, q, k, v, sel, 32, num_splits=3)
    for _ in range(3):
        kept = _run_triton(batch, q, k, v, sel, 32, num_splits=3, arrival_counts=counts)
        assert torch.equal(kept[0], fresh[0]) and torch.equal(kept[1], fresh[1])
        assert torch.count_nonzero(counts).item() == 0
    fewer = _run_triton(batch, q, k, v, sel, 32, num_splits=2, arrival_counts=counts)
    _check("triton, kept counts", _oracle(batch, q, k, v, sel, 32), *fewer, torch.bfloat16)
    assert torch.count_nonzero(counts).item() == 0


def _merge_oracle(o_ws, m_ws, l_ws, num_tokens, hq, group, num_splits):
    """The split merge by KV-outer's torch combine (the same merge, over entries a reverse map
    names), run in float64: split s of (token t, kv head g) is entry (t * Hkv + g) * S + s, and
    its m goes from log2 to natural units. A row no split saw is 0 with lse -inf."""
    from m3_sparse.kvouter.combine import combine_torch

    entries = num_tokens * (hq // group) * num_splits
    slot_of = torch.arange(entries, device=o_ws.device).view(num_tokens, hq // group, num_splits)
    return combine_torch(
        o_ws.double().view(entries, group, -1), m_ws.double().view(entries, group) * math.log(2),
        l_ws.double().view(entries, group), slot_of, torch.float64, True,
    )


@pytest.mark.parametrize("num_splits", [1, 5, 8, 13, 64])
def test_merge_splits_against_float64(num_splits):
    """``core.split_merge.merge_splits`` over split counts below, at and past a step of its
    loop, a ragged head dim and rows padded to the program's rows: splits that saw no key
    (m -inf) drop out, a row none of its splits saw comes out 0 with lse -inf."""
    from m3_sparse.core.split_merge import merge_splits

    torch.manual_seed(num_splits)
    num_tokens, hq, group, d = 3, 12, 4, 40
    rows = num_tokens * (hq // group) * num_splits * group
    o_ws = torch.randn(rows, d, device=DEVICE)
    m_ws = torch.randn(rows, device=DEVICE) * 4
    l_ws = torch.rand(rows, device=DEVICE) + 0.5
    m_ws[torch.rand(rows, device=DEVICE) < 0.3] = float("-inf")  # splits that saw no key
    view = m_ws.view(num_tokens, hq // group, num_splits, group)
    view[1, 2, :, 3] = float("-inf")  # token 1, head 11: no split saw a key
    out = torch.full((num_tokens, hq, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((hq, num_tokens), float("nan"), device=DEVICE)
    merge_splits(o_ws, m_ws, l_ws, out, lse, num_splits, group)
    want_out, want_lse = _merge_oracle(o_ws, m_ws, l_ws, num_tokens, hq, group, num_splits)
    assert_close("merged out", want_out.float(), out.float(), TOLERANCES[torch.bfloat16])
    assert lse[11, 1] == float("-inf") and torch.all(out[1, 11] == 0)
    assert_close("merged lse", want_lse.float(), lse, 1e-5)


@pytest.mark.parametrize("fused_merge", [True, False], ids=["merge_in_place", "merge_kernel"])
def test_a_launch_run_again_reuses_its_scratch(fused_merge):
    """A launch (a plan's) keeps its split workspaces and arrival counts between runs: runs
    on fresh inputs of the planned shapes are each right, with one set of scratch buffers."""
    from m3_sparse.core.validate import attention_args

    batch, q, k, v, sel = _setup(99, DECODE_SEQS, 16, 32, 16, 2, 16, 4, torch.bfloat16)
    bt, cu, kv = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    meta = dict(cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=None, causal=True, return_lse=True, block_size=32)
    args = attention_args(*_to(q, k, v), bt, selected=_to(sel)[0], **meta)
    launch = tdec.DecodeLaunch(args, decplan.DecodeConfig(num_splits=3, fused_merge=fused_merge))
    assert launch.plan.merge is fused_merge and not launch.plan.final
    sets = []
    for seed in (100, 101, 102):
        _, q, k, v, sel = _setup(seed, DECODE_SEQS, 16, 32, 16, 2, 16, 4, torch.bfloat16)
        out, lse = launch.run(*_to(q, k, v, sel))
        _check(f"run {seed}", _oracle(batch, q, k, v, sel, 32), out.cpu(), lse.cpu(), torch.bfloat16)
        sets.append(launch.scratch.get(out.device) + ((launch.counts.get(out.device),) if fused_merge else ()))
        if fused_merge:
            assert torch.count_nonzero(sets[-1][3]).item() == 0
    assert all(a is b for s in sets for a, b in zip(s, sets[0]))


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda n, d: torch.zeros(n, dtype=torch.int64, device=d), "int32"),
        (lambda n, d: torch.zeros(n - 1, dtype=torch.int32, device=d), "at least"),
        (lambda n, d: torch.zeros(2 * n, dtype=torch.int32, device=d)[::2], "contiguous"),
        (lambda n, d: torch.ones(n, dtype=torch.int32, device=d), "expected zeros"),
    ],
)
def test_arrival_counts_are_checked(bad, match, num_splits, monkeypatch):
    """Checked whenever given, also where the launch needs no merge; nonzero counts
    (value checks: on the CPU, or with M3_SPARSE_DEBUG on a GPU) are refused."""
    monkeypatch.setenv("M3_SPARSE_DEBUG", "1")
    batch, q, k, v, sel = _setup(98, DECODE_SEQS, 16, 32, 16, 2, 16, 4, torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        _run_triton(batch, q, k, v, sel, 32, num_splits=num_splits, arrival_counts=bad(q.shape[0] * 2, DEVICE))


def test_repeated_ids_count_once_and_empty_rows():
    batch, q, k, v, sel = _setup(
        63, [(90, 4), (20, 3)], 16, 16, 4, 2, 16, 4, torch.float32, empty_frac=0.0, dup_frac=0.0
    )
    rep = sel.clone()
    rep[..., 2:] = sel[..., :2]  # every valid id twice
    rep[0] = -1  # token 0 selects nothing on both heads
    rep[5, 1] = -1
    single = rep.clone()
    single[..., 2:] = -1
    out_r, lse_r = _run_triton(batch, q, k, v, rep, 16, num_splits=2)
    out_s, lse_s = _run_triton(batch, q, k, v, single, 16, num_splits=2)
    # Deduplicated, both rows hold the same blocks in the same order: the same work.
    assert torch.equal(out_r, out_s) and torch.equal(lse_r, lse_s)
    assert torch.all(out_r[0] == 0) and torch.all(lse_r[:, 0] == float("-inf"))
    assert torch.all(out_r[5, 2:] == 0) and torch.all(lse_r[2:, 5] == float("-inf"))
    _check("triton", _oracle(batch, q, k, v, rep, 16), out_r, lse_r, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_all_slots_empty(num_splits):
    batch, q, k, v, _ = _setup(5, [(20, 3), (1, 1)], 16, 16, 4, 1, 16, 2, torch.bfloat16)
    sel = torch.full((batch.num_tokens, 1, 2), -1, dtype=torch.int32)
    out, lse = _run_triton(batch, q, k, v, sel, 16, num_splits=num_splits)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
def test_block_table_padding_never_addresses_kv(pad):
    # Local blocks end inside a page whose table successors hold `pad`; block 64 > page 16.
    # Entries of any selected id inside the table row may be loaded (also of blocks past the
    # kv length); they are never followed to K/V.
    batch, q, k, v, sel = _setup(80, [(40, 3), (100, 2), (16, 2)], 16, 64, 4, 2, 16, 3, torch.float32, pad=pad)
    batch.block_tables[:, -1] = pad
    ref = _oracle(batch, q, k, v, sel, 64)
    for block_n in (16, 64):  # a table entry per chunk, and per key
        out, lse = _run_triton(batch, q, k, v, sel, 64, num_splits=2, block_n=block_n)
        _check(f"triton block_n {block_n}", ref, out, lse, torch.float32)


def test_int64_indices_and_strided_selection():
    batch, q, k, v, sel = _setup(90, [(60, 2), (30, 3)], 32, 16, 8, 2, 16, 3, torch.float16)
    ref = _oracle(batch, q, k, v, sel, 16)
    batch.block_tables = batch.block_tables.long()
    batch.cu_seqlens_q = batch.cu_seqlens_q.long()
    batch.used_kv_lens = batch.used_kv_lens.long()
    wide = torch.full((sel.shape[0], sel.shape[1], 2 * sel.shape[2]), -1, dtype=torch.int64)
    wide[..., ::2] = sel
    out, lse = _run_triton(batch, q, k, v, wide[..., ::2], 16, num_splits=2)
    _check("triton", ref, out, lse, torch.float16)


def test_without_lse_and_without_tokens():
    batch, q, k, v, sel = _setup(3, [(30, 2), (10, 1)], 16, 16, 4, 2, 16, 2, torch.float32)
    out, lse = _run_triton(batch, q, k, v, sel, 16, return_lse=False, num_splits=2)
    assert_close("out", _oracle(batch, q, k, v, sel, 16)[0], out, 1e-5)
    empty = make_batch(gen(4), [(30, 0)], 16)
    e = _run_triton(empty, q[:0], k, v, sel[:0], 16)
    assert e[0].shape == (0, 4, 16) and e[1].shape == (4, 0)


# --------------------------------------------------------------------------- short rows of a mixed call

# (kv_len, q_len): decode rows and short sequences (1..4 rows) beside longer chunks (5 and 20
# rows, which KV-outer owns in a mixed call), one with no rows, one whose rows precede its keys.
MIXED_SEQS = [(45, 1), (130, 20), (9, 3), (3, 4), (0, 0), (70, 5), (20, 2), (1, 3)]
SHORT_ROWS = 4


def _short_mask(seqs, rows) -> torch.Tensor:
    """[Tq] bool: the rows of sequences of at most ``rows`` query rows."""
    return torch.tensor([n <= rows for _, n in seqs for _ in range(n)])


@pytest.mark.parametrize("num_splits,fused_merge", [(None, True), (1, True), (3, True), (3, False)],
                         ids=["default", "one_split", "splits", "splits_merge_kernel_asked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_rows_of_a_mixed_call(num_splits, fused_merge, dtype):
    """``rows_per_seq``: the rows of sequences of at most R query rows come out as the oracle's,
    written into the given outputs; every other row keeps what they held (a poison value, bit
    for bit), in out and lse. Splits merge in the launch even when the merge kernel is asked
    for (it numbers workspace rows by token)."""
    from m3_sparse.core.validate import attention_args

    batch, q, k, v, sel = _setup(211, MIXED_SEQS, 16, 32, 8, 2, 16, 4, dtype)
    ref_out, ref_lse = _oracle(batch, q, k, v, sel, 32)
    short = _short_mask(MIXED_SEQS, SHORT_ROWS)
    assert short.any() and (~short).any()
    bt, cu, kv = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    args = attention_args(*_to(q, k, v), bt, cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=None, causal=True,
                          return_lse=True, block_size=32, selected=_to(sel)[0])
    cfg = decplan.DecodeConfig(num_splits=num_splits, fused_merge=fused_merge)
    launch = tdec.DecodeLaunch(args, cfg, rows_per_seq=SHORT_ROWS)
    # One program per (sequence, row) and kv head: the 20-row chunk costs no more than a decode row.
    assert launch.grid[:2] == (len(MIXED_SEQS) * SHORT_ROWS, 2)
    out = torch.full(q.shape, 7.0, dtype=dtype, device=DEVICE)
    lse = torch.full((q.shape[1], q.shape[0]), 7.0, device=DEVICE)
    got = launch.run(*_to(q, k, v, sel), out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    out, lse = out.cpu(), lse.cpu()
    assert torch.all(out[~short] == 7.0) and torch.all(lse[:, ~short] == 7.0), "a long sequence's row was written"
    _check("short rows", (ref_out[short], ref_lse[:, short]), out[short], lse[:, short], dtype)


def test_short_rows_need_outputs_to_write_into():
    from m3_sparse.core.validate import attention_args

    batch, q, k, v, sel = _setup(212, [(30, 2), (40, 9)], 16, 16, 4, 2, 16, 2, torch.float32)
    args = attention_args(q, k, v, batch.block_tables, **batch.kwargs(), selected=sel, block_size=16,
                          softmax_scale=None, causal=True, return_lse=False)
    launch = tdec.DecodeLaunch(args, rows_per_seq=2)
    with pytest.raises(ValueError, match="given outputs"):
        launch.run(q, k, v, sel)
    with pytest.raises(ValueError, match="rows_per_seq"):
        tdec.DecodeLaunch(args, rows_per_seq=-1)


# --------------------------------------------------------------------------- public entry point


def test_public_entry_runs_torch_on_cpu_and_triton_when_asked(monkeypatch):
    batch, q, k, v, sel = _setup(7, [(45, 2), (9, 3)], 16, 32, 8, 2, 16, 4, torch.float32)
    ref = _oracle(batch, q, k, v, sel, 32)
    calls = []
    real = tdec.DecodeLaunch.run  # the kernel's launch, whoever sets it up
    monkeypatch.setattr(tdec.DecodeLaunch, "run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv("M3_SPARSE_IMPL", raising=False)
    args = _to(q, k, v, sel, batch.block_tables)
    kw = dict(cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE), used_kv_lens=batch.used_kv_lens.to(DEVICE))
    out, lse = m3_sparse.sparse_decode_attention(*args, **kw, block_size=32, return_lse=True)
    _check("auto", ref, out, lse, torch.float32)
    assert len(calls) == (1 if HAS_CUDA else 0)
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    out, lse = m3_sparse.sparse_decode_attention(*args, **kw, block_size=32, return_lse=True)
    _check("triton", ref, out, lse, torch.float32)
    assert len(calls) == (2 if HAS_CUDA else 1)
    monkeypatch.setenv("M3_SPARSE_IMPL", "torch")
    out, lse = m3_sparse.sparse_decode_attention(*args, **kw, block_size=32)
    assert lse is None
    assert_close("torch", ref[0], out, 1e-5)


def test_public_entry_validates(monkeypatch):
    batch, q, k, v, sel = _setup(8, [(45, 2)], 16, 32, 4, 2, 16, 4, torch.float32)
    kw = batch.kwargs()
    with pytest.raises(ValueError, match="selected"):
        m3_sparse.sparse_decode_attention(q, k, v, sel[:, :1], batch.block_tables, **kw, block_size=32)
    with pytest.raises(ValueError, match="selected"):
        m3_sparse.sparse_decode_attention(q, k, v, sel + 100, batch.block_tables, **kw, block_size=32)
    with pytest.raises(ValueError, match="softmax_scale"):
        m3_sparse.sparse_decode_attention(q, k, v, sel, batch.block_tables, **kw, softmax_scale=-1.0, block_size=32)
    # A block size the kernel lacks: the torch version takes it, an explicit Triton request refuses it.
    monkeypatch.delenv("M3_SPARSE_IMPL", raising=False)
    out, _ = m3_sparse.sparse_decode_attention(q, k, v, sel.clamp(max=0), batch.block_tables, **kw, block_size=24)
    assert_close("block 24", _oracle(batch, q, k, v, sel.clamp(max=0), 24)[0], out, 1e-5)
    # So does a selection wider than the kernel's slot limit.
    wide = torch.cat([sel, torch.full((sel.shape[0], sel.shape[1], 61), -1, dtype=sel.dtype)], -1)
    out, _ = m3_sparse.sparse_decode_attention(q, k, v, wide, batch.block_tables, **kw, block_size=32)
    assert_close("topk 65", _oracle(batch, q, k, v, sel, 32)[0], out, 1e-5)
    dev = _to(q, k, v, sel, wide, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    qd, kd, vd, sd, wd, bt = dev[:6]
    kw = {"cu_seqlens_q": dev[6], "used_kv_lens": dev[7]}
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    with pytest.raises(ValueError, match="decode kernel needs block_size a power of two"):
        m3_sparse.sparse_decode_attention(qd, kd, vd, sd, bt, **kw, block_size=24)
    with pytest.raises(ValueError, match="topk up to 64, got 65"):
        m3_sparse.sparse_decode_attention(qd, kd, vd, wd, bt, **kw, block_size=32)


def test_default_num_splits_from_shapes(monkeypatch):
    cpu = torch.device("cpu")  # stands in for 4 SMs
    cfg = decplan.DecodeConfig(programs_per_sm=4, min_chunks_per_split=2)
    assert decplan.default_num_splits(16, 1, 16, 128, cpu, cfg=cfg) == 1  # the tokens alone fill the target
    assert decplan.default_num_splits(1, 1, 16, 128, cpu, block_n=64, cfg=cfg) == 16  # 16 programs of 2 chunks
    assert decplan.default_num_splits(1, 1, 2, 128, cpu, block_n=128, cfg=cfg) == 1  # one chunk each: nothing to split
    for n, want in ((1, 4), (2, 4), (3, 4), (5, 2)):
        assert decplan.default_num_splits(n, 2, 4, 32, cpu, block_n=16, cfg=cfg) == want  # at most 8 chunks / 2


# --------------------------------------------------------------------------- GPU code generation

# Compiles the kernels for an H100/H200 (sm_90) without a GPU: Triton's frontend, its GPU
# passes and ptxas, which the interpreter never runs. It runs in a fresh interpreter
# because TRITON_INTERPRET=1 (set for this process) changes how Triton's own library
# functions are built. Integer arguments are typed i32, and pointers and strides marked
# divisible by 16, as the JIT specializes them at launch.
SM90_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from m3_sparse.decode import attention_triton as tdec
from m3_sparse.decode import plan as decplan
from m3_sparse.core import split_merge

import triton.language as tl

def build(kernel, constexprs, pointers, num_warps, num_stages=3):
    names = list(kernel.arg_names)
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "qk_scale" else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers or n.startswith("stride_")}
    src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)

def split_case(dtype, num_warps, **kw):
    out = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    cx = dict(G=16, RP=16, D=128, BD=128, BS=128, BN=64, PS=128, TOPK_P2=16, CAUSAL=True, FINAL=False,
              RETURN_LSE=True, SEQ_CHUNK=32, SEQ_STEPS=1, ROWS=0, PREC=None, Q_FP8=False, KV_FP8=False,
              WIDEN_K=False, PV_DT=out.get(dtype, tl.bfloat16))
    kv_dtype = kw.pop("kv_dtype", dtype)
    cx.update(kw)
    cx.setdefault("MERGE", not cx["FINAL"])
    out_dt = {"fp8e4nv": "bf16"}.get(dtype, dtype)
    ptrs = {"q_ptr": "*" + dtype, "k_ptr": "*" + kv_dtype, "v_ptr": "*" + kv_dtype, "scale_ptr": "*fp32"}
    ptrs.update({n: "*i32" for n in ("sel_ptr", "bt_ptr", "cu_ptr", "kvlen_ptr", "cnt_ptr")})
    ptrs.update(o_ptr=("*" + out_dt) if cx["FINAL"] else "*fp32", m_ptr="*fp32", l_ptr="*fp32",
                out_ptr="*" + out_dt, lse_ptr="*fp32")
    return build(tdec._decode_split_kernel, cx, ptrs, num_warps)

res = {}
cases = {
    "m3": lambda: split_case("bf16", 4),  # M3 decode: page 128, chunks of 64 keys, partials merged in place
    "m3-merge-kernel": lambda: split_case("bf16", 4, MERGE=False),  # partials merged by a second launch
    "m3-short-rows": lambda: split_case("bf16", 4, ROWS=4),  # the decode rows of a mixed call
    "final-page64": lambda: split_case("bf16", 8, FINAL=True, PS=64, BN=128, SEQ_STEPS=3),  # chunks over two pages
    "fp16-g64": lambda: split_case("fp16", 4, G=64, RP=64, PS=16, BN=16, BS=64, TOPK_P2=32),
    "fp32-d96": lambda: split_case("fp32", 4, G=1, D=96, PREC="ieee"),
    # fp8 K/V against a bf16 q (K widened), and fp8 q too (an fp8 MMA), bf16 output
    "fp8-kv": lambda: split_case("bf16", 4, kv_dtype="fp8e4nv", KV_FP8=True, WIDEN_K=True),
    "fp8-qkv-final": lambda: split_case("fp8e4nv", 4, kv_dtype="fp8e4nv", Q_FP8=True, KV_FP8=True, FINAL=True),
    "combine": lambda: build(
        split_merge._merge_splits_kernel, dict(SC=32, G=16, RB=2, D=128, BD=128, RETURN_LSE=True),
        {"o_ws_ptr": "*fp32", "m_ws_ptr": "*fp32", "l_ws_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32"}, 4),
}
for name, make in cases.items():
    try:
        ttgir = make().asm["ttgir"]
        res[name] = {"ok": True, "pipelined": "async_copy_global_to_local" in ttgir or "async_tma" in ttgir}
    except Exception as e:
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
print("RESULT " + json.dumps(res))
"""


def test_kernels_compile_for_sm90():
    """Every kernel variant builds for the GPU; on the M3 configuration Triton also
    software-pipelines the K/V loads (asynchronous copies into shared memory), without
    which the kernel is latency-bound."""
    from kernel_test_utils import aot_compile

    res = aot_compile(SM90_SCRIPT)
    bad = {k: v["error"] for k, v in res.items() if not v["ok"]}
    assert not bad, f"kernels that do not compile for sm_90: {bad}"
    for case in ("m3", "m3-short-rows"):
        assert res[case]["pipelined"], f"K/V loads of the M3 configuration ({case}) are not pipelined"


# --------------------------------------------------------------------------- CUDA, full size


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(64, 4), (32, 8), (16, 16), (128, 1)])
@pytest.mark.parametrize("page_size", [64, 128])
def test_m3_shapes_match_torch_cuda(hq, hkv, page_size):
    seqs = [(5000, 1), (129, 16), (77, 3), (1300, 4), (2048, 8)]
    batch, q, k, v, sel = _setup(hq + page_size, seqs, page_size, 128, hq, hkv, 128, 16, torch.bfloat16)
    qd, kd, vd, sd, bt, cu, kv = _to(q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    ref = decode_torch(
        qd, kd, vd, sd, bt, cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=128**-0.5, causal=True,
        block_size=128, return_lse=True,
    )
    for splits in (None, 1, 8):
        out, lse = _run_triton(batch, q, k, v, sel, 128, num_splits=splits)
        assert_close("out", ref[0].float(), out.float(), TOLERANCES[torch.bfloat16])
        assert_close("lse", ref[1], lse, LSE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,num_stages,num_warps", [(32, 2, 4), (64, 3, 4), (128, 2, 8), (128, 3, 4)])
def test_launch_variants_cuda(block_n, num_stages, num_warps):
    batch, q, k, v, sel = _setup(block_n, [(4000, 2), (300, 5)], 64, 128, 64, 4, 128, 16, torch.bfloat16)
    ref = _oracle(batch, q, k, v, sel, 128)
    out, lse = _run_triton(
        batch, q, k, v, sel, 128, num_splits=4, block_n=block_n, num_stages=num_stages, num_warps=num_warps
    )
    _check("triton", ref, out, lse, torch.bfloat16)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    batch, q, k, v, sel = _setup(77, [(3000, 1), (900, 1), (40, 1)], 128, 128, 64, 4, 128, 16, torch.bfloat16)
    qd, kd, vd, sd, bt, cu, kv = _to(q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)

    def call():
        return m3_sparse.sparse_decode_attention(
            qd, kd, vd, sd, bt, cu_seqlens_q=cu, used_kv_lens=kv, block_size=128, return_lse=True
        )

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = call()
    # Replayed twice: the arrival counts of the in-place split merge start from zero
    # at every replay (a stale count would leave rows unmerged or merged early).
    for _ in range(2):
        qd.copy_(torch.randn_like(qd))
        g_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        out, lse = call()
        assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


@pytest.mark.gpu
def test_mixed_step_m3_shapes_match_torch_cuda(monkeypatch):
    """A serving step at M3's shapes: a 2K-row prefill chunk over a history and a 300-row one,
    beside decode rows and short chunks. ``sparse_attention`` runs KV-outer for the chunks and
    the decode kernel's short rows for the rest (both launches seen), against the torch code;
    captured in a CUDA graph, its replays give the same outputs."""
    seqs = [(6144, 2048), (5000, 1), (129, 1), (77, 3), (1300, 4), (700, 300), (2048, 1), (90, 5)]
    batch, q, k, v, sel = _setup(303, seqs, 128, 128, 64, 4, 128, 16, torch.bfloat16)
    qd, kd, vd, sd, bt, cu, kv = _to(q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)

    def call():
        return m3_sparse.sparse_attention(
            qd, kd, vd, sd, bt, cu_seqlens_q=cu, used_kv_lens=kv, block_size=128, max_seqlen_q=2048, return_lse=True
        )

    monkeypatch.setenv("M3_SPARSE_IMPL", "torch")
    ref = call()
    monkeypatch.delenv("M3_SPARSE_IMPL")
    launches = []
    real_run = tdec.DecodeLaunch.run
    monkeypatch.setattr(tdec.DecodeLaunch, "run",
                        lambda self, *a, **kw: launches.append(self.rows_per_seq) or real_run(self, *a, **kw))
    out, lse = call()
    assert launches == [m3_sparse.dispatch.MIXED_DECODE_ROWS]
    assert_close("out", ref[0].float(), out.float(), TOLERANCES[torch.bfloat16])
    assert_close("lse", ref[1], lse, LSE_TOL)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = call()
    for _ in range(2):
        g_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g_out, out) and torch.equal(g_lse, lse)
