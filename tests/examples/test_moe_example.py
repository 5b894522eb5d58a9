"""examples/finetune_moe.py: sparse upcycling of the real SmolLM2-135M-Instruct checkpoint into a
4-expert MixtralForCausalLM, and its FP8 fine-tune through Lightning.

The step-0 equivalence is checked two ways on real text (BBC News): each MoE block against the
dense MLP it was copied from, on the hidden states SmolLM2 itself produces, within a
float32 error bound derived op by op; and the whole model's logits, in float64 and float32.
The run tests count the FP8 GEMMs of the linear layers and of the experts, so that layers that
silently ran in high precision fail them.
"""

import importlib.util
import math
import os
import re
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("lightning")

from reference import assert_state_dicts_equal, count_fp8_gemms  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
U32, U64 = 2.0**-24, 2.0**-53  # unit roundoff of float32, float64
# max |silu'(x)| over the reals: silu'(x) = s(x)(1 + x(1 - s(x))), s the logistic function; its
# maximum 1.0998 is at x = 2.3994.
SILU_LIPSCHITZ = 1.0999


def _example():
    spec = importlib.util.spec_from_file_location("finetune_moe", ROOT / "examples" / "finetune_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _example()


@pytest.fixture(scope="module")
def model_path(smollm2_path):
    """The float32 SmolLM2 folder the examples share (tests/conftest.py converts it once)."""
    return Path(smollm2_path)


@pytest.fixture(scope="module")
def text_ids(model_path):
    """Two blocks of 48 tokens of BBC News, [2, 48] int64."""
    from transformers import AutoTokenizer

    from fp8_plugin.tools.data import bbc_news_path, load_text_folders

    texts, _, _ = load_text_folders(bbc_news_path())
    ids = AutoTokenizer.from_pretrained(model_path)(texts[0] + "\n" + texts[1], add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:96]).view(2, 48)


def test_config_maps_every_smollm2_field_onto_mixtral(example, model_path):
    from transformers import AutoConfig

    dense = AutoConfig.from_pretrained(model_path)
    config = example.mixtral_config(dense, 4, 2)
    # SmolLM2-135M's architecture, from its config.json, and what Mixtral must take from it.
    expected = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
                    tie_word_embeddings=True, max_position_embeddings=8192)
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.rope_parameters["rope_theta"] == dense.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == dense.rms_norm_eps
    assert (config.num_local_experts, config.num_experts_per_tok, config.sliding_window) == (4, 2, None)
    assert config.router_jitter_noise == 0.0 and not config.output_router_logits
    for field in ("attention_bias", "mlp_bias"):
        wrong = AutoConfig.from_pretrained(model_path, **{field: True})
        with pytest.raises(ValueError, match=field):
            example.mixtral_config(wrong)


def _mlp_bound(x: torch.Tensor, mlp, u: float, weighting: float = 0.0) -> torch.Tensor:
    """Per-element bound on |fl(MLP(x)) - MLP(x)| for a SwiGLU MLP (y = D (silu(G x) * U x))
    computed with unit roundoff ``u``, plus ``weighting * |y|``: what a MoE block adds by
    weighting its experts' outputs.

    Higham, "Accuracy and Stability of Numerical Algorithms", 3.1: a K-term dot product errs by at
    most gamma_K sum |a||b|, gamma_K = K u / (1 - K u). First order in u: the error of g = Gx and
    v = Ux propagates through silu (Lipschitz constant 1.0999; torch's silu x / (1 + exp(-x))
    taken to round at most 4 times) and the product (one rounding), then through D with the down
    projection's own gamma_I. Computed in float64 from the inputs as given.
    """
    x = x.double()
    g_w, v_w, d_w = (mlp.gate_proj.weight.double(), mlp.up_proj.weight.double(), mlp.down_proj.weight.double())
    h_dim, i_dim = g_w.shape[1], g_w.shape[0]
    gamma = lambda k: k * u / (1 - k * u)  # noqa: E731
    g, v = x @ g_w.T, x @ v_w.T
    e_g, e_v = gamma(h_dim) * (x.abs() @ g_w.abs().T), gamma(h_dim) * (x.abs() @ v_w.abs().T)
    s = torch.nn.functional.silu(g)
    e_s = SILU_LIPSCHITZ * e_g + 4 * u * s.abs()
    h = s * v
    e_h = e_s * (v.abs() + e_v) + s.abs() * e_v + u * h.abs()
    y = h @ d_w.T
    e_y = e_h @ d_w.abs().T + gamma(i_dim) * ((h.abs() + e_h) @ d_w.abs().T)
    return (e_y + weighting * y.abs()) * (1 + 8 * u)  # the slack covers second-order terms


