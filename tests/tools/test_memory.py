"""The memory tool (fp8_plugin/tools/memory.py, memory_trace.py, autocast_on_meta.py, memory_cli.py).

Every expectation is computed by hand from the model's shapes and the formats' definitions: 4
bytes per FP32 value, 2 per BF16, 1 per E4M3, torch AdamW's two FP32 moments (its ``step``
counter stays on the host), FP8AdamW's E4M3 first moment with one FP32 scale per 128 values and
BF16 second moment, autocast's one BF16 copy of each weight per forward, an FP8 layer's E4M3
copies of its weight (rowwise and columnwise) and of its input (transposed, for wgrad).
"""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from fp8_plugin.tools.autocast_on_meta import cuda_autocast_on_meta
from fp8_plugin.tools.cli import app
from fp8_plugin.tools.memory import compare_memory, estimate_memory
from fp8_plugin.tools.memory_trace import CATEGORIES, MemoryTrace
from fp8_plugin.numerics.device_kind import meta_as_cuda

H, I, HEADS, KV, LAYERS, VOCAB = 256, 512, 4, 2, 2, 128
BATCH, SEQ = 8, 512
TOKENS = BATCH * SEQ


def tiny_llama():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV, vocab_size=VOCAB, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    return config


KV_OUT = KV * (H // HEADS)
# (in, out) of each linear layer of one block: q, k, v, o, gate, up, down.
BLOCK_LINEARS = [(H, H), (H, KV_OUT), (H, KV_OUT), (H, H), (H, I), (H, I), (I, H)]
LINEAR_NUMEL = LAYERS * sum(i * o for i, o in BLOCK_LINEARS)
HEAD_NUMEL = VOCAB * H
# Embedding, the linear layers, two RMSNorm weights per block and the final one, the head.
NUMEL = VOCAB * H + LINEAR_NUMEL + LAYERS * 2 * H + H + HEAD_NUMEL
PARAM_SHAPES = [(VOCAB, H)] + LAYERS * ([(o, i) for i, o in BLOCK_LINEARS] + [(H,), (H,)]) + [(H,), (VOCAB, H)]


@pytest.fixture(scope="module")
def estimates():
    config = tiny_llama()
    runs = [("bf16-mixed", "adamw"), ("fp8-hybrid", "adamw"), ("fp8-hybrid", "fp8-adamw")]
    return {run: estimate_memory(config, *run, batch_size=BATCH, seq_len=SEQ, skip_small=False) for run in runs}


def test_the_shapes_are_those_of_the_hand_count(estimates):
    assert sum(math.prod(s) for s in PARAM_SHAPES) == NUMEL
    assert all(e.parameters == e.trainable_parameters == NUMEL for e in estimates.values())


def test_bf16_mixed_holds_fp32_master_weights_adamw_moments_and_one_bf16_copy_of_each_weight(estimates):
    e = estimates[("bf16-mixed", "adamw")]
    held = e.after_forward.categories
    assert held["parameters"] == 4 * NUMEL
    assert held["optimizer states"] == 8 * NUMEL
    assert held["gradients"] == 0  # zero_grad(set_to_none=True) after each step
    assert held["BF16 weight copies"] == 2 * (LINEAR_NUMEL + HEAD_NUMEL)
    assert held["FP8 weight copies, rowwise"] == held["FP8 weight copies, columnwise"] == 0
    assert e.fp8_layers == e.fp8_gemms == 0 and e.recipe is None
    # Between steps: weights and moments, the int64 token ids (labels are the same tensor), the buffers.
    assert e.resident_bytes == 12 * NUMEL + 8 * TOKENS + _rotary_buffer_bytes()


def test_fp8_hybrid_holds_e4m3_weight_copies_and_e4m3_inputs_instead_of_bf16_copies(estimates):
    e = estimates[("fp8-hybrid", "adamw")]
    held = e.after_forward.categories
    assert e.fp8_layers == 7 * LAYERS
    assert e.fp8_gemms == 3 * e.fp8_layers  # fprop, dgrad, wgrad of every layer ran in FP8
    assert held["parameters"] == 4 * NUMEL
    assert held["optimizer states"] == 8 * NUMEL
    # fprop's rowwise copies are freed after it (nothing caches them without gradient accumulation);
    # the columnwise ones wait for dgrad, saved for backward.
    assert held["FP8 weight copies, rowwise"] == 0
    assert held["FP8 weight copies, columnwise"] == LINEAR_NUMEL
    assert held["BF16 weight copies"] == 2 * HEAD_NUMEL  # the head stays in BF16
    # Each input an FP8 layer reads is saved once, transposed in E4M3, for wgrad: q, k and v read
    # one tensor, gate and up one, o and down one each (one cast each, modules/shared_input.py).
    e4m3_inputs = sum(size for kind, size in e.after_forward.saved_by_kind.items() if "float8_e4m3fn" in kind)
    assert e4m3_inputs == LAYERS * TOKENS * (H + H + H + I)


def test_fp8_adamw_keeps_its_moments_in_three_bytes_and_a_scale_per_128_values(estimates):
    e = estimates[("fp8-hybrid", "fp8-adamw")]
    expected = sum(3 * math.prod(s) + 4 * -(-math.prod(s) // 128) for s in PARAM_SHAPES)
    assert e.after_forward.categories["optimizer states"] == expected
    assert expected / NUMEL <= 3.1  # the target, bytes per parameter
    same = estimates[("fp8-hybrid", "adamw")]
    assert e.peak.bytes == same.peak.bytes - (8 * NUMEL - expected)


def test_every_peak_is_the_sum_of_its_categories_and_holds_at_least_the_forward(estimates):
    for e in estimates.values():
        for view in (e.peak, e.after_forward):
            assert set(view.categories) == set(CATEGORIES)
            assert sum(view.categories.values()) == view.bytes
            assert sum(r.nbytes for r in view.allocations) == view.bytes
        assert e.peak.bytes >= e.after_forward.bytes
        assert e.peak.phase in ("forward", "backward", "optimizer step", "scale update")
    fp8 = estimates[("fp8-hybrid", "adamw")]
    bf16 = estimates[("bf16-mixed", "adamw")]
    assert fp8.peak.bytes < bf16.peak.bytes


def test_a_small_batch_peaks_in_the_optimizer_step_with_every_gradient_and_moment_held():
    e = estimate_memory(tiny_llama(), "fp8-hybrid", "adamw", batch_size=2, seq_len=64, skip_small=False)
    assert e.peak.phase == "optimizer step"
    assert e.peak.categories["gradients"] == 4 * NUMEL
    assert e.peak.categories["optimizer states"] == 8 * NUMEL
    assert e.peak.categories["FP8 weight copies, rowwise"] == 0  # the caches are cleared before the step


@pytest.mark.parametrize("precision,capability,recipe", [
    ("fp8-current", (9, 0), "Float8CurrentScaling"), ("fp8-blockwise", (9, 0), "Float8BlockScaling"),
    ("fp8-hybrid", (9, 0), "DelayedScaling"), ("fp8-hybrid", (10, 0), "MXFP8BlockScaling"),
])
def test_each_precision_traces_its_own_recipe_as_the_gpu_resolves_it(precision, capability, recipe):
    # The recipe of the precision string (training/precision_strings.py), "auto" resolved for the
    # GPU presented: MXFP8 on Blackwell (TE's default there), delayed scaling on Hopper.
    e = estimate_memory(tiny_llama(), precision, "sgd", batch_size=1, seq_len=64, capability=capability,
                        skip_small=False)
    assert e.recipe == recipe
    assert e.fp8_gemms == 3 * 7 * LAYERS


def test_the_json_form_is_plain_values(estimates):
    out = json.loads(json.dumps(estimates[("fp8-hybrid", "adamw")].to_dict()))
    assert out["peak"]["categories"]["parameters"] == 4 * NUMEL
    assert out["device"] == "meta as sm90"


def _rotary_buffer_bytes() -> int:
    # LlamaRotaryEmbedding's inv_freq and original_inv_freq: FP32, half the head dimension each.
    return 2 * 4 * (H // HEADS) // 2


# --- the trace itself ---------------------------------------------------------------------------


def test_the_trace_sees_a_storage_freed_and_its_peak_from_a_hand_count():
    trace = MemoryTrace("meta")
    with trace:
        a = torch.empty(256, device="meta")  # 1 KiB
        b = a + 1  # 1 KiB more: 2 KiB live
        del a
        c = b.view(16, 16)  # a view: no new storage
        d = torch.empty(128, device="meta", dtype=torch.float64)  # 1 KiB: 2 KiB live again
        del b, c, d
    assert trace.live_bytes == 0
    assert trace.peak().bytes == 2048
    assert [r.nbytes for r in trace.allocations] == [1024, 1024, 1024]
    assert all(r.end is not None for r in trace.allocations)


def test_the_trace_refuses_a_device_it_cannot_follow():
    with pytest.raises(ValueError, match="device_type='cpu'.*'meta', 'cuda'"):
        MemoryTrace("cpu")


# --- CUDA autocast's policy on meta tensors ---------------------------------------------------------


def test_autocast_on_meta_follows_cuda_autocasts_lists_and_cache():
    w = torch.nn.Parameter(torch.empty(8, 16, device="meta"))
    x = torch.empty(4, 16, device="meta")
    with meta_as_cuda((9, 0)), cuda_autocast_on_meta(torch.bfloat16):
        assert torch.is_autocast_enabled("cuda")
        y = torch.nn.functional.linear(x, w)  # lower-precision list
        assert y.dtype == torch.bfloat16
        assert torch.softmax(y, -1).dtype == torch.float32  # float32 list
        assert (y + x[:, :8]).dtype == torch.float32  # not listed: type promotion as usual
        assert torch.matmul(x, w.t()).dtype == torch.bfloat16
        with torch.autocast("cuda", enabled=False):
            assert torch.nn.functional.linear(x, w).dtype == torch.float32
    assert not torch.is_autocast_enabled("cuda")


def test_autocast_on_meta_casts_a_weight_once_per_region_and_attention_runs_flash():
    trace = MemoryTrace("meta")
    w = torch.nn.Parameter(torch.empty(8, 16, device="meta"))
    x = torch.empty(4, 16, device="meta")
    q = torch.empty(2, 4, 32, 64, device="meta")
    kv = torch.empty(2, 2, 32, 64, device="meta")
    with trace, meta_as_cuda((9, 0)), cuda_autocast_on_meta(torch.bfloat16):
        torch.nn.functional.linear(x, w)
        torch.nn.functional.linear(x, w)
        out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    ops = [r.op for r in trace.allocations]
    weight_casts = [r for r in trace.allocations if r.op == "_to_copy" and r.shape == (8, 16)]
    assert len(weight_casts) == 1
    assert "_scaled_dot_product_flash_attention" in ops and "bmm" not in ops  # no (S x S) scores
    assert out.shape == (2, 4, 32, 64) and out.dtype == torch.bfloat16


def test_autocast_on_meta_refuses_a_dtype_autocast_does_not_take():
    with pytest.raises(ValueError, match="float32.*torch.bfloat16, torch.float16"):
        with cuda_autocast_on_meta(torch.float32):
            pass


def test_an_fp8_backward_frees_grad_outputs_rowwise_cast_before_wgrad_allocates():
    # dgrad reads grad_output's rowwise E5M2 cast [M, N], wgrad its columnwise one [N, M]: when
    # wgrad's FP32 output is allocated, only the columnwise one (M * N bytes) may be live.
    import fp8_plugin
    from fp8_plugin.numerics.gemm import force_path

    m, k, n = 256, 128, 192
    with meta_as_cuda((9, 0)), force_path("native"):
        layer = fp8_plugin.FP8Linear(k, n, bias=False, device="meta")
        x = torch.empty(m, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
        with MemoryTrace("meta") as trace:
            for _ in range(2):  # the second step: scales initialised, as in training
                with cuda_autocast_on_meta(torch.bfloat16), fp8_plugin.autocast():
                    out = layer(x)
                out.backward(torch.empty(m, n, device="meta", dtype=torch.bfloat16))
                layer.weight.grad = x.grad = None
    wgrad = [r for r in trace.allocations if "scaled_mm" in r.op and r.dtype == torch.float32][-1]
    assert wgrad.shape == (n, k)
    live = [r for r in trace.allocations if r.dtype == torch.float8_e5m2 and r.start < wgrad.start
            and (r.end is None or r.end > wgrad.start)]
    assert sum(r.nbytes for r in live) == m * n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_weights_wgrad_is_written_in_its_dtype_with_no_float32_copy(dtype):
    # A BF16 or FP16 weight (FSDP2's param_dtype, bf16-true) takes a gradient of its own dtype,
    # as nn.Linear's does: the FP8 wgrad GEMM writes it, with no float32 [N, K] in between.
    import fp8_plugin
    from fp8_plugin.numerics.gemm import force_path

    m, k, n = 256, 128, 192
    with meta_as_cuda((9, 0)), force_path("native"):
        layer = fp8_plugin.FP8Linear(k, n, bias=False, device="meta", dtype=dtype)
        x = torch.empty(m, k, device="meta", dtype=dtype, requires_grad=True)
        with MemoryTrace("meta") as trace:
            with fp8_plugin.autocast():
                out = layer(x)
            out.backward(torch.empty(m, n, device="meta", dtype=dtype))
    assert layer.weight.grad.dtype == dtype
    assert not [r for r in trace.allocations if r.dtype == torch.float32 and r.shape == (n, k)]
    wgrad = [r for r in trace.allocations if "scaled_mm" in r.op and r.shape == (n, k)]
    assert [r.dtype for r in wgrad] == [dtype]


def test_grouped_mm_on_meta_gives_float32_experts_what_a_gpu_gives():
    # transformers' experts cast their token rows to float32 master weights' dtype and call
    # grouped_mm, which the GPU runs and torch's meta kernel refuses (BF16 only).
    from fp8_plugin.tools.grouped_mm_on_meta import grouped_mm_on_meta

    rows = torch.empty(10, 16, device="meta", requires_grad=True)
    weights = torch.empty(4, 16, 24, device="meta", requires_grad=True)
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match="BF16"):
        torch.nn.functional.grouped_mm(rows, weights, offs=offs)
    with grouped_mm_on_meta():
        out = torch.nn.functional.grouped_mm(rows, weights, offs=offs)
        bf16 = torch.nn.functional.grouped_mm(rows.bfloat16(), weights.bfloat16(), offs=offs)  # torch's own
    assert out.shape == (10, 24) and out.dtype == torch.float32 and out.grad_fn is not None
    assert bf16.shape == (10, 24) and bf16.dtype == torch.bfloat16
    out.backward(torch.empty(10, 24, device="meta"))
    assert rows.grad.shape == (10, 16) and weights.grad.shape == (4, 16, 24)
    assert rows.grad.dtype == weights.grad.dtype == torch.float32


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true", "fp8-hybrid"])
def test_a_mixture_of_experts_model_traces_in_every_precision(precision):
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           num_key_value_heads=KV, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB)
    estimate = estimate_memory(config, precision, "adamw", batch_size=2, seq_len=64, skip_small=False)
    # At least the FP32 master weights, their gradients and AdamW's two moments: 16 bytes each.
    assert estimate.peak.bytes >= 16 * estimate.parameters


# --- LoRA fine-tunes ---------------------------------------------------------------------------

RANK = 4
# PEFT's "all-linear": every linear layer of the blocks (not the head), A [r, in] and B [out, r].
LORA_NUMEL = LAYERS * sum(RANK * (i + o) for i, o in BLOCK_LINEARS)


@pytest.fixture(scope="module")
def lora_estimates():
    return {p: estimate_memory(tiny_llama(), p, "adamw", batch_size=2, seq_len=64, skip_small=False, lora_rank=RANK)
            for p in ("bf16-mixed", "fp8-hybrid")}


def test_lora_trains_fp32_adapters_over_a_bf16_base(lora_estimates):
    e = lora_estimates["bf16-mixed"]
    held = e.after_forward.categories
    assert (e.parameters, e.trainable_parameters) == (NUMEL + LORA_NUMEL, LORA_NUMEL)
    assert held["parameters"] == 4 * LORA_NUMEL and held["optimizer states"] == 8 * LORA_NUMEL
    assert held["frozen weights"] == 2 * NUMEL
    assert e.fp8_gemms == 0


def test_fp8_lora_keeps_the_frozen_linear_weights_only_in_e4m3(lora_estimates):
    e = lora_estimates["fp8-hybrid"]
    held = e.after_forward.categories
    assert (e.parameters, e.trainable_parameters) == (NUMEL + LORA_NUMEL, LORA_NUMEL)
    assert held["parameters"] == 4 * LORA_NUMEL and held["optimizer states"] == 8 * LORA_NUMEL
    # 1 byte per value of the converted layers' weights; the embedding, norms and head stay BF16.
    assert held["frozen weights"] == LINEAR_NUMEL + 2 * (NUMEL - LINEAR_NUMEL)
    assert held["FP8 weight copies, rowwise"] == held["FP8 weight copies, columnwise"] == 0  # the stored bytes
    assert e.fp8_layers == 7 * LAYERS
    # fprop and dgrad of each, no wgrad (the weight does not train); the first block's q, k and v
    # read the frozen embedding through a frozen norm: no gradient flows there, no dgrad runs.
    assert e.fp8_gemms == 2 * e.fp8_layers - 3
    assert e.peak.bytes < lora_estimates["bf16-mixed"].peak.bytes


# --- errors and the command line -----------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"precision": "fp8-hybrid-float16"}, "precision='fp8-hybrid-float16'.*valid: 32-true, bf16-true, bf16-mixed"),
    ({"optimizer": "adam"}, "optimizer='adam'.*valid: adamw, fp8-adamw, sgd"),
    ({"batch_size": 0}, "batch_size=0.*int >= 1"),
    ({"device": "cpu"}, "device='cpu'.*'meta'"),
    ({"lora_rank": 0}, "lora_rank=0 is not a rank; valid: None .* int >= 1"),
    ({"lora_rank": 4, "lora_targets": ["qkv"]}, "lora_targets=\\['qkv'\\]: .*valid: 'all-linear' or names"),
])
def test_estimate_refuses_bad_settings_naming_the_valid_ones(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(tiny_llama(), **kwargs)


def test_compare_needs_one_optimizer_or_one_per_precision():
    with pytest.raises(ValueError, match="2 optimizers for 3 precisions"):
        compare_memory(tiny_llama(), ("bf16-mixed", "fp8-hybrid", "fp8-current"), ("adamw", "sgd"))


def test_cli_memory_table_and_json(tmp_path):
    config = tiny_llama()
    config.save_pretrained(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["memory", str(tmp_path), "-b", "2", "-s", "64", "--skip-small", "false"])
    assert result.exit_code == 0, result.output
    assert "bf16-mixed + adamw" in result.output and "fp8-hybrid + adamw" in result.output
    # So small a batch peaks in the optimizer step: gradients, moments and foreach's temporaries.
    assert "optimizer step" in result.output and "gradients" in result.output
    assert "largest transient: _foreach" in result.output
    result = runner.invoke(app, ["memory", str(tmp_path / "config.json"), "-p", "fp8-current", "-o", "fp8-adamw",
                                 "--json", "--skip-small", "false"])
    assert result.exit_code == 0, result.output
    (estimate,) = json.loads(result.output)["estimates"]
    assert estimate["precision"] == "fp8-current" and estimate["fp8_gemms"] == 3 * 7 * LAYERS
    result = runner.invoke(app, ["memory", str(tmp_path), "-b", "2", "-s", "64", "-r", "4", "--skip-small", "false"])
    assert result.exit_code == 0, result.output
    assert "(LoRA r=4 on all-linear: 0.0M trainable)" in result.output and "frozen weights" in result.output
    result = runner.invoke(app, ["memory", str(tmp_path), "-p", "bf16-mixed", "-o", "adamw", "-o", "sgd"])
    assert result.exit_code != 0 and "one per --precision" in result.output
    result = runner.invoke(app, ["memory", str(tmp_path), "--capability", "sm90"])
    assert result.exit_code != 0 and "MAJOR.MINOR" in result.output
