"""Grouped FP8 GEMMs for mixture-of-experts layers: one GEMM per expert over its routed tokens.

Operands come grouped: the rows of the token-side operand are sorted by expert, and the groups
are given on the device as ``offsets``, int32 ``[G]``, the end row of each group (torch's
``offs`` convention for ``torch._grouped_mm``: group ``g`` holds rows ``offsets[g-1]`` to
``offsets[g]``, any count, zero included). Nothing here reads them on the host: the products
run without a host sync and trace whole under ``torch.compile(fullgraph=True)``. Each group has
its own float32 scale_inv (one scale per expert per role); the expert-side operand is a stack
``[G, N, K]`` with one scale_inv per expert. Three products serve a gated MLP's forward and
backward (Transformer Engine's names, ``GroupedLinear``):

- :func:`grouped_gemm` (fprop and dgrad): ``out[rows of g] = A_g @ B_g.T``, ``A`` ``[S, K]``,
  ``B`` ``[G, N, K]``, ``out`` ``[S, N]``;
- :func:`grouped_gemm_wgrad` (wgrad): ``out[g] = A_g.T @ B_g``, ``A`` ``[S, N]``, ``B``
  ``[S, K]``, ``out`` ``[G, N, K]``; an expert with no tokens gets zeros.

Paths, chosen like the dense GEMMs of :mod:`fp8_plugin.numerics.gemm`:

- native grouped kernels, on CUDA GPUs where torch builds them (sm90 and sm100, CUTLASS):

  - ``torch._scaled_grouped_mm`` for fprop and dgrad of E4M3 operands. Its rules, from torch's
    own checks (``torch/_meta_registrations.py``, ``_meta_grouped_mm_common``): both operands
    E4M3 (no E5M2), float32 row-wise scales (``scale_a`` ``[S]``, ``scale_b`` ``[G, N]``, so a
    per-expert scale is spread over its rows, exactly), int32 ``offs``, bfloat16 output only, K
    and N multiples of 16 bytes. No padding of the groups: the meta kernel asks nothing of the
    offsets, and the CUDA kernel's setup (``prepare_grouped_gemm_data`` in
    ``aten/src/ATen/native/cuda/GroupMMCommon.cuh``) checks 16-byte group sizes only along a
    dynamic K (the 2-D x 2-D form) or a dynamic dimension of a column-major operand; here the
    dynamic dimension is M, the rows of the row-major ``A``, whose group starts stay 16-byte
    aligned since K is a multiple of 16, and empty groups are allowed there.
  - ``torch._grouped_mm`` in bfloat16 on the FP8 values for the rest (dgrad of E5M2 gradients
    under HYBRID, and wgrad, the 2-D x 2-D form, given as ``A`` column-major and ``B``
    row-major, the one layout for which that setup checks neither 16-byte groups nor non-empty
    ones): every E4M3 and E5M2 value is a bfloat16 value, the kernel accumulates in float32 and
    writes bfloat16, as ``torch._scaled_grouped_mm`` does; the per-expert scales are applied
    to that output in float32.

  Whether they run on a device is decided once, by a probe of both that must match the
  emulation, as :mod:`~fp8_plugin.numerics.gemm` probes its block kernels.
- on a CPU whose FP8 GEMMs run as BF16 GEMMs (:func:`~fp8_plugin.numerics.gemm.emulates_in_bf16`:
  the process's :mod:`~fp8_plugin.numerics.cpu_emulation`, or ``force_path("emulated-bf16")``),
  the same bfloat16 ``torch._grouped_mm`` on the FP8 values, with its one more rounding;
- otherwise (CPU, other GPUs), the exact emulation: both operands dequantized to float32 (FP8
  value times its expert's scale_inv, as the dense emulation
  :func:`~fp8_plugin.numerics.gemm.fp8_gemm` does) and one float32 ``torch._grouped_mm`` with
  float32 accumulation, inside the custom operators ``fp8_plugin::grouped_mm_float32`` and
  ``fp8_plugin::grouped_mm_wgrad_float32``: torch's meta kernel of ``_grouped_mm`` takes
  bfloat16 only, so a float32 call cannot be traced; the custom operators give the compiler
  their shapes and run torch's kernel as they are. Where torch has no ``_grouped_mm`` for the
  device (torch < 2.9 on CPU), they run one float32 GEMM per group, reading the offsets on the
  host. On a GPU torch's float32 ``_grouped_mm`` is itself such a loop (``_grouped_mm_fallback``
  in ``aten/src/ATen/native/GroupedMMUtils.h`` copies ``offs`` to the host): the emulation on
  GPUs without the native kernels synchronises inside torch.

:func:`~fp8_plugin.numerics.gemm.force_path` pins the paths as it pins dense GEMMs.
``EXPERT_GEMMS`` counts the grouped FP8 GEMMs run, per kind (``"fprop"``, ``"dgrad"``,
``"wgrad"``), so that tests can tell FP8 experts from experts that silently ran in high
precision.
"""

