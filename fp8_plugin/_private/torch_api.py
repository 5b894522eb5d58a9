"""The private torch APIs this package relies on, kept here so that a change shows in one place.

``tests/private/test_torch_private.py`` fails loudly if its behaviour changes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

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

__all__ = ["TorchDispatchMode", "in_backward_pass", "has_tensor_hooks", "in_dispatch_mode", "tree_flatten", "tree_unflatten",
           "tree_map", "registered_parameter", "registered_submodule", "eager_apply"]


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


def registered_parameter(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    """``getattr(module, name)`` for the Parameter (or None) registered under ``name``, read from
    ``nn.Module``'s own registry, ``module._parameters``.

    A Parameter is not an instance attribute: reading ``module.weight`` first fails the normal
    lookup, which on Python 3.11 raises and formats an ``AttributeError``, then runs
    ``nn.Module.__getattr__``, about 0.6 µs of CPU against 0.1 µs here; an FP8 layer reads two a
    step. Where nothing is registered under ``name`` (a parametrization makes it a property) it
    is ``getattr(module, name)``.
    """
    parameters = module._parameters
    return parameters[name] if name in parameters else getattr(module, name)


def registered_submodule(module: torch.nn.Module, name: str) -> Any:
    """``getattr(module, name)`` for the submodule registered under ``name``, read from
    ``module._modules`` (as :func:`registered_parameter`, and for the same reason)."""
    modules = module._modules
    return modules[name] if name in modules else getattr(module, name)


def eager_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` for eager calls, without ``torch.autograd.Function.apply``'s Python wrapper.

    The wrapper checks for ``setup_context``, asks whether functorch transforms are active and
    rebuilds the arguments to unwrap dead functorch wrappers: about 2 to 3 µs of CPU per call,
    once per FP8 layer and step. The callable returned calls torch's C++ ``apply``
    (``torch._C._FunctionBase.apply``, which the wrapper ends in) directly, after the same
    unwrapping of its first argument only: callers pass as other arguments no tensor that can be
    a dead functorch wrapper (a module's Parameters, tensors made in the call, tuples, which the
    wrapper leaves alone too). While functorch transforms are active it takes the public path.
    Not for compiled code: ``torch.compile`` traces ``function.apply`` itself.

    Raises:
        TypeError: ``function`` defines ``setup_context`` (its arguments would need binding).
    """
    if function.setup_context is not torch.autograd.Function.setup_context:
        raise TypeError(f"eager_apply({function.__name__}): a Function with setup_context takes the public apply")
    bare = super(torch.autograd.Function, function).apply  # torch._C._FunctionBase.apply, bound to it
    public = function.apply
    transforms_active = torch._C._are_functorch_transforms_active
    unwrap_if_dead = torch._C._functorch.unwrap_if_dead

    def apply(first: torch.Tensor, *args: Any) -> Any:
        if transforms_active():
            return public(first, *args)
        return bare(unwrap_if_dead(first), *args)

    return apply
