"""Every Triton kernel of m3_sparse under compute-sanitizer (memcheck, racecheck).

Each case runs one kernel family on small ragged batches over shuffled paged caches:
block tables padded with -1 past every sequence's pages, selections mostly -1 with
repeated ids and ids past the sequence, rows before a sequence's first token, empty
sequences. One process per (case, tool), the case's output checked against the torch
path so a kernel that silently did nothing does not pass.

    python3 benchmarks/reliability/sanitize.py                      # all cases, memcheck + racecheck
    python3 benchmarks/reliability/sanitize.py --cases kvouter --tools memcheck,racecheck
    python3 benchmarks/reliability/sanitize.py --cases kvouter --tools initcheck --engine triton
    python3 benchmarks/reliability/sanitize.py --list
    python3 benchmarks/reliability/sanitize.py --case dense         # one case, no sanitizer (what a run wraps)

Triton compiles a kernel at its first launch, which under the sanitizer is very slow:
every case first runs once without it (filling TRITON_CACHE_DIR, shared by all
processes), then under each tool, where every kernel comes from the cache. The
children run with PYTORCH_NO_CUDA_MEMORY_CACHING=1: with PyTorch's caching allocator a
read past a tensor usually lands inside the same cached segment, which memcheck cannot
tell from a legal access; without it every tensor is its own allocation.

initcheck does not count what a TMA store writes as initialized, so with the TMA partials
kernel (the KV-outer default on sm_90) it flags the combine's reads of partial O: run
initcheck on the kvouter case with ``--engine triton`` (docs/RELIABILITY.md).

The last thing printed is a table case x tool -> errors; the exit status is 1 if any
tool reported an error, a run did not finish, or a case's check failed. Logs and a
JSON summary go to $OUT/sanitize (or --out).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

ROOT = common.ROOT

CASES = {}  # name -> (function, one-line description)
# Where the cases put their tensors; "cpu" (with TRITON_INTERPRET=1) only to try the driver without a GPU.
DEVICE = "cuda"
# The KV-outer partials kernel of this run's Triton calls (--engine; run_case sets it).
KVOUTER_ENGINE = "auto"


def case(name: str, what: str):
    def register(fn):
        CASES[name] = (fn, what)
        return fn

    return register


# ----------------------------------------------------------------------------- inputs


class Batch:
    """A varlen batch over a shuffled page pool: sequence b has kv_lens[b] cached
    tokens, the last q_lens[b] of them queries (more queries than tokens puts the
    first rows before the sequence start). Table entries past a sequence's pages are
    -1, so a kernel that reads one dereferences a negative page id."""

    def __init__(self, torch, g, seqs, page, extra_cols=2):
        self.kv_lens = [kv for kv, _ in seqs]
        self.q_lens = [n for _, n in seqs]
        self.page = page
        need = [-(-kv // page) for kv in self.kv_lens]
        self.num_pages = sum(need) + 2
        width = max(max(need, default=0) + extra_cols, 1)
        order = torch.randperm(self.num_pages, generator=g)
        tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
        nxt = 0
        for b, n in enumerate(need):
            tables[b, :n] = order[nxt : nxt + n].to(torch.int32)
            nxt += n
        cu = [0]
        for n in self.q_lens:
            cu.append(cu[-1] + n)
        self.num_tokens = cu[-1]
        self.capacity = width * page
        self.block_tables = tables.to(DEVICE)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        self.used_kv_lens = torch.tensor(self.kv_lens, dtype=torch.int32, device=DEVICE)

    def kw(self):
        return {"cu_seqlens_q": self.cu_seqlens_q, "used_kv_lens": self.used_kv_lens}

    def positions(self):
        for b, (kv, n) in enumerate(zip(self.kv_lens, self.q_lens)):
            for i in range(n):
                yield b, kv - n + i


def selection(torch, g, batch: Batch, heads: int, topk: int, block: int, empty: float = 0.6, causal: bool = True):
    """-1-heavy selections: per row the local block plus random earlier ones, then most
    slots emptied, some repeated, a few ids past the query (future blocks, blocks past
    the sequence whose table entries are -1), slots shuffled."""
    max_blocks = -(-batch.capacity // block)
    sel = torch.full((batch.num_tokens, heads, topk), -1, dtype=torch.int64)
    for t, (b, p) in enumerate(batch.positions()):
        last = max(p, 0) // block
        for h in range(heads):
            ids = torch.randperm(max(last, 1), generator=g)[: topk - 1]
            row = torch.cat([torch.tensor([last]), ids])
            row = torch.nn.functional.pad(row, (0, topk - row.numel()), value=-1)
            u = torch.rand(topk, generator=g)
            row = torch.where(u < empty, -1, row)
            row = torch.where((u >= empty) & (u < empty + 0.1), row[0], row)  # repeats
            wild = torch.randint(0, max_blocks, (topk,), generator=g)
            row = torch.where(u > 0.95, wild, row)  # future blocks, blocks past the length
            sel[t, h] = row[torch.randperm(topk, generator=g)]
    return sel.to(torch.int32)


def rel_err(torch, got, ref) -> float:
    got, ref = got.double(), ref.double()
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(got)):
        return float("inf")
    if not fin.any():
        return 0.0
    d = (got[fin] - ref[fin]).norm()
    n = ref[fin].norm()
    return float(d / n) if n > 0 else float(d)


# The launch-config class of each public op, by the op's name.
OP_CONFIGS = {"index_topk": "IndexConfig", "kvouter_attention": "KVOuterConfig",
              "dense_paged_attention": "DenseConfig", "sparse_decode_attention": "DecodeConfig"}


def with_impl(impl: str, fn, *args, **kwargs):
    """``fn`` (a public op of m3_sparse) pinned to ``impl`` ("torch" or "triton") through its
    config; KV-outer's Triton calls run the partials kernel of ``KVOUTER_ENGINE``."""
    import m3_sparse

    settings = {"engine": KVOUTER_ENGINE} if fn.__name__ == "kvouter_attention" and impl == "triton" else {}
    settings.update(kwargs.pop("config_settings", {}))
    config = getattr(m3_sparse, OP_CONFIGS[fn.__name__])(impl=impl, **settings)
    return fn(*args, config=config, **kwargs)


