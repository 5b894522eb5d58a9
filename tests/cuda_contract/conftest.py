"""The CUDA contract fixture: the project's CUDA paths on ``meta`` tensors treated as a GPU, or on a real one.

Two modes, chosen by the environment variable ``FP8_CONTRACT_DEVICE`` once per test session
(:func:`contract_mode`):

- ``meta`` (unset or empty: the default, every machine): tensors on the ``meta`` device, which
  the project treats as a CUDA GPU of the compute capability each test presents (sm80 to sm120).
- ``cuda`` (a machine with a CUDA GPU: ``benchmarks/gpu_run.sh`` runs this third): the same tests
  on real ``cuda`` tensors of the current GPU. Only that GPU's compute capability is presented: a
  test parametrized for another one is skipped, with a reason naming the real one. Nothing of
  ``torch.cuda`` is patched and :func:`~fp8_plugin.numerics.device_kind.meta_as_cuda` is not
  entered. Set without a GPU, the session stops at collection (``FP8_CONTRACT_DEVICE=cuda but
  torch.cuda.is_available() is False``) instead of running on meta tensors; any other value
  stops it naming the valid ones. A test module opts in with ``CONTRACT_DEVICES = ("meta",
  "cuda")`` and builds its tensors on ``cuda.device``; the tests of a module without it are
  skipped in this mode (they build meta tensors, which on a real GPU would test nothing).

``cuda`` (parametrize it indirectly with a compute capability, e.g. ``(9, 0)``; default sm90 on
meta, the GPU's own on a real one) holds, for the length of one test:

- meta mode: :func:`fp8_plugin.numerics.device_kind.meta_as_cuda`, the project's own seam; every
  decision the project makes between its CUDA and CPU paths asks it, and the GPU's compute
  capability is read from it;
- ``force_path("native")`` in both modes: the native kernels, without the block kinds' probe
  GEMM (it reads its result on the host, which a meta tensor cannot give, and on a GPU its host
  reads would show in every test's record; ``test_the_block_probe_reads_the_host_so_tests_force_the_native_path``
  runs the probe itself, on a GPU to its verdict); the per-device caches of
  ``fp8_plugin.numerics.gemm`` are cleared before and after, as the presented GPU changes;
- a dispatch mode that records every aten op: the scaled GEMMs (``_scaled_mm``,
  ``_scaled_mm_v2``, ``_scaled_grouped_mm``) with their operands' shapes and strides, float32
  ``mm`` (the emulation's GEMM), reads of a device tensor's value on the host
  (``_local_scalar_dense``, copies to the CPU: a host sync on a GPU; on meta tensors an error
  anyway, on a real GPU they succeed, so this record is what catches them there; a non-blocking
  ``copy_`` into pinned host memory waits in the stream only and is recorded apart, as
  ``async_host_copies``: the scale update sends the ``initialized`` flags back so), copies of CPU
  tensors to the device (a blocking host-to-device copy waits for the GPU's queue: a sync too;
  one made by ``torch.tensor(list, device=...)`` happens below the dispatcher and is not seen; a
  non-blocking one from pinned memory waits in the stream only and is not recorded),
  CPU tensors mixed into ops on device tensors (all but one kind, torch's own: the 0-dim int64
  philox seed and offset its memory-efficient attention hands its backward, ``HOST_RNG_ARGUMENTS``),
  and the rules of torch's CUDA ``_scaled_mm`` (``aten/src/ATen/native/cuda/ScaledBlas.cpp`` in
  torch 2.11) that its meta kernel leaves out: every tensor on the GPU (a CPU scale passes the meta
  kernel), no bias with a float32 output, a bias of the output dtype (BF16 or FP16), no E5M2 x
  E5M2. On a real GPU these are recorded before the real kernel is called, which refuses them
  itself.

The ``torch.cuda`` calls the project makes, and what the meta mode does with each (the cuda
mode patches none of them):

- ``torch.cuda.get_device_capability`` (numerics/gemm.py, numerics/grouped_gemm.py,
  numerics/device.py): not patched; the project reads it through ``device_kind.cuda_capability``,
  which presents the chosen one.
- ``torch.cuda.get_rng_state`` / ``torch.cuda.set_rng_state`` (training/reference/, and
  ``torch.random.fork_rng``, which the reference check calls with the device): **patched**. A CPU
  build has no CUDA generator; the stand-ins keep one generator state (a uint8 tensor, as
  torch's) per device and check that the device they are given is the meta device.
  :meth:`Contract.device_rng_state` reads the state in either mode.
- ``torch.cuda.synchronize`` (numerics/gemm.py ``tensorwise_choice``, timing on CPU only):
  **patched** to raise; nothing in a training step may wait for the GPU.
- ``torch.cuda.current_device`` (``gemm.normalize_device``, which pins a bare ``"cuda"`` to the
  current device's index): **patched** to answer 0, for the one test of that line; the meta
  device itself is never the bare ``"cuda"``.
- ``torch.cuda.is_available``, ``device_count``, ``get_device_name`` (default devices of the
  precision plugins, ``describe_device``, the command line): not patched; the tests pass the
  device explicitly and do not describe it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fp8_plugin.numerics import gemm
from fp8_plugin.numerics.device_kind import meta_as_cuda
from fp8_plugin.numerics.kernels.ops import OP_LAUNCHES

META = torch.device("meta")
SCALED_GEMMS = ("aten._scaled_mm.default", "aten._scaled_mm_v2.default", "aten._scaled_grouped_mm.default",
                "aten._scaled_grouped_mm_v2.default")
_HOST_READS = ("aten._local_scalar_dense.default",)
# The one kind of CPU tensor the recorder lets into an op on device tensors: the philox seed and
# offset of the dropout of torch's memory-efficient attention. Its CUDA forward makes them 0-dim
# int64 tensors on the host outside CUDA graph capture, with values it read from the generator on
# the host (aten/src/ATen/native/transformers/cuda/attention.cu, _efficient_attention_forward, Note
# [Seed and Offset Device]: `device = in_capture_stream ? at::kCUDA : at::kCPU`, `seed_t =
# at::scalar_tensor(at::Scalar(static_cast<int64_t>(seed)), at::dtype(at::kLong))`, without
# dropout `at::empty({}, at::dtype(at::kLong).device(device))`), and returns them from
# aten._efficient_attention_forward and aten._scaled_dot_product_efficient_attention; their
# backwards take them back (native_functions.yaml: `Tensor philox_seed, Tensor philox_offset`)
# and read them on the host, no sync. FlashAttention is not here: from torch 2.11 its CUDA forward
# keeps its RNG state on the GPU (flash_api.cpp mha_fwd, "[Note] BC breaking change to flash
# seed/offset": `rng_state = at::empty({2}, at::dtype(c10::kUInt64).device(at::kCUDA))`); nor is
# cuDNN attention, whose seed and offset are device tensors (`at::zeros({1},
# query.options().dtype(at::kLong))`). Keyed by op, the values: the exempt arguments' names.
HOST_RNG_ARGUMENTS = {
    "aten._scaled_dot_product_efficient_attention_backward.default": ("philox_seed", "philox_offset"),
    "aten._efficient_attention_backward.default": ("philox_seed", "philox_offset"),
}
MODE_VARIABLE = "FP8_CONTRACT_DEVICE"
MODES = ("meta", "cuda")


def contract_mode(environ: Mapping[str, str], cuda_available: Callable[[], bool]) -> str:
    """The device the contract suite runs on: ``"meta"`` or ``"cuda"`` (module docstring).

    Args:
        environ: the environment; ``FP8_CONTRACT_DEVICE`` unset or empty means ``"meta"``.
        cuda_available: ``torch.cuda.is_available``, asked only for ``"cuda"``.

    Raises:
        pytest.UsageError: a value other than ``meta`` / ``cuda``, or ``cuda`` without a GPU.
    """
    value = environ.get(MODE_VARIABLE, "").strip()
    if value in ("", "meta"):
        return "meta"
    if value != "cuda":
        raise pytest.UsageError(f"{MODE_VARIABLE}={value!r} is not a contract device; valid: "
                                f"{', '.join(MODES)} (unset: meta)")
    if not cuda_available():
        raise pytest.UsageError(f"{MODE_VARIABLE}=cuda but torch.cuda.is_available() is False: the real-device "
                                "mode needs a CUDA GPU (unset the variable to run on meta tensors)")
    return "cuda"


# Decided once, when pytest loads this file: a wrong setting stops the session at collection.
MODE = contract_mode(os.environ, torch.cuda.is_available)


def sm(capability: tuple[int, int]) -> str:
    return f"sm{capability[0]}{capability[1]}"


@dataclass
class Contract:
    """What one contract test ran: the presented GPU, the device its tensors live on, the aten ops seen."""

    capability: tuple[int, int]
    device: torch.device = META
    ops: collections.Counter = field(default_factory=collections.Counter)
    host_reads: list[str] = field(default_factory=list)
    to_device_copies: list[str] = field(default_factory=list)
    mixed_devices: list[str] = field(default_factory=list)
    async_host_copies: list[str] = field(default_factory=list)  # non-blocking, into pinned memory: no sync
    float32_mm: int = 0
    rng_states: dict = field(default_factory=dict)
    # (op, [(shape, stride, dtype) of each tensor operand]) of each scaled GEMM call.
    gemms: list = field(default_factory=list)
    # use_fast_accum of each _scaled_mm, in call order (MMParams.use_split_accumulator negated).
    fast_accum: list = field(default_factory=list)
    # Broken rules of the CUDA kernels that the meta kernels do not check.
    kernel_violations: list[str] = field(default_factory=list)
    # Kernel launches per op name: ops that launch one (not views, not bare allocations), and the
    # project's custom ops at their own launch counts (fp8_plugin.numerics.kernels.ops.OP_LAUNCHES).
    launches: collections.Counter = field(default_factory=collections.Counter)

    @property
    def real(self) -> bool:
        """True on a real CUDA GPU (``FP8_CONTRACT_DEVICE=cuda``), False on meta tensors."""
        return self.device.type == "cuda"

    @property
    def mode(self) -> str:
        """The contract mode this test runs in, ``"meta"`` or ``"cuda"``: the key of a :meth:`kernel_refusal` table."""
        return "cuda" if self.real else "meta"

    @contextlib.contextmanager
    def kernel_refusal(self, refusals: Mapping[str, tuple[type[Exception], str] | None]):
        """Expect the refusal of torch's kernel of this mode, in that kernel's own words.

        Args:
            refusals: per mode (``"meta"``, ``"cuda"``), ``(exception type, message regex)``, or None
                where that mode's kernel accepts the call. The type must be exactly that one (not a
                subclass: torch's ``NotImplementedError`` is a ``RuntimeError``); the regex is searched
                in the message.
        """
        expected = refusals[self.mode]
        if expected is None:
            yield
            return
        kind, pattern = expected
        with pytest.raises(Exception) as raised:
            yield
        error = raised.value
        assert type(error) is kind, f"{self.mode}: expected {kind.__name__}, got {type(error).__name__}: {error}"
        assert re.search(pattern, str(error)), f"{self.mode}: {pattern!r} not in {str(error)!r}"

    def scaled_gemms(self) -> int:
        """Calls of torch's scaled GEMM kernels (tensorwise, block-scaled, grouped)."""
        return sum(self.ops[name] for name in SCALED_GEMMS)

    def device_rng_state(self) -> torch.Tensor:
        """The device generator's state (uint8 CPU tensor): the meta mode's stand-in, or the GPU's."""
        if self.real:
            return torch.cuda.get_rng_state(self.device)
        return self.rng_states[str(self.device)]

    def reset(self) -> None:
        self.ops.clear()
        self.host_reads.clear()
        self.to_device_copies.clear()
        self.mixed_devices.clear()
        self.async_host_copies.clear()
        self.float32_mm = 0
        self.gemms.clear()
        self.fast_accum.clear()
        self.kernel_violations.clear()
        self.launches.clear()

    def clean(self) -> None:
        """Assert no host read, no CPU tensor mixed in, no broken kernel rule so far."""
        assert not self.host_reads, self.host_reads
        assert not self.to_device_copies, self.to_device_copies
        assert not self.mixed_devices, self.mixed_devices
        assert not self.kernel_violations, self.kernel_violations


