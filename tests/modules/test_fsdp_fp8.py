"""FP8 all-gather of FSDP2-sharded weights (fp8_plugin.modules.fsdp_fp8).

The 2-rank test reads tests/modules/fsdp_fp8_worker.py's runs (gloo, CPU; in the shared launch of
tests/training/distributed_worker.py). Under current scaling
a weight's scale comes from the whole weight's amax either way, so gathering the FP8 cast of each
shard must train bit for bit as gathering the high-precision shards and casting after: same FP8
values, same GEMMs. What the layers received shows the gather itself was FP8.
"""

import pytest
import torch
from torch import nn

import fp8_plugin
from fp8_plugin import FP8Linear
from fp8_plugin.modules.fsdp_fp8 import FP8GatheredWeight


def test_fsdp2_fp8_all_gather_trains_bit_for_bit_as_the_high_precision_gather(distributed_runs):
    runs = distributed_runs("fsdp-fp8-current")  # tests/modules/fsdp_fp8_worker.py, in the shared launch
    for rank in (0, 1):
        fp8, hp = runs[f"fp8-gather-rank{rank}"], runs[f"hp-gather-rank{rank}"]
        assert set(fp8["seen"]) == {("FP8GatheredWeight", "torch.float8_e4m3fn")}  # 1 byte per value gathered
        assert set(hp["seen"]) == {("Parameter", "torch.float32")}
        assert torch.equal(fp8["losses"], hp["losses"])
        assert fp8["weights"].keys() == hp["weights"].keys()
        for name in fp8["weights"]:
            assert torch.equal(fp8["weights"][name], hp["weights"][name]), name
    assert torch.equal(runs["fp8-gather-rank0"]["weights"]["2.weight"], runs["fp8-gather-rank1"]["weights"]["2.weight"])
    assert not torch.equal(runs["fp8-gather-rank0"]["losses"], runs["fp8-gather-rank1"]["losses"])  # own batches


def test_an_fp8_gathered_weight_is_the_gemm_operand_and_dequantizes_for_other_ops():
    torch.manual_seed(0)
    recipe = fp8_plugin.Float8CurrentScaling()
    layer = FP8Linear(64, 32, recipe=recipe)
    weight = layer.weight.detach().clone()
    # OCP E4M3 max over the weight's amax (TE's current scaling), correctly rounded to float32
    # (a float64 quotient rounded once), and its inverse likewise.
    scale = (448.0 / weight.abs().max().double()).float()
    scale_inv = (1.0 / scale.double()).float()
    data = (weight * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    gathered = FP8GatheredWeight(data, scale_inv, torch.float32)
    expected_weight = data.float() * scale_inv
    assert torch.equal(gathered + 0, expected_weight)  # any other op sees data * scale_inv
    x = torch.randn(16, 64)
    with fp8_plugin.autocast():
        reference = layer(x)  # casts its own weight with the same scale
    layer.weight = nn.Parameter(gathered)
    with fp8_plugin.autocast():
        got = layer(x.clone().requires_grad_())
    assert torch.equal(got.detach(), reference.detach())
    got.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (32, 64)


def test_fp8_all_gather_refuses_block_scaled_recipes():
    model = nn.Sequential(nn.Linear(64, 64))
    fp8_plugin.convert_model(model, fp8_plugin.MXFP8BlockScaling())
    with pytest.raises(ValueError, match="layer '0' uses MXFP8BlockScaling; valid recipes: DelayedScaling, Float8CurrentScaling"):
        fp8_plugin.enable_fp8_all_gather(model)
