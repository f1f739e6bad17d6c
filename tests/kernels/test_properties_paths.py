"""Hypothesis property tests, as in test_properties.py, of the paths that file does not
draw: the Triton dense kernel, ``sparse_decode_attention`` (torch and Triton), and
``kvouter_attention`` run in query slices under a small workspace budget.

The strategies, the input builder and the checks are test_properties.py's, so a
falsifying example prints as the same short dict of parameters.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import m3_sparse
from kernel_test_utils import gen, make_batch, poisoned_allocations, randn
from m3_sparse.reference import dense_attention_ref, sparse_attention_ref
from test_properties import (
    PAGE_SIZES,
    TORCH_BLOCK_SIZES,
    TRITON_BLOCK_SIZES,
    TRITON_DEVICE,
    TRITON_TOKENS,
    _settings,
    attention_cases,
    build_kvouter,
    check_attention,
    index_dtypes,
    int_args,
    layouts,
    seeds,
    varlen,
)

HAS_CUDA = torch.cuda.is_available()
# Interpreter examples cost about a second each at these sizes; a GPU takes many more.
TRITON_EXAMPLES = 40 if HAS_CUDA else 10


# One test per mask, each with half the examples: on a GPU nearly every example compiles new
# kernel variants, and two tests let pytest-xdist run the halves side by side.
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@_settings(TRITON_EXAMPLES // 2)
@given(
    c=st.fixed_dictionaries(
        {
            "seed": seeds,
            "seqs": varlen(TRITON_TOKENS),
            "page_size": st.sampled_from(PAGE_SIZES),
            "hkv": st.sampled_from([1, 2]),
            "group": st.sampled_from([1, 3, 4]),
            "d": st.sampled_from([8, 16, 32]),
            "scale": st.one_of(st.none(), st.floats(0.05, 2.0)),
            "layout": layouts,
            "index_dtype": index_dtypes,
        }
    )
)
def test_dense_triton_matches_reference(causal, c):
    c = {**c, "causal": causal}
    g = gen(c["seed"])
    batch = make_batch(g, c["seqs"], c["page_size"], **c["layout"])
    q = randn(g, batch.num_tokens, c["hkv"] * c["group"], c["d"])
    k = batch.kv_cache(g, c["hkv"], c["d"])
    v = batch.kv_cache(g, c["hkv"], c["d"])
    kw = {"softmax_scale": c["scale"], "causal": c["causal"]}
    ref = dense_attention_ref(q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, **kw)
    ints = int_args(batch, c["index_dtype"], TRITON_DEVICE)
    with pytest.MonkeyPatch.context() as mp, poisoned_allocations():
        mp.setenv("M3_SPARSE_IMPL", "triton")
        got = m3_sparse.dense_paged_attention(
            q.to(TRITON_DEVICE), k.to(TRITON_DEVICE), v.to(TRITON_DEVICE), ints.pop("block_tables"),
            **ints, return_lse=True, **kw,
        )
    check_attention("dense[triton]", ref, got, batch)


def run_sparse(c, impl, device, fn, **extra):
    batch, q, k, v, sel = build_kvouter(c)
    kw = {"softmax_scale": c["scale"], "causal": c["causal"], "block_size": c["block_size"]}
    ref = sparse_attention_ref(q, k, v, sel, batch.block_tables, batch.cu_seqlens_q, batch.used_kv_lens, **kw)
    ints = int_args(batch, c["index_dtype"], device)
    if "rows_per_slice" in c:
        g = q.shape[1] // k.shape[1]
        extra["max_workspace_bytes"] = c["rows_per_slice"] * k.shape[1] * c["topk"] * g * (q.shape[2] * 4 + 8)
    with pytest.MonkeyPatch.context() as mp, poisoned_allocations():
        mp.setenv("M3_SPARSE_IMPL", impl)
        got = fn(
            q.to(device), k.to(device), v.to(device), sel.to(device, c["index_dtype"]), ints.pop("block_tables"),
            return_lse=True, **ints, **kw, **extra,
        )
    check_attention(f"{fn.__name__}[{impl}]", ref, got, batch)


def decode_cases(max_tokens, block_sizes):
    # Decode shapes: a few new tokens per sequence over longer caches.
    return attention_cases(max_tokens, block_sizes, [8, 16]).map(
        lambda c: {**c, "seqs": [(kv, min(q, 4)) for kv, q in c["seqs"]]}
    )


@_settings(40)
@given(c=decode_cases(96, TORCH_BLOCK_SIZES))
def test_decode_torch_matches_reference(c):
    run_sparse(c, "torch", torch.device("cpu"), m3_sparse.sparse_decode_attention)


@_settings(TRITON_EXAMPLES)
@given(c=decode_cases(TRITON_TOKENS, TRITON_BLOCK_SIZES))
def test_decode_triton_matches_reference(c):
    run_sparse(c, "triton", TRITON_DEVICE, m3_sparse.sparse_decode_attention)


def sliced_cases(max_tokens, block_sizes):
    return st.tuples(attention_cases(max_tokens, block_sizes, [8, 16]), st.sampled_from([2, 5, 16])).map(
        lambda t: {**t[0], "rows_per_slice": t[1]}
    )


@_settings(20)
@given(c=sliced_cases(96, TORCH_BLOCK_SIZES))
def test_kvouter_sliced_torch_matches_reference(c):
    run_sparse(c, "torch", torch.device("cpu"), m3_sparse.kvouter_attention)


# Every slice is a launch of each kernel: in the interpreter that is seconds per example,
# and test_kvouter_chunks.py / test_kvouter_slice_edges.py cover the Triton slices there.
@pytest.mark.gpu
@_settings(TRITON_EXAMPLES)
@given(c=sliced_cases(TRITON_TOKENS, TRITON_BLOCK_SIZES))
def test_kvouter_sliced_triton_matches_reference(c):
    run_sparse(c, "triton", TRITON_DEVICE, m3_sparse.kvouter_attention)
