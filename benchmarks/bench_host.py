"""Host time of an eager generate() decode step, layer by layer: m3_sparse against its dense
twin, m3_sparse calling the ops where it runs plans of them (``hf.attention``'s
``PLANNED_MAX_QUERIES`` at 0), and m3_sparse with every kernel launched through Triton
(``core.launch``'s direct launches off), in turn on one machine.

    python3 benchmarks/bench_host.py --layers sssfsssfsssf --sizes 2k
    python3 benchmarks/bench_host.py --layers sssfsssfsssf --sizes 2k --pieces
    python3 benchmarks/bench_host.py --quick          # CPU smoke run (torch path, toy model)

Each repetition runs every configuration once, one after the other, so a host whose speed
drifts during the run drifts for all of them alike: an eager generate() of ``--new-tokens``
and one of 2 tokens, both without a logits processor; a steady step is their difference
over ``--new-tokens - 2`` (the prompt's prefill and the first step cancel). Every decoder
layer's forward is timed on the host with ``perf_counter`` around it; a layer's figure is
the same difference per step and layer. The table gives medians over ``--reps``; the
sparse layer's extra is its host time less the dense twin's layer (a full-attention layer
over a static cache with sdpa) of the same repetition, the median of those differences (the
host's speed drifts between repetitions more than within one). Rows go to
``<out>/bench_host.json``; the last thing printed is a markdown table.

``--pieces`` then times the pieces of a sparse layer's step: the op calls of the first
sparse layer in the third forward pass of an eager m3_sparse generate() (``index_prep``, the
runs of the ``index_topk`` and ``sparse_attention`` plans, the attention function), the run of
the first full layer's ``dense_paged_attention`` plan, and the dense twin's attention
function, each recorded with its arguments and repeated alone (``index_prep`` writes the
step's index keys into their pages again, the same values; the others write nothing); host
microseconds a call, the median of ``--reps`` rounds of ``PIECE_CALLS`` calls.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from contextlib import contextmanager

import common

import torch  # noqa: E402
from transformers import StaticCache  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface  # noqa: E402
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3  # noqa: E402

import bench_generate as bg  # noqa: E402
import m3_hf_attention  # noqa: E402  (registers m3_sparse)
from m3_hf_attention._kernel import kernel_module  # noqa: E402

CONFIGS = ("dense-eager", "m3_sparse-eager", "m3_sparse-eager-ops", "m3_sparse-eager-triton-launches")
PIECE_OPS = ("index_prep",)
PIECE_PLANS = (
    ("PlannedIndexTopk", "index_topk (a plan's run)"),
    ("PlannedAttention", "sparse_attention (a plan's run)"),
    ("PlannedDenseAttention", "dense_paged_attention (a plan's run, a full layer)"),
)
PIECE_CALLS = 200
M3_FUNCTION = "attention function (m3_sparse)"


def parse_args(argv=None):
    p = common.parser(__doc__, sizes=None, sizes_help="")
    p.add_argument("--sizes", default=None, help="one prompt shape, k = 1024, BxN for a batch (default 2k; --quick 64)")
    p.add_argument("--quick", action="store_true", help="toy shapes on the CPU")
    p.add_argument("--layers", default="sssfsssfsssf", help="layer pattern, s = sparse, f = full (default sssfsssfsssf)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens of the long call (default 42; --quick 6)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of every configuration (default 5; --quick 1)")
    p.add_argument("--pieces", action="store_true", help="also time each op call of a sparse layer's step alone")
    args = p.parse_args(argv)
    args.sizes = args.sizes or ("64" if args.quick else "2k")
    args.new_tokens = args.new_tokens or (6 if args.quick else 42)
    args.reps = args.reps or (1 if args.quick else 5)
    if args.new_tokens < 3:
        p.error("--new-tokens: at least 3 (a steady step is measured against a call of 2)")
    return args


@contextmanager
def layer_clock(totals: dict):
    """Host seconds of every decoder layer's forward, summed under "sparse" and "full"."""
    original = m3.MiniMaxM3VLDecoderLayer.forward

    def forward(self, *a, **k):
        t = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            kind = "sparse" if getattr(self.self_attn, "indexer", None) is not None else "full"
            totals[kind] = totals.get(kind, 0.0) + time.perf_counter() - t

    m3.MiniMaxM3VLDecoderLayer.forward = forward
    try:
        yield
    finally:
        m3.MiniMaxM3VLDecoderLayer.forward = original


