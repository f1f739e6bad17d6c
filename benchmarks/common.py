"""What the benchmarks share: the M3 workload (shapes, block selections, paged caches),
timing, result rows written as JSON, logs and markdown tables, the common flags, and the
instrumentation of generate() (whether it compiled its decode step, a profile per decode
step).

Import this module before ``triton`` and ``m3_sparse``: it puts ``torch-ext`` (the kernel
sources) and the repository root (``m3_hf_attention``) on ``sys.path``, and a hidden
``--cpu-smoke`` flag on the command line turns on Triton's interpreter, which has to be
chosen before any kernel is decorated. A smoke run executes a benchmark's own logic on the
CPU at toy sizes; its "times" are single wall-clock calls and mean nothing.

Results: every benchmark collects :class:`Results` rows (one per timed thing: the
benchmark, the case, its sizes, the median in ms, the baseline it is compared with, the
device, torch / triton / CUDA versions, the date and the command line, plus the figures
particular to the row under ``metrics``) and writes them as one JSON list per run,
``<out>/<benchmark>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "torch-ext"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
    # The public ops would take the torch path on CPU tensors; the smoke run is for the kernels.
    os.environ["M3_SPARSE_IMPL"] = "triton"

import torch  # noqa: E402

DEVICE = torch.device("cpu" if SMOKE else "cuda")

# M3's sparse attention (M3_SPEC sections 1 and 5): query heads, KV heads, head dim, keys per
# block, selected blocks per (token, KV head); the index branch's heads and head dim.
HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
GROUP = HQ // HKV
INDEX_HEADS, INDEX_DIM = 4, 128
# Roofline ceilings of the H200 the floors are computed against.
PEAK_BYTES = 4.2e12  # device-to-device copy, bytes read + written per second (M3_SPEC section 3)
PEAK_FLOPS = 700e12  # bf16 GEMM 8192^3 (M3_SPEC section 3)
PEAK_FP8_FLOPS = 1281e12  # fp8 GEMM (docs/PERF.md, ceilings)
E4M3_MAX = 448.0
GIB = 1 << 30
# A workspace budget no call reaches: KV-outer then runs in one pass, no query slices.
UNBOUNDED = 1 << 62


# --------------------------------------------------------------------------- arguments


def default_out() -> str:
    return os.environ.get("OUT") or "out"


def common_args(*, sizes: str | None = None, sizes_help: str = "", smoke: bool = False) -> argparse.ArgumentParser:
    """Parent parser of the flags every benchmark takes: ``--out``, and where the benchmark
    has them ``--sizes`` (comma separated, ``k`` = 1024) and the hidden ``--cpu-smoke``."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--out", default=default_out(),
                    help="directory of the run's results (JSON rows, logs, tables); default $OUT, else ./out")
    if sizes is not None:
        ap.add_argument("--sizes", default=sizes, help=sizes_help or f"comma-separated sizes, k = 1024 (default {sizes})")
    if smoke:
        ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    return ap


def parser(doc: str | None, **common) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the description, the common flags."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   parents=[common_args(**common)])


def count(text: str) -> int:
    """'8192' or '8k' -> 8192; '1m' -> 1048576."""
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def int_list(text: str) -> list[int]:
    """'8192,32k' -> [8192, 32768] (empty items skipped)."""
    return [count(x) for x in text.split(",") if x.strip()]


def int_tuples(text: str, n: int | tuple[int, ...], flag: str) -> list[tuple[int, ...]]:
    """'4:4:1,8:8:2' -> [(4, 4, 1), (8, 8, 2)]; each item has ``n`` fields (one of ``n``)."""
    sizes = (n,) if isinstance(n, int) else n
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            vals = tuple(int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"{flag}: expected {' or '.join(map(str, sizes))} integers separated by ':', "
                             f"got {item!r}") from None
        if len(vals) not in sizes:
            raise SystemExit(f"{flag}: expected {' or '.join(map(str, sizes))} fields, got {item!r}")
        out.append(vals)
    return out


# --------------------------------------------------------------------------- reporting


class Log:
    """Lines printed as they come and kept for the run's log file; ``echo`` replaces
    ``print`` (a progress bar's own writer, for one)."""

    def __init__(self, echo=None):
        self.lines: list[str] = []
        self.echo = echo

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        self.lines.append(line)
        if self.echo is not None:
            self.echo(line)
        else:
            print(line, flush=True)

    def write(self, path: str | Path, tail: str = "") -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(self.lines) + "\n" + (f"\n{tail}\n" if tail else ""))
        return path


