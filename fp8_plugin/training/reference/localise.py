"""Where a failed check's error sits and what removes it: candidate moves from the figures, the
verified fallback (a move is kept only when a replay with it passes), and the model-wide
escalation (:data:`ESCALATION_STEPS`).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Callable, Optional, Sequence

import torch.distributed as dist
from torch import nn

from ...modules.scaling_choice import blockwise_allowed
from ...modules.linear import FP8Linear
from ...numerics.recipes import GEMMS, DelayedScaling, Float8CurrentScaling
from ..reference_report import move_text
from .config import ReferenceCheck
from .expert_layers import checked_layers, expert_of
from .result import ReferenceResult, judge


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _low_gemms(result: ReferenceResult, config: ReferenceCheck) -> list[tuple[str, str, float]]:
    return [item for item in result.worst_gemms(len(GEMMS) * len(result.gemm_sqnr_db))
            if item[2] < config.min_gemm_sqnr_db]


# Healthy figures of each GEMM under HYBRID (E4M3 forward, E5M2 backward operand; see the
# ReferenceCheck docstring): a GEMM's shortfall from its own is what ranks it as a suspect.
_HEALTHY_GEMM_DB = {"fprop": 28.5, "dgrad": 24.5, "wgrad": 24.5}


Move = tuple[str, Optional[str]]  # (layer, GEMM), (layer, None) for the whole layer, (layer, BLOCKWISE)
# A move that keeps a layer's GEMMs in FP8 and casts them blockwise (FP8Linear.fp8_scaling).
BLOCKWISE = "blockwise"


def _candidates(model: nn.Module, result: ReferenceResult, config: ReferenceCheck, low_layers: list[str]):
    """The moves a verified fallback tries, in order (a generator: bisection steps depend on the
    replays before them, sent back in): the layers under ``min_sqnr_db`` with the GEMMs under
    ``min_gemm_sqnr_db``; then each GEMM furthest below its healthy figure; then bisection over
    the FP8 layers still in FP8, each step moving half and keeping the half that passes."""
    layers = dict(checked_layers(model))
    gemm_moves = _distinct([_move(layers, n, g) for n, g, _ in _low_gemms(result, config)
                            if expert_of(n, layers) not in low_layers])
    first = [(n, None) for n in low_layers] + gemm_moves
    tried = []
    if first:
        tried.append(first)
        if (yield first):
            return
    ranked = sorted(((n, g, db) for n, f in result.gemm_sqnr_db.items() for g, db in f.items() if math.isfinite(db)),
                    key=lambda item: item[2] - _HEALTHY_GEMM_DB[item[1]])
    for name, gemm, _ in ranked[:config.fallback_worst_k]:
        move = [_move(layers, name, gemm)]
        if move not in tried:
            tried.append(move)
            if (yield move):
                return
    pool, shown = [name for name, layer in checked_layers(model) if layer.use_fp8], False
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


def _move(layers: dict, name: str, gemm: str) -> Move:
    # A GEMM of an expert's projection moves the expert: experts have no per-GEMM switch.
    owner = expert_of(name, layers)
    return (owner, None) if owner != name else (name, gemm)


def _distinct(moves: list[Move]) -> list[Move]:
    return list(dict.fromkeys(moves))


def _apply_moves(layers: dict[str, nn.Module], moves: Sequence[Move]) -> None:
    for name, gemm in moves:
        layer = layers[name]
        if gemm == BLOCKWISE:
            layer.fp8_scaling = "blockwise"
        elif gemm is None or not isinstance(layer, FP8Linear):
            layer.use_fp8 = False
        else:
            flags = list(layer.fp8_gemms)
            flags[GEMMS.index(gemm)] = False
            layer.fp8_gemms = tuple(flags)


def _switches(layers: dict[str, nn.Module]) -> dict[str, tuple]:
    return {name: (layer.use_fp8, getattr(layer, "fp8_gemms", None), getattr(layer, "fp8_scaling", None))
            for name, layer in layers.items()}


def _restore_switches(layers: dict[str, nn.Module], saved: dict[str, tuple]) -> None:
    for name, (use_fp8, gemms, scaling) in saved.items():
        layers[name].use_fp8 = use_fp8
        if gemms is not None:
            layers[name].fp8_gemms = gemms
        if scaling is not None:
            layers[name].fp8_scaling = scaling


def _blockwise_fallback(layers: dict[str, nn.Module], result: ReferenceResult, config: ReferenceCheck,
                        low_layers: list[str], verify: Callable[[], Optional[ReferenceResult]]) -> list[Move]:
    """Blockwise scaling on every per-tensor FP8 layer, one replay; when it passes, the suspects
    alone (``low_layers`` and the layers of the GEMMs under ``min_gemm_sqnr_db``), one replay,
    then halves while a half passes (within ``max_fallback_replays``); the smallest passing set,
    or [] (nothing passed, or nothing to try). Every GEMM stays in FP8."""
    pool = [name for name, layer in layers.items()
            if isinstance(layer, FP8Linear) and layer.use_fp8 and layer.fp8_scaling == "recipe"
            and isinstance(layer.recipe, (DelayedScaling, Float8CurrentScaling)) and blockwise_allowed(layer)]
    if not config.fallback_blockwise or not pool:
        return []
    moves = [(name, BLOCKWISE) for name in pool]
    if not _try(layers, result, config, moves, verify, "blockwise"):
        return []
    kept, kept_index, tried = moves, len(result.fallback_tried) - 1, 1
    # The layers the check's own figures name first, as the candidates' first move does: one
    # replay, where halving down to one layer takes one or two per halving.
    named = set(low_layers) | {name for name, _, _ in _low_gemms(result, config)}
    suspects = [name for name in pool if name in named]
    if 0 < len(suspects) < len(pool) and tried < config.max_fallback_replays:
        tried += 1
        suspect_moves = [(name, BLOCKWISE) for name in suspects]
        if _try(layers, result, config, suspect_moves, verify, "blockwise"):
            pool, kept, kept_index = suspects, suspect_moves, len(result.fallback_tried) - 1
    while len(pool) > 1 and tried < config.max_fallback_replays:
        half = len(pool) // 2
        for part in (pool[:half], pool[half:]):
            if tried >= config.max_fallback_replays:
                break
            tried += 1
            part_moves = [(name, BLOCKWISE) for name in part]
            if _try(layers, result, config, part_moves, verify, "blockwise"):
                pool, kept, kept_index = part, part_moves, len(result.fallback_tried) - 1
                break
        else:
            break  # neither half alone passes: the whole last set is kept
    result.fallback_tried[kept_index]["kept"] = True
    return kept


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
in order; ``None``: the whole layer in high precision (MoE experts, which have no per-GEMM
switch, move only at that step, each expert by its own switch)."""


