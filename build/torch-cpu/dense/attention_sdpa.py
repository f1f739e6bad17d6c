"""Causal dense attention of a prefill with no history, on torch's fused sdpa kernels.

A prefill into an empty cache has all of its keys at hand as the new tokens' contiguous K/V,
so it need not read them back from the pages: torch's cuDNN (or flash / memory-efficient)
kernel runs it where flash-attn-4 is not installed. ``dispatch.sdpa_prefill_reason`` says
when; the oracle is the paged torch path (``attention.dense_paged_attention_torch``), which
the tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Never the math backend: it materializes [B, Hq, S, S] scores.
FUSED_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def causal_prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q [B, Hq, S, D], k / v [B, Hkv, S, D] (Hq a multiple of Hkv), the keys of position i
    being those of query i -> out [B, S, Hq, D]."""
    with sdpa_kernel(FUSED_BACKENDS):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
