"""``convert_model``: swap a Hugging Face model's linear layers for FP8 layers, in place.

Candidates are ``nn.Linear`` and GPT-2-style ``transformers.pytorch_utils.Conv1D``. By default the
layers that FP8 hurts most or gains least from stay in high precision: output heads (lm_head,
classifier / score / qa_outputs heads, the pooler), layers whose weight is tied to an embedding,
and layers whose dims are not multiples of 16 (FP8 tensor cores need them). Embeddings and norms
are not linear layers and are never swapped. The returned :class:`ConversionReport` says which
layers were swapped and why the others were not.

Only layers whose swap cannot change what the model computes are swapped: exact ``nn.Linear``,
exact ``transformers.pytorch_utils.Conv1D``, and the classes on the known-equivalent list of
:mod:`fp8_plugin.modules.equivalents` (transformers' ``FalconLinear`` without a bias), whose own
``forward`` computes exactly as ``nn.Linear``. The other linear layers stay, each with its
reason in the report: subclasses with a ``forward`` of their own (bitsandbytes layers, a biased
``FalconLinear``) or state of their own; lazy layers; ``nn.MultiheadAttention``'s
``out_proj`` (MHA reads its weight directly, its ``forward`` never runs); layers with hooks or an
instance ``forward`` (Accelerate's ``_hf_hook``) that the new layer would drop; and PEFT adapters
(``lora_A`` / ``lora_B``, ``modules_to_save``; the wrapped ``base_layer`` is swapped).
``allow_subclasses=True`` also swaps the ``nn.Linear`` subclasses that provably compute as
``nn.Linear``.
"""

from __future__ import annotations

import fnmatch
import functools
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from ..numerics.cpu_emulation import cpu_emulation
from ..numerics.device import default_device, recipe_gemm_kind, recipe_name, resolve_recipe
from ..numerics.device_kind import device_kind, fp8_family
from ..numerics.gemm import native_gemm
from ..numerics.kernels import fused_casts, gemm_kernel
from ..numerics.quantizers import ScalingState, is_scaling_state_key
from ..numerics.recipes import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling, Recipe, check_recipe
from .backends import get_backend
from .coverage import GemmCoverage, measure_gemm_coverage
from .equivalents import equivalent_linear_reason
from .heads import HEAD_NAMES, head_reason, output_embedding_ids, tied_weight_ids
from .experts import FP8ExpertGEMM
from .experts_plan import plan_experts
from .freezing import (
    check_frozen_layout, frozen_figures, is_transformers_fp8_linear, keep_frozen_in_fp8, master_dtype_of, save_dequantized,
    take_over_transformers_fp8,
)  # fmt: skip
from .scaling_group import ScalingGroup
from .speed_rule import size_rule, too_small_for_fp8

# convert_model's frozen_weights choices.
FROZEN_WEIGHTS = ("fp8", "keep")

__all__ = ["convert_model", "FROZEN_WEIGHTS", "too_small_for_fp8", "ConversionReport", "LayerDecision", "fp8_state_dict", "fp8_state_keys", "split_fp8_state",
           "HEAD_NAMES"]


# FP8 GEMMs on GPUs need every dim a multiple of 16 (cuBLASLt FP8 requirement).
DIM_MULTIPLE = 16

Patterns = Union[str, Sequence[str], None]

# Report kinds of the two layer types convert_model swaps.
_PLAIN_KINDS = frozenset({"Linear", "Conv1D"})


@dataclass
class LayerDecision:
    """What ``convert_model`` did with one candidate layer."""

    name: str
    kind: str
    in_features: int
    out_features: int
    swapped: bool
    reason: str
    # For a swapped layer whose frozen weight is kept only in FP8: its layout ("E4M3, one scale"),
    # and the bytes of its weight before and after (data plus scales).
    frozen: str = ""
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    # The scaling a calibration chose (CalibrationReport.annotate): "recipe", "blockwise" or
    # "high precision"; its reason joins ``reason`` where it is not the recipe.
    scaling: str = "recipe"


