"""Non-finite steps and amax outliers: what a training loop does when its numbers go bad.

Loop-neutral, used by :class:`~fp8_plugin.training.core.FP8Training`. Once per optimizer step, right
before it, :meth:`FaultMonitor.check` reads in one host synchronisation whether the step's
gradients are finite (unless a loss scaler checks them already: the sum of each gradient, which
any NaN or inf reaches; a step whose sums are not finite is then checked element by element, so
finite gradients whose sum overflows are not mistaken for bad ones), and which FP8 layers saw a
non-finite amax or had an amax outlier since the last check. Then:

- a step with non-finite gradients is skipped (``nonfinite="skip"``: no optimizer step, so the
  FP32 master weights and the optimizer state stay as they were; a warning names the first FP8
  layer that saw a non-finite value) or stops the run (``"raise"``:
  :class:`FP8NonFiniteError`, before the step). With a loss scaler (FP16) the scaler skips the
  step and backs off, as usual, and nothing is warned: overflow is how it finds its scale;
- more than ``max_consecutive_skips`` skipped steps in a row (by either) stop the run:
  the run is not recovering, and going on would only spend compute;
- delayed-scaling amax outliers (see ``DelayedScaling.amax_outlier_factor``) are warned about,
  naming the layer, the role and the factor.

Non-finite amaxes never enter the scaling state (:meth:`ScalingState.record_amax`), whatever
the policy. Every rank skips or stops on the same step: replicated (DDP) gradients are the same
on every rank after their all-reduce, and under FSDP the verdicts are all-reduced.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..numerics.quantizers import GRAD_OUTPUT, ROLES, ScalingState

__all__ = ["FaultPolicy", "FaultMonitor", "FP8NonFiniteError", "NONFINITE_POLICIES", "resolve_fault_policy"]

NONFINITE_POLICIES = ("skip", "raise")


class FP8NonFiniteError(FloatingPointError):
    """Training stopped on non-finite values (``nonfinite="raise"``, or too many skipped steps).

    Raised before the optimizer step: the weights and the optimizer state are those of the last
    good step, so a checkpoint written now loses nothing.
    """


@dataclass(frozen=True)
class FaultPolicy:
    """What a training step with non-finite gradients does.

    Args:
        nonfinite: ``"skip"`` (default: the optimizer step is not taken, with a warning naming
            the first FP8 layer that saw a non-finite value) or ``"raise"`` (stop with
            :class:`FP8NonFiniteError` before the step). Applies without loss scaling; with a
            loss scaler (FP16) the scaler skips such steps itself.
        max_consecutive_skips: stop with :class:`FP8NonFiniteError` when more than this many
            optimizer steps in a row were skipped (by this policy or the loss scaler); 0 means
            no limit. Default 25: a loss scaler halves its scale at each skip, and 25 halvings
            take the default 65536 below 1e-2, far past any healthy back-off.

    Raises:
        ValueError: an unknown ``nonfinite`` or a ``max_consecutive_skips`` that is not an
            integer >= 0.
    """

    nonfinite: str = "skip"
    max_consecutive_skips: int = 25

    def __post_init__(self) -> None:
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite={self.nonfinite!r} is invalid; valid: {', '.join(repr(p) for p in NONFINITE_POLICIES)}"
            )
        limit = self.max_consecutive_skips
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"max_consecutive_skips={limit!r} is invalid; valid: an integer >= 0 (0: no limit)")


def resolve_fault_policy(nonfinite: Optional[str], max_consecutive_skips: Optional[int]) -> FaultPolicy:
    """A :class:`FaultPolicy` from the loops' two arguments (None: the default)."""
    defaults = FaultPolicy()
    return FaultPolicy(
        nonfinite if nonfinite is not None else defaults.nonfinite,
        max_consecutive_skips if max_consecutive_skips is not None else defaults.max_consecutive_skips,
    )


