"""A layer's FP8 scaling state (:class:`ScalingState`): amax history, scales, counters, the
switches, and the extra state that carries them through ``state_dict()``, checked on load."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import nn

from ..device_kind import fp8_family
from ..formats import FAMILIES, fp8_dtype, fp8_max
from ..kernels.rows import StateRows, rows_changed
from ..recipes import DelayedScaling, Recipe, kept_per_recipe
from .tensor import GRAD_OUTPUT, INPUT, ROLES

__all__ = ["ScalingState", "is_scaling_state_key", "recipe_key", "check_saved_state", "STATE_VERSION", "SCALINGS"]

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
    ``"fnuz"``: :func:`~fp8_plugin.numerics.device_kind.fp8_family`; and ``"scaling"``, uint8
    ``[n]``, the UTF-8 bytes of the layer's scaling choice, one of :data:`SCALINGS`). A state loaded where the
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
    precision. ``scaling`` (host-side str, one of :data:`SCALINGS`) is the layer's scaling
    choice (``FP8Linear.fp8_scaling``): ``"recipe"`` casts as the recipe in force says,
    ``"blockwise"`` casts with 1x128 / 128x128 blocks where that recipe scales per tensor
    (the choice :func:`fp8_plugin.calibrate` makes for a layer whose activations hold outliers);
    a state saved before format version 5 loads as ``"recipe"``.

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
        self.scaling = "recipe"
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
            rows_changed()
        super().__setattr__(name, value)

    def take_pending(self) -> dict[int, Optional[Recipe]]:
        """The pending amaxes' roles and recipes (:attr:`pending`), leaving none pending: what a
        scale update consumes, once per layer and step (past ``nn.Module.__setattr__``, a few
        microseconds of CPU each time)."""
        pending = self.pending
        self.__dict__["pending"] = {}
        return pending

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

    @property
    def input_source(self) -> "ScalingState":
        """The state whose input row this layer's input casts use: its own, or, while the layer
        takes another layer's cast of their common input (:meth:`share_input_of`), that layer's."""
        source = self.__dict__.get("_input_source")
        return self if source is None else source.input_source

    def share_input_of(self, leader: "ScalingState") -> None:
        """Use ``leader``'s input row (amax history, scale, counters) for this layer's input from
        now on: the layer takes ``leader``'s cast of an input both read
        (:mod:`fp8_plugin.modules.shared_input`), so ``leader`` records that input's amaxes.
        A plain attribute, not a submodule: ``state_dict`` and ``modules()`` do not see it."""
        self.__dict__["_input_source"] = None if leader is self else leader.input_source

    def stop_sharing_input(self) -> None:
        """Cast this layer's input itself again, from the input row of the state it shared: that
        row is copied into its own (on the device), as its own would be had it recorded the same
        amaxes, with the update it has pending."""
        source = self.__dict__.pop("_input_source", None)
        if source is None:
            return
        with torch.no_grad():
            _copy_input_row({name: getattr(self, name) for name in _STATE_TENSORS}, source)
        self.pending = _pending_with_input_of(self.pending, source)
        self._forget_initialized()  # the host knows nothing of the copied flag yet

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
        source = state.pop("_input_source", None)
        if source is not None:  # a copy stands alone: the shared input row becomes its own
            with torch.no_grad():
                tensors = {name: state[name].clone() for name in _STATE_TENSORS}
                _copy_input_row(tensors, source)
            state.update(tensors)
            state["pending"] = _pending_with_input_of(self.pending, source)
        return state

    def _forget_initialized(self) -> None:
        # The state tensors were (re)made: nothing is known of them on the host. Plain
        # attributes, set past nn.Module's __setattr__.
        self.__dict__["_initialized_known"] = [False, False, False]
        self.__dict__["_initialized_probe"] = {}
        rows_changed()

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

    def observe_current(self, role: int, amax: torch.Tensor, scale: torch.Tensor, *, versioned: bool = True) -> None:
        """Store the amax and scale of a current-scaling cast, for statistics; a non-finite
        amax is counted and not stored (the slot keeps the last finite one), as in
        :meth:`record_amax`, so the state stays finite whichever recipe reads it next.
        ``versioned=False`` writes the scale without bumping ``scale._version`` (as the fused
        kernels write it): the experts' own-amax token rows under delayed scaling, whose weight
        casts are cached on the version of the weights' delayed scales."""
        with torch.no_grad():
            finite = torch.isfinite(amax)
            self.nonfinite_amax_count[role] += (~finite).to(torch.int64)
            self.amax_history[role, 0] = torch.where(finite, amax, self.amax_history[role, 0])
            # ``.data`` is the same storage with a version counter of its own.
            (self.scale if versioned or torch.compiler.is_compiling() else self.scale.data)[role] = scale

    def get_extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {name: t.detach().clone() for name, t in self.tensors().items()}
        pending, source = self.pending, self.input_source
        if source is not self:  # a shared input: its row as this layer's own would hold it
            _copy_input_row(state, source)
            pending = _pending_with_input_of(pending, source)
        state["pending"] = torch.tensor([role in pending for role in range(len(ROLES))])
        state["use_fp8"] = torch.tensor(self.use_fp8)
        state["fp8_gemms"] = torch.tensor(self.fp8_gemms)
        state["scaling"] = torch.tensor(list(self.scaling.encode()), dtype=torch.uint8)
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
        scaling = _recipe_text(state.get("scaling")) or "recipe"  # versions 1 to 4: as the recipe says
        device = self.device
        for name in _STATE_TENSORS:
            if name not in state:  # format version 1: no outlier counters yet
                setattr(self, name, torch.zeros_like(getattr(self, name)))
                continue
            # A checkpoint written with another amax_history_len restores its own length.
            setattr(self, name, state[name].detach().to(device=device, dtype=getattr(self, name).dtype).clone())
        self._forget_initialized()
        self.__dict__.pop("_input_source", None)  # the loaded input row is this layer's own
        # Which recipe recorded them is not saved: the one in force at the next update applies.
        self.pending = {role: None for role, flag in enumerate(state["pending"].tolist()) if flag}
        self.use_fp8 = use_fp8
        self.fp8_gemms = fp8_gemms
        self.scaling = scaling
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
        self.__dict__.pop("_input_source", None)
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