class _Recorder(TorchDispatchMode):
    def __init__(self, contract: Contract) -> None:
        super().__init__()
        self.contract = contract

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        c = self.contract
        gpu = c.device.type  # "meta" or "cuda"
        c.ops[name] += 1
        c.launches[name] += _launches(func, name)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        target = kwargs.get("device")
        target = None if target is None else torch.device(target).type
        # A value read on the host: from a device tensor (a CPU tensor's .item() waits for nothing).
        if (name in _HOST_READS and gpu in devices) or (name == "aten._to_copy.default" and gpu in devices
                                                        and target == "cpu"):
            c.host_reads.append(name)
        if name == "aten._to_copy.default" and devices == {"cpu"} and target == gpu and not _async_copy(tensors, kwargs):
            c.to_device_copies.append(f"{name}: {[tuple(t.shape) for t in tensors]}")
        to_host = name == "aten.copy_.default" and args[0].device.type == "cpu" and args[1].device.type == gpu
        if to_host and _async_copy([args[0]], {"non_blocking": args[2] if len(args) > 2 else kwargs.get("non_blocking")}):
            # Into pinned memory without blocking: the copy waits in the stream, the host reads the
            # values once an event says so (the scale update's initialized flags): no sync.
            c.async_host_copies.append(f"{name}: {[tuple(t.shape) for t in tensors]}")
        elif to_host:
            c.host_reads.append(name)  # a blocking device-to-host copy waits for the GPU
        else:
            mixed = _mixed_devices(func, name, tensors, args, kwargs, gpu)
            if mixed:
                c.mixed_devices.append(mixed)
        if name in ("aten.mm.default", "aten.addmm.default") and any(t.dtype == torch.float32 for t in tensors):
            c.float32_mm += 1
        if name in SCALED_GEMMS:
            c.gemms.append((name, [(tuple(t.shape), t.stride(), t.dtype) for t in tensors]))
            if name == "aten._scaled_mm.default":  # schema: use_fast_accum is argument 7
                c.fast_accum.append(bool(kwargs.get("use_fast_accum", args[7] if len(args) > 7 else False)))
            c.kernel_violations += _cuda_rules(name, tensors, args, kwargs, gpu)
        return func(*args, **kwargs)


