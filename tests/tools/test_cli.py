"""The ``fp8-plugin`` command line (fp8_plugin/tools/cli.py): inspect, devices, export, user errors."""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fp8_plugin import convert_model, export
from fp8_plugin.tools.cli import app
from fp8_plugin.tools.data import minilm_path
from fp8_plugin.numerics.recipes import AutoRecipe

runner = CliRunner()

# E4M3 keeps 3 mantissa bits: rounding to nearest leaves a relative error of at most half a unit in
# the last place, 2^-4. Taken as uniform on [-2^-4, 2^-4], its RMS is 2^-4 / sqrt(3), so one
# rounded tensor has SQNR 20 log10(2^4 sqrt(3)) = 28.9 dB (a little more in practice: values high
# in a binade have a smaller relative error). A layer's output carries the errors of both rounded
# operands (input and weight: about 3 dB less), so outputs that are sums with cancellation sit
# near 29 dB; outputs dominated by a few large same-sign products score higher, because the
# products' independent errors partly average out while their signal adds up (MiniLM's
# output.dense layers reach about 41 dB). Below 20 dB (10% RMS error) values underflow or
# saturate (a wrong scale). 45 dB bounds the other side with room to spare: a layer that did not
# run in FP8 at all would differ by float32 rounding only, over 100 dB.
SQNR_RANGE_DB = (20.0, 45.0)


def _run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _flat(text: str) -> str:
    # Errors come in a rich panel wrapped to the terminal width: drop the frame, join the lines.
    return " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A GPT-2 (Conv1D layers, tied lm_head) from a tiny config, saved without a tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    path = tmp_path_factory.mktemp("tiny_gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def _expected_share(layers) -> float:
    # From the layer shapes alone: a linear layer costs in * out multiply-adds per token, and every
    # layer but the heads (excepted from the share) runs on every token.
    macs = {d.name: d.in_features * d.out_features for d in layers if "head" not in d.reason}
    return sum(macs[d.name] for d in layers if d.swapped and d.name in macs) / sum(macs.values())


def _check_sqnr(out: dict) -> list[float]:
    values = [d["sqnr_db"] for d in out["layers"] if d["swapped"]]
    assert len(values) == out["swapped"] > 0
    for value in values:
        assert value is not None and math.isfinite(value)
        assert SQNR_RANGE_DB[0] < value < SQNR_RANGE_DB[1], values
    assert all(d["sqnr_db"] is None for d in out["layers"] if not d["swapped"])
    return values


def test_entry_point_runs():
    script = Path(sys.executable).with_name("fp8-plugin")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "fp8_plugin.tools.cli"]
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("inspect", "devices", "export"):
        assert name in done.stdout


