"""Per-tensor FP8 scaling math: amax, scale from amax, saturating cast. Small pure functions.

Sources: Transformer Engine's scale update (``transformer_engine/pytorch/fp8.py``,
``_default_sf_compute``) and the OCP OFP8 spec rev 1.0 for the saturating conversion.
No function here synchronises with a GPU: every result stays a device tensor (on CPU,
:func:`quantize` reads a CPU amax back, which costs nothing there).
"""

from __future__ import annotations

from typing import Optional

import torch

from .decode import decode_fp8
from .device_kind import eager_on_cpu
from .formats import fp8_max, has_infinity

__all__ = ["amax", "scale_from_amax", "quantize", "saturate", "dequantize", "divide"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def divide(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """Correctly rounded ``numerator / denominator`` in the denominator's dtype.

    ``float / tensor`` in torch computes ``tensor.reciprocal() * float``, which is not correctly
    rounded on CPU: the scales below must be exactly TE's ``FP8_MAX / amax`` and ``1 / scale``.
    """
    return torch.full_like(denominator, numerator) / denominator


def amax(x: torch.Tensor) -> torch.Tensor:
    """Absolute maximum of ``x`` as a float32 0-dim tensor (NaN if ``x`` holds a NaN)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)


def scale_from_amax(
    amax: torch.Tensor, fp8_max_value: float, margin: int, previous: torch.Tensor
) -> torch.Tensor:
    """Scale ``(fp8_max / amax) / 2 ** margin``, guarded against bad amaxes (TE's formula).

    Args:
        amax: float32, any shape.
        fp8_max_value: 448.0 (E4M3) or 57344.0 (E5M2).
        margin: integer >= 0.
        previous: float32, broadcastable to ``amax``; kept where amax is 0 or not finite.

    Returns:
        float32 tensor of ``amax``'s shape. Where ``amax`` is tiny the result is clamped to the
        float32 max rather than becoming inf. The margin divides ``fp8_max`` first (exactly: a
        power of two), so that it still applies where ``fp8_max / amax`` alone would overflow
        but the scale does not (E4M3, margin 7: amaxes from 1.0e-38 to 1.3e-36). Elsewhere
        this is the float32 value of dividing the quotient by ``2 ** margin``, but for subnormal
        scales (E4M3, margin 7, amax above 0.88 * float32 max), rounded once instead of twice.
    """
    scale = divide(fp8_max_value / 2.0**margin, amax)
    scale = torch.clamp(scale, max=_FLOAT32_MAX)
    valid = (amax > 0) & torch.isfinite(amax)
    return torch.where(valid, scale, previous)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Saturating cast of ``x * scale`` to the FP8 ``dtype``; infinities of ``x`` are kept.

    Finite values beyond the format's range become +-max (OCP OFP8 "saturating" conversion):
    the clamp happens before the cast, which on its own overflows. An infinite ``x`` is not a
    range problem but an overflow upstream (a loss-scaled gradient that blew up): it stays inf
    in E5M2 and becomes NaN in E4M3 (which has no inf), as in Transformer Engine, so that it
    reaches the GEMM's output and ``GradScaler``'s found-inf check. NaN stays NaN. Rounding is
    round-to-nearest-even, as ``Tensor.to`` does.

    Args:
        x: any floating dtype and shape.
        scale: float32 tensor broadcastable to ``x`` (0-dim for per-tensor scaling).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax: :func:`amax` of ``x``, where the caller has it. On CPU, outside code that
            ``torch.compile`` traces and outside dispatch modes (``FakeTensorMode`` has no value
            to read), a finite one says that ``x`` holds no inf or NaN, and the passes that keep
            them are skipped (reading it back costs nothing on CPU). Elsewhere it is not read: no
            function here synchronises with a GPU.

    Returns:
        Tensor of ``x``'s shape in ``dtype``, row-major (contiguous) whatever the layout of ``x``
        (a transposed view: GPT-2's Conv1D weight, a columnwise copy): the FP8 GEMM kernels read
        their operands row-major and refuse any other layout.
    """
    # One float32 temporary, scaled and saturated in place: on CPU each further full-size
    # temporary costs about as much as the arithmetic (fresh pages).
    scaled = x * scale if x.dtype == torch.float32 else x.to(torch.float32).mul_(scale)
    if amax is not None and eager_on_cpu(x) and not scaled.requires_grad and bool(torch.isfinite(amax)):
        bound = fp8_max(dtype)  # finite x: saturate() would only clamp
        return scaled.clamp_(-bound, bound).to(dtype, memory_format=torch.contiguous_format)
    return saturate(scaled, x, dtype).to(dtype, memory_format=torch.contiguous_format)


def saturate(scaled: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scaled`` (float32 ``x * scale``) clamped to +-max of ``dtype`` where ``x`` is finite;
    infinities of ``x`` stay infinite (see :func:`quantize`). ``scaled`` is a temporary of the
    caller's: it may be overwritten, and may be the tensor returned."""
    bound = fp8_max(dtype)
    infinite = torch.isinf(x)
    if has_infinity(dtype):  # OCP E5M2 keeps an infinity: scaled's own, from before the clamp
        clamped = scaled.clamp(-bound, bound)
        if torch.is_grad_enabled() and scaled.requires_grad:  # autograd refuses out=
            return torch.where(infinite, scaled, clamped)
        return torch.where(infinite, scaled, clamped, out=clamped)
    # E4M3 and the FNUZ formats have no inf, and torch's CPU cast would saturate one: make it
    # the format's NaN.
    return scaled.clamp_(-bound, bound).masked_fill_(infinite, float("nan"))


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
               saturate: bool = True) -> torch.Tensor:
    """``data * scale_inv`` in ``dtype``: the inverse of :func:`quantize` up to rounding.

    Finite data reads back finite: a product beyond the range of ``dtype`` (or of float32, in
    which it is computed) saturates to its max. FP8 rounding can carry a value just below the
    float32 max past it (float32 max cast with the power-of-two scale 2^-120 rounds to 256, and
    256 * 2^120 = 2^128, as a delayed scale from a smaller amax can too); the saturated value is
    nearer to that value than the product was. Infinities and NaNs of ``data`` are kept.

    Args:
        data: FP8 data, any shape.
        scale_inv: float32, broadcastable to ``data``.
        dtype: floating dtype of the result.
        saturate: False gives the plain product, one multiply (the emulated GEMM, whose sums
            can overflow anyway, skips the clamp on its hot path).
    """
    values = decode_fp8(data)
    product = values * scale_inv
    if not saturate:
        return product.to(dtype)
    bound = min(torch.finfo(dtype).max, _FLOAT32_MAX)
    saturated = product.clamp(-bound, bound)  # NaN stays NaN
    if not has_infinity(data.dtype):
        return saturated.to(dtype)  # no inf in the format: an inf product can only be an overflow
    return torch.where(torch.isinf(values), product, saturated).to(dtype)
