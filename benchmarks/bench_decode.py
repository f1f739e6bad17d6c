"""Sparse decode attention on the GPU: the query-outer decode kernel (``sparse_decode_attention``,
``triton_decode.py``) against KV-outer (``kvouter_attention``), dense decode attention with
SDPA and the HBM floor, then the crossover in query tokens per sequence.

Workload (M3_SPEC sections 1 and 5): Hq 64, Hkv 4, D 128, block 128, top-16, bf16, K/V in a
paged cache (page 128, and 64) under a shuffled block table; every query token selects its
local block plus 15 random earlier blocks ("random"; ``--pattern hot`` for shared popularity).

    python3 benchmarks/bench_decode.py            # launch sweep, (a) decode, (b) crossover
    python3 benchmarks/bench_decode.py --quick    # a tiny smoke run of every code path

Sections:

* sweep: launch variants of the decode kernel (keys per chunk, warps, pipeline stages,
  programs per SM, which sets the split count) at batch 32 x the largest context; the
  fastest is used for the rest of the run (the defaults are timed as well);
* (a) decode, batch 32, one new token per sequence, each context: the decode kernel
  (eager call of the public entry, and one call captured in a CUDA graph and replayed),
  ``kvouter_attention`` (the module: Triton index build, schedule, partials and
  combine; eager, and graph-captured if it captures), dense SDPA over the full context on a
  contiguous [B, Hkv, S, D] cache (the backend that accepted the shapes is named), and the
  floor: bytes of the distinct selected K/V blocks (visible keys only) + q + out at 4.2 TB/s;
* (b) crossover: the last n tokens of each sequence as queries, n in --q-tokens, one
  sequence of each context and batch variants; decode vs KV-outer, with the reuse
  ``(token, head) selections / distinct selected blocks`` and ``nsb / N``.

"in-graph" times a call inside a graph of 20 calls, each after a 256 MB L2 flush, minus the
flushes alone; the flush zeroes a buffer (the L2 is left full of dirty lines, which the call
writes back while it reads) or, for the "clean L2" columns, sums it (clean lines: the call
moves its own bytes only, as after the index kernel in a decode step).

Every configuration is checked against an fp32 torch computation on sampled tokens before
it is timed. Times: ``triton.testing.do_bench`` medians (L2 cleared before every run), in
microseconds. The last thing printed is a markdown table, also written to
``$OUT/bench_decode.md`` (with the log in ``bench_decode.log``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "torch-ext"))

# A hidden CPU smoke run of the script's own logic: the Triton kernels in the interpreter
# at tiny sizes, plain wall-clock timing instead of CUDA events and graphs.
SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["M3_SPARSE_IMPL"] = "triton"
DEV = torch.device("cpu" if SMOKE else "cuda")

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import m3_sparse  # noqa: E402
from m3_sparse import triton_decode as tdec  # noqa: E402
from m3_sparse.triton_index_topk import _index_topk_launch  # noqa: E402
from bench_index import canon, quantize_e4m3, quantize_e4m3_tensor  # noqa: E402

HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
G = HQ // HKV
PEAK_BYTES = 4.2e12  # device-to-device copy, read + write (M3_SPEC section 3)
LOG: list[str] = []


def log(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


# --------------------------------------------------------------------------- workload


class Pool:
    """K/V of ``batch`` sequences of ``ctx`` tokens each in a paged cache with a shuffled
    block table; problems take the first sequences of it."""

    def __init__(self, ctx: int, page: int, batch: int, seed: int = 0):
        dev = DEV
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        self.ctx, self.page, self.batch, self.gen = ctx, page, batch, gen
        w = -(-ctx // page)
        pages = batch * w
        self.k = torch.randn(pages, HKV, page, D, device=dev, dtype=torch.bfloat16, generator=gen)
        self.v = torch.randn(pages, HKV, page, D, device=dev, dtype=torch.bfloat16, generator=gen)
        self.bt = torch.randperm(pages, device=dev, generator=gen).to(torch.int32).view(batch, w)

    def problem(self, b: int, n: int, pattern: str) -> dict:
        """``b`` sequences of ``ctx`` tokens, the last ``n`` of each are this call's queries."""
        dev = self.k.device
        q = torch.randn(b * n, HQ, D, device=dev, dtype=torch.bfloat16, generator=self.gen)
        cu = torch.arange(0, b * n + 1, n, device=dev, dtype=torch.int32)
        kv = torch.full((b,), self.ctx, device=dev, dtype=torch.int32)
        pos = (self.ctx - n + torch.arange(n, device=dev)).repeat(b)  # [b * n]
        sel = make_selection(pattern, pos, b, n, self.ctx, self.gen)
        return dict(q=q, k=self.k, v=self.v, bt=self.bt[:b].contiguous(), cu=cu, kv=kv, sel=sel, b=b, n=n, pos=pos)


