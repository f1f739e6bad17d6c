#!/usr/bin/env python3
"""Greedy generation with a MiniMax M3 model on ``attn_implementation="m3_sparse"``.

With ``--model PATH`` a local M3 checkpoint is loaded (a text checkpoint,
``MiniMaxM3VLForCausalLM``, or a full multimodal one, which is run on text only).
Without it a small random-weight M3 text model is built once and saved under
``--work-dir`` (default ``~/.cache/m3_hf_attention``), with a byte-level BPE tokenizer and
a chat template (``m3_hf_attention.toy_tokenizer``): nothing is downloaded. Such a
checkpoint also serves ``m3-serve`` (docs/USAGE.md, "Serving").

``--prompt`` text is encoded with the checkpoint's tokenizer when it has one, otherwise
byte by byte (UTF-8); ``--prompt-tokens N`` draws N random ids, the random model's default
(a real checkpoint's default is a text prompt). ``--compare-sdpa`` reruns the same weights with
``attn_implementation="sdpa"`` (transformers' own dense-mask implementation of the
same sparse attention) and exits with status 1 unless both agree, up to near-ties: two
key blocks whose index scores, or two MoE experts whose router scores, lie within rounding
of each other, which the two paths may rank differently (``m3_hf_attention.compare`` tells
these from a bug).

Examples::

    python examples/generate.py
    python examples/generate.py --compare-sdpa --batch-size 3
    python examples/generate.py --model /path/to/m3 --prompt "Hello" --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import m3_hf_attention
except ImportError:  # a checkout that was not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import m3_hf_attention

from m3_hf_attention import CACHE_KEYWORD, M3PagedCache
from m3_hf_attention import compare as compare_sdpa
from m3_hf_attention.toy_tokenizer import save_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from transformers.generation.streamers import BaseStreamer
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

DEFAULT_WORK_DIR = Path("~/.cache/m3_hf_attention")
TINY_DIR_NAME = "tiny-m3"
# Bumped whenever tiny_config() or the weight recipe changes, so that a cached
# model built by an older version of this script is rebuilt instead of reused.
TINY_RECIPE = 2  # 2: a tokenizer beside the weights
TINY_SEED = 0
DEFAULT_RANDOM_PROMPT_TOKENS = 320
DEFAULT_TEXT_PROMPT = "The MiniMax M3 model attends to a few selected blocks of its context."

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


# ---------------------------------------------------------------------------------------
# the random model
# ---------------------------------------------------------------------------------------
def tiny_config() -> MiniMaxM3VLTextConfig:
    """A small M3 text config that still has every feature of the real one.

    Index blocks of 16 tokens with top-4 selection mean a query sees at most 64
    keys in a sparse layer, so a prompt of a few hundred tokens is really sparse;
    layers mix sparse and full attention, and dense and MoE MLPs.
    """
    return MiniMaxM3VLTextConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=64,
        dense_intermediate_size=256,
        shared_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        rotary_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        index_n_heads=2,
        index_head_dim=32,
        index_block_size=16,
        index_topk_blocks=4,
        index_local_blocks=1,
        layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        max_position_embeddings=4096,
        initializer_range=0.05,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def ensure_tiny_model(work_dir: Path) -> Path:
    """Build the random model into ``work_dir/tiny-m3`` unless an up-to-date one is there."""
    target = work_dir / TINY_DIR_NAME
    marker = target / "m3_example.json"
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("recipe") == TINY_RECIPE:
                return target
        except (OSError, ValueError):
            pass
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(TINY_SEED)
    model = MiniMaxM3VLForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        # RMSNorm weights start at zero (a unit gain); random gains make the
        # per-head norms, and so the index scores, differ between heads.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    # Build beside the target and rename, so that two runs sharing a work dir
    # never load a half-written checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_DIR_NAME}-", dir=work_dir))
    model.save_pretrained(staging)
    save_tokenizer(staging, model.config.vocab_size)
    (staging / "m3_example.json").write_text(json.dumps({"recipe": TINY_RECIPE, "seed": TINY_SEED}) + "\n")
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{TINY_DIR_NAME}-old-", dir=work_dir))
        os.replace(target, old / TINY_DIR_NAME)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(staging, target)
    except OSError:
        if not (target / "m3_example.json").is_file():  # not a concurrent build that won the race
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------
def load_model(path: Path, device: torch.device, dtype: torch.dtype):
    config = AutoConfig.from_pretrained(path)
    # A multimodal checkpoint has no causal-LM auto class; its generate() runs text-only prompts.
    auto_cls = AutoModelForImageTextToText if config.model_type == "minimax_m3_vl" else AutoModelForCausalLM
    model = auto_cls.from_pretrained(path, attn_implementation="m3_sparse", dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(path: Path):
    has_files = any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if not has_files:
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure means "encode bytes instead"
        print(f"note: could not load the tokenizer in {path} ({exc}); encoding prompts byte by byte")
        return None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


# ---------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------
@dataclass
class Batch:
    rows: list[list[int]]  # the real tokens of each row, unpadded
    input_ids: torch.Tensor  # [B, S], left padded
    attention_mask: torch.Tensor  # [B, S]


def make_prompts(args, tokenizer, vocab_size: int, special: set[int], text_default: bool) -> list[list[int]]:
    if args.prompt is not None or (text_default and tokenizer is not None and args.prompt_tokens is None):
        text = args.prompt if args.prompt is not None else DEFAULT_TEXT_PROMPT
        if tokenizer is not None:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            ordinary = [i for i in range(vocab_size) if i not in special]
            ids = [ordinary[b % len(ordinary)] for b in text.encode("utf-8")]
        if not ids:
            raise SystemExit("error: the prompt encodes to no tokens")
        return [list(ids) for _ in range(args.batch_size)]

    n = args.prompt_tokens if args.prompt_tokens is not None else DEFAULT_RANDOM_PROMPT_TOKENS
    if n <= 0:
        raise SystemExit("error: --prompt-tokens must be positive")
    ordinary = torch.tensor([i for i in range(vocab_size) if i not in special])
    gen = torch.Generator().manual_seed(args.seed)
    # Rows of different lengths exercise the left padding of a batch.
    step = max(1, n // (4 * args.batch_size))
    rows = []
    for b in range(args.batch_size):
        length = max(1, n - b * step)
        rows.append(ordinary[torch.randint(len(ordinary), (length,), generator=gen)].tolist())
    return rows


def pad_left(rows: list[list[int]], pad_id: int) -> Batch:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return Batch(rows, ids, mask)


def prepare_inputs(model, tokenizer, args, random_model: bool) -> tuple[Batch, dict, list[int]]:
    """The prompt batch of ``args``, generate()'s keyword arguments and the EOS ids."""
    text_cfg = model.config.get_text_config(decoder=True)
    eos_ids = _ids(model.generation_config.eos_token_id) or _ids(text_cfg.eos_token_id)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = text_cfg.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else None
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    special = {pad_id, *eos_ids, *_ids(text_cfg.bos_token_id)}

    batch = pad_left(make_prompts(args, tokenizer, text_cfg.vocab_size, special, text_default=not random_model), pad_id)
    gen_kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=pad_id)
    if pad_id not in eos_ids:
        # A generated pad id would read as padding to generate(); keep it out of greedy picks.
        gen_kwargs["suppress_tokens"] = [pad_id]
    if random_model:
        gen_kwargs["min_new_tokens"] = args.max_new_tokens  # a random model's EOS would only shorten the timing
    return batch, gen_kwargs, eos_ids


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------
class StepClock(BaseStreamer):
    """generate() hands a streamer the prompt before the prefill and then each step's
    tokens (already copied to the host), so the stamps bracket prefill and decode."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []

    def put(self, value):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def generated_counts(new_tokens: torch.Tensor, eos_ids: list[int]) -> list[int]:
    """Tokens each row really generated: up to and including its first EOS."""
    counts = []
    for row in new_tokens.tolist():
        n = len(row)
        for i, tok in enumerate(row):
            if tok in eos_ids:
                n = i + 1
                break
        counts.append(n)
    return counts


# ---------------------------------------------------------------------------------------
# comparison with sdpa
# ---------------------------------------------------------------------------------------
# Each row is checked against an sdpa run of that row alone, unpadded: transformers'
# dense-mask indexer anchors blocks to key slots, so a left-padded row is not a
# faithful sdpa reference, while m3_sparse must give the unpadded row's result.


def m3_batch_logits(model, batch: Batch, device: torch.device) -> torch.Tensor:
    """Prefill logits [B, S, vocab] of the left-padded batch, through an explicit
    M3PagedCache and with the positions generate() gives a left-padded row."""
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    cache = M3PagedCache(model.config, ids.shape[0], ids.shape[1], device=device, dtype=model.dtype)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{CACHE_KEYWORD: cache})
    return out.logits


def m3_prefill_logits(model, batch: Batch, device: torch.device) -> list[torch.Tensor]:
    """Prefill logits of each row's real tokens [len, vocab] (fp32, CPU)."""
    logits = m3_batch_logits(model, batch, device)
    width = logits.shape[1]
    return [logits[b, width - len(row) :].float().cpu() for b, row in enumerate(batch.rows)]


