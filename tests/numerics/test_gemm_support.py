"""The block kinds' probe (fp8_plugin/numerics/gemm_support.py): every operand pairing and output
dtype is checked on its own, and a refused or wrong one is recorded as such.

Without a GPU the block kernel is scripted: it refuses or miscomputes the pairings each test
plants and otherwise returns the emulation's result; the probe must report exactly what was
planted (an independent expectation: the script), with the kernel's own words as the reason.
"""

import pytest
import torch

from fp8_plugin.numerics import gemm_support
from fp8_plugin.numerics.gemm_kernels import emulated
from fp8_plugin.numerics.gemm_support import KERNEL_OUT_DTYPES, NativeGemm, probe_block_kind

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CPU = torch.device("cpu")


def scripted_kernel(refuse=(), wrong=()):
    """A block kernel refusing the ``(dtype_a, dtype_b)`` pairings in ``refuse`` (any output) and
    doubling the result of the ``(dtype_a, dtype_b, out_dtype)`` cases in ``wrong``."""
    calls = []

    def kernel(kind, a, b, out_dtype):
        calls.append((a.data.dtype, b.data.dtype, out_dtype, a.block, b.block))
        if (a.data.dtype, b.data.dtype) in refuse:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nsecond line")
        out = emulated(a, b, out_dtype)
        return out * 2 if (a.data.dtype, b.data.dtype, out_dtype) in wrong else out

    return kernel, calls


@pytest.mark.parametrize("kind,layouts", [("blockwise", [((1, 128), (128, 128)), ((1, 128), (1, 128))]),
                                          ("mxfp8", [((1, 32), (1, 32))])])
def test_the_probe_checks_every_pairing_output_dtype_and_layout(monkeypatch, kind, layouts):
    kernel, calls = scripted_kernel()
    monkeypatch.setattr(gemm_support, "scaled_mm_blocks", kernel)
    support = probe_block_kind(kind, CPU)
    assert support.native and support.out_dtypes == KERNEL_OUT_DTYPES
    pairs = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
    assert [(a, b, outs) for a, b, outs, _ in support.pairings] == [(a, b, KERNEL_OUT_DTYPES) for a, b in pairs]
    expected_calls = {(a, b, out, la, lb) for a, b in pairs for out in KERNEL_OUT_DTYPES for la, lb in layouts}
    assert set(calls) == expected_calls and len(calls) == len(expected_calls)


def test_a_refused_pairing_and_a_wrong_output_dtype_are_recorded_alone(monkeypatch):
    kernel, _ = scripted_kernel(refuse={(E5M2, E4M3)}, wrong={(E4M3, E5M2, torch.float16)})
    monkeypatch.setattr(gemm_support, "scaled_mm_blocks", kernel)
    support = probe_block_kind("blockwise", CPU)
    assert support.native and support.pairing_out_dtypes(E4M3, E4M3) == KERNEL_OUT_DTYPES
    assert support.pairing_out_dtypes(E5M2, E4M3) == ()
    reason = support.pairing_reason(E5M2, E4M3)
    assert "refused the blockwise GEMM of E5M2 x E4M3" in reason and "CUBLAS_STATUS_NOT_SUPPORTED" in reason
    assert "second line" not in reason  # the error's first line only
    assert support.pairing_out_dtypes(E4M3, E5M2) == (torch.float32, torch.bfloat16)
    assert support.pairing_reason(E4M3, E5M2) == ""  # it runs, in float32 and bfloat16
    assert "E4M3 x E5M2 -> float16 disagreed with the emulation" in dict(
        ((a, b), why) for a, b, _, why in support.pairings)[(E4M3, E5M2)]
    # E5M2 x E5M2 is no pairing of any recipe: never probed, never run natively.
    assert support.pairing_out_dtypes(E5M2, E5M2) == () and "not probed" in support.pairing_reason(E5M2, E5M2)


def test_a_kernel_refusing_e4m3_in_bfloat16_is_not_native(monkeypatch):
    kernel, _ = scripted_kernel(wrong={(E4M3, E4M3, torch.bfloat16)})
    monkeypatch.setattr(gemm_support, "scaled_mm_blocks", kernel)
    support = probe_block_kind("mxfp8", CPU)
    assert not support.native and "E4M3 x E4M3 -> bfloat16 disagreed" in support.reason
    assert support.pairing_out_dtypes(E4M3, E4M3) == ()


def test_a_support_without_pairings_runs_every_pairing_as_e4m3():
    # Tensorwise, and a block kind taken without its probe (force_path("native")).
    support = NativeGemm(True, "", (torch.bfloat16,))
    assert support.pairing_out_dtypes(E5M2, E4M3) == (torch.bfloat16,) and support.pairing_reason(E5M2, E4M3) == ""
    assert NativeGemm(False, "no kernel").pairing_reason(E4M3, E4M3) == "no kernel"
