"""FP8 settings of the Accelerate adapter, from every place an Accelerate user may write them.

Highest first: the ``Accelerator``'s own arguments; a kwargs handler (this project's
:class:`FP8Kwargs`, or Accelerate's ``TERecipeKwargs`` / ``FP8RecipeKwargs`` for users coming from
Transformer Engine); the environment that ``accelerate launch`` sets from a config file's
``fp8_config``; then the defaults. A setting given at a higher level wins over a lower one (with
a warning naming both when they differ); settings that cannot hold together (two names of one
key with different values, a recipe with options it does not have, two recipe handlers) are an
error naming both, raised when the ``Accelerator`` is built, before any step.

``accelerate launch`` exports each ``fp8_config`` key ``k`` as ``ACCELERATE_FP8_<K>``, and each of
its ``--fp8_*`` options, set or not, under the option's name. Accelerate itself reads three keys
under other names than ``accelerate config`` writes them (``amax_history_length``,
``amax_compute_algorithm``, ``optimization_level``): both spellings are read here. A variable under
an option's name that holds the option's default counts as unset (``accelerate launch`` writes
the defaults whether or not they were asked for). This project's own keys: ``recipe``,
``include``, ``exclude``, ``compute_dtype``, for the BF16 reference checks
``reference_every`` and ``reference_policy``, and for steps with non-finite gradients
``nonfinite`` (``skip`` / ``raise``) and ``max_consecutive_skips`` (see :mod:`fp8_plugin.training.faults`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from ..numerics.formats import Format, parse_format
from ..numerics.recipes import AutoRecipe, DelayedScaling, MXFP8BlockScaling, Recipe
from ..training.core import COMPUTE_DTYPES, Patterns
from ..training.faults import NONFINITE_POLICIES, FaultPolicy
from ..training.precision_strings import PRECISION_STRINGS, parse_precision_string
from ..training.reference import POLICIES, ReferenceCheck, resolve_reference_check

__all__ = ["FP8Kwargs", "FP8Settings", "resolve_settings", "ENV_PREFIX", "BASE_PRECISION"]

log = logging.getLogger(__name__)

ENV_PREFIX = "ACCELERATE_FP8_"
# Accelerate's mixed_precision for each compute dtype of the non-FP8 ops.
BASE_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "no"}
RecipeSetting = Union[Recipe, str, None]

# Defaults of `accelerate launch`'s --fp8_* options: a variable holding one of these may be the
# launcher's default rather than the user's choice.
_LAUNCH_DEFAULTS = {
    "MARGIN": "0", "INTERVAL": "1", "FORMAT": "HYBRID", "AMAX_HISTORY_LEN": "1024",
    "AMAX_COMPUTE_ALGO": "most_recent", "OVERRIDE_FPROP": "False", "OVERRIDE_DGRAD": "False",
    "OVERRIDE_WGRAD": "False", "OPT_LEVEL": "O2", "USE_AUTOCAST_DURING_EVAL": "False",
    "ENABLE_FSDP_FLOAT8_ALL_GATHER": "True", "PAD_INNER_DIM": "True",
}
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
_DELAYED_FIELDS = ("margin", "amax_history_len", "amax_compute_algo")


@dataclass
class FP8Kwargs:
    """fp8-plugin's kwargs handler: ``Accelerator(kwargs_handlers=[FP8Kwargs(...)])``.

    Args:
        recipe: a :class:`~fp8_plugin.numerics.recipes.Recipe` or an ``"fp8-*"`` precision string
            (``"fp8-hybrid"``, ``"fp8-current"``, ...); None leaves it to lower settings.
        include, exclude: module-name glob patterns for :func:`fp8_plugin.convert_model`.
        compute_dtype: dtype of the non-FP8 ops (``torch.bfloat16``, ``torch.float16`` with
            dynamic loss scaling, ``torch.float32``), or its name (``"bf16"``, ``"fp16"``, ``"fp32"``).
        use_autocast_during_eval: run FP8 GEMMs in evaluation forwards too (Accelerate's
            Transformer Engine option of that name; default False: evaluation in high precision).
        reference_every: run a BF16 reference check every this many optimizer steps (0: off);
            see :mod:`fp8_plugin.training.reference`.
        reference_policy: what a failed check does: one of ``"log"``, ``"warn"``,
            ``"fallback"``, ``"raise"``.
        reference_check: a :class:`~fp8_plugin.training.reference.ReferenceCheck` (thresholds,
            ``output_loss``, report files); its ``every`` and ``policy`` count as given here.
        nonfinite: what an optimizer step with non-finite gradients does without loss scaling:
            ``"skip"`` (default) or ``"raise"``; see :mod:`fp8_plugin.training.faults`.
        max_consecutive_skips: stop when more than this many optimizer steps in a row were
            skipped (0: no limit; default 25).

    Raises:
        ValueError: (when the Accelerator resolves it) an unknown precision string or dtype, a
            negative ``reference_every``, an unknown ``reference_policy``, or two of the
            reference fields that contradict each other.
        TypeError: (idem) ``reference_check`` not a ReferenceCheck.
    """

    recipe: RecipeSetting = None
    include: Patterns = None
    exclude: Patterns = None
    compute_dtype: Union[torch.dtype, str, None] = None
    use_autocast_during_eval: Optional[bool] = None
    reference_every: Optional[int] = None
    reference_policy: Optional[str] = None
    reference_check: Optional[ReferenceCheck] = None
    nonfinite: Optional[str] = None
    max_consecutive_skips: Optional[int] = None

    def to_kwargs(self) -> dict[str, Any]:
        """The fields that are set (Accelerate's ``KwargsHandler`` convention)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class FP8Settings:
    """The resolved FP8 settings of one ``Accelerator``.

    Attributes:
        recipe: the scaling recipe (an ``AutoRecipe`` is resolved when a model is converted).
        include, exclude: conversion patterns.
        compute_dtype: dtype of the non-FP8 ops.
        use_autocast_during_eval: FP8 GEMMs in evaluation forwards.
        reference_check: the BF16 reference checks (None: off).
        fault_policy: what steps with non-finite gradients do.
        sources: for each setting, where its value came from (``reference_every``,
            ``reference_policy`` and ``reference_check`` for the checks' settings).
    """

    recipe: Recipe
    include: Patterns
    exclude: Patterns
    compute_dtype: torch.dtype
    use_autocast_during_eval: bool
    reference_check: Optional[ReferenceCheck] = None
    fault_policy: FaultPolicy = FaultPolicy()
    sources: dict[str, str] = field(default_factory=dict)


class _Level:
    """The settings one source gives: key -> (value, where it was written)."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[Any, str]] = {}

    def set(self, key: str, value: Any, where: str) -> None:
        if value is None:
            return
        if key in self.values and self.values[key][0] != value:
            other_value, other_where = self.values[key]
            raise ValueError(
                f"Contradictory FP8 settings: {other_where}={other_value!r} and {where}={value!r}; "
                "give one of them"
            )
        self.values[key] = (value, where)


def _dtype(value: Union[torch.dtype, str], where: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = _DTYPES.get(str(value).lower())
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{where}={value!r} is not a valid compute dtype; valid: {', '.join(sorted(_DTYPES))}")
    return dtype


def _flag(text: str) -> bool:
    return str(text).strip().lower() in ("1", "true", "yes", "y", "on")


def _reference_every(value: Any, where: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{where}={value!r} is not valid; valid: an int >= 0 (0: reference checks off)") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}={value!r} is not valid; valid: an int >= 0 (0: reference checks off)")
    return value


def _reference_policy(value: Any, where: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in POLICIES:
        raise ValueError(f"{where}={value!r} is not a valid reference check policy; valid: {', '.join(POLICIES)}")
    return value.strip().lower()


def _nonfinite(value: Any, where: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in NONFINITE_POLICIES:
        raise ValueError(f"{where}={value!r} is not valid; valid: {', '.join(repr(p) for p in NONFINITE_POLICIES)}")
    return value.strip().lower()


def _max_skips(value: Any, where: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}={value!r} is not valid; valid: an int >= 0 (0: no limit)")
    return value


_FAULT_FIELDS = {"nonfinite": _nonfinite, "max_consecutive_skips": _max_skips}


def _set_reference(level: _Level, owner: str, every: Any, policy: Any, check: Any, names: Sequence[str]) -> None:
    """The reference check settings one source gives: ``names`` are the names of its every,
    policy and ReferenceCheck settings. A ReferenceCheck gives its ``every`` and ``policy`` too."""
    every_name, policy_name, check_name = names
    if check is not None:
        if not isinstance(check, ReferenceCheck):
            raise TypeError(f"{owner}({check_name}={check!r}) must be a fp8_plugin.ReferenceCheck")
        level.set("reference_check", check, f"{owner}({check_name})")
        level.set("reference_every", check.every, f"{owner}({check_name}).every")
        level.set("reference_policy", check.policy, f"{owner}({check_name}).policy")
    if every is not None:
        where = f"{owner}({every_name})"
        level.set("reference_every", _reference_every(every, where), where)
    if policy is not None:
        where = f"{owner}({policy_name})"
        level.set("reference_policy", _reference_policy(policy, where), where)


def _code_level(recipe: RecipeSetting, include: Patterns, exclude: Patterns,
                compute_dtype: Union[torch.dtype, str, None], reference_every: Optional[int] = None,
                reference_check: Optional[ReferenceCheck] = None, nonfinite: Optional[str] = None,
                max_consecutive_skips: Optional[int] = None) -> _Level:
    level = _Level()
    for key, value in (("nonfinite", nonfinite), ("max_consecutive_skips", max_consecutive_skips)):
        if value is not None:
            where = f"Accelerator(fp8_{key})"
            level.set(key, _FAULT_FIELDS[key](value, where), where)
    level.set("recipe", recipe, "Accelerator(fp8_recipe)")
    level.set("include", include, "Accelerator(fp8_include)")
    level.set("exclude", exclude, "Accelerator(fp8_exclude)")
    level.set("compute_dtype", compute_dtype, "Accelerator(fp8_compute_dtype)")
    _set_reference(level, "Accelerator", reference_every, None, reference_check,
                   ("fp8_reference_every", "", "fp8_reference_check"))
    return level


_REFERENCE_FIELDS = ("reference_every", "reference_policy", "reference_check")


def _handler_level(handlers: Sequence[Any]) -> _Level:
    level = _Level()
    for handler in handlers:
        name = type(handler).__name__
        if isinstance(handler, FP8Kwargs):
            for key, value in handler.to_kwargs().items():
                if key in _FAULT_FIELDS:
                    value = _FAULT_FIELDS[key](value, f"FP8Kwargs({key})")
                if key not in _REFERENCE_FIELDS:
                    level.set(key, value, f"FP8Kwargs({key})")
            _set_reference(level, "FP8Kwargs", handler.reference_every, handler.reference_policy,
                           handler.reference_check, _REFERENCE_FIELDS)
            continue
        # Accelerate's TERecipeKwargs / FP8RecipeKwargs: every field is filled in (from the
        # environment or Accelerate's defaults), and every one is honoured, defaults included.
        backend = getattr(handler, "backend", "TE")
        if str(backend).upper() == "MSAMP":
            raise ValueError(
                f"{name}(backend='MSAMP') is not supported: fp8-plugin keeps FP32 master weights and "
                "optimizer states (MS-AMP's O1/O2 store them in FP8); valid backends here: 'TE'"
            )
        _te_fields(level, {f: getattr(handler, f, None) for f in (
            "fp8_format", "margin", "interval", "amax_history_len", "amax_compute_algo",
            "override_linear_precision", "use_mxfp8_block_scaling", "use_autocast_during_eval")}, name)
    return level


def _te_fields(level: _Level, values: Mapping[str, Any], owner: str,
               names: Optional[Mapping[str, str]] = None) -> None:
    """Transformer Engine's recipe options, as Accelerate names them, onto ``level``; ``names``
    maps an option to the name its value was read under (default ``owner(option)``)."""

    def label(key: str) -> str:
        return (names or {}).get(key) or f"{owner}({key})"

    interval = values.get("interval")
    if interval is not None and int(interval) != 1:
        raise ValueError(
            f"{label('interval')}: interval={interval!r} is not supported (Transformer Engine deprecated it: scales "
            "are updated every step); valid: 1"
        )
    override = values.get("override_linear_precision")
    if override is not None:
        flags = tuple(override) if isinstance(override, (tuple, list)) else ()
        if len(flags) != 3 or not all(isinstance(f, bool) for f in flags):
            raise ValueError(
                f"{label('override_linear_precision')}: override_linear_precision={override!r} is invalid; valid: "
                "three bools (fprop, dgrad, wgrad), True running that GEMM in high precision"
            )
        if any(flags):  # all False is every recipe's default: it asks for nothing
            level.set("override_linear_precision", flags, label("override_linear_precision"))
    if values.get("fp8_format") is not None:
        level.set("fp8_format", parse_format(str(values["fp8_format"]).upper()), label("fp8_format"))
    if values.get("margin") is not None:
        level.set("margin", int(values["margin"]), label("margin"))
    if values.get("amax_history_len") is not None:
        level.set("amax_history_len", int(values["amax_history_len"]), label("amax_history_len"))
    if values.get("amax_compute_algo") is not None:
        level.set("amax_compute_algo", str(values["amax_compute_algo"]).lower(), label("amax_compute_algo"))
    if values.get("use_mxfp8_block_scaling"):
        level.set("use_mxfp8_block_scaling", True, label("use_mxfp8_block_scaling"))
    if values.get("use_autocast_during_eval") is not None:
        level.set("use_autocast_during_eval", bool(values["use_autocast_during_eval"]),
                  label("use_autocast_during_eval"))


def _env_level(env: Mapping[str, str]) -> _Level:
    level = _Level()

    def get(name: str) -> Optional[str]:
        value = env.get(ENV_PREFIX + name)
        if value is None or value == "None" or _LAUNCH_DEFAULTS.get(name) == value:
            return None
        return value

    def var(name: str) -> str:
        return ENV_PREFIX + name

    backend = (env.get(var("BACKEND")) or "").upper()
    if get("OPTIMIZATION_LEVEL") is not None or (backend == "MSAMP" and get("OPT_LEVEL") is not None):
        name = "OPTIMIZATION_LEVEL" if get("OPTIMIZATION_LEVEL") is not None else "OPT_LEVEL"
        raise ValueError(
            f"{var(name)}={env[var(name)]!r} (MS-AMP's optimization_level) is not supported: fp8-plugin keeps "
            "FP32 master weights and optimizer states; remove it from the fp8_config"
        )
    te: dict[str, Any] = {}
    names: dict[str, str] = {}
    # Two spellings of three keys: the config file's (…_LENGTH, …_ALGORITHM) and the option's.
    for key, spellings in (("amax_history_len", ("AMAX_HISTORY_LENGTH", "AMAX_HISTORY_LEN")),
                           ("amax_compute_algo", ("AMAX_COMPUTE_ALGORITHM", "AMAX_COMPUTE_ALGO"))):
        given = [(name, get(name)) for name in spellings if get(name) is not None]
        if len(given) == 2 and given[0][1].lower() != given[1][1].lower():
            raise ValueError(
                f"Contradictory FP8 settings: {var(given[0][0])}={given[0][1]!r} (the config file's "
                f"{key.replace('_len', '_length').replace('_algo', '_algorithm')}) and {var(given[1][0])}="
                f"{given[1][1]!r} (accelerate launch --fp8_{key}); give one of them"
            )
        if given:
            te[key] = given[0][1]
            where = names[key] = var(given[0][0])
            if key == "amax_history_len":
                try:
                    te[key] = int(given[0][1])
                except ValueError:
                    raise ValueError(f"{where}={given[0][1]!r} is invalid; valid: an integer >= 1") from None
    for key, name in (("fp8_format", "FORMAT"), ("margin", "MARGIN"), ("interval", "INTERVAL")):
        if get(name) is not None:
            te[key], names[key] = get(name), var(name)
    overrides = [get(name) for name in ("OVERRIDE_FPROP", "OVERRIDE_DGRAD", "OVERRIDE_WGRAD")]
    if any(v is not None for v in overrides):
        te["override_linear_precision"] = tuple(_flag(v) if v is not None else False for v in overrides)
        names["override_linear_precision"] = var("OVERRIDE_FPROP/DGRAD/WGRAD")
    if get("USE_MXFP8_BLOCK_SCALING") is not None:
        te["use_mxfp8_block_scaling"] = _flag(get("USE_MXFP8_BLOCK_SCALING"))
        names["use_mxfp8_block_scaling"] = var("USE_MXFP8_BLOCK_SCALING")
    if get("USE_AUTOCAST_DURING_EVAL") is not None:
        te["use_autocast_during_eval"] = _flag(get("USE_AUTOCAST_DURING_EVAL"))
        names["use_autocast_during_eval"] = var("USE_AUTOCAST_DURING_EVAL")
    _te_fields(level, te, "accelerate config fp8_config", names)
    # This project's own keys: recipe, include, exclude, compute_dtype.
    level.set("recipe", env.get(var("RECIPE")), var("RECIPE"))
    for key in ("include", "exclude"):
        value = env.get(var(key.upper()))
        if value:
            level.set(key, [p.strip() for p in value.split(",") if p.strip()], var(key.upper()))
    level.set("compute_dtype", env.get(var("COMPUTE_DTYPE")), var("COMPUTE_DTYPE"))
    # The BF16 reference checks: reference_every, reference_policy.
    for key, parse in (("reference_every", _reference_every), ("reference_policy", _reference_policy)):
        value = env.get(var(key.upper()))
        if value is not None and value.strip() not in ("", "None"):
            level.set(key, parse(value, var(key.upper())), var(key.upper()))
    # Steps with non-finite gradients: nonfinite, max_consecutive_skips.
    for key, parse in _FAULT_FIELDS.items():
        value = env.get(var(key.upper()))
        if value is not None and value.strip() not in ("", "None"):
            level.set(key, parse(value, var(key.upper())), var(key.upper()))
    return level


def _level_recipe(level: _Level) -> tuple[Optional[Recipe], Optional[str], Optional[torch.dtype]]:
    """The recipe one level describes (None if it sets none), where, and a precision string's dtype."""
    values = level.values
    fields = {k: values[k] for k in ("fp8_format", *_DELAYED_FIELDS, "override_linear_precision") if k in values}
    override = {"override_linear_precision": fields["override_linear_precision"][0]} \
        if "override_linear_precision" in fields else {}
    mxfp8 = values.get("use_mxfp8_block_scaling")
    string_dtype = None
    if "recipe" in values:
        recipe, where = values["recipe"]
        if isinstance(recipe, str):
            if recipe.lower() not in PRECISION_STRINGS:
                raise ValueError(f"{where}={recipe!r} is not a valid FP8 recipe; valid: {', '.join(PRECISION_STRINGS)}")
            make_recipe, string_dtype = parse_precision_string(recipe)
            recipe = make_recipe()
        elif not isinstance(recipe, Recipe):
            raise TypeError(f"{where}={recipe!r} is not a Recipe or an 'fp8-*' string; valid: "
                            f"a fp8_plugin Recipe or one of {', '.join(PRECISION_STRINGS)}")
        if mxfp8 and not isinstance(recipe, MXFP8BlockScaling):
            raise ValueError(f"Contradictory FP8 settings: {where}={values['recipe'][0]!r} and {mxfp8[1]}=True")
        if isinstance(recipe, AutoRecipe) and any(k in fields for k in _DELAYED_FIELDS):
            # Options of delayed scaling ask for it.
            recipe = DelayedScaling(fp8_format=recipe.fp8_format,
                                    override_linear_precision=recipe.override_linear_precision)
        init_fields = {f.name for f in dataclasses.fields(recipe) if f.init}
        recipe = dataclasses.replace(recipe, **{k: v for k, (v, _) in fields.items() if k in init_fields})
        for key, (value, key_where) in fields.items():
            if getattr(recipe, key, None) != value:
                raise ValueError(
                    f"Contradictory FP8 settings: {where}={values['recipe'][0]!r} and {key_where}={value!r} "
                    f"({type(recipe).__name__} has no such option to set); give one of them"
                )
        return recipe, where, string_dtype
    if mxfp8:
        if any(k in fields for k in _DELAYED_FIELDS):
            key = next(k for k in _DELAYED_FIELDS if k in fields)
            raise ValueError(f"Contradictory FP8 settings: {mxfp8[1]}=True and {fields[key][1]}={fields[key][0]!r} "
                             "(MXFP8 has no amax history or margin)")
        fmt = fields.get("fp8_format", (Format.E4M3, ""))[0]
        return MXFP8BlockScaling(fp8_format=fmt, **override), mxfp8[1], None
    if any(k in fields for k in _DELAYED_FIELDS):
        wheres = ", ".join(w for _, w in fields.values())
        return DelayedScaling(**{k: v for k, (v, _) in fields.items()}), wheres, None
    if "fp8_format" in fields or override:
        fmt, where = fields.get("fp8_format", (Format.HYBRID, None))
        return AutoRecipe(fp8_format=fmt, **override), where or fields["override_linear_precision"][1], None
    return None, None, None


def resolve_settings(
    recipe: RecipeSetting = None,
    include: Patterns = None,
    exclude: Patterns = None,
    compute_dtype: Union[torch.dtype, str, None] = None,
    handlers: Sequence[Any] = (),
    env: Mapping[str, str] = {},
    reference_every: Optional[int] = None,
    reference_check: Optional[ReferenceCheck] = None,
    nonfinite: Optional[str] = None,
    max_consecutive_skips: Optional[int] = None,
) -> FP8Settings:
    """Resolve the FP8 settings of an ``Accelerator`` (see the module docstring for the order).

    The BF16 reference checks are on when any level gives ``reference_every`` (> 0),
    ``reference_policy`` or a ``ReferenceCheck``: each of ``every`` and ``policy`` comes from
    the highest level giving it, the other settings from the highest ``ReferenceCheck`` given
    (else the :class:`~fp8_plugin.training.reference.ReferenceCheck` defaults: every 200 steps,
    policy ``"warn"``); ``reference_every`` 0 turns them off.

    Args:
        recipe, include, exclude, compute_dtype: the ``Accelerator``'s ``fp8_*`` arguments.
        handlers: the FP8 kwargs handlers passed (``FP8Kwargs``, ``TERecipeKwargs``,
            ``FP8RecipeKwargs``).
        env: the process environment (``os.environ``).
        reference_every, reference_check: the ``Accelerator``'s ``fp8_reference_every`` and
            ``fp8_reference_check`` arguments.
        nonfinite, max_consecutive_skips: the ``Accelerator``'s ``fp8_nonfinite`` and
            ``fp8_max_consecutive_skips`` arguments.

    Raises:
        ValueError: contradictory settings (the message names both), an unsupported option (the
            message names it, its value and the valid ones), an unknown precision string or dtype,
            a negative or non-integer ``reference_every``, an unknown ``reference_policy`` or
            ``nonfinite``, a negative or non-integer ``max_consecutive_skips``.
        TypeError: a recipe that is neither a Recipe nor a string; a ``reference_check`` that
            is not a ReferenceCheck.
    """
    if len(handlers) > 1:
        names = " and ".join(type(h).__name__ for h in handlers)
        raise ValueError(f"Contradictory FP8 settings: {names} both passed in kwargs_handlers; pass one")
    levels = [_code_level(recipe, include, exclude, compute_dtype, reference_every, reference_check, nonfinite,
                          max_consecutive_skips),
              _handler_level(handlers), _env_level(env)]
    sources: dict[str, str] = {}

    chosen_recipe: Optional[Recipe] = None
    string_dtype: Optional[tuple[torch.dtype, str]] = None
    for level in levels:
        level_recipe, where, dtype = _level_recipe(level)
        if level_recipe is None:
            continue
        if chosen_recipe is None:
            chosen_recipe, sources["recipe"] = level_recipe, where
            if dtype is not None:
                string_dtype = (dtype, where)
        elif level_recipe != chosen_recipe:
            log.warning("FP8 recipe %r from %s overrides %r from %s", chosen_recipe, sources["recipe"],
                        level_recipe, where)

    def pick(key: str) -> Optional[tuple[Any, str]]:
        found = [level.values[key] for level in levels if key in level.values]
        for value, where in found[1:]:
            if value != found[0][0]:
                log.warning("FP8 setting %s=%r overrides %s=%r", found[0][1], found[0][0], where, value)
        return found[0] if found else None

    settings: dict[str, Any] = {}
    for key in ("include", "exclude", "use_autocast_during_eval", *_FAULT_FIELDS):
        chosen = pick(key)
        settings[key] = chosen[0] if chosen else None
        if chosen:
            sources[key] = chosen[1]
    dtype_setting = pick("compute_dtype")
    if dtype_setting is not None:
        dtype = _dtype(*dtype_setting)
        sources["compute_dtype"] = dtype_setting[1]
    elif string_dtype is not None:
        dtype, sources["compute_dtype"] = string_dtype
    else:
        dtype = torch.bfloat16
    reference = None
    chosen = {key: pick(key) for key in _REFERENCE_FIELDS}
    if any(chosen.values()):
        for key, value in chosen.items():
            if value is not None:
                sources[key] = value[1]
        base = chosen["reference_check"][0] if chosen["reference_check"] else ReferenceCheck()
        every = chosen["reference_every"][0] if chosen["reference_every"] else base.every
        policy = chosen["reference_policy"][0] if chosen["reference_policy"] else base.policy
        reference = resolve_reference_check(None, dataclasses.replace(base, every=every, policy=policy), "Accelerator")
    return FP8Settings(
        recipe=chosen_recipe if chosen_recipe is not None else AutoRecipe(),
        include=settings["include"],
        exclude=settings["exclude"],
        compute_dtype=dtype,
        use_autocast_during_eval=bool(settings["use_autocast_during_eval"]),
        reference_check=reference,
        fault_policy=FaultPolicy(**{k: settings[k] for k in _FAULT_FIELDS if settings[k] is not None}),
        sources=sources,
    )
