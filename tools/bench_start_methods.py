#!/usr/bin/env python3
"""How long `launch` takes under each start method, and a whole notebook under each (course_lib.distributed.start).

    python tools/bench_start_methods.py                          # 4-rank trivial launch: fork, forkserver, spawn
    python tools/bench_start_methods.py --notebook notebooks/03_ddp.ipynb   # + Run All of it under each method

A launch is timed from the call to its return, `--repeats` times after one untimed launch (which starts the fork
server, or warms the caches); the median is printed, with the first launch beside it. The notebook runs under
papermill in a fresh kernel with COURSE_START_METHOD set, so every launch in it uses that method. Timings, not
asserted anywhere: they move with the machine's load.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("fork", "forkserver", "spawn")

_ONE_METHOD = """
import statistics, sys, time
sys.path.insert(0, {root!r})
from course_lib.distributed.launch import launch
def trivial(ctx):
    return ctx.rank
times = []
for _ in range({repeats} + 1):
    t0 = time.perf_counter()
    assert launch(trivial, {world_size}, start_method={method!r}, timeout=300) == list(range({world_size}))
    times.append(time.perf_counter() - t0)
print(times[0], statistics.median(times[1:]))
"""


def launch_times(method: str, world_size: int, repeats: int) -> tuple[float, float]:
    """(first launch, median of the next `repeats`) in seconds, in a fresh interpreter (a fork server starts once)."""
    code = _ONE_METHOD.format(root=str(ROOT), repeats=repeats, world_size=world_size, method=method)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1200)
    first, median = map(float, out.stdout.split()[-2:])
    return first, median


def notebook_time(path: Path, method: str) -> float:
    import papermill as pm
    os.environ["COURSE_START_METHOD"] = method
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        pm.execute_notebook(str(path), str(Path(tmp) / path.name), kernel_name="python3", progress_bar=False,
                            execution_timeout=600, cwd=str(path.parent))
        return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--notebook", action="append", default=[], help="a notebook to Run All under each method")
    args = ap.parse_args(argv)
    print(f"{args.world_size}-rank trivial launch, seconds (first launch; median of the next {args.repeats}):")
    for m in args.methods:
        first, median = launch_times(m, args.world_size, args.repeats)
        print(f"  {m:<11} first {first:6.2f}   median {median:6.3f}", flush=True)
    for nb in args.notebook:
        for m in args.methods:
            print(f"{nb} Run All under {m}: {notebook_time(Path(nb).resolve(), m):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
