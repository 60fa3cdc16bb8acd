"""The production references — torchrun's elastic restarts, torch.distributed.checkpoint, torchft — and the
workers that run under them.

`torchrun --max-restarts K` (torch.distributed.elastic) watches its worker processes; when one dies it stops the
others and starts the whole group again, up to K times. It restarts processes, nothing more: the workers must
find their place again themselves — here by loading the newest good checkpoint (`checkpoint.load`), so a job
that loses a rank loses the steps since that checkpoint plus the restart.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
             -m course_lib.run course_lib.resilience.references:resumable_worker ROOT STEPS EVERY KILL_RANK KILL_STEP

One pitfall on a single machine: by default the restarted workers reuse the rendezvous store of the previous
attempt and can read the previous attempt's addresses (gloo's "connectFullMesh failed … Connection refused", or a
hang); `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives every attempt a store of its own. `torchrun_command` sets it.
`run_torchrun` runs that command line with torchrun's own `main`, forked (no interpreter to start: see there).

torch.distributed.checkpoint (DCP) is PyTorch's sharded checkpoint: each rank writes its shards (`__r_0.distcp`)
and a `.metadata` file maps every chunk to its global offsets, so a checkpoint of 4 ranks loads on 2 (`dcp_worker`,
with FSDP2's `fully_shard`). It checks shapes, but not the bytes: a flipped bit in a shard loads as a wrong value.

torchft (pytorch/torchft) goes further: replica groups (DDP replicas) coordinate through a lighthouse every step;
when one group dies, the others go on with a smaller quorum and the restarted group rejoins by copying the live
state from a healthy one — no step of the survivors is lost, but the steps it misses are taken with fewer
samples, so the run is no longer bit for bit the uninterrupted one.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ..core.data import ShardedBatches
from ..core.model import GPT, get_config
from ..distributed.mesh import data_parallel_batches
from ..parallel.zero import apply_zero
from .. import optim
from ..train import TrainConfig, optimizer_kwargs, run
from .async_ckpt import CheckpointProbe
from .checkpoint import list_checkpoints, load, save
from .failures import KillAt

CONFIG = get_config("nano")
TRAIN = TrainConfig(batch_size=12, eps=1e-6)   # splits over 1, 2, 3, 4 and 6 ranks


def _build(ctx, stage, seed):
    """The nano GPT with ZeRO-`stage` (0 = DDP, 3 = FSDP) and this dp rank's batches; `seed` for both."""
    tc = replace(TRAIN, seed=int(seed), data_seed=int(seed))
    model = apply_zero(GPT(CONFIG, seed=tc.seed), ctx.comm, int(stage))
    opt = optim.build(model, **optimizer_kwargs(tc))
    return model, opt, data_parallel_batches(ctx.comm, CONFIG.seq_len, tc.batch_size, seed=tc.data_seed)


def resumable_worker(ctx, root, steps, every, kill_rank="-1", kill_step="0", stage="1", seed="0", save_at="0"):
    """Train the nano GPT with ZeRO-`stage` (string arguments: it runs from the command line), checkpointing
    every `every` steps into `root` and resuming from the newest good checkpoint there; in torchrun's first attempt
    rank `kill_rank` SIGKILLs itself in step `kill_step`. save_at > 0: also save after that step — the checkpoint
    a run that stopped there leaves, since saving changes nothing in the run. Returns (attempt, first step, last
    step)."""
    steps, every, kill_rank, kill_step, save_at = int(steps), int(every), int(kill_rank), int(kill_step), int(save_at)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    model, opt, batches = _build(ctx, stage, seed)
    start = 0
    if list_checkpoints(root):
        resumed = load(root, model, opt, batches=batches)
        start, batches = resumed.step, resumed.batches
    probes = [CheckpointProbe(root, every, batches=batches, start_step=start, at=[save_at] if save_at else [])]
    if attempt == 0 and kill_rank >= 0:
        probes.append(KillAt(kill_rank, kill_step, start_step=start))
    run(model, opt, batches, steps=steps - start, probes=probes)
    return attempt, start, steps


