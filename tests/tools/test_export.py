"""fp8_plugin/tools/export.py: vanilla and fine-grained FP8 Hugging Face checkpoints, loaded back by transformers."""

import contextlib
import json
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    FineGrainedFP8Config,
    GPT2Config,
    GPT2LMHeadModel,
)

import fp8_plugin as fp
from fp8_plugin import FP8Linear
from fp8_plugin.modules.experts import FP8ExpertsMixin, expert_gemm_counts
from fp8_plugin.tools.data import minilm_path
from fp8_plugin.tools.export import export

VOCAB = 128
E4M3_MAX = 448.0
# E4M3: 3 mantissa bits, so round-to-nearest is off by at most 2^-4 relative for normal values;
# below the smallest normal (2^-6) the spacing is 2^-9, so at most 2^-10 absolute (before
# unscaling).
E4M3_REL = 2.0**-4
E4M3_SUBNORMAL_ABS = 2.0**-10


def bert(hidden=256, intermediate=384):
    # 256 x 384: weight scale grids of 2x2, 3x2 and 2x3 blocks.
    return BertForSequenceClassification(
        BertConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=intermediate,
                   vocab_size=VOCAB, num_labels=3, max_position_embeddings=64)
    )


def gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def batch(model):
    ids = torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = ids if isinstance(model, GPT2LMHeadModel) else torch.tensor([0, 1, 2, 1])
    return {"input_ids": ids, "labels": labels}


def train_in_fp8(model, steps=2):
    fp.convert_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batch(model)
    for _ in range(steps):
        with fp.autocast():
            loss = model(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return data


def outputs(model, data):
    """High-precision outputs (outside fp8_plugin.modules.autocast), in eval mode."""
    model.eval()
    with torch.no_grad():
        out = model(input_ids=data["input_ids"])
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@contextlib.contextmanager
def captured_load_messages():
    """Everything transformers logs at WARNING and above (its load report of missing and
    unexpected keys among them) and every Python warning, while loading."""
    records = []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = transformers.logging.get_logger()  # the library's root logger: every module's records reach it
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()  # conftest silences transformers below ERROR
    handler = Handler(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records, caught
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)


def load_cleanly(auto_class, path, **kwargs):
    with captured_load_messages() as (records, caught):
        model, info = auto_class.from_pretrained(path, output_loading_info=True, **kwargs)
    assert records == [], records
    assert [str(w.message) for w in caught] == []
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}, model.config.to_dict()


def assert_unchanged(model, before):
    tensors, config = before
    now = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert now.keys() == tensors.keys()
    assert all(torch.equal(now[k], tensors[k]) for k in tensors)
    assert model.config.to_dict() == config
    assert not hasattr(model.config, "quantization_config")


@pytest.mark.parametrize("make, auto_class", [(bert, AutoModelForSequenceClassification), (gpt2, AutoModelForCausalLM)],
                         ids=["bert", "gpt2-conv1d"])