class NoBar:
    """Stands in for tqdm when it is not importable."""

    def __init__(self, total, **_):
        self.total, self.n = total, 0

    def set_postfix_str(self, s, refresh=True):
        print(f"[{self.n}/{self.total}] {s}", flush=True)

    def update(self, k=1):
        self.n += k

    def write(self, s):
        print(s, flush=True)

    def close(self):
        pass


def pyplot():
    """(matplotlib.pyplot on the file-only Agg backend, None), or (None, why a plot is skipped)
    where matplotlib is not installed: plots are optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return None, f"plot skipped: matplotlib is not importable ({exc})"
    return plt, None


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values`` (numpy's, interpolating linearly between
    order statistics), or None for no values."""
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else None


def md_table(header, rows) -> str:
    """A markdown table: ``header`` the column names, ``rows`` lists of cells (str() each)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x, nd: int = 2) -> str:
    """``x`` with ``nd`` decimals, "-" for None (not measured) and NaN (failed)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def ratio(a, b, nd: int = 1) -> str:
    return f"{a / b:.{nd}f}" if a and b else "-"


def tokens_label(n: int) -> str:
    """8192 -> '8K', 1048576 -> '1M', 1000 -> '1000'."""
    if n and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)


def device_name() -> tuple[str, int]:
    """(name, multiprocessor count) of the benchmarked device."""
    if SMOKE or not torch.cuda.is_available():
        return "cpu", 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, props.multi_processor_count


def environment() -> dict:
    """What a result depends on besides the code: device, versions, date, command line."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name, sms = device_name()
    return {
        "device": name,
        "sms": sms,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python3", *sys.argv]),
    }


def header(title: str, env: dict | None = None) -> list[str]:
    """The first lines of a log: what ran, where, on which versions."""
    env = env or environment()
    return [
        f"# {title}, {env['date']}",
        f"# {env['device']} ({env['sms']} SMs), torch {env['torch']}, triton {env['triton']}, cuda {env['cuda']}",
        f"# {env['command']}",
    ]


def jsonable(x):
    """``x`` in plain JSON types: NaN and infinities become null (strict JSON has neither),
    dtypes, devices and paths strings, dataclasses dicts, small tensors lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [jsonable(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return jsonable(dataclasses.asdict(x))
    if isinstance(x, torch.Tensor):
        return jsonable(x.tolist()) if x.numel() <= 4096 else f"tensor {tuple(x.shape)} {x.dtype}"
    return str(x)


def write_json(path: str | Path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(obj), indent=1) + "\n")
    return path


def result_path(out: str | Path, name: str) -> Path:
    """``out/name.json``; an ``out`` that ends in .json is the file itself."""
    out = Path(out)
    return out if out.suffix == ".json" else out / f"{name}.json"


class Results:
    """The rows of one run of a benchmark, written as one JSON list (``write``, which may be
    called again as rows come in: the file always holds the rows so far)."""

    def __init__(self, bench: str, out: str | Path, name: str | None = None):
        self.bench = bench
        self.path = result_path(out, name or bench)
        self.env = environment()
        self.rows: list[dict] = []

    def add(self, case: str, ms: float | None, *, what: str | None = None, sizes: dict | None = None,
            baseline: str | None = None, baseline_ms: float | None = None, **metrics) -> dict:
        """One timed thing: ``case`` the workload, ``what`` the code timed on it, ``ms`` its
        median (None: not measured), ``baseline`` what it is compared with and that one's
        median; ``metrics`` every other figure of the row (errors, floors, rates)."""
        row = {
            "bench": self.bench, "case": case, "what": what, "sizes": sizes or {}, "ms": ms,
            "baseline": baseline, "baseline_ms": baseline_ms, "metrics": metrics, **self.env,
        }
        self.rows.append(row)
        return row

    def write(self) -> Path:
        return write_json(self.path, self.rows)


def start_run(bench: str, out: str | Path, title: str, log: Log) -> Results:
    """A run's result rows, its header (``header``) logged first."""
    results = Results(bench, out)
    for line in header(title, results.env):
        log(line)
    return results


# --------------------------------------------------------------------------- timing


def sync(device: torch.device | None = None) -> None:
    """Wait for the GPU (``device``'s, when given; nothing for a CPU device)."""
    if SMOKE or not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return
    torch.cuda.synchronize(device)


def empty_cache() -> None:
    if not SMOKE and torch.cuda.is_available():
        torch.cuda.empty_cache()


def wall_ms(fn) -> float:
    """One call, wall clock (the smoke run's stand-in for every timer)."""
    t = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t) * 1e3


