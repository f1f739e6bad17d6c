"""The Triton index-branch kernels (triton_index_topk) against the float64 oracles.

On a machine without CUDA the kernels run under the Triton interpreter at tiny
shapes; on CUDA the same tests run at larger shapes (head dim 128, thousands of
keys). Selections are compared as sets (the slot order is not part of the
contract). Ties: the kernel accumulates in fp32, the oracle in fp64, so two
blocks whose oracle scores lie within ``TIE_TOL`` of each other may swap
places. Every such swap is counted; any other difference fails.
"""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # Must precede the first import of triton: @triton.jit picks the interpreter
    # when the decorated module is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402

from kernel_test_utils import (  # noqa: E402
    fp8_mma,
    gen,
    is_poisoned,
    make_batch,
    poisoned_allocations,
    randn,
    require_gluon,
)
from m3_sparse.reference import index_topk_ref  # noqa: E402
import m3_sparse  # noqa: E402
from m3_sparse.index.plan import IndexConfig  # noqa: E402

LAUNCH_CHOICES = ("block_m", "block_k", "num_splits", "num_warps", "num_stages", "key_major", "maxnreg", "engine")


def index_topk_triton(*args, **kw):
    """``index_topk`` pinned to the kernels (the interpreter on the CPU), launch choices as
    keywords."""
    choices = {k: kw.pop(k) for k in LAUNCH_CHOICES if k in kw}
    return m3_sparse.index_topk(*args, **kw, config=IndexConfig(impl="triton", **choices))


_index_topk_launch = index_topk_triton

from m3_sparse.index import topk_triton  # noqa: E402

if not ON_GPU and type(topk_triton._index_topk_kernel).__name__ != "InterpretedFunction":
    raise ImportError(
        "triton was imported before TRITON_INTERPRET=1 was set, so the kernels cannot run on this CPU-only "
        "machine: set TRITON_INTERPRET=1 in the environment (or in conftest.py before importing m3_sparse)"
    )

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# |s_a - s_b| <= TIE_TOL * (1 + max(|s_a|, |s_b|)) lets two blocks swap. fp32
# accumulation of D products differs from fp64 by ~D * 2^-24 relative; 1e-4 is
# well above that and far below the gaps of distinct random blocks.
TIE_TOL = 1e-4
# Hopper's fp8 MMA adds each group of e4m3 products in an accumulator narrower than fp32:
# a 128-term score can be off by ~1e-3 of the sum of its products' magnitudes, up to
# ~4e-3 of the score itself (seen on the H200: two blocks 3.5e-3 apart swapped places).
FP8_TIE_TOL = 1e-2


def tie_tol(fp8_dot: bool) -> float:
    """The swap tolerance of a kernel's scores: Hopper's fp8 bound only where its fp8 MMA runs
    (a GPU); the interpreter computes the fp8 dot in fp32."""
    return FP8_TIE_TOL if fp8_mma(fp8_dot) else TIE_TOL


# Head dim and index heads of the test problems; lengths scale with SCALE.
DIM = 128 if ON_GPU else 32  # 32: the fp8 dot needs an index head dim of at least 32
HEADS = 4 if ON_GPU else 3
SCALE = 8 if ON_GPU else 1


def canon(sel: torch.Tensor) -> torch.Tensor:
    big = torch.iinfo(torch.int32).max
    s = torch.where(sel < 0, big, sel).sort(-1).values
    return torch.where(s == big, -1, s)


