"""KV-outer MSA prefill on the GPU: per-stage times of the Triton pipeline, against dense
causal SDPA (cuDNN), FlexAttention with a block mask of the same selections, and the
query-outer tile kernel (``m3_sparse.qouter_attention``) on the same call.

Workload (M3_SPEC section 5, issue 3): Hq 64, Hkv 4, D 128, block 128, top-16, bf16, one
causal prefill of N tokens (N in 8K/32K/128K) and a batch of 16 x 8K; selections "hot"
(shared block popularity) and "random" (uniform block scores), local block always kept.

    python3 benchmarks/bench_kvouter.py                        # everything
    python3 benchmarks/bench_kvouter.py --sizes 32768 --no-flex
    python3 benchmarks/bench_kvouter.py --tune --sizes 32768    # kernel launch variants

The stages run on their Triton kernels with the launch choices of one ``KVOuterConfig``
(``--engine``, ``--attn-config``, or the best variant of ``--tune`` with ``--then-run``);
the module is ``m3_sparse.kvouter_attention`` under that config with no workspace bound
(one pass, no query slices). ``--comb-config`` sets the combine stage's launch
(``combine_triton(rows=, num_warps=)``); the module's combine keeps its default, as
``KVOuterConfig`` carries no combine settings.

The query-outer kernel's work is its tiles' unions of selected blocks, so each row also gives
the mean union per (tile, kv head) in blocks (``union``, against the top-k a row attends):
the ratio the KV-outer / query-outer crossover is read from (``--no-qouter`` skips it;
``--qouter-variants`` times its launch choices too).

Times are medians of CUDA-event timings (triton.testing.do_bench, which clears L2 before
every run; every working set here is far larger than L2 anyway). The module is also timed
with the host ahead of the GPU (``common.host_ahead_ms``), as it runs inside a model's
forward: event timings of one call also count the time the GPU waits for the host's first
launches. Result rows (``bench_kvouter.json``) and the log go to --out. The last thing
printed is a markdown table.
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from pathlib import Path

import common
from common import BLOCK, D, GROUP, HKV, HQ, PEAK_BYTES, PEAK_FLOPS, SMOKE, TOPK, fmt, ratio

import torch  # noqa: E402

import m3_sparse  # noqa: E402
from m3_sparse import DenseConfig, KVOuterConfig, api, dispatch  # noqa: E402
from m3_sparse.core import launch  # noqa: E402
from m3_sparse.core.validate import attention_args  # noqa: E402
from m3_sparse.dense import plan as dense_plan  # noqa: E402
from m3_sparse.kvouter import build_triton, partials_triton, schedule_triton  # noqa: E402
from m3_sparse.kvouter import plan as kv_plan  # noqa: E402
from m3_sparse.kvouter import combine_triton as combine_module  # noqa: E402
from m3_sparse.kvouter.combine_triton import combine_triton  # noqa: E402

log = common.Log()
LOOP_REMOVED = ("the partials kernel has one loop form now (the resident K/V loop, formerly loop 2); "
                "the staged (0) and prefetch (1) variants were removed")


# --------------------------------------------------------------------------- workload


def make_selection(pattern: str, n: int, gen: torch.Generator, dev) -> torch.Tensor:
    """[n, HKV, TOPK] int32 for one sequence of n tokens, all of them queries."""
    nb = -(-n // BLOCK)
    # Drawn for both patterns, as this workload always has: the "random" selections stay
    # the ones the earlier figures were measured on.
    pop = torch.randn(HKV, nb, device=dev, generator=gen)
    return common.block_selection(
        pattern, torch.arange(n, device=dev), nb, gen, popularity=pop[None],
        row_group=torch.zeros(n, dtype=torch.long, device=dev), chunk_elems=1 << 29,
    )


def make_problem(pattern: str, n_seq: int, seq_len: int, seed: int = 0):
    dev = torch.device(os.environ.get("BENCH_DEVICE", str(common.DEVICE)))
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    n = n_seq * seq_len
    nb = -(-seq_len // BLOCK)
    q = torch.randn(n, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
    k, v = common.paged_kv(gen, n_seq * nb, BLOCK)
    bt = common.shuffled_tables(gen, n_seq, nb)
    cu, kv = common.varlen(n_seq, seq_len, seq_len, dev)
    sel = torch.cat([make_selection(pattern, seq_len, gen, dev) for _ in range(n_seq)])
    return dict(q=q, k=k, v=v, bt=bt, cu=cu, kv=kv, sel=sel, n_seq=n_seq, seq_len=seq_len)


def useful_keys(sel: torch.Tensor, seq_len: int) -> int:
    """Keys really attended, summed over (token, kv head): full 128 for an earlier block,
    p % 128 + 1 for the local one (selections here hold no repeated id)."""
    n = sel.shape[0]
    pos = torch.arange(n, device=sel.device) % seq_len
    local = (pos // BLOCK)[:, None, None]
    valid = sel >= 0
    keys = torch.where(sel == local, (pos % BLOCK + 1)[:, None, None], BLOCK)
    return int(torch.where(valid, keys, 0).sum())


def union_blocks(sel: torch.Tensor, seq_len: int, tile_tokens: int) -> float:
    """Mean distinct selected blocks per (query tile, kv head) of the query-outer kernel:
    tiles of ``tile_tokens`` consecutive tokens of one sequence (every sequence here has
    ``seq_len`` tokens, a multiple of the tile)."""
    n, heads, topk = sel.shape
    tiles = sel.view(n // seq_len, seq_len // tile_tokens, tile_tokens, heads, topk)
    ids = tiles.permute(0, 1, 3, 2, 4).reshape(-1, tile_tokens * topk).sort(-1).values  # [tiles * heads, T*K]
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return float((new & (ids >= 0)).sum()) / ids.shape[0]


def traffic(index, n_tokens: int) -> dict:
    """Minimum HBM bytes of the pipeline as the seed's model counts them: every entry's
    head-packed Q gather, each selected (kv head, block) K/V read once, raw partials
    written and read back with their m/l, the output written."""
    used = int(index.seg_offsets[-1])
    offs = index.seg_offsets
    nsb = int(((offs[1:] - offs[:-1]) > 0).sum())
    q_gather = used * GROUP * D * 2
    kv = nsb * 2 * BLOCK * D * 2
    partial = used * GROUP * (D * 2 + 8)
    out = n_tokens * HQ * D * 2
    return dict(
        used=used, nsb=nsb, attn=q_gather + kv + partial, combine=partial + out + index.slot_of.numel() * 4,
        module=q_gather + kv + 2 * partial + out,
    )


def sampled_rows(parts, used: int, rows: int = 1 << 17) -> list[torch.Tensor]:
    """The first and last ``rows`` used entries of each partial buffer, copied: what
    ``rel_diff`` compares, kept while the buffers themselves are freed (two sets of partials
    at 128K are 70 GB)."""
    idx = torch.cat([torch.arange(min(rows, used)), torch.arange(max(0, used - rows), used)]).to(parts[0].device)
    return [t[idx] for t in parts]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 difference of two sampled partial buffers (``sampled_rows``); -inf (a row
    that saw no key) counts as 0 on both sides, so two equal buffers give 0."""
    if a.numel() == 0:
        return 0.0
    x, y = (t.float().nan_to_num(posinf=0.0, neginf=0.0) for t in (a, b))
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def o_diff(parts, ref, used: int) -> float:
    """``rel_diff`` of the partial outputs (o, the first buffer) of two engines' runs."""
    return rel_diff(sampled_rows(parts[:1], used)[0], sampled_rows(ref[:1], used)[0])