def median_ms(fn, *, warmup: int = 25, rep: int = 200) -> float:
    """Median of ``triton.testing.do_bench`` (CUDA events; it clears the L2 before every run)."""
    if SMOKE:
        return wall_ms(fn)
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def cudagraph_ms(fn, *, rep: int = 100) -> float:
    """Median of ``triton.testing.do_bench_cudagraph``: replays of a CUDA graph of
    back-to-back calls, so the host's launch cost is left out (and the call is shown to be
    capturable)."""
    if SMOKE:
        return wall_ms(fn)
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep, return_mode="median")


class _Eager:
    """Stands in for a captured graph in a smoke run."""

    def __init__(self, fn):
        self.replay = fn


def capture(fn):
    """One call of ``fn`` captured in a CUDA graph (after two warm-up calls on a side stream)."""
    if SMOKE:
        return _Eager(fn)
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


def graph_replay_ms(fn, *, warmup: int = 10, rep: int = 100) -> float:
    """``median_ms`` of replays of one captured call: the kernel time without the host's."""
    graph = capture(fn)
    try:
        return median_ms(graph.replay, warmup=warmup, rep=rep)
    finally:
        del graph


class L2Flush:
    """Evicts the L2 (60 MB on the H200) by touching a 256 MB buffer. ``mode="write"`` zeroes
    it, which leaves the L2 full of dirty lines that the next kernel writes back to HBM while
    it reads (as after a layer that wrote its output); ``"read"`` sums it, which leaves clean
    lines (as after a kernel that only reads): the next kernel then moves its own bytes only."""

    def __init__(self, mode: str = "write", nbytes: int = 256 << 20, device=None):
        if mode not in ("write", "read"):
            raise ValueError(f"flush mode: expected 'write' or 'read', got {mode!r}")
        self.mode = mode
        self.buf = torch.empty(nbytes, dtype=torch.int8, device=device or DEVICE)
        self.words = self.buf.view(torch.int32)
        self.words.fill_(1)
        self.total = torch.empty((), dtype=torch.int64, device=self.buf.device)

    def __call__(self) -> None:
        if self.mode == "write":
            self.buf.zero_()
        else:
            torch.sum(self.words, dim=0, dtype=torch.int64, out=self.total)


def event_ms(fn, *, reps: int = 3, flush: bool = True, lead_ms: float = 0.0) -> tuple[float, float]:
    """(median event time of ``fn`` over ``reps`` calls after one warm-up, the longest host
    time of one call). ``flush``: an L2 flush before each call; ``lead_ms``: a spin kernel
    holds the GPU that long before the start event, so the host issues the call while the
    GPU is still busy (see ``host_ahead_ms``)."""
    if SMOKE:
        return wall_ms(fn), 0.0
    fn()
    torch.cuda.synchronize()
    flusher = L2Flush("write") if flush else None
    cycles = spin_cycles(lead_ms) if lead_ms else 0
    times, host_ms = [], 0.0
    for _ in range(reps):
        if flusher is not None:
            flusher()
        if cycles:
            torch.cuda._sleep(cycles)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host_ms = max(host_ms, (time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), host_ms


def slow_ms(fn, reps: int = 3) -> float:
    """For calls of hundreds of ms: one warm-up, the median of a few flushed event timings."""
    return event_ms(fn, reps=reps)[0]


_SPIN: dict = {}


def spin_cycles(ms: float) -> int:
    """Clock cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``ms``."""
    if "per_ms" not in _SPIN:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10**7)
        b.record()
        torch.cuda.synchronize()
        _SPIN["per_ms"] = 10**7 / a.elapsed_time(b)
    return int(ms * _SPIN["per_ms"])