from __future__ import annotations

import warnings
from collections import Counter
from functools import lru_cache

import torch

from .._private.compile_marks import assume_constant_result
from . import gemm as _gemm
from .decode import decode_fp8
from .device_kind import cuda_capability, device_kind
from .scaling import quantize

__all__ = ["grouped_gemm", "grouped_gemm_wgrad", "group_amax", "group_offsets", "quantize_groups",
           "native_grouped_gemm", "EXPERT_GEMMS"]

# Grouped FP8 GEMMs run, by kind: "fprop", "dgrad", "wgrad" (one per call, whatever the path).
EXPERT_GEMMS: Counter = Counter()
_NATIVE_MAJORS = (9, 10)
# Strides the grouped kernels take: multiples of 16 bytes (GroupedMMUtils.h, check_valid_strides).
_STRIDE_BYTES = 16


@torch.library.custom_op("fp8_plugin::count_expert_gemm", mutates_args=())
def _count_in_compiled_code(anchor: torch.Tensor, kind: str) -> None:
    # Runs when the compiled graph runs (each step), not when it is traced: a Python counter
    # bumped in traced code would be a graph constant (and a mutation autograd.Function's
    # tracing refuses). ``anchor`` (the GEMM's operand) orders it among the graph's ops.
    EXPERT_GEMMS[kind] += 1


@_count_in_compiled_code.register_fake
def _(anchor: torch.Tensor, kind: str) -> None:
    return None


# Kept by the compilers' dead-code elimination although it returns nothing.
torch.fx.node.has_side_effect(torch.ops.fp8_plugin.count_expert_gemm.default)


def _count(kind: str, anchor: torch.Tensor) -> None:
    if torch.compiler.is_compiling():
        torch.ops.fp8_plugin.count_expert_gemm(anchor, kind)
    else:
        EXPERT_GEMMS[kind] += 1


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


def group_offsets(group_of_row: torch.Tensor, groups: int) -> torch.Tensor:
    """The end row of each group, on the device: int32 ``[G]`` (torch's ``offs``).

    Args:
        group_of_row: int ``[S]``, non-decreasing, values in ``[0, groups)``.
        groups: G.

    Binary search of the sorted group ids (deterministic on every device, unlike ``bincount``
    on CUDA), no host read.
    """
    bounds = torch.arange(1, groups + 1, device=group_of_row.device, dtype=group_of_row.dtype)
    return torch.searchsorted(group_of_row, bounds, out_int32=True)


def _row_groups(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    # The group of each row, int64 [S], from the end rows: device-side.
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


def _pad_columns(x: torch.Tensor, multiple: int) -> torch.Tensor:
    # Zero columns up to a multiple (zeros add nothing to a product): the grouped kernels take
    # 16-byte strides only, and read the layout from the strides, size-1 dimensions included
    # (a "contiguous" [1, 1, N] may have strides (N, 1, 1)): row-major strides either way.
    pad = -x.shape[-1] % multiple
    if pad:
        return torch.nn.functional.pad(x, (0, pad))
    return x if x.stride() == _row_major_strides(x.shape) else x.new_empty(x.shape).copy_(x)


def _row_major_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _has_grouped_mm(device: torch.device) -> bool:
    # torch._grouped_mm exists from torch 2.8; its CPU kernel from 2.9.
    return hasattr(torch, "_grouped_mm") and not (device.type == "cpu" and _torch_before((2, 9)))


def _torch_before(version: tuple[int, int]) -> bool:
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) < version


