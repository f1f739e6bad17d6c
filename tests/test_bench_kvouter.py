"""benchmarks/bench_kvouter.py on the CPU, the parts that need no GPU: the union of selected
blocks per query-outer tile it reports (against a count made token by token), and its table
with and without the query-outer columns. No timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_kvouter  # noqa: E402


def test_union_blocks_counts_each_tiles_distinct_ids():
    g = torch.Generator().manual_seed(3)
    seqs, seq_len, heads, topk, tile = 2, 32, 3, 5, 8
    sel = torch.randint(-1, 12, (seqs * seq_len, heads, topk), generator=g, dtype=torch.int32)
    sel[::7] = -1  # rows that select nothing
    sel[1::5, :, 1] = sel[1::5, :, 0]  # repeated ids
    counts = []
    for t0 in range(0, seqs * seq_len, tile):
        for h in range(heads):
            ids = {int(x) for x in sel[t0 : t0 + tile, h].flatten() if int(x) >= 0}
            counts.append(len(ids))
    assert bench_kvouter.union_blocks(sel, seq_len, tile) == sum(counts) / len(counts)


def _row(**extra):
    row = dict(
        name="8K", pattern="hot", engine="tma", t_build=0.1, t_sched=0.1, t_build_torch=1.0, t_sched_torch=1.0,
        t_attn=1.0, t_attn_tl=1.2, t_comb=0.3, t_module=1.5, t_module_ahead=1.4, flops=1e12, bytes=1e9, floor=1.0,
        workspace=1e9, err=1e-3,
    )
    row.update(extra)
    return row


def test_table_gives_the_query_outer_columns_where_measured():
    table = bench_kvouter.table([_row(), _row(pattern="random", t_qouter=0.75, t_qouter_ahead=0.7, union=21.25)])
    lines = table.splitlines()
    assert "union blocks/tile" in lines[0] and "module/qouter" in lines[0]
    hot, random = lines[2], lines[3]
    assert hot.rstrip(" |").endswith("- (-) | - | -")
    assert "0.75 (0.70) | 21.2 | 2.0" in random
