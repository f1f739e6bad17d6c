#!/usr/bin/env python3
"""The first ``generate()`` of a process, as a user starting a script or a server pays it:
each configuration in a fresh Python process with empty compile caches (Triton's and
inductor's, ``TRITON_CACHE_DIR`` / ``TORCHINDUCTOR_CACHE_DIR`` in a new temporary folder), the
model built (bench_generate's M3-shaped random model, ``--layers``), then one generate() of
``--size`` prompt tokens and ``--new-tokens`` tokens, then the same call again (everything warm).

The first call is split by what the process spent inside it (wall time of each kind of work on
the calling thread; work on other threads shows as the time the caller waited for it):

* ``triton``: Triton compiles (``triton.compiler.compile``) on the calling thread, and its
  waits for the compiles of compile-ahead passes (``core.launch.compile_ahead``), which run on
  a pool;
* ``inductor``: torch.compile (dynamo's frame compiles: tracing, inductor and the Triton
  kernels inductor builds, which run in its own worker processes);
* ``graphs``: CUDA-graph captures (``torch.cuda.CUDAGraph.capture_begin`` to ``capture_end``);
* ``flash_attn_4``: flash-attn-4's kernel compiles (``cutlass.cute.compile``), where it runs;
* ``other``: the rest (the forward passes themselves, cache set-up, generate()'s own work).

Compiles nested in another kind count once, under the outer one (a Triton compile inside a
graph capture counts as ``triton`` and is taken out of ``graphs``).

Configurations (``--configs``): ``dense`` and ``m3_sparse`` as bench_generate runs them
(the dense twin on sdpa with its static cache compiled by generate(); m3_sparse with its
default cache and dispatch, where each kernel compiles at its launch, one after another), and
``m3_sparse-ahead``: m3_sparse with compile-ahead passes (``M3_SPARSE_COMPILE_AHEAD=1``: an op's
first calls compile their kernels side by side on a thread pool first).

Each call also records torch.compile's own account of itself (``compile`` in the JSON): the
seconds of each of dynamo's timed phases (``torch._dynamo.utils.compile_times``; phases nest,
so a phase's time includes those it calls), the kernels inductor generated, the calls dynamo
captured into its graphs (about the graphs' nodes) and the graphs. The report lists the phases
where an m3_sparse configuration differs most from the dense twin: where m3_sparse's extra
inductor time goes.

Outputs in ``--out``: bench_first_call.md / .json / .log; each configuration's Triton compiles
(kernel and seconds, slowest first; ``kernels`` in the JSON), the inductor phases, then the
table, printed last.

    python3 benchmarks/bench_first_call.py --layers sssfsssfsssf --size 32k
    python3 benchmarks/bench_first_call.py --quick     # CPU smoke run (no compiles to split)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

CONFIGS = {
    "dense": ("dense", {}),
    "m3_sparse": ("m3_sparse", {"M3_SPARSE_COMPILE_AHEAD": "0"}),
    "m3_sparse-ahead": ("m3_sparse", {"M3_SPARSE_COMPILE_AHEAD": "1"}),
}
KINDS = ("triton", "inductor", "graphs", "flash_attn_4")
# Phases of torch.compile listed in the report: those that differ most from the dense twin's.
PHASES_SHOWN = 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=common.default_out())
    p.add_argument("--layers", default=None, help="layer pattern (default sssfsssfsssf; --quick sf)")
    p.add_argument("--size", default=None, help="prompt tokens, k = 1024 (default 32k; --quick 256)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per call (default 16; --quick 4)")
    p.add_argument("--configs", default="dense,m3_sparse,m3_sparse-ahead", help=f"from {list(CONFIGS)}")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration's process")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.layers = args.layers or ("sf" if args.quick else "sssfsssfsssf")
    args.size = args.size or ("256" if args.quick else "32k")
    args.new_tokens = args.new_tokens or (4 if args.quick else 16)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; expected names from {list(CONFIGS)}")
    return args


# ---------------------------------------------------------------------------------------
# the child: one configuration, one fresh process
# ---------------------------------------------------------------------------------------
class Split:
    """Wall time of the calling thread by kind of work (see the module's docstring)."""

    def __init__(self):
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.counts = dict.fromkeys(KINDS, 0)
        self.kernels: list[tuple[str, float]] = []  # (kernel, seconds) of each Triton compile, on any thread
        self._depth = 0
        self._open: dict = {}
        self._thread = threading.get_ident()

    @contextlib.contextmanager
    def timing(self, kind: str):
        if threading.get_ident() != self._thread:  # a pool's thread: the caller's wait counts
            yield
            return
        outer = self._depth == 0
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if outer:
                self.seconds[kind] += time.perf_counter() - start
                self.counts[kind] += 1

    def wrap(self, owner, name: str, kind: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            with self.timing(kind):
                return fn(*args, **kwargs)

        setattr(owner, name, timed)

    def begin(self, key, kind: str) -> None:
        """A span that starts and ends in two calls (a graph capture)."""
        if self._depth == 0:
            self._open[key] = time.perf_counter()
        self._depth += 1

    def end(self, key, kind: str) -> None:
        self._depth -= 1
        start = self._open.pop(key, None)
        if start is not None:
            self.seconds[kind] += time.perf_counter() - start
            self.counts[kind] += 1


def instrument(split: Split) -> None:
    import torch

    try:
        import triton.compiler as triton_compiler
        from triton.runtime import _async_compile
    except ImportError:
        triton_compiler = None
    if triton_compiler is not None:
        # JITFunction binds the package's ``compile`` at its first use: wrapped before any.
        compile_fn = triton_compiler.compile

        def compile(*args, **kwargs):  # on any thread: a compile-ahead pass compiles on a pool
            start = time.perf_counter()
            try:
                with split.timing("triton"):
                    return compile_fn(*args, **kwargs)
            finally:
                name = kernel_name(args[0] if args else kwargs.get("src"))
                split.kernels.append((name, time.perf_counter() - start))

        triton_compiler.compile = compile
        # The caller's waits for a pass's compiles: its mode's exit, or a launch that needs one.
        split.wrap(_async_compile.AsyncCompileMode, "__exit__", "triton")
        split.wrap(_async_compile.FutureKernel, "result", "triton")
    import torch._dynamo.convert_frame as convert_frame

    for name in ("_compile", "compile_frame"):  # the outer frame compile where this torch has it
        if hasattr(convert_frame, name):
            split.wrap(convert_frame, name, "inductor")
            break
    graph = torch.cuda.CUDAGraph
    begin, end = graph.capture_begin, graph.capture_end

    def capture_begin(self, *args, **kwargs):
        split.begin(id(self), "graphs")
        return begin(self, *args, **kwargs)

    def capture_end(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            split.end(id(self), "graphs")

    graph.capture_begin, graph.capture_end = capture_begin, capture_end
    try:
        import cutlass.cute as cute

        split.wrap(cute, "compile", "flash_attn_4")
    except ImportError:
        pass


def kernel_name(src) -> str:
    """The kernel a Triton compile builds: its source's function name (a JIT function's
    ``__name__``), else the source's own ``name``."""
    fn = getattr(src, "fn", None)
    return getattr(fn, "__name__", None) or getattr(src, "name", None) or type(src).__name__


def compile_state() -> dict:
    """torch.compile's counters so far: seconds per timed phase (summed over frames), kernels
    inductor generated, calls dynamo captured, graphs."""
    from torch._dynamo import utils as dynamo_utils
    from torch._inductor import metrics

    names, values = dynamo_utils.compile_times(repr="csv", aggregate=True)
    stats = dynamo_utils.counters["stats"]
    return {"phases": {n: float(v) for n, v in zip(names, values)}, "inductor_kernels": metrics.generated_kernel_count,
            "calls_captured": stats["calls_captured"], "graphs": stats["unique_graphs"]}


def compile_delta(before: dict, after: dict) -> dict:
    """What one call added to :func:`compile_state` (phases of at least 5 ms)."""
    phases = {n: round(t - before["phases"].get(n, 0.0), 3) for n, t in after["phases"].items()}
    return {"phases": {n: t for n, t in phases.items() if t >= 0.005},
            **{k: after[k] - before[k] for k in ("inductor_kernels", "calls_captured", "graphs")}}


def child(args) -> dict:
    split = Split()
    instrument(split)  # before the first Triton kernel is bound to its compile
    import torch

    import bench_generate as bg

    name = args.child
    gargs = bg.parse_args(["--layers", args.layers, "--sizes", args.size, "--new-tokens", str(args.new_tokens),
                           "--configs", CONFIGS[name][0], "--profile-steps", "0", "--out", args.out] + (["--quick"] if args.quick else []))
    gargs.device = torch.device(gargs.device) if isinstance(gargs.device, str) else gargs.device
    if gargs.device is None:
        gargs.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = bg.CONFIGS[CONFIGS[name][0]]
    shape = gargs.sizes[0]
    models = bg.build_models(gargs, args.layers, torch.bfloat16 if gargs.device.type == "cuda" else torch.float32)
    model = models[config.model]
    if config.model == "sparse":
        model.set_attn_implementation(config.attn)
    ids, mask = bg.make_prompt(shape, gargs.vocab, gargs.seed, gargs.device)
    ctx = bg.dense_backends(gargs.device) if config.model == "dense" else common.env_var("M3_SPARSE_IMPL", "auto")
    calls = []
    with ctx:
        for _ in range(2):
            before, compiled = dict(split.seconds), compile_state()
            common.sync(gargs.device)
            start = time.perf_counter()
            out = bg.generate(model, ids, mask, args.new_tokens, bg.call_args(config, model, shape, gargs))
            common.sync(gargs.device)
            total = time.perf_counter() - start
            parts = {k: split.seconds[k] - before[k] for k in KINDS}
            calls.append({"s": total, **parts, "other": total - sum(parts.values()),
                          "compile": compile_delta(compiled, compile_state())})
    return {"config": name, "first": calls[0], "warm": calls[1], "counts": split.counts, "compiles": len(split.kernels),
            "kernels": sorted(split.kernels, key=lambda k: -k[1]), "tokens": out[0, ids.shape[1]:][:8].tolist()}


# ---------------------------------------------------------------------------------------
# the parent: one fresh process per configuration
# ---------------------------------------------------------------------------------------
def run_config(args, name: str, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="first-call-") as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=f"{tmp}/triton", TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor",
                   PYTHONUNBUFFERED="1", **CONFIGS[name][1])
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--layers", args.layers,
               "--size", args.size, "--new-tokens", str(args.new_tokens), "--out", str(args.out)]
        if args.quick:
            cmd.append("--quick")
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            log(f"- {name}: no result within {args.timeout:g} s")
            return {"config": name, "status": "timeout"}
        wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        log(f"- {name}: the process failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
        return {"config": name, "status": "failed"}
    row = json.loads(lines[-1][len("RESULT "):])
    row.update(status="ok", process_s=wall)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = common.Log(echo=print)
    log(*common.header("The first generate() of a process, empty compile caches"))
    log(f"- layers {args.layers}, prompt {args.size} tokens, {args.new_tokens} new tokens; each configuration in a "
        "fresh process with empty Triton and inductor caches; times in seconds")
    rows = [run_config(args, name, log) for name in args.configs]
    base = next((r for r in rows if r["config"] == "dense" and r["status"] == "ok"), None)
    header = ["config", "first call", "vs dense", *KINDS, "other", "warm call", "Triton compiles", "process"]
    table = []
    for r in rows:
        if r["status"] != "ok":
            table.append([r["config"], r["status"], *[""] * (len(header) - 2)])
            continue
        first = r["first"]
        table.append([r["config"], common.fmt(first["s"], 1),
                      common.ratio(first["s"], base["first"]["s"], 2) if base else "",
                      *(common.fmt(first[k], 1) for k in (*KINDS, "other")), common.fmt(r["warm"]["s"], 2),
                      r["compiles"], common.fmt(r["process_s"], 1)])
    for r in rows:  # each compile, slowest first (seconds of its own thread)
        if r.get("kernels"):
            log(f"- {r['config']}: " + ", ".join(f"{k} {t:.1f}" for k, t in r["kernels"]))
    phases = compile_table(rows)
    if phases:
        log(f"torch.compile in the first call (the {PHASES_SHOWN} phases that differ most from the dense twin's, "
            "seconds; phases nest):")
        log(phases)
    log(common.md_table(header, table))
    common.write_json(out / "bench_first_call.json", {"environment": common.environment(), "args": vars(args),
                                                      "rows": rows})
    log.write(out / "bench_first_call.md")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def compile_table(rows: list[dict]) -> str | None:
    """torch.compile's account of each configuration's first call, the phases that differ most
    from the dense twin's first; None without a dense row or any compile."""
    ok = [r for r in rows if r["status"] == "ok"]
    base = next((r for r in ok if r["config"] == "dense"), None)
    if base is None or len(ok) < 2:
        return None
    first = {r["config"]: r["first"]["compile"] for r in ok}
    names = {n for c in first.values() for n in c["phases"]}
    if not names:
        return None

    def gap(name: str) -> float:
        own = first["dense"]["phases"].get(name, 0.0)
        return max(abs(c["phases"].get(name, 0.0) - own) for config, c in first.items() if config != "dense")

    shown = sorted(names, key=lambda n: (-gap(n), n))[:PHASES_SHOWN]
    table = [[n, *(common.fmt(c["phases"].get(n, 0.0), 2) for c in first.values())] for n in shown]
    table += [[label, *(c[key] for c in first.values())] for key, label in
              (("inductor_kernels", "kernels inductor generated"), ("calls_captured", "calls dynamo captured"),
               ("graphs", "graphs"))]
    return common.md_table(["phase", *first], table)


if __name__ == "__main__":
    sys.exit(main())