# Ops that allocate without launching a kernel.
_ALLOCATIONS = ("aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
                "aten.new_empty.default", "aten.new_empty_strided.default")


def _async_copy(tensors: list[torch.Tensor], kwargs: dict) -> bool:
    # A non-blocking copy from pinned memory waits in the stream, not on the host: no sync.
    return bool(kwargs.get("non_blocking")) and all(t.is_pinned() for t in tensors)


def _launches(func, name: str) -> int:
    # Kernel launches of one op on a GPU: a view or a bare allocation launches none, a custom op
    # of the project as many as it documents ("fp8_plugin.<op>.default"), any other op one.
    if name.startswith("fp8_plugin."):
        return OP_LAUNCHES.get(name.split(".")[1], 1)
    return 0 if func.is_view or name in _ALLOCATIONS else 1


def _host_rng_arguments(func, name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The arguments of a call of ``HOST_RNG_ARGUMENTS``' ops that are torch's host philox seed and
    offset: named so in the op's schema, on the CPU, 0-dim, int64. Any other CPU tensor is not."""
    names = HOST_RNG_ARGUMENTS.get(name, ())
    exempt = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.name not in names:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0
                and value.dtype == torch.int64):
            exempt.append(value)
    return exempt


def _mixed_devices(func, name: str, tensors: list[torch.Tensor], args: tuple, kwargs: dict, gpu: str) -> str | None:
    """The record of a CPU tensor mixed into an op on device tensors, or None (none mixed in, or
    only torch's host philox seed and offset of its efficient attention: ``HOST_RNG_ARGUMENTS``)."""
    if gpu not in {t.device.type for t in tensors}:
        return None
    exempt = _host_rng_arguments(func, name, args, kwargs)
    if not any(t.device.type == "cpu" and not any(t is e for e in exempt) for t in tensors):
        return None
    return f"{name}: {[(t.device.type, tuple(t.shape)) for t in tensors]}"


