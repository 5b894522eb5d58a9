"""Quantizers: turn a high-precision tensor into FP8 data plus the scale_inv to undo it.

One small interface, :class:`Quantizer`, that every scaling granularity implements: per-tensor
delayed and current scaling here; block-scaled recipes (MXFP8, 128-blockwise) plug in beside
them by returning a :class:`QuantizedTensor` whose ``scale_inv`` has block shape.

Per-tensor scaling state of a layer lives in :class:`ScalingState`, whose extra state carries it
through ``state_dict()`` / ``load_state_dict()`` (identical scales on resume), and whose tensors
give per-layer figures (amaxes, scales, non-finite counts) without recomputation.
"""

from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from .block_scaling import block_amax, blockwise_scale, dequantize_blocks, mx_scale_inv, quantize_blocks
from .device_kind import fp8_family, presented_device
from .formats import FAMILIES, fp8_dtype, fp8_max
from .recipes import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling, Recipe
from .kernels import fusable, fused_casts
from .kernels.rows import StateRows
from .scaling import amax as tensor_amax
from .scaling import dequantize, divide, quantize, scale_from_amax

__all__ = [
    "ROLES",
    "QuantizedTensor",
    "Quantizer",
    "PerTensorQuantizer",
    "BlockQuantizer",
    "make_quantizer",
    "ScalingState",
    "is_scaling_state_key",
    "update_delayed_scaling",
    "recipe_key",
    "check_saved_state",
    "mark_recorded",
    "STATE_VERSION",
]

# The three FP8 tensors of a linear layer, in the order of ScalingState's rows.
ROLES = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD_OUTPUT = range(3)


