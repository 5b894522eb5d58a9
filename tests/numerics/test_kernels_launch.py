"""fp8_plugin/numerics/kernels/launch.py: a kernel compiled once per launch key, then launched
through the compiled kernel's own launcher.

No GPU here: the kernel is a stand-in with Triton's two entry points as the private API tests
pin them (``kernel[grid](*args, **constexprs)`` returns the compiled kernel, whose
``compiled[grid]`` is the launcher taking every argument in signature order). The real kernels
run through the same class under Triton's interpreter in every kernel test, and on a GPU in the
contract suite (tests/cuda_contract/test_cached_launches.py).
"""

import pytest
import torch

from fp8_plugin._private import triton_api
from fp8_plugin.numerics.kernels import launch
from fp8_plugin.numerics.kernels.launch import KernelLaunch, record_launches


def _body(x_ptr, n, scale, BLOCK: "tl.constexpr", FLAG: "tl.constexpr"):  # noqa: F821  (a signature only)
    pass


class _Compiled:
    def __init__(self, kernel, grid):
        self.kernel, self.grid = kernel, grid

    def __getitem__(self, grid):
        return lambda *args: self.kernel.launched.append(("runner", grid, args))


class _Kernel:
    """Triton's JITFunction as the launcher sees it: compiles on kernel[grid](...)."""

    fn = staticmethod(_body)

    def __init__(self):
        self.compiled, self.launched = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiled.append((grid, args, kwargs))
            self.launched.append(("jit", grid, args))
            return _Compiled(self, grid)
        return run


@pytest.fixture
def convention(monkeypatch):
    monkeypatch.setattr(triton_api, "launch_convention", lambda: "all")
    monkeypatch.delenv(launch.ENV_VAR, raising=False)


def test_the_first_launch_of_a_key_compiles_and_the_next_ones_take_the_launcher(convention):
    kernel = _Kernel()
    go = KernelLaunch(kernel, BLOCK=64, FLAG=True, num_warps=4)
    x = torch.zeros(64)
    for _ in range(3):
        go((2, 1), x, 64, 0.5)
    assert [k for k, _, _ in kernel.launched] == ["jit", "runner", "runner"]
    assert kernel.compiled[0][2] == dict(BLOCK=64, FLAG=True, num_warps=4)
    # The launcher gets every argument in signature order, the constexprs last, on a 3-D grid.
    assert kernel.launched[1] == ("runner", (2, 1, 1), (x, 64, 0.5, 64, True))


def test_what_triton_specializes_on_makes_a_new_key(convention):
    kernel = _Kernel()
    go = KernelLaunch(kernel, BLOCK=64, FLAG=True)
    base = torch.zeros(64)
    go((1,), base, 64, 0.5)
    go((1,), base[1:], 64, 0.5)  # 4 bytes in: an address Triton does not call 16-byte aligned
    go((1,), base[4:], 64, 0.5)  # 16 bytes in: aligned again, the first key
    go((1,), base.to(torch.bfloat16), 64, 0.5)  # another dtype
    go((1,), base, 1, 0.5)  # an int of 1 (Triton specializes it)
    go((2,), base, 64, 0.5)  # another grid
    assert [k for k, _, _ in kernel.launched] == ["jit", "jit", "runner", "jit", "jit", "jit"]


def test_the_jit_path_can_be_asked_for_and_a_wrong_value_is_refused(convention, monkeypatch):
    kernel = _Kernel()
    go = KernelLaunch(kernel, BLOCK=64, FLAG=True)
    monkeypatch.setenv(launch.ENV_VAR, "jit")
    go((1,), torch.zeros(4), 4, 1.0)
    go((1,), torch.zeros(4), 4, 1.0)
    assert [k for k, _, _ in kernel.launched] == ["jit", "jit"]
    monkeypatch.setenv(launch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="FP8_PLUGIN_TRITON_LAUNCH='fast' is not a launch path; valid: cached, jit"):
        KernelLaunch(_Kernel(), BLOCK=64, FLAG=True)((1,), torch.zeros(4), 4, 1.0)