@contextmanager
def planned(on: bool):
    """The integration's plans of the layers' ops on (its default) or off."""
    attention = kernel_module("hf.attention")
    bound = attention.PLANNED_MAX_QUERIES
    if not on:
        attention.PLANNED_MAX_QUERIES = 0
    try:
        yield
    finally:
        attention.PLANNED_MAX_QUERIES = bound


def direct_launches(on: bool):
    """The loaded kernel's direct launches on (its default) or off (``common.direct_launches``)."""
    return common.direct_launches(kernel_module("core.launch"), on)


def timed_call(model, ids, mask, new_tokens: int, dense: bool, device, cache=None) -> tuple[float, dict]:
    """(host seconds of one eager generate() call, its layers' host seconds by kind); ``cache``:
    the m3_sparse model's cache (default: generate()'s own)."""
    extra = {"disable_compile": True}
    if dense:
        extra["past_key_values"] = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
    elif cache is not None:
        extra["past_key_values"] = cache
    totals: dict = {}
    common.sync(device)
    with layer_clock(totals):
        t = time.perf_counter()
        bg.generate(model, ids, mask, new_tokens, extra)
        common.sync(device)
        return time.perf_counter() - t, totals


def setup(args):
    """(the sparse model on m3_sparse and its dense twin, prompt ids, mask, device)."""
    gen_args = bg.parse_args((["--quick"] if args.quick else []) + ["--layers", args.layers, "--sizes", args.sizes])
    models = bg.build_models(gen_args, args.layers, torch.float32 if args.quick else torch.bfloat16)
    models["sparse"].set_attn_implementation("m3_sparse")
    ids, mask = bg.make_prompt(bg.parse_sizes(args.sizes)[0], gen_args.vocab, 0, gen_args.device)
    return models, ids, mask, torch.device(gen_args.device)


def measure(args, models, ids, mask, device) -> list[dict]:
    steps = args.new_tokens - 2
    samples = {c: {"step": [], "sparse": [], "full": []} for c in CONFIGS}
    for rep in range(args.reps + 1):  # the first round warms every configuration up
        for config in CONFIGS:
            dense = config.startswith("dense")
            model = models["dense" if dense else "sparse"]
            with direct_launches(not config.endswith("triton-launches")), planned(not config.endswith("-ops")):
                short, short_layers = timed_call(model, ids, mask, 2, dense, device)
                long, long_layers = timed_call(model, ids, mask, args.new_tokens, dense, device)
            if rep == 0:
                continue
            samples[config]["step"].append((long - short) / steps)
            for kind in ("sparse", "full"):
                count = args.layers.count(kind[0]) if not dense else (len(args.layers) if kind == "full" else 0)
                if count:
                    per = (long_layers.get(kind, 0.0) - short_layers.get(kind, 0.0)) / steps / count
                    samples[config][kind].append(per)
    ms = lambda xs: statistics.median(xs) * 1e3 if xs else None  # noqa: E731
    dense_layers = samples["dense-eager"]["full"]
    rows = []
    for config in CONFIGS:
        s = samples[config]
        extra = [sparse - dense for sparse, dense in zip(s["sparse"], dense_layers)]  # repetition by repetition
        rows.append({
            "config": config, "step_ms": ms(s["step"]), "sparse_layer_ms": ms(s["sparse"]),
            "full_layer_ms": ms(s["full"]), "sparse_extra_ms": ms(extra),
            "sparse_extra_each_ms": [x * 1e3 for x in extra],
        })
    return rows


@contextmanager
def recorded_calls(calls: dict, armed: list):
    """While ``armed[0]``, keep the first call (function, args, kwargs) of each piece: the ops of
    ``PIECE_OPS``, the runs of the plans of ``PIECE_PLANS`` and the attention functions of
    m3_sparse and sdpa."""
    api = kernel_module("api")
    # (label, the function, how to put a function in its place)
    patched = [(name, getattr(api, name), functools.partial(setattr, api, name)) for name in PIECE_OPS]
    patched += [(label, getattr(api, cls).run, functools.partial(setattr, getattr(api, cls), "run"))
                for cls, label in PIECE_PLANS]
    patched += [(f"attention function ({impl})", ALL_ATTENTION_FUNCTIONS[impl],
                 functools.partial(AttentionInterface.register, impl)) for impl in ("m3_sparse", "sdpa")]

    def recording(label, fn):
        def call(*a, **k):
            # m3_sparse's attention function: a sparse layer's call (it has selections).
            if armed[0] and label not in calls and (label != M3_FUNCTION or k.get("block_indices") is not None):
                calls[label] = (fn, a, k)
            return fn(*a, **k)

        call.__dict__.update(fn.__dict__)  # markers such as is_m3_sparse_attention
        return call

    for label, fn, put in patched:
        put(recording(label, fn))
    try:
        yield
    finally:
        for _, fn, put in patched:
            put(fn)


