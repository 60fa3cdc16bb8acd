"""The capstone's calculator: memory per device, step time, planner and cost for any decoder on any cluster, all
analytic and *modeled* (docs/formulas.md §15). It composes formulas the course already owns — ZeRO's model states
(`parallel.zero`), notebook 05's schedule simulator (`parallel.pipeline.schedules`), the α–β link model
(`costmodel`) — and is checked against published tables (`published`, data/published/).

    config      Decoder (dense or MoE), Cluster, Job (even or uneven pipeline stages), precision recipes as data,
                and `validate`: the one check every entry point goes through, bad input → one line
    memory      bytes per device by category; checkpoint size
    step_time   step_time(): compute, exposed communication per axis, bubble; MFU and HFU; the fitted `Efficiency`
    published   the papers' tables beside the calculator's values (dense and MoE runs); fitting one constant on
                one named row; the headline: every row marked fitted, by construction, post-hoc or predicted
    planner     enumerate, drop what does not fit (with why), rank, the decision flow and its explanation,
                place a given job
    cost        GPU-hours, rent vs own (the GPU, or the whole system), break-even utilisation, energy
    toy         the course's own runs: bytes per axis and model states per rank of a `parallelize` plan, exactly;
                the toy's step modeled from measured op costs
"""
from .config import RECIPES, CalculatorError, Cluster, Decoder, Job, check_job, ends_split, validate
from .cost import Prices, break_even_utilisation, job_cost
from .memory import checkpoint_bytes, memory_per_device, param_count
from .planner import Search, decision_flow, evaluate, search
from .step_time import IDEAL, Efficiency

__all__ = ["RECIPES", "CalculatorError", "Cluster", "Decoder", "Job", "check_job", "ends_split", "validate", "Prices",
           "break_even_utilisation", "job_cost", "checkpoint_bytes", "memory_per_device", "param_count", "Search",
           "decision_flow", "evaluate", "search", "IDEAL", "Efficiency"]
