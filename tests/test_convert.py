"""fp8_plugin/convert.py: the Hugging Face layer swap on BERT, GPT-2 and Llama configs."""

import copy

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.pytorch_utils import Conv1D

import fp8_plugin as fp
from fp8_plugin import FP8Linear
from reference import count_fp8_gemms, train_losses

VOCAB = 128


def bert():
    return BertForSequenceClassification(
        BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                   vocab_size=VOCAB, num_labels=3, max_position_embeddings=64)
    )


def gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def llama():
    return LlamaForCausalLM(
        LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
                    bos_token_id=0, eos_token_id=0, pad_token_id=0)
    )


def test_swap_reuses_parameter_objects_and_keeps_state_dict_keys():
    model = llama()
    before = dict(model.named_parameters())
    keys = set(model.state_dict())
    report = fp.convert_model(model)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(before[k] is after[k] for k in before)
    assert {k for k in model.state_dict() if ".fp8_state." not in k} == keys
    assert isinstance(model.model.layers[0].self_attn.q_proj, FP8Linear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    assert not isinstance(model.lm_head, FP8Linear)
    assert len(report.swapped) == 14 and [d.name for d in report.skipped] == ["lm_head"]


def test_default_skips_heads_and_odd_dims_and_report_says_why():
    model = bert()
    model.bert.encoder.layer[0].intermediate.dense = nn.Linear(64, 100)
    model.bert.encoder.layer[0].output.dense = nn.Linear(100, 64)
    report = fp.convert_model(model)
    reasons = {d.name: d.reason for d in report.skipped}
    assert reasons["classifier"] == "output head ('classifier')"
    assert reasons["bert.pooler.dense"] == "output head ('pooler')"
    assert reasons["bert.encoder.layer.0.intermediate.dense"] == "dims not multiples of 16"
    text = str(report)
    assert "classifier" in text and "10 of 14 linear layers in FP8" in text


def test_include_and_exclude_patterns():
    model = llama()
    report = fp.convert_model(model, include=["*.mlp.*", "lm_head"], exclude="down_proj")
    swapped = {d.name for d in report.swapped}
    assert "lm_head" in swapped  # an explicit include overrides the head rule
    assert "model.layers.0.mlp.up_proj" in swapped
    assert "model.layers.0.mlp.down_proj" not in swapped
    assert "model.layers.0.self_attn.q_proj" not in swapped


def test_tied_lm_head_stays_high_precision_even_when_named_otherwise():
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    report = fp.convert_model(model)
    assert not isinstance(model.lm_head, FP8Linear)
    assert "lm_head" in {d.name for d in report.skipped}


def test_nothing_to_swap_warns():
    model = nn.Sequential(nn.Linear(10, 3))
    with pytest.warns(UserWarning, match="no layer to run in FP8"):
        fp.convert_model(model)


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="backend='te'.*native"):
        fp.convert_model(nn.Linear(16, 16), backend="te")
    with pytest.raises(TypeError, match="not a recipe"):
        fp.convert_model(nn.Linear(16, 16), recipe="hybrid")


def test_conv1d_swap_is_exact_outside_fp8_and_matches_linear_inside():
    conv = Conv1D(48, 32)  # nf=48 outputs, nx=32 inputs; weight [32, 48]
    nn.init.normal_(conv.weight)
    nn.init.normal_(conv.bias)
    layer = FP8Linear.from_module(conv)
    assert layer.weight is conv.weight and layer.weight.shape == (32, 48)
    x = torch.randn(2, 5, 32)
    assert torch.equal(layer(x), conv(x))
    # Inside FP8 it must equal an nn.Linear holding the transposed weight.
    lin = nn.Linear(32, 48)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    ref = FP8Linear.from_module(lin)
    xg = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    with fp.autocast():
        y, yr = layer(xg), ref(xr)
    torch.testing.assert_close(y, yr, rtol=0, atol=0)
    y.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(layer.weight.grad, lin.weight.grad.t(), rtol=0, atol=0)
    torch.testing.assert_close(xg.grad, xr.grad, rtol=0, atol=0)


@pytest.mark.parametrize("build", [gpt2, bert, llama])
def test_save_pretrained_writes_a_vanilla_checkpoint(build, tmp_path):
    model = build()
    fp.convert_model(model)
    ids = torch.randint(1, VOCAB, (2, 16))
    with fp.autocast():
        model(ids)
    model.save_pretrained(tmp_path)
    loaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for name, p in model.named_parameters():
        assert torch.equal(p, loaded.get_parameter(name)), name
    assert not any(isinstance(m, FP8Linear) for m in loaded.modules())


@pytest.mark.parametrize("build", [gpt2, bert, llama])
def test_few_training_steps_track_the_unconverted_model(build):
    torch.manual_seed(0)
    ref = build()
    model = copy.deepcopy(ref)
    fp.convert_model(model)
    ids = torch.randint(1, VOCAB, (8, 32))
    labels = torch.randint(0, 3, (8,)) if build is bert else ids

    base = train_losses(ref, False, input_ids=ids, labels=labels)
    fp8 = train_losses(model, True, input_ids=ids, labels=labels)
    assert fp8[-1] < fp8[0]
    for a, b in zip(base, fp8):
        assert abs(a - b) / a < 0.05, (base, fp8)


