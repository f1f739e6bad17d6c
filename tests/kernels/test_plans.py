"""Plans of the ops (``api.plan_sparse_attention``, ``api.plan_index_topk``,
``api.plan_dense_paged_attention``): checked, the kernel chosen and its launch set up once; a plan's ``run`` on fresh tensors of the planned
shapes answers what the op answers for them, reads the batch metadata in place at every
run, and refuses tensors unlike the planned ones.

The torch path and the Triton kernels (the interpreter without a GPU), tiny decode-shaped
batches: ragged lengths, several tokens per sequence, shuffled block tables, selections
with -1 slots and repeated ids.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import m3_sparse
from kernel_test_utils import gen, make_batch, randn, random_selection, skip_unless_tma
from m3_sparse.decode.plan import DecodeConfig
from m3_sparse.dense.plan import DenseConfig
from m3_sparse.index.plan import IndexConfig

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
HQ, HKV, D, PAGE, BLOCK, TOPK = 4, 2, 32, 16, 16, 4
# (kv_len, q_len): decode steps of 1 and of a few tokens, one shorter than a block
SEQS = {"one_token": [(37, 1), (5, 1), (70, 1)], "few_tokens": [(40, 3), (9, 2), (64, 1)]}


@pytest.fixture(params=["torch", "triton"])
def impl(request, monkeypatch):
    monkeypatch.setenv("M3_SPARSE_IMPL", request.param)
    return request.param


def _to(*tensors):
    return [t.to(DEVICE) for t in tensors]


def _attention_call(g, batch, dtype):
    q = randn(g, batch.num_tokens, HQ, D, dtype=dtype)
    k = batch.kv_cache(g, HKV, D, dtype)
    v = batch.kv_cache(g, HKV, D, dtype)
    sel = random_selection(g, batch, HKV, TOPK, BLOCK)
    return _to(q, k, v, sel)


@pytest.mark.parametrize("seqs", SEQS.values(), ids=SEQS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_plan_runs_like_the_op(impl, seqs, dtype):
    g = gen(11)
    batch = make_batch(g, seqs, PAGE)
    tables, cu, kv_lens = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    meta = dict(cu_seqlens_q=cu, used_kv_lens=kv_lens, max_seqlen_q=max(n for _, n in seqs), block_size=BLOCK)
    q, k, v, sel = _attention_call(g, batch, dtype)
    plan = m3_sparse.plan_sparse_attention(q, k, v, sel, tables, **meta)
    for step in range(3):
        if step == 2:
            # The lengths change in place, as a paged cache advances them: the plan reads
            # the new ones (each sequence keeps at least its queries).
            kv_lens.copy_((kv_lens - 3).clamp(min=torch.tensor([n for _, n in seqs], device=DEVICE)))
        q, k, v, sel = _attention_call(g, batch, dtype)  # fresh tensors, the planned shapes
        out, lse = plan.run(q, k, v, sel)
        want, want_lse = m3_sparse.sparse_attention(q, k, v, sel, tables, **meta)
        assert lse is None and want_lse is None
        assert torch.equal(out, want), f"step {step}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kvouter_plan_runs_like_the_op_and_keeps_no_call_tensors(impl, monkeypatch, dtype):
    """Past the decode bound a plan keeps KV-outer's launches (``KVOuterLaunch``, the Triton
    stages) and runs them on fresh tensors as the op runs them. Released (as the integration
    keeps plans), it holds one-element stand-ins of the call's tensors and answers the same."""
    from m3_sparse import dispatch

    # A prefill past the decode bound, kept small for the interpreter.
    monkeypatch.setattr(dispatch, "DECODE_MAX_QUERIES", 4)
    monkeypatch.setattr(dispatch, "DECODE_MAX_QUERIES_TL", 4)
    g = gen(17)
    batch = make_batch(g, [(61, 29)], PAGE)
    tables, cu, kv_lens = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    meta = dict(cu_seqlens_q=cu, used_kv_lens=kv_lens, block_size=BLOCK, return_lse=True)
    q, k, v, sel = _attention_call(g, batch, dtype)
    plan = m3_sparse.plan_sparse_attention(q, k, v, sel, tables, **meta)
    launch = type(plan._launch).__name__ if plan._launch is not None else None
    assert launch == ("KVOuterLaunch" if impl == "triton" else None)
    for step in range(3):
        if step == 1:
            assert plan.release() is plan
            kept = (plan.args.q, plan.args.k_cache, plan.args.v_cache, plan.args.selected)
            if plan._launch is not None:
                kept += (plan._launch.args.q, plan._launch.args.selected)
            assert all(t.untyped_storage().nbytes() <= t.element_size() for t in kept)
            assert plan.args.q.shape == q.shape and plan.args.block_tables is tables
        q, k, v, sel = _attention_call(g, batch, dtype)
        out, lse = plan.run(q, k, v, sel)
        want, want_lse = m3_sparse.sparse_attention(q, k, v, sel, tables, **meta)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), f"step {step}"


