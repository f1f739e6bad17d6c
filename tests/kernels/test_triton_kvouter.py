"""Triton KV-outer stages (partials, combine, composed) against the torch stages and the
float64 oracle, on fresh random inputs.

Without a CUDA device the kernels run in Triton's interpreter at tiny shapes; with one
they run natively, plus larger shapes (page sizes 64/128, D = 128, G up to 16, and a
partial buffer past 2^31 elements).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton picks the interpreter when a kernel is decorated, so this must precede the
    # first import of the kernel modules; kernels decorated earlier are re-decorated below.
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
    require_gluon,
)
from m3_sparse import api  # noqa: E402
from m3_sparse.kvouter.plan import KVOuterConfig  # noqa: E402
from m3_sparse.reference import sparse_attention_ref  # noqa: E402


tcomb = kernel_module("m3_sparse.kvouter.combine_triton")
tkv = kernel_module("m3_sparse.kvouter.partials_triton")
from m3_sparse.kvouter import plan as kplan  # noqa: E402

DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
LSE_TOL = TOLERANCES[torch.float32]
HEADS_BIG = [(8, 8), (16, 4), (32, 4), (64, 4)]


def _to(dev, *xs):
    return [x.to(dev) for x in xs]


def _setup(seed, seqs, page_size, block_size, hq, hkv, d, topk, dtype, causal, **sel_kwargs):
    g = gen(seed)
    batch = make_batch(g, seqs, page_size)
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k = batch.kv_cache(g, hkv, d, dtype)
    v = batch.kv_cache(g, hkv, d, dtype)
    sel = random_selection(g, batch, hkv, topk, block_size, causal=causal, **sel_kwargs)
    return batch, q, k, v, sel


def _device_batch(batch):
    return {
        "cu_seqlens_q": batch.cu_seqlens_q.to(DEVICE),
        "used_kv_lens": batch.used_kv_lens.to(DEVICE),
    }


def partials_gpu(*args, engine="auto", **kw):
    """The partials stage on the kernels (the interpreter on the CPU), ``engine`` as asked."""
    return api.kvouter_partials_gpu(*args, **kw, config=KVOuterConfig(engine=engine))


def kvouter_triton(*args, tile_q=None, num_programs=None, **kw):
    """``kvouter_attention`` pinned to the Triton stages, with the schedule's shape given."""
    return m3_sparse.kvouter_attention(
        *args, **kw, config=KVOuterConfig(impl="triton", tile_q=tile_q, num_programs=num_programs)
    )


