"""index_topk (the index branch's block selection) against the per-token oracle.

The order of valid ids in a selection row is not part of the contract, so rows are
compared as sets (canonical form: valid ids ascending, then -1).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import m3_sparse
from kernel_test_utils import gen, make_batch, randn
from m3_sparse.reference import index_topk_ref

# Score gap under which two blocks may legitimately swap places (the implementation
# accumulates in fp32, the oracle in fp64). fp32 inputs make exact ties improbable,
# so fp32 selections must match exactly.
TIE_TOLERANCE = {torch.float32: 0.0, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def canon(sel: torch.Tensor) -> torch.Tensor:
    big = torch.iinfo(torch.int32).max
    s = torch.where(sel < 0, big, sel).sort(-1).values
    return torch.where(s == big, -1, s)


def selection_mismatches(batch, out, ref, scores, block_size, local_blocks, rel_tol):
    """Rows whose selection differs from the oracle's other than by a swap of two
    blocks whose oracle scores are within ``rel_tol`` (relative) of each other."""
    out_c = canon(out)
    bad = []
    for _, t, p in batch.tokens():
        last = p // block_size
        forced = {blk for blk in range(last, last - local_blocks, -1) if blk >= 0}
        for h in range(out.shape[1]):
            o = [x for x in out_c[t, h].tolist() if x >= 0]
            r = [x for x in ref[t, h].tolist() if x >= 0]
            if o == r:
                continue
            so, sr = set(o), set(r)
            extra = sorted(so - sr)
            missing = sorted(sr - so)
            ok = (
                rel_tol > 0
                and len(so) == len(o) == len(r)
                and forced <= so
                and all(x <= last for x in extra)
            )
            if ok:
                s = scores[t][h]
                extra.sort(key=lambda x: -float(s[x]))
                missing.sort(key=lambda x: -float(s[x]))
                for a, b in zip(extra, missing):
                    sa, sb = float(s[a]), float(s[b])
                    if abs(sa - sb) > rel_tol * max(abs(sa), abs(sb)):
                        ok = False
            if not ok:
                bad.append(f"token {t} (pos {p}) head {h}: expected {r}, got {o}")
    return bad


def run_and_compare(batch, iq, ik, topk, block_size, local_blocks=1, tie_dtype=None):
    out = m3_sparse.index_topk(
        iq, ik, batch.block_tables, **batch.kwargs(), topk=topk, block_size=block_size, local_blocks=local_blocks
    )
    assert out.dtype == torch.int32
    assert out.shape == (batch.num_tokens, iq.shape[1], topk)
    ref, scores = index_topk_ref(
        iq, ik, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, topk, block_size, local_blocks
    )
    tol = TIE_TOLERANCE[tie_dtype or ik.dtype]
    bad = selection_mismatches(batch, out, ref, scores, block_size, local_blocks, tol)
    assert not bad, f"{len(bad)} selection row(s) differ from the oracle; first: {bad[0]}"
    return out


# (page_size, block_size): blocks that are multiples of the page and divisors of it.
PAGE_BLOCK = [
    (16, 8),
    (16, 16),
    (16, 32),
    (16, 64),
    (64, 16),
    (64, 64),
    (64, 128),
    (128, 32),
    (128, 128),
    (128, 256),
]


def ragged_seqs(bs: int):
    """(kv_len, q_len): a sequence shorter than one block (full prefill), a short
    full prefill, two chunked prefills and a sequence without queries."""
    short = min(2 * bs + 5, 70)
    return [(bs // 2, bs // 2), (short, short), (6 * bs + 3, 5), (9 * bs + bs // 3, 2), (3 * bs, 0)]


@pytest.mark.parametrize("page_size,block_size", PAGE_BLOCK)
@pytest.mark.parametrize("seed", [0, 1])
def test_varlen_paged(seed, page_size, block_size):
    g = gen(seed)
    batch = make_batch(g, ragged_seqs(block_size), page_size)
    iq = randn(g, batch.num_tokens, 3, 16)
    ik = batch.index_cache(g, 16)
    run_and_compare(batch, iq, ik, topk=4, block_size=block_size)


@pytest.mark.parametrize(
    "topk,local_blocks", [(k, n) for k in (1, 2, 4, 8, 16) for n in (1, 2) if n <= k] + [(1, 0), (4, 0)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_topk_and_local_blocks(seed, topk, local_blocks):
    g = gen(100 + seed)
    # 333 tokens = 21 blocks of 16: more visible blocks than the largest topk.
    batch = make_batch(g, [(5, 5), (200, 4), (333, 3), (17, 2), (40, 1)], page_size=16)
    iq = randn(g, batch.num_tokens, 2, 16)
    ik = batch.index_cache(g, 16)
    run_and_compare(batch, iq, ik, topk=topk, block_size=16, local_blocks=local_blocks)


@pytest.mark.parametrize("page_size,block_size", [(16, 16), (64, 32), (128, 128), (16, 64)])
def test_decode(page_size, block_size):
    g = gen(7)
    kv_lens = [1, block_size - 1, block_size, block_size + 1, 7 * block_size + 3]
    batch = make_batch(g, [(kv, 1) for kv in kv_lens], page_size)
    iq = randn(g, batch.num_tokens, 4, 16)
    ik = batch.index_cache(g, 16)
    run_and_compare(batch, iq, ik, topk=4, block_size=block_size)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_decode(seed):
    g = gen(200 + seed)
    kv_lens = [int(x) for x in torch.randint(20, 500, (4,), generator=g)]
    q_lens = [int(x) for x in torch.randint(2, 9, (4,), generator=g)]
    batch = make_batch(g, list(zip(kv_lens, q_lens)), page_size=64)
    iq = randn(g, batch.num_tokens, 2, 16)
    ik = batch.index_cache(g, 16)
    run_and_compare(batch, iq, ik, topk=8, block_size=32)


@pytest.mark.parametrize(
    "q_dtype,k_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_dtypes(seed, q_dtype, k_dtype):
    g = gen(300 + seed)
    batch = make_batch(g, [(9, 9), (300, 6), (77, 3), (520, 1)], page_size=32)
    iq = randn(g, batch.num_tokens, 2, 32, dtype=q_dtype)
    ik = batch.index_cache(g, 32, dtype=k_dtype)
    tie = torch.float32 if q_dtype == k_dtype == torch.float32 else torch.bfloat16
    run_and_compare(batch, iq, ik, topk=4, block_size=32, tie_dtype=tie)


def test_page_permutation_does_not_change_selection():
    """The same logical key stream, laid out contiguously or over shuffled pages,
    must give bit-identical selections."""
    g = gen(11)
    seqs = [(150, 7), (40, 40), (260, 2)]
    flat = make_batch(gen(1), seqs, page_size=16, shuffle=False)
    shuf = make_batch(gen(2), seqs, page_size=16, shuffle=True, extra_pages=9)
    assert not torch.equal(flat.block_tables[:, :3], shuf.block_tables[:, :3])
    rows = [randn(g, kv, 16) for kv, _ in seqs]
    iq = randn(g, flat.num_tokens, 2, 16)
    outs = []
    for batch in (flat, shuf):
        ik = batch.place(batch.index_cache(g, 16), rows)
        outs.append(
            canon(m3_sparse.index_topk(iq, ik, batch.block_tables, **batch.kwargs(), topk=5, block_size=32))
        )
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
def test_block_table_padding_is_never_read(pad):
    """Block-table entries past a sequence's pages are not part of it (validation only
    checks the pages inside its length), whatever they hold."""
    g = gen(12)
    batch = make_batch(g, [(100, 4), (33, 33), (7, 1)], page_size=16, extra_cols=3, pad=pad)
    iq = randn(g, batch.num_tokens, 2, 16)
    ik = batch.index_cache(g, 16)
    run_and_compare(batch, iq, ik, topk=3, block_size=32)


def test_nan_in_unwritten_slots_is_ignored():
    g = gen(13)
    batch = make_batch(g, [(70, 5), (21, 21)], page_size=16)
    iq = randn(g, batch.num_tokens, 2, 16)
    ik = batch.index_cache(g, 16, garbage=float("nan"))
    run_and_compare(batch, iq, ik, topk=3, block_size=16)


def check_selection_invariants(batch, sel, topk, block_size, local_blocks):
    for _, t, p in batch.tokens():
        last = p // block_size
        forced = {blk for blk in range(last, last - local_blocks, -1) if blk >= 0}
        for h in range(sel.shape[1]):
            row = sel[t, h].tolist()
            n_valid = sum(x >= 0 for x in row)
            where = f"token {t} (pos {p}, local block {last}) head {h}: {row}"
            if p < 0:
                assert row == [-1] * topk, f"a row before the sequence's first token selects nothing; {where}"
                continue
            assert row[n_valid:] == [-1] * (topk - n_valid), f"-1 slots must come last; {where}"
            valid = row[:n_valid]
            assert len(set(valid)) == n_valid, f"repeated block id; {where}"
            assert all(0 <= x <= last for x in valid), f"future (or invalid) block selected; {where}"
            assert forced <= set(valid), f"local block(s) {sorted(forced)} missing; {where}"
            assert n_valid == min(topk, last + 1), f"expected {min(topk, last + 1)} valid ids; {where}"


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    topk=st.integers(1, 8),
    local_blocks=st.integers(0, 3),
    block_size=st.sampled_from([8, 16, 32]),
    page_size=st.sampled_from([16, 32]),
    seqs=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 6)), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_selection_invariants(seed, topk, local_blocks, block_size, page_size, seqs, dtype):
    local_blocks = min(local_blocks, topk)
    g = gen(seed)
    batch = make_batch(g, seqs, page_size)
    iq = randn(g, batch.num_tokens, 2, 8, dtype=dtype)
    ik = batch.index_cache(g, 8, dtype=dtype)
    sel = m3_sparse.index_topk(
        iq, ik, batch.block_tables, **batch.kwargs(), topk=topk, block_size=block_size, local_blocks=local_blocks
    )
    check_selection_invariants(batch, sel, topk, block_size, local_blocks)


def test_local_blocks_equal_topk_selects_only_the_window():
    g = gen(14)
    batch = make_batch(g, [(300, 6)], page_size=16)
    iq = randn(g, batch.num_tokens, 2, 16)
    ik = batch.index_cache(g, 16)
    sel = m3_sparse.index_topk(iq, ik, batch.block_tables, **batch.kwargs(), topk=3, block_size=16, local_blocks=3)
    for _, t, p in batch.tokens():
        last = p // 16
        for h in range(2):
            assert sorted(sel[t, h].tolist()) == [last - 2, last - 1, last]


def test_empty_batch():
    g = gen(15)
    batch = make_batch(g, [(40, 0)], page_size=16)
    iq = randn(g, 0, 2, 16)
    ik = batch.index_cache(g, 16)
    sel = m3_sparse.index_topk(iq, ik, batch.block_tables, **batch.kwargs(), topk=4, block_size=16)
    assert sel.shape == (0, 2, 4) and sel.dtype == torch.int32


def test_long_context_block_count():
    """More blocks than one key chunk of the streaming loop: scores of blocks past the
    first chunk must land in the right place."""
    chunk = importlib.import_module("m3_sparse.index.topk").KEY_CHUNK
    g = gen(16)
    kv = 2 * chunk + 3 * 16 + 5
    assert math.ceil(kv / 16) > 2 * (chunk // 16)
    batch = make_batch(g, [(kv, 3), (chunk + 1, 1)], page_size=64)
    iq = randn(g, batch.num_tokens, 1, 8)
    ik = batch.index_cache(g, 8)
    run_and_compare(batch, iq, ik, topk=6, block_size=16)


@pytest.mark.parametrize("local_blocks", [1, 2])
def test_exact_ties_prefer_lower_block_ids(local_blocks):
    """Every key equal: all block scores tie exactly, so after the forced local
    window the lowest block ids win."""
    g = gen(17)
    batch = make_batch(g, [(400, 4), (130, 2), (20, 1)], page_size=16)
    iq = randn(g, batch.num_tokens, 2, 8)
    key = randn(g, 8)
    ik = batch.index_cache(g, 8)
    ik = torch.where(batch.written[:, :, None], key, ik)
    topk = 5
    sel = m3_sparse.index_topk(
        iq, ik, batch.block_tables, **batch.kwargs(), topk=topk, block_size=16, local_blocks=local_blocks
    )
    ref, _ = index_topk_ref(iq, ik, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, topk, 16, local_blocks)
    for _, t, p in batch.tokens():
        last = p // 16
        forced = {blk for blk in range(last, last - local_blocks, -1) if blk >= 0}
        rest = [blk for blk in range(last + 1) if blk not in forced][: topk - len(forced)]
        expected = sorted(forced | set(rest)) + [-1] * (topk - len(forced) - len(rest))
        for h in range(2):
            assert canon(sel)[t, h].tolist() == expected, f"token {t} head {h}"
            assert ref[t, h].tolist() == expected


def test_rows_before_the_first_token_select_nothing():
    """More queries than cached tokens (left padding): the first rows sit at negative
    positions, see no key and select nothing; the other rows are unaffected."""
    g = gen(18)
    batch = make_batch(g, [(3, 6), (0, 2), (40, 4), (20, 20)], page_size=16)
    iq = randn(g, batch.num_tokens, 2, 16)
    ik = batch.index_cache(g, 16)
    sel = run_and_compare(batch, iq, ik, topk=2, block_size=16)
    check_selection_invariants(batch, sel, 2, 16, 1)
    assert sel[:3].eq(-1).all() and sel[6:8].eq(-1).all()
