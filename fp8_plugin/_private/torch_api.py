"""The private torch APIs this package relies on, kept here so that a change shows in one place.

``tests/private/test_torch_private.py`` fails loudly if its behaviour changes.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode as _is_in_torch_dispatch_mode
# The base class of a dispatch mode (an object that sees every aten op below autograd): torch's
# documented extension point ("Extending PyTorch", __torch_dispatch__), in a private module. The
# memory tool's trace (tools/memory_trace.py) is one.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
# torch's pytree (flatten nested tuples, lists and dicts to leaves and back) has no public module;
# the CUDA graphs' call signatures use it as torch's own make_graphed_callables does. ``None`` is
# a leaf, dict keys keep their order, and two specs of one structure compare equal.
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten  # noqa: F401

__all__ = ["TorchDispatchMode", "in_backward_pass", "has_tensor_hooks", "in_dispatch_mode", "tree_flatten", "tree_unflatten", "tree_map"]


def in_backward_pass() -> bool:
    """True while the autograd engine runs a backward pass on this thread.

    A forward that runs then is an activation-checkpoint recomputation (``torch.utils.checkpoint``,
    reentrant or not, recomputes inside the backward). torch has no public way to ask; the
    engine's graph-task id is -1 outside a backward and the id of the running task inside it.
    Under ``torch.compile`` it is False: a compiled region's recomputation runs inside the
    compiled graph (the compiler traces ``torch.utils.checkpoint`` itself), never through this
    forward, and the engine's id cannot be read while tracing.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def has_tensor_hooks(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` has hooks added by ``Tensor.register_hook`` (not yet removed).

    They run before any hook added later and may change the gradient it sees: the reference
    check reads a weight's gradient from such a hook only when no other is there. torch has
    no public way to ask; ``Tensor.register_hook`` keeps them in the ``_backward_hooks`` dict.
    """
    return bool(getattr(tensor, "_backward_hooks", None))


def in_dispatch_mode() -> bool:
    """True while a ``TorchDispatchMode`` is active on this thread (``FakeTensorMode``, a
    recorder of aten ops, ``torch.compile``'s tracing modes).

    The fused casts then go through the dispatcher as custom ops, so that the mode sees them;
    plain eager calls skip it (it costs CPU time per call). torch's public API has no such
    query; ``torch.utils._python_dispatch.is_in_torch_dispatch_mode`` answers it.
    """
    return _is_in_torch_dispatch_mode()
