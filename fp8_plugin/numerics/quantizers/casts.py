"""The casts: per-tensor (delayed and current scaling) and block-scaled (MXFP8, 128-blockwise)
quantizers, made once per recipe, role and state (:func:`make_quantizer`), and the host-side half
of a recording cast (:func:`mark_recorded`). Where the fused kernels run, a cast is their launches
(:mod:`fp8_plugin.numerics.kernels`); elsewhere the torch ops of :mod:`fp8_plugin.numerics.scaling`."""

from __future__ import annotations

from typing import Optional

import torch

from ..block_scaling import block_amax, blockwise_scale, mx_scale_inv, quantize_blocks
from ..cpu_emulation import cpu_emulation
from ..device_kind import eager_on_cpu, fp8_family, presented_device
from ..formats import fp8_dtype, fp8_max
from ..kernels import forced_kernels, fusable, ops
from ..recipes import Float8BlockScaling, MXFP8BlockScaling, Recipe
from ..scaling import amax as tensor_amax
from ..scaling import divide, quantize, scale_from_amax
from .state import ScalingState, recipe_key
from .tensor import GRAD_OUTPUT, QuantizedTensor, Quantizer

__all__ = ["PerTensorQuantizer", "BlockQuantizer", "make_quantizer", "mark_recorded", "columnwise_copy"]


def columnwise_copy(row: QuantizedTensor) -> QuantizedTensor:
    """The transposed operand ``[cols, rows]`` of a per-tensor (or square-block) cast ``row``.

    A row-major copy of the bytes (:meth:`QuantizedTensor.t`), as the kernels read their
    operands. For a per-tensor cast on CPU in a process whose emulation is BF16
    (:mod:`~fp8_plugin.numerics.cpu_emulation`), a transposed view of ``row``'s bytes instead, no
    copy: a BF16 GEMM reads either layout, and a native CPU GEMM handed one makes it row-major
    first (:mod:`~fp8_plugin.numerics.gemm`). Traced code and dispatch modes keep the copy a
    GPU's kernels need.

    Raises:
        ValueError: 1-D block scaling (:meth:`QuantizedTensor.t`).
    """
    if row.block is None and eager_on_cpu(row.data) and cpu_emulation().bf16:
        return QuantizedTensor(row.data.t(), row.scale_inv)
    return row.t()


class _LayerQuantizer(Quantizer):
    # What every cast of one role of one layer holds (the arguments of both quantizers below).
    block: Optional[tuple[int, int]] = None  # the casts' scale block (None: per tensor)

    def __init__(self, recipe: Recipe, role: int, state: ScalingState, record: bool, host: bool) -> None:
        self.recipe, self.role, self.state, self.record, self.host = recipe, role, state, record, host
        # What mark_recorded writes into the state, looked up once (every recording cast writes it).
        self.recipe_key = recipe_key(recipe)

    def eager_plan(self, x: torch.Tensor, columnwise: bool):
        """The launch plan a caller may keep for casts of ``x``'s layout, cast through
        :meth:`cast_with` (:meth:`PerTensorQuantizer.eager_plan`, :meth:`BlockQuantizer.eager_plan`);
        None: every cast takes :meth:`quantize_pair`."""
        return None