def test_hf_export_loads_in_vanilla_transformers_and_computes_as_the_trained_model(tmp_path, make, auto_class):
    model = make()
    data = train_in_fp8(model)
    fp8_layers = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert fp8_layers
    expected = outputs(model, data)
    before = snapshot(model)

    out = export(model, tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"
    assert_unchanged(model, before)
    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == len(fp8_layers)

    saved = load_file(out / "model.safetensors")
    assert not any("fp8_state" in k for k in saved)
    assert all(v.dtype == torch.float32 for v in saved.values())
    if make is gpt2:  # Conv1D keeps its [in, out] layout
        assert saved["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)
    assert json.loads((out / "config.json").read_text()).get("quantization_config") is None

    loaded = load_cleanly(auto_class, out)
    assert type(loaded) is type(model)
    assert not any(isinstance(m, FP8Linear) for m in loaded.modules())
    for name in fp8_layers:
        original = model.get_submodule(name)
        assert type(loaded.get_submodule(name)).__name__ == ("Conv1D" if original.weight_transposed else "Linear")
    # The same weights in the same modules: bit for bit the trained model's high-precision outputs.
    assert torch.equal(outputs(loaded, data), expected)


def per_element(block_values, shape):
    """A [ceil(rows/128), ceil(cols/128)] grid spread over its blocks, in float64."""
    full = block_values.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return full[: shape[0], : shape[1]]


def expected_block_cast(weight):
    """The 128x128 blockwise E4M3 cast, computed here in float64 from the formula:
    scale = 448 / amax as a float32 (float64 division then rounding to float32 gives the correctly
    rounded float32 quotient: 53 >= 2 * 24 + 2 bits), truncated to a power of two; data =
    E4M3(clamp(W * scale, -448, 448)) (W * scale is exact: a power-of-two multiple of a float32);
    scale_inv = 1 / scale (exact). All-zero blocks get scale 1."""
    w = weight.detach().to(torch.float64)
    rows, cols = w.shape
    grid = (math.ceil(rows / 128), math.ceil(cols / 128))
    scale = torch.ones(grid, dtype=torch.float64)
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max().item()
            if amax > 0:
                quotient = float(torch.tensor(E4M3_MAX / amax, dtype=torch.float64).to(torch.float32))
                scale[i, j] = 2.0 ** (math.frexp(quotient)[1] - 1)
    data = (w * per_element(scale, w.shape)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, (1.0 / scale).to(torch.float32)


def test_hf_fp8_export_is_the_fine_grained_fp8_format_and_loads_within_fp8_error(tmp_path):
    model = bert()
    data = train_in_fp8(model)
    with torch.no_grad():
        # Blocks of different ranges: one 64x larger, one all zero (scale 1, data 0).
        w = model.bert.encoder.layer[0].intermediate.dense.weight  # [384, 256]: 3 x 2 blocks
        w[:128, :128] *= 64
        w[128:256, 128:] = 0
    fp8_layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert len(fp8_layers) == 12
    captured = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: captured.__setitem__(n, args[0].detach()))
             for n, m in fp8_layers.items()]
    expected = outputs(model, data)
    for h in hooks:
        h.remove()
    before = snapshot(model)

    path = export(model, tmp_path / "fp8", format="hf-fp8")
    assert_unchanged(model, before)

    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["bert.pooler.dense", "classifier"],
    }
    saved = load_file(path / "model.safetensors")
    hp_state = {k: v for k, v in model.state_dict().items() if "fp8_state" not in k}
    fp8_keys = {f"{n}.{s}" for n in fp8_layers for s in ("weight", "weight_scale_inv")}
    assert saved.keys() == set(hp_state) | fp8_keys
    for key, value in saved.items():
        if key not in fp8_keys:  # embeddings, norms, biases, pooler, classifier: as they were
            assert value.dtype == torch.float32 and torch.equal(value, hp_state[key]), key
    for name, layer in fp8_layers.items():
        data8, scale_inv = saved[f"{name}.weight"], saved[f"{name}.weight_scale_inv"]
        out_f, in_f = layer.out_features, layer.in_features
        assert data8.dtype == torch.float8_e4m3fn and data8.shape == (out_f, in_f)
        assert scale_inv.dtype == torch.float32 and scale_inv.shape == (math.ceil(out_f / 128), math.ceil(in_f / 128))
        want_data, want_scale_inv = expected_block_cast(layer.weight)
        assert torch.equal(data8.view(torch.uint8), want_data.view(torch.uint8)), name
        assert torch.equal(scale_inv, want_scale_inv), name
    layer0 = "bert.encoder.layer.0.intermediate.dense"
    assert saved[f"{layer0}.weight_scale_inv"][1, 1] == 1.0
    assert not saved[f"{layer0}.weight"][128:256, 128:].float().any()
    assert saved[f"{layer0}.weight_scale_inv"][0, 0] >= 32 * saved[f"{layer0}.weight_scale_inv"][2, 0]

    loaded = load_cleanly(AutoModelForSequenceClassification, path,
                          quantization_config=FineGrainedFP8Config(dequantize=True))
    for name, layer in fp8_layers.items():
        w = layer.weight.detach().double()
        wq = loaded.get_submodule(name).weight.detach().double()
        full = per_element(saved[f"{name}.weight_scale_inv"], w.shape)
        # transformers' dequantization is weight * weight_scale_inv, exact for power-of-two scales.
        assert torch.equal(wq, saved[f"{name}.weight"].double() * full), name
        # Each weight within E4M3's rounding of its scaled value, unscaled.
        assert ((wq - w).abs() <= E4M3_REL * w.abs() + E4M3_SUBNORMAL_ABS * full).all(), name
        # So each output of the layer, on the inputs it saw, within
        # sum_k |x_k| |dW_jk| <= 2^-4 sum_k |x_k| |W_jk| + 2^-10 sum_k |x_k| scale_inv_jk
        # (float64 here, so the GEMMs' own rounding is far below the bound).
        x = captured[name].double().reshape(-1, w.shape[1])
        bias = layer.bias.detach().double()
        delta = (F.linear(x, wq, bias) - F.linear(x, w, bias)).abs()
        bound = E4M3_REL * x.abs() @ w.abs().T + E4M3_SUBNORMAL_ABS * x.abs() @ full.T
        assert (delta <= bound).all(), name
    # The whole model: the worst-case bound compounds over the 8 FP8 layers in sequence and
    # through softmax and LayerNorm, and is vacuous. The rounding errors are unbiased and
    # independent (round-to-nearest of different values), so a layer's output error is a sum of
    # K >= 256 independent terms of at most 2^-4 relative each: about 2^-4 / sqrt(3) times
    # ||x|| ||w|| / sqrt(K), which is ~2^-4 / sqrt(3) of the output's size for typical x, w. The
    # 8 layers in sequence add up to sqrt(8) of that in quadrature: 2^-4 * sqrt(8 / 3) = 0.10
    # relative to the logits. The run lands at a fraction of it; a wrong scale, block layout or
    # transposition gives errors of order 1.
    got = outputs(loaded, data)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= E4M3_REL * math.sqrt(8 / 3), rel