def reload_worker(ctx, src, dst, stage="1", seed="0"):
    """Load the newest good checkpoint in `src` on this job's ranks — any number of them: the pieces are re-cut
    to this layout — and save it again in `dst` (then `dst` holds the same values, cut for this many ranks).
    Returns this rank's parameters when it holds the whole model (ZeRO-1/2, DDP), else None."""
    model, opt, batches = _build(ctx, stage, seed)
    resumed = load(src, model, opt, batches=batches)
    save(dst, model, opt, step=resumed.step, batches=batches)
    if int(stage) < 3:
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def dcp_worker(ctx, path, steps: int = 0, seed: int = 0):
    """The PyTorch reference: the nano GPT under FSDP2 (`fully_shard` per block, then the root). steps > 0: train
    that many steps and save with torch.distributed.checkpoint into `path`; steps = 0: load `path` into a fresh
    model on this many ranks. Returns the full state dict (gathered), keyed like `checkpoint.consolidate`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = GPT(CONFIG, seed=seed)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # fused AdamW: one DTensor op per step instead of ~60 distinct ones, each paying DTensor's first-call sharding
    # propagation in every rank (about a CPU-second per rank); saving and loading build the same optimizer
    opt = torch.optim.AdamW(model.parameters(), fused=True, **optimizer_kwargs(TRAIN))
    if steps:
        run(model, opt, data_parallel_batches(ctx.comm, CONFIG.seq_len, TRAIN.batch_size, seed=seed), steps=steps)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full_model, full_optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.detach().clone() for k, v in full_model.items()}
    out.update({f"optim/{s}/{k}": v.clone() for k, state in full_optim["state"].items() for s, v in state.items()})
    return out


# ============================================================================================ forked children
def _forked(target, *args, stdout=None, stderr=None):
    """Start `target(*args)` in a child forked from this process, which has torch and this package imported: a new
    process without a new interpreter. A new interpreter imports torch again, and torch._dynamo at the first
    optimizer step — about 4 CPU-seconds, more than a whole torchrun or torchft run of the nano GPT takes here. The
    child sits in its own process group, dies with this process, runs one thread (the rule for forked ranks) and
    writes stdout and stderr into the files `stdout` and `stderr` (default: stdout nowhere, stderr with it)."""
    import multiprocessing as mp
    proc = mp.get_context("fork").Process(target=_child, args=(target, args, stdout, stderr), name=target.__name__)
    proc.start()
    return proc


def _child(target, args, stdout, stderr):
    from ..distributed.launch import _die_with_parent
    os.setpgid(0, 0)
    _die_with_parent()
    import torch
    torch.set_num_threads(1)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    out = os.open(stdout, flags, 0o644) if stdout else os.open(os.devnull, os.O_WRONLY)
    err = os.open(stderr, flags, 0o644) if stderr else out
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", buffering=1, closefd=False)
    import logging
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):     # torch's log handlers hold the caller's stderr (a
            if type(handler) is logging.StreamHandler:      # notebook's, pytest's): they write to this one now
                handler.stream = sys.stderr
    target(*args)


def _stop(procs) -> None:
    """Kill every child still running (its whole process group: what it started too) and reap it. One that has
    exited was reaped already: its process group id may belong to another process by now."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.join(5)


# ============================================================================================ torchrun
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
    agent = _forked(_torchrun_agent, argv, _torchrun_env(share_store), share_store, stdout=str(work / "output.txt"))
    try:
        agent.join(timeout)
        code = agent.exitcode
    finally:
        _stop([agent])
    text = (work / "output.txt").read_text(errors="replace") if (work / "output.txt").exists() else ""
    if code is None:
        text = f"torchrun did not finish within {timeout:g} s\n" + text
    shutil.rmtree(work, ignore_errors=True)
    m = re.search(r"rank 0: \((\d+), (\d+), (\d+)\)", text)
    return {"returncode": code, "seconds": time.perf_counter() - t0, "output": text,
            "attempt": int(m.group(1)) if m else None, "resumed_from": int(m.group(2)) if m else None}


