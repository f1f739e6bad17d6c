"""KV-outer MSA prefill on the GPU: per-stage times of the Triton pipeline, against dense
causal SDPA (cuDNN) and FlexAttention with a block mask of the same selections.

Workload (M3_SPEC section 5, issue 3): Hq 64, Hkv 4, D 128, block 128, top-16, bf16, one
causal prefill of N tokens (N in 8K/32K/128K) and a batch of 16 x 8K; selections "hot"
(shared block popularity) and "random" (uniform block scores), local block always kept.

    python3 benchmarks/bench_kvouter.py                        # everything
    python3 benchmarks/bench_kvouter.py --sizes 32768 --no-flex
    python3 benchmarks/bench_kvouter.py --tune --sizes 32768    # kernel launch variants

Times are medians of CUDA-event timings (triton.testing.do_bench, which clears L2 before
every run; every working set here is far larger than L2 anyway). The module is also timed
with the host ahead of the GPU (``bench_host_ahead``), as it runs inside a model's forward:
event timings of one call also count the time the GPU waits for the host's first launches. Logs go to $OUT (or
--out). The last thing printed is a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "torch-ext"))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import m3_sparse  # noqa: E402
from m3_sparse import triton_combine as tcomb  # noqa: E402
from m3_sparse import triton_kvouter as tkv  # noqa: E402
from m3_sparse import triton_kvouter_index as tidx  # noqa: E402
from m3_sparse import triton_scheduler as tsched  # noqa: E402

HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
LOOP_NAMES = {v: k for k, v in tkv.LOOPS.items()}
PEAK_FLOPS = 700e12  # bf16 GEMM 8192^3 on this H200 (M3_SPEC section 3)
PEAK_BYTES = 4.2e12  # device-to-device copy, read + write
LOG = []


def log(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


# --------------------------------------------------------------------------- workload


def make_selection(pattern: str, n: int, gen: torch.Generator, dev) -> torch.Tensor:
    """[n, HKV, TOPK] int32 for one sequence of n tokens, all of them queries."""
    nb = -(-n // BLOCK)
    local = torch.arange(n, device=dev) // BLOCK
    sel = torch.full((n, HKV, TOPK), -1, dtype=torch.int32, device=dev)
    pop = torch.randn(HKV, nb, device=dev, generator=gen)
    kk = min(TOPK - 1, nb)
    chunk = max(1, (1 << 29) // (HKV * nb))  # bound the score buffer to 2 GB
    for t0 in range(0, n, chunk):
        t1 = min(n, t0 + chunk)
        if pattern == "hot":
            score = 2 * pop[None] + 0.5 * torch.randn(t1 - t0, HKV, nb, device=dev, generator=gen)
        elif pattern == "random":
            score = torch.rand(t1 - t0, HKV, nb, device=dev, generator=gen)
        else:
            raise ValueError(pattern)
        visible = torch.arange(nb, device=dev)[None, None, :] < local[t0:t1, None, None]
        score = score.masked_fill(~visible, float("-inf"))
        if kk > 0:
            val, idx = score.topk(kk, -1)
            sel[t0:t1, :, 1 : 1 + kk] = torch.where(val > float("-inf"), idx, -1).to(torch.int32)
        sel[t0:t1, :, 0] = local[t0:t1, None].to(torch.int32)
        del score
    return sel


def make_problem(pattern: str, n_seq: int, seq_len: int, seed: int = 0):
    dev = torch.device(os.environ.get("BENCH_DEVICE", "cuda"))
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    n = n_seq * seq_len
    nb = -(-seq_len // BLOCK)
    q = torch.randn(n, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
    pages = n_seq * nb
    k = torch.randn(pages, HKV, BLOCK, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(pages, HKV, BLOCK, D, device=dev, dtype=torch.bfloat16, generator=gen)
    bt = torch.randperm(pages, device=dev, generator=gen).to(torch.int32).view(n_seq, nb)
    cu = torch.arange(0, n + 1, seq_len, device=dev, dtype=torch.int32)
    kv = torch.full((n_seq,), seq_len, device=dev, dtype=torch.int32)
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


def traffic(index, n_tokens: int) -> dict:
    """Minimum HBM bytes of the pipeline as the seed's model counts them: every entry's
    head-packed Q gather, each selected (kv head, block) K/V read once, raw partials
    written and read back with their m/l, the output written."""
    group = HQ // HKV
    used = int(index.seg_offsets[-1])
    offs = index.seg_offsets
    nsb = int(((offs[1:] - offs[:-1]) > 0).sum())
    q_gather = used * group * D * 2
    kv = nsb * 2 * BLOCK * D * 2
    partial = used * group * (D * 2 + 8)
    out = n_tokens * HQ * D * 2
    return dict(
        used=used, nsb=nsb, attn=q_gather + kv + partial, combine=partial + out + index.slot_of.numel() * 4,
        module=q_gather + kv + 2 * partial + out,
    )


# --------------------------------------------------------------------------- timing


def rel_diff(a: torch.Tensor, b: torch.Tensor, used: int, rows: int = 1 << 18) -> float:
    """Relative L2 difference of two partial buffers over their first and last ``rows`` used
    entries (the whole buffers at 128K would need another 68 GB as fp32); -inf (a row that saw
    no key) counts as 0 on both sides, so two equal buffers give 0."""
    if used == 0:
        return 0.0
    idx = torch.cat([torch.arange(min(rows, used)), torch.arange(max(0, used - rows), used)]).to(a.device)
    x, y = (t[idx].float().nan_to_num(posinf=0.0, neginf=0.0) for t in (a, b))
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def bench(fn, rep_ms=200):
    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def _event_timings(fn, reps, lead_cycles=0):
    """Median event timing of ``fn`` after a 256 MB L2 flush (one warm-up first); with
    ``lead_cycles`` a spin kernel of that many cycles runs between the flush and the start
    event, so the host issues the call while the GPU is busy. Also returns the longest
    host time of one call."""
    fn()
    torch.cuda.synchronize()
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times, host_ms = [], 0.0
    for _ in range(reps):
        cache.zero_()
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host_ms = max(host_ms, (time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2], host_ms


def bench_slow(fn, reps=3):
    """For calls of 100s of ms: one warm-up, then the median of a few event timings."""
    return _event_timings(fn, reps)[0]


_SPIN: dict = {}


def _spin_cycles(ms: float) -> int:
    """Clock cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``ms``."""
    if "per_ms" not in _SPIN:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10**7)
        b.record()
        torch.cuda.synchronize()
        _SPIN["per_ms"] = 10**7 / a.elapsed_time(b)
    return int(ms * _SPIN["per_ms"])


def bench_host_ahead(fn, reps=5, lead_ms=50.0):
    """GPU time of one call whose launches the host has already issued, as inside a model's
    forward pass, where the host runs ahead of the GPU: a spin kernel holds the GPU for
    ``lead_ms`` after the L2 flush while the host enqueues the call. ``bench_slow`` and
    ``do_bench`` instead also count the time the GPU waits for the host's first launches
    and for small kernels launched one after the other. A call whose host side outlasts
    the lead is reported on stderr."""
    t, host_ms = _event_timings(fn, reps, _spin_cycles(lead_ms))
    if host_ms > 0.8 * lead_ms:
        print(f"bench_host_ahead: the host took {host_ms:.1f} ms of the {lead_ms:.0f} ms lead", file=sys.stderr)
    return t


def sampled_check(p, out, lse, n_check=96) -> float:
    """Relative RMS error of sampled output rows against an fp32 torch computation."""
    q, k, v, sel, bt, cu, kv = (p[x] for x in ("q", "k", "v", "sel", "bt", "cu", "kv"))
    n = q.shape[0]
    tokens = torch.cat([torch.arange(0, n_check // 2, device=q.device), torch.arange(n - n_check // 2, n, device=q.device)])
    group = HQ // HKV
    seq = torch.searchsorted(cu[1:].long(), tokens, right=True)
    pos = kv.long()[seq] - cu.long()[seq + 1] + tokens
    s_sel = sel[tokens].long()
    kpos = s_sel.clamp(min=0)[..., None] * BLOCK + torch.arange(BLOCK, device=q.device)
    vis = (s_sel >= 0)[..., None] & (kpos <= pos[:, None, None, None])
    page = bt.long()[seq[:, None, None, None], (kpos // BLOCK).clamp(max=bt.shape[1] - 1)]
    heads = torch.arange(HKV, device=q.device)[None, :, None, None]
    kk = k[page, heads, kpos % BLOCK].float().flatten(2, 3)
    vv = v[page, heads, kpos % BLOCK].float().flatten(2, 3)
    qq = q[tokens].float().view(-1, HKV, group, D)
    s = torch.einsum("nhgd,nhkd->nhgk", qq, kk) * D**-0.5
    s = s.masked_fill(~vis.flatten(2, 3)[:, :, None, :], float("-inf"))
    ref = torch.einsum("nhgk,nhkd->nhgd", torch.softmax(s, -1), vv).reshape(-1, HQ, D)
    ref_lse = torch.logsumexp(s, -1).reshape(-1, HQ).T
    err = (out[tokens].float() - ref).norm() / ref.norm()
    err_lse = (lse[:, tokens] - ref_lse).norm() / ref_lse.norm()
    return max(float(err), float(err_lse))


# --------------------------------------------------------------------------- baselines


def dense_cudnn(p) -> tuple[float | None, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    b, s = p["n_seq"], p["seq_len"]
    q = p["q"].view(b, s, HQ, D).transpose(1, 2)
    k = torch.randn(b, HKV, s, D, device=q.device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    note = "gqa"
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
            t = bench_slow(fn) if s * b >= 32768 else bench(fn)
    except RuntimeError as e:  # cuDNN without native GQA: heads expanded
        log(f"  cudnn enable_gqa failed ({str(e).splitlines()[0][:120]}); expanding K/V heads")
        note = "expanded kv"
        k = k.repeat_interleave(HQ // HKV, 1)
        v = v.repeat_interleave(HQ // HKV, 1)
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
                t = bench_slow(fn) if s * b >= 32768 else bench(fn)
        except RuntimeError as e2:
            return None, f"failed: {str(e2).splitlines()[0][:80]}"
    del k, v
    return t, note


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
    group = HQ // HKV
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
    kv_num = union.sum(-1).to(torch.int32).repeat_interleave(group, 1)
    kv_idx = torch.argsort((~union).to(torch.int8), dim=-1, stable=True).to(torch.int32).repeat_interleave(group, 1)
    mean_union = float(kv_num.float().mean())
    del union

    def mask_mod(bb, h, q_idx, kv_idx_):
        return (kv_idx_ <= q_idx) & dense[bb, h // group, q_idx, kv_idx_ // BLOCK]

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
    torch.cuda.synchronize()
    log(f"  flex first call (compile) {time.time() - t0:.1f} s")
    t = bench_slow(fn) if s * b >= 32768 else bench(fn)
    del call, k, v
    return t, note


# --------------------------------------------------------------------------- main runs


def run_config(name, pattern, n_seq, seq_len, args):
    log(f"== {name} {pattern}")
    p = make_problem(pattern, n_seq, seq_len, seed=zlib.crc32(f"{pattern}{n_seq}x{seq_len}".encode()))
    q, k, v, sel, bt, cu, kv = (p[x] for x in ("q", "k", "v", "sel", "bt", "cu", "kv"))
    n = q.shape[0]
    group = HQ // HKV
    max_blocks = bt.shape[1]
    tile_q = tkv.default_tile_q(group)
    nprog = tkv.default_num_programs(q.device)
    scale = D**-0.5
    build = lambda: tidx.build_kvouter_index_triton(sel, cu_seqlens_q=cu, max_blocks=max_blocks, batch_size=n_seq)  # noqa: E731
    build_torch = lambda: m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=max_blocks, batch_size=n_seq)  # noqa: E731
    index = build()
    sched = tsched.schedule_triton(index, tile_q=tile_q, num_programs=nprog)
    # The Triton builder and scheduler must reproduce the torch ones exactly.
    index_torch = build_torch()
    for f in ("seg_offsets", "entry_token", "entry_rank", "entry_segment", "slot_of"):
        if not torch.equal(getattr(index, f), getattr(index_torch, f)):
            raise SystemExit(f"{name} {pattern}: Triton index builder differs from torch in {f}")
    sched_torch = m3_sparse.schedule(index_torch, tile_q=tile_q, num_programs=nprog)
    for f in ("tile_segment", "tile_start", "tile_end", "num_tiles", "program_tiles"):
        if not torch.equal(getattr(sched, f), getattr(sched_torch, f)):
            raise SystemExit(f"{name} {pattern}: Triton scheduler differs from torch in {f}")
    del index_torch, sched_torch
    attn_eng = lambda eng: lambda: tkv.kvouter_partials_triton(  # noqa: E731
        q, k, v, index, sched, bt, cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=scale, causal=True, block_size=BLOCK,
        engine=eng,
    )
    attn, attn_tl = attn_eng(None), attn_eng("triton")
    parts = attn()
    parts_tl = attn_tl()
    # o, m and l of the default engine against the tl kernel on the same schedule.
    eng_diff = max(rel_diff(x, y, int(index.seg_offsets[-1])) for x, y in zip(parts, parts_tl))
    del parts_tl
    comb = lambda: tcomb.combine_triton(*parts, index.slot_of, out_dtype=q.dtype, return_lse=False)  # noqa: E731
    module = lambda: tkv.kvouter_attention_triton(q, k, v, sel, bt, cu_seqlens_q=cu, used_kv_lens=kv)  # noqa: E731
    out, lse = tkv.kvouter_attention_triton(q, k, v, sel, bt, cu_seqlens_q=cu, used_kv_lens=kv, return_lse=True)
    err = sampled_check(p, out, lse)
    del out, lse
    # The kernel "attn" ran: the TMA kernel where it applies under the configured engine.
    ran = "tma" if tkv.tma_reason(q, k, v, BLOCK, None, None, tile_q, index.capacity * group) is None else "triton"
    r = dict(name=name, pattern=pattern, n=n, err=err, eng_diff=eng_diff, engine=ran)
    r["t_build"] = bench(build)
    r["t_sched"] = bench(lambda: tsched.schedule_triton(index, tile_q=tile_q, num_programs=nprog))
    r["t_build_torch"] = bench(build_torch)
    r["t_sched_torch"] = bench(lambda: m3_sparse.schedule(index, tile_q=tile_q, num_programs=nprog))
    r["t_attn"] = bench(attn)
    r["t_attn_tl"] = bench(attn_tl)
    r["t_comb"] = bench(comb)
    del parts
    r["t_module"] = bench(module)
    r["t_module_ahead"] = bench_host_ahead(module)
    keys = useful_keys(sel, seq_len)
    r["flops"] = 4 * D * group * keys
    tr = traffic(index, n)
    r.update(bytes_attn=tr["attn"], bytes_comb=tr["combine"], bytes=tr["module"], nsb=tr["nsb"], used=tr["used"])
    r["floor"] = max(r["flops"] / PEAK_FLOPS, tr["module"] / PEAK_BYTES) * 1e3
    cap = index.capacity
    ws = cap * group * (D * 2 + 8)  # partials
    ws += sum(t.numel() * t.element_size() for t in (index.seg_offsets, index.entry_token, index.entry_rank, index.entry_segment, index.slot_of))
    ws += sum(t.numel() * t.element_size() for t in (sched.tile_segment, sched.tile_start, sched.tile_end, sched.program_tiles))
    r["workspace"] = ws
    r["num_tiles"] = int(sched.num_tiles[0])
    del index, sched
    torch.cuda.empty_cache()
    log(
        f"  build {r['t_build']:.3f} (torch {r['t_build_torch']:.3f}) sched {r['t_sched']:.3f} "
        f"(torch {r['t_sched_torch']:.3f}) attn [{ran}] {r['t_attn']:.3f} (tl kernel {r['t_attn_tl']:.3f}, "
        f"rel. diff {eng_diff:.1e}) comb {r['t_comb']:.3f} "
        f"module {r['t_module']:.3f} ms (host ahead {r['t_module_ahead']:.3f}) | attn {r['flops'] / r['t_attn'] / 1e9:.0f} TFLOP/s, "
        f"attn {tr['attn'] / r['t_attn'] / 1e6:.0f} GB/s, comb {tr['combine'] / r['t_comb'] / 1e6:.0f} GB/s | "
        f"floor {r['floor']:.2f} ms | err {err:.2e} | tiles {r['num_tiles']} nsb {r['nsb']}"
    )
    if args.dense:
        if name not in DENSE_DONE:  # dense attention does not depend on the selections
            DENSE_DONE[name] = dense_cudnn(p)
            log(f"  cudnn dense {fmt(DENSE_DONE[name][0], 3)} ms ({DENSE_DONE[name][1]})")
        r["t_dense"], r["dense_note"] = DENSE_DONE[name]
    if args.flex and name in args.flex_configs:
        try:
            r["t_flex"], r["flex_note"] = flex(p)
        except Exception as e:  # noqa: BLE001
            r["t_flex"], r["flex_note"] = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        log(f"  flex {r['t_flex']} ms ({r['flex_note']})")
    else:
        r["t_flex"], r["flex_note"] = None, "skipped (device-time budget)"
    del p, q, k, v, sel
    torch.cuda.empty_cache()
    return r


DENSE_DONE: dict = {}


def kernel_info(kernel) -> str:
    """Registers, spills and shared memory of the kernel's latest compiled variant."""
    try:
        caches = getattr(kernel, "device_caches", None)
        compiled = list(next(iter(caches.values()))[0].values())[-1]
        return f"regs {compiled.n_regs} spills {compiled.n_spills} smem {compiled.metadata.shared // 1024}K"
    except Exception as e:  # noqa: BLE001
        return f"(no info: {type(e).__name__})"


