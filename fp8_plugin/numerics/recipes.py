"""Scaling recipes for per-tensor FP8 training, with Transformer Engine's names and defaults.

Source: ``transformer_engine.common.recipe`` (DelayedScaling, Float8CurrentScaling) and the TE
user guide, "Using FP8 with Transformer Engine". The scale multiplies a tensor before the FP8
cast and ``scale_inv = 1 / scale`` multiplies the GEMM result back:

    scale = (FP8_MAX / amax) / 2 ** margin

where FP8_MAX is 448 (E4M3) or 57344 (E5M2).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, TypeVar, Union

import torch

from .formats import Format, parse_format

__all__ = [
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "QParams",
    "MMParams",
    "AutoRecipe",
    "OverrideLinearPrecision",
    "GEMMS",
    "gemms_in_fp8",
    "kept_per_recipe",
    "as_gemm_flags",
    "check_recipe",
    "blockwise_variant",
    "AMAX_COMPUTE_ALGOS",
    "AMAX_OUTLIER_POLICIES",
    "MAX_MARGIN",
    "MAX_AMAX_HISTORY_LEN",
]

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
AMAX_OUTLIER_POLICIES = ("clip", "keep", "skip")
# margin 8 puts the largest value of a tensor at 448 / 2**8 = 1.75 in E4M3: fewer than 7 binades
# above the smallest normal (2**-6) remain for the rest of the tensor, and at margin 15 every
# value is subnormal or zero. 7 is the largest margin that leaves a useful range.
MAX_MARGIN = 7
# Each FP8 layer keeps 3 x amax_history_len float32 and max-reduces it every step; 65536 steps
# (256 times TE's default) is beyond any scale schedule and still small per layer (768 KiB).
MAX_AMAX_HISTORY_LEN = 65536

AmaxComputeAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]

# The three GEMMs of a linear layer: forward (y = x W^T), dgrad (dx = dy W), wgrad (dW = dy^T x).
GEMMS = ("fprop", "dgrad", "wgrad")


class OverrideLinearPrecision(NamedTuple):
    """Which GEMMs of every FP8 linear layer run in high precision instead of FP8 (True: high
    precision). Transformer Engine's ``override_linear_precision`` field of its recipes, with
    its meaning: ``DelayedScaling(override_linear_precision=(False, False, True))`` keeps the
    wgrad GEMMs in high precision. A high-precision GEMM runs as ``nn.Linear`` would (in the
    torch autocast dtype, else the operands' dtype) on the unquantised operands."""

    fprop: bool = False
    dgrad: bool = False
    wgrad: bool = False


def as_gemm_flags(value: Any) -> Optional[tuple[bool, bool, bool]]:
    """``value`` as one bool per GEMM ``(fprop, dgrad, wgrad)``, or None where it is not a
    sequence of three bools (TE's NamedTuple, a tuple, a list from a config file)."""
    try:
        flags = tuple(value)
    except TypeError:
        return None
    return flags if len(flags) == 3 and all(isinstance(f, bool) for f in flags) else None


def _check_override(value: Any, recipe: str) -> OverrideLinearPrecision:
    flags = as_gemm_flags(value)
    if flags is None:
        raise ValueError(
            f"{recipe}(override_linear_precision={value!r}) is invalid; valid: three bools (fprop, dgrad, wgrad), "
            "True running that GEMM in high precision, e.g. (False, False, True)"
        )
    return OverrideLinearPrecision(*flags)


def _check_forward_format(fmt: Format, recipe: str) -> None:
    if fmt is Format.E5M2:
        raise ValueError(
            f"{recipe}(fp8_format=Format.E5M2) is not supported: E5M2 cannot be the forward format "
            "(its 2-bit mantissa is too coarse for activations and weights); "
            "valid: Format.HYBRID (E4M3 forward, E5M2 backward) or Format.E4M3"
        )


def check_recipe(recipe: object, owner: str) -> None:
    """Raise unless ``recipe`` is None or a :class:`Recipe`.

    Args:
        recipe: the value given.
        owner: the function or class it was passed to as ``recipe=``, e.g. ``"autocast"``.

    Raises:
        TypeError: naming the setting, the value and the valid recipes.
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(
            f"{owner}(recipe={recipe!r}) is not a recipe; valid: AutoRecipe(...), DelayedScaling(...), "
            "Float8CurrentScaling(...), Float8BlockScaling(...), MXFP8BlockScaling(...) or None"
        )


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class MMParams(NamedTuple):
    """How one FP8 GEMM of a per-tensor recipe accumulates on a GPU (Transformer Engine's
    ``MMParams``; a named tuple here, which ``torch.compile`` traces where a recipe is built).

    Args:
        use_split_accumulator: True: the tensor cores' partial sums are promoted to float32
            after each MMA instruction (cuBLAS without fast accumulation); False: they
            accumulate over the whole K in the tensor cores' own precision (``use_fast_accum``
            of ``torch._scaled_mm``): faster, with about 14 bits kept in the partial sums on
            Hopper (DeepSeek-V3 Technical Report, arXiv:2412.19437, section 3.3.2).

    A value that is not a bool is refused by the recipe that receives it (``TypeError``). CPUs
    and the float32 emulation accumulate in float32 either way.
    """

    use_split_accumulator: bool = True


def _check_mm_params(recipe: "Recipe", owner: str) -> None:
    for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
        value = getattr(recipe, name)
        if not isinstance(value, MMParams) or not isinstance(value.use_split_accumulator, bool):
            raise TypeError(f"{owner}({name}={value!r}) is invalid; valid: MMParams(use_split_accumulator=True "
                            "or False)")


# Transformer Engine's defaults: fast accumulation in fprop, split accumulation in dgrad and wgrad
# (its Float8CurrentScaling fields; for DelayedScaling its _2X_ACC_FPROP/_DGRAD/_WGRAD constants).
_FPROP_MM, _BACKWARD_MM = MMParams(use_split_accumulator=False), MMParams(use_split_accumulator=True)


def split_accumulators(recipe: "Recipe") -> tuple[bool, bool, bool]:
    """``use_split_accumulator`` of the recipe's (fprop, dgrad, wgrad) GEMMs; True (float32
    promotion) for recipes without the fields (block scaling: its kernels scale per block)."""
    return tuple(getattr(recipe, name, _BACKWARD_MM).use_split_accumulator
                 for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"))


def gemms_in_fp8(switches: tuple[bool, bool, bool], recipe: "Recipe") -> tuple[bool, bool, bool]:
    """Which GEMMs ``(fprop, dgrad, wgrad)`` run in FP8: those ``switches`` keep in FP8 (a layer's
    ``fp8_gemms``) and ``recipe``'s ``override_linear_precision`` does not move to high precision."""
    return _gemms_in_fp8(switches, recipe.override_linear_precision)