def _copy_input_row(tensors: dict[str, torch.Tensor], source: ScalingState) -> None:
    # The input row of each state tensor in ``tensors`` set to ``source``'s (in place); an amax
    # history of another length keeps the most recent columns both have, zeros beyond.
    for name, mine in tensors.items():
        theirs = getattr(source, name)[INPUT].to(mine.device)
        if name == "amax_history":
            keep = min(mine.shape[1], theirs.shape[0])
            mine[INPUT].zero_()
            mine[INPUT, :keep] = theirs[:keep]
        else:
            mine[INPUT] = theirs


def _pending_with_input_of(pending: dict[int, Optional[Recipe]], source: ScalingState) -> dict[int, Optional[Recipe]]:
    # ``pending`` with the input role's entry (an update due, or none) taken from ``source``.
    merged = {role: recipe for role, recipe in pending.items() if role != INPUT}
    if INPUT in source.pending:
        merged[INPUT] = source.pending[INPUT]
    return merged


_STATE_TENSORS = ("amax_history", "scale", "initialized", "nonfinite_amax_count", "outlier_count", "outlier_ratio")
# The tensors a fused cast reads or writes through cached row views (ScalingState.kernel_rows).
_ROW_TENSORS = frozenset(_STATE_TENSORS) | {"kernel_workspace"}
# Format of the saved scaling state: 1 had no "version", "recipe" or outlier counters, 2 no
# "fp8_gemms", 3 no "family" (the FP8 format family the scales were made for: "ocp" or "fnuz"),
# 4 no "scaling" (the layer's scaling choice).
STATE_VERSION = 5
#: A layer's scaling choices (``ScalingState.scaling``): as the recipe in force says, or 1x128
#: activation and gradient blocks with 128x128 weight blocks where that recipe scales per tensor.
SCALINGS = ("recipe", "blockwise")
_VERSION_1_ENTRIES = frozenset({"amax_history", "scale", "initialized", "nonfinite_amax_count", "pending"})
_VERSION_2_ENTRIES = frozenset({*_STATE_TENSORS, "pending", "use_fp8", "version", "recipe"})
_VERSION_3_ENTRIES = _VERSION_2_ENTRIES | {"fp8_gemms"}
_VERSION_4_ENTRIES = _VERSION_3_ENTRIES | {"family"}
_ENTRIES = _VERSION_4_ENTRIES | {"scaling"}
# The shape of each saved tensor, "L" standing for the history length.
_SHAPES = {"amax_history": (3, "L"), "scale": (3,), "initialized": (3,), "nonfinite_amax_count": (3,),
           "outlier_count": (3,), "outlier_ratio": (3,), "pending": (3,), "use_fp8": (), "fp8_gemms": (3,)}


def recipe_key(recipe: Recipe) -> str:
    """What makes a layer's saved scales valid for a recipe: its scaling method, format and
    margin (``"DelayedScaling(HYBRID, margin=0)"``); history length and algorithm may differ."""
    if torch.compiler.is_compiling():  # traced: the string is a constant of the graph, no cache
        return _recipe_key(recipe)
    return kept_per_recipe(_recipe_keys, recipe, _recipe_key, limit=256)  # every cast asks


def _recipe_key(recipe: Recipe) -> str:
    return f"{type(recipe).__name__}({recipe.fp8_format.name}, margin={recipe.margin})"


_recipe_keys: dict[int, tuple[Recipe, str]] = {}


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
    required = {1: _VERSION_1_ENTRIES, 2: _VERSION_2_ENTRIES - {"use_fp8"}, 3: _VERSION_3_ENTRIES - {"use_fp8"},
                4: _VERSION_4_ENTRIES - {"use_fp8"}}.get(version, _ENTRIES - {"use_fp8"})
    allowed = {2: _VERSION_2_ENTRIES, 3: _VERSION_3_ENTRIES, 4: _VERSION_4_ENTRIES}.get(version, _ENTRIES)
    if not required <= set(state) <= allowed:
        raise fail(f"entries {sorted(state)}; expected {sorted(required)}, optionally 'use_fp8'")
    try:
        _recipe_text(state.get("recipe"))
        family = _recipe_text(state.get("family"))
        scaling = _recipe_text(state.get("scaling"))
    except (TypeError, ValueError):
        raise fail(f"recipe {state.get('recipe')!r}, family {state.get('family')!r} or scaling "
                   f"{state.get('scaling')!r}") from None
    if family and family not in FAMILIES:
        raise fail(f"family {family!r}; valid: {', '.join(FAMILIES)}")
    if scaling and scaling not in SCALINGS:
        raise fail(f"scaling {scaling!r}; valid: {', '.join(SCALINGS)}")
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
