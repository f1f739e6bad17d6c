"""Triton KV-outer index builder and scheduler against the torch ones (which
test_kvouter.py checks against their definition): every array must be equal, bit for bit.

Without a CUDA device the kernels run in Triton's interpreter at small shapes; with one
they also run at M3 prefill sizes (32K tokens, 4 KV heads, top-16).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import m3_sparse  # noqa: E402
from kernel_test_utils import gen, kernel_module, poisoned_allocations  # noqa: E402

tidx = kernel_module("m3_sparse.kvouter.build_triton")
tsched = kernel_module("m3_sparse.kvouter.schedule_triton")

DEVICE = "cuda" if HAS_CUDA else "cpu"
INDEX_FIELDS = ("seg_offsets", "entry_token", "entry_rank", "entry_segment", "slot_of")
SCHEDULE_FIELDS = ("tile_segment", "tile_start", "tile_end", "num_tiles", "program_tiles")


def cu_of(q_lens, dtype=torch.int32):
    return torch.tensor([0] + torch.cumsum(torch.tensor(q_lens, dtype=torch.int64), 0).tolist(), dtype=dtype)


def random_selection(g, num_tokens, hkv, topk, max_blocks, empty=0.2, repeat=0.1):
    """Ids in [0, max_blocks), a share of them -1 and a share repeating an earlier slot."""
    sel = torch.randint(0, max_blocks, (num_tokens, hkv, topk), generator=g)
    if topk > 1:
        src = torch.randint(0, topk, sel.shape, generator=g)
        src = torch.minimum(src, torch.arange(topk).expand_as(src))  # an earlier (or the same) slot
        rep = torch.rand(sel.shape, generator=g) < repeat
        sel = torch.where(rep, torch.gather(sel, 2, src), sel)
    sel[torch.rand(sel.shape, generator=g) < empty] = -1
    return sel.to(torch.int32)


def assert_same_arrays(ref, got, fields):
    for f in fields:
        a, b = getattr(ref, f), getattr(got, f)
        assert b.dtype == a.dtype and b.shape == a.shape, f"{f}: {b.dtype}{tuple(b.shape)} vs {a.dtype}{tuple(a.shape)}"
        if not torch.equal(a.cpu(), b.cpu()):
            bad = torch.nonzero(a.cpu() != b.cpu())[0].tolist()
            pytest.fail(f"{f} differs first at {bad}: torch {a.cpu()[tuple(bad)]}, triton {b.cpu()[tuple(bad)]}")


def assert_same_index(ref, got):
    assert_same_arrays(ref, got, INDEX_FIELDS)
    for f in ("num_kv_heads", "max_blocks", "num_global_blocks"):
        assert getattr(got, f) == getattr(ref, f), f


def assert_same_schedule(ref, got):
    assert got.tile_q == ref.tile_q
    assert_same_arrays(ref, got, SCHEDULE_FIELDS)


def check(sel, cu, max_blocks, chunk_tokens=None, schedules=((1, 1), (4, 3), (8, 16))):
    """Each builder and scheduler path against the torch ones: the index alone, then each
    schedule made from it, and as a KV-outer call makes both (the build's prefix pass writing
    the tile prefix the scheduler takes)."""
    sel, cu = sel.to(DEVICE), cu.to(DEVICE)
    ref = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=max_blocks)
    with poisoned_allocations():
        got = tidx.build_kvouter_index_triton(sel, cu_seqlens_q=cu, max_blocks=max_blocks, chunk_tokens=chunk_tokens)
    assert_same_index(ref, got)
    launch = tidx.build_launch(*sel.shape, cu.shape[0] - 1, max_blocks, chunk_tokens)
    for tile_q, programs in schedules:
        want = m3_sparse.schedule(ref, tile_q=tile_q, num_programs=programs)
        with poisoned_allocations():
            sched = tsched.schedule_triton(got, tile_q=tile_q, num_programs=programs)
        assert_same_schedule(want, sched)
        with poisoned_allocations():
            fused, tile_base = launch.run_with_tiles(sel, cu, tile_q)
            sched = tsched.ScheduleLaunch(fused.capacity, fused.num_segments, tile_q, programs).run(fused, tile_base)
        assert_same_index(ref, fused)
        assert_same_schedule(want, sched)
    return got


CASES = [
    # q_lens per sequence, hkv, topk, max_blocks, chunk tokens (None: the default)
    ([5], 1, 1, 3, None),
    ([3, 0, 4], 2, 4, 5, 2),  # an empty sequence between two, chunks of 2
    ([1, 1, 1, 1], 4, 16, 6, None),  # decode-like rows
    ([7, 2], 3, 8, 2, 4),  # more slots than blocks: repeats everywhere
    ([12], 2, 3, 40, None),  # topk not a power of two
    ([0, 40, 0, 17, 0], 2, 5, 9, 8),  # empty sequences first, between and last
    ([33], 1, 32, 64, 16),  # topk 32, several chunks, a partial last one
    ([9, 16, 1], 4, 16, 12, 1),  # one token per chunk
    ([70, 3], 2, 2, 9, 1),  # 70 chunks in a sequence: more than one step of the scan pass
    ([9, 4], 2, 80, 50, 4),  # topk past UNROLL_TOPK (slot loops at run time), not a power of two
]


@pytest.mark.parametrize("q_lens,hkv,topk,max_blocks,chunk", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_torch_builder_and_scheduler(seed, q_lens, hkv, topk, max_blocks, chunk):
    sel = random_selection(gen(seed), sum(q_lens), hkv, topk, max_blocks)
    check(sel, cu_of(q_lens), max_blocks, chunk)


def test_int64_and_strided_selection():
    g = gen(2)
    q_lens, hkv, topk, max_blocks = [6, 11], 3, 4, 7
    base = random_selection(g, sum(q_lens), topk, hkv, max_blocks).to(torch.int64)
    sel = base.transpose(1, 2)  # [Tq, Hkv, topk] with non-unit inner strides
    assert not sel.is_contiguous()
    check(sel, cu_of(q_lens, torch.int64), max_blocks, chunk_tokens=4)


@pytest.mark.parametrize("seed", [0, 1])
def test_int64_sort_keys(seed, monkeypatch):
    # Sort keys switch to int64 when max_blocks * chunk entries passes int32; lower the bound
    # so that small shapes take that path too.
    monkeypatch.setattr(tidx, "KEY32_LIMIT", 1)
    q_lens, hkv, topk, max_blocks = [21, 5], 2, 6, 11
    check(random_selection(gen(seed), sum(q_lens), hkv, topk, max_blocks), cu_of(q_lens), max_blocks, 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_pass_in_several_steps(seed, monkeypatch):
    # The prefix pass walks the segments PREFIX_SEGMENTS at a time, carrying both sums from
    # step to step; lower the step so that 2 x 3 x 13 = 78 segments take five of them.
    monkeypatch.setattr(tidx, "PREFIX_SEGMENTS", 16)
    q_lens, hkv, topk, max_blocks = [14, 0, 9], 2, 5, 13
    check(random_selection(gen(seed), sum(q_lens), hkv, topk, max_blocks), cu_of(q_lens), max_blocks, 4,
          schedules=((1, 3), (3, 7)))


def test_hot_block_and_empty_rows():
    # Every token chooses block 0 (a segment spanning many tiles and chunks) and nothing else
    # in half of the rows; the other half is all -1.
    num_tokens, hkv, topk = 50, 2, 4
    sel = torch.full((num_tokens, hkv, topk), -1, dtype=torch.int32)
    sel[::2, :, 1] = 0
    sel[::2, 1, 3] = 0  # a repeat of the same id: counted once
    got = check(sel, cu_of([num_tokens]), 3, chunk_tokens=8, schedules=((4, 8), (3, 64)))
    assert int(got.seg_offsets[-1]) == 2 * 25


def test_all_empty():
    sel = torch.full((10, 2, 3), -1, dtype=torch.int32)
    got = check(sel, cu_of([4, 6]), 5)
    assert int(got.seg_offsets[-1]) == 0


def test_no_tokens():
    sel = torch.empty(0, 2, 4, dtype=torch.int32)
    got = check(sel, cu_of([0, 0]), 3)
    assert got.capacity == 0


def test_chunk_length_grows_to_bound_the_count_matrix():
    assert tidx.chunk_tokens_for(1000, 1, 4, 16, 64) == tidx.CHUNK_ENTRIES // 16
    assert tidx.chunk_tokens_for(1000, 1, 4, 32, 64) == tidx.CHUNK_ENTRIES // 32
    big = tidx.chunk_tokens_for(1 << 19, 1, 4, 16, 4096)  # 512K tokens over a 512K-token table
    assert big > tidx.CHUNK_ENTRIES // 16
    assert ((1 << 19) // big + 1) * 4 * 4096 <= tidx.MAX_COUNT_CELLS
    assert big * 16 <= tidx.MAX_CHUNK_ENTRIES
    # Past what the tile may hold, the chunk stops growing (the count matrix then passes the cap).
    assert tidx.chunk_tokens_for(1 << 24, 1, 4, 16, 1 << 15) * 16 == tidx.MAX_CHUNK_ENTRIES


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(chunk_tokens=3), "chunk_tokens: expected a power of two"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(batch_size=3), "batch_size=3"),
        (dict(max_blocks=0), "max_blocks"),
    ],
)
def test_errors(kwargs, match):
    sel = torch.zeros(4, 1, 2, dtype=torch.int32, device=DEVICE)
    args = dict(cu_seqlens_q=cu_of([4]).to(DEVICE), max_blocks=2) | kwargs
    with pytest.raises(ValueError, match=match):
        tidx.build_kvouter_index_triton(sel, **args)
    with pytest.raises(TypeError, match="KVOuterIndex"):
        tsched.schedule_triton(object(), tile_q=4, num_programs=2)


@settings(max_examples=15 if not HAS_CUDA else 60, deadline=None, derandomize=True, database=None)
@given(
    seed=st.integers(0, 2**16),
    q_lens=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    hkv=st.integers(1, 3),
    topk=st.integers(1, 9),
    max_blocks=st.integers(1, 12),
    chunk=st.sampled_from([None, 1, 2, 8]),
    tile_q=st.integers(1, 9),
    programs=st.integers(1, 20),
)
def test_property(seed, q_lens, hkv, topk, max_blocks, chunk, tile_q, programs):
    sel = random_selection(gen(seed), sum(q_lens), hkv, topk, max_blocks, empty=0.3, repeat=0.3)
    check(sel, cu_of(q_lens), max_blocks, chunk, schedules=((tile_q, programs),))


@pytest.mark.gpu  # M3 prefill sizes
@pytest.mark.parametrize("pattern", ["random", "hot"])
def test_m3_prefill_size(pattern):
    g = gen(7)
    q_lens, hkv, topk = [32768, 4096, 1], 4, 16
    max_blocks = 32768 // 128
    n = sum(q_lens)
    if pattern == "hot":  # every token picks among the first 24 blocks
        sel = torch.rand(n, hkv, 24, generator=g).argsort(-1)[..., :topk]
    else:
        sel = torch.randint(0, max_blocks, (n, hkv, topk), generator=g)
    sel = sel.to(torch.int32)
    sel[torch.rand(sel.shape, generator=g) < 0.05] = -1
    check(sel, cu_of(q_lens), max_blocks, schedules=((8, 528), (16, 132)))
