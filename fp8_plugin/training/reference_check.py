"""BF16 reference checks: replay a training micro-batch with FP8 off, compare, and act.

On the step a check fires, before the optimizer step (the weights are the ones the step's FP8
forwards used), the last micro-batch of the step runs twice more from the RNG state of its
training forward (same dropout masks): once in FP8 and once with every FP8 layer in high
precision (the loop's non-FP8 dtype, BF16 by default; float32 GEMMs for the FP8 layers on a CPU
whose BF16 matmuls are slow, see :func:`reference_gemm_dtype`), each into its own gradient buffers
(``torch.autograd.grad``). Both replays run as evaluation forwards do for FP8 state (no amax
recorded, no scale updated), the model's buffers are restored afterwards, the RNG stream is
restored, and ``.grad`` and the optimizer are never touched: a run with checks trains exactly as
one without. Replaying the FP8 side too, rather than reading ``.grad``, makes the comparison
independent of how the loop scales, normalises and accumulates gradients (loss scaling,
gradient accumulation, the transformers Trainer's token-count normalisation).

The figures (:class:`ReferenceResult`), FP8 against the reference:

- ``loss_rel_diff``: ``|L_fp8 - L_ref| / |L_ref|``;
- ``grad_cosine`` and ``grad_rel_error``: cosine similarity and ``||g_fp8 - g_ref|| / ||g_ref||``
  over all trainable parameters together, and per parameter (``param_figures``);
- ``layer_sqnr_db``: for every FP8 layer, ``10 log10(sum y_ref^2 / sum (y_fp8 - y_ref)^2)`` where
  ``y_ref`` is the layer's high-precision output in the reference replay and ``y_fp8`` its FP8
  output on the same input, so that each layer's figure is its own quantisation error, not the
  error it inherits from the layers before it. A MoE experts module
  (:mod:`fp8_plugin.modules.experts`) is one layer here: its output over the routed tokens, the
  same routing in both; its fallback moves all its experts to high precision.
- ``gemm_sqnr_db``: for every FP8 linear layer, the SQNR of each of its three GEMMs on its own:
  ``fprop`` (``y = x W^T``), ``dgrad`` (``dx = dy W``) and ``wgrad`` (``dW = dy^T x``), each
  ``10 log10(sum z_ref^2 / sum (z_fp8 - z_ref)^2)`` where ``x`` and ``dy`` are the layer's input and
  grad_output in the reference replay, ``z_fp8`` the GEMM on their FP8 casts (the layer's recipe
  and current scales, grad_output in the backward format) and ``z_ref`` the same GEMM on the
  unquantised operands in the reference's GEMM dtype: the reference replay's own result, read
  rather than recomputed (fprop: the layer's output figure above, its signal less the bias;
  dgrad: the gradient the replay hands to the layer's input; wgrad: the weight's gradient). A
  layer's figures so isolate the quantisation error of each of its GEMMs: a bad input scale
  shows in fprop and wgrad, a bad weight scale in fprop and dgrad, a bad grad_output scale in
  dgrad and wgrad. A GEMM the layer runs in high precision
  (``FP8Linear.fp8_gemms``, the recipe's ``override_linear_precision``) has no quantisation
  error (``inf``); a GEMM the training step does not run (dgrad of a layer whose input needs no
  gradient, wgrad of a frozen weight) has no figure. They are computed on the fly, as the
  replay's backward reaches each layer: a layer's input is held from its forward to its backward
  (as autograd holds it anyway), and its FP8 wgrad until the weight's gradient is formed. MoE
  experts modules have no per-GEMM figures.

Under several processes every sum above is all-reduced (SUM) before the figures are formed:
they describe the replayed micro-batches of all ranks together and are identical on every rank,
so every rank takes the same decision.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .._private.torch_api import has_tensor_hooks, in_backward_pass
from ..modules.autocast import replay
from ..modules.experts import FP8ExpertsMixin
from ..modules.linear import FP8Linear
from ..numerics.device import bf16_matmul_is_fast, bf16_matmul_speedup
from ..numerics.device_kind import device_kind
from ..numerics.formats import fp8_dtype
from ..numerics.gemm import fp8_gemm, fp8_gemm_in_bf16, fp8_values_in_bf16, forced_path, scaled_mm_supported
from ..numerics.quantizers import GRAD_OUTPUT, INPUT, PerTensorQuantizer, QuantizedTensor, make_quantizer
from ..numerics.recipes import GEMMS, Recipe
from .reference_report import move_text, summary_text, with_written, write_reports

__all__ = [
    "ReferenceCheck",
    "ReferenceResult",
    "ReferenceChecker",
    "FP8ReferenceCheckError",
    "POLICIES",
    "ESCALATION_STEPS",
    "reference_check",
    "resolve_reference_check",
    "output_loss",
    "capture_rng_state",
    "sqnr_hook",
    "gemm_sqnr_hooks",
    "sqnr_db",
    "GEMMS",
]

POLICIES = ("log", "warn", "fallback", "raise")
METRIC_PREFIX = "fp8_ref/"


@dataclass(frozen=True)
class ReferenceCheck:
    """Settings of the periodic BF16 reference checks.

    Args:
        every: optimizer steps between checks (the check runs on steps ``every``, ``2 * every``,
            ...); 0 turns checks off. The default, 200, keeps their cost near 1% of training
            time (a check costs about one FP8 and one BF16 forward and backward of a micro-batch).
        policy: what a failed check does: ``"log"`` (record it), ``"warn"`` (also a warning),
            ``"fallback"`` (also move layers or single GEMMs to high precision from the next
            step on, on every rank, each move kept only when a replay with it passes, see
            :func:`apply_policy`; saved in checkpoints), ``"raise"`` (stop with
            :class:`FP8ReferenceCheckError` before the optimizer step, so the weights are still
            the ones the check judged and a checkpoint can be written).
        min_sqnr_db: a layer whose output SQNR is below this fails the check. A healthy E4M3
            GEMM gives about 29 dB (both operands rounded to 3 mantissa bits: about 32 dB each,
            whose noises add); 20 dB (10% RMS error, 8x the healthy noise power) is reached
            only when values underflow or saturate (a wrong scale, an outlier channel).
        max_loss_rel_diff: the check fails when the FP8 loss differs from the reference by more
            than this fraction. Healthy FP8 stays far below 1%; 5% is a difference that shows.
        min_grad_cosine, max_grad_rel_error: the check fails when the global gradient's cosine
            similarity falls below, or its relative error rises above, these. Both defaults
            mark an FP8 gradient error as large as the gradient itself (signal-to-noise 0 dB:
            relative error 1, cosine 1 / sqrt(2) = 0.71 for an error orthogonal to the
            gradient). Healthy runs stay far from it, yet not near 1: E5M2 gradients (2
            mantissa bits) compound over depth, and a 30-layer language model in healthy FP8
            training (same final perplexity as BF16) shows cosines of 0.92 to 0.99 per micro-batch.
        fallback_worst_k: under ``"fallback"``, when a check fails on the loss or the gradients
            while no layer is under ``min_sqnr_db``, this many layers with the lowest SQNR move
            to high precision (without verification: when the check cannot replay; with it,
            the GEMMs furthest below their healthy band are tried one by one instead).
        min_gemm_sqnr_db: under ``"fallback"``, the GEMMs (fprop, dgrad, wgrad) whose own SQNR is
            below this are the first suspects of a failed check (they do not fail a check
            themselves). Healthy HYBRID GEMMs give about 28.5 dB (fprop, E4M3 x E4M3) and 24.5
            dB (dgrad, wgrad: E5M2 x E4M3) when the GEMM's products do not cancel; a wgrad whose
            sum over tokens cancels (an untrained model's) gives less: a tiny GPT-2 gave 14.5 dB
            in healthy training. 10 dB (a 30% RMS error) is below that and far above the 0 dB
            of a GEMM whose operand flushed to zero.
        max_fallback_replays: under ``"fallback"``, at most this many verification replays per
            failed check (each costs about a check): a move is kept only when a replay with it
            passes every threshold.
        max_escalation_replays: under ``"fallback"`` (and ``"raise"``, as a diagnosis), when no
            candidate move restores the figures within ``max_fallback_replays``, at most this
            many steps of the escalation (:data:`ESCALATION_STEPS`, in order, each model-wide:
            dgrad in high precision, fprop in high precision, dgrad and wgrad in high
            precision, FP8 off), one replay each; the first that passes is kept. 0: no
            escalation.
        output_loss: how the replay reads the loss from the model's output (Fabric and
            Accelerate replay the model's forward); default :func:`output_loss` (the output's
            ``loss``, its ``"loss"`` entry, or the output itself when it is a 0-dim tensor).
        log_layers: also log each layer's SQNR (``fp8_ref/sqnr_db/<layer>``), not only the worst.
        json_path: where to write every check's figures as JSON at the end of training.
        plot_path: where to write a PNG of FP8 against reference loss and per-layer SQNR over
            training at the end of training (needs matplotlib: ``pip install fp8-plugin[plot]``).

    Raises:
        ValueError: a setting out of its range or ``policy`` not one of :data:`POLICIES`.
        TypeError: a setting of the wrong type.
    """

    every: int = 200
    policy: str = "warn"
    min_sqnr_db: float = 20.0
    max_loss_rel_diff: float = 0.05
    min_grad_cosine: float = 0.7
    max_grad_rel_error: float = 1.0
    fallback_worst_k: int = 1
    min_gemm_sqnr_db: float = 10.0
    max_fallback_replays: int = 6
    max_escalation_replays: int = 4
    output_loss: Optional[Callable[[Any], torch.Tensor]] = None
    log_layers: bool = True
    json_path: Optional[str] = None
    plot_path: Optional[str] = None

    def __post_init__(self) -> None:
        _check_int("every", self.every, 0)
        _check_int("fallback_worst_k", self.fallback_worst_k, 1)
        _check_int("max_fallback_replays", self.max_fallback_replays, 0)
        _check_int("max_escalation_replays", self.max_escalation_replays, 0)
        if self.policy not in POLICIES:
            raise ValueError(f"ReferenceCheck(policy={self.policy!r}) is not valid; valid: {', '.join(POLICIES)}")
        for name, low, high in (("min_sqnr_db", -math.inf, math.inf), ("min_gemm_sqnr_db", -math.inf, math.inf),
                                ("max_loss_rel_diff", 0.0, math.inf),
                                ("min_grad_cosine", -1.0, 1.0), ("max_grad_rel_error", 0.0, math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise TypeError(f"ReferenceCheck({name}={value!r}) must be a number")
            if not low <= value <= high:
                raise ValueError(f"ReferenceCheck({name}={value!r}) is out of range; valid: [{low}, {high}]")
        if self.output_loss is not None and not callable(self.output_loss):
            raise TypeError(f"ReferenceCheck(output_loss={self.output_loss!r}) must be callable")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ReferenceCheck({name}={value!r}) must be an int >= {low}")
    if value < low:
        raise ValueError(f"ReferenceCheck({name}={value!r}) is out of range; valid: an int >= {low}")


def resolve_reference_check(reference_every: Optional[int], reference_check: Optional[ReferenceCheck],
                            owner: str) -> Optional[ReferenceCheck]:
    """The checks an integration runs, from its ``reference_every`` and ``reference_check``
    arguments (None when off).

    Raises:
        TypeError: ``reference_check`` is not a :class:`ReferenceCheck`, or ``reference_every``
            not an int.
        ValueError: ``reference_every`` negative, or both given with different intervals.
    """
    if reference_check is not None and not isinstance(reference_check, ReferenceCheck):
        raise TypeError(f"{owner}(reference_check={reference_check!r}) must be a fp8_plugin.ReferenceCheck")
    if reference_every is not None:
        if isinstance(reference_every, bool) or not isinstance(reference_every, int) or reference_every < 0:
            raise ValueError(f"{owner}(reference_every={reference_every!r}) must be an int >= 0 (0: off)")
        if reference_check is None:
            reference_check = ReferenceCheck(every=reference_every)
        elif reference_every != reference_check.every:
            raise ValueError(
                f"{owner}(reference_every={reference_every}, reference_check=ReferenceCheck(every="
                f"{reference_check.every})) contradict each other; pass one"
            )
    return reference_check if reference_check is not None and reference_check.every > 0 else None


class FP8ReferenceCheckError(RuntimeError):
    """A reference check failed under ``policy="raise"``; ``result`` holds its figures."""

    def __init__(self, result: "ReferenceResult") -> None:
        self.result = result
        text = f"FP8 reference check failed at step {result.step}: {result.describe()}"
        if result.fallback_tried:
            text += "\nreplays tried (nothing kept under policy 'raise'):\n" + result.tried_text()
        super().__init__(text)


@dataclass
class ReferenceResult:
    """The figures of one reference check (see the module docstring for their definitions).

    Attributes:
        step: optimizer steps completed before the checked one (the checked step is ``step + 1``).
        loss_fp8, loss_reference: the replayed micro-batch's loss, FP8 and reference (mean over ranks).
        loss_rel_diff: ``|loss_fp8 - loss_reference| / |loss_reference|``.
        grad_cosine, grad_rel_error: over all trainable parameters.
        param_figures: ``{parameter name: (cosine, relative error)}``.
        layer_sqnr_db: ``{FP8 layer name: SQNR in dB}`` (``inf`` for an exact output).
        gemm_sqnr_db: ``{FP8 linear layer name: {"fprop" | "dgrad" | "wgrad": SQNR in dB}}``, each
            GEMM's own figure (``inf`` for a GEMM in high precision; a GEMM the step does not
            run is absent).
        failures: why the check failed (empty when it passed).
        fallback_layers: the layers this check moved to high precision.
        fallback_gemms: the GEMMs this check moved to high precision, ``"<layer>.<gemm>"``.
        fallback_tried: every replay a verified fallback (or a ``"raise"`` diagnosis) ran, in
            order: ``{"stage": "candidate" | "escalation", "escalation": the step's name or None,
            "moves": ["<layer>" | "<layer>.<gemm>", ...], "passed": bool, "kept": bool,
            "failures": [...], "loss_rel_diff", "grad_cosine", "grad_rel_error", "sqnr_min_db"
            (the replay's figures with the move: after), "before": {the same four of the check:
            before}}``.
        fallback_escalation: the escalation step kept (a name in :data:`ESCALATION_STEPS`), or
            ``""``.
        seconds: wall time the check took.
    """

    step: int
    loss_fp8: float
    loss_reference: float
    loss_rel_diff: float
    grad_cosine: float
    grad_rel_error: float
    param_figures: dict[str, tuple[float, float]] = field(default_factory=dict)
    layer_sqnr_db: dict[str, float] = field(default_factory=dict)
    gemm_sqnr_db: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    fallback_layers: list[str] = field(default_factory=list)
    fallback_gemms: list[str] = field(default_factory=list)
    fallback_tried: list[dict[str, Any]] = field(default_factory=list)
    fallback_escalation: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures

    def worst_layers(self, k: int = 3) -> list[tuple[str, float]]:
        """The ``k`` layers with the lowest SQNR, lowest first."""
        return sorted(self.layer_sqnr_db.items(), key=lambda item: item[1])[:k]

    def worst_gemms(self, k: int = 3) -> list[tuple[str, str, float]]:
        """The ``k`` GEMMs ``(layer, "fprop" | "dgrad" | "wgrad", dB)`` with the lowest SQNR,
        lowest first."""
        every = [(name, gemm, db) for name, figures in self.gemm_sqnr_db.items() for gemm, db in figures.items()]
        return sorted(every, key=lambda item: item[2])[:k]

    def lowest_gemm_sqnr(self) -> dict[str, float]:
        """``{"fprop" | "dgrad" | "wgrad": the lowest SQNR of that GEMM over the layers}`` (``inf``
        when no layer has that GEMM's figure)."""
        return {gemm: min((f[gemm] for f in self.gemm_sqnr_db.values() if gemm in f), default=math.inf)
                for gemm in GEMMS}

    def describe(self) -> str:
        """One line: the figures, the failures, the worst layers and the worst GEMMs."""
        worst = ", ".join(f"{name} {db:.1f} dB" for name, db in self.worst_layers())
        text = (f"loss FP8 {self.loss_fp8:.5g} vs reference {self.loss_reference:.5g} "
                f"(rel diff {self.loss_rel_diff:.2%}), grad cosine {self.grad_cosine:.4f}, "
                f"grad rel error {self.grad_rel_error:.3f}; lowest SQNR: {worst or 'no FP8 layer'}")
        if self.gemm_sqnr_db:
            text += "; lowest GEMM SQNR: " + ", ".join(f"{name} {gemm} {db:.1f} dB"
                                                       for name, gemm, db in self.worst_gemms())
        if self.failures:
            text += "; failed: " + "; ".join(self.failures)
        moved = self.fallback_layers + self.fallback_gemms
        if self.fallback_escalation:
            text += f"; escalated: {self.fallback_escalation} ({len(moved)} moves to high precision)"
        elif moved:
            text += "; moved to high precision: " + ", ".join(moved)
        passed = [t for t in self.fallback_tried if t["passed"]]
        if self.fallback_tried and not moved:
            if passed:  # a diagnosis (policy "raise"): nothing kept
                text += (f"; of the {len(self.fallback_tried)} moves tried, this restored the figures (not kept): "
                         + move_text(passed[-1]))
            else:
                text += f"; no move of the {len(self.fallback_tried)} tried restored the figures: none kept"
        return text

    def tried_text(self) -> str:
        """Every replay of the verified fallback, one per line, with its figures before and after."""
        return "\n".join(f"  {i + 1}. {move_text(t)}" for i, t in enumerate(self.fallback_tried))

    def metrics(self, layers: bool = True) -> dict[str, float]:
        """Scalar figures for a logger, under the ``fp8_ref/`` prefix: the losses, gradient
        figures, ``sqnr_min_db``, ``fprop_sqnr_min_db`` / ``dgrad_sqnr_min_db`` /
        ``wgrad_sqnr_min_db`` (the lowest of each GEMM over the layers), and with ``layers``
        ``sqnr_db/<layer>`` and ``fprop_sqnr_db/<layer>``, ``dgrad_sqnr_db/<layer>``,
        ``wgrad_sqnr_db/<layer>``."""
        sqnr = [db for db in self.layer_sqnr_db.values()]
        out = {
            "loss_fp8": self.loss_fp8,
            "loss_reference": self.loss_reference,
            "loss_rel_diff": self.loss_rel_diff,
            "grad_cosine": self.grad_cosine,
            "grad_rel_error": self.grad_rel_error,
            "sqnr_min_db": min(sqnr) if sqnr else math.inf,
            "failed": float(not self.passed),
            "fallback_layers": float(len(self.fallback_layers)),
            "fallback_gemms": float(len(self.fallback_gemms)),
            "seconds": self.seconds,
        }
        out.update({f"{gemm}_sqnr_min_db": db for gemm, db in self.lowest_gemm_sqnr().items()})
        if layers:
            out.update({f"sqnr_db/{name}": db for name, db in self.layer_sqnr_db.items()})
            out.update({f"{gemm}_sqnr_db/{name}": db
                        for name, figures in self.gemm_sqnr_db.items() for gemm, db in figures.items()})
        return {METRIC_PREFIX + key: float(value) for key, value in out.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (infinities as None)."""
        return _finite_or_none(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReferenceResult":
        data = dict(data)
        data["param_figures"] = {k: tuple(_none_to_inf(x) for x in v) for k, v in data["param_figures"].items()}
        data["layer_sqnr_db"] = {k: _none_to_inf(v) for k, v in data["layer_sqnr_db"].items()}
        # Absent from results saved before the per-GEMM figures existed.
        data["gemm_sqnr_db"] = {k: {g: _none_to_inf(db) for g, db in v.items()}
                                for k, v in data.get("gemm_sqnr_db", {}).items()}
        return cls(**{k: _none_to_inf(v) if k in _FLOAT_FIELDS else v for k, v in data.items()})


_FLOAT_FIELDS = ("loss_fp8", "loss_reference", "loss_rel_diff", "grad_cosine", "grad_rel_error", "seconds")


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def _none_to_inf(value: Any) -> Any:
    return math.inf if value is None else value


def output_loss(output: Any) -> torch.Tensor:
    """The loss in a model's output: ``output.loss`` (transformers), ``output["loss"]``, or the
    output itself when it is a 0-dim tensor.

    Raises:
        ValueError: none of these; pass ``ReferenceCheck(output_loss=...)``.
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"The reference check found no scalar loss in the model's output ({type(output).__name__}); valid: an "
            "output with .loss or ['loss'], or a 0-dim tensor. Pass ReferenceCheck(output_loss=fn) to read it"
        )
    return loss.reshape(())


# ---------------------------------------------------------------------------------------------
# The comparison


@dataclass(frozen=True)
class _RNGState:
    cpu: torch.Tensor
    device: Optional[torch.device]
    device_state: Optional[torch.Tensor]


def capture_rng_state(device: torch.device) -> _RNGState:
    """The CPU RNG state and, on CUDA, the device's: what a training forward draws dropout from."""
    device = torch.device(device)
    if device_kind(device) == "cuda":
        return _RNGState(torch.get_rng_state(), device, torch.cuda.get_rng_state(device))
    return _RNGState(torch.get_rng_state(), None, None)


def _restore_rng_state(state: _RNGState) -> None:
    torch.set_rng_state(state.cpu)
    if state.device is not None:
        torch.cuda.set_rng_state(state.device_state, state.device)


def _fp8_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    # FP8 linear layers and MoE experts modules: each is checked, and falls back, as one layer.
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (FP8Linear, FP8ExpertsMixin))]