def dense_oracle(iq, ik, batch, topk, block_size, local_blocks):
    """Vectorized float64 version of index_topk_ref (same rule, one matmul per
    sequence) for shapes where the per-token oracle is too slow. Returns
    (selected sorted ascending then -1, block scores dict token -> [H, L+1])."""
    tables = batch.block_tables.to(torch.int64)
    sel = torch.full((batch.num_tokens, iq.shape[1], topk), -1, dtype=torch.int32)
    scores = {}
    t0 = 0
    for b, (kv, n) in enumerate(zip(batch.kv_lens, batch.q_lens)):
        if n == 0 or kv == 0:  # no key: every row stays -1
            t0 += n
            continue
        j = torch.arange(kv)
        pages = tables[b, j // batch.page_size]
        keys = ik[pages.to(ik.device), (j % batch.page_size).to(ik.device)].double()  # [kv, D]
        q = iq[t0 : t0 + n].double()  # [n, H, D]
        s = torch.einsum("nhd,kd->nhk", q, keys).cpu()
        pos = torch.arange(kv - n, kv)
        nb = math.ceil(kv / block_size)
        s = s.masked_fill(torch.arange(kv)[None, None, :] > pos[:, None, None], float("-inf"))
        s = torch.nn.functional.pad(s, (0, nb * block_size - kv), value=float("-inf"))
        bs = s.view(n, -1, nb, block_size).amax(-1)  # [n, H, nb]
        last = pos // block_size
        blk = torch.arange(nb)
        forced = (blk[None, :] <= last[:, None]) & (blk[None, :] > last[:, None] - local_blocks)
        key = bs.masked_fill(blk[None, None, :] > last[:, None, None], float("-inf"))
        key = key.masked_fill(forced[:, None, :], float("inf"))
        order = torch.sort(key, dim=-1, descending=True, stable=True)
        k = min(topk, nb)
        ids = order.indices[..., :k].masked_fill(order.values[..., :k] == float("-inf"), -1).to(torch.int32)
        sel[t0 : t0 + n, :, :k] = ids
        for i in range(n):
            if pos[i] >= 0:
                scores[t0 + i] = bs[i, :, : int(last[i]) + 1]
        t0 += n
    return canon(sel), scores


def check(batch, out, ref, scores, topk, block_size, local_blocks, tol=TIE_TOL):
    """Assert the contract row by row; returns the number of tolerated tie swaps."""
    assert out.dtype == torch.int32 and tuple(out.shape) == tuple(ref.shape)
    out = out.cpu()
    assert not is_poisoned(out).any(), f"{int(is_poisoned(out).sum())} output element(s) never written"
    # Layout: valid ids first, then -1 only.
    valid = out >= 0
    n_valid = valid.sum(-1, keepdim=True)
    slot = torch.arange(topk)
    assert torch.equal(valid, slot < n_valid), "-1 slots must come after every valid id"
    assert bool(((out >= -1)).all()), "ids below -1"
    out_c = canon(out)
    swaps = 0
    bad = []
    diff_rows = (out_c != ref).any(-1).nonzero().tolist()
    pos_of = {t: p for _, t, p in batch.tokens()}
    for t, h in diff_rows:
        p = pos_of[t]
        last = p // block_size
        forced = {blk for blk in range(last, last - local_blocks, -1) if blk >= 0}
        o = [x for x in out_c[t, h].tolist() if x >= 0]
        r = [x for x in ref[t, h].tolist() if x >= 0]
        so, sr = set(o), set(r)
        ok = len(so) == len(o) == len(r) and forced <= so and all(x <= last for x in so)
        if ok:
            s = scores[t][h]
            extra = sorted(so - sr, key=lambda x: -float(s[x]))
            missing = sorted(sr - so, key=lambda x: -float(s[x]))
            for a, b in zip(extra, missing):
                sa, sb = float(s[a]), float(s[b])
                if abs(sa - sb) > tol * (1.0 + max(abs(sa), abs(sb))):
                    ok = False
            swaps += len(extra)
        if not ok:
            bad.append(f"token {t} (pos {p}) head {h}: expected {r}, got {o}")
    assert not bad, f"{len(bad)} selection row(s) differ from the oracle beyond ties; first: {bad[0]}"
    return swaps


def run_case(batch, iq, ik, topk, block_size, local_blocks=1, oracle="auto", **launch):
    iq, ik = iq.to(DEVICE), ik.to(DEVICE)
    tables, cu, kv = (x.to(DEVICE) for x in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    with poisoned_allocations():
        out = _index_topk_launch(
            iq, ik, tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=topk, block_size=block_size,
            local_blocks=local_blocks, **launch,
        )
    if ON_GPU:
        torch.cuda.synchronize()
    work = sum(n * kv for kv, n in zip(batch.kv_lens, batch.q_lens))
    if oracle == "naive" or (oracle == "auto" and work <= 8_000):
        ref, scores = index_topk_ref(
            iq.cpu(), ik.cpu(), batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, topk, block_size,
            local_blocks,
        )
    else:
        ref, scores = dense_oracle(iq, ik, batch, topk, block_size, local_blocks)
    return check(batch, out, ref, scores, topk, block_size, local_blocks)


def ragged(bs: int, s: int = SCALE):
    """(kv_len, q_len): shorter than one block, a full prefill of a few blocks, two
    chunked prefills, one decode token and a sequence without queries."""
    return [
        (bs // 2, bs // 2),
        (3 * bs + 5, 3 * bs + 5) if s == 1 else (s * bs + 5, s * bs + 5),
        (6 * s * bs + 3, 5 * s),
        (9 * s * bs + bs // 3, 2),
        (4 * s * bs + 1, 1),
        (3 * bs, 0),
    ]


PAGE_BLOCK = [(16, 16), (16, 64), (64, 32), (64, 64), (64, 128), (128, 128), (128, 32)]


@pytest.mark.parametrize("page_size,block_size", PAGE_BLOCK)
def test_varlen_ragged_shuffled_pages(page_size, block_size):
    g = gen(page_size * 1000 + block_size)
    batch = make_batch(g, ragged(block_size), page_size, shuffle=True)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16)
    ik = batch.index_cache(g, DIM, dtype=torch.bfloat16)
    run_case(batch, iq, ik, topk=4, block_size=block_size)


# topk 1/4/16/32 with local windows 0/1/2 (local <= topk); 40+ visible blocks of
# 8 tokens so that topk 32 is full.
@pytest.mark.parametrize("topk,local_blocks", [(k, n) for k in (1, 4, 16, 32) for n in (0, 1, 2) if n <= k])
def test_topk_and_local_blocks(topk, local_blocks):
    g = gen(100 + 7 * topk + local_blocks)
    bs = 8 if not ON_GPU else 64
    batch = make_batch(g, [(5, 5), (45 * bs + 3, 6), (12 * bs, 3), (bs + 1, 2), (40 * bs, 1)], page_size=16 if not ON_GPU else 64)
    iq = randn(g, batch.num_tokens, 2, DIM)
    ik = batch.index_cache(g, DIM)
    run_case(batch, iq, ik, topk=topk, block_size=bs, local_blocks=local_blocks)


@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("page_size,block_size", [(16, 16), (64, 64), (128, 128), (16, 32)])
def test_decode_one_token(page_size, block_size, num_splits):
    g = gen(7 + page_size + num_splits if num_splits else 7)
    kv_lens = [1, block_size - 1, block_size, block_size + 1, (7 * SCALE) * block_size + 3, 20 * SCALE * block_size]
    batch = make_batch(g, [(kv, 1) for kv in kv_lens], page_size)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16)
    ik = batch.index_cache(g, DIM, dtype=torch.bfloat16)
    run_case(batch, iq, ik, topk=8, block_size=block_size, num_splits=num_splits)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_speculative_decode(seed, num_splits):
    g = gen(200 + seed)
    kv_lens = [int(x) for x in torch.randint(20, 600 * SCALE, (5,), generator=g)]
    q_lens = [16, 1] + [int(x) for x in torch.randint(2, 17, (3,), generator=g)]
    batch = make_batch(g, list(zip(kv_lens, q_lens)), page_size=64)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.float16)
    ik = batch.index_cache(g, DIM, dtype=torch.float16)
    run_case(batch, iq, ik, topk=8, block_size=64, num_splits=num_splits, max_seqlen_q=max(q_lens))


@pytest.mark.parametrize("block_m,num_splits", [(None, None), (16, 1), (32, 5), (128, 3), (64, 1)])
def test_chunked_prefill(block_m, num_splits):
    """A chunk of queries after an existing cache; row tiles of several heights
    and split counts (tiles never straddle the two sequences)."""
    g = gen(300 + (block_m or 0) + (num_splits or 0))
    bs = 32 if not ON_GPU else 128
    seqs = [(20 * bs + 7, 37 * SCALE), (9 * bs, 2 * bs + 1), (bs + 3, 11)]
    batch = make_batch(g, seqs, page_size=64 if not ON_GPU else 128)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16)
    ik = batch.index_cache(g, DIM, dtype=torch.bfloat16)
    run_case(batch, iq, ik, topk=6, block_size=bs, local_blocks=1, block_m=block_m, num_splits=num_splits)


