"""Triton dense paged attention against the float64 oracle (reference.dense_attention_ref)
and the torch implementation (dense_paged_attention_torch), on fresh random inputs.

Without a CUDA device the kernel runs in Triton's interpreter at tiny shapes; with one
the same tests run natively.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton picks the interpreter when a kernel is decorated: this must precede the
    # first import of the kernel module (it is re-decorated below if it came too late).
    os.environ.setdefault("TRITON_INTERPRET", "1")


from kernel_test_utils import (  # noqa: E402
    TOLERANCES,
    kernel_module,
    assert_close,
    gen,
    is_poisoned,
    make_batch,
    poisoned_allocations,
    randn,
    skip_unless_tma,
)
import m3_sparse  # noqa: E402
from m3_sparse.reference import dense_attention_ref  # noqa: E402


tda = kernel_module("m3_sparse.dense.attention_triton")


from m3_sparse.core.validate import attention_args  # noqa: E402
from m3_sparse.dense import plan as dplan  # noqa: E402

DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
LSE_TOL = TOLERANCES[torch.float32]
SCALE = 0.3

# (kv_len, q_len): chunked prefill, full prefill, decode, an empty sequence, rows
# before the first key (kv_len < q_len), a query-less sequence, an empty cache.
RAGGED = [(37, 5), (21, 21), (23, 1), (0, 0), (3, 7), (70, 0), (0, 2), (66, 3)]


def _problem(seed, seqs, page_size, hq, hkv, d, dtype, pad="pool"):
    g = gen(seed)
    batch = make_batch(g, seqs, page_size, pad=pad)
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k = batch.kv_cache(g, hkv, d, dtype)
    v = batch.kv_cache(g, hkv, d, dtype)
    return batch, q, k, v


def dense_torch(*args, **kw):
    """The torch path of ``dense_paged_attention`` whatever the device."""
    return m3_sparse.dense_paged_attention(*args, **kw, config=dplan.DenseConfig(impl="torch"))


def _run(batch, q, k, v, causal, return_lse=True, max_seqlen_q=None, **launch):
    q, k, v, bt = (x.to(DEVICE) for x in (q, k, v, batch.block_tables))
    kw = {"cu_seqlens_q": batch.cu_seqlens_q.to(DEVICE), "used_kv_lens": batch.used_kv_lens.to(DEVICE)}
    with poisoned_allocations():
        out, lse = tda.dense_paged_attention_triton(
            q, k, v, bt, **kw, softmax_scale=SCALE, causal=causal, return_lse=return_lse, max_seqlen_q=max_seqlen_q,
            config=dplan.DenseConfig(**launch),
        )
    assert out.shape == q.shape and out.dtype == q.dtype
    bad = is_poisoned(out)
    assert not bad.any(), f"out: {int(bad.sum())} elements never written, first {torch.nonzero(bad)[0].tolist()}"
    if return_lse:
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
        bad = is_poisoned(lse)
        assert not bad.any(), f"lse: {int(bad.sum())} elements never written"
    else:
        assert lse is None
    return out.cpu(), None if lse is None else lse.cpu()


def _check(batch, q, k, v, causal, dtype, out, lse, against_torch=True):
    ref_o, ref_lse = dense_attention_ref(
        q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, SCALE, causal
    )
    assert_close("out vs oracle", ref_o, out, TOLERANCES[dtype])
    if lse is not None:
        assert_close("lse vs oracle", ref_lse, lse, LSE_TOL)
    # Rows that see no key: exact zeros, lse -inf.
    dead = ref_lse.transpose(0, 1) == float("-inf")  # [Tq, Hq]
    assert torch.all(out[dead] == 0)
    if against_torch:
        t_o, t_lse = dense_torch(
            q, k, v, batch.block_tables, **batch.kwargs(), softmax_scale=SCALE, causal=causal, return_lse=True
        )
        # Both round to the output dtype once: twice the oracle's budget.
        assert_close("out vs torch", t_o, out, 2 * TOLERANCES[dtype])
        if lse is not None:
            assert_close("lse vs torch", t_lse, lse, LSE_TOL)


HEADS = [(4, 4), (8, 2), (16, 2), (4, 1)]  # MHA, GQA G=4, GQA G=8, MQA
HEAD_IDS = ["mha", "gqa4", "gqa8", "mqa"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_ragged_batch(hq, hkv, page_size, causal, dtype):
    seed = hq * 1000 + hkv * 100 + page_size + int(causal)
    batch, q, k, v = _problem(seed, RAGGED, page_size, hq, hkv, 16, dtype)
    out, lse = _run(batch, q, k, v, causal)
    _check(batch, q, k, v, causal, dtype, out, lse)


# Key tiles smaller than a page (several per page), equal, and spanning several pages;
# small query tiles so that sequences own several tiles and the tile search runs deep.
@pytest.mark.parametrize(
    "page_size,block_m,block_n",
    [(64, 16, 16), (64, 32, 32), (16, 16, 128), (16, 64, 16)],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_tile_shapes(page_size, block_m, block_n, causal):
    seqs = [(90, 40), (17, 17), (5, 9), (130, 1), (48, 33)]
    batch, q, k, v = _problem(7 + page_size + block_n, seqs, page_size, 8, 2, 32, torch.float32)
    out, lse = _run(batch, q, k, v, causal, block_m=block_m, block_n=block_n)
    _check(batch, q, k, v, causal, torch.float32, out, lse)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_tile_search_over_several_vectors(monkeypatch, causal):
    """A program finds its tile's sequence counting over vectors of cu_seqlens_q
    (core.launch.seq_vector); vectors of two sequences make that three steps here."""
    from m3_sparse.core import launch

    monkeypatch.setattr(launch, "SEQ_VECTOR_MIN", 2)
    monkeypatch.setattr(launch, "SEQ_VECTOR_MAX", 2)
    seqs = [(90, 40), (17, 17), (5, 9), (130, 1), (48, 33)]
    batch, q, k, v = _problem(11, seqs, 16, 8, 2, 32, torch.float32)
    out, lse = _run(batch, q, k, v, causal, block_m=16, block_n=16)
    _check(batch, q, k, v, causal, torch.float32, out, lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq,hkv", [(8, 1), (8, 8)], ids=["mqa", "mha"])
def test_decode(hq, hkv, dtype):
    # One query per sequence; max_seqlen_q = 1 shrinks the query tile.
    seqs = [(1, 1), (16, 1), (17, 1), (95, 1), (40, 1), (0, 1)]
    batch, q, k, v = _problem(hq + hkv, seqs, 16, hq, hkv, 16, dtype)
    out, lse = _run(batch, q, k, v, True, max_seqlen_q=1)
    _check(batch, q, k, v, True, dtype, out, lse)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_out_of_range_table_padding(causal):
    # Entries past each sequence's pages are -1: reading one would fault or pick garbage.
    batch, q, k, v = _problem(11, RAGGED, 16, 8, 2, 16, torch.float32, pad=-1)
    out, lse = _run(batch, q, k, v, causal, block_n=64)
    _check(batch, q, k, v, causal, torch.float32, out, lse)


def test_strided_q_no_lse():
    # q as a head slice of a fused qkv projection; lse not requested.
    g = gen(5)
    batch = make_batch(g, [(30, 6), (12, 12)], 16)
    qkv = randn(g, batch.num_tokens, 12, 16)
    q = qkv[:, :8]
    k, v = batch.kv_cache(g, 2, 16), batch.kv_cache(g, 2, 16)
    out, lse = _run(batch, q, k, v, True, return_lse=False)
    _check(batch, q, k, v, True, torch.float32, out, None, against_torch=False)


def test_head_dim_not_power_of_two():
    batch, q, k, v = _problem(3, [(45, 7), (9, 3)], 16, 4, 2, 24, torch.float32)
    out, lse = _run(batch, q, k, v, True)
    _check(batch, q, k, v, True, torch.float32, out, lse)


def test_empty_query_batch():
    batch, q, k, v = _problem(2, [(20, 0), (5, 0)], 16, 4, 2, 16, torch.float32)
    out, lse = _run(batch, q, k, v, True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


# Key splits: every tile's keys cut into S shares merged by LSE. More splits than key tiles
# leave some splits empty (m = -inf, l = 0); rows before the first key see nothing in any.
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_key_splits(num_splits, causal):
    batch, q, k, v = _problem(40 + num_splits, RAGGED, 16, 8, 2, 16, torch.bfloat16, pad=-1)
    out, lse = _run(batch, q, k, v, causal, block_n=16, num_splits=num_splits)
    _check(batch, q, k, v, causal, torch.bfloat16, out, lse)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_key_splits_decode_strided_no_lse(num_splits):
    g = gen(9)
    batch = make_batch(g, [(95, 1), (1, 1), (0, 1), (64, 1)], 16)
    qkv = randn(g, batch.num_tokens, 12, 16)
    q = qkv[:, :8]  # strided rows
    k, v = batch.kv_cache(g, 2, 16), batch.kv_cache(g, 2, 16)
    out, _ = _run(batch, q, k, v, True, return_lse=False, max_seqlen_q=1, num_splits=num_splits)
    _check(batch, q, k, v, True, torch.float32, out, None, against_torch=False)


def test_default_splits_follow_the_shapes():
    cpu = torch.device("cpu")  # stands for a 4-SM device: 16 programs wanted
    # Prefill fills the programs: no split.
    assert dplan.default_num_splits(4096, 1, 4, 1, 4096, cpu) == 1
    # One decode token on 1 kv head: 8 splits, if the capacity has 8 x min_key_tiles key tiles.
    tiles = dplan.DEFAULT_CONFIG.min_key_tiles
    assert dplan.default_num_splits(1, 1, 1, 1, 8 * tiles * dplan.BLOCK_N, cpu) == 8
    # A short capacity caps the splits (a power of two).
    assert dplan.default_num_splits(1, 1, 1, 1, 3 * tiles * dplan.BLOCK_N, cpu) == 2
    assert dplan.default_num_splits(1, 1, 1, 1, 16, cpu) == 1


def test_default_block_n_follows_the_tile():
    # Decode-sized tiles take 128 keys where a page holds whole 128-key tiles; prefill tiles,
    # fp32 queries and other page sizes keep BLOCK_N.
    bf, f32 = torch.bfloat16, torch.float32
    assert dplan.default_block_n(16, 128, bf) == dplan.BLOCK_N_DECODE == 128
    assert dplan.default_block_n(64, 256, bf) == 128
    assert dplan.default_block_n(128, 128, bf) == dplan.BLOCK_N
    assert dplan.default_block_n(16, 64, bf) == dplan.BLOCK_N
    assert dplan.default_block_n(16, 128, f32) == dplan.BLOCK_N


@pytest.mark.parametrize("hq,hkv", [(16, 1), (8, 2)], ids=["group16", "group4"])
def test_decode_at_page_128(hq, hkv):
    # The default plan of decode rows at page 128 streams 128-key tiles (several pages of
    # keys, ragged lengths, an empty sequence, -1 table padding): checked against the oracle.
    seqs = [(1, 1), (128, 1), (129, 1), (300, 1), (0, 1), (257, 1)]
    batch, q, k, v = _problem(hq * 10 + hkv, seqs, 128, hq, hkv, 16, torch.bfloat16)
    args = attention_args(q, k, v, batch.block_tables, cu_seqlens_q=batch.cu_seqlens_q,
                          used_kv_lens=batch.used_kv_lens, softmax_scale=SCALE, causal=True, return_lse=True,
                          sparse=False, max_seqlen_q=1)
    assert dplan.plan(args).bn == 128
    out, lse = _run(batch, q, k, v, True, max_seqlen_q=1)
    _check(batch, q, k, v, True, torch.bfloat16, out, lse)


def test_bad_num_splits():
    batch, q, k, v = _problem(1, [(9, 2)], 16, 4, 2, 16, torch.float32)
    for bad in (0, 65):
        with pytest.raises(ValueError, match="num_splits"):
            _run(batch, q, k, v, True, num_splits=bad)


@pytest.mark.gpu  # M3 decode sizes
@pytest.mark.parametrize("page_size", [64, 128])
def test_m3_decode_key_splits_agree(page_size):
    # Batch 8 of one token over 8K contexts at M3's heads: the default split count (several
    # on a GPU; 128-key tiles at page 128), one split, and the torch code agree.
    seqs = [(8192 - 300 * i, 1) for i in range(8)]
    batch, q, k, v = _problem(99, seqs, page_size, 64, 4, 128, torch.bfloat16)
    kw = dict(max_seqlen_q=1)
    split = dplan.default_num_splits(8, 8, 4, 1, batch.capacity, DEVICE)
    assert split > 1
    out_s, lse_s = _run(batch, q, k, v, True, **kw)
    out_1, lse_1 = _run(batch, q, k, v, True, num_splits=1, **kw)
    t_o, t_lse = dense_torch(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), batch.block_tables.to(DEVICE),
        cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE), used_kv_lens=batch.used_kv_lens.to(DEVICE),
        softmax_scale=SCALE, causal=True, return_lse=True,
    )  # fmt: skip
    for name, o, l in (("default splits", out_s, lse_s), ("one split", out_1, lse_1)):
        assert_close(f"{name} vs torch", t_o.cpu(), o, 2 * TOLERANCES[torch.bfloat16])
        assert_close(f"{name} lse vs torch", t_lse.cpu(), l, LSE_TOL)


# TMA boxes: a key tile comes in as one box of its page, unwritten slots included. Those
# hold NaN here, so a tile past a row's last key must not let them reach the output.
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("page_size,block_n,num_splits", [(64, 64, 1), (64, 16, 1), (32, 32, 3)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_tma_boxes_with_nan_slots(use_tma, page_size, block_n, num_splits, causal):
    if use_tma:
        skip_unless_tma()
    g = gen(page_size + block_n + num_splits + int(causal))
    batch = make_batch(g, RAGGED + [(150, 40)], page_size, pad=-1)
    q = randn(g, batch.num_tokens, 8, 32, dtype=torch.bfloat16)
    k = batch.kv_cache(g, 2, 32, torch.bfloat16, garbage=float("nan"))
    v = batch.kv_cache(g, 2, 32, torch.bfloat16, garbage=float("nan"))
    assert tda.tma_unusable(k, v, block_n, 32) is None
    out, lse = _run(batch, q, k, v, causal, block_n=block_n, num_splits=num_splits, use_tma=use_tma)
    assert not out.isnan().any()
    _check(batch, q, k, v, causal, torch.bfloat16, out, lse, against_torch=False)


# int64 tables and lengths are accepted like int32 ones; TMA coordinates are 32-bit, so
# the kernel must narrow the page row it computes from them (it failed to compile before).
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_int64_metadata(use_tma, causal):
    if use_tma:
        skip_unless_tma()
    batch, q, k, v = _problem(11, [(150, 40), (1, 1), (66, 3)], 64, 8, 2, 32, torch.bfloat16)
    wide = dataclasses.replace(batch, **{n: getattr(batch, n).to(torch.int64)
                                          for n in ("block_tables", "cu_seqlens_q", "used_kv_lens")})
    out, lse = _run(wide, q, k, v, causal, block_n=32, use_tma=use_tma)
    ref, ref_lse = _run(batch, q, k, v, causal, block_n=32, use_tma=use_tma)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    _check(batch, q, k, v, causal, torch.bfloat16, out, lse, against_torch=False)


def test_tma_at_m3_shapes():
    # The default launch takes the TMA path for M3's caches (pages of 64 or 128, D 128).
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for page_size in (64, 128):
            cache = torch.empty(5, 4, page_size, 128, dtype=dtype)
            assert tda.tma_unusable(cache, cache, dplan.BLOCK_N, 128) is None


def test_tma_required_but_unusable():
    skip_unless_tma()
    batch, q, k, v = _problem(4, [(40, 5), (9, 9)], 16, 4, 2, 16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"use_tma=True.*page_size \(16\) must be a multiple of block_n \(64\)"):
        _run(batch, q, k, v, True, use_tma=True)
    with pytest.raises(ValueError, match=r"head dim \(24\) must be a power of two"):
        b24, q24, k24, v24 = _problem(4, [(40, 5)], 16, 4, 2, 24, torch.bfloat16)
        _run(b24, q24, k24, v24, True, block_n=16, use_tma=True)
    # [pages, 4, ps, D] on the device (a copy to it would make a slice contiguous): its
    # first two heads are a strided cache.
    wide = torch.cat([k, k], dim=1).to(DEVICE)
    with pytest.raises(ValueError, match="must be contiguous"):
        _run(batch, q, wide[:, :2], v, True, block_n=16, use_tma=True)
    # The same strided cache without the demand: gathered loads, and a correct result.
    out, lse = _run(batch, q, wide[:, :2], v, True, block_n=16)
    _check(batch, q, k, v, True, torch.bfloat16, out, lse)


def test_tma_reasons():
    cache = torch.empty(0, 2, 64, 32, dtype=torch.bfloat16)
    assert tda.tma_unusable(cache, cache, 64, 32) == "an empty page pool"
    cache = torch.empty(3, 2, 64, 32, dtype=torch.bfloat16)
    assert "block_n" in tda.tma_unusable(cache, cache, 128, 32)
    assert "head dim" in tda.tma_unusable(cache, cache, 64, 64)
    assert tda.tma_unusable(cache, cache, 32, 32) is None


def _unaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, contiguous, one element past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def test_launch_keeps_descriptors_per_pool_and_loads_unaligned_pools_gathered():
    """A planned launch keeps the TMA descriptors of each pair of pools it ran on; pools at an
    address a TMA box cannot start from (same shapes and strides) run with gathered loads,
    unless TMA was required."""
    skip_unless_tma()
    batch, q, k, v = _problem(21, [(150, 1), (40, 1)], 32, 8, 2, 32, torch.bfloat16)
    q, k, v = (x.to(DEVICE) for x in (q, k, v))
    call = dict(cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE), used_kv_lens=batch.used_kv_lens.to(DEVICE),
                softmax_scale=SCALE, causal=True, return_lse=True, sparse=False, allow_fp8=False)
    tables = batch.block_tables.to(DEVICE)
    launch = tda.DenseLaunch(attention_args(q, k, v, tables, **call), dplan.DenseConfig(block_n=32))
    assert launch.tma
    want = dense_torch(q, k, v, tables, cu_seqlens_q=call["cu_seqlens_q"], used_kv_lens=call["used_kv_lens"],
                       softmax_scale=SCALE, return_lse=True)
    for _ in range(2):
        out, lse = launch.run(q, k, v)
    assert len(launch._descriptors) == 1
    k2, v2 = k.clone(), v.clone()
    out2, lse2 = launch.run(q, k2, v2)
    assert len(launch._descriptors) == 2 and torch.equal(out2, out) and torch.equal(lse2, lse)
    ku, vu = _unaligned_copy(k), _unaligned_copy(v)
    assert ku.stride() == k.stride() and ku.data_ptr() % 16
    out_u, lse_u = launch.run(q, ku, vu)
    assert len(launch._descriptors) == 2
    for o, l in ((out, lse), (out_u, lse_u)):
        assert_close("planned launch vs torch", want[0].cpu(), o, 2 * TOLERANCES[torch.bfloat16])
        assert_close("planned launch lse vs torch", want[1].cpu(), l, LSE_TOL)
    required = tda.DenseLaunch(attention_args(q, k, v, tables, **call), dplan.DenseConfig(block_n=32, use_tma=True))
    with pytest.raises(ValueError, match="use_tma=True: .*16-byte boundaries"):
        required.run(q, ku, vu)
