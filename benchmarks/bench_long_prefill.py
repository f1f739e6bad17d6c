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
partials. Peak memory: ``torch.cuda.max_memory_allocated`` during the
call minus what the inputs already held. Times: median event timings of one call, and of
one call with the host ahead of the GPU (``bench_kvouter.bench_host_ahead``). Dense cuDNN causal attention of the same
prompt is timed alongside up to --dense-max tokens. The last thing printed is a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "torch-ext"))

import m3_sparse  # noqa: E402
from bench_kvouter import bench_host_ahead, bench_slow, dense_cudnn  # noqa: E402

HQ, HKV, D, HI, DI, BLOCK, TOPK, PAGE = 64, 4, 128, 4, 128, 128, 16, 128
GIB = 1 << 30


def make_inputs(n: int, seed: int = 0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    pages = -(-n // PAGE)
    bf = torch.bfloat16
    return dict(
        q=torch.randn(n, HQ, D, device=dev, dtype=bf, generator=g),
        k=torch.randn(pages, HKV, PAGE, D, device=dev, dtype=bf, generator=g),
        v=torch.randn(pages, HKV, PAGE, D, device=dev, dtype=bf, generator=g),
        iq=torch.randn(n, HI, DI, device=dev, dtype=bf, generator=g),
        ik=torch.randn(pages, PAGE, DI, device=dev, dtype=bf, generator=g),
        bt=torch.randperm(pages, device=dev, generator=g).to(torch.int32)[None],
        cu=torch.tensor([0, n], device=dev, dtype=torch.int32),
        kv=torch.tensor([n], device=dev, dtype=torch.int32),
    )


def quantize_fp8(p, index_scale="token"):
    """The fp8 layer's inputs: per-tensor e4m3 q/K/V; e4m3 index keys with a scale per
    token, or ("tensor") one scale for the cache, which the index kernel does not read."""
    f8 = torch.float8_e4m3fn
    out = dict(p)
    for name in ("q", "k", "v"):
        scale = p[name].abs().amax().float() / 448.0
        out[name] = (p[name].float() / scale).to(f8)
        out[f"{name}_scale"] = scale.reshape(1)
    if index_scale == "tensor":
        ik_scale = (p["ik"].abs().amax().float().clamp(min=1e-12) / 448.0).reshape(1)
        out["ik"] = (p["ik"].float() / ik_scale).clamp(-448, 448).to(f8)
    else:
        ik_scale = p["ik"].abs().amax(-1).float().clamp(min=1e-12) / 448.0  # [pages, PAGE]
        out["ik"] = (p["ik"].float() / ik_scale[..., None]).to(f8)
    out["ik_scale"] = ik_scale
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


def measure(n, budget, dense_max, kind="bf16", index_scale="token"):
    fp8, partial_dtype = KINDS[kind]
    p = make_inputs(n)
    if fp8:
        p = quantize_fp8(p, index_scale)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sparse_layer(p, budget, partial_dtype)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - held
    t = bench_slow(lambda: sparse_layer(p, budget, partial_dtype))
    t_ahead = bench_host_ahead(lambda: sparse_layer(p, budget, partial_dtype))
    dense = None
    if n <= dense_max:
        dense, _ = dense_cudnn({"q": make_inputs(n)["q"] if fp8 else p["q"], "n_seq": 1, "seq_len": n})
    del p
    torch.cuda.empty_cache()
    return dict(n=n, budget=budget, ms=t, ms_host_ahead=t_ahead, peak_gib=peak / GIB, dense_ms=dense, kind=kind,
                index_scale=index_scale if fp8 else None)


# Kernel name -> stage, for the per-budget breakdown.
STAGES = (
    ("_chunk_rank_kernel", "build"),
    ("_chunk_scan_kernel", "build"),
    ("_scatter_kernel", "build"),
    ("_emit_tiles_kernel", "schedule"),
    ("_kvouter_partials_kernel", "partials"),
    ("_kvouter_partials_tma_kernel", "partials"),
    ("_combine_kernel", "combine"),
)


def _stage(name):
    for key, stage in STAGES:
        if key in name:
            return stage
    return "other"


def profile(n, budgets, out_dir, fp8=False, fp8_partials=False, fp8_pages=False):
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
    kinds = [("bf16", p, {})]
    quantized = fp8 or fp8_partials or fp8_pages
    if quantized:
        p8 = quantize_fp8(p)
        scales8 = {f"{x}_scale": p8[f"{x}_scale"] for x in ("q", "k", "v")}
        kinds += [("fp8", p8, scales8)] if fp8 else []
        kinds += [("fp8+e4m3 partials", p8, dict(scales8, partial_dtype=torch.float8_e4m3fn))] if fp8_partials else []
        if fp8_pages:
            pages8 = dict(p8, q=p["q"])
            kv8 = {"k_scale": p8["k_scale"], "v_scale": p8["v_scale"]}
            kinds += [("bf16 q, fp8 pages", pages8, kv8)]
            kinds += [("bf16 q, fp8 pages+e4m3 partials", pages8, dict(kv8, partial_dtype=torch.float8_e4m3fn))]
    for budget, (kind, pk, scales) in [(b, k) for b in budgets for k in kinds]:
        per_row = HKV * TOPK * (HQ // HKV) * (D * (1 if "partial_dtype" in scales else 2) + 8)
        call = lambda: m3_sparse.kvouter_attention(  # noqa: E731
            pk["q"], pk["k"], pk["v"], sel, pk["bt"], cu_seqlens_q=pk["cu"], used_kv_lens=pk["kv"],
            block_size=BLOCK, max_workspace_bytes=budget, **scales,
        )
        call()
        torch.cuda.synchronize()
        wall = bench_slow(call)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        ms = {}
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None)
            if t is None:
                t = ev.cuda_time_total
            if t:
                ms[_stage(ev.key)] = ms.get(_stage(ev.key), 0.0) + t / 1e3
        name = "unbounded" if budget >= 1 << 49 else f"{budget / GIB:g}GiB"
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        (Path(out_dir) / f"profile_{n}_{re.sub(r'[^0-9A-Za-z]+', '_', kind)}_{name}.txt").write_text(table)
        window = min(n, max(1, budget // per_row))
        rows.append(dict(inputs=kind, budget=name, window=window, slices=-(-n // window), wall=wall, **ms))
        print(rows[-1], flush=True)
    dense = None
    if quantized:
        del kinds, p8
        torch.cuda.empty_cache()
        dense, _ = dense_cudnn({"q": p["q"], "n_seq": 1, "seq_len": n})
    (Path(out_dir) / f"profile_{n}.json").write_text(json.dumps(dict(rows=rows, dense_ms=dense), indent=1))
    cols = ("build", "schedule", "partials", "combine", "other")
    print(f"\n## attention only, {n} tokens: GPU ms by stage per workspace budget (query window)\n")
    if dense:
        print(f"dense bf16 cuDNN causal attention, same run: {dense:.1f} ms\n")
    print("| inputs | budget | rows per slice | slices | " + " | ".join(cols) + " | GPU total | wall ms | dense / wall |")
    print("|---|---|---|---|" + "---|" * (len(cols) + 3))
    for r in rows:
        gpu = sum(r.get(c, 0.0) for c in cols)
        vals = " | ".join(f"{r.get(c, 0.0):.2f}" for c in cols)
        ratio = f"{dense / r['wall']:.1f}" if dense else "-"
        print(f"| {r['inputs']} | {r['budget']} | {r['window']} | {r['slices']} | {vals} | {gpu:.2f} | {r['wall']:.2f} | {ratio} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32768,131072,262144,524288")
    ap.add_argument("--budgets", default="1,2,4,8,unbounded", help="GiB budgets swept at 128K")
    ap.add_argument("--dense-max", type=int, default=131072)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
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
    if args.profile:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        budgets = [1 << 50 if b == "unbounded" else int(float(b) * GIB) for b in args.profile_budgets.split(",")]
        profile(131072, budgets, args.out, fp8=args.fp8, fp8_partials=args.fp8_partials, fp8_pages=args.fp8_pages)
        return
    rows = []
    default = m3_sparse.interface.DEFAULT_WORKSPACE_BYTES
    kinds = ["bf16"] + ["fp8"] * args.fp8 + ["fp8+e4m3 partials"] * args.fp8_partials
    for n in [int(x) for x in args.sizes.split(",")]:
        for kind in kinds:
            rows.append(measure(n, default, args.dense_max, kind, args.index_scale))
            print(rows[-1], flush=True)
    if 131072 in [int(x) for x in args.sizes.split(",")]:
        for b in args.budgets.split(","):
            budget = 1 << 50 if b == "unbounded" else int(float(b) * GIB)
            if budget == default:
                continue
            for kind in kinds:
                rows.append(measure(131072, budget, 0, kind, args.index_scale))
                print(rows[-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_long_prefill.json").write_text(json.dumps(rows, indent=1))
    print("\n| tokens | inputs | workspace budget | index + attention ms | same, host ahead | peak extra GiB "
          "| dense cuDNN ms | dense / sparse (host ahead) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = "unbounded" if r["budget"] >= 1 << 49 else f"{r['budget'] / GIB:g} GiB"
        d = f"{r['dense_ms']:.1f}" if r["dense_ms"] else "-"
        ratio = f"{r['dense_ms'] / r['ms']:.1f} ({r['dense_ms'] / r['ms_host_ahead']:.1f})" if r["dense_ms"] else "-"
        kind = f"{r['kind']} ({r['index_scale']} index scale)" if r["index_scale"] else r["kind"]
        print(f"| {r['n']} | {kind} | {b} | {r['ms']:.1f} | {r['ms_host_ahead']:.1f} | {r['peak_gib']:.1f} | {d} | {ratio} |")


if __name__ == "__main__":
    main()
