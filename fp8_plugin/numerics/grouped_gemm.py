"""Grouped FP8 GEMMs for mixture-of-experts layers: one GEMM per expert over its routed tokens.

Operands come grouped: the rows of the token-side operand are sorted by expert, ``counts[g]``
rows for expert ``g`` (any count, zero included), each group with its own float32 scale_inv
(one scale per expert per role); the expert-side operand is a stack ``[G, N, K]`` with one
scale_inv per expert. Three products serve a gated MLP's forward and backward (Transformer
Engine's names, ``GroupedLinear``):

- :func:`grouped_gemm` (fprop and dgrad): ``out[rows of g] = A_g @ B_g.T``, ``A`` ``[S, K]``,
  ``B`` ``[G, N, K]``, ``out`` ``[S, N]``;
- :func:`grouped_gemm_wgrad` (wgrad): ``out[g] = A_g.T @ B_g``, ``A`` ``[S, N]``, ``B``
  ``[S, K]``, ``out`` ``[G, N, K]``; an expert with no tokens gets zeros.

Paths, chosen like the dense GEMMs of :mod:`fp8_plugin.numerics.gemm`:

- native grouped kernel: ``torch._scaled_grouped_mm`` on CUDA GPUs where torch has it. Its
  rules, from torch's own checks (``torch/_meta_registrations.py``,
  ``_meta_grouped_mm_common``): both operands E4M3 (no E5M2: HYBRID's gradients never take it),
  float32 row-wise scales (``scale_a`` ``[S]``, ``scale_b`` ``[G, N]``, so a per-expert scale is
  spread over its rows), bfloat16 output only, K and N multiples of 16 bytes; the kernel is
  built for sm90 and sm100 (CUTLASS grouped GEMM). Groups are padded with zero rows to
  multiples of 16 (as torchao pads its MoE groups), exactly. Whether the kernel runs on a
  device is decided once, by a probe GEMM that must match the emulation, as
  :mod:`~fp8_plugin.numerics.gemm` probes its block kernels.
- otherwise, one :func:`~fp8_plugin.numerics.gemm.fp8_gemm` per expert with tokens: the dense
  GEMM's own path choice (``torch._scaled_mm`` with padding to its alignment on FP8 GPUs; on
  CPU the timed choice between ``torch._scaled_mm`` and the exact float32 emulation) and its
  one-time warning when a GEMM has to be emulated.

Both paths compute each expert's product of the dequantized operands with float32
accumulation; :func:`~fp8_plugin.numerics.gemm.force_path` pins them as it pins dense GEMMs.
``EXPERT_GEMMS`` counts the grouped FP8 GEMMs run, per kind (``"fprop"``, ``"dgrad"``,
``"wgrad"``), so that tests can tell FP8 experts from experts that silently ran in high
precision.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from functools import lru_cache
from typing import Optional, Sequence

import torch

from . import gemm as _gemm
from .device_kind import cuda_capability, device_kind
from .quantizers import QuantizedTensor
from .scaling import quantize

__all__ = ["grouped_gemm", "grouped_gemm_wgrad", "group_amax", "quantize_groups", "native_grouped_gemm",
           "EXPERT_GEMMS", "GROUP_ROW_MULTIPLE"]

# Grouped FP8 GEMMs run, by kind: "fprop", "dgrad", "wgrad" (one per call, whatever the path).
EXPERT_GEMMS: Counter = Counter()
# Rows per group the native grouped kernel is given (zero rows pad each group).
GROUP_ROW_MULTIPLE = 16
_NATIVE_MAJORS = (9, 10)


def group_amax(x: torch.Tensor, group_of_row: torch.Tensor, groups: int) -> torch.Tensor:
    """Absolute maximum of each group's rows.

    Args:
        x: ``[S, K]``, any floating dtype.
        group_of_row: int64 ``[S]``, the group of each row (in ``[0, groups)``).
        groups: G.

    Returns:
        float32 ``[G]``; 0 for a group with no rows; NaN where a group holds a NaN.
    """
    out = torch.zeros(groups, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out
    rows = x.detach().abs().amax(dim=1).to(torch.float32)
    return out.scatter_reduce(0, group_of_row, rows, "amax", include_self=True)


def quantize_groups(x: torch.Tensor, scale: torch.Tensor, group_of_row: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Saturating FP8 cast of each row of ``x`` ``[S, K]`` with its group's ``scale`` (float32
    ``[G]``), as :func:`fp8_plugin.numerics.scaling.quantize` casts a tensor with one scale."""
    return quantize(x, scale[group_of_row].unsqueeze(1), dtype)


