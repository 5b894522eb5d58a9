"""``from_pretrained``: load a fine-grained FP8 checkpoint to train, its FP8 weights as they are.

transformers loads a checkpoint with ``quantization_config.quant_method = "fp8"`` (the Qwen3-*-FP8
and DeepSeek-V3 releases, this project's ``export(..., "hf-fp8")``) as inference-only FP8 layers
on a GPU and dequantizes it on a CPU. :func:`from_pretrained` loads it as FP8 layers that train:
each weight the file holds in FP8 becomes a frozen :class:`~fp8_plugin.modules.linear.FP8Linear`
weight kept only in FP8, with the file's bytes and ``weight_scale_inv`` exactly (no
dequantize-and-requantize round trip), and LoRA adapters (PEFT) or the layers left trainable
train around them.

Sources: transformers' ``FineGrainedFP8Config`` and ``integrations/finegrained_fp8.py`` (the
format: E4M3 ``weight`` ``[out, in]``, float32 or E8M0 ``weight_scale_inv`` per 128x128 block, or
0-dim per tensor when ``weight_block_size`` is null).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from .._private.transformers_api import saved_tensors
from ..modules.convert import ConversionReport, convert_model
from ..modules.freezing import frozen_figures, save_dequantized
from ..modules.frozen_weight import FrozenLayout, frozen_layout, layout_problem
from ..numerics.recipes import DelayedScaling, Float8BlockScaling, Recipe, check_recipe

__all__ = ["from_pretrained", "fp8_checkpoint_recipe"]

_E4M3 = torch.float8_e4m3fn


def _quantization_config(folder: Path) -> dict[str, Any]:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"from_pretrained: no config.json in {str(folder)!r}; valid: a checkpoint folder")
    qc = json.loads(config_file.read_text()).get("quantization_config")
    method = (qc or {}).get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"from_pretrained: {str(folder)!r} is not a fine-grained FP8 checkpoint (quantization_config.quant_method "
            f"= {method!r}); valid: 'fp8'. Load a high-precision checkpoint with transformers' own from_pretrained "
            "and let the training loop convert it")
    return qc


def fp8_checkpoint_recipe(checkpoint: Union[str, os.PathLike, dict[str, Any]]) -> Recipe:
    """The recipe whose GEMMs read a fine-grained FP8 checkpoint's weights as stored.

    Args:
        checkpoint: the checkpoint folder (or a model id cached locally), or its
            ``quantization_config`` as a dict.

    Returns:
        ``weight_block_size`` ``[128, 128]``: ``Float8BlockScaling()`` (128x128 weight blocks);
        null: ``DelayedScaling()`` (one scale per weight).

    Raises:
        ValueError: not a fine-grained FP8 checkpoint, or a block size, activation scheme or
            format this project cannot train, named with the reason.
        FileNotFoundError: a folder without config.json.
    """
    qc = checkpoint if isinstance(checkpoint, dict) else _quantization_config(_local_folder(checkpoint))
    if qc.get("quant_method") != "fp8":
        raise ValueError(f"fp8_checkpoint_recipe: quant_method={qc.get('quant_method')!r} is not a fine-grained FP8 "
                         "checkpoint; valid: 'fp8'")
    block = qc.get("weight_block_size")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"FP8 checkpoint: activation_scheme={qc.get('activation_scheme')!r} is not supported: static activation "
            "scales are an inference calibration, and FP8 training scales activations from their own amaxes; valid: "
            "'dynamic'")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint: fmt={qc.get('fmt')!r} is not supported; valid: 'e4m3' (the FP8 GEMMs' "
                         "forward format)")
    if block is None:
        return DelayedScaling()
    if list(block) != [128, 128]:
        raise ValueError(
            f"FP8 checkpoint: weight_block_size={list(block)!r} is not supported: the blockwise FP8 GEMMs (cuBLAS, "
            "Transformer Engine's Float8BlockScaling) read 128x128 weight blocks; valid: [128, 128] or null "
            "(per-tensor)")
    return Float8BlockScaling()


def _weight_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"from_pretrained: no model.safetensors (or index) in {str(folder)!r}; valid: a "
                                "safetensors checkpoint")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _read(files: dict[str, Path], key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(files[key]), framework="pt") as f:
        return f.get_tensor(key)


def _local_folder(path: Union[str, os.PathLike]) -> Path:
    folder = Path(path)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download  # honours HF_HUB_OFFLINE: a cached snapshot only

    return Path(snapshot_download(str(path)))


def from_pretrained(model_class: Any, path: Union[str, os.PathLike], *, recipe: Optional[Recipe] = None,
                    dtype: torch.dtype = torch.bfloat16, **kwargs: Any) -> Any:
    """Load a fine-grained FP8 checkpoint with its FP8 weights kept only in FP8, frozen, ready to train.

    transformers builds the model (``model_class.from_pretrained(path, dtype=dtype, **kwargs)``
    with ``FineGrainedFP8Config(dequantize=True)``, so every non-FP8 tensor, tie and weight
    conversion is its own); then each ``nn.Linear`` whose weight the file holds in E4M3 with a
    ``weight_scale_inv`` becomes an :class:`~fp8_plugin.modules.linear.FP8Linear` that holds the
    file's bytes and scales as they are (``weight`` E4M3 ``[out, in]``, ``weight_scale_inv``
    float32; E8M0 scales are widened exactly) with ``requires_grad=False``. The dequantized
    copy transformers made is dropped, so peak memory while loading is the model in ``dtype``;
    afterwards each such weight takes 1 byte per value plus its scales. Layers the file keeps in
    high precision (``modules_to_not_convert``, heads, embeddings, norms) load as transformers
    loads them, trainable; the training loop's conversion swaps them as it swaps any layer.

    Train with the recipe returned by :func:`fp8_checkpoint_recipe` (``"fp8-blockwise"`` /
    ``Float8BlockScaling()`` for 128x128 checkpoints, ``"fp8-delayed"`` / ``"fp8-hybrid"`` /
    ``"fp8-current"`` for per-tensor ones): the conversion refuses a recipe whose GEMMs cannot
    read the frozen weights as stored. Add LoRA adapters with PEFT (``get_peft_model``), or
    call :func:`fp8_plugin.dequantize_frozen_weights` for full fine-tuning.

    Args:
        model_class: a transformers model class or Auto class (``AutoModelForCausalLM``).
        path: a checkpoint folder, or a model id cached locally.
        recipe: the layers' recipe (default: :func:`fp8_checkpoint_recipe`'s).
        dtype: the dtype of the tensors the file keeps in high precision, and the master dtype
            of the frozen weights (their high-precision GEMMs, their dequantization).
        kwargs: passed to transformers' ``from_pretrained`` (``device_map``...; not
            ``quantization_config``).

    Returns:
        The model; ``model.fp8_report`` is the :class:`~fp8_plugin.modules.convert.ConversionReport`
        of the layers loaded in FP8, ``model.fp8_recipe`` the recipe they were loaded for.

    Raises:
        ValueError: the checkpoint is not fine-grained FP8, or has a block size, activation
            scheme or format this project cannot train; ``recipe`` cannot read its weights as
            stored; a weight or scale whose shape does not fit its layer. All before training.
        FileNotFoundError: no config.json or safetensors weights in ``path``.
    """
    from transformers import FineGrainedFP8Config

    if "quantization_config" in kwargs:
        raise ValueError("from_pretrained: quantization_config is chosen here (the file's, dequantized while "
                         "loading); valid: leave it out")
    folder = _local_folder(path)
    qc = _quantization_config(folder)
    wanted = fp8_checkpoint_recipe(qc)
    recipe = wanted if recipe is None else recipe
    check_recipe(recipe, "from_pretrained")
    block = qc.get("weight_block_size")
    layout = FrozenLayout("blockwise" if block else "tensorwise", tuple(block) if block else None, _E4M3, dtype)
    problem = layout_problem(layout, recipe, torch.device("cpu"))
    if problem:
        raise ValueError(f"from_pretrained: recipe={type(recipe).__name__}() cannot read this checkpoint's weights: "
                         f"{problem}; valid: {type(wanted).__name__}()")
    files = _weight_files(folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*requires a GPU.*")
        config = FineGrainedFP8Config(dequantize=True, weight_block_size=tuple(block) if block else None,
                                      modules_to_not_convert=qc.get("modules_to_not_convert"))
        model = model_class.from_pretrained(str(folder), quantization_config=config, dtype=dtype, **kwargs)
    _forget_quantization(model)

    # The layers whose weights the file holds in E4M3 with their scales, under the model's names.
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    keys = {n: _checkpoint_key(model, n, m) for n, m in linears.items()}
    stored = {n: k for n, k in keys.items() if k in files and f"{k}_scale_inv" in files}
    for name in stored:
        linears[name].weight.requires_grad_(False)
    unused = sorted(k[:-len("_scale_inv")] for k in files if k.endswith("_scale_inv")
                    and k[:-len("_scale_inv")] not in set(stored.values()))
    if unused:  # MoE experts (3-D weights), layers of other types: loaded dequantized by transformers
        warnings.warn(f"from_pretrained: {len(unused)} FP8 tensors of the checkpoint are not nn.Linear weights and load "
                      f"dequantized, trainable in high precision (the training loop's conversion decides their GEMMs): "
                      f"{', '.join(unused[:3])}{' ...' if len(unused) > 3 else ''}", stacklevel=2)
    report = convert_model(model, recipe, include=sorted(stored) or None, frozen_weights="keep",
                           skip_small=False) if stored else ConversionReport()
    fp8 = dict(model.named_modules())
    for name, key in stored.items():
        layer = fp8.get(name)
        if getattr(layer, "set_frozen_weight", None) is None:
            reason = next((d.reason for d in report.layers if d.name == name), "not converted")
            raise ValueError(f"from_pretrained: {name!r} is stored in FP8 but cannot be an FP8 layer here: {reason}")
        data, scale_inv = _read(files, key), _read(files, f"{key}_scale_inv")
        if data.dtype != _E4M3:
            raise ValueError(f"from_pretrained: {key} is {data.dtype}; valid: torch.float8_e4m3fn")
        scale_inv = scale_inv.to(torch.float32)  # E8M0 scales (powers of two) widen exactly
        if block is None:
            scale_inv = scale_inv.reshape(())
        device = layer.weight.device
        try:
            layer.set_frozen_weight(data.to(device), scale_inv.to(device),
                                    frozen_layout(recipe, device, layer.weight.dtype))
        except ValueError as error:  # name the checkpoint tensor: nothing of the model is trained yet
            raise ValueError(f"from_pretrained: {key}: {error}") from None
    for decision in report.layers:
        if decision.name in stored:
            decision.frozen, decision.weight_bytes_before, decision.weight_bytes_after = frozen_figures(fp8[decision.name])
    save_dequantized(model)
    model.fp8_report, model.fp8_recipe = report, recipe
    return model


def _checkpoint_key(model: nn.Module, name: str, module: nn.Module) -> str:
    # The name save_pretrained (and so the file) gives this layer's weight: the model's weight
    # conversions reverted (identity for most dense models).
    written = saved_tensors(model, {f"{name}.weight": torch.empty(module.weight.shape, device="meta")})
    return next(iter(written)) if len(written) == 1 else f"{name}.weight"


def _forget_quantization(model: nn.Module) -> None:
    # The model is no longer transformers-quantized (its own loader dequantized it): without this
    # save_pretrained would write a quantization_config its weights no longer match, and the
    # Trainer would refuse to train a "quantized" model.
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
