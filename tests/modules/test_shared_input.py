"""FP8 layers that read one input tensor (q, k, v; gate, up) cast it once (modules/shared_input.py).

The expectation is always the model whose layers cast alone: the same model with a forward
pre-hook on every FP8 layer that hands it a copy of its input, so that no two layers read one
tensor. Sharing must change nothing in the numbers, bit for bit, and save the casts it claims.
"""

import copy

import pytest
import torch

import fp8_plugin
from fp8_plugin.modules import shared_input
from fp8_plugin.numerics.quantizers import INPUT

transformers = pytest.importorskip("transformers")

H, I, LAYERS, TOKENS = 64, 128, 2, 2 * 16
KV = 32  # 2 of 4 heads: k and v project to 32
RECIPES = {"delayed": fp8_plugin.DelayedScaling, "current": fp8_plugin.Float8CurrentScaling}


def _llama(seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def _fp8_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, fp8_plugin.FP8Linear)}


def _converted(recipe: str, alone: bool, base=None):
    model = copy.deepcopy(base) if base is not None else _llama()
    fp8_plugin.convert_model(model, recipe=RECIPES[recipe](), skip_small=False)
    if alone:  # each layer gets a tensor of its own: nothing to share
        for layer in _fp8_layers(model).values():
            layer.register_forward_pre_hook(lambda _, args: (args[0].clone(),))
    return model


def _train(model, steps: int, seed: int = 1, checkpointing: bool = False) -> list[float]:
    if checkpointing:  # transformers' activation checkpointing: torch.utils.checkpoint per decoder layer
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 16), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8_plugin.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_same_model(a, b) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        if isinstance(x, dict):  # an FP8 layer's scaling state
            for key in x:
                assert torch.equal(x[key], y[key]), f"{name}[{key!r}]"
        else:
            assert torch.equal(x, y), name


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_shared_input_casts_train_bit_for_bit_as_layers_casting_alone(recipe):
    base = _llama()
    shared, alone = _converted(recipe, False, base), _converted(recipe, True, base)
    assert _train(shared, 4) == _train(alone, 4)
    _assert_same_model(shared, alone)  # weights, and every layer's amax history and scales as saved
    for (name, a), b in zip(_fp8_layers(shared).items(), _fp8_layers(alone).values()):
        for role, figures in a.fp8_stats().items():
            for key, value in figures.items():
                assert torch.equal(value, b.fp8_stats()[role][key]), (name, role, key)
    # Evaluation (no grad, nothing recorded) shares too, with the same bytes.
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = []
    for model in (shared, alone):
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), fp8_plugin.autocast():
            logits.append(model(input_ids=ids).logits)
    assert torch.equal(logits[0], logits[1])
    # k, v and up took the cast of q's and gate's input; the others cast their own.
    followers = {name.rsplit(".", 1)[1] for name, m in _fp8_layers(shared).items()
                 if m.fp8_state.input_source is not m.fp8_state}
    assert followers == {"k_proj", "v_proj", "up_proj"}


def test_each_input_is_cast_and_saved_once_in_e4m3():
    model = _converted("delayed", False)
    saved = {}

    def pack(t: torch.Tensor):
        if t.dtype == torch.float8_e4m3fn:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 64, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8_plugin.autocast():
            loss = model(input_ids=ids, labels=ids).loss
    gemms = {"n": 0}
    gemm = fp8_plugin.modules.linear_function.fp8_gemm

    def counting(*args, **kwargs):
        gemms["n"] += 1
        return gemm(*args, **kwargs)

    fp8_plugin.modules.linear_function.fp8_gemm = counting
    try:
        loss.backward()
    finally:
        fp8_plugin.modules.linear_function.fp8_gemm = gemm
    assert gemms["n"] == 2 * 7 * LAYERS  # dgrad and wgrad of every layer ran in FP8
    weights = LAYERS * (H * H + 2 * H * KV + H * H + 2 * H * I + I * H)  # columnwise copies, for dgrad
    inputs = LAYERS * TOKENS * (H + H + H + I)  # q/k/v's, o's, gate/up's, down's: 4 casts, not 7
    assert sum(saved.values()) == weights + inputs
    assert shared_input._kept.cast is None  # dropped when the autocast exited


