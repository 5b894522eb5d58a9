"""examples/finetune_lora_fp8.py: the real SmolLM2-135M-Instruct written as a fine-grained FP8
checkpoint, loaded back with its FP8 weights kept as in the file, and LoRA-tuned on BBC News.
One short FP8 run: the FP8 GEMMs counted, the base's resident bytes against BF16's, and the
frozen weights still the checkpoint's bytes at the end."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from reference import count_fp8_gemms

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("finetune_lora_fp8", ROOT / "examples" / "finetune_lora_fp8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_lora_example_keeps_the_checkpoint_bytes_and_runs_fprop_and_dgrad_in_fp8(example, smollm2_path,
                                                                                    tmp_path, capsys):
    argv = ["--model-path", str(smollm2_path), "--fp8-path", str(tmp_path / "fp8"), "--precision", "fp8",
            "--in-process", "--max-steps", "1", "--seq-len", "16", "--batch-size", "2", "--val-blocks", "2",
            "--rank", "2"]
    with count_fp8_gemms() as gemms:
        (result,) = example.main(argv)
    # SmolLM2: 30 layers x 7 projections, all frozen in FP8. One step: 210 fprops and the dgrads of
    # the layers whose input requires grad, all but layer 0's q, k, v (their input, the normed
    # embeddings, is frozen). No wgrad. The perplexities run in high precision (no autocast), then
    # the FP8 validation after training: 210 fprops for its one batch of 2 blocks.
    assert result["frozen_layers"] == 210
    assert gemms.count == 210 + 207 + 210
    assert result["ppl_after_fp8"] > 1
    assert result["frozen_unchanged"] is True
    assert result["weight_bytes"] <= 0.55 * result["bf16_bytes"]
    assert result["ppl_after"] > 1 and result["ppl_before"] > 1
    out = capsys.readouterr().out
    assert "210 frozen FP8 weights still the checkpoint's bytes: True" in out
    assert (tmp_path / "fp8" / "model.safetensors").is_file()
