"""CUDA graphs for a training loop's model: the blocks a pattern names, captured after the first step.

The loops' ``cuda_graphs`` setting (``FP8Precision(cuda_graphs="model.layers.*")``,
``FP8Kwargs(cuda_graphs=...)``) names the modules to graph, by glob patterns over module names
(a transformers model's decoder layers, as Transformer Engine and Megatron graph theirs). The first
training step runs eagerly and records, for each named module, the arguments of its first call
(positional and keyword: hidden states, the attention mask, the rotary tables, flags); after that
step's optimizer step the modules are captured with those arguments as samples
(:func:`fp8_plugin.make_graphed_callables`), and every later training step replays them. The
batches must then keep the first one's shapes (a fixed batch size and padded length,
``drop_last=True``): a call of another shape raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from .._private.torch_api import tree_map
from ..modules.cuda_graphs import make_graphed_callables

__all__ = ["GraphedBlocks", "check_cuda_graphs"]

Patterns = Union[str, Sequence[str], None]


def check_cuda_graphs(value: Patterns, owner: str, name: str = "cuda_graphs") -> Optional[tuple[str, ...]]:
    """The ``cuda_graphs`` setting (``owner``'s argument ``name``) as a tuple of patterns (None: off).

    Raises:
        TypeError: not None, a string or a sequence of strings.
        ValueError: an empty pattern.
    """
    if value is None:
        return None
    patterns = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if patterns is None or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{owner}({name}={value!r}) is not valid; valid: None, or module-name glob patterns "
                        "such as 'model.layers.*' (a string or a list of them)")
    if not patterns or not all(patterns):
        raise ValueError(f"{owner}({name}={value!r}) holds an empty pattern; valid: glob patterns over module "
                         "names, such as 'model.layers.*'")
    return patterns


class GraphedBlocks:
    """The modules of one model that ``patterns`` name, recorded in the first training step and
    captured as CUDA graphs after it (module docstring).

    Args:
        patterns: glob patterns over module names (``model.named_modules()``).
        owner: the setting's owner, for messages (``"FP8Precision"``).

    Attributes:
        modules: the named modules, outermost only (a match inside another match is part of it).
        captured: True once the graphs are captured.
    """

    def __init__(self, patterns: tuple[str, ...], owner: str) -> None:
        self.patterns, self.owner = patterns, owner
        self.modules: list[tuple[str, nn.Module]] = []
        self.samples: dict[int, tuple[tuple, dict]] = {}
        self.captured = False
        self._hooks: list[Any] = []

    def select(self, model: nn.Module) -> None:
        """Find the modules the patterns name in ``model``.

        Raises:
            ValueError: no module matches, naming some of the model's module names.
        """
        chosen: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            if name and any(fnmatch.fnmatchcase(name, p) for p in self.patterns) and not any(
                    name.startswith(outer + ".") for outer, _ in chosen):
                chosen.append((name, module))
        if not chosen:
            names = [n for n, _ in model.named_modules() if n][:12]
            raise ValueError(f"{self.owner}(cuda_graphs={list(self.patterns)}) matches no module of the model; its "
                             f"modules are named like {', '.join(names)}")
        self.modules = chosen

    def record(self, device: torch.device) -> None:
        """Record the next call's arguments of every selected module (the first training step's).

        Raises:
            RuntimeError: ``device`` is not a CUDA GPU.
        """
        _require_cuda(device, self.owner)
        if self._hooks or self.captured:
            return
        for _, module in self.modules:
            self._hooks.append(module.register_forward_pre_hook(self._keep, with_kwargs=True))

    def _keep(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if id(module) in self.samples:
            return
        sample = lambda v: v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v  # noqa: E731
        self.samples[id(module)] = (tuple(tree_map(sample, list(args))), tree_map(sample, dict(kwargs)))

    def capture(self, context: Any) -> None:
        """Capture every selected module with its recorded arguments, once (after the first
        optimizer step), inside ``context`` (a context manager: the training forward's torch
        autocast, without its cache, and FP8 autocast).

        Raises:
            RuntimeError: a selected module did not run in the recorded step.
        """
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.captured or not self.samples:
            return
        missing = [name for name, module in self.modules if id(module) not in self.samples]
        if missing:
            raise RuntimeError(f"{self.owner}(cuda_graphs=...): {', '.join(missing[:5])} did not run in the first "
                               "training step, so there is no call to capture it with")
        modules = tuple(m for _, m in self.modules)
        args = tuple(self.samples[id(m)][0] for m in modules)
        kwargs = tuple(self.samples[id(m)][1] for m in modules)
        with context:
            make_graphed_callables(modules, args, sample_kwargs=kwargs)
        self.samples = {}
        self.captured = True


def _require_cuda(device: torch.device, owner: str) -> None:
    # At the first training step, before anything is recorded.
    if device.type != "cuda":
        raise RuntimeError(f"{owner}=...: CUDA graphs run on a CUDA GPU; the model is on {device}. Leave "
                           "cuda_graphs unset on this device")
