"""What a device's native FP8 GEMM kernels run: :class:`NativeGemm`, and the block kinds' probe.

The block-scaled kernels (blockwise on sm90, MXFP8 on sm100+) are probed once per device for
every operand-format pairing the recipes send them and every output dtype a training step asks
for. HYBRID recipes send E5M2 gradients into two of a layer's three GEMMs (dgrad: grad_output x
weight, wgrad: grad_output^T x input^T, so E5M2 x E4M3); E4M3 x E5M2 is probed too, so that the
probe's report covers every mixed pairing. torch's own check accepts any float8 operands for
these scalings ("For BlockWise 1x128 scaling, a and b should be float8", torch 2.11's
aten/src/ATen/native/cuda/ScaledBlas.cpp); whether cuBLASLt then runs a pairing, and writes
each output dtype, only the GPU can say. A pairing or output dtype the kernel refuses or computes
wrongly is recorded as such; :mod:`fp8_plugin.numerics.gemm` then runs that GEMM in the exact
float32 emulation (the others stay native), and :func:`fp8_plugin.numerics.device.auto_recipe`
picks a format the native kernels run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .device_kind import device_kind
from .gemm_kernels import emulated, scaled_mm_blocks
from .quantizers import QuantizedTensor

__all__ = ["NativeGemm", "KERNEL_OUT_DTYPES", "BLOCK_PAIRINGS", "probe_block_kind", "format_name"]

KERNEL_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (first operand, second operand) formats the block probe checks: E4M3 x E4M3 first (every
# recipe's forward: its failure means the kind is not native at all), then the mixed ones.
BLOCK_PAIRINGS = ((_E4M3, _E4M3), (_E5M2, _E4M3), (_E4M3, _E5M2))

Pairing = tuple[torch.dtype, torch.dtype, tuple[torch.dtype, ...], str]


def format_name(dtype: torch.dtype) -> str:
    """"E4M3" / "E5M2" (or "E4M3FNUZ" / "E5M2FNUZ") for an FP8 dtype, else the dtype's name."""
    return {_E4M3: "E4M3", _E5M2: "E5M2", torch.float8_e4m3fnuz: "E4M3FNUZ",
            torch.float8_e5m2fnuz: "E5M2FNUZ"}.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class NativeGemm:
    """Whether a GEMM kind runs natively on a device, per operand pairing and output dtype.

    Attributes:
        native: a native kernel exists and its E4M3 x E4M3 GEMM passed its probe.
        reason: why not (empty when native).
        out_dtypes: output dtypes the kernel writes for E4M3 x E4M3 (and for every pairing where
            ``pairings`` is None); others are written in bfloat16 and cast.
        pairings: None where every operand pairing runs as E4M3 x E4M3 does (tensorwise, whose
            one refused pairing, E5M2 x E5M2, is a fixed rule; a block kind taken without its
            probe); else one ``(dtype_a, dtype_b, out_dtypes, reason)`` per probed pairing, with
            ``out_dtypes`` empty and ``reason`` saying why where the pairing does not run.
    """

    native: bool
    reason: str = ""
    out_dtypes: tuple[torch.dtype, ...] = KERNEL_OUT_DTYPES
    pairings: Optional[tuple[Pairing, ...]] = None

    def pairing_out_dtypes(self, dtype_a: torch.dtype, dtype_b: torch.dtype) -> tuple[torch.dtype, ...]:
        """The output dtypes the kernel writes for ``dtype_a x dtype_b`` operands; empty: it does not run them."""
        if not self.native:
            return ()
        if self.pairings is None:
            return self.out_dtypes
        for a, b, out_dtypes, _ in self.pairings:
            if (a, b) == (dtype_a, dtype_b):
                return out_dtypes
        return ()

    def pairing_reason(self, dtype_a: torch.dtype, dtype_b: torch.dtype) -> str:
        """Why ``dtype_a x dtype_b`` operands do not run natively (empty where they do)."""
        if not self.native:
            return self.reason
        if self.pairing_out_dtypes(dtype_a, dtype_b):
            return ""
        for a, b, _, reason in self.pairings or ():
            if (a, b) == (dtype_a, dtype_b):
                return reason
        return f"{format_name(dtype_a)} x {format_name(dtype_b)} was not probed"


