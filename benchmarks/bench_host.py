"""Host time of an eager generate() decode step, layer by layer: m3_sparse against its dense
twin, m3_sparse calling the ops where it runs plans of them (``hf.attention``'s ``PLANNED``
off), and m3_sparse with every kernel launched through Triton
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

``--prefill`` times the prompt's forward pass instead (an eager generate() of one token):
each decoder layer starts after a sync, with a spin kernel of ``PREFILL_LAYER_LEAD_MS`` holding
the GPU, so no layer waits for it, and each layer's figure is what issuing it costs the host.
Where a layer's spin ended before its issue did, the layer waited for the GPU (a sync inside
it, or a spin too short): the table counts such repetitions under "GPU caught up", and their
figures are not host time. m3_sparse runs with plans (the default), with the ops called
directly, and with every launch through Triton. ``--profile`` adds cProfile's view of the
sparse layers' forwards in the planned calls (functions by their own time, then by their
cumulative time).

    python3 benchmarks/bench_host.py --prefill --sizes 8k --profile

With ``--prefill``, ``--pieces`` times what the prompt's forward calls in its first sparse layer
(``index_prep``, the runs of the ``index_topk`` and ``sparse_attention`` plans, the attention
function), the first full layer's ``dense_paged_attention`` plan and the dense twin's attention
function, each repeated alone, ``PREFILL_PIECE_CALLS`` calls a round while a spin kernel holds
the GPU.

Otherwise ``--pieces`` times the pieces of a sparse layer's step: the op calls of the first
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
# A prefill calls these ops directly (no plans); dense_paged_attention from a full layer.
PREFILL_PIECE_OPS = ("index_topk", "sparse_attention", "dense_paged_attention")
PREFILL_PIECE_CALLS = 4  # calls a round, issued within PREFILL_LEAD_MS
PREFILL_CONFIGS = ("dense-eager", "m3_sparse-eager", "m3_sparse-eager-ops", "m3_sparse-eager-triton-launches")
# Longer than the host's issue of 4 calls of any piece.
PREFILL_LEAD_MS = 250.0
# Longer than the host's issue of one decoder layer of a prefill (a few ms; more under cProfile).
PREFILL_LAYER_LEAD_MS = 25.0
M3_FUNCTION = "attention function (m3_sparse)"


def parse_args(argv=None):
    p = common.parser(__doc__, sizes=None, sizes_help="")
    p.add_argument("--sizes", default=None, help="one prompt shape, k = 1024, BxN for a batch (default 2k; --quick 64)")
    p.add_argument("--quick", action="store_true", help="toy shapes on the CPU")
    p.add_argument("--layers", default="sssfsssfsssf", help="layer pattern, s = sparse, f = full (default sssfsssfsssf)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens of the long call (default 42; --quick 6)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of every configuration (default 5; --quick 1)")
    p.add_argument("--pieces", action="store_true", help="also time each op call of a sparse layer's step alone")
    p.add_argument("--prefill", action="store_true", help="time the prompt's forward pass (prefill) instead of a step")
    p.add_argument("--profile", action="store_true", help="with --prefill: cProfile of the sparse layers' forwards")
    args = p.parse_args(argv)
    args.sizes = args.sizes or ("64" if args.quick else "2k")
    args.new_tokens = args.new_tokens or (6 if args.quick else 42)
    args.reps = args.reps or (1 if args.quick else 5)
    if args.profile and not args.prefill:
        p.error("--profile: only with --prefill")
    if args.new_tokens < 3:
        p.error("--new-tokens: at least 3 (a steady step is measured against a call of 2)")
    return args


@contextmanager
def layer_clock(totals: dict, profile=None):
    """Host seconds of every decoder layer's forward, summed under "sparse" and "full";
    ``profile`` (a ``cProfile.Profile``) runs over the sparse layers' forwards."""
    original = m3.MiniMaxM3VLDecoderLayer.forward

    def forward(self, *a, **k):
        sparse = getattr(self.self_attn, "indexer", None) is not None
        if sparse and profile is not None:
            profile.enable()
        t = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            totals["sparse" if sparse else "full"] = totals.get("sparse" if sparse else "full", 0.0) + time.perf_counter() - t
            if sparse and profile is not None:
                profile.disable()

    m3.MiniMaxM3VLDecoderLayer.forward = forward
    try:
        yield
    finally:
        m3.MiniMaxM3VLDecoderLayer.forward = original


@contextmanager
def planned(on: bool):
    """The integration's plans of the layers' ops on (its default) or off."""
    attention = kernel_module("hf.attention")
    was = attention.PLANNED
    attention.PLANNED = on
    try:
        yield
    finally:
        attention.PLANNED = was


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


