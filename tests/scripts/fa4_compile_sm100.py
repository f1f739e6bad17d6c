"""Run by tests/kernels/test_fa4_dense.py in a fresh process, with the CuTe DSL and
flash-attn-4 told to target sm_100a (the architecture is fixed when they load): compile,
without running, flash-attn-4's fp8 forward for this package's dense calls on fp8 caches,
through ``attention_fa4.forward`` on fake tensors (shapes and dtypes only, nothing
allocated or launched). Prints one JSON line: each call's output shape and dtype."""

from __future__ import annotations

import json

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from m3_sparse.core.validate import attention_args
from m3_sparse.dense import attention_fa4

FP8 = torch.float8_e4m3fn
HQ, HKV, D, PAGE = 64, 4, 128, 128  # M3's full-attention layer, flash-attn-4's TMA page
CALLS = {
    # name: (q dtype and its scale, sequences, query rows per sequence)
    "prefill_bf16_q": (torch.bfloat16, {}, 2, 4096),
    "decode_fp8_q": (FP8, {"q_scale": 0.03}, 8, 1),
}

results = {}
for name, (q_dtype, q_scale, batch, rows) in CALLS.items():
    pages_per_seq = 64
    with FakeTensorMode():
        dev = torch.device("cuda")
        q = torch.empty(batch * rows, HQ, D, dtype=q_dtype, device=dev)
        k = torch.empty(batch * pages_per_seq, HKV, PAGE, D, dtype=FP8, device=dev)
        v = torch.empty_like(k)
        tables = torch.empty(batch, pages_per_seq, dtype=torch.int32, device=dev)
        cu = torch.empty(batch + 1, dtype=torch.int32, device=dev)
        used = torch.empty(batch, dtype=torch.int32, device=dev)
        args = attention_args(
            q, k, v, tables, cu_seqlens_q=cu, used_kv_lens=used, softmax_scale=D**-0.5, causal=True,
            return_lse=True, sparse=False, k_scale=0.05, v_scale=0.02, max_seqlen_q=rows, **q_scale,
        )
        out, lse = attention_fa4.forward(args, tables, cu, used)
        results[name] = {"out": [list(out.shape), str(out.dtype)], "lse": list(lse.shape)}
print(json.dumps(results))