@functools.lru_cache(maxsize=64)
def _gemms_in_fp8(switches: tuple[bool, bool, bool], override: tuple[bool, bool, bool]) -> tuple[bool, bool, bool]:
    # Kept per pair: an FP8 layer's forward asks every step, and a generator costs microseconds.
    return tuple(on and not high for on, high in zip(switches, override))


class Recipe:
    """Base of all scaling recipes. ``fp8_format`` is a ``Format``."""

    fp8_format: Format
    # Which GEMMs run in high precision (all FP8 unless a recipe's field says otherwise).
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()

    def delayed(self) -> bool:
        """True when scales come from an amax history (delayed scaling)."""
        return False


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor delayed scaling: each scale comes from an amax history of past steps.

    At every step the amax of each FP8 tensor (input, weight, grad_output of every layer) is
    recorded. Before the next step, amaxes are reduced over ``amax_history_len`` steps with
    ``amax_compute_algo`` and the scale becomes ``(FP8_MAX / amax) / 2 ** margin``, so the scale
    used at step t depends only on steps < t (no extra pass over the tensor). An amax of 0 keeps
    the previous scale; a non-finite amax is not recorded (it would poison the history) and is
    counted instead. On a tensor's very first step, with no history yet, its own amax is used
    (as torchao's delayed scaling initialised its amaxes) instead of a scale of 1.0.

    Args:
        margin: non-negative integer; the scale is divided by ``2 ** margin`` to leave headroom.
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
        amax_history_len: number of past steps kept (>= 1). TE default: 1024.
        amax_compute_algo: ``"max"`` (max over the history), ``"most_recent"`` (amax of the last
            step), or a callable taking the history, float32 ``[amax_history_len, n]`` with row 0
            the most recent step, and returning float32 ``[n]`` (TE's convention).
        reduce_amax: reduce amaxes across the data-parallel group before each scale update
            (used by the distributed integration; no effect in a single process).
        amax_outlier_factor: a step's amax (after the reduction across ranks) is an outlier
            when it exceeds this factor times the amax the current scale was computed from
            (``FP8_MAX / (scale * 2 ** margin)``). Outliers are counted per layer and role
            (``ScalingState.outlier_count``, the largest ratio in ``outlier_ratio``) and
            reported by the training loops. A float > 1; default 100.
        amax_outlier_policy: what an outlier amax does to the history: ``"clip"`` (default:
            it enters as ``amax_outlier_factor`` times that amax, so the scale drops by at most
            the factor per step and a real change in range is still followed within a few
            steps), ``"keep"`` (it enters as it is: Transformer Engine's behaviour, under which
            one batch of values 10^6 times larger flushes the next ``amax_history_len`` steps
            of normal values to zero with the ``"max"`` algorithm) or ``"skip"`` (it does not
            enter; the scale stays as it was).
        override_linear_precision: ``(fprop, dgrad, wgrad)`` bools, True running that GEMM of
            every FP8 layer in high precision (Transformer Engine's field; default all False:
            see :class:`OverrideLinearPrecision`).
        fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: :class:`MMParams` of each GEMM on a
            GPU; default fast accumulation in fprop, split accumulation in dgrad and wgrad, as
            Transformer Engine runs delayed scaling (its ``_2X_ACC_*`` constants, here fields
            as on its ``Float8CurrentScaling``).

    The outlier policy is this project's addition to TE's recipe: TE keeps every amax.

    Raises:
        ValueError: margin not an integer in [0, ``MAX_MARGIN``] (7), ``amax_history_len`` not
            an integer in [1, ``MAX_AMAX_HISTORY_LEN``] (65536), an unknown
            ``amax_compute_algo`` or ``amax_outlier_policy``, ``amax_outlier_factor`` not a
            finite number > 1, an unknown format, or E5M2 as the forward format.
        TypeError: ``reduce_amax`` not a bool; a ``fp8_gemm_*`` that is not an :class:`MMParams`.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    reduce_amax: bool = True
    amax_outlier_factor: float = 100.0
    amax_outlier_policy: str = "clip"
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()
    fp8_gemm_fprop: MMParams = _FPROP_MM
    fp8_gemm_dgrad: MMParams = _BACKWARD_MM
    fp8_gemm_wgrad: MMParams = _BACKWARD_MM

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", parse_format(self.fp8_format))
        _check_forward_format(self.fp8_format, "DelayedScaling")
        _check_mm_params(self, "DelayedScaling")
        object.__setattr__(self, "override_linear_precision",
                           _check_override(self.override_linear_precision, "DelayedScaling"))
        if not _is_int(self.margin) or not 0 <= self.margin <= MAX_MARGIN:
            raise ValueError(
                f"DelayedScaling(margin={self.margin!r}) is invalid; valid: an integer from 0 to {MAX_MARGIN} "
                f"(the scale is divided by 2**margin; at margin {MAX_MARGIN + 1} and above most E4M3 values "
                "underflow)"
            )
        if not _is_int(self.amax_history_len) or not 1 <= self.amax_history_len <= MAX_AMAX_HISTORY_LEN:
            raise ValueError(
                f"DelayedScaling(amax_history_len={self.amax_history_len!r}) is invalid; "
                f"valid: an integer from 1 to {MAX_AMAX_HISTORY_LEN}"
            )
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"DelayedScaling(reduce_amax={self.reduce_amax!r}) is invalid; valid: True, False")
        factor = self.amax_outlier_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 < factor < math.inf:
            raise ValueError(
                f"DelayedScaling(amax_outlier_factor={factor!r}) is invalid; valid: a finite number > 1"
            )
        if self.amax_outlier_policy not in AMAX_OUTLIER_POLICIES:
            raise ValueError(
                f"DelayedScaling(amax_outlier_policy={self.amax_outlier_policy!r}) is invalid; valid: "
                f"{', '.join(repr(p) for p in AMAX_OUTLIER_POLICIES)}"
            )
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"DelayedScaling(amax_compute_algo={algo!r}) is invalid; valid: "
                f"{', '.join(repr(a) for a in AMAX_COMPUTE_ALGOS)} or a callable "
                "(amax_history [amax_history_len, n]) -> amax [n]"
            )

    def delayed(self) -> bool:
        return True

    def reduce_history(self, history: torch.Tensor) -> torch.Tensor:
        """Amax to scale with, from a history ``[..., amax_history_len]`` (index 0 most recent).

        Returns a float32 tensor of shape ``history.shape[:-1]``.
        """
        if self.amax_compute_algo == "max":
            return history.amax(dim=-1)
        if self.amax_compute_algo == "most_recent":
            return history[..., 0]
        # TE's callable convention: [amax_history_len, n] in, [n] out.
        flat = history.reshape(-1, history.shape[-1]).t()
        return self.amax_compute_algo(flat).reshape(history.shape[:-1])


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor current scaling: each tensor is scaled from its own amax, computed at the cast.

    ``scale = FP8_MAX / amax(tensor)``; an all-zero tensor gets scale 1.0 and a tensor with a
    non-finite amax gets scale 1.0 and is counted. Costs one extra reduction over each tensor
    but never lags behind the data (TE: ``Float8CurrentScaling``).

    Args:
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
        override_linear_precision: ``(fprop, dgrad, wgrad)`` bools, True running that GEMM of
            every FP8 layer in high precision (Transformer Engine's field; default all False:
            see :class:`OverrideLinearPrecision`).
        fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: :class:`MMParams` of each GEMM on a
            GPU (Transformer Engine's fields and defaults: fast accumulation in fprop only).

    Raises:
        ValueError: an unknown format, or E5M2 as the forward format.
        TypeError: a ``fp8_gemm_*`` that is not an :class:`MMParams`.
    """

    fp8_format: Format = Format.HYBRID
    margin: int = field(default=0, init=False)
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()
    fp8_gemm_fprop: MMParams = _FPROP_MM
    fp8_gemm_dgrad: MMParams = _BACKWARD_MM
    fp8_gemm_wgrad: MMParams = _BACKWARD_MM

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", parse_format(self.fp8_format))
        _check_forward_format(self.fp8_format, "Float8CurrentScaling")
        _check_mm_params(self, "Float8CurrentScaling")
        object.__setattr__(self, "override_linear_precision",
                           _check_override(self.override_linear_precision, "Float8CurrentScaling"))


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: one E8M0 (power-of-two) scale per 32 consecutive values along the GEMM reduction dim.

    Scales follow the OCP Microscaling (MX) spec v1.0, section 6.3 (shared exponent
    ``floor(log2(amax)) - emax_elem``); see :mod:`fp8_plugin.numerics.block_scaling`. Tensors are cast
    twice, rowwise (1x32 blocks) and columnwise (32x1), because a block-scaled tensor cannot be
    transposed without re-quantization (TE does the same). Native on Blackwell (sm100); emulated
    elsewhere with identical quantization numerics.

    Args:
        fp8_format: ``Format.E4M3`` (TE's default: E4M3 in both passes) or ``Format.HYBRID``.
        override_linear_precision: ``(fprop, dgrad, wgrad)`` bools, True running that GEMM of
            every FP8 layer in high precision (Transformer Engine's field; default all False:
            see :class:`OverrideLinearPrecision`).

    Raises:
        ValueError: an unknown format or ``Format.E5M2``.
    """

    fp8_format: Format = Format.E4M3
    margin: int = field(default=0, init=False)
    block_size: int = field(default=32, init=False)
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", parse_format(self.fp8_format))
        _check_forward_format(self.fp8_format, "MXFP8BlockScaling")
        object.__setattr__(self, "override_linear_precision",
                           _check_override(self.override_linear_precision, "MXFP8BlockScaling"))


@dataclass(frozen=True)
class QParams:
    """Quantization parameters of one tensor of :class:`Float8BlockScaling` (TE's ``QParams``).

    Args:
        power_2_scale: truncate each block scale to a power of two (TE default True).
        amax_epsilon: floor under each block amax before ``scale = FP8_MAX / amax`` (>= 0).
    """

    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.power_2_scale, bool):
            raise TypeError(f"QParams(power_2_scale={self.power_2_scale!r}) is invalid; valid: True, False")
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps <= _FLOAT32_MAX:
            raise ValueError(
                f"QParams(amax_epsilon={eps!r}) is invalid; valid: a float from 0 to the float32 max "
                f"({_FLOAT32_MAX:.6g}: block amaxes are float32)"
            )


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """128-blockwise scaling as DeepSeek-V3 trained with (TE's ``Float8BlockScaling``).

    Each block of 1x128 (``*_block_scaling_dim=1``) or 128x128 (``=2``) values gets its own FP32
    scale ``FP8_MAX / amax``, a power of two by default. TE's defaults: 1x128 for activations and
    gradients, 128x128 for weights, E4M3 in both passes. Native on Hopper through cuBLAS with
    recent CUDA; emulated elsewhere with identical quantization numerics.

    Args:
        fp8_format: ``Format.E4M3`` (default) or ``Format.HYBRID``.
        fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad: :class:`QParams` of the
            input, the weight and grad_output.
        x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 (1x128 blocks) or
            2 (128x128 blocks).
        override_linear_precision: ``(fprop, dgrad, wgrad)`` bools, True running that GEMM of
            every FP8 layer in high precision (Transformer Engine's field; default all False:
            see :class:`OverrideLinearPrecision`).

    Raises:
        ValueError: an unknown format or E5M2, a block dim other than 1 or 2.
        TypeError: a ``fp8_quant_*`` that is not a :class:`QParams`.
    """

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = QParams()
    fp8_quant_fwd_weight: QParams = QParams()
    fp8_quant_bwd_grad: QParams = QParams()
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    margin: int = field(default=0, init=False)
    block_size: int = field(default=128, init=False)
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", parse_format(self.fp8_format))
        _check_forward_format(self.fp8_format, "Float8BlockScaling")
        object.__setattr__(self, "override_linear_precision",
                           _check_override(self.override_linear_precision, "Float8BlockScaling"))
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            if not isinstance(getattr(self, name), QParams):
                raise TypeError(
                    f"Float8BlockScaling({name}={getattr(self, name)!r}) is invalid; valid: a QParams(...)"
                )
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if not _is_int(getattr(self, name)) or getattr(self, name) not in (1, 2):
                raise ValueError(
                    f"Float8BlockScaling({name}={getattr(self, name)!r}) is invalid; valid: 1 (1x128 blocks), 2 (128x128 blocks)"
                )


