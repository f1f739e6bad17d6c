"""A long generate() on the paged cache: a 128K-token prompt, then 2,000 greedy decode
steps, memory sampled along the way, and the whole run repeated on a fresh cache; eager
decode steps, or (``--decode compiled``) the steps generate() compiles by default.

Model: an M3-shaped random text model small enough to be quick: Hq 64, Hkv 4, D 128,
4 index heads of 128, index blocks of 128 with top-16 (one local), 2 layers (one
sparse, one full attention), dense MLPs of 1024, hidden size 1024, vocabulary 512;
bf16 on CUDA. generate() builds its own M3PagedCache (the default for m3_sparse).

What it checks:
* memory: ``torch.cuda.memory_allocated()``, the peak since the previous sample
  (``max_memory_allocated()`` after a reset) and ``memory_reserved()`` every
  ``--sample-every`` decode steps. Stable means that, from the first decode sample at or
  after ``--settle-steps`` (compilation and graph recording happen in the first steps) to
  the last, neither allocated memory nor the window peak grows by more than what
  generate() itself appends (its input_ids and attention mask gain one int64 column per
  step) plus 1 MiB of the allocator's rounding, and the reserved memory by at most 40 MiB
  (two of the caching allocator's 20 MiB segments, the size class of generate()'s
  growing input_ids); on the CPU the resident set size stands for all three, with 64 MiB
  more;
* output: a second generate() on a fresh cache gives the same token ids and bitwise
  the same logits at every step (recorded into a preallocated buffer by the hook);
* ``--decode compiled``: generate() runs without ``disable_compile``, so it compiles the
  decode step (torch.compile, CUDA graphs) when the cache says it is compileable; the run
  fails if generate() did not use its compiled forward for every decode step
  (``common.CompiledCalls``). ``--compare-eager`` adds a third, eager run and reports
  whether its tokens match (information only: a compiled graph may round differently);
  where they first differ, each run's logit margin for its token against the other's and
  the runs' largest logit difference over the steps before: a flip whose margins lie
  within that difference is a near-tie of the two roundings.

    python3 benchmarks/reliability/long_run.py                          # 128K + 2,000 steps on CUDA
    python3 benchmarks/reliability/long_run.py --decode compiled --compare-eager
    python3 benchmarks/reliability/long_run.py --prompt-len 32768 --steps 500
    python3 benchmarks/reliability/long_run.py --quick                  # CPU smoke run, small shapes

``--impl`` sets M3_SPARSE_IMPL for the run. The default, ``auto``, is what a user gets:
on CUDA every op runs a Triton kernel (the index top-k; the sparse layer's
``sparse_attention``: KV-outer for a prompt of more than 256 tokens, the decode kernel
for shorter ones and for the decode steps; the full-attention layer's dense kernel), on
the CPU the torch code. ``triton`` pins the Triton kernels (on the CPU under
``TRITON_INTERPRET=1``, slow), ``torch`` the torch code.

A warm-up generate() first (unless ``--no-warmup``): the same prompt and cache size,
stopped after 8 decode steps, so that kernels compile, and the compiled decode step is
built and recorded, for the shapes of the measured runs.

Prints timings per phase and a short table; writes long_run.json to $OUT (or --out).
Exit status 1 if memory grew, the two runs differ, or a compiled run was not compiled.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import torch  # noqa: E402

ROOT = common.ROOT

MiB = 2**20
# Growth of reserved memory allowed after the settle steps: two 20 MiB segments, which the
# caching allocator takes for blocks of 1-10 MiB, the size of generate()'s input_ids here.
RESERVED_ALLOWANCE = 40 * MiB
WARM_STEPS = 8

FULL = dict(hidden=1024, hq=64, hkv=4, d=128, index_heads=4, index_dim=128, block=128, topk=16, mlp=1024,
            vocab=512, page=64)
# --quick: the same two layers at toy sizes, so that the torch path runs a few hundred
# tokens on a CPU in seconds (index blocks of 16 with top-4 keep the selection sparse).
QUICK = dict(hidden=128, hq=8, hkv=2, d=32, index_heads=2, index_dim=32, block=16, topk=4, mlp=128,
             vocab=256, page=16)


def build_model(shape: dict, max_positions: int, device, dtype, seed: int):
    from transformers import AutoModelForCausalLM
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    import m3_hf_attention  # noqa: F401  (registers m3_sparse)

    config = MiniMaxM3VLTextConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["mlp"],
        dense_intermediate_size=shape["mlp"],
        shared_intermediate_size=shape["mlp"],
        num_hidden_layers=2,
        num_attention_heads=shape["hq"],
        num_key_value_heads=shape["hkv"],
        head_dim=shape["d"],
        rotary_dim=shape["d"] // 2,
        num_local_experts=2,
        num_experts_per_tok=1,
        index_n_heads=shape["index_heads"],
        index_head_dim=shape["index_dim"],
        index_block_size=shape["block"],
        index_topk_blocks=shape["topk"],
        index_local_blocks=1,
        layer_types=["minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "dense"],
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,  # no early stop: every run makes exactly --steps tokens
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="m3_sparse", dtype=dtype)
    common.randomize_norms(model, torch.Generator().manual_seed(seed))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


class Memory:
    """Allocator figures on CUDA; resident set size on the CPU (no peak per window there)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def now(self) -> tuple[int, int, int]:
        """(allocated, peak since the last reset, reserved) in bytes."""
        if self.cuda:
            return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss, rss, rss


