"""Per-layer FP8 statistics, sampled every N optimizer steps: what each cast did to its tensor.

On a sampled step, every FP8 layer whose name matches the filters measures, for each tensor role
(input, weight, grad_output), the cast its FP8 GEMMs used (the same recipe and scales, recording
nothing): the tensor's amax, the scales (for block recipes the smallest and largest block
scale), the share of its nonzero values that underflow to zero, the share that saturate (their
scaled magnitude beyond the format's largest value, clamped to it), and the quantization error
against the high-precision tensor (MSE and SQNR). Across micro-batches and ranks the counts and
energies add up and amaxes and scales take their extremes (one SUM and one MAX all-reduce per
sampled step), so every rank holds the same figures. They stay on the device until a logger takes
them (:meth:`StatisticsCollector.pop_metrics`, one host read); loops log them on rank zero under
:data:`METRIC_PREFIX`:

``fp8_stats/<layer>/<role>/{amax, scale_min, scale_max, underflow_pct, saturation_pct, mse, sqnr_db}``

and, per ``FP8Linear``, ``fp8_stats/<layer>/blockwise``: 1.0 where the layer's scaling choice
(``FP8Linear.fp8_scaling``, set by a calibration or a reference check's fallback) is blockwise,
else 0.0 (its casts, and so the figures above, are then 1x128 / 128x128 blockwise ones).

MoE experts (:mod:`fp8_plugin.modules.experts`) report per projection
(``<experts>.gate_up_proj``, ``<experts>.down_proj``): the casts of all their experts, each with
its own scale, added up as micro-batches are (scale_min / scale_max span the experts).

Off by default. Cost on a sampled step: one more cast of each tensor, outside the training
numerics, and no host read (the figures are read when a logger takes them); nothing on the other
steps. Definitions follow Transformer Engine's debug features
(``LogFp8TensorStats``: underflows %, overflows %, scale_inv min/max, MSE).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..numerics.decode import decode_fp8
from ..numerics.formats import fp8_max
from ..numerics.quantizers import GRAD_OUTPUT, INPUT, ROLES, WEIGHT, QuantizedTensor, ScalingState, make_quantizer

__all__ = ["FP8Statistics", "StatisticsCollector", "cast_statistics", "statistics_config", "METRIC_PREFIX", "STAT_NAMES"]

METRIC_PREFIX = "fp8_stats/"
STAT_NAMES = ("amax", "scale_min", "scale_max", "underflow_pct", "saturation_pct", "mse", "sqnr_db")
# Layout of one (layer, role) accumulator: extremes first (MAX-reduced; scale_min negated), then
# sums (SUM-reduced).
_AMAX, _NEG_SCALE_MIN, _SCALE_MAX, _NUMEL, _NONZERO, _UNDERFLOW, _SATURATED, _SIGNAL, _NOISE = range(9)
_EXTREMES = 3


@dataclass(frozen=True)
class FP8Statistics:
    """Which steps and layers the per-layer FP8 statistics sample.

    Args:
        every: optimizer steps between samples (steps ``every``, ``2 * every``, ...); must be >= 1.
        layers: glob patterns over FP8 layer names (``"*.attention.*"``); None: every FP8 layer.

    Raises:
        ValueError: ``every`` below 1, or ``layers`` not strings.
    """

    every: int = 100
    layers: Optional[Sequence[str]] = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"FP8Statistics(every={self.every!r}) is invalid; valid: an int >= 1")
        if self.layers is not None:
            patterns = (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)
            if not all(isinstance(p, str) for p in patterns):
                raise ValueError(f"FP8Statistics(layers={self.layers!r}) is invalid; valid: None or glob patterns (str)")
            object.__setattr__(self, "layers", patterns)

    def selects(self, name: str) -> bool:
        """Whether the FP8 layer called ``name`` is sampled."""
        return self.layers is None or any(fnmatch.fnmatchcase(name, p) for p in self.layers)


def cast_statistics(x: torch.Tensor, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """What the cast ``q`` of ``x`` did, as sums and extremes (float64 ``[9]``, no host sync).

    Args:
        x: the high-precision tensor ``[rows, cols]`` that was cast.
        q: its cast (per-tensor or block ``scale_inv``).
        dtype: the FP8 dtype of ``q.data`` (its largest value bounds saturation).

    Returns:
        ``[amax, -scale_min, scale_max, numel, nonzero, underflow, saturated, sum x^2,
        sum (dequantized - x)^2]``: a value underflows when it is nonzero and its FP8 value is
        zero; it saturates when ``|x| * scale`` exceeds the format's largest finite value.
    """
    xf = x.detach().to(torch.float32)
    data = decode_fp8(q.data)
    if q.block is None:
        scale_inv = q.scale_inv
    else:
        rows, cols = xf.shape
        scale_inv = q.scale_inv.repeat_interleave(q.block[0], 0).repeat_interleave(q.block[1], 1)[:rows, :cols]
    nonzero = xf != 0
    scaled = xf.abs() / scale_inv
    error = q.dequantize(torch.float64) - xf.to(torch.float64)
    scale = 1.0 / q.scale_inv.to(torch.float64)
    return torch.stack([
        xf.abs().amax().to(torch.float64) if xf.numel() else xf.new_zeros((), dtype=torch.float64),
        -scale.min(), scale.max(),
        xf.new_full((), float(xf.numel()), dtype=torch.float64),  # a fill: no copy from the host
        nonzero.sum().to(torch.float64),
        (nonzero & (data == 0)).sum().to(torch.float64),
        (scaled > fp8_max(dtype)).sum().to(torch.float64),
        xf.to(torch.float64).square().sum(),
        error.square().sum(),
    ])  # fmt: skip


class StatisticsCollector:
    """Samples the statistics of one model's FP8 layers on the steps :class:`FP8Statistics` picks.

    Loops call :meth:`start_step` when a training step's first forward begins and
    :meth:`end_step` after its optimizer step (every rank: it reduces), and :meth:`pop_metrics`
    when a logger takes the figures: until then they stay on the device (the latest sample of
    each layer and role), so that sampling never makes a training step wait for the host.
    """

    def __init__(self, config: FP8Statistics) -> None:
        self.config = config
        self._handles: list = []
        self._sums: dict[tuple[str, int], torch.Tensor] = {}
        # (layer, role) -> its latest sampled figures, reduced, float64 [9] on the device.
        self._pending: dict[tuple[str, int], torch.Tensor] = {}
        # layer -> whether its sampled casts were blockwise (a host-side switch: no device read).
        self._blockwise: dict[str, bool] = {}

    def start_step(self, model: nn.Module, step: int) -> None:
        """Attach the hooks if optimizer step ``step`` (1-based) is sampled (once per step)."""
        if self._handles or step % self.config.every:
            return
        from ..modules.linear import FP8Linear  # the layer module imports this one's package peers

        from ..modules.experts import FP8ExpertsMixin

        for name, layer in model.named_modules():
            if isinstance(layer, FP8Linear) and self.config.selects(name):
                # Ahead of other forward hooks: DeepSpeed ZeRO-3's releases the gathered weight.
                self._handles.append(layer.register_forward_hook(self._forward_hook(name), prepend=True))
            elif isinstance(layer, FP8ExpertsMixin) and self.config.selects(name):
                # MoE experts: each expert's cast as training made it, added up per projection.
                self._handles.append(layer.observe_casts(self._expert_observer(name)))

    def _expert_observer(self, name: str):
        def observe(proj: str, role: int, x: torch.Tensor, q: QuantizedTensor) -> None:
            with torch.no_grad():
                self._accumulate((f"{name}.{proj}", role), cast_statistics(x, q, q.data.dtype))
        return observe

    def _forward_hook(self, name: str):
        def hook(layer, args, output):
            context = layer._forward_context
            if context is None or context.recipe is None or not context.training:
                return  # a high-precision or evaluation forward: not what training casts
            recipe = context.recipe
            self._blockwise[name] = layer.fp8_scaling == "blockwise"
            with torch.no_grad():
                x2d = args[0].detach().reshape(-1, layer.in_features)
                self._add(name, INPUT, x2d, recipe, layer.fp8_state.input_source)
                w = layer.weight.detach()
                if getattr(layer, "frozen_layout", None) is not None:  # kept only in FP8: the stored cast itself
                    q = layer._stored()
                    self._accumulate((name, WEIGHT), cast_statistics(layer.dense_weight(torch.float32), q, q.data.dtype))
                elif not hasattr(w, "fp8_operand"):  # an FP8-gathered weight has no high-precision copy here
                    self._add(name, WEIGHT, w.t() if layer.weight_transposed else w, recipe, layer.fp8_state)
            if output.requires_grad:
                output.register_hook(self._grad_hook(name, layer, recipe))
        return hook

    def _grad_hook(self, name: str, layer: nn.Module, recipe):
        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                self._add(name, GRAD_OUTPUT, grad.detach().reshape(-1, layer.out_features), recipe, layer.fp8_state)
        return hook

    def _add(self, name: str, role: int, x: torch.Tensor, recipe, state: ScalingState) -> None:
        # The cast training made: the same recipe and scales, recording nothing.
        q = make_quantizer(recipe, role, state, record=False, host=False).quantize(x)
        self._accumulate((name, role), cast_statistics(x, q, q.data.dtype))

    def _accumulate(self, key: tuple[str, int], figures: torch.Tensor) -> None:
        if key not in self._sums:
            self._sums[key] = figures
            return
        acc = self._sums[key]
        self._sums[key] = torch.cat([torch.maximum(acc[:_EXTREMES], figures[:_EXTREMES]),
                                     acc[_EXTREMES:] + figures[_EXTREMES:]])

    def end_step(self, group: Optional["dist.ProcessGroup"] = None) -> None:
        """Detach the hooks and reduce the sampled step's figures across ``group``, on the device
        (every rank must call it on a sampled step; nothing happens on the others)."""
        if not self._handles:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if not self._sums:
            return
        keys = sorted(self._sums)
        table = torch.stack([self._sums[k] for k in keys])
        self._sums = {}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            # Ranks sample the same layers in the same order (the same model, the same step).
            extremes, sums = table[:, :_EXTREMES].contiguous(), table[:, _EXTREMES:].contiguous()
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            table = torch.cat([extremes, sums], dim=1)
        self._pending.update(zip(keys, table.unbind(0)))  # read on the host only by pop_metrics

    def pop_metrics(self) -> dict[str, float]:
        """The figures of the sampled steps since the last call (latest per layer and role), once:
        one host read, none when nothing was sampled."""
        if not self._pending:
            return {}
        choices = {f"{METRIC_PREFIX}{name + '/' if name else ''}blockwise": float(flag)
                   for name, flag in self._blockwise.items()}
        self._blockwise = {}
        keys = sorted(self._pending)
        rows = torch.stack([self._pending[k] for k in keys]).tolist()
        self._pending = {}
        metrics: dict[str, float] = {}
        for (name, role), row in zip(keys, rows):
            prefix = f"{METRIC_PREFIX}{name + '/' if name else ''}{ROLES[role]}/"  # "": the model is the layer
            numel, nonzero = row[_NUMEL], row[_NONZERO]
            signal, noise = row[_SIGNAL], row[_NOISE]
            metrics.update({
                prefix + "amax": row[_AMAX],
                prefix + "scale_min": -row[_NEG_SCALE_MIN],
                prefix + "scale_max": row[_SCALE_MAX],
                prefix + "underflow_pct": 100.0 * row[_UNDERFLOW] / nonzero if nonzero else 0.0,
                prefix + "saturation_pct": 100.0 * row[_SATURATED] / numel if numel else 0.0,
                prefix + "mse": noise / numel if numel else 0.0,
                prefix + "sqnr_db": 10.0 * math.log10(signal / noise) if noise > 0 and signal > 0 else math.inf,
            })  # fmt: skip
        metrics.update(choices)
        return metrics


def statistics_config(value: Union[FP8Statistics, int, None], owner: str, name: str = "statistics") -> Optional[FP8Statistics]:
    """An :class:`FP8Statistics` from a loop's setting ``owner(name=value)``: one, an interval
    (``every``, an int >= 1), or None (off).

    Raises:
        TypeError: any other value, naming the setting.
        ValueError: an interval below 1.
    """
    if value is None or isinstance(value, FP8Statistics):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"{owner}({name}={value!r}) is invalid; valid: None, an int >= 1, an FP8Statistics")
        return FP8Statistics(every=value)
    raise TypeError(f"{owner}({name}={value!r}) is invalid; valid: None, an int >= 1, an FP8Statistics")
