"""Hypothesis property tests of the public ops against the naive float64 oracles of
``m3_sparse.reference``: random ragged batches over shuffled paged caches (garbage
in unused slots and in block-table entries past each sequence's pages), page and
block sizes, top-k, GQA ratios, messy selections (duplicates, -1, ids past the
sequence or in the future), rows before the sequence's first token, causal and not.

Hypothesis draws plain parameters (shapes, options and a seed); the tensors come
from a torch.Generator seeded with it, so a falsifying example is printed as a short
dict from which the test body rebuilds the failing inputs exactly (no tensor reprs).
``derandomize=True`` and no example database keep CI deterministic.

Without CUDA the Triton paths run in Triton's interpreter on the CPU, which costs
about 10 ms per attention tile and per few combine rows: those examples stay tiny.
On a CUDA machine the same tests run natively with larger budgets.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import m3_sparse
from kernel_test_utils import (
    TOLERANCES,
    assert_close,
    gen,
    make_batch,
    poisoned_allocations,
    randn,
    random_selection,
)
from m3_sparse.reference import dense_attention_ref, index_topk_ref, sparse_attention_ref

import triton  # noqa: F401  (a test dependency: the Triton paths below run its kernels)

HAS_CUDA = torch.cuda.is_available()
# CPU tensors reach the Triton kernels only through the interpreter (conftest sets
# TRITON_INTERPRET=1 without CUDA); with CUDA they get CUDA copies of the inputs.
TRITON_DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")

TOL = TOLERANCES[torch.float32]
PAGE_SIZES = [16, 32, 64]
# The torch path takes any positive block size; the Triton kernels need powers of
# two >= 16, so only the torch path sees blocks that straddle pages unevenly.
TORCH_BLOCK_SIZES = [16, 32, 64, 128, 8, 24, 48]
TRITON_BLOCK_SIZES = [16, 32, 64]
# Query-token budgets per example: the oracles loop per token in Python and the
# interpreter per tile, so these bound the file's runtime rather than coverage.
TORCH_TOKENS = 192
TRITON_TOKENS = 160 if HAS_CUDA else 32
INDEX_TRITON_TOKENS = 256 if HAS_CUDA else 64
TRITON_EXAMPLES = 40 if HAS_CUDA else 15


def _settings(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


seeds = st.integers(0, 2**32 - 1)
# Every integer argument (ids, offsets, lengths, tables) may be int32 or int64.
index_dtypes = st.sampled_from([torch.int32, torch.int64])


@st.composite
def varlen(draw, max_tokens: int, max_batch: int = 4, max_kv: int = 200, min_q: int = 1):
    """[(kv_len, q_len)]: q_len in [min_q, kv_len], sometimes a few more than kv_len
    (left-padded rows at negative positions), the total kept near ``max_tokens``."""
    n = draw(st.integers(1, max_batch))
    per_seq = max(1, max_tokens // n)
    seqs = []
    for _ in range(n):
        kv = draw(st.integers(1, max_kv))
        q = draw(st.integers(min_q, max(min_q, min(kv, per_seq))))
        if draw(st.integers(0, 4)) == 0:
            q += draw(st.integers(1, 6))  # rows before the sequence's first token
        seqs.append((kv, q))
    return seqs


# make_batch options: where the spare block-table columns point, and how many there are.
layouts = st.fixed_dictionaries(
    {
        "pad": st.sampled_from(["pool", -1]),
        "extra_cols": st.integers(0, 3),
        "extra_pages": st.integers(0, 3),
    }
)

# "wild": uniform ids over every id the op accepts (duplicates, -1, future blocks,
# blocks past the sequence's length, whose table entries are garbage or -1);
# "like": index_topk-shaped rows (local block + earlier ones) made messy.
selections = st.one_of(
    st.fixed_dictionaries({"kind": st.just("wild")}),
    st.fixed_dictionaries(
        {
            "kind": st.just("like"),
            "empty_frac": st.sampled_from([0.0, 0.2, 0.6]),
            "dup_frac": st.sampled_from([0.0, 0.2, 0.6]),
        }
    ),
)


def make_selection(g, batch, heads, topk, block_size, causal, spec):
    if spec["kind"] == "wild":
        max_blocks = -(-batch.capacity // block_size)
        return torch.randint(-1, max_blocks, (batch.num_tokens, heads, topk), generator=g, dtype=torch.int32)
    return random_selection(
        g, batch, heads, topk, block_size, causal=causal, empty_frac=spec["empty_frac"], dup_frac=spec["dup_frac"]
    )


def int_args(batch, dtype, device):
    return {
        "block_tables": batch.block_tables.to(device, dtype),
        "cu_seqlens_q": batch.cu_seqlens_q.to(device, dtype),
        "used_kv_lens": batch.used_kv_lens.to(device, dtype),
    }


def check_attention(name, ref, got, batch):
    ref_out, ref_lse = ref
    out, lse = got
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert tuple(lse.shape) == (out.shape[1], out.shape[0])
    assert_close(f"{name} out", ref_out, out, TOL)
    assert_close(f"{name} lse", ref_lse, lse, TOL)
    # assert_close bounds empty rows only in RMS: the contract is exact zeros.
    empty = (ref_lse == float("-inf")).T  # [Tq, Hq]
    assert torch.all(out[empty] == 0), f"{name}: a row that sees no key is not exactly zero"
    neg = [t for _, t, p in batch.tokens() if p < 0]
    if neg:
        assert torch.all(out[neg] == 0) and torch.all(lse[:, neg] == float("-inf")), (
            f"{name}: rows at negative positions {neg} must give zeros and lse = -inf"
        )


# --------------------------------------------------------------------------- kvouter_attention


def attention_cases(max_tokens, block_sizes, head_dims):
    return st.fixed_dictionaries(
        {
            "seed": seeds,
            "seqs": varlen(max_tokens),
            "page_size": st.sampled_from(PAGE_SIZES),
            "block_size": st.sampled_from(block_sizes),
            "topk": st.integers(1, 8),
            "hkv": st.sampled_from([1, 2]),
            "group": st.sampled_from([1, 2, 4]),
            "d": st.sampled_from(head_dims),
            "causal": st.booleans(),
            "scale": st.one_of(st.none(), st.floats(0.05, 2.0)),
            "layout": layouts,
            "selection": selections,
            "index_dtype": index_dtypes,
        }
    )


def build_kvouter(c):
    g = gen(c["seed"])
    batch = make_batch(g, c["seqs"], c["page_size"], **c["layout"])
    q = randn(g, batch.num_tokens, c["hkv"] * c["group"], c["d"])
    k = batch.kv_cache(g, c["hkv"], c["d"])
    v = batch.kv_cache(g, c["hkv"], c["d"])
    sel = make_selection(g, batch, c["hkv"], c["topk"], c["block_size"], c["causal"], c["selection"])
    return batch, q, k, v, sel


def run_kvouter(c, impl, device=torch.device("cpu")):
    batch, q, k, v, sel = build_kvouter(c)
    kw = {"softmax_scale": c["scale"], "causal": c["causal"], "block_size": c["block_size"]}
    ref = sparse_attention_ref(q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, **kw)
    ints = int_args(batch, c["index_dtype"], device)
    with pytest.MonkeyPatch.context() as mp, poisoned_allocations():
        mp.setenv("M3_SPARSE_IMPL", impl)
        got = m3_sparse.kvouter_attention(
            q.to(device), k.to(device), v.to(device), sel.to(device, c["index_dtype"]), ints.pop("block_tables"),
            return_lse=True, **ints, **kw,
        )
    check_attention(f"kvouter[{impl}]", ref, got, batch)


def corner(**kw):
    """A hand-picked case on top of the drawn ones."""
    base = {
        "seed": 0, "seqs": [(200, 200)], "page_size": 16, "block_size": 16, "topk": 8, "hkv": 2, "group": 4,
        "d": 16, "causal": True, "scale": None, "layout": {"pad": "pool", "extra_cols": 1, "extra_pages": 3},
        "selection": {"kind": "like", "empty_frac": 0.2, "dup_frac": 0.2}, "index_dtype": torch.int32,
    }
    base.update(kw)
    return example(c=base)


@_settings(60)
@given(c=attention_cases(TORCH_TOKENS, TORCH_BLOCK_SIZES, [8, 16, 32]))
# A full 200-token prefill; a decode batch with a sequence shorter than its queries,
# wild ids and -1 padded tables (every block past a sequence maps to page -1).
@corner()
@corner(
    seqs=[(1, 1), (200, 1), (3, 7), (130, 1)], page_size=64, block_size=24, causal=False, hkv=1,
    layout={"pad": -1, "extra_cols": 3, "extra_pages": 0}, selection={"kind": "wild"},
)
def test_kvouter_torch_matches_reference(c):
    run_kvouter(c, "torch")


@_settings(TRITON_EXAMPLES)
@given(c=attention_cases(TRITON_TOKENS, TRITON_BLOCK_SIZES, [8, 16]))
@corner(
    seqs=[(1, 3), (200, 2), (70, 9)], page_size=32, block_size=64, hkv=2, group=2, d=8,
    layout={"pad": -1, "extra_cols": 2, "extra_pages": 0}, selection={"kind": "wild"}, index_dtype=torch.int64,
)
def test_kvouter_triton_matches_reference(c):
    run_kvouter(c, "triton", TRITON_DEVICE)


# --------------------------------------------------------------------------- index_topk

# Random fp32 keys give no exact ties, but the op accumulates in fp32 and the oracle
# in fp64, so blocks whose oracle scores differ by a few fp32 roundings of a
# D-term dot product may swap; anything wider is a wrong selection.
TIE_TOL = 1e-5


def index_cases(max_tokens, block_sizes, head_dims):
    return st.fixed_dictionaries(
        {
            "seed": seeds,
            "seqs": varlen(max_tokens),
            "page_size": st.sampled_from(PAGE_SIZES),
            "block_size": st.sampled_from(block_sizes),
            "topk": st.integers(1, 8),
            "local_blocks": st.integers(0, 2),  # clamped to topk
            "heads": st.integers(1, 4),
            "d": st.sampled_from(head_dims),
            "layout": layouts,
            "index_dtype": index_dtypes,
        }
    )


def canon(row: list[int]) -> list[int]:
    return sorted(x for x in row if x >= 0)


def check_selection(batch, got, ref, scores, block_size, local_blocks):
    got = got.cpu()
    assert got.shape == ref.shape and got.dtype == torch.int32
    positions = {t: p for _, t, p in batch.tokens()}
    for t in range(got.shape[0]):
        p = positions[t]
        for h in range(got.shape[1]):
            row = got[t, h].tolist()
            want = canon(ref[t, h].tolist())
            ids = canon(row)
            where = f"token {t} (position {p}), head {h}: got {row}, reference {want}"
            assert all(x >= -1 for x in row), where
            assert len(set(ids)) == len(ids), f"repeated id, {where}"
            assert len(ids) == len(want), f"wrong number of valid ids, {where}"
            if ids == want:
                continue
            extra, missing = set(ids) - set(want), set(want) - set(ids)
            last = p // block_size
            forced = set(range(max(0, last - local_blocks + 1), last + 1))
            assert not (missing & forced), f"a forced local block is missing, {where}"
            assert all(0 <= x <= last for x in extra), f"a block the query cannot see, {where}"
            s = scores[t][h]
            for x in extra:
                for y in missing:
                    a, b = float(s[x]), float(s[y])
                    assert abs(a - b) <= TIE_TOL * (1 + max(abs(a), abs(b))), (
                        f"block {x} (score {a!r}) chosen over block {y} (score {b!r}), {where}"
                    )


def run_index(c, impl, device=torch.device("cpu"), max_seqlen_q=None):
    g = gen(c["seed"])
    batch = make_batch(g, c["seqs"], c["page_size"], **c["layout"])
    iq = randn(g, batch.num_tokens, c["heads"], c["d"])
    ik = batch.index_cache(g, c["d"])
    topk, block_size = c["topk"], c["block_size"]
    local_blocks = min(c["local_blocks"], topk)
    ref, scores = index_topk_ref(
        iq, ik, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, topk, block_size, local_blocks
    )
    kw = {} if max_seqlen_q is None else {"max_seqlen_q": max_seqlen_q}
    ints = int_args(batch, c["index_dtype"], device)
    with pytest.MonkeyPatch.context() as mp, poisoned_allocations():
        mp.setenv("M3_SPARSE_IMPL", impl)
        got = m3_sparse.index_topk(
            iq.to(device), ik.to(device), ints.pop("block_tables"),
            topk=topk, block_size=block_size, local_blocks=local_blocks, **ints, **kw,
        )
    check_selection(batch, got, ref, scores, block_size, local_blocks)


def index_corner(**kw):
    base = {
        "seed": 0, "seqs": [(200, 200)], "page_size": 16, "block_size": 16, "topk": 8, "local_blocks": 2,
        "heads": 2, "d": 16, "layout": {"pad": "pool", "extra_cols": 1, "extra_pages": 3}, "index_dtype": torch.int32,
    }
    base.update(kw)
    return example(c=base)


@_settings(60)
@given(c=index_cases(TORCH_TOKENS, TORCH_BLOCK_SIZES, [8, 16, 32]))
# A full 200-token prefill over 13 blocks; blocks spanning several pages, with -1
# past the sequences and a sequence shorter than its queries.
@index_corner()
@index_corner(seqs=[(200, 3), (5, 9), (129, 1)], page_size=32, block_size=128, topk=3, local_blocks=1,
              layout={"pad": -1, "extra_cols": 2, "extra_pages": 0})
def test_index_topk_torch_matches_reference(c):
    run_index(c, "torch")


@_settings(TRITON_EXAMPLES)
@given(
    c=index_cases(INDEX_TRITON_TOKENS, [16, 32, 64, 128], [16, 32]),
    # Documented to change only the tiling, never the result.
    max_seqlen_q=st.one_of(st.none(), st.integers(1, 64)),
)
@example(
    c={
        "seed": 1, "seqs": [(200, 40), (5, 9), (129, 1)], "page_size": 16, "block_size": 32, "topk": 8,
        "local_blocks": 1, "heads": 2, "d": 16, "layout": {"pad": -1, "extra_cols": 2, "extra_pages": 0},
        "index_dtype": torch.int64,
    },
    max_seqlen_q=None,
)
def test_index_topk_triton_matches_reference(c, max_seqlen_q):
    run_index(c, "triton", TRITON_DEVICE, max_seqlen_q)


# --------------------------------------------------------------------------- dense_paged_attention


@_settings(40)
@given(
    c=st.fixed_dictionaries(
        {
            "seed": seeds,
            "seqs": varlen(128),
            "page_size": st.sampled_from(PAGE_SIZES),
            "hkv": st.sampled_from([1, 2]),
            "group": st.sampled_from([1, 2, 4]),
            "d": st.sampled_from([8, 16, 32]),
            "causal": st.booleans(),
            "scale": st.one_of(st.none(), st.floats(0.05, 2.0)),
            "layout": layouts,
            "index_dtype": index_dtypes,
        }
    )
)
def test_dense_paged_attention_matches_reference(c):
    g = gen(c["seed"])
    batch = make_batch(g, c["seqs"], c["page_size"], **c["layout"])
    q = randn(g, batch.num_tokens, c["hkv"] * c["group"], c["d"])
    k = batch.kv_cache(g, c["hkv"], c["d"])
    v = batch.kv_cache(g, c["hkv"], c["d"])
    kw = {"softmax_scale": c["scale"], "causal": c["causal"]}
    ref = dense_attention_ref(q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, **kw)
    ints = int_args(batch, c["index_dtype"], q.device)
    with pytest.MonkeyPatch.context() as mp, poisoned_allocations():
        mp.setenv("M3_SPARSE_IMPL", "torch")
        got = m3_sparse.dense_paged_attention(q, k, v, ints.pop("block_tables"), **ints, return_lse=True, **kw)
    check_attention("dense", ref, got, batch)


# --------------------------------------------------------------------------- index builder + schedule


def check_index_and_schedule(sel, cu, max_blocks, index, sched, tile_q, num_programs):
    num_tokens, hkv, topk = sel.shape
    batch = cu.shape[0] - 1
    nbg = batch * max_blocks
    cap = num_tokens * hkv * topk
    seq_of = [b for b in range(batch) for _ in range(int(cu[b + 1] - cu[b]))]

    # The valid slots, from the definition: -1 is empty, a repeated id keeps its first slot.
    valid = {}
    for t in range(num_tokens):
        for g in range(hkv):
            seen = set()
            for r, x in enumerate(sel[t, g].tolist()):
                if x >= 0 and x not in seen:
                    seen.add(x)
                    valid[(t, g, r)] = g * nbg + seq_of[t] * max_blocks + x

    offs = index.seg_offsets.tolist()
    used = offs[-1]
    assert len(offs) == hkv * nbg + 1 and offs[0] == 0 and all(a <= b for a, b in zip(offs, offs[1:]))
    assert used == len(valid), f"{used} entries for {len(valid)} valid slots"
    tok, rank, segm = index.entry_token.tolist(), index.entry_rank.tolist(), index.entry_segment.tolist()
    assert len(tok) == len(rank) == len(segm) == cap
    entry_of = {}
    for e in range(used):
        s = segm[e]
        assert 0 <= s < hkv * nbg and offs[s] <= e < offs[s + 1], f"entry {e} of segment {s} lies outside its CSR row"
        key = (tok[e], s // nbg, rank[e])
        assert valid.get(key) == s, f"entry {e} = (token, head, rank) {key} in segment {s} is not a valid slot there"
        assert key not in entry_of, f"slot {key} is entries {entry_of[key]} and {e}"
        entry_of[key] = e
    assert len(entry_of) == len(valid)  # with the above: every valid slot exactly once
    # The kernels rely on entries sorted by segment, then token.
    for e in range(1, used):
        assert (segm[e - 1], tok[e - 1]) < (segm[e], tok[e]), f"entries {e - 1}, {e} out of (segment, token) order"
    assert tok[used:] == rank[used:] == segm[used:] == [-1] * (cap - used)
    slot_of = index.slot_of.tolist()
    for t in range(num_tokens):
        for g in range(hkv):
            for r in range(topk):
                want = entry_of.get((t, g, r), -1)
                assert slot_of[t][g][r] == want, f"slot_of[{t}, {g}, {r}] = {slot_of[t][g][r]}, expected {want}"

    n = int(sched.num_tiles[0])
    assert sched.max_tiles >= n
    seg, start, end = sched.tile_segment.tolist(), sched.tile_start.tolist(), sched.tile_end.tolist()
    # Tiles cover [0, used) exactly once, in order, each inside one segment.
    at = 0
    for i in range(n):
        s = seg[i]
        assert start[i] == at, f"tile {i} starts at {start[i]}, expected {at}: a gap or an overlap"
        assert 0 < end[i] - start[i] <= tile_q, f"tile {i} holds {end[i] - start[i]} entries (tile_q {tile_q})"
        assert 0 <= s < index.num_segments and offs[s] <= start[i] and end[i] <= offs[s + 1], (
            f"tile {i} [{start[i]}, {end[i]}) leaves segment {s}"
        )
        at = end[i]
    assert at == used
    assert all(x == -1 for x in seg[n:])
    # No needless tiles: only a segment's last tile may be short.
    counts = [b - a for a, b in zip(offs, offs[1:])]
    assert n == sum(math.ceil(x / tile_q) for x in counts)
    pt = sched.program_tiles.tolist()
    assert len(pt) == num_programs + 1 and pt[0] == 0 and pt[-1] == n
    sizes = [b - a for a, b in zip(pt, pt[1:])]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1, f"program slices {sizes} are not contiguous and balanced"


@_settings(150)
@given(
    c=st.fixed_dictionaries(
        {
            "seed": seeds,
            "seqs": varlen(48, max_kv=160, min_q=0),
            "page_size": st.sampled_from(PAGE_SIZES),
            "block_size": st.sampled_from(TORCH_BLOCK_SIZES),
            "hkv": st.integers(1, 3),
            "topk": st.integers(1, 8),
            "causal": st.booleans(),
            "layout": layouts,
            "selection": selections,
            # A block chosen by every token: a segment the scheduler must cut into
            # many tiles and spread over programs.
            "hot_block": st.booleans(),
            "tile_q": st.one_of(st.integers(1, 8), st.sampled_from([16, 32, 64, 128])),
            "num_programs": st.one_of(st.integers(1, 8), st.integers(9, 300)),
            "index_dtype": index_dtypes,
        }
    )
)
def test_index_and_schedule_invariants(c):
    g = gen(c["seed"])
    batch = make_batch(g, c["seqs"], c["page_size"], **c["layout"])
    sel = make_selection(g, batch, c["hkv"], c["topk"], c["block_size"], c["causal"], c["selection"])
    max_blocks = -(-batch.capacity // c["block_size"])
    if c["hot_block"]:
        sel[:, :, 0] = int(torch.randint(0, max_blocks, (1,), generator=g))
    sel, cu = sel.to(c["index_dtype"]), batch.cu_seqlens_q.to(c["index_dtype"])
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=max_blocks)
    sched = m3_sparse.schedule(index, tile_q=c["tile_q"], num_programs=c["num_programs"])
    check_index_and_schedule(sel, batch.cu_seqlens_q, max_blocks, index, sched, c["tile_q"], c["num_programs"])
