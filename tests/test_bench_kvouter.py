"""benchmarks/bench_kvouter.py on the CPU, the parts that need no GPU: the union of selected
blocks per query-outer tile it reports (against a count made token by token), the query-outer
rows and launch variants of a config (the op on its torch path, timers that only call), and
its table with and without the query-outer columns, and its host profile. No timing is asserted."""

from __future__ import annotations

import dataclasses
import sys
import time
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
        workspace=1e9, err=1e-3, host_module=0.5, host_module_triton=0.6, eng_diff=0.0, bytes_attn=1e9,
        bytes_comb=1e8, nsb=64, used=4096, num_tiles=100, t_flex=None, flex_note="skipped",
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


def test_query_outer_row_and_its_variants(monkeypatch, tmp_path):
    monkeypatch.setenv("BENCH_DEVICE", "cpu")
    p = bench_kvouter.make_problem("hot", 1, 256)
    real, configs = bench_kvouter.m3_sparse.qouter_attention, []

    def on_the_cpu(*args, config, **kwargs):
        configs.append(config)
        return real(*args, config=dataclasses.replace(config, impl="torch"), **kwargs)

    monkeypatch.setattr(bench_kvouter.m3_sparse, "qouter_attention", on_the_cpu)
    for timer in ("median_ms", "host_ahead_ms", "host_ms"):
        monkeypatch.setattr(bench_kvouter.common, timer, lambda fn, **kw: (fn(), 1.0)[1])
    r = _row(t_module=2.0)
    bench_kvouter.run_qouter(r, p, 256, [(64, 32, 4, 3)])
    assert r["t_qouter"] == 1.0 and r["qouter_err"] < 2e-2
    assert r["qouter_tile_tokens"] == 8  # 128 rows of 16 heads
    assert r["union"] == bench_kvouter.union_blocks(p["sel"], 256, 8)
    assert r["qouter_variants"] == {"64:32:4:3": 1.0}
    assert (configs[-1].block_m, configs[-1].block_n, configs[-1].num_warps, configs[-1].num_stages) == (64, 32, 4, 3)
    results = bench_kvouter.common.Results("bench_kvouter", tmp_path)
    bench_kvouter.add_rows(results, dict(r, t_dense=None), 1, 256)
    whats = [row["what"] for row in results.rows]
    assert "qouter_attention (query-outer tiles)" in whats
    assert "qouter_attention, block_m:block_n:num_warps:num_stages 64:32:4:3" in whats


def test_engine_difference_compares_sampled_rows_of_the_partials():
    """The engines' partials are compared over the first and last used rows, copied out so
    one set of partials is alive at a time: equal buffers give 0 (rows that saw no key, -inf,
    count as 0), a changed sampled row shows, rows past ``used`` and between the two ends are
    not read."""
    g = torch.Generator().manual_seed(5)
    o = torch.randn(40, 2, 4, generator=g)
    m = torch.randn(40, 2, generator=g)
    m[3] = float("-inf")
    parts = (o, m)
    same = bench_kvouter.sampled_rows([t.clone() for t in parts], 30, rows=8)
    ref = bench_kvouter.sampled_rows(parts, 30, rows=8)
    assert [t.shape[0] for t in ref] == [16, 16]
    assert max(bench_kvouter.rel_diff(x, y) for x, y in zip(same, ref)) == 0.0
    changed = [t.clone() for t in parts]
    changed[0][10:20] += 1.0  # between the sampled ends
    changed[0][31:] += 1.0  # past the used rows
    assert bench_kvouter.rel_diff(bench_kvouter.sampled_rows(changed, 30, rows=8)[0], ref[0]) == 0.0
    changed[0][25] += 1.0  # among the last sampled rows
    assert bench_kvouter.rel_diff(bench_kvouter.sampled_rows(changed, 30, rows=8)[0], ref[0]) > 1e-3


def test_tuning_compares_the_partial_outputs_alone():
    """``--tune`` compares each variant's partial outputs (o) with the first variant's: a
    difference in o shows, one in the row stats (m) does not."""
    g = torch.Generator().manual_seed(6)
    ref = (torch.randn(20, 2, 4, generator=g), torch.randn(20, 2, generator=g))
    other_m = (ref[0].clone(), ref[1] + 1.0)
    assert bench_kvouter.o_diff(other_m, ref, 20) == 0.0
    other_o = (ref[0] + 0.5, ref[1].clone())
    assert bench_kvouter.o_diff(other_o, ref, 20) > 1e-2


def test_host_profile_names_the_functions_a_call_spends_its_host_time_in():
    """``--host-profile``'s table: the functions of the profiled call by their own time, the
    call's own function among them, with its call count over the repetitions."""

    def slow_part():
        time.sleep(0.002)

    def call():
        slow_part()
        torch.zeros(4)

    text = bench_kvouter.common.host_profile(call, reps=3)
    lines = [line for line in text.splitlines() if "slow_part" in line]
    assert len(lines) == 1 and lines[0].split()[0] == "3"
    assert "Ordered by: internal time" in text
