"""No O(N^2) intermediates: on a 16K-token sequence the largest single tensor any op
allocates inside index_topk, kvouter_attention and dense_paged_attention stays
under a bound derived from the modules' chunk constants, far below N*N*4 bytes
(1 GiB at N = 16384), and below even the [Tq, Tk] fp32 score matrix of the
queries actually run.

Largest allocation = the largest new storage among the outputs of every aten op,
seen through a TorchDispatchMode (composite ops such as einsum arrive decomposed,
so their internal products are seen too; views and in-place results reuse a
storage and do not count). One run cross-checks it with the CPU profiler's
``profile_memory=True`` (largest ``self_cpu_memory_usage`` of any event), which
is too slow to parse for the longer runs.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import m3_sparse
from kernel_test_utils import gen, make_batch, randn

N = 16384  # cached tokens of the one sequence
PAGE = 128
BLOCK = 128
D = 8  # tiny head dims keep the run to a few CPU seconds
HQ, HKV = 2, 1
TOPK = 4
QUADRATIC = N * N * 4

index_mod = importlib.import_module("m3_sparse.index.topk")
kvouter_mod = importlib.import_module("m3_sparse.kvouter.partials")
combine_mod = importlib.import_module("m3_sparse.kvouter.combine")
dense_mod = importlib.import_module("m3_sparse.dense.attention")


class LargestAllocation(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.size, self.name = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in seen and st.nbytes() > self.size:
                    self.size, self.name = st.nbytes(), str(func)
        return out


def largest_allocation(fn):
    with LargestAllocation() as mode:
        fn()
    return mode.size, mode.name


def largest_allocation_profiled(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    top = max(prof.events(), key=lambda e: e.self_cpu_memory_usage)
    return top.self_cpu_memory_usage, top.name


def long_batch(num_queries: int):
    g = gen(0)
    batch = make_batch(g, [(N, num_queries)], PAGE, extra_pages=1)
    return g, batch


@pytest.mark.parametrize("measure", [largest_allocation, largest_allocation_profiled])
def test_measurement_sees_a_quadratic_tensor(measure):
    """Positive control: both measurements catch a [Tq, Tk] score matrix formed
    (as a transient inside a lambda), and ignore views."""
    a, b = torch.randn(64, 4), torch.randn(N, 4)
    size, _ = measure(lambda: torch.einsum("qd,kd->qk", a, b).amax(-1))
    assert size >= 64 * N * 4
    big = torch.zeros(64, N)
    size, _ = measure(lambda: big.view(-1).unsqueeze(0).expand(8, -1))
    assert size < 64 * N * 4


def test_index_topk_streams_keys():
    """Bound: the working set of one (query chunk x key chunk) step,
    QUERY_CHUNK x KEY_CHUNK x max(4 Di, 4 Hi, 8) bytes (gathered fp32 keys, fp32
    token scores, int64 positions / page ids), times 2 for slack: 4 MiB with
    QUERY_CHUNK = 64, KEY_CHUNK = 2048, Di = 4, against 16 MiB for the [Tq, Tk]
    fp32 scores of the 256 queries run."""
    tq, hi, di = 256, HKV, 4
    g, batch = long_batch(tq)
    iq = randn(g, tq, hi, di)
    ik = batch.index_cache(g, di)
    bound = 2 * index_mod.QUERY_CHUNK * index_mod.KEY_CHUNK * max(4 * di, 4 * hi, 8)
    assert bound * 4 <= tq * N * 4 < QUADRATIC, "test setup: the bound must be able to tell"
    run = lambda: m3_sparse.index_topk(iq, ik, batch.block_tables, **batch.kwargs(), topk=TOPK, block_size=BLOCK)
    for measure in (largest_allocation, largest_allocation_profiled):
        size, name = measure(run)
        assert size <= bound, f"index_topk: {name} allocated {size} bytes in one tensor, bound {bound}"


def test_kvouter_attention_is_linear():
    """Full 16K-token prefill. Bound: the larger of the partial buffers, which are
    linear in N (E = Tq x Hkv x topk entries of G x D fp32: 4 MiB here), and one
    entry chunk's gathered K or V, ENTRY_CHUNK x block_size x D fp32 (2 MiB),
    times 2 for slack: 8 MiB, against N*N*4 = 1 GiB."""
    tq = N
    g, batch = long_batch(tq)
    q = randn(g, tq, HQ, D)
    k, v = batch.kv_cache(g, HKV, D), batch.kv_cache(g, HKV, D)
    # The local block plus random earlier ones (repeats allowed: they count once).
    pos = torch.arange(tq)
    last = pos // BLOCK
    rand = (torch.rand(tq, HKV, TOPK - 1, generator=g) * (last[:, None, None] + 1)).long()
    sel = torch.cat([last[:, None, None].expand(tq, HKV, 1), rand], -1).to(torch.int32)
    group = HQ // HKV
    entries = tq * HKV * TOPK
    bound = 2 * max(
        entries * group * D * 4,
        kvouter_mod.ENTRY_CHUNK * BLOCK * max(4 * D, 8),
        combine_mod.TOKEN_CHUNK * HKV * TOPK * group * D * 4,
    )
    assert bound * 32 < QUADRATIC
    size, name = largest_allocation(
        lambda: m3_sparse.kvouter_attention(
            q, k, v, sel, batch.block_tables, **batch.kwargs(), block_size=BLOCK, return_lse=True
        )
    )
    assert size <= bound, f"kvouter_attention: {name} allocated {size} bytes in one tensor, bound {bound}"


def test_dense_paged_attention_streams_keys():
    """Bound: one (query chunk x key chunk) step, QUERY_CHUNK x KEY_CHUNK x
    max(4 Hkv D, 4 Hq, 8) bytes (gathered fp32 K or V, fp32 scores, int64 page ids),
    times 2 for slack: 2 MiB with QUERY_CHUNK = 32, KEY_CHUNK = 1024, against 8 MiB
    for the [Tq, Tk] fp32 scores of the 128 queries run (the torch stage reads the
    whole table for every query chunk, so more queries only cost time)."""
    tq = 128
    g, batch = long_batch(tq)
    q = randn(g, tq, HQ, D)
    k, v = batch.kv_cache(g, HKV, D), batch.kv_cache(g, HKV, D)
    bound = 2 * dense_mod.QUERY_CHUNK * dense_mod.KEY_CHUNK * max(4 * HKV * D, 4 * HQ, 8)
    assert bound * 4 <= tq * N * 4 < QUADRATIC
    for causal in (True, False):
        size, name = largest_allocation(
            lambda: m3_sparse.dense_paged_attention(
                q, k, v, batch.block_tables, **batch.kwargs(), causal=causal, return_lse=True
            )
        )
        assert size <= bound, f"dense_paged_attention: {name} allocated {size} bytes in one tensor, bound {bound}"


@pytest.mark.parametrize("n", [4096, 16384])
def test_index_topk_peak_does_not_grow_with_length(n):
    """Decode against a 4K and a 16K cache: the largest allocation is the same chunk."""
    g = gen(1)
    batch = make_batch(g, [(n, 1), (n // 2, 1)], PAGE)
    iq = randn(g, 2, HKV, D)
    ik = batch.index_cache(g, D)
    size, name = largest_allocation(
        lambda: m3_sparse.index_topk(iq, ik, batch.block_tables, **batch.kwargs(), topk=TOPK, block_size=BLOCK)
    )
    # Two queries: one key chunk of them, whatever n.
    assert size <= 2 * 2 * index_mod.KEY_CHUNK * max(4 * D, 8) + 2 * n // BLOCK * 4 * 2, (name, size)
