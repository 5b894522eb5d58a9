"""``export``: write a Hugging Face model, converted or not, as a checkpoint others load.

Two formats:

- ``"hf"``: a vanilla Hugging Face checkpoint, written by transformers' own ``save_pretrained``:
  the original module types and weight layouts, the FP8 scaling state left out. Vanilla
  ``from_pretrained`` loads it with no missing or unexpected keys.
- ``"hf-fp8"``: the fine-grained FP8 checkpoint transformers documents for DeepSeek-V3 and the Qwen
  FP8 releases (``FineGrainedFP8Config``, ``quant_method: "fp8"``): the weight of each FP8 layer and
  each expert of the FP8 MoE experts modules in E4M3 with one FP32 scale per 128x128 block,
  everything else in the model's dtype.

Sources: transformers' fine-grained FP8 integration (``transformers/integrations/finegrained_fp8.py``,
``transformers/quantizers/quantizer_finegrained_fp8.py``, ``FineGrainedFP8Config`` in
``transformers/utils/quantization_config.py``); Transformer Engine's "FP8 Blockwise Scaling"
(128x128 weight blocks, ``scale = FP8_MAX / amax``, power-of-two scales by default); DeepSeek-V3
technical report (arXiv:2412.19437), section 3.3 (128x128 block scaling of weights).
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .._private.transformers_api import saved_tensors, set_save_conversions_with_scales
from ..modules.backends import BACKENDS
from ..modules.convert import convert_model
from ..modules.experts import FP8ExpertsMixin
from ..modules.frozen_weight import quantize_frozen
from ..numerics.recipes import Float8CurrentScaling
from ..numerics.block_scaling import block_amax, blockwise_scale, quantize_blocks
from ..numerics.scaling import divide

__all__ = ["export", "FORMATS", "WEIGHT_BLOCK_SIZE"]

FORMATS = ("hf", "hf-fp8")
# The block of one weight scale, [rows (out), cols (in)]: DeepSeek-V3's and TE's 128x128.
WEIGHT_BLOCK_SIZE = (128, 128)
_FP8_DTYPE = torch.float8_e4m3fn


def export(model: nn.Module, path: Union[str, os.PathLike], format: str = "hf", *,
           weight_block_size: Optional[tuple[int, int]] = WEIGHT_BLOCK_SIZE, safe_serialization: bool = True) -> Path:
    """Write ``model`` to the folder ``path`` as a Hugging Face checkpoint.

    ``model`` is a transformers ``PreTrainedModel``, converted by :func:`fp8_plugin.convert_model`
    (its FP8 layers may have trained in FP8) or not. It is not modified: the export works on a
    copy of its module tree that shares its weights, so no weight is copied except where it is
    cast to FP8.

    Formats:

    ``"hf"``: a vanilla checkpoint, through transformers' ``save_pretrained``: ``config.json``,
    ``model.safetensors`` (or shards and their index), ``generation_config.json`` for generative
    models. Every FP8 layer is written as the layer it replaced: ``nn.Linear`` with its weight
    ``[out, in]``, GPT-2's ``Conv1D`` with its weight ``[in, out]``; weights in their own dtype;
    the FP8 scaling state (``*.fp8_state._extra_state``) is left out. ``from_pretrained`` on the
    vanilla class loads it with no missing or unexpected keys, and computes exactly what the
    model computes outside :func:`fp8_plugin.autocast`.

    ``"hf-fp8"``: the fine-grained FP8 format of transformers' ``FineGrainedFP8Config``. For each
    FP8 layer ``<name>`` (an ``nn.Linear`` of ``out`` x ``in``):

    - ``<name>.weight``: ``torch.float8_e4m3fn`` ``[out, in]``;
    - ``<name>.weight_scale_inv``: ``torch.float32`` ``[ceil(out / 128), ceil(in / 128)]``, the
      factor that turns each 128x128 block back into the weight: ``W ~= weight * weight_scale_inv``
      (what transformers computes when it dequantizes, and what its FP8 kernels apply);
    - ``<name>.bias``, if any: unchanged, in the model's dtype.

    FP8 MoE experts modules (:mod:`fp8_plugin.modules.experts`; 3-D ``gate_up_proj`` ``[E, 2I, H]``
    or ``up_proj`` ``[E, I, H]``, ``down_proj`` ``[E, H, I]``) are held as transformers' FP8
    experts (``FP8Experts``) hold them: each expert's ``[out, in]`` weight cast as a dense
    layer's, giving E4M3 ``[E, out, in]`` and float32 ``[E, ceil(out / 128), ceil(in / 128)]``
    scales, written by ``save_pretrained`` under the model's per-expert checkpoint names (for
    Mixtral ``experts.<e>.w1.weight`` E4M3 ``[I, H]`` beside ``experts.<e>.w1.weight_scale_inv``),
    which transformers' loader merges back into ``gate_up_proj`` / ``gate_up_proj_scale_inv``
    (``[E, 2 * ceil(I / 128), ceil(H / 128)]``: the gate's and up's grids stacked) or
    dequantizes per expert. They are not listed in ``modules_to_not_convert``.

    With ``weight_block_size=None`` the weights are scaled per tensor instead (transformers'
    per-tensor FP8 layers): ``<name>.weight_scale_inv`` is a float32 0-dim tensor, the weight's
    current scale ``448 / amax`` inverted (not a power of two), so every dim is storable; MoE
    experts then stay in high precision (listed in ``modules_to_not_convert``).

    A layer whose frozen weight is kept only in FP8 (:meth:`FP8Linear.freeze_weight
    <fp8_plugin.modules.linear.FP8Linear.freeze_weight>`, :func:`fp8_plugin.from_pretrained`) is
    written as it is held when its layout is the checkpoint's (E4M3 in 128x128 blocks, or one
    scale with ``weight_block_size=None``): the same bytes and scales; otherwise its dequantized
    weight is cast as above. In ``"hf"`` it is written dequantized, in the dtype it had.

    Every other tensor (embeddings, norms, heads, routers, layers kept in high precision) is
    written as in ``"hf"``. ``config.json`` gains ``"quantization_config": {"quant_method": "fp8",
    "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert":
    [...]}``. When it loads a pre-quantized checkpoint, transformers turns every module that is
    exactly ``nn.Linear`` (and every ``*.experts`` module) into its FP8 layer unless a
    ``modules_to_not_convert`` entry matches its name, or it is in the model's
    ``_keep_in_fp32_modules``; so the list names every such module this export leaves in high
    precision (full dotted names, relative to the model exported), and GPT-2's ``Conv1D`` layers
    too, for the readers that map them to linear layers.

    The FP8 layers: those of a converted model with ``use_fp8`` on; for a model that is not
    converted, those ``convert_model(copy, device="cpu")`` would swap (the same head, tied-weight,
    dims and layer-type rules; on the CPU no layer is left out for its size, so the checkpoint does
    not depend on the machine that exports it). Of these, a layer stays in high precision (and is
    listed) when:

    - it is a GPT-2 ``Conv1D`` (weight ``[in, out]``): transformers' FP8 layers and the
      ``weight_scale_inv`` layout are for ``nn.Linear``'s ``[out, in]`` weight, and storing the
      transposed weight would change the architecture the config names;
    - a dim is above 128 and not a multiple of 128: transformers' dequantizing loader derives the
      block size as ``dim // scale_dim``, which is wrong for a partial last block;
    - its weight is tied to another parameter, or the model keeps it in FP32
      (``_keep_in_fp32_modules``), or a skip-list entry written for another layer also matches it
      (transformers matches entries as prefixes, regexes and suffixes).

    Scaling (Transformer Engine's blockwise recipe for weights, as DeepSeek-V3 trained): per
    128x128 block (partial blocks at the edges take their own values), ``amax = max |W|``,
    ``scale = 448 / amax`` in FP32 (correctly rounded), truncated to a power of two (TE's
    ``power_2_scale=True``, the default of ``Float8BlockScaling``), ``weight =
    saturate_E4M3(W * scale)`` with round-to-nearest-even, ``weight_scale_inv = 1 / scale``. A
    block of zeros gets scale 1. Because the scale is a power of two, ``1 / scale`` is exact and
    so is transformers' product ``weight * weight_scale_inv`` (in FP32): the dequantized weight is
    the E4M3 rounding of ``W * scale`` divided by ``scale`` exactly, with a relative error of at
    most 2^-4 per element (3 mantissa bits), or at most ``2^-10 * weight_scale_inv`` for the
    values below E4M3's smallest normal, 2^-6, after scaling. A scale that is not a power of two
    would add the rounding of ``1 / scale`` to every element, and round ``W * scale`` once more.
    It also makes a second export lossless: a model loaded from an ``"hf-fp8"`` checkpoint with
    ``FineGrainedFP8Config(dequantize=True)`` and exported again, unchanged, stores the same
    weights exactly (each block's new scale is the old one, or twice it where the block's largest
    value had rounded down to 224, and every value is again an E4M3 value times ``1 / scale``).

    Args:
        model: a transformers ``PreTrainedModel`` (not a Lightning module or a DDP / FSDP wrapper:
            pass the Hugging Face model inside).
        path: the folder to write; created if missing (with its parents). A new folder appears
            whole (written beside it, then renamed into place); into an existing folder the files
            are moved one by one, each whole, replacing those of an earlier export (stale weight
            shards are removed) and leaving other files (a tokenizer) alone.
        format: ``"hf"`` (default) or ``"hf-fp8"``.
        weight_block_size: for ``"hf-fp8"``: ``(128, 128)`` (default) or None (per-tensor scales).
        safe_serialization: True writes safetensors. False (pickled ``.bin`` files) only with a
            transformers version whose ``save_pretrained`` still offers it (before 5.0).

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: ``format`` is not one of ``FORMATS``; ``model`` is quantized by transformers
            (loaded from a quantized checkpoint without ``dequantize=True``);
            ``safe_serialization=False`` with a transformers that writes safetensors only; for
            ``"hf-fp8"``, no layer of the model can be stored in FP8, an FP8 layer's weight
            holds an inf or NaN, or an FP8 experts module has no layout in transformers' FP8
            experts (expert biases; transposed weights, ``is_transposed``; a gated intermediate
            size not a multiple of 128, or another expert dim above 128 and not a multiple of
            128; a family whose checkpoints hold the 3-D tensors, whose scales transformers'
            dequantizing loader would not apply): raised before anything is written, naming
            the module and the reason (convert with ``exclude=["experts"]`` to store such
            experts in high precision).
        TypeError: ``model`` is not a transformers ``PreTrainedModel``; ``safe_serialization`` is
            not a bool.
        FileExistsError: ``path`` is a file.
    """
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(f"export: format={format!r} is not valid; valid: {', '.join(repr(f) for f in FORMATS)}")
    _check_model(model)
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        method = getattr(getattr(model.config, "quantization_config", None), "quant_method", "?")
        raise ValueError(
            f"export: model is quantized by transformers (quant_method {getattr(method, 'value', method)!r}); valid: a "
            "model in high precision, e.g. loaded with quantization_config=FineGrainedFP8Config(dequantize=True)"
        )
    if weight_block_size is not None and tuple(weight_block_size) != WEIGHT_BLOCK_SIZE:
        raise ValueError(f"export: weight_block_size={weight_block_size!r} is not valid; valid: (128, 128) (DeepSeek-V3's "
                         "and Transformer Engine's weight blocks) or None (one scale per weight)")
    block = None if weight_block_size is None else WEIGHT_BLOCK_SIZE
    if not isinstance(safe_serialization, bool):
        raise TypeError(f"export: safe_serialization={safe_serialization!r} is not valid; valid: True, False")
    save_kwargs = _save_kwargs(model, safe_serialization)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"export: path {str(path)!r} is a file; valid: a folder, existing or not")

    if format == "hf":
        vanilla, _ = _vanilla_copy(model)
        state_dict = None
    else:
        vanilla, state_dict = _fp8_copy(model, block)
    _write_folder(path, lambda folder: vanilla.save_pretrained(folder, state_dict=state_dict, **save_kwargs))
    return path


def _check_model(model: Any) -> None:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedModel = None
    if PreTrainedModel is None or not isinstance(model, PreTrainedModel):
        hint = ""
        for attr in ("module", "model"):  # DDP / FSDP / Accelerate wrappers; LightningModules
            if PreTrainedModel is not None and isinstance(getattr(model, attr, None), PreTrainedModel):
                hint = f"; this {type(model).__name__} holds one: pass model.{attr}"
                break
        raise TypeError(
            "export: model must be a transformers PreTrainedModel (e.g. from AutoModelForCausalLM.from_pretrained), "
            f"converted by fp8_plugin.convert_model or not; got "
            f"{type(model).__module__}.{type(model).__qualname__}{hint}"
        )


def _save_kwargs(model: nn.Module, safe_serialization: bool) -> dict[str, Any]:
    # transformers 5 writes safetensors only (save_pretrained has no safe_serialization); 4.x
    # accepts the argument.
    if "safe_serialization" in inspect.signature(type(model).save_pretrained).parameters:
        return {"safe_serialization": safe_serialization}
    if not safe_serialization:
        import transformers

        raise ValueError(
            f"export: safe_serialization=False is not valid with transformers {transformers.__version__}, whose "
            "save_pretrained writes safetensors only; valid: True"
        )
    return {}


def _fp8_types() -> tuple[type, ...]:
    return tuple(t for backend in BACKENDS.values() for t in backend.fp8_types)


def _is_conv1d(module: nn.Module) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, Conv1D)


def _vanilla_layer(layer: nn.Module) -> nn.Module:
    # The layer an FP8 layer replaced, around the same Parameter objects (built on meta: nothing
    # allocated). convert_model swaps exact nn.Linear and Conv1D (and with allow_subclasses,
    # nn.Linear subclasses that compute as nn.Linear, whose state is nn.Linear's).
    with torch.device("meta"):
        if getattr(layer, "weight_transposed", False):
            from transformers.pytorch_utils import Conv1D

            vanilla = Conv1D(layer.out_features, layer.in_features)
        else:
            vanilla = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    if getattr(layer, "frozen_layout", None) is not None:  # kept only in FP8: written dequantized
        vanilla.weight = nn.Parameter(layer.dense_weight().detach(), requires_grad=False)
    else:
        vanilla.weight = layer.weight
    vanilla.bias = layer.bias
    vanilla.train(layer.training)
    return vanilla


def _vanilla_copy(model: nn.Module) -> tuple[nn.Module, set[str]]:
    """A copy of ``model``'s module tree (config included) that shares its parameters and
    buffers, with every FP8 layer replaced by the layer it replaced; and the names (every path)
    of the FP8 layers and FP8 experts modules that run in FP8 (``use_fp8``)."""
    fp8_types = _fp8_types()
    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        memo[id(tensor)] = tensor
    fp8_names = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, fp8_types):
            if id(module) not in memo:
                memo[id(module)] = _vanilla_layer(module)
            if getattr(module, "use_fp8", True):
                fp8_names.add(name)
        elif isinstance(module, FP8ExpertsMixin) and module.use_fp8:
            fp8_names.add(name)  # kept as is: its parameters and save_pretrained output are the model's
    vanilla = copy.deepcopy(model, memo)
    _drop_quantizer_conversions(vanilla)
    return vanilla, fp8_names


def _drop_quantizer_conversions(model: nn.Module) -> None:
    # A model loaded from a quantized checkpoint with dequantize=True keeps the loader's weight
    # conversions, whose reverse (run by save_pretrained) would quantize every 2-D weight again,
    # embeddings included, under a config that no longer says so. Without them save_pretrained
    # uses the model's default mapping, as for a model built from its config.
    for module in model.modules():
        conversions = vars(module).get("_weight_conversions")
        if conversions and any(type(op).__name__.endswith(("Quantize", "Dequantize"))
                               for c in conversions for op in getattr(c, "operations", ())):
            del module._weight_conversions


def _shared_copy(model: nn.Module) -> nn.Module:
    memo: dict[int, Any] = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def _transformers_skips(name: str, patterns: list[str]) -> bool:
    """Whether transformers leaves module ``name`` unconverted given ``modules_to_not_convert``
    (its ``should_convert_module``, negated; the same rule restated where transformers lacks it)."""
    try:
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:  # older transformers
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)
    return not should_convert_module(name, patterns)


def _keep_in_fp32(model: nn.Module) -> list[str]:
    names: list[str] = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        names.extend(getattr(model, attr, None) or ())
    return names


def _fp8_copy(model: nn.Module, block: Optional[tuple[int, int]]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The vanilla copy whose config carries the quantization_config, and the state dict to save."""
    source = model
    if not any(isinstance(m, _fp8_types() + (FP8ExpertsMixin,)) for m in model.modules()):
        # Not converted: the layers convert_model would swap are the FP8 layers.
        source = _shared_copy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no layer to run in FP8": answered below
            convert_model(source, device="cpu", frozen_weights="keep")
    vanilla, fp8_names = _vanilla_copy(source)
    held = dict(source.named_modules(remove_duplicate=False))

    modules = dict(vanilla.named_modules(remove_duplicate=False))
    experts = {n for n in fp8_names if isinstance(modules[n], FP8ExpertsMixin)}
    if block is None:  # per-tensor: transformers' FP8 experts take 128x128 blocks only
        fp8_names -= experts
        experts = set()
    if experts:
        # save_pretrained then writes the per-expert scales beside their weights.
        set_save_conversions_with_scales(vanilla)
    for name in sorted(experts):  # refused before anything is cast or written
        reason = _experts_refusal(modules[name]) or _serialized_experts_refusal(vanilla, modules[name], name)
        if reason:
            raise ValueError(_experts_error(name, modules[name], reason))
    # Modules transformers would turn into FP8 layers when loading (replace_with_fp8_linear), and
    # the Conv1D layers other readers map to linear layers.
    linear_like = [n for n, m in modules.items() if n and (isinstance(m, nn.Linear) or _is_conv1d(m)
                                                           or n == "experts" or n.endswith(".experts"))]
    tied = _tied_parameter_ids(vanilla)
    keep_fp32 = _keep_in_fp32(vanilla)
    storable = {n for n in fp8_names
                if (not _has_tied(modules[n], tied) if n in experts else _storable(modules[n], tied, block))}
    quantized = {n for n in storable if not (keep_fp32 and _transformers_skips(n, keep_fp32))}
    # A skip-list entry also matches the names it is a prefix (at a module boundary) or a suffix
    # of: keep such layers in high precision too, until the list and the FP8 layers agree.
    while True:
        skipped = [n for n in linear_like if n not in quantized]
        clash = {n for n in quantized if _transformers_skips(n, skipped)}
        if not clash:
            break
        quantized -= clash
    if not quantized:
        conv1d = sum(_is_conv1d(modules[n]) for n in fp8_names)
        found = (f"its {len(fp8_names)} FP8 layers are {conv1d} GPT-2 Conv1D layers (kept in high precision in this "
                 f"format) and {len(fp8_names) - conv1d} layers with a dim above 128 not a multiple of 128, tied, or "
                 "kept in FP32") if fp8_names else ("it has no layer that runs in FP8 (converted layers with use_fp8 "
                                                    "on; for a model not converted, the layers convert_model swaps)")
        raise ValueError(
            f"export: format='hf-fp8' found no layer of {type(model).__name__} to store in FP8: {found}; valid for "
            "this model: format='hf'"
        )

    state_dict = vanilla.state_dict()
    for name in sorted(quantized - experts):
        key = f"{name}.weight"
        data, scale_inv = _held_fp8(held.get(name), block) or _quantize_weight(state_dict[key], key, block)
        state_dict[key] = data
        state_dict[f"{name}.weight_scale_inv"] = scale_inv
    for name in sorted(quantized & experts):
        for proj in _expert_projections(modules[name]):
            key = f"{name}.{proj}"
            state_dict[key], state_dict[f"{key}_scale_inv"] = _quantize_experts(state_dict[key], key)
    vanilla.config.quantization_config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": None if block is None else list(block),
        "modules_to_not_convert": skipped,
    }
    return vanilla, state_dict


