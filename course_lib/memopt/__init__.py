"""Memory-saving techniques: they change how much each byte of training costs, not how ranks share the work
(notebooks 07–09), each measured by the memory accountant (`course_lib.memory`) on the simulated accelerator.

    offload        activations to host memory (vDNN), optimizer state and the Adam step on the CPU (ZeRO-Offload,
                   with the one-step delayed update), optimizer state on an SSD (ZeRO-Infinity) (07)
    swap_planner   a traced training step, and what to swap out and when to prefetch it under a device budget
                   (a greedy rule and a genetic search, SwapAdvisor-style) (07)
    recompute      keep a segment's inputs instead of what it saves for backward, recompute the rest (08)
    precision      number formats, mixed precision from scratch (fp32 master weights, dynamic loss scaling),
                   FP8 simulation with delayed scaling (09)
    quantize       block-wise quantization, 8-bit Adam, quantized ring all-reduce with error feedback, weight-only
                   post-training quantization (09)

Each module is a short file built on the shared mesh, flat buffers and training loop (`course_lib.train.run`), with
its `apply_<technique>(model, mesh, ...)`; `course_lib.composer.parallelize.ORDER` says in which order they compose with
tensor parallelism, pipelines and data parallelism. The formulas checked are in docs/formulas.md.

    memory_fit     which technique fits a model on a device, host and disk, at what modeled step time (07, 14)
    fp8_compare    our FP8 linear against torchao's, layer by layer, with a bound for any seed and CPU (09)
"""
from ..distributed.launch import preload_in_ranks

# ranks import the techniques inside their workers: warm them in the caller once, so forked ranks inherit them
TECHNIQUES = ("recompute", "offload", "precision", "quantize")
preload_in_ranks(*(f"{__name__}.{name}" for name in TECHNIQUES))
