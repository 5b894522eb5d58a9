"""How each FP8 layer should scale, measured: the calibration's second job
(:func:`fp8_plugin.calibrate`, docs/calibration.md) and its report.

Each ``FP8Linear`` is measured on the inputs the high-precision model gives it, under the recipe
in force and its blockwise variant: its fprop output against the same GEMM in high precision
(token-mean SQNR) and its input's cast alone (the worse of token-mean and channel-mean SQNR);
its figure under a candidate is the worse of the two, and the choice follows from the figures
(:func:`decide`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._private.torch_api import in_backward_pass
from ..numerics.device_kind import device_kind
from ..numerics.gemm import native_gemm
from ..numerics.quantizers import INPUT, make_quantizer
from ..numerics.recipes import DelayedScaling, Float8CurrentScaling, Recipe, blockwise_variant
from .autocast import autocast
from .linear import FP8Linear

__all__ = ["CalibrationReport", "LayerCalibration", "CHOICES", "blockwise_allowed", "scaling_candidates", "choose",
           "decide", "Fidelity", "sqnr_hook", "group_of", "recomputed", "all_reduce_on_host"]

#: A layer's outcome: as the recipe in force says, blockwise, or high precision (``use_fp8 = False``).
CHOICES = ("recipe", "blockwise", "high precision")


@dataclass
class LayerCalibration:
    """One FP8 layer's calibration.

    Attributes:
        name: the module's name in the model.
        kind: ``"linear"`` (an ``FP8Linear``) or ``"experts"`` (a MoE experts module, whose
            scaling is not chosen: its experts keep the recipe).
        input_amax, weight_amax: the largest amax seen over the batches (for experts: over all
            experts and both projections).
        sqnr_recipe_db: fprop output SQNR (dB, token-mean) under the recipe in force with the
            calibrated scales; None where not measured (experts, a layer whose fprop is not in FP8).
        sqnr_blockwise_db: the same under the blockwise variant; None where not measured (a
            block-scaled recipe, experts).
        input_sqnr_recipe_db, input_sqnr_blockwise_db: the SQNR (dB) of the input's cast alone
            under each, the worse of its token-mean and its channel-mean (each input channel's
            error energy over its signal energy, averaged over the channels): what the saved
            input the wgrad reads keeps of every channel.
        choice: one of :data:`CHOICES`.
        reason: why, in words.
        grad_output_amax: the largest amax of the gradient of the layer's output over the
            backwards of a loop's calibration steps; None where none ran (:func:`calibrate`
            runs no backward) or for experts.
    """

    name: str
    kind: str
    input_amax: float
    weight_amax: float
    sqnr_recipe_db: Optional[float] = None
    sqnr_blockwise_db: Optional[float] = None
    input_sqnr_recipe_db: Optional[float] = None
    input_sqnr_blockwise_db: Optional[float] = None
    choice: str = "recipe"
    reason: str = ""
    grad_output_amax: Optional[float] = None


@dataclass
class CalibrationReport:
    """What :func:`calibrate` did: the batches it ran and one :class:`LayerCalibration` per FP8
    layer. ``str(report)`` is a table; :meth:`to_dict` the same as plain data (JSON-ready)."""

    batches: int
    recipe: str
    outlier_margin_db: float
    min_sqnr_db: float
    layers: list[LayerCalibration] = field(default_factory=list)

    def count(self, choice: str) -> int:
        """How many layers got ``choice`` (one of :data:`CHOICES`)."""
        return sum(layer.choice == choice for layer in self.layers)

    def annotate(self, conversion: Any) -> int:
        """Write each calibrated layer's choice into ``conversion`` (the
        :class:`~fp8_plugin.ConversionReport` of the same model): the decision's ``scaling``, and
        where the choice is not the recipe, its reason with the SQNR that decided it, after the
        decision's own reason (so the report's table shows it). The loops' calibration steps call
        it; after :func:`~fp8_plugin.calibrate`, call it with the report ``convert_model``
        returned. Returns how many decisions it wrote."""
        decisions = {d.name: d for d in conversion.layers}
        written = 0
        for layer in self.layers:
            decision = decisions.get(layer.name)
            if decision is None or layer.kind != "linear":
                continue
            decision.scaling = layer.choice
            if layer.choice != "recipe":
                note = f"calibration chose {layer.choice}: {layer.reason}"
                decision.reason = "; ".join(filter(None, (decision.reason, note)))
            written += 1
        return written

    def to_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "recipe": self.recipe, "outlier_margin_db": self.outlier_margin_db,
                "min_sqnr_db": self.min_sqnr_db, "layers": [asdict(layer) for layer in self.layers]}

    def __str__(self) -> str:
        def db(v: Optional[float]) -> str:
            return "-" if v is None else f"{v:.1f}"

        lines = [f"FP8 calibration: {self.batches} batches, {self.recipe}; {len(self.layers)} layers: "
                 + ", ".join(f"{self.count(c)} {c}" for c in CHOICES),
                 "SQNR in dB, fprop / input cast, under the recipe and blockwise:",
                 f"{'layer':48s} {'input amax':>10s} {'recipe':>11s} {'blockwise':>11s}  choice"]
        for layer in self.layers:
            lines.append(f"{layer.name:48s} {layer.input_amax:10.4g} "
                         f"{db(layer.sqnr_recipe_db) + ' / ' + db(layer.input_sqnr_recipe_db):>11s} "
                         f"{db(layer.sqnr_blockwise_db) + ' / ' + db(layer.input_sqnr_blockwise_db):>11s}  "
                         f"{layer.choice}")
        return "\n".join(lines)


def group_of(process_group: Optional["dist.ProcessGroup"]) -> tuple[Any, bool]:
    """``(group, whether it spans several ranks)``; ``(None, False)`` without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, False
    return process_group, dist.get_world_size(process_group) > 1


