#!/usr/bin/env python3
"""Benchmark: a composed 8-rank step against its parts run alone (a report, not a test: timings on a shared 2-core
machine are too noisy to assert).

    .venv/bin/python tools/bench_compose.py [--steps 6] [--preset nano]

For pp × dp × tp = 2 × 2 × 2 with ZeRO-1 and 1F1B, it times the median step of the composed plan and of each part
alone on the same 8 ranks (pp=2 with dp=4; tp=2 with dp=4; dp=8 with ZeRO-1), and prints composed / slowest part.
The course's goal is a ratio ≤ 1.5: composing must not cost more than its slowest ingredient by much.
"""
from __future__ import annotations

import argparse
import statistics

from course_lib.composer.parallelize import ParallelPlan, parallelize
from course_lib.core.model import GPT, get_config
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh
from course_lib.train import TrainConfig


def _worker(ctx, cfg, plans, steps):
    out = []
    tc = TrainConfig(steps=steps, batch_size=16, lr=1e-3)
    for plan in plans:
        mesh = Mesh(ctx.comm, pp=plan.pp, dp=plan.dp, tp=plan.tp)
        with parallelize(GPT(cfg, seed=0), mesh, plan, train_config=tc) as job:
            run = job.train(steps)
        out.append(statistics.median(run.step_seconds[1:]))        # the first step warms up
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--preset", default="nano")
    args = ap.parse_args(argv)
    cfg = get_config(args.preset, n_layer=4, n_head=4)
    plans = {"composed 2×2×2 ZeRO-1 1F1B": ParallelPlan(pp=2, dp=2, tp=2, zero=1, microbatches=4),
             "pp=2 alone (dp=4)": ParallelPlan(pp=2, dp=4, microbatches=4),
             "tp=2 alone (dp=4)": ParallelPlan(tp=2, dp=4, microbatches=4),
             "ZeRO-1 alone (dp=8)": ParallelPlan(dp=8, zero=1, microbatches=2)}
    res = launch(_worker, 8, cfg, list(plans.values()), args.steps, timeout=600)
    step = {name: max(r[i] for r in res) for i, name in enumerate(plans)}      # a step ends with its slowest rank
    for name, s in step.items():
        print(f"{name:<30} {s * 1e3:8.1f} ms per step")
    parts = [s for name, s in step.items() if not name.startswith("composed")]
    print(f"composed / slowest part = {step['composed 2×2×2 ZeRO-1 1F1B'] / max(parts):.2f}  (goal ≤ 1.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