@dataclass
class QuantizedTensor:
    """FP8 ``data`` and the float32 ``scale_inv`` that maps it back: ``x ~= data * scale_inv``.

    ``data`` is 2-D ``[rows, cols]`` in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    ``block`` is None for per-tensor scaling (``scale_inv`` 0-dim) or the ``(rows, cols)`` tile
    each entry of a ``[ceil(rows / block[0]), ceil(cols / block[1])]`` ``scale_inv`` covers.
    ``gemm_scale``: the same scales already in the layout a native block-scaled GEMM takes
    (MXFP8: swizzled E8M0, :func:`fp8_plugin.numerics.scale_layouts.mx_gemm_scale`), written by
    a fused cast; None where the GEMM converts ``scale_inv`` itself. An operation that changes
    ``data`` (padding, transposing) drops it.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Optional[tuple[int, int]] = None
    gemm_scale: Optional[torch.Tensor] = None

    def dequantize(self, dtype: torch.dtype = torch.float32, saturate: bool = True) -> torch.Tensor:
        """High-precision copy ``data * scale_inv`` in ``dtype``; finite data reads back finite
        unless ``saturate=False`` (the plain product, for the emulated GEMM's hot path)."""
        if self.block is None:
            return dequantize(self.data, self.scale_inv, dtype, saturate)
        return dequantize_blocks(self.data, self.scale_inv, self.block, dtype, saturate)

    def t(self) -> "QuantizedTensor":
        """Transpose with a contiguous copy of ``data`` (1 byte per value).

        Raises:
            ValueError: 1-D block scaling, whose transpose needs re-quantization from high
                precision (quantize with ``columnwise=True`` instead).
        """
        if self.block is not None and self.block[0] != self.block[1]:
            raise ValueError(f"a {self.block[0]}x{self.block[1]} block-scaled tensor cannot be transposed exactly")
        scale_inv = self.scale_inv if self.block is None else self.scale_inv.t().contiguous()
        return QuantizedTensor(self.data.t().contiguous(), scale_inv, self.block)


class Quantizer(ABC):
    """Maps a high-precision tensor to a :class:`QuantizedTensor`."""

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize a 2-D tensor ``[rows, cols]`` of any floating dtype (blocks along cols)."""

    def quantize_pair(self, x: torch.Tensor, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        """The rowwise cast of ``x`` ``[rows, cols]`` and, if asked, the columnwise one: ``x.T``
        ``[cols, rows]`` with its blocks along the original rows (what dgrad / wgrad consume).
        Per-tensor scales share one scale, so the columnwise copy is a transpose of the rowwise."""
        row = self.quantize(x)
        return row, (row.t() if columnwise else None)

    def quantize_pair_and_sum(self, x: torch.Tensor, columnwise: bool
                              ) -> tuple[QuantizedTensor, Optional[QuantizedTensor], torch.Tensor]:
        """:meth:`quantize_pair` and ``x.sum(0)`` in float32 ``[cols]``: a grad_output's cast
        and its layer's bias gradient (Transformer Engine's ``bgrad_quantize``). Here the sum is
        torch's own; a fused cast computes it in the same pass, within float32 summation error
        of it."""
        row, col = self.quantize_pair(x, columnwise)
        return row, col, x.to(torch.float32).sum(0)


class ScalingState(nn.Module):
    """Per-tensor FP8 scaling state of one layer: a row per role (input, weight, grad_output).

    Tensors (float32 / bool / int64 whatever ``module.to(dtype)`` or
    ``torch.set_default_dtype`` ask; only the device moves):

    - ``amax_history``: float32 ``[3, amax_history_len]``; column 0 is the current step, column i
      the step i updates ago. Under current and block scaling column 0 holds the last cast's amax.
    - ``scale``: float32 ``[3]``; multiplies a tensor before its FP8 cast.
    - ``initialized``: bool ``[3]``; False until a scale has been computed from a history.
    - ``nonfinite_amax_count``: int64 ``[3]``; casts whose amax was inf or NaN.
    - ``outlier_count``: int64 ``[3]``; delayed-scaling updates whose amax was an outlier
      (``DelayedScaling.amax_outlier_factor``); ``outlier_ratio``: float32 ``[3]``, the last
      outlier's amax over the amax its scale came from.

    They are plain tensor attributes, not buffers, as in Transformer Engine: data-parallel
    wrappers broadcast buffers from rank 0 (DDP's ``broadcast_buffers``), which would overwrite
    each rank's scales; what makes ranks agree is the amax reduction alone. They travel in
    ``state_dict()`` as this module's extra state (one ``"_extra_state"`` entry: a dict of the
    tensors above plus ``"pending"``, bool ``[3]``, ``"use_fp8"``, bool 0-dim, ``"fp8_gemms"``,
    bool ``[3]``, ``"version"``, int64 0-dim, :data:`STATE_VERSION`, ``"recipe"``, uint8
    ``[n]``, the UTF-8 bytes of the :func:`recipe_key` of the scales, and ``"family"``, uint8
    ``[n]``, the UTF-8 bytes of the FP8 format family they were made for, ``"ocp"`` or
    ``"fnuz"``: :func:`~fp8_plugin.numerics.device_kind.fp8_family`). A state loaded where the
    other family is used has its scales converted at the first cast, by the ratio of the two
    formats' maxima (E4M3: 448 and 240), with a warning; its amax history is kept.

    Loading (``set_extra_state``) checks what it is given before it takes any of it:

    - a state of format version 1 (no ``"version"``: without the outlier counters) loads, the
      counters at zero; a state of version 1 or 2 (no ``"fp8_gemms"``) loads with all three
      GEMMs in FP8; a newer version than :data:`STATE_VERSION` is not read: scaling starts
      afresh, with a warning;
    - a state whose scales belong to another recipe than the one in force at the first cast
      after loading (another scaling method, format or margin, by :func:`recipe_key`) is not
      used: scaling starts afresh then, with a warning naming both recipes (``use_fp8`` is
      kept);
    - a state with missing or unknown entries, wrong shapes or dtypes, or impossible values
      (non-finite or non-positive scales, negative or non-finite amaxes, negative counts)
      raises a ``RuntimeError`` naming the ``state_dict`` key and the fault: a corrupted
      checkpoint is never half-loaded.

    ``use_fp8`` (host-side bool) is the layer's FP8 switch (``FP8Linear.use_fp8``): kept here so
    that a layer moved to high precision (by hand, or by a BF16 reference check's fallback)
    stays there after a checkpoint resume. A state saved without it loads as True.
    ``fp8_gemms`` (host-side tuple of three bools: fprop, dgrad, wgrad) is the layer's per-GEMM
    switch (``FP8Linear.fp8_gemms``), kept for the same reason; False runs that GEMM in high
    precision.

    ``pending`` (host-side) maps each role whose current-step amax has not yet become a scale to
    the recipe that recorded it (None after loading: the recipe in force at the update applies),
    so that a state dict taken mid-step resumes with the same update still to come, without a
    collective at save time.
    """

    def __init__(self, amax_history_len: int = 1024, device: Optional[torch.device] = None) -> None:
        super().__init__()
        # Explicit dtypes: the documented float32 must not follow torch.set_default_dtype.
        self.amax_history = torch.zeros(3, amax_history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones(3, dtype=torch.float32, device=device)
        self.initialized = torch.zeros(3, dtype=torch.bool, device=device)
        self.nonfinite_amax_count = torch.zeros(3, dtype=torch.int64, device=device)
        self.outlier_count = torch.zeros(3, dtype=torch.int64, device=device)
        self.outlier_ratio = torch.zeros(3, dtype=torch.float32, device=device)
        # The fused casts' scratch (numerics/kernels/tensorwise.py): zeros between casts, not saved.
        self.kernel_workspace = torch.zeros(3, 2, dtype=torch.int32, device=device)
        self._kernel_rows: dict[int, tuple[int, StateRows]] = {}  # kernel_rows' cache, by generation
        self._cast_plans: dict[tuple, Any] = {}  # the fused casts' launch plans (kernels/ops.py)
        self._quantizers: dict[tuple, Any] = {}  # make_quantizer's, by recipe identity
        self._forget_initialized()
        self.pending: dict[int, Optional[Recipe]] = {}
        self.use_fp8 = True
        self.fp8_gemms = (True, True, True)
        # recipe_key of the recipe whose scales these are ("" until a layer sets it).
        self.recipe = ""
        self._loaded_recipe: Optional[str] = None  # a loaded state's recipe, until the first cast checks it
        self._loaded_family: Optional[str] = None  # and the format family of its scales
        self._key = "fp8_state._extra_state"  # where load_state_dict found it, for messages
        # A vanilla checkpoint (no FP8 state) loads into a converted model: scaling starts fresh.
        self.register_load_state_dict_post_hook(_allow_missing_scaling_state)

    @property
    def amax_history_len(self) -> int:
        return self.amax_history.shape[1]

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state tensors by name (live, not copies)."""
        return {name: getattr(self, name) for name in _STATE_TENSORS}

    def kernel_rows(self, role: int) -> StateRows:
        """``role``'s rows of the state tensors, as views, made once and kept while the tensors
        are the same: a fused cast then selects nothing on the host (each select is an op, some
        microseconds of CPU per cast). A tensor replaced (a load, a reset, a move, a resized
        history: every one an attribute set, which counts :attr:`generation` up) makes them
        again."""
        generation = self.__dict__.get("_generation", 0)
        cache = self.__dict__.setdefault("_kernel_rows", {})  # a state unpickled from before the cache
        cached = cache.get(role)
        if cached is not None and cached[0] == generation:
            return cached[1]
        rows = StateRows(self.scale[role], self.initialized[role], self.amax_history[role],
                         self.nonfinite_amax_count[role], self.kernel_workspace[role])
        cache[role] = (generation, rows)
        return rows

    @property
    def generation(self) -> int:
        """Counts the replacements of the state tensors (any of them set anew): what the fused
        casts' cached row views and launch plans are checked against."""
        return self.__dict__.get("_generation", 0)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ROW_TENSORS:
            self.__dict__["_generation"] = self.__dict__.get("_generation", 0) + 1
        super().__setattr__(name, value)

    def initialized_known(self, role: int) -> bool:
        """Whether the host knows, without asking the device, that ``role`` holds a scale
        (``initialized[role]`` true): from the flags a fused scale update sends back without a
        wait (:meth:`expect_initialized`), read once their copy has completed. False while
        unknown: a delayed cast then runs its amax pass, which a first cast needs and a later
        one skips (one launch fewer per cast)."""
        known = self.__dict__.get("_initialized_known")
        if known is None:  # a state unpickled from before this bookkeeping
            self._forget_initialized()
            known = self._initialized_known
        if known[role]:
            return True
        probe = self._initialized_probe.get(role)
        if probe is None:
            return False
        host, index, event = probe
        if event is not None and not event.query():
            return False
        del self._initialized_probe[role]
        known[role] = bool(host[index])
        return known[role]

    def expect_initialized(self, role: int, host: torch.Tensor, index: int, event: Any) -> None:
        """``host[index]`` (a CPU tensor) will hold ``role``'s ``initialized`` flag once
        ``event`` (a ``torch.cuda.Event``, or None: already) has completed."""
        self.__dict__.setdefault("_initialized_probe", {})[role] = (host, index, event)

    def __getstate__(self) -> dict[str, Any]:
        # Copies (deepcopy: an EMA model, a reference twin; pickling) leave the host-side caches
        # behind: the row views belong to this state's tensors, and a pending flag copy holds a
        # CUDA event, which cannot be copied. The copy knows nothing yet, which is always safe.
        state = dict(self.__dict__)
        state["_kernel_rows"] = {}
        state["_cast_plans"] = {}
        state["_quantizers"] = {}
        state["_initialized_known"] = [False, False, False]
        state["_initialized_probe"] = {}
        return state

    def _forget_initialized(self) -> None:
        # The state tensors were (re)made: nothing is known of them on the host. Plain
        # attributes, set past nn.Module's __setattr__.
        self.__dict__["_initialized_known"] = [False, False, False]
        self.__dict__["_initialized_probe"] = {}

    def resize_history(self, length: int) -> None:
        """Keep the ``length`` most recent columns, padding older ones with zeros."""
        if length == self.amax_history_len:
            return
        new = self.amax_history.new_zeros(3, length)
        keep = min(length, self.amax_history_len)
        new[:, :keep] = self.amax_history[:, :keep]
        self.amax_history = new

    def record_amax(self, role: int, amax: torch.Tensor) -> None:
        """Fold ``amax`` (float32 0-dim) into the current step's slot; non-finite values are
        counted, not recorded, so that one overflow cannot freeze the scale for a whole history."""
        with torch.no_grad():  # not a decorator: torch.compile cannot trace a decorated method inside autograd.Function
            finite = torch.isfinite(amax)
            self.nonfinite_amax_count[role] += (~finite).to(torch.int64)
            slot = self.amax_history[role, 0]
            slot.copy_(torch.where(finite, torch.maximum(slot, amax), slot))

    def observe_current(self, role: int, amax: torch.Tensor, scale: torch.Tensor) -> None:
        """Store the amax and scale of a current-scaling cast, for statistics; a non-finite
        amax is counted and not stored (the slot keeps the last finite one), as in
        :meth:`record_amax`, so the state stays finite whichever recipe reads it next."""
        with torch.no_grad():
            finite = torch.isfinite(amax)
            self.nonfinite_amax_count[role] += (~finite).to(torch.int64)
            self.amax_history[role, 0] = torch.where(finite, amax, self.amax_history[role, 0])
            self.scale[role] = scale

    def get_extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {name: t.detach().clone() for name, t in self.tensors().items()}
        state["pending"] = torch.tensor([role in self.pending for role in range(len(ROLES))])
        state["use_fp8"] = torch.tensor(self.use_fp8)
        state["fp8_gemms"] = torch.tensor(self.fp8_gemms)
        # Tensors only, as every entry: checkpoint formats that take tensors alone carry them too.
        state["version"] = torch.tensor(STATE_VERSION, dtype=torch.int64)
        state["recipe"] = torch.tensor(list(self.recipe.encode()), dtype=torch.uint8)
        # The scales' family: a loaded state not yet cast (so not yet converted) keeps its own.
        family = getattr(self, "_loaded_family", None) or fp8_family(self.device)
        state["family"] = torch.tensor(list(family.encode()), dtype=torch.uint8)
        return state

    def set_extra_state(self, state: dict[str, Any]) -> None:
        version = check_saved_state(state, self._key)
        if version > STATE_VERSION:
            warnings.warn(
                f"{self._key}: FP8 scaling state of format version {version}, written by a newer fp8-plugin "
                f"(this one reads versions up to {STATE_VERSION}); it is not used: this layer's scales start "
                "afresh (they settle within the first training step)",
                stacklevel=2,
            )
            self.reset()
            return
        use_fp8 = bool(state["use_fp8"]) if "use_fp8" in state else True
        # Versions 1 and 2 had no per-GEMM switch: every GEMM in FP8.
        fp8_gemms = tuple(bool(v) for v in state["fp8_gemms"].tolist()) if "fp8_gemms" in state else (True,) * 3
        saved_recipe = _recipe_text(state.get("recipe"))
        device = self.device
        for name in _STATE_TENSORS:
            if name not in state:  # format version 1: no outlier counters yet
                setattr(self, name, torch.zeros_like(getattr(self, name)))
                continue
            # A checkpoint written with another amax_history_len restores its own length.
            setattr(self, name, state[name].detach().to(device=device, dtype=getattr(self, name).dtype).clone())
        self._forget_initialized()
        # Which recipe recorded them is not saved: the one in force at the next update applies.
        self.pending = {role: None for role, flag in enumerate(state["pending"].tolist()) if flag}
        self.use_fp8 = use_fp8
        self.fp8_gemms = fp8_gemms
        self.recipe = saved_recipe or self.recipe
        # The recipe in force is known at the first cast (an autocast may override the layer's).
        self._loaded_recipe = saved_recipe or None
        # The scales' format family (states before version 4: OCP), checked at the first cast too.
        self._loaded_family = _recipe_text(state.get("family")) or "ocp"

    def use_recipe(self, recipe: Recipe) -> None:
        """Called by every cast with the recipe in force: the first cast after a load drops
        (with a warning) saved scales that belong to another recipe, by :func:`recipe_key`."""
        if self._loaded_recipe is None and getattr(self, "_loaded_family", None) is None:
            return
        saved, self._loaded_recipe = self._loaded_recipe, None
        family, self._loaded_family = getattr(self, "_loaded_family", None), None
        key = recipe_key(recipe)
        if saved is not None and key != saved:
            warnings.warn(
                f"{self._key}: the checkpoint's FP8 scales belong to {saved}, this layer now runs {key}; they "
                "are not used: this layer's scales start afresh (they settle within the first training step)",
                stacklevel=3,
            )
            self.reset(recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1)
            self.recipe = key
            return
        if family is not None and family != fp8_family(self.device):
            self._convert_family(recipe, family, fp8_family(self.device))

    def _convert_family(self, recipe: Recipe, saved: str, here: str) -> None:
        # Scales made for one format family, used with the other (an OCP checkpoint resumed on
        # an MI300, or the reverse): the amaxes are in the data's own units and stay; each scale
        # is FP8_MAX / amax / 2**margin, so it moves by the ratio of the two maxima (E4M3: 448
        # and 240; E5M2: 57344 both). Kept rather than refused: the history is what delayed
        # scaling has learnt, and a fresh start would need the first steps to relearn it.
        ratios = [fp8_max(fp8_dtype(recipe.fp8_format, backward=role == GRAD_OUTPUT, family=here))
                  / fp8_max(fp8_dtype(recipe.fp8_format, backward=role == GRAD_OUTPUT, family=saved))
                  for role in range(len(ROLES))]
        with torch.no_grad():
            self.scale.mul_(torch.tensor(ratios, dtype=torch.float32, device=self.device))
        warnings.warn(
            f"{self._key}: the checkpoint's FP8 scales were made for the {saved.upper()} formats, this device "
            f"uses {here.upper()}: the scales were converted by the ratio of the formats' maxima "
            f"({', '.join(f'{r:.6g}' for r in ratios)} for input, weight, grad_output); the amax history is kept",
            stacklevel=4,
        )

    def reset(self, amax_history_len: Optional[int] = None) -> None:
        """Forget every amax and scale (as a new layer's state); the history keeps its length
        unless ``amax_history_len`` is given. ``use_fp8`` and ``fp8_gemms`` stay."""
        fresh = ScalingState(amax_history_len or self.amax_history_len, device=self.device)
        for name in _STATE_TENSORS:
            setattr(self, name, getattr(fresh, name))
        self._forget_initialized()
        self.pending = {}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._key = f"{prefix}_extra_state"
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def follow(self, device: torch.device) -> None:
        """Move the state to ``device`` (a layer whose weights moved without ``Module.to``)."""
        for name, t in self.tensors().items():
            setattr(self, name, t.to(device))
        self.kernel_workspace = self.kernel_workspace.to(device)

    def _apply(self, fn, recurse=True):
        # ``model.to(torch.bfloat16)`` must not round amaxes and scales: follow the device only.
        device = fn(torch.empty(0, device=self.device)).device
        if device != self.device:
            self.follow(device)
        return self


_STATE_TENSORS = ("amax_history", "scale", "initialized", "nonfinite_amax_count", "outlier_count", "outlier_ratio")
# The tensors a fused cast reads or writes through cached row views (ScalingState.kernel_rows).
_ROW_TENSORS = frozenset(_STATE_TENSORS) | {"kernel_workspace"}
# Format of the saved scaling state: 1 had no "version", "recipe" or outlier counters, 2 no
# "fp8_gemms", 3 no "family" (the FP8 format family the scales were made for: "ocp" or "fnuz").
STATE_VERSION = 4
_VERSION_1_ENTRIES = frozenset({"amax_history", "scale", "initialized", "nonfinite_amax_count", "pending"})
_VERSION_2_ENTRIES = frozenset({*_STATE_TENSORS, "pending", "use_fp8", "version", "recipe"})
_VERSION_3_ENTRIES = _VERSION_2_ENTRIES | {"fp8_gemms"}
_ENTRIES = _VERSION_3_ENTRIES | {"family"}
# The shape of each saved tensor, "L" standing for the history length.
_SHAPES = {"amax_history": (3, "L"), "scale": (3,), "initialized": (3,), "nonfinite_amax_count": (3,),
           "outlier_count": (3,), "outlier_ratio": (3,), "pending": (3,), "use_fp8": (), "fp8_gemms": (3,)}


def recipe_key(recipe: Recipe) -> str:
    """What makes a layer's saved scales valid for a recipe: its scaling method, format and
    margin (``"DelayedScaling(HYBRID, margin=0)"``); history length and algorithm may differ."""
    if torch.compiler.is_compiling():  # traced: the string is a constant of the graph, no cache
        return _recipe_key(recipe)
    try:
        return _cached_recipe_key(recipe)
    except TypeError:  # an unhashable field (a callable amax_compute_algo object)
        return _recipe_key(recipe)


def _recipe_key(recipe: Recipe) -> str:
    return f"{type(recipe).__name__}({recipe.fp8_format.name}, margin={recipe.margin})"


# Every cast asks for its recipe's key: format it once per recipe.
_cached_recipe_key = functools.lru_cache(maxsize=256)(_recipe_key)


def _recipe_text(saved: Any) -> str:
    # The recipe key as saved: UTF-8 bytes in a uint8 tensor (absent before version 2).
    if saved is None:
        return ""
    if isinstance(saved, str):
        return saved
    if isinstance(saved, torch.Tensor) and saved.dtype == torch.uint8 and saved.dim() == 1:
        return bytes(saved.tolist()).decode()
    raise TypeError(f"recipe entry {saved!r}")


def check_saved_state(state: Any, key: str) -> int:
    """The format version of a saved scaling state, after checking it is whole and sane.

    Raises:
        RuntimeError: naming ``key`` and what is wrong.
    """
    def fail(problem: str) -> RuntimeError:
        return RuntimeError(
            f"{key}: the FP8 scaling state in the checkpoint is corrupted ({problem}); nothing of it was loaded. "
            "To resume without it, drop the FP8 state (fp8_plugin.split_fp8_state for a model state_dict; the "
            "'FP8Precision' entry of a Lightning checkpoint): scaling then starts afresh"
        )

    if not isinstance(state, dict):
        raise fail(f"a {type(state).__name__}, not a dict")
    version = state.get("version", 1)
    if isinstance(version, torch.Tensor) and version.numel() == 1 and not version.is_floating_point():
        version = int(version)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise fail(f"version {version!r}")
    if version > STATE_VERSION:
        return version
    required = {1: _VERSION_1_ENTRIES, 2: _VERSION_2_ENTRIES - {"use_fp8"},
                3: _VERSION_3_ENTRIES - {"use_fp8"}}.get(version, _ENTRIES - {"use_fp8"})
    allowed = {2: _VERSION_2_ENTRIES, 3: _VERSION_3_ENTRIES}.get(version, _ENTRIES)
    if not required <= set(state) <= allowed:
        raise fail(f"entries {sorted(state)}; expected {sorted(required)}, optionally 'use_fp8'")
    try:
        _recipe_text(state.get("recipe"))
        family = _recipe_text(state.get("family"))
    except (TypeError, ValueError):
        raise fail(f"recipe {state.get('recipe')!r} or family {state.get('family')!r}") from None
    if family and family not in FAMILIES:
        raise fail(f"family {family!r}; valid: {', '.join(FAMILIES)}")
    for name, shape in _SHAPES.items():
        if name not in state:
            continue
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise fail(f"{name} is a {type(t).__name__}, not a tensor")
        length = t.shape[1] if name == "amax_history" and t.dim() == 2 else None
        want = tuple(length if d == "L" else d for d in shape)
        if tuple(t.shape) != want or (length is not None and length < 1):
            raise fail(f"{name} has shape {list(t.shape)}, expected {[*shape]}")
        if t.is_floating_point() or t.is_complex():
            values = t.detach().to(torch.float64)
            if name in ("scale",) and not bool(((values > 0) & torch.isfinite(values)).all()):
                raise fail(f"{name} {t.tolist()} is not all finite and > 0")
            if name in ("amax_history", "outlier_ratio") and not bool(((values >= 0) & torch.isfinite(values)).all()):
                raise fail(f"{name} holds negative or non-finite values")
        elif name.endswith("_count") and bool((t < 0).any()):
            raise fail(f"{name} {t.tolist()} is negative")
    if not state["scale"].is_floating_point():
        raise fail(f"scale has dtype {state['scale'].dtype}, not a floating dtype")
    return version


def _allow_missing_scaling_state(module: nn.Module, incompatible_keys) -> None:
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if not is_scaling_state_key(k)]


