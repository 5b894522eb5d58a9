"""Numerics: FP8 formats, Transformer Engine's recipes, amax and scale, per-tensor and block
(MXFP8, blockwise) quantizers with their scaling state, the block-scale layouts cuBLAS reads, the
FP8 GEMMs (native, or emulated: exact float32 or BF16 GEMMs), dense and grouped per expert, and
which of them a device runs.

Pure tensor code: no ``nn.Module``, no training loop.

May import: torch, :mod:`fp8_plugin._private`. Nothing else of fp8_plugin.
"""
