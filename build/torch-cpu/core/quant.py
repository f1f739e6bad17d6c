"""e4m3 (float8_e4m3fn) quantization in torch, one rule for every fp8 tensor the package
writes: codes ``= x / scale`` saturated at e4m3's largest value (e4m3fn has no infinity, and
an out-of-range cast gives NaN on some backends)."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
# Largest finite float8_e4m3fn value (fp8 caches are saturated at it; normalized partials
# (O / l) of fp8 V stay within it).
E4M3_MAX = 448.0


def to_e4m3(x: torch.Tensor, scale) -> torch.Tensor:
    """e4m3 codes of ``x / scale`` (``scale`` a float or a tensor broadcasting against ``x``)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 of ``x [..., D]``: (codes, fp32 scales ``[...]``) with ``x ~= codes * scales``.

    The scale maps each row's largest magnitude onto e4m3's largest value, so the relative
    rounding error of every element is at most 2^-4 (3 mantissa bits) down to e4m3's normal
    range. A zero row gets a tiny positive scale, never 0 (0 / 0 would give NaN codes)."""
    scales = (x.float().abs().amax(-1) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return to_e4m3(x, scales[..., None]), scales
