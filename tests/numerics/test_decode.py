"""fp8_plugin/numerics/decode.py: every FP8 byte decodes to the value the OCP OFP8 spec gives it."""

import math

import pytest
import torch

from fp8_plugin.numerics.decode import decode_fp8

# OCP OFP8 rev 1.0, table 1: exponent bits, mantissa bits, bias.
LAYOUT = {torch.float8_e4m3fn: (4, 3, 7), torch.float8_e5m2: (5, 2, 15)}


def spec_value(byte: int, dtype: torch.dtype) -> float:
    """The value the spec gives ``byte``, computed in Python floats from the bit fields."""
    e_bits, m_bits, bias = LAYOUT[dtype]
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> m_bits) & ((1 << e_bits) - 1)
    mantissa = byte & ((1 << m_bits) - 1)
    if dtype == torch.float8_e4m3fn and exponent == 0xF and mantissa == 0x7:
        return math.nan  # E4M3: S.1111.111 is NaN, no infinities
    if dtype == torch.float8_e5m2 and exponent == 0x1F:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:
        return sign * mantissa / (1 << m_bits) * 2.0 ** (1 - bias)
    return sign * (1 + mantissa / (1 << m_bits)) * 2.0 ** (exponent - bias)


@pytest.mark.parametrize("fp8", list(LAYOUT))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_byte_decodes_to_its_spec_value(fp8, dtype):
    data = torch.arange(256, dtype=torch.uint8).view(fp8)
    got = decode_fp8(data, dtype)
    assert got.dtype == dtype and got.shape == (256,)
    want = torch.tensor([spec_value(b, fp8) for b in range(256)], dtype=torch.float64)
    # Every FP8 value is exact in each of these dtypes: compared exactly, NaNs where the spec has them.
    assert torch.equal(got.double().isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got.double()[finite], want[finite])
    assert torch.equal(torch.signbit(got.double()[finite]), torch.signbit(want[finite]))  # -0 stays -0


@pytest.mark.parametrize("fp8", list(LAYOUT))
def test_layout_kept_for_transposed_views(fp8):
    data = (torch.randn(24, 40) * 30).to(fp8)
    view = data.t()
    got = decode_fp8(view)
    assert got.shape == (40, 24) and got.stride() == view.stride()
    assert torch.equal(got, torch.tensor([[spec_value(b, fp8) for b in row] for row in view.view(torch.uint8).tolist()],
                                         dtype=torch.float32))


def test_nan_among_finite_values_only_where_the_bytes_are_nan():
    # The path that puts E4M3's NaN back: one NaN byte in a large tensor.
    data = (torch.randn(64, 64) * 100).to(torch.float8_e4m3fn)
    data.view(torch.uint8)[3, 5] = 0xFF
    got = decode_fp8(data)
    assert got.isnan().sum() == 1 and got[3, 5].isnan()
    assert got.abs().nan_to_num(0).max() <= 448


def test_other_formats_devices_and_empty_tensors_take_torchs_cast():
    fnuz = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fnuz)
    assert torch.equal(decode_fp8(fnuz).isnan(), torch.arange(256) == 0x80)  # FNUZ's one NaN
    assert decode_fp8(torch.empty(0, 3, dtype=torch.float8_e4m3fn)).shape == (0, 3)
    meta = torch.empty(4, 4, dtype=torch.float8_e4m3fn, device="meta")
    assert decode_fp8(meta, torch.bfloat16).dtype == torch.bfloat16
    same = torch.ones(2, dtype=torch.bfloat16)
    assert decode_fp8(same, torch.bfloat16) is same
