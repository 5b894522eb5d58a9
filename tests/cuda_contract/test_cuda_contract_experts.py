"""CUDA contract of the experts' grouped FP8 GEMMs (``fp8_plugin/numerics/grouped_gemm.py``).

The native grouped kernel, ``torch._scaled_grouped_mm``, is called here on meta tensors treated
as a Hopper or Blackwell GPU (the ``cuda`` fixture, conftest.py): torch's meta kernel checks its
CUDA rules (E4M3 operands, the first operand row-major and the second column-major, 16-byte
strides, float32 row-wise scales, int32 group offsets). The per-expert path, which GPUs without
the grouped kernel and HYBRID's E5M2 gradients take, runs each expert's GEMM on the dense
kernel. The experts module itself (``fp8_plugin/modules/experts.py``) is not run here: its
routing reads the tokens per expert on the host (a sync by design), which a meta tensor cannot
give.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fp8_plugin.numerics import grouped_gemm

META = torch.device("meta")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
COUNTS = [5, 0, 37, 16]  # tokens per expert: one with none, none a multiple of 16 but the last
G, N, K = len(COUNTS), 64, 128
S = sum(COUNTS)


def operands(dtype_a=E4M3):
    a = torch.empty(S, K, dtype=dtype_a, device=META)
    b = torch.empty(G, N, K, dtype=E4M3, device=META)
    return a, torch.empty(G, device=META), b, torch.empty(G, device=META)


@pytest.mark.parametrize("cuda", [pytest.param((9, 0), id="sm90"), pytest.param((10, 0), id="sm100")],
                         indirect=True)
def test_native_grouped_kernel_is_called_as_cuda_needs_it(cuda):
    a, sa, b, sb = operands()
    out = grouped_gemm._native(a, sa, b, sb, COUNTS, torch.bfloat16)
    assert out.shape == (S, N) and out.dtype == torch.bfloat16
    assert cuda.ops["aten._scaled_grouped_mm.default"] == 1
    (_, operand_list), = cuda.gemms
    (a_shape, a_stride, _), (b_shape, b_stride, _) = operand_list[:2]
    assert a_shape[0] % grouped_gemm.GROUP_ROW_MULTIPLE == 0 and a_stride[1] == 1  # padded groups, row-major
    assert b_shape == (G, K, N) and b_stride[-2] == 1  # column-major per expert
    cuda.clean()  # no host read: the group sizes are known on the host already


@pytest.mark.parametrize("cuda", [pytest.param((9, 0), id="sm90")], indirect=True)
def test_grouped_harness_refuses_a_row_major_expert_stack(cuda):
    a, sa, _, sb = operands()
    wrong = torch.empty(G, K, N, dtype=E4M3, device=META).transpose(-2, -1)  # [G, N, K], column-major
    with pytest.raises(RuntimeError, match="column major"):
        grouped_gemm._native(a, sa, wrong, sb, COUNTS, torch.bfloat16)


@pytest.mark.parametrize("cuda", [pytest.param((9, 0), id="sm90"), pytest.param((12, 0), id="sm120")],
                         indirect=True)
def test_per_expert_path_runs_each_experts_gemm_on_the_dense_kernel(cuda):
    # E5M2 gradients (HYBRID dgrad) never take the grouped kernel; wgrad is per expert always.
    a, sa, b, sb = operands(E5M2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = grouped_gemm.grouped_gemm(a, sa, b, sb, COUNTS, torch.bfloat16, kind="dgrad")
        grad = torch.empty(S, N, dtype=E5M2, device=META)
        x = torch.empty(S, K, dtype=E4M3, device=META)
        wgrad = grouped_gemm.grouped_gemm_wgrad(grad, sa, x, sb, COUNTS, torch.float32)
    assert out.shape == (S, N) and wgrad.shape == (G, N, K)
    experts_with_tokens = sum(1 for c in COUNTS if c)
    assert cuda.ops["aten._scaled_mm.default"] == 2 * experts_with_tokens and cuda.float32_mm == 0
    cuda.clean()
