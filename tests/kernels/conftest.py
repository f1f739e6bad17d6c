"""Shared helpers for the m3_sparse kernel tests.

The kernel package is not installed (the kernels loader reads it from build/), so
the sources in torch-ext/ are put on sys.path here.

Test modules import the helpers as ``kernel_test_utils``: several conftest.py
files may live in this tree without packages, and ``import conftest`` would be
ambiguous between them.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

TORCH_EXT = Path(__file__).resolve().parents[2] / "torch-ext"
if str(TORCH_EXT) not in sys.path:
    sys.path.insert(0, str(TORCH_EXT))

sys.modules.setdefault("kernel_test_utils", sys.modules[__name__])

# Without a GPU, Triton kernels only run in its interpreter, which is chosen when a
# kernel is decorated: set it before anything below imports the package's kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import m3_sparse  # noqa: E402,F401  (fail at collection if the package is broken)

# Allowed relative RMS error ||out - ref|| / ||ref|| against the float64 oracles.
# The oracles read the same (already rounded) inputs, so only the implementation's
# own rounding counts: fp32 accumulation, and for bf16/fp16 the partials and the
# output stored in the input dtype.
TOLERANCES = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}

# Hopper's fp8 MMA adds its products into an accumulator narrower than fp32 (measured on the
# H200: 1.1-1.6e-5 relative RMS on the lse against the exact scores of the same fp8 values),
# so a kernel that runs Q @ K^T on fp8 tensor cores gets a looser lse bound. A masking or
# scaling error moves the lse by 1e-2 or more.
LSE_TOL_FP8_MMA = 1e-4


def fp8_mma(fp8: bool, impl: str = "triton") -> bool:
    """Whether a dot on fp8 operands (``fp8``) run by ``impl`` ("torch" or "triton") adds its
    products in Hopper's narrow accumulator: only a Triton kernel on a real GPU does; the torch
    code and Triton's interpreter compute the dot in fp32, so they get the fp32 bounds."""
    return fp8 and impl == "triton" and torch.cuda.is_available()


def fp8_lse_tol(q: torch.Tensor, impl: str = "triton") -> float:
    """The lse bound of an attention op on ``q`` run by ``impl`` ("torch" or "triton")."""
    return LSE_TOL_FP8_MMA if fp8_mma(q.dtype == torch.float8_e4m3fn, impl) else TOLERANCES[torch.float32]


def decode_bound(hq: int, hkv: int, d: int, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None, *,
                 page_size: int = 16, block_size: int = 16, device: str | torch.device = "cpu") -> int:
    """``dispatch.decode_max_queries`` for inputs of these shapes and dtypes (it reads nothing
    else): ``sparse_attention`` runs the decode kernel while each sequence brings at most this
    many query rows, KV-outer beyond."""
    from m3_sparse import dispatch

    q = torch.empty(1, hq, d, dtype=q_dtype, device=device)
    kv = torch.empty(1, hkv, page_size, d, dtype=kv_dtype or q_dtype, device=device)
    return dispatch.decode_max_queries(q, kv, kv, block_size)


def kvouter_seqs(bound: int) -> list[tuple[int, int]]:
    """(kv_len, q_len) of a batch that ``sparse_attention`` sends to KV-outer when the decode
    bound is ``bound`` rows: one sequence of ``bound + 1`` new rows (the fewest that cross it)
    after a few cached tokens, beside a chunk, a decode step and a sequence with no key."""
    return [(bound + 20, bound + 1), (70, 9), (33, 1), (0, 2)]


