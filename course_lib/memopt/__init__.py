"""Memory-saving techniques: they change how much each byte of training costs, not how ranks share the work
(notebooks 07–09).

    offload     move optimizer state, gradients or activations to host memory or disk and back in time (07)
    recompute   keep a segment's inputs instead of what it saves for backward, recompute the rest (08)
    precision   number formats, mixed precision from scratch (fp32 master weights, dynamic loss scaling),
                FP8 simulation with delayed scaling (09)
    quantize    block-wise quantization, 8-bit Adam, quantized ring all-reduce with error feedback, weight-only
                post-training quantization (09)

Each module is a short file built on the shared mesh, flat buffers and training loop (`course_lib.train.run`), with
its `apply_<technique>(model, mesh, ...)`; `course_lib.parallel.compose` says in which order they compose with
tensor parallelism, pipelines and data parallelism.
"""
