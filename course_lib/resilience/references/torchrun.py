"""torchrun's elastic restarts (torch.distributed.elastic), the reference for recovery by restart.

`torchrun --max-restarts K` watches its worker processes; when one dies it stops the others and starts the whole
group again, up to K times. It restarts processes, nothing more: the workers must find their place again themselves
— here by loading the newest good checkpoint (`workers.resumable_worker`), so a job that loses a rank loses the steps
since that checkpoint plus the restart.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
             -m course_lib.run course_lib.resilience.references:resumable_worker ROOT STEPS EVERY KILL_RANK KILL_STEP

One pitfall on a single machine: by default the restarted workers reuse the rendezvous store of the previous
attempt and can read the previous attempt's addresses (gloo's "connectFullMesh failed … Connection refused", or a
hang); `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives every attempt a store of its own. `torchrun_command` sets it.
`run_torchrun` runs that command line with torchrun's own `main`, forked (no interpreter to start: see there).
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .forked import start_forked, stop_forked


def _torchrun_flags(nproc: int, max_restarts: int) -> list:
    return ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--monitor-interval=0.1"]


def _torchrun_env(share_store: bool) -> dict:
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def torchrun_command(nproc: int, *args, max_restarts: int = 1, share_store: bool = False):
    """(argv, env) of the command line that runs `resumable_worker` under torchrun on this machine. share_store=False
    sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each restart gets a rendezvous store of its own."""
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun) if torchrun.exists() else "torchrun", *_torchrun_flags(nproc, max_restarts), "-m",
            "course_lib.run", "course_lib.resilience.references:resumable_worker", *map(str, args)]
    env = {**os.environ, **_torchrun_env(share_store)}
    if share_store:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return argv, env


def _torchrun_agent(argv: list, env: dict, share_store: bool) -> None:
    """torchrun's own `main` (torch.distributed.run), in a child forked from the caller."""
    import warnings

    from torch.distributed import run as torchrun
    warnings.simplefilter("ignore")
    os.environ.update(env)
    if share_store:
        os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    torchrun.main(argv)


def run_torchrun(nproc: int, root, steps: int, every: int, kill_rank: int = -1, kill_step: int = 0, *,
                 max_restarts: int = 1, share_store: bool = False, timeout: float = 240) -> dict:
    """Run `resumable_worker` under torchrun and report: exit code, seconds, the attempt that finished and the step
    it resumed from (rank 0's result line), and the whole output (torchrun's own log lines included).

    It is `torchrun_command`'s command line with two flags more, run by torchrun's own `main`
    (torch.distributed.run) in a child forked from this process: `--run-path` (each worker runs the script
    `torchrun_entry.py` — `python -m course_lib.run …` — in its interpreter) and `--start-method fork` (the workers
    are forked from torchrun's agent). The agent, its restart policy and the rendezvous are torchrun's; what is saved
    is five interpreters (the agent, two workers per attempt) importing torch and torch._dynamo, about 4 CPU-seconds
    each — most of the command line's 20 s on 2 cores. A restarted worker is still a new process: nothing of the
    killed attempt survives in it but the files on disk. One thing differs: with forked workers torchrun reports the
    first failed worker in rank order, so when rank 1 is killed it may report rank 0's error (its peer was gone)
    instead; kill rank 0 to see torchrun name the killed worker and its signal."""
    import torch._dynamo  # noqa: F401  — what torch.optim imports at the first step: once here, not in each worker
    import torch.distributed.run  # noqa: F401
    work = Path(tempfile.mkdtemp(prefix="course-torchrun-"))
    argv = [*_torchrun_flags(nproc, max_restarts), "--run-path", "--start-method=fork", f"--log-dir={work / 'logs'}",
            str(Path(__file__).with_name("torchrun_entry.py")), "course_lib.resilience.references:resumable_worker",
            *map(str, (root, steps, every, kill_rank, kill_step))]
    t0 = time.perf_counter()
    agent = start_forked(_torchrun_agent, argv, _torchrun_env(share_store), share_store,
                         stdout=str(work / "output.txt"))
    try:
        agent.join(timeout)
        code = agent.exitcode
    finally:
        stop_forked([agent])
    text = (work / "output.txt").read_text(errors="replace") if (work / "output.txt").exists() else ""
    if code is None:
        text = f"torchrun did not finish within {timeout:g} s\n" + text
    shutil.rmtree(work, ignore_errors=True)
    m = re.search(r"rank 0: \((\d+), (\d+), (\d+)\)", text)
    return {"returncode": code, "seconds": time.perf_counter() - t0, "output": text,
            "attempt": int(m.group(1)) if m else None, "resumed_from": int(m.group(2)) if m else None}
