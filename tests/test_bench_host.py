"""benchmarks/bench_host.py on the CPU: the smoke run writes a row per configuration with
every figure, the layer clock sums each decoder layer by kind and restores the forward it
wraps, and the direct-launch switch restores the launcher. No timing is asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_host  # noqa: E402


def test_quick_run_writes_every_configuration(tmp_path):
    assert bench_host.main(["--quick", "--out", str(tmp_path), "--new-tokens", "4"]) == 0
    rows = json.loads((tmp_path / "bench_host.json").read_text())
    assert [r["what"] for r in rows] == list(bench_host.CONFIGS)
    for r in rows:
        sparse_layers = r["what"].startswith("m3_sparse")
        metrics = r["metrics"]
        assert isinstance(r["ms"], float) and isinstance(metrics["full_layer_ms"], float)
        assert isinstance(metrics["sparse_layer_ms"], float) == sparse_layers
        assert isinstance(metrics["sparse_extra_ms"], float) == sparse_layers
        assert r["baseline"] == "dense-eager" and metrics["reps"] == 1


def test_prefill_run_writes_every_configuration_and_the_prefill_pieces(tmp_path, capsys):
    """--prefill: a row per configuration with the layers' host time, the pieces of the
    prompt's forward (a prompt past the top-k, so the index branch and the sparse op run, as
    plans), and cProfile's view with --profile."""
    argv = ["--quick", "--prefill", "--pieces", "--profile", "--sizes", "256", "--out", str(tmp_path)]
    assert bench_host.main(argv) == 0
    rows = json.loads((tmp_path / "bench_host.json").read_text())
    configs = [r for r in rows if not r["what"].startswith("piece: ")]
    assert [r["what"] for r in configs] == list(bench_host.PREFILL_CONFIGS)
    for r in configs:
        sparse_layers = r["what"].startswith("m3_sparse")
        assert isinstance(r["metrics"]["full_layer_ms"], float)
        assert isinstance(r["ms"], float) == sparse_layers
        assert r["metrics"]["gpu_caught_up"] == 0  # no spin on the CPU, so nothing to catch up with
    pieces = {r["what"] for r in rows if r["what"].startswith("piece: ")}
    assert pieces == {"piece: index_prep", "piece: index_topk (a plan's run)", "piece: sparse_attention (a plan's run)",
                      "piece: dense_paged_attention (a plan's run, a full layer)", f"piece: {bench_host.M3_FUNCTION}",
                      "piece: attention function (sdpa)"}
    assert "Ordered by: cumulative time" in capsys.readouterr().out


def test_the_prefill_table_says_where_the_gpu_caught_up():
    """A repetition in which a layer's spin ended before that layer was issued is counted, and
    the table says that such figures are not host time; a clean run carries no such note."""
    args = bench_host.parse_args(["--quick", "--prefill", "--reps", "3"])
    row = {"config": "m3_sparse-eager", "sparse_layer_ms": 0.5, "full_layer_ms": 0.4, "sparse_layer_each_ms": [0.5]}
    clean = bench_host.prefill_table([dict(row, gpu_caught_up=0)], args)
    held = bench_host.prefill_table([dict(row, gpu_caught_up=2)], args)
    assert clean[-1].endswith("| 0 of 3 |") and not any("not host time" in line for line in clean)
    assert held[2].endswith("| 2 of 3 |") and "not host time" in held[-1]


