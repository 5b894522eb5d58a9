"""What a check found: :class:`ReferenceResult` (its figures, the moves it tried and kept), the
judgement of the figures against the thresholds (:func:`judge`), and the error a failed check
raises under ``policy="raise"``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ...numerics.recipes import GEMMS
from ..reference_report import finite_or_none, move_text, none_to_inf
from .config import METRIC_PREFIX, ReferenceCheck


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
        fallback_blockwise: the layers this check moved to blockwise scaling (their GEMMs stay
            in FP8: ``FP8Linear.fp8_scaling``).
        fallback_tried: every replay a verified fallback (or a ``"raise"`` diagnosis) ran, in
            order: ``{"stage": "candidate" | "escalation", "escalation": the step's name or None,
            "moves": ["<layer>" | "<layer>.<gemm>", ...], "passed": bool, "kept": bool,
            "failures": [...], "loss_rel_diff", "grad_cosine", "grad_rel_error", "sqnr_min_db"
            (the replay's figures with the move: after), "before": {the same four of the check:
            before}}``.
        fallback_escalation: the escalation step kept (a name in :data:`ESCALATION_STEPS`), or
            ``""``.
        verdict: ``""``, or why no move can pass: ``"not FP8: ..."`` when even every FP8 layer in
            high precision (the escalation's last step) does not restore the figures, so the drift
            is the compute dtype's against the reference, not FP8's; later checks whose failures are
            the same do not repeat the replays (the verdict says so).
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
    fallback_blockwise: list[str] = field(default_factory=list)
    fallback_tried: list[dict[str, Any]] = field(default_factory=list)
    fallback_escalation: str = ""
    verdict: str = ""
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
        if self.fallback_blockwise:
            text += "; moved to blockwise scaling (GEMMs still FP8): " + ", ".join(self.fallback_blockwise)
        if self.verdict:
            text += f"; {self.verdict}"
        passed = [t for t in self.fallback_tried if t["passed"]]
        if self.fallback_tried and not moved and not self.fallback_blockwise:
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
            "fallback_blockwise": float(len(self.fallback_blockwise)),
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
        return finite_or_none(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReferenceResult":
        data = dict(data)
        data["param_figures"] = {k: tuple(none_to_inf(x) for x in v) for k, v in data["param_figures"].items()}
        data["layer_sqnr_db"] = {k: none_to_inf(v) for k, v in data["layer_sqnr_db"].items()}
        # Absent from results saved before the per-GEMM figures existed.
        data["gemm_sqnr_db"] = {k: {g: none_to_inf(db) for g, db in v.items()}
                                for k, v in data.get("gemm_sqnr_db", {}).items()}
        return cls(**{k: none_to_inf(v) if k in _FLOAT_FIELDS else v for k, v in data.items()})


_FLOAT_FIELDS = ("loss_fp8", "loss_reference", "loss_rel_diff", "grad_cosine", "grad_rel_error", "seconds")


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
