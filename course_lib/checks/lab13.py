"""Checks for Lab 13: choose a configuration for a model and a cluster with the calculator, then run its toy version.

    check_choice(choose)      choose(model, cluster, batch, world) returns a Job that passes `check_job`, fits the
                              device memory (`memory_per_device`, modeled) and whose modeled step time is the best
                              of the options that fit — and beats the stated baseline (ZeRO-3 over every device
                              with full recomputation, the first thing that fits); each wrong choice named by cause
    check_toy_plan(toy_plan)  toy_plan(job) is the ParallelPlan of the same mesh and schedule for the course's toy
                              GPT (float64): dp/tp/pp, ZeRO stage, schedule and chunks, micro-batches per replica,
                              SP, recomputation, and every other field left at its default (precision None: the
                              toy runs in float64) — field by field
    check_toy_run(toy_plan, choose, world_size)
                              that plan trains the toy on real ranks through `parallelize`: every parameter and, at
                              every step, the mean over the dp replicas of their losses (each replica reports the
                              mean over its own micro-batches) equal the single-process run (1e-12, float64)

Everything the calculator says is *modeled* (formulas §15); the toy run is measured.
"""
from __future__ import annotations

from ..calculator import Decoder, Job, check_job
from ..calculator.planner import candidates, evaluate
from ..calculator.published import fitted_efficiency, meta_h100
from . import NOT_IMPLEMENTED, check, exercises, run_ranks

GB = 1e9
MODEL = Decoder("GPT 13B", 40, 5120, 40, 50304, 4096)       # the exercise's model: 40 × 5120, 4K tokens
WORLD = 4
BATCH = 8
# what `parallelize` composes with recomputation: ZeRO-1/2 (not FSDP); at most 2 interleaved chunks, as many as the
# toy's 4 layers on 2 stages split into (the chosen job is run on the toy)
TECHNIQUES = dict(zeros=(1,), max_chunks=2)
BASELINE = Job(batch=BATCH, dp=WORLD, zero=3, recompute="full")
TOY = dict(n_layer=4, n_head=4, d_model=32, seq_len=16)
STEPS = 2

exercises({"choose": "Exercise 1 (choose a configuration)", "toy_plan": "Exercise 2 (the toy's ParallelPlan)"})


def cluster():
    """Four H100 80GB of one Meta-style server (formulas §15.5's preset, `published.meta_h100`)."""
    return meta_h100(WORLD)


def options():
    """Every option of the exercise's technique set, evaluated (what a correct `choose` looks at)."""
    eff, cl = fitted_efficiency(), cluster()
    return [evaluate(MODEL, cl, j, eff, WORLD) for j in candidates(MODEL, cl, BATCH, WORLD, **TECHNIQUES)]