@torch.library.custom_op("fp8_plugin::grouped_mm_float32", mutates_args=())
def _grouped_mm_float32(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # a [S, K], b [G, N, K] float32 -> [S, N], float32 accumulation.
    if a.shape[0] == 0:  # no rows routed at all: torch's stride checks refuse empty operands
        return a.new_zeros(0, b.shape[1])
    if _has_grouped_mm(a.device):
        align = _STRIDE_BYTES // 4
        return torch._grouped_mm(_pad_columns(a, align), _pad_columns(b, align).transpose(-2, -1), offs=offsets)
    out, start = a.new_zeros(a.shape[0], b.shape[1]), 0
    for g, end in enumerate(offsets.tolist()):  # torch without a grouped kernel: host offsets
        out[start:end] = a[start:end] @ b[g].t()
        start = end
    return out


@_grouped_mm_float32.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("fp8_plugin::grouped_mm_wgrad_float32", mutates_args=())
def _grouped_mm_wgrad_float32(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # a [S, N], b [S, K] float32 -> [G, N, K], contracting over each group's rows.
    groups = offsets.shape[0]
    if a.shape[0] == 0:  # no rows routed at all: torch's stride checks refuse empty operands
        return a.new_zeros(groups, a.shape[1], b.shape[1])
    if _has_grouped_mm(a.device):
        align = _STRIDE_BYTES // 4
        a_p, b_p = _pad_columns(a, align), _pad_columns(b, align)
        out = torch._grouped_mm(a_p.t(), b_p, offs=offsets)
        return out[:, :a.shape[1], :b.shape[1]].contiguous()
    out, start = a.new_zeros(groups, a.shape[1], b.shape[1]), 0
    for g, end in enumerate(offsets.tolist()):  # torch without a grouped kernel: host offsets
        out[g] = a[start:end].t() @ b[start:end]
        start = end
    return out


@_grouped_mm_wgrad_float32.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1])


def _dequantized_rows(x: torch.Tensor, scale_inv: torch.Tensor, group_of_row: torch.Tensor) -> torch.Tensor:
    # FP8 rows times their group's scale_inv, in float32 (QuantizedTensor.dequantize's product).
    return decode_fp8(x) * scale_inv[group_of_row].unsqueeze(1)


