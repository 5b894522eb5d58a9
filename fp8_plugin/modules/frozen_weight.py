"""Frozen weights kept only in FP8: the FP8 data and scales, no high-precision copy.

A weight that does not train (a LoRA base layer, a frozen encoder, a published FP8 checkpoint)
needs no master copy: the FP8 bytes its GEMMs read and their ``scale_inv`` are all it must keep,
about 1 byte per value against BF16's 2 and a trained weight's 4 (FP32 master) + 1 (FP8 copy).
Transformer Engine calls this "primary weights in FP8" (``fp8_model_init``); transformers' fine-
grained FP8 layers hold the same two tensors under the same names (``weight``, E4M3 ``[out,
in]``; ``weight_scale_inv``, float32), so a frozen layer's ``state_dict`` is that format.

The layout follows the recipe the layer was frozen for:

- ``"tensorwise"`` (``DelayedScaling``, ``Float8CurrentScaling``): one scale, the weight's
  current scale ``(FP8_MAX / amax) / 2**margin`` (a frozen weight's amax never changes, so a
  delayed history would hold it alone); ``weight_scale_inv`` 0-dim;
- ``"blockwise"`` (``Float8BlockScaling``): ``w_block_scaling_dim`` 2 gives 128x128 blocks
  (DeepSeek-V3's and the fine-grained checkpoints'), 1 gives 1x128; ``weight_scale_inv``
  ``[ceil(out / b0), ceil(in / b1)]``;
- ``"mxfp8"`` (``MXFP8BlockScaling``): 1x32 blocks along ``in`` with power-of-two scales (OCP
  MX v1.0), ``weight_scale_inv`` float32 ``[out, ceil(in / 32)]``.

dgrad reads the weight transposed. Per-tensor and 128x128 scales transpose exactly, so the
backward makes that copy from the stored bytes (``[in, out]``, 1 byte per value) and frees it
after. A 1-D block (1x128, 1x32) does not transpose: the backward re-casts the dequantized
weight's transpose with the recipe's columnwise blocks, a float32 ``[in, out]`` transient, and
the values that fall below E4M3's normal range under the new block scale round once more (a
trained layer casts its high-precision weight instead).

Sources: Transformer Engine's ``fp8_model_init`` (primary FP8 weights), its recipes' docs (the
scale formula); transformers' ``FineGrainedFP8Config`` (``weight_scale_inv``); OCP MX v1.0.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .._private.peft_api import ADAPTER_DTYPE_ATTRIBUTE
from ..numerics.device import recipe_gemm_kind
from ..numerics.device_kind import fp8_family
from ..numerics.formats import fp8_dtype, is_fp8
from ..numerics.quantizers import WEIGHT, QuantizedTensor, ScalingState, columnwise_copy, make_quantizer
from ..numerics.recipes import Float8BlockScaling, MXFP8BlockScaling, Recipe

__all__ = ["FrozenLayout", "FrozenWeightMixin", "frozen_layout", "quantize_frozen", "frozen_columnwise", "layout_problem"]


@dataclass(frozen=True)
class FrozenLayout:
    """How a frozen FP8 weight is stored.

    Attributes:
        kind: ``"tensorwise"``, ``"blockwise"`` or ``"mxfp8"`` (the recipe's GEMM kind).
        block: None (one scale) or the ``(rows, cols)`` block of one ``weight_scale_inv`` entry.
        dtype: the FP8 dtype of the data (the recipe's forward format: E4M3, or E5M2 under
            ``Format.E5M2``; E4M3FNUZ on an AMD MI300).
        master_dtype: the dtype the weight had before it was frozen: the dtype its high-
            precision GEMMs (evaluation outside the autocast, reference checks, fallbacks) and
            its dequantization use.
    """

    kind: str
    block: Optional[tuple[int, int]]
    dtype: torch.dtype
    master_dtype: torch.dtype

    def describe(self) -> str:
        """E.g. ``"E4M3, 128x128 blocks"`` for reports."""
        name = {torch.float8_e4m3fn: "E4M3", torch.float8_e5m2: "E5M2", torch.float8_e4m3fnuz: "E4M3FNUZ",
                torch.float8_e5m2fnuz: "E5M2FNUZ"}.get(self.dtype, str(self.dtype))
        where = "one scale" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"{name}, {where}"


def _weight_quantizer(recipe: Recipe, device: torch.device):
    # A frozen weight's one cast, from a fresh scratch state (the layer's statistics stay clean):
    # delayed scaling's cast of a tensor with no history yet scales by its own amax, as current
    # scaling does (a frozen weight's amax is final); the block recipes cast by their blocks.
    return make_quantizer(recipe, WEIGHT, ScalingState(1, device=device), record=False, host=False)


def quantize_frozen(weight: torch.Tensor, recipe: Recipe) -> tuple[QuantizedTensor, FrozenLayout]:
    """Cast a weight ``[out, in]`` once, for good, as ``recipe`` casts weights.

    Returns:
        The FP8 data ``[out, in]`` with its float32 ``scale_inv`` (see the module docstring for
        the shapes) and the :class:`FrozenLayout` that describes them.

    Raises:
        ValueError: ``weight`` is not 2-D floating point.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_frozen: weight must be a 2-D floating tensor [out, in], got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    with torch.no_grad():
        q = _weight_quantizer(recipe, weight.device).quantize(weight.detach())
    q = QuantizedTensor(q.data, q.scale_inv, q.block)  # the GEMM layout of the scales is rebuilt per GEMM
    return q, FrozenLayout(recipe_gemm_kind(recipe), q.block, q.data.dtype, weight.dtype)


def frozen_layout(recipe: Recipe, device: torch.device, master_dtype: torch.dtype) -> FrozenLayout:
    """The layout :func:`quantize_frozen` gives under ``recipe`` on ``device`` (no cast)."""
    if isinstance(recipe, MXFP8BlockScaling):
        block = (1, 32)
    elif isinstance(recipe, Float8BlockScaling):
        block = (128, 128) if recipe.w_block_scaling_dim == 2 else (1, 128)
    else:
        block = None
    # The weight's forward format in the device's family (E4M3FNUZ on an MI300; the block
    # recipes, refused there, in the OCP formats), as the quantizers choose it.
    family = fp8_family(device) if block is None else "ocp"
    return FrozenLayout(recipe_gemm_kind(recipe), block, fp8_dtype(recipe.fp8_format, backward=False, family=family),
                        master_dtype)


def layout_problem(layout: FrozenLayout, recipe: Recipe, device: torch.device) -> str:
    """Why ``recipe``'s GEMMs cannot read a weight stored in ``layout`` as it is ("" when they can)."""
    wanted = frozen_layout(recipe, device, layout.master_dtype)
    if (wanted.kind, wanted.block, wanted.dtype) == (layout.kind, layout.block, layout.dtype):
        return ""
    return (f"the weight is stored as {layout.describe()} ({layout.kind}); {type(recipe).__name__} casts weights as "
            f"{wanted.describe()} ({wanted.kind})")


def frozen_columnwise(q: QuantizedTensor, recipe: Recipe) -> QuantizedTensor:
    """The transposed copy ``[in, out]`` dgrad reads, from a frozen weight's FP8 ``q`` ``[out, in]``.

    One scale and square blocks transpose exactly (a copy of the bytes, or for one scale under
    the CPU's BF16 emulation a view: :func:`~fp8_plugin.numerics.quantizers.columnwise_copy`);
    1-D blocks re-cast the dequantized weight's transpose with the recipe (see the module docstring).
    """
    if q.block is None or q.block[0] == q.block[1]:
        return columnwise_copy(q)
    with torch.no_grad():
        return _weight_quantizer(recipe, q.data.device).quantize(q.dequantize(torch.float32).t())


class FrozenWeightMixin:
    """What :class:`~fp8_plugin.modules.linear.FP8Linear` does with a weight kept only in FP8.

    Expects ``weight`` ``[out_features, in_features]``, ``recipe``, ``fp8_state``,
    ``weight_transposed`` and ``_weight_cache`` on the layer, and ``_frozen`` (None while the
    weight is not frozen).
    """

    _frozen: Optional[FrozenLayout]
    _layout_checked: Optional[tuple] = None  # (recipe, layout_problem's answer) for the last recipe seen

    @property
    def frozen_layout(self) -> Optional[FrozenLayout]:
        """How the weight is stored when it is kept only in FP8 (:meth:`freeze_weight`), else None."""
        return self._frozen

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the layer's high-precision weight: the weight's own, or for a weight kept
        only in FP8 the dtype it had (what its high-precision GEMMs compute in)."""
        return self.weight.dtype if self._frozen is None else self._frozen.master_dtype

    def freeze_weight(self, recipe: Optional[Recipe] = None) -> None:
        """Keep the (frozen) weight only in FP8: cast it once with ``recipe`` (default: the
        layer's) and drop the high-precision copy.

        Afterwards ``weight`` is an ``nn.Parameter`` of FP8 data ``[out_features, in_features]``
        (E4M3 under HYBRID) with ``requires_grad=False``, and the buffer ``weight_scale_inv``
        holds its float32 scales (0-dim, or one per block: see
        :mod:`fp8_plugin.modules.frozen_weight`), the names and layout of transformers' fine-
        grained FP8 checkpoints. fprop and dgrad read them as they are (no wgrad: the weight does
        not train); high-precision GEMMs read the dequantized weight. ``model.to(dtype)`` leaves
        the FP8 data alone and changes :attr:`master_dtype`.

        Raises:
            ValueError: the weight requires grad (freeze trained weights first:
                ``weight.requires_grad_(False)``), it is in GPT-2's ``Conv1D`` layout, or it is
                already frozen.
        """
        if self._frozen is not None:
            raise ValueError("FP8Linear.freeze_weight: the weight is already kept only in FP8")
        if self.weight.requires_grad:
            raise ValueError("FP8Linear.freeze_weight: the weight requires grad; only a frozen weight "
                             "(requires_grad=False) is kept only in FP8")
        if self.weight_transposed:
            raise ValueError("FP8Linear.freeze_weight: a GPT-2 Conv1D weight ([in, out]) is not kept in FP8; "
                             "transformers' FP8 layout is nn.Linear's [out, in]")
        q, layout = quantize_frozen(self.weight, recipe or self.recipe)
        self.set_frozen_weight(q.data, q.scale_inv, layout)

    def set_frozen_weight(self, data: torch.Tensor, scale_inv: torch.Tensor, layout: FrozenLayout) -> None:
        """Hold ``data`` (FP8 ``[out_features, in_features]``) and ``scale_inv`` (float32, as
        ``layout`` says) as the layer's frozen weight, as they are (no copy, no cast): what
        :meth:`freeze_weight` and the loading of FP8 checkpoints (:func:`fp8_plugin.from_pretrained`)
        use.

        Raises:
            ValueError: a shape or dtype that does not fit the layer or ``layout``.
        """
        rows, cols = self.out_features, self.in_features
        expected = () if layout.block is None else (-(-rows // layout.block[0]), -(-cols // layout.block[1]))
        if tuple(data.shape) != (rows, cols) or data.dtype != layout.dtype:
            raise ValueError(f"FP8Linear: frozen weight data {tuple(data.shape)} {data.dtype} does not fit "
                             f"[{rows}, {cols}] {layout.dtype}")
        if tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
            raise ValueError(f"FP8Linear: weight_scale_inv {tuple(scale_inv.shape)} {scale_inv.dtype} does not fit "
                             f"{layout.describe()} of a [{rows}, {cols}] weight; expected {expected} torch.float32")
        self._weight_cache = None
        self.weight = nn.Parameter(data, requires_grad=False)
        self.register_buffer("weight_scale_inv", scale_inv)
        self._frozen, self._layout_checked = layout, None

    def dequantize_weight(self, dtype: Optional[torch.dtype] = None) -> None:
        """Turn a weight kept only in FP8 back into a trainable high-precision (master) weight:
        ``data * scale_inv`` in ``dtype`` (default :attr:`master_dtype`), ``requires_grad=True``;
        ``weight_scale_inv`` is removed. A new Parameter: build the optimizer after this.
        Does nothing to a weight that is not frozen."""
        if self._frozen is None:
            return
        master = self.dense_weight(dtype).detach().clone()
        del self.weight_scale_inv
        self._frozen = None
        self.weight = nn.Parameter(master, requires_grad=True)

    def dense_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The weight in high precision (``dtype``, default :attr:`master_dtype`), in its stored
        layout: the Parameter itself, or for a weight kept only in FP8 a new dequantized tensor."""
        if self._frozen is None:
            return self.weight if dtype is None else self.weight.to(dtype)
        return self._stored().dequantize(dtype or self._frozen.master_dtype)

    def _stored(self) -> QuantizedTensor:
        return QuantizedTensor(self.weight, self.weight_scale_inv, self._frozen.block)

    def _frozen_casts(self, recipe: Recipe) -> QuantizedTensor:
        # The stored FP8 weight where the recipe reads weights as they are stored; otherwise (an
        # escalation to another recipe, an autocast recipe unlike the layer's) the dequantized
        # weight cast as a trained one would be, every forward, with one warning.
        checked = self._layout_checked  # (recipe, problem) of the last check: one per recipe, not per forward
        if checked is None or checked[0] is not recipe:
            self._layout_checked = checked = (recipe, layout_problem(self._frozen, recipe, self.weight.device))
        problem = checked[1]
        if not problem:
            return self._stored()
        if not getattr(self, "_warned_layout", False):
            self._warned_layout = True
            warnings.warn(f"FP8Linear: {problem}: the frozen weight is dequantized and cast again at every forward "
                          "(a float32 transient); freeze it with the recipe you train with", stacklevel=4)
        return make_quantizer(recipe, WEIGHT, self.fp8_state, record=False).quantize(self.dense_weight(torch.float32))

    def _check_still_frozen(self) -> None:
        if self.weight.requires_grad:
            raise RuntimeError(
                "FP8Linear: the weight is kept only in FP8 (frozen) but now requires grad; an FP8 weight cannot "
                "train. Call fp8_plugin.dequantize_frozen_weights(model) (one dequantization into high-precision "
                "master weights) before building the optimizer, or convert with frozen_weights='keep'")

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) / .half() would turn FP8 codes into numbers without their
        # scales: a frozen weight and its scales follow the device only; the dtype becomes the
        # master dtype its high-precision GEMMs use.
        if self._frozen is None:
            return super()._apply(fn, recurse)
        data, scale_inv = self.weight, self.weight_scale_inv
        del self._parameters["weight"], self._buffers["weight_scale_inv"]
        try:
            super()._apply(fn, recurse)
            probe = fn(torch.empty(0, dtype=self._frozen.master_dtype, device=data.device))
        finally:
            self._parameters["weight"], self._buffers["weight_scale_inv"] = data, scale_inv
        if probe.device != data.device:
            self.weight = nn.Parameter(data.data.to(probe.device), requires_grad=False)
            self.weight_scale_inv = scale_inv.to(probe.device)
        if probe.dtype.is_floating_point and probe.dtype != self._frozen.master_dtype:
            self._frozen, self._layout_checked = dataclasses.replace(self._frozen, master_dtype=probe.dtype), None
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A frozen layer reads a vanilla checkpoint (a high-precision weight) by casting it as
        # freeze_weight does; a trained layer reads a frozen one's FP8 weight and scales
        # dequantized. Either way no FP8 code is ever read as a number without its scale.
        key, scale_key = f"{prefix}weight", f"{prefix}weight_scale_inv"
        incoming = state_dict.get(key)
        if isinstance(incoming, torch.Tensor) and incoming.dim() == 2:
            if self._frozen is not None and not is_fp8(incoming.dtype):
                q, _ = quantize_frozen(incoming.to(self.weight.device, self._frozen.master_dtype), self.recipe)
                if q.block != self._frozen.block or q.data.dtype != self._frozen.dtype:
                    error_msgs.append(f"{key}: a high-precision weight for a frozen FP8 layer stored as "
                                      f"{self._frozen.describe()}, which its recipe {type(self.recipe).__name__} "
                                      "does not cast to; load it into the unconverted model, then convert")
                    return
                state_dict[key], state_dict[scale_key] = q.data, q.scale_inv
            elif self._frozen is None and is_fp8(incoming.dtype) and scale_key in state_dict:
                scale_inv = state_dict.pop(scale_key)
                block = _block_of(tuple(incoming.shape), tuple(scale_inv.shape))
                state_dict[key] = QuantizedTensor(incoming, scale_inv.float(), block).dequantize(self.weight.dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _adapter_dtype(self: FrozenWeightMixin) -> torch.dtype:
    return self.master_dtype


# The dtype PEFT gives new adapters on an FP8 layer: its master dtype, not a frozen weight's FP8
# dtype (fp8_plugin._private.peft_api).
setattr(FrozenWeightMixin, ADAPTER_DTYPE_ATTRIBUTE, property(_adapter_dtype, doc="The layer's master_dtype, for PEFT."))


def _block_of(shape: tuple[int, int], grid: tuple[int, ...]) -> Optional[tuple[int, int]]:
    # The block a saved scale grid stands for: None for one scale, else (1 or 128) x (32 or 128).
    if len(grid) == 0 or grid == (1,):
        return None
    rows = 1 if grid[0] == shape[0] else 128
    cols = 32 if grid[1] == -(-shape[1] // 32) and grid[1] != -(-shape[1] // 128) else 128
    if len(grid) != 2 or grid != (-(-shape[0] // rows), -(-shape[1] // cols)):
        raise ValueError(f"weight_scale_inv {grid} fits no FP8 block layout of a {shape} weight")
    return rows, cols
