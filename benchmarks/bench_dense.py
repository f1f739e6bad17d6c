"""Dense attention over the paged cache (M3's full-attention layers): flash-attn-4 and the
Triton kernel against the chunked torch code and cuDNN / flash SDPA on contiguous K/V,
prefill and decode, so the automatic choice on CUDA rests on a measurement.

    python3 benchmarks/bench_dense.py
    python3 benchmarks/bench_dense.py --prefill 8192,32768 --decode 32768

Workload: Hq 64, Hkv 4, D 128, bf16, pages of ``--pages`` tokens (64 and 128 by default)
handed out in a shuffled order. The Triton kernel runs twice: as launched by default (each
key tile one TMA box of its page) and with gathered pointer loads
(``DenseConfig(use_tma=False)``); flash-attn-4 (``DenseConfig(impl="fa4")``) runs where it is
installed, on the same pool through the same op; "default" names the kernel an unpinned call
gets. Prefill: one causal sequence of N tokens. Decode: batch 32, one new token each,
context C. Floors: FLOPs / 700 TFLOP/s (prefill, causal FLOPs
2 * 2 * D * Hq * N^2 / 2) and K/V bytes / 4.2 TB/s (decode). Times are medians
(triton.testing.do_bench; one warm-up and 3 event timings above 100 ms). Each
configuration is checked against SDPA in fp32 on sampled rows. ``--splits`` and ``--block-n``
time the decode rows' Triton kernel at other key splits and key tiles. Result rows go to
``<out>/bench_dense.json``; the last thing printed is a markdown table.
"""

from __future__ import annotations

import common
from common import D, DEVICE, HKV, HQ, PEAK_BYTES, PEAK_FLOPS, SMOKE

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import m3_sparse  # noqa: E402
from m3_sparse import DenseConfig  # noqa: E402
from m3_sparse.core.launch import next_pow2  # noqa: E402
from m3_sparse.dense import plan as dense_plan  # noqa: E402

SDPA_BACKENDS = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))


def timed(fn, slow):
    return common.slow_ms(fn) if slow else common.median_ms(fn, warmup=10, rep=100)


