"""The index branch's query/key preparation in one Triton launch: per-head RMSNorm and the
partial rotary embedding of the index queries and the index key (``prep.index_prep_torch``
is the reference).

In an eager decode step these are some twenty small torch operations per sparse layer
(norm: cast, square, mean, rsqrt, two products, cast; rotation: slices, a negation, a
concatenation, two products, a sum, a concatenation; twice); here they are one launch of
``B * S`` x 2 programs: program (t, 0) prepares the ``Hi`` query heads of token t, program
(t, 1) its key. The kernel rounds to the input dtype where the model does (after the norm,
after each product of the rotation, after their sum), so it gives the model's values up to
the order of the fp32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.launch import launch_kernel, next_pow2


@triton.jit
def _round(x, BF16: tl.constexpr, out_ty: tl.constexpr):
    """fp32 ``x`` rounded to the output dtype (round to nearest even), kept in fp32. bf16 by
    its bits: Triton's interpreter truncates a float32 -> bfloat16 cast, the GPU rounds, and
    the bit form gives the GPU's result on both (finite values; the norm makes them so)."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(out_ty).to(tl.float32)


@triton.jit
def _prep_rows(
    x_ptr, w_ptr, o_ptr, cos_ptr, sin_ptr, t, seq, rows, eps,
    stride_xt, stride_xh, stride_cb, stride_cs,
    D: tl.constexpr, R: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BF16: tl.constexpr,
):
    """Heads ``0 .. rows`` of token t, normed and rotated, stored at ``o_ptr`` ([rows, D])."""
    h = tl.arange(0, HP)[:, None]  # [HP, 1] heads of token t
    d = tl.arange(0, DP)[None, :]  # [1, DP]
    ok = (h < rows) & (d < D)
    base = x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh
    x = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)  # [HP, DP]
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [HP, 1]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    out_ty = o_ptr.dtype.element_ty
    normed = _round((x * inv) * (1.0 + w), BF16, out_ty)
    # Rotate-half partner of each of the first R dims; the others are their own partner.
    half = R // 2
    p = tl.where(d < half, d + half, tl.where(d < R, d - half, d))  # [1, DP]
    xp = tl.load(base + p, mask=ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + p, mask=p < D, other=0.0).to(tl.float32)
    partner = _round((xp * inv) * (1.0 + wp), BF16, out_ty)
    partner = tl.where(d < half, -partner, partner)
    b = t // seq
    c_off = b.to(tl.int64) * stride_cb + (t % seq) * stride_cs + d
    c = tl.load(cos_ptr + c_off, mask=d < R, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + c_off, mask=d < R, other=0.0).to(tl.float32)
    rotated = _round(_round(normed * c, BF16, out_ty) + _round(partner * s, BF16, out_ty), BF16, out_ty)
    out = tl.where(d < R, rotated, normed)  # exact in the output dtype: the store does not round
    tl.store(o_ptr + h * D + d, out.to(out_ty), mask=ok)


# ``seq``: 1 in every decode step, a prompt's length in a prefill (core.launch: specializations).
@triton.jit(do_not_specialize=["seq"])
def _index_prep_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, k_rows_ptr, seq, heads, eps,
    stride_qt, stride_qh, stride_kt, stride_ko, stride_cb, stride_cs,
    D: tl.constexpr, R: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BF16: tl.constexpr,
    K_ROWS: tl.constexpr,
):
    t = tl.program_id(0)
    if tl.program_id(1) == 0:
        _prep_rows(q_ptr, qw_ptr, qo_ptr + t.to(tl.int64) * heads * D, cos_ptr, sin_ptr, t, seq, heads, eps,
                   stride_qt, stride_qh, stride_cb, stride_cs, D, R, HP, DP, BF16)
    else:
        # The key goes to its row of ``ko`` ([rows, D]): token t's own row, or with K_ROWS
        # the row the caller names (a slot of a paged cache, written in place).
        row = tl.load(k_rows_ptr + t).to(tl.int64) if K_ROWS else t.to(tl.int64)
        _prep_rows(k_ptr, kw_ptr, ko_ptr + row * stride_ko, cos_ptr, sin_ptr, t, seq, 1, eps,
                   stride_kt, 0, stride_cb, stride_cs, D, R, 1, DP, BF16)


def index_prep_triton(q, k, q_weight, k_weight, cos, sin, eps: float, k_out=None, k_rows=None):
    """Same contract as ``prep.index_prep_torch``; q and k must be contiguous over
    (batch, tokens) with unit stride on the head dim (``dispatch.prep_unsupported``).
    With ``k_out`` [N, D] and ``k_rows`` [B * S] the key of token t is written to row
    ``k_rows[t]`` of ``k_out`` (checked by ``api.index_prep``) and ``k_out`` is returned."""
    batch, seq, heads, d = q.shape
    q_out = torch.empty(batch, seq, heads, d, dtype=q.dtype, device=q.device)
    to_rows = k_rows is not None
    if not to_rows:
        k_out = torch.empty(batch * seq, d, dtype=k.dtype, device=k.device)
    if batch * seq:
        # cos / sin [1 or B, S, R]: one row of angles serves every sequence when batch is 1.
        stride_cb = cos.stride(0) if cos.shape[0] > 1 else 0
        rows = k_rows if to_rows else k_out  # a placeholder pointer when unused
        launch_kernel(
            _index_prep_kernel, (batch * seq, 2),
            q, k, q_weight, k_weight, cos, sin, q_out, k_out, rows, seq, heads, float(eps),
            q.stride(1), q.stride(2), k.stride(1), k_out.stride(0), stride_cb, cos.stride(1),
            D=d, R=cos.shape[-1], HP=next_pow2(heads), DP=next_pow2(d), BF16=q.dtype == torch.bfloat16,
            K_ROWS=to_rows,
        )
    return q_out, k_out if to_rows else k_out.view(batch, seq, d)
