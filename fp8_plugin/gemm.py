"""FP8 GEMM: a native scaled GEMM where the device and torch have one, an exact emulation elsewhere.

Three kinds of scaling reach the GEMM, each with its own native kernel:

- ``tensorwise`` (delayed and current scaling): ``torch._scaled_mm`` with one float32 scale_inv
  per operand; on CPU and on CUDA GPUs of compute capability 8.9+ (Ada, Hopper, Blackwell), where
  every dim must be a multiple of 16 and E5M2 x E5M2 has no kernel.
- ``blockwise`` (Float8BlockScaling): ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128``
  for the first operand and ``BlockWise1x128`` or ``BlockWise128x128`` for the second (cuBLAS,
  Hopper sm90 only); the contraction dim and 128x128-scaled dims must be multiples of 128.
- ``mxfp8`` (MXFP8BlockScaling): ``scaled_mm`` with ``BlockWise1x32`` and swizzled E8M0 scales
  (cuBLAS, Blackwell sm100+); the contraction dim must be a multiple of 32.

Whether a kind is native on a device is decided once per device and cached: from the device,
the installed torch, and for the block kinds a one-off probe GEMM on that device whose result
must match the emulation (a kernel that is missing, refuses the layout, or disagrees is not
used). Elsewhere the emulation dequantizes both operands to float32 and multiplies: products of
FP8 values and power-of-two scales are exact in float32, so only the summation order differs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import torch
import torch.nn.functional as F

from .quantizers import QuantizedTensor
from .scale_layouts import blockwise_1x128_gemm_scale, blockwise_128x128_gemm_scale, mx_gemm_scale

__all__ = ["fp8_gemm", "gemm_kind", "native_gemm", "NativeGemm", "GEMM_KINDS", "scaled_mm_supported", "normalize_device"]

GEMM_KINDS = ("tensorwise", "blockwise", "mxfp8")
# Compute capabilities (major) whose tensor cores run each block kind through cuBLAS.
_BLOCK_KIND_MAJORS = {"blockwise": (9,), "mxfp8": (10, 11, 12)}
_BLOCK_KIND_K_MULTIPLE = {"blockwise": 128, "mxfp8": 32}

_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"FP8 GEMM emulated in float32 ({reason}); numerics match, speed does not.", stacklevel=3)


@dataclass(frozen=True)
class NativeGemm:
    """Whether a GEMM kind runs natively on a device.

    Attributes:
        native: a native kernel exists and passed its probe.
        reason: why not (empty when native).
        out_dtypes: output dtypes the kernel writes; others are written in bfloat16 and cast.
    """

    native: bool
    reason: str = ""
    out_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def gemm_kind(a: QuantizedTensor, b: QuantizedTensor) -> str:
    """The GEMM kind of ``a @ b.T``: "tensorwise", "blockwise", "mxfp8" or "unsupported-blocks"."""
    if a.block is None and b.block is None:
        return "tensorwise"
    if a.block == b.block == (1, 32):
        return "mxfp8"
    if a.block == (1, 128) and b.block in ((1, 128), (128, 128)):
        return "blockwise"
    return "unsupported-blocks"


def normalize_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a torch device, ``"cuda"`` pinned to the current CUDA device's index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def native_gemm(kind: str, device: torch.device) -> NativeGemm:
    """Whether GEMMs of ``kind`` run natively on ``device``; decided once per device, then cached.

    Args:
        kind: one of ``GEMM_KINDS``.
        device: a torch device (``"cuda"`` means the current CUDA device).

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in GEMM_KINDS:
        raise ValueError(f"kind={kind!r} is not a GEMM kind; valid: {', '.join(GEMM_KINDS)}")
    return _native_gemm(kind, normalize_device(device))