def compare(model: nn.Module, run_replay: Callable[[], torch.Tensor], *, rng_state: _RNGState,
            compute_dtype: torch.dtype = torch.bfloat16, device_type: str = "cpu", step: int = 0,
            recipe: Optional[Recipe] = None, reference_dtype: Optional[torch.dtype] = None,
            group: Optional["dist.ProcessGroup"] = None) -> Optional[ReferenceResult]:
    """Replay one micro-batch in FP8 and in high precision and compare (no policy applied).

    Returns None, comparing nothing, when ``run_replay`` returns None (a loop that skips the
    micro-batch, as Lightning does when ``training_step`` returns None).

    Args:
        model: the converted model whose parameters and FP8 layers are compared.
        run_replay: runs the micro-batch's forward through ``model`` and returns its scalar loss.
        rng_state: the RNG state at the start of the training forward being replayed.
        compute_dtype: dtype of the non-FP8 ops (torch autocast; float32: none); the reference
            runs the FP8 layers in it too.
        device_type: the autocast device type.
        step: recorded in the result.
        recipe: the recipe the FP8 replay runs (None: each layer's own, as in training).
        reference_dtype: the dtype the reference runs the FP8 layers' GEMMs in, outside torch
            autocast (None: ``compute_dtype``, as ``nn.Linear`` would under autocast); the
            other ops run in ``compute_dtype`` either way.
        group: process group whose ranks' figures are summed; None means the world when
            torch.distributed is initialised (every rank of it must call this together).

    Raises:
        ValueError: the replay's loss is not a scalar tensor, or ``model`` has sharded (DTensor)
            parameters (FSDP2).
    """
    start = time.perf_counter()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in trainable], [p for _, p in trainable]
    sharded = [n for n, p in zip(names, params) if type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor"]
    if sharded:
        raise ValueError(
            f"Reference checks do not support sharded parameters (FSDP / DTensor), found {sharded[0]!r}; "
            "valid set-ups: one process, DDP"
        )
    layers = [(name, layer) for name, layer in _fp8_layers(model) if layer.use_fp8]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [rng_state.device] if rng_state.device is not None else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device_kind(devices[0]) if devices else "cuda"):
            replayed = _replay(run_replay, params, rng_state, True, compute_dtype, device_type, recipe)
            if replayed is None:
                return None
            loss_fp8, grads_fp8 = replayed
            recipes = {name: layer._forward_context.recipe if layer._forward_context else None
                       for name, layer in layers}
            # Per layer: output signal and noise; per GEMM (fprop, dgrad, wgrad) signal and noise.
            energies = torch.zeros(len(layers), 2, dtype=torch.float64, device=loss_fp8.device)
            gemm_energies = torch.zeros(len(layers), len(GEMMS), 2, dtype=torch.float64, device=loss_fp8.device)
            handles = [layer.register_forward_hook(sqnr_hook(
                energies[i], recipes[name], gemm_energies[i, 0] if _has_gemm_figures(layer, recipes[name]) else None))
                for i, (name, layer) in enumerate(layers) if recipes[name] is not None]
            gemm_dtype = reference_dtype or compute_dtype  # the dtype the reference replay's GEMMs run in
            shared = _shared_weights(model)
            handles += [handle for i, (name, layer) in enumerate(layers) if _has_gemm_figures(layer, recipes[name])
                        for handle in gemm_sqnr_hooks(layer, gemm_energies[i], recipes[name],
                                                      layer._forward_context.gemms, gemm_dtype,
                                                      id(layer.weight) in shared or has_tensor_hooks(layer.weight))]
            try:
                loss_ref, grads_ref = _replay(run_replay, params, rng_state, False, compute_dtype, device_type, None,
                                              reference_dtype)
            finally:
                for handle in handles:
                    handle.remove()
    finally:
        with torch.no_grad():  # running statistics and the like: as the training forward left them
            for buffer, saved in buffers:
                buffer.copy_(saved)
    # One flat float64 tensor: the losses, the layers' signal and noise energies, and per
    # parameter <g8, gr>, |g8|^2, |gr|^2, |g8 - gr|^2; summed over ranks in one all-reduce.
    stats = [torch.stack([loss_fp8, loss_ref]).to(torch.float64), energies.flatten(), gemm_energies.flatten()]
    for g8, gr in zip(grads_fp8, grads_ref):
        stats.append(_grad_stats(g8, gr, loss_fp8.device))
    flat = torch.cat([s.to(loss_fp8.device) for s in stats])
    world = 1
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    values = flat.tolist()
    loss8, lossr = values[0] / world, values[1] / world
    layer_values = values[2:2 + 2 * len(layers)]
    gemm_start = 2 + 2 * len(layers)
    gemm_values = values[gemm_start:gemm_start + 2 * len(GEMMS) * len(layers)]
    grad_values = values[gemm_start + 2 * len(GEMMS) * len(layers):]
    sqnr, gemm_sqnr = {}, {}
    for i, (name, layer) in enumerate(layers):
        if recipes[name] is not None:
            sqnr[name] = sqnr_db(layer_values[2 * i], layer_values[2 * i + 1])
        if _has_gemm_figures(layer, recipes[name]):
            pairs = gemm_values[2 * len(GEMMS) * i:2 * len(GEMMS) * (i + 1)]
            # A GEMM that did not run (no signal, no noise) has no figure.
            gemm_sqnr[name] = {gemm: sqnr_db(pairs[2 * j], pairs[2 * j + 1]) for j, gemm in enumerate(GEMMS)
                               if pairs[2 * j] != 0 or pairs[2 * j + 1] != 0}
    totals = [0.0, 0.0, 0.0, 0.0]
    param_figures = {}
    for i, name in enumerate(names):
        four = grad_values[4 * i:4 * i + 4]
        param_figures[name] = (_cosine(*four[:3]), _rel_error(four[2], four[3]))
        totals = [t + v for t, v in zip(totals, four)]
    return ReferenceResult(
        step=step,
        loss_fp8=loss8,
        loss_reference=lossr,
        loss_rel_diff=abs(loss8 - lossr) / abs(lossr) if lossr != 0 else (0.0 if loss8 == 0 else math.inf),
        grad_cosine=_cosine(*totals[:3]),
        grad_rel_error=_rel_error(totals[2], totals[3]),
        param_figures=param_figures,
        layer_sqnr_db=sqnr,
        gemm_sqnr_db=gemm_sqnr,
        seconds=time.perf_counter() - start,
    )