@dataclass(frozen=True)
class AutoRecipe(Recipe):
    """"The best recipe this device runs natively", resolved when a model is converted.

    :func:`fp8_plugin.numerics.device.resolve_recipe` turns it into a concrete recipe for a device:
    ``MXFP8BlockScaling(fp8_format)`` where MXFP8 GEMMs are native (Blackwell),
    ``DelayedScaling(fp8_format)`` elsewhere (Hopper, Ada, CPU: per-tensor GEMMs are native).
    The default of the Lightning precision strings that name a format but no recipe.

    Args:
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
        override_linear_precision: ``(fprop, dgrad, wgrad)`` bools, True running that GEMM of
            every FP8 layer in high precision (Transformer Engine's field; default all False:
            see :class:`OverrideLinearPrecision`).

    Raises:
        ValueError: an unknown format, or E5M2 as the forward format.
    """

    fp8_format: Format = Format.HYBRID
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", parse_format(self.fp8_format))
        _check_forward_format(self.fp8_format, "AutoRecipe")
        object.__setattr__(self, "override_linear_precision",
                           _check_override(self.override_linear_precision, "AutoRecipe"))


_T = TypeVar("_T")


def kept_per_recipe(cache: dict[int, tuple[Recipe, _T]], recipe: Recipe, make: Callable[[Recipe], _T],
                    limit: int = 64) -> _T:
    """``make(recipe)``, kept in ``cache`` by the recipe object's identity and checked against the
    kept object. Recipes are frozen dataclasses, so what is derived from one object stays true;
    hashing one hashes every field (microseconds, asked every cast), and a recipe with a
    callable ``amax_compute_algo`` is not hashable at all. Where recipes are made anew for each
    step the cache is emptied once it holds ``limit`` entries."""
    kept = cache.get(id(recipe))
    if kept is not None and kept[0] is recipe:
        return kept[1]
    value = make(recipe)
    if len(cache) >= limit:
        cache.clear()
    cache[id(recipe)] = (recipe, value)
    return value


