"""``core.launch.launch_kernel``: a kernel launched directly after its first call gives what a
launch through Triton gives, and a call Triton would specialize differently (another dtype,
an unaligned address, an int of another value or type) never reuses another call's kernel.

The key is checked on the CPU; the launches on a CUDA device (the decode kernel, with the
direct path on and off, an unaligned query and a profiler's launch hook; the dense kernel's
TMA descriptors and its split merge; KV-outer's tl kernels and the page-tail kernel; the
Gluon index top-k and KV-outer partials kernels with their descriptors)."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import m3_sparse  # noqa: E402
from kernel_test_utils import gen, make_batch, randn, random_selection, skip_unless_tma  # noqa: E402
from m3_sparse.core import launch  # noqa: E402
from m3_sparse.decode.plan import DecodeConfig  # noqa: E402
from m3_sparse.dense.plan import DenseConfig  # noqa: E402
from m3_sparse.kvouter.plan import KVOuterConfig  # noqa: E402


def test_key_separates_what_triton_specializes():
    def key(a):
        return launch._args_key((a,))[0]

    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert key(buf) == key(torch.zeros(8, dtype=torch.bfloat16))
    assert key(buf) != key(buf[1:])  # 2 bytes off: not 16-byte aligned
    assert key(buf) != key(buf.float())
    assert key(True) != key(1) and key(1) != key(16) and key(None) != key(0)
    assert key(0.5) == key(2.0)  # passed as fp32 whatever the value


def test_key_of_a_tensor_descriptor(monkeypatch):
    """A descriptor is keyed like Triton types it (dtype, block shape), never by its base."""
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor
    monkeypatch.setattr(launch, "_descriptor_class", TensorDescriptor)

    def key(t, block):
        return launch._args_key((TensorDescriptor.from_tensor(t, block),))[0]

    pool = torch.zeros(64, 32, dtype=torch.bfloat16)
    assert key(pool, [16, 32]) == key(torch.ones(128, 32, dtype=torch.bfloat16), [16, 32])
    assert key(pool, [16, 32]) != key(pool, [32, 32])
    assert key(pool, [16, 32]) != key(pool.float(), [16, 32])
    hash(key(pool, [16, 32]))


def test_key_of_a_gluon_descriptor(monkeypatch):
    """A Gluon descriptor is keyed by dtype, block shape, padding and shared layout (Gluon types
    it by all four), never by its base, shape or strides."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon.language import NVMMASharedLayout

    monkeypatch.setattr(launch, "_gluon_descriptor_class", hopper.TensorDescriptor)
    swizzled, plain = NVMMASharedLayout(128, 16), NVMMASharedLayout(0, 16)

    def key(t, block, layout):
        return launch._args_key((hopper.TensorDescriptor.from_tensor(t, block, layout),))[0]

    pool = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert key(pool, [16, 64], swizzled) == key(torch.ones(128, 64, dtype=torch.bfloat16), [16, 64], swizzled)
    assert key(pool, [16, 64], swizzled) != key(pool, [32, 64], swizzled)
    assert key(pool, [16, 64], swizzled) != key(pool, [16, 64], plain)
    assert key(pool, [16, 64], swizzled) != key(pool.half(), [16, 64], swizzled)
    hash(key(pool, [16, 64], swizzled))


def test_gluon_kernels_launch_through_triton_until_checked(monkeypatch):
    """A Gluon kernel launches directly only on a Triton release listed as checked on a GPU
    (stand-in kernels of each class: the interpreter's kernels have no compiled launcher)."""
    import triton

    def kernel(module: str):
        param = type("Param", (), {"name": "x", "default": None})()
        cls = type("Kernel", (), {"params": [param], "__module__": module})
        return cls()

    tl_kernel, gluon_kernel = kernel("triton.runtime.jit"), kernel("triton.experimental.gluon._runtime")
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "DIRECT_LAUNCH_TRITON", (triton.__version__,))
    monkeypatch.setattr(launch, "_launch_cache", {})
    assert launch._cache_for(tl_kernel) == {} and launch._cache_for(gluon_kernel) is None
    monkeypatch.setattr(launch, "DIRECT_LAUNCH_GLUON_TRITON", (triton.__version__,))
    monkeypatch.setattr(launch, "_launch_cache", {})
    assert launch._cache_for(gluon_kernel) == {}


