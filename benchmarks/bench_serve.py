#!/usr/bin/env python3
"""Serving many requests through transformers' continuous batching: the M3-shaped random
model on ``attn_implementation="paged|m3_sparse"`` against its dense twin on
``paged|sdpa``, the same requests for both.

Model: ``bench_generate.build_models`` (random weights of seed ``--seed``, M3's attention
shapes, layer patterns ``--layers`` of sparse ``s`` and full-attention ``f`` layers, the
dense twin with the same weights less the indexers); bf16 on CUDA, fp32 on the CPU
(``--dtype``).

Requests: ``--requests`` prompts of random tokens, lengths drawn uniformly (seed
``--seed``) from ``--prompt-lens`` (``LO-HI`` or one length, ``k`` = 1024), each asking for
``--new-tokens`` greedy tokens (no EOS: every request generates them all). Arrival
(``--rates``, requests per second, one run per rate): 0 adds every request at once, a rate
r adds request i at i / r seconds after the start. Each run starts a fresh manager
(``model.init_continuous_batching``, ``start``, ``add_request`` with per-token timestamps,
``get_result`` until every request finished, ``stop``) with a ``ContinuousBatchingConfig``
of ``--block-size`` tokens per block (its ``page_size`` from transformers 5.18, where a block
holds a page of each layer) and, by default, enough blocks for every request at
once (``--num-blocks``), so no run waits for pages and both configurations hold the same
pool, and ``--max-batch-tokens`` query tokens per step (default 8192, the value transformers
picks when it sizes the cache itself; given a number of blocks it solves for a larger one,
with which ``paged|sdpa`` ran out of memory on the H200); the rest (CUDA graphs, the decode
fast path, asynchronous batching, compilation) is transformers' default for each attention.

Configurations (``--configs``): ``m3_sparse`` (the sparse model loaded with
``m3_sparse``, ``M3_SPARSE_IMPL=auto``), ``dense`` (the dense twin on ``sdpa``; the baseline
of the speedup columns). Up to transformers 5.18 the manager runs them as ``paged|m3_sparse``
and ``paged|sdpa``; from 5.19 under their own names (the ``attn`` of each JSON row). No
flash-attention twin: M3's text model class declares no flash-attention support
(``_supports_flash_attn = False``, 5.17 through 5.25), so it refuses ``flash_attention_2`` /
``_4``.

Figures of a run, from the timestamps transformers takes when it appends a token (on the
host, after the step's tokens came back from the device): output tokens/s (all generated
tokens over the time from the first arrival to the last token), time to first token per
request (its first token's stamp less its ``add_request`` time: queueing and prefill
included), inter-token latency (the gaps between a request's consecutive tokens, all
requests pooled), p50 and p99 of both (and ITL's deciles p10-p90 in the JSON,
``itl_quantiles_ms``), and the peak memory (``torch.cuda.max_memory_allocated``
over the run, weights and the manager's cache included). On CUDA each configuration is warmed
before its timed runs (``--warmup auto``): ``m3_sparse`` serves the whole request set once,
untimed (``full``), because Triton specializes its kernels per step shape and the manager
captures a graph per padded shape, so the timed runs measure a server that has seen such
steps before; ``dense`` serves the two shortest requests (``short``): ``paged|sdpa`` needs a
mask, so the manager captures no graphs for it and nothing of it compiles per shape.
``--warmup short`` for every configuration keeps a cold start's compilation in the figures.

Steps: every run also records each step of the manager's loop (``step_log``): the query
tokens it scheduled, whether it took the decode fast path, and the host time of scheduling,
launching and updating; the JSON row holds their totals (``steps``) and the log a line. For the
runs of consecutive fast-path (decode-only) steps it also holds their medians: a step's host ms
(its three methods together, ``decode_host_ms_p50``, and each alone, ``decode_method_ms_p50``),
the device span of its forward on CUDA (``decode_gpu_span_ms_p50``) and the wall ms from its
start to the next step's (``decode_wall_ms_p50``; its p10-p90 in ``decode_wall_ms_quantiles``).
The host ms include waits for the device (``update_batch`` waits for the step before in async
mode, the manager's default with CUDA graphs; ``_generation_step`` for its own tokens in sync
mode), so it is the GPU span that tells a step held by the device (a span close to the wall
ms) from one held by the host (a span well below it). ``--stub-model`` replaces each step's
forward pass and sampling by a fixed token, so the steps' figures are the manager's own host
bookkeeping as the installed transformers does it (the schedule does not depend on the tokens).

Check: with ``--check`` (on in ``--quick``; ``--check m3_sparse`` for one configuration)
every request's tokens are compared with its own single-request ``generate()`` on the same
model (``m3_sparse`` for the sparse model, the twin's attention for the dense one). In
float32 they must be equal. In bf16 two summation orders (prefill chunks against one prefill)
move logits by a few rounding steps, which flips near ties of a random model's flat logits;
there a request passes when every served token is within ``GAP_TOLERANCE`` of the top logit in
one forward pass over its prompt and the tokens before it (``token_gaps``), and the note gives
the largest gap beside generate()'s own. A failing request is reported and the script exits 1.

Limit: the dense twin's ``paged|sdpa`` runs take minutes at the default sizes.
``--run-limit SECONDS`` stops a run that long after its first arrival; its row says
``stopped``, how many requests finished, and bounds its output tokens/s from above (every
request's tokens over the time it ran: it needed at least that long), so the sparse run's
tokens/s speedup over it is a lower bound (``> N.NNx`` in the table, ``tok_s_min`` in the JSON).

Outputs, in ``--out`` (default ``$OUT``, else ./out): ``bench_serve.md`` (setup and
table), ``bench_serve.json`` (one result row per run, rewritten after each),
``serve.png`` (tokens/s and latencies per configuration; skipped with a message when
matplotlib is missing) and ``bench_serve.log``. The markdown table is printed last.

    python3 benchmarks/bench_serve.py --layers sfs,sssfsssfsssf --requests 64 --prompt-lens 2k-32k --new-tokens 256
    python3 benchmarks/bench_serve.py --quick          # tiny CPU smoke run with the token check
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
from pathlib import Path
from dataclasses import dataclass, field

import common
from common import GIB, env_var, sync

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_generate as bg  # noqa: E402  (models, environment, flags)
import m3_hf_attention  # noqa: E402
import transformers  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor  # noqa: E402

tqdm = bg.tqdm
SERVING = m3_hf_attention.integration.serving  # paged|m3_sparse's integration (and its compat)
DEFAULT_CONFIGS = "m3_sparse,dense"
CONFIGS = {
    # name: (model, attn_implementation it is loaded with; the manager prefixes "paged|")
    "m3_sparse": ("sparse", "m3_sparse"),
    "dense": ("dense", "sdpa"),
}

_BAR = None


def _echo(line: str) -> None:
    if _BAR is not None:
        _BAR.write(line)
    else:
        print(line, flush=True)


log = common.Log(echo=_echo)


# ---------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------
def parse_range(text: str) -> tuple[int, int]:
    """'2k-32k' -> (2048, 32768); '8k' -> (8192, 8192)."""
    lo, _, hi = text.partition("-")
    lo, hi = bg.parse_count(lo), bg.parse_count(hi or lo)
    if lo > hi:
        raise ValueError(f"expected LO-HI with LO <= HI, got {text!r}")
    return lo, hi


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                parents=[common.common_args()])
    p.add_argument("--quick", action="store_true",
                   help="tiny CPU smoke run (toy shapes, fp32) with the token check")
    p.add_argument("--layers", default=None, help=f"layer patterns (default {bg.DEFAULT_LAYERS}; --quick: sf)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"from {list(CONFIGS)} (default {DEFAULT_CONFIGS})")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 64; --quick 4)")
    p.add_argument("--prompt-lens", default=None,
                   help="prompt lengths, LO-HI drawn uniformly or one length, k = 1024 (default 2k-32k; --quick 20-150)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 256; --quick 5)")
    p.add_argument("--rates", default=None,
                   help="arrival rates in requests/s, comma separated, one run each; 0 = all at once "
                   "(default 0,4; --quick 0,50)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per cache block of each layer, ContinuousBatchingConfig.page_size (block_size up to "
                   "transformers 5.17; default 256; --quick 16)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="cache blocks (default: every request's prompt and new tokens at once)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="query tokens per step (default 8192; --quick 64, so prompts are chunked)")
    p.add_argument("--scheduler", default="fifo", choices=["fifo", "prefill_first"],
                   help="ContinuousBatchingConfig.scheduler_type: transformers' FIFO (decode rows first) or its "
                   "prefill-first scheduler (default fifo)")
    p.add_argument("--check", nargs="?", const="all", default=None, metavar="CONFIGS",
                   help="compare every request's tokens with its own generate(), in every configuration or in those "
                   "named (comma separated); on with --quick; in bf16 a token may differ at a near tie, and passes "
                   "within GAP_TOLERANCE of a teacher-forced forward pass")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048; --quick 64)")
    p.add_argument("--mlp", type=int, default=None, help="dense MLP intermediate size (default 1024; --quick 64)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 1024; --quick 128)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (--quick: cpu)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="weights and activations (default bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--warmup", choices=["auto", "full", "short", "none"], default="auto",
                   help="on CUDA before each configuration's runs: every request once (full), the two shortest "
                   "(short) or nothing; auto (default): full where the manager captures CUDA graphs or Triton "
                   "specializes kernels per step shape (m3_sparse), short for dense (paged|sdpa)")
    p.add_argument("--run-limit", type=float, default=None, metavar="SECONDS",
                   help="stop a run (and a warm-up) this many seconds after its first arrival; a stopped run "
                   "reports an upper bound on its output tok/s (every request's tokens over the time it ran) and "
                   "the speedups over it as lower bounds (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, prompt lengths and tokens (default 0)")
    p.add_argument("--stub-model", action="store_true",
                   help="replace each step's forward pass and sampling by a stub that emits token STUB_TOKEN: "
                   "only the manager's host bookkeeping runs (scheduling, input tensors, block tables, the "
                   "cache's allocators, updates), as each transformers release does it; no token check")
    args = p.parse_args(argv)
    q = args.quick
    try:
        args.patterns = bg.parse_layers(args.layers or ("sf" if q else bg.DEFAULT_LAYERS))
        args.lens = parse_range(args.prompt_lens or ("20-150" if q else "2k-32k"))
        args.rates = [float(r) for r in (args.rates or ("0,50" if q else "0,4")).split(",") if r.strip()]
    except ValueError as exc:
        p.error(str(exc))
    args.requests = args.requests or (4 if q else 64)
    args.new_tokens = args.new_tokens or (5 if q else 256)
    args.block_size = args.block_size or (16 if q else 256)
    args.max_batch_tokens = args.max_batch_tokens or (64 if q else 8192)
    bg.model_and_configs(p, args, q, CONFIGS)
    if args.stub_model and args.check:
        p.error("--check: a stubbed model emits STUB_TOKEN, not the model's tokens")
    check = args.check or ("all" if q and not args.stub_model else "")
    args.check = list(args.configs) if check == "all" else [c for c in check.split(",") if c.strip()]
    if set(args.check) - set(args.configs):
        p.error(f"--check: expected configurations of --configs {args.configs}, got {args.check}")
    if not args.rates or any(r < 0 for r in args.rates):
        p.error(f"--rates: expected rates >= 0, got {args.rates}")
    if args.run_limit is not None and args.run_limit <= 0:
        p.error(f"--run-limit: expected seconds > 0, got {args.run_limit}")
    if min(args.requests, args.new_tokens) < 1:
        p.error("--requests and --new-tokens must be >= 1")
    args.device = torch.device(args.device or ("cpu" if q or not torch.cuda.is_available() else "cuda"))
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32"))
    args.out = Path(args.out)
    # bench_generate.text_config sizes the position table from the longest request.
    args.sizes = [bg.Shape(1, args.lens[1] + args.new_tokens)]
    return args


# ---------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------
def make_prompts(args) -> list[list[int]]:
    """``--requests`` prompts of random tokens (never PAD / BOS / EOS), lengths uniform in ``--prompt-lens``."""
    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = args.lens
    lens = torch.randint(lo, hi + 1, (args.requests,), generator=gen).tolist()
    return [torch.randint(3, args.vocab, (n,), generator=gen).tolist() for n in lens]


def gen_config(new_tokens: int) -> GenerationConfig:
    # No EOS: every request generates new_tokens, in both the manager and generate().
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=bg.PAD)


def cb_config(args, prompts) -> ContinuousBatchingConfig:
    blocks = args.num_blocks or sum(-(-(len(p) + args.new_tokens + 1) // args.block_size) for p in prompts)
    pages = {SERVING.compat.CB_PAGE_SIZE_FIELD: args.block_size}
    return ContinuousBatchingConfig(**pages, num_blocks=blocks, max_batch_tokens=args.max_batch_tokens,
                                    scheduler_type=args.scheduler)


@dataclass
class Served:
    """One request's outcome: its tokens, its add_request time and each token's stamp."""

    tokens: list[int]
    added: float
    stamps: list[float]
    error: str | None = None


def serve(model, prompts, args, rate: float, on_done=lambda: None) -> tuple[list, float, str, float | None]:
    """All ``prompts`` through one manager, request i added ``i / rate`` s after the start
    (all at once for rate 0): (the requests in order, None for one unfinished when the run
    was stopped, the start time, the attention the manager switched the model to, the seconds
    after which ``--run-limit`` stopped the run or None)."""
    manager = model.init_continuous_batching(generation_config=gen_config(args.new_tokens),
                                             continuous_batching_config=cb_config(args, prompts))
    attn = model.config._attn_implementation
    manager.start()
    done: dict[str, Served] = {}
    stopped = None
    limit = float("inf") if args.run_limit is None else args.run_limit
    try:
        start = time.perf_counter()
        added = 0
        while len(done) < len(prompts):
            now = time.perf_counter()
            while added < len(prompts) and (rate == 0 or now >= start + added / rate):
                if manager.add_request(prompts[added], request_id=f"r{added}", max_new_tokens=args.new_tokens,
                                       record_timestamps=True) is None:
                    raise RuntimeError(f"the manager dropped request r{added} (it accepts no more requests)")
                added += 1
            if time.perf_counter() - start >= limit:
                stopped = time.perf_counter() - start
                break
            wait = 1.0 if added == len(prompts) else max(0.0, start + added / rate - time.perf_counter())
            wait = min(wait, max(0.0, start + limit - time.perf_counter()))
            out = manager.get_result(timeout=wait)
            if out is not None and out.is_finished():
                done[out.request_id] = Served(out.generated_tokens, out.created_time, out.timestamps or [], out.error)
                on_done()
            elif out is None and not manager.is_running():
                raise RuntimeError(f"the manager stopped with {len(prompts) - len(done)} requests unfinished")
    finally:
        manager.stop(block=True, timeout=60)
    return [done.get(f"r{i}") for i in range(len(prompts))], start, attn, stopped


STEP_METHODS = ("prepare_next_batch", "_generation_step", "update_batch")
STEP_MS = ("prepare_ms", "generation_step_ms", "update_batch_ms")  # a step_log row's host ms, one per method


def _host_io(processor):
    """The batch processor's host-side inputs of the step being prepared (sync or async IOs)."""
    io = processor.inputs_and_outputs
    pairs = getattr(io, "io_pairs", None)
    return pairs[io.current_pair].host_io if pairs is not None else io