def test_a_kvouter_plan_run_issues_its_launches_and_few_torch_calls(monkeypatch):
    """What a prefill's KV-outer run asks of the host besides its seven kernel launches (the
    index build's four passes, the schedule, the partials, the combine): two torch calls that
    run on the device (the index arrays' -1 fill and the zeroed count matrix) and six
    allocations; no cumsum or elementwise op, no copy, nothing read back (the kernels are
    stubbed out here: what runs is the host's part alone)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from m3_sparse import dispatch
    from m3_sparse.kvouter import build_triton, combine_triton, partials_triton, schedule_triton

    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    monkeypatch.setattr(dispatch, "DECODE_MAX_QUERIES", 4)
    monkeypatch.setattr(dispatch, "DECODE_MAX_QUERIES_TL", 4)
    g = gen(19)
    batch = make_batch(g, [(90, 41)], PAGE)
    tables, cu, kv_lens = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    q, k, v, sel = _attention_call(g, batch, torch.bfloat16)
    plan = m3_sparse.plan_sparse_attention(q, k, v, sel, tables, cu_seqlens_q=cu, used_kv_lens=kv_lens,
                                           block_size=BLOCK).release(keep_scratch=False)
    launched = []
    for module in (build_triton, schedule_triton, partials_triton, combine_triton):
        monkeypatch.setattr(module, "launch_kernel", lambda fn, grid, *a, **kw: launched.append(fn.__name__))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        plan.run(q, k, v, sel)
    assert launched == ["_chunk_rank_kernel", "_chunk_scan_kernel", "_segment_prefix_kernel", "_scatter_kernel",
                        "_emit_tiles_kernel", "_kvouter_partials_kernel", "_combine_kernel"]
    views = {"view.default", "slice.Tensor", "select.int", "alias.default", "as_strided.default"}
    work = [n for n in ops.names if n not in views]
    assert sorted(n for n in work if not n.startswith("empty")) == ["full.default", "zeros.default"], work
    assert sum(n.startswith("empty") for n in work) == 6, work


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "made_per_run"])
def test_a_released_plan_keeps_its_scratch_only_when_asked(keep):
    """A decode step's plan keeps its split workspaces between runs; a prefill's
    (``keep_scratch=False``) makes them at every run, so none outlives the run; both answer
    as the op does."""
    g = gen(18)
    batch = make_batch(g, SEQS["few_tokens"], PAGE)
    tables, cu, kv_lens = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    meta = dict(cu_seqlens_q=cu, used_kv_lens=kv_lens, max_seqlen_q=3)
    config = DenseConfig(block_n=16, num_splits=2, impl="triton")
    q, k, v, _ = _attention_call(g, batch, torch.float32)
    plan = m3_sparse.plan_dense_paged_attention(q, k, v, tables, config=config, **meta).release(keep_scratch=keep)
    for _ in range(2):
        q, k, v, _ = _attention_call(g, batch, torch.float32)
        out, _ = plan.run(q, k, v)
        want, _ = m3_sparse.dense_paged_attention(q, k, v, tables, config=config, **meta)
        assert torch.equal(out, want)
        assert bool(plan._launch.scratch._sets) == keep


def _index_call(g, batch, fp8: bool):
    index_q = randn(g, batch.num_tokens, HKV, D)
    cache = batch.index_cache(g, D)
    scale = None
    if fp8:
        scale = cache.abs().amax(-1).clamp(min=1e-6) / 448
        cache = (cache / scale[..., None]).to(torch.float8_e4m3fn)
    return _to(index_q, cache) + ([scale.to(DEVICE)] if fp8 else [None])


@pytest.mark.parametrize("seqs", SEQS.values(), ids=SEQS.keys())
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32_keys", "fp8_keys"])
def test_index_topk_plan_runs_like_the_op(impl, seqs, fp8):
    g = gen(12)
    batch = make_batch(g, seqs, PAGE)
    tables, cu, kv_lens = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    meta = dict(cu_seqlens_q=cu, used_kv_lens=kv_lens, topk=TOPK, block_size=BLOCK, local_blocks=1,
                max_seqlen_q=max(n for _, n in seqs))
    index_q, cache, scale = _index_call(g, batch, fp8)
    plan = m3_sparse.plan_index_topk(index_q, cache, tables, index_k_scale=scale, **meta)
    changed = False
    for step in range(3):
        if step == 2:
            before = m3_sparse.index_topk(index_q, cache, tables, index_k_scale=scale, **meta)
            kv_lens.copy_((kv_lens - 20).clamp(min=torch.tensor([n for _, n in seqs], device=DEVICE)))
            changed = not torch.equal(before, m3_sparse.index_topk(index_q, cache, tables, index_k_scale=scale, **meta))
        index_q, cache, scale = _index_call(g, batch, fp8)
        got = plan.run(index_q, cache, scale)
        want = m3_sparse.index_topk(index_q, cache, tables, index_k_scale=scale, **meta)
        assert torch.equal(got, want), f"step {step}"
    assert changed  # the shorter lengths do change the selection: the last run tested reading them


# The dense kernel's launches: its default (one key split per tile at these sizes, key tiles
# as TMA boxes where the interpreter or the GPU takes them), gathered loads, and key splits
# merged by the split merge.
DENSE_CONFIGS = {
    "default": DenseConfig(),
    "pointers_splits": DenseConfig(block_n=16, use_tma=False, num_splits=3),
    "tma_splits": DenseConfig(block_n=16, use_tma=True, num_splits=2),
}


@pytest.mark.parametrize("seqs", SEQS.values(), ids=SEQS.keys())
@pytest.mark.parametrize("config", DENSE_CONFIGS.values(), ids=DENSE_CONFIGS.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense_attention_plan_runs_like_the_op(impl, seqs, config, causal):
    if config.use_tma:
        skip_unless_tma()
    g = gen(15)
    batch = make_batch(g, seqs, PAGE)
    tables, cu, kv_lens = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    meta = dict(cu_seqlens_q=cu, used_kv_lens=kv_lens, max_seqlen_q=max(n for _, n in seqs), causal=causal,
                return_lse=True, config=config)
    q, k, v, _ = _attention_call(g, batch, torch.bfloat16)
    plan = m3_sparse.plan_dense_paged_attention(q, k, v, tables, **meta)
    assert plan.kernel == impl
    for step in range(3):
        if step == 2:
            kv_lens.copy_((kv_lens - 5).clamp(min=torch.tensor([n for _, n in seqs], device=DEVICE)))
        q, k, v, _ = _attention_call(g, batch, torch.bfloat16)
        out, lse = plan.run(q, k, v)
        want, want_lse = m3_sparse.dense_paged_attention(q, k, v, tables, **meta)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), f"step {step}"
    # ... and against the oracle: the last run read the shortened lengths.
    ref, ref_lse = m3_sparse.dense_paged_attention(q, k, v, tables, **{**meta, "config": DenseConfig(impl="torch")})
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_a_plan_refuses_tensors_unlike_the_planned_ones():
    g = gen(13)
    batch = make_batch(g, SEQS["one_token"], PAGE)
    tables, cu, kv_lens = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    q, k, v, sel = _attention_call(g, batch, torch.float32)
    plan = m3_sparse.plan_sparse_attention(q, k, v, sel, tables, cu_seqlens_q=cu, used_kv_lens=kv_lens,
                                           block_size=BLOCK)
    with pytest.raises(ValueError, match=r"q: the plan was made for shape \(3, 4, 32\)"):
        plan.run(q[:2], k, v, sel)
    with pytest.raises(ValueError, match=r"v_cache: .*torch.bfloat16"):
        plan.run(q, k, v.bfloat16(), sel)
    with pytest.raises(ValueError, match=r"selected: .*strides"):
        plan.run(q, k, v, sel.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="selected: expected a tensor"):
        plan.run(q, k, v, sel.tolist())

    index_q, cache, _ = _index_call(g, batch, fp8=False)
    index_plan = m3_sparse.plan_index_topk(index_q, cache, tables, cu_seqlens_q=cu, used_kv_lens=kv_lens, topk=TOPK,
                                           block_size=BLOCK)
    with pytest.raises(ValueError, match="index_k_scale: the plan was made for None"):
        index_plan.run(index_q, cache, torch.ones(cache.shape[:2], device=DEVICE))
    with pytest.raises(ValueError, match="index_k_cache: the plan was made for shape"):
        index_plan.run(index_q, cache[:-1], None)

    dense_plan = m3_sparse.plan_dense_paged_attention(q, k, v, tables, cu_seqlens_q=cu, used_kv_lens=kv_lens)
    with pytest.raises(ValueError, match=r"k_cache: the plan was made for shape .*; got shape"):
        dense_plan.run(q, k[:-1], v)
    with pytest.raises(ValueError, match=r"q: .*torch.float32 .*torch.bfloat16"):
        dense_plan.run(q.bfloat16(), k, v)


@pytest.mark.parametrize("name", ["block_tables", "cu_seqlens_q", "used_kv_lens"])
@pytest.mark.parametrize("how", ["int64", "strided"])
def test_plans_take_metadata_they_can_read_in_place(name, how):
    """A copy of int64 or strided metadata would not see in-place updates: every plan refuses it."""
    g = gen(14)
    batch = make_batch(g, SEQS["one_token"], PAGE)
    meta = dict(zip(("block_tables", "cu_seqlens_q", "used_kv_lens"),
                    _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)))
    t = meta[name]
    meta[name] = t.long() if how == "int64" else torch.stack([t, t], -1)[..., 0]  # the same values, strided
    tables = meta.pop("block_tables")
    q, k, v, sel = _attention_call(g, batch, torch.float32)
    index_q, cache, _ = _index_call(g, batch, fp8=False)
    why = "int64" if how == "int64" else "strides"
    with pytest.raises(ValueError, match=f"{name}: a plan reads it in place .*{why}"):
        m3_sparse.plan_sparse_attention(q, k, v, sel, tables, block_size=BLOCK, **meta)
    with pytest.raises(ValueError, match=f"{name}: a plan reads it in place .*{why}"):
        m3_sparse.plan_index_topk(index_q, cache, tables, topk=TOPK, block_size=BLOCK, **meta)
    with pytest.raises(ValueError, match=f"{name}: a plan reads it in place .*{why}"):
        m3_sparse.plan_dense_paged_attention(q, k, v, tables, **meta)


def test_dropped_launches_free_their_scratch_at_once(monkeypatch):
    """A launch keeps its split workspaces for its next run; an op call makes a launch and
    drops it, and its workspaces must go with it then, not when the garbage collector runs
    (a prompt's workspaces, layer after layer, would pile up until it did)."""
    from m3_sparse.core.validate import attention_args, index_args
    from m3_sparse.decode.attention_triton import DecodeLaunch
    from m3_sparse.dense.attention_triton import DenseLaunch
    from m3_sparse.index import plan as index_plan
    from m3_sparse.index.topk_triton import TopkLaunch

    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    g = gen(16)
    batch = make_batch(g, SEQS["few_tokens"], PAGE)
    tables, cu, kv_lens = _to(batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens)
    meta = dict(cu_seqlens_q=cu, used_kv_lens=kv_lens, softmax_scale=None, causal=True, return_lse=False)
    q, k, v, sel = _attention_call(g, batch, torch.bfloat16)
    index_q, cache, _ = _index_call(g, batch, fp8=False)
    topk_args = index_args(index_q, cache, tables, cu_seqlens_q=cu, used_kv_lens=kv_lens, topk=TOPK,
                           block_size=BLOCK, local_blocks=1, max_seqlen_q=3, index_k_scale=None, fp8_dot=False)
    topk_cfg = IndexConfig(num_splits=2)
    launches = {
        "decode": (lambda: DecodeLaunch(attention_args(q, k, v, tables, selected=sel, block_size=BLOCK, **meta),
                                        DecodeConfig(num_splits=3)), lambda launch: launch.run(q, k, v, sel)),
        "dense": (lambda: DenseLaunch(attention_args(q, k, v, tables, sparse=False, **meta),
                                      DenseConfig(block_n=16, num_splits=2)), lambda launch: launch.run(q, k, v)),
        "topk": (lambda: TopkLaunch(topk_args, index_plan.plan(topk_args, topk_cfg), topk_cfg),
                 lambda launch: launch.run(index_q, cache)),
    }
    gc.disable()
    try:
        for name, (make, run) in launches.items():
            launch = make()
            run(launch)
            kept = launch.scratch.get(q.device) + ((launch.counts.get(q.device),) if hasattr(launch, "counts") else ())
            buffers = [weakref.ref(t) for t in kept]
            del launch, kept
            assert all(ref() is None for ref in buffers), f"{name}: the dropped launch's workspaces are still alive"
    finally:
        gc.enable()
