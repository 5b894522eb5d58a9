"""Every byte a traced training step holds on its device: when each storage lives, and what it is.

:class:`MemoryTrace` is a dispatch mode: it sees every aten op of a step (forward, backward,
optimizer step), records each new storage on the traced device (its bytes, the op that made it,
shape, dtype, the phase) and, through a weak reference, the moment it is freed. Tensors do not
have to hold data: on ``meta`` tensors a step of an 8B model traces in seconds, with the shapes,
dtypes and lifetimes of a real one.

What each storage is, from the strongest evidence:

1. registered by the caller: parameters (trainable or frozen), buffers, FP8 scaling state, the batch;
2. a parameter's gradient (``register_post_accumulate_grad_hook``), an optimizer state (found in
   ``optimizer.state`` after a step);
3. a copy of a weight: an FP8 tensor, or a dtype cast (``_to_copy``, autocast's BF16 copies), made
   from a parameter or buffer. An FP8 copy saved for backward, or made in it, is the columnwise
   copy dgrad reads; the others are rowwise (fprop's; the forward reads them only);
4. saved for backward (``torch.autograd.graph.saved_tensors_hooks``), by kind: the op that made it
   and its dtype;
5. else a transient.

The peak is the largest sum of live storages between two allocations or frees; the breakdown is
taken at that moment. Not seen: memory a kernel allocates inside itself (cuBLAS's and attention's
workspaces), the CUDA caching allocator's rounding (to 512 bytes) and fragmentation.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from .._private.torch_api import TorchDispatchMode, in_backward_pass, tree_flatten

__all__ = ["MemoryTrace", "Peak", "Allocation", "CATEGORIES"]

# The breakdown's categories, in the order reports list them.
CATEGORIES = (
    "parameters", "frozen weights", "buffers", "FP8 scaling state", "gradients", "optimizer states",
    "FP8 weight copies, rowwise", "FP8 weight copies, columnwise", "BF16 weight copies",
    "FP16 weight copies", "weight copies", "batch", "activations saved for backward", "transients",
)
_REGISTERED = ("parameters", "frozen weights", "buffers", "FP8 scaling state", "batch", "optimizer states")
_FP8_DTYPES = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                    "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))
_WEIGHT_COPY = {torch.bfloat16: "BF16 weight copies", torch.float16: "FP16 weight copies"}


@dataclass
class Allocation:
    """One storage: ``nbytes`` (bytes), made by ``op`` (an aten op name, or the category of a
    registered tensor) with ``shape`` and ``dtype`` in ``phase``; live from event ``start`` to
    ``end`` (None: still live)."""

    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    phase: str
    start: int
    end: Optional[int] = None
    category: Optional[str] = None  # set by a registration or a mark; None: decided at the breakdown
    saved: bool = False
    weight_copy: bool = False  # an FP8 tensor or a dtype cast made from a parameter or buffer
    in_backward: bool = False  # made while the autograd engine ran a backward

    def kind(self) -> str:
        """What a saved activation is: the op that made it and its dtype (``"mm bfloat16"``)."""
        return f"{self.op} {str(self.dtype).replace('torch.', '')}"


@dataclass
class Peak:
    """The peak of a traced window: ``bytes``, the ``phase`` it was reached in, the bytes of each
    category live then (``categories``, every one of :data:`CATEGORIES`), the saved activations by
    kind (``saved_by_kind``), and the largest transient allocated in the window."""

    bytes: int
    phase: str
    categories: dict[str, int]
    saved_by_kind: dict[str, int]
    largest_transient: Optional[Allocation] = None
    allocations: list[Allocation] = field(default_factory=list, repr=False)  # live at the peak


class MemoryTrace(TorchDispatchMode):
    """Record the storages a step allocates on ``device_type`` (``"meta"`` or ``"cuda"``).

    Use as a context manager around the step, after :meth:`register`-ing what exists before it;
    :meth:`phase` names the part of the step, :meth:`saving` marks what autograd saves,
    :meth:`watch_gradients` and :meth:`mark_optimizer_states` what becomes gradients and states;
    :meth:`peak` gives the breakdown of the window since :meth:`reset_peak`.

    Raises:
        ValueError: ``device_type`` is not ``"meta"`` or ``"cuda"``.
    """

    def __init__(self, device_type: str) -> None:
        if device_type not in ("meta", "cuda"):
            raise ValueError(f"MemoryTrace(device_type={device_type!r}) is not traceable; valid: 'meta', 'cuda'")
        super().__init__()
        self.device_type = device_type
        self._by_storage: dict[int, tuple[weakref.ref, Allocation]] = {}
        self._weight_storages: set[int] = set()  # ids of parameters' and buffers' storages
        self.allocations: list[Allocation] = []
        self._event = 0
        self._live = 0
        self._phase = "set-up"
        self._window_start = 0
        self._peak = (0, 0, self._phase)  # bytes, event, phase

    # -- what exists before the step, and what things become -------------------------------------

    def register(self, tensor: torch.Tensor, category: str) -> None:
        """Count ``tensor``'s storage as ``category`` (one of the registered ones: parameters,
        frozen weights, buffers, FP8 scaling state, batch, optimizer states) from now on."""
        record = self._record(tensor, category)
        if record is not None:
            record.category = category
            if category in ("parameters", "frozen weights", "buffers"):
                self._weight_storages.add(_storage_id(tensor))

    def mark(self, tensor: torch.Tensor, category: str) -> None:
        """Reclassify ``tensor``'s storage (already traced, or registered now) as ``category``."""
        record = self._record(tensor, category)
        if record is not None and record.category not in _REGISTERED:
            record.category = category

    def watch_gradients(self, parameters: list[torch.nn.Parameter]) -> list[Any]:
        """Mark each parameter's ``.grad`` as a gradient when backward writes it; returns the hook
        handles (remove them after the trace)."""
        return [p.register_post_accumulate_grad_hook(lambda p: self.mark(p.grad, "gradients"))
                for p in parameters if p.requires_grad]

    def mark_optimizer_states(self, optimizer: torch.optim.Optimizer) -> None:
        """Mark every tensor in ``optimizer.state`` as an optimizer state (call after a step)."""
        for state in optimizer.state.values():
            for value in state.values():
                for tensor in _tensors(value):
                    self.mark(tensor, "optimizer states")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Name the part of the step that runs inside (``"forward"``, ``"backward"``, ...)."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Mark what autograd saves for backward inside (the forward)."""
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            record = self._lookup(tensor)
            if record is not None:
                record.saved = True
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def reset_peak(self) -> None:
        """Start a new window: its peak starts from the bytes live now."""
        self._window_start = self._event
        self._peak = (self._live, self._event, self._phase)

    @property
    def live_bytes(self) -> int:
        """Bytes of the traced storages live now."""
        return self._live

    # -- the trace --------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        fresh = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device.type == self.device_type
                 and self._lookup(t) is None]
        if fresh:
            from_weight = any(_storage_id(t) in self._weight_storages for t in tree_flatten((args, kwargs))[0]
                              if isinstance(t, torch.Tensor) and t.device.type == self.device_type)
            name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
            for tensor in fresh:
                record = self._record(tensor, name)
                if record is not None and from_weight:
                    record.weight_copy = tensor.dtype in _FP8_DTYPES or name == "_to_copy"
        return out

    def _lookup(self, tensor: torch.Tensor) -> Optional[Allocation]:
        entry = self._by_storage.get(_storage_id(tensor))
        return entry[1] if entry is not None and entry[0]() is not None else None

    def _record(self, tensor: torch.Tensor, op: str) -> Optional[Allocation]:
        if tensor is None or tensor.device.type != self.device_type:
            return None
        known = self._lookup(tensor)
        if known is not None:
            return known
        storage = tensor.untyped_storage()
        self._event += 1
        record = Allocation(storage.nbytes(), op, tuple(tensor.shape), tensor.dtype, self._phase, self._event,
                            in_backward=in_backward_pass())
        key = id(storage)

        def freed(_ref: Any, record: Allocation = record, key: int = key) -> None:
            self._event += 1
            self._live -= record.nbytes
            record.end = self._event
            if self._by_storage.get(key, (None, None))[1] is record:
                del self._by_storage[key]

        self._by_storage[key] = (weakref.ref(storage, freed), record)
        self.allocations.append(record)
        self._live += record.nbytes
        if self._live > self._peak[0]:
            self._peak = (self._live, self._event, self._phase)
        return record

    # -- the breakdown ----------------------------------------------------------------------------

    def peak(self) -> Peak:
        """The breakdown at the peak of the window since :meth:`reset_peak`."""
        total, event, phase = self._peak
        return self._breakdown(total, event, phase)

    def snapshot(self) -> Peak:
        """The breakdown of what is live now (its largest transient: the window's so far)."""
        return self._breakdown(self._live, self._event, self._phase)

    def _breakdown(self, total: int, event: int, phase: str) -> Peak:
        categories = {name: 0 for name in CATEGORIES}
        saved: dict[str, int] = {}
        live = [r for r in self.allocations if r.start <= event and (r.end is None or r.end > event)]
        for record in live:
            category = category_of(record)
            categories[category] += record.nbytes
            if category == "activations saved for backward":
                saved[record.kind()] = saved.get(record.kind(), 0) + record.nbytes
        transients = [r for r in self.allocations if self._window_start < r.start <= event
                      and category_of(r) == "transients"]
        largest = max(transients, key=lambda r: r.nbytes, default=None)
        saved = dict(sorted(saved.items(), key=lambda item: -item[1]))
        return Peak(total, phase, categories, saved, largest, live)


def category_of(record: Allocation) -> str:
    """The category of one traced storage, by the precedence of the module docstring."""
    if record.category is not None:
        return record.category
    if record.weight_copy and record.dtype in _FP8_DTYPES:
        columnwise = record.saved or record.in_backward
        return "FP8 weight copies, columnwise" if columnwise else "FP8 weight copies, rowwise"
    if record.weight_copy:
        return _WEIGHT_COPY.get(record.dtype, "weight copies")
    return "activations saved for backward" if record.saved else "transients"


def _storage_id(tensor: torch.Tensor) -> int:
    return id(tensor.untyped_storage())


def _tensors(value: Any) -> list[torch.Tensor]:
    # The tensors in an optimizer state's value (a tensor, or an object holding some, such as FP8AdamW's blocks).
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if hasattr(value, "__dict__"):
        return [t for v in vars(value).values() for t in _tensors(v)]
    return []
