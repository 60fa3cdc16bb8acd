"""Run a worker `fn(ctx, ...)` on real ranks from the command line — locally, or under torchrun on a cluster.

    python -m course_lib.run my_worker.py:worker --world-size 4            # local processes (gloo)
    torchrun --standalone --nproc-per-node 4 -m course_lib.run my_worker.py:worker   # one node, torchrun
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint HEAD_NODE:29500 -m course_lib.run my_worker.py:worker --backend nccl

The worker is the same function a notebook passes to `course_lib.distributed.launch.launch`; under torchrun each
process runs its own rank and rank 0 prints every rank's result.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from .distributed.launch import launch, under_torchrun


def load_worker(spec: str):
    """'path/to/file.py:fn' or 'package.module:fn' -> the function."""
    if ":" not in spec:
        raise ValueError(f"worker {spec!r} must be 'file.py:function' or 'module:function'")
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.exists():
            raise FileNotFoundError(f"worker file {path} not found")
        sys.path.insert(0, str(path.parent))
        module = importlib.import_module(path.stem)
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{target} has no function {name!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("worker", help="file.py:function or module:function; called as function(ctx, *args)")
    ap.add_argument("args", nargs="*", help="extra string arguments passed to the worker")
    ap.add_argument("--world-size", type=int, default=None, help="ranks to start locally (ignored under torchrun)")
    ap.add_argument("--backend", default=None, choices=["gloo", "nccl"])
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_intermixed_args(argv)
    fn = load_worker(a.worker)
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else (a.world_size or 2)
    results = launch(fn, world_size, *a.args, timeout=a.timeout, backend=a.backend)
    if not under_torchrun() or int(os.environ["RANK"]) == 0:
        for rank, r in enumerate(results):
            print(f"rank {rank}: {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
