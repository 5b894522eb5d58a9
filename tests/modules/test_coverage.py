"""FP8 coverage as a number (fp8_plugin/modules/coverage.py): the FP8 share of a model's GEMM
FLOPs in one forward at batch 1, and a sweep of tiny configs of the Hugging Face families.

The share's denominator is the GEMM FLOPs of the linear layers and MoE experts. Excepted from it
(counted, and reported beside it): output heads (``get_output_embeddings``, weights tied to an
embedding, ``lm_head`` / ``cls`` / ``classifier`` / ``score`` / ``pooler`` ... name components:
BERT's ``cls.predictions.transform.dense`` is one), MoE routers (the ``gate`` / ``router``
module beside an experts module), and the matrix products no layer makes (attention's
``Q K^T`` and ``scores x V``). Embeddings are lookups, not GEMMs: no FLOPs at all.
Expected figures below come from the configs by hand: a linear layer costs ``2 x tokens x in x
out`` FLOPs, an experts module ``2 x top_k x tokens x`` one expert's weight elements.
"""

import time

import pytest
import torch
import transformers as tf
from torch import nn

import fp8_plugin as fp
from fp8_plugin.modules.coverage import GemmCount, measure_gemm_coverage, register_gemm_counter
from fp8_plugin.modules.experts import expert_gemm_counts
from reference import count_fp8_gemms

H, I, LAYERS, VOCAB, POSITIONS, SEQ = 64, 128, 2, 128, 512, 512
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=POSITIONS, bos_token_id=0, eos_token_id=0, pad_token_id=0)
DECODER = dict(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=4,
               num_key_value_heads=2, **COMMON)
TOP_K, EXPERTS = 2, 4