def partials_call(p, index, sched, cfg: KVOuterConfig):
    """The partials stage alone over a given index and schedule, its kernel chosen by ``cfg``."""
    return lambda: api.kvouter_partials_gpu(  # noqa: E731
        p["q"], p["k"], p["v"], index, sched, p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"],
        softmax_scale=D**-0.5, causal=True, block_size=BLOCK, config=cfg,
    )


# --------------------------------------------------------------------------- baselines


_FLEX = None


def flex_call(p, compiled=True):
    """FlexAttention over the union of each 128-row query block's selections (block
    mask), with a mask_mod that keeps each token's own selection: the same function.
    Returns (fn computing out [B, Hq, S, D] from the problem's q and the given k, v, note)."""
    global _FLEX
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if compiled and _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    attend = _FLEX if compiled else flex_attention
    b, s = p["n_seq"], p["seq_len"]
    nb = -(-s // BLOCK)
    sel = p["sel"].view(b, s, HKV, TOPK).long()
    dev = sel.device
    valid = sel >= 0
    # Per-token selection as a dense [B, Hkv, S, nb] bool table for the mask_mod.
    dense = torch.zeros(b, HKV, s, nb, dtype=torch.bool, device=dev)
    bi = torch.arange(b, device=dev)[:, None, None, None].expand_as(sel)
    hi = torch.arange(HKV, device=dev)[None, None, :, None].expand_as(sel)
    ti = torch.arange(s, device=dev)[None, :, None, None].expand_as(sel)
    dense[bi[valid], hi[valid], ti[valid], sel[valid]] = True
    pad = nb * BLOCK - s
    union = torch.nn.functional.pad(dense, (0, 0, 0, pad)).view(b, HKV, nb, BLOCK, nb).any(3)  # [B, Hkv, nq, nb]
    kv_num = union.sum(-1).to(torch.int32).repeat_interleave(GROUP, 1)
    kv_idx = torch.argsort((~union).to(torch.int8), dim=-1, stable=True).to(torch.int32).repeat_interleave(GROUP, 1)
    mean_union = float(kv_num.float().mean())
    del union

    def mask_mod(bb, h, q_idx, kv_idx_):
        return (kv_idx_ <= q_idx) & dense[bb, h // GROUP, q_idx, kv_idx_ // BLOCK]

    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(s, s))
    q = p["q"].view(b, s, HQ, D).transpose(1, 2)
    return (lambda k, v: attend(q, k, v, block_mask=bm, enable_gqa=True)), f"union {mean_union:.0f} blocks/q-block"


def flex(p) -> tuple[float | None, str]:
    b, s = p["n_seq"], p["seq_len"]
    call, note = flex_call(p)
    k = torch.randn(b, HKV, s, D, device=p["q"].device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fn = lambda: call(k, v)  # noqa: E731
    t0 = time.time()
    fn()
    common.sync()
    log(f"  flex first call (compile) {time.time() - t0:.1f} s")
    t = common.slow_ms(fn) if s * b >= 32768 else common.median_ms(fn)
    del call, k, v
    return t, note


# --------------------------------------------------------------------------- main runs


def check_builders(name, pattern, index, sched, p, tile_q, nprog):
    """The Triton builder and scheduler must reproduce the torch ones exactly."""
    index_torch = m3_sparse.build_kvouter_index(p["sel"], cu_seqlens_q=p["cu"], max_blocks=p["bt"].shape[1],
                                                batch_size=p["n_seq"])
    for f in ("seg_offsets", "entry_token", "entry_rank", "entry_segment", "slot_of"):
        if not torch.equal(getattr(index, f), getattr(index_torch, f)):
            raise SystemExit(f"{name} {pattern}: Triton index builder differs from torch in {f}")
    sched_torch = m3_sparse.schedule(index_torch, tile_q=tile_q, num_programs=nprog)
    for f in ("tile_segment", "tile_start", "tile_end", "num_tiles", "program_tiles"):
        if not torch.equal(getattr(sched, f), getattr(sched_torch, f)):
            raise SystemExit(f"{name} {pattern}: Triton scheduler differs from torch in {f}")


def run_config(name, pattern, n_seq, seq_len, args):
    log(f"== {name} {pattern}")
    cfg, (comb_rows, comb_warps) = args.cfg, args.comb
    p = make_problem(pattern, n_seq, seq_len, seed=zlib.crc32(f"{pattern}{n_seq}x{seq_len}".encode()))
    q, k, v, sel, bt, cu, kv = (p[x] for x in ("q", "k", "v", "sel", "bt", "cu", "kv"))
    n = q.shape[0]
    max_blocks = bt.shape[1]
    tile_q = kv_plan.default_tile_q(GROUP, cfg)
    nprog = kv_plan.default_num_programs(q.device, cfg)
    build = lambda: build_triton.build_kvouter_index_triton(sel, cu_seqlens_q=cu, max_blocks=max_blocks, batch_size=n_seq)  # noqa: E731
    build_torch = lambda: m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=max_blocks, batch_size=n_seq)  # noqa: E731
    index = build()
    sched = schedule_triton.schedule_triton(index, tile_q=tile_q, num_programs=nprog)
    check_builders(name, pattern, index, sched, p, tile_q, nprog)
    attn = partials_call(p, index, sched, cfg)
    attn_tl = partials_call(p, index, sched, dataclasses.replace(cfg, engine="triton"))
    # o, m and l of the configured engine against the tl kernel on the same schedule, one set
    # of partials alive at a time.
    used = int(index.seg_offsets[-1])
    ref = sampled_rows(attn_tl(), used)
    parts = attn()
    eng_diff = max(rel_diff(x, y) for x, y in zip(sampled_rows(parts, used), ref))
    del ref
    comb = lambda: combine_triton(  # noqa: E731
        *parts, index.slot_of, out_dtype=q.dtype, return_lse=False, rows=comb_rows, num_warps=comb_warps
    )
    t_comb = common.median_ms(comb)
    del parts, comb
    module = lambda: m3_sparse.kvouter_attention(q, k, v, sel, bt, cu_seqlens_q=cu, used_kv_lens=kv, config=cfg)  # noqa: E731
    out, lse = m3_sparse.kvouter_attention(q, k, v, sel, bt, cu_seqlens_q=cu, used_kv_lens=kv, return_lse=True,
                                           config=cfg)
    err = common.sampled_error(p, out, lse, 96)
    del out, lse
    # The kernel "attn" ran: the TMA kernel where it applies under the configured engine.
    why = dispatch.tma_partials_reason(q, k, v, BLOCK, None, None, tile_q, index.capacity * GROUP, cfg=cfg)
    ran = "tma" if why is None else "triton"
    r = dict(name=name, pattern=pattern, n=n, err=err, eng_diff=eng_diff, engine=ran)
    r["t_build"] = common.median_ms(build)
    r["t_sched"] = common.median_ms(lambda: schedule_triton.schedule_triton(index, tile_q=tile_q, num_programs=nprog))
    r["t_build_torch"] = common.median_ms(build_torch)
    r["t_sched_torch"] = common.median_ms(lambda: m3_sparse.schedule(index, tile_q=tile_q, num_programs=nprog))
    r["t_attn"] = common.median_ms(attn)
    r["t_attn_tl"] = common.median_ms(attn_tl)
    r["t_comb"] = t_comb
    r["t_module"] = common.median_ms(module)
    r["t_module_ahead"] = common.host_ahead_ms(module)
    # Host time of one call (an eager forward's share), with the tl kernels launched directly
    # after their first call (the default) and with every launch through Triton.
    r["host_module"] = common.host_ms(module)
    with common.direct_launches(launch, False):
        r["host_module_triton"] = common.host_ms(module)
    if args.host_profile:
        log(f"host profile of one module call ({name} {pattern}):\n{common.host_profile(module)}")
    r["flops"] = 4 * D * GROUP * useful_keys(sel, seq_len)
    tr = traffic(index, n)
    r.update(bytes_attn=tr["attn"], bytes_comb=tr["combine"], bytes=tr["module"], nsb=tr["nsb"], used=tr["used"])
    r["floor"] = max(r["flops"] / PEAK_FLOPS, tr["module"] / PEAK_BYTES) * 1e3
    ws = index.capacity * GROUP * (D * 2 + 8)  # partials
    ws += sum(t.numel() * t.element_size() for t in (index.seg_offsets, index.entry_token, index.entry_rank, index.entry_segment, index.slot_of))
    ws += sum(t.numel() * t.element_size() for t in (sched.tile_segment, sched.tile_start, sched.tile_end, sched.program_tiles))
    r["workspace"] = ws
    r["num_tiles"] = int(sched.num_tiles[0])
    del index, sched
    common.empty_cache()
    log(
        f"  build {r['t_build']:.3f} (torch {r['t_build_torch']:.3f}) sched {r['t_sched']:.3f} "
        f"(torch {r['t_sched_torch']:.3f}) attn [{ran}] {r['t_attn']:.3f} (tl kernel {r['t_attn_tl']:.3f}, "
        f"rel. diff {eng_diff:.1e}) comb {r['t_comb']:.3f} "
        f"module {r['t_module']:.3f} ms (host ahead {r['t_module_ahead']:.3f}; host time {r['host_module']:.3f}, "
        f"through Triton {r['host_module_triton']:.3f}) | attn {r['flops'] / r['t_attn'] / 1e9:.0f} TFLOP/s, "
        f"attn {tr['attn'] / r['t_attn'] / 1e6:.0f} GB/s, comb {tr['combine'] / r['t_comb'] / 1e6:.0f} GB/s | "
        f"floor {r['floor']:.2f} ms | err {err:.2e} | tiles {r['num_tiles']} nsb {r['nsb']}"
    )
    if args.qouter:
        run_qouter(r, p, seq_len, args.qouter_variants)
    if args.dense:
        if name not in DENSE_DONE:  # dense attention does not depend on the selections
            DENSE_DONE[name] = common.cudnn_causal(q, n_seq, seq_len, log)
            log(f"  cudnn dense {fmt(DENSE_DONE[name][0], 3)} ms ({DENSE_DONE[name][1]})")
        r["t_dense"], r["dense_note"] = DENSE_DONE[name]
    if args.flex and name in args.flex_configs and not SMOKE:
        try:
            r["t_flex"], r["flex_note"] = flex(p)
        except Exception as e:  # noqa: BLE001
            r["t_flex"], r["flex_note"] = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        log(f"  flex {r['t_flex']} ms ({r['flex_note']})")
    else:
        r["t_flex"], r["flex_note"] = None, "skipped (device-time budget)"
    del p, q, k, v, sel
    common.empty_cache()
    return r


DENSE_DONE: dict = {}


def run_qouter(r: dict, p: dict, seq_len: int, variants=()) -> None:
    """The query-outer tile kernel on the same call: time (event, host ahead), host time,
    error, and the union of blocks its tiles walk; then each launch variant's time
    (``--qouter-variants``: block_m, block_n, num_warps, num_stages of ``DenseConfig``)."""
    q, k, v, sel, bt, cu, kv = (p[x] for x in ("q", "k", "v", "sel", "bt", "cu", "kv"))
    cfg = DenseConfig(impl="triton")
    call = lambda: m3_sparse.qouter_attention(  # noqa: E731
        q, k, v, sel, bt, cu_seqlens_q=cu, used_kv_lens=kv, max_seqlen_q=seq_len, config=cfg
    )
    out, lse = m3_sparse.qouter_attention(
        q, k, v, sel, bt, cu_seqlens_q=cu, used_kv_lens=kv, max_seqlen_q=seq_len, return_lse=True, config=cfg
    )
    r["qouter_err"] = common.sampled_error(p, out, lse, 96)
    del out, lse
    args = attention_args(
        q, k, v, bt, cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=None, causal=True, return_lse=False,
        selected=sel, block_size=BLOCK, max_seqlen_q=seq_len,
    )
    tm = dense_plan.plan(args, cfg).tm
    r["qouter_tile_tokens"] = tm
    r["union"] = union_blocks(sel, seq_len, tm)
    r["t_qouter"] = common.median_ms(call)
    r["t_qouter_ahead"] = common.host_ahead_ms(call)
    r["host_qouter"] = common.host_ms(call)
    # Its MMA work: every row of a tile against every key of the union (local blocks counted whole).
    r["qouter_flops"] = int(4 * D * GROUP * r["union"] * BLOCK * tm * HKV * (q.shape[0] // tm))
    common.empty_cache()
    log(
        f"  qouter {r['t_qouter']:.3f} ms (host ahead {r['t_qouter_ahead']:.3f}; host time {r['host_qouter']:.3f}) "
        f"| union {r['union']:.1f} blocks per tile of {tm} tokens (top-{TOPK}) | "
        f"{r['qouter_flops'] / r['t_qouter'] / 1e9:.0f} TFLOP/s | err {r['qouter_err']:.2e} | "
        f"KV-outer / qouter {ratio(r['t_module'], r['t_qouter'])}"
    )
    r["qouter_variants"] = {}
    for bm, bn, warps, stages in variants:
        label = f"{bm}:{bn}:{warps}:{stages}"
        vcfg = DenseConfig(impl="triton", block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        try:
            ms = common.median_ms(lambda: m3_sparse.qouter_attention(  # noqa: B023 - called in this iteration
                q, k, v, sel, bt, cu_seqlens_q=cu, used_kv_lens=kv, max_seqlen_q=seq_len, config=vcfg))
        except Exception as e:  # noqa: BLE001 - a variant the GPU cannot run (shared memory) is reported
            log(f"  qouter variant {label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            ms = None
        r["qouter_variants"][label] = ms
        if ms is not None:
            log(f"  qouter variant {label} (block_m:block_n:warps:stages) {ms:.3f} ms "
                f"(default {r['t_qouter']:.3f})")
        common.empty_cache()


def add_rows(results, r, n_seq, seq_len):
    """One config's stage and module rows."""
    case = f"{r['name']} {r['pattern']}"
    sizes = {"n_seq": n_seq, "seq_len": seq_len, "pattern": r["pattern"]}
    results.add(case, r["t_module"], what="module: kvouter_attention (Triton stages)", sizes=sizes,
                baseline=f"cuDNN SDPA dense causal ({r['dense_note']})" if "dense_note" in r else None,
                baseline_ms=r.get("t_dense"),
                host_ahead_ms=r["t_module_ahead"], host_time_ms=r["host_module"],
                host_time_triton_launches_ms=r["host_module_triton"], floor_ms=r["floor"], flops=r["flops"], bytes=r["bytes"],
                err=r["err"], partials_engine=r["engine"], workspace_bytes=r["workspace"], num_tiles=r["num_tiles"],
                nsb=r["nsb"], used_entries=r["used"], flex_ms=r["t_flex"], flex_note=r["flex_note"])
    if "t_qouter" in r:
        results.add(case, r["t_qouter"], what="qouter_attention (query-outer tiles)", sizes=sizes,
                    baseline="module: kvouter_attention (Triton stages)", baseline_ms=r["t_module"],
                    host_ahead_ms=r["t_qouter_ahead"], host_time_ms=r["host_qouter"], flops=r["qouter_flops"],
                    floor_ms=r["qouter_flops"] / PEAK_FLOPS * 1e3, err=r["qouter_err"],
                    union_blocks_per_tile=r["union"], tile_tokens=r["qouter_tile_tokens"], topk=TOPK)
        for label, ms in r["qouter_variants"].items():
            results.add(case, ms, what=f"qouter_attention, block_m:block_n:num_warps:num_stages {label}", sizes=sizes,
                        baseline="qouter_attention (default launch)", baseline_ms=r["t_qouter"])
    results.add(case, r["t_build"], what="index build (Triton)", sizes=sizes, baseline="index build (torch)",
                baseline_ms=r["t_build_torch"])
    results.add(case, r["t_sched"], what="schedule (Triton)", sizes=sizes, baseline="schedule (torch)",
                baseline_ms=r["t_sched_torch"])
    results.add(case, r["t_attn"], what=f"partials ({r['engine']} kernel)", sizes=sizes,
                baseline="partials (tl kernel)", baseline_ms=r["t_attn_tl"], rel_diff=r["eng_diff"],
                bytes=r["bytes_attn"], flops=r["flops"])
    results.add(case, r["t_comb"], what="combine (Triton)", sizes=sizes, bytes=r["bytes_comb"])


def tune(args, results):
    """Launch variants of the two kernels on one problem per size and pattern; returns
    (markdown, best attention variant, best combine variant) by total time."""
    rows = []
    totals: dict = {}
    sms = max(1, common.device_name()[1])

    def record(size, pattern, name, t, rate, note):
        rows.append((size, pattern, name, t, rate, note))
        log(rows[-1])
        results.add(f"tune {common.tokens_label(size)} {pattern}", None if t != t else t, what=name,
                    sizes={"n_seq": 1, "seq_len": size, "pattern": pattern}, rate=rate, note=note)

    for size in args.sizes:
        for pattern in args.tune_patterns:
            p = make_problem(pattern, 1, size)
            sel, bt, cu = p["sel"], p["bt"], p["cu"]
            index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=bt.shape[1], batch_size=1)
            used = int(index.seg_offsets[-1])
            flops = 4 * D * GROUP * useful_keys(sel, size)
            ref = None
            for var in args.attn_variants:
                tq, warps, stages, pps, nreg = var
                sched = m3_sparse.schedule(index, tile_q=tq, num_programs=sms * pps)
                cfg = KVOuterConfig(impl="triton", engine="triton", num_warps=warps, num_stages=stages,
                                    maxnreg=nreg or None)
                fn = partials_call(p, index, sched, cfg)
                name = f"attn tq{tq} w{warps} s{stages} p{pps}" + (f" r{nreg}" if nreg else "")
                try:
                    parts = fn()
                    # The JIT object of the tl kernel: its compiled variant's registers and
                    # spills are what the variants trade against each other.
                    info = common.kernel_info(partials_triton._kvouter_partials_kernel)
                    if ref is None:
                        ref, err = parts, 0.0
                    else:
                        err = o_diff(parts, ref, used)
                        del parts
                    t = common.median_ms(fn)
                    totals[("a", var)] = totals.get(("a", var), 0.0) + t
                    record(size, pattern, name, t, flops / t / 1e9, f"{err:.1e} {info}")
                except Exception as e:  # noqa: BLE001
                    totals[("a", var)] = float("inf")
                    record(size, pattern, name, float("nan"), 0, f"{type(e).__name__}: {str(e)[:80]}")
            for pps in args.tma_programs:
                # The TMA kernel (partials_gluon_sm90) has one launch setting: programs per SM.
                sched = m3_sparse.schedule(index, tile_q=64 // GROUP, num_programs=sms * pps)
                fn = partials_call(p, index, sched, KVOuterConfig(impl="triton", engine="tma"))
                try:
                    parts = fn()
                    err = o_diff(parts, ref, used)
                    del parts
                    t = common.median_ms(fn)
                    totals[("t", ("tma", pps))] = totals.get(("t", ("tma", pps)), 0.0) + t
                    record(size, pattern, f"attn tma p{pps}", t, flops / t / 1e9, f"{err:.1e}")
                except Exception as e:  # noqa: BLE001
                    record(size, pattern, f"attn tma p{pps}", float("nan"), 0, f"{type(e).__name__}: {str(e)[:80]}")
            for var in args.comb_variants:
                brows, warps = var
                fn = lambda: combine_triton(*ref, index.slot_of, rows=brows, num_warps=warps)  # noqa: E731
                fn()
                # The combine kernel's JIT object, for the same register report.
                info = common.kernel_info(combine_module._combine_kernel)
                t = common.median_ms(fn)
                totals[("c", var)] = totals.get(("c", var), 0.0) + t
                gbs = (used * GROUP * (D * 2 + 8) + size * HQ * D * 2) / t / 1e6
                record(size, pattern, f"comb r{brows} w{warps}", t, gbs, info)
            del ref, index, p
            common.empty_cache()
    md = common.md_table(["N", "pattern", "variant", "ms", "TFLOP/s (attn) or GB/s (comb)", "rel. diff / kernel"],
                         [(size, pattern, name, f"{t:.3f}", f"{rate:.0f}", note)
                          for size, pattern, name, t, rate, note in rows])
    best_a = min((v for k_, v in totals if k_ == "a"), key=lambda v: totals[("a", v)])
    best_c = min((v for k_, v in totals if k_ == "c"), key=lambda v: totals[("c", v)])
    return md, best_a, best_c


def table(results):
    head = ["config", "build", "sched", "build torch", "sched torch", "attn", "attn tl", "combine", "module",
            "module, host ahead", "attn TFLOP/s", "module TFLOP/s", "module GB/s", "floor",
            "module/floor (host ahead)", "workspace GB", "cuDNN dense", "Flex", "dense/module (host ahead)", "err",
            "qouter (host ahead)", "union blocks/tile", "module/qouter"]
    rows = []
    for r in results:
        dense = r.get("t_dense")
        rows.append([
            f"{r['name']} {r['pattern']} ({r['engine']})", fmt(r["t_build"]), fmt(r["t_sched"]),
            fmt(r["t_build_torch"]), fmt(r["t_sched_torch"]), fmt(r["t_attn"]), fmt(r["t_attn_tl"]),
            fmt(r["t_comb"]), fmt(r["t_module"]), fmt(r["t_module_ahead"]), f"{r['flops'] / r['t_attn'] / 1e9:.0f}",
            f"{r['flops'] / r['t_module'] / 1e9:.0f}", f"{r['bytes'] / r['t_module'] / 1e6:.0f}", fmt(r["floor"]),
            f"{r['t_module'] / r['floor']:.2f} ({r['t_module_ahead'] / r['floor']:.2f})",
            f"{r['workspace'] / 1e9:.2f}", fmt(dense), fmt(r.get("t_flex")),
            f"{ratio(dense, r['t_module'])} ({ratio(dense, r['t_module_ahead'])})", f"{r['err']:.1e}",
            f"{fmt(r.get('t_qouter'))} ({fmt(r.get('t_qouter_ahead'))})",
            f"{r['union']:.1f}" if "union" in r else "-", ratio(r["t_module"], r.get("t_qouter")),
        ])
    return common.md_table(head, rows)


def attn_variants(text: str, flag: str) -> list[tuple[int, ...]]:
    """tile_q:num_warps:num_stages:programs_per_sm:maxnreg items; a sixth field (the
    former loop form) is accepted as 2 only."""
    out = []
    for vals in common.int_tuples(text, (5, 6), flag):
        if len(vals) == 6 and vals[5] != 2:
            raise SystemExit(f"{flag}: {':'.join(map(str, vals))}: {LOOP_REMOVED}")
        out.append(vals[:5])
    return out


def main():
    ap = common.parser(__doc__, sizes="8192,32768,131072", smoke=True)
    ap.add_argument("--patterns", default="hot,random")
    ap.add_argument("--no-batch", dest="batch", action="store_false", help="skip the 16 x 8K batch")
    ap.add_argument("--no-dense", dest="dense", action="store_false")
    ap.add_argument("--no-flex", dest="flex", action="store_false")
    ap.add_argument("--no-qouter", dest="qouter", action="store_false", help="skip the query-outer tile kernel")
    ap.add_argument("--qouter-variants", default="",
                    help="block_m:block_n:num_warps:num_stages,... launch variants of the query-outer kernel timed "
                         "after its default one (e.g. 128:64:8:2,128:128:8:2,64:64:4:3)")
    ap.add_argument("--flex-configs", default="8K,32K,128K,16x8K", help="configs that run FlexAttention")
    ap.add_argument("--host-profile", action="store_true",
                    help="log where the module's host time goes (cProfile, functions by their own time)")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--then-run", action="store_true", help="after --tune, run the benchmark with the best variants")
    ap.add_argument("--tune-patterns", default="hot", help="selection patterns of --tune")
    ap.add_argument("--run-sizes", default=None, help="sizes of the run after --tune (default 8K,32K,128K)")
    ap.add_argument("--attn-variants", default="4:4:1:4:0,4:4:2:4:0,4:4:3:4:0,8:8:2:2:0",
                    help="--tune: tile_q:num_warps:num_stages:programs_per_sm:maxnreg (0 = none),... of the tl "
                         "kernel (tile_q for G = 16); a sixth field, the former loop form, may only be 2")
    ap.add_argument("--comb-variants", default="8:4,16:4,16:2,32:8", help="rows:num_warps,...")
    ap.add_argument("--attn-config", default=None,
                    help="tile_rows:num_warps:num_stages:programs_per_sm:maxnreg of the main run; warps, stages and "
                         "maxnreg are tl-kernel settings, so engine auto then runs the tl kernel, and --engine tma "
                         "takes only tile_rows and programs_per_sm")
    ap.add_argument("--comb-config", default=None, help="rows:num_warps of the combine stage in the main run")
    ap.add_argument("--tma-programs", default="2,4,8", help="--tune: programs per SM of the TMA kernel")
    ap.add_argument("--engine", default=None, choices=kv_plan.ENGINES,
                    help="partials kernel of the main run (default auto)")
    args = ap.parse_args()
    args.sizes = common.int_list(args.sizes)
    args.sizes_run = common.int_list(args.run_sizes or "8192,32768,131072") if args.tune else args.sizes
    args.patterns = [x for x in args.patterns.split(",") if x]
    args.tune_patterns = [x for x in args.tune_patterns.split(",") if x]
    args.flex_configs = set(args.flex_configs.split(","))
    args.attn_variants = attn_variants(args.attn_variants, "--attn-variants")
    args.comb_variants = common.int_tuples(args.comb_variants, 2, "--comb-variants")
    args.tma_programs = common.int_list(args.tma_programs)
    args.qouter_variants = common.int_tuples(args.qouter_variants, 4, "--qouter-variants")
    base = KVOuterConfig(impl="triton", engine=args.engine or "auto", workspace_bytes=common.UNBOUNDED)

    def main_config(tile_rows, warps, stages, pps, nreg) -> KVOuterConfig:
        """The main run's config from a variant: the schedule's shape, and the tl kernel's
        settings unless the TMA kernel is required (it takes none)."""
        tl = {} if base.engine == "tma" else dict(num_warps=warps, num_stages=stages, maxnreg=nreg or None)
        return dataclasses.replace(base, tile_rows=tile_rows, programs_per_sm=pps, **tl)

    args.cfg = main_config(*attn_variants(args.attn_config, "--attn-config")[0]) if args.attn_config else base
    args.comb = tuple(common.int_tuples(args.comb_config, 2, "--comb-config")[0]) if args.comb_config else (None, None)
    if SMOKE:
        args.sizes = args.sizes_run = [256]
        args.batch, args.dense = False, False
        args.attn_variants, args.comb_variants, args.tma_programs = args.attn_variants[:1], args.comb_variants[:1], [2]
    out_dir = Path(args.out)
    results = common.start_run("bench_kvouter", out_dir, "KV-outer prefill", log)
    log(f"# partials config {args.cfg}, combine rows/warps {args.comb} (None: default)")
    md = ""
    if args.tune:
        md, best_a, best_c = tune(args, results)
        log(md)
        log(f"# best attention variant {best_a}, best combine variant {best_c}")
        if args.then_run:
            tq, w, s_, pps, nreg = best_a
            args.cfg = main_config(tq * GROUP, w, s_, pps, nreg)
            args.comb = tuple(best_c)
            log(f"# partials config {args.cfg}, combine rows/warps {args.comb}")
    if not args.tune or args.then_run:
        rows = []
        jobs = [(common.tokens_label(size), pattern, 1, size) for size in args.sizes_run for pattern in args.patterns]
        if args.batch:
            jobs += [("16x8K", pattern, 16, 8192) for pattern in args.patterns]
        for name, pattern, n_seq, seq_len in jobs:
            r = run_config(name, pattern, n_seq, seq_len, args)
            add_rows(results, r, n_seq, seq_len)
            rows.append(r)
        md = table(rows)
    results.write()
    log.write(out_dir / "bench_kvouter.log", md)
    print()
    print(md)


if __name__ == "__main__":
    main()
