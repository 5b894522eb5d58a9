"""fp8_plugin/modules/convert.py: the Hugging Face layer swap on BERT, GPT-2 and Llama configs."""

import copy
from collections import OrderedDict

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
    """A subclass that adds nothing: it computes as nn.Linear, and is swapped only on request."""


class _StatefulSubclass(nn.Linear):
    """nn.Linear's forward, but a buffer of its own that an FP8Linear would drop."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("mask", torch.ones(16))


def _reasons(report):
    return {d.name: d.reason for d in report.layers}


def test_subclasses_with_their_own_forward_stay_and_compute_as_before():
    from transformers.models.falcon.modeling_falcon import FalconLinear

    # FalconLinear is on the known-equivalent list only without a bias (test_equivalent_subclasses.py).
    model = nn.ModuleDict({"plain": nn.Linear(16, 16), "scaled": _ScaledLinear(16, 16),
                           "falcon": FalconLinear(16, 16, bias=True)})
    x = torch.randn(4, 16)
    before = {k: model[k](x) for k in ("scaled", "falcon")}
    report = fp.convert_model(model)
    assert _reasons(report) == {
        "plain": "",
        "scaled": "subclass _ScaledLinear of nn.Linear with its own forward",
        "falcon": "subclass FalconLinear of nn.Linear with its own forward (equal to nn.Linear only without a "
                  "bias: with one it rounds x @ W^T before adding the bias, nn.Linear rounds once)",
    }
    assert type(model["scaled"]) is _ScaledLinear and type(model["falcon"]) is FalconLinear
    assert isinstance(model["plain"], FP8Linear)
    with fp.autocast():
        for k, y in before.items():
            assert torch.equal(model[k](x), y), k
    # The opt-in never covers a forward of their own.
    again = fp.convert_model(model, allow_subclasses=True)
    assert {d.name for d in again.skipped} == {"scaled", "falcon"}


def test_equivalent_subclass_is_swapped_only_with_allow_subclasses():
    model = nn.ModuleDict({"plain_subclass": _PlainSubclass(16, 16), "stateful": _StatefulSubclass(16, 16)})
    x = torch.randn(4, 16)
    expected = torch.nn.functional.linear(x, model["plain_subclass"].weight, model["plain_subclass"].bias)
    with pytest.warns(UserWarning, match="no layer to run in FP8"):
        report = fp.convert_model(model)
    assert _reasons(report) == {
        "plain_subclass": "subclass _PlainSubclass of nn.Linear (allow_subclasses=True swaps it)",
        "stateful": "subclass _StatefulSubclass of nn.Linear with state of its own (mask)",
    }
    report = fp.convert_model(model, allow_subclasses=True)
    assert [d.name for d in report.swapped] == ["plain_subclass"]
    assert isinstance(model["plain_subclass"], FP8Linear) and type(model["stateful"]) is _StatefulSubclass
    assert torch.equal(model["plain_subclass"](x), expected)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_allow_subclasses_must_be_a_bool(value):
    with pytest.raises(TypeError, match=rf"allow_subclasses={value!r} is not valid; valid: True, False"):
        fp.convert_model(nn.Linear(16, 16), allow_subclasses=value)


def _forward_hook(layer, calls):
    layer.register_forward_hook(lambda *args: calls.append("hook"))


def _forward_pre_hook(layer, calls):
    layer.register_forward_pre_hook(lambda *args: calls.append("hook"))


def _full_backward_hook(layer, calls):
    layer.register_full_backward_hook(lambda *args: calls.append("hook"))


def _instance_forward(layer, calls):
    original = layer.forward

    def forward(x):
        calls.append("hook")
        return original(x)

    layer.forward = forward


def _accelerate_hook(layer, calls):
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append("hook")
            return args, kwargs

    add_hook_to_module(layer, Counting())  # sets _hf_hook, _old_forward and an instance forward


@pytest.mark.parametrize("install, what", [
    (_forward_hook, "forward_hooks"),
    (_forward_pre_hook, "forward_pre_hooks"),
    (_full_backward_hook, "backward_hooks"),
    (_instance_forward, "forward replaced on the instance"),
    (_accelerate_hook, "forward replaced on the instance, Accelerate _hf_hook"),
])
def test_layers_with_hooks_stay_and_their_hooks_keep_firing(install, what):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    calls = []
    install(model[0], calls)
    report = fp.convert_model(model)
    assert _reasons(report) == {"0": f"has forward/backward hooks ({what})", "1": ""}
    assert type(model[0]) is nn.Linear and isinstance(model[1], FP8Linear)
    with fp.autocast():
        model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert calls == ["hook"]


def test_multihead_attention_out_proj_stays_and_is_not_reported_as_fp8():
    attn = nn.MultiheadAttention(16, 2)
    shared = nn.Linear(16, 16)
    attn2 = nn.MultiheadAttention(16, 2)
    attn2.out_proj = shared  # a plain nn.Linear, reached first under another name
    model = nn.ModuleDict({"plain": nn.Linear(16, 16), "shared": shared, "attn": attn, "attn2": attn2})
    reason = "used by nn.MultiheadAttention without its forward"
    report = fp.convert_model(model)
    assert _reasons(report) == {"plain": "", "shared": reason, "attn.out_proj": reason}
    # out_proj is a NonDynamicallyQuantizableLinear, which the opt-in would otherwise swap.
    again = fp.convert_model(model, allow_subclasses=True)
    assert _reasons(again) == {"plain": "already FP8", "shared": reason, "attn.out_proj": reason}
    assert not isinstance(attn.out_proj, FP8Linear) and type(model["shared"]) is nn.Linear
    assert attn2.out_proj is model["shared"]
    x = torch.randn(5, 2, 16)
    with count_fp8_gemms() as gemms, fp.autocast():
        attn(x, x, x)[0].sum().backward()
    assert gemms.count == 0


def test_a_lazy_layer_is_left_to_materialize_and_train():
    model = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 16))
    report = fp.convert_model(model)
    assert _reasons(report) == {"0": "lazy layer (parameters not initialized)", "2": ""}
    with fp.autocast():
        model(torch.randn(4, 8)).sum().backward()
    assert type(model[0]) is nn.Linear and isinstance(model[2], FP8Linear)


def test_only_the_exact_transformers_conv1d_is_swapped():
    class WideConv1D(Conv1D):
        pass

    foreign = type("Conv1D", (nn.Module,), {"forward": lambda self, x: x @ self.weight})()
    foreign.nf, foreign.weight = 16, nn.Parameter(torch.randn(16, 16))
    model = nn.ModuleDict({"exact": Conv1D(16, 16), "subclass": WideConv1D(16, 16), "foreign": foreign})
    report = fp.convert_model(model, allow_subclasses=True)
    reasons = _reasons(report)
    assert reasons["exact"] == "" and isinstance(model["exact"], FP8Linear)
    assert reasons["subclass"] == "subclass WideConv1D of Conv1D (only the exact Conv1D is swapped)"
    assert reasons["foreign"] == f"{__name__}.Conv1D is not transformers' Conv1D"
    assert type(model["subclass"]) is WideConv1D and model["foreign"] is foreign


def test_report_names_the_layer_types_it_skipped():
    model = nn.ModuleDict({
        "a": _ScaledLinear(16, 16), "b": _ScaledLinear(16, 16), "lazy": nn.LazyLinear(16),
        "odd": nn.Linear(16, 10), "plain": nn.Linear(16, 16),
    })
    report = fp.convert_model(model)
    assert report.skipped_types == {"_ScaledLinear": 2, "LazyLinear": 1}
    assert "skipped layer types: LazyLinear (1), _ScaledLinear (2)" in str(report)


def falcon(**config):
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          vocab_size=VOCAB, bias=True, **config))


FALCON_ARCHITECTURES = {
    "falcon-7b": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True),
    "falcon-40b": dict(new_decoder_architecture=True, num_kv_heads=2),
}


@pytest.mark.parametrize("architecture", FALCON_ARCHITECTURES)
def test_falcon_keeps_its_falcon_linear_layers_and_trains_as_before(architecture):
    # FalconLinear computes x @ W.T + b in its own forward, rounding twice: with a bias it stays
    # (off the known-equivalent list, test_equivalent_subclasses.py), with the reason in the
    # report, and training under the FP8 autocast is the unconverted model's, bit for bit.
    from transformers.models.falcon.modeling_falcon import FalconLinear

    model = falcon(**FALCON_ARCHITECTURES[architecture])
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="no layer to run in FP8"):
        report = fp.convert_model(model)
    falcon_rows = [d for d in report.layers if d.kind == "FalconLinear"]
    assert len(falcon_rows) == 8
    assert all(d.reason.startswith("subclass FalconLinear of nn.Linear with its own forward (equal to nn.Linear "
                                   "only without a bias") for d in falcon_rows)
    assert report.skipped_types == {"FalconLinear": 8}
    assert sum(type(m) is FalconLinear for m in model.modules()) == 8
    ids = torch.randint(1, VOCAB, (2, 16))
    fp8 = train_losses(model, True, steps=2, input_ids=ids, labels=ids)
    assert fp8 == train_losses(ref, False, steps=2, input_ids=ids, labels=ids)


@pytest.mark.parametrize("architecture", FALCON_ARCHITECTURES)
def test_tiny_falcon_trains_two_steps_with_its_head_in_fp8(architecture):
    model = falcon(tie_word_embeddings=False, **FALCON_ARCHITECTURES[architecture])
    ref = copy.deepcopy(model)
    report = fp.convert_model(model, include=["*"])  # every layer that may be swapped: here the head
    assert [d.name for d in report.swapped] == ["lm_head"]
    ids = torch.randint(1, VOCAB, (2, 16))
    fp8 = train_losses(model, True, steps=2, input_ids=ids, labels=ids)  # 3 FP8 GEMMs per step
    base = train_losses(ref, False, steps=2, input_ids=ids, labels=ids)
    for a, b in zip(base, fp8):
        assert abs(a - b) / a < 0.05, (base, fp8)


def test_peft_lora_adapters_stay_high_precision_and_out_of_the_adapter_file(tmp_path):
    import warnings

    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    model = get_peft_model(llama(), LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    report = fp.convert_model(model)
    reasons = _reasons(report)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert reasons[f"{q}.lora_A.default"] == "PEFT adapter layer (lora_A)"
    assert reasons[f"{q}.lora_B.default"] == "PEFT adapter layer (lora_B)"
    assert reasons[f"{q}.base_layer"] == ""
    assert reasons["base_model.model.model.layers.0.self_attn.k_proj"] == ""
    adapters = {n: m for n, m in model.named_modules() if ".lora_A.default" in n or ".lora_B.default" in n}
    assert len(adapters) == 8 and all(type(m) is nn.Linear for m in adapters.values())
    assert all(not d.swapped for d in report.layers if d.name in adapters)
    assert isinstance(model.get_submodule(q).base_layer, FP8Linear)
    ids = torch.randint(1, VOCAB, (2, 16))
    with count_fp8_gemms() as gemms:
        with fp.autocast():
            model(input_ids=ids, labels=ids).loss.backward()
    # 14 base layers: forward, and dgrad except for the 3 first-layer projections, whose input
    # (from the frozen embeddings) needs no gradient; no wgrad for frozen base weights.
    assert gemms.count == 14 + 11
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert len(saved) == 8 and all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert not any("fp8" in k or "extra_state" in k for k in saved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = PeftModel.from_pretrained(llama(), tmp_path)
    assert not [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, fresh.get_parameter(name)), name


def test_peft_modules_to_save_copies_stay_high_precision():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(bert(), LoraConfig(r=16, target_modules=["query"], modules_to_save=["intermediate.dense"]))
    report = fp.convert_model(model, include=["*"])
    dense = "base_model.model.bert.encoder.layer.0.intermediate.dense"
    reasons = _reasons(report)
    assert reasons[f"{dense}.modules_to_save.default"] == "PEFT adapter layer (modules_to_save)"
    assert reasons[f"{dense}.original_module"] == "PEFT adapter layer (original_module)"
    assert type(model.get_submodule(f"{dense}.modules_to_save.default")) is nn.Linear
    assert not any(isinstance(m, FP8Linear) for n, m in model.named_modules() if "lora_" in n)
    assert isinstance(model.get_submodule("base_model.model.bert.encoder.layer.0.output.dense"), FP8Linear)


def _sized_model() -> nn.Module:
    # (K, N) around torchao's H100 thresholds for one scale per tensor: FP8 loses when
    # K <= 4096 and N <= 1024.
    return nn.Sequential(OrderedDict(
        small=nn.Linear(4096, 1024), wide_k=nn.Linear(4112, 1024), wide_n=nn.Linear(1024, 1040), tiny=nn.Linear(64, 64),
    ))  # fmt: skip


def test_small_layers_stay_high_precision_where_fp8_cannot_be_faster():
    model = _sized_model()
    report = fp.convert_model(model, fp.DelayedScaling(), skip_small=True)
    reasons = {d.name: d.reason for d in report.layers}
    assert reasons == {"small": "too small for FP8 to be faster on cpu (skip_small)", "wide_k": "", "wide_n": "",
                       "tiny": "too small for FP8 to be faster on cpu (skip_small)"}
    assert isinstance(model.wide_k, fp.FP8Linear) and type(model.small) is nn.Linear


def test_skip_small_is_off_on_a_cpu_by_default_and_overridable():
    model = _sized_model()
    fp.convert_model(model, fp.DelayedScaling())  # "auto" on a CPU: FP8 runs for its numerics
    assert all(isinstance(m, fp.FP8Linear) for m in model)
    model = _sized_model()
    report = fp.convert_model(model, fp.DelayedScaling(), skip_small=True, include=["tiny", "wide_n"])
    assert {d.name for d in report.layers if d.swapped} == {"tiny", "wide_n"}  # include wins over size
    model = _sized_model()
    fp.convert_model(model, fp.DelayedScaling(), skip_small=lambda k, n: k * n < 4_200_000)
    assert [type(m).__name__ for m in model] == ["Linear", "FP8Linear", "Linear", "Linear"]
    with pytest.raises(TypeError, match="skip_small='yes' is not valid; valid: 'auto', True, False"):
        fp.convert_model(_sized_model(), skip_small="yes")


def test_block_recipes_need_larger_layers_than_per_tensor_scaling():
    # torchao's H100 thresholds for finer scales: FP8 loses when N <= 2048, K <= 1024, or
    # N <= 4096 and K <= 2048.
    mx = fp.MXFP8BlockScaling()
    assert fp.too_small_for_fp8(2048, 4096, mx) and not fp.too_small_for_fp8(2064, 4096, mx)
    assert fp.too_small_for_fp8(8192, 2048, mx) and fp.too_small_for_fp8(1024, 8192, mx)
    assert not fp.too_small_for_fp8(4112, 1024) and fp.too_small_for_fp8(4112, 1024, fp.Float8BlockScaling())