def tune(args):
    """Launch variants of the two kernels on one problem per size and pattern; returns
    (markdown, best attention variant, best combine variant) by total time."""
    rows = []
    totals: dict = {}
    for size in args.sizes:
        for pattern in args.tune_patterns:
            p = make_problem(pattern, 1, size)
            q, k, v, sel, bt, cu, kv = (p[x] for x in ("q", "k", "v", "sel", "bt", "cu", "kv"))
            group = HQ // HKV
            index = m3_sparse.build_kvouter_index(sel, cu_seqlens_q=cu, max_blocks=bt.shape[1], batch_size=1)
            used = int(index.seg_offsets[-1])
            flops = 4 * D * group * useful_keys(sel, size)
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            ref = None
            for var in args.attn_variants:
                tq, warps, stages, pps, nreg, lp = var
                sched = m3_sparse.schedule(index, tile_q=tq, num_programs=sms * pps)
                fn = lambda: tkv.kvouter_partials_triton(  # noqa: E731
                    q, k, v, index, sched, bt, cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=D**-0.5,
                    block_size=BLOCK, num_warps=warps, num_stages=stages, maxnreg=nreg or None, loop=LOOP_NAMES[lp],
                )
                name = f"attn tq{tq} w{warps} s{stages} p{pps}" + (f" r{nreg}" if nreg else "") + f" {LOOP_NAMES[lp]}"
                try:
                    parts = fn()
                    info = kernel_info(tkv._kvouter_partials_kernel)
                    if ref is None:
                        ref, err = parts, 0.0
                    else:
                        err = rel_diff(parts[0], ref[0], used)
                        del parts
                    t = bench(fn)
                    totals[("a", var)] = totals.get(("a", var), 0.0) + t
                    rows.append((size, pattern, name, t, flops / t / 1e9, f"{err:.1e} {info}"))
                except Exception as e:  # noqa: BLE001
                    totals[("a", var)] = float("inf")
                    rows.append((size, pattern, name, float("nan"), 0, f"{type(e).__name__}: {str(e)[:80]}"))
                log(rows[-1])
            for pps in args.tma_programs:
                # The TMA kernel (gluon_kvouter) has one launch setting: programs per SM.
                var = ("tma", pps)
                sched = m3_sparse.schedule(index, tile_q=64 // group, num_programs=sms * pps)
                fn = lambda: tkv.kvouter_partials_triton(  # noqa: E731
                    q, k, v, index, sched, bt, cu_seqlens_q=cu, used_kv_lens=kv, softmax_scale=D**-0.5,
                    block_size=BLOCK, engine="tma",
                )
                try:
                    parts = fn()
                    err = rel_diff(parts[0], ref[0], used)
                    del parts
                    t = bench(fn)
                    totals[("t", var)] = totals.get(("t", var), 0.0) + t
                    rows.append((size, pattern, f"attn tma p{pps}", t, flops / t / 1e9, f"{err:.1e}"))
                except Exception as e:  # noqa: BLE001
                    rows.append((size, pattern, f"attn tma p{pps}", float("nan"), 0, f"{type(e).__name__}: {str(e)[:80]}"))
                log(rows[-1])
            for var in args.comb_variants:
                brows, warps = var
                fn = lambda: tcomb.combine_triton(*ref, index.slot_of, rows=brows, num_warps=warps)  # noqa: E731
                fn()
                info = kernel_info(tcomb._combine_kernel)
                t = bench(fn)
                totals[("c", var)] = totals.get(("c", var), 0.0) + t
                gbs = (used * group * (D * 2 + 8) + size * HQ * D * 2) / t / 1e6
                rows.append((size, pattern, f"comb r{brows} w{warps}", t, gbs, info))
                log(rows[-1])
            del ref, index, p, q, k, v, sel
            torch.cuda.empty_cache()
    lines = ["| N | pattern | variant | ms | TFLOP/s (attn) or GB/s (comb) | rel. diff / kernel |", "|---|---|---|---|---|---|"]
    for size, pattern, name, t, rate, note in rows:
        lines.append(f"| {size} | {pattern} | {name} | {t:.3f} | {rate:.0f} | {note} |")
    best_a = min((v for k_, v in totals if k_ == "a"), key=lambda v: totals[("a", v)])
    best_c = min((v for k_, v in totals if k_ == "c"), key=lambda v: totals[("c", v)])
    return "\n".join(lines), best_a, best_c


def fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def ratio(a, b) -> str:
    return f"{a / b:.1f}" if a and b else "-"


def table(results):
    head = (
        "| config | build | sched | build torch | sched torch | attn | attn tl | combine | module | module, host ahead | "
        "attn TFLOP/s | module TFLOP/s | module GB/s | floor | module/floor (host ahead) | workspace GB | cuDNN dense | "
        "Flex | dense/module (host ahead) | err |"
    )
    lines = [head, "|" + "---|" * 20]
    for r in results:
        dense = r.get("t_dense")
        lines.append(
            f"| {r['name']} {r['pattern']} ({r['engine']}) | {fmt(r['t_build'])} | {fmt(r['t_sched'])} | {fmt(r['t_build_torch'])} | "
            f"{fmt(r['t_sched_torch'])} | {fmt(r['t_attn'])} | {fmt(r['t_attn_tl'])} | "
            f"{fmt(r['t_comb'])} | {fmt(r['t_module'])} | {fmt(r['t_module_ahead'])} | "
            f"{r['flops'] / r['t_attn'] / 1e9:.0f} | "
            f"{r['flops'] / r['t_module'] / 1e9:.0f} | {r['bytes'] / r['t_module'] / 1e6:.0f} | {fmt(r['floor'])} | "
            f"{r['t_module'] / r['floor']:.2f} ({r['t_module_ahead'] / r['floor']:.2f}) | {r['workspace'] / 1e9:.2f} | "
            f"{fmt(dense)} | {fmt(r.get('t_flex'))} | {ratio(dense, r['t_module'])} ({ratio(dense, r['t_module_ahead'])}) | "
            f"{r['err']:.1e} |"
        )
    return "\n".join(lines)


def parse_variants(s, n):
    out = []
    for item in s.split(","):
        if item:
            vals = tuple(int(x) for x in item.split(":"))
            assert len(vals) == n, item
            out.append(vals)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--patterns", default="hot,random")
    ap.add_argument("--no-batch", dest="batch", action="store_false", help="skip the 16 x 8K batch")
    ap.add_argument("--no-dense", dest="dense", action="store_false")
    ap.add_argument("--no-flex", dest="flex", action="store_false")
    ap.add_argument("--flex-configs", default="8K,32K,128K,16x8K", help="configs that run FlexAttention")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--then-run", action="store_true", help="after --tune, run the benchmark with the best variants")
    ap.add_argument("--tune-patterns", default="hot", help="selection patterns of --tune")
    ap.add_argument("--run-sizes", default=None, help="sizes of the run after --tune (default 8K,32K,128K)")
    ap.add_argument("--attn-variants", default="4:4:1:4:0:2,4:4:2:4:0:2,4:4:3:4:0:2,8:8:2:2:0:2,4:4:2:4:0:1,4:4:2:4:0:0",
                    help="tile_q:num_warps:num_stages:programs_per_sm:maxnreg (0 = none):loop (0 staged, 1 prefetch, "
                         "2 resident),... (tile_q for G = 16)")
    ap.add_argument("--comb-variants", default="8:4,16:4,16:2,32:8", help="rows:num_warps,...")
    ap.add_argument("--attn-config", default=None, help="tile_rows:num_warps:num_stages:programs_per_sm:maxnreg:loop")
    ap.add_argument("--comb-config", default=None, help="rows:num_warps for the main run")
    ap.add_argument("--tma-programs", default="2,4,8", help="--tune: programs per SM of the TMA kernel")
    ap.add_argument("--engine", default=None, choices=tkv.ENGINES, help="partials kernel of the main run (default: ATTN_CONFIG)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",") if x]
    args.sizes_run = [int(x) for x in (args.run_sizes or "8192,32768,131072").split(",") if x] if args.tune else args.sizes
    args.patterns = [x for x in args.patterns.split(",") if x]
    args.tune_patterns = [x for x in args.tune_patterns.split(",") if x]
    args.flex_configs = set(args.flex_configs.split(","))
    args.attn_variants = parse_variants(args.attn_variants, 6)
    args.comb_variants = parse_variants(args.comb_variants, 2)
    args.tma_programs = [int(x) for x in args.tma_programs.split(",") if x]
    if args.engine:
        tkv.ATTN_CONFIG["engine"] = args.engine
    if args.attn_config:
        tr, w, s_, pps, nreg, lp = (int(x) for x in args.attn_config.split(":"))
        tkv.ATTN_CONFIG.update(
            tile_rows=tr, num_warps=w, num_stages=s_, programs_per_sm=pps, maxnreg=nreg or None, loop=LOOP_NAMES[lp]
        )
    if args.comb_config:
        r_, w = (int(x) for x in args.comb_config.split(":"))
        tcomb.COMBINE_CONFIG.update(rows=r_, num_warps=w)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    props = torch.cuda.get_device_properties(0)
    log(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {props.name} ({props.multi_processor_count} SMs), "
        f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}")
    log(f"# attn config {tkv.ATTN_CONFIG}, combine config {tcomb.COMBINE_CONFIG}")
    log("# " + " ".join(sys.argv))
    md = ""
    if args.tune:
        md, best_a, best_c = tune(args)
        log(md)
        log(f"# best attention variant {best_a}, best combine variant {best_c}")
        if args.then_run:
            tq, w, s_, pps, nreg, lp = best_a
            tkv.ATTN_CONFIG.update(
                tile_rows=tq * (HQ // HKV), num_warps=w, num_stages=s_, programs_per_sm=pps, maxnreg=nreg or None,
                loop=LOOP_NAMES[lp],
            )
            tcomb.COMBINE_CONFIG.update(rows=best_c[0], num_warps=best_c[1])
            log(f"# attn config {tkv.ATTN_CONFIG}, combine config {tcomb.COMBINE_CONFIG}")
    if not args.tune or args.then_run:
        results = []
        for size in args.sizes_run:
            name = f"{size // 1024}K"
            for pattern in args.patterns:
                results.append(run_config(name, pattern, 1, size, args))
        if args.batch:
            for pattern in args.patterns:
                results.append(run_config("16x8K", pattern, 16, 8192, args))
        (out_dir / "bench_kvouter.json").write_text(json.dumps(results, indent=1))
        md = table(results)
    (out_dir / "bench_kvouter.log").write_text("\n".join(LOG) + "\n\n" + md + "\n")
    print()
    print(md)


if __name__ == "__main__":
    main()