def is_scaling_state_key(key: str) -> bool:
    """Whether a ``state_dict`` key holds FP8 scaling state (``...fp8_state._extra_state``)."""
    head, _, leaf = key.rpartition(".")
    return leaf == "_extra_state" and (head == "fp8_state" or head.endswith(".fp8_state"))


class PerTensorQuantizer(Quantizer):
    """One scale for the whole tensor, from the recipe: delayed (history) or current (this tensor).

    Args:
        recipe: a :class:`~fp8_plugin.numerics.recipes.DelayedScaling` or
            :class:`~fp8_plugin.numerics.recipes.Float8CurrentScaling`.
        role: row of ``state``: 0 input, 1 weight, 2 grad_output.
        state: the layer's :class:`ScalingState`.
        record: True for training casts: the amax enters the state (delayed scaling: the
            current-step slot of the history, marked pending until the next scale update;
            current scaling: the statistics). False (evaluation, recomputation) leaves the state
            untouched, as Transformer Engine does for forwards without grad.
        host: False leaves the state's host-side records (the recipe check of
            :meth:`ScalingState.use_recipe` before the cast, :func:`mark_recorded` after it) to
            the caller, which does them outside a traced region: ``torch.compile`` cannot trace
            Python side effects inside ``autograd.Function`` (FP8 layers cast so).
    """

    def __init__(self, recipe: Recipe, role: int, state: ScalingState, record: bool = True, *, host: bool = True) -> None:
        self.recipe = recipe
        self.role = role
        self.state = state
        self.record = record
        self.host = host
        # The device's format family: FNUZ on an AMD MI300 (numerics/formats.py).
        self.dtype = fp8_dtype(recipe.fp8_format, backward=role == GRAD_OUTPUT, family=fp8_family(state.device))
        self.max = fp8_max(self.dtype)

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        if fusable(x, self.dtype):
            return self._fused(x, columnwise=False)[0]
        if self.host:
            self.state.use_recipe(self.recipe)
        with torch.no_grad():  # not a decorator: torch.compile cannot trace a decorated method inside autograd.Function
            amax = tensor_amax(x)
            one = torch.ones((), dtype=torch.float32, device=x.device)
            current = scale_from_amax(amax, self.max, self.recipe.margin, one)
            if self.recipe.delayed():
                # First step of a tensor: no history yet, so scale from its own amax.
                role = self.role
                scale = torch.where(self.state.initialized[role], self.state.scale[role], current)
                if self.record:
                    self.state.record_amax(role, amax)
            else:
                scale = current
                if self.record:
                    self.state.observe_current(self.role, amax, scale)
            q = QuantizedTensor(quantize(x, scale, self.dtype), divide(1.0, scale))
        if self.record and self.host:
            mark_recorded(self.state, self.recipe, self.role)
        return q

    def quantize_pair(self, x: torch.Tensor, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        if fusable(x, self.dtype):
            return self._fused(x, columnwise)
        return super().quantize_pair(x, columnwise)

    def quantize_pair_and_sum(self, x: torch.Tensor, columnwise: bool
                              ) -> tuple[QuantizedTensor, Optional[QuantizedTensor], torch.Tensor]:
        if fusable(x, self.dtype):
            return self._fused(x, columnwise, bias_grad=True)
        return super().quantize_pair_and_sum(x, columnwise)

    def _fused(self, x: torch.Tensor, columnwise: bool, bias_grad: bool = False):
        # The same numerics as quantize() and its transposed copy, and the same scaling state
        # afterwards, bit for bit, in two launches (numerics/kernels/tensorwise.py): delayed
        # scaling reads x once in the steady state (its amax folded into the cast), current
        # scaling twice (amax, then the cast); the scale is chosen or computed on the device and
        # the amax recorded by the cast's last program. With bias_grad, also x.sum(0) in float32.
        from .kernels import ops

        if self.host:
            self.state.use_recipe(self.recipe)
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if ops.traced(x2d):
            cast = ops.cast_delayed if self.recipe.delayed() else ops.cast_current
            with torch.no_grad():
                data, data_t, scale_inv, bias = cast(x2d, self.state, self.role, self.dtype, self.recipe.margin,
                                                        transpose=columnwise, record=self.record, bias_grad=bias_grad)
        else:  # the launches record nothing for autograd: no no_grad context to enter
            data, data_t, scale_inv, bias = ops.eager_cast(
                "delayed" if self.recipe.delayed() else "current", x2d, self.state, self.role, self.dtype,
                self.recipe.margin, columnwise, self.record, bias_grad)
        if self.record and self.host:
            mark_recorded(self.state, self.recipe, self.role)
        row = QuantizedTensor(data, scale_inv)
        col = QuantizedTensor(data_t, scale_inv) if columnwise else None
        return (row, col, bias) if bias_grad else (row, col)


class BlockQuantizer(Quantizer):
    """Block-scaled casts: MXFP8 (1x32, E8M0 scales) or 128-blockwise (1x128 / 128x128, FP32).

    The tensor's overall amax and non-finite events still go to ``state`` for statistics.

    Args:
        recipe: :class:`~fp8_plugin.numerics.recipes.MXFP8BlockScaling` or
            :class:`~fp8_plugin.numerics.recipes.Float8BlockScaling`.
        role: 0 input, 1 weight, 2 grad_output.
        state: the layer's :class:`ScalingState`.
        record, host: as in :class:`PerTensorQuantizer` (here only statistics are recorded).
    """

    def __init__(self, recipe: Recipe, role: int, state: ScalingState, record: bool = True, *, host: bool = True) -> None:
        self.recipe = recipe
        self.role = role
        self.state = state
        self.record = record
        self.host = host
        family = fp8_family(state.device)
        if family == "fnuz":
            raise ValueError(
                f"{type(recipe).__name__} on {state.device} (an AMD MI300: FNUZ FP8 formats) is not supported: "
                "MI300 has no block-scaled FP8 GEMMs; valid there: DelayedScaling, Float8CurrentScaling "
                "(per-tensor scaling in E4M3FNUZ / E5M2FNUZ)")
        self.dtype = fp8_dtype(recipe.fp8_format, backward=role == GRAD_OUTPUT)
        if isinstance(recipe, MXFP8BlockScaling):
            self.block, self.qparams = (1, 32), None
        else:
            dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim)
            params = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
            self.block = (128, 128) if dims[role] == 2 else (1, 128)
            self.qparams = params[role]

    def _cast(self, x: torch.Tensor) -> tuple[QuantizedTensor, torch.Tensor]:
        with torch.no_grad():
            amax = block_amax(x, self.block)
            if self.qparams is None:
                scale_inv = mx_scale_inv(amax, self.dtype)
                scale = divide(1.0, scale_inv)  # exact: powers of two
            else:
                scale = blockwise_scale(amax, self.dtype, self.qparams.power_2_scale, self.qparams.amax_epsilon)
                scale_inv = divide(1.0, scale)
            return QuantizedTensor(quantize_blocks(x, scale, self.block, self.dtype), scale_inv, self.block), amax

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        if self._fusable(x):
            return self._fused(x, columnwise=False, record=False)[0]
        return self._cast(x)[0]

    def quantize_pair(self, x: torch.Tensor, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        if self.host:
            self.state.use_recipe(self.recipe)
        if self._fusable(x):
            row, col = self._fused(x, columnwise, self.record)
        else:
            row, amax = self._cast(x)
            # The tensor's amax is the max of its block amaxes: no second pass over x.
            if self.record:
                self.state.observe_current(self.role, amax.amax(), torch.ones((), device=x.device))
            col = self.quantize(x.t()) if columnwise else None
        if self.record and self.host:
            mark_recorded(self.state, self.recipe, self.role)
        return row, col

    def _fusable(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and self.block in ((1, 32), (1, 128), (128, 128)) and fusable(x, self.dtype)

    def _fused(self, x: torch.Tensor, columnwise: bool, record: bool
               ) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        # The torch ops of _cast (and of the columnwise copy, the cast of x.T) in one pass
        # (numerics/kernels/blockwise.py), bit for bit; the amax recorded by the kernel.
        from .kernels import ops

        params = self.qparams
        with torch.no_grad():
            data, scale_inv, data_t, scale_inv_t, gemm, gemm_t = ops.cast_blocks(
                x, self.state, self.role, self.dtype, self.block, mx=params is None,
                power_2_scale=bool(params and params.power_2_scale), amax_epsilon=params.amax_epsilon if params else 0.0,
                transpose=columnwise, record=record)
        row = QuantizedTensor(data, scale_inv, self.block, gemm)
        return row, (QuantizedTensor(data_t, scale_inv_t, self.block, gemm_t) if columnwise else None)


def mark_recorded(state: ScalingState, recipe: Recipe, role: int) -> None:
    """The host-side half of a recording cast of ``role`` under ``recipe``: a delayed-scaling
    amax becomes pending (its scale update is due), and the state now belongs to ``recipe``."""
    if recipe.delayed():
        state.pending[role] = recipe
    key = recipe_key(recipe)
    if state.recipe != key:  # nn.Module's __setattr__ costs microseconds per cast
        state.recipe = key


def make_quantizer(recipe: Recipe, role: int, state: ScalingState, record: bool = True, *, host: bool = True) -> Quantizer:
    """The quantizer a recipe uses for one role of one layer (``record`` and ``host`` as in
    :class:`PerTensorQuantizer`). Made once per (recipe object, role, flags) and kept by the
    state while its tensors are the same (a quantizer holds nothing else): a training step asks
    for three, and building one costs microseconds of host time. Under ``torch.compile`` made
    anew (a cache would be guarded on)."""
    if torch.compiler.is_compiling():
        return _new_quantizer(recipe, role, state, record, host)
    cache = state.__dict__.setdefault("_quantizers", {})  # a state unpickled from before the cache
    # By the recipe's identity (hashing a recipe hashes every field), checked against the kept one;
    # and by what a meta or CPU device presents (a quantizer's formats follow the device's family).
    key = (id(recipe), role, record, host, presented_device())
    kept = cache.get(key)
    if kept is not None and kept[0] is recipe and kept[1] == state.generation:
        return kept[2]
    quantizer = _new_quantizer(recipe, role, state, record, host)
    if len(cache) >= 32:  # recipes made anew for each step: keep the newest few
        cache.clear()
    cache[key] = (recipe, state.generation, quantizer)
    return quantizer


def _new_quantizer(recipe: Recipe, role: int, state: ScalingState, record: bool, host: bool) -> Quantizer:
    if isinstance(recipe, (MXFP8BlockScaling, Float8BlockScaling)):
        return BlockQuantizer(recipe, role, state, record, host=host)
    return PerTensorQuantizer(recipe, role, state, record, host=host)


def update_delayed_scaling(
    groups: Iterable[tuple[DelayedScaling, int, list[ScalingState]]],
    reduce_amax: Optional[Callable[[torch.Tensor], None]] = None,
    tables: Optional[dict] = None,
) -> None:
    """Update the scales of every pending (recipe, role, states) group and roll their histories.

    All current-step amaxes are first gathered into one flat float32 tensor, so that one call to
    ``reduce_amax`` (an in-place MAX all-reduce in distributed runs) covers the whole step. Then,
    per group: ``amax = recipe.reduce_history(history)``, ``scale = (FP8_MAX / amax) /
    2 ** margin`` (kept where amax is 0 or not finite), and the history shifts by one step with
    a zeroed current slot. Each group costs a fixed number of batched kernels, not one per layer.
    Before the scale is computed, a current-step amax beyond ``recipe.amax_outlier_factor``
    times the amax the previous scale came from is counted and kept, clipped or skipped, as
    ``recipe.amax_outlier_policy`` says: after the reduction, so every rank decides alike.

    Where the fused kernels run (:func:`~fp8_plugin.numerics.kernels.fused_casts`), every row of
    every group is updated by :func:`~fp8_plugin.numerics.kernels.scale_update.bulk_update` in
    at most two launches plus the reduction, with the same numerics; ``tables`` (a dict the
    caller keeps, one per model) caches its device tables between steps. A callable
    ``amax_compute_algo`` keeps the torch ops.
    """
    with torch.no_grad():
        groups = [g for g in groups if g[2]]
        if not groups:
            return
        if fused_casts(groups[0][2][0].device)[0]:
            from .kernels import ops, scale_update  # noqa: F401  (ops: registers the update's custom ops)

            if all(scale_update.supported(recipe) for recipe, _, _ in groups):
                rows = [(recipe, role, state) for recipe, role, states in groups for state in states]
                scale_update.bulk_update(rows, reduce_amax, tables)
                return
        histories = [torch.stack([s.amax_history[role] for s in states]) for _, role, states in groups]
        if reduce_amax is not None:
            current = torch.cat([h[:, 0] for h in histories])
            reduce_amax(current)
            for h, part in zip(histories, current.split([h.shape[0] for h in histories])):
                h[:, 0] = part
        for (recipe, role, states), history in zip(groups, histories):
            dtype = fp8_dtype(recipe.fp8_format, backward=role == GRAD_OUTPUT, family=fp8_family(states[0].device))
            previous = torch.stack([s.scale[role] for s in states])
            _handle_outliers(recipe, role, states, history, previous, fp8_max(dtype))
            amax = recipe.reduce_history(history)
            scale = scale_from_amax(amax, fp8_max(dtype), recipe.margin, previous)
            initialized = torch.stack([s.initialized[role] for s in states]) | (
                (amax > 0) & torch.isfinite(amax)
            )
            history = history.roll(1, dims=1)
            history[:, 0] = 0.0
            torch._foreach_copy_([s.amax_history[role] for s in states], list(history.unbind(0)))
            torch._foreach_copy_([s.scale[role] for s in states], list(scale.unbind(0)))
            torch._foreach_copy_([s.initialized[role] for s in states], list(initialized.unbind(0)))


def _handle_outliers(recipe: DelayedScaling, role: int, states: list[ScalingState], history: torch.Tensor,
                     previous: torch.Tensor, max_value: float) -> None:
    # The amax the previous scale was computed from, recovered from the scale itself: the
    # history may be a single (already rolled) column, and the scale is what casts use.
    bound = divide(max_value, previous) / (2.0**recipe.margin)
    current = history[:, 0]
    initialized = torch.stack([s.initialized[role] for s in states])
    factor = float(recipe.amax_outlier_factor)
    outlier = initialized & torch.isfinite(current) & (current > factor * bound)
    ratio = current / bound
    if recipe.amax_outlier_policy == "clip":
        history[:, 0] = torch.where(outlier, factor * bound, current)
    elif recipe.amax_outlier_policy == "skip":
        history[:, 0] = torch.where(outlier, torch.zeros_like(current), current)
    counts = torch.stack([s.outlier_count[role] for s in states]) + outlier.to(torch.int64)
    ratios = torch.where(outlier, ratio, torch.stack([s.outlier_ratio[role] for s in states]))
    torch._foreach_copy_([s.outlier_count[role] for s in states], list(counts.unbind(0)))
    torch._foreach_copy_([s.outlier_ratio[role] for s in states], list(ratios.unbind(0)))