def test_an_older_tritons_launcher_gets_the_runtime_arguments_only(monkeypatch):
    monkeypatch.setattr(triton_api, "launch_convention", lambda: "runtime")
    monkeypatch.delenv(launch.ENV_VAR, raising=False)
    kernel = _Kernel()
    go = KernelLaunch(kernel, BLOCK=64, FLAG=True)
    x = torch.zeros(4)
    go((1,), x, 4, 1.0)
    go((1,), x, 4, 1.0)
    assert kernel.launched[1] == ("runner", (1, 1, 1), (x, 4, 1.0))


def test_an_unknown_convention_keeps_every_launch_on_the_jit_path(monkeypatch):
    monkeypatch.setattr(triton_api, "launch_convention", lambda: None)
    kernel = _Kernel()
    go = KernelLaunch(kernel, BLOCK=64, FLAG=True)
    go((1,), torch.zeros(4), 4, 1.0)
    go((1,), torch.zeros(4), 4, 1.0)
    assert [k for k, _, _ in kernel.launched] == ["jit", "jit"]


def test_recorded_launches_are_counted_and_not_run(convention):
    kernel = _Kernel()
    go = KernelLaunch(kernel, BLOCK=64, FLAG=True)
    with record_launches() as launches:
        go((1,), torch.zeros(4), 4, 1.0)
        go((1,), torch.zeros(4), 4, 1.0)
    assert launches == {"_body": 2} and kernel.launched == []


def test_constexprs_before_runtime_parameters_are_refused():
    def body(BLOCK: "tl.constexpr", x_ptr):  # noqa: F821
        pass

    class Kernel(_Kernel):
        fn = staticmethod(body)

    with pytest.raises(ValueError, match="constexpr parameters must follow the runtime ones"):
        KernelLaunch(Kernel(), BLOCK=64)


def test_a_launch_site_finds_its_launcher_once_per_variant_and_alignment(convention, monkeypatch):
    # A site skips the launch key (one entry per argument) once it holds the launcher for a
    # (variant, alignment): counted by wrapping the key. A misaligned address, a new variant
    # and a recorded run each take the full path; the launches are those of KernelLaunch.
    kernel = _Kernel()
    go = KernelLaunch(kernel, BLOCK=64, FLAG=True)
    keys = []
    key = go._key
    monkeypatch.setattr(go, "_key", lambda grid, args: keys.append(args) or key(grid, args))
    site = launch.LaunchSite(go, (2,))
    base = torch.zeros(64)
    for _ in range(3):
        site(None, base.data_ptr(), base, 64, 0.5)
    assert [k for k, _, _ in kernel.launched] == ["jit", "runner", "runner"]
    assert kernel.launched[2] == ("runner", (2, 1, 1), (base, 64, 0.5, 64, True))
    assert len(keys) == 2  # the first call's launch and its launcher's lookup: none since
    shifted = base[1:]  # 4 bytes in: Triton's key differs, so the site's does
    site(None, shifted.data_ptr(), shifted, 63, 0.5)
    site(None, shifted.data_ptr(), shifted, 63, 0.5)
    site("another", base.data_ptr(), base, 64, 0.5)
    assert [k for k, _, _ in kernel.launched][3:] == ["jit", "runner", "runner"]
    with record_launches() as launches:
        site(None, base.data_ptr(), base, 64, 0.5)
        site(None, base.data_ptr(), base, 64, 0.5)
    assert launches == {"_body": 2} and len(kernel.launched) == 6  # counted, not run
    site(None, base.data_ptr(), base, 64, 0.5)  # recording over: launched again
    assert kernel.launched[-1] == ("runner", (2, 1, 1), (base, 64, 0.5, 64, True))
