"""benchmarks/bench_prefill_kernels.py: kernels named as an H100 profile of a 32K prefill named
them fall into their groups, the groups add up to the whole, and the CPU smoke run writes a
row per configuration (no device kernels there, so no figures). No timing is asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_prefill_kernels as bpk  # noqa: E402


@pytest.mark.parametrize("name, group", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0",
     "dense_attention"),
    ("_dense_paged_attn_kernel", "dense_attention"),
    ("_kvouter_partials_kernel", "kvouter"),
    ("_combine_kernel", "kvouter"),
    ("_chunk_rank_kernel", "kvouter"),
    ("_chunk_scan_kernel", "kvouter"),
    ("_segment_prefix_kernel", "kvouter"),
    ("_scatter_kernel", "kvouter"),
    ("_emit_tiles_kernel", "kvouter"),
    ("_index_topk_kernel", "index"),
    ("_index_prep_kernel", "index"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>", "other"),
])
def test_kernels_fall_into_their_groups(name, group):
    assert bpk.group_of(name) == group


def test_split_adds_up():
    kernels = {"_kvouter_partials_kernel": 8.0, "_combine_kernel": 3.0, "_index_topk_kernel": 1.0,
               "_dense_paged_attn_kernel": 30.0, "nvjet_gemm": 20.0, "elementwise": 5.0}
    g = bpk.split(kernels)
    assert g == {"kvouter": 11.0, "index": 1.0, "dense_attention": 30.0, "other": 25.0, "all": 67.0}


def test_quick_run_writes_a_row_per_configuration(tmp_path):
    assert bpk.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_prefill_kernels.json").read_text())
    assert [r["what"] for r in rows] == ["dense", "m3_sparse"]
    for r in rows:
        assert set(r["metrics"]["groups_ms"]) == {"kvouter", "index", "dense_attention", "other", "all"}
        assert r["baseline"] == "dense"
    assert set(rows[1]["metrics"]) >= {"free_sparse_x", "free_sparse_twin_full_x"}