def record_pieces(models, ids, mask, device) -> tuple[dict, object]:
    """The pieces' calls in the third forward pass (a decode step) of an eager generate() of
    each model: the first sparse layer's, and the dense twin's first layer's; and the sparse
    model's cache, which the caller keeps while it repeats them (the cache layers that the
    attention function reads hold it by a weak reference)."""
    calls: dict = {}
    new_tokens = 4
    cache = m3_hf_attention.M3PagedCache(models["sparse"].config, ids.shape[0], ids.shape[1] + new_tokens)
    for name, model in (("sparse", models["sparse"]), ("dense", models["dense"])):
        armed, forwards = [False], [0]

        def count(module, args, kwargs, armed=armed, forwards=forwards):
            forwards[0] += 1
            armed[0] = forwards[0] == 3

        hook = model.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            with recorded_calls(calls, armed):
                timed_call(model, ids, mask, new_tokens, name == "dense", device, cache)
        finally:
            hook.remove()
    return calls, cache


def time_pieces(calls: dict, reps: int, device) -> list[dict]:
    """Host microseconds a call of each recorded piece: median of ``reps`` rounds."""
    rows = []
    for label, (fn, a, k) in calls.items():
        fn(*a, **k)
        common.sync(device)
        rounds = []
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(PIECE_CALLS):
                fn(*a, **k)
            rounds.append((time.perf_counter() - t) / PIECE_CALLS * 1e6)
            common.sync(device)
        rows.append({"piece": label, "us": statistics.median(rounds)})
    return rows


def table(rows: list[dict], args) -> list[str]:
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [
        "| layers | context | config | step host ms | sparse layer ms | full layer ms | sparse layer - dense twin layer ms "
        "(range over repetitions) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = r["sparse_extra_each_ms"]
        spread = f" ({min(each):.3f} to {max(each):.3f})" if each else ""
        lines.append(f"| {args.layers} | {args.sizes} | {r['config']} | {f(r['step_ms'])} | {f(r['sparse_layer_ms'])} | "
                     f"{f(r['full_layer_ms'])} | {f(r['sparse_extra_ms'])}{spread} |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    log = common.Log()
    results = common.start_run("bench_host", args.out, "eager decode host time per step and layer", log)
    log(f"layers {args.layers}, size {args.sizes}, new tokens {args.new_tokens}, reps {args.reps}")
    models, ids, mask, device = setup(args)
    rows = measure(args, models, ids, mask, device)
    pieces = []
    if args.pieces:
        calls, _cache = record_pieces(models, ids, mask, device)
        pieces = time_pieces(calls, args.reps, device)
    for r in rows:
        results.add(f"{args.layers} {args.sizes}", r["step_ms"], what=r["config"], sizes={"size": args.sizes},
                    baseline="dense-eager", baseline_ms=rows[0]["step_ms"], sparse_layer_ms=r["sparse_layer_ms"],
                    full_layer_ms=r["full_layer_ms"], sparse_extra_ms=r["sparse_extra_ms"],
                    sparse_extra_each_ms=r["sparse_extra_each_ms"], reps=args.reps,
                    new_tokens=args.new_tokens)
    for piece in pieces:
        results.add(f"{args.layers} {args.sizes}", piece["us"] / 1e3, what=f"piece: {piece['piece']}",
                    sizes={"size": args.sizes}, calls=PIECE_CALLS, reps=args.reps)
    results.write()
    if pieces:
        log("| piece (one decode step: the first sparse layer, the first full layer; the dense twin's first layer) "
            "| host us a call |")
        log("|---|---|")
        for piece in pieces:
            log(f"| {piece['piece']} | {piece['us']:.1f} |")
        log("")
    for line in table(rows, args):
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
