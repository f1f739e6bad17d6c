#!/usr/bin/env python3
"""Where a prompt's prefill spends its GPU time: the kernels of one eager ``generate()`` of one
new token, m3_sparse against its dense twin, grouped by what they compute.

    python3 benchmarks/bench_prefill_kernels.py --layers sssfsssfsssf --sizes 8k,32k
    python3 benchmarks/bench_prefill_kernels.py --quick     # CPU smoke run (no kernels to split)

Models and prompts are bench_generate's (the M3-shaped random model of ``--layers`` and its
dense twin on sdpa over a static cache, as in ``bench_host.py``); each call is made twice
untimed (compiles), then once under ``torch.profiler`` with CUDA activity. Each kernel's time
counts in one group (``GROUPS``, by its name): the dense attention of full layers (the
twin's sdpa, flash-attn-4, the package's dense kernel), KV-outer, the index branch, and
everything else (norms, projections, rotary embeddings, the MLP: the same work in both
models). From the groups, the TTFT bound that the sparse layers cannot beat: the m3_sparse
prefill with its KV-outer and index kernels taken out, against the twin's (``free_sparse_x``),
and the same with m3_sparse's full layers at the twin's attention time as well
(``free_sparse_twin_full_x``). Rows go to ``<out>/bench_prefill_kernels.json``, the kernels
each call spent most on to the log, and a markdown table is printed last.
"""

from __future__ import annotations

import re
import sys

import common

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import StaticCache  # noqa: E402

import bench_generate as bg  # noqa: E402

# Kernel name patterns, first match wins. The twin's sdpa kernels (cuDNN's "fprop", flash,
# memory-efficient), flash-attn-4's and the package's dense kernel are dense attention.
GROUPS = (
    ("kvouter", re.compile(r"_kvouter_|_combine_kernel|_chunk_rank|_chunk_scan|_segment_prefix|_scatter_kernel|_emit_tiles")),
    ("index", re.compile(r"_index_")),
    ("dense_attention", re.compile(r"_dense_paged|sdpa|fmha|flash|attention", re.IGNORECASE)),
)
TOP = 12  # kernels logged per call


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def split(kernels: dict[str, float]) -> dict[str, float]:
    """Milliseconds per group (and ``all``) of ``{kernel name: ms}``."""
    out = {g: 0.0 for g, _ in GROUPS} | {"other": 0.0}
    for name, ms in kernels.items():
        out[group_of(name)] += ms
    out["all"] = sum(kernels.values())
    return out


def parse_args(argv=None):
    p = common.parser(__doc__, sizes=None, sizes_help="")
    p.add_argument("--sizes", default=None, help="prompt lengths, k = 1024, comma separated (default 32k; --quick 256)")
    p.add_argument("--layers", default=None,
                   help="layer pattern, s = sparse, f = full (default sssfsssfsssf; --quick sf)")
    p.add_argument("--quick", action="store_true", help="toy shapes on the CPU")
    args = p.parse_args(argv)
    args.sizes = args.sizes or ("256" if args.quick else "32k")
    args.layers = args.layers or ("sf" if args.quick else "sssfsssfsssf")
    return args


def kernels_of(call, device: torch.device) -> dict[str, float]:
    """{kernel name: ms} of one ``call()`` (device kernels; none on the CPU)."""
    call()
    call()
    common.sync(device)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        call()
        common.sync(device)
    if device.type != "cuda":
        return {}
    return {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages() if e.self_device_time_total > 0}


def main(argv=None) -> int:
    args = parse_args(argv)
    log = common.Log()
    results = common.start_run("bench_prefill_kernels", args.out, "a prefill's GPU time by kernel group", log)
    gen_args = bg.parse_args((["--quick"] if args.quick else []) + ["--layers", args.layers, "--sizes", args.sizes])
    models = bg.build_models(gen_args, args.layers, torch.float32 if args.quick else torch.bfloat16)
    models["sparse"].set_attn_implementation("m3_sparse")
    device = torch.device(gen_args.device)
    full_layers = args.layers.count("f")
    lines = []
    for shape in bg.parse_sizes(args.sizes):
        ids, mask = bg.make_prompt(shape, gen_args.vocab, 0, device)
        groups = {}
        for config, model in (("dense", models["dense"]), ("m3_sparse", models["sparse"])):
            def call(model=model, config=config):
                extra = {"disable_compile": True}
                if config == "dense":
                    extra["past_key_values"] = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 1)
                bg.generate(model, ids, mask, 1, extra)

            kernels = kernels_of(call, device)
            groups[config] = split(kernels)
            log(f"{shape.label} {config}: {groups[config]['all']:.1f} ms of kernels; the largest:")
            for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP]:
                log(f"  {ms:9.2f} ms  {group_of(name):15s}  {name[:100]}")
        dense, sparse = groups["dense"], groups["m3_sparse"]
        twin_full = dense["dense_attention"] * full_layers / len(args.layers)
        free = sparse["all"] - sparse["kvouter"] - sparse["index"]
        free_twin_full = free - sparse["dense_attention"] + twin_full

        def x(ms: float) -> float | None:  # the twin's kernel time over ms
            return dense["all"] / ms if ms > 0 else None

        for config, g in groups.items():
            bounds = {"free_sparse_x": x(free), "free_sparse_twin_full_x": x(free_twin_full)}
            extra = {} if config == "dense" else bounds
            results.add(f"{args.layers} {shape.label}", g["all"] or None, what=config, sizes={"size": shape.label},
                        baseline="dense", baseline_ms=dense["all"] or None, groups_ms=g, **extra)
        lines.append([
            shape.label, common.fmt(dense["all"], 1), common.fmt(sparse["all"], 1),
            common.fmt(dense["dense_attention"], 1), common.fmt(sparse["dense_attention"], 1),
            common.fmt(sparse["kvouter"], 1), common.fmt(sparse["index"], 1),
            common.fmt(dense["other"], 1), common.fmt(sparse["other"], 1),
            common.fmt(x(free)), common.fmt(x(free_twin_full)),
        ])
    results.write()
    log(common.md_table(
        ["prompt", "dense twin ms", "m3_sparse ms", "twin attention", "m3_sparse full layers' attention",
         "KV-outer", "index", "twin other", "m3_sparse other", "x twin, sparse layers free",
         "same, full layers at the twin's"],
        lines,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
