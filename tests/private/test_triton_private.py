"""fp8_plugin/_private/triton_api.py: the private Triton API behaves as the package assumes.

The cached launchers of :mod:`fp8_plugin.numerics.kernels.launch` pass a compiled kernel's
launcher the arguments ``JITFunction.run`` passes it; these tests fail when Triton changes that.
"""

import inspect

import pytest

triton = pytest.importorskip("triton")

from fp8_plugin._private import triton_api  # noqa: E402


def test_this_triton_launches_with_a_known_argument_convention():
    # JITFunction.run ends in kernel.run(grid..., *bound_args.values()) (Triton 3.3 and later):
    # every parameter in signature order, constexprs included. A Triton that passes them
    # otherwise makes launch_convention None, and every launch goes through kernel[grid].
    assert triton_api.launch_convention() == "all", inspect.getsource(triton.runtime.jit.JITFunction.run)


def test_a_compiled_kernels_launcher_is_indexed_by_the_grid_and_takes_the_arguments_kernel_run_takes():
    from triton.compiler.compiler import CompiledKernel

    source = inspect.getsource(CompiledKernel.__getitem__)
    runner = source.split("def runner", 1)[1]
    # The runner bound to a grid hands its *args to the launcher after the launch metadata,
    # exactly as JITFunction.run does.
    assert "def runner(*args, stream=None)" in source
    assert "self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata" in runner
    assert "*args)" in runner


def test_a_launch_takes_the_kernels_constexprs_from_its_annotations():
    # What the launcher appends after the runtime arguments: the constexprs, in signature order.
    from fp8_plugin.numerics.kernels import tensorwise
    from fp8_plugin.numerics.kernels.launch import KernelLaunch

    fixed = dict(FP8_MAX=448.0, E4M3=True, TRANSPOSE=False, RECORD=True, BGRAD=False, SCALE_OUT=False, TILE=64)
    launch = KernelLaunch(tensorwise._delayed_kernel, enable_fp_fusion=False, **dict(reversed(fixed.items())))
    assert launch._constexpr_values == tuple(fixed.values())
    with pytest.raises(ValueError, match="needs the constexprs TILE"):
        KernelLaunch(tensorwise._delayed_kernel, **{k: v for k, v in fixed.items() if k != "TILE"})


def test_the_interpreter_returns_no_compiled_kernel_so_no_launcher_is_kept(monkeypatch):
    # Under TRITON_INTERPRET=1 (the tests' CPU runs) kernel[grid] returns None.
    assert triton_api.compiled_runner(None, (1, 1, 1)) is None
