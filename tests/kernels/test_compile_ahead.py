"""``core.launch.compile_ahead``: the first calls of a call key run once with every launch turned
into a warm-up compile (handed to Triton's asynchronous compile mode), then for real; a pass
launches nothing, and once a pass finds nothing left to compile the key's calls run directly.

The bookkeeping runs on the CPU with a stand-in kernel and compile mode (the interpreter has no
compiles); the public ops are checked to route their calls through it with keys that tell
prefill from decode shapes; on a CUDA device a pass leaves results and inputs bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import m3_sparse  # noqa: E402
from kernel_test_utils import gen, make_batch, randn, random_selection  # noqa: E402
from m3_sparse import api  # noqa: E402
from m3_sparse.core import launch  # noqa: E402

CUDA = torch.device("cuda")


class FakeMode:
    """Triton's ``AsyncCompileMode`` as ``compile_ahead`` uses it: a context whose
    ``raw_futures`` lists the compiles handed to the pool."""

    active = None

    def __init__(self, executor):
        self.executor, self.raw_futures = executor, []

    def __enter__(self):
        FakeMode.active = self
        return self

    def __exit__(self, *exc):
        FakeMode.active = None


class FakeKernel:
    """A kernel that records real launches and warm-up compiles; a specialization (its
    arguments) compiles once, as Triton's in-memory cache would."""

    def __init__(self):
        self.launches, self.warmups, self.compiled = [], [], set()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, tuple(kwargs.items())))

    def run(self, *args, grid, warmup, **kwargs):
        assert warmup and FakeMode.active is not None
        key = (args, tuple(kwargs.items()))
        self.warmups.append((grid, key))
        if key not in self.compiled:
            self.compiled.add(key)
            FakeMode.active.raw_futures.append(key)


@pytest.fixture
def ahead(monkeypatch):
    """compile_ahead on, with the stand-in compile mode, and no key seen yet."""
    monkeypatch.setattr(launch, "_ahead_wanted", lambda: True)
    monkeypatch.setattr(launch, "_async_compile_mode", lambda: FakeMode)
    monkeypatch.setattr(launch, "_passes", {})
    monkeypatch.setattr(launch, "_cache_for", lambda fn: None)  # launch_kernel's Triton path


def test_a_pass_compiles_each_launch_and_launches_nothing(ahead):
    kernel = FakeKernel()

    def call(x, value):
        launch.launch_kernel(kernel, (3,), x, value, BLOCK=16)
        launch.launch_kernel(kernel, (1, 2), x, MODE=value)
        return value

    x = torch.ones(4)
    assert launch.compile_ahead(("k",), CUDA, call, x, 7) == 7
    # The pass: two warm-up compiles with the launches' grids and arguments; then the real call.
    assert kernel.warmups == [((3,), ((x, 7), (("BLOCK", 16),))), ((1, 2), ((x,), (("MODE", 7),)))]
    assert kernel.launches == [((3,), (x, 7), (("BLOCK", 16),)), ((1, 2), (x,), (("MODE", 7),))]
    assert launch._ahead.get() is None


def test_passes_stop_once_one_finds_nothing_to_compile(ahead):
    kernel = FakeKernel()
    calls = []

    def call(value):
        calls.append(launch._ahead.get() is not None)
        launch.launch_kernel(kernel, (1,), value)

    launch.compile_ahead(("k",), CUDA, call, 1)  # compiles 1
    launch.compile_ahead(("k",), CUDA, call, 2)  # compiles 2
    launch.compile_ahead(("k",), CUDA, call, 2)  # finds nothing: the key is warm
    launch.compile_ahead(("k",), CUDA, call, 3)  # runs directly (3 compiles at its launch)
    assert calls == [True, False, True, False, True, False, False]
    assert len(kernel.launches) == 4 and [w[1][0] for w in kernel.warmups] == [(1,), (2,), (2,)]
    # Another key has passes of its own.
    launch.compile_ahead(("other",), CUDA, call, 3)
    assert calls[-2:] == [True, False]


def test_passes_per_key_are_bounded(ahead):
    kernel = FakeKernel()
    for value in range(launch.MAX_PASSES + 3):
        launch.compile_ahead(("k",), CUDA, lambda v: launch.launch_kernel(kernel, (1,), v), value)
    assert len(kernel.warmups) == launch.MAX_PASSES and len(kernel.launches) == launch.MAX_PASSES + 3


