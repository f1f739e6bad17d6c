#!/usr/bin/env python3
"""End-to-end ``generate()`` of an M3-shaped random model, each configuration run the way a
user gets it by default, with an eager row beside it: time to first token (TTFT), decode
tokens/s, and per decode step the host time, the GPU kernel time and the kernel launches.

Model: random weights (seed ``--seed``), attention of the real M3 (Hq 64, Hkv 4, D 128,
4 index heads of dim 128, index block 128, top-16, one local block), layers whose pattern
(``--layers``, comma-separated patterns, one model each) mixes sparse (``s``) and
full-attention (``f``) layers, a small dense MLP on every layer and a small vocabulary;
bf16 on CUDA.

Configurations (``--configs``):

* ``dense``: the same weights with every layer full attention (the indexers dropped),
  ``attn_implementation="sdpa"`` with cuDNN first in the SDPA backend priority, and a
  ``StaticCache`` of prompt + new tokens passed to generate() (what
  ``cache_implementation="static"`` builds on a first call; generate() would keep the largest
  size of earlier calls instead, which would give a small size the cache of a large one).
  generate() compiles its decode step as it does by default for a compileable cache on CUDA
  (``torch.compile`` with its ``CompileConfig``: inductor, CUDA graphs). The baseline of the
  speedup columns.
* ``dense-eager``: the same with ``disable_compile=True``.
* ``m3_sparse``: ``attn_implementation="m3_sparse"`` with generate()'s default
  ``M3PagedCache`` and dispatch (``M3_SPARSE_IMPL=auto``, set for the cell), and no
  ``disable_compile``: generate() compiles the decode step when the cache says it is
  compileable, else runs it eagerly. On CUDA every op runs a Triton kernel; on the CPU the
  same dispatch runs the torch reference code.
* ``m3_sparse-eager``: the same with ``disable_compile=True``.
* ``m3_sparse-checked`` (not in the default list): the ``m3_sparse`` row with generate()'s
  stop flag read on the host every step, as transformers does on CUDA for other caches (the
  package has generate() read it one step late for the paged cache: transformers'
  ``DeferredStopCheck``); the step that change saves.
* ``m3_sparse-no-module-guards`` (not in the default list): the ``m3_sparse`` row with
  generate()'s compile told to skip torch.compile's guards on the model's modules
  (``guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe``; CUDA graphs as
  by default): the part of a compiled step's host time that checking the model's structure
  costs on every call. Those guards catch a model changed after it was compiled (modules
  swapped, hooks added, dtype changed); without them such a model runs its old graph.
* ``sdpa`` (not in the default list): transformers' own M3 path on the same model
  (``attn_implementation="sdpa"``, its dynamic cache, which generate() never compiles); it
  expands the block selection into a dense ``[batch, Hq, queries, keys]`` mask.

Which decode ran is measured, not assumed: the ``decode mode`` column says ``eager`` when
generate() never called the compiled forward it asks the model for
(``common.CompiledCalls``), ``compiled`` when it did, and ``graphs`` when the profile of its
steps also shows CUDA-graph launches. Before each compiled row ``torch.compiler.reset()``
clears what earlier rows compiled (each size is a new static shape, and the compiler's
cache of a code object holds a bounded number of them).

Timing of a cell: a warm-up generate() with the same arguments (Triton compiles, cuDNN
plans, torch.compile and CUDA-graph recording); it is left out for an eager row that follows
its compiled twin at the same size (same model and prefill: the kernels are warm). Then
``--reps`` measured generate() calls of ``--new-tokens`` tokens each, greedy, with no
end-of-sequence token so every row generates that many (no logits processor forces it:
generate() runs only its own per-step work, as in a user's call; the profiled call adds the
profiler's hook). A streamer takes a timestamp (after ``torch.cuda.synchronize()``) at each
token: TTFT is the time from the call to the first token (prefill, generate()'s setup and the
cache allocation included); the synced decode step (``decode_ms_synced`` in the JSON) is the median
of the intervals between tokens over the steps before the profiled ones (a median, so that a
one-off first step, such as a graph re-recorded for a new cache, does not count). The
streamer's synchronization keeps the host's work for a step from overlapping the GPU's, so
pairs of calls run without a streamer, as a user runs generate(), one of ``--new-tokens``
tokens and one of 2: the decode step in the table is the median over ``--step-pairs`` pairs
(default 3) of their difference over ``--new-tokens - 2`` steps, the steady step (prefill and
first step cancel; every call's cache has room for ``--new-tokens``, so both run the same
shapes; each pair's figure is in the JSON, ``decode_ms_pairs``); decode tokens/s counts every row
of the batch; "step / GPU" is that step over the profile's GPU ms (1.0: the step takes its
kernels' time, the host keeps up). Medians over the repetitions. Peak memory:
``torch.cuda.max_memory_allocated`` during the measured calls, the weights of both models
included.

Profile (the last ``--profile-steps`` decode steps of the last measured call, see
``common.StepProfiler`` and ``common.step_profile``): each step is a window from the previous
token to its own, the GPU drained at both ends, profiled with ``torch.profiler`` (CPU and
CUDA activity). Per step: host ms (the window's wall time less the time in runtime calls
that wait for the GPU: what the host spends issuing the step, including generate()'s own
work and a few microseconds of profiler overhead per op; of it, the time in torch.compile's
guard check and inside its compiled frame), GPU ms (summed kernel durations,
kernels inside CUDA graphs included), launches (kernel launches plus graph launches, one
each) and kernels (kernels run, each kernel of a replayed graph counted). Profiling the tail
of a measured call rather than a separate generate() costs no extra prefill, and the
windows need no markers inside transformers: a logits processor runs once per token.

Sizes (``--sizes``): ``N`` or ``BxN`` (B rows of N tokens). A cell whose estimated memory
(``memory_need``: the cache, plus the larger of the prefill's transient tensors and, for the
dense twin's decode, its K/V repeated to Hq heads) exceeds ``--mem-frac`` of the free GPU
memory is skipped with the estimate printed; an out-of-memory error is reported as OOM and
the run goes on. generate() prefills a whole batch in one forward pass: at 32 x 32K (1M
tokens) that runs out of memory on an H200 for either model, and ``--prefill-chunk N`` has
every call prefill in chunks of N tokens instead (generate()'s ``prefill_chunk_size``). The
dense twin's chunks then run eagerly, as m3_sparse's do (``eager_chunked_prefill``):
transformers runs them through the compiled forward it builds for the decode steps, which
fails on CUDA; its decode steps stay compiled.

Cost on an H200 (estimated from earlier runs, not yet measured as a whole): the decode steps
cost little (``--new-tokens`` 20 keeps them to seconds per cell); prefills dominate, 2 + 2 x
``--step-pairs`` per compiled row (one fewer for an eager row after its twin), and so does
torch.compile, about 10-40 s per compiled row. The default sweep (two models, six sizes, four
configurations) should take 40-60 minutes, half of it the 12-layer model at 512K (one prefill
of its dense twin there is about 110 s: run that size with ``--step-pairs 1``, its steps are
long enough for one pair); the other cells take seconds plus their compilation. ``--time-limit-s`` stops
starting cells after a budget; split the sweep over runs with ``--layers`` / ``--sizes`` /
``--configs``, and give a run without dense rows an earlier run's JSON as ``--baseline``.

Outputs, in ``--out`` (default ``$OUT``, else ./out): ``bench_generate.md`` (setup and
table), ``bench_generate.json`` (two result rows per cell, TTFT and decode step, with the
profile figures; rewritten after each cell), ``generate_speedup.png`` (speedup over the
dense row against context length, per model; skipped with a message when matplotlib is
missing) and ``bench_generate.log``. The markdown table is printed last.

    python3 benchmarks/bench_generate.py                              # the H200 sweep
    python3 benchmarks/bench_generate.py --layers sfs --sizes 8k,32k   # a subset
    python3 benchmarks/bench_generate.py --configs m3_sparse,m3_sparse-eager --baseline out/bench_generate.json
    python3 benchmarks/bench_generate.py --quick                      # tiny CPU smoke run
    python3 benchmarks/bench_generate.py --layers sssfsssfsssf --sizes 1m --configs m3_sparse \
        --prefill-chunk 65536 --step-pairs 1                          # one million tokens

``--fp8 index|kv|both`` gives the m3_sparse rows a cache with e4m3 index keys, K/V pages or
both (``M3PagedCache``'s ``index_key_dtype`` / ``kv_cache_dtype``; K/V scales 1.0, which suit
this model's random weights, not a trained one's).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import common
from common import GIB, env_var, sync
from common import tokens_label as fmt_tokens

import torch  # noqa: E402

import m3_hf_attention  # noqa: E402,F401  (registers attn_implementation="m3_sparse")
import transformers  # noqa: E402
from transformers import CompileConfig, LogitsProcessorList, StaticCache  # noqa: E402
from transformers.generation import utils as generation  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig  # noqa: E402

try:
    from tqdm.auto import tqdm
except ImportError:  # tqdm normally comes with huggingface_hub
    tqdm = None

PAD, BOS, EOS = 0, 1, 2
SPARSE, FULL = "minimax_m3_sparse", "full_attention"


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # "dense" (the dense twin) or "sparse"
    attn: str  # attn_implementation
    eager: bool  # generate(disable_compile=True)
    what: str
    checked_stop: bool = False  # transformers' stop check every step (not deferred)
    module_guards: bool = True  # False: torch.compile skips its guards on the model's modules


CONFIGS = {c.name: c for c in (
    Config("dense", "dense", "sdpa", False,
           "dense twin (every layer full attention, same weights without the indexers), sdpa with cuDNN first, "
           "StaticCache, decode compiled by generate() as it does by default"),
    Config("dense-eager", "dense", "sdpa", True, "the dense row with disable_compile=True"),
    Config("m3_sparse", "sparse", "m3_sparse", False,
           "m3_sparse, generate()'s default M3PagedCache and dispatch (M3_SPARSE_IMPL=auto; on CUDA every op on "
           "Triton), no disable_compile: compiled when the cache is compileable"),
    Config("m3_sparse-eager", "sparse", "m3_sparse", True, "the m3_sparse row with disable_compile=True"),
    Config("m3_sparse-checked", "sparse", "m3_sparse", False,
           "the m3_sparse row with generate()'s stop flag read on the host every step (transformers' choice on "
           "CUDA; the package defers it for the paged cache)", checked_stop=True),
    Config("m3_sparse-no-module-guards", "sparse", "m3_sparse", False,
           "the m3_sparse row compiled without torch.compile's guards on the model's modules (generate()'s "
           "CompileConfig with guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe, CUDA graphs "
           "kept): the host time those checks cost a step; sound only while the model is not changed after its "
           "first generate()", module_guards=False),
    Config("sdpa", "sparse", "sdpa", False,
           "transformers' sdpa path of the same model (dense [B, Hq, Sq, Sk] block mask), dynamic cache"),
)}
DEFAULT_CONFIGS = "dense,dense-eager,m3_sparse,m3_sparse-eager"
FP8_CACHES = ("none", "index", "kv", "both")
FP8_NOTES = {"index": "index keys", "kv": "K/V pages", "both": "index keys and K/V pages"}
DEFAULT_SIZES = "8k,32k,128k,16x8k,32x32k,512k"
DEFAULT_LAYERS = "sfs,sssfsssfsssf"

_BAR = None


def _echo(line: str) -> None:
    if _BAR is not None and tqdm is not None:
        _BAR.write(line)
    else:
        print(line, flush=True)


log = common.Log(echo=_echo)


# ---------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    batch: int
    context: int  # prompt tokens per row

    @property
    def label(self) -> str:
        return f"{self.batch}x{fmt_tokens(self.context)}" if self.batch > 1 else fmt_tokens(self.context)

    @property
    def tokens(self) -> int:
        return self.batch * self.context


def parse_count(text: str) -> int:
    value = common.count(text)
    if value <= 0:
        raise ValueError(f"expected a positive count, got {text!r}")
    return value


def parse_sizes(text: str) -> list[Shape]:
    """'16k,64k,128k,16x8k' -> shapes; 'BxN' is a batch of B rows of N tokens."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        batch, _, ctx = item.lower().rpartition("x")
        shapes.append(Shape(parse_count(batch) if batch else 1, parse_count(ctx)))
    if not shapes:
        raise ValueError("no sizes given")
    return shapes


