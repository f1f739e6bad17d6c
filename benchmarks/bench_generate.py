#!/usr/bin/env python3
"""End-to-end ``generate()`` speed of an M3-shaped random model: time to first token
(prefill) and decode tokens/s, ``m3_sparse`` against transformers' ``sdpa`` path of the
same model and against a dense model of the same shapes.

Model: random weights (seed ``--seed``), attention of the real M3 (Hq 64, Hkv 4, D 128,
4 index heads of dim 128, index block 128, top-16, one local block), a few layers whose
pattern ``--layers`` mixes sparse (``s``) and full-attention (``f``) layers, a small
dense MLP on every layer and a small vocabulary; bf16 on CUDA.

Configurations (``--configs``):

* ``dense``: the same weights with every layer turned full attention (the indexers are
  dropped), ``attn_implementation="sdpa"`` with cuDNN first in the SDPA backend
  priority, ``cache_implementation="static"``. This is the baseline of the speedup
  columns.
* ``m3_sparse``: ``attn_implementation="m3_sparse"`` with the default ``M3PagedCache``
  of generate() and the default dispatch (``M3_SPARSE_IMPL=auto``, set for the cell so
  an inherited value cannot change what the row measures). On CUDA every op runs a
  Triton kernel: the index top-k, the sparse layers' ``sparse_attention`` (the decode
  kernel while a sequence brings at most dispatch.decode_max_queries() query rows (96 on
  the H200 with M3's shapes), so every decode step; KV-outer
  for the longer prefills) and the full-attention layers' ``dense_paged_attention``
  (also taken by a sparse layer while its history is so short that every block is
  selected). On the CPU the same dispatch runs the torch reference code.
* ``sdpa``: transformers' own M3 path on the same model (``attn_implementation="sdpa"``,
  its default dynamic cache), which expands the block selection into a dense
  ``[batch, Hq, queries, keys]`` mask; sizes whose mask cannot fit in the free GPU memory
  are skipped (the estimate is printed), and an out-of-memory error is reported as OOM.

Every configuration runs eagerly: generate() is given ``disable_compile=True``, since it
would otherwise ``torch.compile`` the decode of any compileable cache (the dense model's
static cache) by itself; ``--compile`` leaves that choice to generate().

Timing: for each (configuration, size) one warm-up generate() of ``--warmup-tokens`` new
tokens (Triton compiles, cuDNN plans), then ``--reps`` measured generate() calls of
``--new-tokens`` tokens, greedy, with ``min_new_tokens = max_new_tokens`` and the pad id
suppressed so every row generates exactly that many tokens. A streamer takes a timestamp
(after ``torch.cuda.synchronize()``) at each generated token: TTFT is the time from the
call of generate() to the first token (prefill included, plus generate()'s own setup and
cache allocation), decode is (last stamp - first stamp) / (new tokens - 1) per step, and
decode tokens/s counts every row of the batch. Medians over the repetitions. Peak memory is
``torch.cuda.max_memory_allocated`` during the measured call (model weights included).

Outputs, in ``--out`` (default ``$OUT``, else ./out): ``bench_generate.md`` (the table and
the setup), ``bench_generate.json`` (result rows: TTFT and decode step of every cell,
rewritten after each cell) and ``generate_speedup.png`` (speedup over dense against context
length; skipped with a message when matplotlib is missing). The markdown table is printed
last.

    python3 benchmarks/bench_generate.py                      # the H200 run
    python3 benchmarks/bench_generate.py --sizes 16k,128k --new-tokens 64 --skip-sdpa
    python3 benchmarks/bench_generate.py --configs dense,m3_sparse  # no sdpa rows
    python3 benchmarks/bench_generate.py --quick              # tiny CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
from transformers.generation.streamers import BaseStreamer  # noqa: E402
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig  # noqa: E402

try:
    from tqdm.auto import tqdm
except ImportError:  # tqdm normally comes with huggingface_hub
    tqdm = None

PAD, BOS, EOS = 0, 1, 2
CONFIGS = {
    "dense": "dense model (every layer full attention, same weights without the indexers), sdpa with cuDNN first, "
    "static cache",
    "m3_sparse": "m3_sparse, M3PagedCache, default dispatch (M3_SPARSE_IMPL=auto): on CUDA every op on Triton "
    "(index top-k; sparse_attention = decode kernel up to decode_max_queries() query rows per sequence, else KV-outer; dense kernel "
    "in the full-attention layers)",
    "sdpa": "transformers' sdpa path of the same model (dense [B, Hq, Sq, Sk] block mask), dynamic cache",
}

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
    """'sfs' -> ['minimax_m3_sparse', 'full_attention', 'minimax_m3_sparse']."""
    kinds = {"s": "minimax_m3_sparse", "f": "full_attention"}
    if not text or any(c not in kinds for c in text.lower()):
        raise ValueError(f"expected a pattern of 's' (sparse) and 'f' (full attention) layers, got {text!r}")
    return [kinds[c] for c in text.lower()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="End-to-end generate() speed: m3_sparse vs transformers sdpa vs a dense cuDNN model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        parents=[common.common_args(sizes="", sizes_help="prompt sizes, comma separated: N or BxN, k = 1024 "
                                    "(default 16k,64k,128k,16x8k; --quick: 256,2x128)")],
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU smoke run (overrides the model shape)")
    p.add_argument("--layers", default="sfs", help="layer pattern: s = sparse (MSA) layer, f = full attention")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="generated tokens per measured call (default 32; --quick 4)")
    p.add_argument("--warmup-tokens", type=int, default=3,
                   help="new tokens of the warm-up call (>= 2 compiles decode too)")
    p.add_argument("--reps", type=int, default=1, help="measured generate() calls per cell (median)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"which configurations, in this order; from {list(CONFIGS)}")
    p.add_argument("--skip-sdpa", action="store_true", help="leave out the transformers sdpa configuration")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048; --quick 64)")
    p.add_argument("--mlp", type=int, default=None, help="dense MLP intermediate size (default 1024; --quick 64)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 1024; --quick 128)")
    p.add_argument("--sdpa-mem-frac", type=float, default=0.9,
                   help="skip sdpa where its estimated extra memory exceeds this fraction of the free GPU memory")
    p.add_argument("--time-limit-s", type=float, default=270.0,
                   help="start no new cell after this many seconds; the rest is reported as skipped (0: no limit)")
    p.add_argument("--compile", action="store_true",
                   help="let generate() torch.compile the decode of a compileable cache (its default behaviour); "
                   "without it every configuration runs eagerly")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (--quick: cpu)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    q = args.quick
    try:
        args.sizes = parse_sizes(args.sizes or ("256,2x128" if q else "16k,64k,128k,16x8k"))
    except ValueError as exc:
        p.error(f"--sizes: {exc}")
    try:
        args.layer_types = parse_layers(args.layers)
    except ValueError as exc:
        p.error(f"--layers: {exc}")
    args.new_tokens = args.new_tokens if args.new_tokens is not None else (4 if q else 32)
    args.hidden = args.hidden or (64 if q else 2048)
    args.mlp = args.mlp or (64 if q else 1024)
    args.vocab = args.vocab or (128 if q else 1024)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; expected names from {list(CONFIGS)}")
    if args.skip_sdpa:
        args.configs = [c for c in args.configs if c != "sdpa"]
    if args.new_tokens < 2:
        p.error(f"--new-tokens: expected >= 2 (one prefill token and at least one decode step), got {args.new_tokens}")
    if args.warmup_tokens < 1:
        p.error(f"--warmup-tokens: expected >= 1, got {args.warmup_tokens}")
    if args.reps < 1:
        p.error(f"--reps: expected >= 1, got {args.reps}")
    if args.vocab < 8:
        p.error(f"--vocab: expected >= 8, got {args.vocab}")
    args.device = torch.device(args.device or ("cpu" if q or not torch.cuda.is_available() else "cuda"))
    args.out = Path(args.out)
    return args


# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------
def text_config(args, layer_types: list[str]) -> MiniMaxM3VLTextConfig:
    if args.quick:
        attn = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, rotary_dim=16,
                    index_n_heads=2, index_head_dim=32, index_block_size=16, index_topk_blocks=4)
    else:  # the attention of the real M3
        attn = dict(num_attention_heads=64, num_key_value_heads=4, head_dim=128, rotary_dim=64,
                    index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16)
    n = len(layer_types)
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
        layer_types=list(layer_types),
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


def build_models(args, dtype):
    """The sparse model and its dense twin (every layer full attention, same weights
    apart from the indexers, which a full-attention layer does not have)."""
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        sparse = MiniMaxM3VLForCausalLM(text_config(args, args.layer_types))
        common.randomize_norms(sparse)
        dense = MiniMaxM3VLForCausalLM(text_config(args, ["full_attention"] * len(args.layer_types)))
    missing, unexpected = dense.load_state_dict(sparse.state_dict(), strict=False)
    if missing or any(".indexer." not in k for k in unexpected):
        raise RuntimeError(f"dense twin: missing {missing}, unexpected {unexpected}")
    for m in (sparse, dense):
        m.to(dtype).eval()
        m.generation_config.pad_token_id = PAD
        m.generation_config.eos_token_id = EOS
    dense.set_attn_implementation("sdpa")
    return sparse, dense


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


def generate(model, ids, mask, new_tokens: int, extra: dict, streamer=None):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # EOS is masked until then: every row generates new_tokens
        do_sample=False,
        pad_token_id=PAD,
        suppress_tokens=[PAD],
        streamer=streamer,
        **extra,
    )


def measure(model, shape: Shape, args, extra: dict, bar_step) -> dict:
    device = args.device
    ids, mask = make_prompt(shape, args.vocab, args.seed, device)
    bar_step("warm-up")
    sync(device)
    t = time.perf_counter()
    out = generate(model, ids, mask, args.warmup_tokens, extra)
    sync(device)
    warm_s = time.perf_counter() - t
    del out
    ttft, step, peak, first_tokens = [], [], [], None
    for rep in range(args.reps):
        bar_step(f"measure {rep + 1}/{args.reps}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        clock = StepClock(device)
        sync(device)
        t0 = time.perf_counter()
        out = generate(model, ids, mask, args.new_tokens, extra, streamer=clock)
        sync(device)
        new = out[:, ids.shape[1]:]
        if new.shape[1] != args.new_tokens or len(clock.stamps) != args.new_tokens + 1:
            raise RuntimeError(
                f"expected {args.new_tokens} new tokens and {args.new_tokens + 1} streamer stamps, got "
                f"{new.shape[1]} tokens and {len(clock.stamps)} stamps"
            )
        stamps = clock.stamps
        ttft.append(stamps[1] - t0)
        step.append((stamps[-1] - stamps[1]) / (args.new_tokens - 1))
        if device.type == "cuda":
            peak.append(torch.cuda.max_memory_allocated(device) / GIB)
        if first_tokens is None:
            first_tokens = new[0, :8].tolist()
        del out, new
    step_s = statistics.median(step)
    return {
        "status": "ok",
        "warmup_s": warm_s,
        "ttft_ms": statistics.median(ttft) * 1e3,
        "ttft_ms_all": [x * 1e3 for x in ttft],
        "decode_ms_per_step": step_s * 1e3,
        "decode_tok_s": shape.batch / step_s,
        "peak_gib": max(peak) if peak else None,
        "row0_first_tokens": first_tokens,
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
def sdpa_extra_bytes(cfg: MiniMaxM3VLTextConfig, shape: Shape) -> int:
    """Peak extra memory of a sparse layer of transformers' sdpa path at prefill.

    ``build_block_mask`` keeps, alive at once, the block-keep and keep masks (bool,
    ``[B, Hq, S, S]`` each), the float zeros it fills, the inverted mask (bool) and the
    filled result (model dtype): 1 + 1 + 2 + 1 + 2 = 7 bytes x Hq per (row, query, key)
    in bf16, plus the causal test; the indexer before it holds two fp32
    ``[B, Hi, S, S]`` score tensors (8 x Hi bytes). The larger of the two counts.
    """
    pairs = shape.batch * shape.context * shape.context
    mask = (7 * cfg.num_attention_heads + 2) * pairs
    index = (8 * cfg.index_n_heads + 1) * pairs
    return max(mask, index)


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
    config: str
    batch: int
    context: int
    label: str
    status: str = "pending"  # ok | OOM | skipped | error
    note: str = ""
    ttft_ms: float | None = None
    decode_ms_per_step: float | None = None
    decode_tok_s: float | None = None
    peak_gib: float | None = None
    prefill_speedup: float | None = None
    decode_speedup: float | None = None
    details: dict = field(default_factory=dict)


def plan_skip(name: str, shape: Shape, args, cfg) -> str | None:
    device = args.device
    if name == "sdpa" and device.type == "cuda":
        need = sdpa_extra_bytes(cfg, shape)
        free_memory(device)
        free, _ = torch.cuda.mem_get_info(device)
        if need > args.sdpa_mem_frac * free:
            return (
                f"needs ~{need / GIB:.0f} GiB for the dense block mask ((7 x Hq + 2) B per (row, query, key) = "
                f"{7 * cfg.num_attention_heads + 2} x {shape.batch} x {shape.context}^2) > "
                f"{args.sdpa_mem_frac:g} x {free / GIB:.0f} GiB free"
            )
    return None


def attempt(model, shape: Shape, args, extra: dict, ctx, bar_step):
    """(result, None) or (None, (status, message)); the memory of a failed call is freed."""
    free_memory(args.device)
    failure, result = None, None
    try:
        with ctx, torch.no_grad():
            result = measure(model, shape, args, extra, bar_step)
    except Exception as exc:  # noqa: BLE001 - one failing cell must not end the benchmark
        failure = ("OOM" if is_oom(exc) else "error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        if failure[0] == "error":
            log.lines.append(traceback.format_exc())
    # Outside the except block, so the traceback's frames (and their tensors) are gone.
    free_memory(args.device)
    return result, failure


def run_cell(name: str, shape: Shape, models, args, bar_step) -> Cell:
    sparse, dense = models
    cell = Cell(name, shape.batch, shape.context, shape.label)
    cfg = sparse.config
    skip = plan_skip(name, shape, args, cfg)
    if skip:
        cell.status, cell.note = "skipped", skip
        return cell
    if name == "dense":
        model = dense
        extra = {"cache_implementation": "static"}
        ctx = dense_backends(args.device)
    elif name == "m3_sparse":
        model = sparse
        model.set_attn_implementation("m3_sparse")
        extra = {}
        ctx = env_var("M3_SPARSE_IMPL", "auto")
    else:  # sdpa
        model = sparse
        model.set_attn_implementation("sdpa")
        extra = {}
        ctx = contextlib.nullcontext()
    if not args.compile:
        extra["disable_compile"] = True
    try:
        result, failure = attempt(model, shape, args, extra, ctx, bar_step)
        if name == "dense" and failure is not None and failure[0] == "error" and args.device.type == "cuda":
            # A backend that accepts a call's shapes but then fails on it must not cost the
            # baseline: run again on torch's own SDPA choice and say so.
            first = failure[1]
            log(f"dense {shape.label}: {first}; again with the default SDPA backend order")
            result, failure = attempt(model, shape, args, extra, contextlib.nullcontext(), bar_step)
            if failure is None:
                result["note"] = f"cuDNN-first failed ({first}); default SDPA backend order"
    finally:
        if name == "sdpa":
            sparse.set_attn_implementation("m3_sparse")
    if failure is not None:
        cell.status, cell.note = failure
        return cell
    cell.note = result.pop("note", "")
    cell.status = "ok"
    cell.ttft_ms = result["ttft_ms"]
    cell.decode_ms_per_step = result["decode_ms_per_step"]
    cell.decode_tok_s = result["decode_tok_s"]
    cell.peak_gib = result["peak_gib"]
    cell.details = {k: v for k, v in result.items() if k not in asdict(cell)}
    return cell


def fill_speedups(cells: list[Cell]) -> None:
    base = {(c.batch, c.context): c for c in cells if c.config == "dense" and c.status == "ok"}
    for c in cells:
        ref = base.get((c.batch, c.context))
        if c.status != "ok" or ref is None:
            continue
        c.prefill_speedup = ref.ttft_ms / c.ttft_ms
        c.decode_speedup = c.decode_tok_s / ref.decode_tok_s


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------
def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(cells: list[Cell]) -> str:
    rows = []
    for c in cells:
        if c.status == "ok":
            ttft, tok = _f(c.ttft_ms, ".1f"), _f(c.decode_tok_s, ".1f")
        else:
            ttft, tok = c.status, "-"
        note = c.note if len(c.note) <= 90 else c.note[:87] + "..."
        sp_p = _f(c.prefill_speedup, ".2f") + ("x" if c.prefill_speedup is not None else "")
        sp_d = _f(c.decode_speedup, ".2f") + ("x" if c.decode_speedup is not None else "")
        rows.append([c.config, c.label, ttft, tok, sp_p, sp_d, _f(c.peak_gib, ".1f"), note])
    return common.md_table(["config", "context", "TTFT ms", "decode tok/s", "prefill speedup vs dense",
                            "decode speedup vs dense", "peak GiB", "note"], rows)


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
    kinds = "".join("s" if t == "minimax_m3_sparse" else "f" for t in cfg.layer_types)
    gpu = f"{env['device']} ({env['sms']} SMs, {env['gpu_memory_gib']} GiB)" if "gpu_memory_gib" in env else "cpu"
    return [
        f"- Date {env['date']}; device {gpu}; torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}.",
        f"- Model: random weights (seed {args.seed}), {len(kinds)} layers `{kinds}` (s = sparse MSA layer, "
        f"f = full attention); Hq {cfg.num_attention_heads}, Hkv {cfg.num_key_value_heads}, D {cfg.head_dim}, "
        f"index heads {cfg.index_n_heads} x {cfg.index_head_dim}, block {cfg.index_block_size}, "
        f"top-{cfg.index_topk_blocks}, local blocks {cfg.index_local_blocks}; hidden {cfg.hidden_size}, dense MLP "
        f"{cfg.dense_intermediate_size}, vocab {cfg.vocab_size}; {str(args.dtype).removeprefix('torch.')}.",
        f"- Greedy generate() of {args.new_tokens} new tokens (min_new_tokens = max_new_tokens, pad suppressed), "
        f"after one warm-up call of {args.warmup_tokens} tokens per cell; median of {args.reps} call(s). TTFT: "
        "generate() call to first token (streamer stamp after torch.cuda.synchronize), prefill and generate()'s "
        "setup included; decode: (last - first token stamp) / (new tokens - 1); decode tok/s counts every row. "
        "Peak: torch.cuda.max_memory_allocated during the measured call, weights of both models included.",
        f"- dense: {CONFIGS['dense']}; {cudnn}; decode with the static cache passes a padding mask, so transformers "
        "repeats K/V to Hq heads and SDPA takes a masked kernel; "
        + ("generate() may torch.compile decode (--compile)." if args.compile else "no torch.compile (any config)."),
        *(f"- {name}: {CONFIGS[name]}." for name in args.configs if name != "dense"),
        "- Speedups: dense TTFT / TTFT and decode tok/s / dense decode tok/s, same size.",
        *(["- On the CPU every m3_sparse op runs the torch reference: these figures only show that the script runs."]
          if args.device.type != "cuda" else []),
    ]


def write_outputs(args, cfg, env, cudnn, cells, final: bool) -> str:
    fill_speedups(cells)
    args.out.mkdir(parents=True, exist_ok=True)
    tab = table(cells)
    notes = [f"- {c.config} {c.label}: {c.status}: {c.note}" for c in cells if c.note]
    md = ["# generate() end to end: m3_sparse vs sdpa vs dense", "", *setup_lines(args, cfg, env, cudnn), "", tab]
    if notes:
        md += ["", "Notes (skips, failures, fallbacks):", "", *notes]
    (args.out / "bench_generate.md").write_text("\n".join(md) + "\n")
    result_rows(args, cfg, env, cudnn, cells).write()
    if final:
        log.write(args.out / "bench_generate.log")
    return tab


def result_rows(args, cfg, env, cudnn, cells) -> common.Results:
    """Two rows per cell, TTFT and the decode step, each against the dense model's."""
    results = common.Results("bench_generate", args.out)
    results.env = env
    base = {(c.batch, c.context): c for c in cells if c.config == "dense" and c.status == "ok"}
    layers = "".join("s" if t == "minimax_m3_sparse" else "f" for t in cfg.layer_types)
    for c in cells:
        ref = base.get((c.batch, c.context)) if c.config != "dense" else None
        sizes = {"batch": c.batch, "context": c.context, "new_tokens": args.new_tokens, "layers": layers,
                 "hidden": cfg.hidden_size, "vocab": cfg.vocab_size}
        common_metrics = dict(config=c.config, status=c.status, note=c.note, peak_gib=c.peak_gib, cudnn=cudnn,
                              details=c.details)
        baseline = "dense model (cuDNN-first SDPA, static cache)" if ref else None
        results.add(f"{c.config} {c.label}", c.ttft_ms, what=f"{c.config}: generate() time to first token",
                    sizes=sizes, baseline=baseline, baseline_ms=ref.ttft_ms if ref else None,
                    speedup=c.prefill_speedup, **common_metrics)
        results.add(f"{c.config} {c.label}", c.decode_ms_per_step, what=f"{c.config}: generate() decode step",
                    sizes=sizes, baseline=baseline, baseline_ms=ref.decode_ms_per_step if ref else None,
                    speedup=c.decode_speedup, decode_tok_s=c.decode_tok_s, **common_metrics)
    return results


