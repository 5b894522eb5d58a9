"""The output of the project's autograd functions under ``torch.compile`` on torch 2.11.

torch 2.11's dynamo traces an ``autograd.Function``'s forward with side effects allowed, and so
returns every intermediate tensor of the forward as an extra output of the traced function,
aliases included (pytorch/pytorch#180642, fixed from 2.12 by pull request 180921, which filters
them). Where an intermediate is the very tensor the forward returns (an FX node other than the
output that yields the same tensor: ``out.to(out_dtype)`` when ``out`` already has that dtype,
an in-place ``out.add_(bias)`` last), autograd records that tensor's gradient edge once per
output, the last one wins, and the backward receives the real output's gradient in the extra
output's slot: zeros for grad_output, so every gradient of the layer is silently zero.

The FP8 GEMM paths end in such no-op casts on purpose (one expression for every output dtype:
the CPU emulation in float32, the native blockwise GEMM, a GEMM kept in high precision). Rather
than keep every path free of them forever, the functions hand autograd a tensor no other node
yields: a ``clone`` of the output, only while dynamo traces on an affected torch. Inductor
removes a clone whose input has the same layout (``aten.clone`` is one of its no-op
decompositions, torch/_inductor/fx_passes/post_grad.py), so compiled code pays nothing; the
``aot_eager`` backend pays one copy of the output.
"""

from __future__ import annotations

import torch

__all__ = ["ALIASED_INTERMEDIATES_RETURNED", "unaliased_output"]

# The releases whose dynamo returns a forward's aliased intermediates (2.11; 2.12 has the fix).
ALIASED_INTERMEDIATES_RETURNED = torch.__version__ < (2, 12)


def unaliased_output(out: torch.Tensor) -> torch.Tensor:
    """``out`` as an autograd function's forward returns it: a clone while ``torch.compile``
    traces on torch 2.11 (:data:`ALIASED_INTERMEDIATES_RETURNED`), else ``out`` itself.

    Args:
        out: the forward's output, any shape and dtype.

    Returns:
        A tensor equal to ``out``, of its shape, dtype and strides.
    """
    if ALIASED_INTERMEDIATES_RETURNED and torch.compiler.is_compiling():
        return out.clone()
    return out
