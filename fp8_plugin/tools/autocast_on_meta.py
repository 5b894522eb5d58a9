"""CUDA autocast's dtype policy, and the GPU's attention kernel, for ``meta`` tensors presented as a GPU.

``torch.autocast("cuda")`` acts only on tensors with CUDA's dispatch keys: on the meta tensors
:func:`~fp8_plugin.numerics.device_kind.meta_as_cuda` presents as a GPU (and on a machine without
CUDA at all) it does nothing. The memory tool (:mod:`fp8_plugin.tools.memory`) traces a training
step on such tensors, and what a step holds depends on autocast's casts: which tensors are saved
for backward in BF16 and which in float32, the weights' BF16 copies it caches for the forward.
:func:`cuda_autocast_on_meta` applies the same policy at the torch-function level, above
autograd, so that autograd saves what it saves on a GPU:

- the ops of CUDA autocast's lower-precision list (GEMMs, convolutions, attention) cast their
  floating inputs (float64 excepted) to the autocast dtype;
- the ops of its float32 list (norms, softmax, losses, ``exp``, ``pow``, ``sum``...) cast BF16 /
  FP16 inputs to float32;
- the "promote" ops run in the widest floating dtype of their inputs;
- any other op runs in its inputs' dtypes, as under autocast;
- a leaf tensor that requires grad (a weight) is cast once per region and the copy kept until the
  region ends (autocast's cast cache).

The lists are those of torch's AMP documentation ("CUDA Op-Specific Behavior",
https://docs.pytorch.org/docs/stable/amp.html) and ``aten/src/ATen/autocast_mode.cpp``.
``torch.is_autocast_enabled("cuda")`` answers True inside, so that the FP8 layers pick the
autocast dtype as they do on a GPU; a nested ``torch.autocast("cuda", enabled=False)`` turns the
policy off as it would on a GPU.

``torch.nn.functional.scaled_dot_product_attention`` on meta tensors runs torch's math path,
which materialises the (S x S) score matrix a GPU never holds. Here it runs the kernel CUDA's
backend choice takes (``sdp_utils.cpp``: flash attention first, then memory-efficient, then
math): flash attention for BF16 / FP16 inputs without a mask on sm80 and later, head dimension a
multiple of 8 up to 256 (grouped-query attention included, as the flash kernel reads K and V
with fewer heads); memory-efficient attention with a mask and the same heads; else the math path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ..numerics.device_kind import cuda_capability

__all__ = ["cuda_autocast_on_meta", "LOWER_PRECISION_OPS", "FLOAT32_OPS", "PROMOTE_OPS"]

# CUDA autocast's lists, by the name of the torch function (``torch.mm``, ``Tensor.mm`` and
# ``F.linear`` all answer to their name).
LOWER_PRECISION_OPS = frozenset({
    "__matmul__", "__rmatmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul",
    "multi_dot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "linear", "matmul", "mm", "mv", "prelu", "scaled_dot_product_attention",
})
FLOAT32_OPS = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
    "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist",
    "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log",
    "log_softmax", "log10", "log1p", "log2", "logsumexp", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss",
    "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin",
    "softplus", "sum", "renorm", "tan", "triplet_margin_loss", "huber_loss",
})
PROMOTE_OPS = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
                         "scatter_add", "tensordot"})

_LOW = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def cuda_autocast_on_meta(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """CUDA autocast in ``dtype`` for the meta tensors :func:`meta_as_cuda` presents as a GPU.

    Enter it inside :func:`~fp8_plugin.numerics.device_kind.meta_as_cuda`, around the forward
    (as a loop enters ``torch.autocast``). Tensors on other devices are left alone.

    Args:
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Raises:
        ValueError: ``dtype`` is neither.
    """
    if dtype not in _LOW:
        raise ValueError(f"cuda_autocast_on_meta(dtype={dtype}) is not an autocast dtype; valid: "
                         "torch.bfloat16, torch.float16")
    enabled, previous_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    policy = _AutocastPolicy(dtype)
    try:
        with policy:
            yield
    finally:
        policy.cache.clear()  # as autocast empties its cast cache when its region ends
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous_dtype)


class _AutocastPolicy(TorchFunctionMode):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, copy)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cuda"):  # a nested torch.autocast(enabled=False)
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in LOWER_PRECISION_OPS:
            args, kwargs = self._cast(args, kwargs, lambda t: t.dtype != torch.float64, self.dtype)
            if name == "scaled_dot_product_attention":
                return _attention(func, *args, **kwargs)
        elif name in FLOAT32_OPS:
            args, kwargs = self._cast(args, kwargs, lambda t: t.dtype in _LOW, torch.float32)
        elif name in PROMOTE_OPS:
            dtypes = [t.dtype for t in _meta_tensors(args, kwargs) if t.is_floating_point()]
            if len(set(dtypes)) > 1:
                widest = max(dtypes, key=lambda d: torch.finfo(d).bits)
                args, kwargs = self._cast(args, kwargs, lambda t: True, widest)
        return func(*args, **kwargs)

    def _cast(self, args: tuple, kwargs: dict, eligible: Callable[[torch.Tensor], bool],
              dtype: torch.dtype) -> tuple[tuple, dict]:
        def cast(value: Any) -> Any:
            if isinstance(value, (list, tuple)):
                return type(value)(cast(v) for v in value)
            if (not isinstance(value, torch.Tensor) or value.device.type != "meta" or not value.is_floating_point()
                    or value.dtype == dtype or not eligible(value)):
                return value
            if value.is_leaf and value.requires_grad:  # autocast's cast cache: a weight cast once per region
                kept = self.cache.get(id(value))
                if kept is None or kept[0] is not value or kept[1].dtype != dtype:
                    kept = (value, value.to(dtype))
                    self.cache[id(value)] = kept
                return kept[1]
            return value.to(dtype)

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _meta_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    values = [*args, *kwargs.values()]
    return [v for v in values if isinstance(v, torch.Tensor) and v.device.type == "meta"]


def _attention(func: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
               enable_gqa: bool = False) -> torch.Tensor:
    # The kernel CUDA's SDPA would pick (module docstring); a call it cannot serve runs as given.
    head_dim = query.shape[-1]
    fused = (query.device.type == "meta" and cuda_capability(query.device) >= (8, 0) and query.dim() == 4
             and query.dtype in _LOW and key.dtype == query.dtype and value.dtype == query.dtype
             and head_dim % 8 == 0 and head_dim <= 256 and value.shape[-1] == head_dim)
    if fused and attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                   False, scale=scale)[0]
    if fused and query.shape[-3] == key.shape[-3] and not (is_causal and attn_mask is not None):
        mask = attn_mask
        if mask is not None and mask.dtype == torch.bool:  # the kernel takes an additive bias
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device)
        if mask is not None:
            mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, True, dropout_p, is_causal, scale=scale)[0]
    return func(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)