def parse_layers(text: str) -> list[str]:
    """'sfs,ssf' -> ['sfs', 'ssf'], each a pattern of 's' (sparse) and 'f' (full attention) layers."""
    patterns = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not patterns or any(c not in "sf" for p in patterns for c in p):
        raise ValueError(f"expected patterns of 's' (sparse) and 'f' (full attention) layers, got {text!r}")
    return patterns


def layer_types(pattern: str) -> list[str]:
    return [SPARSE if c == "s" else FULL for c in pattern]


def model_and_configs(p, args, quick: bool, known) -> None:
    """The model-shape flags' defaults (toy shapes with ``--quick``) and ``--configs`` as a
    list of names from ``known``; ``p.error`` on an unknown one."""
    args.hidden = args.hidden or (64 if quick else 2048)
    args.mlp = args.mlp or (64 if quick else 1024)
    args.vocab = args.vocab or (128 if quick else 1024)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in known]
    if bad or not args.configs:
        p.error(f"--configs: unknown {bad}; expected names from {list(known)}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common.common_args(sizes="", sizes_help="prompt sizes, comma separated: N or BxN, k = 1024 "
                                    f"(default {DEFAULT_SIZES}; --quick: 256,2x128)")],
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU smoke run (overrides the model shape)")
    p.add_argument("--layers", default=None,
                   help=f"comma-separated layer patterns, one model each: s = sparse (MSA) layer, f = full attention "
                   f"(default {DEFAULT_LAYERS}; --quick: sf)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"which configurations, in this order, from {list(CONFIGS)} (default {DEFAULT_CONFIGS})")
    p.add_argument("--page-size", type=int, default=None,
                   help="m3_sparse rows: pass generate() an M3PagedCache of this page size (default: none passed, "
                   "generate() builds its own with the default page size)")
    p.add_argument("--fp8", default="none", choices=FP8_CACHES,
                   help="m3_sparse rows: pass generate() an M3PagedCache with e4m3 index keys (index, per-token "
                   "scales), e4m3 K/V pages (kv, scales 1.0) or both (default none: the model dtype)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="pass generate() prefill_chunk_size (transformers' chunked prefill) in every call; for a "
                   "batch whose one-pass prefill does not fit in memory (default: none, one pass)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="generated tokens per call (default 20; --quick 8); the last --profile-steps of them are "
                   "profiled, the decode step is timed on the others")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="decode steps profiled at the end of the last measured call (default 4; --quick 2; 0: none)")
    p.add_argument("--reps", type=int, default=1, help="measured generate() calls per cell (median; default 1)")
    p.add_argument("--step-pairs", type=int, default=3,
                   help="pairs of free-running calls (--new-tokens and 2 tokens) whose median difference is the "
                   "decode step (default 3)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048; --quick 64)")
    p.add_argument("--mlp", type=int, default=None, help="dense MLP intermediate size (default 1024; --quick 64)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 1024; --quick 128)")
    p.add_argument("--mem-frac", type=float, default=0.9,
                   help="skip a cell whose estimated memory exceeds this fraction of the free GPU memory (default 0.9)")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="start no new cell after this many seconds; the rest is reported as skipped (default 0: no limit)")
    p.add_argument("--baseline", default=None,
                   help="an earlier run's bench_generate.json: its dense rows are the speedup baseline of the sizes "
                   "this run has no dense row for")
    p.add_argument("--keep-traces", action="store_true",
                   help="keep each cell's profiler trace (chrome JSON) in OUT/traces")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (--quick: cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts (default 0)")
    args = p.parse_args(argv)
    q = args.quick
    try:
        args.sizes = parse_sizes(args.sizes or ("256,2x128" if q else DEFAULT_SIZES))
    except ValueError as exc:
        p.error(f"--sizes: {exc}")
    try:
        args.patterns = parse_layers(args.layers or ("sf" if q else DEFAULT_LAYERS))
    except ValueError as exc:
        p.error(f"--layers: {exc}")
    args.new_tokens = args.new_tokens if args.new_tokens is not None else (8 if q else 20)
    args.profile_steps = args.profile_steps if args.profile_steps is not None else (2 if q else 4)
    model_and_configs(p, args, q, CONFIGS)
    if args.profile_steps < 0:
        p.error(f"--profile-steps: expected >= 0, got {args.profile_steps}")
    # At least two timed decode steps before the profiler starts (the step during which it
    # starts is not timed), and at least one before those.
    need = args.profile_steps + 4 if args.profile_steps else 3
    if args.new_tokens < need:
        p.error(f"--new-tokens: expected >= {need} with --profile-steps {args.profile_steps} (the prefill's token, "
                f"timed decode steps, the step the profiler starts in, the profiled steps), got {args.new_tokens}")
    if args.reps < 1:
        p.error(f"--reps: expected >= 1, got {args.reps}")
    if args.step_pairs < 1:
        p.error(f"--step-pairs: expected >= 1, got {args.step_pairs}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        p.error(f"--prefill-chunk: expected >= 1, got {args.prefill_chunk}")
    if args.vocab < 8:
        p.error(f"--vocab: expected >= 8, got {args.vocab}")
    args.device = torch.device(args.device or ("cpu" if q or not torch.cuda.is_available() else "cuda"))
    args.out = Path(args.out)
    return args


# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------
def text_config(args, types: list[str]) -> MiniMaxM3VLTextConfig:
    if args.quick:
        attn = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, rotary_dim=16,
                    index_n_heads=2, index_head_dim=32, index_block_size=16, index_topk_blocks=4)
    else:  # the attention of the real M3
        attn = dict(num_attention_heads=64, num_key_value_heads=4, head_dim=128, rotary_dim=64,
                    index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16)
    n = len(types)
    return MiniMaxM3VLTextConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        dense_intermediate_size=args.mlp,
        shared_intermediate_size=args.mlp,
        num_hidden_layers=n,
        num_local_experts=4,
        num_experts_per_tok=2,
        index_local_blocks=1,
        layer_types=list(types),
        # Dense MLPs only: the MoE block's per-expert loop syncs with the host and would
        # dominate a decode step of so small a model.
        mlp_layer_types=["dense"] * n,
        max_position_embeddings=max(4096, 2 * max(s.context for s in args.sizes) + 1024),
        initializer_range=0.02,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        **attn,
    )


