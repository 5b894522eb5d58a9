"""A per-tensor-scaled FP8 GEMM in Triton, launched at a few microseconds of CPU.

``torch._scaled_mm`` runs cuBLASLt's FP8 GEMM, whose host side (descriptors, the heuristic query)
cost about 100 µs of CPU per call on the H100 host measured (docs/benchmarks.md), against a GPU
time of 28 to 31 µs for a 4096 x 2048 x 2048 layer's GEMMs: below some size, a layer's FP8 GEMMs
are host-bound. :func:`scaled_gemm` computes the same product as one Triton kernel launched
through its kept launcher (:class:`~fp8_plugin.numerics.kernels.launch.KernelLaunch`): the host
work is one output allocation and one launch. Whether it is faster on a given GPU and shape is
measured, not assumed: it runs where ``FP8_PLUGIN_GEMM_KERNEL=triton`` (or
:func:`~fp8_plugin.numerics.kernels.force_gemm_kernel`) asks, and ``benchmarks/host_profile.py``
and ``benchmarks/suite.py`` time both kernels.

Numerics (the contract of :func:`fp8_plugin.numerics.gemm.fp8_gemm`):

- ``out = (acc * (scale_a * scale_b) + bias)`` rounded once to ``out_dtype``, with ``acc`` the
  float32 accumulation of the exact FP8 products; ``bias`` as the epilogue takes it (rounded to
  a low-precision ``out_dtype`` first, :func:`~fp8_plugin.numerics.gemm_kernels.kernel_bias`).
- ``fast_accum=False`` (split accumulator): the tensor cores' partial sums are added to the
  float32 accumulator after every 32 products (``tl.dot``'s ``max_num_imprecise_acc=32``: one
  Hopper FP8 MMA instruction's K), as cuBLAS and CUTLASS promote them without fast accumulation;
  ``fast_accum=True`` keeps the whole K in the tensor cores' accumulator (Hopper's keeps about 14
  bits; the option only matters there).
- Any M, N, K (masked tiles, no padding) and any strides; operands E4M3 or E5M2 in any pairing.

Launched with ``enable_fp_fusion=False``, as the casts: the scale multiply and the bias add are
two roundings, as in the torch reference.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .fp8_bits import as_float32, raw_pointer
from .launch import KernelLaunch, LaunchSite

__all__ = ["scaled_gemm", "gemm_launch", "GemmLaunch", "block_sizes", "OUT_DTYPES"]

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUP_M = 8  # tiles of 8 row blocks share their B tiles in L2 (Triton's matmul tutorial)


@triton.jit
def _scaled_gemm_kernel(a, b, out, scale_a, scale_b, bias, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                        stride_om, stride_on,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr):
    # out [M, N] = a [M, K] @ b[N, K].T * scale_a * scale_b (+ bias [N]), one tile per program.
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Row offsets in int64: a [tokens, K] operand or output may hold more than 2^31 elements.
    a_tile = a + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_tile = b + rn[None, :].to(tl.int64) * stride_bn + rk[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - k * BLOCK_K
        x = tl.load(a_tile, mask=(rm[:, None] < M) & (rk[None, :] < left), other=0.0)
        y = tl.load(b_tile, mask=(rn[None, :] < N) & (rk[:, None] < left), other=0.0)
        if FAST_ACCUM:
            acc = tl.dot(x, y, acc)
        else:  # the tensor cores' partial sums promoted to float32 after every 32 products
            acc = tl.dot(x, y, acc, max_num_imprecise_acc=32)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk
    acc = acc * (tl.load(scale_a) * tl.load(scale_b))
    if HAS_BIAS:
        acc = acc + as_float32(tl.load(raw_pointer(bias) + rn, mask=rn < N, other=0))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offsets = rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on
    if out.dtype.element_ty == tl.bfloat16:
        tl.store(raw_pointer(out) + offsets, _bfloat16_bits(acc), mask=mask)
    else:
        tl.store(out + offsets, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _bfloat16_bits(x):
    # float32 to bfloat16 rounded to nearest even, as int16 bits: integer operations, which a GPU
    # and the interpreter (whose own conversion truncates) compute alike. NaN stays a quiet NaN;
    # a value that rounds past the largest bfloat16 becomes infinity, as the conversion does.
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


def block_sizes(m: int, n: int, k: int) -> tuple[int, int, int]:
    """The tile ``(BLOCK_M, BLOCK_N, BLOCK_K)`` for an ``[M, K] x [K, N]`` product: 128 x 128 x 128
    (Hopper's FP8 tensor-core shapes), halved along a dim too short to fill it, K at least 32 (the
    smallest FP8 ``tl.dot``)."""
    def fit(size: int, largest: int, smallest: int) -> int:
        return max(smallest, min(largest, triton.next_power_of_2(max(size, 1))))

    return fit(m, 128, 16), fit(n, 128, 16), fit(k, 128, 32)


@lru_cache(maxsize=None)
def _launch(block: tuple[int, int, int], has_bias: bool, fast_accum: bool) -> KernelLaunch:
    block_m, block_n, block_k = block
    return KernelLaunch(_scaled_gemm_kernel, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M,
                        HAS_BIAS=has_bias, FAST_ACCUM=fast_accum, enable_fp_fusion=False,
                        num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3)


def scaled_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, fast_accum: bool = False) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b).T + bias`` in one Triton launch (module docstring).

    Args:
        a: ``[M, K]`` FP8 (E4M3 or E5M2), any strides.
        b: ``[N, K]`` FP8, any strides (the "NT" operand of ``torch._scaled_mm``, untransposed).
        scale_a, scale_b: float32 0-dim ``scale_inv`` of each operand, on the device.
        out_dtype: float32, bfloat16 or float16.
        bias: ``[N]`` as the epilogue adds it (:func:`~fp8_plugin.numerics.gemm_kernels.kernel_bias`),
            or None.
        fast_accum: as ``torch._scaled_mm``'s ``use_fast_accum``.

    Returns:
        a new row-major ``[M, N]`` tensor in ``out_dtype``.

    Raises:
        ValueError: operands that do not multiply, or an ``out_dtype`` the kernel does not write.
    """
    return gemm_launch(a, b, out_dtype, bias is not None, fast_accum)(_Operand(a, scale_a), _Operand(b, scale_b), bias)