def test_activation_checkpointing_recomputes_the_shared_casts_bit_for_bit():
    base = _llama()
    shared, alone = _converted("delayed", False, base), _converted("delayed", True, base)
    assert _train(shared, 3, checkpointing=True) == _train(alone, 3, checkpointing=True)
    _assert_same_model(shared, alone)


def test_a_follower_given_a_tensor_of_its_own_takes_the_shared_row_back():
    base = _llama()
    shared, alone = _converted("delayed", False, base), _converted("delayed", True, base)
    _train(shared, 3)
    _train(alone, 3)
    k_shared = shared.model.layers[0].self_attn.k_proj
    k_alone = alone.model.layers[0].self_attn.k_proj
    assert k_shared.fp8_state.input_source is shared.model.layers[0].self_attn.q_proj.fp8_state
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(5)) * 3
    outs = []
    for layer in (k_shared, k_alone):
        with fp8_plugin.autocast():
            outs.append(layer(x.clone().requires_grad_()))
    assert torch.equal(outs[0], outs[1])  # cast with the scale its own history gives
    assert k_shared.fp8_state.input_source is k_shared.fp8_state
    # Its own row again: the shared history, with this cast's amax recorded into it.
    assert torch.equal(k_shared.fp8_state.amax_history[INPUT], k_alone.fp8_state.amax_history[INPUT])
    assert k_shared.fp8_state.amax_history[INPUT, 0] == x.abs().max()
    assert INPUT in k_shared.fp8_state.pending


def test_an_input_changed_in_place_between_two_layers_is_cast_again():
    first, second = (fp8_plugin.FP8Linear(H, H, recipe=fp8_plugin.Float8CurrentScaling()) for _ in range(2))
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(2))
    with fp8_plugin.autocast():
        first(x)
        x.mul_(4)
        second(x)
    assert second.fp8_state.input_source is second.fp8_state
    assert second.fp8_state.amax_history[INPUT, 0] == x.abs().max()  # the changed tensor's amax
    with fp8_plugin.autocast():
        first(x)
        second(x)
    assert second.fp8_state.input_source is first.fp8_state


def test_a_copy_of_a_follower_stands_alone_with_the_shared_row():
    model = _converted("delayed", False)
    _train(model, 2)
    attention = model.model.layers[0].self_attn
    twin = copy.deepcopy(attention.v_proj)
    assert twin.fp8_state.input_source is twin.fp8_state
    assert torch.equal(twin.fp8_state.amax_history[INPUT], attention.q_proj.fp8_state.amax_history[INPUT])
    assert torch.equal(twin.fp8_state.scale[INPUT], attention.q_proj.fp8_state.scale[INPUT])
    # A whole model copied: each copied layer alone at first, sharing again within the copy
    # from its next forward.
    clone = copy.deepcopy(model)
    attention = clone.model.layers[0].self_attn
    assert attention.v_proj.fp8_state.input_source is attention.v_proj.fp8_state
    _train(clone, 1)
    assert attention.v_proj.fp8_state.input_source is attention.q_proj.fp8_state


def test_a_checkpoint_of_a_sharing_model_resumes_bit_for_bit():
    base = _llama()
    trained = _converted("delayed", False, base)
    _train(trained, 2)
    resumed = _converted("delayed", False, base)
    resumed.load_state_dict(trained.state_dict())
    assert _train(trained, 2, seed=9) == _train(resumed, 2, seed=9)
    _assert_same_model(trained, resumed)


def test_inference_mode_casts_each_layer_alone_and_keeps_nothing():
    base = _llama()
    shared, alone = _converted("current", False, base), _converted("current", True, base)
    ids = torch.randint(0, 64, (2, 16))
    outs = []
    for model in (shared, alone):
        with torch.inference_mode(), fp8_plugin.autocast():
            outs.append(model(input_ids=ids).logits)
            assert shared_input._kept.cast is None  # an inference tensor has no version to check
    assert torch.equal(outs[0], outs[1])