def check_choice(choose) -> Job:
    with check("choice") as c:
        job = choose(MODEL, cluster(), BATCH, WORLD)
        kind = type(job).__name__
        c.expect(isinstance(job, Job), f"choose returned {'an' if kind[0] in 'AEIOU' else 'a'} {kind}, not a Job",
                 hint="an Option carries its Job as .job: return that")
        try:
            check_job(MODEL, cluster(), job, WORLD)
        except ValueError as e:
            c.expect(False, f"the job is not valid: {e}",
                     hint=f"enumerate candidates for world={WORLD}, the devices the job gets")
        c.expect(job.zero in TECHNIQUES["zeros"],
                 f"{job.describe()} uses ZeRO-{job.zero}, outside this lab's technique set {TECHNIQUES}",
                 hint="pass **lab13.TECHNIQUES to candidates: parallelize does not compose FSDP with recomputation")
        eff = fitted_efficiency()
        mine = evaluate(MODEL, cluster(), job, eff, WORLD)
        fits = [o for o in options() if o.fits]
        best, base = min(fits, key=lambda o: o.seconds), evaluate(MODEL, cluster(), BASELINE, eff, WORLD)
        c.expect(mine.fits, f"{job.describe()} does not fit: {mine.reason}",
                 hint="keep only the options whose memory fits (Option.fits) before picking the fastest")
        least = min(fits, key=lambda o: o.memory["total"])
        c.expect(not (mine.job == least.job and mine.seconds > best.seconds),
                 f"{job.describe()} is the option with the least memory ({mine.memory['total'] / GB:.1f} GB), "
                 f"{mine.seconds:.2f} s/step; the fastest that fits takes {best.seconds:.2f} s",
                 hint="rank the options that fit by modeled step time (Option.seconds), not by memory")
        slowest = max(fits, key=lambda o: o.seconds)
        for other, which in ((fits[0], "the first option that fits (in candidates' order)"),
                             (slowest, "the slowest option that fits")):
            c.expect(not (mine.job == other.job and mine.seconds > best.seconds),
                     f"{job.describe()} is {which}: {mine.seconds:.2f} s/step (modeled); the fastest that fits, "
                     f"{best.job.describe()}, takes {best.seconds:.2f} s",
                     hint="of the options that fit, return the job of the one with the smallest modeled step time "
                          "(min over Option.seconds)")
        c.expect(mine.seconds < base.seconds,
                 f"{job.describe()}: {mine.seconds:.2f} s/step (modeled) does not beat the baseline "
                 f"{BASELINE.describe()} at {base.seconds:.2f} s",
                 hint="of the options that fit, pick the one with the smallest modeled step time "
                      "(min over Option.seconds)")
        c.expect(mine.seconds <= best.seconds * (1 + 1e-12),
                 f"{job.describe()}: {mine.seconds:.2f} s/step, but {best.job.describe()} fits and takes "
                 f"{best.seconds:.2f} s", hint="look at every candidate, and keep the fastest one that fits")
        c.passed(f"{job.describe()}: {mine.seconds:.2f} s/step (modeled), {mine.memory['total'] / GB:.1f} of "
                 f"{cluster().device_memory / GB:.0f} GB, MFU {mine.step['mfu']:.0%}; baseline {base.seconds:.2f} s")
    return job


def _want(job: Job):
    from ..composer.plan import ParallelPlan
    return ParallelPlan(dp=job.dp, tp=job.tp, pp=job.pp, zero=job.zero, schedule=job.schedule, chunks=job.chunks,
                        num_microbatches=job.num_microbatches, sequence_parallel=job.sequence_parallel,
                        recompute=job.recompute)


# the hint for a field of the plan that differs from the job's; a field not named here keeps its default
_FIELD_HINTS = {"dp": "dp=job.dp", "tp": "tp=job.tp", "pp": "pp=job.pp", "zero": "zero=job.zero",
                "schedule": "schedule=job.schedule", "chunks": "chunks=job.chunks",
                "num_microbatches": "job.num_microbatches is batch ÷ (dp × micro_batch): each replica's micro-batches, "
                                    "not its sequences",
                "sequence_parallel": "sequence_parallel=job.sequence_parallel", "recompute": "recompute=job.recompute",
                "precision": "leave precision=None: the toy runs in float64 so that it can equal one process to "
                             "1e-12; the job's bf16 is what the calculator models for the real cluster"}


def _check_plan(c, toy_plan, job):
    from dataclasses import fields

    from ..composer.plan import ParallelPlan
    plan = toy_plan(job)
    c.expect(isinstance(plan, ParallelPlan), f"toy_plan returned a {type(plan).__name__}, not a ParallelPlan")
    want = _want(job)
    for name in [*_FIELD_HINTS, *(f.name for f in fields(ParallelPlan) if f.name not in _FIELD_HINTS)]:
        got, exp = getattr(plan, name), getattr(want, name)
        whose = "the job's" if name in _FIELD_HINTS and name != "precision" else "the toy's"
        c.expect(got == exp, f"{job.describe()}: the plan's {name} is {got!r}, {whose} is {exp!r}",
                 hint=_FIELD_HINTS.get(name, f"leave {name} at its default: the job does not set it"))
    return plan


