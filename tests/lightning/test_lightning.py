"""fp8_plugin/lightning: Trainer(precision="fp8-hybrid") end to end on CPU with real Trainers."""

import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fp8_plugin as fp
from fp8_plugin import FP8Linear
from fp8_plugin.modules.convert import fp8_state_dict
from fp8_plugin.lightning import FP8Precision, precision_plugin_from_string
from fp8_plugin.numerics.quantizers import ROLES
from fp8_plugin.optim import FP8AdamW
from reference import count_fp8_gemms

TRAINER_DEFAULTS = dict(
    accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
    enable_checkpointing=False,
)


class TinyClassifier(L.LightningModule):
    """An MLP whose hidden layers are FP8 candidates and whose head is not."""

    def __init__(self, build_in_configure_model: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = None if build_in_configure_model else self._build()

    @staticmethod
    def _build():
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                             nn.ModuleDict({"classifier": nn.Linear(64, 4)})["classifier"])

    def configure_model(self):
        if self.net is None:
            self.net = self._build()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loader(n=64, batch_size=16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :4].argmax(1)).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def fp8_layers(module):
    return [m for m in module.modules() if isinstance(m, FP8Linear)]


def assert_fp8_was_used(module):
    layers = fp8_layers(module)
    assert layers
    for layer in layers:
        # Amaxes are only recorded on the FP8 path: forward (input, weight) and backward (grad_output).
        recorded = layer.fp8_state.initialized.tolist()
        assert recorded == [True, True, True], dict(zip(ROLES, recorded))


def test_fit_with_fp8_hybrid_swaps_layers_uses_fp8_and_keeps_fp32_params():
    model = TinyClassifier()
    trainer = L.Trainer(precision="fp8-hybrid", max_steps=4, **TRAINER_DEFAULTS)
    assert isinstance(trainer.precision_plugin, FP8Precision) and trainer.precision == "fp8-hybrid"
    with count_fp8_gemms() as gemms:
        trainer.fit(model, loader())
    calls = gemms.dtypes
    assert len(fp8_layers(model)) == 2 and not isinstance(model.net[4], FP8Linear)
    assert_fp8_was_used(model)
    # 2 layers x 4 steps x (forward, dgrad, wgrad), minus dgrad of the first layer (input needs none).
    assert len(calls) == 4 * (3 + 2)
    assert torch.float8_e5m2 in calls  # HYBRID: E5M2 output gradients
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_fp8_e4m3_string_uses_e4m3_in_backward():
    trainer = L.Trainer(precision="fp8-e4m3", max_steps=2, **TRAINER_DEFAULTS)
    with count_fp8_gemms() as gemms:
        trainer.fit(TinyClassifier(), loader())
    assert gemms.count == 2 * (3 + 2) and set(gemms.dtypes) == {torch.float8_e4m3fn}


def test_unknown_fp8_string_lists_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"precision='fp8-e5m2' is not a valid FP8 precision; valid: fp8-hybrid, fp8-e4m3, fp8-hybrid-float16, "
        r"fp8-e4m3-float16, fp8-delayed, fp8-current, fp8-mxfp8, fp8-blockwise",
    ):
        L.Trainer(precision="fp8-e5m2", **TRAINER_DEFAULTS)
    with pytest.raises(ValueError, match="choose one"):
        L.Trainer(precision="fp8-hybrid", plugins=[FP8Precision()], **TRAINER_DEFAULTS)
    with pytest.raises(ValueError, match="compute_dtype=torch.int8.*valid: torch.bfloat16, torch.float16, torch.float32"):
        FP8Precision(compute_dtype=torch.int8)


@pytest.mark.parametrize(
    "precision, recipe_type",
    [("fp8-delayed", fp.DelayedScaling), ("fp8-current", fp.Float8CurrentScaling), ("fp8-mxfp8", fp.MXFP8BlockScaling), ("fp8-blockwise", fp.Float8BlockScaling)],
)
def test_recipe_precision_strings_train_with_their_recipe(precision, recipe_type):
    model = TinyClassifier()
    trainer = L.Trainer(precision=precision, max_steps=2, **TRAINER_DEFAULTS)
    with count_fp8_gemms() as gemms:
        trainer.fit(model, loader())
    assert gemms.count == 2 * (3 + 2)
    assert trainer.precision == precision
    assert all(type(layer.recipe) is recipe_type for layer in fp8_layers(model))
    # Each role's amax is in the layer state (block recipes record it too).
    assert all((layer.fp8_state.amax_history > 0).any(1).all() for layer in fp8_layers(model))


