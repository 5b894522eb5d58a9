"""fp8_plugin/_private/torch_api.py: the private torch API behaves as the package assumes."""

import torch
import torch.utils.checkpoint

from fp8_plugin._private.torch_api import has_tensor_hooks, in_backward_pass


def test_in_backward_pass_is_false_in_forward_and_true_in_a_checkpoint_recompute():
    seen = []

    def block(x):
        seen.append(in_backward_pass())
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    for reentrant in (True, False):
        seen.clear()
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant).sum().backward()
        assert seen == [False, True], (reentrant, seen)
    assert in_backward_pass() is False


def test_has_tensor_hooks_sees_register_hook_and_its_removal():
    w = torch.nn.Parameter(torch.randn(3))
    assert has_tensor_hooks(w) is False
    handle = w.register_hook(lambda g: g * 2)
    assert has_tensor_hooks(w) is True
    handle.remove()
    assert has_tensor_hooks(w) is False


def test_in_dispatch_mode_sees_fake_tensor_mode_and_a_dispatch_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp8_plugin._private.torch_api import in_dispatch_mode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert not in_dispatch_mode()
    with FakeTensorMode():
        assert in_dispatch_mode()
    with Passthrough():
        assert in_dispatch_mode()
    assert not in_dispatch_mode()


def test_a_storage_is_one_python_object_while_it_lives_and_a_weak_reference_sees_it_freed():
    # What the memory tool's trace relies on (tools/memory_trace.py): storages are followed by
    # their Python object, which torch keeps while any tensor or view holds the storage.
    import weakref

    from fp8_plugin._private.torch_api import TorchDispatchMode

    assert isinstance(TorchDispatchMode, type)
    t = torch.empty(4, device="meta")
    assert t.untyped_storage() is t.untyped_storage()
    freed = []
    ref = weakref.ref(t.untyped_storage(), lambda _: freed.append(True))
    view = t.view(2, 2)
    del t
    assert not freed and ref() is view.untyped_storage()
    del view
    assert freed == [True]


def test_pytree_flattens_calls_to_leaves_with_none_a_leaf_and_specs_that_compare():
    # What the CUDA graphs' call signatures rely on (modules/cuda_graphs.py, training/graphing.py).
    from fp8_plugin._private.torch_api import tree_flatten, tree_map, tree_unflatten

    a, b = torch.zeros(2), torch.ones(3)
    call = ((a,), {"mask": None, "rope": (a, b), "flag": False})
    leaves, spec = tree_flatten(call)
    assert len(leaves) == 5 and leaves[0] is a and leaves[1] is None and leaves[4] is False
    assert tree_unflatten(leaves, spec) == call
    same, other = tree_flatten(((b,), {"mask": None, "rope": (b, a), "flag": True}))[1], tree_flatten(((a,), {}))[1]
    assert same == spec and other != spec
    assert tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, call)[1]["rope"][1].tolist() == [2, 2, 2]


def test_registered_parameter_and_submodule_read_what_getattr_reads():
    from torch.nn.utils import parametrize

    from fp8_plugin._private.torch_api import registered_parameter, registered_submodule

    layer = torch.nn.Linear(3, 2, bias=False)
    model = torch.nn.Sequential(layer)
    assert registered_parameter(layer, "weight") is layer.weight
    assert registered_parameter(layer, "bias") is None and layer.bias is None
    assert registered_submodule(model, "0") is layer

    class Double(torch.nn.Module):
        def forward(self, w):
            return w * 2

    # A parametrization moves the Parameter out of _parameters and makes `weight` a property.
    parametrize.register_parametrization(layer, "weight", Double())
    assert "weight" not in layer._parameters
    assert torch.equal(registered_parameter(layer, "weight"), layer.parametrizations.weight.original * 2)
    try:
        registered_submodule(model, "missing")
    except AttributeError as err:
        assert "missing" in str(err)
    else:
        raise AssertionError("registered_submodule of a missing name must raise AttributeError")


class _Scale(torch.autograd.Function):
    # y = x * w * factor, with the factor inside a tuple (as FP8LinearFunction's operands are).
    @staticmethod
    def forward(ctx, x, w, extra):
        ctx.save_for_backward(x, w)
        ctx.factor = extra[0]
        return x * w * extra[0]

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w * ctx.factor, (grad * x * ctx.factor).sum(0), None


def test_eager_apply_gives_the_public_apply_s_node_output_and_gradients():
    from fp8_plugin._private.torch_api import eager_apply

    apply = eager_apply(_Scale)
    # Small integers: every product and sum is exact, so both paths must match the expectation bit for bit.
    x = torch.randint(-8, 8, (4, 3)).double().requires_grad_()
    w = torch.randint(-8, 8, (3,)).double().requires_grad_()
    results = []
    for call in (_Scale.apply, apply):
        y = call(x, w, (3.0,))
        assert type(y.grad_fn).__name__ == "_ScaleBackward"
        gx, gw = torch.autograd.grad(y.sum(), (x, w))
        results.append((y.detach(), gx, gw))
    expected = (x.detach() * w.detach() * 3.0, w.detach().expand(4, 3) * 3.0, x.detach().sum(0) * 3.0)
    for got in results:
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_eager_apply_unwraps_a_dead_functorch_wrapper_and_defers_to_the_public_path_under_a_transform():
    from fp8_plugin._private.torch_api import eager_apply

    apply = eager_apply(_Scale)
    base = torch.ones(2, requires_grad=True)
    leaked = []

    def double(x):
        leaked.append(x)  # a functorch wrapper of `base`, dead once the transform returns
        return x * 2

    torch.func.vjp(double, base)
    dead, w = leaked[0], torch.full((2,), 2.0)
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    for call in (_Scale.apply, apply):
        # Unwrapped, the node is recorded on `base` itself: its gradient is w * 1.0.
        out = call(dead, w, (1.0,))
        assert not torch._C._functorch.is_functorch_wrapped_tensor(out) and out.tolist() == [2.0, 2.0]
        assert torch.autograd.grad(out.sum(), base)[0].tolist() == [2.0, 2.0]
    # Under a transform the public path runs: it refuses a Function without setup_context.
    for call in (_Scale.apply, apply):
        try:
            torch.func.grad(lambda x: call(x, w, (1.0,)).sum())(torch.ones(2))
        except RuntimeError as err:
            assert "setup_context" in str(err)
        else:
            raise AssertionError("a Function without setup_context must be refused under torch.func")


def test_eager_apply_refuses_a_function_with_setup_context():
    from fp8_plugin._private.torch_api import eager_apply

    class WithSetup(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

    try:
        eager_apply(WithSetup)
    except TypeError as err:
        assert "setup_context" in str(err)
    else:
        raise AssertionError("eager_apply must refuse a Function with setup_context")
