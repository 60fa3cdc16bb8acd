"""Memory optimizations that trade something else for bytes on the device (notebooks 07–09):

    offload      move model states or activations to host memory or disk and bring them back in time (07)
    recompute    keep a segment's inputs instead of what it saves for backward, recompute the rest (08)
    precision    store and compute in fewer bits: mixed precision, fp8, 8-bit optimizer state (09)

Each module has its `apply_<technique>(model, mesh, ...)`; `course_lib.parallel.compose` says in which order they
compose with tensor parallelism, pipelines and data parallelism.
"""
