"""Memory-saving techniques that change how much each byte of training costs, not how ranks share the work.

    offload     move optimizer state, gradients or activations to host memory or disk and back (notebook 07)
    recompute   drop activations in forward and recompute them in backward (notebook 08)
    precision   number formats, mixed precision from scratch (fp32 master weights, dynamic loss scaling),
                FP8 simulation with delayed scaling; `apply_precision(model, mesh=None, recipe=...)` (notebook 09)
    quantize    block-wise quantization, 8-bit Adam, quantized ring all-reduce with error feedback, weight-only
                post-training quantization (notebook 09)

Each module is a short file built on the shared mesh, flat buffers and training loop (`course_lib.train.run`);
`course_lib.parallel.compose` says in which order the `apply_*` functions compose.
"""