def tile_tokens(q_len: int) -> int:
    """The launcher's query tile in tokens (bf16 q, M3's group of 16 heads)."""
    return dense_plan.tile_tokens(next_pow2(HQ // HKV), q_len, dense_plan.default_block_m(torch.bfloat16))


def problem(batch, q_len, ctx, page, seed=0):
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    pps = -(-ctx // page)
    bf = torch.bfloat16
    k_full = torch.randn(batch, HKV, pps * page, D, device=DEVICE, dtype=bf, generator=g)
    v_full = torch.randn(batch, HKV, pps * page, D, device=DEVICE, dtype=bf, generator=g)
    perm = torch.randperm(batch * pps, device=DEVICE, generator=g)
    # Token-major pages [pages, page, HKV, D] back to the cache layout [pages, HKV, page, D].
    k, bt = common.paginate(list(k_full.transpose(1, 2)), page, perm)
    v, _ = common.paginate(list(v_full.transpose(1, 2)), page, perm)
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    q = torch.randn(batch * q_len, HQ, D, device=DEVICE, dtype=bf, generator=g)
    cu, kv = common.varlen(batch, q_len, ctx)
    return dict(q=q, k=k, v=v, bt=bt, cu=cu, kv=kv, k_full=k_full[:, :, :ctx], v_full=v_full[:, :, :ctx],
                batch=batch, q_len=q_len, ctx=ctx, page=page)


def sdpa(p, backend):
    q = p["q"].view(p["batch"], p["q_len"], HQ, D).transpose(1, 2)
    causal = p["q_len"] > 1  # prefill (q_len == ctx: top-left and bottom-right agree); decode sees all
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, p["k_full"], p["v_full"], is_causal=causal, enable_gqa=True)


def check(p, out) -> float:
    """Relative RMS error of 8 sampled query rows against fp32 attention."""
    b, n, ctx = p["batch"], p["q_len"], p["ctx"]
    num, den = 0.0, 0.0
    for row in torch.linspace(0, b * n - 1, 8).long().tolist():
        seq, pos = row // n, ctx - n + row % n
        k = p["k_full"][seq, :, : pos + 1].float()  # [HKV, keys, D]
        v = p["v_full"][seq, :, : pos + 1].float()
        q = p["q"][row].float().view(HKV, HQ // HKV, D)
        s = torch.einsum("hgd,hkd->hgk", q, k) * D**-0.5
        ref = torch.einsum("hgk,hkd->hgd", torch.softmax(s, -1), v).reshape(HQ, D)
        num += float((out[row].float() - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return (num / den) ** 0.5


def run(kind, batch, q_len, ctx, page, torch_max, splits=(), block_ns=()):
    p = problem(batch, q_len, ctx, page)
    flops = 4 * D * HQ * (q_len * ctx - q_len * (q_len - 1) / 2) * batch
    kv_bytes = 2 * batch * ctx * HKV * D * 2
    floor = max(flops / PEAK_FLOPS, kv_bytes / PEAK_BYTES) * 1e3
    slow = flops > 2e13
    row = dict(kind=kind, batch=batch, q_len=q_len, ctx=ctx, page=page, floor_ms=floor)

    def call(cfg: DenseConfig):
        return lambda: m3_sparse.dense_paged_attention(  # noqa: E731
            p["q"], p["k"], p["v"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], softmax_scale=D**-0.5,
            causal=True, return_lse=False, max_seqlen_q=q_len, config=cfg,
        )

    variants = [("triton", DenseConfig(impl="triton")),
                # The same kernel with gathered pointer loads instead of one TMA box per key tile.
                ("gather", DenseConfig(impl="triton", use_tma=False))]
    variants += [(f"split{s}", DenseConfig(impl="triton", num_splits=s)) for s in splits]
    variants += [(f"bn{n}", DenseConfig(impl="triton", block_n=n)) for n in block_ns]
    try:  # pinned to flash-attn-4, the op says why it cannot run the call
        m3_sparse.dense_paged_attention_kernel(
            p["q"], p["k"], p["v"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], max_seqlen_q=q_len,
            config=DenseConfig(impl="fa4"))
        variants.append(("fa4", DenseConfig(impl="fa4")))
    except ValueError as exc:
        row["fa4_note"] = str(exc)
    if q_len * ctx * batch <= torch_max:
        variants.append(("torch", DenseConfig(impl="torch")))
    for name, cfg in variants:
        fn = call(cfg)
        row[f"{name}_err"] = check(p, fn()[0])
        row[f"{name}_ms"] = timed(fn, slow)
        if name.startswith(("split", "bn")):
            print(f"  {kind} {batch}x{ctx} page {page} {name}: {row[f'{name}_ms']:.3f} ms "
                  f"(err {row[f'{name}_err']:.1e})", flush=True)
    row["splits"] = dense_plan.default_num_splits(batch * q_len, batch, HKV, tile_tokens(q_len),
                                                    p["bt"].shape[1] * page, p["q"].device)
    row["auto"] = m3_sparse.dense_paged_attention_kernel(
        p["q"], p["k"], p["v"], p["bt"], cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], max_seqlen_q=q_len)
    for name, backend in SDPA_BACKENDS:
        try:
            out = sdpa(p, backend).transpose(1, 2).reshape(-1, HQ, D)
            row[f"{name}_err"] = check(p, out)
            row[f"{name}_ms"] = timed(lambda: sdpa(p, backend), slow)
        except RuntimeError as e:
            row[f"{name}_ms"] = None
            row[f"{name}_note"] = str(e).splitlines()[0][:100]
    del p
    common.empty_cache()
    print(row, flush=True)
    return row


def add_rows(results, rows):
    for r in rows:
        case = f"{r['kind']} {r['batch']}x{r['ctx']} page {r['page']}"
        sizes = {"batch": r["batch"], "q_len": r["q_len"], "ctx": r["ctx"], "page": r["page"]}
        metrics = {k: v for k, v in r.items() if k not in ("kind", "batch", "q_len", "ctx", "triton_ms")}
        results.add(case, r["triton_ms"], what="dense_paged_attention (Triton, default launch)", sizes=sizes,
                    baseline="cuDNN SDPA on contiguous K/V", baseline_ms=r.get("cudnn_ms"), **metrics)


def main():
    ap = common.parser(__doc__.split("\n\n")[0], smoke=True)
    ap.add_argument("--prefill", default="8192,32768,131072")
    ap.add_argument("--decode", default="32768,131072", help="contexts of the batch-32 decode")
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--pages", default="64,128", help="page sizes of the pool (each case runs at each)")
    ap.add_argument("--splits", default="", help="key-split counts to time for the decode rows, e.g. 1,2,4,8,16")
    ap.add_argument("--block-n", default="", help="keys per Triton tile to time for the decode rows, e.g. 64,128")
    ap.add_argument("--torch-max", type=float, default=2**31, help="largest q_len*ctx*batch for the torch code")
    args = ap.parse_args()
    if SMOKE:
        args.prefill, args.decode, args.decode_batch = "128", "256", 2
    results = common.Results("bench_dense", args.out)
    pages = common.int_list(args.pages)
    rows = [run("prefill", 1, n, n, pg, args.torch_max) for n in common.int_list(args.prefill) for pg in pages]
    splits, block_ns = common.int_list(args.splits), common.int_list(args.block_n)
    rows += [run("decode", args.decode_batch, 1, c, pg, args.torch_max, splits, block_ns)
             for c in common.int_list(args.decode) for pg in pages]
    add_rows(results, rows)
    results.write()
    f = lambda x: common.fmt(x, 3)  # noqa: E731
    print()
    print(common.md_table(
        ["case", "page", "floor ms", "flash-attn-4 ms", "Triton ms (splits)", "Triton, gathered loads ms", "torch ms",
         "cuDNN ms", "flash ms", "default", "flash-attn-4 err", "Triton err"],
        [[f"{r['kind']} {r['batch']}x{r['ctx']}", r["page"], f(r["floor_ms"]), f(r.get("fa4_ms")),
          f"{f(r['triton_ms'])} ({r['splits']})", f(r["gather_ms"]), f(r.get("torch_ms")), f(r.get("cudnn_ms")),
          f(r.get("flash_ms")), r["auto"], f"{r['fa4_err']:.1e}" if "fa4_err" in r else "-",
          f"{r['triton_err']:.1e}"] for r in rows]))
    extra = [f"split{s}" for s in splits] + [f"bn{n}" for n in block_ns]
    if extra:
        print()
        print(common.md_table(["decode case", "default ms", *(f"{e} ms" for e in extra), "cuDNN ms"],
                              [[f"{r['batch']}x{r['ctx']} page {r['page']}", f(r["triton_ms"]),
                                *(f(r.get(f"{e}_ms")) for e in extra), f(r.get("cudnn_ms"))]
                               for r in rows if r["kind"] == "decode"]))


if __name__ == "__main__":
    main()