@contextmanager
def layer_leads(model, device, ms: float):
    """Before each decoder layer of ``model``: a sync, then a spin kernel of ``ms`` (none off
    CUDA), so the layer issues into an empty launch queue while the GPU is held. (Under one
    spin for the whole forward, the launches of many layers can fill the queue, and the issue
    then goes at the GPU's pace.) Yields a list that gets, as each layer's issue ends, whether
    its spin had already ended: then the layer waited for the GPU (a sync inside it, or a spin
    too short), and its figure holds device time."""
    cycles = common.spin_cycles(ms) if device.type == "cuda" else None
    caught_up: list[bool] = []
    done = []

    def lead(module, args, kwargs):
        if cycles is not None:
            common.sync(device)
            torch.cuda._sleep(cycles)
            done[:] = [torch.cuda.Event()]
            done[0].record()

    def issued(module, args, kwargs, output):
        if done:
            caught_up.append(done[0].query())

    hooks = []
    for layer in model.model.layers:
        hooks += [layer.register_forward_pre_hook(lead, with_kwargs=True),
                  layer.register_forward_hook(issued, with_kwargs=True)]
    try:
        yield caught_up
    finally:
        for hook in hooks:
            hook.remove()


def measure_prefill(args, models, ids, mask, device, profile=None) -> list[dict]:
    """Host ms of the prompt's forward pass per layer kind, each configuration in turn every
    repetition (the first warms them up); ``profile`` covers the sparse layers of m3_sparse-eager."""
    samples = {c: {"sparse": [], "full": [], "caught_up": 0} for c in PREFILL_CONFIGS}
    for rep in range(args.reps + 1):
        for config in PREFILL_CONFIGS:
            dense = config.startswith("dense")
            model = models["dense" if dense else "sparse"]
            extra = {"disable_compile": True}
            if dense:
                extra["past_key_values"] = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 1)
            totals: dict = {}
            profiled = profile if rep and config == "m3_sparse-eager" else None
            with (
                direct_launches(not config.endswith("triton-launches")), planned(not config.endswith("-ops")),
                layer_leads(model, device, PREFILL_LAYER_LEAD_MS) as caught_up,
            ):
                common.sync(device)
                with layer_clock(totals, profiled):
                    bg.generate(model, ids, mask, 1, extra)
                common.sync(device)
            if rep == 0:
                continue
            samples[config]["caught_up"] += any(caught_up)
            for kind in ("sparse", "full"):
                count = args.layers.count(kind[0]) if not dense else (len(args.layers) if kind == "full" else 0)
                if count:
                    samples[config][kind].append(totals.get(kind, 0.0) / count)
    ms = lambda xs: statistics.median(xs) * 1e3 if xs else None  # noqa: E731
    return [{"config": c, "sparse_layer_ms": ms(s["sparse"]), "full_layer_ms": ms(s["full"]),
             "sparse_layer_each_ms": [x * 1e3 for x in s["sparse"]], "gpu_caught_up": s["caught_up"]}
            for c, s in samples.items()]


def log_pieces(log, pieces: list[dict], what: str) -> None:
    if not pieces:
        return
    log(f"| piece ({what}) | host us a call |")
    log("|---|---|")
    for piece in pieces:
        log(f"| {piece['piece']} | {piece['us']:.1f} |")
    log("")


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _spread(each: list) -> str:
    """`` (lowest to highest)`` of a figure's repetitions, "" without any."""
    return f" ({min(each):.3f} to {max(each):.3f})" if each else ""


def prefill_table(rows: list[dict], args) -> list[str]:
    lines = ["| layers | prompt | config | sparse layer host ms (range) | full layer host ms | GPU caught up |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {args.layers} | {args.sizes} | {r['config']} | "
                     f"{_ms(r['sparse_layer_ms'])}{_spread(r['sparse_layer_each_ms'])} | {_ms(r['full_layer_ms'])} | "
                     f"{r['gpu_caught_up']} of {args.reps} |")
    if any(r["gpu_caught_up"] for r in rows):
        lines += ["", "Where the GPU caught up, a layer's spin had ended before its issue did: the host waited for "
                  "the GPU (a sync, or a spin too short), so those layer figures are not host time."]
    return lines