@dataclass
class ConversionReport:
    """Every candidate layer of a model, swapped or skipped, with the reason. ``str()`` is a table.

    ``recipe`` is the layers' recipe (an ``AutoRecipe`` resolved for ``device``); ``gemm`` says
    whether its GEMMs run natively on ``device`` or are emulated, and why. ``coverage`` is the
    FP8 share of the model's GEMM FLOPs once :meth:`gemm_coverage` has measured it.
    """

    layers: list[LayerDecision] = field(default_factory=list)
    recipe: Optional[Recipe] = None
    device: str = ""
    gemm: str = ""
    coverage: Optional[GemmCoverage] = None
    # The high-precision weights replaced by FP8-only frozen ones ({id: weakref}), for the
    # optimizers built before the conversion (fp8_plugin.modules.freezing.release_replaced_weights).
    replaced_weights: dict = field(default_factory=dict, repr=False)

    def gemm_coverage(self, model: nn.Module, seq_len: int = 512, *, inputs: Optional[dict[str, Any]] = None) -> GemmCoverage:
        """Measure the FP8 share of ``model``'s GEMM FLOPs in one forward at batch 1 and ``seq_len``
        tokens (heads, routers and attention's score products excepted), keep it as
        ``coverage`` (printed with the table) and return it.
        :func:`fp8_plugin.modules.coverage.measure_gemm_coverage` says what counts and raises."""
        self.coverage = measure_gemm_coverage(model, seq_len, inputs=inputs)
        return self.coverage

    @property
    def swapped(self) -> list[LayerDecision]:
        return [d for d in self.layers if d.swapped]

    @property
    def skipped(self) -> list[LayerDecision]:
        return [d for d in self.layers if not d.swapped]

    @property
    def skipped_types(self) -> dict[str, int]:
        """Layer types other than ``Linear`` / ``Conv1D`` that stayed high precision, with counts."""
        return dict(Counter(d.kind for d in self.skipped if d.kind not in _PLAIN_KINDS))

    @property
    def frozen(self) -> list[LayerDecision]:
        """The swapped layers whose frozen weights are kept only in FP8 (``convert_model``'s
        ``frozen_weights="fp8"``)."""
        return [d for d in self.layers if d.frozen]

    def __str__(self) -> str:
        header = ("layer", "type", "in", "out", "FP8", "reason")
        rows = [
            (d.name, d.kind, str(d.in_features), str(d.out_features), "yes" if d.swapped else "no",
             "; ".join(filter(None, (d.reason, f"frozen weight kept only in FP8 ({d.frozen})" if d.frozen else ""))))
            for d in self.layers
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + [self.summary()])

    def summary(self) -> str:
        """The report without its table: the FP8 layer count, skipped layer types, the recipe and
        its GEMM path, the FP8 share of GEMM FLOPs (when measured); a few lines."""
        lines = [f"{len(self.swapped)} of {len(self.layers)} linear layers in FP8"]
        if self.frozen:
            before = sum(d.weight_bytes_before for d in self.frozen)
            after = sum(d.weight_bytes_after for d in self.frozen)
            lines.append(f"{len(self.frozen)} frozen weights kept only in FP8: {after / 2**20:.2f} MiB "
                         f"(data and scales), {(before - after) / 2**20:.2f} MiB less than before "
                         f"({after / before:.3f}x)")
        if self.skipped_types:
            types = ", ".join(f"{kind} ({n})" for kind, n in sorted(self.skipped_types.items()))
            lines.append(f"skipped layer types: {types}")
        if self.recipe is not None:
            lines.append(f"recipe {recipe_name(self.recipe)} on {self.device}: {self.gemm}")
        if self.coverage is not None:
            lines.append(str(self.coverage))
        return "\n".join(lines)


