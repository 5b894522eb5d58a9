"""FP8 layers' step plans on a GPU (modules/linear_function.StepPlan): training with them is
training without them, bit for bit, on either GEMM kernel and at token counts that need padding
or not.

Runs where torch sees a CUDA GPU (the GPU run's contract step). On CPU,
tests/modules/test_step_plan.py trains with and without plans under Triton's interpreter and
checks the plans' launches on the meta proxy.
"""

import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin.modules.linear import FP8Linear
from fp8_plugin.numerics.kernels import force_gemm_kernel
from reference import count_fp8_gemms

CONTRACT_DEVICES = ("meta", "cuda")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(planned: bool, recipe, tokens):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256, bias=False)).cuda()
    fp.convert_model(model, recipe, skip_small=False)
    if not planned:
        for layer in model.modules():
            if isinstance(layer, FP8Linear):
                layer._step_info = lambda *args, **kwargs: None
    gen = torch.Generator(device="cuda").manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record = []
    with count_fp8_gemms() as gemms:
        for count in tokens:
            x = torch.randn(count, 256, device="cuda", generator=gen).requires_grad_()
            with torch.autocast("cuda", torch.bfloat16), fp.autocast():
                y = model(x)
            y.float().square().mean().backward()
            record.append((y.detach().clone(), x.grad.clone()))
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert gemms.count == 3 * 2 * len(tokens)
    return record, model.state_dict()


@pytest.mark.parametrize("kernel, recipe", [("torch", fp.DelayedScaling(amax_history_len=4)),
                                            ("triton", fp.Float8CurrentScaling()), ("torch", fp.Float8BlockScaling())],
                         ids=["torch-delayed", "triton-current", "blockwise"])
def test_training_with_plans_equals_training_without_bit_for_bit(recipe, kernel):
    # 128 and 64 tokens need no padding (torch._scaled_mm's route is kept), 72 does; under
    # 128-blockwise (sm90's block-scaled scaled_mm) 128 tokens take the kept route and 64 and 72
    # pad wgrad's K. Few steps of a small model: the contract step's time on the GPU run is capped.
    tokens = [128, 72, 64, 128]
    with force_gemm_kernel(kernel):
        (planned, planned_state), (looked_up, looked_up_state) = (_train(p, recipe, tokens) for p in (True, False))
    for (y, g), (y_ref, g_ref) in zip(planned, looked_up, strict=True):
        assert torch.equal(y, y_ref) and torch.equal(g, g_ref)
    torch.testing.assert_close(planned_state, looked_up_state, rtol=0, atol=0, equal_nan=True)