# Tiny configs: every dim a multiple of 16 (FP8-eligible), 512 positions.
FAMILIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**DECODER)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**DECODER)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**DECODER, head_dim=16)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**DECODER)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=H, n_layer=LAYERS, n_head=4, vocab_size=VOCAB,
                                                     n_positions=POSITIONS, bos_token_id=0, eos_token_id=0)),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(hidden_size=H, intermediate_size=I,
                                                               num_hidden_layers=LAYERS, num_attention_heads=4,
                                                               **COMMON)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(hidden_size=H, ffn_dim=I, num_hidden_layers=LAYERS,
                                                  num_attention_heads=4, word_embed_proj_dim=H, **COMMON)),
    "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(hidden_size=H, num_hidden_layers=LAYERS,
                                                           num_attention_heads=4, **COMMON)),
    "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                                                     num_attention_heads=4, vocab_size=VOCAB,
                                                     max_position_embeddings=POSITIONS)),
    "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(d_model=H, d_kv=16, d_ff=I, num_layers=LAYERS,
                                                            num_heads=4, vocab_size=VOCAB, decoder_start_token_id=0,
                                                            pad_token_id=0, eos_token_id=1)),
    "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**DECODER, num_local_experts=EXPERTS,
                                                              num_experts_per_tok=TOP_K)),
    "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**DECODER, num_experts=EXPERTS,
                                                                  num_experts_per_tok=TOP_K, moe_intermediate_size=I,
                                                                  head_dim=16)),
    # Shared experts too, gated by a 64 x 1 linear (too narrow for FP8: 99.9%).
    "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**DECODER, num_experts=EXPERTS,
                                                                  num_experts_per_tok=TOP_K, moe_intermediate_size=I,
                                                                  shared_expert_intermediate_size=I)),
    "olmoe": lambda: tf.OlmoeForCausalLM(tf.OlmoeConfig(**DECODER, num_experts=EXPERTS, num_experts_per_tok=TOP_K)),
    # Shared experts (plain MLPs beside the routed ones) and a dense first layer.
    "deepseek_v3": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **{**DECODER, "num_key_value_heads": 4}, moe_intermediate_size=I, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)),
    "gpt_oss": lambda: tf.GptOssForCausalLM(tf.GptOssConfig(
        **DECODER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=16, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"])),
}
# MoE layers of each MoE family; one expert holds gate, up and down projections of H x I.
MOE_LAYERS = {"mixtral": 2, "qwen3_moe": 2, "qwen2_moe": 2, "olmoe": 2, "deepseek_v3": 1, "gpt_oss": 2}
STEPS = 2
_TIMES: dict[str, float] = {}


def _build(family: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]()


def _train(model: nn.Module, steps: int) -> tuple[int, dict[str, int]]:
    """FP8 GEMMs of the linear layers and grouped FP8 expert GEMMs (by kind) over ``steps`` steps."""
    ids = torch.randint(1, VOCAB, (2, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = expert_gemm_counts()
    with count_fp8_gemms() as gemms:
        for _ in range(steps):
            with fp.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert torch.isfinite(loss)
    after = expert_gemm_counts()
    return gemms.count, {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_share_at_least_95_percent_and_trains_in_fp8(family):
    """At 512 tokens at least 95% of the linear layers' and experts' GEMM FLOPs run in FP8 (heads,
    MoE routers, attention's Q K^T / scores x V excepted; embeddings are no GEMMs), and two
    training steps run every FP8 layer's and experts module's forward, dgrad and wgrad in FP8."""
    start = time.perf_counter()
    model = _build(family)
    report = fp.convert_model(model)
    coverage = report.gemm_coverage(model, SEQ)
    assert coverage.tokens == SEQ
    assert coverage.share >= 0.95, coverage
    assert str(coverage) in str(report)
    moe = MOE_LAYERS.get(family, 0)
    # Experts: 2 x (top_k x tokens routed) x 3 H I per MoE layer, from the config.
    assert coverage.flops(("expert",)) == moe * 2 * TOP_K * SEQ * 3 * H * I
    assert coverage.flops(("expert",), fp8=True) == coverage.flops(("expert",))
    assert coverage.flops(("router",), fp8=True) == 0 and (coverage.flops(("router",)) > 0) == bool(moe)
    # A head (lm_head, or BERT's cls.*) on every token: 2 x tokens x H x vocab at least.
    assert coverage.flops(("head",)) >= 2 * SEQ * H * VOCAB

    linears = sum(isinstance(m, fp.FP8Linear) for m in model.modules())
    gemms, expert_gemms = _train(model, STEPS)
    assert linears > 0 and gemms == STEPS * 3 * linears  # forward, dgrad, wgrad of every FP8 layer
    # gate_up and down of every experts module: one grouped FP8 GEMM each per kind and step.
    assert expert_gemms == {"fprop": STEPS * 2 * moe, "dgrad": STEPS * 2 * moe, "wgrad": STEPS * 2 * moe}
    _TIMES[family] = time.perf_counter() - start


def test_sweep_time():
    # Runs after the sweep (file order): the sweep must stay fast, under about 60 s in all.
    if len(_TIMES) < len(FAMILIES):
        pytest.skip("the sweep did not run in full in this session")
    assert sum(_TIMES.values()) < 60.0, _TIMES


def test_llama_figures_by_hand():
    model = _build("llama")
    untouched = measure_gemm_coverage(model, 256)
    fp.convert_model(model, exclude=["down_proj"])
    coverage = measure_gemm_coverage(model, 256)
    tokens, kv = 256, 32  # 2 key-value heads of 16
    per_block = H * H + 2 * H * kv + H * H + 3 * H * I  # q, k, v, o, gate, up, down
    layers = 2 * tokens * LAYERS * per_block
    assert coverage.flops(("layer",)) == untouched.flops(("layer",)) == layers
    assert coverage.flops(("head",)) == 2 * tokens * H * VOCAB
    # Q K^T and scores x V: 4 query heads of 16, tokens x tokens each, per block.
    assert coverage.flops(("other",)) == LAYERS * 2 * 4 * tokens * tokens * (16 + 16)
    assert untouched.share == 0.0
    assert coverage.share == pytest.approx(1 - H * I / per_block, rel=1e-12)
    assert coverage.share_of_all == pytest.approx(coverage.fp8_flops / coverage.flops(), rel=1e-12)


def test_experts_left_in_high_precision_lower_the_share():
    model = _build("mixtral")
    coverage = fp.convert_model(model, exclude=["experts"]).gemm_coverage(model, SEQ)
    attention = H * H + 2 * H * 32 + H * H  # q, k, v, o per token
    experts = TOP_K * 3 * H * I  # per token
    assert coverage.share == pytest.approx(attention / (attention + experts), rel=1e-12)  # 0.2
    assert coverage.flops(("expert",), fp8=True) == 0


def test_bert_pooler_runs_on_one_token():
    # The pooler reads the first token only: measured, not assumed per token.
    torch.manual_seed(0)
    model = tf.BertModel(tf.BertConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=1,
                                       num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=POSITIONS))
    fp.convert_model(model)
    coverage = measure_gemm_coverage(model, 100)
    heads = [g for g in coverage.gemms if g.role == "head"]
    assert [(g.name, g.flops) for g in heads] == [("pooler.dense", 2 * 1 * H * H)]
    assert coverage.flops(("layer",)) == 2 * 100 * (4 * H * H + 2 * H * I)


class _StandInExperts(nn.Module):
    """A MoE experts module of its own kind: weights [E, out, in], a loop over experts."""

    def __init__(self, experts=EXPERTS, hidden=32, inner=48):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, inner, hidden) / hidden ** 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, inner) / inner ** 0.5)
        self.inner = nn.Linear(hidden, hidden)  # below the owner: its FLOPs are the owner's
        self.fp8 = False

    def forward(self, x, index):
        out = self.inner(x)
        for e in range(self.w_in.shape[0]):
            rows = (index == e).any(-1)
            out[rows] += (x[rows] @ self.w_in[e].T).relu() @ self.w_out[e].T
        return out