STUB_TOKEN = 3  # what --stub-model emits: never PAD, BOS or EOS, like the prompts' tokens


@contextlib.contextmanager
def stubbed_model(on: bool):
    """With ``on``, transformers' ``ModelRunner._forward_process_and_sample`` (the forward pass,
    logits processing and sampling of a step; the same signature from 5.17 to 5.25) writes
    ``STUB_TOKEN`` for every sampled position instead, and is restored on exit."""
    if not on:
        yield
        return
    from transformers.generation.continuous_batching import model_runner

    original = model_runner.ModelRunner._forward_process_and_sample

    def stub(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids):
        output_ids[0, : batch_data["logits_indices"].numel()].fill_(STUB_TOKEN)

    model_runner.ModelRunner._forward_process_and_sample = stub
    try:
        yield
    finally:
        model_runner.ModelRunner._forward_process_and_sample = original


@contextlib.contextmanager
def step_log():
    """Yields a list that fills with one dict per step of the manager's loop while the block
    runs: transformers' ``ContinuousBatchProcessor`` methods wrapped (restored on exit) to
    take the step's query tokens as scheduled (padded where the manager pads for its graphs),
    requests and decode fast path, and the host ms of each method: ``prepare_next_batch``
    (scheduling, input tensors), ``_generation_step`` (the forward launched, or a graph
    replayed; in sync mode it also waits for the step's tokens) and ``update_batch`` (the
    tokens read back, requests updated; in async mode it waits for the step before). On CUDA
    also ``gpu_span_ms``: from the start of the step's forward on the manager's compute stream
    to its end (``ModelRunner.compute_batch``, CUDA events), the device's share of the step."""
    from transformers.generation.continuous_batching import model_runner

    rows: list[dict] = []
    originals = {name: getattr(ContinuousBatchProcessor, name) for name in STEP_METHODS}
    compute_batch = model_runner.ModelRunner.compute_batch
    spans = []  # (row, start event, end event), read once the block is over

    def timed_compute(runner, *args, **kwargs):
        stream = getattr(runner.inputs_and_outputs, "compute_stream", None)
        if stream is None or not rows:
            return compute_batch(runner, *args, **kwargs)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        out = compute_batch(runner, *args, **kwargs)
        end.record(stream)
        spans.append((rows[-1], begin, end))
        return out

    def wrap(name):
        fn = originals[name]

        def timed(processor, *args, **kwargs):
            start = time.perf_counter()
            out = fn(processor, *args, **kwargs)
            ms = (time.perf_counter() - start) * 1e3
            if name == "prepare_next_batch":
                if out:
                    io = _host_io(processor)
                    rows.append({"q_tokens": int(io.num_q_tokens), "requests": int(io.num_request_in_batch),
                                 "decode_fast_path": bool(io.use_block_table), "prepare_ms": ms, "start": start})
            elif rows:
                rows[-1][f"{name.strip('_')}_ms"] = ms
            return out

        return timed

    for name in STEP_METHODS:
        setattr(ContinuousBatchProcessor, name, wrap(name))
    model_runner.ModelRunner.compute_batch = timed_compute
    try:
        yield rows
    finally:
        for name, fn in originals.items():
            setattr(ContinuousBatchProcessor, name, fn)
        model_runner.ModelRunner.compute_batch = compute_batch
        if spans:
            torch.cuda.synchronize()
            for row, begin, end in spans:
                row["gpu_span_ms"] = begin.elapsed_time(end)