def prefill_main(args, log, results, models, ids, mask, device) -> int:
    import cProfile

    profile = cProfile.Profile() if args.profile else None
    rows = measure_prefill(args, models, ids, mask, device, profile)
    pieces = []
    if args.pieces:
        calls, _cache = record_pieces(models, ids, mask, device, prefill=True)
        pieces = time_pieces(calls, args.reps, device, lead_ms=PREFILL_LEAD_MS)
    for piece in pieces:
        results.add(f"{args.layers} {args.sizes} prefill", piece["us"] / 1e3, what=f"piece: {piece['piece']}",
                    sizes={"size": args.sizes}, calls=PREFILL_PIECE_CALLS, reps=args.reps)
    for r in rows:
        results.add(f"{args.layers} {args.sizes} prefill", r["sparse_layer_ms"], what=r["config"],
                    sizes={"size": args.sizes}, full_layer_ms=r["full_layer_ms"],
                    sparse_layer_each_ms=r["sparse_layer_each_ms"], reps=args.reps, lead_ms=PREFILL_LAYER_LEAD_MS,
                    gpu_caught_up=r["gpu_caught_up"])
    results.write()
    if profile is not None:
        log(f"cProfile of the sparse layers' prefill forwards, m3_sparse-eager, {args.reps} calls:")
        log(common.profile_text(profile, "tottime"))
        log(common.profile_text(profile, "cumulative", 60))
    log_pieces(log, pieces, "one prefill: the first sparse layer, the first full layer; the dense twin's first layer")
    for line in prefill_table(rows, args):
        log(line)
    return 0


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
def recorded_calls(calls: dict, armed: list, ops: tuple = ()):
    """While ``armed[0]``, keep the first call (function, args, kwargs) of each piece: the ops of
    ``PIECE_OPS`` and ``ops`` (the ops a prefill calls directly), the runs of the plans of
    ``PIECE_PLANS`` and the attention functions of m3_sparse and sdpa."""
    api = kernel_module("api")
    # (label, the function, how to put a function in its place)
    patched = [(name, getattr(api, name), functools.partial(setattr, api, name)) for name in PIECE_OPS + ops]
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


def record_pieces(models, ids, mask, device, prefill: bool = False) -> tuple[dict, object]:
    """The pieces' calls in the third forward pass (a decode step; with ``prefill`` the first,
    the prompt's) of an eager generate() of each model: the first sparse layer's, and the
    dense twin's first layer's; and the sparse model's cache, which the caller keeps while it
    repeats them (the cache layers that the attention function reads hold it by a weak
    reference)."""
    calls: dict = {}
    # A prefill's calls read the cache's step metadata, which a later step would rewrite.
    new_tokens = 1 if prefill else 4
    cache = m3_hf_attention.M3PagedCache(models["sparse"].config, ids.shape[0], ids.shape[1] + new_tokens)
    for name, model in (("sparse", models["sparse"]), ("dense", models["dense"])):
        armed, forwards = [False], [0]

        def count(module, args, kwargs, armed=armed, forwards=forwards):
            forwards[0] += 1
            armed[0] = forwards[0] == (1 if prefill else 3)

        hook = model.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            with recorded_calls(calls, armed, PREFILL_PIECE_OPS if prefill else ()):
                timed_call(model, ids, mask, new_tokens, name == "dense", device, cache)
        finally:
            hook.remove()
    return calls, cache


def time_pieces(calls: dict, reps: int, device, lead_ms: float | None = None) -> list[dict]:
    """Host microseconds a call of each recorded piece: median of ``reps`` rounds of
    ``PIECE_CALLS`` calls; with ``lead_ms``, rounds of ``PREFILL_PIECE_CALLS`` calls issued
    while a spin kernel of that length holds the GPU (a prefill's pieces: otherwise the
    rounds would time the GPU's work)."""
    rows = []
    cycles = common.spin_cycles(lead_ms) if lead_ms is not None and device.type == "cuda" else None
    n = PREFILL_PIECE_CALLS if lead_ms is not None else PIECE_CALLS
    for label, (fn, a, k) in calls.items():
        fn(*a, **k)
        common.sync(device)
        rounds = []
        for _ in range(reps):
            if cycles is not None:
                torch.cuda._sleep(cycles)
            t = time.perf_counter()
            for _ in range(n):
                fn(*a, **k)
            rounds.append((time.perf_counter() - t) / n * 1e6)
            common.sync(device)
        rows.append({"piece": label, "us": statistics.median(rounds)})
    return rows


def table(rows: list[dict], args) -> list[str]:
    lines = [
        "| layers | context | config | step host ms | sparse layer ms | full layer ms | sparse layer - dense twin layer ms "
        "(range over repetitions) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {args.layers} | {args.sizes} | {r['config']} | {_ms(r['step_ms'])} | {_ms(r['sparse_layer_ms'])} | "
                     f"{_ms(r['full_layer_ms'])} | {_ms(r['sparse_extra_ms'])}{_spread(r['sparse_extra_each_ms'])} |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    log = common.Log()
    what = "eager prefill host time per layer" if args.prefill else "eager decode host time per step and layer"
    results = common.start_run("bench_host", args.out, what, log)
    log(f"layers {args.layers}, size {args.sizes}, new tokens {args.new_tokens}, reps {args.reps}")
    models, ids, mask, device = setup(args)
    if args.prefill:
        return prefill_main(args, log, results, models, ids, mask, device)
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
    log_pieces(log, pieces, "one decode step: the first sparse layer, the first full layer; the dense twin's first layer")
    for line in table(rows, args):
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