def test_hf_fp8_export_of_an_unconverted_model_follows_convert_models_rules(tmp_path):
    # hidden 128, intermediate 192: the intermediate and output layers have a dim above 128 that
    # is not a multiple of 128 (a partial last block) and stay in high precision.
    model = bert(hidden=128, intermediate=192)
    data = batch(model)
    expected = outputs(model, data)
    before = snapshot(model)
    path = export(model, tmp_path / "fp8", format="hf-fp8")
    assert_unchanged(model, before)
    assert not any(isinstance(m, FP8Linear) for m in model.modules())

    config = json.loads((path / "config.json").read_text())["quantization_config"]
    kept = {f"bert.encoder.layer.{i}.{part}.dense" for i in range(2) for part in ("intermediate", "output")}
    assert set(config["modules_to_not_convert"]) == kept | {"bert.pooler.dense", "classifier"}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    quantized = {k[: -len(".weight_scale_inv")] for k in dtypes if k.endswith(".weight_scale_inv")}
    assert quantized == {f"bert.encoder.layer.{i}.attention.{p}" for i in range(2)
                         for p in ("self.query", "self.key", "self.value", "output.dense")}
    assert all(dtypes[f"{n}.weight"] == "F8_E4M3" for n in quantized)
    assert all(dtypes[f"{n}.weight"] == "F32" for n in kept)

    loaded = load_cleanly(AutoModelForSequenceClassification, path,
                          quantization_config=FineGrainedFP8Config(dequantize=True))
    dequantized = outputs(loaded, data)
    rel = ((dequantized - expected).norm() / expected.norm()).item()
    assert rel <= E4M3_REL * math.sqrt(8 / 3), rel  # as in the test above

    # The dequantized model exports again: "hf" is vanilla (transformers' loader left conversions
    # on it that would quantize on save), "hf-fp8" stores the same weights exactly.
    again = load_cleanly(AutoModelForSequenceClassification, export(loaded, tmp_path / "hf"))
    assert torch.equal(outputs(again, data), dequantized)
    first = load_file(path / "model.safetensors")
    second = load_file(export(loaded, tmp_path / "fp8-again", format="hf-fp8") / "model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        if key.endswith(".weight_scale_inv"):
            name = key[: -len("_scale_inv")]
            a = first[name].double() * per_element(first[key], first[name].shape)
            b = second[name].double() * per_element(second[key], second[name].shape)
            assert torch.equal(a, b), key
        elif not key.endswith(".weight") or key[: -len(".weight")] not in quantized:
            assert torch.equal(first[key], second[key]), key


def test_hf_fp8_export_refuses_a_model_with_only_conv1d_layers(tmp_path):
    model = gpt2()
    fp.convert_model(model)
    with pytest.raises(ValueError, match="format='hf-fp8'.*Conv1D.*format='hf'"):
        export(model, tmp_path / "fp8", format="hf-fp8")
    assert not (tmp_path / "fp8").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_minilm_checkpoint_exports_in_both_formats(tmp_path):
    model = AutoModel.from_pretrained(minilm_path())
    data = {"input_ids": torch.randint(1000, 30000, (2, 24), generator=torch.Generator().manual_seed(2))}
    expected = outputs(model, data)

    vanilla = load_cleanly(AutoModel, export(model, tmp_path / "hf"))
    assert torch.equal(outputs(vanilla, data), expected)

    path = export(model, tmp_path / "hf-fp8", format="hf-fp8")
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["modules_to_not_convert"] == ["pooler.dense"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        scales = [k for k in f.keys() if k.endswith("weight_scale_inv")]
        assert f.get_slice("encoder.layer.0.intermediate.dense.weight_scale_inv").get_shape() == [12, 3]
    assert len(scales) == 36  # 6 layers x (query, key, value, attention output, intermediate, output)
    quantized = load_cleanly(AutoModel, path, quantization_config=FineGrainedFP8Config(dequantize=True))
    got = outputs(quantized, data)
    # 6 layers x 4 FP8 layers in sequence: 2^-4 * sqrt(24 / 3), reasoned as for the tiny BERT.
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= E4M3_REL * math.sqrt(24 / 3), rel


def test_export_into_an_existing_folder_replaces_the_weights_and_keeps_other_files(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model-00001-of-00002.safetensors").write_text("stale")
    (folder / "model.safetensors.index.json").write_text("{}")
    model = bert(hidden=64, intermediate=128)
    export(model, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    load_cleanly(AutoModelForSequenceClassification, folder)


def test_bad_format_and_bad_model_are_refused(tmp_path):
    model = bert(hidden=64, intermediate=128)
    with pytest.raises(ValueError, match=r"format='fp8' is not valid; valid: 'hf', 'hf-fp8'"):
        export(model, tmp_path / "x", format="fp8")
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel.*torch.nn.modules.linear.Linear"):
        export(nn.Linear(4, 4), tmp_path / "x")

    class Wrapper(nn.Module):  # as a LightningModule holds its Hugging Face model
        def __init__(self):
            super().__init__()
            self.model = model

    with pytest.raises(TypeError, match="pass model.model"):
        export(Wrapper(), tmp_path / "x")
    with pytest.raises(TypeError, match="safe_serialization=1"):
        export(model, tmp_path / "x", safe_serialization=1)
    if int(transformers.__version__.split(".")[0]) >= 5:
        with pytest.raises(ValueError, match="safe_serialization=False.*safetensors only"):
            export(model, tmp_path / "x", safe_serialization=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        export(model, tmp_path / "file")
    model.is_quantized = True  # as transformers marks a model it loaded quantized
    with pytest.raises(ValueError, match="quantized by transformers.*dequantize=True"):
        export(model, tmp_path / "x")
    del model.is_quantized
    fp.convert_model(model)
    with torch.no_grad():
        model.bert.encoder.layer[1].attention.self.key.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"bert.encoder.layer.1.attention.self.key.weight holds an inf or NaN"):
        export(model, tmp_path / "x", format="hf-fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# ---------------------------------------------------------------- MoE experts in the fine-grained FP8 format

# hidden 128, expert intermediate 128: each expert's gate, up and down weights are one 128x128
# block, the gate_up_proj of transformers' FP8 experts two blocks stacked.
_MOE_COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
MOE_FAMILIES = {
    # config, the MoE block's name in checkpoints, the per-expert names of gate, up and down
    "Mixtral": (dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
                "block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen3Moe": (dict(intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                      head_dim=32, norm_topk_prob=True), "mlp", ("gate_proj", "up_proj", "down_proj")),
}


def tiny_moe(family, seed=0, **overrides):
    config = getattr(transformers, f"{family}Config")(**{**_MOE_COMMON, **MOE_FAMILIES[family][0], **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def train_moe_in_fp8(model):
    """Convert, then one FP8 training step whose expert GEMMs are counted (each experts module
    runs its two projections' fprop, dgrad and wgrad as grouped FP8 GEMMs)."""
    fp.convert_model(model)
    experts = [m for m in model.modules() if isinstance(m, FP8ExpertsMixin)]
    assert len(experts) == 2
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = expert_gemm_counts()
    with fp.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    after = expert_gemm_counts()
    assert {k: after[k] - before[k] for k in after} == {"fprop": 4, "dgrad": 4, "wgrad": 4}
    return {"input_ids": ids}


def dequantize_blocks(data, scale_inv):
    """[..., rows, cols] E4M3 times its [..., ceil(rows/128), ceil(cols/128)] grid, in float64."""
    full = scale_inv.double().repeat_interleave(128, -2).repeat_interleave(128, -1)
    return data.double() * full[..., : data.shape[-2], : data.shape[-1]]


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_hf_fp8_export_writes_moe_experts_in_fp8_and_transformers_loads_them(tmp_path, family, monkeypatch):
    model = tiny_moe(family)
    data = train_moe_in_fp8(model)
    expected = outputs(model, data)
    before = snapshot(model)
    path = export(model, tmp_path / "fp8", format="hf-fp8")
    assert_unchanged(model, before)

    _, block, (gate, up, down) = MOE_FAMILIES[family]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["modules_to_not_convert"] == ["lm_head"]  # experts are no longer listed
    saved = load_file(path / "model.safetensors")
    masters = {}
    for layer in range(2):
        experts = model.model.layers[layer].mlp.experts
        gate_up = experts.gate_up_proj.detach()  # [E, 2I, H]: gate rows, then up rows
        for e in range(4):
            for part, weight in ((gate, gate_up[e, :128]), (up, gate_up[e, 128:]),
                                 (down, experts.down_proj.detach()[e])):
                name = f"model.layers.{layer}.{block}.experts.{e}.{part}"
                masters[name] = weight
                # Each expert's weight cast as a dense layer's: bit for bit the formula's E4M3
                # data, and its [ceil(out/128), ceil(in/128)] float32 scale_inv.
                want_data, want_scale_inv = expected_block_cast(weight)
                assert saved[f"{name}.weight"].dtype == torch.float8_e4m3fn
                assert torch.equal(saved[f"{name}.weight"].view(torch.uint8), want_data.view(torch.uint8)), name
                assert saved[f"{name}.weight_scale_inv"].dtype == torch.float32
                assert torch.equal(saved[f"{name}.weight_scale_inv"], want_scale_inv), name
    written = {k for k in saved if ".experts." in k}
    assert written == {f"{n}.{s}" for n in masters for s in ("weight", "weight_scale_inv")}

    # transformers' FP8 experts hold them: weights E4M3 [E, out, in], float32 scale_inv
    # [E, ceil(out/128), ceil(in/128)] (gate_up_proj: the gate's and up's grids stacked). On a
    # CPU-only machine transformers would switch the load to dequantizing; the load itself
    # needs no GPU, so its environment check is skipped here.
    from transformers.integrations.finegrained_fp8 import FP8Experts
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    with monkeypatch.context() as patch:
        patch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None)
        fp8_model = load_cleanly(AutoModelForCausalLM, path)
    for layer in range(2):
        source, held = model.model.layers[layer].mlp.experts, fp8_model.model.layers[layer].mlp.experts
        assert isinstance(held, FP8Experts)
        shapes = {n: (tuple(p.shape), p.dtype) for n, p in held.named_parameters()}
        assert shapes == {"gate_up_proj": ((4, 256, 128), torch.float8_e4m3fn),
                          "gate_up_proj_scale_inv": ((4, 2, 1), torch.float32),
                          "down_proj": ((4, 128, 128), torch.float8_e4m3fn),
                          "down_proj_scale_inv": ((4, 1, 1), torch.float32)}
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(source, proj).detach().double()
            wq = dequantize_blocks(getattr(held, proj), getattr(held, f"{proj}_scale_inv"))
            full = dequantize_blocks(torch.ones_like(getattr(held, proj), dtype=torch.float32),
                                     getattr(held, f"{proj}_scale_inv"))
            # E4M3 keeps 3 mantissa bits: a normal value x in [2^k, 2^(k+1)) lies on a grid of
            # spacing 2^(k-3), so round-to-nearest is off by at most half of it, 2^(k-4) <= 2^-4 |x|;
            # below the smallest normal (2^-6) the spacing is 2^-9, at most 2^-10 absolute.
            # Unscaling by a power of two is exact, so per element:
            # |Wq - W| <= 2^-4 |W| + 2^-10 scale_inv.
            assert ((wq - w).abs() <= E4M3_REL * w.abs() + E4M3_SUBNORMAL_ABS * full).all(), (layer, proj)

    # Loaded dequantized (any machine): the same weights, and the model's logits within the
    # E4M3 weight rounding of the source model's high-precision ones.
    loaded = load_cleanly(AutoModelForCausalLM, path, quantization_config=FineGrainedFP8Config(dequantize=True))
    for layer in range(2):
        held, got = fp8_model.model.layers[layer].mlp.experts, loaded.model.layers[layer].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(got, proj).double(), dequantize_blocks(getattr(held, proj),
                                                                              getattr(held, f"{proj}_scale_inv")))
    # Per decoder layer two FP8 weights in sequence on the attention path (q/k/v, then o) and two
    # on the experts' (gate_up, then down): 8 in all. Reasoned as for the tiny BERT above, the
    # independent, unbiased roundings add up to 2^-4 * sqrt(8 / 3) = 0.10 of the logits' norm in
    # quadrature. Routing stays in high precision but sees perturbed inputs; a flipped top-2
    # choice for a token would show as an error of order 1 on its logits, far above the bound.
    got = outputs(loaded, data)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= E4M3_REL * math.sqrt(8 / 3), rel

    # Models loaded by from_pretrained carry the loader's weight conversions: the dequantized
    # model (whose conversions would quantize on save) and the vanilla "hf" export's both write
    # the same checkpoint keys; the dequantized one stores the same weights exactly (power-of-two
    # scales, as for the tiny BERT above), the vanilla one the same E4M3 data and scales.
    vanilla = load_cleanly(AutoModelForCausalLM, export(model, tmp_path / "hf"))
    for source, folder in ((loaded, "again"), (vanilla, "from-hf")):
        again = load_file(export(source, tmp_path / folder, format="hf-fp8") / "model.safetensors")
        assert again.keys() == saved.keys()
        for name in masters:
            first = dequantize_blocks(saved[f"{name}.weight"], saved[f"{name}.weight_scale_inv"])
            assert torch.equal(dequantize_blocks(again[f"{name}.weight"], again[f"{name}.weight_scale_inv"]), first)
            if source is vanilla:
                assert torch.equal(again[f"{name}.weight"].view(torch.uint8), saved[f"{name}.weight"].view(torch.uint8))


def test_hf_fp8_export_refuses_experts_transformers_fp8_experts_cannot_hold(tmp_path):
    # GPT-OSS: expert biases and transposed [E, in, out] weights; FP8Experts holds neither.
    gpt_oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        layer_types=["full_attention"]))
    fp.convert_model(gpt_oss)
    with pytest.raises(ValueError, match=r"format='hf-fp8' cannot store the FP8 experts module "
                                         r"'model\.layers\.0\.mlp\.experts' \(FP8GptOssExperts\).*expert biases.*"
                                         r"exclude=\['experts'\].*format='hf'"):
        export(gpt_oss, tmp_path / "gpt-oss", format="hf-fp8")
    # An expert intermediate size of 64: the up half of gate_up_proj would not start on a 128-row block.
    mixtral = tiny_moe("Mixtral", intermediate_size=64)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts' \(FP8MixtralExperts\).*halves of 64 "
                                         r"rows each, not a multiple of 128"):
        export(mixtral, tmp_path / "mixtral", format="hf-fp8")  # not converted: refused the same
    # Mistral 4 checkpoints hold the 3-D expert tensors themselves: their *_scale_inv would be left
    # unapplied (an unexpected key) by from_pretrained(dequantize=True), which reads only
    # '*.weight' scales and those of per-expert weights the model's conversion mapping merges.
    mistral4 = transformers.Mistral4ForCausalLM(transformers.Mistral4Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32,
        q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=16, max_position_embeddings=64,
        pad_token_id=0))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts' \(FP8Mistral4Experts\).*checkpoint layout "
                                         r"keeps the experts' tensors.*not one 2-D '\*\.weight' per expert"):
        export(mistral4, tmp_path / "mistral4", format="hf-fp8")
    assert list(tmp_path.iterdir()) == []

    # The remedy the message names: experts left in high precision are written so and listed.
    model = tiny_moe("Mixtral", intermediate_size=64)
    fp.convert_model(model, exclude=["experts"])
    path = export(model, tmp_path / "kept", format="hf-fp8")
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["modules_to_not_convert"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts", "lm_head"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if ".experts." in k} == {"F32"}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    loaded = load_cleanly(AutoModelForCausalLM, path, quantization_config=FineGrainedFP8Config(dequantize=True))
    assert torch.equal(loaded.model.layers[0].mlp.experts.gate_up_proj, model.model.layers[0].mlp.experts.gate_up_proj)


def test_hf_fp8_export_of_a_model_trained_in_fnuz_writes_ocp_e4m3_as_on_any_other_device(tmp_path):
    # An MI300 trains in E4M3FNUZ / E5M2FNUZ, but the master weights are what the export casts:
    # the files hold OCP E4M3 (what transformers' fine-grained FP8 format expects), bit for bit
    # as the export of the same weights anywhere else.
    from fp8_plugin.numerics.device_kind import present_rocm

    model = bert()
    with present_rocm("gfx942"):
        train_in_fp8(model)
        assert next(m for m in model.modules() if isinstance(m, FP8Linear)).fp8_state.scale[0] > 0
        fnuz = load_file(export(model, tmp_path / "fnuz", format="hf-fp8") / "model.safetensors")
    ocp = load_file(export(model, tmp_path / "ocp", format="hf-fp8") / "model.safetensors")
    weights = [k for k, t in fnuz.items() if t.dtype == torch.float8_e4m3fn]
    assert len(weights) == 12 and not any(t.dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
                                          for t in fnuz.values())
    assert fnuz.keys() == ocp.keys()
    for k in fnuz:
        a, b = fnuz[k], ocp[k]
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), k
