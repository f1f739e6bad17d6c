"""HBM ceilings of the GPU at hand: what a plain read, a plain write and a copy reach, the
yardsticks for the memory-bound stages (the KV-outer combine reads, the partials kernel
mostly writes). The roofline floors elsewhere use the spec's 4.2 TB/s copy figure; this
says how far a read-only or write-only stream moves from it.

    python3 benchmarks/bench_memory.py
    python3 benchmarks/bench_memory.py --gib 8 --out mem.json

Buffers of ``--gib`` GiB each (two for the copy), far above the 60 MB L2. Times are medians
of triton.testing.do_bench; TB/s counts the bytes read plus the bytes written. Result rows
go to ``<out>/bench_memory.json`` (an ``--out`` ending in .json names the file itself);
the last thing printed is a markdown table.
"""

from __future__ import annotations

import common

import torch  # noqa: E402


def measure(gib: int, results) -> list[dict]:
    n = gib << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 256)

    # Rows of 1M elements keep the reductions' outputs small, so they are all read traffic.
    def as_rows(t, dtype):
        return t.view(dtype).view(-1, (1 << 20) // dtype.itemsize)

    cases = [
        ("read: sum of bf16 rows (fp32 accumulation)", lambda: as_rows(src, torch.bfloat16).sum(dim=1, dtype=torch.float32), n),
        ("read: amax of int32 rows", lambda: as_rows(src, torch.int32).amax(dim=1), n),
        ("write: zero_", lambda: dst.zero_(), n),
        ("write: fill_ (bf16 view)", lambda: dst.view(torch.bfloat16).fill_(1.5), n),
        ("copy: read one buffer, write the other", lambda: dst.copy_(src), 2 * n),
    ]
    rows = []
    for name, fn, nbytes in cases:
        ms = common.median_ms(fn, warmup=3, rep=400)
        rows.append(dict(case=name, ms=ms, tb_s=nbytes / ms / 1e9, gb=nbytes / 1e9))
        results.add(name, ms, what="torch stream", sizes={"gib": gib, "bytes_moved": nbytes},
                    baseline="M3_SPEC copy ceiling (4.2 TB/s)", baseline_ms=nbytes / common.PEAK_BYTES * 1e3,
                    tb_s=rows[-1]["tb_s"])
        print(f"{name}: {ms:.2f} ms, {rows[-1]['tb_s']:.2f} TB/s", flush=True)
    return rows


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=int, default=16, help="size of each buffer in GiB (default 16)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_memory.py measures a CUDA GPU; none is visible")
    if args.gib < 1:
        raise SystemExit(f"--gib: expected at least 1, got {args.gib}")
    free, _ = torch.cuda.mem_get_info()
    if 2 * (args.gib << 30) > free:
        raise SystemExit(f"--gib {args.gib}: two buffers need {2 * args.gib} GiB, {free / 2**30:.1f} GiB free")
    results = common.Results("bench_memory", args.out)
    rows = measure(args.gib, results)
    results.write()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, buffers of {args.gib} GiB\n")
    print(common.md_table(["stream", "GB moved", "ms", "TB/s"],
                          [[r["case"], f"{r['gb']:.1f}", f"{r['ms']:.2f}", f"{r['tb_s']:.2f}"] for r in rows]))


if __name__ == "__main__":
    main()
