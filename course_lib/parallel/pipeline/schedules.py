"""Pipeline schedules as plain data, a validator that proves a schedule runs, and a simulator that times it.

A schedule is, for every pipeline rank, the ordered list of what that rank computes:

    Op("F", stage, mb)   forward of micro-batch `mb` through (virtual) stage `stage`
    Op("B", stage, mb)   backward: the whole backward — or, in a schedule that also has W ops, only the gradient
                         with respect to the stage's *input* (what the previous stage waits for)
    Op("W", stage, mb)   the gradient with respect to the stage's *weights* (zero-bubble schedules only)

Stage k lives on rank k mod S (S = pp_size ranks, v chunks each: rank r holds stages r, r+S, …, r+(v−1)S, the
Megatron / torch.distributed.pipelining layout). `str(op)` is torch's action notation ("2F0"), so a schedule can be
compared op by op with `torch.distributed.pipelining`'s `pipeline_order`. One executor runs any schedule
(`executor.py`); nothing here launches a rank.

Generators (each returns per-rank op lists; `make_schedule` wraps and validates them):

    gpipe              all F, then all B                                  Huang et al., NeurIPS 2019
    one_f_one_b        S−1−r warm-up F, then F/B alternating, then B      PipeDream-Flush; Narayanan et al. SC'21 §2.2.1
    interleaved_1f1b   v chunks per rank, depth-first in rounds of S       Narayanan et al. SC'21 §2.2.2
    zb_h1              1F1B with B split into B (input) and W (weights),  Qi et al., ICLR 2024 §2.1 (ZB-H1)
                       W of rank r delayed by r steps to fill the drain

Checked against (docs/formulas.md §3) with op costs F = 1, B = 2 (the whole backward), W = 1 (its weight part):

    bubble = idle / total time = (p−1)/(m+p−1)      GPipe and 1F1B
                                 (p−1)/(v·m+p−1)    interleaved (m a multiple of p)
                                 (p−1)/(3m+p−1)     ZB-H1 (T_F = T_B = T_W; m ≥ p)
    in flight on rank r (1F1B) = min(p−r, m) micro-batches; GPipe: m.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple


class Op(NamedTuple):
    """One unit of work of a schedule: kind 'F' | 'B' | 'W', the (virtual) stage, the micro-batch."""
    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:           # torch.distributed.pipelining's action notation: stage, kind, micro-batch
        return f"{self.stage}{self.kind}{self.mb}"

    __repr__ = __str__


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or repeated op, an op on the wrong rank, or a deadlock."""