def _patterns(value: Patterns, setting: str) -> Optional[list[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(p, str) for p in value):
        raise TypeError(
            f"convert_model: {setting}={value!r} is invalid; valid: a glob pattern over module names or a list of "
            "them, e.g. '*.attention.*' or ['lm_head', 'encoder.layer.0.*']"
        )
    return list(value)


def _check_patterns_match(patterns: Optional[list[str]], setting: str, names: list[str]) -> None:
    # A pattern that matches no candidate layer is a typo or a pattern for another model: it
    # would silently convert (exclude) or skip (include) layers the user meant otherwise.
    for pattern in patterns or ():
        if not any(_matches(name, [pattern]) for name in names):
            shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(
                f"convert_model: {setting} pattern {pattern!r} matches no linear layer of this model; valid: "
                f"patterns over the full dotted name or one component of the layers {shown or '(none)'}"
            )


def _matches(name: str, patterns: Iterable[str]) -> bool:
    # A pattern matches the full dotted name, or any single component (``"lm_head"``).
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(name, p) or any(fnmatch.fnmatchcase(c, p) for c in parts) for p in patterns)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


@functools.lru_cache(maxsize=None)
def _transformers_conv1d() -> Optional[type]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers without GPT-2's Conv1D
        return None
    return Conv1D


def _is_candidate(module: nn.Module) -> bool:
    conv1d = _transformers_conv1d()
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d)) or _is_conv1d(module)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# Methods through which a subclass can change what a call computes.
_CALL_METHODS = ("forward", "__call__", "_call_impl")


def _unsafe_reason(module: nn.Module, paths: list[str], by_name: dict[str, nn.Module], allow_subclasses: bool) -> str:
    """Why swapping ``module`` (found at every name in ``paths``) could change what the model
    computes; "" if it cannot."""
    for path in paths:
        if path and isinstance(by_name.get(path.rpartition(".")[0]), nn.MultiheadAttention):
            return "used by nn.MultiheadAttention without its forward"
    for path in paths:
        adapter = _peft_adapter_of(path, by_name)
        if adapter:
            return f"PEFT adapter layer ({adapter})"
    if isinstance(module, nn.modules.lazy.LazyModuleMixin):
        return "lazy layer (parameters not initialized)"
    hooks = [h.strip("_") for h in _HOOK_DICTS if getattr(module, h, None)]
    if "forward" in vars(module):
        hooks.append("forward replaced on the instance")
    if hasattr(module, "_hf_hook"):
        hooks.append("Accelerate _hf_hook")
    if hooks:
        return f"has forward/backward hooks ({', '.join(hooks)})"
    return _subclass_reason(module, allow_subclasses)


def _subclass_reason(module: nn.Module, allow_subclasses: bool) -> str:
    cls = type(module)
    if isinstance(module, nn.Linear):
        base, base_name = nn.Linear, "nn.Linear"
    else:
        base, base_name = _transformers_conv1d(), "Conv1D"
        if base is None or not isinstance(module, base):
            return f"{cls.__module__}.{cls.__qualname__} is not transformers' Conv1D"
    if cls is base:
        return ""
    # A class on the known-equivalent list (equivalents.py, checked bit for bit against nn.Linear)
    # is swapped like nn.Linear, its own forward notwithstanding, where the instance qualifies.
    known = equivalent_linear_reason(module) if base is nn.Linear else None
    if known:
        return f"subclass {cls.__name__} of {base_name} with its own forward ({known})"
    if known is None and any(getattr(cls, m) is not getattr(base, m) for m in _CALL_METHODS):
        return f"subclass {cls.__name__} of {base_name} with its own forward"
    if base is not nn.Linear:
        return f"subclass {cls.__name__} of {base_name} (only the exact Conv1D is swapped)"
    own = {n for n, _ in module.named_parameters(recurse=False)} | {n for n, _ in module.named_buffers(recurse=False)}
    own = (own - {"weight", "bias"}) | {n for n, _ in module.named_children()}
    if own:
        return f"subclass {cls.__name__} of {base_name} with state of its own ({', '.join(sorted(own))})"
    if known is None and not allow_subclasses:
        return f"subclass {cls.__name__} of {base_name} (allow_subclasses=True swaps it)"
    return ""


# PEFT classes that wrap a whole model (the user's model sits below them, no adapter).
_PEFT_MODEL_CLASSES = frozenset({"PeftModel", "PeftMixedModel", "BaseTuner"})


