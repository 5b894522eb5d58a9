"""The parts of ``benchmarks/suite.py``: one module per section of the suite.

- :mod:`.common`: devices, clocks, peak memory, the run's environment;
- :mod:`.layers`: ``FP8Linear`` forward + backward against ``nn.Linear`` under BF16 autocast;
- :mod:`.models`: training steps of Llama-style models through Lightning and Accelerate;
- :mod:`.bookkeeping`: the per-step cost of the FP8 state outside the GEMMs and casts;
- :mod:`.saved_bytes`: bytes the linear layers save for backward;
- :mod:`.report`: the markdown tables and the targets.
"""
