"""Parallel training techniques, each built on `course_lib.distributed` (mesh, ledger, collectives, flat buffers).

    dp       data parallelism (DDP): naive, bucketed and overlapped gradient all-reduce
    zero     ZeRO-1/2: a sharded optimizer around any torch.optim class
    fsdp     ZeRO-3 / FSDP: parameters sharded per unit, gathered for compute
    pipeline schedules as data (GPipe, 1F1B, interleaved, ZB-H1), their executor on pp, PipeDream (notebook 05)
    tensor   Megatron 1D, sequence parallelism, 2D / 2.5D / 3D grids (notebook 06)
    context  context parallelism: ring attention and the all-gather variant over cp (notebook 12)
    expert   expert parallelism: the all-to-all that feeds each rank's experts over ep (notebook 12)

Each technique is `apply_<technique>(model, mesh, ...)`; `course_lib.composer` applies them in their one order.
"""
from ..distributed.launch import preload_in_ranks

# ranks import the techniques inside their workers: warm them in the caller once, so forked ranks inherit them
TECHNIQUES = ("dp", "zero", "fsdp", "pipeline", "tensor", "context", "expert")
preload_in_ranks(*(f"{__name__}.{name}" for name in TECHNIQUES))
