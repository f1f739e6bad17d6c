"""Host-side helpers shared by the Triton launchers (no device reads)."""

from __future__ import annotations

import functools
import os

import torch


# Most key splits of one attention row (the decode and dense kernels): the split merge
# (``split_merge``) unrolls its loop over them.
MAX_SPLITS = 64


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def interpreting() -> bool:
    """Triton picks its interpreter from this variable when a kernel is decorated."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (the current device for a bare ``"cuda"``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def device_capability(index: int) -> tuple[int, int]:
    # Asked on every launch (decode steps too): answered once per device.
    return torch.cuda.get_device_capability(index)


def contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels index integer metadata (block tables, offsets, lengths, selections)
    with unit inner strides; a strided view is copied (a small device copy, no sync)."""
    return tuple(t.contiguous() for t in tensors)


def fp8_flags(q: torch.Tensor, k_cache: torch.Tensor, scales, out_dtype, entry: str):
    """(q is fp8, the caches are fp8, output dtype) of a launcher's inputs; fp8 inputs need
    the fp32 [3] scales of ``core.validate.check_quant`` (``entry`` names the public op)."""
    fp8 = torch.float8_e4m3fn
    q_fp8, kv_fp8 = q.dtype == fp8, k_cache.dtype == fp8
    if (q_fp8 or kv_fp8) and scales is None:
        raise ValueError(f"scales: fp8 inputs need their dequantization scales (see {entry})")
    return q_fp8, kv_fp8, out_dtype or q.dtype


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a float torch dtype (a kernel's constexpr compute type)."""
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def num_sms(device: torch.device, cpu_default: int) -> int:
    """Multiprocessors of ``device`` (cached); ``cpu_default`` stands in off the GPU."""
    if device.type != "cuda":
        return cpu_default
    return _sm_count(device_index(device))