def _offsets(counts: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for c in counts:
        starts.append(total)
        total += c
    return starts


@lru_cache(maxsize=None)
def _native_support(device: torch.device, probe: bool) -> tuple[bool, str]:
    # Once per device: the grouped kernel exists, the GPU is one it is built for, and (unless
    # force_path("native") skips it) a probe GEMM through it matches the per-expert path.
    kind = device_kind(device)
    if kind != "cuda":
        return False, f"no grouped FP8 kernel on {kind}"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    major, minor = cuda_capability(device)
    if major not in _NATIVE_MAJORS:
        return False, f"torch._scaled_grouped_mm is built for sm90 / sm100, not sm{major}{minor}"
    if not probe:
        return True, ""
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 37, 16]
    a = (torch.randn(sum(counts), 64, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    b = (torch.randn(len(counts), 32, 64, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    sa = torch.exp2(torch.randint(-4, 5, (len(counts),), generator=gen).float()).to(device)
    sb = torch.exp2(torch.randint(-4, 5, (len(counts),), generator=gen).float()).to(device)
    try:
        with torch.autocast(kind, enabled=False):
            got = _native(a, sa, b, sb, counts, torch.float32).float()
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        return False, f"torch._scaled_grouped_mm refused the probe: {str(err).splitlines()[0]}"
    want = _per_expert(a, sa, b, sb, counts, torch.float32, forced="emulated")
    error = (got - want).abs().max().item()
    if not error <= 1e-2 * want.abs().max().item():  # bfloat16 output rounding
        return False, f"torch._scaled_grouped_mm disagreed with the emulation (max error {error:.3g})"
    return True, ""


def native_grouped_gemm(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """Whether :func:`grouped_gemm` of these FP8 operands (``a`` ``[S, K]``, ``b`` ``[G, N, K]``)
    takes the native grouped kernel, and if not, why (empty when it does). Decided from dtypes,
    shapes and the device's cached support; under ``force_path("native")`` without the probe."""
    if _gemm._forced == "emulated":
        return False, "forced emulation"
    native, reason = _native_support(_gemm.normalize_device(a.device), _gemm._forced != "native")
    if not native:
        return False, reason
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return False, "torch._scaled_grouped_mm takes E4M3 operands only"
    if a.shape[1] % 16 or b.shape[1] % 16:
        return False, "K and N must be multiples of 16 for torch._scaled_grouped_mm"
    return True, ""


def _native(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, counts: Sequence[int],
            out_dtype: torch.dtype) -> torch.Tensor:
    # Each group padded to GROUP_ROW_MULTIPLE rows of zeros; row-wise scales from the per-expert
    # ones (exact: the same float32 value on every row of a group).
    G, N, K = b.shape
    padded = [-(-c // GROUP_ROW_MULTIPLE) * GROUP_ROW_MULTIPLE for c in counts]
    pstarts = _offsets(padded)
    rows = torch.cat([torch.arange(p, p + c, device=a.device) for p, c in zip(pstarts, counts)]) if a.shape[0] else \
        torch.zeros(0, dtype=torch.int64, device=a.device)
    # Through uint8 views: indexing kernels do not all take FP8 dtypes; zero bytes are FP8 zeros.
    a_p = torch.zeros(sum(padded), K, dtype=torch.uint8, device=a.device)
    a_p[rows] = a.view(torch.uint8)
    a_p = a_p.view(a.dtype)
    # output_size: known on the host; without it torch reads the repeats back (a host sync).
    group_of_padded = torch.repeat_interleave(torch.arange(G, device=a.device),
                                              torch.tensor(padded, device=a.device), output_size=sum(padded))
    scale_a = sa[group_of_padded].contiguous()
    scale_b = sb.unsqueeze(1).expand(G, N).contiguous()
    offs = torch.tensor(padded, device=a.device).cumsum(0).to(torch.int32)
    out = torch._scaled_grouped_mm(a_p, b.transpose(-2, -1), scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
    return out[rows].to(out_dtype)


def _per_expert(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, counts: Sequence[int],
                out_dtype: torch.dtype, forced: Optional[str] = None) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    context = _gemm.force_path(forced) if forced else contextlib.nullcontext()
    with context:
        for g, (start, count) in enumerate(zip(_offsets(counts), counts)):
            if count:
                out[start:start + count] = _gemm.fp8_gemm(
                    QuantizedTensor(a[start:start + count], sa[g]), QuantizedTensor(b[g], sb[g]), out_dtype)
    return out


def grouped_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                 counts: Sequence[int], out_dtype: torch.dtype, kind: str = "fprop") -> torch.Tensor:
    """``out[rows of g] = (a_g * a_scale_inv[g]) @ (b[g] * b_scale_inv[g]).T``, FP32 accumulation.

    Args:
        a: ``[S, K]`` FP8 (E4M3 or E5M2), rows sorted by group, ``counts[g]`` rows for group g.
        a_scale_inv: float32 ``[G]``.
        b: ``[G, N, K]`` FP8, row-major per group (the "NT" layout of the dense GEMM).
        b_scale_inv: float32 ``[G]``.
        counts: G non-negative ints (host-side) summing to S.
        out_dtype: float32, bfloat16, float16 (or another float dtype, computed in float32 and cast).
        kind: what the product is, for ``EXPERT_GEMMS`` (``"fprop"`` or ``"dgrad"``).

    Returns:
        ``[S, N]`` in ``out_dtype``, a new tensor.

    Raises:
        ValueError: ``counts`` does not match ``a`` and ``b``.
    """
    if len(counts) != b.shape[0] or sum(counts) != a.shape[0] or a.shape[1] != b.shape[2]:
        raise ValueError(f"grouped_gemm: counts {list(counts)} (sum {sum(counts)}) do not fit a {list(a.shape)} "
                         f"and b {list(b.shape)}; valid: len(counts) = b.shape[0], sum(counts) = a.shape[0], "
                         "a.shape[1] = b.shape[2]")
    EXPERT_GEMMS[kind] += 1
    native, _ = native_grouped_gemm(a, b)
    if native:
        with torch.autocast(device_kind(a.device), enabled=False):
            return _native(a, a_scale_inv, b, b_scale_inv, counts, out_dtype)
    return _per_expert(a, a_scale_inv, b, b_scale_inv, counts, out_dtype)


def grouped_gemm_wgrad(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                       counts: Sequence[int], out_dtype: torch.dtype) -> torch.Tensor:
    """``out[g] = (a_g * a_scale_inv[g]).T @ (b_g * b_scale_inv[g])``, FP32 accumulation: the
    weight gradient of each expert, contracting over its tokens.

    Args:
        a: ``[S, N]`` FP8 (grad_output), rows sorted by group.
        b: ``[S, K]`` FP8 (the input), rows sorted by group.
        a_scale_inv, b_scale_inv: float32 ``[G]``.
        counts: G non-negative ints summing to S.
        out_dtype: as in :func:`grouped_gemm`.

    Returns:
        ``[G, N, K]`` in ``out_dtype``; zeros for a group with no rows.

    One :func:`~fp8_plugin.numerics.gemm.fp8_gemm` per expert with tokens, on each operand's
    transposed copy (1 byte per value), so that the token dimension is the contraction (K) of
    the dense GEMM and is padded to its alignment there.
    """
    if sum(counts) != a.shape[0] or a.shape[0] != b.shape[0]:
        raise ValueError(f"grouped_gemm_wgrad: counts {list(counts)} (sum {sum(counts)}) do not fit a "
                         f"{list(a.shape)} and b {list(b.shape)}; valid: sum(counts) = a.shape[0] = b.shape[0]")
    EXPERT_GEMMS["wgrad"] += 1
    out = torch.zeros(len(counts), a.shape[1], b.shape[1], dtype=out_dtype, device=a.device)
    for g, (start, count) in enumerate(zip(_offsets(counts), counts)):
        if count:
            rows = slice(start, start + count)
            out[g] = _gemm.fp8_gemm(QuantizedTensor(a[rows].t().contiguous(), a_scale_inv[g]),
                                    QuantizedTensor(b[rows].t().contiguous(), b_scale_inv[g]), out_dtype)
    return out