def test_upcycled_blocks_compute_the_dense_mlp_within_rounding_on_real_text(example, model_path, text_ids):
    """Every layer, float32 and float64: the MoE block on the input SmolLM2's own MLP sees (real
    text) returns that MLP's output within the two computations' rounding error bounds.

    Mixtral's router normalises the top-2 softmax weights in float32 whatever the model's dtype
    (``softmax(router_logits.float())``): they sum to 1 within 3 u32 (the sum and each division
    rounded once, plus one unit of slack); weighting each expert's output and adding the two
    round 3 more times in the model's dtype. So even in float64 the block is the MLP only to
    3 u32 relative: the float32 normalisation is the one difference upcycling makes.
    """
    dense = example.load_dense(model_path)
    moe = example.upcycle(dense, 4, 2, router_std=1e-3, seed=0)
    routed = set()
    for dtype, u in ((torch.float32, U32), (torch.float64, U64)):
        if dtype == torch.float64:
            dense.double(), moe.double()
            moe.config._experts_implementation = "eager"  # torch._grouped_mm takes no float64
        inputs = {}
        hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
                 for i, layer in enumerate(dense.model.layers)]
        with torch.no_grad():
            dense(input_ids=text_ids)
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for i, layer in enumerate(dense.model.layers):
                x = inputs[i].reshape(-1, 576)
                got = moe.model.layers[i].mlp(inputs[i]).reshape(-1, 576)
                want = layer.mlp(x)
                bound = _mlp_bound(x, layer.mlp, u) + _mlp_bound(x, layer.mlp, u, 3 * U32 + 3 * u)
                excess = ((got - want).abs().double() - bound).max().item()
                assert excess <= 0, (dtype, i, excess)
                _, _, index = moe.model.layers[i].mlp.gate(x)
                routed.update(index.unique().tolist())
    assert routed == {0, 1, 2, 3}  # the near-zero router still spreads tokens over every expert


def test_upcycled_logits_equal_smollm2_logits_at_step_0_on_real_text(example, model_path, text_ids):
    """The whole model: the upcycled logits are SmolLM2's to within SmolLM2's own float32 rounding.

    Both models compute the same function f (the test above: block by block), so each one's
    float32 logits err from f by its own rounding; SmolLM2's, e32, is measured against its
    float64 evaluation. The upcycled model rounds in the same operations (plus 3 per MoE block,
    the per-layer bound), so it lands within about e32 of f too, and the two float32 evaluations
    within 2 e32 of each other. In float64 the models differ only by the router's float32
    normalisation (3 u32 relative per MoE block output), a smaller perturbation than a float32
    evaluation's (u32 in every operation, K-term sums): within e32.
    """
    dense = example.load_dense(model_path)
    moe = example.upcycle(dense, 4, 2, router_std=1e-3, seed=0)
    with torch.no_grad():
        d32, m32 = dense(input_ids=text_ids).logits, moe(input_ids=text_ids).logits
        moe.config._experts_implementation = "eager"  # torch._grouped_mm takes no float64
        d64, m64 = dense.double()(input_ids=text_ids).logits, moe.double()(input_ids=text_ids).logits
    e_dense, e_moe = (d32.double() - d64).abs().max().item(), (m32.double() - m64).abs().max().item()
    assert 0 < e_dense < 1e-3 and 0 < e_moe < 1e-3  # float32 evaluations of a 30-layer model, not broken ones
    assert (m32.double() - d32.double()).abs().max().item() <= 2 * e_dense
    assert (m64 - d64).abs().max().item() <= e_dense
    # And the model's own loss: perplexity unchanged by the upcycling, to float32 rounding.
    assert math.isclose(dense.float()(input_ids=text_ids, labels=text_ids).loss.item(),
                        moe.float()(input_ids=text_ids, labels=text_ids).loss.item(), rel_tol=1e-5)


