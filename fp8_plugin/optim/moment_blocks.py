"""An optimizer moment in FP8: E4M3 values in blocks of 128 consecutive elements, one FP32 scale each.

The format of :class:`~fp8_plugin.optim.FP8AdamW`'s first moment (MS-AMP's O2 level keeps it in
FP8; torchao's ``AdamWFp8`` and bitsandbytes' 8-bit optimizers scale per block as here). The
moment is flattened (row-major) and cut into blocks of ``BLOCK`` elements, the last one short; each
block is scaled so that its amax meets the E4M3 maximum, as Transformer Engine scales a tensor
(``scale = FP8_MAX / amax``, the values multiplied by ``scale`` and rounded to nearest, ties to
even, by the OCP FP8 cast), and ``scale_inv = 1 / scale`` is kept for the dequantization. A block
of zeros keeps ``scale_inv = 1``. Bytes per element: 1 + 4 / 128.
"""

from __future__ import annotations

import torch

from ..numerics.formats import fp8_max

__all__ = ["BLOCK", "MOMENT_DTYPE", "quantize_moment", "dequantize_moment", "blocks_of"]

BLOCK = 128
MOMENT_DTYPE = torch.float8_e4m3fn


def blocks_of(numel: int) -> int:
    """The number of blocks of a moment of ``numel`` elements (the last one may be short)."""
    return -(-numel // BLOCK)


def _padded(x: torch.Tensor) -> torch.Tensor:
    # [blocks, BLOCK] float32 view of x's values, zero-padded at the end.
    flat = x.reshape(-1).float()
    pad = blocks_of(flat.numel()) * BLOCK - flat.numel()
    if pad:  # only a short last block costs a copy
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def quantize_moment(x: torch.Tensor, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, float32, bfloat16 or float16) as E4M3 blocks; ``check_finite=False``
    skips the check below (a host read on a GPU) where the caller has checked already.

    Returns:
        ``(data, scale_inv)``: ``data`` float8_e4m3fn of ``x``'s shape, ``x * scale`` rounded to
        nearest, ties to even, per block, with ``scale = 448 / amax`` of the block (float32);
        ``scale_inv`` float32 ``[blocks_of(x.numel())]``, ``1 / scale`` (1 for a block of
        zeros), so that ``data * scale_inv`` is within half an E4M3 step (2**-4 relative, plus
        float32 rounding) of ``x`` where ``x * scale`` is an E4M3 normal (above 2**-6).

    Raises:
        ValueError: ``check_finite`` and ``x`` holds a NaN or an infinity (a moment that
            overflowed: the step's gradient was not finite), which the format cannot hold.
    """
    blocks = _padded(x)
    amax = blocks.abs().amax(dim=1)
    if check_finite and not torch.isfinite(amax).all():  # a host read on a GPU: callers that checked skip it
        raise ValueError("quantize_moment: the moment holds a NaN or an infinity; an optimizer step needs finite "
                         "gradients (skip the step, as torch's GradScaler does, when they are not)")
    # scale = FP8_MAX / amax, one correctly rounded division (a Python number divided by a tensor
    # is its reciprocal times the number in torch: two roundings); a zero block keeps scale 1.
    positive = amax > 0
    quotient = torch.full_like(amax, fp8_max(MOMENT_DTYPE)).div(torch.where(positive, amax, 1.0))
    scale = torch.where(positive, quotient, 1.0)
    data = (blocks * scale[:, None]).to(MOMENT_DTYPE)
    return data.view(-1)[: x.numel()].view(x.shape), scale.reciprocal()


def dequantize_moment(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``data * scale_inv`` per block, float32, of ``data``'s shape (each product rounded once to
    float32).

    Raises:
        ValueError: ``scale_inv`` has not ``blocks_of(data.numel())`` elements.
    """
    if scale_inv.numel() != blocks_of(data.numel()):
        raise ValueError(f"dequantize_moment: {scale_inv.numel()} block scales for a moment of {data.numel()} "
                         f"elements; expected {blocks_of(data.numel())} (blocks of {BLOCK})")
    blocks = _padded(data)
    return (blocks * scale_inv.float()[:, None]).view(-1)[: data.numel()].view(data.shape)