def all_reduce_on_host(values: torch.Tensor, op: "dist.ReduceOp", group: Any) -> torch.Tensor:
    """``values`` (a CPU tensor) all-reduced over ``group`` in place, and returned: through the
    current CUDA device where the group's backend is NCCL, which reduces no CPU tensor."""
    if dist.get_backend(group) == "nccl":
        on_device = values.cuda()
        dist.all_reduce(on_device, op=op, group=group)
        values.copy_(on_device.cpu())
    else:
        dist.all_reduce(values, op=op, group=group)
    return values


def recomputed() -> bool:
    """Whether this forward is activation checkpointing's rerun in a backward (a calibration
    step's batch, recorded once already)."""
    return torch.is_grad_enabled() and in_backward_pass()


def scaling_candidates(layers: dict[str, FP8Linear], recipe: Optional[Recipe], online: bool) -> dict[str, tuple]:
    """``{name: (recipe measured, blockwise variant or None)}`` for each layer whose fprop runs
    in FP8 under ``recipe`` (None: each layer's own): the blockwise variant for a per-tensor
    recipe where :func:`blockwise_allowed`; ``online``, the per-tensor candidate is current
    scaling in the recipe's format (each batch scaled from its own amax)."""
    out = {}
    for name, layer in layers.items():
        used = recipe or layer.recipe
        if not layer.use_fp8 or not layer.gemms_in_fp8(used)[0]:
            continue
        per_tensor = isinstance(used, (DelayedScaling, Float8CurrentScaling))
        block = blockwise_variant(used) if per_tensor and blockwise_allowed(layer) else None
        measured = Float8CurrentScaling(fp8_format=used.fp8_format) if online and per_tensor else used
        out[name] = (measured, block)
    return out