# ============================================================================================ generators
def gpipe(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """GPipe: every rank runs all M forwards, then all M backwards (Huang et al. 2019, Fig. 2c)."""
    S, M = num_stages, num_microbatches
    return [[Op("F", r, mb) for mb in range(M)] + [Op("B", r, mb) for mb in range(M)] for r in range(S)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """1F1B (PipeDream-Flush): rank r runs S−1−r warm-up forwards, then alternates one forward and one backward,
    then drains the backwards. Micro-batch mb's backward starts as soon as its forward reached the last stage, so
    rank r never holds more than S−r micro-batches (SC'21 §2.2.1)."""
    S, M = num_stages, num_microbatches
    out = []
    for r in range(S):
        warmup = min(S - 1 - r, M)
        ops = [Op("F", r, mb) for mb in range(warmup)]
        for i in range(M - warmup):                 # steady state: F of a new micro-batch, B of the oldest
            ops += [Op("F", r, warmup + i), Op("B", r, i)]
        ops += [Op("B", r, mb) for mb in range(M - warmup, M)]
        out.append(ops)
    return out


def _rounds(S: int, M: int) -> int:
    """Micro-batches per round of an interleaved schedule: M in rounds of (about) S, as torch.distributed.pipelining
    relaxes Megatron's 'M a multiple of S'; M must split into equal rounds."""
    rounds = max(1, M // S)
    if M % rounds:
        ok = [m for m in range(1, 4 * S + 1) if m % max(1, m // S) == 0]
        raise ScheduleError(f"interleaved 1F1B runs micro-batches in equal rounds of about S={S}: M={M} does not "
                            f"split into {rounds} equal rounds; use M in {ok[:12]}… (a multiple of S is best)")
    return M // rounds


def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int = 2) -> list[list[Op]]:
    """Interleaved 1F1B: rank r holds v = `chunks` model chunks (stages r, r+S, …). Forwards go depth-first in rounds
    of S micro-batches — chunk 0 for a round, then chunk 1 for the same round, … — after a warm-up of
    (v−1)·S + 2(S−1−r) forwards; then one forward and one backward alternate, backwards walking the chunks in reverse.
    Each op is 1/v of a stage's work, so the fill and drain shrink by v (SC'21 §2.2.2, Fig. 4)."""
    S, M, v = num_stages, num_microbatches, chunks
    per_round = _rounds(S, M)
    total = M * v                                   # forwards (and backwards) on each rank
    out = []
    for r in range(S):
        warmup = min((v - 1) * per_round + 2 * (S - 1 - r), total)
        f_next, b_next = [0] * v, [0] * v           # next micro-batch per chunk

        def fwd(k, f_next=f_next, r=r):             # the k-th forward of this rank
            c = (k // per_round) % v
            f_next[c] += 1
            return Op("F", c * S + r, f_next[c] - 1)

        def bwd(k, b_next=b_next, r=r):             # the k-th backward: chunks in reverse order
            c = v - 1 - (k // per_round) % v
            b_next[c] += 1
            return Op("B", c * S + r, b_next[c] - 1)

        ops = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [fwd(warmup + k), bwd(k)]
        ops += [bwd(k) for k in range(total - warmup, total)]
        out.append(ops)
    return out


def zb_h1(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """ZB-H1 (Qi et al. 2024, §2.1 and Fig. 3): 1F1B's order of F and B — B now only the input gradient, which is
    all the previous stage waits for — and the weight gradients W deferred: rank r runs the W of its k-th backward
    only after its (k+r)-th backward, so the W's of later ranks fill the time they would otherwise idle in the drain.
    The number of forwards in flight is 1F1B's; a micro-batch's W inputs stay alive until its W."""
    S, M = num_stages, num_microbatches
    out = []
    for r in range(S):
        warmup = min(S - 1 - r, M)
        ops = [Op("F", r, mb) for mb in range(warmup)]
        w_next = 0
        for k in range(M):                          # k-th backward; steady state while forwards remain
            if warmup + k < M:
                ops.append(Op("F", r, warmup + k))
            ops.append(Op("B", r, k))
            if k >= r:                              # W lags its B by r backwards on rank r
                ops.append(Op("W", r, w_next))
                w_next += 1
        ops += [Op("W", r, mb) for mb in range(w_next, M)]
        out.append(ops)
    return out


GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb_h1": zb_h1}


# ============================================================================================ the schedule object
@dataclass(frozen=True)
class Schedule:
    """Per-rank op lists plus the shape of the pipeline: S ranks, M micro-batches, v chunks (stages) per rank."""
    name: str
    num_stages: int
    num_microbatches: int
    chunks: int
    ops: tuple

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.chunks

    @property
    def split_backward(self) -> bool:
        """True when backward is split into B (input gradient) and W (weight gradient)."""
        return any(op.kind == "W" for ops in self.ops for op in ops)

    def rank_of(self, stage: int) -> int:
        return stage % self.num_stages

    def stages_of(self, rank: int) -> list[int]:
        return [c * self.num_stages + rank for c in range(self.chunks)]

    def table(self) -> str:
        """One line per rank, ops in order (torch's notation)."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, ops)) for r, ops in enumerate(self.ops))


def make_schedule(kind, num_stages: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """Build and validate a schedule: `kind` is a name of GENERATORS or a generator fn(S, M) -> per-rank op lists."""
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    if callable(kind):
        name, fn = getattr(kind, "__name__", "custom"), kind
    else:
        if kind not in GENERATORS:
            raise ScheduleError(f"unknown schedule {kind!r}; use one of {sorted(GENERATORS)} or pass a generator")
        name, fn = kind, GENERATORS[kind]
    if chunks > 1 and fn is not interleaved_1f1b:
        raise ScheduleError(f"chunks={chunks} (model chunks per rank) needs the 'interleaved' schedule, not {name!r}; "
                            f"use schedule='interleaved', or chunks=1")
    ops = fn(num_stages, num_microbatches, chunks) if fn is interleaved_1f1b else fn(num_stages, num_microbatches)
    sched = Schedule(name, num_stages, num_microbatches, chunks, tuple(tuple(Op(*o) for o in r) for r in ops))
    validate(sched)
    return sched


# ============================================================================================ validate + simulate
COSTS = {"F": 1, "B": 2, "W": 1}    # per device stage; B is the whole backward, W its weight part


def _deps(op: Op, last: int, split: bool) -> list[Op]:
    """The ops (on any rank) that must finish before `op` can start."""
    if op.kind == "F":
        return [Op("F", op.stage - 1, op.mb)] if op.stage > 0 else []
    if op.kind == "B":
        after = Op("F", op.stage, op.mb)
        return [after] + ([Op("B", op.stage + 1, op.mb)] if op.stage < last else [])
    return [Op("B", op.stage, op.mb)]                                       # W needs its B


def _check_complete(s: Schedule) -> None:
    """Every (stage, micro-batch) has exactly one F and one B (and one W iff the schedule splits backward), each
    on the rank that holds the stage."""
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    seen: dict = {}
    for r, ops in enumerate(s.ops):
        if not isinstance(ops, tuple) or not all(isinstance(o, Op) for o in ops):
            raise ScheduleError(f"rank {r}: a schedule is a list of Op(kind, stage, mb) per rank")
        for op in ops:
            if op.kind not in kinds:
                raise ScheduleError(f"rank {r}: {op} has kind {op.kind!r}; ops are {kinds}"
                                    + ("" if op.kind != "W" else " (W only together with B/W split)"))
            if not (0 <= op.stage < s.num_virtual_stages and 0 <= op.mb < s.num_microbatches):
                raise ScheduleError(f"rank {r}: {op} is outside stages 0..{s.num_virtual_stages - 1} or "
                                    f"micro-batches 0..{s.num_microbatches - 1}")
            if s.rank_of(op.stage) != r:
                raise ScheduleError(f"rank {r} runs {op}, but stage {op.stage} lives on rank {s.rank_of(op.stage)}")
            if op in seen:
                raise ScheduleError(f"{op} appears twice (rank {seen[op]} and rank {r}); each op runs exactly once")
            seen[op] = r
    for k in kinds:
        for stage in range(s.num_virtual_stages):
            for mb in range(s.num_microbatches):
                if Op(k, stage, mb) not in seen:
                    raise ScheduleError(f"{Op(k, stage, mb)} is missing: every micro-batch needs its {k} on every "
                                        f"stage (rank {s.rank_of(stage)})")


def simulate(s: Schedule, costs=None, comm: float = 0, stage_weights=None) -> list[list[tuple[Op, float, float]]]:
    """Time a schedule: each rank runs its ops in order, an op starting when the rank is free and its inputs have
    arrived (`comm` time units after the op that produced them on another rank). Costs are per device stage
    (`COSTS` by default, or e.g. measured means {"F": …, "B": …, "W": …}); an op on one of v chunks costs 1/v of it,
    and in a B/W-split schedule B costs B − W. `stage_weights` (one per virtual stage, default all 1) scales each
    stage's ops: unequal stages, e.g. layers per stage ÷ the mean. Integer costs are timed in exact fractions, so
    a bubble computed from them equals its closed form exactly. Returns per rank [(op, start, end)]; raises
    ScheduleError naming the ops every rank is stuck on if the schedule deadlocks."""
    costs = {k: Fraction(c) if isinstance(c, (int, Fraction)) else float(c)
             for k, c in dict(COSTS, **(costs or {})).items()}
    split, last = s.split_backward, s.num_virtual_stages - 1
    weights = [1] * s.num_virtual_stages if stage_weights is None else list(stage_weights)
    if len(weights) != s.num_virtual_stages:
        raise ScheduleError(f"stage_weights has {len(weights)} entries for {s.num_virtual_stages} virtual stages")

    def cost(op: Op) -> float:
        c = costs["B"] - costs["W"] if (op.kind == "B" and split) else costs[op.kind]
        return c * weights[op.stage] / s.chunks

    done: dict[Op, float] = {}
    pos = [0] * s.num_stages
    free = [Fraction(0)] * s.num_stages
    out: list[list] = [[] for _ in range(s.num_stages)]
    remaining = sum(len(o) for o in s.ops)
    while remaining:
        progressed = False
        for r in range(s.num_stages):
            while pos[r] < len(s.ops[r]):
                op = s.ops[r][pos[r]]
                deps = _deps(op, last, split)
                if not all(d in done for d in deps):
                    break
                ready = max([free[r]] + [done[d] + (comm if s.rank_of(d.stage) != r else 0) for d in deps])
                end = ready + cost(op)
                out[r].append((op, ready, end))
                done[op] = free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: s.ops[r][pos[r]] for r in range(s.num_stages) if pos[r] < len(s.ops[r])}
            waits = "; ".join(f"rank {r} waits at {op} for {[str(d) for d in _deps(op, last, split) if d not in done]}"
                              for r, op in stuck.items())
            raise ScheduleError(f"deadlock: no rank can proceed — {waits}")
    return out


def validate(s: Schedule) -> Schedule:
    """Prove that `s` runs: complete (each op once, on its stage's rank) and deadlock-free when every rank blocks on
    its inputs and sends without waiting. Raises ScheduleError with the first problem; returns `s`."""
    if len(s.ops) != s.num_stages:
        raise ScheduleError(f"the schedule has op lists for {len(s.ops)} ranks, expected num_stages={s.num_stages}")
    _check_complete(s)
    simulate(s)
    return s


# ============================================================================================ reading a schedule
def bubble_fraction(timeline) -> list[float]:
    """Per rank: idle time / total time, with total = from 0 to the end of the last op on any rank."""
    end = max(t1 for ops in timeline for _, _, t1 in ops)
    return [1 - sum(t1 - t0 for _, t0, t1 in ops) / end for ops in timeline]


def bubble_formula(name: str, S: int, M: int, v: int = 1) -> Fraction:
    """The closed form of docs/formulas.md §3 for a schedule, as a fraction of the total time (costs F=1, B=2, W=1;
    interleaved and ZB-H1 for M ≥ S — with fewer micro-batches than stages the pipeline never fills)."""
    if name in ("gpipe", "1f1b"):
        return Fraction(S - 1, M + S - 1)
    if name == "interleaved":
        return Fraction(S - 1, v * M + S - 1)
    if name == "zb_h1":
        return Fraction(S - 1, 3 * M + S - 1)
    raise ValueError(f"no closed form for schedule {name!r}")


def in_flight(s: Schedule, until: str = "B") -> list[int]:
    """Per rank, the most micro-batches (× chunks) whose F has run and whose `until` ('B' or 'W') has not: how many
    micro-batches' activations (until='B') or W inputs (until='W') a rank holds at its peak."""
    out = []
    for ops in s.ops:
        held = peak = 0
        for op in ops:
            held += 1 if op.kind == "F" else -1 if op.kind == until else 0
            peak = max(peak, held)
        out.append(peak)
    return out


def peak_bytes(s: Schedule, stage_bytes: dict, backward_bytes: dict | None = None) -> list[int]:
    """Per rank, the peak of bytes held when F(stage) adds stage_bytes[stage] and its B releases them (a schedule
    without B/W split): the activation peak the memory accountant must measure.

    `backward_bytes[stage]` (default: stage_bytes) is what one micro-batch needs at once while its B runs, in place
    of what it held: more than it held when the backward rebuilds what the forward dropped (recomputation,
    notebook 08), so during B(stage) the rank holds held − stage_bytes[stage] + backward_bytes[stage]."""
    if s.split_backward:
        raise ValueError("peak_bytes counts whole-backward schedules; a B/W split keeps part of a micro-batch until W")
    work = stage_bytes if backward_bytes is None else backward_bytes
    out = []
    for ops in s.ops:
        held = peak = 0
        for op in ops:
            if op.kind == "F":
                held += stage_bytes[op.stage]
            else:
                peak = max(peak, held - stage_bytes[op.stage] + work[op.stage])
                held -= stage_bytes[op.stage]
            peak = max(peak, held)
        out.append(peak)
    return out


__all__ = ["Op", "Schedule", "ScheduleError", "GENERATORS", "COSTS", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zb_h1", "make_schedule", "validate", "simulate", "bubble_fraction", "bubble_formula", "in_flight",
           "peak_bytes"]
