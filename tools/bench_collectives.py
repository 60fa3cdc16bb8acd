#!/usr/bin/env python3
"""Benchmark (not a test): the course's from-scratch ring all-reduce against gloo's own, and the ledger's overhead.

    .venv/bin/python tools/bench_collectives.py                       16 MiB of float32 on 4 ranks
    .venv/bin/python tools/bench_collectives.py --world-size 2 --mib 64 --repeats 21

Prints, per variant, the median and best time (each run counts the slowest rank) and nccl-tests' busbw
(algbw × 2(p−1)/p), then two ratios with their goals:
  * own ring busbw / gloo busbw                        goal ≥ 0.5×  (Python steps over gloo send/recv)
  * Communicator.all_reduce / raw dist.all_reduce − 1   goal ≤ 5 %   (the ledger is a thin wrapper)
The variants run interleaved, repetition by repetition (alternating the order), and each ratio is the median of the
per-repetition ratios, so that slow drifts in the machine's load cancel. On a shared 2-core machine a single 16 MiB
all-reduce still varies by ±10 % from run to run, more than the wrapper costs; so the ledger's own work (one
`Event` recorded per call) is also timed on its own, in one process, which bounds the overhead robustly.
Nothing is asserted: timings on a shared machine move; read the ratios.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from course_lib.core.costmodel import bus_bandwidth  # noqa: E402
from course_lib.distributed import collectives  # noqa: E402
from course_lib.distributed.comm import Event, Ledger  # noqa: E402
from course_lib.distributed.launch import launch  # noqa: E402

VARIANTS = ("gloo dist.all_reduce", "ledger comm.all_reduce", "own all_reduce_ring")


def _worker(ctx, n: int, repeats: int):
    comm = ctx.comm
    run = {
        VARIANTS[0]: lambda t: dist.all_reduce(t),
        VARIANTS[1]: lambda t: comm.all_reduce(t, tag="bench"),
        VARIANTS[2]: lambda t: collectives.all_reduce_ring(comm, t, tag="bench"),
    }
    x = torch.randn(n)
    times = {v: [] for v in VARIANTS}
    for rep in range(repeats + 1):                 # rep 0 warms up connections and allocations
        for name in (VARIANTS if rep % 2 else VARIANTS[::-1]):   # alternate the order: no variant always first
            y = x.clone()
            dist.barrier()
            t0 = time.perf_counter()
            run[name](y)
            times[name].append(time.perf_counter() - t0)
    return {v: ts[1:] for v, ts in times.items()}


def _bookkeeping_seconds(calls: int = 20_000) -> float:
    """What Communicator.all_reduce adds to dist.all_reduce: a timestamp, the byte count and one Event recorded."""
    ledger = Ledger(0, 4)
    t0 = time.perf_counter()
    for _ in range(calls):
        ledger.record(Event("collective", "all_reduce", "bench", t0, time.perf_counter(), 1, 1, None, "world", True))
    return (time.perf_counter() - t0) / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--mib", type=float, default=16.0, help="all-reduce size in MiB of float32")
    ap.add_argument("--repeats", type=int, default=21)
    a = ap.parse_args(argv)
    p, n = a.world_size, int(a.mib * 2**20) // 4
    nbytes = 4 * n
    per_rank = launch(_worker, p, n, a.repeats, timeout=600)
    bookkeeping = _bookkeeping_seconds()
    slowest = {v: [max(r[v][i] for r in per_rank) for i in range(a.repeats)] for v in VARIANTS}
    med = {v: statistics.median(ts) for v, ts in slowest.items()}
    print(f"all-reduce of {nbytes / 2**20:.1f} MiB float32 on {p} ranks (gloo, this machine), {a.repeats} runs each")
    print(f"  {'variant':<24}{'median ms':>10}{'best ms':>10}{'busbw GB/s':>12}")
    for v in VARIANTS:
        busbw = bus_bandwidth("all_reduce", nbytes, med[v], p)[1]
        print(f"  {v:<24}{med[v] * 1e3:>10.2f}{min(slowest[v]) * 1e3:>10.2f}{busbw / 1e9:>12.3f}")
    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(slowest[a], slowest[b]))

    ring_ratio = paired(VARIANTS[0], VARIANTS[2])             # busbw ratio = inverse time ratio, same S and p
    overhead = paired(VARIANTS[1], VARIANTS[0]) - 1
    print(f"own ring busbw / gloo busbw         = {ring_ratio:.2f}×   (goal ≥ 0.5×)  "
          f"{'ok' if ring_ratio >= 0.5 else 'BELOW GOAL'}")
    print(f"ledger overhead (comm vs raw dist)  = {overhead * 100:+.1f} %  (goal ≤ 5 %)  "
          f"{'ok' if overhead <= 0.05 else 'ABOVE GOAL'}  (noise of a single run: ±10 % here)")
    print(f"ledger bookkeeping alone            = {bookkeeping * 1e6:.1f} µs per call = "
          f"{bookkeeping / med[VARIANTS[0]] * 100:.4f} % of one {nbytes / 2**20:.0f} MiB all-reduce")
    return 0


if __name__ == "__main__":
    sys.exit(main())