def spy(monkeypatch, owner, name: str, seen) -> None:
    """Wrap ``owner.name`` so that each call, which still runs, hands its result to ``seen``:
    how a test sees which branch of a dispatch ran, and what it made."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        seen(out)
        return out

    monkeypatch.setattr(owner, name, wrapper)


def sparse_branches(monkeypatch) -> list[str]:
    """The branch that each later ``sparse_attention`` call runs, in order: "decode" or
    "kvouter", seen at the two functions of ``api`` the branches call (the public
    ``sparse_decode_attention`` and ``kvouter_attention`` call them too)."""
    from m3_sparse import api

    ran = []
    for branch in ("decode", "kvouter"):
        spy(monkeypatch, api, f"_{branch}", lambda _, b=branch: ran.append(b))
    return ran


def partial_dtypes(monkeypatch) -> list[torch.dtype]:
    """The dtype of the partials that each later KV-outer call (or slice of one) stores, seen
    at its partials stage, the torch one (``api.partials_torch``) or the kernels'
    (``kvouter.pipeline_triton.run_partials``)."""
    from m3_sparse import api
    from m3_sparse.kvouter import pipeline_triton

    dtypes = []
    for owner, name in ((api, "partials_torch"), (pipeline_triton, "run_partials")):
        spy(monkeypatch, owner, name, lambda partials: dtypes.append(partials[0].dtype))
    return dtypes


def quantize_e4m3(x: torch.Tensor, amax: float | None = None) -> tuple[torch.Tensor, float]:
    """Per-tensor e4m3 with scale = amax / 448 over the finite values (garbage slots of a
    cache become NaN or huge: never read by a correct kernel)."""
    finite = x[torch.isfinite(x) & (x.abs() < 100)]
    scale = float(finite.abs().max()) / 448.0 if amax is None else amax / 448.0
    return (x / scale).to(torch.float8_e4m3fn), scale


# Value written into cache slots that hold no token of any sequence and into pages
# that no sequence uses. Large enough that reading it by mistake wrecks the result
# (a garbage key dominates a softmax or a block max), finite so that correctly
# masked reads multiply it by exactly zero.
GARBAGE = 1.0e3


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
    """Fail unless ``||out - ref|| / ||ref|| <= ratio`` over the finite entries of ``ref``.

    Non-finite reference entries (an lse of -inf) must be matched exactly. A NaN
    in ``out`` fails whatever the ratio.
    """
    assert tuple(out.shape) == tuple(ref.shape), f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    r = ref.detach().to("cpu", torch.float64)
    o = out.detach().to("cpu", torch.float64)
    if torch.isnan(r).any():
        pytest.fail(f"{name}: the reference itself holds NaN (test bug)")
    nan = torch.isnan(o)
    if nan.any():
        first = tuple(int(i) for i in torch.nonzero(nan)[0])
        pytest.fail(f"{name}: {int(nan.sum())} NaN value(s) in the output, first at index {first}")
    fin = torch.isfinite(r)
    bad = (~fin) & (o != r)
    if bad.any():
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        pytest.fail(f"{name}: reference {float(r[first])} at {first} (non-finite) but got {float(o[first])}")
    bad = fin & ~torch.isfinite(o)
    if bad.any():
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        pytest.fail(f"{name}: non-finite output {float(o[first])} at {first}, reference {float(r[first])}")
    r, o = r[fin], o[fin]
    err = float(torch.linalg.vector_norm(o - r))
    norm = float(torch.linalg.vector_norm(r))
    rel = err / norm if norm > 0 else err
    if not rel <= ratio:
        diff = (o - r).abs()
        worst = int(diff.argmax()) if diff.numel() else -1
        detail = ""
        if worst >= 0:
            detail = f"; worst flat index {worst}: ref {float(r[worst]):.6g}, got {float(o[worst]):.6g}"
        pytest.fail(f"{name}: relative RMS error {rel:.3e} exceeds {ratio:.1e} (||ref|| = {norm:.4g}){detail}")


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no correct code path produces and return it:
    NaN for floating tensors, the dtype's minimum for integer ones."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)
    return t


@contextlib.contextmanager
def poisoned_allocations():
    """Make ``torch.empty``/``torch.empty_like`` return poisoned tensors while active,
    so an output element the code under test forgets to write is visible."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        return poison(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return poison(real_empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def is_poisoned(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return torch.isnan(t)
    return t == torch.iinfo(t.dtype).min


