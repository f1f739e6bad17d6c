"""Dense attention over the paged cache (M3's full-attention layers): the Triton kernel
against the chunked torch code and cuDNN / flash SDPA on contiguous K/V, prefill and
decode, so the automatic choice on CUDA rests on a measurement.

    python3 benchmarks/bench_dense.py
    python3 benchmarks/bench_dense.py --prefill 8192,32768 --decode 32768

Workload: Hq 64, Hkv 4, D 128, bf16, page 64. The Triton kernel runs twice: as launched by
default (each key tile one TMA box of its page) and with gathered pointer loads. Prefill: one causal sequence of N tokens.
Decode: batch 32, one new token each, context C. Floors: FLOPs / 700 TFLOP/s (prefill,
causal FLOPs 2 * 2 * D * Hq * N^2 / 2) and K/V bytes / 4.2 TB/s (decode). Times are
medians (triton.testing.do_bench; one warm-up and 3 event timings above 100 ms). Each
configuration is checked against SDPA in fp32 on sampled rows. The last thing printed is a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "torch-ext"))

from triton.testing import do_bench  # noqa: E402

from m3_sparse.dense_attention import dense_paged_attention_torch  # noqa: E402
from m3_sparse.triton_dense_attention import (  # noqa: E402
    BLOCK_M,
    _tile_tokens,
    default_num_splits,
    dense_paged_attention_triton,
)
from bench_kvouter import bench_slow  # noqa: E402

HQ, HKV, D, PAGE = 64, 4, 128, 64
PEAK_FLOPS, PEAK_BYTES = 700e12, 4.2e12


def timed(fn, slow):
    return bench_slow(fn) if slow else do_bench(fn, warmup=10, rep=100, return_mode="median")


def problem(batch, q_len, ctx, seed=0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    pps = -(-ctx // PAGE)
    bf = torch.bfloat16
    k_full = torch.randn(batch, HKV, pps * PAGE, D, device=dev, dtype=bf, generator=g)
    v_full = torch.randn(batch, HKV, pps * PAGE, D, device=dev, dtype=bf, generator=g)
    perm = torch.randperm(batch * pps, device=dev, generator=g)
    bt = perm.view(batch, pps).to(torch.int32)
    k = torch.empty(batch * pps, HKV, PAGE, D, device=dev, dtype=bf)
    v = torch.empty_like(k)
    k[perm] = k_full.view(batch, HKV, pps, PAGE, D).permute(0, 2, 1, 3, 4).reshape(-1, HKV, PAGE, D)
    v[perm] = v_full.view(batch, HKV, pps, PAGE, D).permute(0, 2, 1, 3, 4).reshape(-1, HKV, PAGE, D)
    q = torch.randn(batch * q_len, HQ, D, device=dev, dtype=bf, generator=g)
    cu = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32)
    kv = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    return dict(q=q, k=k, v=v, bt=bt, cu=cu, kv=kv, k_full=k_full[:, :, :ctx], v_full=v_full[:, :, :ctx],
                batch=batch, q_len=q_len, ctx=ctx)


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


def run(kind, batch, q_len, ctx, torch_max, splits=()):
    p = problem(batch, q_len, ctx)
    kw = dict(cu_seqlens_q=p["cu"], used_kv_lens=p["kv"], softmax_scale=D**-0.5, causal=True, return_lse=False)
    flops = 4 * D * HQ * (q_len * ctx - q_len * (q_len - 1) / 2) * batch
    kv_bytes = 2 * batch * ctx * HKV * D * 2
    floor = max(flops / PEAK_FLOPS, kv_bytes / PEAK_BYTES) * 1e3
    slow = flops > 2e13
    row = dict(kind=kind, batch=batch, q_len=q_len, ctx=ctx, floor_ms=floor)
    tri = lambda: dense_paged_attention_triton(p["q"], p["k"], p["v"], p["bt"], max_seqlen_q=q_len, **kw)  # noqa: E731
    row["triton_err"] = check(p, tri()[0])
    row["triton_ms"] = timed(tri, slow)
    # The same kernel with gathered pointer loads instead of one TMA box per key tile.
    gat = lambda: dense_paged_attention_triton(  # noqa: E731
        p["q"], p["k"], p["v"], p["bt"], max_seqlen_q=q_len, use_tma=False, **kw
    )
    row["gather_err"] = check(p, gat()[0])
    row["gather_ms"] = timed(gat, slow)
    tm = _tile_tokens(HQ // HKV, q_len, BLOCK_M)  # the launcher's query tile (G = 16 is a power of two)
    row["splits"] = default_num_splits(batch * q_len, batch, HKV, tm, p["bt"].shape[1] * PAGE, p["q"].device)
    for s in splits:  # the key-split sweep behind SPLIT_CONFIG
        fn = lambda: dense_paged_attention_triton(  # noqa: E731
            p["q"], p["k"], p["v"], p["bt"], max_seqlen_q=q_len, num_splits=s, **kw
        )
        err = check(p, fn()[0])
        row[f"split{s}_ms"] = timed(fn, slow)
        print(f"  {kind} {batch}x{ctx} splits={s}: {row[f'split{s}_ms']:.3f} ms (err {err:.1e})", flush=True)
    if q_len * ctx * batch <= torch_max:
        tor = lambda: dense_paged_attention_torch(p["q"], p["k"], p["v"], p["bt"], **kw)  # noqa: E731
        row["torch_err"] = check(p, tor()[0])
        row["torch_ms"] = timed(tor, slow)
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            out = sdpa(p, backend).transpose(1, 2).reshape(-1, HQ, D)
            row[f"{name}_err"] = check(p, out)
            row[f"{name}_ms"] = timed(lambda: sdpa(p, backend), slow)
        except RuntimeError as e:
            row[f"{name}_ms"] = None
            row[f"{name}_note"] = str(e).splitlines()[0][:100]
    del p
    torch.cuda.empty_cache()
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", default="8192,32768,131072")
    ap.add_argument("--decode", default="32768,131072", help="contexts of the batch-32 decode")
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--splits", default="", help="key-split counts to time for the decode rows, e.g. 1,2,4,8,16")
    ap.add_argument("--torch-max", type=float, default=2**31, help="largest q_len*ctx*batch for the torch code")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = [run("prefill", 1, n, n, args.torch_max) for n in map(int, filter(None, args.prefill.split(",")))]
    splits = [int(x) for x in args.splits.split(",") if x]
    rows += [
        run("decode", args.decode_batch, 1, c, args.torch_max, splits)
        for c in map(int, filter(None, args.decode.split(",")))
    ]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_dense.json").write_text(json.dumps(rows, indent=1))
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print("\n| case | floor ms | Triton ms (splits) | Triton, gathered loads ms | torch ms | cuDNN ms | flash ms "
          "| Triton err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        case = f"{r['kind']} {r['batch']}x{r['ctx']}"
        print(f"| {case} | {f(r['floor_ms'])} | {f(r['triton_ms'])} ({r['splits']}) | {f(r['gather_ms'])} | "
              f"{f(r.get('torch_ms'))} | {f(r.get('cudnn_ms'))} | {f(r.get('flash_ms'))} | {r['triton_err']:.1e} |")
    if splits:
        print("\n| decode case | " + " | ".join(f"S={s} ms" for s in splits) + " |")
        print("|---|" + "---|" * len(splits))
        for r in rows:
            if r["kind"] == "decode":
                cells = " | ".join(f(r.get(f"split{s}_ms")) for s in splits)
                print(f"| {r['batch']}x{r['ctx']} | {cells} |")


if __name__ == "__main__":
    main()