_FIGURES = ("loss_rel_diff", "grad_cosine", "grad_rel_error")


log = logging.getLogger(__package__)  # "fp8_plugin.training.reference": the one logger of the checks (docs)


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
    """Try blockwise scaling first (:func:`_blockwise_fallback`), then the candidate moves, then
    the escalation; return the moves whose replay passed (empty when none did), the switches
    left as they were. At most 1 + ``max_fallback_replays`` replays before the escalation
    (blockwise's first and the candidates'), and ``max_escalation_replays`` escalation replays."""
    layers = dict(checked_layers(model))
    blockwise = _blockwise_fallback(layers, result, config, low_layers, verify)
    if blockwise:
        return blockwise
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
        if keep is None:  # FP8 off failed too: no move can pass, the difference is not FP8's
            result.verdict = _not_fp8_verdict(result.fallback_tried[-1])
    return []


def _not_fp8_verdict(entry: dict) -> str:
    return ("not FP8: with every FP8 layer in high precision the replay still differs from the reference "
            f"(grad cosine {entry.get('grad_cosine', math.nan):.4f}, loss rel diff "
            f"{entry.get('loss_rel_diff', math.nan):.2%}): the compute dtype differs from the reference by that much; "
            "nothing moved")


def _escalation_warning(result: ReferenceResult, config: ReferenceCheck) -> None:
    # One loud warning when the escalation ran: which step was kept (or that none was), and why.
    steps = [t for t in result.fallback_tried if t.get("stage") == "escalation"]
    if not steps or not _is_rank_zero():
        return
    candidates = len(result.fallback_tried) - len(steps)
    why = (f"no candidate move restored the figures ({candidates} tried, max_fallback_replays="
           f"{config.max_fallback_replays})")
    kept = [t for t in steps if t["kept"]]
    if result.verdict:
        text = f"{result.verdict}; {why}, nor did any of the {len(steps)} escalation steps"
    elif kept:
        text = f"ESCALATED to {_step_description(kept[0]['escalation'])}: {why}; {move_text(kept[0])}"
    elif any(t["passed"] for t in steps):  # policy "raise": a diagnosis, nothing kept
        text = f"escalation (a diagnosis, nothing kept): {why}; " + "; ".join(move_text(t) for t in steps)
    else:
        text = (f"ESCALATION FAILED, nothing moved: {why}, nor did any of the {len(steps)} escalation steps tried "
                f"(max_escalation_replays={config.max_escalation_replays}): " + "; ".join(move_text(t) for t in steps))
    warnings.warn(f"FP8 reference check at step {result.step + 1}: {text}", stacklevel=3)


def _step_description(name: Optional[str]) -> str:
    return next((d for n, d, _ in ESCALATION_STEPS if n == name), str(name))
