"""Sparse decode attention on the GPU: the query-outer decode kernel (``sparse_decode_attention``,
``decode/attention_triton.py``) against KV-outer (``kvouter_attention``), dense decode attention
with SDPA and the HBM floor, then the crossover in query tokens per sequence.

Workload (M3_SPEC sections 1 and 5): Hq 64, Hkv 4, D 128, block 128, top-16, bf16, K/V in a
paged cache (page 128, and 64) under a shuffled block table; every query token selects its
local block plus 15 random earlier blocks ("random"; ``--pattern hot`` for shared popularity).

    python3 benchmarks/bench_decode.py            # launch sweep, (a) decode, (b) crossover
    python3 benchmarks/bench_decode.py --quick    # a tiny smoke run of every code path

Sections:

* sweep: launch variants of the decode kernel (``DecodeConfig``: keys per chunk, warps,
  pipeline stages, programs per SM, which sets the split count) at batch 32 x the largest
  context; the fastest config is passed to every decode call of the rest of the run (the
  default config is timed as well);
* (a) decode, batch 32, one new token per sequence, each context: the decode kernel
  (eager call of the public entry, and one call captured in a CUDA graph and replayed),
  ``kvouter_attention`` (the module: Triton index build, schedule, partials and
  combine; eager, and graph-captured if it captures), dense SDPA over the full context on a
  contiguous [B, Hkv, S, D] cache (the backend that accepted the shapes is named), and the
  floor: bytes of the distinct selected K/V blocks (visible keys only) + q + out at 4.2 TB/s;
* (b) crossover: the last n tokens of each sequence as queries, n in --q-tokens, one
  sequence of each context and batch variants; decode vs KV-outer, with the reuse
  ``(token, head) selections / distinct selected blocks`` and ``nsb / N``;
* (d) mixed step (``--mixed CHUNK``): a serving step at the largest context, one prefill chunk
  of CHUNK queries beside --batch decode rows. ``sparse_attention`` (KV-outer for the chunk,
  the decode kernel's short rows for the decode rows) against ``kvouter_attention`` over every
  row (what a mixed step ran before), and the two parts alone: the chunk through KV-outer, the
  decode rows through the decode kernel.

"in-graph" times a call inside a graph of 20 calls, each after a 256 MB L2 flush, minus the
flushes alone (``common.in_graph_ms``); the flush zeroes a buffer (the L2 is left full of
dirty lines, which the call writes back while it reads) or, for the "clean L2" columns, sums
it (clean lines: the call moves its own bytes only, as after the index kernel in a decode
step).

Every configuration is checked against an fp32 torch computation on sampled tokens before
it is timed. Times: ``triton.testing.do_bench`` medians (L2 cleared before every run), in
microseconds. The last thing printed is a markdown table, also written to
``<out>/bench_decode.md`` (with the log in ``bench_decode.log`` and the result rows in
``bench_decode.json``).
"""

from __future__ import annotations

import time
from pathlib import Path

import common
from common import BLOCK, D, DEVICE as DEV, GROUP as G, HKV, HQ, PEAK_BYTES, SMOKE, TOPK, canon, fmt
from common import tokens_label as kib

import torch  # noqa: E402

import m3_sparse  # noqa: E402
from m3_sparse import DecodeConfig, IndexConfig  # noqa: E402
from m3_sparse.core.launch import MAX_SPLITS  # noqa: E402
from m3_sparse.decode import attention_triton as decode_triton  # noqa: E402
from m3_sparse.decode import plan as decode_plan  # noqa: E402

log = common.Log()


# --------------------------------------------------------------------------- workload