def build_models(args, pattern: str, dtype) -> dict:
    """The sparse model of ``pattern`` and its dense twin (every layer full attention, same
    weights apart from the indexers, which a full-attention layer does not have)."""
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        sparse = MiniMaxM3VLForCausalLM(text_config(args, layer_types(pattern)))
        common.randomize_norms(sparse)
        dense = MiniMaxM3VLForCausalLM(text_config(args, [FULL] * len(pattern)))
    missing, unexpected = dense.load_state_dict(sparse.state_dict(), strict=False)
    if missing or any(".indexer." not in k for k in unexpected):
        raise RuntimeError(f"dense twin: missing {missing}, unexpected {unexpected}")
    for m in (sparse, dense):
        m.to(dtype).eval()
        m.generation_config.pad_token_id = PAD
        m.generation_config.eos_token_id = EOS
    dense.set_attn_implementation("sdpa")
    return {"sparse": sparse, "dense": dense}


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------
class StepClock(BaseStreamer):
    """generate() hands a streamer the prompt first, then each step's tokens (already on
    the host); a stamp after a device sync marks when each token existed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []

    def put(self, value):
        sync(self.device)
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def make_prompt(shape: Shape, vocab: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000003 + shape.batch * 7919 + shape.context)
    ids = torch.randint(3, vocab, (shape.batch, shape.context), generator=gen)  # never PAD/BOS/EOS
    return ids.to(device), torch.ones_like(ids, device=device)


def generate(model, ids, mask, new_tokens: int, extra: dict, streamer=None, processors=()):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=PAD,
        # No end-of-sequence token: every row generates new_tokens, and generate() runs no
        # logits processor to force that (min_new_tokens would add one to every step).
        eos_token_id=None,
        streamer=streamer,
        logits_processor=LogitsProcessorList(processors),
        **extra,
    )


def call_args(config: Config, model, shape: Shape, args):
    """generate()'s extra arguments for one call of ``config`` (a fresh cache each call), with
    room for ``--new-tokens`` in every call: a shorter call then runs the same shapes."""
    extra = {"disable_compile": True} if config.eager else {}
    if not config.module_guards:
        # generate()'s default (inductor, CUDA graphs: what mode="reduce-overhead" sets), and a
        # guard filter, which torch.compile takes through options only.
        extra["compile_config"] = CompileConfig(mode=None, options={
            "triton.cudagraphs": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    length = shape.context + args.new_tokens
    if config.model == "dense":
        extra[m3_hf_attention.CACHE_KEYWORD] = StaticCache(config=model.config, max_cache_len=length)
    elif config.attn == "m3_sparse" and (args.page_size is not None or args.fp8 != "none"):
        fp8 = torch.float8_e4m3fn
        kw = {} if args.page_size is None else {"page_size": args.page_size}
        if args.fp8 in ("kv", "both"):
            kw["kv_cache_dtype"] = fp8
        if args.fp8 in ("index", "both"):
            kw["index_key_dtype"] = fp8
        extra[m3_hf_attention.CACHE_KEYWORD] = m3_hf_attention.M3PagedCache(model.config, shape.batch, length, **kw)
    elif config.attn == "m3_sparse":
        extra["max_cache_len"] = length  # generate() sizes its own M3PagedCache from it
    if args.prefill_chunk:
        extra["prefill_chunk_size"] = args.prefill_chunk
    return extra


def decode_mode(compiled_calls: int, profile: dict) -> str:
    if compiled_calls == 0:
        return "eager"
    return "graphs" if profile.get("graph_launches") else "compiled"


def measured_call(model, config: Config, shape: Shape, args, ids, mask, profiler) -> dict:
    """One timed generate(): TTFT, the decode step (median and mean over the timed steps,
    and the first step), the peak, the decode steps run compiled, row 0's first tokens."""
    device, n = args.device, args.new_tokens
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = StepClock(device)
    sync(device)
    t0 = time.perf_counter()
    with common.CompiledCalls(model) as watch:
        out = generate(model, ids, mask, n, call_args(config, model, shape, args), clock, [profiler] if profiler else ())
    sync(device)
    new = out[:, ids.shape[1]:]
    if new.shape[1] != n or len(clock.stamps) != n + 1:
        raise RuntimeError(f"expected {n} new tokens and {n + 1} streamer stamps, got {new.shape[1]} tokens "
                           f"and {len(clock.stamps)} stamps")
    stamps = clock.stamps  # [0]: the prompt; [1 + t]: token t (0: the prefill's)
    intervals = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # [t - 1]: decode step t
    # The profiler starts during step n - profile_steps - 1 and is on from the next one.
    timed = intervals[: n - args.profile_steps - 2] if profiler else intervals
    return {
        "ttft": stamps[1] - t0,
        "step": statistics.median(timed),
        "mean": statistics.fmean(timed),
        "first": intervals[0],
        "peak": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
        "calls": watch.calls,
        "tokens": new[0, :8].tolist(),
    }


