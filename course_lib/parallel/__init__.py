"""Parallel training techniques, each built on `course_lib.distributed` (mesh, ledger, collectives, flat buffers).

    dp       data parallelism (DDP): naive, bucketed and overlapped gradient all-reduce
    zero     ZeRO-1/2: a sharded optimizer around any torch.optim class
    fsdp     ZeRO-3 / FSDP: parameters sharded per unit, gathered for compute
    pipeline schedules as data (GPipe, 1F1B, interleaved, ZB-H1), their executor on pp, PipeDream (notebook 05)
    tensor   Megatron 1D, sequence parallelism, 2D / 2.5D / 3D grids (notebook 06)
    compose  apply_<technique>(model, mesh, ...) and the order in which techniques compose
"""
from ..distributed.launch import preload_in_ranks

# ranks import the techniques inside their workers: warm them in the caller once, so forked ranks inherit them
preload_in_ranks("course_lib.parallel.compose")