def _emulated(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(device_kind(a.device), enabled=False):
        a32 = _dequantized_rows(a, sa, _row_groups(offsets, a.shape[0]))
        b32 = decode_fp8(b) * sb.view(-1, 1, 1)
        return _grouped_mm_float32(a32, b32, offsets).to(out_dtype)


def _emulated_wgrad(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(device_kind(a.device), enabled=False):
        rows = _row_groups(offsets, a.shape[0])
        out = _grouped_mm_wgrad_float32(_dequantized_rows(a, sa, rows), _dequantized_rows(b, sb, rows), offsets)
        return out.to(out_dtype)


@lru_cache(maxsize=None)
def _native_support(device: torch.device, capability: tuple[int, int], probe: bool) -> tuple[bool, str]:
    # Once per device (and the capability it presents): the grouped kernels exist, the GPU is one
    # they are built for, and (unless force_path("native") skips it) probe GEMMs through them
    # match the emulation.
    if not hasattr(torch, "_scaled_grouped_mm") or not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_grouped_mm / torch._grouped_mm"
    major, minor = capability
    if major not in _NATIVE_MAJORS:
        return False, f"torch's grouped FP8 kernels are built for sm90 / sm100, not sm{major}{minor}"
    if not probe:
        return True, ""
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 37, 16]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    a = (torch.randn(sum(counts), 64, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    b = (torch.randn(len(counts), 32, 64, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    g = (torch.randn(sum(counts), 32, generator=gen) * 64).to(torch.float8_e5m2).to(device)
    sa = torch.exp2(torch.randint(-4, 5, (len(counts),), generator=gen).float()).to(device)
    sb = torch.exp2(torch.randint(-4, 5, (len(counts),), generator=gen).float()).to(device)
    try:
        with torch.autocast(device_kind(device), enabled=False):
            got = [_native(a, sa, b, sb, offsets, torch.float32), _bf16_grouped(g, sa, b.transpose(1, 2).contiguous(),
                                                                               sb, offsets, torch.float32),
                   _bf16_grouped_wgrad(g, sa, a, sb, offsets, torch.float32)]
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        return False, f"torch's grouped kernels refused the probe: {str(err).splitlines()[0]}"
    want = [_emulated(a, sa, b, sb, offsets, torch.float32),
            _emulated(g, sa, b.transpose(1, 2).contiguous(), sb, offsets, torch.float32),
            _emulated_wgrad(g, sa, a, sb, offsets, torch.float32)]
    for name, x, y in zip(("_scaled_grouped_mm", "_grouped_mm", "_grouped_mm (wgrad)"), got, want):
        error = (x - y).abs().max().item()
        if not error <= 1e-2 * y.abs().max().item():  # bfloat16 output rounding
            return False, f"torch.{name} disagreed with the emulation (max error {error:.3g})"
    return True, ""


def native_grouped_gemm(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """Whether :func:`grouped_gemm` of these FP8 operands (``a`` ``[S, K]``, ``b`` ``[G, N, K]``)
    takes the native grouped kernels, and if not, why (empty when it does). Decided from the
    device and its cached support (dtypes and shapes pick between the two native kernels);
    under ``force_path("native")`` without the probe."""
    forced = _gemm.forced_path()
    if forced in ("emulated", "emulated-bf16"):
        return False, "forced emulation"
    kind = device_kind(a.device)
    if kind != "cuda":
        return False, f"no grouped FP8 kernel on {kind}"
    return _native_decision(_gemm.normalize_device(a.device), forced != "native")


# A host-side decision, as a constant: under torch.compile it runs once while tracing (its probe
# cannot be traced) and the graph keeps the answer, as the dense GEMMs' decisions do.
@assume_constant_result
def _native_decision(device: torch.device, probe: bool) -> tuple[bool, str]:
    return _native_support(device, cuda_capability(device), probe)


_warned: set[str] = set()


@assume_constant_result
def _warn_emulated_once(reason: str) -> bool:
    # Once per reason, on GPUs only (on the CPU the emulation is the FP8 path).
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"FP8 expert GEMMs emulated in float32 ({reason}); numerics match, speed does not.",
                      stacklevel=4)
    return True


def _scaled_kernel_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch._scaled_grouped_mm: E4M3 both, K and N multiples of 16 bytes.
    return (a.dtype == b.dtype == torch.float8_e4m3fn) and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0


def _native(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
    # Row-wise scales from the per-expert ones (exact: the same float32 value on every row of a
    # group); the groups as they are (module docstring: no padding needed).
    G, N, _ = b.shape
    scale_a = sa[_row_groups(offsets, a.shape[0])].contiguous()
    scale_b = sb.unsqueeze(1).expand(G, N).contiguous()
    out = torch._scaled_grouped_mm(a, b.transpose(-2, -1), scale_a, scale_b, offs=offsets, out_dtype=torch.bfloat16)
    return out.to(out_dtype)


def _bf16_grouped(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    # The FP8 values as bfloat16 (exact), float32 accumulation, bfloat16 output; then each
    # row's product of its expert's scale_invs, in float32.
    if a.shape[0] == 0:  # no rows routed at all: torch's stride checks refuse empty operands
        return torch.zeros(0, b.shape[1], dtype=out_dtype, device=a.device)
    align = _STRIDE_BYTES // 2
    a16 = _pad_columns(decode_fp8(a, torch.bfloat16), align)
    b16 = _pad_columns(decode_fp8(b, torch.bfloat16), align)
    out = torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offsets)
    scale = (sa * sb)[_row_groups(offsets, a.shape[0])].unsqueeze(1)
    # Scaled in place: one float32 tensor of the output's size, not one per op.
    return out.to(torch.float32).mul_(scale).to(out_dtype)


def _bf16_grouped_wgrad(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    # A column-major [N, S] (a view of the row-major [S, N]) and B row-major [S, K]: the layout
    # for which the kernel takes any group size, empty groups included.
    if a.shape[0] == 0:  # no rows routed at all: torch's stride checks refuse empty operands
        return torch.zeros(offsets.shape[0], a.shape[1], b.shape[1], dtype=out_dtype, device=a.device)
    align = _STRIDE_BYTES // 2
    a16 = _pad_columns(decode_fp8(a, torch.bfloat16), align)
    b16 = _pad_columns(decode_fp8(b, torch.bfloat16), align)
    out = torch._grouped_mm(a16.t(), b16, offs=offsets)[:, :a.shape[1], :b.shape[1]]
    no_rows = (torch.diff(offsets, prepend=offsets.new_zeros(1)) <= 0).view(-1, 1, 1)
    # Scaled in place (one float32 [G, N, K] at a time: the experts' largest tensor), and zeros
    # for an expert without tokens, whatever the kernel leaves in an empty group's output.
    return out.to(torch.float32).mul_((sa * sb).view(-1, 1, 1)).masked_fill_(no_rows, 0.0).to(out_dtype)


def _check(name: str, ok: bool, detail: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {detail}")


def grouped_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                 offsets: torch.Tensor, out_dtype: torch.dtype, kind: str = "fprop") -> torch.Tensor:
    """``out[rows of g] = (a_g * a_scale_inv[g]) @ (b[g] * b_scale_inv[g]).T``, FP32 accumulation.

    Args:
        a: ``[S, K]`` FP8 (E4M3 or E5M2), rows sorted by group.
        a_scale_inv: float32 ``[G]``.
        b: ``[G, N, K]`` FP8, row-major per group (the "NT" layout of the dense GEMM).
        b_scale_inv: float32 ``[G]``.
        offsets: int32 ``[G]`` on ``a``'s device, the end row of each group (non-decreasing,
            the last one S; :func:`group_offsets`). Not read on the host.
        out_dtype: float32, bfloat16, float16 (or another float dtype, computed in float32 and cast).
        kind: what the product is, for ``EXPERT_GEMMS`` (``"fprop"`` or ``"dgrad"``).

    Returns:
        ``[S, N]`` in ``out_dtype``, a new tensor.

    Raises:
        ValueError: shapes or ``offsets`` that do not fit (checked from shapes and dtypes only).
    """
    _check("grouped_gemm", a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[2],
           f"a {list(a.shape)} and b {list(b.shape)} do not fit; valid: a [S, K], b [G, N, K]")
    _check("grouped_gemm", offsets.shape == (b.shape[0],) and offsets.dtype == torch.int32,
           f"offsets {offsets.dtype} {list(offsets.shape)} do not fit b {list(b.shape)}; valid: int32 [G]")
    _count(kind, a)
    native, reason = native_grouped_gemm(a, b)
    if native:
        with torch.autocast(device_kind(a.device), enabled=False):
            if _scaled_kernel_takes(a, b):
                return _native(a, a_scale_inv, b, b_scale_inv, offsets, out_dtype)
            return _bf16_grouped(a, a_scale_inv, b, b_scale_inv, offsets, out_dtype)
    if _cpu_bf16(a):
        with torch.autocast("cpu", enabled=False):
            return _bf16_grouped(a, a_scale_inv, b, b_scale_inv, offsets, out_dtype)
    if device_kind(a.device) == "cuda" and reason != "forced emulation":
        _warn_emulated_once(reason)
    return _emulated(a, a_scale_inv, b, b_scale_inv, offsets, out_dtype)


def grouped_gemm_wgrad(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                       offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[g] = (a_g * a_scale_inv[g]).T @ (b_g * b_scale_inv[g])``, FP32 accumulation: the
    weight gradient of each expert, contracting over its tokens (the 2-D x 2-D grouped form,
    groups along the token dimension).

    Args:
        a: ``[S, N]`` FP8 (grad_output), rows sorted by group.
        b: ``[S, K]`` FP8 (the input), rows sorted by group.
        a_scale_inv, b_scale_inv: float32 ``[G]``.
        offsets: int32 ``[G]``, as in :func:`grouped_gemm`.
        out_dtype: as in :func:`grouped_gemm`.

    Returns:
        ``[G, N, K]`` in ``out_dtype``; zeros for a group with no rows.

    Raises:
        ValueError: shapes or ``offsets`` that do not fit.
    """
    _check("grouped_gemm_wgrad", a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[0],
           f"a {list(a.shape)} and b {list(b.shape)} do not fit; valid: a [S, N], b [S, K]")
    _check("grouped_gemm_wgrad", offsets.dim() == 1 and offsets.dtype == torch.int32
           and a_scale_inv.shape == offsets.shape, f"offsets {offsets.dtype} {list(offsets.shape)} do not fit "
           f"a_scale_inv {list(a_scale_inv.shape)}; valid: int32 [G]")
    _count("wgrad", a)
    native, reason = native_grouped_gemm(a, b.unsqueeze(0))
    if native:
        with torch.autocast(device_kind(a.device), enabled=False):
            return _bf16_grouped_wgrad(a, a_scale_inv, b, b_scale_inv, offsets, out_dtype)
    if _cpu_bf16(a):
        with torch.autocast("cpu", enabled=False):
            return _bf16_grouped_wgrad(a, a_scale_inv, b, b_scale_inv, offsets, out_dtype)
    if device_kind(a.device) == "cuda" and reason != "forced emulation":
        _warn_emulated_once(reason)
    return _emulated_wgrad(a, a_scale_inv, b, b_scale_inv, offsets, out_dtype)


def _cpu_bf16(a: torch.Tensor) -> bool:
    # The CPU's BF16 emulation, as the dense GEMMs take it (gemm.emulates_in_bf16): the bfloat16
    # grouped kernel on the FP8 values, where torch has a CPU _grouped_mm (2.6x faster than its
    # float32 one at SmolLM2's expert shapes on a 2-core AMD EPYC with AVX512-BF16).
    return _gemm.emulates_in_bf16(a.device) and _has_grouped_mm(a.device)
