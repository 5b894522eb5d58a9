"""The GPU's ``grouped_mm`` of float32 and float16 operands, for ``meta`` tensors presented as a GPU.

transformers runs a mixture-of-experts block's experts with ``torch.nn.functional.grouped_mm``
(``transformers/integrations/moe.py``), the token rows ``[S, K]`` against the experts' weights
``[G, K, N]``, and casts the rows to the weights' dtype: float32 master weights under bf16-mixed
(``grouped_mm`` is not on autocast's lists) and under 32-true. A GPU runs that through torch's
composite fallback (per-group matrix products; pytorch/pytorch pull requests 161407 and 161717),
but the meta kernel of ``torch._grouped_mm`` takes BF16 operands only, so the memory tool could
not trace such a model on meta tensors.

:func:`grouped_mm_on_meta` gives those calls (2-D rows, 3-D weights, offsets; meta tensors not in
BF16) what the GPU's gives: an output ``[S, N]`` in the operands' dtype, the rows and weights saved
for backward (references, as autograd saves them), and gradients of their shapes and dtypes. No
value is computed: meta tensors hold none. Any other call runs as given.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["grouped_mm_on_meta"]

_NAMES = ("grouped_mm", "_grouped_mm")


@contextlib.contextmanager
def grouped_mm_on_meta() -> Iterator[None]:
    """Inside it, ``torch.nn.functional.grouped_mm`` and ``torch._grouped_mm`` of float32 or float16
    meta tensors (rows ``[S, K]``, weights ``[G, K, N]``, ``offs``) return what a GPU's would: a
    ``[S, N]`` output whose backward makes gradients of the operands' shapes (module docstring)."""
    with _GroupedMatmulOnMeta():
        yield


class _GroupedMatmulOnMeta(TorchFunctionMode):
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _NAMES and _fallback_call(args, kwargs):
            return _GroupedMatmul.apply(args[0], args[1])
        return func(*args, **kwargs)


def _fallback_call(args: tuple, kwargs: dict) -> bool:
    # Rows [S, K] and weights [G, K, N] on meta, not BF16 (which the meta kernel takes), with
    # offsets and without a bias or another output dtype.
    if len(args) != 2 or set(kwargs) - {"offs", "bias", "out_dtype"} or kwargs.get("offs") is None:
        return False
    if kwargs.get("bias") is not None or kwargs.get("out_dtype") not in (None, args[0].dtype):
        return False
    rows, weights = args
    return (isinstance(rows, torch.Tensor) and isinstance(weights, torch.Tensor) and rows.device.type == "meta"
            and rows.dim() == 2 and weights.dim() == 3 and rows.dtype == weights.dtype
            and rows.dtype in (torch.float32, torch.float16) and rows.shape[1] == weights.shape[1])


class _GroupedMatmul(torch.autograd.Function):
    # The fallback's tensors, without values: out [S, N]; saved: rows and weights; grads of both.
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weights)
        return rows.new_empty(rows.shape[0], weights.shape[2])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        rows, weights = ctx.saved_tensors
        need_rows, need_weights = ctx.needs_input_grad
        return (torch.empty_like(rows) if need_rows else None, torch.empty_like(weights) if need_weights else None)
