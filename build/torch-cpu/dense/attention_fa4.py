"""Dense paged attention on flash-attn-4 (its CuTe DSL kernels), where it is installed and
takes the call: bfloat16 / float16 q and caches on sm_90 or sm_100, and float8_e4m3fn
caches on sm_100 (see "fp8" below).

Same contract as :func:`attention.dense_paged_attention_torch` (the oracle):

* the pools ``[pages, Hkv, page_size, D]`` go in as the permuted view ``[pages, page_size,
  Hkv, D]`` that flash-attn-4 indexes: a view, never a copy (``unsupported_reason`` refuses
  strides it would copy, since it copies a misaligned pool whole without a word);
* a sequence's queries are its last tokens (flash-attn-4's causal mask is aligned to the
  end of the keys, as here); ``seqused_k`` is ``used_kv_lens``; the lse comes back as
  ``[Hq, Tq]`` in natural-log units, as here; rows that see no key are set to zeros and
  an lse of -inf afterwards (flash-attn-4 marks them otherwise, and without the causal mask
  does not drop the rows before a sequence's first key);
* with pages of its key tile (128 keys at D 128) it loads each page as one TMA box and
  multiplies the masked probabilities (zeros) into every V row of the box, so a NaN in a
  slot past a sequence's length poisons the row. ``tails_triton.clear_page_tails`` zeroes
  those slots first, on every call (one launch of ``B x Hkv`` programs): they hold no token,
  and every reader of the cache ignores them.

fp8 (sm_100 only: flash-attn-4 has no fp8 kernel for sm_90): its fp8 kernels take q, K and V
all in e4m3 with float32 dequantization scales per (sequence, kv head) and write bfloat16.
A bfloat16 / float16 q is quantized here with one scale for the call (its largest magnitude
to e4m3's largest, computed on the device); the caches' scales are this package's one value
each, broadcast. In flash-attn-4 4.0 only its internal ``_flash_attn_fwd`` takes those
scales (the public varlen function has no arguments for them), which is why the ``fa4``
extra pins it below 4.1. This path is compiled for sm_100a in the GPU tests and has not run
on Blackwell hardware, so the dispatch takes it only when asked (``impl="fa4"``).

flash-attn-4 is imported on first use: a CPU install, or a GPU one without it, never loads
the CUTLASS DSL.
"""

from __future__ import annotations

import functools

import torch

from ..core.args import FP8, AttnArgs
from ..core.launch import compiling_ahead, device_capability, device_index
from ..core.layout import token_positions
from ..core.quant import E4M3_MAX

DTYPES = (torch.bfloat16, torch.float16)
# The compute-capability majors whose flash-attn-4 kernels this package runs: sm_90 (Hopper,
# measured) and sm_100 (Blackwell, where it is the reference kernel); fp8 on sm_100 only.
ARCHS = (9, 10)
FP8_ARCHS = (10,)
INSTALL_HINT = 'pip install flash-attn-4, or this project with its fa4 extra: pip install -e ".[fa4]"'


@functools.lru_cache(maxsize=None)
def varlen_function():
    """flash-attn-4's ``flash_attn_varlen_func``, or None when it is not installed."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def fp8_function():
    """flash-attn-4's ``_flash_attn_fwd`` (the entry that takes fp8 descales), or None."""
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except ImportError:
        return None
    return _flash_attn_fwd


def _aligned(t: torch.Tensor) -> bool:
    """flash-attn-4's layout rule (16-byte aligned base and outer strides, unit last
    stride): a pool that breaks it would be copied whole on every call."""
    elems = 16 // t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % elems == 0 for s in t.stride()[:-1])


