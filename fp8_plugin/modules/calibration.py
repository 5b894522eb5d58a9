"""``fp8_plugin.calibrate``: a model's FP8 scales from real data before its first FP8 step, and
each layer's scaling chosen by the fidelity it measured.

Transformer Engine calibrates inside ``fp8_autocast(enabled=False, calibrating=True)``: the
forwards run in high precision and record amaxes. This does the same in two passes over the
calibration batches, both in high precision (FP8 off):

1. **Amaxes.** Every FP8 GEMM operand's amax (the input and the weight of each ``FP8Linear``,
   each expert's input and weight) per batch. The delayed-scaling histories are filled from them
   (the newest in column 1, column 0 left as the first training step's slot), the scales
   computed with the recipe's ``amax_compute_algo`` and margin, and marked initialized: no layer
   casts its first steps from a guess. A MoE experts module gives every expert of a projection
   the amax of all its experts' inputs, so that an expert whose calibration batches routed it no
   token (or no outlier token) still has a scale that covers the module's tokens. (Those input
   scales serve experts with ``token_scaling="recipe"``; by default an expert's token rows are
   scaled by their own amax at each cast, and its weights by the calibrated scales.)
2. **Scaling per layer.** Each ``FP8Linear`` is measured on the inputs the high-precision model
   gives it, under the recipe in force with the scales just calibrated and under its blockwise
   variant (1x128 activation tiles, 128x128 weight blocks:
   :func:`~fp8_plugin.numerics.recipes.blockwise_variant`): its fprop output against the same
   GEMM in high precision (SQNR in dB, token-mean: ``-10 log10(mean over output rows of
   |error|^2 / |output|^2)``), and its input's cast alone (the worse of the token-mean and the
   channel-mean SQNR: what the saved input the wgrad reads keeps of every token and channel).
   A layer's figure under a candidate is the worse of the two. The layer keeps the recipe where
   blockwise scaling would not gain ``outlier_margin_db``, moves to ``fp8_scaling =
   "blockwise"`` where it would (activation outliers: the "massive activations" of a token, or
   a channel a norm's weight makes huge in every token), and to high precision (``use_fp8 =
   False``) where no candidate reaches ``min_sqnr_db``.

The amax history, the scales and the choice are the layers' FP8 scaling state, saved in every
checkpoint that carries it. :func:`calibrate` runs no backward, so grad_output is not
calibrated there (as in TE); a loop's calibration steps (``Calibrator(online=True)``) run theirs,
and each ``FP8Linear``'s grad_output history and scale come from the amaxes of the gradients of
its output in those backwards (MoE experts' grad_output is not calibrated).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..numerics.quantizers import GRAD_OUTPUT, INPUT, WEIGHT, ScalingState, update_delayed_scaling
from ..numerics.recipes import DelayedScaling, Recipe
from .autocast import autocast
from .experts import FP8ExpertsMixin
from .linear import FP8Linear
from .scaling_choice import (
    CHOICES, CalibrationReport, Fidelity, LayerCalibration, all_reduce_on_host, blockwise_allowed, choose, decide,
    group_of, recomputed, scaling_candidates, sqnr_hook,
)  # fmt: skip
from .weight_cache import clear_weight_caches

__all__ = ["calibrate", "Calibrator", "CalibrationReport", "LayerCalibration", "CHOICES", "blockwise_allowed"]

def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _check(name: str, value: Any, valid: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"calibrate({name}={value!r}) is invalid; valid: {valid}")


def calibrate(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    forward: Optional[Callable[[nn.Module, Any], Any]] = None,
    recipe: Optional[Recipe] = None,
    choose_scaling: bool = True,
    outlier_margin_db: float = 1.0,
    min_sqnr_db: float = 20.0,
    process_group: Optional["dist.ProcessGroup"] = None,
) -> CalibrationReport:
    """Calibrate a converted model's FP8 scales on ``batches`` and choose each layer's scaling.

    Run it after :func:`fp8_plugin.convert_model` and before the first FP8 step (or before FP8
    evaluation of a trained model). The forwards run in high precision under ``torch.no_grad()``
    in the model's current mode (train or eval) and the caller's torch autocast, if any.

    Args:
        model: a model converted by :func:`fp8_plugin.convert_model`.
        batches: the calibration batches (a list, a DataLoader or any iterable; each batch is
            kept until the second pass). Each is passed as ``model(**batch)`` (a dict),
            ``model(*batch)`` (a tuple or list) or ``model(batch)``, or to ``forward``.
        forward: ``forward(model, batch)`` runs one batch, for models called otherwise.
        recipe: the recipe the model will run (default: each layer's own recipe, as
            ``convert_model`` set it); delayed-scaling histories are resized to its length.
        choose_scaling: measure and choose each ``FP8Linear``'s scaling (pass 2); False fills
            the scales only.
        outlier_margin_db: a per-tensor layer moves to blockwise scaling where blockwise gives
            a figure (the worse of its fprop and input-cast SQNR) at least this many dB higher
            (1 dB: 21% less noise power).
        min_sqnr_db: a layer whose best FP8 figure is below this moves to high precision
            (20 dB: a 10% RMS error, as :class:`fp8_plugin.ReferenceCheck`'s ``min_sqnr_db``).
        process_group: the ranks that calibrate together (default: the world, where
            ``torch.distributed`` is initialized): amaxes are MAX-reduced and SQNR sums SUM-reduced
            over them, so every rank gets the same scales and choices. Every rank must call it,
            with as many batches.

    Returns:
        A :class:`CalibrationReport`.

    Raises:
        ValueError: no FP8 layer in ``model``; no batch; an invalid ``outlier_margin_db`` or
            ``min_sqnr_db``.
    """
    calibrator = Calibrator(model, recipe=recipe, choose_scaling=choose_scaling, outlier_margin_db=outlier_margin_db,
                            min_sqnr_db=min_sqnr_db)
    batches = list(batches)
    if not batches:
        raise ValueError("calibrate(batches=...) is empty; valid: at least one batch")
    run = forward or _call
    with torch.no_grad(), autocast(enabled=False), calibrator.recording():
        for batch in batches:
            run(model, batch)
    report = calibrator.finish(process_group)
    if choose_scaling:
        choose(model, calibrator.layers, batches, run, recipe, report, process_group)
    return report


class Calibrator:
    """The calibration of one model, run by :func:`calibrate` or by a training loop's first
    steps (``FP8Training(calibration_steps=N)``): forwards run in high precision inside
    :meth:`recording` record amaxes; :meth:`finish` fills the scaling states and returns the
    report.

    With ``online=True`` (a loop's calibration steps, whose batches are not run twice) the
    scaling is chosen from the same forwards: the per-tensor candidate is then scaled from each
    batch's own amax (``Float8CurrentScaling`` in the recipe's format) rather than from the
    calibrated history; :func:`calibrate` measures it with the calibrated scales, in a second pass.
    Online, the backwards of those steps also record each ``FP8Linear``'s grad_output amax (a
    hook on the layer's output; one host read per layer and backward, in the calibration steps
    only), which :meth:`finish` fills in as it fills input and weight.

    Args:
        model, recipe, choose_scaling, outlier_margin_db, min_sqnr_db: as :func:`calibrate`.
        online: choose from the recording forwards (above).

    Raises:
        ValueError: as :func:`calibrate`.
    """

    def __init__(self, model: nn.Module, *, recipe: Optional[Recipe] = None, choose_scaling: bool = True,
                 outlier_margin_db: float = 1.0, min_sqnr_db: float = 20.0, online: bool = False) -> None:
        _check("outlier_margin_db", outlier_margin_db, "a finite number >= 0",
               isinstance(outlier_margin_db, (int, float)) and not isinstance(outlier_margin_db, bool)
               and math.isfinite(outlier_margin_db) and outlier_margin_db >= 0)
        _check("min_sqnr_db", min_sqnr_db, "a finite number of dB", isinstance(min_sqnr_db, (int, float))
               and not isinstance(min_sqnr_db, bool) and math.isfinite(min_sqnr_db))
        self.model = model
        self.recipe = recipe
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
        self.experts = {name: m for name, m in model.named_modules() if isinstance(m, FP8ExpertsMixin)}
        if not self.layers and not self.experts:
            raise ValueError("calibrate: the model has no FP8 layer; call fp8_plugin.convert_model(model) first")
        self.report = CalibrationReport(0, _describe(recipe, self.layers, self.experts), float(outlier_margin_db),
                                        float(min_sqnr_db))
        self.online = online and choose_scaling
        self._amaxes: dict[str, list[torch.Tensor]] = {}
        # Online only: the amax of each backward's gradient of a layer's output (grad_output).
        self._grad_amaxes: dict[str, list[torch.Tensor]] = {}
        self._candidates = scaling_candidates(self.layers, recipe, online=True) if self.online else {}
        self._energies = {name: Fidelity(self.layers[name].in_features) for name in self._candidates}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the amaxes (and online, the SQNR) of the forwards run inside; each is a batch.
        The caller runs them in high precision (FP8 off)."""
        hooks = [m.register_forward_pre_hook(_linear_amax_hook(self._amaxes, name)) for name, m in self.layers.items()]
        hooks += [m.register_forward_pre_hook(_experts_amax_hook(self._amaxes, name), with_kwargs=True)
                  for name, m in self.experts.items()]
        hooks += [self.layers[name].register_forward_pre_hook(sqnr_hook(self._energies[name], *candidate))
                  for name, candidate in self._candidates.items()]
        if self.online:  # a loop's steps run their backward: grad_output's amaxes too
            hooks += [m.register_forward_hook(_grad_amax_hook(self._grad_amaxes, name))
                      for name, m in self.layers.items()]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def finish(self, process_group: Optional["dist.ProcessGroup"] = None) -> CalibrationReport:
        """Fill every recorded layer's scaling state (amaxes MAX-reduced over ``process_group``
        where ``torch.distributed`` runs: every rank must call it), choose the scaling online,
        and return the report."""
        group, distributed = group_of(process_group)
        # [calls, 2 (input, weight)] per linear layer, [calls, 2, projections, experts] per experts
        # module; [backwards] per linear layer's grad_output (online, under "<name>/grad_output").
        stacked = {n: torch.stack(v) for n, v in self._amaxes.items()}
        stacked.update({f"{n}/grad_output": torch.stack(v) for n, v in self._grad_amaxes.items()})
        names = list(stacked)
        if distributed and names:
            flat = all_reduce_on_host(torch.cat([stacked[n].flatten() for n in names]), dist.ReduceOp.MAX, group)
            stacked = {n: t.view_as(stacked[n]) for n, t in zip(names, flat.split([stacked[n].numel() for n in names]))}
        report = self.report
        updates: dict = {}  # (delayed recipe, role) -> the states its update makes scales for
        report.batches = max((len(v) for v in self._amaxes.values()), default=0)
        for name, layer in self.layers.items():
            if name not in stacked:  # never called by the batches: left as it was
                continue
            history = stacked[name]
            per_role = {INPUT: history[:, 0], WEIGHT: history[:, 1]}
            grads = stacked.get(f"{name}/grad_output")
            if grads is not None:
                per_role[GRAD_OUTPUT] = grads
            _fill(layer.fp8_state, self.recipe or layer.recipe, per_role, updates)
            report.layers.append(LayerCalibration(name, "linear", float(history[:, 0].max()),
                                                  float(history[:, 1].max()),
                                                  grad_output_amax=None if grads is None else float(grads.max())))
        for name, module in self.experts.items():
            if name not in stacked:
                continue
            history = stacked[name]
            for p, proj in enumerate(module.fp8_scaling):
                shared_input = history[:, 0, p].amax(dim=1)  # every expert: the module's tokens
                for e, member in enumerate(module.fp8_scaling[proj]):
                    _fill(member.fp8_state, self.recipe or module.recipe,
                          {INPUT: shared_input, WEIGHT: history[:, 1, p, e]}, updates)
            report.layers.append(LayerCalibration(name, "experts", float(history[:, 0].max()),
                                                  float(history[:, 1].max()),
                                                  reason=_experts_reason(module)))
        _update(updates)
        clear_weight_caches(self.model)  # weight casts made with the scales before
        self._amaxes, self._grad_amaxes = {}, {}
        if self.online:
            decide(self.layers, self._candidates, self._energies, report, process_group)
        return report