# ============================================================================================ torchft
def torchft_replica(replica: int, lighthouse: str, steps: int, kill_step: int, log: str, work: str,
                    standby: bool = False, step_seconds: float = 0.0, rejoin: bool = False) -> None:
    """One torchft replica group (one process here): the nano GPT and AdamW on its half of every global batch.
    Each step: `zero_grad` asks the lighthouse for a quorum (a group that comes back first heals: it copies the
    live state of a healthy group); the gradients are averaged over the quorum by the Manager; `step` commits only
    if every member's all-reduce succeeded. Appends one JSON line per step to `log`; SIGKILLs itself at
    `kill_step`. standby: a spare that has imported everything and waits for the file `work/go` before joining
    (a replacement machine that is already up). step_seconds: extra time per step, as a larger model would take.
    rejoin: a failure is expected — keep going past `steps` until both groups have trained 3 steps together
    again (so the survivor is still there to heal the replacement, however long the replacement takes).
    Runs in a child forked by `run_torchft`."""
    import json
    import logging
    import signal
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    while standby and not Path(work, "go").exists():
        time.sleep(0.01)
    model = GPT(CONFIG, seed=TRAIN.seed)
    opt = optim.build(model, **optimizer_kwargs(TRAIN))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)    # this group's own store
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1, use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"replica_{replica}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=30))
    ft_opt = Optimizer(manager, opt)
    data = ShardedBatches(CONFIG.seq_len, TRAIN.batch_size // 2, 2, replica, seed=TRAIN.data_seed)
    Path(work, f"ready_{replica}").touch()                  # both groups heartbeat before the first quorum
    while len(list(Path(work).glob("ready_*"))) < 2:
        time.sleep(0.01)
    together, alone = None, False                             # first step both trained again after a failure
    with open(log, "a") as out:
        while manager.current_step() < steps or (rejoin and (together is None or
                                                              manager.current_step() < together + 3)):
            t0 = time.perf_counter()
            ft_opt.zero_grad()                                    # quorum: join, maybe heal from a live peer
            step = manager.current_step()
            if step == kill_step:
                out.write(json.dumps({"replica": replica, "killed": step, "t": time.perf_counter()}) + "\n")
                out.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = data.get(step)
            loss = model(x, y)[1]
            loss.backward()
            time.sleep(step_seconds)
            for w in [manager.allreduce(p.grad) for p in model.parameters()]:   # average over the quorum
                w.wait()
            ft_opt.step()                                         # commits only if every all-reduce succeeded
            alone = alone or manager.num_participants() == 1
            if together is None and manager.num_participants() == 2 and (standby or alone):
                together = step                                   # the replacement is back
            out.write(json.dumps({"replica": replica, "step": step, "committed": manager.current_step() > step,
                                  "participants": manager.num_participants(), "t0": t0,
                                  "t1": time.perf_counter()}) + "\n")
            out.flush()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        out.write(json.dumps({"replica": replica, "done": True, "sha256": digest}) + "\n")
    manager.shutdown(wait=False)
    os._exit(0)


def _lighthouse(conn, min_replicas, join_timeout_ms, heartbeat_timeout_ms):
    """The torchft lighthouse, in a child of its own: this process never starts torchft's (Rust, multi-threaded)
    runtime, so every replica forked from it starts clean. Sends its address and serves until it is killed."""
    from torchft._torchft import LighthouseServer
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                  heartbeat_timeout_ms=heartbeat_timeout_ms)
    conn.send(lighthouse.address())
    while True:
        time.sleep(3600)


