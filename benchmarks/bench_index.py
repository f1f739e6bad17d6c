"""Index-branch benchmark (issue 4): scores + block max + top-k on an H200.

Workload: 4 index heads, head dim 128, bf16, block 128, top-k 16, one local
block, paged index-key cache (page 128 unless --page-size) with a shuffled block
table.

* prefill, one sequence of N in {8K, 32K, 128K}: time of the whole index branch
  and TFLOP/s on the causal score FLOPs 2 * 128 * 4 * N^2 / 2;
* decode, batch 32 x one new token, contexts 32K and 128K: time against the floor
  of reading every index key once at 4.2 TB/s;
* side by side: the transformers ``MiniMaxM3VLIndexer`` math (fp32 matmul scores,
  causal mask, block max, local boost, topk) where its [B, H, Sq, Sk] fp32 score
  tensor fits in memory, and the package's torch ``index_topk`` at 8K;
* optional fp8 (e4m3, per-token scale) index keys: time, and how often the
  selection differs from bf16 and by how much the swapped blocks' bf16 scores
  differ.

Times are medians of ``triton.testing.do_bench`` (CUDA events) after warm-up;
the slow torch reference is timed with CUDA events over a few runs. The log
and a JSON of every figure go to ``$OUT`` (or --out); the markdown table is
printed last.

    python benchmarks/bench_index.py [--sweep] [--fp8] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "torch-ext"))

from m3_sparse.index_topk import index_topk_torch as index_topk  # noqa: E402
from m3_sparse.triton_index_topk import _index_topk_launch  # noqa: E402

HEADS, DIM, BLOCK, TOPK, LOCAL = 4, 128, 128, 16, 1
# --cpu-smoke runs every code path at toy sizes under the Triton interpreter.
SMOKE = "--cpu-smoke" in sys.argv
DEV = "cpu" if SMOKE else "cuda"
HBM_BW = 4.2e12  # device-to-device copy, bytes read + written per second (M3_SPEC.md)
GEMM_BF16 = 700e12  # bf16 GEMM 8192^3 on this H200 (M3_SPEC.md)
GEMM_FP8 = 1281e12  # fp8 GEMM on this H200 (docs/PERF.md, ceilings)

LOG = []


def log(msg=""):
    print(msg, flush=True)
    LOG.append(str(msg))


def paged(keys_per_seq: list[torch.Tensor], page_size: int, g: torch.Generator):
    """Lay the sequences' keys over a shuffled page pool: (cache, block_tables)."""
    pages = [math.ceil(k.shape[0] / page_size) for k in keys_per_seq]
    total = sum(pages)
    perm = torch.randperm(total, generator=g).to(DEV)
    cache = torch.empty(total, page_size, DIM, dtype=keys_per_seq[0].dtype, device=DEV)
    width = max(pages)
    tables = torch.zeros(len(keys_per_seq), width, dtype=torch.int32, device=DEV)
    start = 0
    for b, k in enumerate(keys_per_seq):
        ids = perm[start : start + pages[b]]
        start += pages[b]
        pad = pages[b] * page_size - k.shape[0]
        kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(pages[b], page_size, DIM)
        cache[ids] = kp
        tables[b, : pages[b]] = ids.to(torch.int32)
    return cache, tables


