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