def step_summary(rows: list[dict]) -> dict:
    """Totals of a run's steps: how many (and how many on the decode fast path), query
    tokens, mean query tokens of the other (prefill or mixed) steps, host ms per method."""
    mixed = [r for r in rows if not r["decode_fast_path"]]
    out = {"steps": len(rows), "decode_steps": len(rows) - len(mixed), "q_tokens": sum(r["q_tokens"] for r in rows),
           "mixed_q_tokens_mean": sum(r["q_tokens"] for r in mixed) / len(mixed) if mixed else None}
    for key in STEP_MS:
        out[key] = sum(r.get(key, 0.0) for r in rows)
    # Consecutive decode-only steps: each one's host ms, and the wall ms to the next one's start.
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if a["decode_fast_path"] and b["decode_fast_path"]]
    host = [sum(a.get(k, 0.0) for k in STEP_MS) for a, _ in pairs]
    wall = [(b["start"] - a["start"]) * 1e3 for a, b in pairs]
    out["decode_host_ms_p50"] = float(np.median(host)) if host else None
    # Per method, so two releases' steps can be told apart by where their host time goes.
    out["decode_method_ms_p50"] = {k: float(np.median([a.get(k, 0.0) for a, _ in pairs])) for k in STEP_MS} if pairs else None
    gpu = [a["gpu_span_ms"] for a, _ in pairs if "gpu_span_ms" in a]
    out["decode_gpu_span_ms_p50"] = float(np.median(gpu)) if gpu else None
    out["decode_wall_ms_p50"] = float(np.median(wall)) if wall else None
    out["decode_wall_ms_quantiles"] = quantiles(wall)
    return out