class Pool:
    """K/V of ``batch`` sequences of ``ctx`` tokens each in a paged cache with a shuffled
    block table; problems take the first sequences of it."""

    def __init__(self, ctx: int, page: int, batch: int, seed: int = 0):
        gen = torch.Generator(device=DEV)
        gen.manual_seed(seed)
        self.ctx, self.page, self.batch, self.gen = ctx, page, batch, gen
        w = -(-ctx // page)
        self.k, self.v = common.paged_kv(gen, batch * w, page)
        self.bt = common.shuffled_tables(gen, batch, w)

    def problem(self, b: int, n: int, pattern: str) -> dict:
        """``b`` sequences of ``ctx`` tokens, the last ``n`` of each are this call's queries."""
        dev = self.k.device
        q = torch.randn(b * n, HQ, D, device=dev, dtype=torch.bfloat16, generator=self.gen)
        cu, kv = common.varlen(b, n, self.ctx, dev)
        pos = (self.ctx - n + torch.arange(n, device=dev)).repeat(b)  # [b * n]
        nb = -(-self.ctx // BLOCK)
        pop = torch.randn(b, HKV, nb, device=dev, generator=self.gen) if pattern == "hot" else None
        sel = common.block_selection(pattern, pos, nb, self.gen, popularity=pop,
                                     row_group=torch.arange(b * n, device=dev) // n, chunk_elems=1 << 28)
        return dict(q=q, k=self.k, v=self.v, bt=self.bt[:b].contiguous(), cu=cu, kv=kv, sel=sel, b=b, n=n, pos=pos)


def reuse_stats(p: dict) -> dict:
    """Distinct selected (sequence, kv head, block)s, their visible keys (the floor's K/V
    bytes), and the selections per distinct block."""
    sel, pos, b, n = p["sel"].long(), p["pos"], p["b"], p["n"]
    nb = p["bt"].shape[1] * p["k"].shape[2] // BLOCK
    seq = torch.arange(b * n, device=sel.device) // n
    key = (seq[:, None, None] * HKV + torch.arange(HKV, device=sel.device)[None, :, None]) * nb + sel
    valid = sel >= 0
    # Visible keys of a block: up to the latest query of the sequence that selected it.
    last = torch.full((b * HKV * nb,), -1, dtype=torch.int64, device=sel.device)
    last.scatter_reduce_(0, key[valid], pos[:, None, None].expand_as(sel)[valid], reduce="amax")
    blk = torch.arange(b * HKV * nb, device=sel.device) % nb
    keys = (last - blk * BLOCK + 1).clamp(min=0, max=BLOCK)
    nsb = int((last >= 0).sum())
    selections = int(valid.sum())
    return dict(nsb=nsb, keys=int(keys.sum()), selections=selections, N=b * n)


def floor_us(p: dict, st: dict, kv_bytes_per_value: int = 2) -> float:
    kv_bytes = st["keys"] * D * kv_bytes_per_value * 2  # K and V
    qo_bytes = 2 * p["q"].numel() * 2
    return (kv_bytes + qo_bytes) / PEAK_BYTES * 1e6


# bf16 output rounding is ~4e-3 relative; anything far above it is a wrong result.
ERR_LIMIT = 2e-2


def check(p: dict, out: torch.Tensor, lse: torch.Tensor) -> float:
    """Max relative RMS error (out, lse) on the first and last sampled tokens."""
    err = common.sampled_error(p, out, lse, 8)
    if not err <= ERR_LIMIT:
        log(f"  CHECK FAILED: relative error {err:.2e} against the fp32 reference (limit {ERR_LIMIT:.0e})")
    return err


# --------------------------------------------------------------------------- timing (microseconds)


def bench(fn, rep_ms: int = 100) -> float:
    """Median microseconds (L2 cleared before every run)."""
    return common.median_ms(fn, warmup=10, rep=rep_ms) * 1e3


def bench_graph(fn, rep_ms: int = 100) -> float:
    return common.graph_replay_ms(fn, warmup=10, rep=rep_ms) * 1e3


def in_graph(fn, flush_mode: str = "write") -> float:
    return common.in_graph_ms(fn, flush_mode=flush_mode) * 1e3


KVOUTER_GRAPH = {"ok": True, "why": ""}


def bench_kvouter_graph(fn) -> float | None:
    """KV-outer captured in a graph, once it is known to capture (first failure disables it)."""
    if not KVOUTER_GRAPH["ok"]:
        return None
    try:
        return bench_graph(fn)
    except Exception as e:  # noqa: BLE001
        KVOUTER_GRAPH.update(ok=False, why=f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
        log(f"  kvouter_attention does not capture in a CUDA graph ({KVOUTER_GRAPH['why']}); eager only from here")
        try:
            common.sync()
        except Exception as e2:  # noqa: BLE001
            log(f"  after the failed capture: {type(e2).__name__}: {str(e2).splitlines()[0][:100]}")
        return None


# --------------------------------------------------------------------------- calls


def decode_call(p: dict, cfg: DecodeConfig, return_lse: bool = False):
    """The public entry; ``k_scale`` / ``v_scale`` of an fp8 problem passed along."""
    scales = {x: p[x] for x in ("k_scale", "v_scale") if x in p}
    return lambda: m3_sparse.sparse_decode_attention(  # noqa: E731
        p["q"], p["k"], p["v"], p["sel"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], block_size=BLOCK,
        return_lse=return_lse, config=cfg, **scales,
    )


def kernel_call(p: dict, cfg: DecodeConfig, counts: torch.Tensor | None = None, sel: torch.Tensor | None = None):
    """The decode kernels on the Triton path whatever the dispatch, with ``cfg``'s launch and,
    given ``counts``, the in-place merge's arrival counts kept by the caller."""
    return lambda: decode_triton.sparse_decode_attention_triton(  # noqa: E731
        p["q"], p["k"], p["v"], p["sel"] if sel is None else sel, p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"],
        softmax_scale=D**-0.5, causal=True, block_size=BLOCK, return_lse=False, config=cfg, arrival_counts=counts,
    )


def splits_of(p: dict, cfg: DecodeConfig) -> int:
    """The split count ``cfg`` gives this problem (its own, or the default from the shapes)."""
    return cfg.num_splits or decode_plan.default_num_splits(
        p["q"].shape[0], HKV, TOPK, BLOCK, p["q"].device, block_n=cfg.block_n, cfg=cfg
    )


def fp8_problem(p: dict) -> dict:
    """The same problem with K/V in e4m3 and per-tensor scales (q stays bf16)."""
    out = dict(p)
    for name in ("k", "v"):
        out[name], out[f"{name}_scale"] = common.e4m3_tensor(p[name])
    return out


def kvouter_call(p: dict, return_lse: bool = False):
    return lambda: m3_sparse.kvouter_attention(  # noqa: E731
        p["q"], p["k"], p["v"], p["sel"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], block_size=BLOCK,
        return_lse=return_lse,
    )


def dense_sdpa(p: dict, ctx: int) -> tuple[float | None, str]:
    """Dense decode attention over the full context, one query per sequence, on a contiguous
    [B, Hkv, S, D] cache. With one query and no mask the G heads of a kv head are G query
    rows of the same K/V, so q is viewed as [B, Hkv, G, D] (no GQA expansion needed)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = p["b"]
    q = p["q"].view(b, HKV, G, D)
    k = torch.randn(b, HKV, ctx, D, device=q.device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    result = (None, "no backend accepted the shapes")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                fn = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
                fn()
                common.sync()
                result = (bench(fn), backend.name.lower().replace("_attention", ""))
            break
        except RuntimeError as e:
            log(f"  sdpa {backend.name} refused: {str(e).splitlines()[0][:100]}")
    k = v = fn = None  # free the dense cache before the next configuration
    common.empty_cache()
    return result


# --------------------------------------------------------------------------- sections


def variant_config(var) -> DecodeConfig:
    bn, w, s_, pps, fused, _keep, forced = var
    return DecodeConfig(block_n=bn, num_warps=w, num_stages=s_, programs_per_sm=pps, fused_merge=bool(fused),
                        num_splits=forced or None)


def sweep(pool: Pool, args, results) -> tuple[DecodeConfig, list]:
    """Launch variants at batch args.batch x 1 token; returns (best config, table rows)."""
    p = pool.problem(min(args.batch, pool.batch), 1, args.pattern)
    st = reuse_stats(p)
    fl = floor_us(p, st)
    ref = kernel_call(p, DecodeConfig())()
    kept = torch.zeros(p["q"].shape[0] * HKV, dtype=torch.int32, device=DEV)
    best, best_t = None, float("inf")
    rows = []
    for var in args.variants:
        bn, w, s_, pps, fused, keep, forced = var
        cfg = variant_config(var)
        splits = splits_of(p, cfg)
        fn = kernel_call(p, cfg, kept if keep else None)
        try:
            out, _ = fn()
            diff = float((out.float() - ref[0].float()).norm() / ref[0].float().norm())
            if diff > 2e-2:
                raise RuntimeError(f"differs from the default launch by {diff:.2e}")
            # The decode kernel's JIT object: registers and spills of the variant just compiled.
            info = common.kernel_info(decode_triton._decode_split_kernel)
            t = bench_graph(fn)
            ta = in_graph(fn)
            tc = in_graph(fn, flush_mode="read")
        except Exception as e:  # noqa: BLE001
            t = ta = tc = float("nan")
            info = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        merge = ("in place, kept counts" if keep else "in place") if fused and splits > 1 else "kernel" if splits > 1 else "-"
        rows.append([bn, w, s_, pps, merge, splits, f"{t:.1f}", f"{t / fl:.2f}", f"{ta:.1f}", f"{ta / fl:.2f}",
                     f"{tc:.1f}", f"{tc / fl:.2f}", info])
        log(" | ".join(map(str, rows[-1])))
        results.add(f"sweep B={p['b']} ctx={kib(pool.ctx)} page {pool.page}", None if t != t else t / 1e3,
                    what=f"decode kernel: block_n {bn}, warps {w}, stages {s_}, programs/SM {pps}, merge {merge}"
                    + (f", {forced} splits forced" if forced else ""),
                    sizes={"batch": p["b"], "ctx": pool.ctx, "page": pool.page},
                    in_graph_us=ta, in_graph_clean_us=tc, floor_us=fl, splits=splits, kernel=info)
        # Kept counts and forced split counts are call arguments, not settings the run carries on with.
        if t < best_t and not keep and not forced:
            best, best_t = cfg, t
    log(f"  floor {fl:.1f} us; best {best} at {best_t:.1f} us")
    del p, ref
    return best or DecodeConfig(), rows


def checked(section: str, pool: Pool, p: dict, cfg: DecodeConfig) -> tuple[dict, dict]:
    """(the row of a problem: its reuse statistics, floor and both kernels' errors against
    the fp32 reference, the statistics alone)."""
    st = reuse_stats(p)
    r = dict(section=section, ctx=pool.ctx, page=pool.page, b=p["b"], n=p["n"], **st)
    r["floor"] = floor_us(p, st)
    out, lse = decode_call(p, cfg, True)()
    r["err_decode"] = check(p, out, lse)
    out, lse = kvouter_call(p, True)()
    r["err_kvouter"] = check(p, out, lse)
    return r, st


def decode_section(pool: Pool, args, default_cfg: DecodeConfig, cfg: DecodeConfig) -> dict:
    """(a): batch args.batch, 1 new token each."""
    p = pool.problem(min(args.batch, pool.batch), 1, args.pattern)
    r, st = checked("a", pool, p, cfg)
    r["decode_default_graph"] = bench_graph(decode_call(p, default_cfg))
    r["decode_eager"] = bench(decode_call(p, cfg))
    r["decode_graph"] = bench_graph(decode_call(p, cfg))
    r["decode_in_graph"] = in_graph(decode_call(p, cfg))
    r["decode_in_graph_clean"] = in_graph(decode_call(p, cfg), flush_mode="read")
    r["splits"] = splits_of(p, cfg)
    r["kvouter_eager"] = bench(kvouter_call(p))
    r["kvouter_graph"] = bench_kvouter_graph(kvouter_call(p))
    if args.dense:
        r["dense"], r["dense_backend"] = dense_sdpa(p, pool.ctx)
    if args.fp8:
        # fp8 K/V: half the K/V bytes; the error is against the bf16 inputs (quantization included).
        p8 = fp8_problem(p)
        out, lse = decode_call(p8, cfg, True)()
        r["err_fp8"] = check(p, out, lse)
        del out, lse
        r["decode_fp8_graph"] = bench_graph(decode_call(p8, cfg))
        r["decode_fp8_in_graph"] = in_graph(decode_call(p8, cfg))
        r["decode_fp8_in_graph_clean"] = in_graph(decode_call(p8, cfg), flush_mode="read")
        r["floor_fp8"] = floor_us(p, st, kv_bytes_per_value=1)
        log(f"  (a) fp8 K/V: decode {r['decode_fp8_graph']:.1f} us graph | floor {r['floor_fp8']:.1f} us | "
            f"err vs bf16 inputs {r['err_fp8']:.1e}")
        del p8
    log(
        f"  (a) ctx {pool.ctx} page {pool.page} B {p['b']}: decode {r['decode_eager']:.1f} eager / "
        f"{r['decode_graph']:.1f} graph ({r['decode_default_graph']:.1f} default config, {r['splits']} splits) | "
        f"kvouter {r['kvouter_eager']:.1f} eager / {r['kvouter_graph'] or float('nan'):.1f} graph | dense "
        f"{r.get('dense') or float('nan'):.1f} ({r.get('dense_backend', '-')}) | floor {r['floor']:.1f} us | "
        f"err {r['err_decode']:.1e} / {r['err_kvouter']:.1e}"
    )
    del p
    return r


def step_section(pool: Pool, args, cfg: DecodeConfig) -> list[dict]:
    """(c): one sparse layer's decode step, batch args.batch x 1 new token: the index
    top-k over the paged index keys (bf16, or e4m3 with the fp8 dot and per-token scales or
    one scale for the cache) and the decode attention on its selections, captured together;
    each part also alone, all as calls inside a graph of many (L2 flushed before each).
    Dense decode attention over the full context in the same run."""
    p = pool.problem(min(args.batch, pool.batch), 1, args.pattern)
    b, dev = p["b"], p["q"].device
    gen = pool.gen
    pages = pool.k.shape[0]
    hi, di = common.INDEX_HEADS, common.INDEX_DIM
    iq = torch.randn(b, hi, di, device=dev, dtype=torch.bfloat16, generator=gen)
    ik = torch.randn(pages, pool.page, di, device=dev, dtype=torch.bfloat16, generator=gen)
    ik8, ik_scale = common.e4m3_rows(ik)
    # One scale for the cache (M3PagedCache(index_k_scale=...)): no scale read in the kernel.
    ik8_one, one_scale = common.e4m3_tensor(ik)
    kept = torch.zeros(b * HKV, dtype=torch.int32, device=dev)
    dense = dense_sdpa(p, pool.ctx)[0] if args.dense else None
    # Floors: the index keys read once, and the selected K/V (the step's own selections).
    idx_floor = {"bf16": b * pool.ctx * di * 2 / PEAK_BYTES * 1e6, "fp8": b * pool.ctx * (di + 4) / PEAK_BYTES * 1e6,
                 "fp8, one scale": b * pool.ctx * di / PEAK_BYTES * 1e6}
    rows = []
    for keys, cache, extra in (
        ("bf16", ik, {}),
        ("fp8", ik8, {"index_k_scale": ik_scale, "fp8_dot": True}),
        ("fp8, one scale", ik8_one, {"index_k_scale": one_scale, "fp8_dot": True}),
    ):
        def index(config=None):
            return m3_sparse.index_topk(
                iq, cache, p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], topk=TOPK, block_size=BLOCK,
                max_seqlen_q=1, config=config, **extra,
            )

        sel = index()
        ps = dict(p, sel=sel)
        st = reuse_stats(ps)
        out, lse = decode_call(ps, cfg, True)()
        err = check(ps, out, lse)
        del out, lse

        def attention(counts=None, chosen=None):
            ps_ = ps if chosen is None else dict(ps, sel=chosen)
            return (decode_call(ps_, cfg) if counts is None else kernel_call(ps_, cfg, counts))()

        def step(counts=None):
            return attention(counts, index())

        r = dict(keys=keys, ctx=pool.ctx, b=b, err=err, dense=dense, index_floor=idx_floor[keys],
                 attn_floor=floor_us(ps, st))
        r["index"] = in_graph(index)
        # Key-range splits of the index kernel (the default comes from the SM count).
        r["index_splits"] = {}
        for sp in args.index_splits:
            index_sp = lambda sp=sp: index(IndexConfig(impl="triton", num_splits=sp))  # noqa: E731
            same = bool(torch.equal(canon(index_sp()), canon(sel)))
            r["index_splits"][sp] = (in_graph(index_sp), same)
            log(f"  (c) {keys} index keys, {sp} splits: {r['index_splits'][sp][0]:.1f} us, same selection {same}")
        r["attention"] = in_graph(attention)
        r["attention_kept"] = in_graph(lambda: attention(kept))
        r["step"] = in_graph(step)
        r["step_kept"] = in_graph(lambda: step(kept))
        rows.append(r)
        log(f"  (c) {keys} index keys: index {r['index']:.1f} | attention {r['attention']:.1f} "
            f"({r['attention_kept']:.1f} kept counts) | step {r['step']:.1f} ({r['step_kept']:.1f}) | dense "
            f"{dense or float('nan'):.1f} us | err {err:.1e}")
        del sel, ps
    del p, iq, ik, ik8, ik_scale, ik8_one
    common.empty_cache()
    return rows


def crossover_point(pool: Pool, b: int, n: int, args, cfg: DecodeConfig) -> dict:
    """(b): b sequences, the last n tokens of each are queries."""
    p = pool.problem(b, n, args.pattern)
    r, st = checked("b", pool, p, cfg)
    rep = 100 if b * n <= 4096 else 300
    r["decode_eager"] = bench(decode_call(p, cfg), rep)
    r["decode_graph"] = bench_graph(decode_call(p, cfg), rep)
    r["kvouter_eager"] = bench(kvouter_call(p), rep)
    r["kvouter_graph"] = bench_kvouter_graph(kvouter_call(p))
    r["splits"] = splits_of(p, cfg)
    log(
        f"  (b) ctx {pool.ctx} B {b} n {n}: nsb {st['nsb']} N {st['N']} reuse "
        f"{st['selections'] / max(1, st['nsb']):.2f} | decode {r['decode_eager']:.1f} eager / "
        f"{r['decode_graph']:.1f} graph ({r['splits']} splits) | kvouter {r['kvouter_eager']:.1f} eager / "
        f"{r['kvouter_graph'] or float('nan'):.1f} graph | floor {r['floor']:.1f} us | "
        f"err {r['err_decode']:.1e} / {r['err_kvouter']:.1e}"
    )
    del p
    common.empty_cache()
    return r


def mixed_problem(pool: Pool, chunk: int, b: int, pattern: str) -> tuple[dict, dict, dict]:
    """(d): (the step: sequence 0's last ``chunk`` tokens as a prefill chunk, then one query of
    each of sequences 1..b; the chunk alone; the decode rows alone)."""
    pc = pool.problem(1, chunk, pattern)
    pd = pool.problem(b + 1, 1, pattern)
    dev = pc["q"].device
    rows = {x: pd[x][1:] for x in ("q", "sel", "pos")}
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), chunk + torch.arange(b + 1, dtype=torch.int32)]).to(dev)
    kv = torch.full((b + 1,), pool.ctx, dtype=torch.int32, device=dev)
    step = dict(k=pool.k, v=pool.v, bt=pool.bt[: b + 1].contiguous(), cu=cu, kv=kv, b=b + 1, n=chunk,
                **{x: torch.cat([pc[x], rows[x]]) for x in rows})
    cu_d, kv_d = common.varlen(b, 1, pool.ctx, dev)
    decode_rows = dict(k=pool.k, v=pool.v, bt=pool.bt[1 : b + 1].contiguous(), cu=cu_d, kv=kv_d, b=b, n=1, **rows)
    return step, pc, decode_rows


def sparse_call(p: dict, return_lse: bool = False):
    """The public entry that picks the kernels (``max_seqlen_q``: the longest sequence's rows)."""
    return lambda: m3_sparse.sparse_attention(  # noqa: E731
        p["q"], p["k"], p["v"], p["sel"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], block_size=BLOCK,
        max_seqlen_q=p["n"], return_lse=return_lse,
    )


def mixed_section(pool: Pool, chunk: int, args, cfg: DecodeConfig) -> dict:
    """(d): one prefill chunk beside args.batch decode rows, at the pool's context."""
    step, chunk_p, rows_p = mixed_problem(pool, chunk, args.batch, args.pattern)
    st = reuse_stats(chunk_p)
    r = dict(section="d", ctx=pool.ctx, page=pool.page, b=args.batch, n=chunk)
    r["err_sparse"] = check(step, *sparse_call(step, True)())
    r["err_kvouter"] = check(step, *kvouter_call(step, True)())
    # The floor: the chunk's distinct K/V and the decode rows' blocks, each read once.
    r["floor"] = floor_us(chunk_p, st) + floor_us(rows_p, reuse_stats(rows_p))
    for name, fn in (("sparse", sparse_call(step)), ("kvouter", kvouter_call(step)),
                     ("chunk", kvouter_call(chunk_p)), ("rows", decode_call(rows_p, cfg))):
        r[f"{name}_eager"] = bench(fn, 300)
        r[f"{name}_graph"] = bench_kvouter_graph(fn) if name != "rows" else bench_graph(fn)
    log(
        f"  (d) ctx {pool.ctx} chunk {chunk} + {args.batch} decode rows: sparse_attention {r['sparse_eager']:.1f} "
        f"eager / {r['sparse_graph'] or float('nan'):.1f} graph | KV-outer, every row {r['kvouter_eager']:.1f} / "
        f"{r['kvouter_graph'] or float('nan'):.1f} | chunk alone {r['chunk_eager']:.1f} | decode rows alone "
        f"{r['rows_eager']:.1f} | floor {r['floor']:.1f} us | err {r['err_sparse']:.1e} / {r['err_kvouter']:.1e}"
    )
    del step, chunk_p, rows_p
    common.empty_cache()
    return r


def table_d(rows: list) -> str:
    def us(v):
        return "-" if v is None else f"{v:.1f}"

    return common.md_table(
        ["ctx", "chunk + decode rows", "sparse_attention eager", "graph", "KV-outer every row eager", "graph",
         "chunk alone (KV-outer)", "decode rows alone", "floor"],
        [[kib(r["ctx"]), f"{r['n']} + {r['b']}", us(r["sparse_eager"]), us(r["sparse_graph"]),
          us(r["kvouter_eager"]), us(r["kvouter_graph"]), us(r["chunk_eager"]), us(r["rows_eager"]),
          us(r["floor"])] for r in rows],
    )


# --------------------------------------------------------------------------- report


# Figures of the sections' dicts that are microseconds (their names get a _us suffix in the rows).
US_KEYS = {
    "decode_default_graph", "decode_eager", "decode_graph", "decode_in_graph", "decode_in_graph_clean",
    "kvouter_eager", "kvouter_graph", "dense", "floor", "decode_fp8_graph", "decode_fp8_in_graph",
    "decode_fp8_in_graph_clean", "floor_fp8", "index", "attention", "attention_kept", "step", "step_kept",
    "index_floor", "attn_floor", "sparse_eager", "sparse_graph", "chunk_eager", "chunk_graph",
    "rows_eager", "rows_graph",
}


def ms(us):
    return None if us is None else us / 1e3


def metrics(r: dict, *skip: str) -> dict:
    return {(f"{k}_us" if k in US_KEYS else k): v for k, v in r.items() if k not in skip}


def add_rows(results, rows_a, rows_b, rows_c, rows_d=()):
    """The sections' figures as result rows (ms; the tables keep microseconds)."""
    for r in rows_a:
        case = f"(a) decode B={r['b']} ctx={kib(r['ctx'])} page {r['page']}"
        sizes = {"batch": r["b"], "ctx": r["ctx"], "page": r["page"], "q_tokens": 1}
        results.add(case, ms(r["decode_graph"]), what="sparse_decode_attention, graph replay", sizes=sizes,
                    baseline=f"dense SDPA ({r.get('dense_backend', 'not run')})", baseline_ms=ms(r.get("dense")),
                    **metrics(r, "section", "b", "ctx", "page", "n"))
        results.add(case, ms(r["kvouter_eager"]), what="kvouter_attention, eager", sizes=sizes,
                    baseline="sparse_decode_attention, eager", baseline_ms=ms(r["decode_eager"]),
                    graph_ms=ms(r["kvouter_graph"]))
    for r in rows_b:
        case = f"(b) crossover B={r['b']} ctx={kib(r['ctx'])} q_tokens={r['n']}"
        sizes = {"batch": r["b"], "ctx": r["ctx"], "page": r["page"], "q_tokens": r["n"]}
        results.add(case, ms(r["decode_graph"]), what="sparse_decode_attention, graph replay", sizes=sizes,
                    baseline="kvouter_attention, graph replay", baseline_ms=ms(r["kvouter_graph"]),
                    **metrics(r, "section", "b", "ctx", "page", "n"))
    for r in rows_c:
        case = f"(c) decode step, {r['keys']} index keys, B={r['b']} ctx={kib(r['ctx'])}"
        results.add(case, ms(r["step"]), what="index_topk + sparse_decode_attention, in graph",
                    sizes={"batch": r["b"], "ctx": r["ctx"], "q_tokens": 1}, baseline="dense SDPA",
                    baseline_ms=ms(r["dense"]), **metrics(r, "b", "ctx", "keys"))
    for r in rows_d:
        case = f"(d) mixed step, {r['n']}-token chunk + {r['b']} decode rows, ctx={kib(r['ctx'])}"
        results.add(case, ms(r["sparse_eager"]), what="sparse_attention (KV-outer chunk, decode-kernel rows), eager",
                    sizes={"batch": r["b"] + 1, "ctx": r["ctx"], "q_tokens": r["n"] + r["b"]},
                    baseline="kvouter_attention over every row, eager", baseline_ms=ms(r["kvouter_eager"]),
                    **metrics(r, "section", "b", "ctx", "page", "n"))


def table_a(rows: list[dict]) -> str:
    out = []
    for r in rows:
        kvg = r.get("kvouter_graph")
        out.append([
            kib(r["ctx"]), r["page"], r["b"], fmt(r["decode_graph"], 1), fmt(r["decode_in_graph"], 1),
            fmt(r["decode_in_graph_clean"], 1), fmt(r["decode_eager"], 1), fmt(r["decode_default_graph"], 1),
            r["splits"], fmt(r["kvouter_eager"], 1), fmt(kvg, 1),
            f"{fmt(r.get('dense'), 1)} ({r.get('dense_backend', '-')})", fmt(r["floor"], 1),
            f"{r['decode_graph'] / r['floor']:.2f}", f"{r['decode_in_graph'] / r['floor']:.2f}",
            f"{r['decode_in_graph_clean'] / r['floor']:.2f}", fmt(kvg / r["decode_graph"] if kvg else None),
            f"{max(r['err_decode'], r['err_kvouter']):.1e}",
        ])
    text = common.md_table(
        ["ctx", "page", "B", "decode graph us", "decode in-graph us", "in-graph, clean L2", "decode eager us",
         "default config graph us", "splits", "KV-outer eager us", "KV-outer graph us", "dense SDPA us (backend)",
         "floor us", "decode graph / floor", "in-graph / floor", "in-graph clean / floor",
         "KV-outer / decode (graph)", "err"], out)
    fp8 = [r for r in rows if "decode_fp8_graph" in r]
    if fp8:
        text += "\n\n" + common.md_table(
            ["ctx", "page", "B", "fp8 K/V decode graph us", "in-graph us", "in-graph, clean L2", "fp8 floor us",
             "graph / floor", "in-graph / floor", "in-graph clean / floor", "err vs bf16 inputs"],
            [[kib(r["ctx"]), r["page"], r["b"], fmt(r["decode_fp8_graph"], 1), fmt(r["decode_fp8_in_graph"], 1),
              fmt(r["decode_fp8_in_graph_clean"], 1), fmt(r["floor_fp8"], 1),
              f"{r['decode_fp8_graph'] / r['floor_fp8']:.2f}", f"{r['decode_fp8_in_graph'] / r['floor_fp8']:.2f}",
              f"{r['decode_fp8_in_graph_clean'] / r['floor_fp8']:.2f}", f"{r['err_fp8']:.1e}"] for r in fp8])
    return text


def table_b(rows: list[dict]) -> str:
    out = []
    for r in rows:
        kvg = r.get("kvouter_graph")
        win_e = "decode" if r["decode_eager"] <= r["kvouter_eager"] else "KV-outer"
        win_g = "-" if kvg is None else ("decode" if r["decode_graph"] <= kvg else "KV-outer")
        out.append([
            kib(r["ctx"]), r["b"], r["n"], r["N"], r["nsb"], f"{r['nsb'] / r['N']:.2f}",
            f"{r['selections'] / max(1, r['nsb']):.2f}", fmt(r["decode_eager"], 1), fmt(r["decode_graph"], 1),
            r["splits"], fmt(r["kvouter_eager"], 1), fmt(kvg, 1), fmt(r["floor"], 1), win_e, win_g,
            f"{max(r['err_decode'], r['err_kvouter']):.1e}",
        ])
    return common.md_table(
        ["ctx", "B", "q tokens/seq", "N", "nsb", "nsb/N", "reuse", "decode eager us", "decode graph us", "splits",
         "KV-outer eager us", "KV-outer graph us", "floor us", "winner (eager)", "winner (graph)", "err"], out)


def table_c(rows: list[dict]) -> str:
    out = []
    for r in rows:
        d = r["dense"]
        out.append([
            r["keys"], kib(r["ctx"]), r["b"], f"{r['index']:.1f} ({r['index_floor']:.1f})",
            f"{r['attention']:.1f} ({r['attn_floor']:.1f})", f"{r['attention_kept']:.1f}", f"{r['step']:.1f}",
            f"{r['step_kept']:.1f}", fmt(d, 1), fmt(d / r["step"] if d else None), fmt(d / r["step_kept"] if d else None),
        ])
    for r in rows:
        for sp, (t, same) in r.get("index_splits", {}).items():
            out.append([f"{r['keys']}, index with {sp} splits", "", "", f"{t:.1f}", "", "", "", "", "", "",
                        f"same selection: {same}"])
    return common.md_table(
        ["index keys", "ctx", "B", "index us (floor)", "attention us (floor)", "attention, kept counts", "step us",
         "step, kept counts", "dense us", "dense / step", "dense / step, kept counts"], out)


def parse_variants(s: str) -> list[tuple[int, int, int, int, int, int, int]]:
    """``block_n:warps:stages:programs_per_sm[:fused[:kept]][@splits]`` items; splits 0 = from
    programs_per_sm (``default_num_splits``)."""
    out = []
    for item in s.split(","):
        if item:
            head, at, forced = item.partition("@")
            usage = (
                "--variants: expected block_n:warps:stages:programs_per_sm[:fused[:kept counts]][@splits], "
                f"got {item!r}"
            )
            try:
                vals = tuple(int(x) for x in head.split(":"))
            except ValueError:
                raise SystemExit(usage) from None
            if len(vals) == 4:
                vals += (1,)
            if len(vals) == 5:
                vals += (0,)
            if len(vals) != 6 or (at and not forced.isdigit()):
                raise SystemExit(usage)
            if at and not 1 <= int(forced) <= MAX_SPLITS:
                raise SystemExit(f"--variants: splits must be in 1..{MAX_SPLITS}, got {item!r}")
            if vals[5] and not vals[4]:
                raise SystemExit(f"--variants: kept counts are the in-place merge's, so need fused 1: {item!r}")
            out.append(vals + (int(forced or 0),))
    return out


DEFAULT_VARIANTS = (
    # block_n:num_warps:num_stages:programs_per_sm[:fused merge 1/0[:kept counts 1/0]]
    # (kept counts: the in-place merge's arrival counts come from a buffer the caller keeps,
    # instead of a zeroed one per call); at batch 32 x 4 kv
    # heads, programs per SM 1 / 2 / 4 / 8 give 2 / 4 / 8 / 16 splits (at most 2 chunks of
    # block_n keys each)
    "64:4:3:1,64:4:3:1:0,64:4:3:2,64:4:3:4,64:4:3:4:0,64:4:3:8,"
    "64:4:2:4,64:4:4:4,64:8:3:4,"
    "32:4:3:8,32:4:4:8,"
    "128:4:2:2,128:4:2:4,128:8:2:4,128:4:3:4"
)


def main():
    ap = common.parser(__doc__, smoke=True)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: 4K context, batch 4, few variants")
    ap.add_argument("--contexts", default="32768,131072", help="context lengths of (a) and (b)")
    ap.add_argument("--page-sizes", default="128,64", help="page sizes of (a); (b) uses the first")
    ap.add_argument("--batch", type=int, default=32, help="sequences in (a) and the sweep")
    ap.add_argument("--q-tokens", default="1,4,16,64,256,1024,4096", help="query tokens per sequence in (b)")
    ap.add_argument("--batch-variants", default="8,32", help="(b) also at these batch sizes (largest context)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="(b) skips batch variants with more query tokens")
    ap.add_argument("--pattern", default="random", choices=("random", "hot"))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="launch sweep: block_n:warps:stages:programs_per_sm[:fused merge 1/0[:kept counts 1/0]]"
                         "[@splits],... (@S forces S splits)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="keep the default DecodeConfig, skip the sweep")
    ap.add_argument("--no-dense", dest="dense", action="store_false", help="skip dense SDPA")
    ap.add_argument("--no-crossover", dest="crossover", action="store_false", help="skip (b)")
    ap.add_argument("--fp8", action="store_true", help="(a) also times the decode kernel on e4m3 K/V")
    ap.add_argument("--step", action="store_true",
                    help="(c) index + attention decode step of one sparse layer at batch --batch x the largest context")
    ap.add_argument("--step-only", action="store_true", help="only (c) (implies --no-sweep, no (a), no (b))")
    ap.add_argument("--index-splits", default="", help="(c) also times the index kernel alone at these split counts")
    ap.add_argument("--mixed", default="", help="(d) mixed steps: prefill chunk sizes beside --batch decode rows, "
                    "at the largest context (e.g. 2048,8192)")
    args = ap.parse_args()
    if args.step_only:
        args.step, args.sweep, args.crossover = True, False, False
    if args.quick:
        args.contexts, args.page_sizes, args.batch = "4096", "128,64", 4
        args.q_tokens, args.batch_variants, args.max_tokens = "1,16,64", "4", 256
        args.variants = "64:4:3:4,64:4:3:4:0,128:4:2:2"
    args.contexts = common.int_list(args.contexts)
    args.page_sizes = common.int_list(args.page_sizes)
    args.q_tokens = common.int_list(args.q_tokens)
    args.batch_variants = common.int_list(args.batch_variants)
    args.variants = parse_variants(args.variants)
    args.index_splits = common.int_list(args.index_splits)
    args.mixed = common.int_list(args.mixed)
    if SMOKE:
        args.contexts, args.page_sizes, args.batch = [512], [128, 64], 2
        args.q_tokens, args.batch_variants, args.max_tokens = [1, 4], [2], 8
        args.variants = args.variants[:1]
    elif not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA device (the tests cover the kernels on the CPU)")
    out_dir = Path(args.out)
    results = common.start_run("bench_decode", out_dir, "sparse decode attention", log)
    log(f"# Hq {HQ} Hkv {HKV} D {D} block {BLOCK} top-{TOPK} bf16, pattern {args.pattern}")
    t_start = time.time()
    default_cfg = DecodeConfig()
    ctx_max = max(args.contexts)
    page0 = args.page_sizes[0]
    sweep_rows = []
    cfg = default_cfg
    pools: dict = {}

    def pool(ctx, page, batch):
        key = (ctx, page)
        if key not in pools or pools[key].batch < batch:
            pools.clear()
            common.empty_cache()
            pools[key] = Pool(ctx, page, batch)
        return pools[key]

    if args.sweep:
        log(f"== sweep: batch {args.batch} x ctx {ctx_max}, page {page0}")
        cfg, sweep_rows = sweep(pool(ctx_max, page0, args.batch), args, results)
    log(f"# default config {default_cfg}; used {cfg}")

    rows_a, rows_b, rows_c, rows_d = [], [], [], []
    if args.step:
        log(f"== (c) decode step, batch {args.batch} x ctx {ctx_max}, page {page0}")
        rows_c = step_section(pool(ctx_max, page0, args.batch), args, cfg)
    # Largest context first: the sweep's pool serves the first rows.
    for ctx in sorted(args.contexts, reverse=True) if not args.step_only else []:
        for page in args.page_sizes:
            log(f"== (a) ctx {ctx} page {page}")
            rows_a.append(decode_section(pool(ctx, page, args.batch), args, default_cfg, cfg))
            common.empty_cache()
    if args.crossover:
        jobs = [(ctx_max, 1, n) for n in args.q_tokens]
        jobs += [(ctx_max, b, n) for b in args.batch_variants for n in args.q_tokens if b * n <= args.max_tokens]
        jobs += [(ctx, 1, n) for ctx in sorted(args.contexts, reverse=True) if ctx != ctx_max for n in args.q_tokens]
        for ctx, b, n in jobs:
            if n > ctx:
                continue
            need = max([b2 for c2, b2, _ in jobs if c2 == ctx] + [1])
            log(f"== (b) ctx {ctx} B {b} n {n}")
            rows_b.append(crossover_point(pool(ctx, page0, need), b, n, args, cfg))
    for chunk in args.mixed:
        log(f"== (d) mixed step, chunk {chunk} + {args.batch} decode rows, ctx {ctx_max}, page {page0}")
        rows_d.append(mixed_section(pool(ctx_max, page0, args.batch + 1), min(chunk, ctx_max), args, cfg))
    pools.clear()

    env = results.env
    md = [
        f"Decode attention, {env['device']}, torch {env['torch']}, triton {env['triton']}; "
        f"Hq {HQ} Hkv {HKV} D {D} block {BLOCK} top-{TOPK} bf16, selections {args.pattern}; "
        f"launch config {cfg}.",
    ]
    if rows_a:
        md += ["", "(a) decode, one new token per sequence (us; graph = one call captured in a CUDA graph and replayed)",
               "", table_a(rows_a)]
    if rows_c:
        md += ["", "(c) one sparse layer's decode step (index top-k + decode attention on its selections), us per "
               "call inside a graph of 20 with L2 flushed before each; floors at 4.2 TB/s", "", table_c(rows_c)]
    if rows_b:
        md += ["", "(b) crossover: the last n tokens of each sequence are queries (page "
               f"{page0}); reuse = (token, head) selections per distinct selected block", "", table_b(rows_b)]
    if rows_d:
        md += ["", f"(d) mixed step: one prefill chunk beside {args.batch} decode rows (us; graph = captured and "
               "replayed; floor: each distinct selected block read once at 4.2 TB/s)", "", table_d(rows_d)]
    if sweep_rows:
        md += ["", f"Launch sweep (kernel alone, graph replay), batch {args.batch} x {kib(ctx_max)}, page {page0}", "",
               common.md_table(["block_n", "warps", "stages", "programs/SM", "merge", "splits", "graph us", "x floor",
                                "in-graph us", "x floor", "in-graph us, clean L2", "x floor", "kernel"], sweep_rows)]
    if not KVOUTER_GRAPH["ok"]:
        md += ["", f"KV-outer graph capture failed: {KVOUTER_GRAPH['why']}"]
    md = "\n".join(md)
    add_rows(results, rows_a, rows_b, rows_c, rows_d)
    results.write()
    log.write(out_dir / "bench_decode.log", md)
    (out_dir / "bench_decode.md").write_text(md + "\n")
    log(f"# total {time.time() - t_start:.0f} s")
    print()
    print(md)


if __name__ == "__main__":
    main()