def hf_indexer(idx_q, idx_k, position_ids, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL):
    """MiniMaxM3VLIndexer.forward's selection math (transformers 5.17), from the
    normed/rotated q [B, H, Sq, D] and k [B, 1, Sk, D] on."""
    batch, heads, q_len, _ = idx_q.shape
    k_len = idx_k.shape[2]
    nb = -(-k_len // block_size)
    pad = nb * block_size - k_len
    scores = torch.matmul(idx_q.float(), idx_k.float().transpose(-1, -2))
    k_positions = torch.arange(k_len, device=idx_q.device)
    token_future = k_positions[None, None, None, :] > position_ids[:, None, :, None]
    scores = scores.masked_fill(token_future, float("-inf"))
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    block_scores = scores.view(batch, heads, q_len, nb, block_size).amax(dim=-1)
    q_block = position_ids // block_size
    local = torch.arange(local_blocks, device=idx_q.device)
    local_idx = (q_block[..., None] - local.view(1, 1, -1)).clamp(min=0)
    local_idx = local_idx.unsqueeze(1).expand(-1, heads, -1, -1)
    block_scores.scatter_(-1, local_idx, float("inf"))
    k = min(topk, nb)
    top_s, top_i = block_scores.topk(k, dim=-1)
    return top_i.masked_fill(top_s == float("-inf"), -1)


def bench_graph(fn, rep=100):
    """Kernel time without the host's launch cost: replays of a CUDA graph of
    back-to-back calls (also shows that the launch path is capturable)."""
    if SMOKE:
        return bench(fn)
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def median_events(fn, runs=3):
    if SMOKE:
        return bench(fn)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench(fn, rep=200):
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def canon(sel):
    big = torch.iinfo(torch.int32).max
    s = torch.where(sel < 0, big, sel).sort(-1).values
    return torch.where(s == big, -1, s)


def quantize_e4m3(x):
    amax = x.float().abs().amax(-1).clamp(min=1e-12)
    scale = amax / 448.0
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def fp8_modes(codes, scale, codes1, scale1):
    """(name, codes, scale, fp8_dot) of the fp8 columns: per-token scales with the keys
    widened or the fp8 dot, and one scale for the cache with the fp8 dot."""
    return (("fp8", codes, scale, False), ("fp8dot", codes, scale, True), ("fp8dot1", codes1, scale1, True))


def quantize_e4m3_tensor(x):
    """One scale for the whole cache (the largest magnitude onto 448): (codes, scale [1])."""
    scale = (x.float().abs().amax().clamp(min=1e-12) / 448.0).reshape(1)
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def selection_diff(a, b, block_scores=None):
    """Fraction of (token, head) rows whose selected sets differ; with block scores
    [T, H, NB] (fp32, of the reference inputs) also the median / max score gap of
    swapped blocks relative to the score spread of their row."""
    w = max(a.shape[-1], b.shape[-1])
    a = torch.nn.functional.pad(a, (0, w - a.shape[-1]), value=-1)
    b = torch.nn.functional.pad(b.to(a.device), (0, w - b.shape[-1]), value=-1)
    ca, cb = canon(a), canon(b)
    diff = (ca != cb).any(-1)
    frac = float(diff.float().mean())
    if block_scores is None or not bool(diff.any()):
        return frac, None, None
    rows = diff.nonzero()[:2000]
    gaps = []
    for t, h in rows.tolist():
        s = block_scores[t, h]
        sa, sb = set(ca[t, h].tolist()) - {-1}, set(cb[t, h].tolist()) - {-1}
        ex, mi = sorted(sa - sb), sorted(sb - sa)
        fin = s[torch.isfinite(s)]
        spread = float(fin.std()) if fin.numel() > 1 else 1.0
        for x, y in zip(sorted(ex, key=lambda i: -float(s[i])), sorted(mi, key=lambda i: -float(s[i]))):
            gaps.append(abs(float(s[x]) - float(s[y])) / spread)
    return frac, statistics.median(gaps) if gaps else None, max(gaps) if gaps else None


def prefill_inputs(n, page_size, g):
    iq = torch.randn(n, HEADS, DIM, generator=g).to(DEV, torch.bfloat16)
    keys = torch.randn(n, DIM, generator=g).to(DEV, torch.bfloat16)
    cache, tables = paged([keys], page_size, g)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    kv = torch.tensor([n], dtype=torch.int32, device=DEV)
    return iq, keys, cache, tables, cu, kv


def run_triton(iq, cache, tables, cu, kv, max_q, **kw):
    return _index_topk_launch(
        iq, cache, tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=TOPK, block_size=BLOCK, local_blocks=LOCAL,
        max_seqlen_q=max_q, **kw,
    )


def sweep(args, g):
    """Launch configurations of both kernels (compile + time), for tuning."""
    n = 512 if SMOKE else 32768
    iq, _, cache, tables, cu, kv = prefill_inputs(n, args.page_size, g)
    flops = 2 * DIM * HEADS * n * n / 2
    log(f"## sweep: prefill N={n}")
    for bm, bk, nw, ns in [(128, 128, 4, 2), (128, 128, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4), (256, 128, 8, 2),
                           (128, 128, 8, 2)]:
        try:
            fn = lambda: run_triton(iq, cache, tables, cu, kv, n, block_m=bm, block_k=bk, num_warps=nw, num_stages=ns)  # noqa: E731
            t = bench(fn, rep=100)
            log(f"prefill BM={bm} BK={bk} warps={nw} stages={ns}: {t * 1e3:.0f} us, {flops / t / 1e9:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            log(f"prefill BM={bm} BK={bk} warps={nw} stages={ns}: failed {type(e).__name__}: {str(e)[:200]}")
    batch = 2 if SMOKE else 32
    for ctx in [1024] if SMOKE else [32768, 131072]:
        iq = torch.randn(batch, HEADS, DIM, generator=g).to(DEV, torch.bfloat16)
        keys = [torch.randn(ctx, DIM, generator=g).to(DEV, torch.bfloat16) for _ in range(batch)]
        cache, tables = paged(keys, args.page_size, g)
        del keys
        cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        kv = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        floor = batch * ctx * DIM * 2 / HBM_BW
        log(f"## sweep: decode batch {batch} x ctx {ctx} (floor {floor * 1e6:.0f} us)")
        for bk, nw, ns, sp in [(128, 4, 3, None), (128, 4, 3, 33), (128, 4, 3, 66), (128, 4, 3, 132),
                               (128, 4, 4, 66), (64, 4, 4, 66), (128, 2, 3, 66)]:
            try:
                fn = lambda: run_triton(  # noqa: E731
                    iq, cache, tables, cu, kv, 1, block_k=bk, num_warps=nw, num_stages=ns, num_splits=sp
                )
                t = bench(fn, rep=100)
                log(f"decode ctx={ctx} BK={bk} warps={nw} stages={ns} splits={sp}: {t * 1e3:.0f} us = "
                    f"{t * 1e-3 / floor:.2f}x floor")
            except Exception as e:  # noqa: BLE001
                log(f"decode BK={bk} warps={nw} stages={ns} splits={sp}: failed {type(e).__name__}: {str(e)[:200]}")
        del cache


# (BM, BK, warps, stages, maxnreg): the register cap lets 3-4 programs share a
# multiprocessor, so one program's top-k epilogue runs under another's MMA.
FP8_PREFILL_VARIANTS = [
    (128, 128, 4, 2, None), (128, 128, 4, 3, None), (64, 128, 4, 3, None), (64, 128, 4, 2, 168),
    (64, 128, 4, 3, 168), (64, 128, 4, 4, 168), (64, 128, 4, 3, 128), (128, 128, 8, 2, 128), (128, 128, 8, 3, 128),
]


def sweep_fp8(args, g):
    n = 512 if SMOKE else 131072
    iq, _, cache, tables, cu, kv = prefill_inputs(n, args.page_size, g)
    codes, scale = quantize_e4m3(cache)
    flops = 2 * DIM * HEADS * n * n / 2
    log(f"## sweep: fp8-dot prefill N={n}")
    ref = None
    for bm, bk, nw, ns, nreg in FP8_PREFILL_VARIANTS:
        what = f"BM={bm} BK={bk} warps={nw} stages={ns} maxnreg={nreg}"
        try:
            fn = lambda: run_triton(  # noqa: E731
                iq, codes, tables, cu, kv, n, index_k_scale=scale, fp8_dot=True, block_m=bm, block_k=bk,
                num_warps=nw, num_stages=ns, maxnreg=nreg,
            )
            sel = canon(fn())
            # Every variant computes the same function up to the fp8 MMA's accumulation order.
            differ = "-" if ref is None else f"{(sel != ref).any(-1).float().mean().item():.2%}"
            ref = sel if ref is None else ref
            t = bench_graph(fn, rep=60)
            log(f"fp8dot prefill {what}: {t:.2f} ms, {flops / t / 1e9:.0f} TFLOP/s, rows differing from the first: {differ}")
        except Exception as e:  # noqa: BLE001
            log(f"fp8dot prefill {what}: failed {type(e).__name__}: {str(e)[:200]}")
    # One scale for the cache: the kernel skips the per-score multiply.
    codes1, scale1 = quantize_e4m3_tensor(cache)
    exact = canon(run_triton(iq, cache, tables, cu, kv, n))
    for fp8_dot in (True, False):
        fn = lambda: run_triton(iq, codes1, tables, cu, kv, n, index_k_scale=scale1, fp8_dot=fp8_dot)  # noqa: E731
        sel = canon(fn())
        tok = canon(run_triton(iq, codes, tables, cu, kv, n, index_k_scale=scale, fp8_dot=fp8_dot))
        t = bench_graph(fn, rep=60)
        log(f"fp8 prefill, one scale for the cache, fp8_dot={fp8_dot}, default launch: {t:.2f} ms, "
            f"{flops / t / 1e9:.0f} TFLOP/s; rows differing from per-token scales "
            f"{(sel != tok).any(-1).float().mean().item():.2%}, from bf16 keys {(sel != exact).any(-1).float().mean().item():.2%}"
            f" (per-token vs bf16 {(tok != exact).any(-1).float().mean().item():.2%})")
    del cache, codes, codes1


def compare_engines(args, g):
    """The two prefill kernels on the same calls: the tl kernel (engine="triton") and the
    Gluon one for sm_90 (engine="tma"); selections must be equal row for row."""
    sizes = [512] if SMOKE else [32768, 131072]
    log("## prefill engines: tl kernel against the Gluon kernel (CUDA-graph medians)")
    log("| N | keys | tl ms | Gluon ms | Gluon / tl | floor ms (GEMM ceiling) | rows differing |")
    log("|---|---|---|---|---|---|---|")
    for n in sizes:
        iq, _, cache, tables, cu, kv = prefill_inputs(n, args.page_size, g)
        flops = 2 * DIM * HEADS * n * n / 2
        codes, scale = quantize_e4m3(cache)
        codes1, scale1 = quantize_e4m3_tensor(cache)
        cases = [("bf16", cache, {}), ("fp8, one scale", codes1, dict(index_k_scale=scale1, fp8_dot=True))]
        if args.page_size >= BLOCK:  # per-token scales ride with whole blocks
            cases.append(("fp8, per-token scales", codes, dict(index_k_scale=scale, fp8_dot=True)))
        for label, kc, kw in cases:
            floor = flops / (GEMM_FP8 if kw else GEMM_BF16) * 1e3
            times, sels = {}, {}
            for engine in ("triton", "tma"):
                fn = lambda: run_triton(iq, kc, tables, cu, kv, n, engine=engine, num_splits=1, **kw)  # noqa: E731
                try:
                    sels[engine] = canon(fn())
                    times[engine] = bench_graph(fn)
                except ValueError as e:  # the Gluon kernel does not run here (device, Triton): say why
                    log(f"| {n // 1024}K | {label} | - | {e} | - | - | - |")
                    break
            else:
                differ = (sels["triton"] != sels["tma"]).any(-1).float().mean().item()
                log(f"| {n // 1024}K | {label} | {times['triton']:.3f} | {times['tma']:.3f} | "
                    f"{times['tma'] / times['triton']:.3f} | {floor:.2f} | {differ:.1e} |")
        del iq, cache, codes, codes1


def sweep_decode(args, g):
    """Decode, batch 32: score orientation (key-major K @ Q^T vs Q @ K^T), warps and
    pipeline stages, for bf16 keys, fp8 keys widened to bf16, and fp8 keys with the fp8 dot."""
    batch = 2 if SMOKE else 32
    variants = [(True, 4, 3), (False, 4, 3), (True, 4, 4), (True, 4, 6), (True, 4, 8), (True, 8, 6), (True, 2, 4),
                (False, 2, 4), (False, 4, 6)]
    for ctx in [1024] if SMOKE else [131072, 32768]:
        iq = torch.randn(batch, HEADS, DIM, generator=g).to(DEV, torch.bfloat16)
        keys = [torch.randn(ctx, DIM, generator=g).to(DEV, torch.bfloat16) for _ in range(batch)]
        cache, tables = paged(keys, args.page_size, g)
        del keys
        codes, scale = quantize_e4m3(cache)
        codes1, scale1 = quantize_e4m3_tensor(cache)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        kv = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        floor = batch * ctx * DIM * 2 / HBM_BW
        log(f"## sweep: decode batch {batch} x ctx {ctx} (bf16 floor {floor * 1e6:.0f} us, fp8 floor "
            f"{floor * 5e5:.0f} us)")
        log("| keys | key-major | warps | stages | graph us | x its floor |")
        log("|---|---|---|---|---|---|")
        for mode in ("bf16", "fp8", "fp8 dot", "fp8 dot, one scale"):
            k_in, extra = (cache, {}) if mode == "bf16" else (codes, dict(index_k_scale=scale, fp8_dot=mode != "fp8"))
            if mode.endswith("one scale"):
                k_in, extra = codes1, dict(index_k_scale=scale1, fp8_dot=True)
            fl = floor if mode == "bf16" else floor / 2
            ref = None
            for km, nw, ns in variants if not mode.endswith("one scale") else [(True, 4, 6), (True, 4, 4)]:
                fn = lambda: run_triton(iq, k_in, tables, cu, kv, 1, key_major=km, num_warps=nw, num_stages=ns, **extra)  # noqa: E731
                try:
                    sel = canon(fn())
                    if ref is None:
                        ref = sel
                    differ = float((sel != ref).any(-1).float().mean())
                    # The fp8 MMA's accumulation order depends on the tile shape: near-ties
                    # may swap between variants there, nowhere else.
                    if differ and not mode.startswith("fp8 dot"):
                        raise RuntimeError(f"selection differs from the first variant in {differ:.1e} of the rows")
                    t = bench_graph(fn)
                    note = f" ({differ:.1e} of rows differ from the first variant)" if differ else ""
                    log(f"| {mode} | {km} | {nw} | {ns} | {t * 1e3:.1f} | {t * 1e-3 / fl:.2f}{note} |")
                except Exception as e:  # noqa: BLE001
                    log(f"| {mode} | {km} | {nw} | {ns} | failed: {type(e).__name__}: {str(e)[:120]} | - |")
        del cache, codes, scale, codes1, scale1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time several launch configurations first")
    ap.add_argument("--fp8", action="store_true", help="also fp8 (e4m3 + per-token scale) index keys")
    ap.add_argument("--quick", action="store_true", help="8K/32K prefill and 32K decode only")
    ap.add_argument("--sweep-fp8", action="store_true", help="launch configurations of the fp8-dot prefill")
    ap.add_argument("--sweep-decode", action="store_true",
                    help="decode launch configurations (score orientation, warps, stages), bf16 and fp8 keys")
    ap.add_argument("--engines", action="store_true",
                    help="prefill: the tl kernel against the Gluon kernel (sm_90), bf16 and fp8 keys")
    ap.add_argument("--sweeps-only", action="store_true", help="run the requested sweeps, skip the main tables")
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    name = "cpu (interpreter smoke run)" if SMOKE else torch.cuda.get_device_properties(0).name
    sms = 0 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    log(f"# index branch benchmark, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    log(f"device {name}, {sms} SMs; torch {torch.__version__}, triton {triton.__version__}")
    log(f"heads {HEADS}, dim {DIM}, block {BLOCK}, topk {TOPK}, local {LOCAL}, page {args.page_size}, bf16")
    if args.sweep:
        sweep(args, g)
    if args.sweep_fp8:
        sweep_fp8(args, g)
    if args.sweep_decode:
        sweep_decode(args, g)
    if args.engines:
        compare_engines(args, g)
    if args.sweeps_only:
        (out_dir / "bench_index.log").write_text("\n".join(LOG) + "\n")
        return
    rows = []
    results = {}

    # ---------------- prefill ----------------
    sizes = [8192, 32768] if args.quick else [8192, 32768, 131072]
    if SMOKE:
        sizes = [512, 1024]
    for n in sizes:
        iq, keys, cache, tables, cu, kv = prefill_inputs(n, args.page_size, g)
        flops = 2 * DIM * HEADS * n * n / 2
        fn = lambda: run_triton(iq, cache, tables, cu, kv, n)  # noqa: E731
        sel = fn()
        te = bench(fn)
        t = bench_graph(fn)
        r = {"ms": t, "eager_ms": te, "tflops": flops / t / 1e9}
        row = [f"prefill N={n // 1024}K", f"{t:.3f} ms ({te:.3f} eager)", f"{flops / t / 1e9:.0f} TFLOP/s"]
        # transformers indexer math: [1, 4, N, N] fp32 scores (+ a mask copy)
        need = HEADS * n * n * 4 * 2.2
        free = 1e10 if SMOKE else torch.cuda.mem_get_info()[0]
        if need < 0.8 * free:
            q4 = iq.transpose(0, 1)[None]  # [1, H, N, D]
            k4 = keys[None, None]  # [1, 1, N, D]
            posn = torch.arange(n, device=DEV)[None]
            hf_fn = lambda: hf_indexer(q4, k4, posn)  # noqa: E731
            hf_sel = hf_fn()
            th = bench(hf_fn, rep=100) if n <= 8192 else median_events(hf_fn)
            frac, _, _ = selection_diff(sel, hf_sel[0].transpose(0, 1).to(torch.int32))
            r.update(hf_ms=th, hf_rows_differ=frac)
            row.append(f"{th:.2f} ms (rows differing {frac:.1e})")
            del hf_sel
        else:
            r.update(hf_ms=None, hf_gb=need / 1e9)
            row.append(f"does not fit ({need / 1e9:.0f} GB of fp32 scores)")
        if n == (512 if SMOKE else 8192):
            ref_fn = lambda: index_topk(  # noqa: E731
                iq, cache, tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=TOPK, block_size=BLOCK, local_blocks=LOCAL
            )
            tr = median_events(ref_fn, runs=2)
            frac, _, _ = selection_diff(sel, ref_fn())
            r.update(torch_ms=tr, torch_rows_differ=frac)
            row.append(f"{tr:.1f} ms (rows differing {frac:.1e})")
        else:
            row.append("-")
        if args.fp8:
            codes, scale = quantize_e4m3(cache)
            bs = None
            if n == (512 if SMOKE else 8192):
                sc = torch.einsum("thd,kd->thk", iq.float(), keys.float())
                ar = torch.arange(n, device=DEV)
                sc = sc.masked_fill(ar[None, None, :] > ar[:, None, None], float("-inf"))
                bs = sc.view(n, HEADS, n // BLOCK, BLOCK).amax(-1).cpu()
                del sc
            codes1, scale1 = quantize_e4m3_tensor(cache)
            for mode, c8, s8, dot in fp8_modes(codes, scale, codes1, scale1):
                f8 = lambda: run_triton(iq, c8, tables, cu, kv, n, index_k_scale=s8, fp8_dot=dot)  # noqa: E731
                sel8 = f8()
                t8 = bench_graph(f8)
                frac, gmed, gmax = selection_diff(sel8.cpu(), sel.cpu(), bs)
                r.update({f"{mode}_ms": t8, f"{mode}_rows_differ": frac, f"{mode}_gap_median": gmed,
                          f"{mode}_gap_max": gmax})
                extra = f"; swap gap med {gmed:.3f} max {gmax:.3f} sd" if gmed is not None else ""
                row.append(f"{t8:.3f} ms, {flops / t8 / 1e9:.0f} TFLOP/s ({frac:.1e} rows differ{extra})")
            del codes, scale, codes1, scale1
        results[f"prefill_{n}"] = r
        rows.append(row)
        log(" | ".join(row))
        del iq, keys, cache, tables
        if not SMOKE:
            torch.cuda.empty_cache()

    # ---------------- decode ----------------
    batch = 32
    ctxs = [32768] if args.quick else [32768, 131072]
    if SMOKE:
        batch, ctxs = 3, [1024]
    drows = []
    for ctx in ctxs:
        iq = torch.randn(batch, HEADS, DIM, generator=g).to(DEV, torch.bfloat16)
        keys = torch.randn(batch, ctx, DIM, generator=g).to(DEV, torch.bfloat16)
        cache, tables = paged(list(keys), args.page_size, g)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        kv = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        floor = batch * ctx * DIM * 2 / HBM_BW * 1e3  # ms
        fn = lambda: run_triton(iq, cache, tables, cu, kv, 1)  # noqa: E731
        sel = fn()
        te = bench(fn)
        t = bench_graph(fn)
        r = {"ms": t, "eager_ms": te, "floor_ms": floor}
        row = [
            f"decode B={batch} ctx={ctx // 1024}K",
            f"{t * 1e3:.0f} us ({te * 1e3:.0f} eager)",
            f"{t / floor:.2f}x floor ({floor * 1e3:.0f} us)",
        ]
        q4 = iq[:, :, None, :]  # [B, H, 1, D]
        k4 = keys[:, None]  # [B, 1, ctx, D] (contiguous, not paged)
        posn = torch.full((batch, 1), ctx - 1, device=DEV)
        hf_fn = lambda: hf_indexer(q4, k4, posn)  # noqa: E731
        th = bench(hf_fn, rep=100)
        frac, _, _ = selection_diff(sel, hf_fn()[:, :, 0].to(torch.int32))
        r.update(hf_ms=th, hf_rows_differ=frac)
        row.append(f"{th * 1e3:.0f} us (rows differing {frac:.1e})")
        row.append("-")
        if args.fp8:
            codes, scale = quantize_e4m3(cache)
            sc = torch.einsum("bhd,bkd->bhk", iq.float(), keys.float())
            bs = sc.view(batch, HEADS, ctx // BLOCK, BLOCK).amax(-1).cpu()
            del sc
            codes1, scale1 = quantize_e4m3_tensor(cache)
            for mode, c8, s8, dot in fp8_modes(codes, scale, codes1, scale1):
                f8 = lambda: run_triton(iq, c8, tables, cu, kv, 1, index_k_scale=s8, fp8_dot=dot)  # noqa: E731
                sel8 = f8()
                t8 = bench_graph(f8)
                frac, gmed, gmax = selection_diff(sel8.cpu(), sel.cpu(), bs)
                r.update({f"{mode}_ms": t8, f"{mode}_rows_differ": frac, f"{mode}_gap_median": gmed,
                          f"{mode}_gap_max": gmax, "fp8_floor_ms": floor / 2})
                extra = f"; swap gap med {gmed:.3f} max {gmax:.3f} sd" if gmed is not None else ""
                row.append(f"{t8 * 1e3:.0f} us = {t8 / (floor / 2):.2f}x fp8 floor ({frac:.1e} rows differ{extra})")
            del codes, scale, codes1, scale1
        results[f"decode_{ctx}"] = r
        drows.append(row)
        log(" | ".join(row))
        del iq, keys, cache, tables
        if not SMOKE:
            torch.cuda.empty_cache()

    (out_dir / "bench_index.json").write_text(json.dumps(results, indent=1))
    fp8_col = " | fp8 keys, bf16 dot | fp8 keys, fp8 dot | fp8 keys, one scale, fp8 dot" if args.fp8 else ""
    table = [
        "",
        f"| case | Triton index_topk | rate | transformers indexer math | torch index_topk{fp8_col} |",
        "|---|---|---|---|---|" + ("---|---|---|" if args.fp8 else ""),
    ]
    for row in rows + drows:
        table.append("| " + " | ".join(row) + " |")
    for line in table:
        log(line)
    (out_dir / "bench_index.log").write_text("\n".join(LOG) + "\n")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"(bench wall time {time.time() - t0:.0f} s)")
