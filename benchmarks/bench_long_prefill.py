"""One sparse M3 layer's prefill (index branch + KV-outer attention) at long prompts, with
the partial buffer bounded by ``max_workspace_bytes``: time and peak memory per prompt
length, and at 128K the effect of the workspace budget (query slices) on speed.

    python3 benchmarks/bench_long_prefill.py                      # 32K..512K + 128K budget sweep
    python3 benchmarks/bench_long_prefill.py --sizes 131072 --budgets 1,4,unbounded
    python3 benchmarks/bench_long_prefill.py --fp8 --sizes 32768,131072 --budgets 4,unbounded
    python3 benchmarks/bench_long_prefill.py --profile --fp8 --profile-budgets 4   # attention alone, by stage
    python3 benchmarks/bench_long_prefill.py --fp8 --fp8-partials --sizes 131072 --budgets 4
    python3 benchmarks/bench_long_prefill.py --profile --fp8-pages --profile-budgets 4   # bf16 q, fp8 K/V

Workload: Hq 64, Hkv 4, D 128, 4 index heads of dim 128, block 128, top-16, page 128, bf16,
one causal prefill; index queries/keys random, so the selections are the index kernel's
own (no hand-made pattern). ``--fp8`` adds the fp8 layer: q, K and V in e4m3 with per-tensor
scales (KV-outer on fp8 inputs, bf16 partials and output) and e4m3 index keys with per-token
scales read by the index kernel's fp8 MMA; ``--fp8-partials`` adds the fp8 layer with e4m3
partials (``partial_dtype=torch.float8_e4m3fn``); ``--fp8-pages`` (with ``--profile``) adds
what a model with an fp8 KV cache runs: a bf16 q over e4m3 K/V, with bf16 and with e4m3
partials. Peak memory: ``torch.cuda.max_memory_allocated`` during the call minus what the
inputs already held. Times: median event timings of one call, and of one call with the host
ahead of the GPU (``common.host_ahead_ms``). Dense cuDNN causal attention of the same prompt
is timed alongside up to --dense-max tokens. Result rows go to ``<out>/bench_long_prefill.json``
(``bench_long_prefill_profile.json`` with --profile); the last thing printed is a markdown
table.
"""

from __future__ import annotations

import re
from pathlib import Path

import common
from common import BLOCK, D, GIB, HKV, HQ, INDEX_DIM as DI, INDEX_HEADS as HI, SMOKE, TOPK

import torch  # noqa: E402

import m3_sparse  # noqa: E402
from m3_sparse import dispatch  # noqa: E402

PAGE = 128
log = common.Log()


def cuda() -> bool:
    return not SMOKE and torch.cuda.is_available()


def make_inputs(n: int, seed: int = 0):
    g = torch.Generator(device=common.DEVICE)
    g.manual_seed(seed)
    pages = -(-n // PAGE)
    bf = torch.bfloat16
    q = torch.randn(n, HQ, D, device=common.DEVICE, dtype=bf, generator=g)
    k, v = common.paged_kv(g, pages, PAGE)
    iq = torch.randn(n, HI, DI, device=common.DEVICE, dtype=bf, generator=g)
    ik = torch.randn(pages, PAGE, DI, device=common.DEVICE, dtype=bf, generator=g)
    cu, kv = common.varlen(1, n, n)
    return dict(q=q, k=k, v=v, iq=iq, ik=ik, bt=common.shuffled_tables(g, 1, pages), cu=cu, kv=kv)


def quantize_fp8(p, index_scale="token"):
    """The fp8 layer's inputs: per-tensor e4m3 q/K/V; e4m3 index keys with a scale per
    token, or ("tensor") one scale for the cache, which the index kernel does not read."""
    out = dict(p)
    for name in ("q", "k", "v"):
        out[name], out[f"{name}_scale"] = common.e4m3_tensor(p[name])
    out["ik"], out["ik_scale"] = (common.e4m3_tensor if index_scale == "tensor" else common.e4m3_rows)(p["ik"])
    return out


def sparse_layer(p, budget, partial_dtype=None):
    fp8 = "q_scale" in p
    sel = m3_sparse.index_topk(
        p["iq"], p["ik"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], topk=TOPK, block_size=BLOCK,
        max_seqlen_q=p["q"].shape[0], **({"index_k_scale": p["ik_scale"], "fp8_dot": True} if fp8 else {}),
    )
    scales = {f"{x}_scale": p[f"{x}_scale"] for x in ("q", "k", "v")} if fp8 else {}
    out, _ = m3_sparse.kvouter_attention(
        p["q"], p["k"], p["v"], sel, p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], block_size=BLOCK,
        max_workspace_bytes=budget, partial_dtype=partial_dtype, **scales,
    )
    return out