def host_ahead_ms(fn, reps: int = 5, lead_ms: float = 50.0) -> float:
    """GPU time of one call whose launches the host has already issued, as inside a model's
    forward pass, where the host runs ahead of the GPU: a spin kernel holds the GPU for
    ``lead_ms`` after the L2 flush while the host enqueues the call. ``slow_ms`` and
    ``median_ms`` instead also count the time the GPU waits for the host's first launches
    and for small kernels launched one after the other. A call whose host side outlasts the
    lead is reported on stderr."""
    t, host_ms = event_ms(fn, reps=reps, lead_ms=lead_ms)
    if host_ms > 0.8 * lead_ms:
        print(f"host_ahead_ms: the host took {host_ms:.1f} ms of the {lead_ms:.0f} ms lead", file=sys.stderr)
    return t


def host_ms(fn, reps: int = 21, lead_ms: float = 20.0) -> float:
    """Median host time of issuing one call (``perf_counter`` around it), each while a spin
    kernel holds the GPU for ``lead_ms``, so that no call waits on the GPU: what the call
    costs the host of an eager forward pass."""
    if SMOKE:
        return wall_ms(fn)
    fn()
    torch.cuda.synchronize()
    cycles = spin_cycles(lead_ms)
    times = []
    for _ in range(reps):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def host_profile(fn, reps: int = 21, lead_ms: float = 20.0, top: int = 30) -> str:
    """Where the host time of one call goes: ``cProfile`` over ``reps`` calls, each issued
    while a spin kernel holds the GPU for ``lead_ms`` (as in :func:`host_ms`, so no call waits
    on the GPU); the ``top`` functions by their own time, as ``pstats`` prints them."""
    import cProfile

    fn()
    sync()
    profile = cProfile.Profile()
    cycles = None if SMOKE or not torch.cuda.is_available() else spin_cycles(lead_ms)
    for _ in range(reps):
        if cycles is not None:
            torch.cuda._sleep(cycles)
        profile.enable()
        fn()
        profile.disable()
        sync()
    return profile_text(profile, "tottime", top)


def profile_text(profile, order: str, top: int = 30) -> str:
    """The ``top`` functions of a ``cProfile.Profile`` sorted by ``order`` ("tottime",
    "cumulative"), as ``pstats`` prints them."""
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(order).print_stats(top)
    return text.getvalue()


@contextlib.contextmanager
def direct_launches(launch, on: bool):
    """The direct launches of ``launch`` (the kernel package's ``core.launch``) on (its
    default) or off, its caches emptied when changed."""
    releases = launch.DIRECT_LAUNCH_TRITON
    if not on:
        launch.DIRECT_LAUNCH_TRITON = ()
        launch._launch_cache.clear()
    try:
        yield
    finally:
        if not on:
            launch.DIRECT_LAUNCH_TRITON = releases
            launch._launch_cache.clear()


def in_graph_ms(fn, *, calls: int = 20, reps: int = 15, flush_mode: str = "write") -> float:
    """Median ms per call inside one graph of ``calls`` calls, each after an L2 flush
    (``L2Flush``), minus a graph of the flushes alone: what a call costs inside a captured
    decode step, launch gaps included, the one-off graph launch not."""
    if SMOKE:
        return median_ms(fn)
    flush = L2Flush(flush_mode)

    def graph(with_call: bool):
        def run():
            for _ in range(calls):
                flush()
                if with_call:
                    fn()

        return capture(run)

    def timed(g) -> float:
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    g_both, g_flush = graph(True), graph(False)
    t = (timed(g_both) - timed(g_flush)) / calls
    del g_both, g_flush, flush
    return t


class Clock:
    """Times of code regions on the device's timeline: CUDA events (read once at the end,
    no sync inside a timed region) or perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def kernel_info(kernel) -> str:
    """Registers, spills and shared memory of a Triton kernel's latest compiled variant."""
    try:
        caches = getattr(kernel, "device_caches", None)
        compiled = list(next(iter(caches.values()))[0].values())[-1]
        return f"regs {compiled.n_regs} spills {compiled.n_spills} smem {compiled.metadata.shared // 1024}K"
    except Exception as e:  # noqa: BLE001
        return f"(no info: {type(e).__name__})"


@contextlib.contextmanager
def env_var(name: str, value: str):
    """``name=value`` in the environment for the block, the old value (or none) after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# --------------------------------------------------------------------------- workload


def varlen(batch: int, q_len: int, ctx: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens_q, used_kv_lens) of ``batch`` sequences of ``ctx`` cached tokens whose last
    ``q_len`` are this call's queries."""
    device = device or DEVICE
    cu = torch.arange(0, batch * q_len + 1, q_len, device=device, dtype=torch.int32)
    kv = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    return cu, kv


