"""FP8 encoding in Triton with integer operations: the bytes of torch's own cast, on a GPU and under
Triton's interpreter alike.

Triton's ``.to(tl.float8e4nv)`` is the hardware conversion on a GPU, but under the interpreter
(``TRITON_INTERPRET=1``, which runs the kernels on CPU tensors for the tests) it is wrong for
ties and subnormals: of the 65,536 BF16 bit patterns cast at scale 1, 994 differ from torch's
cast. These functions are c10's conversions (``c10/util/Float8_e4m3fn.h``,
``fp8e4m3fn_from_fp32_value``; ``c10/util/Float8_e5m2.h``, ``fp8e5m2_from_fp32_value``) written
with bit operations and one float32 addition, so both paths give torch's bytes: round to nearest
even, the input's sign kept; E4M3 (OCP OFP8 rev 1.0, "fn": no infinity) maps NaN to 0x7F and
|f| >= 464 to 448 (0x7E, torch's CPU cast; c10's scalar conversion gives NaN there); E5M2 maps NaN
to 0x7F and |f| >= 65536 to infinity (0x7C). The callers
saturate first (:func:`fp8_plugin.numerics.scaling.saturate`), so only NaN and kept infinities
reach those branches.

Cost on a GPU: about 10 integer operations and one float addition per element against one
conversion instruction, in kernels that move 3 to 5 bytes per element and are bound by memory
bandwidth (an H100 SXM issues about 30 integer operations per byte of HBM traffic), so the
encoding is not expected to show in their time; the first GPU run measures it
(benchmarks/README.md, "GPU protocol").
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["e4m3_bits", "e5m2_bits", "saturated", "as_float32", "loadable"]


@triton.jit
def e4m3_bits(f):
    """float32 ``f`` -> uint8 E4M3 (fn) bits, torch's rounding and special values."""
    f_bits = f.to(tl.uint32, bitcast=True)
    sign = f_bits & 0x80000000
    f_bits = f_bits ^ sign
    # Below 2^-6 (E4M3's smallest normal): add 2^14, whose float32 ulp is E4M3's subnormal step
    # 2^-9, so the float addition rounds to nearest even; the low bits are then the code.
    denorm = (f_bits.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
    # Normal: rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits, ties to even.
    mant_odd = (f_bits >> 20) & 1
    normal = (f_bits - (120 << 23) + 0x7FFFF + mant_odd) >> 20
    code = tl.where(f_bits < (121 << 23), denorm, normal)
    # NaN: the NaN code. |f| above 464 (the midpoint of 448 and the NaN code's 480) and
    # infinities: 448 (0x7E), as torch's CPU cast (c10's scalar conversion gives NaN from 464 up);
    # the callers saturate first, so no such value reaches this.
    code = tl.where(f_bits >= 0x43E80000, 0x7E, code)
    code = tl.where(f_bits > (255 << 23), 0x7F, code)
    return ((code & 0xFF) | (sign >> 24)).to(tl.uint8)


@triton.jit
def e5m2_bits(f):
    """float32 ``f`` -> uint8 E5M2 bits, torch's rounding and special values."""
    f_bits = f.to(tl.uint32, bitcast=True)
    sign = f_bits & 0x80000000
    f_bits = f_bits ^ sign
    # Below 2^-14: add 2^7 (float32 ulp 2^-16, E5M2's subnormal step).
    denorm = (f_bits.to(tl.float32, bitcast=True) + 128.0).to(tl.uint32, bitcast=True) - (134 << 23)
    mant_odd = (f_bits >> 21) & 1
    normal = (f_bits - (112 << 23) + 0xFFFFF + mant_odd) >> 21
    code = tl.where(f_bits < (113 << 23), denorm, normal)
    special = tl.where(f_bits > (255 << 23), 0x7F, 0x7C)  # NaN, else |f| >= 65536: infinity
    code = tl.where(f_bits >= (143 << 23), special, code)
    return ((code & 0xFF) | (sign >> 24)).to(tl.uint8)


def loadable(x):
    """The tensor a kernel loads for ``x``: a bfloat16 tensor as its int16 bits (any strides),
    which :func:`as_float32` widens exactly; other dtypes as they are."""
    import torch

    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


@triton.jit
def raw_pointer(ptr):
    """The pointer a kernel loads through for a tensor passed as it is: a bfloat16 tensor's as
    int16 (its bits, which :func:`as_float32` widens), other dtypes unchanged. A bitcast inside
    the kernel, where :func:`loadable` makes a view on the host (one op per launch)."""
    # One return: a static if (a dtype test) keeps one branch, so the result has one type.
    if ptr.dtype.element_ty == tl.bfloat16:
        raw = ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    else:
        raw = ptr
    return raw


@triton.jit
def byte_pointer(ptr):
    """An FP8 tensor's pointer as uint8, for storing the codes the encoders compute: the FP8
    tensor is passed as it is (no ``.view(torch.uint8)`` on the host)."""
    return ptr.to(tl.pointer_type(tl.uint8), bitcast=True)


@triton.jit
def as_float32(raw):
    """float32 values of a tile loaded from :func:`loadable`'s tensor. bfloat16 arrives as its
    int16 bits and widens by a 16-bit shift, exact on a GPU and under the interpreter alike:
    the interpreter's own bfloat16 conversion is wrong for subnormals (1e-39 reads as 4.4e-39,
    9.2e-41 as 0), which a large scale makes visible in the FP8 bytes."""
    if raw.dtype == tl.int16:
        return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return raw.to(tl.float32)


@triton.jit
def saturated(x, scale, FP8_MAX: tl.constexpr, E4M3: tl.constexpr):
    """``x * scale`` in float32 saturated as :func:`fp8_plugin.numerics.scaling.saturate` does:
    finite values clamped to +-FP8_MAX (NaN kept: comparisons with NaN are false), an infinite
    ``x`` kept infinite (E5M2) or made NaN (E4M3, which has no infinity)."""
    xf = x.to(tl.float32)
    scaled = xf * scale
    clamped = tl.where(scaled > FP8_MAX, FP8_MAX, tl.where(scaled < -FP8_MAX, -FP8_MAX, scaled))
    infinite = (xf.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) == 0x7F800000
    if E4M3:
        return tl.where(infinite, float("nan"), clamped)
    return tl.where(infinite, scaled, clamped)
