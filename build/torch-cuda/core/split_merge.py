"""Merging key splits: one attention row computed by S programs over disjoint key ranges.

Each split leaves its raw fp32 (o, m, l) in a workspace: ``o`` the unnormalized output row,
``m`` the row max in log2 units, ``l`` the row sum of ``2^(s - m)``. The merge takes
``M = max m_s``, ``a_s = 2^(m_s - M)``, ``out = sum a_s o_s / sum a_s l_s``,
``lse = (M + log2 sum a_s l_s) * ln 2``. Used by the sparse decode kernel (when its last
split does not merge in place) and by the dense kernel's key splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_kernel, next_pow2

# Partial values (splits x heads x head dim) one merge program holds at a time: MERGE_STEP
# splits of RB heads, loaded together (64 registers a thread at 4 warps).
COMBINE_ELEMS = 8192
# Splits a merge program takes per step of its loop. The split count is a run-time value, so
# one compile serves every count: a decode step's splits grow with the context (8 at 4K, 64
# from 32K on an H100), and a loop unrolled over 64 splits was the slowest compile of a
# model's first call. 32 splits a step leave RB = 2 heads a program at D = 128: a one-token
# step spreads over Hq / 2 programs, as when the loop was unrolled.
MERGE_STEP = 32


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])  # lengths and counts (core.launch: specializations)
def _merge_splits_kernel(
    o_ws_ptr,
    m_ws_ptr,
    l_ws_ptr,
    out_ptr,
    lse_ptr,
    num_tokens,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    SC: tl.constexpr,
    G: tl.constexpr,
    RB: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1) * RB + tl.arange(0, RB)
    offs_d = tl.arange(0, BD)
    offs_s = tl.arange(0, SC)
    row_ok = head < num_heads
    d_ok = offs_d < D
    # Split s of (t, head) is workspace row ((t * Hkv + g) * S + s) * G + r, head = g * G + r.
    hkv = num_heads // G
    row0 = ((t.to(tl.int64) * hkv + head // G) * num_splits) * G + head % G  # [RB]

    # The rows' max over their splits, SC splits a step (the m values alone: a few bytes).
    b_mx = tl.full([RB], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, SC):
        ok = ((s0 + offs_s) < num_splits)[:, None] & row_ok[None, :]  # [SC, RB]
        rows = row0[None, :] + (s0 + offs_s)[:, None] * G
        b_mx = tl.maximum(b_mx, tl.max(tl.load(m_ws_ptr + rows, mask=ok, other=float("-inf")), axis=0))
    empty = b_mx == float("-inf")
    m_safe = tl.where(empty, 0.0, b_mx)
    b_l = tl.zeros([RB], tl.float32)
    acc = tl.zeros([RB, BD], tl.float32)
    # A step's partials as one [SC, RB, BD] tile: their loads are independent and in flight
    # together, as the unrolled loop had them.
    for s0 in range(0, num_splits, SC):
        ok = ((s0 + offs_s) < num_splits)[:, None] & row_ok[None, :]  # [SC, RB]
        rows = row0[None, :] + (s0 + offs_s)[:, None] * G
        b_m = tl.load(m_ws_ptr + rows, mask=ok, other=float("-inf"))
        b_ls = tl.load(l_ws_ptr + rows, mask=ok, other=0.0)
        b_o = tl.load(o_ws_ptr + rows[:, :, None] * D + offs_d[None, None, :],
                      mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)  # [SC, RB, BD]
        # 2^-inf = 0 drops splits that saw no key, and the masked ones.
        b_a = tl.exp2(b_m - m_safe[None, :])  # [SC, RB]
        b_l += tl.sum(b_a * b_ls, axis=0)
        acc += tl.sum(b_a[:, :, None] * b_o, axis=0)  # [RB, BD]
    b_out = acc / tl.where(empty, 1.0, b_l)[:, None]
    p_out = out_ptr + t.to(tl.int64) * stride_ot + head.to(tl.int64)[:, None] * stride_oh + offs_d[None, :]
    tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        b_lse = tl.where(empty, float("-inf"), (b_mx + tl.log2(tl.where(empty, 1.0, b_l))) * 0.6931471805599453)
        tl.store(lse_ptr + head.to(tl.int64) * num_tokens + t, b_lse, mask=row_ok)


def split_workspaces(rows: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialized fp32 workspaces of ``rows`` split rows: o [rows, d], m [rows], l [rows]
    (each split writes its rows before the merge reads them)."""
    return (torch.empty(rows, d, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))


def merge_splits(o_ws, m_ws, l_ws, out, lse, num_splits: int, group: int) -> None:
    """Merge split partials (workspace rows ``((t * Hkv + g) * S + s) * G + r``: raw o
    [rows, D] fp32, m in log2 units, l) into ``out`` [Tq, Hq, D] and ``lse`` [Hq, Tq] or None.
    Shared by the decode kernel and the dense kernel's key splits."""
    num_tokens, hq, d = out.shape
    bd = max(16, next_pow2(d))
    # Rows per program: a step's MERGE_STEP x rows x D tile of partials stays about COMBINE_ELEMS.
    rb = max(2, min(next_pow2(hq), COMBINE_ELEMS // (MERGE_STEP * bd)))
    launch_kernel(
        _merge_splits_kernel, (num_tokens, -(-hq // rb)),
        o_ws,
        m_ws,
        l_ws,
        out,
        lse if lse is not None else out,
        num_tokens,
        hq,
        num_splits,
        out.stride(0),
        out.stride(1),
        SC=MERGE_STEP,
        G=group,
        RB=rb,
        D=d,
        BD=bd,
        RETURN_LSE=lse is not None,
        num_warps=4,
    )