def _cuda_rules(name: str, tensors: list[torch.Tensor], args: tuple, kwargs: dict, gpu: str) -> list[str]:
    # Checks of torch's CUDA scaled GEMMs (aten/src/ATen/native/cuda/ScaledBlas.cpp) that the meta
    # kernels leave out.
    broken = [f"{name}: a tensor on {t.device} (all must be on the GPU)" for t in tensors if t.device.type != gpu]
    if name != "aten._scaled_mm.default":
        return broken
    mat1, mat2 = args[0], args[1]
    bias = kwargs.get("bias", args[4] if len(args) > 4 else None)
    out_dtype = kwargs.get("out_dtype", args[6] if len(args) > 6 else None) or mat1.dtype
    if mat1.dtype == mat2.dtype == torch.float8_e5m2:
        broken.append("Multiplication of two Float8_e5m2 matrices is not supported")
    if bias is not None:
        if out_dtype == torch.float32:
            broken.append("Bias is not supported when out_dtype is set to Float32")
        elif bias.dtype != out_dtype:
            broken.append(f"Bias must be {out_dtype} to compute {out_dtype} output, but got {bias.dtype}")
    return broken


def _rng_stand_ins(contract: Contract):
    def get_rng_state(device="cuda"):
        device = torch.device(device)
        assert device == META, f"torch.cuda.get_rng_state got {device}, expected the meta device treated as CUDA"
        return contract.rng_states.setdefault(str(device), torch.Generator().manual_seed(1234).get_state()).clone()

    def set_rng_state(new_state, device="cuda"):
        device = torch.device(device)
        assert device == META, f"torch.cuda.set_rng_state got {device}, expected the meta device treated as CUDA"
        assert new_state.dtype == torch.uint8 and new_state.device.type == "cpu", new_state
        contract.rng_states[str(device)] = new_state.clone()

    return get_rng_state, set_rng_state