def make_selection(pattern: str, pos: torch.Tensor, b: int, n: int, ctx: int, gen) -> torch.Tensor:
    """[b * n, HKV, TOPK] int32: the local block plus the best TOPK - 1 earlier blocks by a
    random score (uniform, or "hot": shared per-sequence popularity plus noise)."""
    dev = pos.device
    nb = -(-ctx // BLOCK)
    local = pos // BLOCK
    sel = torch.full((b * n, HKV, TOPK), -1, dtype=torch.int32, device=dev)
    kk = min(TOPK - 1, nb)
    chunk = max(1, (1 << 28) // (HKV * nb))
    pop = torch.randn(b, HKV, nb, device=dev, generator=gen) if pattern == "hot" else None
    for t0 in range(0, b * n, chunk):
        t1 = min(b * n, t0 + chunk)
        if pattern == "hot":
            score = 2 * pop[torch.arange(t0, t1, device=dev) // n] + 0.5 * torch.randn(
                t1 - t0, HKV, nb, device=dev, generator=gen
            )
        elif pattern == "random":
            score = torch.rand(t1 - t0, HKV, nb, device=dev, generator=gen)
        else:
            raise ValueError(f"--pattern: expected random or hot, got {pattern!r}")
        earlier = torch.arange(nb, device=dev)[None, None, :] < local[t0:t1, None, None]
        score = score.masked_fill(~earlier, float("-inf"))
        if kk > 0:
            val, idx = score.topk(kk, -1)
            sel[t0:t1, :, 1 : 1 + kk] = torch.where(val > float("-inf"), idx, -1).to(torch.int32)
        sel[t0:t1, :, 0] = local[t0:t1, None].to(torch.int32)
        del score
    return sel


def reuse_stats(p: dict) -> dict:
    """Distinct selected (sequence, kv head, block)s, their visible keys (the floor's K/V
    bytes), and the selections per distinct block."""
    sel, pos, b, n = p["sel"].long(), p["pos"], p["b"], p["n"]
    nb = p["bt"].shape[1] * p["k"].shape[2] // BLOCK
    seq = torch.arange(b * n, device=sel.device) // n
    key = (seq[:, None, None] * HKV + torch.arange(HKV, device=sel.device)[None, :, None]) * nb + sel
    valid = sel >= 0
    # Visible keys of a block: up to the latest query of the sequence that selected it.
    last = torch.full((b * HKV * nb,), -1, dtype=torch.int64, device=sel.device)
    last.scatter_reduce_(0, key[valid], pos[:, None, None].expand_as(sel)[valid], reduce="amax")
    blk = torch.arange(b * HKV * nb, device=sel.device) % nb
    keys = (last - blk * BLOCK + 1).clamp(min=0, max=BLOCK)
    nsb = int((last >= 0).sum())
    selections = int(valid.sum())
    return dict(nsb=nsb, keys=int(keys.sum()), selections=selections, N=b * n)


def floor_us(p: dict, st: dict) -> float:
    kv_bytes = st["keys"] * D * 2 * 2  # K and V, bf16
    qo_bytes = 2 * p["q"].numel() * 2
    return (kv_bytes + qo_bytes) / PEAK_BYTES * 1e6


def sampled_reference(p: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention (fp32) of query rows ``tokens`` over their deduplicated selected blocks."""
    q, k, v, sel, bt, cu, kv = (p[x] for x in ("q", "k", "v", "sel", "bt", "cu", "kv"))
    page = k.shape[2]
    tokens = tokens.long()
    seq = torch.searchsorted(cu[1:].long(), tokens, right=True)
    pos = kv.long()[seq] - cu.long()[seq + 1] + tokens
    s_sel = sel[tokens].long()
    before = torch.ones(TOPK, TOPK, dtype=torch.bool, device=q.device).tril(-1)
    earlier = (s_sel[..., :, None] == s_sel[..., None, :]) & before
    ok = (s_sel >= 0) & ~earlier.any(-1)
    kpos = s_sel.clamp(min=0)[..., None] * BLOCK + torch.arange(BLOCK, device=q.device)  # [n, Hkv, K, B]
    vis = ok[..., None] & (kpos <= pos[:, None, None, None])
    kpos = kpos.clamp(max=bt.shape[1] * page - 1)
    pg = bt.long()[seq[:, None, None, None], kpos // page]
    heads = torch.arange(HKV, device=q.device)[None, :, None, None]
    kk = k[pg, heads, kpos % page].float().flatten(2, 3)  # [n, Hkv, K*B, D]
    vv = v[pg, heads, kpos % page].float().flatten(2, 3)
    qq = q[tokens].float().view(-1, HKV, G, D)
    s = torch.einsum("nhgd,nhkd->nhgk", qq, kk) * D**-0.5
    s = s.masked_fill(~vis.flatten(2, 3)[:, :, None, :], float("-inf"))
    out = torch.einsum("nhgk,nhkd->nhgd", torch.softmax(s, -1), vv).reshape(-1, HQ, D)
    return out, torch.logsumexp(s, -1).reshape(-1, HQ).T


# bf16 output rounding is ~4e-3 relative; anything far above it is a wrong result.
ERR_LIMIT = 2e-2


def check(p: dict, out: torch.Tensor, lse: torch.Tensor, n_check: int = 8) -> float:
    """Max relative RMS error (out, lse) on the first and last sampled tokens."""
    t = p["q"].shape[0]
    tokens = torch.unique(torch.cat([torch.arange(0, min(t, n_check // 2)), torch.arange(max(0, t - n_check // 2), t)]))
    tokens = tokens.to(p["q"].device)
    ref, ref_lse = sampled_reference(p, tokens)
    e_out = (out[tokens].float() - ref).norm() / ref.norm()
    e_lse = (lse[:, tokens] - ref_lse).norm() / ref_lse.norm()
    err = max(float(e_out), float(e_lse))
    if not err <= ERR_LIMIT:
        log(f"  CHECK FAILED: relative error {err:.2e} against the fp32 reference (limit {ERR_LIMIT:.0e})")
    return err


# --------------------------------------------------------------------------- timing


def bench(fn, rep_ms: int = 100) -> float:
    """Median microseconds (L2 cleared before every run)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def graph_of(fn):
    """One call of ``fn`` captured in a CUDA graph (after warm-up calls on a side stream)."""
    if SMOKE:
        return type("Replay", (), {"replay": staticmethod(fn)})()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    sync()
    return graph


def bench_graph(fn, rep_ms: int = 100) -> float:
    graph = graph_of(fn)
    t = bench(graph.replay, rep_ms)
    del graph
    return t


def bench_graph_amortized(fn, calls: int = 20, reps: int = 15, flush_mode: str = "write") -> float:
    """Median microseconds per call inside one graph of ``calls`` calls, each after a
    256 MB L2 flush, minus a graph of the flushes alone: what a call costs inside a
    captured decode step (launch gaps included, the one-off graph launch not).

    ``flush_mode="write"`` flushes by zeroing the buffer, which leaves the L2 full of
    dirty lines that the call then writes back to HBM while it reads (as after a layer
    that wrote its output); ``"read"`` flushes by summing it, which leaves clean lines
    (as after the index kernel, which only reads): the call moves its own bytes only."""
    if flush_mode not in ("write", "read"):
        raise ValueError(f"flush_mode: expected 'write' or 'read', got {flush_mode!r}")
    if SMOKE:
        return bench(fn)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    flush_words = flush.view(torch.int32)
    flush_words.fill_(1)
    total = torch.empty((), dtype=torch.int64, device=DEV)

    def one_flush():
        if flush_mode == "write":
            flush.zero_()
        else:
            torch.sum(flush_words, dim=0, dtype=torch.int64, out=total)

    def many(with_call):
        def run():
            for _ in range(calls):
                one_flush()
                if with_call:
                    fn()
        return graph_of(run)

    def timed(graph):
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return sorted(times)[len(times) // 2]

    g_both, g_flush = many(True), many(False)
    t = (timed(g_both) - timed(g_flush)) / calls
    del g_both, g_flush, flush, flush_words, total
    return t


KVOUTER_GRAPH = {"ok": True, "why": ""}


def bench_kvouter_graph(fn) -> float | None:
    """KV-outer captured in a graph, once it is known to capture (first failure disables it)."""
    if not KVOUTER_GRAPH["ok"]:
        return None
    try:
        return bench_graph(fn)
    except Exception as e:  # noqa: BLE001
        KVOUTER_GRAPH.update(ok=False, why=f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
        log(f"  kvouter_attention does not capture in a CUDA graph ({KVOUTER_GRAPH['why']}); eager only from here")
        try:
            sync()
        except Exception as e2:  # noqa: BLE001
            log(f"  after the failed capture: {type(e2).__name__}: {str(e2).splitlines()[0][:100]}")
        return None


def empty_cache():
    if not SMOKE:
        torch.cuda.empty_cache()


def kernel_info(kernel) -> str:
    """Registers, spills and shared memory of the kernel's latest compiled variant."""
    try:
        caches = getattr(kernel, "device_caches", None)
        compiled = list(next(iter(caches.values()))[0].values())[-1]
        return f"regs {compiled.n_regs} spills {compiled.n_spills} smem {compiled.metadata.shared // 1024}K"
    except Exception as e:  # noqa: BLE001
        return f"(no info: {type(e).__name__})"


def decode_call(p: dict, return_lse: bool = False):
    return lambda: m3_sparse.sparse_decode_attention(  # noqa: E731
        p["q"], p["k"], p["v"], p["sel"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], block_size=BLOCK,
        return_lse=return_lse,
    )


def kernel_call(p: dict, **launch):
    """The decode kernels alone (no argument checks), with launch overrides."""
    return lambda: tdec.run_decode_triton(  # noqa: E731
        p["q"], p["k"], p["v"], p["sel"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], softmax_scale=D**-0.5,
        causal=True, block_size=BLOCK, return_lse=False, batch=p["b"], **launch,
    )


def fp8_problem(p: dict) -> dict:
    """The same problem with K/V in e4m3 and per-tensor scales (q stays bf16)."""
    out = dict(p)
    for name in ("k", "v"):
        scale = p[name].abs().amax().float() / 448.0
        out[name] = (p[name].float() / scale).to(torch.float8_e4m3fn)
        out[f"{name}_scale"] = scale.reshape(1)
    return out


def decode_fp8_call(p: dict, return_lse: bool = False):
    return lambda: m3_sparse.sparse_decode_attention(  # noqa: E731
        p["q"], p["k"], p["v"], p["sel"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], block_size=BLOCK,
        return_lse=return_lse, k_scale=p["k_scale"], v_scale=p["v_scale"],
    )


def kvouter_call(p: dict, return_lse: bool = False):
    return lambda: m3_sparse.kvouter_attention(  # noqa: E731
        p["q"], p["k"], p["v"], p["sel"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], block_size=BLOCK,
        return_lse=return_lse,
    )


def dense_sdpa(p: dict, ctx: int) -> tuple[float | None, str]:
    """Dense decode attention over the full context, one query per sequence, on a contiguous
    [B, Hkv, S, D] cache. With one query and no mask the G heads of a kv head are G query
    rows of the same K/V, so q is viewed as [B, Hkv, G, D] (no GQA expansion needed)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = p["b"]
    q = p["q"].view(b, HKV, G, D)
    k = torch.randn(b, HKV, ctx, D, device=q.device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    result = (None, "no backend accepted the shapes")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                fn = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
                fn()
                sync()
                result = (bench(fn), backend.name.lower().replace("_attention", ""))
            break
        except RuntimeError as e:
            log(f"  sdpa {backend.name} refused: {str(e).splitlines()[0][:100]}")
    k = v = fn = None  # free the dense cache before the next configuration
    empty_cache()
    return result


# --------------------------------------------------------------------------- sections


def sweep(pool: Pool, args) -> tuple[dict, list[str]]:
    """Launch variants at batch args.batch x 1 token; returns (best config, table lines)."""
    p = pool.problem(min(args.batch, pool.batch), 1, args.pattern)
    st = reuse_stats(p)
    fl = floor_us(p, st)
    ref = kernel_call(p)()
    lines = ["| block_n | warps | stages | programs/SM | merge | splits | graph us | x floor | in-graph us | x floor | "
             "in-graph us, clean L2 | x floor | kernel |", "|" + "---|" * 13]
    kept = torch.zeros(p["q"].shape[0] * HKV, dtype=torch.int32, device=DEV)
    best, best_t = None, float("inf")
    saved = dict(tdec.DECODE_CONFIG)
    for var in args.variants:
        bn, w, s_, pps, fused, keep, forced = var
        tdec.DECODE_CONFIG.update(block_n=bn, num_warps=w, num_stages=s_, programs_per_sm=pps, fused_merge=bool(fused))
        splits = forced or tdec.default_num_splits(p["q"].shape[0], HKV, TOPK, BLOCK, p["q"].device)
        extra = {"arrival_counts": kept} if keep else {}
        if forced:
            extra["num_splits"] = forced
        fn = kernel_call(p, **extra)
        try:
            out, _ = fn()
            diff = float((out.float() - ref[0].float()).norm() / ref[0].float().norm())
            if diff > 2e-2:
                raise RuntimeError(f"differs from the default launch by {diff:.2e}")
            info = kernel_info(tdec._decode_split_kernel)
            t = bench_graph(fn)
            ta = bench_graph_amortized(fn)
            tc = bench_graph_amortized(fn, flush_mode="read")
        except Exception as e:  # noqa: BLE001
            t = ta = tc = float("nan")
            info = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        merge = ("in place, kept counts" if keep else "in place") if fused and splits > 1 else "kernel" if splits > 1 else "-"
        lines.append(f"| {bn} | {w} | {s_} | {pps} | {merge} | {splits} | {t:.1f} | {t / fl:.2f} | {ta:.1f} | "
                     f"{ta / fl:.2f} | {tc:.1f} | {tc / fl:.2f} | {info} |")
        log(lines[-1])
        # Kept counts and forced split counts are not DECODE_CONFIG settings.
        if t < best_t and not keep and not forced:
            best, best_t = dict(block_n=bn, num_warps=w, num_stages=s_, programs_per_sm=pps, fused_merge=bool(fused)), t
    tdec.DECODE_CONFIG.clear()
    tdec.DECODE_CONFIG.update(saved)
    log(f"  floor {fl:.1f} us; best {best} at {best_t:.1f} us")
    del p, ref
    return best or saved, lines


def decode_section(pool: Pool, args, default_cfg: dict, best_cfg: dict) -> dict:
    """(a): batch args.batch, 1 new token each."""
    p = pool.problem(min(args.batch, pool.batch), 1, args.pattern)
    st = reuse_stats(p)
    r = dict(section="a", ctx=pool.ctx, page=pool.page, b=p["b"], n=1, **st)
    r["floor"] = floor_us(p, st)
    out, lse = decode_call(p, True)()
    r["err_decode"] = check(p, out, lse)
    out, lse = kvouter_call(p, True)()
    r["err_kvouter"] = check(p, out, lse)
    del out, lse
    tdec.DECODE_CONFIG.update(default_cfg)
    r["decode_default_graph"] = bench_graph(decode_call(p))
    tdec.DECODE_CONFIG.update(best_cfg)
    r["decode_eager"] = bench(decode_call(p))
    r["decode_graph"] = bench_graph(decode_call(p))
    r["decode_in_graph"] = bench_graph_amortized(decode_call(p))
    r["decode_in_graph_clean"] = bench_graph_amortized(decode_call(p), flush_mode="read")
    r["splits"] = tdec.default_num_splits(p["q"].shape[0], HKV, TOPK, BLOCK, p["q"].device)
    r["kvouter_eager"] = bench(kvouter_call(p))
    r["kvouter_graph"] = bench_kvouter_graph(kvouter_call(p))
    if args.dense:
        r["dense"], r["dense_backend"] = dense_sdpa(p, pool.ctx)
    if args.fp8:
        # fp8 K/V: half the K/V bytes; the error is against the bf16 inputs (quantization included).
        p8 = fp8_problem(p)
        out, lse = decode_fp8_call(p8, True)()
        r["err_fp8"] = check(p, out, lse)
        del out, lse
        r["decode_fp8_graph"] = bench_graph(decode_fp8_call(p8))
        r["decode_fp8_in_graph"] = bench_graph_amortized(decode_fp8_call(p8))
        r["decode_fp8_in_graph_clean"] = bench_graph_amortized(decode_fp8_call(p8), flush_mode="read")
        r["floor_fp8"] = (st["keys"] * D * 2 + 2 * p["q"].numel() * 2) / PEAK_BYTES * 1e6
        log(f"  (a) fp8 K/V: decode {r['decode_fp8_graph']:.1f} us graph | floor {r['floor_fp8']:.1f} us | "
            f"err vs bf16 inputs {r['err_fp8']:.1e}")
        del p8
    log(
        f"  (a) ctx {pool.ctx} page {pool.page} B {p['b']}: decode {r['decode_eager']:.1f} eager / "
        f"{r['decode_graph']:.1f} graph ({r['decode_default_graph']:.1f} default config, {r['splits']} splits) | "
        f"kvouter {r['kvouter_eager']:.1f} eager / {r['kvouter_graph'] or float('nan'):.1f} graph | dense "
        f"{r.get('dense') or float('nan'):.1f} ({r.get('dense_backend', '-')}) | floor {r['floor']:.1f} us | "
        f"err {r['err_decode']:.1e} / {r['err_kvouter']:.1e}"
    )
    del p
    return r


HI, DI = 4, 128  # index heads, index head dim


def step_section(pool: Pool, args) -> list[dict]:
    """(c): one sparse layer's decode step, batch args.batch x 1 new token: the index
    top-k over the paged index keys (bf16, or e4m3 with the fp8 dot and per-token scales or
    one scale for the cache)
    and the decode attention on its selections, captured together; each part also alone,
    all as calls inside a graph of many (L2 flushed before each). Dense decode attention
    over the full context in the same run."""
    p = pool.problem(min(args.batch, pool.batch), 1, args.pattern)
    b, dev = p["b"], p["q"].device
    gen = pool.gen
    pages = pool.k.shape[0]
    iq = torch.randn(b, HI, DI, device=dev, dtype=torch.bfloat16, generator=gen)
    ik = torch.randn(pages, pool.page, DI, device=dev, dtype=torch.bfloat16, generator=gen)
    ik8, ik_scale = quantize_e4m3(ik)
    # One scale for the cache (M3PagedCache(index_k_scale=...)): no scale read in the kernel.
    ik8_one, one_scale = quantize_e4m3_tensor(ik)
    kept = torch.zeros(b * HKV, dtype=torch.int32, device=dev)
    dense = dense_sdpa(p, pool.ctx)[0] if args.dense else None
    # Floors: the index keys read once, and the selected K/V (the step's own selections).
    idx_floor = {"bf16": b * pool.ctx * DI * 2 / PEAK_BYTES * 1e6, "fp8": b * pool.ctx * (DI + 4) / PEAK_BYTES * 1e6,
                 "fp8, one scale": b * pool.ctx * DI / PEAK_BYTES * 1e6}
    rows = []
    for keys, cache, extra in (
        ("bf16", ik, {}),
        ("fp8", ik8, {"index_k_scale": ik_scale, "fp8_dot": True}),
        ("fp8, one scale", ik8_one, {"index_k_scale": one_scale, "fp8_dot": True}),
    ):
        def index():
            return m3_sparse.index_topk(
                iq, cache, p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], topk=TOPK, block_size=BLOCK,
                max_seqlen_q=1, **extra,
            )

        sel = index()
        ps = dict(p, sel=sel)
        st = reuse_stats(ps)
        out, lse = decode_call(ps, True)()
        err = check(ps, out, lse)
        del out, lse

        def attention(counts=None, chosen=None):
            chosen = sel if chosen is None else chosen
            if counts is None:
                return m3_sparse.sparse_decode_attention(
                    p["q"], p["k"], p["v"], chosen, p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"],
                    block_size=BLOCK,
                )
            return tdec.sparse_decode_attention_triton(
                p["q"], p["k"], p["v"], chosen, p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"],
                block_size=BLOCK, arrival_counts=counts,
            )

        def step(counts=None):
            return attention(counts, index())

        r = dict(keys=keys, ctx=pool.ctx, b=b, err=err, dense=dense, index_floor=idx_floor[keys],
                 attn_floor=floor_us(ps, st))
        r["index"] = bench_graph_amortized(index)
        # Key-range splits of the index kernel (the default comes from the SM count).
        r["index_splits"] = {}
        for sp in args.index_splits:
            def index_sp(sp=sp):
                return _index_topk_launch(
                    iq, cache, p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], topk=TOPK, block_size=BLOCK,
                    max_seqlen_q=1, num_splits=sp, **extra,
                )
            same = bool(torch.equal(canon(index_sp()), canon(sel)))
            r["index_splits"][sp] = (bench_graph_amortized(index_sp), same)
            log(f"  (c) {keys} index keys, {sp} splits: {r['index_splits'][sp][0]:.1f} us, same selection {same}")
        r["attention"] = bench_graph_amortized(attention)
        r["attention_kept"] = bench_graph_amortized(lambda: attention(kept))
        r["step"] = bench_graph_amortized(step)
        r["step_kept"] = bench_graph_amortized(lambda: step(kept))
        rows.append(r)
        log(f"  (c) {keys} index keys: index {r['index']:.1f} | attention {r['attention']:.1f} "
            f"({r['attention_kept']:.1f} kept counts) | step {r['step']:.1f} ({r['step_kept']:.1f}) | dense "
            f"{dense or float('nan'):.1f} us | err {err:.1e}")
        del sel, ps
    del p, iq, ik, ik8, ik_scale, ik8_one
    empty_cache()
    return rows


def table_c(rows: list[dict]) -> str:
    lines = [
        "| index keys | ctx | B | index us (floor) | attention us (floor) | attention, kept counts | step us | "
        "step, kept counts | dense us | dense / step | dense / step, kept counts |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        d = r["dense"]
        lines.append(
            f"| {r['keys']} | {kib(r['ctx'])} | {r['b']} | {r['index']:.1f} ({r['index_floor']:.1f}) | "
            f"{r['attention']:.1f} ({r['attn_floor']:.1f}) | {r['attention_kept']:.1f} | {r['step']:.1f} | "
            f"{r['step_kept']:.1f} | {fmt(d)} | {fmt(d / r['step'] if d else None, 2)} | "
            f"{fmt(d / r['step_kept'] if d else None, 2)} |"
        )
    for r in rows:
        for sp, (t, same) in r.get("index_splits", {}).items():
            lines.append(f"| {r['keys']}, index with {sp} splits | | | {t:.1f} | | | | | | | same selection: {same} |")
    return "\n".join(lines)


def crossover_point(pool: Pool, b: int, n: int, args) -> dict:
    """(b): b sequences, the last n tokens of each are queries."""
    p = pool.problem(b, n, args.pattern)
    st = reuse_stats(p)
    r = dict(section="b", ctx=pool.ctx, page=pool.page, b=b, n=n, **st)
    r["floor"] = floor_us(p, st)
    out, lse = decode_call(p, True)()
    r["err_decode"] = check(p, out, lse)
    out, lse = kvouter_call(p, True)()
    r["err_kvouter"] = check(p, out, lse)
    del out, lse
    rep = 100 if b * n <= 4096 else 300
    r["decode_eager"] = bench(decode_call(p), rep)
    r["decode_graph"] = bench_graph(decode_call(p), rep)
    r["kvouter_eager"] = bench(kvouter_call(p), rep)
    r["kvouter_graph"] = bench_kvouter_graph(kvouter_call(p))
    r["splits"] = tdec.default_num_splits(p["q"].shape[0], HKV, TOPK, BLOCK, p["q"].device)
    log(
        f"  (b) ctx {pool.ctx} B {b} n {n}: nsb {st['nsb']} N {st['N']} reuse "
        f"{st['selections'] / max(1, st['nsb']):.2f} | decode {r['decode_eager']:.1f} eager / "
        f"{r['decode_graph']:.1f} graph ({r['splits']} splits) | kvouter {r['kvouter_eager']:.1f} eager / "
        f"{r['kvouter_graph'] or float('nan'):.1f} graph | floor {r['floor']:.1f} us | "
        f"err {r['err_decode']:.1e} / {r['err_kvouter']:.1e}"
    )
    del p
    empty_cache()
    return r


# --------------------------------------------------------------------------- report


def kib(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def table_a(rows: list[dict]) -> str:
    lines = [
        "| ctx | page | B | decode graph us | decode in-graph us | in-graph, clean L2 | decode eager us | "
        "default config graph us | splits | KV-outer eager us | KV-outer graph us | dense SDPA us (backend) | floor us | "
        "decode graph / floor | in-graph / floor | in-graph clean / floor | KV-outer / decode (graph) | err |",
        "|" + "---|" * 18,
    ]
    for r in rows:
        kvg = r.get("kvouter_graph")
        lines.append(
            f"| {kib(r['ctx'])} | {r['page']} | {r['b']} | {fmt(r['decode_graph'])} | {fmt(r['decode_in_graph'])} | "
            f"{fmt(r['decode_in_graph_clean'])} | {fmt(r['decode_eager'])} | "
            f"{fmt(r['decode_default_graph'])} | {r['splits']} | {fmt(r['kvouter_eager'])} | {fmt(kvg)} | "
            f"{fmt(r.get('dense'))} ({r.get('dense_backend', '-')}) | {fmt(r['floor'])} | "
            f"{r['decode_graph'] / r['floor']:.2f} | {r['decode_in_graph'] / r['floor']:.2f} | "
            f"{r['decode_in_graph_clean'] / r['floor']:.2f} | {fmt(kvg / r['decode_graph'] if kvg else None, 2)} | "
            f"{max(r['err_decode'], r['err_kvouter']):.1e} |"
        )
    fp8 = [r for r in rows if "decode_fp8_graph" in r]
    if fp8:
        lines += ["", "| ctx | page | B | fp8 K/V decode graph us | in-graph us | in-graph, clean L2 | fp8 floor us | "
                  "graph / floor | in-graph / floor | in-graph clean / floor | err vs bf16 inputs |", "|" + "---|" * 11]
        for r in fp8:
            lines.append(
                f"| {kib(r['ctx'])} | {r['page']} | {r['b']} | {fmt(r['decode_fp8_graph'])} | "
                f"{fmt(r['decode_fp8_in_graph'])} | {fmt(r['decode_fp8_in_graph_clean'])} | {fmt(r['floor_fp8'])} | "
                f"{r['decode_fp8_graph'] / r['floor_fp8']:.2f} | {r['decode_fp8_in_graph'] / r['floor_fp8']:.2f} | "
                f"{r['decode_fp8_in_graph_clean'] / r['floor_fp8']:.2f} | "
                f"{r['err_fp8']:.1e} |"
            )
    return "\n".join(lines)


def table_b(rows: list[dict]) -> str:
    lines = [
        "| ctx | B | q tokens/seq | N | nsb | nsb/N | reuse | decode eager us | decode graph us | splits | "
        "KV-outer eager us | KV-outer graph us | floor us | winner (eager) | winner (graph) | err |",
        "|" + "---|" * 16,
    ]
    for r in rows:
        kvg = r.get("kvouter_graph")
        win_e = "decode" if r["decode_eager"] <= r["kvouter_eager"] else "KV-outer"
        win_g = "-" if kvg is None else ("decode" if r["decode_graph"] <= kvg else "KV-outer")
        lines.append(
            f"| {kib(r['ctx'])} | {r['b']} | {r['n']} | {r['N']} | {r['nsb']} | {r['nsb'] / r['N']:.2f} | "
            f"{r['selections'] / max(1, r['nsb']):.2f} | {fmt(r['decode_eager'])} | {fmt(r['decode_graph'])} | "
            f"{r['splits']} | {fmt(r['kvouter_eager'])} | {fmt(kvg)} | {fmt(r['floor'])} | {win_e} | {win_g} | "
            f"{max(r['err_decode'], r['err_kvouter']):.1e} |"
        )
    return "\n".join(lines)


def parse_variants(s: str) -> list[tuple[int, int, int, int, int, int, int]]:
    """``block_n:warps:stages:programs_per_sm[:fused[:kept]][@splits]`` items; splits 0 = from
    programs_per_sm (``default_num_splits``)."""
    out = []
    for item in s.split(","):
        if item:
            head, at, forced = item.partition("@")
            usage = (
                "--variants: expected block_n:warps:stages:programs_per_sm[:fused[:kept counts]][@splits], "
                f"got {item!r}"
            )
            try:
                vals = tuple(int(x) for x in head.split(":"))
            except ValueError:
                raise SystemExit(usage) from None
            if len(vals) == 4:
                vals += (1,)
            if len(vals) == 5:
                vals += (0,)
            if len(vals) != 6 or (at and not forced.isdigit()):
                raise SystemExit(usage)
            if at and not 1 <= int(forced) <= tdec.MAX_SPLITS:
                raise SystemExit(f"--variants: splits must be in 1..{tdec.MAX_SPLITS}, got {item!r}")
            if vals[5] and not vals[4]:
                raise SystemExit(f"--variants: kept counts are the in-place merge's, so need fused 1: {item!r}")
            out.append(vals + (int(forced or 0),))
    return out


DEFAULT_VARIANTS = (
    # block_n:num_warps:num_stages:programs_per_sm[:fused merge 1/0[:kept counts 1/0]]
    # (kept counts: the in-place merge's arrival counts come from a buffer the caller keeps,
    # instead of a zeroed one per call); at batch 32 x 4 kv
    # heads, programs per SM 1 / 2 / 4 / 8 give 2 / 4 / 8 / 16 splits (at most 2 chunks of
    # block_n keys each)
    "64:4:3:1,64:4:3:1:0,64:4:3:2,64:4:3:4,64:4:3:4:0,64:4:3:8,"
    "64:4:2:4,64:4:4:4,64:8:3:4,"
    "32:4:3:8,32:4:4:8,"
    "128:4:2:2,128:4:2:4,128:8:2:4,128:4:3:4"
)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: 4K context, batch 4, few variants")
    ap.add_argument("--contexts", default="32768,131072", help="context lengths of (a) and (b)")
    ap.add_argument("--page-sizes", default="128,64", help="page sizes of (a); (b) uses the first")
    ap.add_argument("--batch", type=int, default=32, help="sequences in (a) and the sweep")
    ap.add_argument("--q-tokens", default="1,4,16,64,256,1024,4096", help="query tokens per sequence in (b)")
    ap.add_argument("--batch-variants", default="8,32", help="(b) also at these batch sizes (largest context)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="(b) skips batch variants with more query tokens")
    ap.add_argument("--pattern", default="random", choices=("random", "hot"))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="launch sweep: block_n:warps:stages:programs_per_sm[:fused merge 1/0[:kept counts 1/0]]"
                         "[@splits],... (@S forces S splits)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="keep DECODE_CONFIG, skip the sweep")
    ap.add_argument("--no-dense", dest="dense", action="store_false", help="skip dense SDPA")
    ap.add_argument("--no-crossover", dest="crossover", action="store_false", help="skip (b)")
    ap.add_argument("--fp8", action="store_true", help="(a) also times the decode kernel on e4m3 K/V")
    ap.add_argument("--step", action="store_true",
                    help="(c) index + attention decode step of one sparse layer at batch --batch x the largest context")
    ap.add_argument("--step-only", action="store_true", help="only (c) (implies --no-sweep, no (a), no (b))")
    ap.add_argument("--index-splits", default="", help="(c) also times the index kernel alone at these split counts")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step_only:
        args.step, args.sweep, args.crossover = True, False, False
    if args.quick:
        args.contexts, args.page_sizes, args.batch = "4096", "128,64", 4
        args.q_tokens, args.batch_variants, args.max_tokens = "1,16,64", "4", 256
        args.variants = "64:4:3:4,64:4:3:4:0,128:4:2:2"
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.page_sizes = [int(x) for x in args.page_sizes.split(",") if x]
    args.q_tokens = [int(x) for x in args.q_tokens.split(",") if x]
    args.batch_variants = [int(x) for x in args.batch_variants.split(",") if x]
    args.variants = parse_variants(args.variants)
    args.index_splits = [int(x) for x in args.index_splits.split(",") if x]
    if SMOKE:
        args.contexts, args.page_sizes, args.batch = [512], [128, 64], 2
        args.q_tokens, args.batch_variants, args.max_tokens = [1, 4], [2], 8
        args.variants = args.variants[:1]
    elif not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA device (the tests cover the kernels on the CPU)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    if SMOKE:
        props = type("Props", (), {"name": "cpu", "multi_processor_count": 0})
    else:
        props = torch.cuda.get_device_properties(0)
    log(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {props.name} ({props.multi_processor_count} SMs), "
        f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}")
    log("# " + " ".join(sys.argv))
    log(f"# Hq {HQ} Hkv {HKV} D {D} block {BLOCK} top-{TOPK} bf16, pattern {args.pattern}")
    t_start = time.time()
    default_cfg = dict(tdec.DECODE_CONFIG)
    ctx_max = max(args.contexts)
    page0 = args.page_sizes[0]
    sweep_md = ""
    best_cfg = default_cfg
    pools: dict = {}

    def pool(ctx, page, batch):
        key = (ctx, page)
        if key not in pools or pools[key].batch < batch:
            pools.clear()
            empty_cache()
            pools[key] = Pool(ctx, page, batch)
        return pools[key]

    if args.sweep:
        log(f"== sweep: batch {args.batch} x ctx {ctx_max}, page {page0}")
        best_cfg, lines = sweep(pool(ctx_max, page0, args.batch), args)
        sweep_md = "\n".join(lines)
    tdec.DECODE_CONFIG.update(best_cfg)
    log(f"# default config {default_cfg}; used {tdec.DECODE_CONFIG}")

    rows_a, rows_b, rows_c = [], [], []
    if args.step:
        log(f"== (c) decode step, batch {args.batch} x ctx {ctx_max}, page {page0}")
        rows_c = step_section(pool(ctx_max, page0, args.batch), args)
    # Largest context first: the sweep's pool serves the first rows.
    for ctx in sorted(args.contexts, reverse=True) if not args.step_only else []:
        for page in args.page_sizes:
            log(f"== (a) ctx {ctx} page {page}")
            rows_a.append(decode_section(pool(ctx, page, args.batch), args, default_cfg, best_cfg))
            empty_cache()
    if args.crossover:
        jobs = [(ctx_max, 1, n) for n in args.q_tokens]
        jobs += [(ctx_max, b, n) for b in args.batch_variants for n in args.q_tokens if b * n <= args.max_tokens]
        jobs += [(ctx, 1, n) for ctx in sorted(args.contexts, reverse=True) if ctx != ctx_max for n in args.q_tokens]
        for ctx, b, n in jobs:
            if n > ctx:
                continue
            need = max([b2 for c2, b2, _ in jobs if c2 == ctx] + [1])
            log(f"== (b) ctx {ctx} B {b} n {n}")
            rows_b.append(crossover_point(pool(ctx, page0, need), b, n, args))
    pools.clear()

    md = [
        f"Decode attention, {props.name}, torch {torch.__version__}, triton {triton.__version__}; "
        f"Hq {HQ} Hkv {HKV} D {D} block {BLOCK} top-{TOPK} bf16, selections {args.pattern}; "
        f"launch config {tdec.DECODE_CONFIG}.",
    ]
    if rows_a:
        md += ["", "(a) decode, one new token per sequence (us; graph = one call captured in a CUDA graph and replayed)",
               "", table_a(rows_a)]
    if rows_c:
        md += ["", "(c) one sparse layer's decode step (index top-k + decode attention on its selections), us per "
               "call inside a graph of 20 with L2 flushed before each; floors at 4.2 TB/s", "", table_c(rows_c)]
    if rows_b:
        md += ["", "(b) crossover: the last n tokens of each sequence are queries (page "
               f"{page0}); reuse = (token, head) selections per distinct selected block", "", table_b(rows_b)]
    if sweep_md:
        md += ["", f"Launch sweep (kernel alone, graph replay), batch {args.batch} x {kib(ctx_max)}, page {page0}", "",
               sweep_md]
    if not KVOUTER_GRAPH["ok"]:
        md += ["", f"KV-outer graph capture failed: {KVOUTER_GRAPH['why']}"]
    md = "\n".join(md)
    (out_dir / "bench_decode.json").write_text(json.dumps({"a": rows_a, "b": rows_b, "c": rows_c}, indent=1))
    (out_dir / "bench_decode.log").write_text("\n".join(LOG) + "\n\n" + md + "\n")
    (out_dir / "bench_decode.md").write_text(md + "\n")
    log(f"# total {time.time() - t_start:.0f} s")
    print()
    print(md)


if __name__ == "__main__":
    main()
