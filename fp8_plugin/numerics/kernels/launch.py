"""Triton launches at a few microseconds of CPU each: each compiled kernel's own launcher, kept.

``kernel[grid](...)`` binds and specializes every argument and looks the compiled kernel up on
each call (``JITFunction.run``: about 12 µs of CPU per launch, tritonbench); a training step of
an FP8 layer makes four to six launches, so on the models people fine-tune that host time, not
the GPU, sets the speed. :class:`KernelLaunch` fixes a kernel's constexprs and options once and
keeps, per launch key, the launcher of the kernel the first ``kernel[grid]`` call compiled
(:func:`fp8_plugin._private.triton_api.compiled_runner`): later launches call it directly.

The launch key holds what Triton specializes a kernel on, or more: each tensor argument's dtype
and whether its address is a multiple of 16 bytes, every other argument's value, the grid and
the first argument's device (a tensor in every kernel here).
A key seen before launches the kernel Triton compiled for it; a new one goes through
``kernel[grid]`` once. Where no launcher can be kept (Triton's interpreter on CPU, an unknown
Triton), every launch goes through ``kernel[grid]``, as before.

:func:`record_launches` is the host profile's seam (``benchmarks/host_profile.py``): inside it
launches are counted, not run, and the fused casts take their eager path on meta tensors
presented as a GPU, so that a CPU measures the host work of the CUDA path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["KernelLaunch", "LaunchSite", "record_launches", "recording_launches", "graph_capture", "capturing", "launch_path",
           "ENV_VAR"]

# FP8_PLUGIN_TRITON_LAUNCH=jit sends every launch through kernel[grid] (a comparison, or a Triton
# whose launchers misbehave).
ENV_VAR = "FP8_PLUGIN_TRITON_LAUNCH"
_MAX_KEYS = 64  # launch keys kept per kernel: the steady state repeats a few shapes per layer
_recorder: Optional[Counter] = None
_capturing = False


@contextlib.contextmanager
def record_launches() -> Iterator[Counter]:
    """Count every Triton launch of the fused kernels by kernel name instead of running it.

    For measuring the host work of the CUDA path on a machine without a GPU (meta tensors
    presented as one, :func:`~fp8_plugin.numerics.device_kind.meta_as_cuda`): the casts then
    take their eager path (not the custom ops that meta tensors otherwise go through), whose
    outputs are allocated and whose kernels are counted. Nothing is written to any tensor, so
    the values a step computes inside are meaningless.

    Yields:
        a ``collections.Counter`` of launches by kernel name, filled as launches happen.
    """
    global _recorder
    previous, _recorder = _recorder, Counter()
    try:
        yield _recorder
    finally:
        _recorder = previous


def recording_launches() -> bool:
    """Whether :func:`record_launches` is active (the casts then run eagerly on meta tensors)."""
    return _recorder is not None


@contextlib.contextmanager
def graph_capture() -> Iterator[None]:
    """Mark the FP8 work inside as captured into a CUDA graph (``fp8_plugin.make_graphed_callables``
    enters it around its warm-up and capture): what the host decides from its own knowledge must
    then hold for every replay, so the casts take the path that is right in any state (a delayed
    cast keeps its amax pass, masked off on the device once the state holds a scale) and weights
    are cast anew, never taken from a cache."""
    global _capturing
    previous, _capturing = _capturing, True
    try:
        yield
    finally:
        _capturing = previous


def capturing() -> bool:
    """Whether :func:`graph_capture` is active."""
    return _capturing


def _argument_key(arg: Any) -> Any:
    # What Triton specializes an argument on, or finer: a tensor's dtype and 16-byte alignment
    # (it specializes pointers on the latter), any other argument's value.
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    return arg


class KernelLaunch:
    """One Triton kernel with its constexprs and compile options fixed, launched through the
    compiled kernel's own launcher once a launch key has been seen.

    Args:
        kernel: a ``triton.jit`` function whose constexpr parameters all come after its runtime
            ones (every kernel of this package).
        **fixed: every constexpr parameter by name, and Triton options (``num_warps``,
            ``enable_fp_fusion``...).

    Raises:
        ValueError: a constexpr parameter before a runtime one, or one missing from ``fixed``.
    """

    def __init__(self, kernel: Any, **fixed: Any) -> None:
        self.kernel = kernel
        fn = getattr(kernel, "fn", kernel)  # the Python function (a JIT or an interpreted kernel)
        self.name = fn.__name__
        # Parameters annotated tl.constexpr (a string under postponed annotations) are constexprs.
        params = list(inspect.signature(fn).parameters.values())
        constexprs = [p.name for p in params if "constexpr" in str(p.annotation)]
        runtime = [p.name for p in params if "constexpr" not in str(p.annotation)]
        if [p.name for p in params] != runtime + constexprs:
            raise ValueError(f"KernelLaunch({self.name}): constexpr parameters must follow the runtime ones")
        missing = [name for name in constexprs if name not in fixed]
        if missing:
            raise ValueError(f"KernelLaunch({self.name}) needs the constexprs {', '.join(missing)}")
        self.fixed = fixed
        self._constexpr_values = tuple(fixed[name] for name in constexprs)
        self._runners: dict[tuple, Callable[..., None]] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        """Launch on ``grid`` (1 to 3 ints) with the runtime arguments ``args``, in order."""
        grid, key = self._key(grid, args)
        if _recorder is not None:  # counted, not run: the key made first, as a launch's host work
            _recorder[self.name] += 1
            return
        runner = self._runners.get(key)
        if runner is not None:
            runner(*args)
            return
        compiled = self.kernel[grid](*args, **self.fixed)
        runner = self._runner(compiled, grid)
        if runner is not None:
            if len(self._runners) >= _MAX_KEYS:
                self._runners.clear()
            self._runners[key] = runner

    def _key(self, grid: tuple[int, ...], args: tuple) -> tuple[tuple[int, int, int], tuple]:
        # The grid as three ints, and the launch key (module docstring). The first argument's
        # device: a launcher runs the module loaded on one device.
        grid = (tuple(grid) + (1, 1))[:3]
        return grid, (grid, args[0].get_device(), *[_argument_key(a) for a in args])

    def kept_runner(self, grid: tuple[int, ...], args: tuple) -> Optional[Callable[..., None]]:
        """The launcher kept for the launch key of ``grid`` and ``args``, to be called with the
        runtime arguments alone, or None where none is kept: before the key's first launch, or
        where launchers are not kept (the interpreter, ``FP8_PLUGIN_TRITON_LAUNCH=jit``). While
        launches are recorded, a function that counts one."""
        grid, key = self._key(grid, args)
        if _recorder is not None:
            return functools.partial(_count, self.name)
        return self._runners.get(key)

    def _runner(self, compiled: Any, grid: tuple[int, int, int]) -> Optional[Callable[..., None]]:
        # The compiled kernel's launcher, taking this call's runtime arguments alone.
        if launch_path() == "jit":
            return None
        from ..._private.triton_api import compiled_runner, launch_convention

        runner = compiled_runner(compiled, grid)
        if runner is None:
            return None
        if launch_convention() == "runtime":  # launchers that take the runtime arguments only
            return runner
        constexprs = self._constexpr_values  # launchers that take the constexprs after them
        return lambda *values: runner(*values, *constexprs)


def _count(name: str, *_: Any) -> None:
    # A recorded launch of kernel ``name`` (a LaunchSite's runner while launches are recorded).
    if _recorder is not None:
        _recorder[name] += 1


class LaunchSite:
    """One launch of a kept plan (a cast's, a GEMM's) whose launch key can change between calls
    only by the values the caller gives as ``variant`` and by whether its tensors' addresses are
    multiples of 16 bytes: the kept launcher is found once per (variant, alignment) and then
    called directly. The key of a :class:`KernelLaunch` call, one entry per argument, costs about
    3.6 µs of CPU for a cast's 17 arguments; a training step of an FP8 layer makes 7 to 9 launches.

    Args:
        launch: the kernel.
        grid: the launch grid, fixed for the site.
    """

    __slots__ = ("launch", "grid", "runners")

    def __init__(self, launch: KernelLaunch, grid: tuple[int, ...]) -> None:
        self.launch, self.grid = launch, grid
        self.runners: dict[tuple, Callable[..., None]] = {}

    def __call__(self, variant: Any, addresses: int, *args: Any) -> None:
        """Launch with the runtime arguments ``args``. ``variant``: every value of the launch key
        (module docstring) that may differ between this site's calls, other than alignment (the
        caller's promise: all else is fixed by its plan); ``addresses``: the bitwise OR of the
        ``data_ptr()`` of every tensor argument that may differ between calls."""
        key = (variant, addresses & 15 == 0, _recorder is not None)
        runner = self.runners.get(key)
        if runner is not None:
            runner(*args)
            return
        self.launch(self.grid, *args)
        runner = self.launch.kept_runner(self.grid, args)
        if runner is not None:
            if len(self.runners) >= _MAX_KEYS:
                self.runners.clear()
            self.runners[key] = runner


def launch_path() -> str:
    """``"cached"`` (the default: compiled kernels' own launchers) or ``"jit"`` (every launch
    through ``kernel[grid]``), from ``FP8_PLUGIN_TRITON_LAUNCH``.

    Raises:
        ValueError: another value of ``FP8_PLUGIN_TRITON_LAUNCH``.
    """
    path = os.environ.get(ENV_VAR, "cached")
    if path not in ("cached", "jit"):
        raise ValueError(f"{ENV_VAR}={path!r} is not a launch path; valid: cached, jit")
    return path
