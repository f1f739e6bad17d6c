"""A long generate() on the paged cache: a 128K-token prompt, then 2,000 greedy decode
steps, memory sampled along the way, and the whole run repeated on a fresh cache.

Model: an M3-shaped random text model small enough to be quick: Hq 64, Hkv 4, D 128,
4 index heads of 128, index blocks of 128 with top-16 (one local), 2 layers (one
sparse, one full attention), dense MLPs of 1024, hidden size 1024, vocabulary 512;
bf16 on CUDA. generate() builds its own M3PagedCache (the default for m3_sparse).

What it checks:
* memory: ``torch.cuda.memory_allocated()`` and the peak since the previous sample
  (``max_memory_allocated()`` after a reset) every ``--sample-every`` decode steps.
  Stable means that neither grows from the first decode sample to the last by more
  than what generate() itself appends (its input_ids and attention mask gain one
  int64 column per step), plus the allocator's rounding;
* output: a second generate() on a fresh cache gives the same token ids and bitwise
  the same logits at every step (recorded into a preallocated buffer by the hook).

    python3 benchmarks/reliability/long_run.py                          # 128K + 2,000 steps on CUDA
    python3 benchmarks/reliability/long_run.py --prompt-len 32768 --steps 500
    python3 benchmarks/reliability/long_run.py --quick                  # CPU smoke run, small shapes

``--impl`` sets M3_SPARSE_IMPL for the run. The default, ``auto``, is what a user gets:
on CUDA every op runs a Triton kernel (the index top-k; the sparse layer's
``sparse_attention``: KV-outer for a prompt of more than 256 tokens, the decode kernel
for shorter ones and for the decode steps; the full-attention layer's dense kernel), on
the CPU the torch code. ``triton`` pins the Triton kernels (on the CPU under
``TRITON_INTERPRET=1``, slow), ``torch`` the torch code.

Prints timings per phase and a short table; writes long_run.json to $OUT (or --out).
Exit status 1 if memory grew or the two runs differ.
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

    def now(self) -> tuple[int, int]:
        """(allocated, peak since the last reset) in bytes."""
        if self.cuda:
            return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss, rss


class Probe:
    """LogitsProcessor hook: runs once per generated token, after the forward that
    produced its logits. Records every step's logits into a preallocated buffer (a
    device copy, no sync) and, every ``every`` steps, syncs and samples memory."""

    def __init__(self, prompt_len: int, steps: int, vocab: int, every: int, mem: Memory, device):
        self.prompt_len, self.steps, self.every, self.mem = prompt_len, steps, every, mem
        self.logits = torch.empty(steps, vocab, dtype=torch.float32, device=device)
        self.samples = []  # (step, seconds since start, allocated, peak in the window)
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
            alloc, peak = self.mem.now()
            if step == 0:
                self.t_prefill = t
                self.prefill_peak = peak
            self.samples.append((step, t, alloc, peak))
            self.mem.reset_peak()
        return scores


def generate(model, ids, steps, every, mem, cache=None):
    from transformers import LogitsProcessorList

    probe = Probe(ids.shape[1], steps, model.config.vocab_size, every, mem, ids.device)
    probe.start()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            do_sample=False,
            logits_processor=LogitsProcessorList([probe]),
            past_key_values=cache,
            # Eager decode steps: should the cache become compileable, generate() would
            # otherwise compile them on CUDA in the middle of the measurement.
            disable_compile=True,
        )
    mem.sync()
    total = time.perf_counter() - probe.t0
    return out[0, ids.shape[1] :].clone(), probe, total


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


def stability(samples, steps: int, cuda: bool) -> dict:
    """Growth of allocated memory and of the window peak from the first decode sample
    to the last, against what generate() itself appends."""
    decode = [s for s in samples if s[0] > 0]
    if len(decode) < 2:
        return {"stable": None, "why": "fewer than two decode samples"}
    first, last = decode[0], decode[-1]
    grow_alloc = last[2] - first[2]
    grow_peak = max(s[3] for s in decode[len(decode) // 2 :]) - max(s[3] for s in decode[: len(decode) // 2])
    # input_ids and attention_mask gain an int64 column per step (16 B), each copied
    # whole per step (the caching allocator rounds to 512 B blocks); on the CPU the RSS
    # moves with the system allocator, so the bound is loose there.
    tol = 2 * 8 * (last[0] - first[0]) + 2 * 512 + (0 if cuda else 64 * MiB) + 1 * MiB
    return {
        "stable": grow_alloc <= tol and grow_peak <= tol,
        "allocated_growth_bytes": grow_alloc,
        "window_peak_growth_bytes": grow_peak,
        "tolerance_bytes": tol,
        "decode_allocated_min_max": [min(s[2] for s in decode), max(s[2] for s in decode)],
        "decode_peak_max": max(s[3] for s in decode),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 131072; 512 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default 2000; 64 with --quick)")
    ap.add_argument("--sample-every", type=int, default=None, help="decode steps between memory samples")
    ap.add_argument("--impl", default="auto", choices=["auto", "torch", "triton"],
                    help="M3_SPARSE_IMPL for the run (default auto: the Triton kernels on CUDA, the torch code on the "
                    "CPU)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: toy shapes, short prompt, fp32")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --quick)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the short generate() that compiles the kernels")
    ap.add_argument("--shuffle-pages", action="store_true",
                    help="the second run's fresh cache places pages in a random order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for long_run.json (default $OUT, else out/)")
    args = ap.parse_args()

    quick = args.quick
    shape = QUICK if quick else FULL
    prompt_len = args.prompt_len or (512 if quick else 131072)
    steps = args.steps or (64 if quick else 2000)
    every = args.sample_every or max(1, steps // 20)
    device = torch.device(args.device or ("cpu" if quick else "cuda"))
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
    model = build_model(shape, prompt_len + steps + 64, device, dtype, args.seed)
    phases["build model"] = time.perf_counter() - t
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, shape["vocab"], (1, prompt_len), generator=g).to(device)

    if not args.no_warmup:
        # Compiles the Triton kernels before anything is timed: with the default shapes the
        # 4096-token prompt already selects blocks and takes KV-outer like the long prefill,
        # and its decode steps take the decode kernel.
        t = time.perf_counter()
        warm = min(prompt_len, 4096)
        generate(model, ids[:, :warm], 4, 1000, mem)
        phases["warm-up (short generate)"] = time.perf_counter() - t

    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = mem.now()[0]
    tokens_a, probe_a, total_a = generate(model, ids, steps, every, mem)
    phases["run A prefill"] = probe_a.t_prefill
    phases["run A decode"] = total_a - probe_a.t_prefill

    cache_b = fresh_cache(model, ids, steps, shape["page"], args.shuffle_pages, args.seed) if args.shuffle_pages \
        else None
    tokens_b, probe_b, total_b = generate(model, ids, steps, every, mem, cache=cache_b)
    phases["run B prefill (fresh cache)"] = probe_b.t_prefill
    phases["run B decode"] = total_b - probe_b.t_prefill

    same_tokens = torch.equal(tokens_a, tokens_b)
    same_logits = torch.equal(probe_a.logits.view(torch.int32), probe_b.logits.view(torch.int32))
    first_diff = None
    if not same_tokens:
        first_diff = int(torch.nonzero(tokens_a != tokens_b)[0])
    stab_a = stability(probe_a.samples, steps, mem.cuda)
    stab_b = stability(probe_b.samples, steps, mem.cuda)
    distinct = int(tokens_a.unique().numel())

    # ------------------------------------------------------------------ report
    unit = "allocated" if mem.cuda else "RSS"
    print(f"\ndevice {torch.cuda.get_device_name(device) if mem.cuda else 'CPU'}, {str(dtype)[6:]}, "
          f"M3_SPARSE_IMPL={args.impl}, prompt {prompt_len}, {steps} decode steps, memory before the runs "
          f"{base / MiB:.0f} MiB ({unit})")
    print("\nphase | seconds")
    print("---|---")
    for name, secs in phases.items():
        extra = f" ({secs / max(steps - 1, 1) * 1e3:.1f} ms/step)" if "decode" in name else ""
        print(f"{name} | {secs:.1f}{extra}")
    print(f"\nrun A memory ({unit}, MiB): prefill peak {probe_a.prefill_peak / MiB:.0f}")
    print(f"step | {unit} | peak since previous sample")
    print("---|---|---")
    for step, _, alloc, peak in probe_a.samples:
        print(f"{step} | {alloc / MiB:.1f} | {peak / MiB:.1f}")
    print("\ncheck | result")
    print("---|---")
    for name, st in (("run A", stab_a), ("run B", stab_b)):
        if st["stable"] is None:
            print(f"{name} memory stable | n/a ({st['why']})")
            continue
        print(f"{name} memory stable | {'yes' if st['stable'] else 'NO'}: {unit} growth "
              f"{st['allocated_growth_bytes'] / 1024:.1f} KiB, window-peak growth "
              f"{st['window_peak_growth_bytes'] / 1024:.1f} KiB (tolerance {st['tolerance_bytes'] / 1024:.0f} KiB)")
    print(f"token ids A == B (fresh cache{', shuffled pages' if args.shuffle_pages else ''}) | "
          f"{'yes' if same_tokens else f'NO, first difference at step {first_diff}'}")
    print(f"logits A == B bitwise, all {steps} steps | {'yes' if same_logits else 'NO'}")
    print(f"distinct tokens generated | {distinct}")

    ok = same_tokens and same_logits and stab_a["stable"] is not False and stab_b["stable"] is not False
    result = {
        **common.environment(),
        "device": torch.cuda.get_device_name(device) if mem.cuda else "CPU",
        "dtype": str(dtype),
        "impl": args.impl,
        "shape": shape,
        "prompt_len": prompt_len,
        "steps": steps,
        "sample_every": every,
        "phases_s": phases,
        "memory_before_bytes": base,
        "run_a": {"prefill_peak_bytes": probe_a.prefill_peak, "samples": probe_a.samples, "stability": stab_a},
        "run_b": {"prefill_peak_bytes": probe_b.prefill_peak, "samples": probe_b.samples, "stability": stab_b},
        "same_tokens": same_tokens,
        "same_logits": same_logits,
        "first_token_difference": first_diff,
        "distinct_tokens": distinct,
        "shuffle_pages": args.shuffle_pages,
        "ok": ok,
    }
    common.write_json(out_dir / "long_run.json", result)
    print(f"\n{'OK' if ok else 'FAILED'}; wrote {out_dir / 'long_run.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