class _StandInModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = _StandInExperts()

    def forward(self, x, index):
        return self.experts(x, index)


def test_a_registered_counter_reports_its_modules_gemms():
    def count(module, args, kwargs, output):
        routed = int((args[1] >= 0).sum())
        return GemmCount(2 * routed * (32 * 48 + 48 * 32), module.fp8)

    model = _StandInModel()
    x = torch.randn(10, 32)
    index = torch.tensor([[0, 1]] * 4 + [[2, -1]] * 6)  # 8 + 6 = 14 routed, expert 3 empty
    remove = register_gemm_counter(lambda m: "expert" if isinstance(m, _StandInExperts) else None, count)
    try:
        coverage = measure_gemm_coverage(model, inputs={"x": x, "index": index})
        model.experts.fp8 = True
        fp8 = measure_gemm_coverage(model, inputs={"x": x, "index": index})
    finally:
        remove()
    assert [(g.name, g.role, g.flops, g.fp8) for g in coverage.gemms if g.role != "other"] == [
        ("experts", "expert", 2 * 14 * 2 * 32 * 48, False)]
    # The loop's products and the inner linear were measured inside the owner: not "other".
    assert coverage.flops(("other",)) == 0
    assert (coverage.share, fp8.share) == (0.0, 1.0)
    # Unregistered: the inner linear is a layer of its own, the expert loop lands in "other".
    plain = measure_gemm_coverage(model, inputs={"x": x, "index": index})
    assert [g.name for g in plain.gemms if g.role == "layer"] == ["experts.inner"]
    assert plain.flops(("other",)) > 0


@pytest.mark.parametrize("seq_len", [0, -3, 2.5, True])
def test_bad_seq_len_is_refused(seq_len):
    with pytest.raises(ValueError, match=rf"seq_len={seq_len!r} is not valid; valid: a positive int"):
        measure_gemm_coverage(nn.Linear(16, 16), seq_len)


def test_seq_len_beyond_the_positions_is_refused():
    model = FAMILIES["gpt2"]()
    with pytest.raises(ValueError, match=r"seq_len=600 exceeds the model.s max_position_embeddings=512; valid: 1 to 512"):
        measure_gemm_coverage(model, 600)


def test_a_model_without_a_vocabulary_needs_inputs():
    with pytest.raises(ValueError, match=r"no config.vocab_size .* valid: pass inputs="):
        measure_gemm_coverage(nn.Linear(16, 16), 8)