def test_inspect_minilm_json():
    from transformers import AutoModel

    out = _json(_run("inspect", minilm_path(), "--json", "--seq-len", "64"))
    model = AutoModel.from_pretrained(minilm_path(), local_files_only=True, dtype=torch.float32)
    report = convert_model(model, AutoRecipe(), device="cpu")
    assert out["model_class"] == "BertModel"
    assert out["recipe"] == "DelayedScaling(HYBRID)"
    assert (out["swapped"], out["skipped"]) == (len(report.swapped), len(report.skipped)) == (36, 1)
    assert [(d["name"], d["swapped"], d["reason"]) for d in out["layers"]] == [
        (d.name, d.swapped, d.reason) for d in report.layers]
    assert out["fp8_flop_share"] == pytest.approx(_expected_share(report.layers), rel=1e-12) == 1.0
    # One forward of 64 tokens, 2 FLOPs per multiply-add: 6 blocks x (4 x 384 x 384 + 2 x 384 x
    # 1536) per token in FP8; the 384 x 384 pooler (a head) on the first token only; Q K^T and
    # scores x V: 12 heads of 32, 64 x 64 scores, in each block.
    layers = 2 * 64 * 6 * (4 * 384 * 384 + 2 * 384 * 1536)
    flops = out["gemm_flops"]
    assert (flops["tokens"], flops["fp8"], flops["counted"]) == (64, layers, layers)
    assert flops["by_role"] == {"layer": layers, "expert": 0, "head": 2 * 384 * 384, "router": 0,
                                "other": 6 * 2 * 12 * 64 * 64 * (32 + 32)}
    assert flops["share_of_all"] == pytest.approx(layers / sum(flops["by_role"].values()), rel=1e-12)
    assert "excepted: output heads, MoE routers, attention score" in out["flop_note"]
    assert out["sample"]["source"] == "tokenizer" and out["sample"]["tokens"] == 64
    values = _check_sqnr(out)
    assert 25.0 < sorted(values)[len(values) // 2] < 35.0  # the median: E4M3 rounding, about 29 dB


def test_inspect_minilm_table_with_options():
    result = _run("inspect", minilm_path(), "--recipe", "fp8-current", "--exclude", "*.output.dense",
                  "--seq-len", "32", "--sample-text", "Shares rose in London on Monday.")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "recipe fp8-current -> Float8CurrentScaling(HYBRID)" in text
    # attention.output.dense and output.dense of 6 blocks matched by the exclude pattern.
    assert "24 of 37 linear layers in FP8" in text
    assert text.count("matched by exclude") == 12
    assert "output head ('pooler')" in text
    share = (3 * 384 * 384 + 384 * 1536) / (4 * 384 * 384 + 2 * 384 * 1536)  # the pooler excepted
    assert f"FP8 share of GEMM FLOPs: {share:.1%}" in text
    assert "in one forward of 32 tokens" in text and "attention score matmuls" in text
    assert "Quantization error on a sample batch (32 tokens: the sample text through MODEL_PATH's tokenizer)" in text
    rows = re.findall(r"^(encoder\.\S+)\s+\d+\s+\d+\s+([\d.]+)$", text, flags=re.M)
    assert len(rows) == 24
    assert all(SQNR_RANGE_DB[0] < float(db) < SQNR_RANGE_DB[1] for _, db in rows)


def test_inspect_tiny_gpt2_conv1d(tiny_gpt2):
    from transformers import AutoModelForCausalLM

    out = _json(_run("inspect", tiny_gpt2, "--json"))
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, local_files_only=True)
    report = convert_model(model, AutoRecipe(), device="cpu")
    assert out["model_class"] == "GPT2LMHeadModel"  # from config.architectures
    assert (out["swapped"], out["skipped"]) == (len(report.swapped), len(report.skipped)) == (8, 1)
    assert {d["kind"] for d in out["layers"] if d["swapped"]} == {"Conv1D"}
    assert [d["name"] for d in out["layers"] if not d["swapped"]] == ["lm_head"]
    assert out["fp8_flop_share"] == pytest.approx(_expected_share(report.layers), rel=1e-12)
    assert out["sample"]["source"].startswith("random token ids, seed 0")
    assert out["sample"]["tokens"] == 64  # --seq-len 128 capped at n_positions
    _check_sqnr(out)


def test_inspect_include_and_skip_small(tiny_gpt2):
    out = _json(_run("inspect", tiny_gpt2, "--json", "--include", "c_fc", "--recipe", "fp8-mxfp8"))
    assert [d["name"] for d in out["layers"] if d["swapped"]] == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    assert out["recipe"].startswith("MXFP8BlockScaling")
    _check_sqnr(out)
    # Every layer of this model is too small for FP8 to be faster: nothing swapped, and said so.
    out = _json(_run("inspect", tiny_gpt2, "--json", "--skip-small", "true"))
    assert out["swapped"] == 0 and out["fp8_flop_share"] == 0.0
    assert any("no layer to run in FP8" in w for w in out["warnings"])


