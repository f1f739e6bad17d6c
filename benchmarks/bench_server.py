#!/usr/bin/env python3
"""``m3-serve`` under load, measured with guidellm (the vLLM project's load generator for
OpenAI-compatible servers), against the dense twin served the same way.

For each ``--layers`` pattern, benchmarks/save_model.py's checkpoints (bench_generate's
M3-shaped model and its dense twin, with the toy tokenizer) are served one at a time by
``m3-serve --continuous-batching`` (m3_sparse, and ``--attn-implementation sdpa`` for the twin:
``paged|sdpa`` under the manager). guidellm then drives each server with synthetic prompts of
``--prompt-lens`` tokens (its ``synthetic_text`` data, counted with the checkpoint's tokenizer),
``--new-tokens`` each:

* a sweep (guidellm's ``sweep`` profile: one request at a time, then as fast as the server
  takes them, then ``--sweep-size`` - 2 constant rates between the two), each rate for
  ``--seconds``;
* a closed loop of ``--concurrency`` users (``concurrent``).

``--runs`` picks other runs, in the order given: ``sync`` (one request at a time),
``throughput`` (as fast as the server takes them), ``rates`` (one constant-rate run per
``--rates`` value) besides ``sweep`` and ``concurrent``. A rate is requests/s, or ``0.5x``:
that share of the highest requests/s the configuration has reached so far (its throughput
run, in this call or in the rows appended to). ``--append`` adds this call's rows to those of
OUT/bench_server.json (same prompts, new tokens and goodput bounds), so a configuration's full
length can be measured over several calls, each under a time limit::

    bench_server.py --configs m3_sparse --runs sync,throughput
    bench_server.py --configs m3_sparse --runs concurrent --append
    bench_server.py --configs m3_sparse --runs rates --rates 0.25x,0.5x,0.75x --append

(the closed loop before the rates: its requests/s can pass the throughput run's, and a share
is taken of the highest so far).

``--max-batch-tokens`` (the servers' ``--cb-max-batch-tokens``, the query tokens of one step)
takes a list: each value gets its own servers and runs, so one call shows what the step size
does to ITL p99 when prefill chunks share steps with decodes. Without it each server keeps its
command's default, listed as "default": m3-serve's own step size for m3_sparse
(``m3_hf_attention.serve.SERVE_STEP_TOKENS``) and transformers' for the twin.

Before them each server is warmed by two runs of ``--warmup-seconds`` each, whose figures are
dropped: one request at a time, then the closed loop. Their first steps compile the Triton
kernels of each step shape and capture the manager's graphs, which a long-running server has
done long before. The closed loop alone leaves the shapes of a lone request (its prefill
chunks, a decode step of one row) to the sweep's first run, whose requests then wait seconds
for their compiles.

Per run: output tok/s, requests/s, TTFT and ITL p50 / p99, and goodput: requests/s of those with
TTFT <= ``--ttft-slo`` ms and a mean ITL <= ``--itl-slo`` ms, all from guidellm's per-request
figures. guidellm's ITL of a request is its mean gap (the time from its first to its last token
over its tokens less one), and its percentiles are over requests, each weighted by its gaps: a
decode step held up by a prefill chunk only raises the means of the requests it held. So beside
each run of ``--runs rates``, ``benchmarks/stream_probe.py`` sends requests of its own at
``--probe-share`` of the run's rate (on top of it), times every streamed event of each, and
reports the p50 / p99 of the gaps between consecutive events, pooled ("gap ITL"), with the
tokens an event carried on average (the server sends a token whose bytes are not yet whole
UTF-8 characters with the next one). Written to OUT: bench_server.json
(every row, with guidellm's own JSON of each server beside it), bench_server.md and
bench_server.png (p50 / p99 latency against output tok/s). A configuration whose server stops
(or whose guidellm fails) is listed with the reason, from the server's log, under "Failed"; the
other configurations still run, and the exit status is 1. A run that guidellm gives no report
for within its time, twice, while the server still serves (it waits for the requests in flight,
which a slow server may not finish for minutes) is listed there too, and the configuration's
next runs go on. SIGTERM (a time limit's) or Ctrl-C
stops the server and guidellm run of the moment, writes the rows so far with the interrupted run
under "Failed", and exits with 128 + the signal's number.

guidellm's OpenAI backend sends vLLM's ``ignore_eos`` when the data fixes output lengths, and
transformers' server refuses unknown fields (422); the new tokens go as the backend's
``max_tokens`` instead, and the saved checkpoints have no end-of-sequence token, so every
request generates them all.

    python3 benchmarks/bench_server.py --layers sfs,sssfsssfsssf             # GPU, bf16
    python3 benchmarks/bench_server.py --quick                               # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import stream_probe  # noqa: E402

CONFIGS = {"m3_sparse": ("m3", []), "dense": ("dense", ["--attn-implementation", "sdpa"])}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=common.default_out())
    p.add_argument("--layers", default=None, help="patterns, comma separated (default sfs,sssfsssfsssf; --quick sf)")
    p.add_argument("--configs", default="m3_sparse,dense", help=f"from {list(CONFIGS)}")
    p.add_argument("--prompt-lens", default=None, help="MIN-MAX prompt tokens, k = 1024 (default 2k-32k; --quick 20-150)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 64; --quick 8)")
    p.add_argument("--runs", default="sweep,concurrent",
                   help=f"runs after the warm-ups, in order, from {list(RUN_KINDS)} (default sweep,concurrent)")
    p.add_argument("--rates", default=None,
                   help="constant request rates of the 'rates' runs: requests/s, or Fx for F times the highest "
                        "requests/s of the configuration's rows so far (0.5x)")
    p.add_argument("--append", action="store_true",
                   help="add the rows to those of OUT/bench_server.json (runs of the same prompts, new tokens and "
                        "bounds) and report them all")
    p.add_argument("--sweep-size", type=int, default=None, help="guidellm sweep runs (default 8; --quick 3)")
    p.add_argument("--concurrency", type=int, default=None, help="closed-loop users (default 64; --quick 4)")
    p.add_argument("--seconds", type=float, default=None, help="length of each run (default 60; --quick 8)")
    p.add_argument("--warmup-seconds", type=float, default=None,
                   help="length of each of the two warm-up runs (one request at a time, then the closed "
                        "loop), dropped (default 30; --quick 1)")
    p.add_argument("--ttft-slo", type=float, default=2000.0, help="goodput bound on TTFT, ms")
    p.add_argument("--itl-slo", type=float, default=50.0, help="goodput bound on a request's mean ITL, ms")
    p.add_argument("--probe-share", type=float, default=0.2,
                   help="rate of the per-gap probe's requests beside each run of --runs rates, as a share of its "
                   "rate, added to it (benchmarks/stream_probe.py; 0: no probe; default 0.2)")
    p.add_argument("--max-batch-tokens", default=None,
                   help="--cb-max-batch-tokens of both servers, k = 1024; a comma-separated list runs each value "
                   "(default: transformers' own)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="--cb-num-blocks of both servers (default: transformers sizes the pool from the free memory; "
                   "--quick 1024, since on the CPU that would be most of the host's memory)")
    p.add_argument("--quick", action="store_true", help="toy shapes on the CPU, fp32")
    p.add_argument("--guidellm", default=None, help="guidellm executable (default: the one beside this Python)")
    args = p.parse_args(argv)
    q = args.quick
    args.layers = common_list(args.layers or ("sf" if q else "sfs,sssfsssfsssf"))
    args.configs = common_list(args.configs)
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; expected names from {list(CONFIGS)}")
    lo, hi = (common.count(x) for x in (args.prompt_lens or ("20-150" if q else "2k-32k")).split("-"))
    args.prompt_min, args.prompt_max = lo, hi
    args.new_tokens = args.new_tokens or (8 if q else 64)
    args.sweep_size = args.sweep_size or (3 if q else 8)
    args.concurrency = args.concurrency or (4 if q else 64)
    args.seconds = args.seconds or (8.0 if q else 60.0)
    args.num_blocks = args.num_blocks or (1024 if q else None)
    try:
        steps = common.int_list(args.max_batch_tokens or "")
    except ValueError:  # not a count
        steps = None
    if steps is None or any(n <= 0 for n in steps):
        p.error(f"--max-batch-tokens: expected positive token counts (k = 1024), got {args.max_batch_tokens!r}")
    args.max_batch_tokens = steps or [None]
    args.warmup_seconds = (1.0 if q else 30.0) if args.warmup_seconds is None else args.warmup_seconds
    args.runs = common_list(args.runs)
    bad = [r for r in args.runs if r not in RUN_KINDS]
    if bad or not args.runs:
        p.error(f"--runs: expected names from {list(RUN_KINDS)}, got {bad or args.runs}")
    try:
        args.rates = [parse_rate(x) for x in common_list(args.rates or "")]
    except ValueError as e:
        p.error(f"--rates: {e}")
    if not 0 <= args.probe_share <= 1:
        p.error(f"--probe-share: expected a share of the run's rate from 0 to 1, got {args.probe_share:g}")
    if ("rates" in args.runs) != bool(args.rates):
        p.error("--rates: give rates with 'rates' in --runs, and only then")
    exe = args.guidellm or str(Path(sys.executable).with_name("guidellm"))
    if not Path(exe).exists() and shutil.which("guidellm") is None:
        p.error("guidellm is not installed (pip install guidellm; offline: carry its wheels)")
    args.guidellm = exe if Path(exe).exists() else shutil.which("guidellm")
    return args


def common_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# The requests in flight at most in guidellm's sweep's throughput and constant-rate runs (its
# sweep profile's default); the runs of --runs throughput and rates take the same, so that
# they are the sweep's runs made one by one.
SWEEP_CONCURRENCY = 512
PROBE_PROMPTS = 64  # distinct prompts of the per-gap probe, sent in turn
# What --runs takes (rates: one constant-rate run per --rates value).
RUN_KINDS = ("sync", "throughput", "rates", "sweep", "concurrent")


def parse_rate(text: str) -> tuple[float, bool]:
    """'0.8' -> (0.8, False): requests/s; '0.5x' -> (0.5, True): a share of the highest
    requests/s reached so far."""
    share = text.lower().endswith("x")
    try:
        value = float(text[:-1] if share else text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"expected positive requests/s or shares such as 0.5x, got {text!r}")
    return value, share


def resolve_rate(rate: tuple[float, bool], rows: list[dict], layers: str, config: str, steps: int | None) -> float:
    """Requests/s of a --rates value for one configuration: a share of the highest requests/s
    of its rows so far (same pattern and step size)."""
    value, share = rate
    if not share:
        return value
    best = max((r["requests_s"] or 0 for r in rows if (r["layers"], r["config"], r.get("max_batch_tokens"))
                == (layers, config, steps)), default=0)
    if not best:
        raise RuntimeError(f"rate {value:g}x: {config} {layers} has no run with finished requests to take a share "
                           "of (run 'throughput' first, in this call or in the rows appended to)")
    return round(value * best, 3)


# What rows appended to must share with this call's (--append).
SAME_FOR_APPEND = ("prompt_min", "prompt_max", "new_tokens", "ttft_slo", "itl_slo", "quick")


def earlier_results(args, path: Path) -> tuple[list[dict], list[dict]]:
    """(rows, failures) of ``path`` for --append: nothing when it does not exist; an error when
    its runs had other prompts, new tokens or bounds than this call's."""
    if not path.is_file():
        return [], []
    data = json.loads(path.read_text())
    theirs = data.get("args") or {}
    differ = [k for k in SAME_FOR_APPEND if theirs.get(k) != getattr(args, k)]
    if differ:
        raise ValueError(f"{path} holds runs with other "
                         + ", ".join(f"{k} ({theirs.get(k)!r}, here {getattr(args, k)!r})" for k in differ))
    return list(data.get("rows") or []), list(data.get("failures") or [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_models(args, pattern: str, where: Path) -> Path:
    if not (where / f"m3-{pattern}").is_dir():
        cmd = [sys.executable, str(HERE / "save_model.py"), "--layers", pattern, "--out", str(where),
               "--max-len", str(2 * args.prompt_max + 4 * args.new_tokens), "--no-eos"]
        if args.quick:
            cmd += ["--quick", "--hidden", "64", "--mlp", "64", "--vocab", "512", "--dtype", "float32"]
        subprocess.run(cmd, check=True)
    return where


class ServerProcess:
    def __init__(self, checkpoint: Path, extra: list[str], args, log: Path):
        self.port = free_port()
        cmd = [sys.executable, "-m", "m3_hf_attention.serve", str(checkpoint), "--continuous-batching",
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32" if args.quick else "bfloat16",
               "--device", "cpu" if args.quick else "cuda", *extra]
        if args.num_blocks:
            cmd += ["--cb-num-blocks", str(args.num_blocks)]
        self.log = open(log, "w")
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self.wait_ready(log)
        except BaseException:  # not answering, or interrupted while it starts: no server left behind
            self.stop(grace_s=2.0)
            raise

    def wait_ready(self, log: Path) -> None:
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the server did not answer in 600 s: see {log}")

    def dump_stacks(self) -> None:
        """Has the server and the process it runs its model in print their threads' stacks to
        its log (m3-serve's ``kill -USR1``): where a run that made no progress was waiting."""
        if self.proc.poll() is not None or not hasattr(signal, "SIGUSR1"):
            return
        try:
            import psutil
        except ImportError:
            return
        # m3-serve and the model's process it spawned, nothing else: SIGUSR1 would end any other.
        with contextlib.suppress(psutil.Error):
            main = psutil.Process(self.proc.pid)
            if "m3_hf_attention.serve" not in " ".join(main.cmdline()):
                return
            for proc in [main, *(p for p in main.children(recursive=True) if "spawn_main" in " ".join(p.cmdline()))]:
                proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# guidellm now and then never finishes a run (no progress after "started", the server idle), on
# a loaded machine more often: a run gets this long beyond its own length, then it is stopped and
# made again, once.
GUIDELLM_GRACE_S = 120.0


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to a process started in its own session: guidellm and its worker processes."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Interrupted(BaseException):
    """SIGTERM or SIGINT while the runs go on (a BaseException, as KeyboardInterrupt is, so that
    no ``except Exception`` on the way takes it for an error of its own)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


class NoResult(RuntimeError):
    """guidellm gave no report within its time, twice: it waits for the requests in flight when
    the run's time is up, which a slow server (the dense twin under hundreds of long prompts) may
    not finish for minutes."""


def run_guidellm(args, port: int, model: str, profile: str, out_json: Path, log: Path, seconds: float) -> dict:
    mean = (args.prompt_min + args.prompt_max) // 2
    data = (f"kind=synthetic_text,prompt_tokens={mean},prompt_tokens_stdev={(args.prompt_max - args.prompt_min) // 3},"
            f"prompt_tokens_min={args.prompt_min},prompt_tokens_max={args.prompt_max}")
    cmd = [args.guidellm, "run",
           "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={model},"
                        f"request_format=/v1/completions,max_tokens={args.new_tokens}",
           "--profile", profile, "--data", data,
           "--constraint", f"kind=max_duration,seconds={seconds}",
           "--output", f"kind=json,path={out_json}", "--disable-console"]  # fmt: skip
    runs = args.sweep_size if profile.startswith("kind=sweep") else 1
    limit = GUIDELLM_GRACE_S + 2 * seconds * runs
    for attempt in (1, 2):
        with open(log, "a" if attempt > 1 else "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, HF_HUB_OFFLINE="1"))
            try:
                code = proc.wait(limit)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                print(f"guidellm ({profile}) made no result in {limit:g} s; "
                      f"{'running it again' if attempt == 1 else 'giving up'}: see {log}", file=sys.stderr)
                continue
            except BaseException:  # Interrupted: its own session keeps it alive unless killed here.
                kill_group(proc)
                raise
        if code != 0:
            raise subprocess.CalledProcessError(code, cmd)
        return json.loads(out_json.read_text())
    raise NoResult(f"guidellm ({profile}) made no result in two tries of {limit:g} s: see {log}")


def stop_reason(log: Path) -> str:
    """Why a server stopped, from its log: transformers' first "... died: ..." line (the
    manager's worker and the error that ended it), else the last line naming an error."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    died = [line for line in lines if " died: " in line]
    errors = [line for line in lines if "Error" in line]
    return (died[:1] or errors[-1:] or ["no error in its log"])[0].strip()[:300]


# A server whose manager died takes a few seconds to shut down after guidellm has failed
# against it: how long to wait before taking guidellm's failure as its own.
SERVER_EXIT_WAIT_S = 15.0


def failure(exc: Exception, server: "ServerProcess | None", server_log: Path, run_log: Path) -> str:
    """What stopped a configuration's runs: the server, when it is no longer running (guidellm
    then fails for want of it), else guidellm or the server's start."""
    if server is not None:
        try:
            server.proc.wait(SERVER_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
    if server is not None and server.proc.poll() is not None:
        return f"the server stopped (exit {server.proc.returncode}): {stop_reason(server_log)}"
    if isinstance(exc, subprocess.CalledProcessError):
        return f"guidellm exited with {exc.returncode}: see {run_log}"
    if server is None:  # it never answered
        return f"{exc} ({stop_reason(server_log)})"
    return str(exc)


def pct(metric: dict, name: str) -> float | None:
    ok = (metric or {}).get("successful") or {}
    return (ok.get("percentiles") or {}).get(name) if ok.get("count") else None


def rows_of(report: dict, args, layers: str, config: str, max_batch_tokens: int | None = None,
            seconds: float | None = None) -> list[dict]:
    rows = []
    for b in report["benchmarks"]:
        m, strategy = b["metrics"], b["config"]["strategy"]
        ok = b["requests"]["successful"]
        good = [r for r in ok if (r.get("time_to_first_token_ms") or 1e18) <= args.ttft_slo
                and (r.get("inter_token_latency_ms") or 0.0) <= args.itl_slo]
        duration = b.get("duration") or 0.0
        rows.append({
            "layers": layers, "config": config, "max_batch_tokens": max_batch_tokens, "seconds": seconds,
            "strategy": strategy.get("type_"), "rate": strategy.get("rate") or strategy.get("streams"),
            "requests": len(ok), "errored": len(b["requests"]["errored"]),
            "output_tok_s": (m["output_tokens_per_second"]["successful"] or {}).get("mean"),
            "requests_s": (m["requests_per_second"]["successful"] or {}).get("mean"),
            "ttft_p50_ms": pct(m["time_to_first_token_ms"], "p50"), "ttft_p99_ms": pct(m["time_to_first_token_ms"], "p99"),
            "itl_p50_ms": pct(m["inter_token_latency_ms"], "p50"), "itl_p99_ms": pct(m["inter_token_latency_ms"], "p99"),
            "goodput_requests_s": len(good) / duration if duration else None,
            "goodput_share": len(good) / len(ok) if ok else None,
        })  # fmt: skip
    return rows


def targets(rows: list[dict], layers: str, max_batch_tokens: int | None = None) -> dict | None:
    """The serving issue's three figures for one layer pattern and step size
    (``max_batch_tokens``, None for the server's default), from guidellm's runs:

    * goodput: m3_sparse's best goodput (requests/s meeting both bounds, any run) over the dense
      twin's at the highest request rate where at least half the twin's requests met them;
      ``goodput_over_best``: over the twin's best goodput of any run, the figure left where no
      rate of the twin's got half its requests within the bounds (no reference rate);
    * tok/s at saturation: the best output tok/s of each configuration (its throughput run);
    * ITL p99 / p50 of m3_sparse at half its saturation: the constant-rate run whose rate is
      nearest half its best requests/s (``m3_half_of_best_req_s``, beside the run's own rate
      ``m3_half_rate``); of guidellm's per-request mean ITL, and of the probe's
      gaps (``m3_gap_itl_p99_over_p50``, None without the probe)."""
    mine = {c: [r for r in rows if r["layers"] == layers and r["config"] == c and r["requests"]
                and r.get("max_batch_tokens") == max_batch_tokens] for c in ("m3_sparse", "dense")}
    if not mine["m3_sparse"] or not mine["dense"]:
        return None
    ok_dense = [r for r in mine["dense"] if (r["goodput_share"] or 0) >= 0.5 and r["strategy"] != "concurrent"]
    dense_at = max(ok_dense, key=lambda r: r["requests_s"] or 0, default=None)
    dense_best = max(r["goodput_requests_s"] or 0 for r in mine["dense"])
    m3_best = max(mine["m3_sparse"], key=lambda r: r["goodput_requests_s"] or 0)
    sat = {c: max(rs, key=lambda r: r["output_tok_s"] or 0) for c, rs in mine.items()}
    half = (max(r["requests_s"] or 0 for r in mine["m3_sparse"])) / 2
    paced = [r for r in mine["m3_sparse"] if r["strategy"] == "constant" and r["rate"]]
    at_half = min(paced, key=lambda r: abs(r["rate"] - half), default=None)

    def ratio(a, b):
        return a / b if a and b else None

    return {
        "layers": layers, "max_batch_tokens": max_batch_tokens,
        "dense_rate_req_s": dense_at and dense_at["requests_s"],
        "dense_goodput_req_s": dense_at and dense_at["goodput_requests_s"],
        "m3_goodput_req_s": m3_best["goodput_requests_s"], "m3_goodput_strategy": m3_best["strategy"],
        "goodput_ratio": ratio(m3_best["goodput_requests_s"], dense_at and dense_at["goodput_requests_s"]),
        "dense_best_goodput_req_s": dense_best,
        "goodput_over_best": ratio(m3_best["goodput_requests_s"], dense_best),
        "m3_saturation_tok_s": sat["m3_sparse"]["output_tok_s"], "dense_saturation_tok_s": sat["dense"]["output_tok_s"],
        "tok_s_ratio": ratio(sat["m3_sparse"]["output_tok_s"], sat["dense"]["output_tok_s"]),
        "m3_half_of_best_req_s": round(half, 3), "m3_half_rate": at_half and at_half["rate"],
        "m3_itl_p99_over_p50": at_half and ratio(at_half["itl_p99_ms"], at_half["itl_p50_ms"]),
        "m3_gap_itl_p99_over_p50": at_half and ratio(at_half.get("gap_itl_p99_ms"), at_half.get("gap_itl_p50_ms")),
    }  # fmt: skip


def step_tokens(max_batch_tokens: int | None) -> str:
    """A step size as the tables show it: each server's default when none was given."""
    return "default" if max_batch_tokens is None else str(max_batch_tokens)


def write_outputs(args, rows: list[dict], log: common.Log, failures: list[dict] = ()) -> None:
    out = Path(args.out)
    header = ["layers", "config", "strategy", "max batch tokens", "rate", "requests", "errored", "output tok/s",
              "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "gap ITL p50 ms", "gap ITL p99 ms",
              "goodput req/s", "goodput share"]
    table = [[r["layers"], r["config"], r["strategy"], step_tokens(r.get("max_batch_tokens")), common.fmt(r["rate"]),
              r["requests"], r["errored"], common.fmt(r["output_tok_s"], 1), common.fmt(r["requests_s"]),
              common.fmt(r["ttft_p50_ms"], 1), common.fmt(r["ttft_p99_ms"], 1), common.fmt(r["itl_p50_ms"]),
              common.fmt(r["itl_p99_ms"]), common.fmt(r.get("gap_itl_p50_ms")), common.fmt(r.get("gap_itl_p99_ms")),
              common.fmt(r["goodput_requests_s"]), common.fmt(r["goodput_share"])]
             for r in rows]  # fmt: skip
    log(common.md_table(header, table))
    probed = [r for r in rows if "probe_requests" in r]
    if probed:
        log("Per-gap probe (benchmarks/stream_probe.py) beside the runs of --runs rates:")
        log(common.md_table(
            ["layers", "config", "max batch tokens", "rate", "probe req/s", "requests", "failed", "gaps",
             "tokens per event", "first failure"],
            [[r["layers"], r["config"], step_tokens(r.get("max_batch_tokens")), common.fmt(r["rate"]),
              common.fmt(r.get("probe_rate")), r["probe_requests"], r["probe_failed"], r["probe_gaps"],
              common.fmt(r.get("tokens_per_event")), r.get("probe_failure") or ""] for r in probed]))
    # Every pattern and step size the rows hold: with --append, earlier calls' too.
    kinds = sorted({(r["layers"], r.get("max_batch_tokens")) for r in rows}, key=lambda k: (k[0], k[1] or 0))
    found = [t for t in (targets(rows, layers, n) for layers, n in kinds) if t]
    if found:
        log("Targets (m3_sparse against the dense twin; see targets() for how each is taken):")
        log(common.md_table(
            ["layers", "max batch tokens", "dense rate req/s", "dense goodput", "m3 goodput", "goodput x",
             "dense best goodput", "x best", "m3 sat tok/s", "dense sat tok/s", "tok/s x", "m3 best req/s / 2",
             "m3 nearest run rate", "m3 ITL p99/p50", "m3 gap ITL p99/p50"],
            [[t["layers"], step_tokens(t["max_batch_tokens"]), common.fmt(t["dense_rate_req_s"]),
              common.fmt(t["dense_goodput_req_s"]), common.fmt(t["m3_goodput_req_s"]), common.fmt(t["goodput_ratio"], 1),
              common.fmt(t["dense_best_goodput_req_s"]), common.fmt(t["goodput_over_best"], 1),
              common.fmt(t["m3_saturation_tok_s"], 1), common.fmt(t["dense_saturation_tok_s"], 1),
              common.fmt(t["tok_s_ratio"], 1), common.fmt(t["m3_half_of_best_req_s"]),
              common.fmt(t["m3_half_rate"]), common.fmt(t["m3_itl_p99_over_p50"], 1),
              common.fmt(t["m3_gap_itl_p99_over_p50"], 1)]
             for t in found]))  # fmt: skip
    if failures:
        log("Failed (a configuration's runs stop at its first failure, unless guidellm made no result while "
            "the server still served):")
        log(common.md_table(["layers", "config", "max batch tokens", "run", "why"],
                            [[f["layers"], f["config"], step_tokens(f.get("max_batch_tokens")), f["run"], f["why"]]
                             for f in failures]))
    common.write_json(out / "bench_server.json", {"environment": common.environment(), "args": vars(args),
                                                  "rows": rows, "targets": found, "failures": list(failures)})
    log.write(out / "bench_server.md")
    plt, why = common.pyplot()
    if plt is None:
        log(why)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))

    def series(r):
        return r["layers"], r["config"], step_tokens(r.get("max_batch_tokens"))

    for key in sorted({series(r) for r in rows}):
        layers, config, steps = key
        mine = sorted((r for r in rows if series(r) == key and r["output_tok_s"]), key=lambda r: r["output_tok_s"])
        label = f"{config} {layers}" + ("" if len({r.get("max_batch_tokens") for r in rows}) == 1 else f" {steps}")
        x = [r["output_tok_s"] for r in mine]
        for ax, metric in zip(axes, ("ttft", "itl")):
            for q, style in (("p50", "-o"), ("p99", "--x")):
                ax.plot(x, [r[f"{metric}_{q}_ms"] for r in mine], style, label=f"{label} {q}")
    for ax, title in zip(axes, ("TTFT", "ITL")):
        ax.set(xlabel="output tok/s", ylabel=f"{title} ms", yscale="log", title=f"{title} against throughput")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench_server.png", dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = common.Log(echo=print)
    try:
        rows, failures = earlier_results(args, out / "bench_server.json") if args.append else ([], [])
    except ValueError as e:
        print(f"bench_server: --append: {e}", file=sys.stderr)
        return 2
    log(*common.header("m3-serve under load (guidellm)"))
    log(f"- prompts {args.prompt_min}-{args.prompt_max} tokens, {args.new_tokens} new tokens; runs "
        f"{', '.join(describe_run(args, r) for r in args.runs)}, {args.seconds:g} s each; goodput: TTFT <= "
        f"{args.ttft_slo:g} ms and mean ITL <= {args.itl_slo:g} ms; max batch tokens "
        f"{', '.join(step_tokens(n) for n in args.max_batch_tokens)}"
        + (f"; after {len(rows)} rows of earlier calls" if args.append else ""))
    # The servers and guidellm runs sit in sessions of their own, so that a kill of their process
    # group reaches their workers; the same makes them outlive this process. A time limit's
    # SIGTERM (or Ctrl-C) therefore ends the runs here: each child is stopped, and the rows so
    # far are written with the interruption listed under "Failed".
    previous = {signum: signal.signal(signum, raise_interrupted) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        run_all(args, out, log, rows, failures)
        code = 1 if failures else 0
    except Interrupted as e:
        code = 128 + e.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    write_outputs(args, rows, log, failures)
    return code


def timed_runs(args) -> list[tuple]:
    """(guidellm profile, file tag) of each --runs entry, in order; a --rates value stands in
    for its profile until the configuration's rows so far give its requests/s."""
    profiles = {"sync": "kind=synchronous", "throughput": f"kind=throughput,max_concurrency={SWEEP_CONCURRENCY}",
                "sweep": f"kind=sweep,sweep_size={args.sweep_size}", "concurrent": closed_loop(args)}
    runs = []
    for kind in args.runs:
        runs += [(rate, "rate") for rate in args.rates] if kind == "rates" else [(profiles[kind], kind)]
    return runs


def closed_loop(args) -> str:
    return f"kind=concurrent,streams={args.concurrency}"


def describe_run(args, kind: str) -> str:
    if kind == "sweep":
        return f"sweep of {args.sweep_size}"
    if kind == "concurrent":
        return f"{args.concurrency} closed-loop users"
    if kind == "rates":
        return "rates " + "/".join(f"{v:g}{'x' if share else ''}" for v, share in args.rates)
    return kind


def run_all(args, out: Path, log: common.Log, rows: list[dict], failures: list[dict]) -> None:
    """Every pattern, step size and configuration in turn; rows and failures are appended as
    they come."""
    for layers in args.layers:
        models = save_models(args, layers, out / "models")
        # The probe's prompts (for the runs of --runs rates), for the tokenizer both checkpoints share.
        probing = args.probe_share > 0 and "rates" in args.runs
        prompts = stream_probe.make_prompts(models / f"m3-{layers}" / "tokenizer.json", args.prompt_min,
                                            args.prompt_max, PROBE_PROMPTS) if probing else []
        for steps, config in ((n, c) for n in args.max_batch_tokens for c in args.configs):
            name, extra = CONFIGS[config]
            checkpoint = models / f"{name}-{layers}"
            # Files keep their plain names at the server's default step size.
            suffix = "" if steps is None else f"-mbt{steps}"
            if steps is not None:
                extra = [*extra, "--cb-max-batch-tokens", str(steps)]

            def failed(run: str, why: str) -> None:
                failures.append({"layers": layers, "config": config, "max_batch_tokens": steps, "run": run, "why": why})
                log(f"- {config} {layers} (max batch tokens {step_tokens(steps)}): the {run} run failed: {why}")

            warmups = [("kind=synchronous", "warmup-sync"), (closed_loop(args), "warmup")]
            runs = [(profile, tag, args.warmup_seconds) for profile, tag in warmups] if args.warmup_seconds > 0 else []
            runs += [(profile, tag, args.seconds) for profile, tag in timed_runs(args)]
            server, server_log, tag, stem = None, out / f"server-{config}-{layers}{suffix}.log", "start", ""
            try:
                server = ServerProcess(checkpoint, extra, args, server_log)
                for profile, tag, seconds in runs:
                    if not isinstance(profile, str):  # a --rates value, resolved from the rows so far
                        tag = "rates"
                        rate = resolve_rate(profile, rows, layers, config, steps)
                        profile = f"kind=constant,rate={rate:g},max_concurrency={SWEEP_CONCURRENCY}"
                        tag = f"rate{rate:g}"
                    stem = f"guidellm-{config}-{layers}{suffix}-{tag}"
                    probe = None
                    if prompts and tag.startswith("rate"):
                        probe = stream_probe.ProbeThread(
                            f"http://127.0.0.1:{server.port}", str(checkpoint), prompts, rate=args.probe_share * rate,
                            seconds=seconds, max_tokens=args.new_tokens,
                        )
                        probe.start()
                    try:
                        report = run_guidellm(args, server.port, str(checkpoint), profile, out / f"{stem}.json",
                                              out / f"{stem}.log", seconds)
                    except BaseException as e:
                        if probe is not None:  # a daemon thread: ends with the process, not waited for
                            probe.stop.set()
                        if not isinstance(e, NoResult) or server.proc.poll() is not None:
                            raise
                        # The server still serves, only too slowly for this run's load: the run
                        # is listed under Failed and the configuration's next runs go on (killing
                        # guidellm closed its connections, which cancels their requests).
                        server.dump_stacks()
                        failed(tag, f"{e} (the next runs go on; the server's stacks are in its log)")
                        continue
                    if probe is not None:  # its arrivals ended with guidellm's; its requests drain
                        probe.stop.set()
                        probe.join(stream_probe.DRAIN_S + seconds)
                    if not tag.startswith("warmup"):
                        new = rows_of(report, args, layers, config, steps, seconds)
                        if probe is not None:
                            figures = dict(stream_probe.gap_figures(probe.results), probe_rate=args.probe_share * rate)
                            for r in new:
                                r.update(figures)
                        rows += new
                        # JSON after every run: a run cut short by a time limit keeps the ones before it.
                        common.write_json(out / "bench_server.json", {"environment": common.environment(),
                                                                      "args": vars(args), "rows": rows,
                                                                      "failures": failures})
            except (subprocess.CalledProcessError, RuntimeError, Interrupted) as e:
                # The other configurations still run: a server that dies under load is a finding
                # of the benchmark, and its twin's figures stay worth having. An interruption
                # ends them all.
                interrupted = isinstance(e, Interrupted)
                failed(tag, f"interrupted by {e}" if interrupted
                       else failure(e, server, server_log, out / f"{stem}.log"))
                if interrupted:
                    if server is not None:
                        server.dump_stacks()  # what a run cut by a time limit was waiting for
                        # A time limit's SIGKILL follows its SIGTERM soon: no graceful minute.
                        server.stop(grace_s=2.0)
                        server = None
                    raise
            finally:
                if server is not None:
                    server.stop()


if __name__ == "__main__":
    sys.exit(main())
