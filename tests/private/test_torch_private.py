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