# Inputs of a row: bf16, fp8 q/K/V with bf16 partials, fp8 with e4m3 partials.
KINDS = {"bf16": (False, None), "fp8": (True, None), "fp8+e4m3 partials": (True, torch.float8_e4m3fn)}


def budget_name(budget: int) -> str:
    return "unbounded" if budget >= 1 << 49 else f"{budget / GIB:g}GiB"


def parse_budgets(text: str) -> list[int]:
    return [1 << 50 if b == "unbounded" else int(float(b) * GIB) for b in text.split(",") if b]


def measure(n, budget, dense_max, kind="bf16", index_scale="token"):
    fp8, partial_dtype = KINDS[kind]
    p = make_inputs(n)
    if fp8:
        p = quantize_fp8(p, index_scale)
    peak = None
    if cuda():
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        sparse_layer(p, budget, partial_dtype)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - held) / GIB
    t = common.slow_ms(lambda: sparse_layer(p, budget, partial_dtype))
    t_ahead = common.host_ahead_ms(lambda: sparse_layer(p, budget, partial_dtype))
    dense = None
    if n <= dense_max:
        dense, _ = common.cudnn_causal(make_inputs(n)["q"] if fp8 else p["q"], 1, n, log)
    del p
    common.empty_cache()
    return dict(n=n, budget=budget, ms=t, ms_host_ahead=t_ahead, peak_gib=peak, dense_ms=dense, kind=kind,
                index_scale=index_scale if fp8 else None)


# Kernel name -> stage, for the per-budget breakdown (names as the profiler reports them).
STAGES = (
    ("_chunk_rank_kernel", "build"),
    ("_chunk_scan_kernel", "build"),
    ("_segment_prefix_kernel", "build"),  # the segment offsets, and the schedule's tile prefix
    ("_scatter_kernel", "build"),
    ("_emit_tiles_kernel", "schedule"),
    ("_kvouter_partials_kernel", "partials"),
    ("_kvouter_partials_tma_kernel", "partials"),
    ("_combine_kernel", "combine"),
)
STAGE_COLUMNS = ("build", "schedule", "partials", "combine", "other")


def stage_of(name):
    for key, stage in STAGES:
        if key in name:
            return stage
    return "other"


def profile_kinds(p, fp8, fp8_partials, fp8_pages):
    """(label, inputs, extra kwargs of kvouter_attention) of the profiled rows."""
    kinds = [("bf16", p, {})]
    if not (fp8 or fp8_partials or fp8_pages):
        return kinds
    p8 = quantize_fp8(p)
    scales8 = {f"{x}_scale": p8[f"{x}_scale"] for x in ("q", "k", "v")}
    e4m3 = {"partial_dtype": torch.float8_e4m3fn}
    kinds += [("fp8", p8, scales8)] if fp8 else []
    kinds += [("fp8+e4m3 partials", p8, dict(scales8, **e4m3))] if fp8_partials else []
    if fp8_pages:
        pages8 = dict(p8, q=p["q"])
        kv8 = {"k_scale": p8["k_scale"], "v_scale": p8["v_scale"]}
        kinds += [("bf16 q, fp8 pages", pages8, kv8), ("bf16 q, fp8 pages+e4m3 partials", pages8, dict(kv8, **e4m3))]
    return kinds


