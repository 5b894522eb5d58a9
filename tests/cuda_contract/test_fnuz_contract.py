"""The GEMM path of an AMD MI300 (issue 35) on meta tensors: a ROCm gfx942, which torch presents
as a CUDA device of compute capability (9, 4), runs per-tensor FP8 GEMMs with FNUZ operands.

The device is presented twice over: ``meta_as_cuda((9, 4))`` (the ``cuda`` fixture) for the
GEMM path and its kernel rules, ``present_rocm("gfx942")`` for the format family. The fused
cast kernels encode the OCP formats, so the casts run as torch ops.
"""

from __future__ import annotations

import pytest
import torch

import fp8_plugin as fp
from fp8_plugin.numerics.device_kind import present_rocm

E4M3FNUZ, E5M2FNUZ = torch.float8_e4m3fnuz, torch.float8_e5m2fnuz


@pytest.mark.parametrize("cuda", [pytest.param((9, 4), id="gfx942")], indirect=True)
@pytest.mark.parametrize("recipe", [fp.DelayedScaling(), fp.Float8CurrentScaling()], ids=["delayed", "current"])
def test_an_fp8_linear_step_on_an_mi300_multiplies_fnuz_operands_without_a_host_read(cuda, recipe):
    with present_rocm("gfx942"):
        layer = fp.FP8Linear(256, 384, bias=False, device=cuda.device, dtype=torch.bfloat16)
        x = torch.empty(512, 256, device=cuda.device, dtype=torch.bfloat16).normal_().requires_grad_()
        grad = torch.empty(512, 384, device=cuda.device, dtype=torch.bfloat16).normal_()
        cuda.reset()
        with fp.autocast(recipe=recipe):
            y = layer(x)
        y.backward(grad)
    operand_dtypes = [tuple(t[2] for t in operands[:2]) for _, operands in cuda.gemms]
    # fprop E4M3FNUZ x E4M3FNUZ; dgrad and wgrad E5M2FNUZ x E4M3FNUZ.
    assert operand_dtypes == [(E4M3FNUZ, E4M3FNUZ), (E5M2FNUZ, E4M3FNUZ), (E5M2FNUZ, E4M3FNUZ)]
    assert not any(name.startswith("fp8_plugin.cast_") for name in cuda.ops)  # torch ops, not the kernels
    cuda.clean()