@dataclass
class PagedBatch:
    """A varlen batch over a paged cache: sequence ``b`` has ``kv_lens[b]`` cached
    tokens, the last ``q_lens[b]`` of which are this call's queries."""

    kv_lens: list[int]
    q_lens: list[int]
    page_size: int
    num_pages: int
    block_tables: torch.Tensor  # [B, W] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    used_kv_lens: torch.Tensor  # [B] int32
    written: torch.Tensor  # [num_pages, page_size] bool: the slot holds a token of some sequence

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def capacity(self) -> int:
        return self.block_tables.shape[1] * self.page_size

    def tokens(self):
        """Yield (seq, token row, absolute position) of every query token."""
        t = 0
        for b, (kv, n) in enumerate(zip(self.kv_lens, self.q_lens)):
            for i in range(n):
                yield b, t, kv - n + i
                t += 1

    def kwargs(self) -> dict:
        return {"cu_seqlens_q": self.cu_seqlens_q, "used_kv_lens": self.used_kv_lens}

    def _fill(self, x: torch.Tensor, unwritten: torch.Tensor, value: float) -> torch.Tensor:
        return x.masked_fill(unwritten, value)

    def place(self, cache: torch.Tensor, rows: list[torch.Tensor], head_axis: bool = False) -> torch.Tensor:
        """Write sequence ``b``'s logical rows ``rows[b]`` ([kv_len, ...], or
        [heads, kv_len, D] with ``head_axis``) into a copy of ``cache`` through the
        block table."""
        cache = cache.clone()
        ps = self.page_size
        for b, kv in enumerate(self.kv_lens):
            for j in range(0, kv, ps):
                page = int(self.block_tables[b, j // ps])
                n = min(ps, kv - j)
                if head_axis:
                    cache[page, :, :n] = rows[b][:, j : j + n].to(cache.dtype)
                else:
                    cache[page, :n] = rows[b][j : j + n].to(cache.dtype)
        return cache

    def kv_cache(self, g, heads: int, dim: int, dtype=torch.float32, garbage: float = GARBAGE) -> torch.Tensor:
        """[num_pages, heads, page_size, dim], ``garbage`` wherever no token lives."""
        x = randn(g, self.num_pages, heads, self.page_size, dim)
        return self._fill(x, ~self.written[:, None, :, None], garbage).to(dtype)

    def index_cache(self, g, dim: int, dtype=torch.float32, garbage: float = GARBAGE) -> torch.Tensor:
        """[num_pages, page_size, dim], ``garbage`` wherever no token lives."""
        x = randn(g, self.num_pages, self.page_size, dim)
        return self._fill(x, ~self.written[:, :, None], garbage).to(dtype)


def make_batch(
    g: torch.Generator,
    seqs: list[tuple[int, int]],
    page_size: int,
    *,
    shuffle: bool = True,
    extra_pages: int = 3,
    extra_cols: int = 1,
    pad: int | str = "pool",
) -> PagedBatch:
    """Lay out ``seqs`` = [(kv_len, q_len), ...] over a pool of pages.

    ``shuffle`` hands the pages out in a random permutation (so that a kernel
    ignoring the block table fails); ``pad`` fills block-table entries past each
    sequence's pages: ``"pool"`` random in-pool pages, or a literal id such as -1.
    """
    kv_lens = [kv for kv, _ in seqs]
    q_lens = [n for _, n in seqs]
    # q_len > kv_len is allowed: the first queries then sit before the sequence's
    # first token (negative positions) and see nothing.
    assert all(kv >= 0 and n >= 0 for kv, n in seqs)
    need = [math.ceil(kv / page_size) for kv in kv_lens]
    num_pages = sum(need) + extra_pages
    width = max(max(need, default=0) + extra_cols, 1)
    order = torch.randperm(num_pages, generator=g) if shuffle else torch.arange(num_pages)
    tables = torch.empty(len(seqs), width, dtype=torch.int32)
    written = torch.zeros(num_pages, page_size, dtype=torch.bool)
    nxt = 0
    for b, kv in enumerate(kv_lens):
        pages = order[nxt : nxt + need[b]]
        nxt += need[b]
        if pad == "pool":
            fill = torch.randint(0, num_pages, (width,), generator=g, dtype=torch.int32)
        else:
            fill = torch.full((width,), int(pad), dtype=torch.int32)
        tables[b] = fill
        tables[b, : need[b]] = pages.to(torch.int32)
        for j, p in enumerate(pages.tolist()):
            written[p, : min(page_size, kv - j * page_size)] = True
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int64), 0).to(torch.int32)
    return PagedBatch(
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_pages=num_pages,
        block_tables=tables,
        cu_seqlens_q=cu,
        used_kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        written=written,
    )