def _expert_projections(module: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


def _experts_refusal(module: nn.Module) -> str:
    """Why transformers' FP8 experts (``FP8Experts`` in ``integrations/finegrained_fp8.py``)
    cannot hold this experts module's weights, or "" when they can."""
    if module.has_bias:
        return ("it has expert biases (*_proj_bias), which transformers' FP8 experts do not hold (FP8Experts "
                "requires has_bias=False)")
    if module.is_transposed:
        return ("its weights are stored transposed ([experts, in, out], is_transposed=True), and transformers' FP8 "
                "experts hold [experts, out, in] weights with their scale grids")
    first, down = _expert_projections(module)
    experts, rows, hidden = getattr(module, first).shape
    _, _, inner = getattr(module, down).shape
    if module.has_gate and (rows // 2) % WEIGHT_BLOCK_SIZE[0]:
        return (f"its gate_up_proj stacks gate and up halves of {rows // 2} rows each, not a multiple of 128: "
                "transformers' FP8 experts stack the two halves' 128-row scale grids, so the up half must start "
                "on a block boundary")
    for what, dim in (("intermediate", rows // 2 if module.has_gate else rows), ("hidden", hidden), ("inner", inner)):
        if dim > 128 and dim % 128:
            return (f"its {what} size {dim} is above 128 and not a multiple of 128 (a partial last block, which "
                    "transformers' dequantizing loader reads with the wrong block size)")
    return ""


def _experts_error(name: str, module: nn.Module, reason: str) -> str:
    return (f"export: format='hf-fp8' cannot store the FP8 experts module {name!r} ({type(module).__name__}) in "
            f"transformers' fine-grained FP8 layout: {reason}. Valid: convert the model with "
            f"exclude=[{name.rpartition('.')[2]!r}] (its experts stay in high precision, listed in "
            "modules_to_not_convert), or format='hf'")


def _has_tied(module: nn.Module, tied: set[int]) -> bool:
    return any(id(p) in tied for p in module.parameters(recurse=False))


def _quantize_experts(weight: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's ``[out, in]`` weight as :func:`_quantize_weight` casts a dense one: E4M3
    ``[E, out, in]`` and float32 ``[E, ceil(out/128), ceil(in/128)]``."""
    casts = [_quantize_weight(weight[e], f"{key}[{e}]") for e in range(weight.shape[0])]
    return torch.stack([c[0] for c in casts]), torch.stack([c[1] for c in casts])


def _serialized_experts_refusal(model: nn.Module, module: nn.Module, name: str) -> str:
    """Why save_pretrained would not write this experts module as per-expert 2-D weights, each
    beside its ``[ceil(out/128), ceil(in/128)]`` ``weight_scale_inv`` ("" when it would): the
    layout transformers' FP8 loader merges into its FP8 experts, or dequantizes per expert. A
    family whose checkpoints hold the 3-D tensors themselves has no such layout: from_pretrained
    with dequantize=True would load their E4M3 values without their ``*_scale_inv``."""
    tensors = {}
    for proj in _expert_projections(module):
        experts, rows, cols = getattr(module, proj).shape
        grid = tuple(-(-d // b) for d, b in zip((rows, cols), WEIGHT_BLOCK_SIZE))
        tensors[f"{name}.{proj}"] = torch.empty(experts, rows, cols, dtype=_FP8_DTYPE, device="meta")
        tensors[f"{name}.{proj}_scale_inv"] = torch.empty(experts, *grid, dtype=torch.float32, device="meta")
    written = saved_tensors(model, tensors)
    scales = {k: v for k, v in written.items() if k.endswith(".weight_scale_inv")}
    weights = {k: v for k, v in written.items() if k not in scales}
    if weights and len(scales) == len(weights) and all(
            k.endswith(".weight") and v.dim() == 2 and f"{k}_scale_inv" in scales
            and tuple(scales[f"{k}_scale_inv"].shape) == tuple(-(-d // b) for d, b in zip(v.shape, WEIGHT_BLOCK_SIZE))
            for k, v in weights.items()):
        return ""
    return (f"{type(model).__name__}'s checkpoint layout keeps the experts' tensors as {sorted(written)[:2]} (not "
            "one 2-D '*.weight' per expert), whose scale_inv transformers' dequantizing loader does not apply")


def _tied_parameter_ids(model: nn.Module) -> set[int]:
    # Parameters reachable under two names of different modules (tied weights). A module shared
    # by two parents is one layer, not a tie.
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(id(module))
    return {p for p, mods in owners.items() if len(mods) > 1}


def _storable(module: nn.Module, tied: set[int], block: Optional[tuple[int, int]]) -> bool:
    if type(module) is not nn.Linear or id(module.weight) in tied:
        return False
    return block is None or all(d <= b or d % b == 0 for d, b in zip((module.out_features, module.in_features), WEIGHT_BLOCK_SIZE))


def _held_fp8(module: Optional[nn.Module], block: Optional[tuple[int, int]]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    # A frozen weight kept only in FP8 in the checkpoint's layout: its own bytes and scales.
    layout = getattr(module, "frozen_layout", None)
    if layout is None or layout.block != block or layout.dtype != _FP8_DTYPE:
        return None
    return module.weight.detach(), module.weight_scale_inv


def _quantize_weight(weight: torch.Tensor, key: str, block: Optional[tuple[int, int]] = WEIGHT_BLOCK_SIZE
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 data ``[out, in]`` and float32 ``weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]``,
    or 0-dim for ``block`` None (the cast a frozen layer makes under per-tensor scaling)."""
    with torch.no_grad():
        amax = block_amax(weight, block or weight.shape)
        if not torch.isfinite(amax).all():
            raise ValueError(f"export: {key} holds an inf or NaN; valid for format='hf-fp8': finite weights")
        if block is None:
            q, _ = quantize_frozen(weight.detach(), Float8CurrentScaling())
            return q.data, q.scale_inv
        scale = blockwise_scale(amax, _FP8_DTYPE, power_2_scale=True, amax_epsilon=0.0)
        data = quantize_blocks(weight.detach(), scale, WEIGHT_BLOCK_SIZE, _FP8_DTYPE)
        return data, divide(1.0, scale)


# Files save_pretrained writes the weights to: an earlier export's may be stale.
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def _write_folder(path: Path, write: Callable[[str], Any]) -> None:
    parent = path.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{path.name}.tmp-"))
    try:
        write(str(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private (0700)
        if not path.exists():
            os.rename(tmp, path)
            return
        new = sorted(p.name for p in tmp.iterdir())
        # Weights first, config.json last: a reader that sees the new config finds the new weights.
        for name in sorted(new, key=lambda n: (n == "config.json", not _WEIGHT_FILE.fullmatch(n), n)):
            os.replace(tmp / name, path / name)
        for old in path.iterdir():
            if old.name not in new and _WEIGHT_FILE.fullmatch(old.name) and old.is_file():
                old.unlink()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