def measure(model, config: Config, shape: Shape, args, warm: bool, trace: Path | None, bar_step) -> dict:
    """One cell: an optional warm-up call, then ``--reps`` measured calls, the last one
    profiled over its last ``--profile-steps`` decode steps."""
    ids, mask = make_prompt(shape, args.vocab, args.seed, args.device)
    warm_s = None
    if warm:
        bar_step("warm-up")
        sync(args.device)
        t = time.perf_counter()
        out = generate(model, ids, mask, args.new_tokens, call_args(config, model, shape, args))
        sync(args.device)
        del out
        warm_s = time.perf_counter() - t
    calls, profiler = [], None
    for rep in range(args.reps):
        bar_step(f"measure {rep + 1}/{args.reps}")
        if rep == args.reps - 1 and args.profile_steps > 0:
            profiler = common.StepProfiler(ids.shape[1], args.new_tokens, args.profile_steps, args.device, trace)
        calls.append(measured_call(model, config, shape, args, ids, mask, profiler))
    profile = profiler.summary() if profiler else {}
    # The streamer synchronizes at every token, so in the calls above the host's work for a
    # step cannot overlap the GPU's. Two more calls without it, as a user runs generate(), of
    # 2 and of --new-tokens tokens: the difference is the steady decode steps alone (the
    # prefill and the first step, which re-records a CUDA graph for a new cache, cancel).
    def free_call(new_tokens: int) -> float:
        sync(args.device)
        t = time.perf_counter()
        generate(model, ids, mask, new_tokens, call_args(config, model, shape, args))
        sync(args.device)
        return time.perf_counter() - t

    bar_step("free-running")
    # One pair's difference carries the jitter of two prefills over a few tens of steps (at
    # 8K, 0.3-0.5 ms a step on an H200 host): the median of --step-pairs pairs.
    pairs = [(free_call(args.new_tokens) - free_call(2)) / (args.new_tokens - 2) for _ in range(args.step_pairs)]
    free_step = statistics.median(pairs)

    def median(key):
        return statistics.median(c[key] for c in calls)

    if free_step <= 0:
        # Noise larger than the decode time (a loaded CPU, tiny shapes): the synced step
        # stands in.
        free_step = median("step")

    compiled = sum(c["calls"] for c in calls)
    peaks = [c["peak"] for c in calls if c["peak"] is not None]
    return {
        "warmup_s": warm_s,
        "ttft_ms": median("ttft") * 1e3,
        "ttft_ms_all": [c["ttft"] * 1e3 for c in calls],
        "decode_ms_per_step": free_step * 1e3,
        "decode_ms_pairs": [p * 1e3 for p in pairs],
        "decode_ms_synced": median("step") * 1e3,
        "decode_ms_mean": median("mean") * 1e3,
        "first_decode_step_ms": median("first") * 1e3,
        "decode_tok_s": shape.batch / free_step,
        "peak_gib": max(peaks) if peaks else None,
        "compiled_calls": compiled,
        "mode": decode_mode(compiled, profile),
        "profile": profile,
        "row0_first_tokens": calls[0]["tokens"],
    }


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    if isinstance(exc, oom_type):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------
# what will not fit
# ---------------------------------------------------------------------------------------
def memory_need(config: Config, shape: Shape, cfg: MiniMaxM3VLTextConfig, new_tokens: int, elem: int = 2,
                prefill_chunk: int | None = None, fp8: str = "none") -> dict:
    """Rough bytes a cell needs beyond the models' weights (``elem`` bytes per element):

    * cache: K and V of every layer for prompt + new tokens (and the sparse layers' index
      keys, ``m3_sparse``; one byte an element where ``fp8`` stores them in e4m3, plus a
      4-byte scale per index key);
    * prefill: about six q-sized tensors per token alive at a layer's peak (q in its
      projected, rotated and transposed forms, the attention output; measured 95-99 KB per
      token with M3's shapes at 128K-512K, docs/perf-log/2026-11-29.md), for the tokens of
      one forward pass (a chunk with ``prefill_chunk``);
    * the dense twin's decode: SDPA with a padding mask gets K/V repeated to Hq heads;
    * ``sdpa``: transformers' block mask, ``sdpa_mask_bytes``.

    The cache plus the largest transient."""
    rows = shape.batch * (shape.context + new_tokens)
    q_elems = cfg.num_attention_heads * cfg.head_dim
    fp8 = fp8 if config.attn == "m3_sparse" else "none"
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * (1 if fp8 in ("kv", "both") else elem)
    index = cfg.index_head_dim + 4 if fp8 in ("index", "both") else cfg.index_head_dim * elem
    sparse_layers = sum(t == SPARSE for t in cfg.layer_types) if config.model == "sparse" else 0
    # generate() prefills a batch in chunks of prefill_chunk tokens of each row.
    pass_tokens = shape.batch * min(shape.context, prefill_chunk) if prefill_chunk else shape.tokens
    need = {
        "cache": rows * (cfg.num_hidden_layers * kv + sparse_layers * index),
        "prefill": pass_tokens * 6 * q_elems * elem,
        "decode": 2 * rows * q_elems * elem if config.model == "dense" else 0,
        "mask": sdpa_mask_bytes(cfg, shape) if config.name == "sdpa" else 0,
    }
    need["total"] = need["cache"] + max(need["prefill"], need["decode"], need["mask"])
    return need


