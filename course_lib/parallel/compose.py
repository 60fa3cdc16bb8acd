"""Every `apply_<technique>(model, mesh, ...)` of the course in one namespace, for notebooks and labs.

The composer is `course_lib.parallelize.parallelize(model, mesh, plan)`: it applies them in the one order they
compose in, with the reason for each position (`parallelize.ORDER`), and builds the optimizer last; its
`train_parallel` is the one-axis form notebooks 03, 04 and 09 train with (a hand-written data-parallel wrapper over
dp). Each technique lives in its own file and imports nothing from here; this module only re-exports them.

    apply_tp        parallel.tensor      rewrites the layers (which rows or columns of each weight a rank holds)
    apply_pipeline  parallel.pipeline    keeps this stage's blocks: the stage, its executor stage.pipeline
    apply_recompute memopt.recompute     hooks on the blocks that run here; the replay re-issues TP's collectives
    apply_offload   memopt.offload       activations on the same blocks; the optimizer as ZeRO's inner one
    apply_precision memopt.precision     casts in place, keeps fp32 masters; the optimizer comes from course_lib.optim
    apply_dp / apply_zero / apply_fsdp   outermost: reduce or shard whatever this rank holds, over dp
"""
from __future__ import annotations

from ..distributed.mesh import axis_comm, data_parallel_batches  # noqa: F401  (re-exported: notebooks import them here)
from ..memopt.precision import apply_precision  # noqa: F401  step 4 (notebook 09), re-exported for the capstone
from ..memopt.recompute import apply_recompute  # noqa: F401  step 3 (notebook 08), re-exported for the capstone
from .dp import DP_KINDS, apply_dp  # noqa: F401  5. data parallelism over dp (notebook 03)
from .fsdp import apply_fsdp  # noqa: F401  5. ZeRO-3 / FSDP over dp (notebook 04)
from .pipeline import apply_pipeline  # noqa: F401  2. pipeline split over pp (notebook 05): the stage
from .zero import STAGE_NAMES, apply_zero  # noqa: F401  5. ZeRO stages 0-3 over dp (notebook 04)
from .tensor import apply_tp  # noqa: E402  (step 1 above: tensor parallelism over tp, course_lib.parallel.tensor)
from ..memopt.offload import apply_offload  # noqa: E402  (offload: activations at 3, ZeRO's inner optimizer at 5)

__all__ = ["apply_dp", "apply_fsdp", "apply_precision", "apply_recompute", "apply_zero", "apply_tp", "apply_pipeline",
           "apply_offload", "axis_comm", "data_parallel_batches", "DP_KINDS", "STAGE_NAMES"]