class PerTensorQuantizer(_LayerQuantizer):
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
        super().__init__(recipe, role, state, record, host)
        # The device's format family: FNUZ on an AMD MI300 (numerics/formats.py).
        self.dtype = fp8_dtype(recipe.fp8_format, backward=role == GRAD_OUTPUT, family=fp8_family(state.device))
        self.max = fp8_max(self.dtype)
        self.kind = "delayed" if recipe.delayed() else "current"
        # The last eager fused cast's plan, with what it was chosen on (_kept_plan).
        self._eager: Optional[tuple] = None

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
            q = QuantizedTensor(quantize(x, scale, self.dtype, amax), divide(1.0, scale))
        if self.record and self.host:
            mark_recorded(self.state, self.recipe, self.role, self.recipe_key)
        return q

    def quantize_pair(self, x: torch.Tensor, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        plan = self._kept_plan(x, columnwise)
        if plan is not None:  # the steady state of a layer: the launches, nothing else
            return self.cast_with(plan, x, columnwise)
        if fusable(x, self.dtype):
            return self._fused(x, columnwise)
        row = self.quantize(x)
        return row, (columnwise_copy(row) if columnwise else None)

    def eager_plan(self, x: torch.Tensor, columnwise: bool):
        """The fused cast's launch plan (:class:`~fp8_plugin.numerics.kernels.tensorwise.RecordingCast`)
        that :meth:`quantize_pair` runs for a 2-D ``x`` of this layout in plain eager code, or
        None where it takes another path (not 2-D, not fusable, traced). A caller that keeps it
        for tensors of this layout casts them with :meth:`cast_with` while the state's
        ``generation`` and the kernel settings are the same."""
        if x.dim() != 2 or not fusable(x, self.dtype) or ops.traced(x):
            return None
        return ops.eager_cast_plan(self.kind, x, self.state, self.role, self.dtype, self.recipe.margin, columnwise,
                                   self.record, False)

    def cast_with(self, plan, x: torch.Tensor, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        """:meth:`quantize_pair` of ``x`` through ``plan`` (:meth:`eager_plan`'s for ``x``'s layout
        and ``columnwise``): the launches and the host-side records, nothing checked."""
        if self.host:
            self.state.use_recipe(self.recipe)
        data, data_t, _, scale_inv, _ = plan(x, ops.skips_amax_pass(self.kind, self.state, self.role))
        return self._result(data, data_t, scale_inv, columnwise)

    def _eager_key(self, x: torch.Tensor, columnwise: bool) -> tuple:
        # What an eager fused cast's plan was chosen on: the layout, the state's tensors, the
        # kernel setting (force_kernels).
        return x.shape, x.stride(), x.dtype, x.device, columnwise, self.state.generation, forced_kernels()

    def _kept_plan(self, x: torch.Tensor, columnwise: bool):
        # The plan of this quantizer's last eager fused cast where this cast is one like it and a
        # plain eager call again: it skips _fused's checks and lookups (microseconds each, three
        # casts a training step), and the result is the same launches on the same rows.
        kept = self._eager
        if kept is None or kept[0] != self._eager_key(x, columnwise) or ops.traced(x):
            return None
        return kept[1]

    def _result(self, data: torch.Tensor, data_t: Optional[torch.Tensor], scale_inv: torch.Tensor,
                columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        # A fused cast's outputs as QuantizedTensors, its amax recorded on the host side too.
        if self.record and self.host:
            mark_recorded(self.state, self.recipe, self.role, self.recipe_key)
        return QuantizedTensor(data, scale_inv), (QuantizedTensor(data_t, scale_inv) if columnwise else None)

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
        if self.host:
            self.state.use_recipe(self.recipe)
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if ops.traced(x2d):
            cast = ops.cast_delayed if self.recipe.delayed() else ops.cast_current
            with torch.no_grad():
                data, data_t, scale_inv, bias = cast(x2d, self.state, self.role, self.dtype, self.recipe.margin,
                                                        transpose=columnwise, record=self.record, bias_grad=bias_grad)
        else:  # the launches record nothing for autograd: no no_grad context to enter
            plan = ops.eager_cast_plan(self.kind, x2d, self.state, self.role, self.dtype, self.recipe.margin,
                                       columnwise, self.record, bias_grad)
            if x2d is x and not bias_grad:  # what quantize_pair's next cast of this layout launches
                self._eager = (self._eager_key(x, columnwise), plan)
            data, data_t, _, scale_inv, bias = plan(x2d, ops.skips_amax_pass(self.kind, self.state, self.role))
        row, col = self._result(data, data_t, scale_inv, columnwise)
        return (row, col, bias) if bias_grad else (row, col)


class BlockQuantizer(_LayerQuantizer):
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
        super().__init__(recipe, role, state, record, host)
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
        # The fused cast's scale options (ops.cast_blocks, ops.eager_block_plan), from the recipe.
        qparams = self.qparams
        self._options = dict(mx=qparams is None, power_2_scale=bool(qparams and qparams.power_2_scale),
                             amax_epsilon=qparams.amax_epsilon if qparams else 0.0)

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
            mark_recorded(self.state, self.recipe, self.role, self.recipe_key)
        return row, col

    def _fusable(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and self.block in ((1, 32), (1, 128), (128, 128)) and fusable(x, self.dtype)

    def eager_plan(self, x: torch.Tensor, columnwise: bool):
        """The fused block cast's launch plan (:class:`~fp8_plugin.numerics.kernels.blockwise.BlockCast`)
        that :meth:`quantize_pair` runs for a 2-D ``x`` of this layout in plain eager code, or
        None where it takes another path; kept by a caller as :meth:`PerTensorQuantizer.eager_plan`'s."""
        if not self._fusable(x) or ops.traced(x):
            return None
        return ops.eager_block_plan(x, self.state, self.role, self.dtype, self.block, transpose=columnwise,
                                    record=self.record, **self._options)

    def cast_with(self, plan, x: torch.Tensor, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        """:meth:`quantize_pair` of ``x`` through ``plan`` (:meth:`eager_plan`'s for ``x``'s layout
        and ``columnwise``): the launch and the host-side records, nothing checked."""
        if self.host:
            self.state.use_recipe(self.recipe)
        outputs = plan(x)
        if self.record and self.host:
            mark_recorded(self.state, self.recipe, self.role, self.recipe_key)
        return self._pair(outputs, columnwise)

    def _pair(self, outputs: tuple, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        # A fused block cast's outputs (data, scale_inv, data_t, scale_inv_t, gemm, gemm_t) as
        # the rowwise and (where asked) columnwise QuantizedTensors.
        data, scale_inv, data_t, scale_inv_t, gemm, gemm_t = outputs
        row = QuantizedTensor(data, scale_inv, self.block, gemm)
        return row, (QuantizedTensor(data_t, scale_inv_t, self.block, gemm_t) if columnwise else None)

    def _fused(self, x: torch.Tensor, columnwise: bool, record: bool
               ) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        # The torch ops of _cast (and of the columnwise copy, the cast of x.T) in one pass
        # (numerics/kernels/blockwise.py), bit for bit; the amax recorded by the kernel.
        with torch.no_grad():
            outputs = ops.cast_blocks(x, self.state, self.role, self.dtype, self.block, transpose=columnwise,
                                      record=record, **self._options)
        return self._pair(outputs, columnwise)


def mark_recorded(state: ScalingState, recipe: Recipe, role: int, key: Optional[str] = None) -> None:
    """The host-side half of a recording cast of ``role`` under ``recipe``: a delayed-scaling
    amax becomes pending (its scale update is due), and the state now belongs to ``recipe``.
    ``key``: ``recipe_key(recipe)`` where the caller holds it (a quantizer's), else looked up."""
    if recipe.delayed():
        state.pending[role] = recipe
    if key is None:
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
