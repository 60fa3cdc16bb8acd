"""Pipeline parallelism from scratch: schedules as plain data, one executor for all of them, a simulator for the
bubble, and PipeDream's asynchronous variants.

    schedules   Op / Schedule; gpipe, one_f_one_b, interleaved_1f1b, zb_h1; validate, simulate, bubble, in-flight
    stage       PipelineStage (this rank's blocks of the GPT), split_layers, activation bytes per stage, B/W split
    executor    plan_pipeline → PipelineLayout (bad input → one clear error), Pipeline (the step_fn for train.run),
                apply_pipeline (→ the stage; its executor: handle_of(stage, 'pipeline')), boundary_bytes (the pp
                bytes per step)
    pipedream   asynchronous 1F1B without flush: no stashing (the bug), weight stashing, PipeDream-2BW
    reference   the same split trained by torch.distributed.pipelining, and its schedule tables in our notation
    plots       Gantt rows of F/B/W per rank, simulated or measured

Huang et al., GPipe, NeurIPS 2019; Narayanan et al., PipeDream, SOSP 2019; Narayanan et al., PipeDream-2BW,
ICML 2021; Narayanan et al., Megatron-LM, SC'21; Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024.
The formulas checked are docs/formulas.md §3.
"""
from .executor import (
                       ACTIVATION_TAG,
                       GRADIENT_TAG,
                       Pipeline,
                       PipelineLayout,
                       PipelinePlan,
                       apply_pipeline,
                       boundary_bytes,
                       plan_pipeline,
)
from .schedules import (
                       COSTS,
                       GENERATORS,
                       Op,
                       Schedule,
                       ScheduleError,
                       bubble_formula,
                       bubble_fraction,
                       gpipe,
                       in_flight,
                       interleaved_1f1b,
                       make_schedule,
                       one_f_one_b,
                       peak_bytes,
                       simulate,
                       validate,
                       zb_h1,
)
from .stage import (
                       PipelineStage,
                       check_splittable,
                       defer_weight_grads,
                       run_weight_grads,
                       split_layers,
                       stage_activation_bytes,
)

__all__ = ["ACTIVATION_TAG", "GRADIENT_TAG", "Pipeline", "PipelineLayout", "PipelinePlan", "apply_pipeline",
           "boundary_bytes", "plan_pipeline", "COSTS", "GENERATORS", "Op", "Schedule", "ScheduleError",
           "bubble_formula", "bubble_fraction", "gpipe", "in_flight", "interleaved_1f1b", "make_schedule",
           "one_f_one_b", "peak_bytes", "simulate", "validate", "zb_h1", "PipelineStage", "defer_weight_grads",
           "run_weight_grads", "split_layers", "stage_activation_bytes", "check_splittable"]
