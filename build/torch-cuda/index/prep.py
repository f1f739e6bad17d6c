"""The index branch's query/key preparation, in torch: M3's per-head RMSNorm (Gemma style,
a ``1 + w`` gain) and its partial rotary embedding, as the model computes them.

``index_prep_torch`` is the reference of the fused kernel (``prep_triton``) and runs the
operations in the model's order and precision: the norm in fp32, rounded to the input
dtype; each product of the rotation rounded to the input dtype, then their sum. Rounding at
the same places is what lets the kernel give the model's own values.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` normalized over D in fp32 and scaled by ``1 + weight``, in x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first ``R = cos.shape[-1]`` dims of ``x [..., D]`` (halves
    rotated: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``), the rest passed through.
    ``cos``/``sin`` broadcast against ``x[..., :R]``."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat((-rot[..., r // 2:], rot[..., : r // 2]), dim=-1)
    return torch.cat(((rot * cos) + (half * sin), rest), dim=-1)


def index_prep_torch(q, k, q_weight, k_weight, cos, sin, eps: float):
    """q [B, S, Hi, D], k [B, S, D] (projections) -> (q, k) normed and rotated, same shapes.
    cos / sin: [B, S, R] in the inputs' dtype."""
    q = rotate(rms_norm(q, q_weight, eps), cos[:, :, None], sin[:, :, None])
    k = rotate(rms_norm(k, k_weight, eps), cos, sin)
    return q, k
