"""m3_sparse against transformers' sdpa on the example's random model (examples/generate.py,
fp32, loaded once): a sweep of ``--compare-sdpa``'s exact check, or a diagnosis per prompt.

    python3 benchmarks/reliability/sdpa_agreement.py                # seeds 0-9 x 1K, 4K, 16K x batch 1, 3
    python3 benchmarks/reliability/sdpa_agreement.py --diagnose --seeds 0 --prompt-tokens 3000 --batch-sizes 1

Sweep: every (seed, prompt length, batch size) draws the prompt the example draws
(``--seed S --prompt-tokens N --batch-size B``), generates greedily on m3_sparse and runs the
example's exact check (``check_exact``: prefill logits per row against an unpadded sdpa run,
block-selection and MoE-routing near-ties told from wrong choices by
``m3_hf_attention.compare``, greedy tokens). Prints each run's row verdicts with the lines that explain a near-tie or a
disagreement, then the counts of agree / near-tie / disagree rows. Exit status 1 on any
disagreement.

``--diagnose``: for each prompt, sdpa row by row, m3_sparse as it runs (the Triton kernels on
CUDA), m3_sparse with sdpa's choices (block selections and MoE experts) handed to every
layer, and with ``--torch-impl`` m3_sparse under ``M3_SPARSE_IMPL=torch``. Every sparse
layer's selection, every MoE layer's experts and every layer's attention output are captured.
Per row it prints the first (layer, position, KV head) whose selection differs from sdpa's,
both selections, the float64 index scores of the blocks that differ (from m3_sparse's layer
input and from sdpa's), and "near-tie (gap X)" or "not a near-tie"; the first token whose
experts differ, with the float64 router scores of the experts that differ; then whether the
attention outputs agree given the same choices (a disagreement there is an attention-kernel
bug). A selection that differs by far more than rounding after an MoE layer whose experts
differed is a consequence of that routing: the token's input to the layer is another. Memory: the captured attention outputs are
fp32 on the host, batch x tokens x hidden per layer and run; scores are computed only for
the blocks that differ, never a [tokens, tokens] matrix.

Writes sdpa_agreement.json (the rows' verdicts) to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import torch  # noqa: E402
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3  # noqa: E402

EXAMPLE = common.ROOT / "examples" / "generate.py"


def load_example():
    spec = importlib.util.spec_from_file_location("m3_generate_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ex = load_example()
from m3_hf_attention import compare  # noqa: E402  (after the example: it puts the checkout on sys.path)


def seeds(text: str) -> list[int]:
    """'0-9' or '0,3,5' -> the seeds."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--seeds", type=seeds, default=seeds("0-9"), help="prompt seeds: '0-9' or '0,3,5'")
    p.add_argument("--prompt-tokens", type=common.int_list, default=common.int_list("1k,4k,16k"),
                   help="prompt lengths, comma separated, k = 1024")
    p.add_argument("--batch-sizes", type=common.int_list, default=[1, 3])
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--logit-tol", type=float, default=1e-4, help="the example's --logit-tol")
    p.add_argument("--diagnose", action="store_true", help="diagnose each prompt instead of counting verdicts")
    p.add_argument("--torch-impl", action="store_true", help="--diagnose: also run m3_sparse with M3_SPARSE_IMPL=torch")
    p.add_argument("--work-dir", type=Path, default=ex.DEFAULT_WORK_DIR, help="the example's --work-dir")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return p.parse_args(argv)


def example_inputs(model, seed: int, tokens: int, batch: int, new_tokens: int):
    args = ex.parse_args(["--seed", str(seed), "--prompt-tokens", str(tokens), "--batch-size", str(batch),
                          "--max-new-tokens", str(new_tokens)])
    return ex.prepare_inputs(model, None, args, True)[:2]


# ---------------------------------------------------------------------------------------
# sweep
# ---------------------------------------------------------------------------------------
def sweep_one(model, device, seed, tokens, bsz, args) -> tuple[list[str], list[str]]:
    """The row verdicts of one prompt and the lines that explain its near-ties or disagreements."""
    batch, gen_kwargs = example_inputs(model, seed, tokens, bsz, args.max_new_tokens)
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    with torch.no_grad():
        new = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)[:, ids.shape[1] :].cpu()
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        verdicts, _ = ex.check_exact(model, batch, new, gen_kwargs, device, args.logit_tol)
    notes = [line for line in log.getvalue().splitlines() if "near-tie" in line or "DISAGREE" in line]
    return verdicts, notes


def sweep(model, device, prompts, args) -> list[dict]:
    rows, counts = [], Counter()
    for seed, tokens, bsz in prompts:
        t0 = time.perf_counter()
        verdicts, notes = sweep_one(model, device, seed, tokens, bsz, args)
        counts.update(verdicts)
        rows.append(dict(seed=seed, tokens=tokens, batch=bsz, verdicts=verdicts, notes=notes))
        print(f"seed {seed} tokens {tokens} batch {bsz}: {verdicts} ({time.perf_counter() - t0:.1f} s)", flush=True)
        for line in notes:
            print(f"   {line.strip()}", flush=True)
    print(f"rows: {counts['agree']} agree, {counts['near-tie']} near-tie, {counts['disagree']} disagree")
    return rows