def _from_peft(cls: type) -> bool:
    return cls.__module__.startswith("peft.")


def _peft_adapter_of(path: str, by_name: dict[str, nn.Module]) -> str:
    # PEFT's tuner layers (LoRA and others) wrap the original layer as ``base_layer`` and keep
    # their adapters beside it (lora_A / lora_B ModuleDicts, modules_to_save copies): those must
    # stay high precision and out of the FP8 state, which the adapter file would carry. The
    # nearest PEFT ancestor decides; detected by the classes' modules, so peft is not imported.
    parts = path.split(".") if path else []
    for depth in range(len(parts) - 1, -1, -1):
        ancestor = by_name.get(".".join(parts[:depth]))
        if ancestor is None or not _from_peft(type(ancestor)):
            continue
        if any(c.__name__ in _PEFT_MODEL_CLASSES and _from_peft(c) for c in type(ancestor).__mro__):
            return ""
        return "" if parts[depth] == "base_layer" else parts[depth]
    return ""


def _skip_reason(name: str, module: nn.Module, in_f: int, out_f: int, heads: set[int], tied: set[int], explicit: bool) -> str:
    if not explicit:
        head = head_reason(name, module, heads, tied)
        if head:
            return head
    if in_f % DIM_MULTIPLE or out_f % DIM_MULTIPLE:
        return f"dims not multiples of {DIM_MULTIPLE}"
    return ""


def _check_family(recipe: Optional[Recipe], target: torch.device) -> None:
    # At start-up: a block-scaled recipe cannot run where the FP8 formats are FNUZ (AMD MI300).
    if isinstance(recipe, (MXFP8BlockScaling, Float8BlockScaling)) and fp8_family(target) == "fnuz":
        raise ValueError(
            f"convert_model: recipe {type(recipe).__name__} cannot run on {target} (an AMD MI300: FNUZ FP8 "
            "formats, no block-scaled FP8 GEMMs); valid there: DelayedScaling, Float8CurrentScaling, or "
            "\"auto\" (which picks DelayedScaling)")