def check_toy_plan(toy_plan, jobs=None) -> None:
    with check("toy plan") as c:
        jobs = jobs or [Job(batch=16, dp=2, tp=2, zero=1, sequence_parallel=True, recompute="selective"),
                        Job(batch=16, dp=1, tp=2, pp=2, schedule="interleaved", chunks=2, sequence_parallel=True),
                        Job(batch=8, micro_batch=2, dp=2, pp=2, zero=1, recompute="full")]
        for job in jobs:
            _check_plan(c, toy_plan, job)
        c.passed(f"{len(jobs)} jobs → their ParallelPlans, field by field")


def _toy_worker(ctx, plan, batch, reference, seed):
    import torch

    from ..composer.parallelize import parallelize
    from ..core.model import GPT, get_config
    from ..distributed.mesh import Mesh
    from ..train import TrainConfig
    torch.set_default_dtype(torch.float64)
    cfg = get_config("nano", **TOY)
    tc = TrainConfig(steps=STEPS, batch_size=batch, lr=1e-3, seed=seed)
    mesh = Mesh(ctx.comm, pp=plan.pp, dp=plan.dp, tp=plan.tp)
    with parallelize(GPT(cfg, seed=tc.seed).double(), mesh, plan, train_config=tc) as job:
        run = job.train(STEPS, keep_params=True)
        err = max((v - job.local_shard(k, reference[k])).abs().max().item() for k, v in run.params.items())
    return {"losses": run.losses, "err": err, "dp": mesh.dp_rank}


def check_toy_run(toy_plan, choose, world_size: int = WORLD, seed: int = 0) -> None:
    import torch

    from ..core.model import GPT, get_config
    from ..train import TrainConfig, train_reference
    with check("toy run") as c:
        job = choose(MODEL, cluster(), BATCH, WORLD)
        plan = _check_plan(c, toy_plan, job)
        cfg = get_config("nano", **TOY)
        batch = plan.dp * plan.num_microbatches                  # one toy sequence per micro-batch
        plan.check(cfg, world_size, batch_size=batch)
        torch.set_default_dtype(torch.float64)
        try:
            tc = TrainConfig(steps=STEPS, batch_size=batch, lr=1e-3, seed=seed)
            ref = train_reference(cfg, tc, progress=False, model=GPT(cfg, seed=seed).double())
        finally:
            torch.set_default_dtype(torch.float32)
        params = {k: v.detach() for k, v in ref.model.named_parameters()}
        res = run_ranks(c, _toy_worker, world_size, plan, batch, params, seed, timeout=120)
        err = max(r["err"] for r in res)
        # each dp replica reports the mean loss over its own micro-batches, and only the ranks that hold the head see
        # it (the others report None or NaN); one process's loss is the mean over all of them, and every replica
        # runs as many micro-batches, so it is the mean over the replicas of theirs
        per_dp = {r["dp"]: r["losses"] for r in res if all(a is not None and a == a for a in r["losses"])}
        c.expect(sorted(per_dp) == list(range(plan.dp)),
                 f"{plan.describe()}: only dp replicas {sorted(per_dp)} of {plan.dp} reported a loss",
                 hint="a bug in the check or the library, not in your plan: please report it")
        mean = [sum(ls[i] for ls in per_dp.values()) / plan.dp for i in range(STEPS)]
        dloss = max(abs(a - b) for a, b in zip(mean, ref.losses))
        c.expect(err < 1e-12, f"{plan.describe()}: parameters off by {err:.1e} from one process after {STEPS} "
                              f"steps (mean loss off by {dloss:.1e})",
                 hint="the plan equals the job's field by field, so this is a bug in the library: please report it")
        c.expect(dloss < 1e-12, f"{plan.describe()}: the replicas' mean loss is off by {dloss:.1e} from one "
                                f"process's, though the parameters agree to {err:.0e}",
                 hint="a bug in the check or the library, not in your plan: please report it")
        c.passed(f"{plan.describe()} on {world_size} real ranks: {STEPS} steps, loss {ref.losses[-1]:.6f} = one "
                 f"process's (|Δloss| {dloss:.0e}, max |Δparam| {err:.0e}, float64)")


__all__ = ["MODEL", "WORLD", "BATCH", "BASELINE", "TECHNIQUES", "cluster", "options", "check_choice",
           "check_toy_plan", "check_toy_run", "NOT_IMPLEMENTED"]