# ---------------------------------------------------------------------------------------
# diagnosis
# ---------------------------------------------------------------------------------------
def attention_layers(model) -> list:
    return [mod for mod in model.modules() if isinstance(mod, m3.MiniMaxM3VLAttention)]


def capture_attention(model, store: dict):
    """store[layer] = the attention block's output (before the residual), fp32 on the host."""

    def hook(module, args, kwargs, output):
        store[module.layer_idx] = output[0].float().cpu()

    return compare.forward_hooks(attention_layers(model), hook)


def capture_index_inputs(model, store: dict):
    """store[layer] = (hidden, cos, sin) of the indexer's input for a one-row batch, on the host."""

    def hook(module, args, kwargs, output):
        hidden, cos, sin = compare.indexer_inputs(args, kwargs)
        store[module.layer_idx] = (hidden[0].cpu(), cos[0].cpu(), sin[0].cpu())

    return compare.forward_hooks(compare.indexers(model), hook)


def sdpa_rows(model, rows):
    """Each row alone on sdpa: logits, selections, MoE routing, attention outputs and indexer inputs."""
    out = []
    with compare.attn_implementation(model, "sdpa"), torch.no_grad():
        for row in rows:
            sel, routing, attn, inputs = {}, {}, {}, {}
            with compare.capture_selections(model, sel), compare.capture_routing(model, routing), \
                    capture_attention(model, attn), capture_index_inputs(model, inputs):
                logits = model(input_ids=torch.as_tensor(row, device=model.device)[None]).logits[0].float().cpu()
            out.append(dict(logits=logits, sel=sel, routing=routing, attn={k: v[0] for k, v in attn.items()},
                            inputs=inputs))
    return out


def m3_run(model, batch, device, refs, offsets, *, replay: bool, impl: str | None = None):
    """m3_sparse on the batch with its selections and MoE routing recorded against sdpa's
    (``replay``: replaced by sdpa's); as it runs, only the first differences are scored."""
    limit = compare.DEFAULT_SCORE_LIMIT if replay else 8
    selections = compare.SelectionRecorder([r["sel"] for r in refs], offsets, replay=replay,
                                           first_layer_only=not replay)
    routing = compare.RoutingRecorder([r["routing"] for r in refs], offsets, batch.input_ids.shape[1],
                                      replay=replay, score_limit=limit)
    attn = {}
    env = common.env_var("M3_SPARSE_IMPL", impl) if impl else contextlib.nullcontext()
    with env, selections.attach(model), routing.attach(model), capture_attention(model, attn):
        logits = ex.m3_batch_logits(model, batch, device)
    return dict(logits=logits, recorder=selections, routing=routing, attn=attn)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(max |a - b|, the position where it is) of [len, ...] tensors."""
    d = (a - b).abs().flatten(1).amax(1)
    pos = int(d.argmax())
    return float(d[pos]), pos


def print_attention(run_a, replay, ref, b, offsets, length, tol) -> dict[int, tuple[float, float]]:
    """Per layer: max |m3_sparse - sdpa| of the attention output, as it ran and with sdpa's choices."""
    cols = slice(offsets[b], offsets[b] + length)
    print(f"  attention output per layer, max |m3_sparse - sdpa| (bound {tol:g} x max(1, |sdpa|)): "
          "as it ran | with sdpa's choices and experts")
    found = {}
    for layer in sorted(ref["attn"]):
        want = ref["attn"][layer]
        bound = tol * max(1.0, want.abs().max().item())
        a, pa = max_diff(run_a["attn"][layer][b, cols], want)
        r, pr = max_diff(replay["attn"][layer][b, cols], want)
        kind = "sparse" if layer in ref["sel"] else "full"
        flag = "" if r <= bound else "   <- DIFFERS with the same choices"
        print(f"    layer {layer} ({kind}): {a:.3g} at position {pa} | {r:.3g} at position {pr} "
              f"(bound {bound:.3g}){flag}")
        found[layer] = (r, bound)
    return found


def describe_first(first: compare.SelectionDiff, ref, indexer) -> None:
    hidden, cos, sin = ref["inputs"][first.layer]
    print(f"  first differing selection: {first.describe()}")
    if first.reason:
        print("  -> not a near-tie (" + first.reason + ")")
        return
    again = compare.score_diff(indexer, hidden, cos, sin, layer=first.layer, row=first.row, position=first.position,
                               head=first.head, m3_blocks=first.m3, sdpa_blocks=first.sdpa)
    print(f"    (scores above from m3_sparse's layer input; from sdpa's: "
          + ", ".join(f"block {k} {v:.9g}" for k, v in sorted(again.scores.items()))
          + f", gap {again.gap:.3g})")
    if first.near_tie:
        print(f"  -> near-tie (gap {first.gap:.3g} <= bound {first.bound:.3g})")
    else:
        print(f"  -> not a near-tie (gap {first.gap:.3g} > bound {first.bound:.3g})")