def convert_model(
    model: nn.Module,
    recipe: Optional[Recipe] = None,
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    backend: str = "native",
    device: Union[str, torch.device, None] = None,
    allow_subclasses: bool = False,
    skip_small: Union[str, bool, Callable[[int, int], Union[bool, str]]] = "auto",
    frozen_weights: str = "fp8",
    tokens_per_step: Optional[int] = None,
) -> ConversionReport:
    """Replace the model's ``nn.Linear`` / ``Conv1D`` layers with FP8 layers, in place.

    The new layers reuse the old Parameter objects, so optimizer references, ``state_dict`` keys
    and shapes stay as they were (a Conv1D keeps its ``[in, out]`` weight layout). Each gains an
    ``fp8_state`` submodule (amax history, scales) that ``state_dict()`` includes and that
    ``save_pretrained()`` leaves out, so a saved checkpoint loads in vanilla ``transformers``.

    Args:
        model: any ``nn.Module``; ``transformers`` models get head detection.
        recipe: the layers' default recipe (:func:`fp8_plugin.autocast` may override it);
            None means ``DelayedScaling()``; an :class:`~fp8_plugin.numerics.recipes.AutoRecipe` is
            resolved here for ``device``.
        include: glob patterns over module names (the full dotted name or one component); when
            given, only matching layers are candidates, and a match overrides the head rule.
        exclude: glob patterns; matching layers always stay high precision.
        backend: name of the layer backend (``"native"``).
        allow_subclasses: also swap the subclasses of ``nn.Linear`` that provably compute as
            ``nn.Linear``: ``forward`` (and ``__call__``) not overridden, not lazy, no
            parameters, buffers or submodules beyond ``weight`` and ``bias``. Off by default:
            only exact ``nn.Linear``, transformers' ``Conv1D`` and the known-equivalent classes
            (:mod:`fp8_plugin.modules.equivalents`, always swapped) are. Subclasses of
            ``Conv1D``, layers with hooks, MultiheadAttention's ``out_proj`` and PEFT adapters
            are never swapped.
        device: the device training will run on, for which "auto" is resolved and the GEMM
            path chosen (once, here: a GEMM probe on GPUs); None means the model's device if it
            is not the CPU, else the current CUDA device if CUDA is available, else the CPU
            (Lightning and Accelerate convert before they move the model).
        skip_small: layers FP8 would not make faster stay high precision. ``"auto"``
            (default): on a CUDA GPU, those whose projected GEMM time saved per step is less
            than the host time an FP8 layer step adds there, measured once per process
            (:class:`~fp8_plugin.modules.speed_rule.SpeedRule`; the report gives both figures
            per layer); by :func:`too_small_for_fp8` on a GPU the rule has no figures for (and
            on meta tensors presented as one); none on a CPU (no FP8 hardware: FP8 runs there
            for its numerics, at any size). True: by :func:`too_small_for_fp8` on any device;
            False: none; a callable ``(in_features, out_features)`` returning True (or a
            non-empty reason) keeps that layer high precision, such as a ``SpeedRule`` with
            ``host_overhead_us=0`` for layers that will run in CUDA graphs. A layer named by an
            ``include`` pattern is swapped whatever its size.
        frozen_weights: what becomes of the weight of a swapped layer that does not require grad
            (a LoRA base layer, a frozen encoder). ``"fp8"`` (default): it is kept only in FP8,
            cast once with ``recipe`` (:meth:`FP8Linear.freeze_weight
            <fp8_plugin.modules.linear.FP8Linear.freeze_weight>`: about 1 byte per value, no
            high-precision copy; GPT-2 ``Conv1D`` layers excepted); ``"keep"``: it stays in high
            precision, cast at each forward as a trained weight is. Freeze the weights before
            converting (``requires_grad_(False)``, or PEFT's ``get_peft_model``).
        tokens_per_step: the tokens of one training step's micro-batch (batch x sequence
            length) that ``skip_small="auto"`` judges the layers at; None: 8192
            (:data:`~fp8_plugin.modules.speed_rule.DEFAULT_TOKENS`).

    Returns:
        A :class:`ConversionReport`; ``print()`` it for a table.

    Raises:
        TypeError: ``recipe`` is not a Recipe, bad pattern types, ``allow_subclasses`` is
            not a bool, or ``skip_small`` is none of "auto", a bool, a callable.
        ValueError: ``tokens_per_step`` is not None or a positive int.
        ValueError: unknown backend, an ``include`` / ``exclude`` pattern that matches no
            candidate layer, or an unknown ``frozen_weights`` (checked before any layer is swapped).
        RuntimeError: a candidate layer is already sharded by FSDP2 (convert before
            ``fully_shard``).

    Warns:
        UserWarning: nothing was swapped.
    """
    if not isinstance(allow_subclasses, bool):
        raise TypeError(f"convert_model: allow_subclasses={allow_subclasses!r} is not valid; valid: True, False")
    if frozen_weights not in FROZEN_WEIGHTS:
        raise ValueError(f"convert_model: frozen_weights={frozen_weights!r} is not valid; valid: "
                         + ", ".join(repr(v) for v in FROZEN_WEIGHTS))
    check_recipe(recipe, "convert_model")
    chosen = get_backend(backend)
    target = _target_device(model, device)
    recipe = resolve_recipe(recipe, target)
    _check_family(recipe, target)
    too_small = size_rule(skip_small, recipe or DelayedScaling(), target, tokens_per_step)
    include_p, exclude_p = _patterns(include, "include"), _patterns(exclude, "exclude")
    heads, tied = output_embedding_ids(model), tied_weight_ids(model)

    report = ConversionReport()
    replacements: dict[int, nn.Module] = {}
    # Every name of every module: a layer shared by two parents is judged under both.
    by_name: dict[str, nn.Module] = {}
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        by_name[path] = module
        paths.setdefault(id(module), []).append(path)

    def pattern_reason(name: str) -> str:
        # The include / exclude patterns' verdict on a module ("" where they leave it to the rules).
        if include_p is not None and not _matches(name, include_p):
            return "not matched by include"
        if exclude_p is not None and _matches(name, exclude_p):
            return "matched by exclude"
        return ""

    # MoE experts (3-D weights, fp8_plugin.modules.experts) convert in place; routers stay high precision.
    experts = plan_experts(model, recipe, pattern_reason)
    for name, module in list(model.named_modules()):
        if isinstance(module, chosen.fp8_types):
            check_frozen_layout(name, module, recipe or DelayedScaling(), target)
            report.layers.append(LayerDecision(name, type(module).__name__, module.in_features, module.out_features, True,
                                               "already FP8", *frozen_figures(module)))
            continue
        if is_transformers_fp8_linear(module):  # loaded in FP8 by transformers (a GPU): taken over as it is
            if id(module) not in replacements:
                replacements[id(module)] = take_over_transformers_fp8(name, module, recipe or DelayedScaling(),
                                                                      master_dtype_of(model))
            report.layers.append(LayerDecision(name, type(module).__name__, module.in_features, module.out_features,
                                               True, "", *frozen_figures(replacements[id(module)])))
            continue
        if not _is_candidate(module):
            continue
        _refuse_sharded(name, module)
        conv = not isinstance(module, nn.Linear)
        in_f, out_f = (module.weight.shape[0], module.nf) if conv else (module.in_features, module.out_features)
        kind = type(module).__name__
        explicit = include_p is not None and _matches(name, include_p)
        # Unsafe layers first: not even an explicit include swaps them (the model would compute otherwise).
        reason = _unsafe_reason(module, paths[id(module)], by_name, allow_subclasses) or pattern_reason(name)
        if not reason:
            reason = ("" if explicit else experts.router_reason(module)) or _skip_reason(
                name, module, in_f, out_f, heads, tied, explicit)
            if not reason and not explicit and too_small is not None:
                reason = too_small(in_f, out_f)
        if not reason and id(module) not in replacements:
            replacements[id(module)] = chosen.make_linear(module, recipe)
        report.layers.append(LayerDecision(name, kind, in_f, out_f, not reason, reason))

    report.layers.extend(LayerDecision(*d) for d in experts.decisions)
    candidates = [d.name for d in report.layers]
    _check_patterns_match(include_p, "include", candidates)
    _check_patterns_match(exclude_p, "exclude", candidates)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in replacements:
                setattr(parent, child_name, replacements[id(child)])

    experts.apply()
    if frozen_weights == "fp8":
        report.replaced_weights = keep_frozen_in_fp8(model, report.layers,
                                                     {id(m) for m in (*replacements.values(), *experts.todo)})
        if report.frozen:
            save_dequantized(model)
    _join_one_scaling_group(model, (*chosen.fp8_types, FP8ExpertGEMM))
    _ignore_fp8_state_on_save(model)
    report.recipe, report.device = recipe or DelayedScaling(), str(target)
    kind = recipe_gemm_kind(report.recipe)
    support = native_gemm(kind, target)
    if support.native and kind == "tensorwise" and target.type == "cpu":
        emulation = "the BF16 emulation" if cpu_emulation().bf16 else "the exact float32 emulation"
        report.gemm = f"tensorwise GEMMs: torch._scaled_mm or {emulation} per operand pairing, as python -m fp8_plugin reports"
    else:
        report.gemm = f"{kind} GEMMs " + ("native" if support.native else f"emulated ({support.reason})")
    fnuz = fp8_family(target) == "fnuz"
    kernel = gemm_kernel()  # FP8_PLUGIN_GEMM_KERNEL checked here, at set-up, not at the first GEMM
    if kind == "tensorwise":
        if kernel == "triton" and device_kind(target) == "cuda" and not fnuz:
            report.gemm += " (the Triton GEMM: FP8_PLUGIN_GEMM_KERNEL=triton)"
        fused, why = fused_casts(target)
        if fnuz:
            fused, why = False, "the fused kernels encode the OCP formats"
        report.gemm += "; casts: fused Triton kernels" if fused else f"; casts: torch ops ({why})"
    if fnuz:  # an AMD MI300: the recipe's format names stand for the FNUZ pair
        report.gemm += "; formats: E4M3FNUZ (max 240) / E5M2FNUZ"
    if not report.swapped:
        warnings.warn(
            f"convert_model found no layer to run in FP8 among {len(report.layers)} candidate linear layers "
            f"of {type(model).__name__}; the model trains in high precision. Reasons:\n{report}",
            stacklevel=2,
        )
    return report


