"""A recorder of what would make a training step wait for a GPU, run on a CPU.

On a GPU a training step runs ahead of its kernels until something needs a value on the host.
On a CPU nothing waits, and ``.cpu()`` or ``.tolist()`` does not even reach the dispatcher, so
counting ``aten._local_scalar_dense`` alone misses most of them. :class:`HostReads` records, in
one step of a CPU run, every operation that on a GPU run of the same code would be:

- ``read``: a device tensor's value read on the host: ``item()``, ``tolist()``, ``bool()``,
  ``float()``, ``int()``, ``index()``, ``numpy()``, ``torch.equal`` / ``allclose``, formatting or
  printing it (a torch function mode sees these Python calls), and ``aten._local_scalar_dense``
  reached otherwise (from C++, or from inside a torch function written in Python, whose own
  calls the function mode does not see; a dispatch mode, not counted twice);
- ``to_host``: a copy of a device tensor to the CPU: ``.cpu()``, ``.to("cpu")`` written with the
  string, ``copy_`` into a host tensor;
- ``to_device``: a copy of a host tensor to the device, synchronous with the GPU's queue unless
  pinned and non-blocking: ``.to(device)`` / ``copy_`` / ``torch.tensor(data, device=...)``,
  and a host tensor (more than a scalar) mixed into an op on device tensors;
- ``shape_sync``: an op whose output size depends on a device tensor's values, which the GPU
  computes and the host must read to allocate the output: ``nonzero``, ``masked_select``,
  boolean-mask indexing, ``unique``, ``repeat_interleave`` without ``output_size``, ``bincount``.

Which tensors are on "the device": on a CPU machine every tensor is a CPU tensor, so the recorder
tracks which of them a GPU run would have on the host. Tensors that exist when recording starts
(at the first :meth:`HostReads.step`: parameters, optimizer state, scaling state), unless marked
with :meth:`HostReads.host` (a data set), and those made by a factory given a ``device`` are
device tensors; tensors made from Python data or by a factory without a device or with
``device="cpu"`` written out (``torch.tensor(x)``, ``torch.zeros(3)``; torch's optimizers keep
their step counts so), copies made by ``.cpu()``, and results of ops on host
tensors alone are host tensors. Reading a host tensor waits for nothing and is not counted.
``Tensor.to(torch.device("cpu"))`` of a device tensor reads as a move to the model's device (on a
CPU run the code cannot say which it means), a no-op on a GPU run: not counted.

What it cannot see: a ``.cpu()`` inside a torch function written in Python (on a CPU run such a
copy reaches no dispatcher), and the GPU's own kernels' syncs beyond the ops listed above; a
pinned, non-blocking copy to the device, which does not wait, is counted as ``to_device`` all the
same.

Each event is counted under ``(kind, site)``, the site being the first frame outside torch and
this file (``fp8_plugin/training/faults.py:check``), one :class:`collections.Counter` per step:
:meth:`HostReads.step` starts the next one.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import weakref
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("read", "to_host", "to_device", "shape_sync")

_T = torch.Tensor
# Python calls that read a tensor's value on the host.
_READS = {_T.item, _T.tolist, _T.__bool__, _T.__float__, _T.__int__, _T.__index__, _T.__complex__, _T.numpy,
          _T.__format__, _T.__repr__, _T.__str__, _T.__array__, torch.equal, _T.equal, torch.allclose, _T.allclose,
          torch.is_nonzero, _T.is_nonzero}
# Factories whose result is on the default device (the host) unless given a device.
_FACTORIES = {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
              torch.arange, torch.linspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye}
# Factories that copy Python data into the tensor they make: given a device, a host-to-device copy.
_FROM_DATA = {torch.tensor, torch.as_tensor}
# aten ops whose output size depends on the values of their input.
_SHAPE_SYNCS = {"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                "aten.unique_dim.default", "aten.unique_consecutive.default", "aten.bincount.default",
                "aten.argwhere.default"}
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _site() -> str:
    """The first caller outside torch and this file, as ``package/path.py:function``."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH) and "/contextlib.py" not in path:
            return f"{_short(path)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _short(path: str) -> str:
    parts = path.split(os.sep)
    for root in ("site-packages", "tests"):
        if root in parts:
            index = parts.index(root)
            return "/".join(parts[index + 1:] if root == "site-packages" else parts[index:])
    for index in range(len(parts) - 1, -1, -1):
        if parts[index] == "fp8_plugin":
            return "/".join(parts[index:])
    return path


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _names_cpu(value: Any) -> bool:
    return isinstance(value, str) and value.split(":")[0] == "cpu"


