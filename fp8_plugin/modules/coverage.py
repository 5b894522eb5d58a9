"""FP8 coverage as a number: the share of a model's GEMM FLOPs that runs in FP8.

Measured on the real model: one forward at batch 1 and a given sequence length (random token
ids unless inputs are given), in high precision under ``torch.no_grad()`` (FP8 off: the FLOPs
are those of the same GEMMs, and no FP8 state changes), with ``torch.utils.flop_counter``'s
``FlopCounterMode`` counting every matrix product torch runs (``mm``, ``addmm``, ``bmm``,
``baddbmm``, ``_scaled_mm``, convolutions, scaled-dot-product attention; 2 FLOPs per
multiply-add) and forward hooks attributing them to the modules that own GEMMs. Each owner
reports its FLOPs and whether they run in FP8 through a counter (:func:`register_gemm_counter`):

* linear layers (``nn.Linear`` and its subclasses, GPT-2's ``Conv1D``, the FP8 layers that
  replace them): the FLOPs measured inside them, ``2 x tokens x in x out``; FP8 when the layer
  is an ``FP8Linear`` with ``use_fp8``;
* MoE experts modules (:func:`fp8_plugin.modules.experts.is_experts_module`):
  ``2 x tokens routed x`` the elements of one expert's 3-D weights (``gate_up_proj`` and
  ``down_proj``), where tokens routed counts the valid entries of the routing indices
  (``top_k x seq_len`` in all, however they spread over the experts). Computed, not measured:
  transformers' ``grouped_mm`` implementation runs ``torch._grouped_mm``, which the flop
  counter does not count, and some implementations compute every expert on every token. FP8
  when the module was converted (``use_fp8``);
* routers: the ``gate`` / ``router`` modules beside an experts module (their measured FLOPs).

Roles, and what the FP8 share excepts:

* ``layer``, ``expert``: the share's denominator: every linear layer that is not a head or a
  router, and every experts module;
* ``head``: output heads (:mod:`fp8_plugin.modules.heads`: ``get_output_embeddings``, weights
  tied to an embedding, ``lm_head`` / ``classifier`` / ``score`` / ``pooler`` / ``cls`` ...
  name components) are excepted: ``convert_model`` keeps them in high precision by default;
* ``router``: MoE routers are excepted: they stay in high precision (their logits pick experts);
* ``other``: the matrix products that no owner makes, measured as the rest of the forward's
  FLOPs: attention's ``Q K^T`` and ``scores x V`` (activation by activation, no weight to
  cast: FP8 attention is a different feature, which this project does not offer; their cost
  grows with the square of the sequence length and depends on the attention kernel) and any
  product a model computes in its own forward. Excepted, and reported beside the share.

Embeddings are table lookups, not GEMMs: no FLOPs. Norms, activations and softmax are not
matrix products: not counted. Only the forward is measured: a training step's dgrad and wgrad
GEMMs are two more of the same size for each layer, in FP8 exactly where its forward is (also
for experts), so the share of a training step's GEMM FLOPs is the same figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from .autocast import autocast
from .experts import ROUTER_NAMES, FP8ExpertsMixin, is_experts_module
from .heads import head_reason, output_embedding_ids, tied_weight_ids
from .linear import FP8Linear

__all__ = ["GemmFlops", "GemmCoverage", "GemmCount", "measure_gemm_coverage", "register_gemm_counter",
           "COUNTED_ROLES", "EXCEPTED_ROLES"]

# Roles in the share's denominator, and those excepted from it (see the module docstring).
COUNTED_ROLES = ("layer", "expert")
EXCEPTED_ROLES = ("head", "router", "other")


@dataclass(frozen=True)
class GemmCount:
    """What a counter reports for one call of its module.

    Attributes:
        flops: FLOPs (2 per multiply-add) of the call's GEMMs; None: the FLOPs the flop counter
            measured inside the module.
        fp8: whether these GEMMs run in FP8 inside :func:`fp8_plugin.autocast`.
    """

    flops: Optional[int]
    fp8: bool


# (module) -> role or None; (module, args, kwargs, output) -> GemmCount.
Matcher = Callable[[nn.Module], Optional[str]]
Counter = Callable[[nn.Module, tuple, dict, Any], GemmCount]
_COUNTERS: list[tuple[Matcher, Counter]] = []


def register_gemm_counter(matches: Matcher, count: Counter) -> Callable[[], None]:
    """Make :func:`measure_gemm_coverage` count the GEMMs of another kind of module.

    Args:
        matches: ``module -> role`` ("layer" or "expert": in the share; "head" or "router":
            excepted) for the modules this counter owns, None for the others. Later
            registrations are asked first; the modules below an owner are not asked (their
            FLOPs are the owner's).
        count: ``(module, args, kwargs, output) -> GemmCount`` for one forward call of an owned
            module (a forward hook's arguments).

    Returns:
        A function that removes this registration.

    Raises:
        TypeError: ``matches`` or ``count`` is not callable.
    """
    if not callable(matches) or not callable(count):
        raise TypeError(f"register_gemm_counter: matches={matches!r} and count={count!r} must both be callables; "
                        "valid: (module) -> role or None, and (module, args, kwargs, output) -> GemmCount")
    entry = (matches, count)
    _COUNTERS.insert(0, entry)
    return lambda: _COUNTERS.remove(entry) if entry in _COUNTERS else None


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def _linear_count(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> GemmCount:
    return GemmCount(None, isinstance(module, FP8Linear) and module.use_fp8)


def _expert_count(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> GemmCount:
    index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
    experts = int(module.num_experts)
    routed = int(((index >= 0) & (index < experts)).sum()) if isinstance(index, torch.Tensor) else 0
    # One expert's weights: the 3-D parameters [E, out, in] (or [E, in, out]) over E.
    per_token = sum(p[0].numel() for p in module.parameters(recurse=False) if p.dim() == 3)
    # An experts module counts as FP8 when all its experts are: one moved by a reference check's
    # fallback puts the module's FLOPs on the high-precision side (the share errs low, never high).
    return GemmCount(2 * routed * per_token, isinstance(module, FP8ExpertsMixin) and all(module.fp8_experts))


register_gemm_counter(lambda m: "layer" if _is_linear(m) else None, _linear_count)
register_gemm_counter(lambda m: "expert" if is_experts_module(m) else None, _expert_count)


@dataclass(frozen=True)
class GemmFlops:
    """The GEMMs of one module in the measured forward.

    Attributes:
        name: dotted module name ("" for the rest of the forward, role "other").
        kind: the module's class name.
        role: "layer", "expert", "head", "router" or "other".
        flops: FLOPs (2 per multiply-add), summed over the module's calls.
        fp8: whether they run in FP8.
    """

    name: str
    kind: str
    role: str
    flops: int
    fp8: bool


@dataclass
class GemmCoverage:
    """FP8 share of a model's GEMM FLOPs in one forward at batch 1 and ``tokens`` tokens.

    ``share`` is the FP8 share of the linear layers' and experts' FLOPs (heads, routers,
    attention's score products and other matrix products that no layer makes excepted:
    :data:`EXCEPTED_ROLES`); ``share_of_all`` is the FP8 share of every GEMM FLOP counted.
    """

    tokens: int
    gemms: list[GemmFlops] = field(default_factory=list)

    def flops(self, roles: tuple[str, ...] = COUNTED_ROLES + EXCEPTED_ROLES, fp8: Optional[bool] = None) -> int:
        """FLOPs of the GEMMs with a role in ``roles`` (and ``fp8`` if given)."""
        return sum(g.flops for g in self.gemms if g.role in roles and (fp8 is None or g.fp8 == fp8))

    @property
    def fp8_flops(self) -> int:
        """FP8 FLOPs of the linear layers and experts."""
        return self.flops(COUNTED_ROLES, fp8=True)

    @property
    def counted_flops(self) -> int:
        """FLOPs of the linear layers and experts (heads, routers, other products excepted)."""
        return self.flops(COUNTED_ROLES)

    @property
    def share(self) -> float:
        """``fp8_flops / counted_flops`` (0.0 when there is none)."""
        return self.fp8_flops / self.counted_flops if self.counted_flops else 0.0

    @property
    def share_of_all(self) -> float:
        """FP8 FLOPs over every GEMM FLOP counted, excepted roles included."""
        total = self.flops()
        return self.flops(fp8=True) / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain figures for JSON: tokens, FLOPs by role, FP8 FLOPs, both shares."""
        return {
            "tokens": self.tokens,
            "share": self.share,
            "share_of_all": self.share_of_all,
            "fp8": self.fp8_flops,
            "counted": self.counted_flops,
            "by_role": {role: self.flops((role,)) for role in COUNTED_ROLES + EXCEPTED_ROLES},
            "fp8_by_role": {role: self.flops((role,), fp8=True) for role in COUNTED_ROLES + EXCEPTED_ROLES},
        }

    def __str__(self) -> str:
        by = {role: self.flops((role,)) for role in EXCEPTED_ROLES}
        return "\n".join([
            f"FP8 share of GEMM FLOPs: {self.share:.1%} ({self.fp8_flops:,} of {self.counted_flops:,} FLOPs of the "
            f"linear layers and experts in one forward of {self.tokens} tokens)",
            f"  excepted: heads {by['head']:,}, routers {by['router']:,}, attention scores and other products "
            f"{by['other']:,} FLOPs; FP8 share of all GEMM FLOPs {self.share_of_all:.1%}",
        ])


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # Q K^T and scores x V of torch's fused CPU attention kernel, which the flop counter does not
    # know (it counts the CUDA kernels and the math path's bmm): 2 FLOPs per multiply-add, dense
    # (a causal mask is not discounted, as the counter's own formula for the CUDA kernels).
    *batch, s_q, d_qk = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    rows = 1
    for b in batch:
        rows *= b
    return 2 * rows * s_q * s_k * (d_qk + d_v)


def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    cpu_sdpa = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return FlopCounterMode(display=False, custom_mapping={cpu_sdpa: _sdpa_flops} if cpu_sdpa is not None else None)


def _owners(model: nn.Module) -> list[tuple[str, nn.Module, str, Counter]]:
    heads, tied = output_embedding_ids(model), tied_weight_ids(model)
    routers = set()
    for module in model.modules():
        if any(is_experts_module(child) for child in module.children()):
            routers.update(id(c) for n, c in module.named_children() if n in ROUTER_NAMES)
    owners, prefixes = [], []
    for name, module in model.named_modules():
        if any(name.startswith(p) for p in prefixes):
            continue  # below an owner: its FLOPs are the owner's
        role, counter = next(((r, c) for m, c in _COUNTERS if (r := m(module)) is not None), (None, None))
        if id(module) in routers:
            role, counter = "router", counter or _linear_count
        if role is None:
            continue
        if role == "layer" and head_reason(name, module, heads, tied):
            role = "head"
        owners.append((name, module, role, counter))
        prefixes.append(f"{name}." if name else "")
    return owners


def _default_inputs(model: nn.Module, tokens: int, seed: int) -> dict[str, torch.Tensor]:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"measure_gemm_coverage: {type(model).__name__} has no config.vocab_size to draw token ids "
                         "from; valid: pass inputs={...} (one batch of the model's forward arguments)")
    for key in ("max_position_embeddings", "n_positions"):
        limit = getattr(text, key, None)
        if isinstance(limit, int) and 0 < limit < tokens:
            raise ValueError(f"measure_gemm_coverage: seq_len={tokens} exceeds the model's {key}={limit}; "
                             f"valid: 1 to {limit}")
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed)).to(device)
    inputs = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    return inputs