TOL = {"torch.float32": 1e-4, "torch.bfloat16": 2e-2, "torch.float16": 5e-3}


def selection_mismatch(torch, got, ref) -> float:
    """Fraction of rows whose selected set differs (slot order is free)."""
    a = torch.sort(got.long(), -1).values
    b = torch.sort(ref.long(), -1).values
    return float((a != b).any(-1).float().mean()) if a.numel() else 0.0


# ----------------------------------------------------------------------------- cases


def _index_problem(torch, g, seqs, page, dtype, dim=128, heads=4):
    batch = Batch(torch, g, seqs, page)
    iq = torch.randn(batch.num_tokens, heads, dim, generator=g).to(DEVICE, dtype)
    ik = torch.randn(batch.num_pages, page, dim, generator=g).to(DEVICE, dtype)
    return batch, iq, ik


def _index_runs(torch, m3, results, label, batch, iq, ik, topk, block, local, scale=None, fp8_dot=False, splits=()):
    extra = {} if scale is None else {"index_k_scale": scale}
    ref = with_impl("torch", m3.index_topk, iq, ik, batch.block_tables, **batch.kw(), topk=topk, block_size=block,
                    local_blocks=local, **extra)
    runs = [("public", lambda: with_impl("triton", m3.index_topk, iq, ik, batch.block_tables, **batch.kw(), topk=topk,
                                        block_size=block, local_blocks=local, fp8_dot=fp8_dot, **extra))]
    for s in splits:
        runs.append((f"splits={s}", lambda s=s: with_impl(
            "triton", m3.index_topk, iq, ik, batch.block_tables, **batch.kw(), topk=topk, block_size=block,
            local_blocks=local, fp8_dot=fp8_dot, config_settings={"num_splits": s}, **extra)))
    # fp8 dots rank on quantized queries: near-ties may swap, so only gross failures count.
    limit = 0.25 if fp8_dot else 0.05
    for name, fn in runs:
        got = fn()
        mis = selection_mismatch(torch, got, ref)
        results.append((f"{label} {name}", mis, mis <= limit))