def test_short_sequences():
    """Every sequence shorter than one block: only the local block (or nothing
    besides it) can be selected. Queries before a sequence's first token (more
    queries than cached tokens, or an empty cache) see nothing: all -1."""
    g = gen(400)
    batch = make_batch(g, [(1, 1), (5, 5), (127, 127), (64, 3), (3, 6), (0, 2)], page_size=64)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16)
    ik = batch.index_cache(g, DIM, dtype=torch.bfloat16)
    for local in (0, 1, 2):
        run_case(batch, iq, ik, topk=4, block_size=128, local_blocks=local)


@pytest.mark.parametrize(
    "q_dtype,k_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_dtypes(q_dtype, k_dtype):
    g = gen(500)
    batch = make_batch(g, [(9, 9), (300 * SCALE, 6), (77, 3), (520 * SCALE, 1)], page_size=32)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=q_dtype)
    ik = batch.index_cache(g, DIM, dtype=k_dtype)
    run_case(batch, iq, ik, topk=4, block_size=32)


@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
def test_block_table_padding_and_nan_garbage_never_read(pad):
    """Table entries past a sequence's pages hold garbage ids and unwritten cache
    slots hold NaN: neither may reach a score."""
    g = gen(600)
    batch = make_batch(g, [(100, 4), (33, 33), (7, 1), (200, 1)], page_size=16, extra_cols=3, pad=pad)
    iq = randn(g, batch.num_tokens, HEADS, DIM)
    ik = batch.index_cache(g, DIM, garbage=float("nan"))
    run_case(batch, iq, ik, topk=3, block_size=32)
    run_case(batch, iq, ik, topk=3, block_size=32, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("local_blocks", [0, 1, 2])
def test_exact_ties_prefer_lower_block_ids(local_blocks, num_splits):
    """All keys equal: every block score ties exactly, so after the forced window
    the lowest ids win, also across splits."""
    g = gen(700)
    batch = make_batch(g, [(400, 4), (130, 2), (20, 1)], page_size=16)
    # Small integers: every dot is exact whatever the summation order (BLAS
    # under the interpreter sums edge columns differently).
    iq = torch.randint(-3, 4, (batch.num_tokens, HEADS, DIM), generator=g).float()
    key = torch.randint(-3, 4, (DIM,), generator=g).float()
    ik = batch.index_cache(g, DIM)
    ik = torch.where(batch.written[:, :, None], key, ik)
    topk = 5
    out = _index_topk_launch(
        iq.to(DEVICE), ik.to(DEVICE), batch.block_tables.to(DEVICE), cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE),
        used_kv_lens=batch.used_kv_lens.to(DEVICE), topk=topk, block_size=16, local_blocks=local_blocks,
        num_splits=num_splits,
    ).cpu()
    for _, t, p in batch.tokens():
        last = p // 16
        forced = {blk for blk in range(last, last - local_blocks, -1) if blk >= 0}
        rest = [blk for blk in range(last + 1) if blk not in forced][: topk - len(forced)]
        expected = sorted(forced | set(rest)) + [-1] * (topk - len(forced) - len(rest))
        for h in range(HEADS):
            assert canon(out)[t, h].tolist() == expected, f"token {t} head {h}"