class HostReads:
    """Counts per training step the operations that would wait for a GPU (module docstring).

    Use as a context manager around the whole loop, calling :meth:`step` at the start of each
    training step; ``steps[i]`` then holds step ``i``'s events (``steps[0]``: what ran before the
    first :meth:`step`, set-up).
    """

    def __init__(self) -> None:
        self.steps: list[collections.Counter] = [collections.Counter()]
        self._host: dict[int, "weakref.ref[torch.Tensor]"] = {}  # id -> the host tensor, weakly
        self._in_python_read = 0
        self._stack: Optional[contextlib.ExitStack] = None
        self.active = False  # from the first step on

    def step(self) -> None:
        """Start counting the next training step (the first call starts the recording)."""
        self.active = True
        self.steps.append(collections.Counter())

    def host(self, *tensors: torch.Tensor) -> None:
        """Mark ``tensors`` as host tensors (a data set's, which a GPU run keeps on the CPU)."""
        for t in tensors:
            self._add_host(t)

    def count(self, step: int, kinds: tuple[str, ...] = KINDS) -> int:
        """Events of ``kinds`` in step ``step`` (1-based: the first :meth:`step`)."""
        return sum(n for (kind, _), n in self.steps[step].items() if kind in kinds)

    def kinds(self, step: int) -> dict[str, int]:
        """``kind -> count`` of step ``step``."""
        counts: collections.Counter = collections.Counter()
        for (kind, _), n in self.steps[step].items():
            counts[kind] += n
        return dict(counts)

    def sites(self, step: int) -> dict[str, int]:
        """``"kind site" -> count`` of step ``step``, for messages."""
        return {f"{kind} {site}": n for (kind, site), n in sorted(self.steps[step].items())}

    def is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _add_host(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        host = self._host

        def forget(ref: "weakref.ref[torch.Tensor]") -> None:  # a new tensor may have taken the id since
            if host.get(key) is ref:
                del host[key]

        host[key] = weakref.ref(tensor, forget)

    def _record(self, kind: str) -> None:
        self.steps[-1][(kind, _site())] += 1

    def __enter__(self) -> "HostReads":
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_Functions(self))
        self._stack.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        stack.close()


class _Functions(TorchFunctionMode):
    """Python-level calls: reads, copies, factories, and which results are host tensors."""

    def __init__(self, recorder: HostReads) -> None:
        super().__init__()
        self.r = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        r = self.r
        if not r.active:
            return func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        host = [t for t in inputs if r.is_host(t)]
        device = [t for t in inputs if not r.is_host(t)]
        result_on_host: Optional[bool] = None  # None: host iff every tensor input is
        if func in _READS:
            if inputs and not host:
                r._record("read")
            r._in_python_read += 1
            try:
                return func(*args, **kwargs)
            finally:
                r._in_python_read -= 1
        if func in _FACTORIES:
            target = kwargs.get("device")
            on_device = target is not None and not _names_cpu(target)  # device="cpu" written out: the host
            if func in _FROM_DATA and on_device:
                r._record("to_device")
            result_on_host = not on_device
        elif func is _T.cpu:
            if device:
                r._record("to_host")
                return _copied(func(*args, **kwargs), inputs, r)
            result_on_host = True
        elif func is _T.to or func is _T.cuda:
            target = _target_device(args[1:], kwargs)
            if _names_cpu(target):  # written as the string "cpu": meant for the host
                if device:
                    r._record("to_host")
                    return _copied(func(*args, **kwargs), inputs, r)
                result_on_host = True
            elif host and (func is _T.cuda or target is not None
                           or (len(args) > 1 and isinstance(args[1], torch.Tensor) and not r.is_host(args[1]))):
                r._record("to_device")  # .to(device), .cuda(), .to(a device tensor)
                return _moved(func(*args, **kwargs), inputs)
        elif func is _T.copy_ and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            dst_host, src_host = r.is_host(args[0]), r.is_host(args[1])
            if dst_host and not src_host:
                r._record("to_host")
            elif src_host and not dst_host:
                r._record("to_device")
            result_on_host = dst_host
        elif host and device and any(t.dim() > 0 for t in host):
            r._record("to_device")  # a host tensor mixed into a device op: copied (or refused) on a GPU
            result_on_host = False
        out = func(*args, **kwargs)
        on_host = result_on_host if result_on_host is not None else bool(inputs) and not device
        if on_host:
            for t in _tensors(out):
                if not any(t is i for i in inputs):  # an op that returns its input leaves it where it is
                    r._add_host(t)
        return out


def _copied(out: Any, inputs: list[torch.Tensor], r: HostReads) -> Any:
    # A device tensor's copy to the host: on a CPU run ``.cpu()`` returns the tensor itself; a
    # clone stands in for the GPU run's new host tensor, so that reading it is not counted again.
    if isinstance(out, torch.Tensor) and any(out is i for i in inputs):
        out = out.clone()
    for t in _tensors(out):
        r._add_host(t)
    return out


def _moved(out: Any, inputs: list[torch.Tensor]) -> Any:
    # A host tensor's copy to the device: on a CPU run ``.to(device)`` returns the tensor itself;
    # a clone (not a host tensor) stands in for the GPU run's new device tensor.
    if isinstance(out, torch.Tensor) and any(out is i for i in inputs):
        out = out.clone()
    return out


def _target_device(args: tuple, kwargs: dict) -> Any:
    """The device argument of ``Tensor.to`` / ``cuda`` as given (a string, a torch.device), or None."""
    target = kwargs.get("device")
    if target is None:
        target = next((a for a in args if isinstance(a, (str, torch.device, int))), None)
    return target


class _Dispatch(TorchDispatchMode):
    """aten-level events that Python calls do not show: reads from C++ and value-dependent sizes."""

    def __init__(self, recorder: HostReads) -> None:
        super().__init__()
        self.r = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        r = self.r
        if not r.active:
            return func(*args, **kwargs)
        name = str(func)
        inputs = _tensors((args, kwargs))
        on_device = [t for t in inputs if not r.is_host(t)]
        if name == "aten._local_scalar_dense.default" and not r._in_python_read and on_device:
            r._record("read")
        elif on_device and (name in _SHAPE_SYNCS or _bool_index(name, args, kwargs)
                            or (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None)):
            r._record("shape_sync")
        return func(*args, **kwargs)


def _bool_index(name: str, args: tuple, kwargs: dict) -> bool:
    # x[mask] and x[mask] = v: the mask's true entries become indices (nonzero) on the GPU.
    if name not in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default",
                    "aten._index_put_impl_.default"):
        return False
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())