class FaultMonitor:
    """Applies a :class:`FaultPolicy` to one converted model, step by step.

    Attributes:
        skipped_steps: optimizer steps skipped for non-finite gradients by this policy.
        consecutive_skips: skipped steps in a row up to the last check (this policy's and the
            loss scaler's).
        outliers: ``(layer, role, ratio)`` of every amax outlier reported so far.
    """

    def __init__(self, policy: FaultPolicy) -> None:
        self.policy = policy
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.outliers: list[tuple[str, str, float]] = []
        self._layers: Optional[list[tuple[str, ScalingState]]] = None
        self._seen: Optional[torch.Tensor] = None  # counters at the last check, [2, layers, 3]
        self._baseline = True  # no check yet: the counters' present values are not news
        # Skips by the loss scaler in a row: on the device, or an int where the loop knows them on the host.
        self._scaler_skipped: Union[torch.Tensor, int, None] = None
        self._sharded: Optional[bool] = None

    def _states(self, module: nn.Module) -> list[tuple[str, ScalingState]]:
        if self._layers is None:
            self._layers = [(name.rpartition(".fp8_state")[0] if name != "fp8_state" else "", m)
                            for name, m in module.named_modules() if isinstance(m, ScalingState)]
        return self._layers

    def check(self, module: nn.Module, step: int, loss_scaled: bool,
              group: Optional["dist.ProcessGroup"] = None) -> bool:
        """Decide whether the optimizer step may run; call it right before the step.

        Args:
            module: the converted model, its gradients complete for this step.
            step: the optimizer step's number, for messages.
            loss_scaled: a loss scaler checks the gradients (and skips the step) itself.
            group: the process group whose ranks must agree (None: the world, when initialised).

        Returns:
            True to take the step, False to skip it (``zero_grad`` as usual afterwards).

        Raises:
            FP8NonFiniteError: ``nonfinite="raise"`` and the gradients are not finite, or more
                than ``max_consecutive_skips`` steps in a row were skipped.
        """
        states = self._states(module)
        parts = []
        if not loss_scaled:
            if self._sharded is None:
                self._sharded = _is_sharded(module)
            parts.append(self._suspect(_gradients(module), group, _device(module)))
        if isinstance(self._scaler_skipped, torch.Tensor):
            parts.append(self._scaler_skipped.to(torch.float32).reshape(1))
        counters = None
        if states:
            counters = torch.stack([torch.stack([s.nonfinite_amax_count, s.outlier_count]) for _, s in states], 1)
            ratios = torch.stack([s.outlier_ratio for _, s in states])
            parts += [counters.to(torch.float32).flatten(), ratios.flatten()]
        values = torch.cat([p.to(parts[0].device) for p in parts]).tolist() if parts else []  # the one sync
        grads_bad = bool(values.pop(0)) if not loss_scaled else False
        if grads_bad:  # the fast test can flag finite gradients whose sum overflows: confirm
            grads_bad = self._confirmed(_gradients(module), group, _device(module))
        if isinstance(self._scaler_skipped, torch.Tensor):
            self.consecutive_skips = int(values.pop(0))
        elif self._scaler_skipped is not None:
            self.consecutive_skips = self._scaler_skipped
        new_nonfinite: list[tuple[str, str]] = []
        if counters is not None:
            n = len(states)
            now = torch.tensor(values[: 2 * n * 3]).reshape(2, n, 3)
            ratio = torch.tensor(values[2 * n * 3:]).reshape(n, 3)
            # At the first check, counters from before (a loaded checkpoint) are not news;
            # this step's own events are then named by a zero baseline only for non-finite values.
            before = self._seen if self._seen is not None else torch.zeros_like(now)
            if self._baseline:
                before[1] = now[1]
                self._baseline = False
            self._seen = now
            new_nonfinite = [(states[i][0], ROLES[r]) for i, r in (now[0] > before[0]).nonzero().tolist()]
            for i, r in (now[1] > before[1]).nonzero().tolist():
                self._report_outlier(states[i][0], ROLES[r], float(ratio[i, r]), step)
        self._check_streak(step)
        if not grads_bad:
            if not loss_scaled:
                self.consecutive_skips = 0
            return True
        where = _first_seen(new_nonfinite) or _first_nonfinite_parameter(module)
        if self.policy.nonfinite == "raise":
            raise FP8NonFiniteError(
                f"non-finite gradients at optimizer step {step}{where}; stopped before the step "
                "(nonfinite='raise'): the weights and optimizer state are the last good step's"
            )
        self.skipped_steps += 1
        self.consecutive_skips += 1
        warnings.warn(
            f"FP8: non-finite gradients at optimizer step {step}{where}; the step is skipped (weights and "
            f"optimizer state unchanged; {self.skipped_steps} skipped so far, nonfinite='skip')",
            stacklevel=2,
        )
        self._check_streak(step)
        return False

    def _suspect(self, grads: list[torch.Tensor], group: Optional["dist.ProcessGroup"],
                 device: torch.device) -> torch.Tensor:
        # Sums are the cheapest reduction that a NaN or inf reaches (an inf-norm costs 9x more on
        # CPU): float32 [1], 0 or more; the ranks' verdicts added where gradients are sharded.
        total = torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum() if grads else torch.zeros((), device=device)
        return self._agreed((~torch.isfinite(total)).to(torch.float32).reshape(1), group)

    def _confirmed(self, grads: list[torch.Tensor], group: Optional["dist.ProcessGroup"],
                   device: torch.device) -> bool:
        # Every rank gets here together (the verdict above is the same on all): check each
        # element exactly, which only the rare suspect step pays for.
        bad = any(not bool(torch.isfinite(g).all()) for g in grads)
        return bool(self._agreed(torch.tensor([float(bad)], device=device), group).item())

    def _agreed(self, bad: torch.Tensor, group: Optional["dist.ProcessGroup"]) -> torch.Tensor:
        # Replicated gradients (DDP) are identical on every rank after their all-reduce, so are
        # the verdicts; sharded ones (FSDP) are not: the ranks agree through a sum of their 0/1
        # verdicts (a SUM, so that MAX all-reduces stay the amax reductions alone).
        if self._sharded and _world(group) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.SUM, group=group)
        return bad

    def restart_counts(self) -> None:
        """Take the counters as they are now as the baseline (after loading a checkpoint: its
        past outliers and non-finite amaxes are not this run's news)."""
        self._seen = None
        self._baseline = True

    def scaler_step(self, skipped: Union[torch.Tensor, bool]) -> None:
        """Record whether the loss scaler skipped the last step, for the next :meth:`check`: a
        bool tensor (kept on the device, read with the check's figures) or a bool where the loop
        knows it on the host already (Accelerate's ``optimizer_step_was_skipped``: no tensor is
        made, nothing copied)."""
        if isinstance(skipped, torch.Tensor):
            previous = self._scaler_skipped if isinstance(self._scaler_skipped, torch.Tensor) \
                else torch.zeros_like(skipped, dtype=torch.int64)
            self._scaler_skipped = torch.where(skipped, previous + 1, torch.zeros_like(previous))
        else:
            previous = self._scaler_skipped if isinstance(self._scaler_skipped, int) else 0
            self._scaler_skipped = previous + 1 if skipped else 0

    def _check_streak(self, step: int) -> None:
        limit = self.policy.max_consecutive_skips
        if limit and self.consecutive_skips > limit:
            raise FP8NonFiniteError(
                f"{self.consecutive_skips} optimizer steps in a row were skipped for non-finite gradients (up to "
                f"step {step}; max_consecutive_skips={limit}): the run is not recovering. Lower the learning rate, "
                "check the data for NaN/inf, or resume from an earlier checkpoint"
            )

    def _report_outlier(self, layer: str, role: str, ratio: float, step: int) -> None:
        self.outliers.append((layer, role, ratio))
        warnings.warn(
            f"FP8: amax outlier in layer {layer!r} ({role}) before optimizer step {step}: {ratio:.3g} times the "
            "amax its scale came from (DelayedScaling.amax_outlier_policy decides what enters the history)",
            stacklevel=3,
        )


