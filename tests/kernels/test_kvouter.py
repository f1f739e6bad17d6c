"""KV-outer pipeline: index builder, scheduler, partials, combine, each on its own and
composed, plus dense_paged_attention, against the float64 oracles."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import m3_sparse
from kernel_test_utils import (
    TOLERANCES,
    assert_close,
    gen,
    is_poisoned,
    make_batch,
    poison,
    poisoned_allocations,
    randn,
    random_selection,
)
from m3_sparse.reference import dense_attention_ref, sparse_attention_ref

LSE_TOL = TOLERANCES[torch.float32]  # lse is computed in fp32 whatever the input dtype


# --------------------------------------------------------------------------- index


def seq_ids(cu: torch.Tensor) -> list[int]:
    cu = cu.tolist()
    return [b for b in range(len(cu) - 1) for _ in range(cu[b + 1] - cu[b])]


def expected_segments(sel, cu, max_blocks, batch):
    """segment -> [(token, rank)] in token order, from the definition: a repeated id
    in one (token, head) row keeps its first slot, -1 slots are dropped."""
    nbg = batch * max_blocks
    seq = seq_ids(cu)
    segs = defaultdict(list)
    for t in range(sel.shape[0]):
        for g in range(sel.shape[1]):
            seen = set()
            for r, x in enumerate(sel[t, g].tolist()):
                if x < 0 or x in seen:
                    continue
                seen.add(x)
                segs[g * nbg + seq[t] * max_blocks + x].append((t, r))
    return segs


def check_index(index, sel, cu, max_blocks, batch):
    num_tokens, hkv, topk = sel.shape
    cap = num_tokens * hkv * topk
    nseg = hkv * batch * max_blocks
    assert index.seg_offsets.shape == (nseg + 1,)
    for name in ("entry_token", "entry_rank", "entry_segment"):
        assert getattr(index, name).shape == (cap,), name
    assert index.slot_of.shape == sel.shape
    for name in ("seg_offsets", "entry_token", "entry_rank", "entry_segment", "slot_of"):
        assert getattr(index, name).dtype == torch.int32, name
    assert (index.num_kv_heads, index.max_blocks, index.num_global_blocks) == (hkv, max_blocks, batch * max_blocks)
    assert index.capacity == cap and index.num_segments == nseg

    segs = expected_segments(sel, cu, max_blocks, batch)
    offs = index.seg_offsets.tolist()
    assert offs[0] == 0
    assert all(a <= b for a, b in zip(offs, offs[1:])), "seg_offsets must be non-decreasing"
    tok, rank, segm = index.entry_token.tolist(), index.entry_rank.tolist(), index.entry_segment.tolist()
    for s in range(nseg):
        got = list(zip(tok[offs[s] : offs[s + 1]], rank[offs[s] : offs[s + 1]]))
        assert got == segs.get(s, []), f"segment {s}: expected {segs.get(s, [])}, got {got}"
        assert all(x == s for x in segm[offs[s] : offs[s + 1]]), f"entry_segment wrong in segment {s}"
    used = offs[-1]
    assert used == sum(len(v) for v in segs.values())
    assert tok[used:] == [-1] * (cap - used) and rank[used:] == [-1] * (cap - used)
    assert segm[used:] == [-1] * (cap - used)

    slot_of = index.slot_of
    for s, items in segs.items():
        for t, r in items:
            g = s // (batch * max_blocks)
            e = int(slot_of[t, g, r])
            assert 0 <= e < used and (tok[e], rank[e], segm[e]) == (t, r, s), f"slot_of[{t}, {g}, {r}] = {e}"
    live = {(t, s // (batch * max_blocks), r) for s, items in segs.items() for t, r in items}
    for t in range(num_tokens):
        for g in range(hkv):
            for r in range(topk):
                if (t, g, r) not in live:
                    assert int(slot_of[t, g, r]) == -1, f"slot_of[{t}, {g}, {r}] should be -1 (empty or repeated)"
    # Every live entry is reached from exactly one slot.
    hits = slot_of[slot_of >= 0]
    assert hits.numel() == used and torch.unique(hits).numel() == used


def random_ids(g, num_tokens, hkv, topk, max_blocks):
    return torch.randint(-1, max_blocks, (num_tokens, hkv, topk), generator=g, dtype=torch.int32)


INDEX_SHAPES = [
    # q_lens per sequence, hkv, topk, max_blocks
    ([5], 1, 1, 3),
    ([3, 0, 4], 2, 4, 5),
    ([1, 1, 1, 1], 4, 16, 6),
    ([7, 2], 3, 8, 2),
    ([12], 2, 3, 40),
]


@pytest.mark.parametrize("q_lens,hkv,topk,max_blocks", INDEX_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_build_index_matches_definition(seed, q_lens, hkv, topk, max_blocks, index_dtype):
    g = gen(seed)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0).tolist()), dtype=index_dtype)
    sel = random_ids(g, sum(q_lens), hkv, topk, max_blocks).to(index_dtype)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=max_blocks)
    check_index(index, sel, cu, max_blocks, len(q_lens))
    again = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=max_blocks, batch_size=len(q_lens))
    for name in ("seg_offsets", "entry_token", "entry_rank", "entry_segment", "slot_of"):
        assert torch.equal(getattr(index, name), getattr(again, name)), name


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    q_lens=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    hkv=st.integers(1, 3),
    topk=st.integers(1, 6),
    max_blocks=st.integers(1, 6),
)
def test_build_index_property(seed, q_lens, hkv, topk, max_blocks):
    g = gen(seed)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0).tolist()), dtype=torch.int32)
    sel = random_ids(g, sum(q_lens), hkv, topk, max_blocks)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=max_blocks)
    check_index(index, sel, cu, max_blocks, len(q_lens))


def test_build_index_repeated_and_empty_rows():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    sel = torch.tensor(
        [
            [[2, 2, 2, 2]],  # one block, four times
            [[-1, -1, -1, -1]],  # nothing
            [[1, -1, 1, 0]],  # a repeat after an empty slot
        ],
        dtype=torch.int32,
    )
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=3)
    check_index(index, sel, cu, 3, 1)
    assert index.slot_of[0, 0].tolist()[1:] == [-1, -1, -1] and int(index.slot_of[0, 0, 0]) >= 0
    assert index.slot_of[1, 0].tolist() == [-1] * 4
    assert int(index.seg_offsets[-1]) == 3


# --------------------------------------------------------------------------- schedule


def check_schedule(index, sched, tile_q, num_programs):
    offs = index.seg_offsets.tolist()
    used = offs[-1]
    n = int(sched.num_tiles[0])
    assert sched.num_tiles.shape == (1,) and sched.tile_q == tile_q
    assert sched.program_tiles.shape == (num_programs + 1,) and sched.num_programs == num_programs
    assert sched.max_tiles >= n
    seg, start, end = sched.tile_segment.tolist(), sched.tile_start.tolist(), sched.tile_end.tolist()
    covered = [0] * used
    for i in range(n):
        s = seg[i]
        assert 0 <= s < index.num_segments, f"tile {i}: segment {s}"
        assert offs[s] <= start[i] < end[i] <= offs[s + 1], f"tile {i} [{start[i]}, {end[i]}) leaves segment {s}"
        assert end[i] - start[i] <= tile_q, f"tile {i} holds {end[i] - start[i]} > tile_q entries"
        for e in range(start[i], end[i]):
            covered[e] += 1
    assert all(c == 1 for c in covered), f"entries covered {[i for i, c in enumerate(covered) if c != 1]} != once"
    assert all(s == -1 for s in seg[n:]), "tiles past num_tiles must be marked -1"
    pt = sched.program_tiles.tolist()
    assert pt[0] == 0 and pt[-1] == n
    sizes = [b - a for a, b in zip(pt, pt[1:])]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1, f"unbalanced program slices {sizes}"
    # The ideal tiling: each non-empty segment cut into ceil(count / tile_q) tiles.
    counts = [b - a for a, b in zip(offs, offs[1:])]
    assert n == sum(math.ceil(c / tile_q) for c in counts)


@pytest.mark.parametrize("tile_q", [1, 3, 8, 128])
@pytest.mark.parametrize("num_programs", [1, 7, 132])
def test_schedule_covers_entries(tile_q, num_programs):
    g = gen(tile_q * 1000 + num_programs)
    q_lens = [9, 1, 0, 14]
    cu = torch.tensor([0, 9, 10, 10, 24], dtype=torch.int32)
    sel = random_ids(g, sum(q_lens), 2, 4, 5)
    sel[:, 0, 0] = 3  # one hot block per sequence
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=5)
    sched = m3_sparse.schedule(index, tile_q=tile_q, num_programs=num_programs)
    check_schedule(index, sched, tile_q, num_programs)
    again = m3_sparse.schedule(index, tile_q=tile_q, num_programs=num_programs)
    for name in ("tile_segment", "tile_start", "tile_end", "num_tiles", "program_tiles"):
        assert torch.equal(getattr(sched, name), getattr(again, name)), f"{name} differs between two calls"


def test_schedule_splits_a_hot_block_over_programs():
    num_tokens = 64
    sel = torch.zeros(num_tokens, 1, 2, dtype=torch.int32)
    sel[:, 0, 1] = -1
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=torch.tensor([0, num_tokens]), max_blocks=1)
    sched = m3_sparse.schedule(index, tile_q=4, num_programs=8)
    check_schedule(index, sched, 4, 8)
    assert int(sched.num_tiles[0]) == 16
    assert (sched.program_tiles[1:] - sched.program_tiles[:-1]).tolist() == [2] * 8


def test_schedule_of_an_empty_index():
    sel = torch.full((5, 2, 3), -1, dtype=torch.int32)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=torch.tensor([0, 5]), max_blocks=4)
    sched = m3_sparse.schedule(index, tile_q=8, num_programs=4)
    check_schedule(index, sched, 8, 4)
    assert int(sched.num_tiles[0]) == 0 and sched.program_tiles.tolist() == [0] * 5


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    q_lens=st.lists(st.integers(0, 8), min_size=1, max_size=3),
    topk=st.integers(1, 5),
    max_blocks=st.integers(1, 5),
    tile_q=st.integers(1, 10),
    num_programs=st.integers(1, 20),
)
def test_schedule_property(seed, q_lens, topk, max_blocks, tile_q, num_programs):
    g = gen(seed)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0).tolist()), dtype=torch.int32)
    sel = random_ids(g, sum(q_lens), 2, topk, max_blocks)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=max_blocks)
    check_schedule(index, m3_sparse.schedule(index, tile_q=tile_q, num_programs=num_programs), tile_q, num_programs)


# --------------------------------------------------------------------------- partials


def expected_partials(batch, index, q, k_cache, v_cache, scale, causal, block_size):
    """m, l, o of every live entry straight from the definition, float64."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    group = hq // hkv
    pos = {t: (b, p) for b, t, p in batch.tokens()}
    used = int(index.seg_offsets[-1])
    m = torch.full((used, group), float("-inf"), dtype=torch.float64)
    l = torch.zeros(used, group, dtype=torch.float64)
    o = torch.zeros(used, group, d, dtype=torch.float64)
    nbg = index.num_global_blocks
    for e in range(used):
        t, s = int(index.entry_token[e]), int(index.entry_segment[e])
        g, gb = divmod(s, nbg)
        b, blk = divmod(gb, index.max_blocks)
        assert pos[t][0] == b
        limit = pos[t][1] + 1 if causal else batch.kv_lens[b]
        js = [j for j in range(blk * block_size, (blk + 1) * block_size) if j < limit]
        if not js:
            continue
        pages = [int(batch.block_tables[b, j // batch.page_size]) for j in js]
        kk = torch.stack([k_cache[p, g, j % batch.page_size] for p, j in zip(pages, js)]).double()
        vv = torch.stack([v_cache[p, g, j % batch.page_size] for p, j in zip(pages, js)]).double()
        sc = q[t, g * group : (g + 1) * group].double() @ kk.T * scale  # [G, n]
        mx = sc.amax(-1)
        w = torch.exp(sc - mx[:, None])
        m[e], l[e], o[e] = mx, w.sum(-1), w @ vv
    return m, l, o


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size,block_size", [(16, 32), (32, 16)])
def test_partials_per_entry(causal, dtype, page_size, block_size):
    g = gen(21)
    batch = make_batch(g, [(70, 5), (20, 20), (130, 2)], page_size)
    hq, hkv, d = 4, 2, 8
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k = batch.kv_cache(g, hkv, d, dtype)
    v = batch.kv_cache(g, hkv, d, dtype)
    sel = random_selection(g, batch, hkv, 4, block_size, causal=causal)
    max_blocks = -(-batch.capacity // block_size)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=batch.cu_seqlens_q, max_blocks=max_blocks)
    scale = 0.3
    with poisoned_allocations():
        po, pm, pl = m3_sparse.kvouter_partials(
            q, k, v, index, batch.block_tables, **batch.kwargs(), softmax_scale=scale, causal=causal,
            block_size=block_size,
        )
    cap = index.capacity
    assert po.shape == (cap, hq // hkv, d) and po.dtype == dtype
    assert pm.shape == pl.shape == (cap, hq // hkv) and pm.dtype == pl.dtype == torch.float32
    for name, x in (("partial_o", po), ("partial_m", pm), ("partial_l", pl)):
        assert not is_poisoned(x).any(), f"{name}: rows {torch.nonzero(is_poisoned(x))[:5].tolist()} never written"
    used = int(index.seg_offsets[-1])
    assert used < cap, "test setup: want unused entries"
    assert torch.all(pm[used:] == float("-inf")) and torch.all(pl[used:] == 0) and torch.all(po[used:] == 0)
    m, l, o = expected_partials(batch, index, q, k, v, scale, causal, block_size)
    assert_close("partial_m", m, pm[:used], LSE_TOL)
    assert_close("partial_l", l, pl[:used], TOLERANCES[torch.float32] * 10)
    assert_close("partial_o", o, po[:used], TOLERANCES[dtype])


# --------------------------------------------------------------------------- combine


def lse_merge(partial_o, partial_m, partial_l, slot_of):
    """out = sum_s exp(m_s - lse) O_s with lse = logsumexp_s(m_s + log l_s), float64."""
    num_tokens, hkv, topk = slot_of.shape
    group, d = partial_o.shape[1], partial_o.shape[2]
    out = torch.zeros(num_tokens, hkv * group, d, dtype=torch.float64)
    lse = torch.full((hkv * group, num_tokens), float("-inf"), dtype=torch.float64)
    for t in range(num_tokens):
        for g in range(hkv):
            slots = [int(s) for s in slot_of[t, g] if int(s) >= 0]
            for h in range(group):
                terms = [(float(partial_m[s, h]), float(partial_l[s, h]), s) for s in slots]
                terms = [x for x in terms if x[0] > float("-inf")]
                if not terms:
                    continue
                row = torch.logsumexp(torch.tensor([mm + math.log(ll) for mm, ll, _ in terms], dtype=torch.float64), 0)
                lse[g * group + h, t] = row
                for mm, _, s in terms:
                    out[t, g * group + h] += math.exp(mm - float(row)) * partial_o[s, h].double()
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hkv,group,topk", [(1, 1, 1), (2, 4, 5), (1, 16, 16), (3, 2, 3)])
def test_combine_matches_lse_merge(dtype, hkv, group, topk):
    g = gen(31 + topk)
    num_tokens, d = 300, 8  # more than one TOKEN_CHUNK
    entries = num_tokens * hkv * topk
    po = randn(g, entries, group, d, dtype=dtype)
    pm = randn(g, entries, group) * 3
    pl = torch.rand(entries, group, generator=g) * 4 + 0.25
    empty = torch.rand(entries, group, generator=g) < 0.1  # partials that saw no key
    pm = pm.masked_fill(empty, float("-inf"))
    pl = pl.masked_fill(empty, 0.0)
    po = po.masked_fill(empty[..., None], 0)
    slot_of = torch.randperm(entries, generator=g).view(num_tokens, hkv, topk).to(torch.int32)
    slot_of = slot_of.masked_fill(torch.rand(slot_of.shape, generator=g) < 0.25, -1)
    slot_of[0] = -1  # token 0: no partial at all
    slot_of[1] = -1  # token 1: one partial, which saw no key
    slot_of[1, :, 0] = 0
    pm[0], pl[0], po[0] = float("-inf"), 0.0, 0
    with poisoned_allocations():
        out, lse = m3_sparse.combine(po, pm, pl, slot_of, out_dtype=dtype, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = lse_merge(po, pm, pl, slot_of)
    assert torch.all(out[:2] == 0) and torch.all(lse[:, :2] == float("-inf"))
    assert_close("combine out", ref_out, out, TOLERANCES[dtype])
    assert_close("combine lse", ref_lse, lse, LSE_TOL)


def test_combine_defaults():
    """No out_dtype: the partials' dtype; no return_lse: no lse. The values are the merge's."""
    g = gen(40)
    po = randn(g, 6, 2, 4, dtype=torch.bfloat16)
    pm, pl = randn(g, 6, 2), torch.rand(6, 2, generator=g) + 0.5
    slot_of = torch.arange(6, dtype=torch.int32).view(3, 1, 2)
    out, lse = m3_sparse.combine(po, pm, pl, slot_of)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 2, 4) and lse is None
    assert_close("combine out", lse_merge(po, pm, pl, slot_of)[0], out, TOLERANCES[torch.bfloat16])


# --------------------------------------------------------------------------- composed


def run_sparse(
    seed, seqs, page_size, block_size, hq, hkv, d, topk, dtype, causal, *, scale=None, sel=None, batch_kwargs=None,
    **sel_kwargs,
):
    """Random batch from ``seed`` (the same batch make_batch(gen(seed), seqs, page_size,
    **batch_kwargs) gives), kvouter_attention against the oracle."""
    g = gen(seed)
    batch = make_batch(g, seqs, page_size, **(batch_kwargs or {}))
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k = batch.kv_cache(g, hkv, d, dtype)
    v = batch.kv_cache(g, hkv, d, dtype)
    if sel is None:
        sel = random_selection(g, batch, hkv, topk, block_size, causal=causal, **sel_kwargs)
    with poisoned_allocations():
        out, lse = m3_sparse.kvouter_attention(
            q, k, v, sel, batch.block_tables, **batch.kwargs(), softmax_scale=scale, causal=causal,
            block_size=block_size, return_lse=True,
        )
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (hq, batch.num_tokens) and lse.dtype == torch.float32
    ref_out, ref_lse = sparse_attention_ref(
        q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, scale, causal, block_size
    )
    assert_close("out", ref_out, out, TOLERANCES[dtype])
    assert_close("lse", ref_lse, lse, LSE_TOL)
    return batch, sel, out, lse


HEADS = [(4, 4), (8, 2), (32, 2), (4, 1)]  # MHA, GQA G=4, GQA G=16, MQA


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hq,hkv", HEADS)
def test_heads_and_dtypes(hq, hkv, dtype, causal):
    run_sparse(hq * 10 + hkv, [(40, 6), (9, 9), (100, 3)], 16, 32, hq, hkv, 16, 4, dtype, causal)


# (page_size, block_size): block smaller than, equal to and larger than the page,
# and one block size that is neither a multiple nor a divisor of the page.
PAGING = [(16, 16), (16, 64), (64, 16), (64, 64), (128, 32), (128, 128), (32, 128), (16, 128), (32, 48)]


@pytest.mark.parametrize("page_size,block_size", PAGING)
@pytest.mark.parametrize("seed", [0, 1])
def test_paging(seed, page_size, block_size):
    bs = block_size
    seqs = [(min(bs // 2, 12), min(bs // 2, 12)), (3 * bs + 5, 4), (5 * bs + 1, 2), (2 * bs, 0)]
    run_sparse(seed, seqs, page_size, block_size, 8, 2, 16, 4, torch.float32, seed == 0)


@pytest.mark.parametrize("topk", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_topk(topk, causal):
    run_sparse(50 + topk, [(300, 3), (50, 2), (7, 7)], 16, 16, 4, 2, 16, topk, torch.float32, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_speculative_decode(dtype):
    seqs = [(1, 1), (31, 1), (32, 1), (33, 1), (200, 16), (97, 5)]
    run_sparse(60, seqs, 16, 32, 8, 2, 16, 4, dtype, True)


def test_all_empty_rows_output_zeros():
    g = gen(61)
    batch = make_batch(g, [(50, 4), (20, 3)], 16)
    sel = random_selection(g, batch, 2, 3, 16)
    sel[0] = -1  # token 0: every slot empty, both heads
    sel[5, 1] = -1  # token 5: one head empty
    _, _, out, lse = run_sparse(61, [(50, 4), (20, 3)], 16, 16, 4, 2, 8, 3, torch.float32, True, sel=sel)
    assert torch.all(out[0] == 0) and torch.all(lse[:, 0] == float("-inf"))
    assert torch.all(out[5, 2:] == 0) and torch.all(lse[2:, 5] == float("-inf"))
    assert torch.isfinite(lse[:2, 5]).all()


def test_future_and_out_of_length_blocks_see_nothing():
    """Causal: a selected block entirely after the query contributes nothing, and a
    selection made only of such blocks outputs zeros with lse = -inf. Blocks past a
    sequence's length but inside the block table's capacity are valid ids too."""
    seqs = [(40, 3), (64, 1)]
    g = gen(62)
    batch = make_batch(g, seqs, 16, extra_cols=3)
    max_blocks = batch.capacity // 16
    sel = torch.full((batch.num_tokens, 1, 3), -1, dtype=torch.int32)
    sel[0, 0] = torch.tensor([2, -1, max_blocks - 1])  # pos 37: own block and one past the length
    sel[1, 0] = torch.tensor([max_blocks - 1, -1, -1])  # only past the length
    sel[2, 0] = torch.tensor([0, 1, 2])
    sel[3, 0] = torch.tensor([3, 3, 1])  # pos 63: own block, repeated
    for causal in (True, False):
        _, _, out, lse = run_sparse(
            62, seqs, 16, 16, 2, 1, 8, 3, torch.float32, causal, sel=sel, batch_kwargs={"extra_cols": 3}
        )
        assert torch.all(out[1] == 0) and torch.all(lse[:, 1] == float("-inf"))


def test_repeated_ids_count_once():
    seqs = [(90, 4)]
    g = gen(63)
    batch = make_batch(g, seqs, 16)
    base = random_selection(g, batch, 2, 4, 16, empty_frac=0.0, dup_frac=0.0)
    rep = base.clone()
    rep[..., 1:] = base[..., :1]  # every slot the first id
    single = base.clone()
    single[..., 1:] = -1
    _, _, out_rep, lse_rep = run_sparse(63, seqs, 16, 16, 4, 2, 8, 4, torch.float32, True, sel=rep)
    _, _, out_one, lse_one = run_sparse(63, seqs, 16, 16, 4, 2, 8, 4, torch.float32, True, sel=single)
    assert torch.equal(out_rep, out_one) and torch.equal(lse_rep, lse_one)


def test_softmax_scale():
    run_sparse(64, [(60, 5), (18, 2)], 16, 16, 4, 2, 16, 3, torch.float32, True, scale=0.05)
    run_sparse(64, [(60, 5), (18, 2)], 16, 16, 4, 2, 16, 3, torch.bfloat16, False, scale=2.0)


def test_slot_order_does_not_matter():
    seqs = [(120, 6), (33, 2)]
    g = gen(65)
    batch = make_batch(g, seqs, 16)
    sel = random_selection(g, batch, 2, 5, 16)
    perm = sel[..., torch.randperm(5, generator=g)]
    _, _, out_a, lse_a = run_sparse(65, seqs, 16, 16, 4, 2, 8, 5, torch.float32, True, sel=sel)
    _, _, out_b, lse_b = run_sparse(65, seqs, 16, 16, 4, 2, 8, 5, torch.float32, True, sel=perm)
    assert_close("out (permuted slots)", out_a, out_b, 1e-6)
    assert_close("lse (permuted slots)", lse_a, lse_b, 1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_composed_stages_equal_entry_point(causal):
    g = gen(70)
    batch = make_batch(g, [(75, 6), (16, 16), (200, 1)], 16)
    q = randn(g, batch.num_tokens, 8, 16)
    k, v = batch.kv_cache(g, 2, 16), batch.kv_cache(g, 2, 16)
    sel = random_selection(g, batch, 2, 4, 32, causal=causal)
    out, lse = m3_sparse.kvouter_attention(
        q, k, v, sel, batch.block_tables, **batch.kwargs(), causal=causal, block_size=32, return_lse=True
    )
    max_blocks = -(-batch.capacity // 32)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=batch.cu_seqlens_q, max_blocks=max_blocks)
    sched = m3_sparse.schedule(index, tile_q=8, num_programs=5)
    check_schedule(index, sched, 8, 5)
    parts = m3_sparse.kvouter_partials(
        q, k, v, index, batch.block_tables, **batch.kwargs(), softmax_scale=0.25, causal=causal, block_size=32
    )
    # Running the partials tile by tile, in schedule order, gives the same rows.
    n = int(sched.num_tiles[0])
    rows = torch.cat([torch.arange(int(sched.tile_start[i]), int(sched.tile_end[i])) for i in range(n)])
    assert torch.equal(rows, torch.arange(int(index.seg_offsets[-1])))
    out2, lse2 = m3_sparse.combine(*parts, index.slot_of, out_dtype=q.dtype, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_all_blocks_selected_equals_dense():
    g = gen(71)
    batch = make_batch(g, [(70, 7), (130, 3), (5, 5)], 32)
    q = randn(g, batch.num_tokens, 4, 16)
    k, v = batch.kv_cache(g, 2, 16), batch.kv_cache(g, 2, 16)
    nb = batch.capacity // 32
    sel = torch.arange(nb, dtype=torch.int32).flip(0).expand(batch.num_tokens, 2, nb).contiguous()
    for causal in (True, False):
        a = m3_sparse.kvouter_attention(
            q, k, v, sel, batch.block_tables, **batch.kwargs(), causal=causal, block_size=32, return_lse=True
        )
        b = m3_sparse.dense_paged_attention(
            q, k, v, batch.block_tables, **batch.kwargs(), causal=causal, return_lse=True
        )
        assert_close("out vs dense", b[0], a[0], 1e-5)
        assert_close("lse vs dense", b[1], a[1], 1e-5)


def test_empty_query_batch():
    g = gen(72)
    batch = make_batch(g, [(40, 0), (3, 0)], 16)
    q = randn(g, 0, 4, 8)
    k, v = batch.kv_cache(g, 2, 8), batch.kv_cache(g, 2, 8)
    sel = torch.empty(0, 2, 4, dtype=torch.int32)
    out, lse = m3_sparse.kvouter_attention(
        q, k, v, sel, batch.block_tables, **batch.kwargs(), block_size=16, return_lse=True
    )
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
    out, lse = m3_sparse.dense_paged_attention(q, k, v, batch.block_tables, **batch.kwargs(), return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)


def test_return_lse_false():
    g = gen(73)
    batch = make_batch(g, [(40, 2)], 16)
    q = randn(g, 2, 2, 8)
    k, v = batch.kv_cache(g, 1, 8), batch.kv_cache(g, 1, 8)
    sel = torch.tensor([[[2, 0]], [[2, 1]]], dtype=torch.int32)
    assert m3_sparse.kvouter_attention(q, k, v, sel, batch.block_tables, **batch.kwargs(), block_size=16)[1] is None
    assert m3_sparse.dense_paged_attention(q, k, v, batch.block_tables, **batch.kwargs())[1] is None


# --------------------------------------------------------------------------- robustness of the cache reads


@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
@pytest.mark.parametrize("page_size,block_size", [(16, 64), (16, 16)])
def test_sparse_block_table_padding_is_never_read(pad, page_size, block_size):
    """Entries of a block table past a sequence's pages are outside the contract
    (validation only checks the pages inside its length), so they may hold anything.
    With block_size > page_size a sequence's last block spans such entries."""
    g = gen(80)
    seqs = [(40, 3), (100, 2), (16, 16)]
    batch = make_batch(g, seqs, page_size, extra_cols=6, pad=pad)
    q = randn(g, batch.num_tokens, 4, 8)
    k, v = batch.kv_cache(g, 2, 8), batch.kv_cache(g, 2, 8)
    sel = random_selection(g, batch, 2, 3, block_size, empty_frac=0.0, dup_frac=0.0)
    out, lse = m3_sparse.kvouter_attention(
        q, k, v, sel, batch.block_tables, **batch.kwargs(), block_size=block_size, return_lse=True
    )
    ref = sparse_attention_ref(
        q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, True, block_size
    )
    assert_close("out", ref[0], out, 1e-5)
    assert_close("lse", ref[1], lse, 1e-5)


@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
def test_dense_block_table_padding_is_never_read(pad):
    g = gen(81)
    batch = make_batch(g, [(40, 3), (100, 2)], 16, extra_cols=4, pad=pad)
    q = randn(g, batch.num_tokens, 4, 8)
    k, v = batch.kv_cache(g, 2, 8), batch.kv_cache(g, 2, 8)
    for causal in (True, False):
        out, lse = m3_sparse.dense_paged_attention(
            q, k, v, batch.block_tables, **batch.kwargs(), causal=causal, return_lse=True
        )
        ref = dense_attention_ref(q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, causal)
        assert_close("out", ref[0], out, 1e-5)
        assert_close("lse", ref[1], lse, 1e-5)


@pytest.mark.parametrize("op", ["kvouter", "dense"])
def test_nan_in_unwritten_cache_slots_is_ignored(op):
    """Slots past a sequence's last token (the tail of its last page) hold whatever
    the pool's memory held; a NaN there must not reach any output."""
    g = gen(82)
    batch = make_batch(g, [(40, 3), (21, 21)], 16)
    q = randn(g, batch.num_tokens, 4, 8)
    k = batch.kv_cache(g, 2, 8, garbage=float("nan"))
    v = batch.kv_cache(g, 2, 8, garbage=float("nan"))
    if op == "kvouter":
        sel = random_selection(g, batch, 2, 3, 16)
        out, lse = m3_sparse.kvouter_attention(
            q, k, v, sel, batch.block_tables, **batch.kwargs(), block_size=16, return_lse=True
        )
        ref = sparse_attention_ref(
            q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, True, 16
        )
    else:
        out, lse = m3_sparse.dense_paged_attention(
            q, k, v, batch.block_tables, **batch.kwargs(), causal=False, return_lse=True
        )
        ref = dense_attention_ref(q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, False)
    assert_close("out", ref[0], out, 1e-5)
    assert_close("lse", ref[1], lse, 1e-5)


# --------------------------------------------------------------------------- dense


def run_dense(seed, seqs, page_size, hq, hkv, d, dtype, causal):
    g = gen(seed)
    batch = make_batch(g, seqs, page_size)
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k, v = batch.kv_cache(g, hkv, d, dtype), batch.kv_cache(g, hkv, d, dtype)
    with poisoned_allocations():
        out, lse = m3_sparse.dense_paged_attention(
            q, k, v, batch.block_tables, **batch.kwargs(), causal=causal, return_lse=True
        )
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hq, batch.num_tokens)
    ref_out, ref_lse = dense_attention_ref(
        q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, causal
    )
    assert_close("dense out", ref_out, out, TOLERANCES[dtype])
    assert_close("dense lse", ref_lse, lse, LSE_TOL)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
def test_dense_varlen_chunked_prefill(hq, hkv, dtype, causal):
    # A full prefill (shorter than a page), a chunked prefill, a decode and a long
    # chunked prefill crossing the implementation's key chunk and query chunk.
    seqs = [(11, 11), (150, 40), (64, 1), (1100, 3)]
    run_dense(90 + hq, seqs, 64, hq, hkv, 8, dtype, causal)


@pytest.mark.parametrize("page_size", [16, 32, 128])
def test_dense_page_sizes(page_size):
    run_dense(91, [(3, 3), (page_size + 1, 2), (3 * page_size, 5)], page_size, 4, 2, 16, torch.float32, True)


def test_poison_helper_marks_everything():
    # The poisoned-allocation check above is only as good as this.
    with poisoned_allocations():
        f = torch.empty(3, 2)
        i = torch.empty_like(torch.zeros(4, dtype=torch.int32))
    assert is_poisoned(f).all() and is_poisoned(i).all()
    assert is_poisoned(poison(torch.zeros(2, dtype=torch.int64))).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_rows_before_the_first_token_output_zeros(causal):
    """More queries than cached tokens (left padding): rows at negative positions see
    no key, whatever they selected, and output zeros with lse = -inf."""
    seqs = [(3, 6), (0, 2), (40, 4)]
    _, _, out, lse = run_sparse(92, seqs, 16, 16, 4, 2, 8, 3, torch.float32, causal, empty_frac=0.0)
    assert torch.all(out[:3] == 0) and torch.all(out[6:8] == 0)
    assert torch.all(lse[:, :3] == float("-inf")) and torch.all(lse[:, 6:8] == float("-inf"))
    run_dense(92, seqs, 16, 4, 2, 8, torch.float32, causal)
