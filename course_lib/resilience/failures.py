"""How often to checkpoint (Young, Daly), a seeded simulation of failures, and a fault to inject into a real run.

With δ the time a checkpoint costs the job, M the mean time between failures, R the restart cost and τ the
compute between checkpoints (docs/formulas.md §8.3, which also derives the exact expectation below):

    Young (CACM 1974)           τ = √(2δM)                                   (minimizes δ/τ + (τ/2 + R)/M)
    Daly (FGCS 2006)            τ = √(2δM)·[1 + ⅓·√(δ/2M) + ⅑·(δ/2M)] − δ    for δ < 2M, else τ = M

Both are approximations. For exponential failures (memoryless, no failures during a restart) the expected time
to get one segment of τ + δ done is exact [derived]: a segment of length s succeeds with probability e^(−s/M),
each failed try costs E[X | X < s] + R, and summing the geometric series gives

    E[T(s)] = (M + R)·(e^(s/M) − 1),       goodput(τ) = τ / E[T(τ + δ)]

`simulate_goodput` draws the failures and replays the job — seeded, so it is a measurement of the model that
must agree with the exact expectation within its standard error.
"""
from __future__ import annotations

import math
import os
import signal
import time

import numpy as np

from ..train import Probe


def young_interval(delta: float, mtbf: float) -> float:
    """Young's optimal compute time between checkpoints, √(2δM)."""
    _positive(delta=delta, mtbf=mtbf)
    return math.sqrt(2 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum: √(2δM)·[1 + ⅓(δ/2M)^½ + ⅑(δ/2M)] − δ for δ < 2M, else M."""
    _positive(delta=delta, mtbf=mtbf)
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def expected_time(work: float, tau: float, delta: float, mtbf: float, restart: float) -> float:
    """Exact expected wall time to finish `work` seconds of compute, checkpointing after every τ (the last
    segment is shorter), with exponential failures of mean `mtbf` and a restart cost `restart`."""
    _positive(work=work, tau=tau, mtbf=mtbf)
    full, rest = divmod(work, tau)

    def seg(s):
        return (mtbf + restart) * math.expm1((s + delta) / mtbf)

    return full * seg(tau) + (seg(rest) if rest > 1e-12 * tau else 0.0)


def expected_goodput(work: float, tau: float, delta: float, mtbf: float, restart: float) -> float:
    return work / expected_time(work, tau, delta, mtbf, restart)


def best_interval(work: float, delta: float, mtbf: float, restart: float) -> float:
    """τ that maximizes the exact expected goodput of `work` seconds of compute: work / n for the best whole n.

    A job of n segments costs least when they are equal (E[T(s)] is convex in s), so the optimum is τ = work / n
    for some whole n. Between work / n and work / (n − 1) the last segment is a short one that still pays a whole δ,
    so goodput(τ) is a saw with a tooth at every work / n, and a search over τ can stop on the wrong tooth. Over n,
    the expected time n · E[T(work/n + δ)] = work · E[T(τ + δ)] / τ is convex: its continuous minimum is the
    steady-state optimum τ∞ (the one Young and Daly approximate; always below M, where ∂/∂τ vanishes at
    τ/M = 1 − e^(−(τ+δ)/M); found by golden-section search on log τ), and the best whole n is the floor or the
    ceiling of work / τ∞.
    """
    _positive(work=work, mtbf=mtbf)

    def cost(tau):                  # steady state: time per second of work
        return expected_time(tau, tau, delta, mtbf, restart) / tau

    a, b = math.log(max(delta, 1e-9) * 1e-3), math.log(mtbf)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        c, d = b - g * (b - a), a + g * (b - a)
        if cost(math.exp(c)) < cost(math.exp(d)):
            b = d
        else:
            a = c
    n = work / math.exp((a + b) / 2)
    whole = {max(1, math.floor(n)), max(1, math.ceil(n))}
    return max((work / k for k in whole), key=lambda tau: expected_goodput(work, tau, delta, mtbf, restart))


def simulate_goodput(tau: float, delta: float, mtbf: float, restart: float, work: float, *, runs: int = 1000,
                     seed: int = 0) -> tuple[float, float]:
    """Replay `runs` jobs of `work` seconds of compute: a checkpoint (δ) after every τ, failures at exponential
    times (mean `mtbf`; none while restarting), each failure losing the work since the last checkpoint and costing
    `restart`. Returns (goodput, its standard error) with goodput = work / mean wall time: useful time over elapsed
    time summed over all runs (the mean of per-run ratios would be biased upwards, 1/x being convex), and the
    standard error from the delta method. Seeded, all runs at once (numpy); each pass of the loop first takes
    every whole segment that ends before the run's next failure at once, so it loops once per failure, not once
    per segment."""
    _positive(tau=tau, mtbf=mtbf, work=work)
    rng = np.random.default_rng(seed)
    clock = np.zeros(runs)                          # wall time of each run
    done = np.zeros(runs)                           # compute secured by a checkpoint
    fail_at = rng.exponential(mtbf, runs)           # the next failure of each run
    active = np.ones(runs, dtype=bool)
    while active.any():
        k = np.minimum(np.floor((fail_at - clock) / (tau + delta)), np.floor((work - done) / tau))
        k = np.where(active, np.maximum(k, 0), 0)   # whole segments done before the next failure
        clock += k * (tau + delta)
        done += k * tau
        active &= done < work * (1 - 1e-12)
        seg = np.minimum(tau, work - done) + delta  # the next segment: compute, then its checkpoint
        ok = active & (clock + seg <= fail_at)
        hit = active & ~ok
        clock[ok] += seg[ok]
        done[ok] += seg[ok] - delta
        clock[hit] = fail_at[hit] + restart         # the work since the last checkpoint is lost
        fail_at[hit] = clock[hit] + rng.exponential(mtbf, hit.sum())
        active &= done < work * (1 - 1e-12)
    mean, sem = clock.mean(), clock.std(ddof=1) / math.sqrt(runs)
    return float(work / mean), float(work * sem / mean ** 2)


def _positive(**values) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")


# ============================================================================================ a real fault
class KillAt(Probe):
    """Kill this process with `sig` (SIGKILL: no handler runs, no cleanup, like a machine dying) when rank `rank`
    enters phase `phase` of global step `step`. `note`: a file that receives the time of death (perf_counter)."""
    name = "kill"

    def __init__(self, rank: int, step: int, *, phase: str = "backward", start_step: int = 0,
                 sig: int = signal.SIGKILL, note=None):
        self.rank, self.step, self.phase = rank, step, phase
        self.start_step, self.sig, self.note = start_step, sig, note
        self.name = f"kill rank {rank}"

    def start(self, model, optimizer):
        import torch.distributed as dist
        self.me = dist.get_rank() if dist.is_initialized() else 0

    def enter(self, step, phase):
        if self.me == self.rank and self.start_step + step == self.step and phase == self.phase:
            if self.note is not None:
                with open(self.note, "w") as f:
                    f.write(repr(time.perf_counter()))
            os.kill(os.getpid(), self.sig)


__all__ = ["young_interval", "daly_interval", "expected_time", "expected_goodput", "best_interval",
           "simulate_goodput", "KillAt"]