def choose(model: nn.Module, layers: dict[str, FP8Linear], batches: list, run: Callable, recipe: Optional[Recipe],
           report: CalibrationReport, process_group: Any) -> None:
    """The calibration's second pass: ``batches`` run again in high precision (``run(model,
    batch)``), each layer of ``report`` measured under its candidates (the recipe with the
    calibrated scales, its blockwise variant), then :func:`decide`."""
    recorded = {row.name for row in report.layers}
    measured = {n: c for n, c in scaling_candidates(layers, recipe, online=False).items() if n in recorded}
    energies = {name: Fidelity(layers[name].in_features) for name in measured}
    hooks = [layers[name].register_forward_pre_hook(sqnr_hook(energies[name], *measured[name]))
             for name in measured]
    try:
        with torch.no_grad(), autocast(enabled=False):
            for batch in batches:
                run(model, batch)
    finally:
        for h in hooks:
            h.remove()
    decide(layers, measured, energies, report, process_group)


def decide(layers: dict[str, FP8Linear], measured: dict[str, tuple], energies: dict[str, "Fidelity"],
           report: CalibrationReport, process_group: Any) -> None:
    """Each measured layer's figures (sums over the batches, SUM-reduced over ``process_group``'s
    ranks where ``torch.distributed`` runs: every rank decides alike) into ``report``, and its
    choice: by the worse of its fprop and input figures, so that an outlier that harms only what
    the backward reads (a channel's values crushed in the saved input) decides too. Sets the
    layers' ``fp8_scaling`` or ``use_fp8``."""
    group, distributed = group_of(process_group)
    if distributed and energies:
        flat = all_reduce_on_host(torch.cat([energies[n].sums for n in measured]), dist.ReduceOp.SUM, group)
        for n, part in zip(measured, flat.split([energies[n].sums.numel() for n in measured])):
            energies[n].sums = part
    rows = {row.name: row for row in report.layers}
    margin = report.outlier_margin_db
    for name, (_, block) in measured.items():
        layer, row = layers[name], rows.get(name)
        layer.clear_weight_cache()
        figures = energies[name].figures()
        if row is None or figures is None:
            continue
        row.sqnr_recipe_db, row.input_sqnr_recipe_db = figures[0]
        worst = {"recipe": min(figures[0])}
        if block is not None:
            row.sqnr_blockwise_db, row.input_sqnr_blockwise_db = figures[1]
            worst["blockwise"] = min(figures[1])
        best = max(worst.values())
        if best < report.min_sqnr_db:
            layer.use_fp8 = False
            row.choice = "high precision"
            row.reason = f"best FP8 figure {best:.1f} dB < {report.min_sqnr_db:g} dB"
        elif block is not None and worst["blockwise"] >= worst["recipe"] + margin:
            layer.fp8_scaling = "blockwise"
            row.choice = "blockwise"
            row.reason = f"blockwise {worst['blockwise']:.1f} dB >= per-tensor {worst['recipe']:.1f} dB + {margin:g} dB"
        else:
            layer.fp8_scaling = "recipe"
            row.choice = "recipe"
            row.reason = "per-tensor within the margin" if block is not None else "the recipe holds"


def blockwise_allowed(layer: FP8Linear) -> bool:
    """Whether ``layer`` may move to blockwise scaling here: its weight neither gathered in FP8
    by FSDP2 nor kept only in FP8, and blockwise GEMMs native on its GPU (on a CPU every GEMM is
    emulated: allowed)."""
    # On a GPU, emulated blockwise would be far slower than high precision; a weight FSDP2
    # gathers in FP8 is per-tensor scaled before the gather.
    if hasattr(layer.weight, "fp8_operand") or layer.frozen_layout is not None:
        return False
    device = layer.weight.device
    return device_kind(device) == "cpu" or native_gemm("blockwise", device).native


def _db(signal: float, noise: float) -> float:
    if noise <= 0:
        return math.inf
    if signal <= 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


