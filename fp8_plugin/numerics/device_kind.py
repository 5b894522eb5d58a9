"""Which kind of device a tensor's device behaves as: the one place the FP8 code asks.

Every decision that differs between a CUDA GPU and the CPU (the GEMM path and its alignment
padding, the autocast device, the device RNG a reference check saves) asks :func:`device_kind`
instead of reading ``device.type``, and reads the GPU's compute capability from
:func:`cuda_capability`.

:func:`meta_as_cuda` makes tensors on the ``meta`` device answer as a CUDA GPU of a chosen
compute capability. Meta tensors carry shapes, strides and dtypes but no data, and torch's meta
kernels of the scaled GEMMs (``torch._scaled_mm``, ``torch.nn.functional.scaled_mm``) check
CUDA's rules for them (``torch._meta_registrations.device_hint`` is "cuda" for meta tensors):
the second operand column-major, dims multiples of 16, the block-scale tensors' padded and
swizzled shapes. So the CUDA code paths run end to end, layouts and all, on a machine without a
GPU (the CUDA contract suite, ``tests/cuda_contract``); a read of a value on the host raises
there, as a host sync would stall a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional, Union

import torch

from .._private.torch_api import in_dispatch_mode

__all__ = ["device_kind", "tensor_device_kind", "eager_on_cpu", "cuda_capability", "meta_as_cuda", "fp8_family", "present_rocm",
           "presented_device", "FNUZ_ARCHS"]

# The compute capability meta tensors present while meta_as_cuda is active (None: they are meta).
_meta_capability: Optional[tuple[int, int]] = None
# The ROCm architecture meta and CPU devices present while present_rocm is active.
_presented_arch: Optional[str] = None
# AMD's architectures whose FP8 formats are FNUZ: MI300A/MI300X/MI325X (torchao's is_MI300);
# gfx950 (MI350) uses the OCP formats.
FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")


def device_kind(device: Union[str, torch.device]) -> str:
    """The kind of device ``device`` behaves as: ``"cuda"``, ``"cpu"``, or another device type.

    The device's own type, except ``"meta"`` inside :func:`meta_as_cuda`, which is ``"cuda"``.
    It is also the device type to give ``torch.autocast`` for tensors on ``device``.
    """
    if isinstance(device, str):
        device = torch.device(device)
    if device.type == "meta" and _meta_capability is not None:
        return "cuda"
    return device.type


def tensor_device_kind(tensor: torch.Tensor) -> str:
    """:func:`device_kind` of ``tensor``'s device, without making a ``torch.device`` for a CUDA
    or CPU tensor (about half a microsecond of CPU, asked every FP8 layer step)."""
    if tensor.is_cuda:
        return "cuda"
    if tensor.is_cpu:
        return "cpu"
    if tensor.is_meta and _meta_capability is not None:  # as cheap as a GPU's (the host profile's proxy)
        return "cuda"
    return device_kind(tensor.device)


def eager_on_cpu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a CPU tensor in plain eager code: not traced by ``torch.compile``,
    under no dispatch mode (``FakeTensorMode``, a recorder of ops). There a value read back waits
    for nothing and the layout of an operand is the caller's to choose; the CPU emulation's
    shortcuts (the FP8 decode's NaN check, a cast's finite-amax check, transposed views) ask this."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling() and not in_dispatch_mode()


def presented_device() -> tuple[Optional[tuple[int, int]], Optional[str]]:
    """What :func:`meta_as_cuda` and :func:`present_rocm` present now (a compute capability, an
    architecture; None where inactive): the part of a device decision a cache must key on."""
    return _meta_capability, _presented_arch


def cuda_capability(device: Union[str, torch.device]) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a device :func:`device_kind` calls ``"cuda"``
    (``torch.cuda.get_device_capability``; the presented one for meta in :func:`meta_as_cuda`)."""
    if isinstance(device, str):
        device = torch.device(device)
    if device.type == "meta" and _meta_capability is not None:
        return _meta_capability
    return torch.cuda.get_device_capability(device)


@contextlib.contextmanager
def meta_as_cuda(capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """Inside the context, ``meta`` devices behave as a CUDA GPU of compute ``capability``.

    For tests of the CUDA code paths without a GPU. What torch itself does is unchanged: torch's
    own ``torch.cuda`` functions still see no GPU (the contract suite's fixture names the few the
    project calls), and ``torch.autocast("cuda")`` stays disabled without CUDA. Decisions cached
    per device (:func:`fp8_plugin.numerics.gemm.native_gemm`) must be cleared around it.

    Args:
        capability: ``(major, minor)``, e.g. ``(8, 9)`` Ada, ``(9, 0)`` Hopper, ``(10, 0)`` and
            ``(12, 0)`` Blackwell.

    Raises:
        ValueError: ``capability`` is not a pair of non-negative ints.
    """
    global _meta_capability
    if (not isinstance(capability, tuple) or len(capability) != 2
            or not all(isinstance(v, int) and v >= 0 for v in capability)):
        raise ValueError(f"meta_as_cuda(capability={capability!r}) is not a compute capability; valid: "
                         "a (major, minor) pair of non-negative ints, e.g. (9, 0)")
    previous, _meta_capability = _meta_capability, capability
    try:
        yield
    finally:
        _meta_capability = previous


def fp8_family(device: Union[str, torch.device]) -> str:
    """The FP8 format family of ``device``: ``"fnuz"`` on an AMD MI300 (a ROCm build of torch,
    ``gcnArchName`` gfx940, gfx941 or gfx942, as torchao's ``is_MI300`` reads it), else
    ``"ocp"`` (NVIDIA GPUs, MI350, CPUs); inside :func:`present_rocm`, meta and CPU devices
    answer as that architecture."""
    if isinstance(device, str):
        device = torch.device(device)
    if device.type in ("meta", "cpu") and _presented_arch is not None:
        return _family_of(_presented_arch)
    if device.type == "cuda" and getattr(torch.version, "hip", None):
        return _family_of(_rocm_arch(device.index if device.index is not None else torch.cuda.current_device()))
    return "ocp"


def _family_of(arch: str) -> str:
    return "fnuz" if arch.split(":")[0] in FNUZ_ARCHS else "ocp"


@functools.lru_cache(maxsize=None)
def _rocm_arch(index: int) -> str:
    # e.g. "gfx942:sramecc+:xnack-"; read once per device.
    return torch.cuda.get_device_properties(index).gcnArchName


@contextlib.contextmanager
def present_rocm(arch: str = "gfx942") -> Iterator[None]:
    """Inside the context, meta and CPU devices take the FP8 formats of a ROCm GPU of
    architecture ``arch`` (:func:`fp8_family`): the FNUZ path, tested without an AMD GPU (the
    emulated GEMMs on CPU, the GEMM calls on meta tensors). Nothing else about the device changes.

    Raises:
        ValueError: ``arch`` is not a gfx architecture name (``"gfx942"``, ``"gfx950"``).
    """
    global _presented_arch
    if not isinstance(arch, str) or not arch.startswith("gfx"):
        raise ValueError(f"present_rocm(arch={arch!r}) is not a ROCm architecture; valid: a gfx name such as "
                         f"{', '.join(FNUZ_ARCHS)} (FNUZ formats) or gfx950 (OCP formats)")
    previous, _presented_arch = _presented_arch, arch
    try:
        yield
    finally:
        _presented_arch = previous