def test_passes_are_off_unless_asked_for(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.delenv(launch.COMPILE_AHEAD_ENV, raising=False)
    assert not launch._ahead_wanted()
    monkeypatch.setenv(launch.COMPILE_AHEAD_ENV, "1")
    assert launch._ahead_wanted()
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    assert not launch._ahead_wanted()


def test_a_key_is_made_only_while_passes_are_on(ahead, monkeypatch):
    """Every op call comes through compile_ahead: with passes off (the default) its key is
    never built."""
    made = []

    def key():
        made.append(1)
        return ("k",)

    monkeypatch.setattr(launch, "_ahead_wanted", lambda: False)
    assert launch.compile_ahead(key, CUDA, lambda: 3) == 3 and made == []
    monkeypatch.setattr(launch, "_ahead_wanted", lambda: True)
    assert launch.compile_ahead(key, CUDA, lambda: 4) == 4 and made == [1]
    assert launch._passes == {("k",): launch.MAX_PASSES}  # its pass found nothing to compile


@pytest.mark.parametrize("why", ["cpu", "turned off", "no async compile", "inside a pass"])
def test_no_pass(ahead, monkeypatch, why):
    kernel = FakeKernel()
    device = torch.device("cpu") if why == "cpu" else CUDA
    if why == "turned off":
        monkeypatch.setattr(launch, "_ahead_wanted", lambda: False)
    if why == "no async compile":
        monkeypatch.setattr(launch, "_async_compile_mode", lambda: None)

    def call():
        launch.launch_kernel(kernel, (1,), 5)
        if why == "inside a pass":  # a nested op's call makes no pass of its own
            launch.compile_ahead(("inner",), CUDA, launch.launch_kernel, kernel, (2,), 6)

    launch.compile_ahead(("k",), device, call)
    if why == "inside a pass":
        # The outer pass compiles both launches; in the real call the inner key's own pass
        # finds nothing left to compile, so the inner key is warm.
        assert [w[0] for w in kernel.warmups] == [(1,), (2,), (2,)] and len(kernel.launches) == 2
        assert launch._passes[("inner",)] == launch.MAX_PASSES
    else:
        assert kernel.warmups == [] and len(kernel.launches) == 1


def test_a_stopped_pass_leaves_the_call_to_run_as_it_would(ahead):
    """Whatever stops a pass (bad input, a compile error), the real call runs without one and
    raises its own error, if any; the key makes no more passes."""
    calls = []

    def call(fail_in_pass: bool):
        calls.append(launch._ahead.get() is not None)
        if fail_in_pass and launch._ahead.get() is not None:
            raise RuntimeError("compile error")
        if not fail_in_pass:
            raise ValueError("bad input")
        return "done"

    assert launch.compile_ahead(("a",), CUDA, call, True) == "done"
    with pytest.raises(ValueError, match="bad input"):
        launch.compile_ahead(("b",), CUDA, call, False)
    assert calls == [True, False, True, False]
    assert launch._passes == {("a",): launch.MAX_PASSES, ("b",): launch.MAX_PASSES}
    assert launch._ahead.get() is None and FakeMode.active is None


def test_the_ops_hand_their_calls_to_compile_ahead(monkeypatch):
    """Every public op that launches kernels goes through compile_ahead, keyed apart for
    prefill and decode shapes; a plan maker launches nothing and makes no pass."""
    seen = []

    def recording(key, device, call, *args, **kwargs):
        seen.append(key() if callable(key) else key)
        return call(*args, **kwargs)

    monkeypatch.setattr(api, "compile_ahead", recording)
    # Passes on for the plans, which read it once at their first run (these tensors are on the CPU).
    monkeypatch.setattr(api, "compile_ahead_on", lambda device: True)
    g = gen(3)
    for seqs in ([(300, 40), (90, 23)], [(300, 1), (90, 1)]):
        batch = make_batch(g, seqs, 16)
        q = randn(g, batch.num_tokens, 4, 32)
        k, v = (batch.kv_cache(g, 1, 32) for _ in range(2))
        sel = random_selection(g, batch, 1, 3, 32)
        lens = dict(batch.kwargs(), block_size=32)
        m3_sparse.sparse_attention(q, k, v, sel, batch.block_tables, **lens)
        index_q, index_k = randn(g, batch.num_tokens, 2, 16), batch.index_cache(g, 16)
        m3_sparse.index_topk(index_q, index_k, batch.block_tables, topk=3, **lens)
        plan = m3_sparse.plan_sparse_attention(q, k, v, sel, batch.block_tables, **lens)
        plan.run(q, k, v, sel)
    names = [key[0] for key in seen]
    assert names == ["sparse_attention", "index_topk", "PlannedAttention"] * 2
    for i in range(3):  # prefill and decode shapes make different keys
        assert seen[i] != seen[i + 3]
    q, k = randn(g, 2, 5, 2, 16), randn(g, 2, 5, 16)
    w, cos, sin = randn(g, 16), randn(g, 1, 5, 8), randn(g, 1, 5, 8)
    m3_sparse.index_prep(q, k, w, w, cos, sin, eps=1e-6, impl="triton")
    assert seen[-1][0] == "index_prep"


def test_a_plan_reads_whether_passes_are_on_once(monkeypatch):
    """A plan asks at its first run whether passes are on, and with them off its runs call
    the kernels directly, without compile_ahead (a decode step runs a plan in every layer)."""
    asked, seen = [], []
    monkeypatch.setattr(api, "compile_ahead_on", lambda device: asked.append(device) or False)
    monkeypatch.setattr(api, "compile_ahead", lambda *a, **kw: seen.append(a))
    g = gen(4)
    batch = make_batch(g, [(90, 1), (40, 1)], 16)
    q = randn(g, batch.num_tokens, 4, 32)
    k, v = (batch.kv_cache(g, 1, 32) for _ in range(2))
    sel = random_selection(g, batch, 1, 3, 32)
    plan = m3_sparse.plan_sparse_attention(q, k, v, sel, batch.block_tables, **batch.kwargs(), block_size=32)
    first = plan.run(q, k, v, sel)
    second = plan.run(q, k, v, sel)
    assert asked == [q.device] and seen == []
    torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("seqs", [[(2000, 300), (900, 77)], [(2000, 1), (900, 1), (400, 1)]], ids=["prefill", "decode"])
def test_a_pass_leaves_results_and_inputs_as_they_were(monkeypatch, seqs):
    """The first call of a key (with its pass) gives bit for bit what a call without passes
    gives, and leaves its inputs as they were; the key is then known."""
    g = gen(12)
    batch = make_batch(g, seqs, 64)
    q = randn(g, batch.num_tokens, 16, 128, dtype=torch.bfloat16).cuda()
    k, v = (batch.kv_cache(g, 2, 128, torch.bfloat16).cuda() for _ in range(2))
    sel = random_selection(g, batch, 2, 8, 128).cuda()
    tables, cu, lens = (t.cuda() for t in (batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens))
    inputs = (q, k, v, sel, tables, cu, lens)
    saved = [t.clone() for t in inputs]

    def call():
        return m3_sparse.sparse_attention(q, k, v, sel, tables, cu_seqlens_q=cu, used_kv_lens=lens, block_size=128,
                                          return_lse=True)

    monkeypatch.setenv(launch.COMPILE_AHEAD_ENV, "0")
    want = call()
    monkeypatch.setenv(launch.COMPILE_AHEAD_ENV, "1")
    monkeypatch.setattr(launch, "_passes", {})
    got = call()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for t, before in zip(inputs, saved):
        assert torch.equal(t, before)
    assert [key[0] for key in launch._passes] == ["sparse_attention"]


def test_a_pass_runs_no_flash_attn_4(ahead, monkeypatch):
    """flash-attn-4 is not a Triton launch: in a pass the dense op's flash-attn-4 path only
    compiles its page-tail kernel and runs no attention (its results would be dropped)."""
    from m3_sparse.core.validate import attention_args
    from m3_sparse.dense import attention_fa4, tails_triton

    kernel = FakeKernel()
    monkeypatch.setattr(tails_triton, "_clear_page_tails_kernel", kernel)

    def no_forward(*args, **kwargs):
        raise AssertionError("flash-attn-4 ran inside a pass")

    monkeypatch.setattr(attention_fa4, "forward", no_forward)
    g = gen(4)
    batch = make_batch(g, [(90, 20), (40, 7)], 16)
    q = randn(g, batch.num_tokens, 4, 32)
    k, v = (batch.kv_cache(g, 1, 32) for _ in range(2))
    args = attention_args(q, k, v, batch.block_tables, **batch.kwargs(), softmax_scale=None, causal=True,
                          return_lse=False, sparse=False)
    before = k.clone()
    with FakeMode(None) as mode:
        token = launch._ahead.set(launch._AheadPass(mode))
        try:
            out, lse = attention_fa4.run_dense_fa4(args)
        finally:
            launch._ahead.reset(token)
    assert out.shape == q.shape and lse is None
    assert len(kernel.warmups) == 1 and kernel.launches == [] and torch.equal(k, before)