def _refuse_sharded(name: str, module: nn.Module) -> None:
    # FSDP2 hooks and parameter bookkeeping belong to the module object it sharded: a new FP8
    # layer put in its place would see sharded weights. Convert first, then shard.
    sharded = _is_fsdp2_module(module) or any(type(p).__name__ == "DTensor" for p in module.parameters(recurse=False))
    if sharded:
        raise RuntimeError(
            f"convert_model: layer {name!r} is already sharded by FSDP2 (fully_shard); convert the model "
            "before sharding it. In Lightning's configure_model, call "
            "self.trainer.precision_plugin.convert_module(self) before fully_shard(...)"
        )


def _is_fsdp2_module(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def _target_device(model: nn.Module, device: Union[str, torch.device, None]) -> torch.device:
    if device is not None:
        return default_device(device)
    param = next(model.parameters(), None)
    if param is not None and device_kind(param.device) != "cpu":
        return param.device
    return default_device(None)


def fp8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FP8 scaling state of ``model`` alone, under its ``model.state_dict()`` keys.

    One ``<layer>.fp8_state._extra_state`` entry per FP8 layer: the layer's
    :class:`~fp8_plugin.numerics.quantizers.ScalingState` as the module's extra state (scale,
    amax history, flags; not buffers, see ``ScalingState``), amaxes not yet applied included as
    pending roles, exactly as a full ``state_dict()`` holds them.
    """
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, ScalingState):
            state.update(module.state_dict(prefix=f"{name}." if name else ""))
    return state


def split_fp8_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a converted model's ``state_dict()`` into its vanilla part and its FP8 scaling state.

    The vanilla part loads into the unconverted model with ``load_state_dict(strict=True)``
    (same keys, shapes and layouts as before conversion); both parts together load back into a
    converted model (``load_state_dict(vanilla)`` alone also works: scaling then starts afresh).

    Args:
        state_dict: any mapping of ``state_dict`` keys (a converted or a vanilla model's).

    Returns:
        ``(vanilla, fp8)``: two new dicts, in the original key order; ``fp8`` holds the
        ``...fp8_state._extra_state`` entries.
    """
    vanilla = {k: v for k, v in state_dict.items() if not is_scaling_state_key(k)}
    fp8 = {k: v for k, v in state_dict.items() if is_scaling_state_key(k)}
    return vanilla, fp8


def fp8_state_keys(model: nn.Module) -> list[str]:
    """``state_dict`` keys of ``model`` that hold FP8 scaling state (and nothing else)."""
    return [f"{name}._extra_state" if name else "_extra_state" for name, module in model.named_modules()
            if isinstance(module, ScalingState)]


def _join_one_scaling_group(model: nn.Module, fp8_types: tuple[type, ...]) -> None:
    # The model's FP8 layers update their scales together: one amax reduction per step.
    group = ScalingGroup()
    for module in model.modules():
        if isinstance(module, fp8_types):
            group.add(module)


def _ignore_fp8_state_on_save(model: nn.Module) -> None:
    # transformers' save_pretrained drops the exact keys in _keys_to_ignore_on_save; register
    # them on every PreTrainedModel in the tree, relative to it, so the saved checkpoint is vanilla.
    for module in model.modules():
        if hasattr(module, "save_pretrained") and hasattr(module, "_keys_to_ignore_on_save"):
            ignored = set(module._keys_to_ignore_on_save or ())
            ignored.update(fp8_state_keys(module))
            module._keys_to_ignore_on_save = ignored