def test_pieces_are_recorded_from_a_decode_step_and_timed(tmp_path):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    api = bench_host.kernel_module("api")
    before = {impl: ALL_ATTENTION_FUNCTIONS[impl] for impl in ("m3_sparse", "sdpa")}
    runs = {cls: getattr(api, cls).run for cls, _ in bench_host.PIECE_PLANS}
    assert bench_host.main(["--quick", "--pieces", "--out", str(tmp_path), "--new-tokens", "4"]) == 0
    rows = json.loads((tmp_path / "bench_host.json").read_text())
    pieces = {r["what"]: r for r in rows if r["what"].startswith("piece: ")}
    assert set(pieces) == {f"piece: {name}" for name in bench_host.PIECE_OPS} | {
        f"piece: {label}" for _, label in bench_host.PIECE_PLANS} | {
        f"piece: {bench_host.M3_FUNCTION}", "piece: attention function (sdpa)"}
    assert all(r["ms"] > 0 and r["metrics"]["calls"] == bench_host.PIECE_CALLS for r in pieces.values())
    assert {impl: ALL_ATTENTION_FUNCTIONS[impl] for impl in before} == before  # the recorders are gone
    assert {cls: getattr(api, cls).run for cls in runs} == runs


def test_the_plans_switch_restores_the_setting():
    attention = bench_host.kernel_module("hf.attention")
    assert attention.PLANNED is True
    with bench_host.planned(False):
        assert attention.PLANNED is False
    assert attention.PLANNED is True


def test_layer_clock_sums_layers_by_kind_and_restores_forward():
    original = m3.MiniMaxM3VLDecoderLayer.forward

    class Attn(torch.nn.Module):
        def __init__(self, sparse):
            super().__init__()
            self.indexer = torch.nn.Identity() if sparse else None

    layers = []
    for sparse in (True, False, True):
        layer = m3.MiniMaxM3VLDecoderLayer.__new__(m3.MiniMaxM3VLDecoderLayer)
        torch.nn.Module.__init__(layer)
        layer.self_attn = Attn(sparse)
        layers.append(layer)
    calls = []
    m3.MiniMaxM3VLDecoderLayer.forward = lambda self, *a, **k: calls.append(self)
    try:
        totals = {}
        with bench_host.layer_clock(totals):
            for layer in layers:
                m3.MiniMaxM3VLDecoderLayer.forward(layer)
        assert calls == layers and set(totals) == {"sparse", "full"}
        assert all(v >= 0 for v in totals.values())
    finally:
        m3.MiniMaxM3VLDecoderLayer.forward = original


def test_direct_launch_switch_restores_the_launcher():
    launch = bench_host.kernel_module("core.launch")
    releases = launch.DIRECT_LAUNCH_TRITON
    with bench_host.direct_launches(False):
        assert launch.DIRECT_LAUNCH_TRITON == ()
    assert launch.DIRECT_LAUNCH_TRITON == releases
    with bench_host.direct_launches(True):
        assert launch.DIRECT_LAUNCH_TRITON == releases


def test_the_extra_is_the_median_of_differences_within_repetitions(monkeypatch):
    """A host that slows down in one repetition moves both sides of that repetition's
    difference, not the median of the differences."""
    args = bench_host.parse_args(["--quick", "--layers", "sf", "--reps", "3", "--new-tokens", "4"])
    steps = args.new_tokens - 2
    dense_ms = iter([1.0, 1.0, 2.0, 10.0])  # full layer of the dense twin, per repetition (the first warms up)
    sparse_ms = iter([1.5, 1.5, 9.0, 10.5])

    def timed_call(model, ids, mask, new_tokens, dense, device, cache=None):
        if new_tokens == 2:
            return 0.0, {}
        if dense:
            return 1.0, {"full": next(dense_ms) * 1e-3 * steps * 2}  # two full layers
        layer = next(sparse_ms) * 1e-3 * steps
        return 1.0, {"sparse": layer, "full": layer}

    monkeypatch.setattr(bench_host, "timed_call", timed_call)
    monkeypatch.setattr(bench_host, "CONFIGS", ("dense-eager", "m3_sparse-eager"))
    rows = bench_host.measure(args, {"dense": "dense", "sparse": "sparse"}, None, None, None)
    m3 = rows[1]
    assert m3["sparse_extra_each_ms"] == pytest.approx([0.5, 7.0, 0.5])
    assert m3["sparse_extra_ms"] == pytest.approx(0.5)  # the medians' difference would say 9.0 - 2.0
