"""Checks for Lab 05: the 1F1B schedule generator, written from GPipe's.

    check_validates(one_f_one_b)            the validator accepts it for S = 1…4 and M ∈ {1, S, 2S+1} (each op once,
                                            on its stage's rank, no deadlock) and it has no W ops
    check_in_flight(one_f_one_b)            rank r never holds more than S − r micro-batches (GPipe holds M)
    check_bubble(one_f_one_b)               the simulated bubble (F=1, B=2) equals (S−1)/(M+S−1) exactly, every rank,
                                            and the ops follow 1F1B's rules (a failure says which rule, on which rank)
    check_trains(one_f_one_b, world_size)   on real ranks, one float64 step gives the single-process gradients (1e-12)
"""
from __future__ import annotations

from ..core.data import ShardedBatches
from ..core.model import GPT, get_config
from ..parallel.pipeline import Op, ScheduleError, bubble_formula, bubble_fraction, in_flight, make_schedule, simulate
from . import check, run_ranks

CFG = get_config("nano", n_layer=4, seq_len=32)      # 4 blocks: up to 4 stages; short sequences: a fast check
SHAPES = [(S, M) for S in (1, 2, 3, 4) for M in sorted({1, S, 2 * S + 1})]
GRAD_TOL = 1e-12
_HINT = ("rank r: min(S−1−r, M) warm-up forwards; then while forwards remain, one forward and one backward "
         "(the backward of the oldest micro-batch); then the remaining backwards")


def diagnose(ops: list, S: int, M: int) -> str | None:
    """The first 1F1B rule the per-rank op lists break, in words that name it (None if they follow every rule):
    one stage per rank, forwards and backwards each in micro-batch order, min(S−1−r, M) warm-up forwards, then
    one F and one B while forwards remain, then the backwards left."""
    for r, rank_ops in enumerate(ops):
        rank_ops = [Op(*o) for o in rank_ops]
        stages = sorted({o.stage for o in rank_ops})
        if stages != [r]:
            return f"rank {r} runs ops of stage(s) {stages}: with one stage per rank, rank r runs stage r only"
        want = min(S - 1 - r, M)
        lead = want + 1 if want < M else M       # the warm-up, then the steady state's first forward
        got = next((i for i, o in enumerate(rank_ops) if o.kind == "B"), len(rank_ops))
        if got == 0:
            return (f"rank {r} starts with a backward ({rank_ops[0]}): a micro-batch's backward needs its forward "
                    f"first — after min(S−1−r, M) = {want} warm-up forwards, each steady step is a forward, then a "
                    f"backward")
        if got != lead:
            why = ("all forwards before any backward is GPipe's order" if got == M and want < M else
                   "S−1−r > M here: clamp the warm-up to M" if want == M and got > M else
                   "one too many" if got == lead + 1 else "one too few" if got == lead - 1 else "")
            return (f"rank {r} runs {got} forwards before its first backward, 1F1B runs {lead}: a warm-up of "
                    f"min(S−1−r, M) = min({S - 1 - r}, {M}) = {want}"
                    + (" and the steady state's first forward" if want < M else "") + (f" ({why})" if why else ""))
        for kind, what in (("F", "forwards"), ("B", "backwards")):
            order = [o.mb for o in rank_ops if o.kind == kind]
            if order != list(range(M)):
                shown = ", ".join(map(str, order[:8])) + (", …" if len(order) > 8 else "")
                return (f"rank {r} runs its {what} on micro-batches [{shown}]; 1F1B runs each micro-batch once, "
                        f"in order 0 … M−1 = {M - 1} (the backwards oldest first)")
        steady = [o.kind for o in rank_ops[want:want + 2 * (M - want)]]
        if steady != ["F", "B"] * (M - want):
            i = next((i for i, (a, b) in enumerate(zip(steady, ["F", "B"] * (M - want))) if a != b), len(steady))
            seen = rank_ops[want + i] if want + i < len(rank_ops) else "the end of its ops"
            return (f"rank {r}: after the warm-up comes {seen} where 1F1B runs "
                    f"{'a forward' if i % 2 == 0 else 'a backward'}: while forwards remain, one forward, then one "
                    f"backward (forward first)")
    return None


def _hint(fn, S, M) -> str:
    try:
        why = diagnose(fn(S, M), S, M)
    except Exception:  # noqa: BLE001 — the generator itself failed: the error says why, the rule is the hint
        why = None
    return why or _HINT


def _schedule(fn, S, M, c):
    try:
        return make_schedule(fn, S, M)
    except ScheduleError as e:
        c.expect(False, f"S={S}, M={M}: {e}", hint=_hint(fn, S, M))