# blockwise_variant's, by the per-tensor recipe's identity (kept_per_recipe).
_BLOCKWISE_VARIANTS: dict[int, tuple[Recipe, Recipe]] = {}


def blockwise_variant(recipe: Recipe) -> Recipe:
    """The recipe a layer whose scaling choice is ``"blockwise"`` runs under ``recipe``.

    For a per-tensor recipe (:class:`DelayedScaling`, :class:`Float8CurrentScaling`):
    ``Float8BlockScaling()`` as Transformer Engine defines it (1x128 activation and gradient
    blocks, 128x128 weight blocks, power-of-two scales, E4M3 in both passes: the DeepSeek-V3
    recipe, whose 1x128 activation tiles exist for activation outliers) with the recipe's
    ``override_linear_precision``. E4M3 even under HYBRID: each 1x128 gradient tile gets its own
    scale, so E5M2's wider range buys nothing there (DeepSeek-V3 technical report, 3.3.1), and
    Hopper's blockwise GEMMs take E4M3 operands only (torch refuses E5M2 ones). A block-scaled
    recipe (MXFP8, blockwise) is returned as it is: its blocks already confine an outlier to its
    own block. Made once per recipe object.
    """
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        return recipe
    return kept_per_recipe(_BLOCKWISE_VARIANTS, recipe,
                           lambda r: Float8BlockScaling(override_linear_precision=r.override_linear_precision))
