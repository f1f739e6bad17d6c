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

The Triton kernels run through ``m3_sparse.index_topk`` with an ``IndexConfig`` pinning
``impl="triton"`` (and, in the sweeps, the launch settings). Times are medians of
``triton.testing.do_bench`` (CUDA events) after warm-up, and of CUDA-graph replays; the
slow torch reference is timed with CUDA events over a few runs. The log, the result rows
(``bench_index.json``) go to --out; the markdown table is printed last.

    python benchmarks/bench_index.py [--sweep] [--fp8] [--quick]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import common
from common import BLOCK, DEVICE as DEV, INDEX_DIM as DIM, INDEX_HEADS as HEADS, PEAK_BYTES, SMOKE, TOPK, canon

import torch  # noqa: E402

import m3_sparse  # noqa: E402
from m3_sparse import IndexConfig  # noqa: E402

LOCAL = 1
GEMM_BF16, GEMM_FP8 = common.PEAK_FLOPS, common.PEAK_FP8_FLOPS
log = common.Log()


def paged(keys_per_seq: list[torch.Tensor], page_size: int, g: torch.Generator):
    """The sequences' keys over a shuffled page pool: (cache, block_tables)."""
    total = sum(-(-k.shape[0] // page_size) for k in keys_per_seq)
    return common.paginate([k.to(DEV) for k in keys_per_seq], page_size, torch.randperm(total, generator=g))


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


def bench(fn, rep=200):
    return common.median_ms(fn, warmup=25, rep=rep)


def fp8_modes(codes, scale, codes1, scale1):
    """(name, codes, scale, fp8_dot) of the fp8 columns: per-token scales with the keys
    widened or the fp8 dot, and one scale for the cache with the fp8 dot."""
    return (("fp8", codes, scale, False), ("fp8dot", codes, scale, True), ("fp8dot1", codes1, scale1, True))


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


def differ(a, b) -> float:
    """Fraction of rows whose canonical selections differ."""
    return float((a != b).any(-1).float().mean())


def prefill_inputs(n, page_size, g):
    iq = torch.randn(n, HEADS, DIM, generator=g).to(DEV, torch.bfloat16)
    keys = torch.randn(n, DIM, generator=g).to(DEV, torch.bfloat16)
    cache, tables = paged([keys], page_size, g)
    cu, kv = common.varlen(1, n, n)
    return iq, keys, cache, tables, cu, kv


def decode_inputs(batch, ctx, page_size, g):
    """(iq, keys [B, ctx, DIM], cache, tables, cu, kv) of a batch of one new token each."""
    iq = torch.randn(batch, HEADS, DIM, generator=g).to(DEV, torch.bfloat16)
    keys = torch.randn(batch, ctx, DIM, generator=g).to(DEV, torch.bfloat16)
    cache, tables = paged(list(keys), page_size, g)
    cu, kv = common.varlen(batch, 1, ctx)
    return iq, keys, cache, tables, cu, kv


def run_triton(iq, cache, tables, cu, kv, max_q, *, index_k_scale=None, fp8_dot=False, **launch):
    """``index_topk`` on the Triton kernels, ``launch`` the IndexConfig settings."""
    return m3_sparse.index_topk(
        iq, cache, tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=TOPK, block_size=BLOCK, local_blocks=LOCAL,
        max_seqlen_q=max_q, index_k_scale=index_k_scale, fp8_dot=fp8_dot,
        config=IndexConfig(impl="triton", **launch),
    )


def try_variant(results, case, what, sizes, fn, timer, describe):
    """Time one launch variant: log ``describe(ms)`` (or why it failed) and add its row."""
    try:
        t = timer(fn)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result of the sweep
        log(f"{case} {what}: failed {type(e).__name__}: {str(e)[:200]}")
        results.add(case, None, what=what, sizes=sizes, error=f"{type(e).__name__}: {str(e)[:200]}")
        return None
    log(f"{case} {what}: {describe(t)}")
    results.add(case, t, what=what, sizes=sizes)
    return t


def sweep(args, g, results):
    """Launch configurations of both kernels (compile + time), for tuning."""
    n = 512 if SMOKE else 32768
    iq, _, cache, tables, cu, kv = prefill_inputs(n, args.page_size, g)
    flops = 2 * DIM * HEADS * n * n / 2
    log(f"## sweep: prefill N={n}")
    for bm, bk, nw, ns in [(128, 128, 4, 2), (128, 128, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4), (256, 128, 8, 2),
                           (128, 128, 8, 2)]:
        try_variant(
            results, "sweep prefill", f"BM={bm} BK={bk} warps={nw} stages={ns}", {"n": n, "page": args.page_size},
            lambda: run_triton(iq, cache, tables, cu, kv, n, block_m=bm, block_k=bk, num_warps=nw, num_stages=ns),
            lambda f: bench(f, rep=100), lambda t: f"{t * 1e3:.0f} us, {flops / t / 1e9:.0f} TFLOP/s",
        )
    batch = 2 if SMOKE else 32
    for ctx in [1024] if SMOKE else [32768, 131072]:
        iq, _, cache, tables, cu, kv = decode_inputs(batch, ctx, args.page_size, g)
        floor = batch * ctx * DIM * 2 / PEAK_BYTES
        log(f"## sweep: decode batch {batch} x ctx {ctx} (floor {floor * 1e6:.0f} us)")
        for bk, nw, ns, sp in [(128, 4, 3, None), (128, 4, 3, 33), (128, 4, 3, 66), (128, 4, 3, 132),
                               (128, 4, 4, 66), (64, 4, 4, 66), (128, 2, 3, 66)]:
            try_variant(
                results, f"sweep decode ctx={ctx}", f"BK={bk} warps={nw} stages={ns} splits={sp}",
                {"batch": batch, "ctx": ctx, "page": args.page_size},
                lambda: run_triton(iq, cache, tables, cu, kv, 1, block_k=bk, num_warps=nw, num_stages=ns,
                                   num_splits=sp),
                lambda f: bench(f, rep=100), lambda t: f"{t * 1e3:.0f} us = {t * 1e-3 / floor:.2f}x floor",
            )
        del cache


# (BM, BK, warps, stages, maxnreg): the register cap lets 3-4 programs share a
# multiprocessor, so one program's top-k epilogue runs under another's MMA.
FP8_PREFILL_VARIANTS = [
    (128, 128, 4, 2, None), (128, 128, 4, 3, None), (64, 128, 4, 3, None), (64, 128, 4, 2, 168),
    (64, 128, 4, 3, 168), (64, 128, 4, 4, 168), (64, 128, 4, 3, 128), (128, 128, 8, 2, 128), (128, 128, 8, 3, 128),
]


def sweep_fp8(args, g, results):
    n = 512 if SMOKE else 131072
    iq, _, cache, tables, cu, kv = prefill_inputs(n, args.page_size, g)
    codes, scale = common.e4m3_rows(cache)
    flops = 2 * DIM * HEADS * n * n / 2
    sizes = {"n": n, "page": args.page_size}
    log(f"## sweep: fp8-dot prefill N={n}")
    ref = None
    for bm, bk, nw, ns, nreg in FP8_PREFILL_VARIANTS:
        what = f"BM={bm} BK={bk} warps={nw} stages={ns} maxnreg={nreg}"
        fn = lambda: run_triton(  # noqa: E731
            iq, codes, tables, cu, kv, n, index_k_scale=scale, fp8_dot=True, block_m=bm, block_k=bk,
            num_warps=nw, num_stages=ns, maxnreg=nreg,
        )
        try:
            sel = canon(fn())
            # Every variant computes the same function up to the fp8 MMA's accumulation order.
            diff = None if ref is None else differ(sel, ref)
            ref = sel if ref is None else ref
            t = common.cudagraph_ms(fn, rep=60)
        except Exception as e:  # noqa: BLE001
            log(f"fp8dot prefill {what}: failed {type(e).__name__}: {str(e)[:200]}")
            results.add("sweep fp8dot prefill", None, what=what, sizes=sizes, error=str(e)[:200])
            continue
        log(f"fp8dot prefill {what}: {t:.2f} ms, {flops / t / 1e9:.0f} TFLOP/s, rows differing from the first: "
            f"{'-' if diff is None else f'{diff:.2%}'}")
        results.add("sweep fp8dot prefill", t, what=what, sizes=sizes, rows_differ_from_first=diff)
    # One scale for the cache: the kernel skips the per-score multiply.
    codes1, scale1 = common.e4m3_tensor(cache)
    exact = canon(run_triton(iq, cache, tables, cu, kv, n))
    for fp8_dot in (True, False):
        fn = lambda: run_triton(iq, codes1, tables, cu, kv, n, index_k_scale=scale1, fp8_dot=fp8_dot)  # noqa: E731
        sel = canon(fn())
        tok = canon(run_triton(iq, codes, tables, cu, kv, n, index_k_scale=scale, fp8_dot=fp8_dot))
        t = common.cudagraph_ms(fn, rep=60)
        log(f"fp8 prefill, one scale for the cache, fp8_dot={fp8_dot}, default launch: {t:.2f} ms, "
            f"{flops / t / 1e9:.0f} TFLOP/s; rows differing from per-token scales {differ(sel, tok):.2%}, from bf16 "
            f"keys {differ(sel, exact):.2%} (per-token vs bf16 {differ(tok, exact):.2%})")
        results.add("sweep fp8 prefill, one scale", t, what=f"default launch, fp8_dot={fp8_dot}", sizes=sizes,
                    rows_differ_from_token_scales=differ(sel, tok), rows_differ_from_bf16=differ(sel, exact))
    del cache, codes, codes1


def compare_engines(args, g, results):
    """The two prefill kernels on the same calls: the tl kernel (engine="triton") and the
    Gluon one for sm_90 (engine="tma"); selections must be equal row for row."""
    sizes = [512] if SMOKE else [32768, 131072]
    log("## prefill engines: tl kernel against the Gluon kernel (CUDA-graph medians)")
    rows = []
    for n in sizes:
        iq, _, cache, tables, cu, kv = prefill_inputs(n, args.page_size, g)
        flops = 2 * DIM * HEADS * n * n / 2
        codes, scale = common.e4m3_rows(cache)
        codes1, scale1 = common.e4m3_tensor(cache)
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
                    times[engine] = common.cudagraph_ms(fn)
                except ValueError as e:  # the Gluon kernel does not run here (device, Triton): say why
                    rows.append([common.tokens_label(n), label, "-", str(e), "-", "-", "-"])
                    break
            else:
                diff = differ(sels["triton"], sels["tma"])
                rows.append([common.tokens_label(n), label, f"{times['triton']:.3f}", f"{times['tma']:.3f}",
                             f"{times['tma'] / times['triton']:.3f}", f"{floor:.2f}", f"{diff:.1e}"])
                results.add(f"engines prefill N={n}, {label} keys", times["tma"], what="Gluon kernel (engine=tma)",
                            sizes={"n": n, "page": args.page_size}, baseline="tl kernel (engine=triton)",
                            baseline_ms=times["triton"], floor_ms=floor, rows_differ=diff)
        del iq, cache, codes, codes1
    log(common.md_table(["N", "keys", "tl ms", "Gluon ms", "Gluon / tl", "floor ms (GEMM ceiling)", "rows differing"],
                        rows))


def sweep_decode(args, g, results):
    """Decode, batch 32: score orientation (key-major K @ Q^T vs Q @ K^T), warps and
    pipeline stages, for bf16 keys, fp8 keys widened to bf16, and fp8 keys with the fp8 dot."""
    batch = 2 if SMOKE else 32
    variants = [(True, 4, 3), (False, 4, 3), (True, 4, 4), (True, 4, 6), (True, 4, 8), (True, 8, 6), (True, 2, 4),
                (False, 2, 4), (False, 4, 6)]
    for ctx in [1024] if SMOKE else [131072, 32768]:
        iq, _, cache, tables, cu, kv = decode_inputs(batch, ctx, args.page_size, g)
        codes, scale = common.e4m3_rows(cache)
        codes1, scale1 = common.e4m3_tensor(cache)
        floor = batch * ctx * DIM * 2 / PEAK_BYTES
        log(f"## sweep: decode batch {batch} x ctx {ctx} (bf16 floor {floor * 1e6:.0f} us, fp8 floor "
            f"{floor * 5e5:.0f} us)")
        rows = []
        for mode in ("bf16", "fp8", "fp8 dot", "fp8 dot, one scale"):
            k_in, extra = (cache, {}) if mode == "bf16" else (codes, dict(index_k_scale=scale, fp8_dot=mode != "fp8"))
            if mode.endswith("one scale"):
                k_in, extra = codes1, dict(index_k_scale=scale1, fp8_dot=True)
            fl = floor if mode == "bf16" else floor / 2
            ref = None
            for km, nw, ns in variants if not mode.endswith("one scale") else [(True, 4, 6), (True, 4, 4)]:
                fn = lambda: run_triton(iq, k_in, tables, cu, kv, 1, key_major=km, num_warps=nw, num_stages=ns, **extra)  # noqa: E731
                what = f"{mode} keys, key-major {km}, warps {nw}, stages {ns}"
                try:
                    sel = canon(fn())
                    if ref is None:
                        ref = sel
                    diff = differ(sel, ref)
                    # The fp8 MMA's accumulation order depends on the tile shape: near-ties
                    # may swap between variants there, nowhere else.
                    if diff and not mode.startswith("fp8 dot"):
                        raise RuntimeError(f"selection differs from the first variant in {diff:.1e} of the rows")
                    t = common.cudagraph_ms(fn)
                except Exception as e:  # noqa: BLE001
                    rows.append([mode, km, nw, ns, f"failed: {type(e).__name__}: {str(e)[:120]}", "-"])
                    results.add(f"sweep decode ctx={ctx}", None, what=what, error=str(e)[:200])
                    continue
                note = f" ({diff:.1e} of rows differ from the first variant)" if diff else ""
                rows.append([mode, km, nw, ns, f"{t * 1e3:.1f}", f"{t * 1e-3 / fl:.2f}{note}"])
                results.add(f"sweep decode ctx={ctx}", t, what=what,
                            sizes={"batch": batch, "ctx": ctx, "page": args.page_size}, floor_ms=fl * 1e3,
                            rows_differ_from_first=diff)
        log(common.md_table(["keys", "key-major", "warps", "stages", "graph us", "x its floor"], rows))
        del cache, codes, scale, codes1, scale1


def fp8_cells(results, case, sizes, run, sel, t_bf16, block_scores, describe):
    """The fp8 columns of a row: each fp8 mode timed (graph replays) and its selections
    compared with the bf16 keys' (``run(codes, scale, fp8_dot)`` makes the call)."""
    cells = []
    for mode, c8, s8, dot in fp8_modes(*common.e4m3_rows(run.cache), *common.e4m3_tensor(run.cache)):
        fn = lambda: run(c8, s8, dot)  # noqa: E731
        sel8 = fn()
        t8 = common.cudagraph_ms(fn)
        frac, gmed, gmax = selection_diff(sel8.cpu(), sel.cpu(), block_scores)
        results.add(case, t8, what=f"index_topk, {mode} keys", sizes=sizes, baseline="index_topk, bf16 keys",
                    baseline_ms=t_bf16, rows_differ=frac, gap_median=gmed, gap_max=gmax)
        extra = f"; swap gap med {gmed:.3f} max {gmax:.3f} sd" if gmed is not None else ""
        cells.append(f"{describe(t8)} ({frac:.1e} rows differ{extra})")
    return cells


class Call:
    """``index_topk`` of one problem with other keys: ``run(codes, scale, fp8_dot)``."""

    def __init__(self, iq, cache, tables, cu, kv, max_q):
        self.iq, self.cache, self.tables, self.cu, self.kv, self.max_q = iq, cache, tables, cu, kv, max_q

    def __call__(self, keys=None, scale=None, fp8_dot=False):
        keys = self.cache if keys is None else keys
        return run_triton(self.iq, keys, self.tables, self.cu, self.kv, self.max_q, index_k_scale=scale,
                          fp8_dot=fp8_dot)


def prefill_row(n, args, g, results):
    iq, keys, cache, tables, cu, kv = prefill_inputs(n, args.page_size, g)
    flops = 2 * DIM * HEADS * n * n / 2
    run = Call(iq, cache, tables, cu, kv, n)
    sel = run()
    te = bench(run)
    t = common.cudagraph_ms(run)
    case, sizes = f"prefill N={common.tokens_label(n)}", {"n": n, "page": args.page_size}
    metrics = {"eager_ms": te, "tflops": flops / t / 1e9}
    row = [case, f"{t:.3f} ms ({te:.3f} eager)", f"{flops / t / 1e9:.0f} TFLOP/s"]
    # transformers indexer math: [1, 4, N, N] fp32 scores (+ a mask copy)
    need = HEADS * n * n * 4 * 2.2
    free = 1e10 if SMOKE else torch.cuda.mem_get_info()[0]
    th = None
    if need < 0.8 * free:
        q4 = iq.transpose(0, 1)[None]  # [1, H, N, D]
        k4 = keys[None, None]  # [1, 1, N, D]
        posn = torch.arange(n, device=DEV)[None]
        hf_fn = lambda: hf_indexer(q4, k4, posn)  # noqa: E731
        hf_sel = hf_fn()
        th = bench(hf_fn, rep=100) if n <= 8192 else common.event_ms(hf_fn, flush=False)[0]
        frac, _, _ = selection_diff(sel, hf_sel[0].transpose(0, 1).to(torch.int32))
        metrics.update(hf_rows_differ=frac)
        row.append(f"{th:.2f} ms (rows differing {frac:.1e})")
        del hf_sel
    else:
        metrics.update(hf_gb=need / 1e9)
        row.append(f"does not fit ({need / 1e9:.0f} GB of fp32 scores)")
    first = n == (512 if SMOKE else 8192)
    if first:
        ref_fn = lambda: m3_sparse.index_topk(  # noqa: E731
            iq, cache, tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=TOPK, block_size=BLOCK, local_blocks=LOCAL,
            config=IndexConfig(impl="torch"),
        )
        tr = common.event_ms(ref_fn, reps=2, flush=False)[0]
        frac, _, _ = selection_diff(sel, ref_fn())
        metrics.update(torch_ms=tr, torch_rows_differ=frac)
        row.append(f"{tr:.1f} ms (rows differing {frac:.1e})")
    else:
        row.append("-")
    results.add(case, t, what="index_topk (Triton, graph replay)", sizes=sizes,
                baseline="transformers MiniMaxM3VLIndexer math", baseline_ms=th, **metrics)
    if args.fp8:
        bs = None
        if first:
            sc = torch.einsum("thd,kd->thk", iq.float(), keys.float())
            ar = torch.arange(n, device=DEV)
            sc = sc.masked_fill(ar[None, None, :] > ar[:, None, None], float("-inf"))
            bs = sc.view(n, HEADS, n // BLOCK, BLOCK).amax(-1).cpu()
            del sc
        row += fp8_cells(results, case, sizes, run, sel, t, bs, lambda t8: f"{t8:.3f} ms, {flops / t8 / 1e9:.0f} TFLOP/s")
    log(" | ".join(row))
    del iq, keys, cache, tables, run
    common.empty_cache()
    return row


def decode_row(batch, ctx, args, g, results):
    iq, keys, cache, tables, cu, kv = decode_inputs(batch, ctx, args.page_size, g)
    floor = batch * ctx * DIM * 2 / PEAK_BYTES * 1e3  # ms
    run = Call(iq, cache, tables, cu, kv, 1)
    sel = run()
    te = bench(run)
    t = common.cudagraph_ms(run)
    case, sizes = f"decode B={batch} ctx={common.tokens_label(ctx)}", {"batch": batch, "ctx": ctx, "page": args.page_size}
    row = [case, f"{t * 1e3:.0f} us ({te * 1e3:.0f} eager)", f"{t / floor:.2f}x floor ({floor * 1e3:.0f} us)"]
    q4 = iq[:, :, None, :]  # [B, H, 1, D]
    k4 = keys[:, None]  # [B, 1, ctx, D] (contiguous, not paged)
    posn = torch.full((batch, 1), ctx - 1, device=DEV)
    hf_fn = lambda: hf_indexer(q4, k4, posn)  # noqa: E731
    th = bench(hf_fn, rep=100)
    frac, _, _ = selection_diff(sel, hf_fn()[:, :, 0].to(torch.int32))
    row += [f"{th * 1e3:.0f} us (rows differing {frac:.1e})", "-"]
    results.add(case, t, what="index_topk (Triton, graph replay)", sizes=sizes,
                baseline="transformers MiniMaxM3VLIndexer math", baseline_ms=th, eager_ms=te, floor_ms=floor,
                hf_rows_differ=frac)
    if args.fp8:
        sc = torch.einsum("bhd,bkd->bhk", iq.float(), keys.float())
        bs = sc.view(batch, HEADS, ctx // BLOCK, BLOCK).amax(-1).cpu()
        del sc
        row += fp8_cells(results, case, sizes, run, sel, t, bs,
                         lambda t8: f"{t8 * 1e3:.0f} us = {t8 / (floor / 2):.2f}x fp8 floor")
    log(" | ".join(row))
    del iq, keys, cache, tables, run
    common.empty_cache()
    return row


def main():
    ap = common.parser(__doc__, smoke=True)
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
    args = ap.parse_args()
    out_dir = Path(args.out)
    results = common.start_run("bench_index", out_dir, "index branch benchmark", log)
    g = torch.Generator().manual_seed(0)
    log(f"heads {HEADS}, dim {DIM}, block {BLOCK}, topk {TOPK}, local {LOCAL}, page {args.page_size}, bf16")
    if args.sweep:
        sweep(args, g, results)
    if args.sweep_fp8:
        sweep_fp8(args, g, results)
    if args.sweep_decode:
        sweep_decode(args, g, results)
    if args.engines:
        compare_engines(args, g, results)
    if not args.sweeps_only:
        sizes = [8192, 32768] if args.quick else [8192, 32768, 131072]
        batch, ctxs = 32, [32768] if args.quick else [32768, 131072]
        if SMOKE:
            sizes, batch, ctxs = [512, 1024], 3, [1024]
        rows = [prefill_row(n, args, g, results) for n in sizes]
        rows += [decode_row(batch, ctx, args, g, results) for ctx in ctxs]
        fp8_cols = ["fp8 keys, bf16 dot", "fp8 keys, fp8 dot", "fp8 keys, one scale, fp8 dot"] if args.fp8 else []
        log()
        log(common.md_table(["case", "Triton index_topk", "rate", "transformers indexer math", "torch index_topk",
                             *fp8_cols], rows))
    results.write()
    log.write(out_dir / "bench_index.log")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"(bench wall time {time.time() - t0:.0f} s)")
