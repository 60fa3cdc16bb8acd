"""The production references: torchrun's elastic restarts, and torchft's per-step fault tolerance.

`torchrun --max-restarts K` (torch.distributed.elastic) watches its worker processes; when one dies it stops the
others and starts the whole group again, up to K times. It restarts processes, nothing more: the workers must
find their place again themselves — here by loading the newest good checkpoint (`checkpoint.load`), so a job
that loses a rank loses the steps since that checkpoint plus the restart.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
             -m course_lib.run course_lib.resilience.elastic:resumable_worker ROOT STEPS EVERY KILL_RANK KILL_STEP

One pitfall on a single machine: by default the restarted workers reuse the rendezvous store of the previous
attempt and can read the previous attempt's addresses (gloo's "connectFullMesh failed … Connection refused", or a
hang); `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives every attempt a store of its own. `torchrun_command` sets it.

torchft (pytorch/torchft) goes further: replica groups (DDP replicas) coordinate through a lighthouse every step;
when one group dies, the others go on with a smaller quorum and the restarted group rejoins by copying the live
state from a healthy one — no step of the survivors is lost, but the steps it misses are taken with fewer
samples, so the run is no longer bit for bit the uninterrupted one.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ..model import GPT, get_config
from ..parallel.compose import apply_zero, data_parallel_batches
from ..train import TrainConfig, optimizer_kwargs, run
from .async_ckpt import CheckpointProbe
from .checkpoint import list_checkpoints, load
from .failures import KillAt

CONFIG = get_config("nano")
TRAIN = TrainConfig(batch_size=12, eps=1e-6)   # splits over 1, 2, 3, 4 and 6 ranks


def resumable_worker(ctx, root, steps, every, kill_rank="-1", kill_step="0", stage="1"):
    """Train the nano GPT with ZeRO-`stage` (string arguments: it runs from the command line), checkpointing
    every `every` steps into `root` and resuming from the newest good checkpoint there; in torchrun's first attempt
    rank `kill_rank` SIGKILLs itself in step `kill_step`. Returns (attempt, first step, last step)."""
    steps, every, kill_rank, kill_step = int(steps), int(every), int(kill_rank), int(kill_step)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    model, opt = apply_zero(GPT(CONFIG, seed=TRAIN.seed), ctx.comm, int(stage), **optimizer_kwargs(TRAIN))
    batches = data_parallel_batches(ctx.comm, CONFIG.seq_len, TRAIN.batch_size, seed=TRAIN.data_seed)
    start = 0
    if list_checkpoints(root):
        resumed = load(root, model, opt, batches=batches)
        start, batches = resumed.step, resumed.batches
    probes = [CheckpointProbe(root, every, batches=batches, start_step=start)]
    if attempt == 0 and kill_rank >= 0:
        probes.append(KillAt(kill_rank, kill_step, start_step=start))
    run(model, opt, batches, steps=steps - start, probes=probes)
    return attempt, start, steps


def torchrun_command(nproc: int, *args, max_restarts: int = 1, share_store: bool = False):
    """(argv, env) to run `resumable_worker` under torchrun on this machine. share_store=False sets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each restart gets a rendezvous store of its own."""
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", "-m", "course_lib.run",
            "course_lib.resilience.elastic:resumable_worker", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return argv, env


def run_torchrun(nproc: int, root, steps: int, every: int, kill_rank: int = -1, kill_step: int = 0, *,
                 max_restarts: int = 1, share_store: bool = False, timeout: float = 240) -> dict:
    """Run `resumable_worker` under torchrun and report: exit code, seconds, the attempt that finished and the step
    it resumed from (rank 0's result line), and the whole output (torchrun's own log lines included)."""
    argv, env = torchrun_command(nproc, root, steps, every, kill_rank, kill_step, max_restarts=max_restarts,
                                 share_store=share_store)
    t0 = time.perf_counter()
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                             start_new_session=True)
        code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        code, text = None, f"torchrun did not finish within {timeout:g} s\n{e.stdout or ''}{e.stderr or ''}"
    m = re.search(r"rank 0: \((\d+), (\d+), (\d+)\)", text)
    return {"returncode": code, "seconds": time.perf_counter() - t0, "output": text,
            "attempt": int(m.group(1)) if m else None, "resumed_from": int(m.group(2)) if m else None}


__all__ = ["resumable_worker", "torchrun_command", "run_torchrun", "CONFIG", "TRAIN"]