def test_kernel_lookup_learns_the_descriptor_class():
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor
    from m3_sparse.dense import attention_triton

    launch._cache_for(attention_triton._dense_paged_attn_kernel)
    assert launch._descriptor_class is TensorDescriptor


def test_interpreter_launches_through_triton(monkeypatch):
    calls = []

    class Kernel:
        params = ()

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fn = Kernel()
    launch.launch_kernel(fn, (3,), 1, X=2)
    launch.launch_kernel(fn, (3,), 1, X=2)
    assert calls == [((3,), (1,), {"X": 2})] * 2
    assert launch._launch_cache.pop(fn) is None


def test_hooks_are_seen_in_either_form(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    hook = lambda metadata: None  # noqa: E731

    class Chain:  # Triton's HookChain: present even when it holds no hook
        def __init__(self, calls):
            self.calls = calls

    for enter, exit_, registered in ((None, None, False), (Chain([]), Chain([]), False), (Chain([hook]), None, True),
                                     (None, hook, True)):
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", enter)
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", exit_)
        assert launch._hooks_set() is registered


def _decode_call(seed, q_offset=0):
    """A decode batch (2 sequences, one query each, ragged lengths, -1 slots) on the GPU."""
    g = gen(seed)
    hq, hkv, d, ps, topk = 8, 2, 64, 16, 4
    kv_lens = [45, 30]
    pages = 8
    k = randn(g, pages, hkv, ps, d, dtype=torch.bfloat16)
    v = randn(g, pages, hkv, ps, d, dtype=torch.bfloat16)
    tables = torch.randperm(pages, generator=g).to(torch.int32).view(2, 4)
    q = randn(g, 2 * hq * d + q_offset, dtype=torch.bfloat16)
    selected = torch.tensor([[[0, 2, -1, 1], [2, -1, -1, 0]], [[1, 0, -1, -1], [-1, 1, 0, -1]]], dtype=torch.int32)
    cu = torch.arange(3, dtype=torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    q, k, v, tables, selected, cu, lens = (t.cuda() for t in (q, k, v, tables, selected, cu, lens))
    q = q[q_offset:].view(2, hq, d)  # offset on the device: q_offset elements past an aligned start
    return dict(q=q, k_cache=k, v_cache=v, selected=selected, block_tables=tables, cu_seqlens_q=cu, used_kv_lens=lens)


def _decode(call, impl="triton"):
    out, _ = m3_sparse.sparse_decode_attention(**call, block_size=16, config=DecodeConfig(impl=impl, num_splits=2))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_direct_launches_match_triton_launches(monkeypatch):
    from m3_sparse.decode import attention_triton

    kernel = attention_triton._decode_split_kernel
    direct = launch._cache_for(kernel) is not None
    call = _decode_call(0)
    ref = _decode(call, impl="torch")
    first, again = _decode(call), _decode(call)  # the second launch is direct where supported
    if direct:
        assert launch._launch_cache[kernel], "the decode call was not kept for direct launches"
    unaligned = _decode_call(0, q_offset=1)
    assert unaligned["q"].data_ptr() % 16
    got_unaligned = [_decode(unaligned) for _ in range(2)]

    monkeypatch.setattr(launch, "DIRECT_LAUNCH_TRITON", ())
    monkeypatch.setattr(launch, "_launch_cache", {})
    through_triton = _decode(call)
    assert launch._cache_for(kernel) is None
    assert torch.equal(first, through_triton) and torch.equal(again, through_triton)
    torch.testing.assert_close(first.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for out in got_unaligned:
        assert torch.equal(out, _decode(unaligned))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_launch_hooks_see_every_launch(monkeypatch):
    from triton import knobs

    call = _decode_call(1)
    ref = _decode(call)
    _decode(call)
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "calls"):  # a HookChain: the hook in its list
        monkeypatch.setattr(chain, "calls", [hook])
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    out = _decode(call)
    torch.cuda.synchronize()
    assert seen, "a profiler's launch hook was bypassed"
    assert torch.equal(out, ref)


def _dense_call(seed, splits: int):
    """A dense decode batch (3 sequences, one query each, ragged lengths) on the GPU, as
    (kwargs, config): key tiles as TMA boxes, ``splits`` key splits."""
    g = gen(seed)
    hq, hkv, d, ps = 8, 2, 64, 32
    pages = 12
    k = randn(g, pages, hkv, ps, d, dtype=torch.bfloat16)
    v = randn(g, pages, hkv, ps, d, dtype=torch.bfloat16)
    tables = torch.randperm(pages, generator=g).to(torch.int32).view(3, 4)
    q = randn(g, 3, hq, d, dtype=torch.bfloat16)
    cu = torch.arange(4, dtype=torch.int32)
    lens = torch.tensor([100, 7, 128], dtype=torch.int32)
    q, k, v, tables, cu, lens = (t.cuda() for t in (q, k, v, tables, cu, lens))
    call = dict(q=q, k_cache=k, v_cache=v, block_tables=tables, cu_seqlens_q=cu, used_kv_lens=lens, return_lse=True,
                max_seqlen_q=1)
    return call, DenseConfig(impl="triton", block_n=32, use_tma=True, num_splits=splits)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("splits", [1, 4])
def test_direct_dense_launches_match_triton_launches(monkeypatch, splits):
    """The dense kernel takes its K/V pools as TMA descriptors, and its key splits go through
    the split merge: both launched directly after their first call."""
    from m3_sparse.core import split_merge
    from m3_sparse.dense import attention_triton

    skip_unless_tma()
    call, cfg = _dense_call(2, splits)
    first = m3_sparse.dense_paged_attention(**call, config=cfg)
    again = m3_sparse.dense_paged_attention(**call, config=cfg)
    kernels = [attention_triton._dense_paged_attn_kernel] + ([split_merge._merge_splits_kernel] if splits > 1 else [])
    for kernel in kernels:
        if launch._cache_for(kernel) is not None:
            assert launch._launch_cache[kernel], f"{kernel} was not kept for direct launches"
    monkeypatch.setattr(launch, "DIRECT_LAUNCH_TRITON", ())
    monkeypatch.setattr(launch, "_launch_cache", {})
    through_triton = m3_sparse.dense_paged_attention(**call, config=cfg)
    ref = m3_sparse.dense_paged_attention(**call, config=DenseConfig(impl="torch"))
    for got in (first, again):
        assert torch.equal(got[0], through_triton[0]) and torch.equal(got[1], through_triton[1])
    torch.testing.assert_close(first[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_direct_kvouter_launches_match_triton_launches(monkeypatch):
    """A KV-outer call's tl kernels (the index build's four passes, the schedule, the tl
    partials, the combine) and the dense path's page-tail kernel, launched directly after
    their first call, give what launches through Triton give, bit for bit."""
    from m3_sparse.dense import tails_triton
    from m3_sparse.dense.tails import clear_page_tails_torch
    from m3_sparse.kvouter import build_triton, combine_triton, partials_triton, schedule_triton

    g = gen(5)
    batch = make_batch(g, [(300, 40), (90, 9), (50, 1)], 32)
    q = randn(g, batch.num_tokens, 8, 64, dtype=torch.bfloat16).cuda()
    k, v = (batch.kv_cache(g, 2, 64, torch.bfloat16).cuda() for _ in range(2))
    sel = random_selection(g, batch, 2, 4, 32).cuda()
    tables, cu, lens = (t.cuda() for t in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    cfg = KVOuterConfig(engine="triton")

    def run():
        out, lse = m3_sparse.kvouter_attention(q, k, v, sel, tables, cu_seqlens_q=cu, used_kv_lens=lens,
                                               block_size=32, return_lse=True, config=cfg)
        cleared = k.clone()
        tails_triton.clear_page_tails(cleared, v.clone(), tables, lens)
        return out, lse, cleared

    first, again = run(), run()
    kernels = [build_triton._chunk_rank_kernel, build_triton._chunk_scan_kernel, build_triton._segment_prefix_kernel,
               build_triton._scatter_kernel, schedule_triton._emit_tiles_kernel, partials_triton._kvouter_partials_kernel,
               combine_triton._combine_kernel, tails_triton._clear_page_tails_kernel]
    for kernel in kernels:
        if launch._cache_for(kernel) is not None:
            assert launch._launch_cache[kernel], f"{kernel} was not kept for direct launches"
    monkeypatch.setattr(launch, "DIRECT_LAUNCH_TRITON", ())
    monkeypatch.setattr(launch, "_launch_cache", {})
    through_triton = run()
    for got in (first, again):
        assert all(torch.equal(a, b) for a, b in zip(got, through_triton))
    ref = k.clone()
    clear_page_tails_torch(ref, v.clone(), tables, lens)
    assert torch.equal(first[2], ref)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_direct_gluon_launches_match_triton_launches(monkeypatch):
    """The sm_90 Gluon kernels (index top-k, KV-outer partials), launched directly after their
    first call with their TMA descriptors, give what launches through Triton give, bit for bit."""
    from kernel_test_utils import require_gluon
    from m3_sparse.index import topk_gluon_sm90
    from m3_sparse.index.plan import IndexConfig
    from m3_sparse.kvouter import partials_gluon_sm90

    require_gluon(topk_gluon_sm90.device_reason(torch.empty(1, device="cuda")), "the Gluon kernels")
    import triton

    # Gluon kernels launch directly only on releases listed once this comparison passed there.
    monkeypatch.setattr(launch, "DIRECT_LAUNCH_GLUON_TRITON", (triton.__version__,))
    monkeypatch.setattr(launch, "_launch_cache", {})
    g = gen(6)
    batch = make_batch(g, [(700, 300), (260, 77)], 64)
    q = randn(g, batch.num_tokens, 16, 128, dtype=torch.bfloat16).cuda()
    k, v = (batch.kv_cache(g, 2, 128, torch.bfloat16).cuda() for _ in range(2))
    sel = random_selection(g, batch, 2, 4, 128).cuda()
    index_q = randn(g, batch.num_tokens, 4, 128, dtype=torch.bfloat16).cuda()
    index_k = batch.index_cache(g, 128, torch.bfloat16).cuda()
    tables, cu, lens = (t.cuda() for t in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    lengths = dict(cu_seqlens_q=cu, used_kv_lens=lens, block_size=128)

    def run():
        out, lse = m3_sparse.kvouter_attention(q, k, v, sel, tables, return_lse=True,
                                               config=KVOuterConfig(engine="tma"), **lengths)
        # One key split: the Gluon index kernel takes prefill tiles only, and a call this small
        # would otherwise be planned over several splits to fill the GPU.
        chosen = m3_sparse.index_topk(index_q, index_k, tables, topk=4,
                                      config=IndexConfig(engine="tma", num_splits=1), **lengths)
        return out, lse, chosen

    first, again = run(), run()
    for kernel in (topk_gluon_sm90._index_topk_tma_kernel, partials_gluon_sm90._kvouter_partials_tma_kernel):
        assert launch._launch_cache.get(kernel), f"{kernel} was not kept for direct launches"
    monkeypatch.setattr(launch, "DIRECT_LAUNCH_GLUON_TRITON", ())
    monkeypatch.setattr(launch, "_launch_cache", {})
    through_triton = run()
    for got in (first, again):
        assert all(torch.equal(a, b) for a, b in zip(got, through_triton))