class Fidelity:
    """A layer's sums for its candidates' figures, over batches (and ranks: :attr:`sums` is one
    float64 tensor, SUM-reduced as it is). Per candidate (0: the recipe, 1: blockwise):

    - fprop, token-mean: the sum over output rows of |error|^2 / |output|^2, and the row count;
    - the input cast, token-mean: the same over input rows;
    - the input cast, channel-mean: per input channel, the sums over tokens of |error|^2 and of
      |x|^2, whose ratio is averaged over the channels at the end.

    Token-mean, not one sum over the tensor: a massive activation's own row would otherwise hold
    most of the energy and hide the damage its scale does to every other row; channel-mean for
    the outliers a channel carries in every token (a norm's weight), which crush the other
    channels' values in the cast the wgrad reads.
    """

    def __init__(self, in_features: int) -> None:
        self.k = in_features
        # [rows out, fprop x2, rows in, input rows x2, channel sums: |x|^2, |e|^2 x2 (K each)]
        self.sums = torch.zeros(6 + 3 * in_features, dtype=torch.float64)

    def add(self, slot: int, out_ratio: torch.Tensor, in_ratio: torch.Tensor, in_col_noise: torch.Tensor) -> None:
        self.sums[1 + slot] += float(out_ratio.sum())
        self.sums[4 + slot] += float(in_ratio.sum())
        start = 6 + (1 + slot) * self.k
        self.sums[start:start + self.k] += in_col_noise

    def figures(self) -> Optional[list[tuple[float, float]]]:
        """Per candidate (fprop token-mean, input min(token-mean, channel-mean)) SQNR in dB; None
        when nothing was measured."""
        rows_out, rows_in = float(self.sums[0]), float(self.sums[3])
        if rows_out == 0 or rows_in == 0:
            return None
        signal = self.sums[6:6 + self.k]
        live = signal > 0
        out = []
        for slot in (0, 1):
            noise = self.sums[6 + (1 + slot) * self.k:6 + (2 + slot) * self.k]
            channel = float((noise[live] / signal[live]).mean()) if bool(live.any()) else 0.0
            token = float(self.sums[4 + slot]) / rows_in
            out.append((_db(rows_out, float(self.sums[1 + slot])), min(_db(1.0, token), _db(1.0, channel))))
        return out


def sqnr_hook(fidelity: Fidelity, used: Recipe, block: Optional[Recipe]) -> Callable:
    """A forward pre-hook of an ``FP8Linear`` that adds each call's figures under ``used`` and
    ``block`` (None: not measured) to ``fidelity``."""
    # No autograd (a loop's calibration steps record inside training forwards); the reference
    # in float32 outside torch autocast, the FP8 candidates as they would run there.
    def hook(layer: FP8Linear, args: tuple) -> None:
        if recomputed():
            return
        x = args[0].detach()
        with torch.no_grad():
            weight = layer.dense_weight()
            w2d = weight.t() if layer.weight_transposed else weight
            with torch.autocast(device_kind(x.device), enabled=False):
                want = F.linear(x.to(torch.float32), w2d.to(torch.float32))
            want = want.to(torch.float64).reshape(-1, layer.out_features)
            x64 = x.reshape(-1, layer.in_features).to(torch.float64)
            signal, x_rows = want.square().sum(dim=1), x64.square().sum(dim=1)
            kept, kept_in = signal > 0, x_rows > 0
            fidelity.sums[0] += float(kept.sum())
            fidelity.sums[3] += float(kept_in.sum())
            fidelity.sums[6:6 + fidelity.k] += x64.square().sum(dim=0).cpu()
            bias = None if layer.bias is None else layer.bias.to(torch.float64)
            for slot, candidate in ((0, used), (1, block)):
                if candidate is None:
                    continue
                got = layer._fp8_forward(x, candidate, record_forward=False, record_backward=False)
                got = got.to(torch.float64).reshape(-1, layer.out_features)
                if bias is not None:
                    got = got - bias
                cast = make_quantizer(candidate, INPUT, layer.fp8_state.input_source, record=False)
                error = cast.quantize(x.reshape(-1, layer.in_features)).dequantize().to(torch.float64) - x64
                e2 = error.square()
                fidelity.add(slot, (got - want).square().sum(dim=1)[kept] / signal[kept],
                             e2.sum(dim=1)[kept_in] / x_rows[kept_in], e2.sum(dim=0).cpu())
    return hook