def run_torchft(steps: int = 20, kill_step: int = 5, *, down_steps: int = 3, step_seconds: float = 0.05,
                timeout: float = 180) -> dict:
    """Two torchft replica groups under a lighthouse; replica 1 SIGKILLs itself at `kill_step` (kill_step < 0:
    never). A standby process (already started) replaces it once replica 0 has committed `down_steps` more steps
    alone, and rejoins by healing from replica 0's live state. Every process is forked from this one (`_forked`).
    Returns every replica's per-step log: which steps committed, with how many participants, and when; and a sha256
    of each replica's final parameters. Exit codes: replica 0, replica 1, and (with a kill) the replacement."""
    import json
    import multiprocessing as mp

    import torch._dynamo  # noqa: F401  — imported once here (torch.optim's first step), not in every replica
    import torchft  # noqa: F401
    os.environ.setdefault("RUST_LOG", "error")                # torchft's Rust side logs every quorum otherwise
    work = Path(tempfile.mkdtemp(prefix="course-torchft-"))
    log = work / "log.jsonl"
    log.touch()
    here, there = mp.get_context("fork").Pipe()
    # heartbeat_timeout_ms: how long a silent replica still counts as alive. Until it expires the survivor cannot
    # form a quorum alone (a majority of the replicas the lighthouse believes alive must join), so it is the stall
    # after a death; 1 s is 10 missed heartbeats (one every 100 ms) — a live replica on a loaded machine keeps it.
    lighthouse = _forked(_lighthouse, there, 1, 500, 1000, stderr=str(work / "stderr_lighthouse.txt"))
    there.close()
    procs = [lighthouse]
    restarted_at = None
    try:
        if not here.poll(timeout):
            raise TimeoutError(f"the torchft lighthouse did not start within {timeout:g} s")
        address = here.recv()

        def start(replica, kill, standby=False):
            rejoin = kill_step >= 0 and (replica == 0 or standby)
            return _forked(torchft_replica, replica, address, steps, kill, str(log), str(work), standby,
                           step_seconds, rejoin, stderr=str(work / f"stderr_{replica}.txt"))
        t0 = time.perf_counter()
        procs += [start(0, -1), start(1, kill_step)] + ([start(1, -1, standby=True)] if kill_step >= 0 else [])
        replicas = procs[1:]
        if kill_step >= 0:
            replicas[1].join(timeout)
            deadline = time.perf_counter() + timeout
            while time.perf_counter() < deadline and not any(
                    e.get("replica") == 0 and e.get("committed") and e["step"] >= kill_step + down_steps - 1
                    for e in map(json.loads, log.read_text().splitlines())):
                time.sleep(0.02)                              # replica 0 goes on alone meanwhile
            restarted_at = time.perf_counter()
            (work / "go").touch()
        for p in replicas:
            p.join(max(0.0, t0 + timeout - time.perf_counter()))
        codes = [p.exitcode for p in replicas]
    finally:
        here.close()
        _stop(procs)                                          # the lighthouse, and any replica left
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    errors = {r: (work / f"stderr_{r}.txt").read_text()[-2000:] for r in (0, 1)}
    shutil.rmtree(work, ignore_errors=True)
    return {"codes": codes, "seconds": time.perf_counter() - t0, "log": lines, "stderr": errors,
            "restarted_at": restarted_at}


def torchft_summary(out: dict) -> dict:
    """What a `run_torchft` run lost: the attempts discarded, the steps committed by replica 0 alone (half the
    global batch each), the step at which the replacement joined (healed from live state), the stall from the
    kill to replica 0's next commit, and whether the replicas ended with the same parameters."""
    log = out["log"]
    kill = next((e for e in log if "killed" in e), None)
    steps = [e for e in log if "step" in e]
    zero = [e for e in steps if e["replica"] == 0]
    after = [e for e in zero if kill and e["committed"] and e["t1"] > kill["t"]]
    joined = [e["step"] for e in steps if e["replica"] == 1 and kill and e["t0"] > kill["t"]]
    done = {e["replica"]: e["sha256"] for e in log if e.get("done")}
    return {"killed_at_step": kill["killed"] if kill else None,
            "discarded": sum(not e["committed"] for e in zero),
            "alone": sum(e["committed"] and e["participants"] == 1 for e in zero),
            "joined_at_step": min(joined) if joined else None,
            "stall": after[0]["t1"] - kill["t"] if after else None,
            "steps": max(e["step"] for e in zero if e["committed"]) + 1,
            "same_parameters": len(set(done.values())) == 1 and len(done) == 2,
            "sha256": done.get(0)}


__all__ = ["resumable_worker", "reload_worker", "dcp_worker", "torchrun_command", "run_torchrun", "run_torchft",
           "torchft_replica", "torchft_summary", "CONFIG", "TRAIN"]

