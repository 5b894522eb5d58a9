"""Frozen weights kept only in FP8 (fp8_plugin/modules/frozen_weight.py, freezing.py) and the
loading of fine-grained FP8 checkpoints to train (fp8_plugin/tools/fp8_checkpoint.py)."""

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import fp8_plugin as fp
from fp8_plugin import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, FP8Linear, MXFP8BlockScaling
from reference import count_fp8_gemms

E4M3_MAX = 448.0
RECIPES = [DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()]


def llama(layers: int = 1) -> LlamaForCausalLM:
    # Dims that are multiples of 128 (k/v: 2 heads x 64), so every layer has whole 128x128 blocks.
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=384, vocab_size=300,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def frozen_pair(recipe, bias=True):
    """A trained-path layer whose weight does not require grad, and its twin frozen in FP8."""
    a = FP8Linear(256, 384, bias=bias, recipe=recipe)
    a.weight.requires_grad_(False)
    b = copy.deepcopy(a)
    b.freeze_weight()
    return a, b


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_frozen_layer_computes_as_the_same_layer_with_its_weight_in_high_precision(recipe):
    # The control: FP8Linear with the weight in float32 casts it at each forward, as the recipe
    # casts weights. A frozen weight's one cast is that cast, so fprop, dgrad, the bias gradient
    # and the scaling state match bit for bit over several delayed-scaling updates.
    a, b = frozen_pair(recipe)
    for _ in range(3):
        x = torch.randn(64, 256) * 3
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        with fp.autocast(recipe=recipe):
            ya, yb = a(xa), b(xb)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad) and torch.equal(a.bias.grad, b.bias.grad)
    assert b.weight.grad is None
    for role in ("input", "grad_output"):
        assert torch.equal(a.fp8_stats()[role]["scale"], b.fp8_stats()[role]["scale"])


def test_tensorwise_frozen_weight_is_the_e4m3_cast_of_the_spec():
    # OCP FP8 E4M3 with TE's scale = (FP8_MAX / amax) / 2**margin, margin 0: the stored bytes are
    # torch's round-to-nearest-even cast of W * scale, computed here in float64.
    a, b = frozen_pair(DelayedScaling())
    w = a.weight.double()
    scale = E4M3_MAX / w.abs().max()
    assert b.weight_scale_inv.dim() == 0
    assert b.weight_scale_inv.item() == pytest.approx(1 / scale.item(), rel=2**-23)
    expected = (w * scale).float().to(torch.float8_e4m3fn)
    assert torch.equal(b.weight.view(torch.uint8), expected.view(torch.uint8))