def test_public_entry_and_int64_metadata():
    """index_topk_triton with int64 lengths/tables and a max_seqlen_q hint, and the
    empty batch."""
    g = gen(800)
    batch = make_batch(g, [(150, 7), (40, 40), (260, 2)], page_size=16)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16).to(DEVICE)
    ik = batch.index_cache(g, DIM, dtype=torch.bfloat16).to(DEVICE)
    kw = dict(topk=5, block_size=32, local_blocks=1)
    ref, scores = index_topk_ref(iq.cpu(), ik.cpu(), batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, **kw)
    for hint in (None, 40, 1):
        out = index_topk_triton(
            iq, ik, batch.block_tables.to(DEVICE, torch.int64), cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE, torch.int64),
            used_kv_lens=batch.used_kv_lens.to(DEVICE, torch.int64), max_seqlen_q=hint, **kw,
        )
        check(batch, out, ref, scores, 5, 32, 1)
    empty = make_batch(g, [(40, 0)], page_size=16)
    sel = index_topk_triton(
        iq[:0], ik, empty.block_tables.to(DEVICE), cu_seqlens_q=empty.cu_seqlens_q.to(DEVICE),
        used_kv_lens=empty.used_kv_lens.to(DEVICE), topk=4, block_size=16,
    )
    assert sel.shape == (0, HEADS, 4) and sel.dtype == torch.int32


