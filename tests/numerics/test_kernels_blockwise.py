"""The fused block-scaled cast kernel (fp8_plugin/numerics/kernels/blockwise.py) under Triton's
interpreter, against the torch ops of BlockQuantizer byte for byte.

MXFP8 (1x32 blocks, E8M0 scales, OCP MX v1.0) and 128-blockwise (1x128 and 128x128 blocks, with
and without power-of-two scales and an amax epsilon) on every BF16 bit pattern (65,536: zeros,
subnormals, infinities, NaNs, the extremes), float16 and float32 samples over their whole range,
shapes that are not multiples of the block, and transposed and strided inputs: both FP8 copies,
both scale_inv tensors and the amax the scaling state records.
"""

import copy
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the kernels under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py without a GPU)",
                allow_module_level=True)

import fp8_plugin as fp  # noqa: E402
from fp8_plugin.numerics.kernels import blockwise, force_kernels  # noqa: E402
from fp8_plugin.numerics.kernels.blockwise import cast_blocks, reference_blocks  # noqa: E402
from fp8_plugin.numerics.quantizers import ScalingState  # noqa: E402
from fp8_plugin.numerics.scale_layouts import mx_gemm_scale  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value", "ignore:overflow", "ignore:divide by zero")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KINDS = {  # block, mx, power_2_scale, amax_epsilon
    "mxfp8": ((1, 32), True, False, 0.0),
    "1x128": ((1, 128), False, False, 0.0),
    "1x128-pow2": ((1, 128), False, True, 0.0),
    "128x128": ((128, 128), False, False, 0.0),
    "128x128-pow2-eps": ((128, 128), False, True, 1e-3),
}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in (E4M3, E5M2):
        return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def check(x: torch.Tensor, dtype: torch.dtype, kind: str) -> None:
    block, mx, power_2, eps = KINDS[kind]
    state = ScalingState(4)
    state.amax_history[0, 0] = 0.25
    data, scale_inv, data_t, scale_inv_t, gemm, gemm_t = cast_blocks(
        x, dtype, block, mx=mx, power_2_scale=power_2, amax_epsilon=eps, transpose=True, record=True, role=0,
        scale=state.scale, amax_history=state.amax_history, nonfinite_amax_count=state.nonfinite_amax_count,
        workspace=state.kernel_workspace)
    want, want_inv, amax = reference_blocks(x, dtype, block, mx=mx, power_2_scale=power_2, amax_epsilon=eps)
    want_t, want_inv_t, _ = reference_blocks(x.t(), dtype, block, mx=mx, power_2_scale=power_2, amax_epsilon=eps)
    assert same(scale_inv, want_inv) and same(scale_inv_t, want_inv_t)
    assert same(data, want) and same(data_t, want_t)
    if block[0] == 1:  # 1xB grids in the blockwise GEMM's layout: column-major, so its conversion is a view
        assert scale_inv.stride() == (1, scale_inv.shape[0]) and scale_inv_t.stride() == (1, scale_inv_t.shape[0])
    if mx:  # the E8M0 bytes in the GEMM's swizzled layout, as scale_layouts makes them from scale_inv
        assert torch.equal(gemm.view(torch.uint8), mx_gemm_scale(want_inv).view(torch.uint8))
        assert torch.equal(gemm_t.view(torch.uint8), mx_gemm_scale(want_inv_t).view(torch.uint8))
    else:
        assert gemm is None and gemm_t is None
    # The statistics the torch ops record: observe_current(max of the block amaxes, scale 1).
    tensor_amax = amax.amax() if amax.numel() else torch.zeros(())
    finite = bool(torch.isfinite(tensor_amax))
    assert state.nonfinite_amax_count.tolist() == [0 if finite else 1, 0, 0]
    assert state.amax_history[0, 0].item() == (tensor_amax.item() if finite else 0.25)
    assert state.scale[0].item() == 1.0 and not state.kernel_workspace.any()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_bf16_pattern_casts_to_torchs_bytes_and_scales(dtype, kind):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    check(x, dtype, kind)
    # Without the infinities and NaNs, every 1xB block of subnormals gets its own large scale.
    check(torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).to(torch.bfloat16), dtype, kind)