def paged_kv(gen: torch.Generator, pages: int, page: int, *, heads: int = HKV, dim: int = D,
             dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V page pools ``[pages, heads, page, dim]`` (K drawn first, then V)."""
    dev = gen.device
    k = torch.randn(pages, heads, page, dim, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(pages, heads, page, dim, device=dev, dtype=dtype, generator=gen)
    return k, v


def shuffled_tables(gen: torch.Generator, batch: int, width: int) -> torch.Tensor:
    """Block tables ``[batch, width]`` over a shuffled pool of ``batch * width`` pages."""
    return torch.randperm(batch * width, device=gen.device, generator=gen).to(torch.int32).view(batch, width)


def paginate(seqs: list[torch.Tensor], page: int, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major tensors ``[S_b, *rest]`` (one per sequence) laid over a page pool in the
    order ``perm``: (cache ``[pages, page, *rest]``, block tables ``[B, max pages]`` int32).
    Sequence b takes the next ``ceil(S_b / page)`` ids of ``perm``; its last page is padded
    with zeros."""
    counts = [-(-s.shape[0] // page) for s in seqs]
    rest = tuple(seqs[0].shape[1:])
    dev = seqs[0].device
    perm = perm.to(dev)
    cache = torch.empty(sum(counts), page, *rest, dtype=seqs[0].dtype, device=dev)
    tables = torch.zeros(len(seqs), max(counts), dtype=torch.int32, device=dev)
    start = 0
    for b, (s, n) in enumerate(zip(seqs, counts)):
        ids = perm[start : start + n]
        start += n
        flat = torch.zeros(n * page, *rest, dtype=s.dtype, device=dev)
        flat[: s.shape[0]] = s
        cache[ids] = flat.view(n, page, *rest)
        tables[b, :n] = ids.to(torch.int32)
    return cache, tables


def block_selection(pattern: str, pos: torch.Tensor, num_blocks: int, gen: torch.Generator, *,
                    heads: int = HKV, topk: int = TOPK, block: int = BLOCK, popularity: torch.Tensor | None = None,
                    row_group: torch.Tensor | None = None, chunk_elems: int = 1 << 28) -> torch.Tensor:
    """Selections ``[R, heads, topk]`` int32 of query rows at key positions ``pos`` [R]:
    slot 0 the row's own (local) block ``pos // block``, then its best ``topk - 1`` strictly
    earlier blocks by a random score, -1 in the slots left over.

    "random": scores uniform in [0, 1); "hot": ``2 * popularity[row_group[r], h, b] + 0.5 *
    noise[r, h, b]`` (standard normal noise), where ``popularity [P, heads, num_blocks]`` is
    shared by the rows of a group: blocks that a whole sequence favours. Scores are drawn
    for chunks of rows of at most ``chunk_elems`` values, which bounds the buffer (and fixes
    how the generator's stream is consumed, so a benchmark keeps its chunk size)."""
    if pattern not in ("random", "hot"):
        raise ValueError(f"selection pattern: expected 'random' or 'hot', got {pattern!r}")
    dev = pos.device
    rows = pos.shape[0]
    local = pos // block
    sel = torch.full((rows, heads, topk), -1, dtype=torch.int32, device=dev)
    kk = min(topk - 1, num_blocks)
    chunk = max(1, chunk_elems // (heads * num_blocks))
    blocks = torch.arange(num_blocks, device=dev)
    for t0 in range(0, rows, chunk):
        t1 = min(rows, t0 + chunk)
        if pattern == "hot":
            noise = torch.randn(t1 - t0, heads, num_blocks, device=dev, generator=gen)
            score = 2 * popularity[row_group[t0:t1]] + 0.5 * noise
        else:
            score = torch.rand(t1 - t0, heads, num_blocks, device=dev, generator=gen)
        earlier = blocks[None, None, :] < local[t0:t1, None, None]
        score = score.masked_fill(~earlier, float("-inf"))
        if kk > 0:
            val, idx = score.topk(kk, -1)
            sel[t0:t1, :, 1 : 1 + kk] = torch.where(val > float("-inf"), idx, -1).to(torch.int32)
        sel[t0:t1, :, 0] = local[t0:t1, None].to(torch.int32)
        del score
    return sel


def canon(sel: torch.Tensor) -> torch.Tensor:
    """Selections with each row's ids sorted and the -1 slots last: equal sets compare equal."""
    big = torch.iinfo(torch.int32).max
    s = torch.where(sel < 0, big, sel).sort(-1).values
    return torch.where(s == big, -1, s)


def e4m3_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of ``x`` with one scale per row of the last dim (its largest magnitude onto
    448): (codes, fp32 scales ``x.shape[:-1]``)."""
    scale = x.float().abs().amax(-1).clamp(min=1e-12) / E4M3_MAX
    codes = (x.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def e4m3_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of ``x`` with one scale for the whole tensor: (codes, fp32 scale [1])."""
    scale = (x.float().abs().amax().clamp(min=1e-12) / E4M3_MAX).reshape(1)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 difference of ``a`` from ``b`` (in fp64)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def sparse_reference(q, k, v, sel, bt, cu, kv, tokens: torch.Tensor, *, block: int = BLOCK):
    """Exact causal attention (fp32) of query rows ``tokens`` over their selected blocks, a
    repeated id counted once: (out ``[n, Hq, D]``, lse ``[Hq, n]``). Token-major q, paged
    ``[pages, Hkv, page, D]`` K/V as the ops take them; scale ``D ** -0.5``."""
    hq, d = q.shape[1], q.shape[2]
    hkv, page = k.shape[1], k.shape[2]
    topk = sel.shape[2]
    tokens = tokens.long()
    dev = q.device
    seq = torch.searchsorted(cu[1:].long(), tokens, right=True)
    pos = kv.long()[seq] - cu.long()[seq + 1] + tokens
    s_sel = sel[tokens].long()
    before = torch.ones(topk, topk, dtype=torch.bool, device=dev).tril(-1)
    repeated = ((s_sel[..., :, None] == s_sel[..., None, :]) & before).any(-1)
    ok = (s_sel >= 0) & ~repeated
    kpos = s_sel.clamp(min=0)[..., None] * block + torch.arange(block, device=dev)  # [n, Hkv, K, B]
    vis = ok[..., None] & (kpos <= pos[:, None, None, None])
    kpos = kpos.clamp(max=bt.shape[1] * page - 1)
    pg = bt.long()[seq[:, None, None, None], kpos // page]
    heads = torch.arange(hkv, device=dev)[None, :, None, None]
    kk = k[pg, heads, kpos % page].float().flatten(2, 3)  # [n, Hkv, K*B, D]
    vv = v[pg, heads, kpos % page].float().flatten(2, 3)
    qq = q[tokens].float().view(-1, hkv, hq // hkv, d)
    s = torch.einsum("nhgd,nhkd->nhgk", qq, kk) * d**-0.5
    s = s.masked_fill(~vis.flatten(2, 3)[:, :, None, :], float("-inf"))
    out = torch.einsum("nhgk,nhkd->nhgd", torch.softmax(s, -1), vv).reshape(-1, hq, d)
    return out, torch.logsumexp(s, -1).reshape(-1, hq).T


def sampled_error(p: dict, out: torch.Tensor, lse: torch.Tensor, n_check: int, *, block: int = BLOCK) -> float:
    """Largest relative RMS error (out, lse) of the first and last ``n_check / 2`` query rows
    against ``sparse_reference``; ``p`` holds the call's q, k, v, sel, bt, cu, kv."""
    t = p["q"].shape[0]
    half = n_check // 2
    tokens = torch.unique(torch.cat([torch.arange(0, min(t, half)), torch.arange(max(0, t - half), t)]))
    tokens = tokens.to(p["q"].device)
    ref, ref_lse = sparse_reference(*(p[x] for x in ("q", "k", "v", "sel", "bt", "cu", "kv")), tokens, block=block)
    e_out = (out[tokens].float() - ref).norm() / ref.norm()
    e_lse = (lse[:, tokens] - ref_lse).norm() / ref_lse.norm()
    return max(float(e_out), float(e_lse))


def cudnn_causal(q: torch.Tensor, n_seq: int, seq_len: int, log=print) -> tuple[float | None, str]:
    """Dense causal cuDNN SDPA over ``n_seq`` sequences of ``seq_len`` tokens (q token-major
    ``[n_seq * seq_len, Hq, D]``, random contiguous K/V of ``HKV`` heads): (ms, note). Native
    GQA first, K/V heads expanded where cuDNN refuses it; flushed event timings from 32K
    tokens on, ``median_ms`` below."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, d = q.shape[1], q.shape[2]
    qq = q.view(n_seq, seq_len, hq, d).transpose(1, 2)
    k = torch.randn(n_seq, HKV, seq_len, d, device=q.device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    timer = slow_ms if n_seq * seq_len >= 32768 else median_ms
    note = "gqa"
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            t = timer(lambda: F.scaled_dot_product_attention(qq, k, v, is_causal=True, enable_gqa=True))
    except RuntimeError as e:
        log(f"  cudnn enable_gqa failed ({str(e).splitlines()[0][:120]}); expanding K/V heads")
        note = "expanded kv"
        k = k.repeat_interleave(hq // HKV, 1)
        v = v.repeat_interleave(hq // HKV, 1)
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                t = timer(lambda: F.scaled_dot_product_attention(qq, k, v, is_causal=True))
        except RuntimeError as e2:
            return None, f"failed: {str(e2).splitlines()[0][:80]}"
    del k, v
    return t, note


def randomize_norms(model, gen: torch.Generator | None = None) -> None:
    """Random RMSNorm gains (N(0, 0.5^2); from ``gen`` when given, else torch's global
    generator). They start at zero (a 1 + w gain), which makes every index head score alike
    and the selections uniform across queries and heads."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                if gen is None:
                    p.normal_(0.0, 0.5)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


# --------------------------------------------------------------------------- generate() instrumentation


class CompiledCalls:
    """Counts the forward calls that ``model.generate()`` makes through its compiled forward,
    inside the ``with`` block. generate() asks the model for that forward
    (``get_compiled_call``, public in transformers) only when it compiles the decode step:
    a compileable cache on a device it compiles for, and no ``disable_compile``. So
    ``calls == 0`` after a generate() means its decode ran eagerly."""

    def __init__(self, model):
        self.model = model
        self.calls = 0

    def __enter__(self):
        ask = self.model.get_compiled_call

        def get_compiled_call(compile_config):
            forward = ask(compile_config)

            def counted(*args, **kwargs):
                self.calls += 1
                return forward(*args, **kwargs)

            return counted

        # An instance attribute, found before the class's method; removed on exit.
        self.model.get_compiled_call = get_compiled_call
        return self

    def __exit__(self, *exc):
        del self.model.get_compiled_call
        return False


STEP_MARK = "generate.decode_step"
# Runtime / driver calls during which the host waits for the GPU rather than issuing work
# (a device-to-host copy waits for the stream; so does every synchronize).
_WAITS = ("Synchronize", "Memcpy")
# Host events of a torch.compile'd call: the guard check that picks the compiled frame (run
# before the frame, not inside it), then the frame itself (named "...: frame id/compile id").
_GUARD_CHECK = "TorchDynamo Cache Lookup"
_COMPILED_FRAME = "Torch-Compiled Region"


def _is_graph_launch(name: str) -> bool:
    """cudaGraphLaunch / cuGraphLaunch (a version suffix such as ``_v10000`` allowed)."""
    return "GraphLaunch" in name


def _is_launch(name: str) -> bool:
    """cudaLaunchKernel(ExC), cuLaunchKernel(Ex) (Triton), cooperative launches, and graph
    launches, each one launch."""
    return "LaunchKernel" in name or "LaunchCooperativeKernel" in name or _is_graph_launch(name)


def start_profiler_early(device: torch.device) -> None:
    """One empty profiler session on ``device``'s process before any CUDA graph is captured:
    the profiler shows the kernels inside a graph only when its tracing was set up before
    the graph was captured."""
    if device.type != "cuda":
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]):
        torch.cuda.synchronize(device)


class StepProfiler:
    """A logits processor (generate() calls it once per generated token, on the host, after
    the forward that produced the token's logits) that runs ``torch.profiler`` over the last
    ``steps`` decode steps of a call of ``new_tokens`` tokens, earlier steps being the
    warm-up (compilation, CUDA-graph recording).

    Each profiled step is one window, marked with ``record_function``: it opens when the
    previous token has been processed and closes after the step's own token, once the GPU
    has finished (a synchronize before the window closes, another before the first opens),
    so it holds everything generate() does for one token (input preparation, the forward,
    logits processing, the stopping check) and every kernel the step launched starts and
    ends inside it. ``summary()`` reads the trace (``step_profile``)."""

    def __init__(self, prompt_len: int, new_tokens: int, steps: int, device: torch.device, trace: Path | None = None):
        if not 1 <= steps <= new_tokens - 2:
            raise ValueError(f"profile steps: expected 1 to {new_tokens - 2} of {new_tokens} tokens, got {steps}")
        self.prompt_len, self.new_tokens, self.device, self.trace = prompt_len, new_tokens, device, trace
        self.first = new_tokens - steps  # token index of the first profiled step
        self.prof = None
        self.window = None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _open(self, token: int):
        self.window = torch.profiler.record_function(f"{STEP_MARK}.{token}")
        self.window.__enter__()

    def __call__(self, input_ids, scores):
        token = input_ids.shape[1] - self.prompt_len  # 0: the prefill's token; t >= 1: decode step t's
        if token == self.first - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self._sync()
            self.prof.start()
            self._open(token + 1)
        elif self.first <= token < self.new_tokens and self.window is not None:
            self._sync()
            self.window.__exit__(None, None, None)
            self.window = None
            if token + 1 < self.new_tokens:
                self._open(token + 1)
            else:
                self.prof.stop()
        return scores

    def summary(self) -> dict:
        """``step_profile`` of the recorded trace (kept at ``trace`` when given)."""
        if self.prof is None or self.window is not None:
            raise RuntimeError("the profiled decode steps did not all run")
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(self.trace) if self.trace else Path(tmp) / "trace.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
        return step_profile(events, gpu=self.device.type == "cuda")


def step_profile(events: list[dict], gpu: bool) -> dict:
    """Per decode step, from a chrome trace of ``StepProfiler`` (its ``STEP_MARK`` windows):

    * host_ms: the window's wall time minus the time spent in runtime / driver calls that
      wait for the GPU (synchronizes and memory copies: a device-to-host copy waits for the
      stream): what the host spends issuing the step, profiler overhead included (a few
      microseconds per op);
    * gpu_ms: the summed duration of the GPU kernels that start inside the window (inside a
      CUDA graph too, where the profiler shows them), memory copies and sets left out;
    * launches: kernel launch calls plus graph launches, one each (graph_launches: the
      latter alone); kernels: GPU kernels run, each kernel of a replayed graph counted;
    * guard_ms and frame_ms, parts of host_ms: torch.compile's guard checks, and the host
      time inside its compiled frames (outermost ones, waits left out), where the step ran
      through torch.compile (0 where it did not). The rest of host_ms is generate()'s own
      loop around the model call.

    Medians over the windows, and the per-window values under ``per_step``. Without a GPU
    (``gpu`` False) the GPU figures are None."""
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(STEP_MARK + "."))
    if not windows:
        raise ValueError(f"no {STEP_MARK} window in the trace")
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    waits = [e for e in calls if any(w in e["name"] for w in _WAITS)]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    host = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    guards = [e for e in host if e.get("name") == _GUARD_CHECK]
    frames = _outermost([e for e in host if str(e.get("name", "")).startswith(_COMPILED_FRAME)])
    steps = []
    for a, b in windows:
        inside = [e for e in calls if a <= e["ts"] < b]
        waited = _overlap(waits, a, b)
        run = [k for k in kernels if a <= k["ts"] < b]
        mine = [f for f in frames if a <= f["ts"] < b]
        steps.append({
            "host_ms": (b - a - waited) / 1e3,
            "guard_ms": sum(g["dur"] for g in guards if a <= g["ts"] < b) / 1e3,
            "frame_ms": sum(f["dur"] - _overlap(waits, f["ts"], f["ts"] + f["dur"]) for f in mine) / 1e3,
            "gpu_ms": sum(k["dur"] for k in run) / 1e3 if gpu else None,
            "launches": sum(_is_launch(e["name"]) for e in inside) if gpu else None,
            "graph_launches": sum(_is_graph_launch(e["name"]) for e in inside) if gpu else None,
            "kernels": len(run) if gpu else None,
        })
    out = {key: (None if steps[0][key] is None else statistics.median(s[key] for s in steps)) for key in steps[0]}
    out["steps"] = len(steps)
    out["per_step"] = steps
    return out


def _overlap(waits: list[dict], a: float, b: float) -> float:
    """Time (us) of the calls in ``waits`` that start in [a, b), cut at b."""
    return sum(min(e["ts"] + e["dur"], b) - e["ts"] for e in waits if a <= e["ts"] < b)


def _outermost(spans: list[dict]) -> list[dict]:
    """The spans not inside another one of them (a compiled frame can call another)."""
    out, end = [], float("-inf")
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out
