"""``fp8_plugin.make_graphed_callables``: FP8 modules run as CUDA graphs, the host's work per step near zero.

An eager FP8 layer step costs the host more than a BF16 one (launches, Python); on the models
people fine-tune the GPU then waits for the host. A CUDA graph replays the whole forward (and the
whole backward) of a module with one launch each, as Transformer Engine's and torch's
``make_graphed_callables`` do; this one is torch's
(:func:`torch.cuda.make_graphed_callables`: warm-up on a side stream, capture, replay through
static input and output buffers) with the FP8 work around it:

- **warm-up and capture** run inside :func:`fp8_plugin.autocast` (``fp8_recipe``) as one training
  step, and leave no trace: every FP8 layer's scaling state (amax histories, scales, counters,
  pending updates) is as it was before, the cached weight casts are dropped, and the capture
  holds every cast (weights included: the optimizer changes them in place between replays) and
  each delayed cast's amax pass (masked off on the device once a scale is held);
- **each replay** is a training forward: the first of a training step (a new step id of the
  enclosing :func:`fp8_plugin.autocast`) first turns the previous step's amaxes into scales, as an
  eager forward does, outside the graph (one update and one amax reduction per step for the
  whole model); after the replay, the amaxes it recorded on the device are marked pending on the
  host, as the eager forward marks them. Scales and amaxes stay on the device: a replay reads
  the scales the update wrote in place.

So a graphed module trains as its eager self does, bit for bit: same kernels, same scales, same
order. Gradient accumulation works: torch's replay returns the gradients in the graph's static
buffers, and autograd keeps a gradient it is handed as a parameter's ``.grad`` where that is
still None, so the next micro-batch's replay would overwrite the gradient accumulated so far
(pytorch/pytorch#181723); ``clone_param_grads_on_return`` (Transformer Engine's name, default
True) hands autograd a copy there instead, and a leaf input's gradient likewise. Activation
checkpointing inside the module is captured with its recompute.

Differences from Transformer Engine's function of the same name: FP8 modules only (a callable
that is not an ``nn.Module`` has no FP8 state to keep), and ``fp8_enabled`` defaults to True; no
``fp8_weight_caching`` (every replay casts its weights); the amax reduction is the enclosing
autocast's ``reduce_amax`` (no ``fp8_group``); MoE experts are refused (their routing sizes are
data-dependent). Arguments that are not tensors (``None``, flags) are constants of the graph.

``torch.compile(mode="reduce-overhead")`` is the other way to CUDA graphs; see docs/performance.md.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from .._private.torch_api import tree_flatten, tree_unflatten
from ..numerics.kernels.launch import graph_capture
from ..numerics.quantizers import ScalingState, mark_recorded
from ..numerics.recipes import Recipe, check_recipe
from .autocast import autocast, current_context, in_replay, new_step_id, note_fp8_forward
from .scaling_group import ScalingGroup
from .weight_cache import clear_weight_caches

__all__ = ["make_graphed_callables", "StaticSignature", "check_graphable"]


@dataclass(frozen=True)
class StaticSignature:
    """The call a graph was captured for: the structure of its positional and keyword arguments
    (a pytree spec), each tensor's ``(shape, dtype, device, requires_grad)`` and every other
    argument's value (``None``, flags: constants of the graph). A replay copies its tensors into
    the captured buffers, which a tensor of another shape would silently broadcast into (or a
    tensor of another dtype be converted into), and cannot see another constant: :meth:`check`
    refuses both first."""

    spec: Any
    tensors: tuple[tuple[int, tuple[tuple[int, ...], torch.dtype, torch.device, bool]], ...]
    constants: tuple[tuple[int, Any], ...]
    names: tuple[str, ...]

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: Optional[dict[str, Any]], name: str) -> "StaticSignature":
        """The signature of a sample call.

        Raises:
            TypeError: no tensor among the arguments.
        """
        leaves, spec = tree_flatten((tuple(args), dict(kwargs or {})))
        tensors = tuple((i, _facts(leaf)) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        if not tensors:
            raise TypeError(f"make_graphed_callables: the sample arguments of {name} hold no tensor")
        constants = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor))
        return cls(spec, tensors, constants, _leaf_names(args, kwargs or {}))

    def flat_tensors(self, args: Sequence[Any], kwargs: dict[str, Any], name: str) -> list[torch.Tensor]:
        """The tensors of a call, in the graph's order, after :meth:`check`."""
        leaves = self.check(args, kwargs, name)
        return [leaves[i] for i, _ in self.tensors]

    def check(self, args: Sequence[Any], kwargs: dict[str, Any], name: str) -> list[Any]:
        """The call's leaves, unless it differs from the captured one.

        Raises:
            ValueError: naming the first argument that differs, what was captured and what came.
        """
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.spec:
            raise ValueError(f"{name} was graphed for a call of structure {self.spec}, called with {spec}; a CUDA "
                             "graph replays one call structure: pass the same arguments every step")
        for i, facts in self.tensors:
            got = leaves[i]
            if not isinstance(got, torch.Tensor) or _facts(got) != facts:
                shown = _describe(*_facts(got)) if isinstance(got, torch.Tensor) else type(got).__name__
                raise ValueError(
                    f"{name}: argument {self.names[i]} is {shown}, but the graph was captured for {_describe(*facts)}; "
                    "a CUDA graph replays static shapes: pad the batch to the captured shape (a fixed batch size and "
                    "sequence length, drop_last=True), capture one graph per shape, or run this module eagerly")
        for i, value in self.constants:
            if not _same_constant(leaves[i], value):
                got = _describe(*_facts(leaves[i])) if isinstance(leaves[i], torch.Tensor) else repr(leaves[i])
                raise ValueError(f"{name}: argument {self.names[i]} is {got}, but the graph was captured with "
                                 f"{value!r}, which it holds as a constant; pass the same value every step (a model's "
                                 "cache: model.config.use_cache = False for training)")
        return leaves


