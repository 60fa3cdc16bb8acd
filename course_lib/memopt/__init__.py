"""Memory-saving techniques: each trades memory on the accelerator for something else (link time, host memory, disk,
recomputation, precision), measured by the memory accountant (`course_lib.memory`) on the simulated accelerator.

    offload        activations to host memory (vDNN), optimizer state and the Adam step on the CPU (ZeRO-Offload,
                   with the one-step delayed update), optimizer state on an SSD (ZeRO-Infinity); `apply_offload`
    swap_planner   a traced training step, and what to swap out and when to prefetch it under a device budget
                   (a greedy rule and a genetic search, SwapAdvisor-style)
    recompute      activation recomputation (notebook 08)
    precision      mixed precision (notebook 09)
    quantize       quantized weights, gradients and optimizer state (notebook 09)

The formulas checked are docs/formulas.md §5–§7.
"""
