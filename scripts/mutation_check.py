#!/usr/bin/env python3
"""Mutation check: break the kernels on purpose, one named change at a time, and make sure the
tests that claim to check that code fail.

A mutation replaces a literal text in one file of ``torch-ext/m3_sparse/`` inside a temporary
copy of the repository (``torch-ext/``, ``tests/``, ``pyproject.toml``, ``build.toml``; the
working tree is never written), builds the copy's ``build/`` (``scripts/build_kernel.py``, which
the package loads through ``M3_SPARSE_KERNEL``: the model tests run the mutated kernel too) and
runs the tests it names there. Each named test (a node id; a test
function names all its parameter sets) must fail under the mutation, and pass on the
unmutated copy, which runs first. The first named test is a quick one: ``--short`` runs
only that one per mutation (the others are the existing tests that catch it too). A mutation whose text no longer occurs exactly as often as
it says stops the check with an error, so the list cannot rot into mutations that apply
nowhere; so does a named test that no longer exists or is skipped here.

Some mutations change only what runs under Triton's interpreter (the stand-ins of
``core/interpreter.py``); on a GPU they change nothing, so they are skipped there.

    python scripts/mutation_check.py --list         # the mutations, the CI list marked
    python scripts/mutation_check.py --short        # the CI list, quick tests (tests/test_mutations.py)
    python scripts/mutation_check.py --all          # every mutation
    python scripts/mutation_check.py NAME [NAME...] # chosen ones

Exit status 0 when every mutation ran is caught; 1 when one survives; 2 on an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_kernel  # noqa: E402  (scripts/build_kernel.py, beside this script; also when loaded from a path)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path("torch-ext") / "m3_sparse"
COPIED = ("torch-ext", "tests", "pyproject.toml", "build.toml")
TIMEOUT_S = 1800

K = "tests/kernels/"
BRANCHES = K + "test_interpreter_branches.py::"
PLACEMENT = "tests/test_cache_placement.py::"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # under torch-ext/m3_sparse/
    old: str
    new: str
    tests: tuple[str, ...]  # node ids that must each fail, the quick one first
    what: str
    count: int = 1  # occurrences of ``old`` in the file (all are replaced)
    interpreter_only: bool = False


MUTATIONS = (
    Mutation(
        name="kvouter_widened_key_scale", path="kvouter/partials_triton.py",
        old="b_kt = b_kt.to(q_dt)  # fp8", new="b_kt = (b_kt.to(tl.float32) * 1.25).to(q_dt)  # fp8",
        tests=(BRANCHES + "test_widened_fp8_keys_against_a_bf16_q[kvouter]",
               K + "test_fp8_attention.py::test_fp8_caches[q16-causal-triton-kvouter]"),
        what="KV-outer: fp8 keys widened for a bf16 q come out 1.25x too large",
    ),  # fmt: skip
    Mutation(
        name="decode_widened_key_scale", path="decode/attention_triton.py",
        old="b_k = b_k.to(b_q.dtype)  # fp8", new="b_k = (b_k.to(tl.float32) * 1.25).to(b_q.dtype)  # fp8",
        tests=(BRANCHES + "test_widened_fp8_keys_against_a_bf16_q[decode]",
               K + "test_fp8_attention.py::test_fp8_caches[q16-causal-triton-decode]"),
        what="decode: fp8 keys widened for a bf16 q come out 1.25x too large",
    ),  # fmt: skip
    Mutation(
        name="dense_widened_key_scale", path="dense/attention_triton.py",
        old="b_k = b_k.to(b_q.dtype)  # fp8", new="b_k = (b_k.to(tl.float32) * 1.25).to(b_q.dtype)  # fp8",
        tests=(BRANCHES + "test_widened_fp8_keys_against_a_bf16_q[dense]",
               K + "test_fp8_attention.py::test_fp8_caches[q16-causal-triton-dense]"),
        what="dense: fp8 keys widened for a bf16 q come out 1.25x too large",
    ),  # fmt: skip
    Mutation(
        name="e4m3_rounding_skipped", path="core/interpreter.py",
        old="x = round_e4m3(x)", new="x = tl.clamp(x, -448.0, 448.0)",
        tests=(BRANCHES + "test_e4m3_conversion_rounds_to_nearest_even_and_saturates",
               BRANCHES + "test_e4m3_partials_round_like_the_torch_stage"),
        what="e4m3 partials and queries left to the interpreter's own fp32 -> e4m3 conversion",
        interpreter_only=True,
    ),  # fmt: skip
    Mutation(
        name="e4m3_rounding_two_bits", path="core/interpreter.py",
        old="step = tl.exp2((exp - 3).to(tl.float32))", new="step = tl.exp2((exp - 2).to(tl.float32))",
        tests=(BRANCHES + "test_e4m3_conversion_rounds_to_nearest_even_and_saturates",
               BRANCHES + "test_e4m3_partials_round_like_the_torch_stage"),
        what="the e4m3 rounding keeps 2 mantissa bits instead of 3",
        interpreter_only=True,
    ),  # fmt: skip
    Mutation(
        name="e4m3_partials_unnormalized", path="kvouter/partials_triton.py",
        old="b_o = to_e4m3(b_o / tl.where(b_l == 0.0, 1.0, b_l)[:, None])", new="b_o = to_e4m3(b_o)",
        tests=(BRANCHES + "test_e4m3_partials_round_like_the_torch_stage",
               K + "test_fp8_partials.py::test_partials_kernel_matches_the_torch_stage"),
        what="e4m3 partials stored as raw O instead of O / l",
    ),  # fmt: skip
    Mutation(
        name="bf16_dot_stand_in_dropped", path="core/interpreter.py",
        old="if INTERPRETER and (a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16):", new="if False:",
        tests=(BRANCHES + "test_dot_of_bf16_operands_is_exact_products_in_fp32",
               BRANCHES + "test_widened_fp8_keys_against_a_bf16_q"),
        what="bf16 dots left to the interpreter, which multiplies their bit patterns",
        interpreter_only=True,
    ),  # fmt: skip
    Mutation(
        name="combine_drops_a_partial", path="kvouter/combine_triton.py",
        old="live = row_ok & (b_slot >= 0)", new="live = row_ok & (b_slot >= 0) & (k > 0)",
        tests=(BRANCHES + "test_e4m3_partials_round_like_the_torch_stage",
               K + "test_triton_kvouter.py::test_combine_matches_torch"),
        what="the combine leaves out each row's first partial",
    ),  # fmt: skip
    Mutation(
        name="combine_drops_v_scale", path="kvouter/combine_triton.py",
        old="b_out = b_out * tl.load(scale_ptr)", new="b_out = b_out",
        tests=(BRANCHES + "test_e4m3_partials_round_like_the_torch_stage",
               K + "test_fp8_partials.py::test_combine_of_normalized_partials"),
        what="the combine of e4m3 partials forgets V's scale",
    ),  # fmt: skip
    Mutation(
        name="decode_softmax_scale", path="decode/attention_triton.py",
        old="self.scale = float(args.softmax_scale) * LOG2E", new="self.scale = float(args.softmax_scale) * 1.1 * LOG2E",
        tests=(K + "test_triton_decode.py::test_decode_matches_reference",),
        what="the decode kernel's softmax scale 10% too large",
    ),  # fmt: skip
    Mutation(
        name="kvouter_softmax_scale", path="kvouter/partials_triton.py",
        old="float(args.softmax_scale) * LOG2E,", new="float(args.softmax_scale) * 1.1 * LOG2E,",
        tests=(K + "test_triton_kvouter.py::test_composed_matches_reference",),
        what="the KV-outer partials kernel's softmax scale 10% too large",
    ),  # fmt: skip
    Mutation(
        name="fa4_fp8_descales_swapped", path="dense/attention_fa4.py",
        old="for s in (q_scale, args.scales[1], args.scales[2])", new="for s in (q_scale, args.scales[2], args.scales[1])",
        tests=(K + "test_fa4_dense.py::test_fp8_plumbing_against_the_contract",),
        what="flash-attn-4's fp8 call gets V's scale for K and K's for V",
    ),  # fmt: skip
    Mutation(
        name="fa4_rows_before_first_key_kept", path="dense/attention_fa4.py",
        old="dead |= (pos < 0)[None, :]", new="dead |= (pos < -1)[None, :]",
        tests=(K + "test_fa4_dense.py::test_plumbing_against_the_measured_contract",),
        what="without the causal mask, the rows before a sequence's first key keep what flash-attn-4 gives them",
    ),  # fmt: skip
    Mutation(
        name="page_tail_keeps_first_free_slot", path="dense/tails_triton.py",
        old="keep = (offs_s[:, None] >= tail)", new="keep = (offs_s[:, None] > tail)",
        tests=(K + "test_fa4_dense.py::test_clear_page_tails_matches_torch",),
        what="the page-tail kernel leaves the first slot past a sequence's length unzeroed",
    ),  # fmt: skip
    Mutation(
        name="index_tie_to_higher_id", path="index/topk_triton.py",
        old="(cand > worst_val)[:, None]", new="(cand >= worst_val)[:, None]",
        tests=(K + "test_triton_index_topk.py::test_exact_ties_prefer_lower_block_ids",),
        what="the index kernel lets a later (higher) block win a tie for the last kept slot",
    ),  # fmt: skip
    Mutation(
        name="decode_plan_keeps_its_query", path="decode/attention_triton.py",
        old="            q, k_cache, v_cache, selected, block_tables, self.cu_seqlens_q",
        new="            self.args.q, k_cache, v_cache, selected, block_tables, self.cu_seqlens_q",
        tests=(K + "test_plans.py::test_sparse_attention_plan_runs_like_the_op",),
        what="a sparse-attention plan launches on the query it was made with, not the run's",
    ),  # fmt: skip
    Mutation(
        name="index_plan_copies_the_lengths", path="index/topk_triton.py",
        old="self.block_tables, self.cu_seqlens_q, self.used_kv_lens = metadata(args)",
        new="self.block_tables, self.cu_seqlens_q, self.used_kv_lens = metadata(args)[:5] + (args.used_kv_lens.clone(),)",
        tests=(K + "test_plans.py::test_index_topk_plan_runs_like_the_op",),
        what="an index plan reads a copy of the kv lengths made when it was planned",
    ),  # fmt: skip
    Mutation(
        name="dense_launch_descriptors_of_any_pool", path="dense/attention_triton.py",
        old="        key = (k_cache.data_ptr(), v_cache.data_ptr())",
        new="        key = (0, 0)",
        tests=(K + "test_plans.py::test_dense_attention_plan_runs_like_the_op",),
        what="a dense plan loads every run's keys through the TMA descriptors of the first pools it ran on",
    ),  # fmt: skip
    Mutation(
        name="decode_counts_left_nonzero", path="decode/attention_triton.py",
        old="                tl.store(cnt_ptr + pair, 0)",
        new="                pass",
        tests=(K + "test_triton_decode.py::test_a_launch_run_again_reuses_its_scratch",),
        what="the merging split leaves its arrival count set, which a kept count buffer carries to the next run",
    ),  # fmt: skip
    Mutation(
        name="crop_keeps_the_pending_step", path="hf/cache.py",
        old='        n["pending"].zero_()\n', new="",
        tests=("tests/test_deferred_stop.py::test_crop_puts_the_lengths_back",
               "tests/test_deferred_stop.py::test_the_deferred_loop_gives_the_checked_loop_result"),
        what="crop leaves the last step's tokens pending, so the next step commits them again",
    ),  # fmt: skip
    Mutation(
        name="prefill_token_deferred", path="hf/attention.py",
        old="            self.deferring = not self.paged\n", new="            self.deferring = True\n",
        tests=("tests/test_deferred_stop.py::test_the_deferred_loop_gives_the_checked_loop_result",),
        what="the prefill's token waits for the first decode step (a CUDA graph's recording) to be streamed",
    ),  # fmt: skip
    Mutation(
        name="last_leading_pad_on_a_real_slot", path="hf/cache.py",
        old="scratch = (i[None, :] < lead[:, None]) | (pos >= capacity)",
        new="scratch = (i[None, :] < lead[:, None] - 1) | (pos >= capacity)",
        tests=(PLACEMENT + "test_a_left_padded_prompt_sends_every_pad_to_the_scratch_page[16-cpu]",
               PLACEMENT + "test_a_left_padded_prompt_sends_every_pad_to_the_scratch_page[128-cpu]",
               "tests/test_fp8_index.py::test_cache_stores_quantized_keys_where_the_plain_cache_stores_keys"),
        what="the last leading pad of a left-padded row is written to a real slot instead of the scratch page "
             "(on the CPU its real token 0 overwrites it; on a GPU the two writes race)",
    ),  # fmt: skip
    Mutation(
        name="leading_pads_after_a_history_on_real_slots", path="hf/cache.py",
        old="scratch = (i[None, :] < lead[:, None]) | (pos >= capacity)",
        new="scratch = (pos < 0) | (pos >= capacity)",
        tests=(PLACEMENT + "test_a_left_padded_step_after_a_history[16-None-cpu]",
               PLACEMENT + "test_a_left_padded_step_after_a_history[128-float8_e4m3fn-cpu]",
               PLACEMENT + "test_a_left_padded_chunk_after_a_history_matches_the_unpadded_rows"),
        what="only pads of negative position go to the scratch page: a step with leading pads on a cache that "
             "holds a history writes them over the history's last tokens (a first step is unaffected)",
    ),  # fmt: skip
    Mutation(
        name="serving_index_keys_one_slot_early", path="hf/serving.py",
        old="self.group.write_index_keys(self.layer_idx, index_keys, self.group_step.slots)",
        new="self.group.write_index_keys(self.layer_idx, index_keys, (self.group_step.slots - 1).clamp(min=0))",
        tests=("tests/test_continuous_batching.py::test_served_index_keys_sit_at_their_tokens_slots",
               "tests/test_continuous_batching.py::test_mixed_lengths_equal_generate"),
        what="a continuous-batching step writes each new token's index keys one slot before its K/V (clamped at "
             "slot 0: one slot late runs past the pool's last slot and fails the step, not the placement check)",
    ),  # fmt: skip
    Mutation(
        name="decode_short_rows_bound_exclusive", path="decode/attention_triton.py",
        old="live = (q_hi - q_lo <= ROWS) & (t < q_hi)", new="live = (q_hi - q_lo < ROWS) & (t < q_hi)",
        tests=(K + "test_triton_decode.py::test_short_rows_of_a_mixed_call",
               K + "test_dispatch.py::test_a_kvouter_call_leaves_its_short_sequences_to_the_decode_kernel"),
        what="in a mixed call the decode kernel skips the sequences of exactly R rows, which KV-outer left to it",
    ),  # fmt: skip
    Mutation(
        name="decode_short_rows_take_long_rows", path="decode/attention_triton.py",
        old="live = (q_hi - q_lo <= ROWS) & (t < q_hi)", new="live = t < q_hi",
        tests=(K + "test_triton_decode.py::test_short_rows_of_a_mixed_call",),
        what="in a mixed call the decode kernel also writes the first R rows of the long sequences (right values, "
             "the work done twice)",
    ),  # fmt: skip
    Mutation(
        name="mixed_kvouter_keeps_short_rows", path="api.py",
        old="long_rows = args.replace(selected=args.selected.masked_fill(short[:, None, None], -1))",
        new="long_rows = args",
        tests=(K + "test_dispatch.py::test_a_kvouter_call_leaves_its_short_sequences_to_the_decode_kernel",),
        what="a mixed call still runs its decode rows through KV-outer as well (right values, the work twice)",
    ),  # fmt: skip
    Mutation(
        name="serving_page_reads_skip_a_page", path="hf/serving_layout.py",
        old="return torch.cumsum(counts, 0) - counts", new="return torch.cumsum(counts, 0) - counts + 1",
        tests=("tests/test_continuous_batching.py::test_kernel_view_matches_cache_reads",
               "tests/test_continuous_batching.py::test_mixed_lengths_equal_generate"),
        what="a step with a history finds each request's pages one cache page late in the manager's per-page read "
             "index (transformers 5.18 and later)",
    ),  # fmt: skip
    Mutation(
        name="kvouter_plan_stale_queries", path="kvouter/pipeline_triton.py",
        old="args = self.args.replace(q=q, k_cache=k_cache",
        new="args = self.args.replace(k_cache=k_cache",
        tests=("tests/kernels/test_plans.py::test_a_kvouter_plan_runs_like_the_op_and_keeps_no_call_tensors",),
        what="a kept KV-outer plan attends the queries of the call it was made from, not the run's",
    ),  # fmt: skip
    Mutation(
        name="prefill_plan_keeps_scratch", path="core/launch.py",
        old="self._keep = False", new="self._keep = True",
        tests=("tests/kernels/test_plans.py::test_a_released_plan_keeps_its_scratch_only_when_asked",),
        what="a prefill plan's launch keeps its split workspaces after its run, so they outlive the forward pass",
    ),  # fmt: skip
    Mutation(
        name="page_table_slice_short", path="hf/serving_layout.py",
        old="kv_tables[r0:r1] = kv", new="kv_tables[r0:r1 - 1] = kv[:-1]",
        tests=("tests/test_continuous_batching.py::test_page_tables_built_in_slices",),
        what="a step's K/V page tables, built a slice of rows at a time, leave each slice's last row unfilled",
    ),  # fmt: skip
    Mutation(
        name="decode_table_rows_stale", path="hf/serving_allocator.py",
        old="if kept is None or kept[0] != block_ids or", new="if kept is None or",
        tests=("tests/test_continuous_batching.py::test_decode_table_rows_follow_the_blocks",),
        what="a request's kept row of the decode block table is copied after its blocks changed",
    ),  # fmt: skip
    Mutation(
        name="tile_prefix_rounds_down", path="kvouter/build_triton.py",
        old="b_t = (b_n + tile_q - 1) // tile_q", new="b_t = b_n // tile_q",
        tests=(K + "test_triton_kvouter_index.py::test_prefix_pass_in_several_steps",
               K + "test_triton_kvouter_index.py::test_matches_torch_builder_and_scheduler"),
        what="the prefix pass counts a segment's partial last tile out",
    ),  # fmt: skip
    Mutation(
        name="segment_prefix_drops_its_carry", path="kvouter/build_triton.py",
        old="carry_e += tl.sum(b_n, 0)", new="carry_e += 0",
        tests=(K + "test_triton_kvouter_index.py::test_prefix_pass_in_several_steps",),
        what="the prefix pass restarts the segment offsets at every step of PREFIX_SEGMENTS",
    ),  # fmt: skip
    Mutation(
        name="dense_search_reads_one_vector", path="dense/attention_triton.py",
        old="for i in tl.static_range(SEARCH_STEPS):", new="for i in tl.static_range(1):",
        tests=(K + "test_triton_dense_attention.py::test_tile_search_over_several_vectors",),
        what="a dense program looks for its tile's sequence in the first vector of sequences only",
    ),  # fmt: skip
    Mutation(
        name="index_prep_specializes_its_length", path="index/prep_triton.py",
        old='@triton.jit(do_not_specialize=["seq"])', new="@triton.jit",
        tests=(K + "test_gpu_compile.py::test_lengths_share_their_compiles",),
        what="a decode step's index prep compiles again beside the prefill's",
    ),  # fmt: skip
    Mutation(
        name="kvouter_build_specializes_its_rows", path="kvouter/build_triton.py",
        old='common = dict(C=self.chunk, TK=tk, BB=seq_block(self.batch),',
        new='common = dict(C=self.chunk, TK=tk, BB=max(2, next_pow2(self.batch)),',
        tests=(K + "test_gpu_compile.py::test_lengths_share_their_compiles",),
        what="a serving step with one more prefill row compiles KV-outer's index build again",
    ),  # fmt: skip
    Mutation(
        name="decode_specializes_its_table_width", path="decode/attention_triton.py",
        old='@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "stride_bt"])',
        new='@triton.jit(do_not_specialize=["num_tokens", "num_seqs"])',
        tests=(K + "test_gpu_compile.py::test_lengths_share_their_compiles",),
        what="a decode step over block tables of another width compiles the decode kernel again",
    ),  # fmt: skip
    Mutation(
        name="split_merge_specializes_its_split_count", path="core/split_merge.py",
        old='@triton.jit(do_not_specialize=["num_tokens", "num_splits"])',
        new='@triton.jit(do_not_specialize=["num_tokens"])',
        tests=(K + "test_gpu_compile.py::test_lengths_share_their_compiles",),
        what="a decode step whose history selects another split count compiles the split merge again",
    ),  # fmt: skip
    Mutation(
        name="split_merge_drops_its_last_split", path="core/split_merge.py",
        old="        b_ls = tl.load(l_ws_ptr + rows, mask=ok, other=0.0)",
        new="        ok = ok & ((s0 + offs_s) < num_splits - 1)[:, None]\n"
            "        b_ls = tl.load(l_ws_ptr + rows, mask=ok, other=0.0)",
        tests=(K + "test_triton_decode.py::test_merge_splits_against_float64",
               K + "test_triton_decode.py::test_merge_in_place_equals_merge_kernel"),
        what="the split merge leaves out each row's last split",
    ),  # fmt: skip
    Mutation(
        name="tma_partials_refuse_a_transposed_q", path="kvouter/partials_gluon_sm90.py",
        old="    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):",
        new="    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):",
        tests=(K + "test_dispatch_capability.py::test_a_models_transposed_q_runs_the_tma_partials",
               "tests/test_model_kernel_choice.py::test_a_prompts_kvouter_calls_meet_the_tma_kernels_rule"),
        what="a model's batch-1 prefill runs the tl partials kernel instead of the TMA one",
    ),  # fmt: skip
    Mutation(
        name="sdpa_prefill_scale", path="dense/attention_sdpa.py",
        old="is_causal=True, scale=scale,", new="is_causal=True, scale=scale * 1.05,",
        tests=("tests/test_sdpa_prefill.py::test_prefill_on_sdpa_matches_the_pages",),
        what="a prefill on sdpa scales its scores wrongly",
    ),  # fmt: skip
    Mutation(
        name="sdpa_prefill_after_history", path="hf/cache.py",
        old="empty = attention_mask is None and not _in_graph() and self._host_slots == 0",
        new="empty = attention_mask is None and not _in_graph()",
        tests=("tests/test_sdpa_prefill.py::test_a_history_padding_or_fp8_pages_keep_the_pages",),
        what="a step with a history attends to its new tokens alone",
    ),  # fmt: skip
    Mutation(
        name="step_segments_unreserved", path="hf/serving_layout.py",
        old="segment_bytes = api.kvouter_bytes_per_segment() * rows * per_row", new="segment_bytes = 0.0",
        tests=("tests/test_serving_memory.py::test_no_mask_nor_read_back_is_reserved",),
        what="the memory handler leaves out KV-outer's segments of a step as wide as the pool",
    ),  # fmt: skip
    Mutation(
        name="cancelled_request_hashed", path="hf/serving_allocator.py",
        old="        if request_id not in self.block_table:\n            return\n", new="",
        tests=("tests/test_continuous_batching.py::test_a_request_cancelled_in_flight_keeps_the_manager_alive",),
        what="a request cancelled while its step was in flight has its blocks hashed after its table is gone: "
             "KeyError stops the manager (transformers 5.18 and later)",
    ),  # fmt: skip
    Mutation(
        name="cancelled_request_marked", path="hf/serving_groups.py",
        old="    if runs_m3_sparse(self.config) and any(", new="    if False and any(",
        tests=("tests/test_continuous_batching.py::test_a_request_cancelled_in_flight_keeps_the_manager_alive",),
        what="a request cancelled while its step was in flight has its blocks marked after its table is gone: "
             "KeyError stops the manager (transformers 5.17)",
    ),  # fmt: skip
    Mutation(
        name="compile_ahead_pass_launches", path="core/launch.py",
        old="        fn.run(*args, grid=grid, warmup=True, **kwargs)", new="        fn[grid](*args, **kwargs)",
        tests=(K + "test_compile_ahead.py::test_a_pass_compiles_each_launch_and_launches_nothing",),
        what="a compile-ahead pass launches its kernels instead of only compiling them (every kernel runs twice, "
             "and a kernel that updates its inputs in place updates them twice)",
    ),  # fmt: skip
    Mutation(
        name="qouter_rows_take_every_union_block", path="dense/attention_triton.py",
        old="chose = tl.max((r_ids == blk).to(tl.int32), 1) > 0  # [BM]", new="chose = row_ok  # [BM]",
        tests=(K + "test_triton_qouter.py::test_qouter_matches_reference",),
        what="query-outer tiles: every row attends the whole union of its tile's blocks, not only those its "
             "token chose",
    ),  # fmt: skip
    Mutation(
        name="qouter_union_keeps_repeats", path="dense/attention_triton.py",
        old="u_keep = u_keep & (tl.max(u_seen.to(tl.int32), 1) == 0)", new="u_keep = u_keep",
        tests=(K + "test_triton_qouter.py::test_qouter_matches_reference",),
        what="query-outer tiles: a block that several tokens chose (or one chose twice) is attended once per "
             "choice",
    ),  # fmt: skip
    Mutation(
        name="qouter_block_end_not_cut", path="dense/attention_triton.py",
        old="b_lim = tl.where(chose, tl.minimum(lim, b_lo + BS), 0)", new="b_lim = tl.where(chose, lim, 0)",
        tests=(K + "test_triton_qouter.py::test_qouter_matches_reference[16-16-4-4-6-dtype4-32-None-random]",),
        what="query-outer tiles: a key tile wider than a block also attends the next block's keys",
    ),  # fmt: skip
)
BY_NAME = {m.name: m for m in MUTATIONS}
# What CI runs (tests/test_mutations.py): the mutations of the GPU branches the interpreter
# used to skip, one each of the combine and the index kernel, a plan's launch, where a
# serving step puts the index keys, and the query-outer tiles' rows.
SHORT = (
    "kvouter_widened_key_scale",
    "decode_widened_key_scale",
    "dense_widened_key_scale",
    "e4m3_rounding_skipped",
    "combine_drops_a_partial",
    "index_tie_to_higher_id",
    "decode_plan_keeps_its_query",
    "serving_index_keys_one_slot_early",
    "qouter_rows_take_every_union_block",
)


class MutationError(Exception):
    """The check itself cannot run as written (rotted text, missing tests, a failing baseline)."""


def copy_tree(dest: Path) -> Path:
    """The parts of the repository the kernel tests need, copied under ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    build_kernel.write(dest)
    return dest