def stopped_figures(served: list[Served | None], stopped_s: float, new_tokens: int) -> dict:
    """A run stopped by ``--run-limit`` after ``stopped_s`` seconds: it would have needed at
    least that long for every request's tokens, so their count over it bounds its output
    tokens/s from above (``tok_s_max``); latencies of the requests that finished first would
    flatter it and are left out."""
    finished = [s for s in served if s is not None]
    return {"output_tokens": sum(len(s.tokens) for s in finished), "finished": len(finished), "wall_s": stopped_s,
            "tok_s": None, "tok_s_max": len(served) * new_tokens / stopped_s,
            "ttft_p50_ms": None, "ttft_p99_ms": None, "itl_p50_ms": None, "itl_p99_ms": None,
            "itl_quantiles_ms": None}


QUANTILES = (10, 25, 50, 75, 90)


def quantiles(values) -> dict | None:
    """``{"p10": ..., "p90": ...}`` (``QUANTILES``) of ``values``, or None: the shape of a
    distribution whose median alone can sit on either side of a gap between two kinds of step."""
    return {f"p{q}": common.percentile(values, q) for q in QUANTILES} if len(values) else None


def figures(served: list[Served], start: float) -> dict:
    """Output tokens/s, TTFT and inter-token latency (p50 / p99, ms) of one run."""
    ttft = [(s.stamps[0] - s.added) * 1e3 for s in served if s.stamps]
    itl = [(b - a) * 1e3 for s in served for a, b in zip(s.stamps, s.stamps[1:])]
    end = max((s.stamps[-1] for s in served if s.stamps), default=start)
    tokens = sum(len(s.tokens) for s in served)
    return {
        "output_tokens": tokens,
        "wall_s": end - start,
        "tok_s": tokens / (end - start) if end > start else None,
        "ttft_p50_ms": common.percentile(ttft, 50), "ttft_p99_ms": common.percentile(ttft, 99),
        "itl_p50_ms": common.percentile(itl, 50), "itl_p99_ms": common.percentile(itl, 99),
        "itl_quantiles_ms": quantiles(itl),
    }