@case("index_prefill", "index_topk prefill (one split: final selection) and split + merge, bf16/fp32 keys")
def case_index_prefill(torch, m3, g):
    results = []
    seqs = [(300, 300), (130, 7), (3, 6), (0, 0), (129, 129)]
    for dtype, page, block, topk, local in [
        (torch.bfloat16, 64, 128, 16, 1),
        (torch.bfloat16, 16, 64, 4, 2),
        (torch.float32, 32, 16, 8, 1),
    ]:
        batch, iq, ik = _index_problem(torch, g, seqs, page, dtype, dim=128 if dtype != torch.float32 else 64)
        _index_runs(torch, m3, results, f"{str(dtype)[6:]} page {page} block {block} top{topk}", batch, iq, ik,
                    topk, block, local, splits=(1, 3))
    return results


@case("index_decode", "index_topk decode (1-4 new tokens per sequence: split kernel + merge kernel)")
def case_index_decode(torch, m3, g):
    results = []
    seqs = [(1000, 1), (64, 4), (1, 1), (257, 2), (0, 1), (5, 3)]
    for page, block, topk in [(64, 128, 16), (16, 16, 6)]:
        batch, iq, ik = _index_problem(torch, g, seqs, page, torch.bfloat16)
        _index_runs(torch, m3, results, f"page {page} block {block} top{topk}", batch, iq, ik, topk, block, 1,
                    splits=(1, 7))
    return results