def _run_partials(batch, q, k, v, sel, block_size, causal, scale, tile_q, num_programs, engine="auto", **tl):
    q, k, v, sel, bt = _to(DEVICE, q, k, v, sel, batch.block_tables)
    kw = _device_batch(batch)
    max_blocks = -(-batch.capacity // block_size)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=kw["cu_seqlens_q"], max_blocks=max_blocks)
    sched = m3_sparse.schedule(index, tile_q=tile_q, num_programs=num_programs)
    with poisoned_allocations():
        got = api.kvouter_partials_gpu(
            q, k, v, index, sched, bt, **kw, softmax_scale=scale, causal=causal, block_size=block_size,
            config=KVOuterConfig(engine=engine, **tl),
        )
    ref = m3_sparse.kvouter_partials(q, k, v, index, bt, **kw, softmax_scale=scale, causal=causal, block_size=block_size)
    return index, got, ref


def _check_partials(index, got, ref, dtype):
    po, pm, pl = got
    ro, rm, rl = ref
    assert po.shape == ro.shape and po.dtype == ro.dtype
    assert pm.shape == rm.shape and pm.dtype == torch.float32 and pl.dtype == torch.float32
    for name, x in (("partial_o", po), ("partial_m", pm), ("partial_l", pl)):
        bad = is_poisoned(x)
        assert not bad.any(), f"{name}: {int(bad.sum())} elements never written, first {torch.nonzero(bad)[0].tolist()}"
    used = int(index.seg_offsets[-1])
    assert torch.all(pm[used:] == float("-inf")) and torch.all(pl[used:] == 0) and torch.all(po[used:] == 0)
    # Rows that saw no key: exactly the oracle's.
    assert torch.equal(pm[:used] == float("-inf"), rm[:used] == float("-inf"))
    assert torch.all(pl[:used][rm[:used] == float("-inf")] == 0)
    assert_close("partial_m", rm[:used], pm[:used], LSE_TOL)
    assert_close("partial_l", rl[:used], pl[:used], LSE_TOL * 10)
    assert_close("partial_o", ro[:used], po[:used], TOLERANCES[dtype])


# --------------------------------------------------------------------------- partials

PARTIAL_CASES = [
    # hq, hkv, page, block, dtype, causal, tile_q, num_programs
    (2, 2, 16, 16, torch.float32, True, None, 3),
    (8, 2, 16, 32, torch.bfloat16, True, None, 2),
    (8, 1, 32, 16, torch.float32, False, 2, 5),
    (16, 1, 16, 16, torch.bfloat16, True, 1, 1),
    (16, 1, 32, 32, torch.float16, False, None, 4),
    (6, 2, 16, 32, torch.float32, True, 3, 7),
]


@pytest.mark.parametrize("hq,hkv,page_size,block_size,dtype,causal,tile_q,num_programs", PARTIAL_CASES)
def test_partials_match_torch(hq, hkv, page_size, block_size, dtype, causal, tile_q, num_programs):
    seed = hq * 100 + page_size + block_size
    # Ragged: one sequence shorter than a block, one exactly a block, several blocks.
    seqs = [(block_size // 2 + 1, 5), (block_size, block_size // 2), (3 * block_size + 3, 6)]
    batch, q, k, v, sel = _setup(seed, seqs, page_size, block_size, hq, hkv, 16, 4, dtype, causal)
    tile_q = tile_q or kplan.default_tile_q(hq // hkv)
    index, got, ref = _run_partials(batch, q, k, v, sel, block_size, causal, 0.3, tile_q, num_programs)
    assert int(index.seg_offsets[-1]) < index.capacity, "test setup: want unused entries"
    _check_partials(index, got, ref, dtype)


def test_partials_all_slots_empty():
    """No live entry at all: every row is the unused tail and must still be written."""
    g = gen(5)
    batch = make_batch(g, [(20, 3)], 16)
    q = randn(g, 3, 4, 16)
    k, v = batch.kv_cache(g, 1, 16), batch.kv_cache(g, 1, 16)
    sel = torch.full((3, 1, 2), -1, dtype=torch.int32)
    index, got, ref = _run_partials(batch, q, k, v, sel, 16, True, 0.25, 4, 3)
    assert int(index.seg_offsets[-1]) == 0
    _check_partials(index, got, ref, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", HEADS_BIG)
@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_partials_match_torch_cuda(hq, hkv, page_size, causal):
    seqs = [(1000, 300), (77, 77), (129, 1), (640, 128)]
    batch, q, k, v, sel = _setup(hq + page_size, seqs, page_size, 128, hq, hkv, 128, 16, torch.bfloat16, causal)
    index, got, ref = _run_partials(
        batch, q, k, v, sel, 128, causal, 128**-0.5, kplan.default_tile_q(hq // hkv), 132
    )
    _check_partials(index, got, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size,page_size", [(64, 64), (64, 128), (128, 64), (32, 16)])
def test_partials_block_sizes_cuda(block_size, page_size):
    seqs = [(500, 200), (33, 33), (300, 17)]
    batch, q, k, v, sel = _setup(7 + block_size, seqs, page_size, block_size, 32, 2, 128, 8, torch.float16, True)
    index, got, ref = _run_partials(batch, q, k, v, sel, block_size, True, 0.1, 8, 50)
    _check_partials(index, got, ref, torch.float16)


RESIDENT_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from m3_sparse.kvouter import partials_triton as tkv
from m3_sparse.kvouter import plan as kplan

k = tkv._kvouter_partials_kernel
cx = dict(G=16, GP=16, TQ=4, D=128, BD=128, BS=128, PS=64, CAUSAL=True, PREC=None,
          FILL=64, Q_FP8=False, KV_FP8=False, WIDEN_K=False,
          PV_DT=triton.language.bfloat16, NORM=False)
names = list(k.arg_names)
ptrs = {n for n in names if n.endswith("_ptr")}
types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "po_ptr": "*bf16", "pm_ptr": "*fp32",
         "pl_ptr": "*fp32", "scale_ptr": "*fp32"}
sig = {n: "constexpr" if n in cx else types.get(n, "*i32") if n in ptrs else "fp32" if n == "qk_scale" else "i32"
       for n in names}
# The launcher's strides at M3 shapes are multiples of 16, which Triton's runtime specializes on.
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptrs or n.startswith("stride")}
src = ASTSource(k, sig, {(names.index(a),): v for a, v in cx.items()}, attrs)
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": int(sys.argv[2])})
print("RESULT " + json.dumps({"ttgir": c.asm["ttgir"]}))
"""


def _region(lines, start):
    """Lines of the op opened at ``lines[start]``: until the first line indented no deeper,
    past the ``} do {`` (and block label) between a while loop's two regions."""
    depth = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (
        len(lines[end]) - len(lines[end].lstrip()) > depth or lines[end].lstrip().startswith(("} do", "^bb"))
    ):
        end += 1
    return lines[start:end]


@pytest.mark.parametrize("num_stages", [1, 2])
def test_resident_loop_keeps_kv_out_of_the_inner_loop(num_stages):
    """The resident loop's point: a run's K^T and V go to shared memory once, outside the loop
    over its query tiles. A change that moves a K/V copy back into the loop (a transpose at
    the dot did, under the software pipeliner) still gives correct results, so only the
    compiled IR (sm_90, the launcher's M3 config and a pipelined one) shows it."""
    from kernel_test_utils import aot_compile

    lines = aot_compile(RESIDENT_SCRIPT, str(num_stages))["ttgir"].splitlines()
    w = next(i for i, x in enumerate(lines) if "scf.while" in x)
    body = _region(lines, w)
    f = next(i for i, x in enumerate(body) if "scf.for" in x)
    inner = _region(body, f)
    kv_copies = [x for x in body[:f] if "ttg.local_alloc %" in x and "tensor<128x128x" in x]
    assert len(kv_copies) == 2, "expected K^T and V copied to shared memory once per run:\n" + "\n".join(kv_copies)
    in_loop = [x for x in inner if "ttg.local_alloc %" in x and "tensor<128x128x" in x]
    assert not in_loop, "a K/V shared-memory copy inside the loop over query tiles:\n" + "\n".join(in_loop)


# --------------------------------------------------------------------------- combine


def _random_partials(g, num_tokens, hkv, group, topk, d, dtype):
    entries = num_tokens * hkv * topk
    po = randn(g, entries, group, d, dtype=dtype)
    pm = randn(g, entries, group) * 3
    pl = torch.rand(entries, group, generator=g) * 4 + 1.0
    empty = torch.rand(entries, group, generator=g) < 0.1  # partials that saw no key
    pm = pm.masked_fill(empty, float("-inf"))
    pl = pl.masked_fill(empty, 0.0)
    po = po.masked_fill(empty[..., None], 0)
    slot_of = torch.randperm(entries, generator=g).view(num_tokens, hkv, topk).to(torch.int32)
    slot_of = slot_of.masked_fill(torch.rand(slot_of.shape, generator=g) < 0.25, -1)
    slot_of[0] = -1  # a row with no partial at all
    slot_of[1, :, 1:] = -1  # a row whose only partial saw no key
    e = slot_of[1, :, 0].long()
    pm[e], pl[e], po[e] = float("-inf"), 0.0, 0
    return po, pm, pl, slot_of


COMBINE_CASES = [
    # hkv, group, topk, d, dtype
    (2, 1, 4, 16, torch.float32),
    (1, 4, 8, 16, torch.bfloat16),
    (2, 8, 16, 8, torch.float16),
    (1, 16, 16, 32, torch.bfloat16),
    (3, 2, 3, 16, torch.float32),
    (2, 12, 5, 16, torch.float32),  # one token per program, padded head rows
]


@pytest.mark.parametrize("hkv,group,topk,d,dtype", COMBINE_CASES)
@pytest.mark.parametrize("return_lse", [True, False])
def test_combine_matches_torch(hkv, group, topk, d, dtype, return_lse):
    g = gen(31 + topk + group)
    num_tokens = 37
    po, pm, pl, slot_of = _to(DEVICE, *_random_partials(g, num_tokens, hkv, group, topk, d, dtype))
    with poisoned_allocations():
        out, lse = tcomb.combine_triton(po, pm, pl, slot_of, out_dtype=dtype, return_lse=return_lse)
    ref_out, ref_lse = m3_sparse.combine(po, pm, pl, slot_of, out_dtype=dtype, return_lse=True)
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert not is_poisoned(out).any()
    assert torch.all(out[0] == 0)
    assert_close("combine out", ref_out.float(), out.float(), TOLERANCES[dtype])
    if return_lse:
        assert lse.dtype == torch.float32 and not is_poisoned(lse).any()
        assert torch.all(lse[:, 0] == float("-inf")) and torch.all(lse[:, 1] == float("-inf"))
        assert_close("combine lse", ref_lse, lse, LSE_TOL)
    else:
        assert lse is None


@pytest.mark.gpu
@pytest.mark.parametrize("group,topk", [(1, 4), (4, 8), (8, 16), (16, 16), (16, 32)])
def test_combine_matches_torch_cuda(group, topk):
    g = gen(90 + group + topk)
    po, pm, pl, slot_of = _to(DEVICE, *_random_partials(g, 3001, 4, group, topk, 128, torch.bfloat16))
    with poisoned_allocations():
        out, lse = tcomb.combine_triton(po, pm, pl, slot_of, out_dtype=torch.bfloat16, return_lse=True)
    ref_out, ref_lse = m3_sparse.combine(po, pm, pl, slot_of, out_dtype=torch.bfloat16, return_lse=True)
    assert not is_poisoned(out).any() and not is_poisoned(lse).any()
    assert_close("combine out", ref_out.float(), out.float(), TOLERANCES[torch.bfloat16])
    assert_close("combine lse", ref_lse, lse, LSE_TOL)


# --------------------------------------------------------------------------- composed

COMPOSED_CASES = [
    # seqs, page, block, hq, hkv, topk, dtype, causal
    ([(40, 6), (9, 9), (100, 3)], 16, 32, 8, 2, 4, torch.float32, True),
    ([(70, 5), (16, 16)], 32, 16, 16, 1, 8, torch.bfloat16, True),
    ([(130, 4), (5, 5)], 16, 16, 4, 4, 16, torch.float32, False),
    ([(1, 1), (33, 1), (200, 3)], 16, 16, 6, 2, 4, torch.float16, True),  # decode-like
]


@pytest.mark.parametrize("seqs,page_size,block_size,hq,hkv,topk,dtype,causal", COMPOSED_CASES)
def test_composed_matches_reference(seqs, page_size, block_size, hq, hkv, topk, dtype, causal):
    batch, q, k, v, sel = _setup(len(seqs) + topk + hq, seqs, page_size, block_size, hq, hkv, 16, topk, dtype, causal)
    qd, kd, vd, seld, bt = _to(DEVICE, q, k, v, sel, batch.block_tables)
    with poisoned_allocations():
        out, lse = kvouter_triton(
            qd, kd, vd, seld, bt, **_device_batch(batch), causal=causal, block_size=block_size, return_lse=True,
            num_programs=3,
        )
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hq, batch.num_tokens)
    ref_out, ref_lse = sparse_attention_ref(
        q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, causal, block_size
    )
    assert_close("out", ref_out, out, TOLERANCES[dtype])
    assert_close("lse", ref_lse, lse, LSE_TOL)


def test_composed_repeated_ids_and_empty_rows():
    """Every slot repeating the first id reads that block once: bitwise the result of the
    single slot, and the oracle's; rows that select nothing are zeros with lse -inf."""
    seqs = [(90, 4), (20, 3)]
    batch, q, k, v, sel = _setup(63, seqs, 16, 16, 4, 2, 16, 4, torch.float32, True, empty_frac=0.0, dup_frac=0.0)
    rep = sel.clone()
    rep[..., 1:] = sel[..., :1]
    rep[0] = -1  # token 0 sees nothing on both heads
    rep[5, 1] = -1
    single = rep.clone()
    single[..., 1:] = -1
    outs = []
    for s in (rep, single):
        qd, kd, vd, sd, bt = _to(DEVICE, q, k, v, s, batch.block_tables)
        outs.append(kvouter_triton(qd, kd, vd, sd, bt, **_device_batch(batch), block_size=16, return_lse=True))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    out, lse = outs[0]
    ref = sparse_attention_ref(q, k, v, single, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, True, 16)
    assert_close("out", ref[0], out, TOLERANCES[torch.float32])
    assert_close("lse", ref[1], lse, LSE_TOL)
    assert torch.all(out[0] == 0) and torch.all(lse[:, 0] == float("-inf"))
    assert torch.all(out[5, 2:] == 0) and torch.all(lse[2:, 5] == float("-inf"))


@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
def test_block_table_padding_is_never_read(pad):
    g = gen(80)
    batch = make_batch(g, [(40, 3), (100, 2), (16, 16)], 16, extra_cols=6, pad=pad)
    q = randn(g, batch.num_tokens, 4, 16)
    k, v = batch.kv_cache(g, 2, 16), batch.kv_cache(g, 2, 16)
    sel = random_selection(g, batch, 2, 3, 32, empty_frac=0.0, dup_frac=0.0)
    qd, kd, vd, sd, bt = _to(DEVICE, q, k, v, sel, batch.block_tables)
    out, lse = kvouter_triton(qd, kd, vd, sd, bt, **_device_batch(batch), block_size=32, return_lse=True)
    ref = sparse_attention_ref(q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, None, True, 32)
    assert_close("out", ref[0], out, 1e-5)
    assert_close("lse", ref[1], lse, 1e-5)


def test_rejects_unsupported_block_size():
    g = gen(1)
    batch = make_batch(g, [(50, 2)], 16)
    q = randn(g, 2, 2, 16)
    k, v = batch.kv_cache(g, 1, 16), batch.kv_cache(g, 1, 16)
    sel = torch.zeros(2, 1, 1, dtype=torch.int32)
    qd, kd, vd, sd, bt = _to(DEVICE, q, k, v, sel, batch.block_tables)
    with pytest.raises(ValueError, match="block_size"):
        kvouter_triton(qd, kd, vd, sd, bt, **_device_batch(batch), block_size=48)


# --------------------------------------------------------------------------- TMA engine (sm_90)

gkv = kernel_module("m3_sparse.kvouter.partials_gluon_sm90")


def _reason(hq=64, hkv=4, d=128, page=128, block=128, dtype=torch.bfloat16, kv_dtype=None, tile_q=4, pages=2, **kw):
    q = torch.empty(3, hq, d, dtype=dtype)
    if kw.get("strided") == "q head dim":
        q = torch.empty(3, hq, 2 * d, dtype=dtype)[..., ::2]
    k = torch.empty(pages, hkv, page, d, dtype=kv_dtype or dtype)
    if kw.get("strided") == "caches":
        k = torch.empty(pages, hkv, page, 2 * d, dtype=kv_dtype or dtype)[..., :d]
    return gkv.unsupported_reason(
        q, k, k, block, kw.get("out_dtype"), kw.get("scales"), tile_q, kw.get("rows", 10), kw.get("partial_dtype")
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dtype=torch.float32), "all bf16, all fp16 or all float8_e4m3fn"),
        (dict(kv_dtype=torch.float16), "got torch.bfloat16 / torch.float16 / torch.float16"),
        (dict(dtype=torch.float8_e4m3fn, kv_dtype=torch.bfloat16, scales=1), "or a bf16 / fp16 q over float8_e4m3fn"),
        (dict(kv_dtype=torch.float8_e4m3fn), "fp8 K and V need their scales"),
        (dict(kv_dtype=torch.float8_e4m3fn, scales=1, out_dtype=torch.float32), "partials in q's dtype"),
        (dict(out_dtype=torch.float32), "q's dtype"),
        (dict(dtype=torch.float8_e4m3fn), "fp8 inputs need their scales"),
        (dict(dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16), "fp8 inputs need their scales"),
        (dict(scales=1), "no fp8 scales"),
        (dict(dtype=torch.float8_e4m3fn, scales=1, out_dtype=torch.float8_e4m3fn), "a bf16 or fp16 output"),
        (dict(partial_dtype=torch.float8_e4m3fn), "float8_e4m3fn partials need float8_e4m3fn K and V"),
        (dict(hq=16), "GQA group in \\[8, 64\\], got 4"),
        (dict(hq=48, hkv=4), "got 12"),
        (dict(tile_q=8), "at most 4 tokens"),
        (dict(d=96), "head dim"),
        (dict(page=8), "page 8"),
        (dict(block=256), "block 256"),
        (dict(block=32, page=32), "block 32"),
        (dict(pages=0), "empty page pool"),
        (dict(strided="q head dim"), "q with a contiguous head dim \\(stride 1\\), got stride 2"),
        (dict(strided="caches"), "contiguous caches"),
        (dict(rows=2**31), "2\\^31 rows"),
    ],
)
def test_tma_engine_says_why_it_does_not_apply(kw, match):
    why = _reason(**kw)
    assert why is not None and re.search(match, why), why


def test_tma_engine_errors_name_the_reason():
    g = gen(11)
    batch = make_batch(g, [(40, 5)], 16)
    q = randn(g, 5, 8, 16)
    k, v = batch.kv_cache(g, 1, 16), batch.kv_cache(g, 1, 16)
    sel = random_selection(g, batch, 1, 2, 16)
    with pytest.raises(ValueError, match="engine='tma': needs q, K and V all bf16"):
        _run_partials(batch, q, k, v, sel, 16, True, 0.3, 4, 2, engine="tma")
    with pytest.raises(ValueError, match="engine: one of"):
        _run_partials(batch, q, k, v, sel, 16, True, 0.3, 4, 2, engine="cuda")
    with pytest.raises(ValueError, match="engine='tma': num_warps / num_stages / maxnreg"):
        _run_partials(batch, q.bfloat16(), k.bfloat16(), v.bfloat16(), sel, 16, True, 0.3, 4, 2, num_stages=1, engine="tma")
    if not HAS_CUDA:
        batch = make_batch(g, [(140, 5)], 16)
        q, k, v = randn(g, 5, 8, 64, dtype=torch.bfloat16), batch.kv_cache(g, 1, 64, torch.bfloat16), batch.kv_cache(g, 1, 64, torch.bfloat16)
        sel = random_selection(g, batch, 1, 2, 64)
        with pytest.raises(ValueError, match="engine='tma': (needs a CUDA device|written for Triton)"):
            _run_partials(batch, q, k, v, sel, 64, True, 0.3, 8, 2, engine="tma")


def _m3_shape_reason():
    q = torch.empty(3, 64, 128, dtype=torch.bfloat16, device=DEVICE)
    k = torch.empty(2, 4, 128, 128, dtype=torch.bfloat16, device=DEVICE)
    return gkv.unsupported_reason(q, k, k, 128, None, None, 4, 10)


@pytest.fixture
def tma_partials():
    """The TMA tests below run on sm_90 with the Triton the kernel is written for: they skip
    elsewhere (the tl kernel's tests above still run) and fail there if it refuses M3's shape."""
    require_gluon(_m3_shape_reason(), "the TMA partials kernel at M3's shape")


@pytest.mark.gpu
@pytest.mark.usefixtures("tma_partials")
def test_auto_engine_runs_the_tma_kernel(monkeypatch):
    """The default engine ("auto") on the M3 shape launches the TMA kernel; on G = 4
    the tl kernel, both right against the torch stage."""
    assert kplan.DEFAULT_CONFIG.engine == "auto"
    calls = []
    real = gkv.kvouter_partials_tma
    monkeypatch.setattr(gkv, "kvouter_partials_tma", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for hq, want in ((64, 1), (16, 0)):
        g = gen(hq)
        batch = make_batch(g, [(700, 300), (90, 90)], 128)
        q = randn(g, batch.num_tokens, hq, 128, dtype=torch.bfloat16)
        k, v = batch.kv_cache(g, 4, 128, torch.bfloat16), batch.kv_cache(g, 4, 128, torch.bfloat16)
        sel = random_selection(g, batch, 4, 16, 128)
        calls.clear()
        index, got, ref = _run_partials(batch, q, k, v, sel, 128, True, 0.088, kplan.default_tile_q(hq // 4), 132)
        assert len(calls) == want
        _check_partials(index, got, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.usefixtures("tma_partials")
def test_partials_tma_int64_metadata():
    """int64 block tables, lengths and offsets (the public ops accept them)."""
    g = gen(64)
    batch = make_batch(g, [(1000, 300), (300, 400), (77, 77)], 64)
    q = randn(g, batch.num_tokens, 64, 128, dtype=torch.bfloat16)
    k, v = batch.kv_cache(g, 4, 128, torch.bfloat16), batch.kv_cache(g, 4, 128, torch.bfloat16)
    sel = random_selection(g, batch, 4, 16, 128, causal=False)
    batch.block_tables = batch.block_tables.long()
    batch.cu_seqlens_q = batch.cu_seqlens_q.long()
    batch.used_kv_lens = batch.used_kv_lens.long()
    index, got, ref = _run_partials(batch, q, k, v, sel, 128, False, 0.088, 4, 132, engine="tma")
    _check_partials(index, got, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.usefixtures("tma_partials")
def test_partials_tma_take_a_transposed_q():
    """A model's batch-1 q is a view of [Hq, T, D] as [T, Hq, D]: the default engine runs the
    TMA kernel on it (its wrapper copies q for the descriptor), right against the torch stage."""
    g = gen(65)
    batch = make_batch(g, [(1000, 300)], 128)
    q = randn(g, 64, batch.num_tokens, 128, dtype=torch.bfloat16).to(DEVICE).transpose(0, 1)
    assert not q.is_contiguous()
    k, v = batch.kv_cache(g, 4, 128, torch.bfloat16), batch.kv_cache(g, 4, 128, torch.bfloat16)
    sel = random_selection(g, batch, 4, 16, 128)
    index, got, ref = _run_partials(batch, q, k, v, sel, 128, True, 0.088, 4, 132, engine="tma")
    _check_partials(index, got, ref, torch.bfloat16)


TMA_CASES = [
    # hq, hkv, d, page, block, dtype, causal, tile_q (None: the most), num_programs
    (64, 4, 128, 128, 128, torch.bfloat16, True, None, 132),
    (64, 4, 128, 64, 128, torch.bfloat16, True, None, 528),
    (64, 4, 128, 128, 64, torch.bfloat16, False, None, 7),
    (32, 4, 128, 64, 64, torch.float16, True, None, 1),
    (16, 2, 128, 128, 128, torch.bfloat16, True, 3, 50),
    (64, 2, 64, 32, 128, torch.float16, False, None, 132),
    (64, 1, 128, 16, 64, torch.bfloat16, True, None, 33),
    (64, 4, 128, 128, 128, torch.bfloat16, True, 1, 132),
]


@pytest.mark.gpu
@pytest.mark.usefixtures("tma_partials")
@pytest.mark.parametrize("hq,hkv,d,page_size,block_size,dtype,causal,tile_q,num_programs", TMA_CASES)
@pytest.mark.parametrize("garbage", [1.0e3, float("nan")])
def test_partials_tma_match_torch_cuda(hq, hkv, d, page_size, block_size, dtype, causal, tile_q, num_programs, garbage):
    """Ragged sequences (shorter than a block, partial last blocks), -1 slots and
    duplicates, poisoned outputs; NaN in unwritten cache slots must not leak through
    the zero-weight keys of a partial block."""
    g = gen(hq + d + page_size + block_size)
    # (300, 400): 100 rows before the sequence's first key, over full blocks (non-causal too).
    seqs = [(1000, 300), (77, 77), (block_size + 1, 1), (640, 128), (block_size // 2, 9), (300, 400)]
    batch = make_batch(g, seqs, page_size)
    q = randn(g, batch.num_tokens, hq, d, dtype=dtype)
    k = batch.kv_cache(g, hkv, d, dtype, garbage=garbage)
    v = batch.kv_cache(g, hkv, d, dtype, garbage=garbage)
    sel = random_selection(g, batch, hkv, 16, block_size, causal=causal)
    tile_q = tile_q or 64 // (hq // hkv)
    index, got, ref = _run_partials(
        batch, q, k, v, sel, block_size, causal, d**-0.5, tile_q, num_programs, engine="tma"
    )
    assert int(index.seg_offsets[-1]) < index.capacity, "test setup: want unused entries"
    _check_partials(index, got, ref, dtype)


@pytest.mark.gpu
@pytest.mark.usefixtures("tma_partials")
@pytest.mark.parametrize("tile_q,num_programs", [(4, 132), (3, 7), (1, 528)])
def test_partials_tma_split_hot_blocks_match_torch_cuda(tile_q, num_programs):
    """Every query of a long sequence selects its first block, and every query of a second one
    that sequence's block 2: the scheduler cuts those heavy segments into many tiles spread
    over programs, each tile's end read from ``tile_end`` (the Triton kernel the CPU runs
    recomputes it, so only this GPU test sees the Gluon kernel read it)."""
    g = gen(tile_q + num_programs)
    batch = make_batch(g, [(2048, 2048), (900, 700)], 128)
    q = randn(g, batch.num_tokens, 64, 128, dtype=torch.bfloat16)
    k, v = batch.kv_cache(g, 4, 128, torch.bfloat16), batch.kv_cache(g, 4, 128, torch.bfloat16)
    sel = random_selection(g, batch, 4, 16, 128)
    sel[:2048, :, 0] = 0
    sel[2048 + 300:, :, 1] = 2  # rows at positions 500 and on: past block 2 (keys 256-383)
    index, got, ref = _run_partials(batch, q, k, v, sel, 128, True, 0.088, tile_q, num_programs, engine="tma")
    sched = m3_sparse.schedule(index, tile_q=tile_q, num_programs=num_programs)
    seg = sched.tile_segment[: int(sched.num_tiles[0])].cpu()
    tiles_per_segment = torch.bincount(seg.long())
    assert int(tiles_per_segment.max()) >= 2048 // tile_q // 2, "test setup: want a segment cut into many tiles"
    starts = sched.program_tiles.cpu()
    hot = int(tiles_per_segment.argmax())
    owners = {int(torch.searchsorted(starts, t, right=True)) - 1 for t in torch.nonzero(seg == hot).flatten().tolist()}
    # With many programs the hot segment's tiles go to several of them (with 7, to one: 683 tiles
    # in a row, each ended by its own tile_end).
    if num_programs >= 132:
        assert len(owners) > 1, "test setup: the hot segment's tiles all went to one program"
    _check_partials(index, got, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.usefixtures("tma_partials")
@pytest.mark.parametrize("d,page_size,block_size,out_dtype", [(128, 128, 128, torch.bfloat16), (64, 64, 128, torch.float16)])
@pytest.mark.parametrize("causal", [True, False])
def test_partials_tma_fp8_match_torch_cuda(d, page_size, block_size, out_dtype, causal):
    """e4m3 q/K/V with per-tensor scales: the fp8 MMA for Q K^T, V widened in shared memory,
    P @ V and the partials in ``out_dtype``; the torch stage does the same roundings."""
    fp8 = torch.float8_e4m3fn
    g = gen(d + page_size + int(causal))
    seqs = [(900, 260), (block_size + 1, 1), (block_size // 2, 9)]
    batch = make_batch(g, seqs, page_size)
    q = randn(g, batch.num_tokens, 64, d)
    k = batch.kv_cache(g, 4, d, garbage=float("nan"))
    v = batch.kv_cache(g, 4, d, garbage=float("nan"))
    sel = random_selection(g, batch, 4, 16, block_size, causal=causal)
    scales = torch.tensor([0.011, 0.009, 0.013], device=DEVICE)
    q8, k8, v8 = ((x / float(s_)).clamp(-448, 448).to(fp8) for x, s_ in zip((q, k, v), scales.tolist()))
    q8, k8, v8, sel, bt = _to(DEVICE, q8, k8, v8, sel, batch.block_tables)
    kw = _device_batch(batch)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=kw["cu_seqlens_q"], max_blocks=bt.shape[1] * page_size // block_size)
    sched = m3_sparse.schedule(index, tile_q=4, num_programs=132)
    args = (q8, k8, v8, index)
    common = dict(**kw, softmax_scale=d**-0.5, causal=causal, block_size=block_size, scales=scales, out_dtype=out_dtype)
    with poisoned_allocations():
        got = partials_gpu(*args, sched, bt, **common, engine="tma")
    ref = m3_sparse.kvouter_partials(*args, bt, **common)
    same_mma = partials_gpu(*args, sched, bt, **common, engine="triton")
    po, pm, pl = got
    used = int(index.seg_offsets[-1])
    for name, x in (("partial_o", po), ("partial_m", pm), ("partial_l", pl)):
        assert not is_poisoned(x).any(), name
    assert po.dtype == out_dtype
    assert torch.equal(pm[:used] == float("-inf"), ref[1][:used] == float("-inf"))
    # Hopper's fp8 MMA adds into an accumulator narrower than fp32: against exact scores the
    # row maxima (scores of ~2, sums of 128 products of ~1e4) are off by ~1.2e-4 relative RMS
    # at D = 128; a scale or mask error is off by 1e-2 or more. The tl kernel runs the
    # same MMA, so against it the bound is fp32 reordering.
    assert_close("partial_m", ref[1][:used], pm[:used], 5e-4)
    assert_close("partial_l", ref[2][:used], pl[:used], 2e-3)
    assert_close("partial_o", ref[0][:used], po[:used], 2 * TOLERANCES[out_dtype])
    assert_close("partial_m vs tl kernel", same_mma[1][:used], pm[:used], 1e-6)
    assert_close("partial_l vs tl kernel", same_mma[2][:used], pl[:used], 1e-5)
    assert_close("partial_o vs tl kernel", same_mma[0][:used], po[:used], TOLERANCES[out_dtype])
    assert torch.all(po[used:] == 0) and torch.all(pm[used:] == float("-inf")) and torch.all(pl[used:] == 0)


@pytest.mark.gpu
@pytest.mark.usefixtures("tma_partials")
@pytest.mark.parametrize(
    "dtype,d,page_size,partial_dtype",
    [
        (torch.bfloat16, 128, 128, None),
        (torch.bfloat16, 128, 64, torch.float8_e4m3fn),
        (torch.float16, 64, 32, None),
        (torch.float16, 128, 128, torch.float8_e4m3fn),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_partials_tma_float_q_over_fp8_caches(dtype, d, page_size, partial_dtype, causal):
    """A model's q over fp8 pages: K and V widened in shared memory (both fp8 blocks land
    in V's buffer), Q K^T in q's dtype; against the torch stage and the tl kernel, which
    widens K the same way. NaN in unwritten slots, poisoned outputs."""
    fp8 = torch.float8_e4m3fn
    g = gen(3 * d + page_size + int(causal))
    seqs = [(900, 260), (129, 1), (64, 9), (300, 400)]
    batch = make_batch(g, seqs, page_size)
    q = randn(g, batch.num_tokens, 64, d, dtype=dtype)
    k = batch.kv_cache(g, 4, d, garbage=float("nan"))
    v = batch.kv_cache(g, 4, d, garbage=float("nan"))
    sel = random_selection(g, batch, 4, 16, 128, causal=causal)
    scales = torch.tensor([1.0, 0.009, 0.013], device=DEVICE)
    k8, v8 = ((x / float(s_)).clamp(-448, 448).to(fp8) for x, s_ in zip((k, v), scales.tolist()[1:]))
    q, k8, v8, sel, bt = _to(DEVICE, q, k8, v8, sel, batch.block_tables)
    kw = _device_batch(batch)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=kw["cu_seqlens_q"], max_blocks=-(-bt.shape[1] * page_size // 128))
    sched = m3_sparse.schedule(index, tile_q=4, num_programs=132)
    common = dict(**kw, softmax_scale=d**-0.5, causal=causal, block_size=128, scales=scales, out_dtype=dtype,
                  partial_dtype=partial_dtype)  # fmt: skip
    with poisoned_allocations():
        got = partials_gpu(q, k8, v8, index, sched, bt, **common, engine="tma")
    ref = m3_sparse.kvouter_partials(q, k8, v8, index, bt, **common)
    same = partials_gpu(q, k8, v8, index, sched, bt, **common, engine="triton")
    po, pm, pl = got
    used = int(index.seg_offsets[-1])
    for name, x in (("partial_o", po), ("partial_m", pm), ("partial_l", pl)):
        assert not is_poisoned(x).any(), name
    assert po.dtype == (partial_dtype or dtype)
    assert torch.equal(pm[:used] == float("-inf"), ref[1][:used] == float("-inf"))
    assert_close("partial_m", ref[1][:used], pm[:used], 1e-5)
    assert_close("partial_l", ref[2][:used], pl[:used], 1e-4)
    # e4m3 rows: both round the same values, and differ where accumulation order moves one
    # across a rounding boundary (as in test_fp8_partials).
    tol, tl_tol = (2 * TOLERANCES[dtype], TOLERANCES[dtype]) if partial_dtype is None else (0.04, 0.04)
    assert_close("partial_o", ref[0][:used].float(), po[:used].float(), tol)
    assert_close("partial_m vs tl kernel", same[1][:used], pm[:used], 1e-6)
    assert_close("partial_l vs tl kernel", same[2][:used], pl[:used], 1e-5)
    assert_close("partial_o vs tl kernel", same[0][:used].float(), po[:used].float(), tl_tol)
    assert torch.all(po[used:].float() == 0) and torch.all(pm[used:] == float("-inf")) and torch.all(pl[used:] == 0)
    assert not torch.isnan(po.float()).any()


@pytest.mark.gpu
@pytest.mark.usefixtures("tma_partials")
def test_partials_tma_equal_the_triton_kernel_in_a_cuda_graph():
    g = gen(99)
    batch = make_batch(g, [(3000, 700), (200, 200)], 128)
    q = randn(g, batch.num_tokens, 64, 128, dtype=torch.bfloat16)
    k, v = batch.kv_cache(g, 4, 128, torch.bfloat16), batch.kv_cache(g, 4, 128, torch.bfloat16)
    sel = random_selection(g, batch, 4, 16, 128)
    q, k, v, sel, bt = _to(DEVICE, q, k, v, sel, batch.block_tables)
    kw = _device_batch(batch)
    index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=kw["cu_seqlens_q"], max_blocks=bt.shape[1] * 128 // 128)
    sched = m3_sparse.schedule(index, tile_q=4, num_programs=264)
    run = lambda eng: partials_gpu(  # noqa: E731
        q, k, v, index, sched, bt, **kw, softmax_scale=0.088, block_size=128, engine=eng
    )
    want = run("triton")
    run("tma")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run("tma")
    for x in got:
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    used = int(index.seg_offsets[-1])
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert_close("partial_o", want[0][:used], got[0][:used], TOLERANCES[torch.bfloat16])
    assert torch.all(got[0][used:] == 0)


# --------------------------------------------------------------------------- CUDA, full size


def sampled_reference(q, k_cache, v_cache, sel, block_tables, cu, kv_lens, tokens, block_size, scale):
    """Exact attention (fp32, on the device) of the query rows ``tokens`` over their selected
    blocks, deduplicated: a cheap oracle for shapes too large for the float64 one."""
    hq, d = q.shape[1], q.shape[2]
    hkv, page_size = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    tokens = tokens.to(torch.int64)
    seq = torch.searchsorted(cu[1:].to(torch.int64), tokens, right=True)
    pos = kv_lens.to(torch.int64)[seq] - cu.to(torch.int64)[seq + 1] + tokens
    s_sel = sel[tokens].to(torch.int64)  # [n, Hkv, K]
    topk = s_sel.shape[-1]
    earlier = (s_sel[..., :, None] == s_sel[..., None, :]) & torch.ones(topk, topk, dtype=torch.bool, device=q.device).tril(-1)
    ok = (s_sel >= 0) & ~earlier.any(-1)
    kpos = s_sel.clamp(min=0)[..., None] * block_size + torch.arange(block_size, device=q.device)  # [n, Hkv, K, B]
    vis = ok[..., None] & (kpos <= pos[:, None, None, None]) & (kpos < kv_lens.to(torch.int64)[seq][:, None, None, None])
    kpos = kpos.clamp(max=block_tables.shape[1] * page_size - 1)
    page = block_tables.to(torch.int64)[seq[:, None, None, None], kpos // page_size].clamp(min=0)
    heads = torch.arange(hkv, device=q.device)[None, :, None, None]
    kk = k_cache[page, heads, kpos % page_size].float().flatten(2, 3)  # [n, Hkv, K*B, D]
    vv = v_cache[page, heads, kpos % page_size].float().flatten(2, 3)
    qq = q[tokens].float().view(-1, hkv, group, d)
    s = torch.einsum("ngd,nkd->ngk", qq.flatten(0, 1), kk.flatten(0, 1)).view(-1, hkv, group, kk.shape[2]) * scale
    s = s.masked_fill(~vis.flatten(2, 3)[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [n, Hkv, G]
    w = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("nhgk,nhkd->nhgd", w, vv).reshape(-1, hq, d)
    return out, lse.reshape(-1, hq).T


@pytest.mark.gpu
def test_large_partial_buffer_64bit_offsets():
    """32K query tokens x 4 kv heads x top-16 x 16 heads x 128 = 4.3e9 partial elements:
    the last entries' offsets only fit in 64 bits."""
    torch.manual_seed(3)
    n, hq, hkv, d, blk, topk = 32768, 64, 4, 128, 128, 16
    dev = DEVICE
    nb = n // blk
    q = torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(nb, hkv, blk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(nb, hkv, blk, d, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(nb, device=dev, dtype=torch.int32)[None]
    cu = torch.tensor([0, n], device=dev, dtype=torch.int32)
    kv = torch.tensor([n], device=dev, dtype=torch.int32)
    local = torch.arange(n, device=dev) // blk
    score = torch.rand(n, hkv, nb, device=dev)
    score = score.masked_fill(torch.arange(nb, device=dev)[None, None, :] >= local[:, None, None], -1.0)
    top = score.topk(topk - 1, -1).indices.to(torch.int32)
    top = torch.where(score.gather(-1, top.long()) >= 0, top, -1)
    sel = torch.cat([local[:, None, None].expand(n, hkv, 1).to(torch.int32), top], -1)
    assert n * hkv * topk * (hq // hkv) * d > 2**31
    out, lse = kvouter_triton(q, k, v, sel, bt, cu_seqlens_q=cu, used_kv_lens=kv, return_lse=True)
    tokens = torch.cat([torch.arange(0, 64, device=dev), torch.arange(n - 192, n, device=dev)])
    ref_out, ref_lse = sampled_reference(q, k, v, sel, bt, cu, kv, tokens, blk, d**-0.5)
    assert_close("out (sampled)", ref_out, out[tokens].float(), TOLERANCES[torch.bfloat16])
    assert_close("lse (sampled)", ref_lse, lse[:, tokens], LSE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", HEADS_BIG)
def test_composed_matches_torch_cuda(hq, hkv):
    seqs = [(700, 500), (64, 64), (1300, 7), (300, 300)]
    batch, q, k, v, sel = _setup(hq * 3 + hkv, seqs, 64, 128, hq, hkv, 128, 16, torch.bfloat16, True)
    qd, kd, vd, sd, bt = _to(DEVICE, q, k, v, sel, batch.block_tables)
    kw = _device_batch(batch)
    with poisoned_allocations():
        out, lse = kvouter_triton(qd, kd, vd, sd, bt, **kw, return_lse=True)
    ref_out, ref_lse = m3_sparse.kvouter_attention(qd, kd, vd, sd, bt, **kw, return_lse=True)
    assert_close("out", ref_out.float(), out.float(), TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, LSE_TOL)