class _ScaledLinear(nn.Linear):
    """A subclass that computes differently (like transformers' FalconLinear or bitsandbytes)."""

    def forward(self, x):
        return super().forward(x) * 2


class _PlainSubclass(nn.Linear):
    """A subclass that adds nothing: proven equivalent, converted only on request."""


def test_only_layers_whose_swap_cannot_change_the_model_are_swapped():
    model = nn.ModuleDict({
        "plain": nn.Linear(16, 16),
        "own_forward": _ScaledLinear(16, 16),
        "subclass": _PlainSubclass(16, 16),
        "lazy": nn.LazyLinear(16),
        "attn": nn.MultiheadAttention(16, 2),
        "hooked": nn.Linear(16, 16),
        "accelerate_style": nn.Linear(16, 16),
    })
    calls = []
    model["hooked"].register_forward_hook(lambda *args: calls.append("hook"))
    model["accelerate_style"].forward = model["accelerate_style"].forward  # as add_hook_to_module does
    x = torch.randn(4, 16)
    before = {k: model[k](x) for k in ("own_forward", "hooked")}
    report = fp.convert_model(model)
    reasons = {d.name: d.reason for d in report.layers}
    assert reasons["plain"] == "" and isinstance(model["plain"], FP8Linear)
    assert reasons["own_forward"] == "subclass _ScaledLinear of Linear with its own forward"
    assert reasons["subclass"] == "subclass _PlainSubclass of Linear (allow_subclasses=True converts it)"
    assert reasons["lazy"] == "lazy layer (parameters not initialized)"
    assert reasons["attn.out_proj"] == "used by nn.MultiheadAttention without its forward"
    assert reasons["hooked"] == "has hooks (forward_hooks) the FP8 layer would not carry"
    assert reasons["accelerate_style"] == "has hooks (forward replaced on the instance) the FP8 layer would not carry"
    assert [d.name for d in report.swapped] == ["plain"]
    # The skipped layers compute as before, and the hook still fires.
    calls.clear()
    for k, y in before.items():
        assert torch.equal(model[k](x), y), k
    assert calls == ["hook"]
    # The opt-in converts the equivalent subclass only.
    again = fp.convert_model(model, allow_subclasses=True)
    assert {d.name for d in again.swapped} == {"plain", "subclass"}
    with pytest.raises(TypeError, match="allow_subclasses='yes'"):
        fp.convert_model(model, allow_subclasses="yes")


def test_a_lazy_layer_is_left_to_materialize_and_train():
    model = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 16))
    fp.convert_model(model)
    with fp.autocast():
        model(torch.randn(4, 8)).sum().backward()
    assert type(model[0]) is nn.Linear and isinstance(model[2], FP8Linear)


def test_falcon_keeps_its_falcon_linear_layers_and_computes_as_before():
    # FalconLinear computes x @ W.T (+ b) in its own forward: swapping it changed the model and
    # failed in training. It stays, with the reason in the report.
    from transformers import FalconConfig, FalconForCausalLM
    from transformers.models.falcon.modeling_falcon import FalconLinear

    torch.manual_seed(0)
    model = FalconForCausalLM(FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                                           new_decoder_architecture=False, bias=True))
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="no layer to run in FP8"):
        report = fp.convert_model(model)
    falcon = [d for d in report.layers if d.kind == "FalconLinear"]
    assert len(falcon) == 8 and all(d.reason == "subclass FalconLinear of Linear with its own forward" for d in falcon)
    assert sum(type(m) is FalconLinear for m in model.modules()) == 8
    ids = torch.randint(1, VOCAB, (2, 16))
    assert train_losses(model, True, steps=2, input_ids=ids, labels=ids) == train_losses(
        ref, False, steps=2, input_ids=ids, labels=ids)


def test_peft_adapters_stay_high_precision_and_out_of_the_adapter_file(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(llama(), LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    report = fp.convert_model(model)
    reasons = {d.name: d.reason for d in report.layers}
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert reasons[f"{q}.lora_A.default"] == "PEFT adapter layer (lora_A)"
    assert reasons[f"{q}.lora_B.default"] == "PEFT adapter layer (lora_B)"
    assert reasons[f"{q}.base_layer"] == ""
    layer = model.get_submodule(q)
    assert isinstance(layer.base_layer, FP8Linear) and type(layer.lora_A["default"]) is nn.Linear
    ids = torch.randint(1, VOCAB, (2, 16))
    with count_fp8_gemms() as gemms:
        with fp.autocast():
            model(input_ids=ids, labels=ids).loss.backward()
    # 14 base layers: forward, and dgrad except for the 3 first-layer projections, whose input
    # (from the frozen embeddings) needs no gradient; no wgrad for frozen base weights.
    assert gemms.count == 14 + 11
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and not any("fp8_state" in k for k in saved)
    fresh = PeftModel.from_pretrained(llama(), tmp_path)
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, fresh.get_parameter(name)), name