def test_plugin_object_with_custom_recipe():
    recipe = fp.Float8CurrentScaling()
    model = TinyClassifier()
    trainer = L.Trainer(plugins=[FP8Precision(recipe, compute_dtype=torch.float32)], max_steps=2, **TRAINER_DEFAULTS)
    trainer.fit(model, loader())
    assert all(layer.recipe is recipe for layer in fp8_layers(model))
    assert precision_plugin_from_string("FP8-Hybrid").recipe == fp.AutoRecipe(fp.Format.HYBRID)
    assert precision_plugin_from_string("fp8-e4m3").recipe == fp.AutoRecipe(fp.Format.E4M3)


def test_auto_recipe_resolves_to_delayed_scaling_on_cpu():
    # On a CPU only per-tensor GEMMs are native, so "auto" must train with delayed scaling.
    model = TinyClassifier()
    trainer = L.Trainer(precision="fp8-hybrid", max_steps=1, **TRAINER_DEFAULTS)
    trainer.fit(model, loader())
    chosen = fp.DelayedScaling(fp8_format=fp.Format.HYBRID)
    assert trainer.precision_plugin.report.recipe == chosen
    assert all(layer.recipe == chosen for layer in fp8_layers(model))
    assert "recipe DelayedScaling(HYBRID) on cpu: tensorwise GEMMs: torch._scaled_mm or the exact float32 emulation" in str(
        trainer.precision_plugin.report)


def test_configure_model_is_converted_too():
    model = TinyClassifier(build_in_configure_model=True)
    trainer = L.Trainer(precision="fp8-hybrid", max_steps=2, **TRAINER_DEFAULTS)
    trainer.fit(model, loader())
    assert len(fp8_layers(model)) == 2
    assert_fp8_was_used(model)


def test_validation_and_predict_run_under_fp8_and_leave_the_scales_alone():
    # Transformer Engine updates scaling state only for forwards with grad: 10x larger
    # validation and predict batches run FP8 GEMMs but must not touch the training scales.
    model = TinyClassifier()
    trainer = L.Trainer(precision="fp8-hybrid", max_steps=2, limit_val_batches=2, **TRAINER_DEFAULTS)
    trainer.fit(model, loader(), loader())
    before = fp8_state_dict(model)
    big = DataLoader(TensorDataset(torch.randn(32, 32) * 10, torch.zeros(32, dtype=torch.long)), batch_size=16)
    with count_fp8_gemms() as gemms:
        trainer.validate(model, big, verbose=False)
        preds = trainer.predict(model, big)
    assert gemms.count == 2 * 2 * 2  # 2 layers, forward only, 2 batches, validate + predict
    assert preds[0].dtype == torch.bfloat16  # BF16 autocast around the FP8 GEMMs
    after = fp8_state_dict(model)
    for key in before:
        for name in before[key]:
            assert torch.equal(before[key][name], after[key][name]), (key, name)


def test_fp8_figures_are_logged(tmp_path):
    trainer = L.Trainer(
        precision="fp8-hybrid", max_steps=4, log_every_n_steps=2, accelerator="cpu", devices=1,
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="run"), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(TinyClassifier(), loader())
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = [r for r in rows if r.get("fp8/layers")]
    assert logged and float(logged[-1]["fp8/layers"]) == 2.0
    assert float(logged[-1]["fp8/scale_min"]) > 1.0 and float(logged[-1]["fp8/nonfinite_amax"]) == 0.0


