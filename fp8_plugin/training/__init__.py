"""The loop-neutral training core and its services: ``FP8Training`` (convert once, the forward
context, settle the FP8 state after each optimizer step, state and figures), the precision
strings, the amax reduction across ranks, non-finite step handling (faults), the BF16 reference
checks with their reports, per-layer FP8 statistics, and crash-safe file writes.

Every loop adapter (Lightning, Fabric, Accelerate, the transformers Trainer) maps its hooks onto
these; nothing here knows which loop runs it.

May import: :mod:`fp8_plugin.modules`, :mod:`fp8_plugin.numerics`, :mod:`fp8_plugin._private`.
"""