def plot(args, cells: list[Cell]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"plot skipped: matplotlib is not importable ({exc})"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    markers = {"m3_sparse": "o", "sdpa": "^"}
    plotted = False
    for ax, key, title in ((axes[0], "prefill_speedup", "prefill (TTFT)"), (axes[1], "decode_speedup", "decode")):
        ax.axhline(1.0, color="gray", lw=1, ls="--", label="dense (cuDNN SDPA)")
        for name in args.configs:
            if name == "dense":
                continue
            for batch in sorted({c.batch for c in cells}):
                pts = sorted((c.context, getattr(c, key)) for c in cells
                             if c.config == name and c.batch == batch and getattr(c, key) is not None)
                if not pts:
                    continue
                plotted = True
                xs, ys = zip(*pts)
                label = name if batch == 1 else f"{name}, batch {batch}"
                ax.plot(xs, ys, marker=markers.get(name, "x"), ls="-" if batch == 1 else ":", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{title}: speedup over dense")
        ax.set_xlabel("context tokens per row")
        ax.grid(True, which="both", alpha=0.3)
        ticks = sorted({c.context for c in cells})
        ax.set_xticks(ticks)
        ax.set_xticklabels([fmt_tokens(t) for t in ticks])
    axes[0].set_ylabel("speedup (x)")
    axes[1].legend(fontsize=8, loc="best")
    fig.suptitle("generate(): m3_sparse vs dense, M3 attention shapes")
    fig.tight_layout()
    path = args.out / "generate_speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written: {path}" + ("" if plotted else " (no speedup to plot: no dense baseline measured)")


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
class _NoBar:
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


def main(argv=None) -> int:
    global _BAR
    args = parse_args(argv)
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    env = environment(args)
    sparse, dense = build_models(args, args.dtype)
    cfg = sparse.config
    cudnn = cudnn_probe(args.device)
    log(f"bench_generate: {env}")
    log(f"cuDNN: {cudnn}")
    log(f"configs {args.configs}, sizes {[s.label for s in args.sizes]}, layers {args.layers}, "
        f"new tokens {args.new_tokens}, output {args.out}")

    plan = [(name, shape) for name in args.configs for shape in args.sizes]
    cells: list[Cell] = []
    bar_cls = tqdm if tqdm is not None else _NoBar
    interactive = sys.stderr.isatty()
    _BAR = bar_cls(total=len(plan), desc="bench_generate", unit="cell", dynamic_ncols=True)
    try:
        for name, shape in plan:
            elapsed = time.perf_counter() - start
            if args.time_limit_s > 0 and elapsed > args.time_limit_s:
                cell = Cell(name, shape.batch, shape.context, shape.label, status="skipped",
                            note=f"time limit: {elapsed:.0f} s > --time-limit-s {args.time_limit_s:g}")
            else:
                def bar_step(what, _n=name, _s=shape):
                    # Off a terminal every refresh is a new line of the log: show the step on a terminal only.
                    _BAR.set_postfix_str(f"{_n} {_s.label}: {what}", refresh=interactive)

                bar_step("start")
                t = time.perf_counter()
                cell = run_cell(name, shape, (sparse, dense), args, bar_step)
                cell.details["cell_s"] = time.perf_counter() - t
            cells.append(cell)
            if cell.status == "ok":
                log(f"{name} {shape.label}: TTFT {cell.ttft_ms:.1f} ms, decode {cell.decode_ms_per_step:.2f} ms/step "
                    f"({cell.decode_tok_s:.1f} tok/s), peak {_f(cell.peak_gib, '.1f')} GiB, "
                    f"warm-up {cell.details.get('warmup_s', 0):.1f} s")
            else:
                log(f"{name} {shape.label}: {cell.status}: {cell.note}")
            _BAR.update(1)
            write_outputs(args, cfg, env, cudnn, cells, final=False)
    finally:
        _BAR.close()
        _BAR = None
    tab = write_outputs(args, cfg, env, cudnn, cells, final=False)
    log(plot(args, cells))
    log(f"total {time.perf_counter() - start:.0f} s; outputs in {args.out}")
    write_outputs(args, cfg, env, cudnn, cells, final=True)
    print()
    print(tab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
