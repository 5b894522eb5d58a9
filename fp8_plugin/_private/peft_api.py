"""The private hook into PEFT this project uses.

PEFT places a new adapter (LoRA's ``lora_A`` / ``lora_B``) in the dtype of its base layer's
``weight``, and reads a ``compute_dtype`` attribute of the base layer instead where there is one
(``BaseTunerLayer._get_base_layer_device_and_dtype``, written for bitsandbytes' 4-bit layers; not
in PEFT's documented API). A frozen FP8 layer's ``weight`` is E4M3: without the attribute PEFT
would round the adapters' initial values to E4M3 before it upcasts them to float32.
:data:`ADAPTER_DTYPE_ATTRIBUTE` names it; tests/modules/test_frozen_fp8.py checks that adapters over a
frozen FP8 base start bit for bit as over the high-precision one, so a PEFT release that stops
reading it fails loudly.
"""

__all__ = ["ADAPTER_DTYPE_ATTRIBUTE"]

ADAPTER_DTYPE_ATTRIBUTE = "compute_dtype"
