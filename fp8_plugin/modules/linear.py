"""``FP8Linear``: an ``nn.Linear`` whose GEMMs run in FP8 inside :func:`fp8_plugin.autocast`.

Forward: input and weight are cast to the recipe's forward format (E4M3) with the recipe's
scales and multiplied by an FP8 GEMM with FP32 accumulation; the bias is added in high
precision. Backward: grad_output is cast to the backward format (E5M2 under HYBRID), and dgrad
(``grad_output @ W``) and wgrad (``grad_output.T @ x``) are FP8 GEMMs on the FP8 copies of input
and weight saved by the forward. Master weights stay in their own dtype (FP32).

Any of the three GEMMs (fprop, dgrad, wgrad) can run in high precision instead, as
``nn.Linear`` runs it, on the unquantised operands: for every layer through the recipe's
``override_linear_precision`` (Transformer Engine's field), for one layer through
``FP8Linear.fp8_gemms``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .._private.torch_api import eager_apply, in_backward_pass, registered_parameter, registered_submodule
from ..numerics.device_kind import device_kind, presented_device, tensor_device_kind
from ..numerics.gemm import forced_path
from ..numerics.kernels import forced_kernels, gemm_kernel
from ..numerics.kernels.launch import capturing
from ..numerics.kernels.ops import dispatched
from .autocast import current_context, note_fp8_forward
from .frozen_weight import FrozenLayout, FrozenWeightMixin, frozen_columnwise
from ..numerics.quantizers import (
    GRAD_OUTPUT, INPUT, ROLES, SCALINGS, WEIGHT, QuantizedTensor, ScalingState, make_quantizer, mark_recorded,
    recipe_key,
)  # fmt: skip
from ..numerics.recipes import DelayedScaling, Recipe, as_gemm_flags, blockwise_variant, gemms_in_fp8, split_accumulators
from .linear_function import (
    BackwardInfo, FP8LinearFunction, StepPlan, fp8_operands, fprop, high_precision_gemm, output_dtype, weight_2d,
)  # fmt: skip
from .scaling_group import ScalingGroup
from .shared_input import find_shared_cast, keep_cast
from .weight_cache import WeightCache, keeps_weight_casts, weight_cast_key

__all__ = ["FP8Linear"]

# recipe_key prefixes of the block-scaled recipes (ScalingState.recipe: the recipe that last recorded).
_BLOCK_KEYS = ("Float8BlockScaling(", "MXFP8BlockScaling(")
# FP8LinearFunction.apply for eager steps, past torch's Python wrapper (a few µs of CPU a call).
_eager_apply = eager_apply(FP8LinearFunction)


def _cast(quantizer, plan, x: torch.Tensor, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
    # A cast through a step plan's launches where it has them, else the quantizer's own path.
    if plan is not None:
        return quantizer.cast_with(plan, x, columnwise)
    return quantizer.quantize_pair(x, columnwise=columnwise)


class _ForwardContext(NamedTuple):
    # How a layer's last forward ran, so that an activation-checkpoint recompute (which runs in
    # the backward, outside the autocast) reruns it alike: the FP8 recipe (None: high
    # precision), whether it was a training forward, and the group's update it used. A named
    # tuple: made every forward, at a fraction of a frozen dataclass's host time.
    recipe: Optional[Recipe]
    training: bool
    group_step: Optional[int]
    gemms: tuple[bool, bool, bool] = (True, True, True)  # which GEMMs ran in FP8 (fprop, dgrad, wgrad)
    high_precision: Optional[torch.dtype] = None  # the autocast's high_precision_dtype


class FP8Linear(FrozenWeightMixin, nn.Linear):
    """Drop-in ``nn.Linear`` with FP8 GEMMs inside :func:`fp8_plugin.autocast`.

    Outside the autocast, or with ``use_fp8 = False``, it computes exactly as the layer it
    replaced (``F.linear``, or ``addmm`` for GPT-2's Conv1D layout).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        recipe: scaling recipe used when the autocast gives none; default ``DelayedScaling()``.

    Attributes:
        weight: ``[out_features, in_features]``, or ``[in_features, out_features]`` when
            ``weight_transposed`` (a converted ``transformers.pytorch_utils.Conv1D`` keeps its
            Parameter and layout, so checkpoints keep theirs).
        use_fp8: per-layer switch; False runs this layer in high precision even inside the
            autocast (the BF16 reference checks' fallback sets it); saved in checkpoints.
        fp8_gemms: per-GEMM switch, three bools ``(fprop, dgrad, wgrad)``: False runs that GEMM
            of this layer in high precision (default all True); saved in checkpoints. A GEMM
            runs in FP8 when ``use_fp8``, its ``fp8_gemms`` entry and not the recipe's
            ``override_linear_precision`` entry say so; a layer none of whose GEMMs runs in FP8
            computes exactly as with ``use_fp8 = False``.
        fp8_scaling: the layer's scaling choice, ``"recipe"`` (default: as the recipe in force
            says) or ``"blockwise"`` (where that recipe scales per tensor, this layer casts with
            1x128 activation and gradient blocks and 128x128 weight blocks:
            :func:`~fp8_plugin.numerics.recipes.blockwise_variant`); :func:`fp8_plugin.calibrate`
            sets it for layers whose activation outliers break per-tensor scaling; saved in
            checkpoints.
        fp8_state: :class:`~fp8_plugin.numerics.quantizers.ScalingState` with amax history and scales.
        scaling_group: the :class:`~fp8_plugin.modules.scaling_group.ScalingGroup` whose layers update
            their delayed scales together (one per ``convert_model`` call).
        cache_fp8_weights: ``"auto"`` (default), True or False: whether a forward keeps the
            weight's FP8 copies for the next while the weight, its scale and the recipe are
            unchanged (:mod:`fp8_plugin.modules.weight_cache`: evaluation batches, and the micro-
            batches of gradient accumulation once seen), with identical numerics.
            :meth:`clear_weight_cache` drops them (training loops do before each optimizer step).

    Forwards inside an autocast entered with grad enabled are training forwards: they record
    amaxes, and the first of a step applies the previous step's. Other FP8 forwards (evaluation)
    use the current scales and leave the state alone. A forward rerun by activation
    checkpointing runs as the original did, with the same scales, recording nothing twice. The
    transposed FP8 copies the backward consumes are made only when a backward can run (not
    under ``torch.no_grad()`` / ``torch.inference_mode()``). ``torch.compile(fullgraph=True)``
    compiles the layer whole, forward and backward.

    Shapes: input ``[..., in_features]`` in any floating dtype; output ``[..., out_features]``
    in the torch autocast dtype when torch autocast is on, else the input dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        recipe: Optional[Recipe] = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.recipe = recipe if recipe is not None else DelayedScaling()
        self.weight_transposed = False
        self.fp8_state = ScalingState(self._history_len(self.recipe), device=device)
        self.fp8_state.recipe = recipe_key(self.recipe)
        self._forward_context: Optional[_ForwardContext] = None
        self.cache_fp8_weights: Union[str, bool] = "auto"
        self._weight_cache: Optional[WeightCache] = None
        self._frozen: Optional[FrozenLayout] = None  # set while the weight is kept only in FP8
        # A layer of its own; convert_model puts all the layers of a model in one group.
        ScalingGroup().add(self)

    @property
    def use_fp8(self) -> bool:
        """Per-layer switch: False runs this layer in high precision even inside the autocast.
        Saved with the FP8 scaling state (``fp8_state``), so it survives checkpoint resume."""
        return self.fp8_state.use_fp8

    @use_fp8.setter
    def use_fp8(self, value: bool) -> None:
        self.fp8_state.use_fp8 = bool(value)

    @property
    def fp8_gemms(self) -> tuple[bool, bool, bool]:
        """Per-GEMM switch ``(fprop, dgrad, wgrad)``: False runs that GEMM in high precision.
        Saved with the FP8 scaling state (``fp8_state``), so it survives checkpoint resume.

        Raises:
            ValueError: (on assignment) not three bools.
        """
        return self.fp8_state.fp8_gemms

    @fp8_gemms.setter
    def fp8_gemms(self, value: tuple[bool, bool, bool]) -> None:
        flags = as_gemm_flags(value)
        if flags is None:
            raise ValueError(
                f"FP8Linear.fp8_gemms = {value!r} is invalid; valid: three bools (fprop, dgrad, wgrad), False "
                "running that GEMM in high precision, e.g. (True, True, False)"
            )
        self.fp8_state.fp8_gemms = flags

    @property
    def fp8_scaling(self) -> str:
        """The layer's scaling choice, one of ``"recipe"``, ``"blockwise"``. Saved with the FP8
        scaling state (``fp8_state``), so it survives checkpoint resume.

        Raises:
            ValueError: (on assignment) another value.
        """
        return self.fp8_state.scaling

    @fp8_scaling.setter
    def fp8_scaling(self, value: str) -> None:
        if value not in SCALINGS:
            raise ValueError(f"FP8Linear.fp8_scaling = {value!r} is invalid; valid: {', '.join(map(repr, SCALINGS))}")
        state = self.fp8_state
        if value != state.scaling and state.recipe.startswith(_BLOCK_KEYS):
            # Block casts recorded since the per-tensor scales were made (their statistics leave
            # scale 1 in the state): those scales are stale, and the next per-tensor cast of each
            # role scales from its own amax, as a first cast does. A trial move that recorded
            # nothing (a reference check's replay) leaves the state as it was.
            with torch.no_grad():
                state.initialized.zero_()
            state._forget_initialized()
        state.scaling = value

    def layer_recipe(self, recipe: Recipe) -> Recipe:
        """The recipe this layer casts with when ``recipe`` is in force: ``recipe``, or its
        :func:`~fp8_plugin.numerics.recipes.blockwise_variant` where :attr:`fp8_scaling` is
        ``"blockwise"``."""
        return blockwise_variant(recipe) if self.fp8_state.scaling == "blockwise" else recipe

    def gemms_in_fp8(self, recipe: Recipe) -> tuple[bool, bool, bool]:
        """Which of this layer's GEMMs ``(fprop, dgrad, wgrad)`` run in FP8 under ``recipe``:
        those its :attr:`fp8_gemms` keeps in FP8 and the recipe's ``override_linear_precision``
        does not move to high precision (``use_fp8`` is not consulted)."""
        return gemms_in_fp8(self.fp8_state.fp8_gemms, recipe)

    @staticmethod
    def _history_len(recipe: Recipe) -> int:
        return recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1

    @classmethod
    def from_module(cls, module: nn.Module, recipe: Optional[Recipe] = None) -> "FP8Linear":
        """Build an FP8Linear around the Parameters of ``module`` (no copy, same objects).

        Args:
            module: ``nn.Linear`` (weight ``[out, in]``) or ``transformers.pytorch_utils.Conv1D``
                (weight ``[in, out]``, attribute ``nf``).

        Raises:
            TypeError: ``module`` is neither.
        """
        if isinstance(module, nn.Linear):
            in_features, out_features, transposed = module.in_features, module.out_features, False
        elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
            in_features, out_features, transposed = module.weight.shape[0], module.nf, True
        else:
            raise TypeError(
                f"FP8Linear.from_module got {type(module).__name__}; valid: nn.Linear, transformers Conv1D"
            )
        with torch.device("meta"):
            new = cls(in_features, out_features, bias=False, recipe=recipe)
        new.weight = module.weight
        new.bias = module.bias
        new.weight_transposed = transposed
        new.fp8_state = ScalingState(cls._history_len(new.recipe), device=module.weight.device)
        new.fp8_state.recipe = recipe_key(new.recipe)
        new.train(module.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and in_backward_pass() and self._forward_context is not None:
            return self._recompute(x, self._forward_context)
        context = current_context()
        training = context.training
        state = registered_submodule(self, "fp8_state")  # read once, past nn.Module.__getattr__
        recipe = (context.recipe or self.recipe) if (state.use_fp8 and context.enabled) else None
        if recipe is not None and state.scaling != "recipe":
            recipe = blockwise_variant(recipe)
        gemms = gemms_in_fp8(state.fp8_gemms, recipe) if recipe is not None else (False, False, False)
        if not any(gemms):  # no GEMM in FP8: the layer runs as the one it replaced
            recipe = None
        if recipe is None:
            self._forward_context = _ForwardContext(None, training, None, high_precision=context.high_precision_dtype)
            if context.high_precision_dtype is not None:
                return self._reference_forward(x, context.high_precision_dtype)
            return self._high_precision_forward(x)
        compiling = torch.compiler.is_compiling()  # asked once: each ask is two Python calls
        note_fp8_forward(compiling)
        frozen, weight = self._frozen, registered_parameter(self, "weight")
        if frozen is not None:
            self._check_still_frozen()
        if x.dtype != (weight.dtype if frozen is None else frozen.master_dtype) and not torch.is_autocast_enabled(
                tensor_device_kind(x)):
            # nn.Linear refuses this pairing; an FP8 GEMM would not notice, and the model would
            # then compute in the input's dtype only while FP8 is on.
            raise RuntimeError(
                f"FP8Linear: input dtype {x.dtype} differs from the weight's {weight.dtype} outside torch "
                "autocast (nn.Linear raises for this too); cast the inputs to the model's dtype, or run under "
                "torch.autocast"
            )
        group = self.scaling_group
        if training and not compiling and group.step != context.step:
            # First FP8 forward of a training step: last step's amaxes become scales (all the
            # group's layers, one amax reduction), before this forward casts with them. Not in
            # compiled code: a decision on a step id that changes every step would recompile
            # the graph every step; there the loop applies them after the optimizer step
            # (fp8_plugin.update_pending_scales; the integrations do it themselves).
            group.step = context.step
            group.update(context.reduce_amax, context.recipe)
        # A plain attribute, past nn.Module.__setattr__ (about 1.3 µs of CPU a call, every step).
        self.__dict__["_forward_context"] = _ForwardContext(recipe, training, group.step, gemms, context.high_precision_dtype)
        return self._fp8_forward(x, recipe, record_forward=training, record_backward=training, gemms=gemms,
                                 high_precision=context.high_precision_dtype, share=True, state=state, weight=weight,
                                 compiling=compiling)

    def _recompute(self, x: torch.Tensor, original: _ForwardContext) -> torch.Tensor:
        # torch.utils.checkpoint reruns the forward in the backward, outside the autocast: run it
        # as the original ran, with the same scales, and record no amax twice (the original
        # forward recorded input and weight; grad_output is recorded by whichever backward runs).
        if original.recipe is None:
            if original.high_precision is not None:
                return self._reference_forward(x, original.high_precision)
            return self._high_precision_forward(x)
        if self.scaling_group.step != original.group_step:
            raise RuntimeError(
                "FP8Linear: an activation-checkpoint recomputation ran after the FP8 scales were updated "
                "by a later training step; run each step's backward before the next step's forward"
            )
        return self._fp8_forward(x, original.recipe, record_forward=False, record_backward=original.training,
                                 gemms=original.gemms, high_precision=original.high_precision)

    def _fp8_forward(self, x: torch.Tensor, recipe: Recipe, record_forward: bool, record_backward: bool,
                     gemms: Optional[tuple[bool, bool, bool]] = None,
                     high_precision: Optional[torch.dtype] = None, share: bool = False,
                     state: Optional[ScalingState] = None, weight: Optional[torch.Tensor] = None,
                     compiling: Optional[bool] = None) -> torch.Tensor:
        # ``gemms``: which GEMMs run in FP8 (None: as gemms_in_fp8 says for ``recipe``);
        # ``high_precision``: the dtype of those that do not (None: the output dtype); ``share``:
        # an autocast forward, which may take or keep an input cast (modules/shared_input.py);
        # ``state``, ``weight``: fp8_state and weight, where the caller has read them. Submodules
        # and Parameters are read once per forward (each read costs about a microsecond of CPU).
        # ``compiling``: torch.compiler.is_compiling(), where the caller has asked.
        gemms = self.gemms_in_fp8(recipe) if gemms is None else gemms
        state = self.fp8_state if state is None else state
        weight = self.weight if weight is None else weight
        bias = registered_parameter(self, "bias")
        if isinstance(recipe, DelayedScaling):
            state.resize_history(recipe.amax_history_len)
        if state.device != x.device:
            state.follow(x.device)
        state.use_recipe(recipe)
        # A 2-D input is its own 2-D view: no view op, and no view node for the backward to run
        # (a view node each way costs about 6 µs of CPU, forward and backward).
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        # The transposed FP8 copies serve the backward only: build them only when one will run
        # (under no_grad autograd still reports the parameters as needing grad).
        grad = torch.is_grad_enabled()
        need_dgrad = grad and x2d.requires_grad
        need_wgrad = grad and weight.requires_grad
        need_bgrad = grad and bias is not None and bias.requires_grad
        # Compiled code and CUDA graph captures cast every time: nothing kept from one call to the next.
        plain = not ((torch.compiler.is_compiling() if compiling is None else compiling) or capturing())
        flags = (record_forward, record_backward, need_dgrad, need_wgrad, need_bgrad, gemms, high_precision)
        info = (self._step_info(x2d, weight, bias, recipe, flags, state)
                if plain and self._frozen is None and not dispatched(x2d) else None)
        plan = None if info is None else info.plan
        qx, qx_t, recorded = self._input_casts(x, x2d, recipe, record_forward, need_wgrad and gemms[2],
                                               share and plain, state, plan)
        # A frozen weight's transposed copy is made by the backward (and freed after), not kept from here.
        qw, qw_t = self._weight_casts(recipe, record_forward, columnwise=need_dgrad and gemms[1] and self._frozen is None,
                                      state=state, weight=weight, plain=plain, plan=plan)
        key = None if plan is None else plan.input_quantizer.recipe_key  # mark_recorded's, looked up once
        if recorded is not None:
            mark_recorded(recorded, recipe, INPUT, key)
        if not (need_dgrad or need_wgrad or need_bgrad):
            if gemms[0]:
                out = fprop(qx, qw, output_dtype(x2d) if plan is None else plan.out_dtype, bias,
                            split_accumulators(recipe)[0], plan)
            else:
                dtype = output_dtype(x2d)
                out = high_precision_gemm(x2d, weight_2d(self.dense_weight(), self.weight_transposed),
                                          high_precision or dtype, dtype, bias)
        else:
            if record_backward and (gemms[1] or gemms[2]):
                # Marked now, recorded by the backward: host-side state cannot change inside a
                # compiled backward. Should no backward run, the step's grad_output amax stays 0,
                # which no scale update takes for a scale.
                mark_recorded(state, recipe, GRAD_OUTPUT, key)
            frozen = self._frozen is not None
            if info is None:
                info = self._backward_info(recipe, record_backward, qx.block, qw.block, gemms, frozen, high_precision)
            # A GEMM in high precision reads the weight itself: a frozen one's dequantized copy.
            if frozen and not (gemms[0] and gemms[1]):
                weight = self.dense_weight()
            apply = _eager_apply if plain else FP8LinearFunction.apply
            out = apply(x2d, weight, bias, fp8_operands(qx, qw, qx_t, qw_t), state, info)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def _input_casts(self, x: torch.Tensor, x2d: torch.Tensor, recipe: Recipe, record: bool, columnwise: bool,
                     share: bool, state: ScalingState, plan: Optional[StepPlan] = None
                     ) -> tuple[QuantizedTensor, Optional[QuantizedTensor], Optional[ScalingState]]:
        # The input's FP8 copies and the state that recorded the cast (None: none). An autocast
        # forward outside compiled code and captures (``share``) takes the cast an FP8 layer just
        # made of the same tensor, or keeps its own (a layer that shared and now casts alone takes
        # the row back first). Elsewhere (recompute, compiled code, a capture, hooks) it casts with
        # the row the input last used, as training. ``plan``: the step's (_step_info), whose
        # quantizer and launches cast with the layer's own row.
        if share:
            kept = find_shared_cast(x, recipe, record, columnwise)
            if kept is not None:
                if state.input_source is not kept.state:
                    state.share_input_of(kept.state)
                return kept.rowwise, (kept.columnwise if columnwise else None), None
            if record:
                state.stop_sharing_input()
        source = state.input_source
        if plan is not None and source is state:
            qx, qx_t = _cast(plan.input_quantizer, plan.input_cast, x2d, columnwise)
        else:
            qx, qx_t = make_quantizer(recipe, INPUT, source, record, host=False).quantize_pair(x2d, columnwise=columnwise)
        if share:
            keep_cast(x, recipe, record, qx, qx_t, source)
        return qx, qx_t, (source if record else None)

    def _step_info(self, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: Recipe,
                   flags: tuple, state: ScalingState) -> BackwardInfo:
        # The BackwardInfo of an eager forward with its StepPlan (linear_function.py), kept per
        # layer under one key for everything the plan's answers depend on: the recipe object, the
        # flags (record_forward, record_backward, need_dgrad, need_wgrad, need_bgrad, gemms,
        # high_precision), the input's and the weight's layouts, the output dtype (torch
        # autocast's), the state's tensors (generation) and the kernel and device settings.
        out_dtype = output_dtype(x2d)
        key = (id(recipe), flags, x2d.shape, x2d.stride(), x2d.dtype, x2d.get_device(), weight.dtype, weight.shape,
               weight.stride(), bias is None, out_dtype, state.generation, forced_kernels(), forced_path(), gemm_kernel(),
               presented_device())
        infos = self.__dict__.setdefault("_step_infos", {})
        info = infos.get(key)
        if info is not None and info.recipe is recipe:
            return info
        record_forward, record_backward, need_dgrad, need_wgrad, _, gemms, high_precision = flags
        w = weight.t() if self.weight_transposed else weight
        input_quantizer = make_quantizer(recipe, INPUT, state, record_forward, host=False)
        weight_quantizer = make_quantizer(recipe, WEIGHT, state, record_forward)
        plan = StepPlan(out_dtype, input_quantizer, input_quantizer.eager_plan(x2d, need_wgrad and gemms[2]),
                        weight_quantizer, weight_quantizer.eager_plan(w, need_dgrad and gemms[1]),
                        make_quantizer(recipe, GRAD_OUTPUT, state, record_backward, host=False))
        info = BackwardInfo(recipe, record_backward, input_quantizer.block, weight_quantizer.block,
                            self.weight_transposed, gemms, split_accumulators(recipe), False, high_precision, plan)
        if len(infos) >= 8:  # layouts or recipes that keep changing: keep the newest few
            infos.clear()
        infos[key] = info
        return info

    def _backward_info(self, recipe: Recipe, record: bool, x_block: Optional[tuple[int, int]],
                       w_block: Optional[tuple[int, int]], gemms: tuple[bool, bool, bool], frozen: bool,
                       high_precision: Optional[torch.dtype]) -> BackwardInfo:
        # The same BackwardInfo for the same forward, made once: a frozen dataclass costs
        # microseconds to build, every step. Keyed by the recipe's identity (hashing a recipe
        # hashes all its fields), checked against the kept one.
        if torch.compiler.is_compiling():  # traced once, kept by the graph: no memo to guard on
            return BackwardInfo(recipe, record, x_block, w_block, self.weight_transposed, gemms,
                                split_accumulators(recipe), frozen, high_precision)
        key = (id(recipe), record, x_block, w_block, self.weight_transposed, gemms, frozen, high_precision)
        memo = self.__dict__.setdefault("_backward_infos", {})
        info = memo.get(key)
        if info is None or info.recipe is not recipe:
            info = BackwardInfo(recipe, record, x_block, w_block, self.weight_transposed, gemms,
                                split_accumulators(recipe), frozen, high_precision)
            if len(memo) >= 16:  # recipes made anew for each step: keep the newest few
                memo.clear()
            memo[key] = info
        return info

    def _weight_casts(self, recipe: Recipe, record: bool, columnwise: bool, *, state: Optional[ScalingState] = None,
                      weight: Optional[torch.Tensor] = None, plain: Optional[bool] = None,
                      plan: Optional[StepPlan] = None) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        # The weight's FP8 copies (rowwise, and columnwise for dgrad), cast once and reused while
        # nothing they depend on changes: the micro-batches of gradient accumulation and
        # evaluation batches cast each weight once (as Transformer Engine's weight caching does).
        # ``state``, ``weight``: fp8_state and weight, where the caller has read them; ``plain``:
        # not compiled code nor a CUDA graph capture (None: asked here); ``plan``: the step's
        # (_step_info), whose quantizer and launches cast the weight.
        if self._frozen is not None:  # kept only in FP8: the stored bytes, transposed on request
            rowwise = self._frozen_casts(recipe)
            return rowwise, (frozen_columnwise(rowwise, recipe) if columnwise else None)
        weight = self.weight if weight is None else weight
        state = self.fp8_state if state is None else state
        fp8_operand = getattr(weight, "fp8_operand", None)
        if fp8_operand is not None:  # gathered in FP8 by FSDP2 (fp8_plugin.modules.fsdp_fp8): cast already
            rowwise = fp8_operand(self.weight_transposed)
            return rowwise, (rowwise.t() if columnwise else None)
        w = weight.t() if self.weight_transposed else weight
        quantizer = make_quantizer(recipe, WEIGHT, state, record) if plan is None else plan.weight_quantizer
        cast = None if plan is None else plan.weight_cast
        if not (plain if plain is not None else not (torch.compiler.is_compiling() or capturing())):
            # Compiled or captured into a CUDA graph: the cast is part of the graph, run every time.
            return quantizer.quantize_pair(w, columnwise=columnwise)
        step = self.scaling_group.step if record else None  # a recording cast fills this step's amax slot
        if not keeps_weight_casts(self, step):
            self.__dict__["_weight_cache"] = None  # what an earlier forward kept goes (modules/weight_cache.py)
            return _cast(quantizer, cast, w, columnwise)
        key = weight_cast_key(weight, recipe, (state,), step)
        cached = self._weight_cache
        if cached is not None and cached.matches(key, record) and (cached.columnwise is not None or not columnwise):
            if record:
                mark_recorded(state, recipe, WEIGHT, quantizer.recipe_key)
            return cached.rowwise, (cached.columnwise if columnwise else None)
        self._weight_cache = None  # free the stale copies before casting new ones
        rowwise, columnwise_copy = _cast(quantizer, cast, w, columnwise)
        self._weight_cache = WeightCache(key, record, rowwise, columnwise_copy)
        return rowwise, columnwise_copy

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) starts without the step plans: they hold this layer's
        # quantizers and launch plans (Triton kernels, which do not pickle), keyed by identities.
        return {**super().__getstate__(), "_step_infos": {}}

    def clear_weight_cache(self) -> None:
        """Drop the cached FP8 copies of the weight (they are rebuilt at the next FP8 forward).

        Training loops call it before each optimizer step, whose update makes them stale, so
        that they do not hold memory through the step.
        """
        self._weight_cache = None

    def _reference_forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # A reference check's replay: the GEMM in ``dtype`` outside torch autocast, the output in
        # the dtype the layer would give, so that the ops after it run as in training.
        out_dtype = output_dtype(x)
        with torch.autocast(device_kind(x.device), enabled=False):
            weight = self.dense_weight(dtype)
            out = F.linear(x.to(dtype), weight.t() if self.weight_transposed else weight,
                           None if self.bias is None else self.bias.to(dtype))
        return out.to(out_dtype)

    def _high_precision_forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dense_weight()
        if not self.weight_transposed:
            return F.linear(x, weight, self.bias)
        # transformers' Conv1D.forward, verbatim in effect.
        shape = x.shape[:-1] + (self.out_features,)
        x2d = x.reshape(-1, self.in_features)
        out = x2d @ weight if self.bias is None else torch.addmm(self.bias, x2d, weight)
        return out.reshape(shape)

    def fp8_stats(self) -> dict[str, dict[str, torch.Tensor]]:
        """Current scaling figures per role, read from state (no recomputation, no sync).

        Returns ``{role: {"amax": float32 0-dim (current step's or last cast's amax),
        "scale": float32 0-dim, "nonfinite_amax_count": int64 0-dim, "amax_outlier_count":
        int64 0-dim, "amax_outlier_ratio": float32 0-dim (the last outlier's)}}`` for roles
        ``input``, ``weight``, ``grad_output``. A layer that takes another's cast of their common
        input (``k_proj`` taking ``q_proj``'s, modules/shared_input.py) reports that row for ``input``.
        """
        s = self.fp8_state
        rows = (s.input_source, s, s)  # a shared input's figures are in the row its casts use
        return {
            role: {
                "amax": rows[i].amax_history[i, 0],
                "scale": rows[i].scale[i],
                "nonfinite_amax_count": rows[i].nonfinite_amax_count[i],
                "amax_outlier_count": rows[i].outlier_count[i],
                "amax_outlier_ratio": rows[i].outlier_ratio[i],
            }
            for i, role in enumerate(ROLES)
        }

    def extra_repr(self) -> str:
        layout = ", weight_transposed=True" if self.weight_transposed else ""
        gemms = "" if all(self.fp8_gemms) else f", fp8_gemms={self.fp8_gemms}"
        if self.fp8_scaling != "recipe":
            gemms += f", fp8_scaling={self.fp8_scaling!r}"
        if self._frozen is not None:
            layout += f", frozen weight in FP8 ({self._frozen.describe()})"
        return f"{super().extra_repr()}{layout}, recipe={type(self.recipe).__name__}, use_fp8={self.use_fp8}{gemms}"