# Largest relative gap (see ``token_gaps``) a served token may have, per dtype with rounding
# that moves near ties: two summation orders of bf16 attention (prefill chunks against one
# prefill, the decode kernel against KV-outer) move logits by a few bf16 steps, and a sparse
# layer's top-k can flip a near-tie block with them. float32 has no entry: its tokens must
# equal generate()'s.
GAP_TOLERANCE = {torch.bfloat16: 2.0**-4, torch.float16: 2.0**-7}


def token_gaps(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced check of a request's ``tokens``: one forward pass over the prompt and the
    tokens before each; per token, (largest logit - its logit) / largest |logit| there, 0 where
    the forward picks it too. A fault (another request's pages, a wrong slot) gives large gaps
    at many tokens; rounding gives small ones at near ties."""
    ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
    logits = model(ids, use_cache=False, logits_to_keep=len(tokens)).logits[0].float()  # [n, V]
    chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    gaps = (logits.amax(1) - chosen) / logits.abs().amax(1).clamp_min(1e-30)
    return gaps.tolist()


def check_tokens(model, prompts, served: list[Served], new_tokens: int, refs: dict | None = None) -> dict:
    """Every request against its own single-request generate(): which differ (``mismatched``)
    and where each first differs (``divergences``); with a rounding dtype (``GAP_TOLERANCE``)
    also the largest teacher-forced gap of the served tokens (``gap``) and of generate()'s own
    (``reference_gap``, its decode steps against one forward pass), and the requests whose
    served tokens exceed the tolerance (``failed``). In float32 every difference fails.
    ``refs`` keeps generate()'s tokens and their gap per request across the runs of one model
    (another arrival rate serves the same prompts)."""
    tol = GAP_TOLERANCE.get(model.dtype)
    out = {"mismatched": [], "divergences": [], "failed": [], "gap": None, "reference_gap": None, "tolerance": tol}
    refs = {} if refs is None else refs
    for i, (prompt, s) in enumerate(zip(prompts, served)):
        if i not in refs:
            ids = torch.tensor([prompt], device=model.device)
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config(new_tokens))
            refs[i] = {"tokens": ref[0, len(prompt):].tolist(), "gap": None}
        ref = refs[i]["tokens"]
        if s.tokens != ref:
            out["mismatched"].append(i)
            out["divergences"].append(dict(request=i, **divergence(model, prompt, s.tokens, ref)))
        if tol is None:
            continue
        gap = max(token_gaps(model, prompt, s.tokens))
        # Equal tokens have equal gaps: one forward pass over a long prompt is enough.
        if refs[i]["gap"] is None:
            refs[i]["gap"] = gap if s.tokens == ref else max(token_gaps(model, prompt, ref))
        ref_gap = refs[i]["gap"]
        out["gap"] = max(out["gap"] or 0.0, gap)
        out["reference_gap"] = max(out["reference_gap"] or 0.0, ref_gap)
        if gap > tol:
            out["failed"].append(i)
    if tol is None:
        out["failed"] = list(out["mismatched"])
    return out


def divergence(model, prompt: list[int], got: list[int], ref: list[int]) -> dict:
    """Where ``got`` first leaves ``ref`` (the request's own generate()), and how close the two
    tokens were there in generate()'s logits, recomputed for the common prefix: ``margin`` (its
    token's logit less the served token's; positive unless the recomputation flips it),
    ``relative`` (over the largest logit's magnitude) and ``rank`` (the served token's place in
    generate()'s order, 1 = its choice). A near tie (rank 2, a margin within the
    dtype's rounding) points at two summation orders; a large margin at a fault."""
    step = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    if step >= min(len(got), len(ref)):
        return {"step": step, "margin": None, "relative": None, "rank": None}
    ids = torch.tensor([prompt + ref[:step]], device=model.device)
    cfg = gen_config(1)
    cfg.output_logits, cfg.return_dict_in_generate = True, True
    logits = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg).logits[0][0].float()
    margin = float(logits[ref[step]] - logits[got[step]])
    rank = int((logits > logits[got[step]]).sum()) + 1
    return {"step": step, "margin": margin, "relative": margin / max(float(logits.abs().max()), 1e-30), "rank": rank}


# ---------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------
@dataclass
class Run:
    layers: str
    config: str
    rate: float
    status: str = "pending"  # ok | mismatch | stopped | OOM | error
    note: str = ""
    figures: dict = field(default_factory=dict)
    peak_gib: float | None = None
    attn: str | None = None  # the attention the manager ran
    mismatched: list[int] = field(default_factory=list)  # tokens differ from generate()'s
    failed: list[int] = field(default_factory=list)  # beyond the dtype's tolerance (check_tokens)
    check: dict = field(default_factory=dict)  # check_tokens: gaps and tolerance
    steps: dict = field(default_factory=dict)  # step_summary of the run
    divergences: list[dict] = field(default_factory=list)  # check_tokens: where each mismatch starts
    speedup: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return "at once" if self.rate == 0 else f"{self.rate:g}/s"


def attention_context(name: str, device):
    return env_var("M3_SPARSE_IMPL", "auto") if name == "m3_sparse" else (
        bg.dense_backends(device) if name == "dense" else contextlib.nullcontext())


def run_one(model, name: str, pattern: str, prompts, args, rate: float, on_done, refs: dict) -> Run:
    run = Run(pattern, name, rate)
    bg.free_memory(args.device)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    try:
        with attention_context(name, args.device), torch.no_grad():
            with step_log() as steps:
                served, start, run.attn, stopped_s = serve(model, prompts, args, rate, on_done)
            run.steps = step_summary(steps)
            sync(args.device)
            run.peak_gib = torch.cuda.max_memory_allocated(args.device) / GIB if args.device.type == "cuda" else None
            errors = [f"r{i}: {s.error}" for i, s in enumerate(served) if s is not None and s.error]
            errors += [f"r{i}: {len(s.stamps)} token stamps for {len(s.tokens)} tokens" for i, s in enumerate(served)
                       if s is not None and not s.error and len(s.stamps) != len(s.tokens)]
            if errors:
                raise RuntimeError("; ".join(errors)[:300])
            if stopped_s is not None:
                run.figures = stopped_figures(served, stopped_s, args.new_tokens)
                run.status = "stopped"
                run.note = (f"stopped after {stopped_s:.0f} s (--run-limit), {run.figures['finished']} of "
                            f"{len(served)} requests finished: output tok/s below {run.figures['tok_s_max']:.1f}")
            else:
                run.figures = figures(served, start)
                run.status = "ok"
            if run.status == "ok" and name in args.check:
                run.check = check_tokens(model, prompts, served, args.new_tokens, refs)
                run.mismatched, run.divergences = run.check.pop("mismatched"), run.check.pop("divergences")
                run.failed = run.check.pop("failed")
                run.status, run.note = ("mismatch" if run.failed else "ok"), check_note(run)
    except Exception as exc:  # noqa: BLE001 - one failing run must not end the benchmark
        run.status = "OOM" if bg.is_oom(exc) else "error"
        run.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    bg.free_memory(args.device)
    return run


def check_note(run: Run) -> str:
    """The token check in words: how many requests equal generate(), the first differences,
    and the largest gaps against the tolerance."""
    n = len(run.mismatched)
    if not n:
        return ""
    first = ", ".join(f"r{d['request']} at {d['step']} (rank {d['rank']}, margin {common.fmt(d['margin'], 3)})"
                      for d in run.divergences[:3])
    text = f"{n} requests differ from generate() (first: {first})"
    c = run.check
    if c.get("tolerance") is not None:
        text += (f"; largest gap {c['gap']:.2%} (generate()'s own {c['reference_gap']:.2%}, tolerance "
                 f"{c['tolerance']:.2%}){f', beyond it: {run.failed}' if run.failed else ''}")
    return text


# --warmup auto: what each configuration's timed runs would otherwise pay for once. The
# m3_sparse manager captures a CUDA graph per padded step shape and Triton specializes its
# kernels on the shapes' integer arguments. paged|sdpa needs a mask: no graphs, nothing
# compiled per shape.
AUTO_WARMUP = {"m3_sparse": "full", "dense": "short"}


def warmup_mode(name: str, args) -> str:
    return AUTO_WARMUP[name] if args.warmup == "auto" else args.warmup


def warm_up(model, name: str, prompts, args) -> None:
    """Before the timed runs, on CUDA: every request through a manager (``full``: each shape
    the timed runs meet is compiled, its kernels specialized and its graphs captured once, as in
    a server that has run for a while) or the two shortest (``short``: a cold start's
    compilation stays in the timed runs); ``warmup_mode`` picks per configuration."""
    mode = warmup_mode(name, args)
    if args.device.type != "cuda" or mode == "none":
        return
    batch = prompts if mode == "full" else sorted(prompts, key=len)[:2]
    try:
        with attention_context(name, args.device), torch.no_grad():
            serve(model, batch, args, 0.0)
    except Exception as exc:  # noqa: BLE001 - the timed runs report the failure as theirs
        log(f"{name}: warm-up failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    bg.free_memory(args.device)


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------
def fill_speedups(runs: list[Run]) -> None:
    """Against the dense run of the same model pattern and rate: tokens/s ratio, and dense
    latency / latency for TTFT and inter-token p50. Against a dense run that ``--run-limit``
    stopped, only the tokens/s ratio, as a lower bound (``tok_s_min``)."""
    base = {(r.layers, r.rate): r for r in runs if r.config == "dense" and r.status in ("ok", "stopped")}
    for r in runs:
        ref = base.get((r.layers, r.rate))
        if ref is None or r.status != "ok" or r.config == "dense":
            continue
        f, b = r.figures, ref.figures
        if ref.status == "stopped":
            r.speedup = {"tok_s": None, "tok_s_min": f["tok_s"] / b["tok_s_max"] if f["tok_s"] else None,
                         "ttft_p50": None, "itl_p50": None}
            continue
        r.speedup = {
            "tok_s": f["tok_s"] / b["tok_s"] if f["tok_s"] and b["tok_s"] else None,
            "ttft_p50": b["ttft_p50_ms"] / f["ttft_p50_ms"] if f["ttft_p50_ms"] else None,
            "itl_p50": b["itl_p50_ms"] / f["itl_p50_ms"] if f["itl_p50_ms"] else None,
        }


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _tok_s(f: dict) -> str:
    return f"< {f['tok_s_max']:.1f}" if f.get("tok_s_max") is not None else common.fmt(f.get("tok_s"), 1)


def _tok_s_speedup(s: dict) -> str:
    return f"> {s['tok_s_min']:.2f}x" if s.get("tok_s_min") is not None else _x(s.get("tok_s"))


def table(runs: list[Run]) -> str:
    rows = []
    for r in runs:
        f, s = r.figures, r.speedup
        rows.append([r.layers, r.config, r.label, r.status, _tok_s(f),
                     common.fmt(f.get("ttft_p50_ms"), 1), common.fmt(f.get("ttft_p99_ms"), 1),
                     common.fmt(f.get("itl_p50_ms"), 2), common.fmt(f.get("itl_p99_ms"), 2),
                     common.fmt(r.peak_gib, 1), _tok_s_speedup(s), _x(s.get("ttft_p50")), _x(s.get("itl_p50")),
                     r.note[:90]])
    return common.md_table(["layers", "config", "arrival", "status", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
                            "ITL p50 ms", "ITL p99 ms", "peak GiB", "tok/s speedup", "TTFT p50 speedup",
                            "ITL p50 speedup", "note"], rows)


def setup_lines(args, env, prompts) -> list[str]:
    lens = [len(p) for p in prompts]
    return [
        f"- Date {env['date']}; device {env['device']}; torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}.",
        f"- Models: bench_generate's M3-shaped random model (seed {args.seed}), layer patterns "
        f"{', '.join(f'`{x}`' for x in args.patterns)}; hidden {args.hidden}, MLP {args.mlp}, vocab {args.vocab}; "
        f"{str(args.dtype).removeprefix('torch.')}.",
        f"- {args.requests} requests, prompts {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}, "
        f"drawn from {args.lens[0]}-{args.lens[1]}), {args.new_tokens} greedy new tokens each; arrival "
        f"{', '.join('all at once' if r == 0 else f'{r:g} requests/s' for r in args.rates)}.",
        f"- Continuous batching: block size {args.block_size}, "
        f"{args.num_blocks or 'enough'} blocks{'' if args.num_blocks else ' for every request at once'}, "
        f"max_batch_tokens {args.max_batch_tokens}, scheduler {args.scheduler}; a fresh manager per run.",
        "- TTFT: first token's stamp less the request's add_request time; ITL: gaps between a request's "
        "consecutive tokens, all requests pooled; output tok/s: generated tokens / (last token - first arrival); "
        "peak: torch.cuda.max_memory_allocated over the run, weights and cache included.",
        "- Speedups: over the `dense` (paged|sdpa) run of the same model and arrival.",
        f"- Warm-up before each configuration's runs (CUDA): "
        f"{', '.join(f'{c} {warmup_mode(c, args)}' for c in args.configs) if args.device.type == 'cuda' else 'none'}.",
        f"- Token check: {check_line(args) if args.check else 'off (--check)'}.",
    ] + ([f"- Model stubbed (--stub-model): every step emits token {STUB_TOKEN} without a forward pass, so only "
          "the manager's host bookkeeping is timed; tokens/s and latencies are not the model's."]
         if args.stub_model else [])


def check_line(args) -> str:
    tol = GAP_TOLERANCE.get(args.dtype)
    line = f"{', '.join(args.check)}: every request against its own generate()"
    if tol is None:
        return line + ", tokens equal"
    return (line + f"; in {str(args.dtype).removeprefix('torch.')} a request passes when each served token is within "
            f"{tol:.2%} of the top logit (relative to its magnitude) in one forward pass over the prompt and the "
            "tokens before it (`token_gaps`); the note gives the largest gap, and generate()'s own")


def write_outputs(args, env, prompts, runs: list[Run], final: bool) -> str:
    fill_speedups(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    tab = table(runs)
    md = ["# Continuous batching: paged|m3_sparse and a dense twin on paged|sdpa", "",
          *setup_lines(args, env, prompts), "", tab]
    (args.out / "bench_serve.md").write_text("\n".join(md) + "\n")
    results = common.Results("bench_serve", args.out)
    results.env = env
    sizes = {"requests": args.requests, "prompt_lens": list(args.lens), "prompt_tokens": sum(map(len, prompts)),
             "new_tokens": args.new_tokens,
             "block_size": args.block_size, "hidden": args.hidden, "vocab": args.vocab}
    base = {(r.layers, r.rate): r.figures for r in runs if r.config == "dense" and r.status == "ok"}
    for r in runs:
        ref = base.get((r.layers, r.rate)) if r.config != "dense" else None
        results.add(f"{r.layers} {r.config} {r.label}", r.figures.get("ttft_p50_ms"),
                    what=f"{r.config}: continuous batching, TTFT p50", sizes=dict(sizes, layers=r.layers, rate=r.rate),
                    baseline="dense twin on paged|sdpa" if ref else None,
                    baseline_ms=ref["ttft_p50_ms"] if ref else None, config=r.config,
                    attn=r.attn, status=r.status,
                    note=r.note, peak_gib=r.peak_gib, speedup=r.speedup, checked=r.config in args.check,
                    mismatched=r.mismatched, failed=r.failed, divergences=r.divergences, check=r.check,
                    steps=r.steps, **r.figures)
    results.write()
    if final:
        log.write(args.out / "bench_serve.log")
    return tab


def plot(args, runs: list[Run]) -> str:
    plt, why = common.pyplot()
    if plt is None:
        return why
    ok = [r for r in runs if r.status == "ok"]
    panels = (("tok_s", "output tokens/s"), ("ttft", "TTFT ms (p50 bar, p99 tick)"),
              ("itl", "inter-token ms (p50 bar, p99 tick)"))
    fig, axes = plt.subplots(len(args.patterns), 3, figsize=(14, 4 * len(args.patterns)), squeeze=False)
    for row, pattern in zip(axes, args.patterns):
        mine = [r for r in ok if r.layers == pattern]
        labels = [f"{r.config}\n{r.label}" for r in mine]
        for ax, (key, title) in zip(row, panels):
            xs = range(len(mine))
            if key == "tok_s":
                ax.bar(xs, [r.figures["tok_s"] or 0 for r in mine])
            else:
                ax.bar(xs, [r.figures[f"{key}_p50_ms"] or 0 for r in mine])
                ax.scatter(xs, [r.figures[f"{key}_p99_ms"] or 0 for r in mine], marker="_", s=400, color="black")
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=8)
            ax.set_title(f"{pattern}: {title}")
            ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"continuous batching, {args.requests} requests of {args.lens[0]}-{args.lens[1]} tokens, "
                 f"{args.new_tokens} new tokens each")
    fig.tight_layout()
    path = args.out / "serve.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written: {path}"


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def log_run(run: Run) -> None:
    f, fmt = run.figures, common.fmt
    note = f" ({run.note})" if run.note else ""
    log(f"{run.layers} {run.config} {run.label}: {run.status}{note}, tok/s {_tok_s(f)}, "
        f"TTFT p50/p99 {fmt(f.get('ttft_p50_ms'), 1)}/{fmt(f.get('ttft_p99_ms'), 1)} ms, "
        f"ITL p50/p99 {fmt(f.get('itl_p50_ms'), 2)}/{fmt(f.get('itl_p99_ms'), 2)} ms, peak {fmt(run.peak_gib, 1)} GiB")
    st = run.steps
    if st:
        log(f"  steps {st['steps']} ({st['decode_steps']} on the decode fast path), {st['q_tokens']} query tokens "
            f"({fmt(st['mixed_q_tokens_mean'], 0)} a step off the fast path); "
            f"host ms: prepare {fmt(st['prepare_ms'], 0)}, "
            f"step {fmt(st['generation_step_ms'], 0)}, update {fmt(st['update_batch_ms'], 0)}; "
            f"a decode-only step: host {fmt(st['decode_host_ms_p50'], 2)} ms, wall {fmt(st['decode_wall_ms_p50'], 2)} ms "
            f"(medians; prepare / step / update {_method_ms(st.get('decode_method_ms_p50'))}; "
            f"GPU span {fmt(st.get('decode_gpu_span_ms_p50'), 2)} ms)")


def _method_ms(per_method: dict | None) -> str:
    return "/".join(common.fmt(per_method[k], 2) for k in STEP_MS) if per_method else "-"


def main(argv=None) -> int:
    global _BAR
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    env = dict(bg.environment(args), python=platform.python_version())
    prompts = make_prompts(args)
    for line in common.header("bench_serve", env):
        log(line)
    log(f"configs {args.configs}, layers {args.patterns}, {args.requests} requests of "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.new_tokens} new tokens, rates {args.rates}")
    runs: list[Run] = []
    bar_cls = tqdm if tqdm is not None else common.NoBar
    _BAR = bar_cls(total=len(args.patterns) * len(args.configs) * len(args.rates) * args.requests,
                   desc="bench_serve", unit="request", dynamic_ncols=True)
    try:
        with stubbed_model(args.stub_model):
            for pattern in args.patterns:
                models = bg.build_models(args, pattern, args.dtype)
                for name in args.configs:
                    kind, attn = CONFIGS[name]
                    model = models[kind]
                    refs: dict = {}  # generate()'s tokens per request, shared by this model's runs
                    model.set_attn_implementation(attn)
                    warm_up(model, name, prompts, args)
                    for rate in args.rates:
                        _BAR.set_postfix_str(f"{pattern} {name} {'at once' if rate == 0 else f'{rate:g}/s'}")
                        run = run_one(model, name, pattern, prompts, args, rate, lambda: _BAR.update(1), refs)
                        runs.append(run)
                        log_run(run)
                        write_outputs(args, env, prompts, runs, final=False)
                del models
                bg.free_memory(args.device)
    finally:
        _BAR.close()
        _BAR = None
    log(plot(args, runs))
    log(f"total {time.perf_counter() - start:.0f} s; outputs in {args.out}")
    tab = write_outputs(args, env, prompts, runs, final=True)
    print()
    print(tab)
    bad = [r for r in runs if r.status == "mismatch"]
    if bad:
        print(f"token check FAILED: {[f'{r.layers} {r.config} {r.label}: {r.failed}' for r in bad]}", file=sys.stderr)
        return 1
    if args.quick and any(r.status not in ("ok", "stopped") for r in runs):
        print("smoke run FAILED: a run did not finish", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