def test_blockwise_frozen_weight_has_one_power_of_two_scale_per_128x128_block():
    a, b = frozen_pair(Float8BlockScaling())
    assert b.weight_scale_inv.shape == (3, 2)
    w = a.weight.double()
    for i in range(3):
        for j in range(2):
            block = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            # Float8BlockScaling's power_2_scale: the largest power of two <= 448 / amax.
            scale = 2.0 ** torch.floor(torch.log2(E4M3_MAX / block.abs().max())).item()
            assert b.weight_scale_inv[i, j].item() == 1 / scale
            expected = (block * scale).float().to(torch.float8_e4m3fn)
            got = b.weight[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_a_frozen_layer_holds_no_high_precision_copy_of_its_weight_anywhere():
    _, b = frozen_pair(DelayedScaling())
    x = torch.randn(32, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with fp.autocast():
            y = b(x)
    y.sum().backward()
    weight_sized = [t for t in list(b.parameters()) + list(b.buffers()) + saved
                    if t.numel() >= 256 * 384 and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert weight_sized == [], [(tuple(t.shape), t.dtype) for t in weight_sized]
    assert b._weight_cache is None
    assert b.weight.dtype == torch.float8_e4m3fn and not b.weight.requires_grad


def test_model_to_dtype_moves_frozen_fp8_weights_without_touching_their_bytes():
    _, b = frozen_pair(Float8CurrentScaling())
    data, scale = b.weight.clone(), b.weight_scale_inv.clone()
    b.to(torch.bfloat16)
    assert b.weight.dtype == torch.float8_e4m3fn and torch.equal(b.weight.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(b.weight_scale_inv, scale) and b.master_dtype == torch.bfloat16
    assert b.bias.dtype == torch.bfloat16
    assert b.dense_weight().dtype == torch.bfloat16


def test_lora_on_frozen_fp8_base_runs_fprop_and_dgrad_in_fp8_and_no_wgrad():
    model = get_peft_model(llama(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    report = fp.convert_model(model)
    frozen = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(report.frozen) == len(frozen) == 7 and all(m.frozen_layout is not None for m in frozen)
    before = {id(m): m.weight.clone() for m in frozen}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 300, (2, 16))
    with count_fp8_gemms() as gemms:
        for _ in range(2):
            with fp.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    # Per step: 7 fprops; dgrads for every layer whose input requires grad: not q, k, v (their
    # input, the normed embeddings, is frozen), so 4. No wgrad.
    assert gemms.count == 2 * (7 + 4)
    assert all(torch.equal(m.weight.view(torch.uint8), before[id(m)].view(torch.uint8)) for m in frozen)
    lora_b = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default")
    assert lora_b.weight.abs().sum() > 0  # the adapters trained
    # Resident bytes of the converted weights: FP8 data and scales against BF16's 2 bytes per value.
    fp8_bytes = sum(m.weight.numel() + 4 * m.weight_scale_inv.numel() for m in frozen)
    assert fp8_bytes <= 0.55 * sum(2 * m.weight.numel() for m in frozen)


def test_conversion_keeps_frozen_weights_in_high_precision_when_asked():
    model = llama()
    model.requires_grad_(False)
    report = fp.convert_model(model, frozen_weights="keep")
    assert report.frozen == [] and all(m.frozen_layout is None for m in model.modules() if isinstance(m, FP8Linear))
    with pytest.raises(ValueError, match=r"frozen_weights='nope' is not valid; valid: 'fp8', 'keep'"):
        fp.convert_model(llama(), frozen_weights="nope")


def test_a_frozen_weight_unfrozen_is_refused_at_conversion_and_in_the_forward():
    model = llama()
    model.requires_grad_(False)
    fp.convert_model(model)
    model.requires_grad_(True)
    with pytest.raises(ValueError, match="kept only in FP8, and it now requires grad.*dequantize_frozen_weights"):
        fp.convert_model(model)
    with pytest.raises(RuntimeError, match="now requires grad.*dequantize_frozen_weights"):
        with fp.autocast():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    names = fp.dequantize_frozen_weights(model)
    assert len(names) == 7
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.dtype == torch.float32 and q.weight.requires_grad and not hasattr(q, "weight_scale_inv")


def test_a_recipe_that_cannot_read_the_stored_layout_is_refused_at_conversion():
    model = llama()
    model.requires_grad_(False)
    fp.convert_model(model, Float8BlockScaling())
    with pytest.raises(ValueError, match=r"128x128 blocks.*valid recipes for it: Float8BlockScaling\(\)"):
        fp.convert_model(model, DelayedScaling())


def test_an_optimizer_built_before_conversion_lets_go_of_the_replaced_weights(fresh_accelerate):
    from fp8_plugin.accelerate import Accelerator

    model = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # every parameter, frozen ones included
    held = sum(len(g["params"]) for g in opt.param_groups)
    accelerator = Accelerator(mixed_precision="fp8", cpu=True)
    model, opt = accelerator.prepare(model, opt)
    params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    assert len(params) == held - 7
    assert all(p.dtype == torch.float32 for p in params)


def test_save_pretrained_writes_the_frozen_weights_dequantized(tmp_path):
    model = llama()
    model.requires_grad_(False)
    fp.convert_model(model)
    model.save_pretrained(tmp_path / "vanilla")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "vanilla")
    q = model.model.layers[0].self_attn.q_proj
    expected = q.weight.to(torch.float32) * q.weight_scale_inv  # the E4M3 values times their scale
    assert torch.equal(reloaded.model.layers[0].self_attn.q_proj.weight, expected)
    with safe_open(str(tmp_path / "vanilla" / "model.safetensors"), "pt") as f:
        assert not any(k.endswith("weight_scale_inv") for k in f.keys())


@pytest.mark.parametrize("block", [(128, 128), None], ids=["128x128", "per-tensor"])
def test_fp8_checkpoint_loads_byte_exact_trains_lora_merges_and_reloads_in_transformers(tmp_path, block):
    source = llama()
    fp.export(source, tmp_path / "fp8", "hf-fp8", weight_block_size=block)
    # Scales as published checkpoints have them (not powers of two, unlike this project's export):
    # a loader that dequantized and cast again would not give the file's bytes back.
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    save_file({k: v * 3 if k.endswith("_scale_inv") else v for k, v in tensors.items()},
              tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    model = fp.from_pretrained(AutoModelForCausalLM, tmp_path / "fp8", dtype=torch.float32)
    recipe = fp.fp8_checkpoint_recipe(tmp_path / "fp8")
    assert isinstance(recipe, Float8BlockScaling if block else DelayedScaling)
    assert len(model.fp8_report.frozen) == 7
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        stored = {n: (f.get_tensor(f"{n}.weight"), f.get_tensor(f"{n}.weight_scale_inv")) for n in layers}
    for name, layer in layers.items():
        assert torch.equal(layer.weight.view(torch.uint8), stored[name][0].view(torch.uint8)), name
        assert torch.equal(layer.weight_scale_inv, stored[name][1]), name

    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    fp.convert_model(peft_model, recipe)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 300, (2, 16))
    with count_fp8_gemms() as gemms:
        with fp.autocast(recipe=recipe):
            peft_model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert gemms.count == 7 + 4  # fprops, and the dgrads of the layers whose input requires grad
    for name, layer in layers.items():  # frozen: still the file's bytes
        assert torch.equal(layer.weight.view(torch.uint8), stored[name][0].view(torch.uint8)), name

    fp.dequantize_frozen_weights(peft_model)
    merged = peft_model.merge_and_unload()
    merged.eval()
    with torch.no_grad():
        want = merged(input_ids=ids).logits
    merged.save_pretrained(tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, want)
    fp.export(merged, tmp_path / "merged-fp8", "hf-fp8", weight_block_size=block)
    assert json.loads((tmp_path / "merged-fp8" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_fp8_export_of_frozen_weights_writes_their_bytes_as_held(tmp_path):
    model = fp.from_pretrained(AutoModelForCausalLM, _fp8_checkpoint(tmp_path), dtype=torch.float32)
    q = model.model.layers[0].self_attn.q_proj
    fp.export(model, tmp_path / "again", "hf-fp8")
    with safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as f:
        data = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        assert torch.equal(data.view(torch.uint8), q.weight.view(torch.uint8))
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv"), q.weight_scale_inv)


def _fp8_checkpoint(tmp_path, **config):
    path = tmp_path / "fp8"
    fp.export(llama(), path, "hf-fp8")
    if config:
        data = json.loads((path / "config.json").read_text())
        data["quantization_config"].update(config)
        (path / "config.json").write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, message", [
    ({"weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\] is not supported: .*read 128x128 weight blocks"),
    ({"activation_scheme": "static"}, r"activation_scheme='static' is not supported"),
    ({"quant_method": "bitsandbytes"}, r"not a fine-grained FP8 checkpoint .*'bitsandbytes'"),
])
def test_fp8_checkpoints_the_project_cannot_train_are_refused_with_the_reason(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        fp.from_pretrained(AutoModelForCausalLM, _fp8_checkpoint(tmp_path, **change))


def test_from_pretrained_refuses_a_recipe_that_cannot_read_the_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"recipe=DelayedScaling\(\) cannot read .*valid: Float8BlockScaling\(\)"):
        fp.from_pretrained(AutoModelForCausalLM, _fp8_checkpoint(tmp_path), recipe=DelayedScaling())


def test_set_frozen_weight_refuses_scales_that_do_not_fit():
    layer = FP8Linear(256, 384, recipe=Float8BlockScaling())
    layer.weight.requires_grad_(False)
    layout = fp.modules.frozen_weight.frozen_layout(Float8BlockScaling(), torch.device("cpu"), torch.float32)
    data = torch.zeros(384, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight_scale_inv \(2, 2\) torch.float32 does not fit .*expected \(3, 2\)"):
        layer.set_frozen_weight(data, torch.ones(2, 2), layout)


def test_lora_adapters_over_a_frozen_fp8_base_start_as_over_the_high_precision_base():
    # PEFT places adapters in the base layer's dtype unless the layer names another
    # (fp8_plugin._private.peft_api): over E4M3 weights they would start rounded to E4M3.
    config = LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights=False)
    plain = llama()
    frozen = llama()
    frozen.requires_grad_(False)
    fp.convert_model(frozen)
    torch.manual_seed(1)
    a = get_peft_model(plain, config).base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight
    torch.manual_seed(1)
    b = get_peft_model(frozen, copy.deepcopy(config)).base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight
    assert b.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("block", [(128, 128), None], ids=["128x128", "per-tensor"])
def test_transformers_own_fp8_layers_are_taken_over_as_they_are(block):
    # What transformers builds from a fine-grained FP8 checkpoint on a GPU: its inference FP8Linear.
    from transformers.integrations.finegrained_fp8 import FP8Linear as HFFP8Linear

    model = llama()
    model.requires_grad_(False)
    hf = HFFP8Linear(256, 256, block_size=block)
    with torch.no_grad():
        hf.weight.copy_((torch.randn(256, 256) * 64).to(torch.float8_e4m3fn))
        hf.weight_scale_inv.copy_(torch.rand(hf.weight_scale_inv.shape) + 0.5)
    model.model.layers[0].self_attn.q_proj = hf
    recipe = Float8BlockScaling() if block else DelayedScaling()
    report = fp.convert_model(model, recipe)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, FP8Linear) and q.frozen_layout is not None
    assert torch.equal(q.weight.view(torch.uint8), hf.weight.view(torch.uint8))
    assert torch.equal(q.weight_scale_inv, hf.weight_scale_inv.reshape(q.weight_scale_inv.shape))
    assert any(d.name.endswith("q_proj") and d.frozen for d in report.layers)
    with count_fp8_gemms() as gemms, fp.autocast(recipe=recipe):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert gemms.count == 7

    other = llama()
    other.model.layers[0].self_attn.q_proj = HFFP8Linear(256, 256, block_size=(128, 128))
    other.model.layers[0].self_attn.q_proj.weight.data = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"transformers FP8Linear.*valid recipes for it: Float8BlockScaling"):
        fp.convert_model(other, DelayedScaling())


def test_a_recipe_reaching_a_frozen_layer_at_run_time_casts_its_dequantized_weight_with_one_warning():
    _, frozen = frozen_pair(DelayedScaling(), bias=False)
    control = FP8Linear(256, 384, bias=False, recipe=Float8BlockScaling())
    with torch.no_grad():
        control.weight.copy_(frozen.dense_weight())  # the weight the frozen layer holds, in high precision
    x = torch.randn(32, 256)
    with pytest.warns(UserWarning, match="dequantized and cast again at every forward"):
        with fp.autocast(recipe=Float8BlockScaling()):
            got = frozen(x)
    with fp.autocast(recipe=Float8BlockScaling()):
        want = control(x)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, not at every forward
            again = frozen(x)
    assert torch.equal(got, want) and torch.equal(again, want)


def test_reference_checks_and_statistics_cover_frozen_fp8_layers():
    # The reference replay reads each frozen weight dequantized (the model's own weights in high
    # precision); the FP8 replay reads the stored bytes. The adapters' gradients are compared.
    from fp8_plugin.training.statistics import StatisticsCollector

    model = get_peft_model(llama(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    fp.convert_model(model)
    ids = torch.randint(0, 300, (2, 16))
    result = fp.reference_check(model, ids, lambda m, b: m(input_ids=b, labels=b).loss, compute_dtype=torch.float32)
    frozen = [n for n, m in model.named_modules() if isinstance(m, FP8Linear) and m.frozen_layout is not None]
    assert len(frozen) == 7 and set(result.layer_sqnr_db) == set(frozen)
    # HYBRID FP8 against float32: tens of dB per layer (E4M3's 2^-4 relative rounding is ~30 dB),
    # gradients of the trained adapters pointing the same way.
    assert all(v > 15 for v in result.layer_sqnr_db.values()), result.layer_sqnr_db
    assert result.grad_cosine > 0.99 and not result.failures, result
    # Per-GEMM figures: fprop everywhere, dgrad where the input needs a gradient (not q, k, v,
    # whose input is the frozen embeddings normed), never wgrad (the weights do not train).
    first = ("q_proj.base_layer", "k_proj", "v_proj.base_layer")
    for name, figures in result.gemm_sqnr_db.items():
        assert set(figures) == ({"fprop"} if name.endswith(first) else {"fprop", "dgrad"}), (name, figures)

    collector = StatisticsCollector(fp.FP8Statistics(every=1))
    collector.start_step(model, 1)
    with fp.autocast():
        model(input_ids=ids, labels=ids).loss.backward()
    collector.end_step()
    metrics = collector.pop_metrics()
    # The weight's figures are those of the stored cast: its values are E4M3 values, exact.
    prefix = "fp8_stats/base_model.model.model.layers.0.self_attn.q_proj.base_layer/weight/"
    assert metrics[prefix + "amax"] > 0 and metrics[prefix + "sqnr_db"] == float("inf"), sorted(metrics)[:8]


def test_a_model_with_frozen_fp8_weights_survives_torch_save_and_deepcopy(tmp_path):
    model = llama()
    model.requires_grad_(False)
    fp.convert_model(model)
    torch.save(model, tmp_path / "whole.pt")
    for other in (torch.load(tmp_path / "whole.pt", weights_only=False), copy.deepcopy(model)):
        q, q0 = other.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.q_proj
        assert torch.equal(q.weight.view(torch.uint8), q0.weight.view(torch.uint8))
        other.save_pretrained(tmp_path / "copy")  # still writes the frozen weights dequantized, its own
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
        assert torch.equal(reloaded.model.layers[0].self_attn.q_proj.weight, q.dense_weight())


def test_state_dicts_load_across_frozen_and_trained_layers_without_reading_fp8_codes_as_numbers():
    a, frozen = frozen_pair(DelayedScaling())
    # A vanilla (high-precision) state into a frozen layer: cast as freezing casts it.
    fresh = copy.deepcopy(frozen)
    with torch.no_grad():
        fresh.weight.zero_()
    fresh.load_state_dict(a.state_dict())
    assert torch.equal(fresh.weight.view(torch.uint8), frozen.weight.view(torch.uint8))
    assert torch.equal(fresh.weight_scale_inv, frozen.weight_scale_inv)
    # A frozen layer's FP8 state into a trained layer: dequantized, data * scale_inv.
    trained = FP8Linear(256, 384, recipe=DelayedScaling())
    trained.load_state_dict(frozen.state_dict())
    expected = frozen.weight.to(torch.float32) * frozen.weight_scale_inv
    assert torch.equal(trained.weight.detach(), expected) and trained.weight.dtype == torch.float32


def test_an_fp8_checkpoints_experts_load_dequantized_and_say_so(tmp_path):
    from test_export import tiny_moe

    fp.export(tiny_moe("Mixtral"), tmp_path / "moe", "hf-fp8")
    with pytest.warns(UserWarning, match=r"FP8 tensors of the checkpoint are not nn.Linear weights and load dequantized"):
        model = fp.from_pretrained(AutoModelForCausalLM, tmp_path / "moe", dtype=torch.float32)
    assert model.fp8_report.frozen  # the attention projections: frozen FP8
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32


def test_frozen_moe_experts_keep_their_weights_only_in_fp8_and_compute_as_the_trained_path(tmp_path):
    from fp8_plugin.modules.experts import expert_gemm_counts
    from test_export import tiny_moe

    control = tiny_moe("Mixtral")
    control.requires_grad_(False)
    control.get_input_embeddings().weight.requires_grad_(True)  # so that gradients flow through the experts
    frozen = copy.deepcopy(control)
    fp.convert_model(control, frozen_weights="keep")
    report = fp.convert_model(frozen)
    experts = frozen.model.layers[0].mlp.experts
    assert set(experts.frozen_projections()) == {"gate_up_proj", "down_proj"}
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale_inv.shape == (4,)
    assert {d.name for d in report.frozen} >= {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    # One scale per expert, the expert's own: (448 / amax) in float32, as the experts' cast.
    w = control.model.layers[0].mlp.experts.gate_up_proj.double()
    scale = (E4M3_MAX / w.abs().amax(dim=(1, 2))).float()
    assert torch.equal(experts.gate_up_proj_scale_inv, 1 / scale)
    ids = torch.randint(0, 100, (2, 16))
    for _ in range(2):  # the stored cast is the trained path's cast: bit for bit, a delayed update between
        before = expert_gemm_counts()
        with fp.autocast():
            losses = [m(input_ids=ids, labels=ids).loss for m in (control, frozen)]
        for loss in losses:
            loss.backward()
        after = expert_gemm_counts()
        assert torch.equal(*losses)
        grads = [m.get_input_embeddings().weight.grad for m in (control, frozen)]
        assert torch.equal(*grads)
        for m in (control, frozen):
            m.get_input_embeddings().weight.grad = None
        # 2 models x 2 layers x 2 projections: a grouped fprop and dgrad each, no wgrad (no weight
        # trains; the frozen ones have no high-precision weight to train).
        assert {k: after[k] - before[k] for k in after} == {"fprop": 8, "dgrad": 8, "wgrad": 0}
    # High precision (outside the autocast): the module's own forward on the dequantized stacks.
    with torch.no_grad():  # the control given the values the frozen model holds (experts and attention)
        controls = dict(control.named_modules())
        for name, held in frozen.named_modules():
            for proj in held.frozen_projections() if hasattr(held, "frozen_projections") else ():
                getattr(controls[name], proj).copy_(held.dense_projection(proj))
            if getattr(held, "frozen_layout", None) is not None:
                controls[name].weight.copy_(held.dense_weight())
        assert torch.equal(control(input_ids=ids).logits, frozen(input_ids=ids).logits)
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn  # the FP8 data again after that forward
    frozen.save_pretrained(tmp_path / "vanilla")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "vanilla")
    assert torch.equal(reloaded.model.layers[0].mlp.experts.gate_up_proj, experts.dense_projection("gate_up_proj"))
    data = experts.gate_up_proj.clone()
    frozen.to(torch.bfloat16)
    assert torch.equal(experts.gate_up_proj.view(torch.uint8), data.view(torch.uint8))
    assert fp.dequantize_frozen_weights(frozen)[-2:] == ["model.layers.1.mlp.experts.gate_up_proj",
                                                         "model.layers.1.mlp.experts.down_proj"]
    assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.gate_up_proj.requires_grad
