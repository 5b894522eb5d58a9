"""fp8_plugin/numerics/block_scaling.py and the block recipes against references written from the specs."""

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fp8_plugin as fp
from fp8_plugin.numerics.quantizers import INPUT, BlockQuantizer, ScalingState
from fp8_plugin.numerics.recipes import Float8BlockScaling, MXFP8BlockScaling, QParams
from reference import DEVICES, MAX, train_losses

E4M3 = torch.float8_e4m3fn
EMAX_ELEM = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}  # OCP MX v1.0 table 2


def floor_log2(v: float) -> int:
    return math.frexp(v)[1] - 1  # exact, unlike math.log2 near powers of two


def ref_mx(x: torch.Tensor, dtype=E4M3):
    """OCP MX v1.0, 6.3, per 1x32 block of each row: X = 2^(floor(log2 amax) - emax_elem)."""
    rows, cols = x.shape
    nb = -(-cols // 32)
    scales = torch.empty(rows, nb, dtype=torch.float64)
    data = torch.empty(rows, cols, dtype=torch.float64)
    for r in range(rows):
        for b in range(nb):
            v = x[r, b * 32:(b + 1) * 32].double()
            amax = v.abs().max().item()
            if not math.isfinite(amax):
                X = float("nan")
            elif amax == 0:
                X = 2.0 ** -127
            else:
                X = 2.0 ** min(max(floor_log2(amax) - EMAX_ELEM[dtype], -127), 127)
            scales[r, b] = X
            data[r, b * 32:(b + 1) * 32] = (v / X).clamp(-MAX[dtype], MAX[dtype]).to(dtype).double()
    return data, scales


def ref_blockwise(x: torch.Tensor, block, power_2=True, dtype=E4M3):
    """TE blockwise: FP32 scale = FP8_MAX / amax per tile, mantissa zeroed if power_2; zero amax -> 1;
    data = saturate(x * scale) in FP32; scale_inv = 1 / scale in FP32."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    rows, cols = x.shape
    br, bc = block
    scales = torch.empty(-(-rows // br), -(-cols // bc), dtype=torch.float64)
    data = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            v = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            amax = v.abs().max().item()
            s = f32(MAX[dtype]) / f32(amax) if amax > 0 and math.isfinite(amax) else f32(1.0)
            if power_2 and amax > 0 and math.isfinite(amax):
                s = f32(2.0 ** floor_log2(s.item()))
            scales[i, j] = (f32(1.0) / s).double()
            data[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (v * s).clamp(-MAX[dtype], MAX[dtype]).to(dtype).double()
    return data, scales


def inputs():
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(6, 200, generator=g)
    heavy = torch.randn(6, 200, generator=g) ** 3 * 50  # heavy tails: cubes of normals
    outliers = torch.randn(6, 200, generator=g) * 1e-3
    outliers[:, ::37] = 3e4
    zeros = torch.randn(6, 200, generator=g)
    zeros[:, :128] = 0.0
    tiny = torch.randn(6, 200, generator=g) * 1e-30
    return {"normal": normal, "heavy_tailed": heavy, "outliers": outliers, "all_zero_blocks": zeros, "tiny": tiny}


def _quantize(recipe, x, role=INPUT):
    q = BlockQuantizer(recipe, role, ScalingState(1)).quantize(x)
    return q.data.double(), q.scale_inv.double(), q


@pytest.mark.parametrize("name", list(inputs()))
def test_mxfp8_values_and_scales_match_ocp_spec(name):
    x = inputs()[name]
    data, scale_inv, q = _quantize(MXFP8BlockScaling(), x)
    ref_data, ref_scales = ref_mx(x)
    assert torch.equal(scale_inv, ref_scales)
    assert torch.equal(data, ref_data)
    assert q.block == (1, 32) and scale_inv.shape == (6, 7)  # 200 cols: 6 full blocks + 1 partial
    # Every scale is an E8M0 value: a power of two.
    assert torch.equal(torch.frexp(scale_inv)[0].abs(), torch.full_like(scale_inv, 0.5))


@pytest.mark.parametrize("name", list(inputs()))
@pytest.mark.parametrize("dim, power_2", [(1, True), (2, True), (1, False)])
def test_blockwise_values_and_scales_match_te_definition(name, dim, power_2):
    x = inputs()[name]
    recipe = Float8BlockScaling(x_block_scaling_dim=dim, fp8_quant_fwd_inp=QParams(power_2_scale=power_2))
    data, scale_inv, q = _quantize(recipe, x)
    block = (128, 128) if dim == 2 else (1, 128)
    ref_data, ref_scales = ref_blockwise(x, block, power_2)
    torch.testing.assert_close(scale_inv, ref_scales, rtol=0, atol=0)
    torch.testing.assert_close(data, ref_data, rtol=0, atol=0)
    assert q.block == block


def test_non_finite_blocks():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    _, scale_inv, q = _quantize(MXFP8BlockScaling(), x)
    assert torch.isnan(scale_inv[0, 0]) and torch.isnan(scale_inv[1, 1])  # E8M0 NaN: block reads as NaN
    assert torch.isfinite(scale_inv[0, 1]) and torch.isfinite(scale_inv[1, 0])
    assert torch.isnan(q.dequantize()[0, :32]).all()
    _, bw_scale, qb = _quantize(Float8BlockScaling(), x)
    assert bw_scale.tolist() == [[1.0], [1.0]]
    assert math.isnan(qb.dequantize()[1, 40].item())  # inf is an overflow, not a range: E4M3 NaN


def test_bad_block_recipe_arguments():
    with pytest.raises(ValueError, match="E5M2.*Format.E4M3"):
        MXFP8BlockScaling(fp8_format="E5M2")
    with pytest.raises(ValueError, match="w_block_scaling_dim=3.*1 \\(1x128 blocks\\), 2"):
        Float8BlockScaling(w_block_scaling_dim=3)
    with pytest.raises(ValueError, match="amax_epsilon=-1.*from 0 to the float32 max"):
        QParams(amax_epsilon=-1)
    with pytest.raises(ValueError, match="1x128 block-scaled tensor cannot be transposed"):
        _quantize(Float8BlockScaling(), torch.randn(4, 128))[2].t()


def ref_operand(x, recipe, role_dims):
    """Dequantized float64 operand as the GEMM sees it, blocks along the last dim."""
    if isinstance(recipe, MXFP8BlockScaling):
        data, scales = ref_mx(x)
        return data * scales.repeat_interleave(32, 1)[:, : x.shape[1]]
    block = (128, 128) if role_dims == 2 else (1, 128)
    data, scales = ref_blockwise(x, block)
    full = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return data * full[: x.shape[0], : x.shape[1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling()], ids=["mxfp8", "blockwise"])
def test_fp8_linear_forward_dgrad_wgrad_under_block_recipes_match_float64(recipe, device):
    # On a GPU whose native block GEMM writes bf16 only, results carry one bf16 rounding.
    rtol = 1e-5 if device == "cpu" else 1e-2
    layer = fp.FP8Linear(256, 384, recipe=recipe, device=device)
    x = (torch.randn(4, 64, 256, device=device) * 2).requires_grad_()
    g = torch.randn(4, 64, 384, device=device) * 1e-2
    with fp.autocast():
        y = layer(x)
    y.backward(g)
    x2, w, g2 = x.detach().reshape(-1, 256).cpu(), layer.weight.detach().cpu(), g.reshape(-1, 384).cpu()
    dims = (1, 2, 1) if isinstance(recipe, Float8BlockScaling) else (1, 1, 1)
    # Each GEMM operand is quantized with its blocks along that GEMM's reduction dim.
    ref_y = ref_operand(x2, recipe, dims[0]) @ ref_operand(w, recipe, dims[1]).t() + layer.bias.detach().double().cpu()
    ref_dx = ref_operand(g2, recipe, dims[2]) @ ref_operand(w.t().contiguous(), recipe, dims[1]).t()
    ref_dw = ref_operand(g2.t().contiguous(), recipe, dims[2]) @ ref_operand(x2.t().contiguous(), recipe, dims[0]).t()
    torch.testing.assert_close(y.double().reshape(-1, 384).cpu(), ref_y, rtol=rtol, atol=rtol)
    torch.testing.assert_close(x.grad.double().reshape(-1, 256).cpu(), ref_dx, rtol=rtol, atol=1e-8 + rtol * 1e-2)
    torch.testing.assert_close(layer.weight.grad.double().cpu(), ref_dw, rtol=rtol, atol=1e-8 + rtol * 1e-2)


@pytest.mark.parametrize(
    "recipe",
    [fp.DelayedScaling(amax_history_len=16), fp.Float8CurrentScaling(), MXFP8BlockScaling(), Float8BlockScaling()],
    ids=["delayed", "current", "mxfp8", "blockwise"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_small_llama_trains_under_each_recipe_close_to_high_precision(recipe, device):
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=256, vocab_size=128,
                                       max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    ref.to(device)
    model = copy.deepcopy(ref)
    fp.convert_model(model, recipe)
    ids = torch.randint(1, 128, (8, 32), device=device)

    base = train_losses(ref, False, input_ids=ids, labels=ids)
    fp8 = train_losses(model, True, input_ids=ids, labels=ids)
    assert fp8[-1] < fp8[0] - 0.2
    for a, b in zip(base, fp8):
        assert abs(a - b) / a < 0.05, (base, fp8)
