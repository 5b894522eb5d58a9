"""``FP8AdamW``: AdamW whose first moment is kept in FP8 (E4M3, per-block scales) and second in BF16.

For a full fine-tune with torch's AdamW the two moments are the largest item in memory, 8 bytes
per parameter in FP32. MS-AMP's O2 level keeps the first moment in FP8 and the second in 16 bits
(Peng et al., "FP8-LM: Training FP8 Large Language Models", 2023, section 2.3); this optimizer
does the same with the first moment in the per-block E4M3 format of :mod:`.moment_blocks` and
the second in BF16: 1 + 4/128 + 2 = 3.03 bytes per parameter. The parameters themselves stay as
they are (FP32 master weights under the project's precisions).

Why BF16 and not FP16 for the second moment: it holds squared gradients, which span a far wider
range than FP16's (a gradient of 1e-5 squares to 1e-10, below FP16's smallest subnormal, 6e-8);
a second moment that flushed to zero would turn an element's update into ``m / eps``. BF16 keeps
FP32's exponent range.

Each step computes the moments in FP32 from the stored ones, updates the parameter from those
FP32 values exactly as ``torch.optim.AdamW`` (single-tensor path, ``amsgrad=False``) does, then
stores them back rounded (E4M3 per block, BF16): the only difference from torch's AdamW is the
rounding of the stored moments between steps. The step works one parameter at a time, a large one
in pieces of ``STEP_CHUNK`` elements (whole blocks, so the result is the same), so that its FP32
temporaries stay under 300 MiB whatever the parameter's size (traced: 4.3 FP32 values per element
of a piece at their peak, tests/optim/test_fp8_adamw.py): a step over all parameters at once
(torch's ``foreach`` path) holds temporaries of 4 bytes per parameter at the optimizer step's peak.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Optional

import torch

from .moment_blocks import BLOCK, MOMENT_DTYPE, blocks_of, dequantize_moment, quantize_moment

__all__ = ["FP8AdamW", "STATE_KEYS"]

# The per-parameter state: torch AdamW's keys, and the first moment's block scales.
STATE_KEYS = ("step", "exp_avg", "exp_avg_scale_inv", "exp_avg_sq")
_SECOND_MOMENT_DTYPES = (torch.bfloat16, torch.float32)
# Elements updated at a time, a multiple of BLOCK: each FP32 temporary of the step (the moments,
# the denominator, the scaled blocks, about five) is at most 64 MiB, not its parameter's size (a
# Llama 3 embedding, 128256 x 2048, would need 4 GiB of them at the optimizer step's peak).
STEP_CHUNK = 2**24


class FP8AdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov and Hutter, decoupled weight decay; ``torch.optim.AdamW``'s arguments
    and update) with the first moment in E4M3 per 128-element block and the second in BF16.

    Args:
        params: the parameters or parameter groups, as for any torch optimizer: floating-point
            tensors (FP32 master weights in the project's precisions; BF16 or FP16 parameters are
            updated in their own dtype).
        lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW`` (same defaults:
            1e-3, (0.9, 0.999), 1e-8, 1e-2, False).
        exp_avg_sq_dtype: the stored second moment's dtype: ``torch.bfloat16`` (default, 2 bytes)
            or ``torch.float32`` (4 bytes: the first moment alone in FP8).
        amsgrad, foreach, fused, capturable, differentiable: accepted for the signature's sake,
            only at torch's defaults (False / None): this optimizer runs its own per-parameter step.

    State per parameter (``state_dict()``): ``step`` (float32 0-dim, on the CPU, as torch's),
    ``exp_avg`` (float8_e4m3fn, the parameter's shape), ``exp_avg_scale_inv`` (float32
    ``[ceil(numel / 128)]``), ``exp_avg_sq`` (``exp_avg_sq_dtype``, the parameter's shape).
    :meth:`load_state_dict` takes this format or a ``torch.optim.AdamW`` state (its FP32 moments
    rounded into this format); :meth:`torch_adamw_state_dict` gives a state that
    ``torch.optim.AdamW.load_state_dict`` takes.

    Raises:
        ValueError: a hyperparameter out of range (torch's checks), an option other than torch's
            default among ``amsgrad``, ``foreach``, ``fused``, ``capturable``, ``differentiable``, an
            ``exp_avg_sq_dtype`` other than bfloat16 or float32, a parameter that is not floating
            point.
        TypeError: a parameter sharded by FSDP2 (a ``DTensor``): per-block scales of a local
            shard change with the world size and FSDP2's sharded checkpoints expect states
            placed as the parameters; use torch's AdamW there.

    ``step()`` raises RuntimeError for a sparse gradient and ValueError for a non-finite one,
    before any parameter moves (a step whose gradients overflowed must be skipped, as
    ``torch.amp.GradScaler.step`` does); the check costs one host read per step.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False,
                 exp_avg_sq_dtype: torch.dtype = torch.bfloat16, foreach: Optional[bool] = None,
                 fused: Optional[bool] = None, capturable: bool = False, differentiable: bool = False) -> None:
        if isinstance(lr, torch.Tensor):
            lr = float(lr)
        if not 0.0 <= lr:
            raise ValueError(f"FP8AdamW: invalid learning rate lr={lr}; valid: >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"FP8AdamW: invalid epsilon eps={eps}; valid: >= 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= float(beta) < 1.0:
                raise ValueError(f"FP8AdamW: invalid beta parameter at index {i}: {beta}; valid: 0 <= beta < 1")
        if not 0.0 <= weight_decay:
            raise ValueError(f"FP8AdamW: invalid weight_decay={weight_decay}; valid: >= 0")
        unsupported = {name: value for name, value in (("amsgrad", amsgrad), ("foreach", foreach), ("fused", fused),
                                                       ("capturable", capturable),
                                                       ("differentiable", differentiable)) if value}
        if unsupported:
            name, value = next(iter(unsupported.items()))
            raise ValueError(f"FP8AdamW: {name}={value!r} is not supported; valid: {name}=False (or None): this "
                             "optimizer runs its own per-parameter step with an FP8 first moment")
        if exp_avg_sq_dtype not in _SECOND_MOMENT_DTYPES:
            raise ValueError(f"FP8AdamW: exp_avg_sq_dtype={exp_avg_sq_dtype} is not supported; valid: torch.bfloat16, "
                             "torch.float32 (float16 would flush small squared gradients to zero)")
        defaults = dict(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps, weight_decay=weight_decay,
                        maximize=maximize, exp_avg_sq_dtype=exp_avg_sq_dtype, amsgrad=False, foreach=None,
                        fused=None, capturable=False, differentiable=False)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                _check_param(p, i)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None) -> Optional[torch.Tensor]:
        """One AdamW step of every parameter that has a gradient; returns ``closure()``'s loss
        if given (evaluated with grad enabled, as torch's optimizers do)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _check_finite_grads(self.param_groups)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = float(group["lr"]), group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FP8AdamW does not support sparse gradients; use torch.optim.SparseAdam")
                state = self.state[p]
                if not state:
                    state.update(_zero_state(p, group["exp_avg_sq_dtype"]))
                state["step"] += 1
                step = float(state["step"])
                p.mul_(1 - lr * weight_decay)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5  # as torch computes it
                for chunk in _chunks(p, state):
                    _update(*chunk, group["maximize"], beta1, beta2, eps, -lr / bias_correction1,
                            bias_correction2_sqrt)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state of this optimizer, or of ``torch.optim.AdamW`` (its FP32 moments rounded
        into this format; ``amsgrad=True`` states are refused).

        Raises:
            ValueError: as ``torch.optim.Optimizer.load_state_dict`` (groups that do not match),
                a state whose moments do not have their parameter's shape, an ``amsgrad`` state,
                or block scales of the wrong length.
        """
        saved_states = state_dict["state"]
        # torch's loader casts every floating state tensor to its parameter's dtype (which would
        # turn the E4M3 moment into FP32): it loads the groups and steps, the moments come after.
        steps_only = {pid: {k: v for k, v in s.items() if k == "step"} for pid, s in saved_states.items()}
        groups = []
        for group in state_dict["param_groups"]:
            group = dict(group)
            if group.get("amsgrad"):
                raise ValueError("FP8AdamW.load_state_dict: the state is of an AdamW with amsgrad=True; FP8AdamW "
                                 "keeps no max_exp_avg_sq; valid: a state of amsgrad=False")
            group.setdefault("exp_avg_sq_dtype", torch.bfloat16)
            groups.append(group)
        super().load_state_dict({**state_dict, "state": steps_only, "param_groups": groups})
        # Each saved id's parameter and its group's second-moment dtype (torch matched the groups).
        owner = {pid: (p, group["exp_avg_sq_dtype"])
                 for saved, group in zip(state_dict["param_groups"], self.param_groups)
                 for pid, p in zip(saved["params"], group["params"])}
        for pid, saved in saved_states.items():
            p, dtype = owner[pid]
            self.state[p].update(_imported_moments(p, saved, dtype, pid))

    def torch_adamw_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as ``torch.optim.AdamW`` keeps it: FP32 moments (the first
        dequantized as this optimizer's own step reads it, each value ``data * scale_inv``
        rounded once to FP32; the second widened, exactly), ``step``, no block scales; the groups
        without ``exp_avg_sq_dtype``. ``torch.optim.AdamW(params).load_state_dict(...)`` takes
        it, and its next step is the one this optimizer would take."""
        state_dict = self.state_dict()
        converted = {}
        for pid, s in state_dict["state"].items():
            converted[pid] = {"step": s["step"].clone(),
                              "exp_avg": dequantize_moment(s["exp_avg"], s["exp_avg_scale_inv"]),
                              "exp_avg_sq": s["exp_avg_sq"].float().clone()}
        groups = [{k: v for k, v in g.items() if k != "exp_avg_sq_dtype"} for g in state_dict["param_groups"]]
        return {"state": converted, "param_groups": copy.deepcopy(groups)}

    def state_bytes(self) -> int:
        """Bytes of every state tensor (moments, block scales, steps) this optimizer holds now."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))


def _chunks(p: torch.Tensor, state: dict[str, Any]):
    # (parameter, gradient, first moment, its block scales, second moment) in flat pieces of at
    # most STEP_CHUNK elements (whole blocks), views that the update writes through; the whole
    # tensors where one of them is not contiguous (then no view of a piece exists).
    tensors = (p, state["exp_avg"], state["exp_avg_sq"])
    if p.numel() <= STEP_CHUNK or not all(t.is_contiguous() for t in tensors):
        yield p, p.grad, state["exp_avg"], state["exp_avg_scale_inv"], state["exp_avg_sq"]
        return
    flat_p, flat_m, flat_v = (t.view(-1) for t in tensors)
    flat_g = p.grad.reshape(-1)  # a copy only for a non-contiguous gradient
    for start in range(0, p.numel(), STEP_CHUNK):
        end = min(start + STEP_CHUNK, p.numel())
        yield (flat_p[start:end], flat_g[start:end], flat_m[start:end],
               state["exp_avg_scale_inv"][start // BLOCK: blocks_of(end)], flat_v[start:end])


def _update(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, m_scale_inv: torch.Tensor, v: torch.Tensor,
            maximize: bool, beta1: float, beta2: float, eps: float, step_size: float,
            bias_correction2_sqrt: float) -> None:
    # torch's AdamW update (single-tensor path, after the weight decay) from the stored moments,
    # computed in FP32, the moments stored back rounded: E4M3 per block, the second moment's dtype.
    grad = grad.float()
    if maximize:
        grad = -grad
    exp_avg = dequantize_moment(m, m_scale_inv)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq = v.float()
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(exp_avg, denom, value=step_size)
    data, scale_inv = quantize_moment(exp_avg, check_finite=False)
    m.copy_(data)
    m_scale_inv.copy_(scale_inv)
    v.copy_(exp_avg_sq)


def _check_finite_grads(groups: list[dict[str, Any]]) -> None:
    # Before any parameter moves: one host read per step (as torch's GradScaler makes one), not
    # one per parameter; a step with a non-finite gradient changes nothing. The largest |g| of
    # all gradients is NaN or infinite exactly when one element is; a max-reduction holds no
    # temporary (torch.isfinite(g) holds 4 + 3 bytes per element of the gradient).
    grads = [p.grad for g in groups for p in g["params"] if p.grad is not None and not p.grad.is_sparse]
    if not grads:
        return
    largest = torch.nn.utils.get_total_norm(grads, norm_type=float("inf"))
    if largest.device.type == "meta":  # shapes without values (the memory tool's traced step): nothing to read
        return
    if not bool(torch.isfinite(largest)):
        index = next(i for i, g in enumerate(grads)
                     if not bool(torch.isfinite(torch.linalg.vector_norm(g, float("inf")))))
        raise ValueError(f"FP8AdamW.step: the gradient of parameter {index} (of those with gradients) holds a NaN or "
                         "an infinity; nothing was updated. Skip such steps (torch.amp.GradScaler.step does, and the "
                         "project's FP16 precisions use it) or clip the gradients")


def _check_param(p: torch.Tensor, index: int) -> None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        DTensor = ()  # noqa: N806
    if isinstance(p, DTensor):
        raise TypeError(f"FP8AdamW: parameter {index} is a DTensor (sharded by FSDP2); FP8AdamW keeps whole-tensor "
                        "block scales, which a shard's do not reproduce: use torch.optim.AdamW under FSDP2")
    if not p.is_floating_point() or p.is_complex():
        raise ValueError(f"FP8AdamW: parameter {index} has dtype {p.dtype}; valid: a floating-point parameter "
                         "(float32 master weights, bfloat16, float16)")


def _zero_state(p: torch.Tensor, exp_avg_sq_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros(p.shape, dtype=MOMENT_DTYPE, device=p.device),
            "exp_avg_scale_inv": torch.ones(blocks_of(p.numel()), dtype=torch.float32, device=p.device),
            "exp_avg_sq": torch.zeros(p.shape, dtype=exp_avg_sq_dtype, device=p.device)}


def _imported_moments(p: torch.Tensor, saved: dict[str, Any], exp_avg_sq_dtype: torch.dtype,
                      pid: Any) -> dict[str, torch.Tensor]:
    # The moments of a saved state (this format, or torch AdamW's FP32 one) on p's device.
    if "max_exp_avg_sq" in saved:
        raise ValueError(f"FP8AdamW.load_state_dict: parameter {pid}'s state holds max_exp_avg_sq (amsgrad=True); "
                         "valid: a state of amsgrad=False")
    moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        if key not in saved:
            raise ValueError(f"FP8AdamW.load_state_dict: parameter {pid}'s state lacks {key!r}; it has "
                             f"{sorted(saved)}")
        if tuple(saved[key].shape) != tuple(p.shape):
            raise ValueError(f"FP8AdamW.load_state_dict: parameter {pid}'s {key} has shape {list(saved[key].shape)}, "
                             f"the parameter {list(p.shape)}")
    if "exp_avg_scale_inv" in saved:  # this format: the bytes as they were
        scale_inv = saved["exp_avg_scale_inv"]
        if scale_inv.numel() != blocks_of(p.numel()):
            raise ValueError(f"FP8AdamW.load_state_dict: parameter {pid} has {scale_inv.numel()} block scales; "
                             f"expected {blocks_of(p.numel())}")
        moments["exp_avg"] = saved["exp_avg"].to(device=p.device, dtype=MOMENT_DTYPE)
        moments["exp_avg_scale_inv"] = scale_inv.to(device=p.device, dtype=torch.float32)
    else:  # torch AdamW's FP32 first moment, rounded into this format
        data, scale_inv = quantize_moment(saved["exp_avg"].to(p.device))
        moments["exp_avg"], moments["exp_avg_scale_inv"] = data, scale_inv
    moments["exp_avg_sq"] = saved["exp_avg_sq"].to(device=p.device, dtype=exp_avg_sq_dtype)
    return moments
