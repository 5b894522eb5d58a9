"""The FP8 tensor a cast makes (:class:`QuantizedTensor`), the interface every cast implements
(:class:`Quantizer`), and the three roles of a linear layer's FP8 tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from ..block_scaling import dequantize_blocks
from ..scaling import dequantize

__all__ = ["ROLES", "INPUT", "WEIGHT", "GRAD_OUTPUT", "QuantizedTensor", "Quantizer"]

# The three FP8 tensors of a linear layer, in the order of ScalingState's rows.
ROLES = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD_OUTPUT = range(3)


@dataclass
class QuantizedTensor:
    """FP8 ``data`` and the float32 ``scale_inv`` that maps it back: ``x ~= data * scale_inv``.

    ``data`` is 2-D ``[rows, cols]`` in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    ``block`` is None for per-tensor scaling (``scale_inv`` 0-dim) or the ``(rows, cols)`` tile
    each entry of a ``[ceil(rows / block[0]), ceil(cols / block[1])]`` ``scale_inv`` covers.
    ``gemm_scale``: the same scales already in the layout a native block-scaled GEMM takes
    (MXFP8: swizzled E8M0, :func:`fp8_plugin.numerics.scale_layouts.mx_gemm_scale`), written by
    a fused cast; None where the GEMM converts ``scale_inv`` itself. An operation that changes
    ``data`` (padding, transposing) drops it.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Optional[tuple[int, int]] = None
    gemm_scale: Optional[torch.Tensor] = None

    def dequantize(self, dtype: torch.dtype = torch.float32, saturate: bool = True) -> torch.Tensor:
        """High-precision copy ``data * scale_inv`` in ``dtype``; finite data reads back finite
        unless ``saturate=False`` (the plain product, for the emulated GEMM's hot path)."""
        if self.block is None:
            return dequantize(self.data, self.scale_inv, dtype, saturate)
        return dequantize_blocks(self.data, self.scale_inv, self.block, dtype, saturate)

    def t(self) -> "QuantizedTensor":
        """Transpose with a contiguous copy of ``data`` (1 byte per value).

        Raises:
            ValueError: 1-D block scaling, whose transpose needs re-quantization from high
                precision (quantize with ``columnwise=True`` instead).
        """
        if self.block is not None and self.block[0] != self.block[1]:
            raise ValueError(f"a {self.block[0]}x{self.block[1]} block-scaled tensor cannot be transposed exactly")
        scale_inv = self.scale_inv if self.block is None else self.scale_inv.t().contiguous()
        return QuantizedTensor(self.data.t().contiguous(), scale_inv, self.block)


class Quantizer(ABC):
    """Maps a high-precision tensor to a :class:`QuantizedTensor`."""

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize a 2-D tensor ``[rows, cols]`` of any floating dtype (blocks along cols)."""

    def quantize_pair(self, x: torch.Tensor, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        """The rowwise cast of ``x`` ``[rows, cols]`` and, if asked, the columnwise one: ``x.T``
        ``[cols, rows]`` with its blocks along the original rows (what dgrad / wgrad consume).
        Per-tensor scales share one scale, so the columnwise copy is a transpose of the rowwise."""
        row = self.quantize(x)
        return row, (row.t() if columnwise else None)

    def quantize_pair_and_sum(self, x: torch.Tensor, columnwise: bool
                              ) -> tuple[QuantizedTensor, Optional[QuantizedTensor], torch.Tensor]:
        """:meth:`quantize_pair` and ``x.sum(0)`` in float32 ``[cols]``: a grad_output's cast
        and its layer's bias gradient (Transformer Engine's ``bgrad_quantize``). Here the sum is
        torch's own; a fused cast computes it in the same pass, within float32 summation error
        of it."""
        row, col = self.quantize_pair(x, columnwise)
        return row, col, x.to(torch.float32).sum(0)