VERDICTS = ("agree", "near-tie", "disagree")  # a row's verdict is the worst of its checks


def check_exact(model, batch: Batch, m3_tokens: torch.Tensor, gen_kwargs: dict, device, tol: float):
    """Prefill logits within ``tol`` x max(1, |logit|) and identical greedy tokens.

    A row whose logits differ more is accepted only where the difference comes from
    near-ties (m3_hf_attention.compare): key blocks whose index scores, or MoE experts
    whose router scores, lie within rounding of each other, ranked differently by the two
    paths. A first differing
    token is accepted only where sdpa's own logits for the two candidates are within that
    same bound (a tie at the precision of the check).
    Returns (verdict per row: "agree", "near-tie" or "disagree"; sdpa prefill logits per row).
    """
    run_m3 = functools.partial(m3_batch_logits, model, batch, device)
    checks = compare_sdpa.check_prefill(model, run_m3, model, batch.rows, tol=tol)
    verdicts = []
    with compare_sdpa.attn_implementation(model, "sdpa"):
        for b, (row, check) in enumerate(zip(batch.rows, checks)):
            tag = {"agree": "", "near-tie": "near-tie: ", "disagree": "DISAGREE: "}[check.verdict]
            print(f"  row {b}: {tag}{check.message}")
            tokens = check_tokens(model, b, row, m3_tokens[b], gen_kwargs, device, tol, check)
            verdicts.append(max(check.verdict, tokens, key=VERDICTS.index))
    return verdicts, [c.sdpa_logits for c in checks]


