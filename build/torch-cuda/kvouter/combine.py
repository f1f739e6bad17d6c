"""Combine stage: merge each (token, head)'s partials through the reverse map.

    M = max_s m_s,  a_s = exp(m_s - M),  l = sum_s a_s l_s,
    O = sum_s a_s O_s / l,  lse = M + log l

Empty slots (``slot_of == -1``) contribute nothing; a row with no key at all
gets ``O = 0`` and ``lse = -inf``.

float8_e4m3fn partials are normalized (``O_s / l_s``, see ``kvouter_attention``): their
weight is ``a_s l_s``. ``o_scale`` (V's dequantization scale there) multiplies the result.
"""

from __future__ import annotations

import torch

from ..core.validate import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, check_tensor, default_out_dtype, value_checks_enabled

TOKEN_CHUNK = 256


def validate_combine(partial_o, partial_m, partial_l, slot_of, o_scale=None, out_dtype=None) -> torch.dtype:
    """Checks of :func:`combine`; returns the output dtype."""
    check_tensor("partial_o", partial_o, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES)
    device = partial_o.device
    rows = tuple(partial_o.shape[:2])
    for name, t in (("partial_m", partial_m), ("partial_l", partial_l)):
        check_tensor(name, t, ndim=2, dtypes=(torch.float32,), device=device)
        if tuple(t.shape) != rows:
            raise ValueError(f"{name}: expected shape {rows} (entries, heads per group of partial_o), got {tuple(t.shape)}")
    check_tensor("slot_of", slot_of, ndim=3, dtypes=INDEX_DTYPES, device=device)
    if value_checks_enabled(slot_of) and slot_of.numel():
        lo, hi = int(slot_of.min()), int(slot_of.max())
        if lo < -1 or hi >= rows[0]:
            bad = lo if lo < -1 else hi
            raise ValueError(f"slot_of: entry {bad} out of range; expected -1 or an entry in [0, {rows[0]})")
    check_o_scale(o_scale, device)
    if out_dtype is None:
        return default_out_dtype(partial_o.dtype)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of (bfloat16, float16, float32), got {out_dtype}")
    return out_dtype


def check_o_scale(o_scale: torch.Tensor | None, device: torch.device) -> None:
    """``o_scale``: None, or one fp32 value on the partials' device (read by the kernel)."""
    if o_scale is None:
        return
    check_tensor("o_scale", o_scale, dtypes=(torch.float32,), device=device)
    if o_scale.numel() != 1:
        raise ValueError(f"o_scale: expected one float32 value, got shape {tuple(o_scale.shape)}")


def merge_scale(partial_o: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor | None:
    """``o_scale`` for partials from the attention stage with fp32 [3] (q, k, v) ``scales``:
    e4m3 partials are in V's stored units, so V's scale comes in at the merge; other
    partials already carry it."""
    return scales[2:] if partial_o.dtype in FP8_DTYPES else None


def combine(
    partial_o: torch.Tensor,
    partial_m: torch.Tensor,
    partial_l: torch.Tensor,
    slot_of: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    return_lse: bool = False,
    o_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """partial_o [E, G, D], partial_m/l [E, G], slot_of [Tq, Hkv, topk] ->
    (out [Tq, Hkv*G, D] in ``out_dtype`` (default partial_o's, bfloat16 for fp8 partials),
    lse [Hkv*G, Tq] fp32 or None). ``o_scale``: a one-element fp32 tensor or None (1)."""
    out_dtype = validate_combine(partial_o, partial_m, partial_l, slot_of, o_scale, out_dtype)
    return combine_torch(partial_o, partial_m, partial_l, slot_of, out_dtype, return_lse, o_scale)


def combine_torch(partial_o, partial_m, partial_l, slot_of, out_dtype, return_lse, o_scale=None, out=None, lse=None):
    """:func:`combine` on checked partials, into ``out`` / ``lse`` when given (query slices)."""
    normalized = partial_o.dtype in FP8_DTYPES
    num_tokens, hkv, topk = slot_of.shape
    _, group, d = partial_o.shape
    device = partial_o.device
    if out is None:
        out = torch.empty(num_tokens, hkv * group, d, dtype=out_dtype, device=device)
    if lse is None and return_lse:
        lse = torch.empty(hkv * group, num_tokens, dtype=torch.float32, device=device)
    for t0 in range(0, num_tokens, TOKEN_CHUNK):
        t1 = min(t0 + TOKEN_CHUNK, num_tokens)
        slots = slot_of[t0:t1].to(torch.int64)  # [C, Hkv, K]
        used = slots >= 0
        sc = slots.clamp(min=0)
        m = partial_m[sc].masked_fill(~used[..., None], float("-inf"))  # [C, Hkv, K, G]
        l = partial_l[sc].masked_fill(~used[..., None], 0.0)
        o = partial_o[sc].float().masked_fill(~used[..., None, None], 0.0)  # [C, Hkv, K, G, D]
        big_m = m.amax(2)  # [C, Hkv, G]
        empty = big_m == float("-inf")
        a = torch.exp(m - torch.where(empty, 0.0, big_m)[:, :, None, :])  # [C, Hkv, K, G]
        a = a.masked_fill(m == float("-inf"), 0.0)
        al = a * l  # [C, Hkv, K, G]
        w = al if normalized else a
        l_tot = al.sum(2)  # [C, Hkv, G]
        o_tot = (w[..., None] * o).sum(2)  # [C, Hkv, G, D]
        o_tot = o_tot / torch.where(empty, 1.0, l_tot)[..., None]
        if o_scale is not None:
            o_tot = o_tot * o_scale.reshape(())
        o_tot = o_tot.masked_fill(empty[..., None], 0.0)
        out[t0:t1] = o_tot.reshape(t1 - t0, hkv * group, d).to(out.dtype)
        if lse is not None:
            row = torch.where(empty, float("-inf"), big_m + torch.log(torch.where(empty, 1.0, l_tot)))
            lse[:, t0:t1] = row.reshape(t1 - t0, hkv * group).transpose(0, 1)
    return out, lse
