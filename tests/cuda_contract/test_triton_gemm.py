"""The Triton FP8 GEMM (numerics/kernels/scaled_gemm.py) on the CUDA path.

On meta tensors the kernel's launch is recorded and its output allocated as on a GPU. On a GPU
(``FP8_CONTRACT_DEVICE=cuda``, the GPU run's contract step) its products are checked against the
float64 product of the dequantized operands, within float32 accumulation's bound
(reference.scaled_gemm_error_bound) plus the tensor cores' own, as benchmarks/gpu_probe.py
bounds cuBLAS: Hopper's FP8 MMA keeps about 14 bits of its partial sums (DeepSeek-V3 technical
report, 3.3.2; truncation's unit roundoff 2^-13) over 32 products with split accumulation, over
the whole K with fast accumulation: gamma_c(2^-13) times the sum of |products|.
"""

import pytest
import torch

from fp8_plugin.numerics.kernels.launch import record_launches
from reference import assert_within_bound, scaled_gemm_error_bound

triton = pytest.importorskip("triton")
from fp8_plugin.numerics.kernels.scaled_gemm import scaled_gemm  # noqa: E402

CONTRACT_DEVICES = ("meta", "cuda")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("fast", [False, True], ids=["split", "fast"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype_a, dtype_b", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3xe4m3", "e5m2xe4m3"])
def test_the_triton_gemm_runs_on_the_device_within_its_accumulation_bound(cuda, dtype_a, dtype_b, out_dtype, fast):
    m, k, n = 200, 520, 136  # no dim a multiple of the 128 tile
    if not cuda.real:
        a = torch.empty(m, k, device=cuda.device, dtype=dtype_a)
        b = torch.empty(n, k, device=cuda.device, dtype=dtype_b)
        scale = torch.empty((), device=cuda.device)
        with record_launches() as launches:
            out = scaled_gemm(a, b, scale, scale, out_dtype, None, fast)
        assert launches == {"_scaled_gemm_kernel": 1}
        assert out.shape == (m, n) and out.dtype == out_dtype and out.device == cuda.device
        assert cuda.scaled_gemms() == 0  # no torch._scaled_mm
        return
    gen = torch.Generator(device=cuda.device).manual_seed(0)
    a = (torch.randn(m, k, device=cuda.device, generator=gen) * 6).to(dtype_a)
    b = (torch.randn(n, k, device=cuda.device, generator=gen) * 6).to(dtype_b)
    bias = (torch.randn(n, device=cuda.device, generator=gen) * 50).to(out_dtype)
    scale_a, scale_b = torch.tensor(0.37, device=cuda.device), torch.tensor(1.9, device=cuda.device)
    got = scaled_gemm(a, b, scale_a, scale_b, out_dtype, bias, fast).cpu()
    a, b, bias = a.cpu(), b.cpu(), bias.cpu()
    exact = (a.double() * 0.37) @ (b.double() * 1.9).t() + bias.double()
    bound = scaled_gemm_error_bound(a, scale_a.item(), b, scale_b.item(), out_dtype, bias)
    chunk, u = (k if fast else 32), 2.0**-13  # products summed in the tensor cores' accumulator
    magnitude = (a.double().abs() * 0.37) @ (b.double().abs() * 1.9).t()
    bound = bound + chunk * u / (1 - chunk * u) * magnitude
    assert_within_bound(got, exact, bound)