def reference_gemm_dtype(compute_dtype: torch.dtype, device_type: str) -> Optional[torch.dtype]:
    """The dtype a reference check runs the FP8 layers' GEMMs in: float32 on a CPU whose BF16
    matmuls are slow (no AVX512-BF16 or AMX: tens of times slower than float32, which made a
    check cost a dozen training steps there), else None (``compute_dtype``, as in training).
    A float32 reference is the more exact one; the other ops stay in ``compute_dtype``."""
    if device_type != "cpu" or compute_dtype != torch.bfloat16:
        return None
    return None if _cpu_bf16_is_fast() else torch.float32


@functools.lru_cache(maxsize=None)
def _cpu_bf16_is_fast() -> bool:
    return bf16_matmul_is_fast("cpu")[0]


def _replay(run_replay: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], rng_state: _RNGState, fp8: bool,
            compute_dtype: torch.dtype, device_type: str, recipe: Optional[Recipe],
            reference_dtype: Optional[torch.dtype] = None):
    _restore_rng_state(rng_state)
    with torch.enable_grad(), replay(fp8, recipe if fp8 else None, reference_dtype=reference_dtype), torch.autocast(
            device_type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
        loss = run_replay()
    if loss is None:
        return None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"The reference replay must return a scalar loss tensor, got {type(loss).__name__}")
    loss = loss.reshape(())
    if not params or not loss.requires_grad:
        return loss.detach().float(), [None] * len(params)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach().float(), grads


