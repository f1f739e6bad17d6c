"""The two constructs Triton's interpreter (3.9) computes differently from the GPU, and the
stand-ins the kernels take there, so that the CPU runs every other line of the GPU's branches.

* ``tl.dot`` of bf16 operands multiplies their raw 16-bit patterns as integers: ``dot`` widens
  bf16 operands to fp32 first (exact: the product of two bf16 values fits fp32's mantissa),
  which is the GPU's MMA with fp32 accumulation up to the order of the sum.
* fp32 -> float8_e4m3fn neither saturates nor carries a rounding into the exponent (1.97
  becomes 1.0): ``to_e4m3`` first rounds onto the e4m3 grid in fp32, where the conversion is
  exact, as the GPU's ``cvt.rn.satfinite`` rounds (to nearest even, saturating at +-448).

With ``INTERPRETER`` false both are the plain construct: the GPU code is unchanged.
``tests/kernels/test_interpreter_branches.py`` checks both against torch, on the CPU and the GPU.

Known and left: the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even), one
bf16 unit at most, within the bf16 tolerances of the tests.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import interpreting

# Read when the kernels are decorated, which is when Triton picks its interpreter too.
INTERPRETER = tl.constexpr(interpreting())


@triton.jit
def dot(a, b, PREC: tl.constexpr):
    """``tl.dot(a, b)`` accumulated in fp32 (``PREC``: its input_precision)."""
    if INTERPRETER and (a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16):
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def round_e4m3(x):
    """fp32 ``x`` rounded to the nearest e4m3 value (ties to even), saturated at +-448; fp32."""
    ax = tl.minimum(tl.abs(x), 448.0)
    # Grid step: 3 mantissa bits below the leading one, or the subnormal step below 2^-6.
    exp = tl.maximum(((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = tl.exp2((exp - 3).to(tl.float32))
    units = ax / step  # exact: step is a power of two
    low = tl.floor(units)
    frac = units - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    r = (low + ((frac > 0.5) | ((frac == 0.5) & odd)).to(tl.float32)) * step
    return tl.where(x < 0, -r, r)


@triton.jit
def to_e4m3(x):
    """fp32 ``x`` as float8_e4m3fn: round to nearest even, saturating at +-448."""
    if INTERPRETER:
        x = round_e4m3(x)
    return x.to(tl.float8e4nv)