@case("index_fp8", "index_topk with float8_e4m3fn keys, per-token scales or one scale, with and without fp8 dots")
def case_index_fp8(torch, m3, g):
    results = []
    if not hasattr(torch, "float8_e4m3fn"):
        return [("no float8 in this torch", 0.0, True)]
    for seqs, label in [([(300, 300), (130, 7), (3, 6), (0, 0)], "prefill"), ([(900, 1), (70, 4), (0, 1)], "decode")]:
        batch, iq, ik = _index_problem(torch, g, seqs, 64, torch.bfloat16)
        k = ik.float()
        scale = (k.abs().amax(-1) / 448.0).clamp(min=1e-12)
        codes = (k / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        for fp8_dot in (False, True):
            _index_runs(torch, m3, results, f"{label} fp8_dot={fp8_dot}", batch, iq, codes, 16, 128, 1,
                        scale=scale.contiguous(), fp8_dot=fp8_dot, splits=(1, 3))
        # One scale for the cache: the kernel reads no scale.
        one = (k.abs().amax() / 448.0).clamp(min=1e-12).reshape(1)
        codes1 = (k / one).clamp(-448, 448).to(torch.float8_e4m3fn)
        for fp8_dot in (False, True):
            _index_runs(torch, m3, results, f"{label} one scale, fp8_dot={fp8_dot}", batch, iq, codes1, 16, 128, 1,
                        scale=one, fp8_dot=fp8_dot, splits=(1, 3))
    return results


def _kv_problem(torch, g, seqs, page, dtype, hq, hkv, d):
    batch = Batch(torch, g, seqs, page)
    q = torch.randn(batch.num_tokens, hq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(batch.num_pages, hkv, page, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(batch.num_pages, hkv, page, d, generator=g).to(DEVICE, dtype)
    return batch, q, k, v


def _compare(torch, results, label, got, ref, dtype):
    tol = TOL[str(dtype)]
    e_out = rel_err(torch, got[0], ref[0])
    e_lse = rel_err(torch, got[1], ref[1]) if ref[1] is not None else 0.0
    err = max(e_out, e_lse)
    results.append((label, err, err <= tol))


@case("kvouter", "kvouter_attention: Triton partials over the schedule + Triton combine (and query slices)")
def case_kvouter(torch, m3, g):
    results = []
    seqs = [(300, 40), (17, 17), (3, 6), (0, 0), (260, 1), (129, 3)]
    sliced = "max_workspace_bytes" in inspect.signature(m3.kvouter_attention).parameters
    for dtype, hq, hkv, d, page, block, topk, causal in [
        (torch.bfloat16, 32, 2, 128, 64, 128, 16, True),  # M3's group of 16 (TMA kernel on sm_90)
        (torch.float16, 16, 2, 64, 128, 64, 8, False),  # G = 8, page > block (TMA kernel on sm_90)
        (torch.bfloat16, 8, 8, 64, 16, 16, 4, True),  # MHA, blocks spanning one page
        (torch.float16, 12, 4, 64, 16, 64, 6, False),  # G = 3 (padded), blocks over several pages
        (torch.float32, 8, 2, 32, 32, 32, 5, True),
    ]:
        batch, q, k, v = _kv_problem(torch, g, seqs, page, dtype, hq, hkv, d)
        sel = selection(torch, g, batch, hkv, topk, block, causal=causal).to(DEVICE)
        kw = dict(**batch.kw(), block_size=block, causal=causal, return_lse=True)
        label = f"{str(dtype)[6:]} G{hq // hkv} D{d} page {page} block {block}{'' if causal else ' non-causal'}"
        ref = with_impl("torch", m3.kvouter_attention, q, k, v, sel, batch.block_tables, **kw)
        got = with_impl("triton", m3.kvouter_attention, q, k, v, sel, batch.block_tables, **kw)
        _compare(torch, results, label, got, ref, dtype)
        if sliced:
            # A budget of a few query rows: the partials and combine run per slice.
            got = with_impl("triton", m3.kvouter_attention, q, k, v, sel, batch.block_tables, **kw,
                            max_workspace_bytes=8 * hkv * topk * (hq // hkv) * (d * q.element_size() + 8))
            _compare(torch, results, label + " sliced", got, ref, dtype)
    if "k_scale" in inspect.signature(m3.kvouter_attention).parameters:
        # fp8 q/K/V with per-tensor scales (bf16 partials and output), also in slices.
        f8 = torch.float8_e4m3fn
        batch, q, k, v = _kv_problem(torch, g, seqs, 64, torch.float32, 32, 2, 128)
        sel = selection(torch, g, batch, 2, 16, 128).to(DEVICE)
        q8, k8, v8 = ((x / 0.02).to(f8) for x in (q, k, v))
        kw = dict(**batch.kw(), block_size=128, return_lse=True, q_scale=0.02, k_scale=0.02, v_scale=0.02)
        ref = with_impl("torch", m3.kvouter_attention, q8, k8, v8, sel, batch.block_tables, **kw)
        for label, extra in (("fp8 q/K/V", {}), ("fp8 q/K/V sliced", {"max_workspace_bytes": 8 * 2 * 16 * 16 * 264})):
            got = with_impl("triton", m3.kvouter_attention, q8, k8, v8, sel, batch.block_tables, **kw, **extra)
            _compare(torch, results, label, got, ref, torch.bfloat16)
        if "partial_dtype" in inspect.signature(m3.kvouter_attention).parameters:
            # e4m3 partials (the TMA kernel's fp8 staging tile and store), and a bf16 q over
            # the fp8 caches (K and V widened in shared memory), each with both partial dtypes.
            qb = q8.float().mul(0.02).bfloat16()
            kw_kv = {x: y for x, y in kw.items() if x != "q_scale"}
            for label, qq, kwx in (("fp8 q/K/V", q8, kw), ("bf16 q, fp8 K/V", qb, kw_kv)):
                for pdt in ((f8,) if qq is q8 else (None, f8)):
                    ref = with_impl("torch", m3.kvouter_attention, qq, k8, v8, sel, batch.block_tables, **kwx,
                                    partial_dtype=pdt)
                    got = with_impl("triton", m3.kvouter_attention, qq, k8, v8, sel, batch.block_tables, **kwx,
                                    partial_dtype=pdt)
                    _compare(torch, results, f"{label}, {'e4m3' if pdt else 'bf16'} partials", got, ref, torch.bfloat16)
    # Nothing selected at all: every partial row is the unused tail the programs clear.
    batch, q, k, v = _kv_problem(torch, g, [(40, 5), (7, 2)], 16, torch.bfloat16, 8, 2, 64)
    empty = torch.full((batch.num_tokens, 2, 4), -1, dtype=torch.int32, device=DEVICE)
    got = with_impl("triton", m3.kvouter_attention, q, k, v, empty, batch.block_tables, **batch.kw(), block_size=16,
                    return_lse=True)
    ok = bool((got[0] == 0).all()) and bool(torch.isneginf(got[1]).all())
    results.append(("all slots -1", 0.0 if ok else float("inf"), ok))
    # The same with G = 16, D = 64 (the TMA kernel on sm_90: no tile, only the cleared tail).
    batch, q, k, v = _kv_problem(torch, g, [(40, 5), (7, 2)], 16, torch.bfloat16, 32, 2, 64)
    got = with_impl("triton", m3.kvouter_attention, q, k, v, empty, batch.block_tables, **batch.kw(), block_size=16,
                    return_lse=True)
    ok = bool((got[0] == 0).all()) and bool(torch.isneginf(got[1]).all())
    results.append(("all slots -1, G16", 0.0 if ok else float("inf"), ok))
    return results


@case("dense", "dense_paged_attention on the Triton kernel (causal and bidirectional; forced key splits)")
def case_dense(torch, m3, g):
    results = []
    seqs = [(300, 40), (17, 17), (3, 6), (0, 0), (260, 1), (129, 3)]
    for dtype, hq, hkv, d, page, causal in [
        (torch.bfloat16, 32, 2, 128, 64, True),
        (torch.bfloat16, 12, 4, 64, 16, False),
        (torch.float16, 8, 8, 64, 32, True),
        (torch.float32, 8, 2, 32, 16, True),
    ]:
        batch, q, k, v = _kv_problem(torch, g, seqs, page, dtype, hq, hkv, d)
        kw = dict(**batch.kw(), causal=causal, return_lse=True)
        ref = with_impl("torch", m3.dense_paged_attention, q, k, v, batch.block_tables, **kw)
        got = with_impl("triton", m3.dense_paged_attention, q, k, v, batch.block_tables, **kw)
        label = f"{str(dtype)[6:]} G{hq // hkv} D{d} page {page}{'' if causal else ' non-causal'}"
        _compare(torch, results, label, got, ref, dtype)
        # Key splits (decode's path) written to the workspace and merged: forced here,
        # since these short caches would get one split by default.
        for splits in (3, 8):
            got = with_impl("triton", m3.dense_paged_attention, q, k, v, batch.block_tables, **kw,
                            config_settings={"block_n": 16, "num_splits": splits})
            _compare(torch, results, f"{label} {splits} key splits", got, ref, dtype)
    return results


@case("decode_attention", "sparse_decode_attention (the decode kernel), when m3_sparse exports it; also on kept arrival counts")
def case_decode_attention(torch, m3, g):
    from m3_sparse.decode.attention_triton import sparse_decode_attention_triton

    fn = getattr(m3, "sparse_decode_attention", None)
    if fn is None:
        return None  # not in this tree
    results = []
    params = inspect.signature(fn).parameters
    seqs = [(1000, 1), (64, 4), (1, 1), (257, 2), (0, 1), (5, 3)]
    for dtype, hq, hkv, d, page, block, topk, causal in [
        (torch.bfloat16, 64, 4, 128, 64, 128, 16, True),  # M3
        (torch.bfloat16, 8, 2, 64, 16, 16, 4, True),
        (torch.float16, 12, 4, 64, 32, 64, 6, False),
        (torch.float32, 8, 2, 32, 16, 32, 5, True),
    ]:
        batch, q, k, v = _kv_problem(torch, g, seqs, page, dtype, hq, hkv, d)
        sel = selection(torch, g, batch, hkv, topk, block, causal=causal).to(DEVICE)
        avail = {
            "q": q, "k_cache": k, "v_cache": v, "selected": sel, "block_tables": batch.block_tables,
            "cu_seqlens_q": batch.cu_seqlens_q, "used_kv_lens": batch.used_kv_lens, "block_size": block,
            "causal": causal, "return_lse": True, "max_seqlen_q": max(batch.q_lens), "softmax_scale": None,
            "page_size": page, "topk": topk,
        }
        args, kwargs, missing = [], {}, []
        for name, p in params.items():
            if name in avail:
                if p.kind == p.POSITIONAL_ONLY:
                    args.append(avail[name])
                else:
                    kwargs[name] = avail[name]
            elif p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                missing.append(name)
        if missing:
            return [(f"cannot call sparse_decode_attention: unknown parameters {missing}", float("inf"), False)]
        ref = with_impl("torch", m3.kvouter_attention, q, k, v, sel, batch.block_tables, **batch.kw(),
                        block_size=block, causal=causal, return_lse=True)
        got = with_impl("triton", fn, *args, **kwargs)
        if not isinstance(got, tuple):
            got = (got, None)
        if got[1] is None:
            ref = (ref[0], None)
        label = f"{str(dtype)[6:]} G{hq // hkv} D{d} page {page} block {block}{'' if causal else ' non-causal'}"
        _compare(torch, results, label, got, ref, dtype)
        # The in-place merge on a count buffer kept across calls (left zero by each).
        counts = torch.zeros(q.shape[0] * hkv, dtype=torch.int32, device=DEVICE)
        for i in range(2):
            kept = sparse_decode_attention_triton(
                q, k, v, sel, batch.block_tables, **batch.kw(), block_size=block, causal=causal,
                return_lse=True, config=m3.DecodeConfig(num_splits=3), arrival_counts=counts,
            )
            _compare(torch, results, f"{label}, kept counts, call {i}", kept, ref, dtype)
        results.append((f"{label}, counts left zero", 0.0, int(torch.count_nonzero(counts)) == 0))
    return results


# ----------------------------------------------------------------------------- child


def run_case(name: str, device: str = "cuda", engine: str = "auto") -> int:
    """Run one case once (the process a sanitizer run wraps); 0 if its checks pass.
    ``engine``: the KV-outer partials kernel of the Triton calls (``KVOuterConfig.engine``)."""
    global DEVICE, KVOUTER_ENGINE
    DEVICE, KVOUTER_ENGINE = device, engine
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    import m3_sparse

    if device == "cuda" and not torch.cuda.is_available():
        print(f"case {name}: needs a CUDA device", flush=True)
        return 2
    fn, _ = CASES[name]
    g = torch.Generator().manual_seed(zlib_seed(name))
    start = time.perf_counter()
    results = fn(torch, m3_sparse, g)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if results is None:
        print(f"case {name}: absent", flush=True)
        return 3
    bad = [r for r in results if not r[2]]
    for label, err, ok in results:
        print(f"  {name}: {label}: err {err:.2e} {'ok' if ok else 'MISMATCH'}", flush=True)
    print(f"case {name}: {len(results)} runs, {len(bad)} mismatches, {elapsed:.1f} s", flush=True)
    return 1 if bad else 0


def zlib_seed(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


# ----------------------------------------------------------------------------- driver


def find_sanitizer(explicit: str | None) -> str | None:
    for cand in (explicit, os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer"),
                 "/usr/local/cuda/bin/compute-sanitizer"):
        if cand and Path(cand).exists():
            return cand
    return None


ERROR_RE = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+error")
RACE_RE = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards? displayed\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")


FINDING_RE = re.compile(r"^=+ +(Invalid|Race|Error|Warning|Uninitialized|Barrier|.*[Hh]azard)", re.M)


def parse_log(text: str) -> dict:
    m = ERROR_RE.findall(text)
    r = RACE_RE.findall(text)
    first = FINDING_RE.search(text)
    return {
        # racecheck reports a RACECHECK SUMMARY (hazards) instead of an ERROR SUMMARY.
        "errors": sum(int(x) for x in m) if m else (sum(int(x[1]) for x in r) if r else None),
        "summaries": len(m),
        "race_errors": sum(int(x[1]) for x in r) if r else None,
        "race_warnings": sum(int(x[2]) for x in r) if r else None,
        # The report's first lines (access, kernel, thread): later ones are often cascades.
        "first_finding": "\n".join(text[first.start():].splitlines()[:4]) if first else None,
    }


def child_cmd(name: str, device: str = "cuda", engine: str = "auto") -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--case", name, "--device", device, "--engine", engine]


def run_proc(cmd, env, timeout, log_path: Path) -> tuple[int | None, float, str]:
    """Run ``cmd`` in its own process group (the sanitizer starts the Python process as
    its child: on a timeout both must go); returns (exit status or None, seconds, output)."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        out = (out or "") + f"\n[killed after {timeout} s]\n"
        rc = None
    log_path.write_text(out)
    return rc, time.perf_counter() - start, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", help="run one case once, without the sanitizer (what each sanitizer run wraps)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to try the cases in the Triton interpreter")
    ap.add_argument("--list", action="store_true", help="list the cases")
    ap.add_argument(
        "--engine", default="auto", choices=("auto", "triton"),
        help="KV-outer partials kernel: auto (the TMA kernel on sm_90) or triton (the tl kernel). initcheck does "
        "not count bytes a TMA store writes as initialized: with auto it flags the combine's reads of partial O",
    )
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases (default: all)")
    ap.add_argument("--tools", default="memcheck,racecheck", help="compute-sanitizer tools (also initcheck, synccheck)")
    ap.add_argument("--jobs", type=int, default=6, help="sanitizer processes at once (they share the one GPU)")
    ap.add_argument("--timeout", type=int, default=170, help="seconds per process")
    ap.add_argument("--sanitizer", help="compute-sanitizer binary (default: $COMPUTE_SANITIZER, PATH, /usr/local/cuda/bin)")
    ap.add_argument("--out", help="directory for logs and sanitize.json (default: $OUT/sanitize or out/sanitize)")
    args = ap.parse_args()

    if args.list:
        for name, (_, what) in CASES.items():
            print(f"{name:18s} {what}")
        return 0
    if args.case:
        return run_case(args.case, args.device, args.engine)

    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {list(CASES)}")
    tools = [t for t in args.tools.split(",") if t]
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("compute-sanitizer not found (give --sanitizer PATH)", file=sys.stderr)
        return 2
    out_dir = Path(args.out or Path(os.environ.get("OUT", ROOT / "out")) / "sanitize")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # Outside the output folder: compiled kernels are not results.
    env.setdefault("TRITON_CACHE_DIR", str(Path(tempfile.gettempdir()) / "m3_sparse_sanitize_triton_cache"))
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    print(f"sanitizer: {sanitizer}\ncases: {names}\ntools: {tools}\ntriton cache: {env['TRITON_CACHE_DIR']}", flush=True)

    # 1. Warm-up without the sanitizer: compiles every kernel variant into the cache
    #    and checks each case's results.
    warm = {}
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futs = {
            pool.submit(run_proc, child_cmd(n, args.device, args.engine), env, args.timeout, out_dir / f"{n}.warmup.log"): n
            for n in names
        }
        for f in cf.as_completed(futs):
            n = futs[f]
            rc, secs, out = f.result()
            warm[n] = {"rc": rc, "seconds": round(secs, 1)}
            tail = out.strip().splitlines()[-1] if out.strip() else ""
            print(f"warm-up {n}: rc {rc}, {secs:.1f} s: {tail}", flush=True)
    runnable = [n for n in names if warm[n]["rc"] in (0, 1)]  # 3 = absent, None/other = crashed

    # 2. Under each tool, one process per (case, tool).
    jobs = [(n, t) for t in tools for n in runnable]
    res = {}

    def sanitize(n, t):
        log = out_dir / f"{n}.{t}.log"
        cmd = [sanitizer, "--tool", t, "--target-processes", "all", "--print-limit", "20",
               "--log-file", str(log)] + child_cmd(n, args.device, args.engine)
        rc, secs, out = run_proc(cmd, env, args.timeout, out_dir / f"{n}.{t}.stdout.log")
        text = log.read_text(errors="replace") if log.exists() else ""
        return n, t, rc, secs, parse_log(text + out)

    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for f in cf.as_completed([pool.submit(sanitize, n, t) for n, t in jobs]):
            n, t, rc, secs, parsed = f.result()
            res[(n, t)] = {"rc": rc, "seconds": round(secs, 1), **parsed}
            print(f"{t} {n}: rc {rc}, {secs:.1f} s, errors {parsed['errors']}", flush=True)

    # 3. Table.
    failed = False
    lines = ["", "| case | warm-up | " + " | ".join(tools) + " |", "|---|---|" + "---|" * len(tools)]
    for n in names:
        w = warm[n]
        if w["rc"] == 3:
            lines.append(f"| {n} | absent | " + " | ".join("-" for _ in tools) + " |")
            continue
        wtxt = f"{w['seconds']} s" + ("" if w["rc"] == 0 else " CHECK FAILED" if w["rc"] == 1 else f" rc {w['rc']}")
        failed |= w["rc"] != 0
        cells = []
        for t in tools:
            r = res.get((n, t))
            if r is None:
                cells.append("not run")
                failed = True
                continue
            if r["errors"] is None:
                cells.append("no summary (timeout?)" if r["rc"] is None else f"no summary, rc {r['rc']}")
                failed = True
                continue
            cell = f"{r['errors']} errors"
            if t == "racecheck" and r["race_warnings"] is not None:
                cell += f" ({r['race_errors']} hazard errors, {r['race_warnings']} warnings)"
            cell += f", {r['seconds']} s"
            if r["rc"] not in (0,):
                cell += f", rc {r['rc']}"
            failed |= r["errors"] > 0 or r["rc"] != 0
            cells.append(cell)
        lines.append(f"| {n} | {wtxt} | " + " | ".join(cells) + " |")
    for (n, t), r in sorted(res.items()):
        if r.get("first_finding") and (r["errors"] or r.get("race_warnings")):
            lines.append(f"\nfirst finding, {n} / {t}:\n{r['first_finding']}")
    total = time.perf_counter() - t0
    lines.append(f"\ntotal {total:.0f} s; logs in {out_dir}; {'FAILED' if failed else 'all clean'}")
    print("\n".join(lines), flush=True)
    summary = {
        "sanitizer": sanitizer,
        "tools": tools,
        "warmup": warm,
        "runs": {f"{n}/{t}": r for (n, t), r in res.items()},
        "seconds": round(total, 1),
        "failed": failed,
    }
    common.write_json(out_dir / "sanitize.json", {**common.environment(), **summary})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