def _facts(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, torch.device, bool]:
    return tuple(t.shape), t.dtype, t.device, t.requires_grad


def _same_constant(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or not isinstance(a, (bool, int, float, str, torch.dtype, torch.device)):
        return False  # an object (a cache) is the same only as itself
    return a == b


def _leaf_names(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, ...]:
    # A name per flattened leaf, for messages: "#0", "position_embeddings[1]".
    names: list[str] = []
    for label, value in [(f"#{i}", a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items()]:
        count = len(tree_flatten(value)[0])
        names += [label] if count == 1 else [f"{label}[{j}]" for j in range(count)]
    return tuple(names)


def _describe(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, grad: bool) -> str:
    return f"{list(shape)} {dtype} on {device}{' requiring grad' if grad else ''}"


def check_graphable(module: nn.Module, name: str = "module") -> list[ScalingState]:
    """The FP8 scaling states of ``module``, after checking that a CUDA graph can hold it.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: it or a submodule has forward or backward hooks (a graph replays none: the
            hook would silently stop running), it holds FP8 MoE experts (data-dependent routing
            sizes), or it has no FP8 layer (convert it first; a BF16 module needs
            ``torch.cuda.make_graphed_callables``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"make_graphed_callables: {name} is a {type(module).__name__}; valid: an nn.Module holding "
                        "FP8 layers (fp8_plugin.convert_model), for a plain callable torch.cuda.make_graphed_callables")
    hooked = [sub or "(the module itself)" for sub, m in module.named_modules()
              if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks]
    if hooked:
        raise ValueError(f"make_graphed_callables: {name} has module hooks on {', '.join(hooked[:5])}; a CUDA graph "
                         "replays kernels, not Python, so the hooks would stop running. Remove them before graphing "
                         "(hooks added afterwards run around the replay)")
    experts = [sub for sub, m in module.named_modules() if hasattr(m, "fp8_experts")]
    if experts:
        raise ValueError(f"make_graphed_callables: {name} holds FP8 MoE experts ({experts[0]}); their token counts "
                         "per expert change every step, which a CUDA graph cannot hold: graph the attention "
                         "blocks only, or run the model eagerly")
    states = [m for m in module.modules() if isinstance(m, ScalingState)]
    if not states:
        raise ValueError(f"make_graphed_callables: {name} has no FP8 layer; convert it first "
                         "(fp8_plugin.convert_model), or graph it with torch.cuda.make_graphed_callables")
    return states


class _FlatCall(nn.Module):
    """``module``'s own forward called with the captured call's tensors as positional arguments
    (what a capture takes) and its other arguments as the captured constants."""

    def __init__(self, module: nn.Module, forward: Any, signature: StaticSignature, leaves: list[Any]) -> None:
        super().__init__()
        self.inner = module  # a submodule: its parameters are the graph's static inputs too
        self._forward, self._signature, self._leaves = forward, signature, leaves

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self._leaves)
        for (i, _), t in zip(self._signature.tensors, tensors):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, self._signature.spec)
        return self._forward(*args, **kwargs)


class _GraphedFP8:
    """The FP8 bookkeeping around one graphed module's replays (module docstring)."""

    def __init__(self, module: nn.Module, name: str, signature: StaticSignature,
                 marks: list[tuple[ScalingState, int, Recipe]], eager_forward: Any, graphed: nn.Module,
                 fp8: bool = True, own_grads: bool = True) -> None:
        self.module, self.name, self.signature, self.fp8, self.own_grads = module, name, signature, fp8, own_grads
        self.marks, self.eager_forward, self.graphed = marks, eager_forward, graphed
        self.groups = list({id(layer.scaling_group): layer.scaling_group for layer in module.modules()
                            if isinstance(getattr(layer, "scaling_group", None), ScalingGroup)}.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not self.module.training or in_replay():
            # Evaluation and a reference check's replays record nothing and update nothing: the
            # eager forward (the graph records amaxes).
            return self.eager_forward(*args, **kwargs)
        tensors = self.signature.flat_tensors(args, kwargs, self.name)
        if self.own_grads:
            for t in tensors:
                if t.is_leaf and t.requires_grad:  # its .grad would be the graph's buffer
                    t.register_hook(torch.clone)
        if not self.fp8:  # captured in high precision (fp8_enabled=False): no FP8 state to keep
            return self.graphed(*tensors)
        context = current_context()
        if not context.enabled or not context.training:
            raise RuntimeError(f"{self.name} was graphed as an FP8 training step: call it inside "
                               "fp8_plugin.autocast() with grad enabled (the integrations' forward contexts are)")
        for group in self.groups:
            if group.step != context.step:  # the first forward of a training step: last step's amaxes become scales
                group.step = context.step
                group.update(context.reduce_amax, context.recipe)
        out = self.graphed(*tensors)
        for state, role, recipe in self.marks:  # what the eager forward marks on the host
            mark_recorded(state, recipe, role)
        note_fp8_forward()
        return out


def make_graphed_callables(
    modules: Union[nn.Module, tuple[nn.Module, ...]],
    sample_args: Union[tuple[Any, ...], tuple[tuple[Any, ...], ...]],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: Optional[Union[dict[str, Any], tuple[dict[str, Any], ...]]] = None,
    *,
    fp8_enabled: bool = True,
    fp8_recipe: Optional[Recipe] = None,
    pool: Optional[Any] = None,
    clone_param_grads_on_return: bool = True,
) -> Union[nn.Module, tuple[nn.Module, ...]]:
    """FP8 modules whose training forward and backward replay CUDA graphs (Transformer Engine's
    name and arguments; module docstring for what differs).

    Args:
        modules: one converted ``nn.Module`` (holding FP8 layers) or a tuple of them, on one CUDA
            device, in training mode; each is changed in place (its ``forward`` replays the
            graph while it is in training mode and grad is enabled, else runs eagerly) and
            returned. A tuple's modules are replayed in the order given, their backwards in the
            reverse order, as a model's layers are (torch's rule).
        sample_args: the positional arguments of one training forward (a tuple; a tuple of such
            tuples for a tuple of modules). Tensors (also inside tuples and lists) are the graph's
            inputs: their shapes, dtypes and ``requires_grad`` are the only ones it takes; any
            other value (``None``, a flag) is a constant of the graph.
        num_warmup_iters: forward-backward runs before the capture (torch's default 3).
        allow_unused_input: as :func:`torch.cuda.make_graphed_callables`.
        sample_kwargs: the keyword arguments of that forward (a dict, or a tuple of dicts), as
            ``sample_args``: a transformers decoder layer's ``attention_mask``,
            ``position_embeddings``, ``position_ids``.
        fp8_enabled: False graphs the modules' high-precision forward (``fp8_plugin.autocast(
            enabled=False)``). Default True, unlike Transformer Engine's: these are FP8 modules.
        fp8_recipe: the recipe of the capture (None: the layers' own), as ``fp8_plugin.autocast(recipe=...)``.
        pool: a CUDA graph memory pool to share (``torch.cuda.graph_pool_handle()``).
        clone_param_grads_on_return: give autograd a copy of a replay's parameter gradient where
            the parameter's ``.grad`` is None (the first micro-batch of a step), not the graph's
            static buffer, which the next replay overwrites (Transformer Engine 2.19's argument).
            One copy per parameter and step. False only where every gradient is consumed before
            the next replay (no gradient accumulation, or one into buffers of the loop's own).

    Returns:
        The module, or the tuple of modules, graphed.

    Raises:
        RuntimeError: no CUDA GPU, or a sample tensor not on one; called inside a CUDA graph
            capture.
        TypeError, ValueError: a module that cannot be graphed (:func:`check_graphable`), sample
            arguments without a tensor, or counts of them that differ from the modules'.

    The graphed forward raises ``ValueError`` for a call of another structure, tensors of another
    shape, dtype, device or ``requires_grad``, or other constants than the sample's
    (:class:`StaticSignature`), and ``RuntimeError`` when called for training outside
    :func:`fp8_plugin.autocast`. Call it under torch autocast with ``cache_enabled=False``
    where the training forward runs under torch autocast (torch's rule for captures).
    """
    single = not isinstance(modules, tuple)
    mods = (modules,) if single else modules
    all_args = (sample_args,) if single else sample_args
    all_kwargs = (sample_kwargs,) if single else (sample_kwargs or tuple({} for _ in mods))
    check_recipe(fp8_recipe, "make_graphed_callables")
    if not isinstance(all_args, tuple) or len(all_args) != len(mods) or len(all_kwargs) != len(mods):
        raise ValueError(f"make_graphed_callables: {len(mods)} module(s) need as many tuples of sample_args "
                         "(and dicts of sample_kwargs)")
    names = [f"{type(m).__name__}#{i}" if not single else type(m).__name__ for i, m in enumerate(mods)]
    states_of = [check_graphable(m, n) for m, n in zip(mods, names)]
    signatures = [StaticSignature.of(a, k, n) for a, k, n in zip(all_args, all_kwargs, names)]
    devices = ({t.device for args, kwargs in zip(all_args, all_kwargs) for t in tree_flatten((args, kwargs or {}))[0]
                if isinstance(t, torch.Tensor)} | {p.device for m in mods for p in m.parameters()})
    _check_cuda(devices)
    eager = [m.forward for m in mods]
    # The captured call's constants; its tensors come from each replay (not kept: memory).
    flat = [_FlatCall(m, forward, sig, [None if isinstance(leaf, torch.Tensor) else leaf
                                        for leaf in tree_flatten((tuple(a), dict(k or {})))[0]])
            for m, forward, sig, a, k in zip(mods, eager, signatures, all_args, all_kwargs)]
    flat_args = tuple(tuple(sig.flat_tensors(a, dict(k or {}), n)) for sig, a, k, n in
                      zip(signatures, all_args, all_kwargs, names))
    all_states = [s for states in states_of for s in states]
    saved = _snapshot(all_states)
    with contextlib.ExitStack() as stack:
        stack.enter_context(graph_capture())
        # One step id for warm-up and capture: the capture itself holds no scale update.
        stack.enter_context(autocast(enabled=fp8_enabled, recipe=fp8_recipe, step=new_step_id()))
        _clear_weight_caches(mods)
        for state in all_states:
            state.pending = {}
        _capture(tuple(flat), flat_args, num_warmup_iters=num_warmup_iters, allow_unused_input=allow_unused_input,
                 pool=pool)
        marks = [[(s, role, recipe) for s in states for role, recipe in sorted(s.pending.items()) if recipe]
                 for states in states_of]
    _restore(all_states, saved)
    _clear_weight_caches(mods)
    if clone_param_grads_on_return:
        for module in mods:
            for param in module.parameters():
                if param.requires_grad:
                    param.register_hook(_OwnFirstGrad(param))
    for module, name, signature, mark, forward, graphed in zip(mods, names, signatures, marks, eager, flat):
        module.forward = _GraphedFP8(module, name, signature, mark, forward, graphed, fp8_enabled,
                                     clone_param_grads_on_return)
    return mods[0] if single else mods


def _check_cuda(devices: set[torch.device]) -> None:
    # At start-up, before any warm-up: CUDA graphs need a GPU and no capture already under way.
    if not torch.cuda.is_available() or any(d.type != "cuda" for d in devices):
        raise RuntimeError(f"make_graphed_callables: CUDA graphs run on a CUDA GPU; the modules and sample_args are "
                           f"on {', '.join(sorted(map(str, devices)))}")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("make_graphed_callables: called inside a CUDA graph capture")


# Warm-up and capture: torch's (each module's forward replaced by one that replays its graphs
# while the module is in the training mode it was captured in).
_capture = torch.cuda.make_graphed_callables


def _snapshot(states: list[ScalingState]) -> list[tuple[dict[str, torch.Tensor], dict]]:
    # Each state's tensors (copies) and pending updates, to undo what warm-up recorded.
    return [({name: t.detach().clone() for name, t in s.tensors().items()}, dict(s.pending)) for s in states]


def _restore(states: list[ScalingState], saved: list[tuple[dict[str, torch.Tensor], dict]]) -> None:
    # In place: the graph holds these tensors' addresses.
    with torch.no_grad():
        for state, (tensors, pending) in zip(states, saved):
            for name, t in state.tensors().items():
                t.copy_(tensors[name])
            state.kernel_workspace.zero_()
            state.pending = pending


class _OwnFirstGrad:
    """A parameter's gradient hook: a copy of the gradient where autograd would keep it as the
    parameter's ``.grad`` (None so far), so that a replay's static buffer never becomes one; later
    micro-batches are added into that copy in place. Holds the parameter weakly."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = weakref.ref(param)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        param = self.param()
        return grad.clone() if param is not None and param.grad is None else grad


def _clear_weight_caches(modules: Sequence[nn.Module]) -> None:
    for module in modules:
        clear_weight_caches(module)