def _random_operand(rows: int, cols: int, block: tuple[int, int], dtype: torch.dtype, device: torch.device,
                    gen: torch.Generator) -> QuantizedTensor:
    # Values up to 448, block scales 2^-7 to 2^-3: outputs of a few thousand at most, well inside
    # float16's range (65504), so that float16 outputs compare (they overflowed with larger scales).
    data = (torch.randn(rows, cols, generator=gen) * 64).clamp(-448, 448).to(dtype)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = torch.exp2(torch.randint(-7, -2, grid, generator=gen).to(torch.float32))
    return QuantizedTensor(data.to(device), scale_inv.to(device), block)


def probe_block_kind(kind: str, device: torch.device) -> NativeGemm:
    """Probe the block kernel of ``kind`` ("blockwise" or "mxfp8") on ``device`` against the emulation.

    One 256x512x256 GEMM per block layout (blockwise: 1x128 x 128x128 and 1x128 x 1x128;
    mxfp8: 1x32 x 1x32), per pairing of :data:`BLOCK_PAIRINGS` and per output dtype of
    :data:`KERNEL_OUT_DTYPES`, each compared with :func:`~fp8_plugin.numerics.gemm_kernels.emulated`
    in float32. Power-of-two block scales make every product exact, so the two differ only in
    float32 summation order (tolerance 1e-4 of the largest output) or the output rounding of
    bfloat16 and float16 (1e-2); a wrong scale layout shows as errors of whole powers of two.
    Reads the results on the host: one sync per device and process, before training.

    Returns:
        :class:`NativeGemm`: not native where E4M3 x E4M3 in bfloat16 fails; else each pairing
        with the output dtypes that passed, and the reason where none did.
    """
    with torch.autocast(device_kind(device), enabled=False):
        gen = torch.Generator().manual_seed(0)
        layouts = [((1, 32), (1, 32))] if kind == "mxfp8" else [((1, 128), (128, 128)), ((1, 128), (1, 128))]
        pairings: list[Pairing] = []
        for dtype_a, dtype_b in BLOCK_PAIRINGS:
            outs, why = _probe_pairing(kind, layouts, dtype_a, dtype_b, device, gen)
            pairings.append((dtype_a, dtype_b, outs, why))
    e4m3_outs, e4m3_why = pairings[0][2], pairings[0][3]
    if torch.bfloat16 not in e4m3_outs:
        return NativeGemm(False, e4m3_why or f"native {kind} GEMM does not write bfloat16")
    return NativeGemm(True, "", e4m3_outs, tuple(pairings))


def _probe_pairing(kind: str, layouts: list, dtype_a: torch.dtype, dtype_b: torch.dtype, device: torch.device,
                   gen: torch.Generator) -> tuple[tuple[torch.dtype, ...], str]:
    # The output dtypes every layout of this pairing writes correctly, and why the others failed.
    ok = dict.fromkeys(KERNEL_OUT_DTYPES, True)
    why: list[str] = []
    name = f"{format_name(dtype_a)} x {format_name(dtype_b)}"
    for block_a, block_b in layouts:
        a = _random_operand(256, 512, block_a, dtype_a, device, gen)
        b = _random_operand(256, 512, block_b, dtype_b, device, gen)
        expected = emulated(a, b, torch.float32)
        for out_dtype in KERNEL_OUT_DTYPES:
            if not ok[out_dtype]:
                continue
            dtype_name = str(out_dtype).replace("torch.", "")
            try:
                got = scaled_mm_blocks(kind, a, b, out_dtype).float()
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
                ok[out_dtype] = False
                why.append(f"torch {torch.__version__} refused the {kind} GEMM of {name} -> {dtype_name}: "
                           f"{str(err).splitlines()[0] if str(err) else type(err).__name__}")
                continue
            tolerance = (1e-4 if out_dtype is torch.float32 else 1e-2) * expected.abs().max().item()
            error = (got - expected).abs().max().item()
            if not error <= tolerance:
                ok[out_dtype] = False
                why.append(f"native {kind} GEMM of {name} -> {dtype_name} disagreed with the emulation "
                           f"(max error {error:.3g})")
    outs = tuple(d for d, good in ok.items() if good)
    return outs, "; ".join(why)