def _no_synchronize(device=None):
    raise AssertionError(f"torch.cuda.synchronize({device}) called: a host sync")


def _meta_gpu(capability: tuple[int, int], monkeypatch):
    contract = Contract(capability)
    get_rng_state, set_rng_state = _rng_stand_ins(contract)
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda, "synchronize", _no_synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return contract, meta_as_cuda(capability)


def _real_gpu(request, asked):
    if "cuda" not in getattr(request.module, "CONTRACT_DEVICES", ("meta",)):
        pytest.skip(f"{MODE_VARIABLE}=cuda: {request.module.__name__} builds its tensors on the meta device "
                    "(no CONTRACT_DEVICES = ('meta', 'cuda')); it runs in the meta mode")
    device = torch.device("cuda", torch.cuda.current_device())
    real = torch.cuda.get_device_capability(device)
    if asked is not None and tuple(asked) != real:
        pytest.skip(f"{MODE_VARIABLE}=cuda: presents {sm(tuple(asked))}, but this GPU "
                    f"({torch.cuda.get_device_name(device)}) is {sm(real)}; the meta mode covers {sm(tuple(asked))}")
    return Contract(real, device)


@pytest.fixture
def cuda(request, monkeypatch):
    """A CUDA GPU of compute capability ``request.param`` (default (9, 0)): meta tensors treated
    as one, or with ``FP8_CONTRACT_DEVICE=cuda`` the real GPU (skipped for another capability).
    Tests build their tensors on ``cuda.device``."""
    asked = getattr(request, "param", None)
    if MODE == "cuda":
        contract, seam = _real_gpu(request, asked), contextlib.nullcontext()
    else:
        contract, seam = _meta_gpu(asked or (9, 0), monkeypatch)
    gemm.clear_plans()
    try:
        with seam, gemm.force_path("native"), _Recorder(contract):
            yield contract
    finally:
        gemm.clear_plans()