def test_dense_oracle_matches_naive_oracle():
    """The vectorized oracle used at large GPU shapes is the per-token one."""
    g = gen(900)
    batch = make_batch(g, [(70, 70), (300, 5), (33, 1)], page_size=16)
    iq = randn(g, batch.num_tokens, 2, 16)
    ik = batch.index_cache(g, 16)
    for local in (0, 1, 2):
        a, _ = dense_oracle(iq, ik, batch, 6, 16, local)
        b, _ = index_topk_ref(iq, ik, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, 6, 16, local)
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(topk=33), "topk"),
        (dict(block_size=48), "power of two"),
        (dict(page=48), "page size"),
        (dict(dim=8), "head dim"),
    ],
)
def test_rejects_unsupported_shapes(kwargs, match):
    g = gen(1000)
    page = kwargs.pop("page", 16)
    dim = kwargs.pop("dim", 16)
    batch = make_batch(g, [(40, 4)], page_size=page)
    iq = randn(g, batch.num_tokens, 2, dim).to(DEVICE)
    ik = batch.index_cache(g, dim).to(DEVICE)
    args = dict(topk=4, block_size=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        index_topk_triton(
            iq, ik, batch.block_tables.to(DEVICE), cu_seqlens_q=batch.cu_seqlens_q.to(DEVICE),
            used_kv_lens=batch.used_kv_lens.to(DEVICE), **args,
        )


def quantize_e4m3(x: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantization per token (last dim) or with one scale for the whole tensor:
    (codes, scale) with x ~ codes * scale (scale [...] or [1])."""
    amax = x.float().abs().amax(-1).clamp(min=1e-12)
    if per_tensor:
        scale = (amax.max() / 448.0).reshape(1)
        return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    scale = amax / 448.0
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * (scale if scale.numel() == 1 else scale[..., None])


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("fp8_dot", [False, True])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_fp8_keys(num_splits, fp8_dot, per_tensor):
    """fp8 keys with a per-token or a per-tensor scale select what the oracle selects
    on the same quantized numbers: the dequantized keys, and with ``fp8_dot`` the query
    rows quantized as the kernel does it (scaled to amax 448, cast to e4m3). The kernel
    never reads a per-tensor scale; the oracle applies it."""
    g = gen(1100 + per_tensor)
    batch = make_batch(g, [(200 * SCALE, 6), (60, 60), (500 * SCALE, 1)], page_size=64)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16)
    ik = batch.index_cache(g, DIM, garbage=0.0)
    codes, scale = quantize_e4m3(ik, per_tensor)
    q_rows = iq.float()
    if fp8_dot:
        q_rows = (q_rows * (448.0 / q_rows.abs().amax(-1, keepdim=True))).to(torch.float8_e4m3fn).float()
    k_deq = dequantize(codes, scale)
    tables, cu, kv = (x.to(DEVICE) for x in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    with poisoned_allocations():
        out = _index_topk_launch(
            iq.to(DEVICE), codes.to(DEVICE), tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=6, block_size=64,
            index_k_scale=scale.to(DEVICE), num_splits=num_splits, fp8_dot=fp8_dot,
        )
    ref, scores = dense_oracle(q_rows, k_deq, batch, 6, 64, 1)
    # Hopper's fp8 MMA accumulates with fewer than fp32's mantissa bits.
    check(batch, out, ref, scores, 6, 64, 1, tol=tie_tol(fp8_dot))


KEY_MAJOR_CASES = [
    (page, block, tiles, bm, km, keys)
    for page, block, tiles in ((64, 64, 1), (16, 32, 1), (64, 64, 2))
    for bm in (16, 32, 64)
    for km in (False, True, None)
    for keys in ("bf16", "fp8", "fp8_dot")
] + [(128, 128, 1, 16, None, keys) for keys in ("bf16", "fp8", "fp8_dot")] + [  # the default tiles of block 128
    # fp8 keys with one scale for the cache: no scale read in either orientation
    (page, block, 1, bm, km, keys) for page, block in ((64, 64), (128, 128)) for bm in (16, 64)
    for km in (False, True) for keys in ("fp8_tensor", "fp8_tensor_dot")
]


@pytest.mark.parametrize("page_size,block_size,tiles,block_m,key_major,keys", KEY_MAJOR_CASES)
def test_key_major_scores(page_size, block_size, tiles, block_m, key_major, keys):
    """Both score orientations (K @ Q^T for short row tiles, Q @ K^T otherwise) and the
    default choice (key_major None) select what the oracle selects: decode rows,
    speculative rows and a chunk after a cache; key tiles within one page, over several
    pages, and two tiles per block."""
    g = gen(1300 + block_m + page_size + (7 if key_major else 0))
    # The 4-row sequence straddles a block boundary: its rows cut the same key tile differently.
    seqs = [(9 * block_size + 5, 1), (3 * block_size + 2, 4), (5 * SCALE * block_size + 17, 9), (block_size // 2, 1)]
    batch = make_batch(g, seqs, page_size=page_size)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16)
    if keys.endswith("_dot"):
        # Rows whose in-kernel e4m3 quantization is exact (amax 7, so the scale is 64 and
        # every scaled value an e4m3 number): the oracle then sees the kernel's q whatever
        # rounding the float -> e4m3 cast uses (the interpreter's differs from the GPU's).
        v = (iq.float() * 100).clamp(-440, 440).to(torch.float8_e4m3fn).float()
        v[..., 0] = 448.0
        iq = (v / 64).to(torch.bfloat16)
    # Key tiles inside one block (the key-major form needs that); key_major None with the
    # default tiles: what the launcher picks (block 128: one 128-key tile per block).
    launch = dict(block_m=block_m, key_major=key_major, max_seqlen_q=9)
    if block_size != 128:
        launch["block_k"] = block_size // tiles
    if keys == "bf16":
        ik = batch.index_cache(g, DIM, dtype=torch.bfloat16)
        run_case(batch, iq, ik, topk=5, block_size=block_size, **launch)
        return
    ik = batch.index_cache(g, DIM, garbage=0.0)
    codes, scale = quantize_e4m3(ik, per_tensor=keys.startswith("fp8_tensor"))
    dot = keys.endswith("_dot")
    q_rows = iq.float()
    if dot:
        q_rows = (q_rows * (448.0 / q_rows.abs().amax(-1, keepdim=True))).to(torch.float8_e4m3fn).float()
    tables, cu, kv = (x.to(DEVICE) for x in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    with poisoned_allocations():
        out = _index_topk_launch(
            iq.to(DEVICE), codes.to(DEVICE), tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=5, block_size=block_size,
            index_k_scale=scale.to(DEVICE), fp8_dot=dot, **launch,
        )
    ref, scores = dense_oracle(q_rows, dequantize(codes, scale), batch, 5, block_size, 1)
    check(batch, out, ref, scores, 5, block_size, 1, tol=tie_tol(dot))


@pytest.fixture
def gluon_platform():
    """The device query of the Gluon tests, made when they run: skip with the reason where the
    Gluon kernels cannot run, fail where they should."""
    from m3_sparse.core.gluon import platform_reason

    require_gluon(platform_reason(torch.cuda.current_device()), "the Gluon index kernel")


@pytest.mark.gpu
@pytest.mark.usefixtures("gluon_platform")
@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("keys", ["bf16", "fp8_tensor_dot", "fp8_token_dot"])
@pytest.mark.parametrize("topk,local", [(16, 1), (4, 2), (7, 0)])
def test_gluon_prefill_engine(page_size, keys, topk, local):
    """The Gluon prefill kernel (sm_90) selects what the tl kernel selects, row for row, and
    what the oracle selects up to ties; ragged sequences over shuffled pages, chunked
    prefill, rows before a sequence's first block."""
    g = gen(2000 + page_size + len(keys) + topk)
    batch = make_batch(g, ragged(128), page_size, shuffle=True)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16)
    ik = batch.index_cache(g, DIM, dtype=torch.bfloat16, garbage=float("nan"))
    kw = dict(topk=topk, block_size=128, local_blocks=local, max_seqlen_q=max(batch.q_lens), num_splits=1)
    q_rows, k_ref, tol = iq.float(), ik.float(), TIE_TOL
    if keys != "bf16":
        codes, scale = quantize_e4m3(torch.nan_to_num(ik.float(), nan=0.0), keys == "fp8_tensor_dot")
        ik = torch.where(ik.isnan(), float("nan"), codes.float()).to(torch.float8_e4m3fn)
        kw.update(index_k_scale=scale.to(DEVICE), fp8_dot=True)
        q_rows = (q_rows * (448.0 / q_rows.abs().amax(-1, keepdim=True))).to(torch.float8_e4m3fn).float()
        k_ref, tol = dequantize(codes, scale), tie_tol(True)
    tables, cu, kv = (x.to(DEVICE) for x in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    args = (iq.to(DEVICE), ik.to(DEVICE), tables)
    if keys == "fp8_token_dot" and page_size < 128:
        with pytest.raises(ValueError, match="per-token key scales need pages of at least 128"):
            _index_topk_launch(*args, cu_seqlens_q=cu, used_kv_lens=kv, engine="tma", **kw)
        return
    with poisoned_allocations():
        out = _index_topk_launch(*args, cu_seqlens_q=cu, used_kv_lens=kv, engine="tma", **kw)
    tl_out = _index_topk_launch(*args, cu_seqlens_q=cu, used_kv_lens=kv, engine="triton", **kw)
    assert torch.equal(canon(out.cpu()), canon(tl_out.cpu())), "Gluon and tl kernels select differently"
    ref, scores = dense_oracle(q_rows, k_ref, batch, topk, 128, local)
    check(batch, out, ref, scores, topk, 128, local, tol=tol)


def test_engine_choice_is_checked():
    g = gen(7)
    batch = make_batch(g, [(40, 40)], 16)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16)
    ik = batch.index_cache(g, DIM, dtype=torch.bfloat16)
    tables, cu, kv = (x.to(DEVICE) for x in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    args = (iq.to(DEVICE), ik.to(DEVICE), tables)
    with pytest.raises(ValueError, match="engine: one of"):
        _index_topk_launch(*args, cu_seqlens_q=cu, used_kv_lens=kv, topk=4, block_size=16, engine="cuda")
    # Blocks of 16 keys: never the Gluon kernel's, so demanding it names the reason.
    with pytest.raises(ValueError, match=r"engine='tma'.*blocks of 128 keys"):
        _index_topk_launch(*args, cu_seqlens_q=cu, used_kv_lens=kv, topk=4, block_size=16, engine="tma")
    # Per-token fp8 scales that do not start on a 16-byte boundary cannot be TMA boxes.
    g = gen(8)
    batch = make_batch(g, [(300, 300)], 128)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16).to(DEVICE)
    codes, scale = quantize_e4m3(batch.index_cache(g, DIM, dtype=torch.bfloat16).float())
    shifted = torch.empty(scale.numel() + 1, device=DEVICE)[1:].view_as(scale)
    shifted.copy_(scale.to(DEVICE))
    tables, cu, kv = (x.to(DEVICE) for x in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    with pytest.raises(ValueError, match=r"engine='tma'.*16-byte aligned start"):
        _index_topk_launch(iq, codes.to(DEVICE), tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=16, block_size=128,
                           index_k_scale=shifted, fp8_dot=True, num_splits=1, engine="tma")


@pytest.mark.gpu
@pytest.mark.usefixtures("gluon_platform")
@pytest.mark.parametrize("keys,expect_gluon", [("bf16", False), ("fp8_tensor_dot", True), ("fp8_token_dot", False)])
def test_auto_engine_takes_gluon_where_faster(monkeypatch, keys, expect_gluon):
    """engine='auto' runs the Gluon kernel only for fp8 keys with one scale (where it
    measured faster); the selections are the tl kernel's either way."""
    from m3_sparse.index import topk_gluon_sm90 as gi

    calls = []
    real = gi.index_topk_tma
    monkeypatch.setattr(gi, "index_topk_tma", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = gen(31)
    batch = make_batch(g, [(700, 700), (300, 900)], 128, shuffle=True)
    iq = randn(g, batch.num_tokens, HEADS, DIM, dtype=torch.bfloat16).to(DEVICE)
    ik = batch.index_cache(g, DIM, dtype=torch.bfloat16)
    kw = dict(topk=16, block_size=128, max_seqlen_q=max(batch.q_lens), num_splits=1)
    if keys != "bf16":
        codes, scale = quantize_e4m3(ik.float(), keys == "fp8_tensor_dot")
        ik = codes.to(torch.float8_e4m3fn)
        kw.update(index_k_scale=scale.to(DEVICE), fp8_dot=True)
    tables, cu, kv = (x.to(DEVICE) for x in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    out = _index_topk_launch(iq, ik.to(DEVICE), tables, cu_seqlens_q=cu, used_kv_lens=kv, engine="auto", **kw)
    assert bool(calls) == expect_gluon
    tl_out = _index_topk_launch(iq, ik.to(DEVICE), tables, cu_seqlens_q=cu, used_kv_lens=kv, engine="triton", **kw)
    assert torch.equal(canon(out.cpu()), canon(tl_out.cpu()))