def _experts_reason(module: FP8ExpertsMixin) -> str:
    if module.token_scaling == "current":
        return ("experts keep the recipe for their weights; their token rows are scaled by their own amax at each "
                "cast (token_scaling='current')")
    return "experts keep the recipe; each expert's input scale covers all the module's tokens"


def _describe(recipe: Optional[Recipe], layers: dict, experts: dict) -> str:
    if recipe is not None:
        return type(recipe).__name__
    kinds = sorted({type(m.recipe).__name__ for m in (*layers.values(), *experts.values())})
    return ", ".join(kinds)


def _amax(x: torch.Tensor) -> torch.Tensor:
    # Non-finite values are not an amax any scale could serve: left out, as the casts count them.
    a = x.detach().abs().to(torch.float32)
    return torch.where(torch.isfinite(a), a, torch.zeros((), device=a.device)).amax() if a.numel() else a.new_zeros(())


def _linear_amax_hook(amaxes: dict, name: str) -> Callable:
    def hook(layer: FP8Linear, args: tuple) -> None:
        if recomputed():
            return
        weight = layer.dense_weight()
        amaxes.setdefault(name, []).append(torch.stack([_amax(args[0]), _amax(weight)]).cpu())
    return hook


def _grad_amax_hook(amaxes: dict, name: str) -> Callable:
    # The gradient of the layer's output, as the FP8 backward would cast it (grad_output): a hook
    # on the output tensor, which autograd calls once per backward (an activation-checkpoint
    # rerun's output is not in the graph that backward walks, and is skipped).
    def hook(layer: FP8Linear, args: tuple, output: torch.Tensor) -> None:
        if recomputed() or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        output.register_hook(lambda grad: amaxes.setdefault(name, []).append(_amax(grad).cpu()))
    return hook