def sdpa_mask_bytes(cfg: MiniMaxM3VLTextConfig, shape: Shape) -> int:
    """Peak extra memory of a sparse layer of transformers' sdpa path at prefill.

    ``build_block_mask`` keeps, alive at once, the block-keep and keep masks (bool,
    ``[B, Hq, S, S]`` each), the float zeros it fills, the inverted mask (bool) and the
    filled result (model dtype): 1 + 1 + 2 + 1 + 2 = 7 bytes x Hq per (row, query, key)
    in bf16, plus the causal test; the indexer before it holds two fp32
    ``[B, Hi, S, S]`` score tensors (8 x Hi bytes). The larger of the two counts.
    """
    pairs = shape.batch * shape.context * shape.context
    return max((7 * cfg.num_attention_heads + 2) * pairs, (8 * cfg.index_n_heads + 1) * pairs)


def plan_skip(config: Config, shape: Shape, args, cfg) -> str | None:
    if args.device.type != "cuda":
        return None
    need = memory_need(config, shape, cfg, args.new_tokens, prefill_chunk=args.prefill_chunk, fp8=args.fp8)
    free_memory(args.device)
    free, _ = torch.cuda.mem_get_info(args.device)
    if need["total"] <= args.mem_frac * free:
        return None
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in need.items() if k != "total" and v)
    return (f"needs ~{need['total'] / GIB:.0f} GiB (GiB: {parts}; the cache plus the largest transient) > "
            f"{args.mem_frac:g} x {free / GIB:.0f} GiB free")