class Probe:
    """LogitsProcessor hook: runs once per generated token, after the forward that
    produced its logits. Records every step's logits into a preallocated buffer (a
    device copy, no sync) and, every ``every`` steps, syncs and samples memory."""

    def __init__(self, prompt_len: int, steps: int, vocab: int, every: int, mem: Memory, device):
        self.prompt_len, self.steps, self.every, self.mem = prompt_len, steps, every, mem
        self.logits = torch.empty(steps, vocab, dtype=torch.float32, device=device)
        self.samples = []  # (step, seconds since start, allocated, peak in the window, reserved)
        self.t_prefill = None

    def start(self):
        self.mem.sync()
        self.mem.reset_peak()
        self.t0 = time.perf_counter()

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        self.logits[step].copy_(scores[0])
        if step == 0 or step % self.every == 0 or step == self.steps - 1:
            self.mem.sync()
            t = time.perf_counter() - self.t0
            alloc, peak, reserved = self.mem.now()
            if step == 0:
                self.t_prefill = t
                self.prefill_peak = peak
            self.samples.append((step, t, alloc, peak, reserved))
            self.mem.reset_peak()
        return scores


class StopAfter:
    """Stopping criterion: every row is done after ``steps`` decode steps (the warm-up)."""

    def __init__(self, prompt_len: int, steps: int):
        self.prompt_len, self.steps = prompt_len, steps

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[1] - self.prompt_len > self.steps
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def generate(model, ids, steps, every, mem, cache=None, compiled=False, stop_after=None):
    """generate() of ``steps`` tokens with the memory probe: (new tokens, probe, seconds,
    decode steps run through generate()'s compiled forward)."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    probe = Probe(ids.shape[1], steps, model.config.vocab_size, every, mem, ids.device)
    stop = StoppingCriteriaList([StopAfter(ids.shape[1], stop_after)] if stop_after else [])
    probe.start()
    with torch.no_grad(), common.CompiledCalls(model) as watch:
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            do_sample=False,
            logits_processor=LogitsProcessorList([probe]),
            stopping_criteria=stop,
            past_key_values=cache,
            # Eager: with a compileable cache generate() would otherwise compile the decode
            # steps on CUDA by itself.
            disable_compile=not compiled,
        )
    mem.sync()
    total = time.perf_counter() - probe.t0
    return out[0, ids.shape[1] :].clone(), probe, total, watch.calls


def fresh_cache(model, ids, steps, page, shuffle: bool, seed: int):
    from m3_hf_attention import M3PagedCache

    length = ids.shape[1] + steps
    pages = -(-length // page)
    tables = None
    if shuffle:
        g = torch.Generator().manual_seed(seed)
        tables = torch.randperm(pages, generator=g).to(torch.int32)[None]
    return M3PagedCache(model.config, 1, length, page_size=page, device=ids.device, dtype=model.dtype,
                        block_tables=tables, num_pages=pages if shuffle else None)


def stability(samples, steps: int, cuda: bool, settle: int = 1) -> dict:
    """Growth of allocated memory, of the window peak and of reserved memory from the
    first decode sample at or after step ``settle`` to the last: the first two against
    what generate() itself appends, the third against ``RESERVED_ALLOWANCE``. Samples are
    (step, seconds, allocated, window peak[, reserved])."""
    decode = [s for s in samples if s[0] >= max(1, settle)]
    if len(decode) < 2:
        return {"stable": None, "why": f"fewer than two decode samples from step {max(1, settle)}"}
    first, last = decode[0], decode[-1]
    grow_alloc = last[2] - first[2]
    grow_peak = max(s[3] for s in decode[len(decode) // 2 :]) - max(s[3] for s in decode[: len(decode) // 2])
    # input_ids and attention_mask gain an int64 column per step (16 B), each copied
    # whole per step (the caching allocator rounds to 512 B blocks); on the CPU the RSS
    # moves with the system allocator, so the bound is loose there.
    loose = 0 if cuda else 64 * MiB
    tol = 2 * 8 * (last[0] - first[0]) + 2 * 512 + loose + 1 * MiB
    out = {
        "from_step": first[0],
        "allocated_growth_bytes": grow_alloc,
        "window_peak_growth_bytes": grow_peak,
        "tolerance_bytes": tol,
        "decode_allocated_min_max": [min(s[2] for s in decode), max(s[2] for s in decode)],
        "decode_peak_max": max(s[3] for s in decode),
    }
    stable = grow_alloc <= tol and grow_peak <= tol
    if len(first) > 4:
        out["reserved_growth_bytes"] = last[4] - first[4]
        out["reserved_tolerance_bytes"] = RESERVED_ALLOWANCE + loose
        stable = stable and out["reserved_growth_bytes"] <= out["reserved_tolerance_bytes"]
    return {"stable": stable, **out}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 131072; 512 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default 2000; 64 with --quick)")
    ap.add_argument("--sample-every", type=int, default=None, help="decode steps between memory samples (default steps / 20)")
    ap.add_argument("--settle-steps", type=int, default=16,
                    help="decode steps left out of the memory-growth check (compilation, graph recording; default 16)")
    ap.add_argument("--decode", default="eager", choices=["eager", "compiled"],
                    help="eager (default): generate(disable_compile=True); compiled: generate()'s default, which compiles "
                    "the decode step of a compileable cache on CUDA (the run fails if it did not)")
    ap.add_argument("--compare-eager", action="store_true",
                    help="with --decode compiled: a third run, eager, whose tokens are compared (reported only)")
    ap.add_argument("--impl", default="auto", choices=["auto", "torch", "triton"],
                    help="M3_SPARSE_IMPL for the run (default auto: the Triton kernels on CUDA, the torch code on the "
                    "CPU)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: toy shapes, short prompt, fp32")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --quick)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up generate()")
    ap.add_argument("--shuffle-pages", action="store_true",
                    help="the second run's fresh cache places pages in a random order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for long_run.json (default $OUT, else out/)")
    args = ap.parse_args(argv)
    args.prompt_len = args.prompt_len or (512 if args.quick else 131072)
    args.steps = args.steps or (64 if args.quick else 2000)
    args.every = args.sample_every or max(1, args.steps // 20)
    args.device = torch.device(args.device or ("cpu" if args.quick else "cuda"))
    if args.compare_eager and args.decode != "compiled":
        ap.error("--compare-eager: compares a compiled run with an eager one; pass --decode compiled")
    return args


def run(model, ids, args, mem, name: str, phases: dict, cache=None, compiled=None) -> dict:
    """One measured generate(): its tokens, probe and compiled-call count, timings in ``phases``."""
    compiled = args.decode == "compiled" if compiled is None else compiled
    tokens, probe, total, calls = generate(model, ids, args.steps, args.every, mem, cache=cache, compiled=compiled)
    phases[f"{name} prefill"] = probe.t_prefill
    phases[f"{name} decode"] = total - probe.t_prefill
    return {"tokens": tokens, "probe": probe, "compiled_calls": calls,
            "stability": stability(probe.samples, args.steps, mem.cuda, args.settle_steps)}


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    return None if torch.equal(a, b) else int(torch.nonzero(a != b)[0])


def divergence(a: dict, c: dict, step: int) -> dict:
    """Where runs ``a`` and ``c`` first pick different greedy tokens (``step``): each run's
    logit margin of its own token over the other's, and the largest |logit difference| of
    the two runs over the steps before, whose inputs were the same tokens and which picked
    the same (the size of their rounding difference). The flip is a near-tie when both
    margins are within that difference."""
    la, lc = a["probe"].logits, c["probe"].logits
    ta, tc = int(a["tokens"][step]), int(c["tokens"][step])
    before = (la[:step] - lc[:step]).abs()
    before = before[before.isfinite()]
    noise = float(before.max()) if before.numel() else 0.0
    margins = (float(la[step, ta] - la[step, tc]), float(lc[step, tc] - lc[step, ta]))
    return {"step": step, "tokens": (ta, tc), "margins": margins, "rounding_difference": noise,
            "near_tie": max(margins) <= noise}


def report(args, dtype, phases, base, runs, checks, unit) -> None:
    print(f"\ndevice {torch.cuda.get_device_name(args.device) if unit != 'RSS' else 'CPU'}, {str(dtype)[6:]}, "
          f"M3_SPARSE_IMPL={args.impl}, {args.decode} decode, prompt {args.prompt_len}, {args.steps} decode steps, "
          f"memory before the runs {base / MiB:.0f} MiB ({unit})")
    print("\nphase | seconds")
    print("---|---")
    for name, secs in phases.items():
        extra = f" ({secs / max(args.steps - 1, 1) * 1e3:.1f} ms/step)" if name.endswith("decode") else ""
        print(f"{name} | {secs:.1f}{extra}")
    probe = runs["run A"]["probe"]
    print(f"\nrun A memory (MiB): prefill peak {probe.prefill_peak / MiB:.0f}")
    print(f"step | {unit} | peak since previous sample | reserved")
    print("---|---|---|---")
    for step, _, alloc, peak, reserved in probe.samples:
        print(f"{step} | {alloc / MiB:.1f} | {peak / MiB:.1f} | {reserved / MiB:.1f}")
    print("\ncheck | result")
    print("---|---")
    for name, text in checks:
        print(f"{name} | {text}")


def memory_check(st: dict, unit: str) -> str:
    if st["stable"] is None:
        return f"n/a ({st['why']})"
    reserved = (f", reserved growth {st['reserved_growth_bytes'] / MiB:.1f} MiB (allowance "
                f"{st['reserved_tolerance_bytes'] / MiB:.0f} MiB)" if "reserved_growth_bytes" in st else "")
    return (f"{'yes' if st['stable'] else 'NO'}: from step {st['from_step']}, {unit} growth "
            f"{st['allocated_growth_bytes'] / 1024:.1f} KiB, window-peak growth "
            f"{st['window_peak_growth_bytes'] / 1024:.1f} KiB (tolerance {st['tolerance_bytes'] / 1024:.0f} KiB)"
            + reserved)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = QUICK if args.quick else FULL
    device, steps = args.device, args.steps
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --quick for the CPU smoke run)", file=sys.stderr)
        return 2
    if device.type == "cpu" and args.impl == "triton":
        # Triton kernels on CPU tensors need its interpreter, chosen when they are decorated.
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ["M3_SPARSE_IMPL"] = args.impl
    out_dir = Path(args.out or os.environ.get("OUT", ROOT / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    mem = Memory(device)
    phases = {}

    t = time.perf_counter()
    model = build_model(shape, args.prompt_len + steps + 64, device, dtype, args.seed)
    phases["build model"] = time.perf_counter() - t
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, shape["vocab"], (1, args.prompt_len), generator=g).to(device)

    if not args.no_warmup:
        # The measured runs' prompt and cache size, stopped early: the kernels compile for
        # their shapes (the long prompt takes KV-outer, the steps the decode kernel), and
        # so does a compiled decode step, whose graph is recorded here.
        t = time.perf_counter()
        generate(model, ids, steps, 1000, mem, compiled=args.decode == "compiled", stop_after=WARM_STEPS)
        phases["warm-up (stopped after 8 steps)"] = time.perf_counter() - t

    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = mem.now()[0]
    runs = {"run A": run(model, ids, args, mem, "run A", phases)}
    cache_b = fresh_cache(model, ids, steps, shape["page"], args.shuffle_pages, args.seed) if args.shuffle_pages \
        else None
    runs["run B"] = run(model, ids, args, mem, "run B (fresh cache)", phases, cache=cache_b)
    a, b = runs["run A"], runs["run B"]
    same_logits = torch.equal(a["probe"].logits.view(torch.int32), b["probe"].logits.view(torch.int32))
    first_diff = first_difference(a["tokens"], b["tokens"])
    unit = "allocated" if mem.cuda else "RSS"
    checks = [(f"{name} memory stable", memory_check(r["stability"], unit)) for name, r in runs.items()]
    checks += [
        (f"token ids A == B (fresh cache{', shuffled pages' if args.shuffle_pages else ''})",
         "yes" if first_diff is None else f"NO, first difference at step {first_diff}"),
        (f"logits A == B bitwise, all {steps} steps", "yes" if same_logits else "NO"),
        ("distinct tokens generated", str(int(a["tokens"].unique().numel()))),
    ]
    compiled_ok = True
    if args.decode == "compiled":
        # generate() calls the compiled forward for every decode step, none for the prefill.
        compiled_ok = all(r["compiled_calls"] == steps - 1 for r in runs.values())
        checks.append(("decode steps through generate()'s compiled forward, A / B",
                       f"{a['compiled_calls']} / {b['compiled_calls']} of {steps - 1}"
                       + ("" if compiled_ok else ": NO, generate() did not compile (is the cache compileable?)")))
    eager = None
    if args.compare_eager:
        c = run(model, ids, args, mem, "run C (eager)", phases, compiled=False)
        diff = first_difference(a["tokens"], c["tokens"])
        eager = {"first_token_difference": diff,
                 "max_abs_logit_difference": float((a["probe"].logits - c["probe"].logits).abs().max())}
        if diff is None:
            said = f"yes; largest logit difference {eager['max_abs_logit_difference']:.3g}"
        else:
            eager["divergence"] = d = divergence(a, c, diff)
            said = (f"no, first difference at step {diff}: compiled picks {d['tokens'][0]} (margin "
                    f"{d['margins'][0]:.3g}), eager {d['tokens'][1]} (margin {d['margins'][1]:.3g}); before it "
                    f"the runs' logits differ by up to {d['rounding_difference']:.3g}: "
                    + ("a near-tie" if d["near_tie"] else "NOT a near-tie"))
        checks.append(("token ids compiled A == eager C (information)", said))
    report(args, dtype, phases, base, runs, checks, unit)

    ok = (first_diff is None and same_logits and compiled_ok
          and all(r["stability"]["stable"] is not False for r in runs.values()))
    result = {
        **common.environment(),
        "device": torch.cuda.get_device_name(device) if mem.cuda else "CPU",
        "dtype": str(dtype),
        "impl": args.impl,
        "decode": args.decode,
        "shape": shape,
        "prompt_len": args.prompt_len,
        "steps": steps,
        "sample_every": args.every,
        "settle_steps": args.settle_steps,
        "phases_s": phases,
        "memory_before_bytes": base,
        **{name.replace(" ", "_").lower(): {"prefill_peak_bytes": r["probe"].prefill_peak, "samples": r["probe"].samples,
                                            "stability": r["stability"], "compiled_calls": r["compiled_calls"]}
           for name, r in runs.items()},
        "same_tokens": first_diff is None,
        "same_logits": same_logits,
        "first_token_difference": first_diff,
        "distinct_tokens": int(a["tokens"].unique().numel()),
        "shuffle_pages": args.shuffle_pages,
        "compiled_ok": compiled_ok,
        "eager_comparison": eager,
        "ok": ok,
    }
    common.write_json(out_dir / "long_run.json", result)
    print(f"\n{'OK' if ok else 'FAILED'}; wrote {out_dir / 'long_run.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
