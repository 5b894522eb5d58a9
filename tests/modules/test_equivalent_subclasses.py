"""Equivalent subclasses (fp8_plugin/modules/equivalents.py): layer classes that override
``forward`` but compute exactly what ``nn.Linear`` computes are swapped by ``convert_model``.

Each entry of the list is checked here bit for bit against ``nn.Linear`` on the installed
library (same weights; several shapes and dtypes; forward and both gradients), so an update of
that library that changes the class's forward fails here before it changes a model.
"""

import copy

import pytest
import torch
from torch import nn
from transformers import FalconConfig, FalconForCausalLM
from transformers.models.falcon.modeling_falcon import FalconLinear

import fp8_plugin as fp
from fp8_plugin import FP8Linear
from fp8_plugin.modules.equivalents import EQUIVALENT_LINEARS, equivalent_linear_reason
from reference import count_fp8_gemms, train_losses

VOCAB = 128
SHAPES = [(4, 16), (1, 48), (130, 64), (3, 5, 64), (2, 7, 33, 48)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def falcon(**kwargs):
    config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return FalconForCausalLM(FalconConfig(**{**config, **kwargs}))


# Falcon-7B and Falcon-40B layouts; both without biases, as their configs (and the default).
FALCON_ARCHITECTURES = {
    "falcon-7b": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True),
    "falcon-40b": dict(new_decoder_architecture=True, num_kv_heads=2),
}


@pytest.mark.parametrize("architecture", FALCON_ARCHITECTURES)
def test_falcon_trains_with_its_linear_layers_in_fp8(architecture):
    torch.manual_seed(0)
    model = falcon(**FALCON_ARCHITECTURES[architecture])
    assert model.config.bias is False
    report = fp.convert_model(model)
    # 2 blocks x (query_key_value, dense, dense_h_to_4h, dense_4h_to_h), all FalconLinear; the
    # lm_head (tied to the embedding) stays.
    fp8_layers = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert len(fp8_layers) == 8, report
    assert [d.name for d in report.skipped] == ["lm_head"]
    assert {d.kind for d in report.swapped} == {"FalconLinear"}
    ids = torch.randint(1, VOCAB, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with count_fp8_gemms() as gemms:
        for _ in range(2):
            with fp.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert gemms.count == 2 * 3 * 8  # forward, dgrad, wgrad of each layer, each step


@pytest.mark.parametrize("architecture", FALCON_ARCHITECTURES)
def test_the_swap_keeps_falcon_computing_as_before_outside_fp8(architecture):
    torch.manual_seed(0)
    ref = falcon(**FALCON_ARCHITECTURES[architecture])
    model = copy.deepcopy(ref)
    fp.convert_model(model)
    ids = torch.randint(1, VOCAB, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    # Training with FP8 off: the unconverted model's losses, bit for bit.
    assert train_losses(model, False, steps=2, input_ids=ids, labels=ids) == train_losses(
        ref, False, steps=2, input_ids=ids, labels=ids)


def _pair(cls, k: int, n: int, bias: bool, dtype: torch.dtype):
    ref = nn.Linear(k, n, bias=bias, dtype=dtype)
    layer = cls(k, n, bias=bias, dtype=dtype)
    layer.load_state_dict(ref.state_dict())
    return ref, layer


@pytest.mark.parametrize("entry", EQUIVALENT_LINEARS, ids=lambda e: e.qualname.rpartition(".")[2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_listed_class_computes_as_nn_linear_bit_for_bit(entry, dtype):
    cls = entry.load()
    assert cls is not None, f"{entry.qualname} no longer exists"
    for bias in (False, True):
        for shape in SHAPES:
            ref, layer = _pair(cls, shape[-1], 32, bias, dtype)
            if entry.condition(layer):  # the entry's own condition refuses this instance
                assert bias, f"{entry.qualname} refused without a bias: {entry.condition(layer)}"
                continue
            x = torch.randn(*shape, dtype=dtype)
            for inputs in (x, x.transpose(-1, -2).contiguous().transpose(-1, -2)):  # non-contiguous too
                a, b = inputs.clone().requires_grad_(), inputs.clone().requires_grad_()
                y_ref, y = ref(a), layer(b)
                assert torch.equal(y, y_ref), (shape, bias)
                g = torch.randn_like(y)
                y_ref.backward(g)
                y.backward(g)
                assert torch.equal(b.grad, a.grad), (shape, bias)
                assert torch.equal(layer.weight.grad, ref.weight.grad), (shape, bias)
                ref.zero_grad(), layer.zero_grad()


def test_falcon_linear_with_a_bias_rounds_twice_and_is_refused():
    # FalconLinear adds its bias after rounding x @ W^T to the input dtype; nn.Linear (addmm)
    # rounds x @ W^T + b once. A hand-made bfloat16 case (8 significant bits, so the spacing
    # just above 1 is 2^-7) where the two differ: x @ W^T = 1 + 2^-8 (a tie, rounds to even: 1),
    # b = 2^-8. Once: 1 + 2^-7, exact in bfloat16. Twice: round(1 + 2^-8) = 1 again.
    layer = FalconLinear(2, 1, bias=True, dtype=torch.bfloat16)
    ref = nn.Linear(2, 1, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        for m in (layer, ref):
            m.weight.copy_(torch.tensor([[1.0, 2.0**-8]]))
            m.bias.fill_(2.0**-8)
    x = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    assert ref(x).item() == 1 + 2.0**-7
    assert layer(x).item() == 1.0
    assert "bias" in equivalent_linear_reason(layer)
    model = nn.ModuleDict({"plain": nn.Linear(16, 16), "biased": FalconLinear(16, 16, bias=True),
                           "unbiased": FalconLinear(16, 16, bias=False)})
    report = fp.convert_model(model)
    reasons = {d.name: d.reason for d in report.layers}
    assert reasons["plain"] == reasons["unbiased"] == ""
    assert reasons["biased"].startswith("subclass FalconLinear of nn.Linear with its own forward")
    assert "bias" in reasons["biased"]
    assert type(model["biased"]) is FalconLinear and isinstance(model["unbiased"], FP8Linear)


def test_a_subclass_of_a_listed_class_is_not_covered_by_the_entry():
    class Scaled(FalconLinear):
        def forward(self, x):
            return super().forward(x) * 2

    class Plain(FalconLinear):
        pass

    assert equivalent_linear_reason(Scaled(16, 16, bias=False)) is None
    assert equivalent_linear_reason(Plain(16, 16, bias=False)) is None
    model = nn.ModuleDict({"scaled": Scaled(16, 16, bias=False), "plain": Plain(16, 16, bias=False)})
    with pytest.warns(UserWarning, match="no layer to run in FP8"):
        report = fp.convert_model(model)
    assert all("with its own forward" in d.reason for d in report.layers)