def _fit(tmp_path, max_epochs, ckpt_path=None, callbacks=()):
    torch.manual_seed(0)
    model = TinyClassifier()
    trainer = L.Trainer(
        precision="fp8-hybrid", max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        default_root_dir=tmp_path, enable_checkpointing=bool(callbacks),
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model


def test_resume_from_checkpoint_matches_uninterrupted_run_bit_for_bit(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    full = _fit(tmp_path, max_epochs=3, callbacks=[ckpt])
    path = tmp_path / "ckpt" / "epoch=0.ckpt"
    saved = torch.load(path, weights_only=True)
    assert not any(".fp8_state." in k for k in saved["state_dict"])
    assert saved["FP8Precision"]["fp8_state"]

    resumed = _fit(tmp_path, max_epochs=3, ckpt_path=path)
    # FP8 state is settled after every optimizer step: nothing pending in either run.
    full_state, resumed_state = full.state_dict(), resumed.state_dict()
    assert full_state.keys() == resumed_state.keys()
    for key in full_state:
        assert torch.equal(full_state[key], resumed_state[key]), key
    full_fp8, resumed_fp8 = fp8_state_dict(full), fp8_state_dict(resumed)
    assert full_fp8.keys() == resumed_fp8.keys() and len(full_fp8) == 2
    for key in full_fp8:
        for name in full_fp8[key]:
            assert torch.equal(full_fp8[key][name], resumed_fp8[key][name]), (key, name)
        assert not full_fp8[key]["pending"].any()


def test_weights_only_checkpoint_loads_into_the_plain_module(tmp_path):
    # Lightning skips on_save_checkpoint for weights-only saves: the module's own state dict
    # must already be vanilla.
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_weights_only=True, filename="last")
    trained = _fit(tmp_path, max_epochs=1, callbacks=[ckpt])
    path = tmp_path / "ckpt" / "last.ckpt"
    assert not any(".fp8_state." in k for k in torch.load(path, weights_only=True)["state_dict"])
    loaded = TinyClassifier.load_from_checkpoint(path)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained.get_parameter(name)), name


def test_load_from_checkpoint_gives_plain_module_with_trained_weights(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    trained = _fit(tmp_path, max_epochs=1, callbacks=[ckpt])
    loaded = TinyClassifier.load_from_checkpoint(tmp_path / "ckpt" / "epoch=0.ckpt")
    assert not fp8_layers(loaded)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained.get_parameter(name)), name
    # A module converted in advance loads it too (FP8 state simply starts fresh).
    converted = TinyClassifier()
    fp.convert_model(converted)
    state = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=False)["state_dict"]
    converted.load_state_dict(state)


def test_fsdp_strategy_gets_the_fp8_fsdp_plugin():
    # FSDPStrategy accepts FSDPPrecision plugins only; its run needs GPUs, its selection does not.
    from lightning.pytorch.strategies import FSDPStrategy

    from fp8_plugin.lightning import FP8FSDPPrecision

    for strategy in ("fsdp", FSDPStrategy()):
        if not torch.cuda.is_available():
            # Lightning's ShardedGradScaler is disabled without CUDA: float16 is refused at start-up.
            with pytest.raises(ValueError, match="needs an enabled loss scaler"):
                precision_plugin_from_string("fp8-hybrid-float16", strategy=strategy)
            plugin = precision_plugin_from_string("fp8-hybrid", strategy=strategy)
            assert isinstance(plugin, FP8FSDPPrecision) and plugin.compute_dtype == torch.bfloat16
            FSDPStrategy().precision_plugin = plugin  # the strategy's own type check
            continue
        plugin = precision_plugin_from_string("fp8-hybrid-float16", strategy=strategy)
        assert isinstance(plugin, FP8FSDPPrecision)
        assert plugin.compute_dtype == torch.float16 and plugin.scaler is not None
        FSDPStrategy().precision_plugin = plugin  # the strategy's own type check
        config = plugin.mixed_precision_config
        assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == (torch.float16, torch.float32, None)
    assert precision_plugin_from_string("fp8-hybrid", strategy="fsdp").scaler is None
    assert type(precision_plugin_from_string("fp8-hybrid", strategy="ddp")) is FP8Precision