@lru_cache(maxsize=None)
def _native_gemm(kind: str, device: torch.device) -> NativeGemm:
    if device.type not in ("cpu", "cuda"):
        return NativeGemm(False, f"no FP8 GEMM on device type {device.type!r}")
    if kind == "tensorwise":
        if device.type == "cpu":
            return NativeGemm(hasattr(torch, "_scaled_mm"), "torch._scaled_mm missing in this torch build")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return NativeGemm(False, f"GPU compute capability {major}.{minor} < 8.9 has no FP8 tensor cores")
        return NativeGemm(True)
    if device.type == "cpu":
        return NativeGemm(False, f"torch has no {kind} GEMM on CPU (tensorwise and rowwise only)")
    if not hasattr(F, "scaled_mm"):
        return NativeGemm(False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    major, minor = torch.cuda.get_device_capability(device)
    if major not in _BLOCK_KIND_MAJORS[kind]:
        majors = "/".join(f"sm{m}x" for m in _BLOCK_KIND_MAJORS[kind])
        return NativeGemm(False, f"{kind} GEMMs are native on {majors}, not sm{major}{minor}")
    return _probe(kind, device)


def _random_operand(rows: int, cols: int, block: tuple[int, int], device: torch.device, gen: torch.Generator) -> QuantizedTensor:
    data = (torch.randn(rows, cols, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = torch.exp2(torch.randint(-4, 5, grid, generator=gen).to(torch.float32))
    return QuantizedTensor(data.to(device), scale_inv.to(device), block)


def _probe(kind: str, device: torch.device) -> NativeGemm:
    # One small GEMM per operand pairing the training step uses, compared with the emulation:
    # a wrong scale layout shows as errors of whole powers of two, far above the tolerance.
    with torch.autocast(device.type, enabled=False):
        return _probe_pairs(kind, device)


def _probe_pairs(kind: str, device: torch.device) -> NativeGemm:
    gen = torch.Generator().manual_seed(0)
    pairs = [((1, 32), (1, 32))] if kind == "mxfp8" else [((1, 128), (128, 128)), ((1, 128), (1, 128))]
    out_dtypes = {torch.bfloat16: True, torch.float32: True, torch.float16: True}
    for block_a, block_b in pairs:
        a = _random_operand(256, 512, block_a, device, gen)
        b = _random_operand(256, 512, block_b, device, gen)
        expected = _emulated(a, b, torch.float32)
        for out_dtype in out_dtypes:
            try:
                got = _scaled_mm_blocks(kind, a, b, out_dtype).float()
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
                if out_dtype is torch.bfloat16:
                    return NativeGemm(False, f"torch {torch.__version__} refused the {kind} GEMM: {str(err).splitlines()[0]}")
                out_dtypes[out_dtype] = False
                continue
            # Relative to the largest output: bf16 / fp16 rounding, or summation order in fp32.
            tolerance = (1e-4 if out_dtype is torch.float32 else 1e-2) * expected.abs().max().item()
            error = (got - expected).abs().max().item()
            if not error <= tolerance:
                if out_dtype is torch.bfloat16:
                    return NativeGemm(False, f"native {kind} GEMM disagreed with the emulation (max error {error:.3g})")
                out_dtypes[out_dtype] = False
    return NativeGemm(True, "", tuple(d for d, ok in out_dtypes.items() if ok))


def _scaled_mm_blocks(kind: str, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    S = F.ScalingType
    if kind == "mxfp8":
        swizzle = F.SwizzleType.SWIZZLE_32_4_4
        return F.scaled_mm(
            a.data, b.data.t(),
            mx_gemm_scale(a.scale_inv), S.BlockWise1x32,
            mx_gemm_scale(b.scale_inv), S.BlockWise1x32,
            swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype,
        )  # fmt: skip
    if b.block == (128, 128):
        scale_b, recipe_b = blockwise_128x128_gemm_scale(b.scale_inv), S.BlockWise128x128
    else:
        scale_b, recipe_b = blockwise_1x128_gemm_scale(b.scale_inv), S.BlockWise1x128
    return F.scaled_mm(
        a.data, b.data.t(),
        blockwise_1x128_gemm_scale(a.scale_inv), S.BlockWise1x128,
        scale_b, recipe_b, output_dtype=out_dtype,
    )  # fmt: skip


def _plan(a: QuantizedTensor, b: QuantizedTensor) -> tuple[str, Optional[NativeGemm], str]:
    # (kind, its native support if this call can use it, else None, and why not).
    kind = gemm_kind(a, b)
    if kind not in GEMM_KINDS:
        return kind, None, f"no native GEMM for {a.block} x {b.block} blocks"
    support = _native_gemm(kind, a.data.device)  # a tensor's device already carries its index
    if not support.native:
        return kind, None, support.reason
    if a.data.device.type != "cuda":
        return kind, support, ""
    m, k = a.data.shape
    n = b.data.shape[0]
    if any(d % 16 for d in (m, k, n)):
        return kind, None, f"dims {tuple(a.data.shape)} x {tuple(b.data.shape)} not all multiples of 16 on CUDA"
    if kind == "tensorwise" and a.data.dtype == b.data.dtype == torch.float8_e5m2:
        return kind, None, "E5M2 x E5M2 has no CUDA kernel"
    if kind in _BLOCK_KIND_K_MULTIPLE and k % _BLOCK_KIND_K_MULTIPLE[kind]:
        return kind, None, f"{kind} GEMM needs the contraction dim ({k}) to be a multiple of {_BLOCK_KIND_K_MULTIPLE[kind]}"
    if b.block == (128, 128) and n % 128:
        return kind, None, f"128x128-scaled operand needs its rows ({n}) to be a multiple of 128"
    return kind, support, ""


def scaled_mm_supported(a: QuantizedTensor, b: QuantizedTensor) -> tuple[bool, str]:
    """Whether ``a @ b.T`` runs natively on this device and shape, and if not, why.

    Decided from shapes, dtypes, blocks and the (cached) device support alone: no host-device
    synchronisation.
    """
    _, support, reason = _plan(a, b)
    return support is not None, reason


def _emulated(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    # Outside torch autocast, which would round the dequantized operands to bf16.
    with torch.autocast(a.data.device.type, enabled=False):
        out = a.dequantize() @ b.dequantize().t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def fp8_gemm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(a.data * a.scale_inv) @ (b.data * b.scale_inv).T + bias`` with FP32 accumulation.

    Args:
        a: ``[M, K]`` FP8 data, row-major; per-tensor (0-dim) or block ``scale_inv`` with blocks
            along K.
        b: ``[N, K]`` FP8 data, row-major (the "NT" layout: ``b.data.t()`` is column-major, as
            the kernels want their second operand); per-tensor or block ``scale_inv``.
        out_dtype: dtype of the result (float32, bfloat16 or float16).
        bias: optional ``[N]`` tensor, added to the FP32 accumulator before the rounding to
            ``out_dtype`` (in the GEMM epilogue where the kernel offers it).

    Returns:
        ``[M, N]`` tensor in ``out_dtype``.

    Warns:
        UserWarning: once per reason, when a GEMM is emulated.
    """
    kind, support, reason = _plan(a, b)
    if support is None:
        _warn_once(reason)
        return _emulated(a, b, out_dtype, bias)
    # Outside torch autocast: on CPU, _scaled_mm under autocast takes a path ~40x slower.
    with torch.autocast(a.data.device.type, enabled=False):
        return _native(kind, support, a, b, out_dtype, bias)


def _native(kind: str, support: NativeGemm, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
            bias: Optional[torch.Tensor]) -> torch.Tensor:
    if kind == "tensorwise":
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
    # Block kernels: out_dtype where the kernel writes it, else bfloat16 then cast (documented).
    kernel_dtype = out_dtype if out_dtype in support.out_dtypes else torch.bfloat16
    out = _scaled_mm_blocks(kind, a, b, kernel_dtype)
    if bias is not None:
        out = (out.float() + bias.float()).to(out_dtype)
    return out.to(out_dtype)
