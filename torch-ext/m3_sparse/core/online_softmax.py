"""What the attention kernels share: the fp8 scales folded into the softmax scale (all three)
and the online-softmax step (the query-outer kernels, dense and decode attention).

Scores are in log2 units (``qk_scale`` folds in log2(e)); a row keeps its running max
``m`` (-inf until it sees a key), its running sum ``l`` of ``2^(s - m)`` and its unnormalized
output ``acc``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .interpreter import dot


@triton.jit
def fold_fp8_scales(qk_scale, scale_ptr, Q_FP8: tl.constexpr, KV_FP8: tl.constexpr):
    """``qk_scale`` times the dequantization scales of fp8 keys and queries, read on the
    device from ``scale_ptr`` (fp32 [3]: q, k, v); V's scale is applied by each kernel where
    its output takes it."""
    if KV_FP8:
        qk_scale = qk_scale * tl.load(scale_ptr + 1)
    if Q_FP8:
        qk_scale = qk_scale * tl.load(scale_ptr)
    return qk_scale


@triton.jit
def online_softmax_step(
    acc, m_i, l_i, b_s, b_v, PREC: tl.constexpr, PV_DT: tl.constexpr,
):
    """Fold one key tile into the running row state. b_s: [M, N] masked scores (-inf where a
    key is not visible); b_v: [N, BD] the tile's values. Returns (acc, m, l)."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1))  # [M]
    # A row that has seen nothing yet keeps m = -inf; exp2 against 0 keeps it NaN-free.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)  # [M]
    b_p = tl.exp2(b_s - m_safe[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(b_p, 1)
    # P is rounded to the P @ V dtype (the output's).
    b_pv = dot(b_p.to(PV_DT), b_v.to(PV_DT), PREC)  # [M, BD]
    acc = acc * alpha[:, None] + b_pv
    return acc, m_new, l_i