def test_example_runs_fp8_and_reference_with_fp8_gemms_counted(example, model_path, capsys):
    from fp8_plugin.modules.experts import expert_gemm_counts

    argv = ["--model-path", str(model_path), "--num-layers", "2", "--max-steps", "2", "--seq-len", "32",
            "--batch-size", "2", "--val-blocks", "2"]
    experts_before = expert_gemm_counts()
    with count_fp8_gemms() as linear:
        results = example.main(argv)
    experts = {k: v - experts_before[k] for k, v in expert_gemm_counts().items()}
    out = capsys.readouterr().out
    # FP8 run only: 2 layers x 4 attention projections (lm_head and routers stay high precision),
    # fprop, dgrad and wgrad in each of 2 steps, then fprop in the one validation batch; its
    # second validation (FP8 layers off), the reference run and the coverage forward add none.
    assert linear.count == 2 * 3 * 8 + 8, linear.count
    # 2 layers x 2 projections (gate_up, down): per step fprop, dgrad, wgrad; validation fprop.
    assert experts == {"fprop": 2 * 4 + 4, "dgrad": 2 * 4, "wgrad": 2 * 4}, experts
    assert results[0]["expert_gemms"] == {"fprop": 8, "dgrad": 8, "wgrad": 8}
    assert results[0]["fp8_share"] == 1.0 and results[1]["fp8_share"] is None
    before = re.search(r"before training \(float32\): SmolLM2 ([\d.]+), upcycled ([\d.]+)", out)
    assert before, out[-3000:]  # the same perplexity: exp of float32 losses that agree to ~1e-6 relative
    assert math.isclose(float(before.group(1)), float(before.group(2)), rel_tol=1e-4)
    rows = re.findall(r"^(fp8-hybrid \(\w+ elsewhere\)|\S+ \(reference\))\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                      r"\s+([\d.]+)\s+(\S+)$", out, re.M)
    assert [r[0].split()[0] for r in rows] == ["fp8-hybrid", results[1]["precision"].split()[0]], out[-2000:]
    assert rows[0][6] == "100.0%" and rows[1][6] == "-"
    assert all(float(r[1]) > 1 and float(r[2]) > 1 and float(r[3]) > 1 for r in rows)
    # The FP8 run validated twice: in FP8 (the count above) and in high precision, which differ;
    # the reference run once, its one figure in both columns.
    assert results[0]["ppl_after_fp8_off"] != results[0]["ppl_after"]
    assert results[1]["ppl_after_fp8_off"] == results[1]["ppl_after"]
    changes = re.search(r"FP8 against the reference: ([+-][\d.]+)% validated in each run's precision, "
                        r"([+-][\d.]+)% both validated in the reference's precision", out)
    assert changes, out[-2000:]
    for column, key in ((1, "ppl_after"), (2, "ppl_after_fp8_off")):  # hand-computed relative changes
        assert float(changes.group(column)) == pytest.approx(100 * (results[0][key] / results[1][key] - 1), abs=0.006)
    assert "FP8 share of GEMM FLOPs: 100.0%" in out


def test_upcycled_lightning_run_resumes_bit_for_bit_and_saves_a_plain_transformers_model(example, model_path,
                                                                                        text_ids, tmp_path):
    """The issue's checkpoint round trip, on the upcycled model cut to 2 layers: a fit resumed from
    its epoch-0 checkpoint repeats the uninterrupted run's epoch-1 losses and ends with identical
    weights and FP8 state; ``save_pretrained`` loads into plain ``MixtralForCausalLM`` and gives
    the same logits in high precision."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader
    from transformers import MixtralForCausalLM

    from fp8_plugin.modules.convert import fp8_state_dict
    from fp8_plugin.modules.experts import FP8ExpertsMixin

    blocks = text_ids.reshape(4, 24)

    class Losses(Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    def fit(ckpt_path=None, save=False):
        torch.manual_seed(0)
        losses = Losses()
        callbacks = [losses] + ([ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")] if save else [])
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="fp8-hybrid", max_epochs=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=save,
                            callbacks=callbacks, num_sanity_val_steps=0)
        module = example.UpcycledLM(example.upcycle(example.load_dense(model_path, 2)), lr=1e-3, total_steps=4)
        trainer.fit(module, DataLoader(blocks, batch_size=2), ckpt_path=ckpt_path)
        assert any(isinstance(m, FP8ExpertsMixin) for m in module.modules())
        return losses.losses, module, {**module.state_dict(), **fp8_state_dict(module)}

    full_losses, module, full = fit(save=True)
    resumed_losses, _, resumed = fit(ckpt_path=tmp_path / "epoch=0.ckpt")
    assert resumed_losses == full_losses[2:]
    assert any(".experts.fp8_scaling." in k for k in full)
    assert_state_dicts_equal(full, resumed)

    module.model.save_pretrained(tmp_path / "hf")
    plain = MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not any(isinstance(m, FP8ExpertsMixin) for m in plain.modules())
    module.model.eval()
    with torch.no_grad():  # outside the FP8 autocast: high precision
        assert torch.equal(module.model(input_ids=text_ids).logits, plain(input_ids=text_ids).logits)

