"""Tensor parallelism over heads with m3_sparse: an M3-shaped random model (2 sparse layers,
Hq 64, Hkv 4, D 128, 4 index heads of 128, blocks of 128, top-16, bf16) loaded with
``DistributedConfig(tp_size=N)`` under torchrun, timed on a 128K-token prefill and on decode
steps of a batch of 32, and compared with the same model on one GPU.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py
    python3 benchmarks/bench_tp.py      # one process: the 1-GPU row only

Every rank holds Hq/N query heads, Hkv/N KV heads (its share of the paged cache) and Hi/N
index query heads; the one index key head is replicated (``m3_hf_attention.tp``). The random
checkpoint and the one-GPU result are kept in ``--work-dir`` (default: m3_bench_tp in the
temporary directory, never under $OUT), so runs of 2 and 4 GPUs in a row share them: rank 0
runs the one-GPU reference itself the first time (``--fresh`` rebuilds both). The MLPs are
small dense ones (replicated, as transformers' M3 plan leaves dense MLPs): the figures are
about attention, whose time is also measured alone ("attn": the attention modules, o_proj's
all-reduce included).

``--quick`` shrinks everything (Hq 8, Hkv 4, D 16, blocks of 16, 256-token prefill, fp32) for
a smoke test on the CPU with the gloo backend:

    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 2 benchmarks/bench_tp.py --quick

The last thing printed is a markdown table; its rows go to
``<out>/bench_tp_<model>-seed<seed>-<sizes>_world<N>.json`` (one file per world size, so runs
of 2 and 4 GPUs into the same --out keep both).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

# NVLink multicast stays off (shared hosts), also for NCCL communicators created below.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import common  # noqa: E402
from common import Clock  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import m3_hf_attention  # noqa: E402,F401  registers m3_sparse and its head-parallel TP plan
from m3_hf_attention import M3PagedCache  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig  # noqa: E402

FULL = dict(
    model=dict(hidden_size=6144, num_attention_heads=64, num_key_value_heads=4, head_dim=128, rotary_dim=64,
               index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16,
               dense_intermediate_size=2048, vocab_size=2048),
    prefill=131072, decode_batch=32, decode_context=4096, decode_steps=16, page_size=128, dtype="bf16",
    tol=3e-2,  # relative L2 error: bf16 rounding, summed in another order per rank, and a rare selection flip
)  # fmt: skip
QUICK = dict(
    model=dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=16, rotary_dim=8,
               index_n_heads=4, index_head_dim=16, index_block_size=16, index_topk_blocks=2,
               dense_intermediate_size=64, vocab_size=160),
    prefill=256, decode_batch=4, decode_context=64, decode_steps=3, page_size=16, dtype="fp32",
    tol=1e-5,  # fp32: only the order of the all-reduced sums differs
)  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WARM_STEPS = 2  # decode steps run before the timed ones (Triton compiles the decode shapes)


def log(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def text_config(shape: dict) -> MiniMaxM3VLTextConfig:
    return MiniMaxM3VLTextConfig(
        num_hidden_layers=2,
        layer_types=["minimax_m3_sparse"] * 2,
        mlp_layer_types=["dense"] * 2,
        index_local_blocks=1,
        max_position_embeddings=262144,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **shape,
    )


def build_checkpoint(path: Path, shape: dict, dtype: torch.dtype, device: torch.device, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.device(device):
        model = MiniMaxM3VLForCausalLM(text_config(shape)).eval()
        common.randomize_norms(model)
    model.to(dtype).save_pretrained(path)


# --------------------------------------------------------------------------- timing
class AttentionTimer:
    """Time spent inside the attention modules (index branch, sparse attention, o_proj)."""

    def __init__(self, model, clock: Clock):
        self.clock, self.on, self.spans = clock, False, []
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(self._start)
            layer.self_attn.register_forward_hook(self._stop)

    def _start(self, module, args):
        if self.on:
            self.spans.append([self.clock.mark(), None])

    def _stop(self, module, args, output):
        if self.on:
            self.spans[-1][1] = self.clock.mark()

    def __enter__(self):
        self.on, self.spans = True, []
        return self

    def __exit__(self, *exc):
        self.on = False

    def total_ms(self) -> float:
        return sum(self.clock.ms(a, b) for a, b in self.spans)


def sync(device: torch.device, ranks: bool) -> None:
    common.sync(device)
    if ranks:
        dist.barrier()  # all ranks start a timed region together


def max_over_ranks(x: float, device: torch.device, ranks: bool) -> float:
    if not ranks:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def cache_mib(cache: M3PagedCache) -> float:
    pools = [t for layer in cache.layers for t in (layer.keys, layer.values, layer.index_keys) if t is not None]
    return sum(t.numel() * t.element_size() for t in pools) / 2**20


# --------------------------------------------------------------------------- workload
@torch.no_grad()
def workload(model, cfg: dict, device: torch.device, dtype: torch.dtype, reps: int, ranks: bool) -> dict:
    """Prefill of one long sequence, then decode steps of a batch. Inputs are drawn on the
    CPU from fixed seeds (same on every rank); decode feeds random tokens, not the argmax,
    so every run sees the same inputs whatever it computes. ``ranks``: the model is split
    over the process group (every rank runs this), else one process runs it alone."""
    clock, attn = Clock(device), AttentionTimer(model, Clock(device))
    text = model.config
    g = torch.Generator().manual_seed(1)
    n = cfg["prefill"]
    ids = torch.randint(3, text.vocab_size, (1, n), generator=g).to(device)
    cache = M3PagedCache(text, 1, n, page_size=cfg["page_size"], dtype=dtype)
    stride = max(1, n // 1024)
    rows = torch.cat([torch.arange(0, n - 64, stride), torch.arange(n - 64, n)]).to(device)
    prefill_ms, prefill_attn_ms = [], []
    for rep in range(reps + 1):  # the first run compiles the kernels for these shapes
        cache.reset()
        sync(device, ranks)
        with attn:
            a = clock.mark()
            hidden = model.model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
            b = clock.mark()
        if rep:
            prefill_ms.append(clock.ms(a, b))
            prefill_attn_ms.append(attn.total_ms())
    prefill_rows = hidden[0, rows].float().cpu()
    prefill_cache_mib = cache_mib(cache)
    del hidden, cache

    batch, context, steps = cfg["decode_batch"], cfg["decode_context"], cfg["decode_steps"]
    ctx = torch.randint(3, text.vocab_size, (batch, context), generator=g).to(device)
    new = torch.randint(3, text.vocab_size, (WARM_STEPS + steps, batch, 1), generator=g).to(device)
    cache = M3PagedCache(text, batch, context + WARM_STEPS + steps, page_size=cfg["page_size"], dtype=dtype)
    model(input_ids=ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
    step_ms, step_attn_ms, logits = [], [], []
    for i in range(WARM_STEPS + steps):
        sync(device, ranks)
        with attn:
            a = clock.mark()
            out = model(input_ids=new[i], past_key_values=cache, use_cache=True).logits
            b = clock.mark()
        if i >= WARM_STEPS:
            step_ms.append(clock.ms(a, b))
            step_attn_ms.append(attn.total_ms())
            logits.append(out[:, -1].float().cpu())
    return {
        "prefill_ms": max_over_ranks(statistics.median(prefill_ms), device, ranks),
        "prefill_attn_ms": max_over_ranks(statistics.median(prefill_attn_ms), device, ranks),
        "decode_ms": max_over_ranks(statistics.median(step_ms), device, ranks),
        "decode_attn_ms": max_over_ranks(statistics.median(step_attn_ms), device, ranks),
        "prefill_cache_mib": prefill_cache_mib,
        "decode_cache_mib": cache_mib(cache),
        "prefill_rows": prefill_rows,
        "decode_logits": torch.stack(logits),
    }


# --------------------------------------------------------------------------- main
def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny shapes in fp32 (a CPU/gloo smoke test)")
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "m3_bench_tp"),
                    help="the random checkpoint and the 1-GPU result, reused by later runs")
    ap.add_argument("--fresh", action="store_true", help="rebuild the checkpoint and the 1-GPU result")
    ap.add_argument("--reps", type=int, default=3, help="timed prefill runs (after one warm-up run)")
    ap.add_argument("--seed", type=int, default=0)
    for name in ("prefill", "decode_batch", "decode_context", "decode_steps"):
        flag = "--" + name.replace("_", "-")
        ap.add_argument(flag, type=int, help=f"default {FULL[name]} ({QUICK[name]} with --quick)")
    args = ap.parse_args()
    cfg = dict(QUICK if args.quick else FULL)
    sizes = ("prefill", "decode_batch", "decode_context", "decode_steps")
    cfg.update({k: getattr(args, k) for k in sizes if getattr(args, k) is not None})
    dtype = DTYPES[cfg["dtype"]]

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")

    tag = f"{'quick' if args.quick else 'm3'}-seed{args.seed}"
    ref_tag = tag + "".join(f"-{cfg[k]}" for k in sizes)  # the 1-GPU result of these sizes
    ckpt = [None]
    if rank == 0:
        ckpt[0] = str(Path(args.work_dir) / f"model-{tag}")
        if args.fresh or not (Path(ckpt[0]) / "config.json").exists():
            for old in Path(args.work_dir).glob(f"ref-{tag}-*.pt"):
                old.unlink()
            log(f"building the random checkpoint {ckpt[0]}")
            build_checkpoint(Path(ckpt[0]), cfg["model"], dtype, device, args.seed)
    if world > 1:
        dist.broadcast_object_list(ckpt, src=0)
    path = ckpt[0]
    log(f"world {world}, device {device}, {cfg['dtype']}, model {cfg['model']}, sizes {[cfg[k] for k in sizes]}")

    results = {}
    if world > 1:
        model = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="m3_sparse", dtype=dtype, distributed_config=DistributedConfig(tp_size=world)
        ).eval()
        attn = model.model.layers[0].self_attn
        log(f"rank 0 holds q_proj {tuple(attn.q_proj.weight.to_local().shape)}, "
            f"k_proj {tuple(attn.k_proj.weight.to_local().shape)}, "
            f"indexer.q_proj {tuple(attn.indexer.q_proj.weight.to_local().shape)}")  # fmt: skip
        results[world] = workload(model, cfg, device, dtype, args.reps, ranks=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if rank == 0:
        ref_file = Path(args.work_dir) / f"ref-{ref_tag}.pt"
        if ref_file.exists():
            ref = torch.load(ref_file)
            log(f"1-GPU reference read from {ref_file}")
        else:
            log("running the 1-GPU reference on rank 0")
            model = AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="m3_sparse", dtype=dtype, device_map=device
            ).eval()
            ref = workload(model, cfg, device, dtype, args.reps, ranks=False)
            del model
            torch.save(ref, ref_file)
        results[1] = ref
    if world > 1:
        dist.barrier()  # the other ranks wait for the reference

    status = 0
    if rank == 0:
        n, b = cfg["prefill"], cfg["decode_batch"]
        rows = []
        report = common.Results("bench_tp", args.out, name=f"bench_tp_{ref_tag}_world{world}")
        sizes = {"prefill": n, "decode_batch": b, "decode_context": cfg["decode_context"],
                 "decode_steps": cfg["decode_steps"], "dtype": cfg["dtype"], "model": cfg["model"]}
        for tp in sorted(results):
            r = results[tp]
            e1 = common.rel_l2(r["prefill_rows"], results[1]["prefill_rows"])
            e2 = common.rel_l2(r["decode_logits"], results[1]["decode_logits"])
            ok = e1 <= cfg["tol"] and e2 <= cfg["tol"]
            status |= 0 if ok else 1
            rows.append([tp, f"{r['prefill_ms']:.1f}", f"{r['prefill_attn_ms']:.1f}", f"{r['decode_ms']:.2f}",
                         f"{r['decode_attn_ms']:.2f}", f"{b / r['decode_ms'] * 1e3:.0f}",
                         f"{r['prefill_cache_mib']:.1f}, {r['decode_cache_mib']:.1f}", f"{e1:.2e}", f"{e2:.2e}",
                         "yes" if ok else "NO"])
            figures = {k: v for k, v in r.items() if not isinstance(v, torch.Tensor)}
            figures.update(gpus=tp, prefill_rel_err=e1, decode_rel_err=e2, ok=ok, tol=cfg["tol"])
            base = None if tp == 1 else results[1]
            report.add(f"TP {tp}, prefill {n}", r["prefill_ms"], what="model forward (m3_sparse)", sizes=sizes,
                       baseline="1 GPU" if base else None, baseline_ms=base["prefill_ms"] if base else None, **figures)
            report.add(f"TP {tp}, decode b{b}", r["decode_ms"], what="decode step (m3_sparse)", sizes=sizes,
                       baseline="1 GPU" if base else None, baseline_ms=base["decode_ms"] if base else None, **figures)
        report.write()
        log(f"\nrel err: relative L2 error against 1 GPU (tolerance {cfg['tol']:g}); times: medians, slowest rank")
        log(common.md_table(["ranks", f"prefill {n} ms", "attn ms", f"decode b{b} ms/step", "attn ms/step",
                             "decode tok/s", "cache MiB/rank (prefill, decode)", "prefill rel err", "decode rel err",
                             "ok"], rows))
    if world > 1:
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