def cudnn_probe(device: torch.device) -> str:
    """Whether cuDNN SDPA takes the dense baseline's prefill call (causal, native GQA, bf16)."""
    if device.type != "cuda":
        return "no CUDA device: the dense rows use the CPU SDPA"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 64, 256, 128, device=device, dtype=torch.bfloat16)
    kv = torch.randn(1, 4, 256, 128, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        sync(device)
        return "cuDNN SDPA available (causal, enable_gqa)"
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
        return (f"cuDNN SDPA NOT usable here ({type(exc).__name__}: {str(exc)[:160]}); "
                "dense rows fall back to flash/efficient")


@contextlib.contextmanager
def dense_backends(device: torch.device):
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    try:
        ctx = sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without backend priorities: cuDNN is then only one of the allowed backends
        ctx = sdpa_kernel(order)
    with ctx:
        yield


# ---------------------------------------------------------------------------------------
# one cell
# ---------------------------------------------------------------------------------------
@dataclass
class Cell:
    layers: str
    config: str
    batch: int
    context: int
    label: str
    status: str = "pending"  # ok | OOM | skipped | error
    note: str = ""
    mode: str | None = None  # eager | compiled | graphs
    ttft_ms: float | None = None
    decode_ms_per_step: float | None = None
    decode_ms_synced: float | None = None
    decode_tok_s: float | None = None
    host_ms: float | None = None
    guard_ms: float | None = None
    frame_ms: float | None = None
    gpu_ms: float | None = None
    launches: float | None = None
    kernels: float | None = None
    peak_gib: float | None = None
    prefill_speedup: float | None = None
    decode_speedup: float | None = None
    details: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return self.layers, self.batch, self.context


@contextlib.contextmanager
def checked_stop():
    """generate() reads its stop flag on the host every step, with any cache: the stop check
    in place before this package switched it on for M3PagedCache."""
    deferred = generation.DeferredStopCheck
    generation.DeferredStopCheck = deferred.m3_sparse_base
    try:
        yield
    finally:
        generation.DeferredStopCheck = deferred


@contextlib.contextmanager
def eager_chunked_prefill(model):
    """generate() on ``model`` runs the chunks of a chunked prefill eagerly, its decode steps
    compiled as before. transformers runs the chunks through the compiled forward that it
    builds for the decode steps; with the dense twin's StaticCache on CUDA that stopped with
    "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"
    (2026-12-04), so the dense twin had no chunked figure. (The package does the same for
    M3PagedCache in generate() itself.)"""
    original = model._prefill

    def prefill(input_ids, generation_config, model_kwargs, *args, **kwargs):
        eager = generation_config.disable_compile
        generation_config.disable_compile = True  # read by the compile decision of this prefill only
        try:
            return original(input_ids, generation_config, model_kwargs, *args, **kwargs)
        finally:
            generation_config.disable_compile = eager

    model._prefill = prefill
    try:
        yield
    finally:
        del model._prefill


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def attempt(model, config: Config, shape: Shape, args, ctx, warm: bool, trace, bar_step):
    """(result, None) or (None, (status, message)); the memory of a failed call is freed."""
    free_memory(args.device)
    failure, result = None, None
    try:
        with ctx, torch.no_grad():
            result = measure(model, config, shape, args, warm, trace, bar_step)
    except Exception as exc:  # noqa: BLE001 - one failing cell must not end the benchmark
        failure = ("OOM" if is_oom(exc) else "error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        if failure[0] == "error":
            log.lines.append(traceback.format_exc())
    # Outside the except block, so the traceback's frames (and their tensors) are gone.
    free_memory(args.device)
    return result, failure


def run_cell(config: Config, shape: Shape, pattern: str, models: dict, args, warm: bool, bar_step) -> Cell:
    model = models[config.model]
    cell = Cell(pattern, config.name, shape.batch, shape.context, shape.label)
    skip = plan_skip(config, shape, args, model.config)
    if skip:
        cell.status, cell.note = "skipped", skip
        return cell
    if not config.eager and args.device.type == "cuda":
        # Each size is a new static shape for the compiler: start from a clean slate rather
        # than run into its bound on compiled variants of one code object.
        torch.compiler.reset()
    if config.model == "sparse":
        model.set_attn_implementation(config.attn)
    ctx = dense_backends(args.device) if config.model == "dense" else (
        env_var("M3_SPARSE_IMPL", "auto") if config.attn == "m3_sparse" else contextlib.nullcontext())
    if config.checked_stop:
        ctx = _both(ctx, checked_stop())
    if config.model == "dense" and args.prefill_chunk:
        ctx = _both(ctx, eager_chunked_prefill(model))
    trace = args.out / "traces" / f"{pattern}_{config.name}_{shape.label}.json" if args.keep_traces else None
    try:
        result, failure = attempt(model, config, shape, args, ctx, warm, trace, bar_step)
        if config.model == "dense" and failure is not None and failure[0] == "error" and args.device.type == "cuda":
            # A backend that accepts a call's shapes but then fails on it must not cost the
            # baseline: run again on torch's own SDPA choice and say so.
            first = failure[1]
            log(f"{config.name} {shape.label}: {first}; again with the default SDPA backend order")
            result, failure = attempt(model, config, shape, args, contextlib.nullcontext(), True, trace, bar_step)
            if failure is None:
                cell.note = f"cuDNN-first failed ({first}); default SDPA backend order"
    finally:
        if config.model == "sparse":
            model.set_attn_implementation("m3_sparse")
    if failure is not None:
        cell.status, cell.note = failure
        return cell
    prof = result["profile"]
    cell.status = "ok"
    cell.mode = result["mode"]
    if config.attn == "m3_sparse" and not config.eager and cell.mode == "eager" and args.device.type == "cuda":
        cell.note = "generate() did not compile the decode step (the cache does not say it is compileable)"
    for name in ("ttft_ms", "decode_ms_per_step", "decode_ms_synced", "decode_tok_s", "peak_gib"):
        setattr(cell, name, result[name])
    for name in ("host_ms", "guard_ms", "frame_ms", "gpu_ms", "launches", "kernels"):
        setattr(cell, name, prof.get(name))
    cell.details = {k: v for k, v in result.items() if k not in asdict(cell)}
    return cell


def load_baseline(path: str | None) -> dict:
    """The ok dense rows of an earlier run's JSON, as cells keyed like ``Cell.key``."""
    if not path:
        return {}
    base = {}
    for row in json.loads(Path(path).read_text()):
        m, s = row.get("metrics", {}), row.get("sizes", {})
        if m.get("config") != "dense" or m.get("status") != "ok" or row.get("ms") is None:
            continue
        key = (s["layers"], s["batch"], s["context"])
        cell = base.setdefault(key, Cell(s["layers"], "dense", s["batch"], s["context"], ""))
        if m.get("phase") == "ttft":
            cell.ttft_ms = row["ms"]
        elif m.get("phase") == "decode":
            cell.decode_tok_s = m.get("decode_tok_s")
            cell.decode_ms_per_step = row["ms"]
    return {k: c for k, c in base.items() if c.ttft_ms and c.decode_tok_s}


def baselines(cells: list[Cell], earlier: dict) -> dict:
    """Each size's dense row: this run's, else the ``--baseline`` run's."""
    return {**earlier, **{c.key: c for c in cells if c.config == "dense" and c.status == "ok"}}


def fill_speedups(cells: list[Cell], earlier: dict) -> None:
    base = baselines(cells, earlier)
    for c in cells:
        ref = base.get(c.key)
        if c.status != "ok" or ref is None:
            continue
        c.prefill_speedup = ref.ttft_ms / c.ttft_ms
        c.decode_speedup = c.decode_tok_s / ref.decode_tok_s


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------
def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(cells: list[Cell]) -> str:
    rows = []
    for c in cells:
        note = c.note if len(c.note) <= 90 else c.note[:87] + "..."
        if c.status != "ok":
            rows.append([c.layers, c.config, c.label, c.status] + ["-"] * 15 + [note])
            continue
        bound = c.decode_ms_per_step / c.gpu_ms if c.gpu_ms else None  # 1.0: the step is its kernels' time
        rows.append([c.layers, c.config, c.label, c.mode, _f(c.ttft_ms, ".1f"), _f(c.decode_tok_s, ".1f"),
                     _f(c.decode_ms_per_step, ".2f"), _f(c.decode_ms_synced, ".2f"), _f(c.host_ms, ".2f"),
                     _f(c.guard_ms, ".2f"), _f(c.frame_ms, ".2f"), _f(c.gpu_ms, ".2f"), _f(bound, ".2f"),
                     _f(c.launches, ".0f"), _f(c.kernels, ".0f"), _x(c.prefill_speedup), _x(c.decode_speedup),
                     _f(c.peak_gib, ".1f"), note])
    return common.md_table(["layers", "config", "context", "decode mode", "TTFT ms", "decode tok/s", "step ms",
                            "synced step ms", "host ms/step", "guards ms/step", "compiled frame ms/step",
                            "GPU ms/step", "step / GPU", "launches/step",
                            "kernels/step", "TTFT speedup", "decode speedup", "peak GiB", "note"], rows)


def environment(args) -> dict:
    """``common.environment()`` with the Python and transformers versions, and the device
    the model runs on."""
    env = dict(common.environment(), python=platform.python_version(), transformers=transformers.__version__,
               torch_device=str(args.device))
    if args.device.type == "cuda":
        prop = torch.cuda.get_device_properties(args.device)
        env.update(device=prop.name, sms=prop.multi_processor_count, gpu_memory_gib=round(prop.total_memory / GIB, 1))
    else:
        env.update(device="cpu", sms=0)
    return env


def setup_lines(args, cfg, env, cudnn: str) -> list[str]:
    gpu = f"{env['device']} ({env['sms']} SMs, {env['gpu_memory_gib']} GiB)" if "gpu_memory_gib" in env else "cpu"
    p = args.profile_steps
    return [
        f"- Date {env['date']}; device {gpu}; torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}.",
        f"- Models: random weights (seed {args.seed}), layer patterns {', '.join(f'`{x}`' for x in args.patterns)} "
        f"(s = sparse MSA layer, f = full attention); Hq {cfg.num_attention_heads}, Hkv {cfg.num_key_value_heads}, "
        f"D {cfg.head_dim}, index heads {cfg.index_n_heads} x {cfg.index_head_dim}, block {cfg.index_block_size}, "
        f"top-{cfg.index_topk_blocks}, local blocks {cfg.index_local_blocks}; hidden {cfg.hidden_size}, dense MLP "
        f"{cfg.dense_intermediate_size}, vocab {cfg.vocab_size}; {str(args.dtype).removeprefix('torch.')}.",
        f"- Greedy generate() of {args.new_tokens} new tokens (no end-of-sequence token, no logits processor"
        + (f", prefill in chunks of {args.prefill_chunk} tokens" if args.prefill_chunk else "")
        + (f", m3_sparse caches with e4m3 {FP8_NOTES[args.fp8]}" if args.fp8 != "none" else "") + "), "
        f"median of {args.reps} measured call(s) after a warm-up call (none for an eager row right after its "
        "compiled twin). TTFT: generate() call to first token (streamer stamp after torch.cuda.synchronize), "
        f"prefill and setup included; step ms: (time of a call of {args.new_tokens} tokens - time of a call of 2) / "
        f"{args.new_tokens - 2}, both without a streamer (steady steps, the first excluded); step / GPU: step ms / "
        "GPU ms; synced step ms: median interval between streamer tokens"
        + (f" over the steps before the {p} profiled ones" if p else "") + " (host and GPU work of a step "
        "serialized by the streamer's synchronization); decode tok/s = rows / step ms. "
        "Peak: torch.cuda.max_memory_allocated during the measured calls, weights of both models included.",
        "- decode mode: eager (generate() did not use its compiled forward), compiled (it did), graphs (compiled, and "
        "the profile shows CUDA-graph launches). Before each compiled row torch.compiler.reset().",
        (f"- Per step, from torch.profiler over the last {p} decode steps of the last measured call, the GPU drained "
         "at each step's ends: host ms = wall time less runtime calls that wait for the GPU; guards ms and compiled "
         "frame ms = the parts of host ms in torch.compile's guard check and inside its compiled frame (the rest is "
         "generate()'s loop; 0 for an eager step); GPU ms = summed kernel time (kernels in graphs included); "
         "launches = kernel and graph launches; kernels = kernels run."
         if p else "- No profile (--profile-steps 0)."),
        f"- SDPA backends of the dense rows: {cudnn}; transformers passes a padding mask at decode with a static "
        "cache, so SDPA gets K/V repeated to Hq heads and takes a masked kernel.",
        *(f"- {name}: {CONFIGS[name].what}." for name in args.configs),
        "- Speedups: over the `dense` row of the same model and size"
        + (f" (from {args.baseline} where this run has none)" if args.baseline else "")
        + ": dense TTFT / TTFT, decode tok/s / dense decode tok/s.",
        *(["- On the CPU every m3_sparse op runs the torch reference and generate() compiles nothing: these figures "
           "only show that the script runs."] if args.device.type != "cuda" else []),
    ]


def write_outputs(args, cfg, env, cudnn, cells, earlier, final: bool) -> str:
    fill_speedups(cells, earlier)
    args.out.mkdir(parents=True, exist_ok=True)
    tab = table(cells)
    notes = [f"- {c.layers} {c.config} {c.label}: {c.status}: {c.note}" for c in cells if c.note]
    md = ["# generate() end to end: m3_sparse and a dense twin, default and eager", "",
          *setup_lines(args, cfg, env, cudnn), "", tab]
    if notes:
        md += ["", "Notes (skips, failures, fallbacks):", "", *notes]
    (args.out / "bench_generate.md").write_text("\n".join(md) + "\n")
    result_rows(args, env, cudnn, cells, earlier).write()
    if final:
        log.write(args.out / "bench_generate.log")
    return tab


def result_rows(args, env, cudnn, cells, earlier) -> common.Results:
    """Two rows per cell, TTFT and the decode step (with the profile), each against the
    dense row of the same model and size."""
    results = common.Results("bench_generate", args.out)
    results.env = env
    base = baselines(cells, earlier)
    for c in cells:
        ref = base.get(c.key) if c.config != "dense" else None
        sizes = {"batch": c.batch, "context": c.context, "new_tokens": args.new_tokens, "layers": c.layers,
                 "hidden": args.hidden, "vocab": args.vocab}
        common_metrics = dict(config=c.config, status=c.status, note=c.note, mode=c.mode, peak_gib=c.peak_gib,
                              cudnn=cudnn, details=c.details)
        baseline = "dense twin (cuDNN-first SDPA, static cache, generate()'s default compile)" if ref else None
        results.add(f"{c.layers} {c.config} {c.label}", c.ttft_ms, what=f"{c.config}: generate() time to first token",
                    sizes=sizes, baseline=baseline, baseline_ms=ref.ttft_ms if ref else None,
                    speedup=c.prefill_speedup, phase="ttft", **common_metrics)
        results.add(f"{c.layers} {c.config} {c.label}", c.decode_ms_per_step, what=f"{c.config}: generate() decode step",
                    sizes=sizes, baseline=baseline, baseline_ms=ref.decode_ms_per_step if ref else None,
                    speedup=c.decode_speedup, phase="decode", decode_tok_s=c.decode_tok_s, host_ms=c.host_ms,
                    guard_ms=c.guard_ms, frame_ms=c.frame_ms, gpu_ms=c.gpu_ms, launches=c.launches,
                    kernels=c.kernels, **common_metrics)
    return results


def plot(args, cells: list[Cell]) -> str:
    plt, why = common.pyplot()
    if plt is None:
        return why
    n = len(args.patterns)
    fig, axes = plt.subplots(n, 2, figsize=(11, 4.2 * n), sharex=True, squeeze=False)
    markers = {"dense-eager": "s", "m3_sparse": "o", "m3_sparse-eager": "D", "sdpa": "^"}
    plotted = False
    ticks = sorted({c.context for c in cells})
    for row, pattern in zip(axes, args.patterns):
        for ax, key, title in ((row[0], "prefill_speedup", "TTFT"), (row[1], "decode_speedup", "decode")):
            ax.axhline(1.0, color="gray", lw=1, ls="--", label="dense (generate()'s default)")
            for name in args.configs:
                for batch in sorted({c.batch for c in cells}):
                    pts = sorted((c.context, getattr(c, key)) for c in cells if c.config == name and c.batch == batch
                                 and c.layers == pattern and c.config != "dense" and getattr(c, key) is not None)
                    if not pts:
                        continue
                    plotted = True
                    xs, ys = zip(*pts)
                    label = name if batch == 1 else f"{name}, batch {batch}"
                    ax.plot(xs, ys, marker=markers.get(name, "x"), ls="-" if batch == 1 else ":", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pattern}: {title} speedup over dense")
            ax.set_xlabel("context tokens per row")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xticks(ticks)
            ax.set_xticklabels([fmt_tokens(t) for t in ticks])
        row[0].set_ylabel("speedup (x)")
        row[1].legend(fontsize=8, loc="best")
    fig.suptitle("generate(): m3_sparse vs a dense twin, M3 attention shapes")
    fig.tight_layout()
    path = args.out / "generate_speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written: {path}" + ("" if plotted else " (no speedup to plot: no dense baseline measured)")


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def log_cell(cell: Cell) -> None:
    head = f"{cell.layers} {cell.config} {cell.label}"
    if cell.status != "ok":
        log(f"{head}: {cell.status}: {cell.note}")
        return
    warm = cell.details.get("warmup_s")
    log(f"{head}: {cell.mode}, TTFT {cell.ttft_ms:.1f} ms, decode {cell.decode_ms_per_step:.2f} ms/step "
        f"({cell.decode_tok_s:.1f} tok/s; first step {cell.details['first_decode_step_ms']:.1f} ms), host "
        f"{_f(cell.host_ms, '.2f')} ms (guards {_f(cell.guard_ms, '.2f')}, compiled frame {_f(cell.frame_ms, '.2f')}), "
        f"GPU {_f(cell.gpu_ms, '.2f')} ms, {_f(cell.launches, '.0f')} launches, "
        f"{_f(cell.kernels, '.0f')} kernels per step, peak {_f(cell.peak_gib, '.1f')} GiB, "
        f"warm-up {'none' if warm is None else f'{warm:.1f} s'}, cell {cell.details['cell_s']:.1f} s")


def main(argv=None) -> int:
    global _BAR
    args = parse_args(argv)
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    env = environment(args)
    earlier = load_baseline(args.baseline)
    common.start_profiler_early(args.device)
    cudnn = cudnn_probe(args.device)
    log(f"bench_generate: {env}")
    log(f"cuDNN: {cudnn}")
    log(f"configs {args.configs}, sizes {[s.label for s in args.sizes]}, layers {args.patterns}, "
        f"new tokens {args.new_tokens}, profiled steps {args.profile_steps}, output {args.out}")

    cells: list[Cell] = []
    cfg = None
    bar_cls = tqdm if tqdm is not None else common.NoBar
    interactive = sys.stderr.isatty()
    _BAR = bar_cls(total=len(args.patterns) * len(args.sizes) * len(args.configs), desc="bench_generate",
                   unit="cell", dynamic_ncols=True)
    try:
        for pattern in args.patterns:
            models = build_models(args, pattern, args.dtype)
            cfg = cfg or models["sparse"].config
            previous = None  # (model, attention, shape) of the last cell that ran
            for shape in args.sizes:
                for name in args.configs:
                    config = CONFIGS[name]
                    elapsed = time.perf_counter() - start
                    if args.time_limit_s > 0 and elapsed > args.time_limit_s:
                        cell = Cell(pattern, name, shape.batch, shape.context, shape.label, status="skipped",
                                    note=f"time limit: {elapsed:.0f} s > --time-limit-s {args.time_limit_s:g}")
                    else:
                        def bar_step(what, _c=f"{pattern} {name} {shape.label}"):
                            # Off a terminal every refresh is a new line of the log: show the step on a terminal only.
                            _BAR.set_postfix_str(f"{_c}: {what}", refresh=interactive)

                        bar_step("start")
                        # An eager row right after its compiled twin at the same size runs
                        # the same model and prefill: its kernels are warm.
                        warm = not (config.eager and previous == (config.model, config.attn, shape))
                        t = time.perf_counter()
                        cell = run_cell(config, shape, pattern, models, args, warm, bar_step)
                        cell.details["cell_s"] = time.perf_counter() - t
                        previous = (config.model, config.attn, shape) if cell.status == "ok" else None
                    cells.append(cell)
                    log_cell(cell)
                    _BAR.update(1)
                    write_outputs(args, cfg, env, cudnn, cells, earlier, final=False)
            del models
            if args.device.type == "cuda":
                torch.compiler.reset()  # its caches and CUDA graphs hold on to the models
            free_memory(args.device)
    finally:
        _BAR.close()
        _BAR = None
    tab = write_outputs(args, cfg, env, cudnn, cells, earlier, final=False)
    log(plot(args, cells))
    log(f"total {time.perf_counter() - start:.0f} s; outputs in {args.out}")
    write_outputs(args, cfg, env, cudnn, cells, earlier, final=True)
    print()
    print(tab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
