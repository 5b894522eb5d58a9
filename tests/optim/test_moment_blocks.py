"""The FP8 moment format (fp8_plugin/optim/moment_blocks.py) against the OCP E4M3 grid, rounded
to nearest with ties to even by a search over all 256 codes here (float64), and TE's scale rule."""

import pytest
import torch

from fp8_plugin.optim.moment_blocks import BLOCK, blocks_of, dequantize_moment, quantize_moment


def e4m3_grid() -> torch.Tensor:
    """The finite E4M3 values in float64, from the OCP FP8 spec (rev 1.0): sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent 0 subnormal; S.1111.111 is NaN, no infinities."""
    values = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue
            if exponent == 0:
                values.append(mantissa / 8 * 2.0 ** -6)
            else:
                values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    positive = torch.tensor(values, dtype=torch.float64)
    return positive, torch.tensor([m % 2 == 0 for e in range(16) for m in range(8) if not (e == 15 and m == 7)])


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest E4M3 value, ties to the even code (|x| <= 448 here)."""
    grid, even = e4m3_grid()
    mag = x.abs().reshape(-1, 1)
    dist = (mag - grid).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    tie = candidates.sum(1) > 1
    index = torch.where(tie, (candidates & even).float().argmax(1), candidates.float().argmax(1))
    return (grid[index] * x.sign().reshape(-1)).reshape(x.shape)


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scale_inv) per the format: scale = 448 / amax per block of 128, float32."""
    flat = x.reshape(-1).double()
    values, scale_invs = [], []
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start:start + BLOCK]
        amax = block.abs().max()
        scale = torch.tensor(448.0 / amax.item() if amax > 0 else 1.0, dtype=torch.float32).double()
        values.append(round_to_e4m3((block * scale).float().double()))
        scale_invs.append((1 / scale).float())
    return torch.cat(values).reshape(x.shape), torch.stack(scale_invs)


def moment_like(n: int) -> torch.Tensor:
    # Magnitudes over eight decades, a block of zeros, exact ties of the grid are likely after scaling.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    x[BLOCK:2 * BLOCK] = 0
    return x


def test_quantize_gives_the_spec_bytes_and_te_scales():
    x = moment_like(64 * BLOCK).view(64, -1)[:, :100].contiguous()  # 6400 elements: 50 blocks
    data, scale_inv = quantize_moment(x)
    want, want_scale_inv = reference(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (blocks_of(6400),) == (50,)
    assert torch.equal(data.double(), want)
    assert torch.equal(scale_inv, want_scale_inv)


def test_a_block_of_zeros_keeps_scale_one_and_dequantizes_to_zero():
    x = moment_like(3 * BLOCK)
    data, scale_inv = quantize_moment(x)
    assert scale_inv[1] == 1.0 and not data[BLOCK:2 * BLOCK].float().any()
    assert not dequantize_moment(data, scale_inv)[BLOCK:2 * BLOCK].any()


def test_dequantize_is_within_half_an_e4m3_step():
    x = moment_like(5 * BLOCK + 7)
    data, scale_inv = quantize_moment(x)
    back = dequantize_moment(data, scale_inv).double()
    per_element = scale_inv.double().repeat_interleave(BLOCK)[: x.numel()]
    # Half a step: 2**-4 relative for normals (3 mantissa bits), 2**-10 absolute below 2**-6 (the
    # subnormal step 2**-9), in scaled units; then the float32 products' own rounding.
    bound = torch.maximum(x.double().abs() * 2.0 ** -4, 2.0 ** -10 * per_element) * (1 + 2.0 ** -22)
    assert ((back - x.double()).abs() <= bound).all()


def test_non_finite_moments_and_wrong_scale_counts_are_refused():
    with pytest.raises(ValueError, match="holds a NaN or an infinity"):
        quantize_moment(torch.tensor([1.0, float("nan")]))
    data, scale_inv = quantize_moment(torch.ones(300))
    with pytest.raises(ValueError, match="2 block scales for a moment of 300 elements; expected 3"):
        dequantize_moment(data, scale_inv[:2])
