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
  error it inherits from the layers before it. Each expert of a MoE experts module
  (:mod:`fp8_plugin.modules.experts`) is a layer of its own here, named with its index
  (``model.layers.3.mlp.experts[2]``, :mod:`.expert_layers`): its output over the tokens routed
  to it, each routed slot unweighted, the same routing in both; it falls back alone
  (``FP8ExpertsMixin.fp8_experts``), the module's other experts staying in FP8. An expert no
  token was routed to has no figure.
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
  (as autograd holds it anyway), and its FP8 wgrad until the weight's gradient is formed. Each
  MoE expert has them per projection (``...experts[2].gate_up_proj``, ``...experts[2].down_proj``),
  against a float32 recomputation of the expert on the same operands (:mod:`.expert_layers`); an
  expert GEMM's move moves its expert, which has no per-GEMM switch.

Under several processes every sum above is all-reduced (SUM) before the figures are formed:
they describe the replayed micro-batches of all ranks together and are identical on every rank,
so every rank takes the same decision.

Modules, one job each: :mod:`.config` (:class:`ReferenceCheck`), :mod:`.expert_layers` (the layers checked: FP8 linear layers
and each expert), :mod:`.result`
(:class:`ReferenceResult`, :func:`judge`, :class:`FP8ReferenceCheckError`), :mod:`.replay` (the
two replays and their comparison), :mod:`.figures` (layer and per-GEMM SQNR hooks),
:mod:`.localise` (candidates, verified fallback, escalation), :mod:`.policy` (what a check does;
:func:`reference_check`), :mod:`.checker` (:class:`ReferenceChecker`, for the loops). The names
below are the public ones, importable from here.
"""

from .checker import ReferenceChecker
from .config import METRIC_PREFIX, POLICIES, ReferenceCheck, resolve_reference_check
from .figures import gemm_sqnr_hooks, sqnr_db, sqnr_hook
from .localise import ESCALATION_STEPS
from .policy import apply_policy, reference_check
from .replay import ReferenceSide, capture_rng_state, compare, output_loss, reference_gemm_dtype
from .result import FP8ReferenceCheckError, ReferenceResult, judge
from ...numerics.recipes import GEMMS

__all__ = [
    "ReferenceCheck",
    "ReferenceResult",
    "ReferenceChecker",
    "FP8ReferenceCheckError",
    "POLICIES",
    "METRIC_PREFIX",
    "ESCALATION_STEPS",
    "reference_check",
    "resolve_reference_check",
    "apply_policy",
    "compare",
    "ReferenceSide",
    "judge",
    "reference_gemm_dtype",
    "output_loss",
    "capture_rng_state",
    "sqnr_hook",
    "gemm_sqnr_hooks",
    "sqnr_db",
    "GEMMS",
]