def diagnose_row(model, b, length, ref, runs, offsets, tol):
    run_a, replay, torch_run = runs
    print(f"row {b}: {length} tokens")
    bound = tol * max(1.0, ref["logits"].abs().max().item())
    errs = {name: compare.row_errors(run["logits"][b : b + 1], [ref["logits"]], [offsets[b]])[0][0]
            for name, run in (("as it ran", run_a), ("with sdpa's choices", replay), ("torch impl", torch_run))
            if run is not None}
    print("  prefill logits, max |m3_sparse - sdpa| (bound %.3g): " % bound
          + ", ".join(f"{k} {v:.3g}" for k, v in errs.items()))
    diffs = [d for d in run_a["recorder"].diffs if d.row == b]
    per_layer = Counter(d.layer for d in diffs)
    print(f"  selections differing from sdpa's, per sparse layer (as it ran): "
          + ", ".join(f"layer {layer}: {per_layer.get(layer, 0)}" for layer in sorted(ref["sel"])))
    found = print_attention(run_a, replay, ref, b, offsets, length, tol)
    indexer = {mod.layer_idx: mod for mod in compare.indexers(model)}
    if diffs:
        first = diffs[0]
        describe_first(first, ref, indexer[first.layer])
        for d in [d for d in diffs[1:] if d.layer == first.layer][:4]:
            print(f"    also {d.describe()}")
        r, rb = found[first.layer]
        same = "agrees" if r <= rb else "DIFFERS: an attention-kernel bug"
        print(f"  attention output at layer {first.layer} with the same selection: max |diff| {r:.3g} "
              f"(bound {rb:.3g}): {same}")
    else:
        bad = [layer for layer, (r, rb) in found.items() if r > rb]
        print("  no selection differs from sdpa's" + (f"; the attention differs from layer {bad[0]} on: an "
                                                     "attention-kernel bug" if bad else ""))
    if torch_run is not None:
        tdiffs = [d for d in torch_run["recorder"].diffs if d.row == b]
        print(f"  M3_SPARSE_IMPL=torch: {len(tdiffs)} selections differ from sdpa's"
              + (f", the first at {tdiffs[0].describe()}" if tdiffs else ""))
    routes = [d for d in run_a["routing"].diffs if d.row == b]
    if routes:
        print(f"  MoE routings differing from sdpa's (as it ran): {len(routes)}, the first at {routes[0].describe()}")
    else:
        print("  no MoE routing differs from sdpa's (as it ran)")
    replay_diffs = [d for d in replay["recorder"].diffs + replay["routing"].diffs if d.row == b]
    verdict, message = compare.classify(errs["as it ran"], bound, errs["with sdpa's choices"], replay_diffs)
    print(f"  --compare-sdpa's verdict: {verdict}: {message}")
    return dict(row=b, tokens=length, verdict=verdict, message=message, logit_errors=errs,
                first=diffs[0].describe() if diffs else None, differing=dict(per_layer))


def diagnose(model, device, seed, tokens, bsz, args) -> list[dict]:
    batch, _ = example_inputs(model, seed, tokens, bsz, args.max_new_tokens)
    print(f"== seed {seed}, {tokens} tokens, batch {bsz} (lengths {[len(r) for r in batch.rows]})", flush=True)
    refs = sdpa_rows(model, batch.rows)
    offsets = [batch.input_ids.shape[1] - len(r) for r in batch.rows]
    run_a = m3_run(model, batch, device, refs, offsets, replay=False)
    replay = m3_run(model, batch, device, refs, offsets, replay=True)
    torch_run = m3_run(model, batch, device, refs, offsets, replay=False, impl="torch") if args.torch_impl else None
    return [dict(seed=seed, **diagnose_row(model, b, len(row), refs[b], (run_a, replay, torch_run), offsets,
                                           args.logit_tol))
            for b, row in enumerate(batch.rows)]


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = ex.load_model(ex.ensure_tiny_model(args.work_dir.expanduser()), device, torch.float32)
    print(f"{common.device_name()[0]}, fp32, M3_SPARSE_IMPL={os.environ.get('M3_SPARSE_IMPL', 'auto')}", flush=True)
    t0 = time.perf_counter()
    prompts = [(s, n, b) for s in args.seeds for n in args.prompt_tokens for b in args.batch_sizes]
    if args.diagnose:
        rows = [r for prompt in prompts for r in diagnose(model, device, *prompt, args)]
        verdicts = [r["verdict"] for r in rows]
    else:
        rows = sweep(model, device, prompts, args)
        verdicts = [v for r in rows for v in r["verdicts"]]
    print(f"done in {time.perf_counter() - t0:.1f} s")
    common.write_json(common.result_path(args.out, "sdpa_agreement"), dict(env=common.environment(), rows=rows))
    return 1 if "disagree" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