def mutated_text(m: Mutation, text: str) -> str:
    found = text.count(m.old)
    if found != m.count:
        raise MutationError(
            f"{m.name}: {m.path} holds {found} occurrence(s) of {m.old!r}, expected {m.count}; "
            "update the mutation to the current source"
        )
    return text.replace(m.old, m.new)


@contextlib.contextmanager
def applied(tree: Path, m: Mutation):
    """``m`` applied to the copy at ``tree`` while active."""
    path = tree / PACKAGE / m.path
    original = path.read_text()
    path.write_text(mutated_text(m, original))
    build_kernel.write(tree)
    try:
        yield
    finally:
        path.write_text(original)
        build_kernel.write(tree)


REPORT_PLUGIN = '''
import json, os

_outcomes = {}

def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped:
        _outcomes.setdefault(report.nodeid, "skipped")
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, "passed")

def pytest_sessionfinish(session):
    with open(os.environ["MUTATION_REPORT"], "w") as f:
        json.dump(_outcomes, f)
'''


def run_tests(tree: Path, tests: list[str]) -> tuple[dict[str, str], str]:
    """Run ``tests`` in the copy at ``tree``: (outcome of each test that ran, output tail)."""
    (tree / "_mutation_report.py").write_text(REPORT_PLUGIN)
    report = tree / "_mutation_report.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", MUTATION_REPORT=str(report),
               M3_SPARSE_KERNEL=str(tree))
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_mutation_report", *tests]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    tail = (proc.stdout + proc.stderr)[-3000:]
    if not report.exists():
        raise MutationError(f"pytest ended without a report (exit {proc.returncode}):\n{tail}")
    return json.loads(report.read_text()), tail