def check_tokens(model, b: int, row: list[int], mine_all: torch.Tensor, gen_kwargs: dict, device, tol: float,
                 prefill: compare_sdpa.RowCheck) -> str:
    """Row ``b``'s greedy tokens against sdpa's (``model`` runs sdpa); returns the verdict."""
    ids = torch.tensor([row], device=device)
    ref = model.generate(
        ids, attention_mask=torch.ones_like(ids), output_scores=True, return_dict_in_generate=True, **gen_kwargs
    )
    ref_new = ref.sequences[0, len(row) :].tolist()
    mine = mine_all[: len(ref_new)].tolist()
    # A row that stopped before the rest of its batch is padded to the batch's length.
    tail_is_pad = bool((mine_all[len(ref_new) :] == gen_kwargs["pad_token_id"]).all())
    if mine == ref_new and tail_is_pad:
        print(f"  row {b}: generated tokens identical ({len(ref_new)} tokens)")
        return "agree"
    step = next((i for i, (x, y) in enumerate(zip(mine, ref_new)) if x != y), len(ref_new))
    if prefill.verdict == "near-tie" and prefill.last_err > prefill.bound:
        print(
            f"  row {b}: near-tie: generated tokens differ from step {step}, after the near-tie above changed the "
            f"last prompt position's logits by {prefill.last_err:.3g}: the two continuations are not compared"
        )
        return "near-tie"
    if step < len(ref_new):
        scores = ref.scores[step][0].float()
        margin = (scores[ref_new[step]] - scores[mine[step]]).item()
        bound = tol * max(1.0, scores[torch.isfinite(scores)].abs().max().item())
        if abs(margin) <= bound:
            print(
                f"  row {b}: near-tie: tokens agree up to step {step}, where sdpa's logits for the two candidates "
                f"({ref_new[step]} vs m3_sparse's {mine[step]}) differ by only {margin:.3g} <= {bound:.3g}: "
                "a tie at this precision, not a disagreement"
            )
            return "near-tie"
        detail = f"sdpa chose {ref_new[step]}, m3_sparse {mine[step]}, sdpa logit margin {margin:.3g}"
    else:
        detail = f"sdpa stopped after {len(ref_new)} tokens, m3_sparse went on"
    print(f"  row {b}: DISAGREE: generated tokens differ from step {step} ({detail})")
    print(f"    m3_sparse: {mine}")
    print(f"    sdpa:      {ref_new}")
    return "disagree"