def _first_seen(nonfinite: list[tuple[str, str]]) -> str:
    # Forwards run in module order and backwards in reverse: the first layer to see a bad value
    # is the first one whose input or weight was non-finite, else the last whose grad_output was.
    forward = [(name, role) for name, role in nonfinite if role != ROLES[GRAD_OUTPUT]]
    if forward:
        name, role = forward[0]
    elif nonfinite:
        name, role = nonfinite[-1]
    else:
        return ""
    others = len(nonfinite) - 1
    return f"; first seen by FP8 layer {name!r} ({role})" + (f", then by {others} more" if others else "")


def _first_nonfinite_parameter(module: nn.Module) -> str:
    # No FP8 layer saw it (a high-precision layer did): name the first parameter it reached.
    for name, param in module.named_parameters():
        if param.grad is not None and not bool(torch.isfinite(_local(param.grad)).all()):
            return f"; first non-finite gradient in parameter {name!r} (no FP8 layer saw a non-finite value)"
    return ""


def _gradients(module: nn.Module) -> list[torch.Tensor]:
    # Sharded (DTensor) gradients: each rank judges its own shard; the ranks then agree.
    return [_local(p.grad) for p in module.parameters() if p.grad is not None]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor's shard on this rank
    return to_local() if callable(to_local) else tensor


def _is_sharded(module: nn.Module) -> bool:
    # FSDP2 makes parameters DTensors; FSDP1 wraps submodules and flattens their parameters.
    return (any(type(p).__name__ in ("DTensor", "FlatParameter") for p in module.parameters())
            or any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()))


def _device(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _world(group: Optional["dist.ProcessGroup"]) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