def check_validates(one_f_one_b) -> None:
    with check("validates") as c:
        for S, M in SHAPES:
            s = _schedule(one_f_one_b, S, M, c)
            c.expect(not s.split_backward, f"S={S}, M={M}: your schedule has W ops; 1F1B runs whole backwards (B)",
                     hint="use only Op('F', …) and Op('B', …)")
        c.passed(f"the validator accepts your schedule for {len(SHAPES)} shapes (S = 1…4, M ∈ {{1, S, 2S+1}}): "
                 f"every F and B once, on its stage's rank, no deadlock")


def check_in_flight(one_f_one_b) -> None:
    with check("in_flight") as c:
        for S, M in SHAPES:
            held = in_flight(_schedule(one_f_one_b, S, M, c))
            for r, h in enumerate(held):
                c.expect(h <= S - r, f"S={S}, M={M}: rank {r} holds {h} micro-batches at its peak; 1F1B holds at most "
                         f"S − r = {S - r}", hint=_hint(one_f_one_b, S, M))
        S, M = 4, 9
        c.passed(f"rank r never holds more than S − r micro-batches; S={S}, M={M}: "
                 f"{in_flight(make_schedule(one_f_one_b, S, M))} (GPipe: {[M] * S})")


def check_bubble(one_f_one_b) -> None:
    with check("bubble") as c:
        for S, M in SHAPES:
            got = bubble_fraction(simulate(_schedule(one_f_one_b, S, M, c)))
            want = bubble_formula("1f1b", S, M)
            c.expect(got == [want] * S, f"S={S}, M={M}: simulated bubble per rank {[str(g) for g in got]}, expected "
                     f"(S−1)/(M+S−1) = {want} on every rank", hint=_hint(one_f_one_b, S, M))
        for S, M in SHAPES:    # the bubble and the memory are right: the order must be 1F1B's too
            why = diagnose(one_f_one_b(S, M), S, M)
            c.expect(why is None, f"S={S}, M={M}: the bubble is right, but {why}", hint=_HINT)
        c.passed(f"simulated bubble = (S−1)/(M+S−1) exactly on every rank, e.g. S=4, M=9: "
                 f"{bubble_formula('1f1b', 4, 9)}")


def _trains(ctx, one_f_one_b, M):
    from ..distributed.mesh import Mesh
    from ..train import GradProbe, TrainConfig
    mesh = Mesh(ctx.comm, pp=ctx.world_size)
    tc = TrainConfig(steps=1, batch_size=2 * M)
    from ..composer.parallelize import ParallelPlan, parallelize
    plan = ParallelPlan(pp=ctx.world_size, schedule=one_f_one_b, microbatches=M)    # the learner's schedule
    with parallelize(GPT(CFG, seed=tc.seed).double(), mesh, plan, train_config=tc) as job:
        run = job.train(tc.steps, probes=[GradProbe()])
    return {"grads": run["grads"], "loss": run.losses[0], "sent": ctx.comm.ledger.bytes_sent(group="pp")}


def check_trains(one_f_one_b, world_size: int) -> None:
    with check("trains") as c:
        if not 2 <= world_size <= CFG.n_layer:
            raise ValueError(f"world_size must be 2 to {CFG.n_layer} (one stage per rank, one block per stage "
                             "at least)")
        M = 2 * world_size + 1
        make_schedule(one_f_one_b, world_size, M)             # a schedule that cannot run fails here, not as a hang
        ranks = run_ranks(c, _trains, world_size, one_f_one_b, M, timeout=120,
                          hang_hint="a rank waits for a message no rank sends: check the order of your ops")
        model = GPT(CFG).double()
        model(*ShardedBatches(CFG.seq_len, 2 * M).global_batch(0))[1].backward()
        ref = {k: p.grad for k, p in model.named_parameters()}
        grads = {k: g for r in ranks for k, g in r["grads"].items()}
        c.expect(grads.keys() == ref.keys(), "the stages' gradients do not cover the model's parameters exactly once")
        worst, name = max(((grads[k] - ref[k]).abs().max().item(), k) for k in ref)
        c.expect(worst < GRAD_TOL, f"gradient of {name} differs from one process's by {worst:.1e} (tolerance "
                 f"{GRAD_TOL:g}, float64)", hint="every micro-batch needs exactly one F and one B on every stage")
        c.passed(f"{world_size} ranks, M={M}: one step's gradients equal one process's within {worst:.1e} "
                 f"({len(grads)} tensors, float64)")


__all__ = ["diagnose", "check_validates", "check_in_flight", "check_bubble", "check_trains"]
