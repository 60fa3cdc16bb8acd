"""The composer: one plan of every technique, checked before launch, applied on a rank in the one order the
techniques compose in, with the bytes each axis must carry.

    plan         `ParallelPlan`: sizes of every mesh axis and each technique's options, checked (`check`) before
                 any rank talks to another; `PlanError` says what to change
    parallelize  `parallelize(model, mesh, plan)`: every `apply_<technique>` in `ORDER`, with the reason for each
                 position; `train_parallel`, the one-axis form
    expected     bytes one rank sends per step on each axis, summed from each technique's own formula
"""
from .parallelize import ORDER, Parallelized, parallelize, train_parallel
from .plan import ParallelPlan, PlanError

__all__ = ["ORDER", "ParallelPlan", "Parallelized", "PlanError", "parallelize", "train_parallel"]
