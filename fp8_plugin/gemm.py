"""FP8 GEMM: ``torch._scaled_mm`` where it can run, an exact emulation where it cannot.

``torch._scaled_mm(a, b, scale_a, scale_b)`` multiplies FP8 operands with FP32 accumulation and
applies the dequantization scales (scale_inv) to the result. It runs on CPU and on CUDA GPUs of
compute capability 8.9+ (Ada, Hopper, Blackwell), where every dim must be a multiple of 16 and
E5M2 x E5M2 is not supported. Elsewhere the emulation dequantizes both operands to float32 and
multiplies: products of FP8 values are exact in float32, so only the summation order differs.
"""

from __future__ import annotations

import warnings
from functools import lru_cache
from typing import Optional

import torch

from .quantizers import QuantizedTensor

__all__ = ["fp8_gemm", "scaled_mm_supported"]

_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"FP8 GEMM emulated in float32 ({reason}); numerics match, speed does not.", stacklevel=3)


@lru_cache(maxsize=None)
def _device_supports_scaled_mm(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        return hasattr(torch, "_scaled_mm"), "torch._scaled_mm missing in this torch build"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return False, f"GPU compute capability {major}.{minor} < 8.9 has no FP8 tensor cores"
        return True, ""
    return False, f"no FP8 GEMM on device type {device.type!r}"


def scaled_mm_supported(a: QuantizedTensor, b: QuantizedTensor) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` runs ``a @ b.T`` on this device and shape, and if not, why.

    Decided from shapes, dtypes and the device alone: no host-device synchronisation.
    """
    if a.block is not None or b.block is not None:
        return False, "block-scaled (MXFP8 / blockwise) GEMMs run as exact emulation in this release"
    ok, reason = _device_supports_scaled_mm(a.data.device)
    if not ok:
        return ok, reason
    if a.data.device.type == "cuda":
        dims = (*a.data.shape, *b.data.shape)
        if any(d % 16 for d in dims):
            return False, f"dims {tuple(a.data.shape)} x {tuple(b.data.shape)} not all multiples of 16 on CUDA"
        if a.data.dtype == b.data.dtype == torch.float8_e5m2:
            return False, "E5M2 x E5M2 has no CUDA kernel"
    return True, ""


def fp8_gemm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(a.data * a.scale_inv) @ (b.data * b.scale_inv).T + bias`` with FP32 accumulation.

    Args:
        a: ``[M, K]`` FP8 data, row-major; per-tensor (0-dim) or block ``scale_inv``.
        b: ``[N, K]`` FP8 data, row-major (the "NT" layout: ``b.data.t()`` is column-major, as
            ``torch._scaled_mm`` wants its second operand); per-tensor or block ``scale_inv``.
        out_dtype: dtype of the result (float32, bfloat16 or float16).
        bias: optional ``[N]`` tensor, added to the FP32 accumulator before the rounding to
            ``out_dtype`` (in the GEMM epilogue where the kernel offers it).

    Returns:
        ``[M, N]`` tensor in ``out_dtype``.
    """
    ok, reason = scaled_mm_supported(a, b)
    if ok:
        # The kernel's epilogue takes a bias only for low-precision outputs.
        fused = bias if out_dtype != torch.float32 and bias is not None else None
        out = torch._scaled_mm(
            a.data,
            b.data.t(),
            scale_a=a.scale_inv,
            scale_b=b.scale_inv,
            bias=None if fused is None else fused.to(out_dtype),
            out_dtype=out_dtype,
        )
        return out if fused is not None or bias is None else out + bias
    _warn_once(reason)
    out = a.dequantize() @ b.dequantize().t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