def random_selection(
    g: torch.Generator,
    batch: PagedBatch,
    heads: int,
    topk: int,
    block_size: int,
    *,
    causal: bool = True,
    empty_frac: float = 0.2,
    dup_frac: float = 0.2,
) -> torch.Tensor:
    """Selections shaped like index_topk's but messier: the local block plus random
    earlier blocks (causal) or any block of the sequence (non-causal, and rows at a
    negative position), slots in a random order, some slots emptied (-1) and some
    holding a repeated id."""
    sel = torch.full((batch.num_tokens, heads, topk), -1, dtype=torch.int32)
    for b, t, p in batch.tokens():
        last = p // block_size
        nb = last + 1 if causal and p >= 0 else max(1, math.ceil(batch.kv_lens[b] / block_size))
        for h in range(heads):
            k = min(topk, nb)
            if causal and p >= 0:
                rest = torch.randperm(last, generator=g)[: k - 1] if last else torch.empty(0, dtype=torch.int64)
                ids = torch.cat([torch.tensor([last]), rest])
            else:
                ids = torch.randperm(nb, generator=g)[:k]
            row = torch.full((topk,), -1, dtype=torch.int64)
            row[: ids.numel()] = ids
            u = torch.rand(topk, generator=g)
            row = torch.where(u < empty_frac, -1, row)
            src = row[torch.randint(0, topk, (topk,), generator=g)]
            row = torch.where((u >= empty_frac) & (u < empty_frac + dup_frac), src, row)
            sel[t, h] = row[torch.randperm(topk, generator=g)].to(torch.int32)
    return sel


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The shapes here are tiny, so intra-op threads buy nothing, while on a busy
    2-core machine their spin-waits slow these tests down tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def aot_compile(script: str, *args: str) -> dict:
    """Run an ahead-of-time compile script in a fresh interpreter without TRITON_INTERPRET
    (argv: the torch-ext folder, then ``args``) and return the dict it prints after
    ``RESULT ``. The scripts use Triton's compile API (``ASTSource``, ``GPUTarget``) of every
    release the test extra allows: a script that fails, an ImportError included, fails."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(TORCH_EXT), *args], capture_output=True, text=True, env=env, timeout=900
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        pytest.fail(f"compile script failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def kernel_module(name: str):
    """Import the Triton kernel module ``name``; without CUDA, make sure its kernels are the
    interpreter's (they are re-decorated if the module was imported before
    TRITON_INTERPRET was set, which the conftest files normally prevent)."""
    import importlib

    mod = importlib.import_module(name)
    if torch.cuda.is_available():
        return mod
    kernels = [v for k, v in vars(mod).items() if k.endswith("_kernel")]
    if not all(type(k).__name__ == "InterpretedFunction" for k in kernels):
        mod = importlib.reload(mod)
    return mod


def gluon_expected() -> bool:
    """Whether this machine should run the Gluon (sm_90) kernels: a Hopper GPU with the Triton
    they are written for (the H200 of docs/PERF.md)."""
    from m3_sparse.core import gluon
    from m3_sparse.core.launch import device_capability

    # The capability dispatch sees: M3_SPARSE_CAPABILITY when the suite acts as another GPU.
    return (
        torch.cuda.is_available() and torch.version.hip is None
        and device_capability(torch.cuda.current_device()) == (9, 0)
        and gluon.triton_version().startswith(gluon.TESTED_TRITON)
    )  # fmt: skip


def skip_unless_tma() -> None:
    """For a test that pins TMA key tiles (``use_tma=True``) or expects them: skipped where the
    GPU dispatch sees has no TMA (below sm_90; acting as an older GPU through
    M3_SPARSE_CAPABILITY), which refuses the pin. The CPU's interpreter runs the TMA path."""
    from m3_sparse.core.launch import TMA_CAPABILITY, device_capability

    if torch.cuda.is_available() and device_capability(torch.cuda.current_device()) < TMA_CAPABILITY:
        pytest.skip("TMA key tiles need sm_90 or newer")


def require_gluon(why: str | None, what: str) -> None:
    """For a GPU test of a Gluon kernel that refuses its call for reason ``why`` (None: it takes
    it): skip with the reason on a machine it is not written for, fail on one it is."""
    if why is None:
        return
    if gluon_expected():
        pytest.fail(f"{what} should run on this sm_90 GPU with this Triton, but: {why}")
    pytest.skip(f"{what}: {why}")