class _Operand(NamedTuple):
    # An FP8 operand as GemmLaunch reads it: the fields of a QuantizedTensor it uses.
    data: torch.Tensor
    scale_inv: torch.Tensor


class GemmLaunch:
    """:func:`scaled_gemm` for one pair of operand shapes, output dtype, bias presence and
    accumulation, resolved once (:func:`gemm_launch`): a call allocates the output and launches,
    nothing else. Called as ``launch(a, b, bias)``, ``a`` and ``b`` FP8 operands of the shapes it
    was made for (any strides) with their ``scale_inv`` (a
    :class:`~fp8_plugin.numerics.quantizers.QuantizedTensor`'s ``data`` and ``scale_inv``), with
    a bias exactly where it was made with one: ``fp8_gemm``'s route
    (:func:`~fp8_plugin.numerics.gemm.gemm_route`)."""

    __slots__ = ("launch", "grid", "m", "n", "k", "out_dtype")

    def __init__(self, launch: KernelLaunch, grid: tuple[int], m: int, n: int, k: int, out_dtype: torch.dtype) -> None:
        # A launch site: the operands' device, dtypes and strides are what may differ between calls.
        self.launch, self.grid = LaunchSite(launch, grid), grid
        self.m, self.n, self.k, self.out_dtype = m, n, k, out_dtype

    def __call__(self, a_operand: Any, b_operand: Any, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        a, b, scale_a, scale_b = a_operand.data, b_operand.data, a_operand.scale_inv, b_operand.scale_inv
        m, n = self.m, self.n
        out = torch.empty(m, n, dtype=self.out_dtype, device=a.device)
        bias = scale_a if bias is None else bias
        (sam, sak), (sbn, sbk) = a.stride(), b.stride()
        self.launch((a.get_device(), a.dtype, b.dtype, bias.dtype, sam, sak, sbn, sbk),
                    a.data_ptr() | b.data_ptr() | out.data_ptr() | scale_a.data_ptr() | scale_b.data_ptr() | bias.data_ptr(),
                    a, b, out, scale_a, scale_b, bias, m, n, self.k, sam, sak, sbn, sbk, n, 1)
        return out


# The launch of each GEMM shape seen (a few per layer: fprop, dgrad, wgrad; the last short batch).
_plans: dict[tuple, GemmLaunch] = {}


def gemm_launch(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, has_bias: bool,
                fast_accum: bool) -> GemmLaunch:
    """The :class:`GemmLaunch` of :func:`scaled_gemm` for operands of ``a``'s and ``b``'s shapes,
    checked and made once per shape (arguments as :func:`scaled_gemm`; ``has_bias``: a bias
    will be given).

    Raises:
        ValueError: as :func:`scaled_gemm`.
    """
    key = (a.shape, b.shape, out_dtype, has_bias, fast_accum)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_gemm: a {list(a.shape)} and b {list(b.shape)} do not multiply; valid: a [M, K], "
                         "b [N, K]")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"scaled_gemm: out_dtype {out_dtype} is not written by the kernel; valid: "
                         f"{', '.join(str(d) for d in OUT_DTYPES)}")
    (m, k), n = a.shape, b.shape[0]
    block = block_sizes(m, n, k)
    plan = GemmLaunch(_launch(block, has_bias, fast_accum), (triton.cdiv(m, block[0]) * triton.cdiv(n, block[1]),),
                      m, n, k, out_dtype)
    if len(_plans) >= 256:  # shapes that keep changing: keep the newest few
        _plans.clear()
    _plans[key] = plan
    return plan
