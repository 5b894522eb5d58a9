"""The parts of ``benchmarks/suite.py``: one module per section of the suite.

- :mod:`.common`: devices, clocks, peak memory, the run's environment;
- :mod:`.layers`: ``FP8Linear`` forward + backward against ``nn.Linear`` under BF16 autocast;
- :mod:`.models`: training steps of Llama-style models through Lightning and Accelerate;
- :mod:`.bookkeeping`: the per-step cost of the FP8 state outside the GEMMs and casts;
- :mod:`.saved_bytes`: bytes the linear layers save for backward;
- :mod:`.report`: the markdown tables and the targets.

And of ``benchmarks/model_table.py``, the model table (every precision and mode of a model side by
side, as users run them) and ``benchmarks/results.py``, the results files:

- :mod:`.training_runs`: one run, a plain training loop in this process;
- :mod:`.cuda_graphs`: the decoder layers as CUDA graphs (``fp8_plugin.make_graphed_callables``);
- :mod:`.model_table`: the runs' order, each in a process of its own, within a budget;
- :mod:`.results`: rows per (model or layer, mode, recipe) from a GPU run's archive, as markdown.

And of ``benchmarks/cost_model.py``, the projected (not measured) H100 / H200 cost model:

- :mod:`.op_costs`: every aten op of a step counted with its bytes and FLOPs, each bounded on a
  GPU's published peak figures, eager or ideally fused;
- :mod:`.workloads`: the steps it traces on fake tensors (an FP8 / BF16 linear layer, a Llama block).
"""