def _experts_amax_hook(amaxes: dict, name: str) -> Callable:
    # Each expert's input amax of both projections, in high precision: the routed rows of the
    # hidden states, then their intermediate activation, as the experts' forward computes them.
    def hook(module: FP8ExpertsMixin, args: tuple, kwargs: dict) -> None:
        if recomputed():
            return
        hidden, top_k_index = args[0], args[1]
        projections = list(module.fp8_scaling)
        num_experts = module.num_experts
        inputs = torch.zeros(len(projections), num_experts)
        weights = torch.zeros(len(projections), num_experts)
        with module.dequantized():
            x = hidden.reshape(-1, hidden.shape[-1])
            for e in range(num_experts):
                rows = (top_k_index == e).any(dim=-1).reshape(-1)
                for p, proj in enumerate(projections):
                    weights[p, e] = _amax(getattr(module, proj)[e]).cpu()
                if not bool(rows.any()):
                    continue
                h = x[rows]
                inputs[0, e] = _amax(h).cpu()
                h = _expert_projection(module, projections[0], h, e)
                h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
                inputs[1, e] = _amax(h).cpu()
        amaxes.setdefault(name, []).append(torch.stack([inputs, weights]))
    return hook


def _expert_projection(module: FP8ExpertsMixin, proj: str, h: torch.Tensor, e: int) -> torch.Tensor:
    weight = getattr(module, proj)[e]
    out = h @ weight.to(h.dtype) if module.is_transposed else h @ weight.to(h.dtype).t()
    if module.has_bias:
        out = out + getattr(module, f"{proj}_bias")[e].to(out.dtype)
    return out