def check_half_noise(name: str, half_m3, half_sdpa, ref_fp32) -> bool:
    """In half precision both implementations round activations at different points,
    and a discrete block selection or greedy pick can turn that into a large change
    of single logits; so the half-precision run is held to sdpa's own error against
    fp32 (mean |error| at most 1.5x sdpa's, plus 1e-3 x the logit scale)."""
    ok = True
    for b, (a, s, r) in enumerate(zip(half_m3, half_sdpa, ref_fp32)):
        scale = max(1.0, r.abs().max().item())
        err_m3 = (a - r).abs().mean().item()
        err_sdpa = (s - r).abs().mean().item()
        bound = 1.5 * err_sdpa + 1e-3 * scale
        verdict = "close" if err_m3 <= bound else "DISAGREE"
        ok &= err_m3 <= bound
        print(
            f"  row {b}: {name} prefill logits vs fp32 sdpa: mean |error| m3_sparse {err_m3:.3g}, "
            f"sdpa {err_sdpa:.3g} (bound {bound:.3g}): {verdict}"
        )
    return ok


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Greedy generation with a MiniMax M3 model on attn_implementation='m3_sparse'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local M3 checkpoint directory; by default a small random-weight M3 text model is built in --work-dir",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help=f"where the random model is built and kept (as {TINY_DIR_NAME}/)",
    )
    p.add_argument(
        "--prompt",
        default=None,
        help="prompt text (without a tokenizer: one token per UTF-8 byte, skipping special ids)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help=f"use a random prompt of N tokens instead (default for the random model or a checkpoint without a "
        f"tokenizer: {DEFAULT_RANDOM_PROMPT_TOKENS}); "
        "with --batch-size > 1 row b is shorter by b*N/(4*batch) tokens, so the batch is left padded",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument(
        "--compare-sdpa",
        action="store_true",
        help="rerun with attn_implementation='sdpa' on the same weights; exit 1 unless the generated tokens "
        "are identical and the prefill logits close, or differ only through near-ties (key blocks whose index scores, "
        "or MoE experts whose router scores, lie within rounding of each other, ranked differently). The exact check runs in fp32 (a "
        "bf16/fp16 run also loads an fp32 copy of the weights); a bf16/fp16 run is held to sdpa's own rounding error",
    )
    p.add_argument(
        "--logit-tol",
        type=float,
        default=1e-4,
        help="--compare-sdpa: bound of the fp32 check on |logit difference|, relative to max(1, largest |logit|)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--no-warmup", action="store_true", help="time the first generate() call (import and first-call costs included)")
    args = p.parse_args(argv)
    if args.max_new_tokens <= 0:
        p.error("--max-new-tokens must be positive")
    if args.batch_size <= 0:
        p.error("--batch-size must be positive")
    if args.prompt is not None and args.prompt_tokens is not None:
        p.error("--prompt and --prompt-tokens are mutually exclusive")
    return args


def compare(model, batch: Batch, new_tokens, gen_kwargs, device, dtype, tol: float, half_logits) -> list[str]:
    """``model`` is the fp32 model; for a bf16/fp16 run, ``half_logits`` holds that
    run's (m3_sparse, sdpa) prefill logits, and ``new_tokens`` its tokens.
    Returns the verdict of each row ("agree", "near-tie" or "disagree")."""
    if half_logits is None:
        print(f"comparing with attn_implementation='sdpa' (logit bound {tol:g} x max(1, |logit|)):")
        return check_exact(model, batch, new_tokens, gen_kwargs, device, tol)[0]
    name = str(dtype).removeprefix("torch.")
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    fp32_tokens = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)[:, ids.shape[1] :].cpu()
    print(f"comparing with attn_implementation='sdpa' in fp32, exactly (logit bound {tol:g} x max(1, |logit|)):")
    verdicts, ref = check_exact(model, batch, fp32_tokens, gen_kwargs, device, tol)
    print(f"comparing the {name} run with sdpa in {name}, against sdpa's own rounding error:")
    if not check_half_noise(name, *half_logits, ref):
        verdicts = ["disagree"] * len(verdicts)
    same = [
        next((i for i, (x, y) in enumerate(zip(h, f)) if x != y), len(f))
        for h, f in zip(new_tokens.tolist(), fp32_tokens.tolist())
    ]
    print(f"  (for information: the timed {name} run's tokens equal the fp32 run's for the first {same} tokens of each row)")
    return verdicts


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)

    random_model = args.model is None
    path = ensure_tiny_model(args.work_dir.expanduser()) if random_model else args.model.expanduser()
    if not path.is_dir():
        print(f"error: --model {path}: not a directory", file=sys.stderr)
        return 2
    model = load_model(path, device, dtype)
    tokenizer = load_tokenizer(path)
    text_cfg = model.config.get_text_config(decoder=True)
    batch, gen_kwargs, eos_ids = prepare_inputs(model, tokenizer, args, random_model)
    rows = batch.rows

    layer_types = list(getattr(text_cfg, "layer_types", None) or [])
    n_sparse = sum(t == "minimax_m3_sparse" for t in layer_types)
    block, topk = text_cfg.index_block_size, text_cfg.index_topk_blocks
    width = batch.input_ids.shape[1]
    print(f"model: {path}{' (random weights)' if random_model else ''}, {type(model).__name__}")
    print(
        f"  {len(layer_types)} layers, {n_sparse} sparse (index block {block}, top-{topk}: at most {block * topk} keys "
        f"per query), attn_implementation={text_cfg._attn_implementation}"
    )
    print(f"device: {device}, dtype: {str(dtype).removeprefix('torch.')}, tokenizer: {'yes' if tokenizer else 'no'}")
    padded = f" (left padded to {width})" if any(len(r) != width for r in rows) else ""
    print(f"prompt: batch {len(rows)}, lengths {[len(r) for r in rows]}{padded}")

    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    if not args.no_warmup:
        warm = dict(gen_kwargs, max_new_tokens=min(2, args.max_new_tokens))
        warm.pop("min_new_tokens", None)
        model.generate(input_ids=ids, attention_mask=mask, **warm)

    clock = StepClock(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, streamer=clock, **gen_kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total_s = time.perf_counter() - t0
    new_tokens = out[:, width:].cpu()

    print("generated token ids:")
    for b, row in enumerate(new_tokens.tolist()):
        print(f"  row {b}: {row}")
        if tokenizer is not None:
            print(f"  row {b} text: {tokenizer.decode(row, skip_special_tokens=True)!r}")

    counts = generated_counts(new_tokens, eos_ids)
    prompt_tokens = sum(len(r) for r in rows)
    generated = sum(counts)
    prefill_s = clock.stamps[1] - clock.stamps[0] if len(clock.stamps) > 1 else total_s
    decode_steps = max(0, len(clock.stamps) - 2)
    decode_s = clock.stamps[-1] - clock.stamps[1] if decode_steps else 0.0
    decode_tokens = max(0, generated - len(rows)) if decode_steps else 0
    print(f"prefill: {prefill_s * 1e3:.1f} ms for {prompt_tokens} prompt tokens ({prompt_tokens / prefill_s:.1f} tok/s)")
    if decode_s > 0:
        print(
            f"decode: {decode_tokens} tokens in {decode_steps} steps, {decode_s * 1e3:.1f} ms: "
            f"{decode_tokens / decode_s:.1f} tokens/s"
        )
    else:
        print("decode: no decode step (one new token)")
    print(
        f"total: {generated} generated tokens in {total_s:.3f} s (prefill included): {generated / total_s:.1f} tokens/s; "
        f"prompt + generated: {(prompt_tokens + generated) / total_s:.1f} tokens/s"
    )

    if args.compare_sdpa:
        half_logits = None
        if dtype != torch.float32:
            # The exact check needs fp32: keep this run's logits, then swap in an fp32 copy of the weights.
            half_logits = (m3_prefill_logits(model, batch, device), compare_sdpa.sdpa_reference(model, batch.rows).logits)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = load_model(path, device, torch.float32)
        verdicts = compare(model, batch, new_tokens, gen_kwargs, device, dtype, args.logit_tol, half_logits)
        if "disagree" in verdicts:
            print("FAIL: m3_sparse and sdpa disagree (see the rows marked DISAGREE above)", file=sys.stderr)
            print("compare-sdpa: DISAGREE")
            return 1
        ties = [b for b, v in enumerate(verdicts) if v == "near-tie"]
        note = f"; rows {ties} only up to the near-ties shown" if ties else ""
        print(f"compare-sdpa: AGREE (generated tokens and prefill logits match sdpa{note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