def profile(n, budgets, out_dir, results, fp8=False, fp8_partials=False, fp8_pages=False):
    """GPU time of the attention call alone (selections precomputed) per workspace budget,
    summed over kernels by stage. A small budget is a query-window order: each slice of
    rows runs its partials and then its combine while its partials may still sit in L2,
    at the price of reloading every K/V block once per slice that selects it. ``fp8``: the
    same module on e4m3 q/K/V (per-tensor scales, bf16 partials) as extra rows, and dense
    bf16 cuDNN attention of the prompt timed once for the ratio; ``fp8_partials``: rows with
    e4m3 partials too; ``fp8_pages``: a bf16 q over the e4m3 K/V (a model's fp8 KV cache),
    with bf16 and with e4m3 partials."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    p = make_inputs(n)
    sel = m3_sparse.index_topk(
        p["iq"], p["ik"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], topk=TOPK, block_size=BLOCK,
        max_seqlen_q=n,
    )
    rows = []
    kinds = profile_kinds(p, fp8, fp8_partials, fp8_pages)
    activities = [ProfilerActivity.CUDA] if cuda() else [ProfilerActivity.CPU]
    for budget, (kind, pk, scales) in [(b, k) for b in budgets for k in kinds]:
        per_row = HKV * TOPK * (HQ // HKV) * (D * (1 if "partial_dtype" in scales else 2) + 8)
        call = lambda: m3_sparse.kvouter_attention(  # noqa: E731
            pk["q"], pk["k"], pk["v"], sel, pk["bt"], cu_seqlens_q=pk["cu"], used_kv_lens=pk["kv"],
            block_size=BLOCK, max_workspace_bytes=budget, **scales,
        )
        call()
        common.sync()
        wall = common.slow_ms(call)
        with torch_profile(activities=activities) as prof:
            call()
            common.sync()
        ms = {}
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None)
            if t is None:
                t = ev.cuda_time_total
            if t:
                ms[stage_of(ev.key)] = ms.get(stage_of(ev.key), 0.0) + t / 1e3
        name = budget_name(budget)
        sort = "cuda_time_total" if cuda() else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60)
        (Path(out_dir) / f"profile_{n}_{re.sub(r'[^0-9A-Za-z]+', '_', kind)}_{name}.txt").write_text(table)
        window = min(n, max(1, budget // per_row))
        rows.append(dict(inputs=kind, budget=name, window=window, slices=-(-n // window), wall=wall, **ms))
        print(rows[-1], flush=True)
    dense = None
    if len(kinds) > 1:
        del kinds
        common.empty_cache()
        dense, _ = common.cudnn_causal(p["q"], 1, n, log)
    for r in rows:
        results.add(f"attention only, {n} tokens, {r['inputs']}", r["wall"], what=f"kvouter_attention, budget {r['budget']}",
                    sizes={"n": n, "window": r["window"], "slices": r["slices"]},
                    baseline="cuDNN SDPA dense causal, bf16" if dense else None, baseline_ms=dense,
                    gpu_ms_by_stage={c: r.get(c, 0.0) for c in STAGE_COLUMNS})
    print(f"\n## attention only, {n} tokens: GPU ms by stage per workspace budget (query window)\n")
    if dense:
        print(f"dense bf16 cuDNN causal attention, same run: {dense:.1f} ms\n")
    print(common.md_table(
        ["inputs", "budget", "rows per slice", "slices", *STAGE_COLUMNS, "GPU total", "wall ms", "dense / wall"],
        [[r["inputs"], r["budget"], r["window"], r["slices"], *(f"{r.get(c, 0.0):.2f}" for c in STAGE_COLUMNS),
          f"{sum(r.get(c, 0.0) for c in STAGE_COLUMNS):.2f}", f"{r['wall']:.2f}", common.ratio(dense, r["wall"])]
         for r in rows]))


def main():
    ap = common.parser(__doc__.split("\n\n")[0], sizes="32768,131072,262144,524288", smoke=True)
    ap.add_argument("--budgets", default="1,2,4,8,unbounded", help="GiB budgets swept at 128K")
    ap.add_argument("--dense-max", type=int, default=131072)
    ap.add_argument("--profile", action="store_true",
                    help="only the attention call's GPU time by stage at 128K, per --profile-budgets")
    ap.add_argument("--profile-budgets", default="4,unbounded",
                    help="GiB budgets for --profile; small ones give short query windows (below ~0.04 GiB a "
                         "window's partials fit in L2)")
    ap.add_argument("--fp8", action="store_true", help="also run every row with fp8 q/K/V and fp8 index keys")
    ap.add_argument("--fp8-partials", action="store_true",
                    help="also run every row with fp8 inputs and e4m3 partials (partial_dtype=float8_e4m3fn)")
    ap.add_argument("--fp8-pages", action="store_true",
                    help="--profile: also run a bf16 q over e4m3 K/V (a model's fp8 KV cache), bf16 and e4m3 partials")
    ap.add_argument("--index-scale", default="token", choices=("token", "tensor"),
                    help="fp8 index keys: a scale per token (default) or one for the cache")
    args = ap.parse_args()
    sizes, long_n = common.int_list(args.sizes), 131072
    if SMOKE:
        sizes, long_n, args.dense_max = [256], 256, 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.profile:
        results = common.Results("bench_long_prefill", args.out, name="bench_long_prefill_profile")
        profile(long_n, parse_budgets(args.profile_budgets), args.out, results, fp8=args.fp8,
                fp8_partials=args.fp8_partials, fp8_pages=args.fp8_pages)
        results.write()
        return
    results = common.Results("bench_long_prefill", args.out)
    rows = []
    default = dispatch.DEFAULT_WORKSPACE_BYTES
    kinds = ["bf16"] + ["fp8"] * args.fp8 + ["fp8+e4m3 partials"] * args.fp8_partials
    jobs = [(n, default, args.dense_max, kind) for n in sizes for kind in kinds]
    if long_n in sizes:
        jobs += [(long_n, b, 0, kind) for b in parse_budgets(args.budgets) if b != default for kind in kinds]
    for n, budget, dense_max, kind in jobs:
        rows.append(measure(n, budget, dense_max, kind, args.index_scale))
        print(rows[-1], flush=True)
    for r in rows:
        kind = f"{r['kind']} ({r['index_scale']} index scale)" if r["index_scale"] else r["kind"]
        results.add(f"{r['n']} tokens, {kind}", r["ms"], what=f"index_topk + kvouter_attention, budget {budget_name(r['budget'])}",
                    sizes={"n": r["n"], "workspace_budget": r["budget"]}, baseline="cuDNN SDPA dense causal",
                    baseline_ms=r["dense_ms"], host_ahead_ms=r["ms_host_ahead"], peak_extra_gib=r["peak_gib"])
    results.write()
    print()
    print(common.md_table(
        ["tokens", "inputs", "workspace budget", "index + attention ms", "same, host ahead", "peak extra GiB",
         "dense cuDNN ms", "dense / sparse (host ahead)"],
        [[r["n"], f"{r['kind']} ({r['index_scale']} index scale)" if r["index_scale"] else r["kind"],
          budget_name(r["budget"]).replace("GiB", " GiB"), f"{r['ms']:.1f}", f"{r['ms_host_ahead']:.1f}",
          common.fmt(r["peak_gib"], 1), common.fmt(r["dense_ms"], 1),
          f"{r['dense_ms'] / r['ms']:.1f} ({r['dense_ms'] / r['ms_host_ahead']:.1f})" if r["dense_ms"] else "-"]
         for r in rows]))


if __name__ == "__main__":
    main()