def selected(outcomes: dict[str, str], test: str) -> dict[str, str]:
    """The outcomes of the tests node id ``test`` names (itself, or its parameter sets)."""
    return {k: v for k, v in outcomes.items() if k == test or k.startswith(test + "[")}


def named_tests(m: Mutation, quick: bool = False) -> tuple[str, ...]:
    return m.tests[:1] if quick else m.tests


def check_baseline(tree: Path, mutations: list[Mutation], quick: bool = False) -> float:
    """Every named test exists, runs here and passes on the unmutated copy; returns seconds."""
    tests = sorted({t for m in mutations for t in named_tests(m, quick)})
    t0 = time.monotonic()
    outcomes, tail = run_tests(tree, tests)
    for t in tests:
        got = selected(outcomes, t)
        if not got:
            raise MutationError(f"named test {t} does not exist (renamed or removed?)\n{tail}")
        bad = {k: v for k, v in got.items() if v != "passed"}
        if bad:
            raise MutationError(f"unmutated, these tests do not pass, so they can catch nothing: {bad}\n{tail}")
    return time.monotonic() - t0


def check_mutation(tree: Path, m: Mutation, quick: bool = False) -> tuple[list[str], float, str]:
    """Run ``m``'s tests with ``m`` applied: (the named tests that did not fail, seconds, output)."""
    tests = named_tests(m, quick)
    t0 = time.monotonic()
    with applied(tree, m):
        outcomes, tail = run_tests(tree, list(tests))
    missed = [t for t in tests if "failed" not in selected(outcomes, t).values()]
    return missed, time.monotonic() - t0, tail


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (see --list)")
    ap.add_argument("--list", action="store_true", help="list the mutations and their tests")
    ap.add_argument("--short", action="store_true", help="the CI list, the first named test of each")
    ap.add_argument("--all", action="store_true", help="every mutation")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            flags = " [CI]" if m.name in SHORT else ""
            flags += " [interpreter only]" if m.interpreter_only else ""
            print(f"{m.name}{flags}: {m.what}\n  {m.path}: {m.old!r} -> {m.new!r}")
            print("".join(f"  must fail: {t}\n" for t in m.tests), end="")
        return 0
    chosen = list(MUTATIONS) if args.all else [BY_NAME[n] for n in SHORT] if args.short else []
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown mutation(s) {unknown}; --list shows them")
    chosen += [BY_NAME[n] for n in args.names if BY_NAME[n] not in chosen]
    if not chosen:
        ap.error("name mutations, or give --short, --all or --list")
    gpu = on_gpu()
    todo = [m for m in chosen if not (gpu and m.interpreter_only)]
    for m in chosen:
        if m not in todo:
            print(f"{m.name}: skipped (changes only what runs under Triton's interpreter)")
    tmp = Path(tempfile.mkdtemp(prefix="m3-mutations-"))
    try:
        tree = copy_tree(tmp)
        for m in todo:  # every text applies before anything runs
            mutated_text(m, (tree / PACKAGE / m.path).read_text())
        secs = check_baseline(tree, todo, args.short)
        print(f"baseline: the named tests pass unmutated ({secs:.0f} s)", flush=True)
        survived = []
        for m in todo:
            missed, secs, tail = check_mutation(tree, m, args.short)
            print(f"{m.name}: {'caught' if not missed else 'SURVIVED'} ({secs:.0f} s) - {m.what}", flush=True)
            for t in missed:
                print(f"  did not fail: {t}")
            if missed:
                survived.append(m.name)
                print(tail)
    except (MutationError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"copy kept at {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if survived:
        print(f"{len(survived)} of {len(todo)} mutation(s) survived: {', '.join(survived)}")
        return 1
    print(f"all {len(todo)} mutation(s) caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