def sqnr_hook(energy: torch.Tensor, recipe: Recipe, fprop_energy: Optional[torch.Tensor] = None) -> Callable:
    """A forward hook for an FP8 layer running in high precision: adds the signal energy of its
    output, ``sum y^2``, to ``energy[0]`` and the energy of its FP8 output's error under
    ``recipe``, ``sum (y_fp8 - y)^2``, to ``energy[1]`` (``energy``: float64 ``[2]``, no host
    sync). The FP8 output is computed from the same input, recording nothing.

    ``fprop_energy`` (float64 ``[2]``, an :class:`~fp8_plugin.modules.linear.FP8Linear` only):
    also adds the signal energy of its GEMM, ``sum (y - b)^2`` (the output less the bias), and,
    when the layer runs its fprop GEMM in FP8, the same error energy: the fprop figure of
    :func:`gemm_sqnr_hooks`, at no further GEMM."""
    def hook(layer: FP8Linear, args: tuple, output: torch.Tensor) -> None:
        if torch.is_grad_enabled() and in_backward_pass():
            return  # an activation-checkpoint recomputation: this forward was counted already
        with torch.no_grad():
            if isinstance(layer, FP8ExpertsMixin):  # (hidden_states, top_k_index, top_k_weights)
                fp8_out = layer._fp8_experts_forward(*(a.detach() for a in args[:3]), recipe, False, False)
            else:
                fp8_out = layer._fp8_forward(args[0].detach(), recipe, record_forward=False, record_backward=False)
            reference = output.detach().to(torch.float64)
            energy[0] += reference.square().sum()
            noise = (fp8_out.to(torch.float64) - reference).square().sum()
            energy[1] += noise
            if fprop_energy is not None:
                gemm = reference if layer.bias is None else reference - layer.bias.detach().to(torch.float64)
                fprop_energy[0] += gemm.square().sum()
                if layer.gemms_in_fp8(recipe)[0]:  # else the fprop GEMM ran in high precision: no error
                    fprop_energy[1] += noise
    return hook