def test_devices():
    result = _run("devices")
    assert result.exit_code == 0, result.output
    assert "CPU (cpu)" in result.stdout
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
        assert name in result.stdout
    out = _json(_run("devices", "--json"))
    expected = 1 + (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert len(out["devices"]) == expected and out["devices"][0]["device"] == "cpu"
    assert len(out["devices"][0]["recipes"]) == 4


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A BERT with dims of 128 and 256, which hf-fp8 stores in 128x128 blocks (GPT-2's Conv1D it cannot)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                        vocab_size=512, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_bert")
    BertModel(config).save_pretrained(path)
    return path


_EXPORT_MISSING = importlib.util.find_spec("fp8_plugin.tools.export") is None
needs_export = pytest.mark.skipif(_EXPORT_MISSING, reason="fp8_plugin/tools/export.py (fp8_plugin.tools.export.export) is not "
                                  "in this checkout")


@needs_export
@pytest.mark.parametrize("fmt, model", [("hf", "gpt2"), ("hf", "bert"), ("hf-fp8", "bert")])
def test_export(tiny_gpt2, tiny_bert, tmp_path, fmt, model):
    # Loading the checkpoints back is tested with fp8_plugin.tools.export itself; here: the command ran.
    out_dir = tmp_path / fmt
    result = _run("export", tiny_gpt2 if model == "gpt2" else tiny_bert, out_dir, "--format", fmt)
    assert result.exit_code == 0, result.output
    assert (out_dir / "model.safetensors").is_file()
    config = json.loads((out_dir / "config.json").read_text())
    assert ("quantization_config" in config) == (fmt == "hf-fp8")
    assert f"wrote {fmt} checkpoint to {out_dir}" in result.stdout
    if fmt == "hf-fp8":
        # 12 FP8 layers stored in E4M3; the pooler head stays in high precision.
        assert config["quantization_config"]["quant_method"] == "fp8"
        assert config["quantization_config"]["modules_to_not_convert"] == ["pooler.dense"]
        assert "12 of 13 linear layers in FP8" in result.stdout


@needs_export
def test_export_hf_fp8_refused_for_conv1d(tiny_gpt2, tmp_path):
    # GPT-2's Conv1D weights have no fine-grained FP8 layout: a clear error, exit 1, nothing written.
    result = _run("export", tiny_gpt2, tmp_path / "out", "--format", "hf-fp8")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert "format='hf-fp8'" in result.stderr and "valid for this model: format='hf'" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["inspect", "{gpt2}", "--recipe", "fp8-bogus"],
         ["'--recipe'", "'fp8-bogus'", "'auto'", "'fp8-delayed'", "'fp8-blockwise'"]),
        (["inspect", "{missing}"], ["MODEL_PATH", "does not exist", "valid: a local folder"]),
        (["inspect", "{empty}"], ["MODEL_PATH", "no config.json", "valid:"]),
        (["inspect", "{no_weights}"], ["MODEL_PATH", "could not be loaded with AutoModelForCausalLM", "valid:"]),
        (["inspect", "{gpt2}", "--include", "nothing*"],
         ["'--include'", "'nothing*'", "matches no linear layer", "'transformer.h.0.attn.c_attn'"]),
        (["inspect", "{gpt2}", "--skip-small", "maybe"], ["'--skip-small'", "'maybe'", "'auto', 'true', 'false'"]),
        (["inspect", "{gpt2}", "--device", "tpu"], ["'--device'", "'tpu'", "valid here: cpu"]),
        (["inspect", "{gpt2}", "--device", "cuda:7"], ["'--device'", "'cuda:7'", "valid here: cpu"]),
        (["export", "{gpt2}", "{out}", "--format", "gguf"], ["'--format'", "'gguf'", "'hf', 'hf-fp8'"]),
        (["export", "{missing}", "{out}"], ["MODEL_PATH", "does not exist"]),
    ],
    ids=["recipe", "missing-path", "not-a-checkpoint", "no-weights", "include", "skip-small", "device", "cuda-index", "format",
         "export-path"],
)
def test_user_errors(tiny_gpt2, tmp_path, args, expected):
    (tmp_path / "e").mkdir()
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text((tiny_gpt2 / "config.json").read_text())
    names = {"gpt2": tiny_gpt2, "missing": tmp_path / "nope", "empty": tmp_path / "e", "no_weights": tmp_path / "w",
             "out": tmp_path / "o"}
    result = _run(*[a.format(**{k: str(v) for k, v in names.items()}) for a in args])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # a usage error, not a crash
    assert "Traceback" not in result.output
    text = _flat(result.output)
    for part in expected:
        assert part in text, (part, text)


def test_inspect_an_fp8_checkpoint_lists_its_frozen_fp8_layers_and_refuses_a_recipe_that_cannot_read_them(tmp_path):
    from test_frozen_fp8 import llama

    export(llama(), tmp_path / "fp8", "hf-fp8")
    out = _json(_run("inspect", tmp_path / "fp8", "--json"))
    frozen = [d for d in out["layers"] if d["frozen_fp8"]]
    assert len(frozen) == 7 and all(d["frozen_fp8"] == "E4M3, 128x128 blocks" for d in frozen)
    # q_proj: 256 x 256 E4M3 bytes and a 2 x 2 float32 scale grid.
    q = next(d for d in frozen if d["name"].endswith("q_proj"))
    assert q["weight_bytes"] == 256 * 256 + 4 * 4
    result = _run("inspect", tmp_path / "fp8", "--recipe", "fp8-delayed")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "valid recipes for it: Float8BlockScaling()" in _flat(result.output)