def _fill(state: ScalingState, recipe: Recipe, per_role: dict[int, torch.Tensor], updates: dict) -> None:
    # The calibration amaxes (oldest first) into the history, newest in column 0, as a step's
    # amax stands before its update; delayed scaling's own update (``_update``, for all the
    # states at once) then makes the scales from them and rolls the history, so the newest lands
    # in column 1 and column 0 is the first training step's slot. The roll drops the last
    # column: at most length - 1 amaxes are kept (a history of length 1 keeps none, its scale
    # from the largest). Block and current scaling compute their scales at the cast, and keep
    # the largest amax for statistics.
    device = state.device
    with torch.no_grad():
        if isinstance(recipe, DelayedScaling):
            state.resize_history(recipe.amax_history_len)
        length = state.amax_history_len
        for role, values in per_role.items():
            newest_first = values.flip(0).to(device=device, dtype=torch.float32)
            row = torch.zeros(length, dtype=torch.float32, device=device)
            if length == 1:
                row[0] = newest_first.max()
            else:
                n = min(length - 1, newest_first.numel())
                row[:n] = newest_first[:n]
            state.amax_history[role].copy_(row)
            state.pending.pop(role, None)
            if isinstance(recipe, DelayedScaling):
                state.initialized[role] = False  # the calibrated scale replaces any earlier one
                updates.setdefault((recipe, role), []).append(state)
        state._forget_initialized()


def _update(updates: dict) -> None:
    # Delayed scaling's update of every calibrated state: scale = (FP8_MAX / amax) / 2**margin
    # from the recipe's amax_compute_algo over the history, then the roll (quantizers.delayed_update).
    update_delayed_scaling([(recipe, role, states) for (recipe, role), states in updates.items()])