def _shared_weights(model: nn.Module) -> set[int]:
    # ids of the parameters more than one module holds (tied weights): their gradient is not one
    # layer's wgrad.
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    return {key for key, n in counts.items() if n > 1}


def _has_gemm_figures(layer: nn.Module, recipe: Optional[Recipe]) -> bool:
    # FP8 linear layers that ran in FP8 in the FP8 replay (MoE experts: their output figure only).
    return recipe is not None and isinstance(layer, FP8Linear)


def gemm_sqnr_hooks(layer: FP8Linear, energy: torch.Tensor, recipe: Recipe, gemms: Sequence[bool] = (True, True, True),
                    dtype: torch.dtype = torch.float32, weight_shared: bool = False) -> list:
    """Hooks on an :class:`~fp8_plugin.modules.linear.FP8Linear` running in high precision (the
    reference replay) that measure its backward GEMMs' quantisation error; returns their handles.

    For dgrad (``dx = dy W``, row 1 of ``energy``) and wgrad (``dW = dy^T x``, row 2) it adds the
    signal energy ``sum z^2`` of the reference's own result ``z`` to ``energy[j, 0]``, and the
    noise energy ``sum (z_fp8 - z)^2`` of the same GEMM on the FP8 casts of its operands under
    ``recipe`` (current scales, recording nothing: forward format for the input ``x`` ``[M, K]``
    and the weight ``W`` ``[N, K]``, backward format for the grad_output ``dy`` ``[M, N]``,
    blocks along the reduction dim as training casts them; FP32 accumulation) to
    ``energy[j, 1]``. On a CPU whose BF16 GEMMs are at least
    :data:`BF16_FIGURES_SPEEDUP_REQUIRED` times faster than float32 ones (timed once per process,
    :func:`~fp8_plugin.numerics.device.bf16_matmul_speedup`), where the FP8 GEMM would be the
    float32 emulation, per-tensor operands are multiplied as a BF16 GEMM of their FP8 values
    (:func:`~fp8_plugin.numerics.gemm.fp8_gemm_in_bf16`: one more rounding, of at most 2^-8
    relative per output). ``energy``: float64 ``[3, 2]`` (:data:`GEMMS` order; row 0, fprop, is
    :func:`sqnr_hook`'s), no host sync.

    The reference's results are read, not recomputed: dgrad is the gradient the replay's
    backward hands to this layer's input (an identity on the input, this call's alone), wgrad the
    weight's gradient the replay's backward forms (a hook on the weight: the sum over the
    layer's calls in the micro-batch, as the FP8 side sums them); so the figures cost the FP8
    GEMMs and casts alone. ``weight_shared`` (the weight is also another module's, or has a
    user's tensor hook, which runs first and may change the gradient): wgrad's reference is then
    recomputed per call in ``dtype`` (the reference replay's GEMM dtype), as the weight's
    gradient holds the other module's share too. The FP8 side runs when the
    backward reaches the layer's output (a tensor hook on it), and only what the training step
    computes: dgrad when ``x`` needs a gradient, wgrad when ``W`` does. A GEMM that ``gemms``
    (which GEMMs the layer ran in FP8: fprop, dgrad, wgrad) puts in high precision adds signal
    and no noise. ``x`` is held from the forward to the backward, as autograd holds it.

    Energies of a tensor are summed in float32 (pairwise, as torch's reductions sum: for ``n``
    non-negative terms a relative error at most ``ceil(log2 n) * 2^-24``, 1.2e-6 for a million
    terms, 5e-6 dB; Higham, "Accuracy and Stability of Numerical Algorithms", 4.2) and added up
    in float64.
    """
    current: list[dict] = [{}]  # the call in progress: its forward hook pairs with its pre-hook
    wgrad_fp8: list[Optional[torch.Tensor]] = [None]  # sum over the calls of the FP8 wgrad
    wgrad_pending = [False]
    needs_wgrad = layer.weight.requires_grad

    def dgrad_done(call: dict, dx: torch.Tensor) -> None:  # the reference's own dgrad of one call
        with torch.no_grad():
            z = dx.detach().reshape(-1, layer.in_features).float()
            energy[1, 0] += z.square().sum()
            fp8 = call.pop("dgrad", None)
            if fp8 is not None:  # the figure's own tensor: its error computed in place
                energy[1, 1] += fp8.sub_(z).square_().sum()

    def pre_hook(module: FP8Linear, args: tuple):
        call: dict = {}
        current[0] = call
        x = args[0]
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            return (_Tap.apply(x, functools.partial(dgrad_done, call)), *args[1:])
        return None

    def hook(module: FP8Linear, args: tuple, output: torch.Tensor) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            # Fires once per backward through this output: a non-reentrant checkpoint's recomputed
            # output is not on the loss's graph, a reentrant one's original output needs no grad.
            call, x, needs_dgrad = current[0], args[0].detach(), args[0].requires_grad
            output.register_hook(lambda grad: backward(call, x, grad, needs_dgrad))

    def backward(call: dict, x: torch.Tensor, grad: torch.Tensor, needs_dgrad: bool) -> None:
        with torch.no_grad():
            g = grad.detach().reshape(-1, layer.out_features)  # [M, N]
            fp8_dgrad, fp8_wgrad = needs_dgrad and gemms[1], needs_wgrad and gemms[2]
            qg = qg_t = None
            in_bf16 = False
            if fp8_dgrad or fp8_wgrad:  # grad_output cast once for both, as the training backward casts it
                quantizer = make_quantizer(recipe, GRAD_OUTPUT, layer.fp8_state, record=False, host=False)
                in_bf16 = _figures_in_bf16(quantizer, g.device)
                qg, qg_t = _figure_casts(quantizer, g, fp8_wgrad, in_bf16)
            if fp8_dgrad:  # dx [M, K] = dy [M, N] @ W [N, K], on the weight's transposed FP8 copy as cached
                call["dgrad"] = _figure_gemm(qg, layer._weight_casts(recipe, False, columnwise=True)[1])
            if not needs_wgrad:
                return
            x2d = x.reshape(-1, layer.in_features)  # dW [N, K] = dy^T [N, M] @ x [M, K]
            qx_t = None
            if fp8_wgrad:  # x^T [K, M], blocks along M; one scale per tensor: the transposed cast
                quantizer = make_quantizer(recipe, INPUT, layer.fp8_state, record=False, host=False)
                qx_t = _figure_casts(quantizer, x2d, True, in_bf16)[1] if isinstance(quantizer, PerTensorQuantizer) \
                    else quantizer.quantize(x2d.t().contiguous())
            x_t = x2d.t()
            if weight_shared:
                _gemm_energy(energy[2], dtype, g.t(), x_t, qg_t, qx_t)
                return
            wgrad_pending[0] = True
            if fp8_wgrad:
                fp8 = _figure_gemm(qg_t, qx_t)
                wgrad_fp8[0] = fp8 if wgrad_fp8[0] is None else wgrad_fp8[0].add_(fp8)

    def weight_done(grad_w: torch.Tensor) -> None:  # the reference's own wgrad, over the layer's calls
        if not wgrad_pending[0]:
            return
        with torch.no_grad():
            z = (grad_w.t() if layer.weight_transposed else grad_w).detach().float()
            energy[2, 0] += z.square().sum()
            if wgrad_fp8[0] is not None:
                energy[2, 1] += wgrad_fp8[0].sub_(z).square_().sum()
        wgrad_fp8[0], wgrad_pending[0] = None, False

    handles = [layer.register_forward_pre_hook(pre_hook), layer.register_forward_hook(hook)]
    if needs_wgrad and not weight_shared:
        handles.append(layer.weight.register_hook(weight_done))
    return handles


# A BF16 GEMM must be this many times faster than a float32 one for the figures to use it.
BF16_FIGURES_SPEEDUP_REQUIRED = 1.25


