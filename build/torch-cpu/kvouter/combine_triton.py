"""Triton combine stage: merge each (token, head)'s partials through the reverse map.

Same contract as :func:`combine.combine` (the oracle):

    M = max_s m_s,  a_s = exp(m_s - M),  l = sum_s a_s l_s,
    O = sum_s a_s O_s / l,  lse = M + log l

Empty slots (``slot_of == -1``) and partials that saw no key (m = -inf) contribute
nothing; a row with no key at all gets ``O = 0`` and ``lse = -inf``. float8_e4m3fn
partials are normalized rows (weight ``a_s l_s``); ``o_scale`` multiplies the result.

One program per (block of tokens, kv head): rows are (token, head of the group)
pairs, so a slot's G partial rows are one contiguous G x D read. The merge takes
two passes over the slots: the row max first from the small m stats, then the O
rows, whose loads are then independent of each other and can all be in flight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.launch import launch_kernel, next_pow2
from ..core.validate import FP8_DTYPES, default_out_dtype
from .combine import check_o_scale


# Default launch settings (``combine_triton``'s ``rows`` / ``num_warps`` override them): rows
# (token x head pairs) per program and warps; 8 or 16 rows run in the same time on the H200.
COMBINE_ROWS = 16
COMBINE_WARPS = 4


@triton.jit
def _load_slot(p_slot, p_slot_tok, offset, row_ok, BR: tl.constexpr, BT: tl.constexpr):
    """Slot ids ``[BR]`` at ``offset`` (-1 = empty). With one token per program every row
    has the same id, and one scalar load instead of a vector of equal ids lets ptxas hold
    the kernel in 168 registers instead of 222 (80 instead of 127 with lse) on sm_90: more
    programs per SM, 6-17% faster (docs/PERF.md, "The combine's registers")."""
    if BT == 1:
        return tl.load(p_slot_tok + offset) + tl.zeros([BR], tl.int32)
    else:
        return tl.load(p_slot + offset, mask=row_ok, other=-1)


@triton.jit(do_not_specialize=["num_tokens"])  # a length (core.launch: specializations)
def _combine_kernel(
    po_ptr,
    pm_ptr,
    pl_ptr,
    slot_ptr,
    out_ptr,
    lse_ptr,
    scale_ptr,
    num_tokens,
    stride_st,
    stride_sg,
    stride_sk,
    stride_ot,
    stride_oh,
    stride_lh,
    G: tl.constexpr,
    GP: tl.constexpr,
    TOPK: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    NORM: tl.constexpr,
    SCALE: tl.constexpr,
):
    BR: tl.constexpr = BT * GP
    pid_t = tl.program_id(0)
    g = tl.program_id(1)
    offs_r = tl.arange(0, BR)
    offs_d = tl.arange(0, BD)
    tok = pid_t * BT + offs_r // GP
    head = offs_r % GP
    if BT == 1:  # the grid has one program per token
        row_ok = head < G
    else:
        row_ok = (tok < num_tokens) & (head < G)
    d_ok = offs_d < D
    p_slot = slot_ptr + tok.to(tl.int64) * stride_st + g * stride_sg  # [BR]
    p_slot_tok = slot_ptr + pid_t.to(tl.int64) * stride_st + g * stride_sg  # the token when BT == 1

    b_mx = tl.full([BR], float("-inf"), tl.float32)
    for k in tl.static_range(TOPK):
        b_slot = _load_slot(p_slot, p_slot_tok, k * stride_sk, row_ok, BR, BT)
        b_m = tl.load(pm_ptr + b_slot.to(tl.int64) * G + head, mask=row_ok & (b_slot >= 0), other=float("-inf"))
        b_mx = tl.maximum(b_mx, b_m)
    empty = b_mx == float("-inf")
    m_safe = tl.where(empty, 0.0, b_mx)

    b_acc = tl.zeros([BR, BD], dtype=tl.float32)
    b_l = tl.zeros([BR], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        b_slot = _load_slot(p_slot, p_slot_tok, k * stride_sk, row_ok, BR, BT)
        live = row_ok & (b_slot >= 0)
        p_row = b_slot.to(tl.int64) * G + head
        b_m = tl.load(pm_ptr + p_row, mask=live, other=float("-inf"))
        b_ls = tl.load(pl_ptr + p_row, mask=live, other=0.0)
        b_o = tl.load(po_ptr + p_row[:, None] * D + offs_d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0)
        # exp2(-inf) = 0 drops empty slots and partials that saw no key.
        b_a = tl.exp2((b_m - m_safe) * 1.4426950408889634)  # [BR]
        b_l += b_a * b_ls
        if NORM:
            b_a = b_a * b_ls
        b_acc += b_a[:, None] * b_o.to(tl.float32)  # [BR, BD]

    b_out = b_acc / tl.where(empty, 1.0, b_l)[:, None]
    if SCALE:
        b_out = b_out * tl.load(scale_ptr)
    p_out = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + (g * G + head).to(tl.int64)[:, None] * stride_oh + offs_d[None, :]
    tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        b_lse = tl.where(empty, float("-inf"), b_mx + tl.log2(tl.where(empty, 1.0, b_l)) * 0.6931471805599453)
        tl.store(lse_ptr + (g * G + head).to(tl.int64) * stride_lh + tok, b_lse, mask=row_ok)


def combine_triton(
    partial_o: torch.Tensor,
    partial_m: torch.Tensor,
    partial_l: torch.Tensor,
    slot_of: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    return_lse: bool = False,
    rows: int | None = None,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    o_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """partial_o [E, G, D], partial_m/l [E, G], slot_of [Tq, Hkv, topk] ->
    (out [Tq, Hkv*G, D], lse [Hkv*G, Tq] fp32 or None); ``out_dtype`` and ``o_scale`` as in
    :func:`combine.combine`.

    ``out`` / ``lse`` may be given (views into larger buffers, as the chunked
    KV-outer driver passes): ``out`` with a contiguous head dim, ``lse`` with a
    contiguous token axis."""
    num_tokens, hkv, topk = slot_of.shape
    _, group, d = partial_o.shape
    if not (partial_o.is_contiguous() and partial_m.is_contiguous() and partial_l.is_contiguous()):
        raise ValueError("partial_o/partial_m/partial_l: expected contiguous tensors")
    device = partial_o.device
    normalized = partial_o.dtype in FP8_DTYPES
    if out_dtype is None:
        out_dtype = default_out_dtype(partial_o.dtype)
    check_o_scale(o_scale, device)
    if out is None:
        out = torch.empty(num_tokens, hkv * group, d, dtype=out_dtype, device=device)
    elif tuple(out.shape) != (num_tokens, hkv * group, d) or out.stride(2) != 1:
        raise ValueError(
            f"out: expected shape {(num_tokens, hkv * group, d)} with stride 1 in the last dim, "
            f"got {tuple(out.shape)} with strides {out.stride()}"
        )
    if return_lse and lse is None:
        lse = torch.empty(hkv * group, num_tokens, dtype=torch.float32, device=device)
    elif not return_lse:
        lse = None
    elif tuple(lse.shape) != (hkv * group, num_tokens) or lse.stride(1) != 1 or lse.dtype != torch.float32:
        raise ValueError(
            f"lse: expected float32 of shape {(hkv * group, num_tokens)} with stride 1 in the last dim, "
            f"got {lse.dtype} {tuple(lse.shape)} with strides {lse.stride()}"
        )
    if num_tokens == 0 or hkv == 0 or group == 0:
        return out, lse
    rows = COMBINE_ROWS if rows is None else rows
    num_warps = COMBINE_WARPS if num_warps is None else num_warps
    gp = next_pow2(group)
    bt = max(1, next_pow2(rows) // gp)
    bd = max(16, next_pow2(d))
    grid = (-(-num_tokens // bt), hkv)
    launch_kernel(
        _combine_kernel, grid,
        partial_o,
        partial_m,
        partial_l,
        slot_of,
        out,
        lse if lse is not None else out,
        o_scale if o_scale is not None else partial_m,
        num_tokens,
        slot_of.stride(0),
        slot_of.stride(1),
        slot_of.stride(2),
        out.stride(0),
        out.stride(1),
        lse.stride(0) if lse is not None else 0,
        G=group,
        GP=gp,
        TOPK=topk,
        D=d,
        BD=bd,
        BT=bt,
        RETURN_LSE=return_lse,
        NORM=normalized,
        SCALE=o_scale is not None,
        num_warps=num_warps,
    )
    return out, lse
