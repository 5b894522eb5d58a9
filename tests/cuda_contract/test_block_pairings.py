"""A block-kind pairing the GPU refused runs in the emulation alone, and "auto" picks a format
the native kernels run (fp8_plugin/numerics/gemm_support.py).

On meta tensors the probe cannot run (it reads its results on the host), so each test plants the
probe's verdict: a :class:`NativeGemm` whose E5M2 x E4M3 pairing was refused, as a GPU may
answer for HYBRID's dgrad and wgrad.
"""

import warnings
from functools import lru_cache

import pytest
import torch

import fp8_plugin
from fp8_plugin import FP8Linear
from fp8_plugin.numerics import gemm
from fp8_plugin.numerics.device import auto_recipe
from fp8_plugin.numerics.gemm_support import KERNEL_OUT_DTYPES, NativeGemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALL = KERNEL_OUT_DTYPES
REFUSED = "torch refused the GEMM of E5M2 x E4M3 -> bfloat16: CUBLAS_STATUS_NOT_SUPPORTED"


def planted(monkeypatch, e5m2_by_e4m3):
    """Every block kind's probe answers: E4M3 x E4M3 and E4M3 x E5M2 native, E5M2 x E4M3 as given."""
    verdict = NativeGemm(True, "", ALL, ((E4M3, E4M3, ALL, ""), (E5M2, E4M3, e5m2_by_e4m3, "" if e5m2_by_e4m3 else REFUSED),
                                         (E4M3, E5M2, ALL, "")))

    @lru_cache(maxsize=None)
    def native_gemm(kind, device, probe=True):
        return verdict if kind != "tensorwise" else NativeGemm(True)

    monkeypatch.setattr(gemm, "_native_gemm", native_gemm)


def run_layer(device, recipe):
    layer = FP8Linear(256, 384, bias=False, device=device, dtype=torch.bfloat16, recipe=recipe)
    x = torch.empty(2, 64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    with fp8_plugin.autocast():
        y = layer(x)
    y.backward(torch.empty_like(y))
    return x, y


@pytest.mark.parametrize("cuda,recipe", [((9, 0), fp8_plugin.Float8BlockScaling), ((10, 0), fp8_plugin.MXFP8BlockScaling)],
                         indirect=["cuda"], ids=["sm90-blockwise", "sm100-mxfp8"])
def test_a_refused_pairing_runs_its_gemms_emulated_and_the_forward_native(cuda, recipe, monkeypatch):
    planted(monkeypatch, ())
    gemm._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = run_layer(cuda.device, recipe(fp8_format="HYBRID"))
    assert y.shape == (2, 64, 384) and x.grad.shape == x.shape
    assert cuda.scaled_gemms() == 1 and cuda.float32_mm == 2  # fprop native; dgrad, wgrad (E5M2 x E4M3) emulated
    assert [str(w.message) for w in caught if "E5M2 x E4M3" in str(w.message)] == [
        f"FP8 GEMM emulated in float32 ({'blockwise' if recipe is fp8_plugin.Float8BlockScaling else 'mxfp8'} "
        f"GEMM of E5M2 x E4M3 operands: {REFUSED}); numerics match, speed does not."]
    cuda.clean()


@pytest.mark.parametrize("cuda", [(10, 0)], indirect=True, ids=["sm100"])
def test_the_same_recipe_runs_all_three_gemms_native_where_the_pairing_passed(cuda, monkeypatch):
    planted(monkeypatch, ALL)
    x, y = run_layer(cuda.device, fp8_plugin.MXFP8BlockScaling(fp8_format="HYBRID"))
    assert cuda.scaled_gemms() == 3 and cuda.float32_mm == 0
    cuda.clean()


@pytest.mark.parametrize("cuda", [(10, 0)], indirect=True, ids=["sm100"])
@pytest.mark.parametrize("e5m2_by_e4m3,asked,expected", [
    (ALL, "HYBRID", "HYBRID"),   # every HYBRID pairing native: as asked
    ((), "HYBRID", "E4M3"),      # E5M2 gradients refused: E4M3 everywhere, TE's MXFP8 default
    ((), "E4M3", "E4M3"),
], ids=["hybrid-native", "hybrid-refused", "e4m3"])
def test_auto_on_blackwell_runs_what_the_probe_found(cuda, monkeypatch, e5m2_by_e4m3, asked, expected):
    planted(monkeypatch, e5m2_by_e4m3)
    recipe = auto_recipe(asked, cuda.device)
    assert isinstance(recipe, fp8_plugin.MXFP8BlockScaling) and recipe.fp8_format.name == expected
    cuda.clean()