def _figures_in_bf16(grad_quantizer, device: torch.device) -> bool:
    # Whether a layer's dgrad and wgrad figures multiply as BF16 GEMMs of the FP8 values
    # (fp8_gemm_in_bf16: one more rounding, 2^-8 relative, moving a figure near its band by
    # under 0.01 dB): per-tensor casts, on a CPU where the FP8 GEMM of the grad_output with a
    # forward-format operand would be the float32 emulation and BF16 GEMMs are clearly faster
    # than float32 ones. These two GEMMs per layer are most of what the figures add to a check.
    if not isinstance(grad_quantizer, PerTensorQuantizer) or device.type != "cpu" or forced_path() is not None:
        return False
    one = torch.ones(())  # scaled_mm_supported reads dtypes, blocks and the device alone
    pairing = [QuantizedTensor(torch.zeros(1, 1, dtype=dtype), one)
               for dtype in (grad_quantizer.dtype, fp8_dtype(grad_quantizer.recipe.fp8_format, backward=False))]
    return not scaled_mm_supported(*pairing)[0] and _cpu_bf16_is_faster()


def _figure_casts(quantizer, x: torch.Tensor, columnwise: bool,
                  in_bf16: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
    # quantize_pair, or for BF16 figures the per-tensor cast's FP8 values once in bfloat16 (exact)
    # and the columnwise operand a transposed view of them: one scale, the same values.
    if not in_bf16:
        return quantizer.quantize_pair(x, columnwise=columnwise)
    row = quantizer.quantize(x)
    row = QuantizedTensor(fp8_values_in_bf16(row.data), row.scale_inv)
    return row, (QuantizedTensor(row.data.t(), row.scale_inv) if columnwise else None)


def _figure_gemm(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    # The FP8 GEMM of a per-GEMM figure, float32 [M, N] and the caller's to overwrite.
    if a.data.dtype == torch.bfloat16:  # cast by _figure_casts for BF16 figures
        return fp8_gemm_in_bf16(a, b)
    return fp8_gemm(a, b, torch.float32)


@functools.lru_cache(maxsize=None)
def _cpu_bf16_is_faster() -> bool:
    return bf16_matmul_speedup("cpu")[0] >= BF16_FIGURES_SPEEDUP_REQUIRED


class _Tap(torch.autograd.Function):
    """The identity on a layer's input, whose backward hands ``sink`` the gradient it receives:
    the input's gradient from that layer alone (its dgrad), before other uses of the input add
    theirs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.sink(grad)
        return grad, None


def _gemm_energy(energy: torch.Tensor, dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor,
                 qa: Optional[QuantizedTensor], qb: Optional[QuantizedTensor]) -> None:
    # a [M, K] @ b [N, K]^T in ``dtype`` on the unquantised operands; and, unless the GEMM runs
    # in high precision (no casts: no quantisation error), the FP8 GEMM on their casts ``qa``,
    # ``qb`` (row-wise: blocks along K, the reduction dim, as the training GEMM's operands).
    with torch.autocast(device_kind(a.device), enabled=False):
        exact = (a.to(dtype) @ b.to(dtype).t()).float()
    energy[0] += exact.square().sum()
    if qa is not None:
        energy[1] += _figure_gemm(qa, qb).sub_(exact).square_().sum()


def _grad_stats(g8: Optional[torch.Tensor], gr: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    if g8 is None and gr is None:
        return torch.zeros(4, dtype=torch.float64, device=device)
    a = g8.detach().to(torch.float64) if g8 is not None else torch.zeros_like(gr, dtype=torch.float64)
    b = gr.detach().to(torch.float64) if gr is not None else torch.zeros_like(a)
    return torch.stack([(a * b).sum(), a.square().sum(), b.square().sum(), (a - b).square().sum()])


def _cosine(dot: float, a2: float, b2: float) -> float:
    if a2 == 0 or b2 == 0:
        return 1.0 if a2 == b2 else 0.0
    return dot / math.sqrt(a2 * b2)


def _rel_error(ref2: float, diff2: float) -> float:
    if ref2 == 0:
        return 0.0 if diff2 == 0 else math.inf
    return math.sqrt(diff2 / ref2)


def sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)`` in dB; ``inf`` for an exact output, ``-inf`` for a zero signal."""
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


# ---------------------------------------------------------------------------------------------
# Thresholds and policies


def judge(result: ReferenceResult, config: ReferenceCheck) -> list[str]:
    """The layers to move to high precision under ``"fallback"``; fills ``result.failures``."""
    failures = []
    if result.loss_rel_diff > config.max_loss_rel_diff:
        failures.append(f"loss rel diff {result.loss_rel_diff:.2%} > max_loss_rel_diff {config.max_loss_rel_diff:.2%}")
    if result.grad_cosine < config.min_grad_cosine:
        failures.append(f"grad cosine {result.grad_cosine:.4f} < min_grad_cosine {config.min_grad_cosine}")
    if result.grad_rel_error > config.max_grad_rel_error:
        failures.append(f"grad rel error {result.grad_rel_error:.3f} > max_grad_rel_error {config.max_grad_rel_error}")
    low = [name for name, db in result.worst_layers(len(result.layer_sqnr_db)) if db < config.min_sqnr_db]
    if low:
        failures.append(f"{len(low)} layer(s) under min_sqnr_db {config.min_sqnr_db} dB: "
                        + ", ".join(f"{n} {result.layer_sqnr_db[n]:.1f} dB" for n in low[:5])
                        + (" ..." if len(low) > 5 else ""))
    result.failures = failures
    if not failures:
        return []
    return low or [name for name, _ in result.worst_layers(config.fallback_worst_k)]


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _low_gemms(result: ReferenceResult, config: ReferenceCheck) -> list[tuple[str, str, float]]:
    return [item for item in result.worst_gemms(len(GEMMS) * len(result.gemm_sqnr_db))
            if item[2] < config.min_gemm_sqnr_db]


# Healthy figures of each GEMM under HYBRID (E4M3 forward, E5M2 backward operand; see the
# ReferenceCheck docstring): a GEMM's shortfall from its own is what ranks it as a suspect.
_HEALTHY_GEMM_DB = {"fprop": 28.5, "dgrad": 24.5, "wgrad": 24.5}

Move = tuple[str, Optional[str]]  # (layer, GEMM), or (layer, None) for the whole layer


def _candidates(model: nn.Module, result: ReferenceResult, config: ReferenceCheck, low_layers: list[str]):
    """The moves a verified fallback tries, in order (a generator: bisection steps depend on the
    replays before them, sent back in): the layers under ``min_sqnr_db`` with the GEMMs under
    ``min_gemm_sqnr_db``; then each GEMM furthest below its healthy figure; then bisection over
    the FP8 layers still in FP8, each step moving half and keeping the half that passes."""
    gemm_moves = [(n, g) for n, g, _ in _low_gemms(result, config) if n not in low_layers]
    first = [(n, None) for n in low_layers] + gemm_moves
    tried = []
    if first:
        tried.append(first)
        if (yield first):
            return
    ranked = sorted(((n, g, db) for n, f in result.gemm_sqnr_db.items() for g, db in f.items() if math.isfinite(db)),
                    key=lambda item: item[2] - _HEALTHY_GEMM_DB[item[1]])
    for name, gemm, _ in ranked[:config.fallback_worst_k]:
        move = [(name, gemm)]
        if move not in tried:
            tried.append(move)
            if (yield move):
                return
    pool, shown = [name for name, layer in _fp8_layers(model) if layer.use_fp8], False
    while True:  # O(log n) replays: keep the half whose move passes
        if len(pool) <= 1:
            if pool and not shown:
                yield [(pool[0], None)]
            return
        half = len(pool) // 2
        for part in (pool[:half], pool[half:]):
            if (yield [(n, None) for n in part]):
                pool, shown = part, True
                break
        else:
            return  # neither half alone restores the figures: drift that no one half explains


def _apply_moves(layers: dict[str, nn.Module], moves: Sequence[Move]) -> None:
    for name, gemm in moves:
        layer = layers[name]
        if gemm is None or not isinstance(layer, FP8Linear):
            layer.use_fp8 = False
        else:
            flags = list(layer.fp8_gemms)
            flags[GEMMS.index(gemm)] = False
            layer.fp8_gemms = tuple(flags)


def _switches(layers: dict[str, nn.Module]) -> dict[str, tuple]:
    return {name: (layer.use_fp8, getattr(layer, "fp8_gemms", None)) for name, layer in layers.items()}


def _restore_switches(layers: dict[str, nn.Module], saved: dict[str, tuple]) -> None:
    for name, (use_fp8, gemms) in saved.items():
        layers[name].use_fp8 = use_fp8
        if gemms is not None:
            layers[name].fp8_gemms = gemms


# The escalation, in order of the FP8 GEMMs each step keeps (two thirds, two thirds, one third,
# none); each step replaces the one before (on the switches as the check found them). dgrad
# first: its E5M2 error flows into every layer below it (a wgrad's stays in its own layer's
# weight gradient). fprop next: a forward error, healthy in every layer's own figure, that the
# model amplifies (a LayerNorm with a massive weight channel turns 28 dB of E4M3 noise into a
# gradient of another sign). Then the whole backward, then FP8 off, which always passes (the
# replay is the reference). Transformer Engine's override_linear_precision (fprop, dgrad, wgrad)
# is the same switch, model-wide.
ESCALATION_STEPS: tuple[tuple[str, str, Optional[tuple[bool, bool, bool]]], ...] = (
    ("dgrad", "dgrad in high precision model-wide (fprop and wgrad stay FP8)", (True, False, True)),
    ("fprop", "fprop in high precision model-wide (dgrad and wgrad stay FP8)", (False, True, True)),
    ("dgrad+wgrad", "dgrad and wgrad in high precision model-wide (fprop stays FP8)", (True, False, False)),
    ("fp8_off", "every FP8 layer in high precision (FP8 off)", None),
)
"""``(name, description, GEMMs left in FP8 as (fprop, dgrad, wgrad))`` of each escalation step,
in order; ``None``: the whole layer in high precision (MoE experts modules, which have no
per-GEMM switch, move only at that step)."""

_FIGURES = ("loss_rel_diff", "grad_cosine", "grad_rel_error")
log = logging.getLogger(__name__)


def _figures(result: ReferenceResult) -> dict[str, float]:
    # What a move is judged on, before and after: the check's figures and its lowest layer SQNR.
    return {**{k: getattr(result, k) for k in _FIGURES},
            "sqnr_min_db": min(result.layer_sqnr_db.values(), default=math.inf)}


def _escalation_moves(layers: dict[str, nn.Module], keep: Optional[tuple[bool, bool, bool]]) -> list[Move]:
    # The moves of one escalation step, on the switches as they are: only what it changes.
    moves: list[Move] = []
    for name, layer in layers.items():
        if not layer.use_fp8:
            continue
        if keep is None:
            moves.append((name, None))
        elif isinstance(layer, FP8Linear):
            moves += [(name, gemm) for gemm, on, stays in zip(GEMMS, layer.fp8_gemms, keep) if on and not stays]
    return moves


def _try(layers: dict[str, nn.Module], result: ReferenceResult, config: ReferenceCheck, moves: Sequence[Move],
         verify: Callable[[], Optional[ReferenceResult]], stage: str, escalation: Optional[str] = None) -> bool:
    # One replay with ``moves`` on top of the switches as they are; records it (figures before and
    # after) in result.fallback_tried and undoes the moves.
    before = _switches(layers)
    _apply_moves(layers, moves)
    try:
        replayed = verify()
    finally:
        _restore_switches(layers, before)
    if replayed is not None:
        judge(replayed, config)
    passed = replayed is not None and replayed.passed
    entry = {"stage": stage, "escalation": escalation,
             "moves": [name if gemm is None else f"{name}.{gemm}" for name, gemm in moves], "passed": passed,
             "kept": False, "failures": list(replayed.failures) if replayed is not None else [],
             **(_figures(replayed) if replayed is not None else {}), "before": _figures(result)}
    result.fallback_tried.append(entry)
    if _is_rank_zero():
        log.info("FP8 reference check at step %d: tried %s", result.step + 1, move_text(entry))
    return passed


def _verified_fallback(model: nn.Module, result: ReferenceResult, config: ReferenceCheck, low_layers: list[str],
                       verify: Callable[[], Optional[ReferenceResult]]) -> list[Move]:
    """Try the candidate moves, then the escalation; return the moves whose replay passed (empty
    when none did), the switches left as they were. At most ``max_fallback_replays`` candidate
    replays and ``max_escalation_replays`` escalation replays."""
    layers = dict(_fp8_layers(model))
    candidates = _candidates(model, result, config, low_layers)
    kept: list[Move] = []
    tried = 0
    try:
        moves = next(candidates)
        while tried < config.max_fallback_replays:
            tried += 1
            passed = _try(layers, result, config, moves, verify, "candidate")
            if passed:  # bisection goes on inside a half that passed, for a smaller move
                kept, kept_index = list(moves), len(result.fallback_tried) - 1
            moves = candidates.send(passed)
    except StopIteration:
        pass
    if kept:
        result.fallback_tried[kept_index]["kept"] = True
        return kept
    # Nothing localised the drift within the cap: escalate, model-wide, one step at a time.
    steps = 0
    for name, _, keep in ESCALATION_STEPS:
        if steps >= config.max_escalation_replays:
            break
        moves = _escalation_moves(layers, keep)
        if not moves:  # the switches are there already: nothing to replay
            continue
        steps += 1
        if _try(layers, result, config, moves, verify, "escalation", name):
            result.fallback_tried[-1]["kept"] = True
            result.fallback_escalation = name
            return moves
    return []


def _escalation_warning(result: ReferenceResult, config: ReferenceCheck) -> None:
    # One loud warning when the escalation ran: which step was kept (or that none was), and why.
    steps = [t for t in result.fallback_tried if t.get("stage") == "escalation"]
    if not steps or not _is_rank_zero():
        return
    candidates = len(result.fallback_tried) - len(steps)
    why = (f"no candidate move restored the figures ({candidates} tried, max_fallback_replays="
           f"{config.max_fallback_replays})")
    kept = [t for t in steps if t["kept"]]
    if kept:
        text = f"ESCALATED to {_step_description(kept[0]['escalation'])}: {why}; {move_text(kept[0])}"
    elif any(t["passed"] for t in steps):  # policy "raise": a diagnosis, nothing kept
        text = f"escalation (a diagnosis, nothing kept): {why}; " + "; ".join(move_text(t) for t in steps)
    else:
        text = (f"ESCALATION FAILED, nothing moved: {why}, nor did any of the {len(steps)} escalation steps tried "
                f"(max_escalation_replays={config.max_escalation_replays}): " + "; ".join(move_text(t) for t in steps))
    warnings.warn(f"FP8 reference check at step {result.step + 1}: {text}", stacklevel=3)


def _step_description(name: Optional[str]) -> str:
    return next((d for n, d, _ in ESCALATION_STEPS if n == name), str(name))


def apply_policy(model: nn.Module, result: ReferenceResult, config: ReferenceCheck,
                 verify: Optional[Callable[[], Optional[ReferenceResult]]] = None) -> None:
    """Judge ``result`` against ``config``'s thresholds and act on a failure as its policy says.

    Under ``"fallback"`` with ``verify`` (a replay of the checked micro-batch with the model's
    switches as they are then, returning its :class:`ReferenceResult`), a move is kept only when
    a replay with it passes every threshold: first the candidate moves (see :func:`_candidates`
    for the order; at most ``max_fallback_replays`` replays), then, when none passes, the
    escalation (:data:`ESCALATION_STEPS`, at most ``max_escalation_replays`` replays, with one
    warning naming the step); when nothing passes, nothing is moved. ``ReferenceResult.fallback_tried``
    records every replay with its figures before and after. Without ``verify``, the offending
    layers move unverified: those under ``min_sqnr_db``, else the ``fallback_worst_k`` lowest.

    Under ``"raise"`` with ``verify``, the same replays run as a diagnosis (nothing is kept: the
    switches stay as they were) and the error lists them with their figures.

    Raises:
        FP8ReferenceCheckError: a failed check under ``policy="raise"``.
    """
    offending = judge(result, config)
    if not result.failures or config.policy == "log":
        return
    if config.policy in ("fallback", "raise") and verify is not None:
        low_layers = [name for name, db in result.layer_sqnr_db.items() if db < config.min_sqnr_db]
        kept = _verified_fallback(model, result, config, low_layers, verify)
        if config.policy == "raise":  # a diagnosis: the switches stay as they were
            for entry in result.fallback_tried:
                entry["kept"] = False
            result.fallback_escalation = ""
            _escalation_warning(result, config)
            raise FP8ReferenceCheckError(result)
        _escalation_warning(result, config)
        _apply_moves(dict(_fp8_layers(model)), kept)
        result.fallback_layers = [name for name, gemm in kept if gemm is None]
        result.fallback_gemms = [f"{name}.{gemm}" for name, gemm in kept if gemm is not None]
    elif config.policy == "raise":
        raise FP8ReferenceCheckError(result)
    elif config.policy == "fallback":
        layers = dict(_fp8_layers(model))
        for name in offending:
            layers[name].use_fp8 = False
        result.fallback_layers = list(offending)
    if _is_rank_zero():
        warnings.warn(f"FP8 reference check at step {result.step + 1}: {result.describe()}", stacklevel=2)
        for entry in result.fallback_tried:
            if entry["kept"]:
                log.warning("FP8 reference check at step %d: moved to high precision: %s", result.step + 1,
                            move_text(entry))


def reference_check(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                    compute_dtype: torch.dtype = torch.bfloat16, config: Optional[ReferenceCheck] = None,
                    recipe: Optional[Recipe] = None, group: Optional["dist.ProcessGroup"] = None,
                    step: int = 0, rng_state: Optional[_RNGState] = None) -> ReferenceResult:
    """Run one BF16 reference check by hand (plain PyTorch): call it before ``optimizer.step()``.

    ``loss_fn(model, batch)`` runs the forward and returns the scalar loss; it runs twice, in
    FP8 and with FP8 off, from the current RNG state (restored afterwards: the training run's
    random stream is unchanged), with gradients into separate buffers: ``.grad``, the optimizer
    and the FP8 scaling state are left as they were.

    Args:
        model: a converted model (:func:`fp8_plugin.convert_model`).
        batch: passed to ``loss_fn``.
        loss_fn: ``(model, batch) -> 0-dim tensor``.
        compute_dtype: dtype of the non-FP8 ops and of the reference (torch autocast); float32: none.
        config: thresholds and policy (default ``ReferenceCheck(policy="log")``: judge, do nothing).
        recipe: the recipe of the FP8 replay (None: each layer's own).
        group: process group whose ranks' figures are summed (None: the world, when initialised).
        step: recorded in the result.
        rng_state: replay from this RNG state (:func:`capture_rng_state` taken right before the
            training forward: the same dropout masks); None: the current one.

    Returns:
        :class:`ReferenceResult` (``failures`` filled in against the thresholds).

    Raises:
        FP8ReferenceCheckError: a failed check under ``policy="raise"``.
    """
    config = config if config is not None else ReferenceCheck(policy="log")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    rng_state = rng_state if rng_state is not None else capture_rng_state(device)
    result = compare(model, lambda: loss_fn(model, batch), rng_state=rng_state,
                     compute_dtype=compute_dtype, device_type=device_kind(device), step=step, recipe=recipe, group=group)
    if result is None:
        raise ValueError("reference_check: loss_fn returned None; it must return the 0-dim loss tensor")
    apply_policy(model, result, config, verify=lambda: compare(
        model, lambda: loss_fn(model, batch), rng_state=rng_state, compute_dtype=compute_dtype,
        device_type=device_kind(device), step=step, recipe=recipe, group=group))
    return result


# ---------------------------------------------------------------------------------------------
# Scheduling, across the steps of a training run


class ReferenceChecker:
    """Runs the checks of one training run: when, on which micro-batch, and what they found.

    Loops feed it through :class:`~fp8_plugin.training.core.FP8Training`: ``capture`` at each
    training forward (kept only on a step that is due), ``run`` before the optimizer step,
    ``end_step`` after it.

    Attributes:
        config: the :class:`ReferenceCheck`.
        steps: optimizer steps ended so far (restored on resume).
        results: every check's :class:`ReferenceResult`, in order.
        check_seconds, train_seconds: time spent in checks, and in training between the first
            and the last optimizer step seen (checks included).
    """

    def __init__(self, config: ReferenceCheck) -> None:
        self.config = config
        self.steps = 0
        self.results: list[ReferenceResult] = []
        self.check_seconds = 0.0
        self.train_seconds = 0.0
        self._capture: Optional[tuple[Callable[[], torch.Tensor], _RNGState]] = None
        self._new_result: Optional[ReferenceResult] = None
        self._last_step_end: Optional[float] = None

    def due(self) -> bool:
        """Whether the step in progress is one a check runs on."""
        return (self.steps + 1) % self.config.every == 0

    def capture(self, run_replay: Callable[[], torch.Tensor], device: torch.device) -> None:
        """Keep ``run_replay`` (the micro-batch's forward returning its loss) and the RNG state
        now, at the start of its training forward, if this step is due: the last micro-batch
        of the step is the one replayed."""
        if self.due():
            self._capture = (run_replay, capture_rng_state(device))

    def run(self, model: nn.Module, compute_dtype: torch.dtype, group: Optional["dist.ProcessGroup"]) -> None:
        """Check the captured micro-batch, if any, and apply the policy.

        Raises:
            FP8ReferenceCheckError: a failed check under ``policy="raise"``.
        """
        if self._capture is None:
            return
        run_replay, rng_state = self._capture
        self._capture = None
        device_type = device_kind(rng_state.device) if rng_state.device is not None else "cpu"
        def check() -> Optional[ReferenceResult]:
            return compare(model, run_replay, rng_state=rng_state, compute_dtype=compute_dtype,
                           device_type=device_type, step=self.steps, group=group,
                           reference_dtype=reference_gemm_dtype(compute_dtype, device_type))

        result = check()
        if result is None:
            return
        self.results.append(result)
        self._new_result = result
        start = time.perf_counter()
        try:
            apply_policy(model, result, self.config, verify=check)
        finally:  # the verification replays of a failed check count as the check's time
            result.seconds += time.perf_counter() - start
            self.check_seconds += result.seconds

    def end_step(self) -> None:
        """The optimizer step ended (or was skipped by the loss scaler)."""
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.train_seconds += now - self._last_step_end
        self._last_step_end = now
        self.steps += 1
        self._capture = None

    def pop_metrics(self) -> dict[str, float]:
        """The figures of the check the last step ran, once (empty when none ran)."""
        result, self._new_result = self._new_result, None
        return result.metrics(self.config.log_layers) if result is not None else {}

    def fallback_layers(self) -> list[tuple[int, str]]:
        """``(step, layer)`` of every layer the checks moved to high precision."""
        return [(r.step + 1, name) for r in self.results for name in r.fallback_layers]

    def summary(self) -> str:
        """A short text: checks run and failed, worst layers, fallbacks, overhead."""
        return summary_text(self)

    def finish(self) -> str:
        """Write the report files, then return the summary with a line per file written."""
        return with_written(self.summary(), self.write_reports())

    def write_reports(self) -> list[str]:
        """Write the JSON and PNG files the config asks for; returns their paths."""
        return write_reports(self)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "results": [r.to_dict() for r in self.results],
                "check_seconds": self.check_seconds, "train_seconds": self.train_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.results = [ReferenceResult.from_dict(r) for r in state["results"]]
        self.check_seconds = float(state["check_seconds"])
        self.train_seconds = float(state["train_seconds"])
