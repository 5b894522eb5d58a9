"""FP8 cast kernels: fused Triton kernels where they can run, torch ops elsewhere.

The layers ask for "a cast"; this room decides how it runs, in one place, as
:mod:`fp8_plugin.numerics.gemm` decides the GEMM path. Triton is imported only when a kernel is
asked for, so ``import fp8_plugin`` does not need it. Each kernel module names the torch
reference it equals byte for byte (``reference_*``), and the tests run every kernel under
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors against that reference.

Modules: :mod:`.fp8_bits` (the FP8 encoding with integer operations), :mod:`.tensorwise`
(per-tensor casts: cast + transpose + amax in one pass; current scaling's amax and cast; each
recording its amax into the layer's scaling state), :mod:`.blockwise` (MXFP8 and 128-blockwise
casts, both copies and the GEMM's scale layouts in one pass), :mod:`.grouped` (the experts'
per-expert casts), :mod:`.scale_update` (delayed scaling's update of a whole model in one
launch), :mod:`.ops` (the casts as torch custom ops, for ``torch.compile``, fake tensors and
dispatch modes), :mod:`.scaled_gemm` (a per-tensor-scaled FP8 GEMM, the alternative to
``torch._scaled_mm`` that :func:`gemm_kernel` selects).
"""

from __future__ import annotations

import contextlib
import os
from functools import lru_cache
from typing import Iterator, Optional

import torch

from ..device_kind import device_kind
from ..formats import is_fnuz

__all__ = ["fused_casts", "fusable", "force_kernels", "forced_kernels", "KERNEL_PATHS", "ENV_VAR", "gemm_kernel",
           "force_gemm_kernel", "GEMM_KERNELS", "GEMM_ENV_VAR"]

KERNEL_PATHS = ("auto", "triton", "torch")
# Set to "torch" to keep the torch ops on a GPU (a comparison, or a Triton build that misbehaves).
ENV_VAR = "FP8_PLUGIN_CAST_KERNELS"
_forced: Optional[str] = None
GEMM_KERNELS = ("torch", "triton")
# Which kernel runs a per-tensor-scaled FP8 GEMM on a CUDA GPU in eager code (gemm_kernel).
GEMM_ENV_VAR = "FP8_PLUGIN_GEMM_KERNEL"
_forced_gemm: Optional[str] = None


@contextlib.contextmanager
def force_kernels(path: str) -> Iterator[None]:
    """Run every per-tensor FP8 cast in the context as ``path``: ``"triton"`` (the fused kernels on
    any device: on CPU tensors under ``TRITON_INTERPRET=1``, for tests), ``"torch"`` (the torch
    ops) or ``"auto"`` (the default: :func:`fused_casts` decides).

    Raises:
        ValueError: unknown ``path``.
    """
    global _forced
    if path not in KERNEL_PATHS:
        raise ValueError(f"force_kernels(path={path!r}) is not a cast path; valid: {', '.join(KERNEL_PATHS)}")
    previous, _forced = _forced, (None if path == "auto" else path)
    try:
        yield
    finally:
        _forced = previous


def forced_kernels() -> Optional[str]:
    """The path :func:`force_kernels` pins now: ``"triton"``, ``"torch"``, or None (``"auto"``)."""
    return _forced


def fused_casts(device: torch.device) -> tuple[bool, str]:
    """Whether per-tensor FP8 casts on ``device`` run as the fused Triton kernels, and if not, why.

    Yes on a real CUDA device where Triton imports (torch's CUDA wheels ship it), unless
    ``FP8_PLUGIN_CAST_KERNELS=torch`` is set or :func:`force_kernels` says otherwise. Not while
    ``torch.compile`` traces (Inductor fuses the torch ops itself) unless
    ``FP8_PLUGIN_CAST_KERNELS=triton`` (or :func:`force_kernels`) asks for them: compiled graphs
    then hold each cast as one custom op (:mod:`.ops`), ``fullgraph=True`` included. CPU runs the torch ops. Meta
    tensors presented as a GPU (:func:`~fp8_plugin.numerics.device_kind.meta_as_cuda`, the CUDA
    contract suite and the cost model) take the fused path, as the custom ops of
    :mod:`.ops` with their fake kernels. Decided from the device type alone: no host read.
    """
    if _forced is not None:
        return _forced == "triton", "" if _forced == "triton" else "forced: torch ops"
    if device_kind(device) != "cuda":  # meta tensors presented as a GPU (meta_as_cuda) take the ops' fake kernels
        return False, f"the fused kernels run on CUDA GPUs, not on {device.type}"
    if torch.compiler.is_compiling() and os.environ.get(ENV_VAR, "auto") != "triton":
        # FP8_PLUGIN_CAST_KERNELS=triton keeps them in compiled graphs too, as custom ops.
        return False, "torch.compile fuses the torch ops itself"
    return _triton_available()


def fusable(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a cast of ``x`` to the FP8 ``dtype`` runs as the fused kernels: :func:`fused_casts`
    for its device, an input dtype the kernels take (float32, bfloat16, float16; a float64 model
    keeps the torch ops), and an OCP target (the kernels' encoders are the OCP formats'; the
    FNUZ formats of an AMD MI300 keep the torch ops)."""
    return (x.dtype in (torch.float32, torch.bfloat16, torch.float16) and not is_fnuz(dtype)
            and fused_casts(x.device)[0])


@lru_cache(maxsize=None)
def _triton_available() -> tuple[bool, str]:
    if os.environ.get(ENV_VAR, "auto") == "torch":
        return False, f"{ENV_VAR}=torch"
    if os.environ.get(ENV_VAR, "auto") not in ("auto", "triton"):
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a cast path; valid: auto, triton, torch")
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return False, f"Triton does not import ({err})"
    return True, ""


def gemm_kernel() -> str:
    """The kernel of per-tensor-scaled FP8 GEMMs on a CUDA GPU in eager code: ``"torch"`` (the
    default: ``torch._scaled_mm``, cuBLASLt) or ``"triton"`` (:mod:`.scaled_gemm`: launched at a
    few microseconds of CPU, where cuBLASLt's host side costs tens to a hundred; its GPU time
    against cuBLAS's is measured by ``benchmarks/suite.py``), from :func:`force_gemm_kernel`, else
    ``FP8_PLUGIN_GEMM_KERNEL``. Compiled code, dispatch modes and the block-scaled recipes keep
    ``torch._scaled_mm`` / ``scaled_mm`` whatever it says.

    Raises:
        ValueError: another value of ``FP8_PLUGIN_GEMM_KERNEL``.
    """
    if _forced_gemm is not None:
        return _forced_gemm
    kernel = os.environ.get(GEMM_ENV_VAR, "torch")
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"{GEMM_ENV_VAR}={kernel!r} is not a GEMM kernel; valid: {', '.join(GEMM_KERNELS)}")
    return kernel


@contextlib.contextmanager
def force_gemm_kernel(kernel: str) -> Iterator[None]:
    """Run the per-tensor-scaled FP8 GEMMs of the context with ``kernel`` (:func:`gemm_kernel`'s
    choices), whatever ``FP8_PLUGIN_GEMM_KERNEL`` says.

    Raises:
        ValueError: unknown ``kernel``.
    """
    global _forced_gemm
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"force_gemm_kernel(kernel={kernel!r}) is not a GEMM kernel; valid: {', '.join(GEMM_KERNELS)}")
    previous, _forced_gemm = _forced_gemm, kernel
    try:
        yield
    finally:
        _forced_gemm = previous