def unsupported_reason(args: AttnArgs) -> str | None:
    """Why flash-attn-4 cannot run this checked call (None when it can). Host facts only."""
    q, k, v = args.q, args.k_cache, args.v_cache
    if q.device.type != "cuda":
        return f"flash-attn-4 runs on CUDA tensors, got tensors on {q.device}"
    major, minor = device_capability(device_index(q.device))
    if major not in ARCHS:
        return f"flash-attn-4 runs here on sm_90 and sm_100, this GPU is sm_{major}{minor}"
    if args.kv_fp8:
        if major not in FP8_ARCHS:
            return (
                f"flash-attn-4's fp8 kernels run on sm_100 only, this GPU is sm_{major}{minor} "
                "(fp8 caches run the Triton kernel)"
            )
        if q.dtype not in DTYPES + (FP8,):
            return f"flash-attn-4 takes fp8 caches with a bfloat16, float16 or float8_e4m3fn q, got q {q.dtype}"
        if args.out_dtype != torch.bfloat16:
            return f"flash-attn-4's fp8 kernels write bfloat16, the call asks for {args.out_dtype}"
    elif q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return (
            f"flash-attn-4 takes bfloat16 or float16 q and caches of q's dtype (or, on sm_100, float8_e4m3fn "
            f"caches), got q {q.dtype}, caches {k.dtype}"
        )
    d = args.d
    if d % 8 or not 8 <= d <= (256 if major == 9 else 128):
        return f"flash-attn-4 takes head dims that are multiples of 8 up to {256 if major == 9 else 128}, got {d}"
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
        if not _aligned(t):
            return f"flash-attn-4 needs {name} with a unit last stride and 16-byte aligned outer strides"
    if (fp8_function() if args.kv_fp8 else varlen_function()) is None:
        return f"flash-attn-4 is not installed ({INSTALL_HINT})"
    return None


def quantize_q(args: AttnArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in e4m3, its dequantization scale, fp32 0-d): an fp8 q as given; else one scale
    that maps q's largest magnitude to e4m3's largest, on the device (no host read). The
    rule of ``core.quant.to_e4m3`` (saturated codes of ``q / scale``), but divided in q's
    dtype by the scale rounded to it: ``to_e4m3`` would widen q to fp32 first, a copy twice
    q's size at a long prefill."""
    if args.q_fp8:
        return args.q, args.scales[0]
    amax = args.q.abs().amax().float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(args.q.dtype)
    q8 = (args.q / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q8, scale.float()


def forward(args: AttnArgs, tables, cu, used) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-attn-4 call on int32 metadata: (out [Tq, Hq, D], lse [Hq, Tq]) as it returns
    them (no page tails cleared, no keyless rows fixed: ``run_dense_fa4`` does both)."""
    kw = dict(
        cu_seqlens_q=cu, seqused_k=used, page_table=tables, max_seqlen_q=args.rows_per_seq,
        softmax_scale=args.softmax_scale, causal=args.causal, return_lse=True,
    )
    k = args.k_cache.permute(0, 2, 1, 3)  # [pages, page_size, Hkv, D]
    v = args.v_cache.permute(0, 2, 1, 3)
    if not args.kv_fp8:
        return varlen_function()(args.q, k, v, **kw)
    q8, q_scale = quantize_q(args)
    # Per (sequence, kv head), as flash-attn-4 takes them: [B, Hkv] fp32, contiguous.
    q_descale, k_descale, v_descale = (
        s.reshape(1, 1).expand(args.batch, args.hkv).contiguous() for s in (q_scale, args.scales[1], args.scales[2])
    )
    return fp8_function()(q8, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, **kw)[:2]


def run_dense_fa4(args: AttnArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash-attn-4 on a checked call that ``unsupported_reason`` accepts. Returns (out
    [Tq, Hq, D] in the call's ``out_dtype``, lse [Hq, Tq] fp32 or None). Zeroes the page tails of K and V
    (see the module docstring); reads nothing back to the host."""
    if args.num_tokens == 0 or args.batch <= 0:
        return args.new_outputs(no_keys=True)
    from .tails_triton import clear_page_tails

    tables = args.block_tables.to(torch.int32).contiguous()
    cu = args.cu_seqlens_q.to(torch.int32).contiguous()
    used = args.used_kv_lens.to(torch.int32).contiguous()
    clear_page_tails(args.k_cache, args.v_cache, tables, used)
    if compiling_ahead():
        # A compile-ahead pass only builds the Triton kernels; flash-attn-4 would run for real.
        return args.new_outputs()
    out, lse = forward(args, tables, cu, used)
    # A row that sees no key gets zeros and an lse of -inf here. flash-attn-4 marks the rows
    # it finds keyless (an empty sequence; under its causal mask, rows before the first key)
    # with a non-finite lse of its own sign, so the lse is always asked for. Without the
    # causal mask it lets a row before its sequence's first key (more queries than keys) see
    # every key, where this package's rule is that such a row sees none: those rows are
    # found from the lengths, on the device.
    dead = ~torch.isfinite(lse)  # [Hq, Tq]
    if not args.causal:
        _, pos = token_positions(cu, used, args.num_tokens)
        dead |= (pos < 0)[None, :]
    out.masked_fill_(dead.transpose(0, 1)[..., None], 0.0)
    lse.masked_fill_(dead, float("-inf"))
    return out, (lse if args.return_lse else None)