class ScaleDuringBackward(TinyClassifier):
    """Records the first layer's input scale as each micro-batch's forward used it."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = []

    def on_before_backward(self, loss):
        self.scales.append(self.net[0].fp8_state.scale[0].item())


def test_accumulated_micro_batches_share_one_scale_update_per_optimizer_step():
    model = ScaleDuringBackward()
    plugin = FP8Precision(fp.DelayedScaling(), compute_dtype=torch.float32)
    trainer = L.Trainer(plugins=[plugin], max_steps=2, accumulate_grad_batches=2, **TRAINER_DEFAULTS)
    trainer.fit(model, loader(n=64, batch_size=16))
    xs = [b[0] for b in loader(n=64, batch_size=16)]
    # Micro-batches 1 and 2 form optimizer step 1: both cast with the initial scale; step 2's use
    # the first update, from the largest input amax of step 1's two micro-batches (TE: 448 / amax).
    assert model.scales[0] == model.scales[1]
    amax = max(xs[0].abs().max().item(), xs[1].abs().max().item())
    assert model.scales[2] == model.scales[3] == torch.tensor(448.0 / amax, dtype=torch.float32).item()


def test_the_console_gets_the_fp8_layer_counts_and_the_debug_log_the_table(caplog):
    # The table has a row per layer (hundreds in a MoE model): kept off the console (Lightning's
    # INFO messages) unless the user turns on debug logging; the plugin's `report` holds it either way.
    import logging

    def fit(level):
        caplog.clear()
        module = TinyClassifier()
        trainer = L.Trainer(precision="fp8-hybrid", accelerator="cpu", max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with caplog.at_level(level, logger="lightning.pytorch"):  # the logger Lightning sets to INFO
            trainer.fit(module, loader())
        return trainer.precision_plugin.report, "\n".join(r.getMessage() for r in caplog.records if r.levelno >= level)

    report, info = fit(logging.INFO)
    assert f"{len(report.swapped)} of {len(report.layers)} linear layers in FP8" in info
    assert not any(layer.name in info for layer in report.layers)  # no table row
    report, debug = fit(logging.DEBUG)
    assert all(layer.name in debug for layer in report.layers)


def test_the_same_precision_string_trains_in_fnuz_on_an_mi300():
    # Trainer(precision="fp8-hybrid") with no setting changed: on a (presented) gfx942 the
    # HYBRID pair is E4M3FNUZ / E5M2FNUZ.
    from fp8_plugin.numerics.device_kind import present_rocm

    model = TinyClassifier()
    with present_rocm("gfx942"):
        trainer = L.Trainer(precision="fp8-hybrid", max_steps=2, **TRAINER_DEFAULTS)
        with count_fp8_gemms() as gemms:
            trainer.fit(model, loader())
    assert gemms.count == 2 * (3 + 2)
    assert set(gemms.dtypes) == {torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


class TinyClassifierFP8AdamW(TinyClassifier):
    def configure_optimizers(self):
        return FP8AdamW(self.parameters(), lr=1e-2)


def test_fp8_adamw_from_configure_optimizers_trains_in_fp8_and_resumes_bit_for_bit(tmp_path):
    def fit(max_epochs, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        model = TinyClassifierFP8AdamW()
        trainer = L.Trainer(precision="fp8-hybrid", max_epochs=max_epochs, accelerator="cpu", devices=1,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=list(callbacks), default_root_dir=tmp_path,
                            enable_checkpointing=bool(callbacks))
        with count_fp8_gemms() as gemms:
            trainer.fit(model, loader(), ckpt_path=ckpt_path)
        return model, trainer, gemms.count

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    full, trainer, gemms = fit(3, callbacks=[ckpt])
    assert gemms == 3 * 4 * (3 + 2)  # 3 epochs x 4 batches x (3 GEMMs + the first layer's 2: no dgrad)
    assert isinstance(trainer.optimizers[0], FP8AdamW)
    saved = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=True)
    moments = saved["optimizer_states"][0]["state"]
    assert moments and all(s["exp_avg"].dtype == torch.float8_e4m3fn for s in moments.values())
    resumed, _, _ = fit(3, ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt")
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