def measure_gemm_coverage(model: nn.Module, seq_len: int = 512, *, inputs: Optional[dict[str, Any]] = None,
                          seed: int = 0) -> GemmCoverage:
    """Measure which share of ``model``'s GEMM FLOPs runs in FP8 (module docstring: what counts).

    Args:
        model: a model, converted or not (unconverted: share 0).
        seq_len: tokens of the measured forward (batch 1); token ids drawn from the config's
            vocabulary with ``seed`` (the ids change MoE routing, not the routed-token count).
            Encoder-decoder models get ``seq_len`` decoder tokens too.
        inputs: keyword arguments of one forward instead (batch 1 for per-sequence figures);
            ``seq_len`` is then the length of their ``input_ids`` (or of their first tensor).

    Returns:
        A :class:`GemmCoverage`; ``print()`` it for the share and what it excepts.

    Raises:
        ValueError: ``seq_len`` is not a positive int or exceeds the model's maximum positions,
            or the model has no ``config.vocab_size`` and no ``inputs`` were given.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"measure_gemm_coverage: seq_len={seq_len!r} is not valid; valid: a positive int (tokens)")
    if inputs is None:
        inputs = _default_inputs(model, seq_len, seed)
    else:
        first = inputs.get("input_ids", next((v for v in inputs.values() if isinstance(v, torch.Tensor)), None))
        seq_len = int(first.shape[-1]) if isinstance(first, torch.Tensor) else seq_len
    owners = _owners(model)
    counter = _flop_counter()
    measured: dict[str, list] = {name: [0, 0, False] for name, *_ in owners}  # flops, inner measured, fp8
    starts: dict[str, list[int]] = {}
    handles = []

    def before(name: str):
        def hook(module, args):
            starts.setdefault(name, []).append(counter.get_total_flops())
        return hook

    def after(name: str, count: Counter):
        def hook(module, args, kwargs, output):
            inner = counter.get_total_flops() - starts[name].pop()
            reported = count(module, args, kwargs, output)
            entry = measured[name]
            entry[0] += inner if reported.flops is None else reported.flops
            entry[1] += inner
            entry[2] = entry[2] or reported.fp8
        return hook

    for name, module, role, count in owners:
        handles.append(module.register_forward_pre_hook(before(name)))
        handles.append(module.register_forward_hook(after(name, count), with_kwargs=True))
    training = model.training
    try:
        model.eval()
        with torch.no_grad(), autocast(enabled=False), counter:
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    coverage = GemmCoverage(tokens=seq_len)
    owned = 0
    for name, module, role, _ in owners:
        flops, inner, fp8 = measured[name]
        owned += inner
        if flops or fp8:
            coverage.gemms.append(GemmFlops(name, type(module).__name__, role, int(flops), bool(fp8)))
    coverage.gemms.append(GemmFlops("", "", "other", int(counter.get_total_flops() - owned), False))
    return coverage