@pytest.mark.parametrize("src", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("kind", ["mxfp8", "1x128", "128x128-pow2-eps"])
def test_float16_and_float32_samples(src, kind):
    gen = torch.Generator().manual_seed(0)
    info = torch.finfo(src)
    exponents = torch.randint(int(torch.log2(torch.tensor(info.tiny)).item()) - 8,
                              int(torch.log2(torch.tensor(info.max)).item()), (128 * 160,), generator=gen)
    x = (torch.rand(exponents.shape, generator=gen) + 1) * torch.exp2(exponents.double())
    x = (x * (torch.randint(0, 2, x.shape, generator=gen) * 2 - 1)).clamp(-info.max, info.max).to(src).reshape(128, 160)
    x[3, :4] = torch.tensor([float("inf"), float("nan"), 0.0, info.max])
    check(x, E4M3, kind)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape,layout", [((1, 1), "contiguous"), ((130, 70), "transposed"), ((33, 257), "strided"),
                                          ((256, 160), "contiguous")])
def test_ragged_shapes_and_any_layout(kind, shape, layout):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(shape[0] * 2, shape[1] * 2, generator=gen).to(torch.bfloat16) * 300
    x = {"contiguous": base[: shape[0], : shape[1]].contiguous(),
         "transposed": base[: shape[1], : shape[0]].t(),
         "strided": base[::2, ::2][: shape[0], : shape[1]]}[layout]
    check(x, E5M2, kind)


def test_block_shapes_without_a_kernel_are_refused_naming_the_valid_ones():
    state = ScalingState(4)
    tensors = dict(scale=state.scale, amax_history=state.amax_history, nonfinite_amax_count=state.nonfinite_amax_count,
                   workspace=state.kernel_workspace, role=0)
    with pytest.raises(ValueError, match=r"block=\(1, 64\) has no fused blockwise cast; valid: \(1, 128\), \(128, 128\)"):
        cast_blocks(torch.ones(4, 4), E4M3, (1, 64), mx=False, transpose=False, record=False, **tensors)
    with pytest.raises(ValueError, match=r"block=\(1, 128\) has no fused MXFP8 cast; valid: \(1, 32\)"):
        cast_blocks(torch.ones(4, 4), E4M3, (1, 128), mx=True, transpose=False, record=False, **tensors)


@pytest.mark.parametrize("recipe", [fp.Float8BlockScaling(), fp.MXFP8BlockScaling()], ids=["blockwise", "mxfp8"])
def test_fp8_linear_trains_bit_for_bit_through_the_block_kernel(recipe, monkeypatch):
    torch.manual_seed(0)
    layer = fp.FP8Linear(256, 160, bias=True)
    twin = copy.deepcopy(layer)
    calls = []
    real = blockwise.BlockCast.__call__
    monkeypatch.setattr(blockwise.BlockCast, "__call__", lambda plan, x: calls.append(1) or real(plan, x))
    runs = []
    for module, path in ((layer, "triton"), (twin, "torch")):
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        gen = torch.Generator().manual_seed(3)
        record = []
        for _ in range(2 if isinstance(recipe, fp.Float8BlockScaling) else 1):  # no state carries over: MXFP8 once
            x = (torch.randn(3, 40, 256, generator=gen) * 4).requires_grad_()
            with force_kernels(path), torch.autocast("cpu", dtype=torch.bfloat16):
                with fp.autocast(recipe=recipe):
                    y = module(x)
                y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            record.append((y.detach(), x.grad))
        runs.append(record)
    assert len(calls) == 3 * len(runs[0])  # input, weight, grad_output per step: the kernel ran
    for (y1, g1), (y2, g2) in zip(*runs):
        assert torch.equal(y1, y2) and torch.equal(g1, g2)
    assert torch.equal(layer.weight, twin.weight)
    for name, t in layer.fp8_state.tensors().items():
        assert torch.equal(t, twin.fp8_state.tensors()[name]), name
