"""torchft (pytorch/torchft), the reference for recovery without a restart of the survivors.

Replica groups (DDP replicas) coordinate through a lighthouse every step; when one group dies, the others go on with a
smaller quorum and the restarted group rejoins by copying the live state from a healthy one — no step of the
survivors is lost, but the steps it misses are taken with fewer samples, so the run is no longer bit for bit the
uninterrupted one.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from ... import optim
from ...core.data import ShardedBatches
from ...core.model import GPT
from ...train import optimizer_kwargs
from .forked import start_forked, stop_forked
from .workers import CONFIG, TRAIN


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
    alone, and rejoins by healing from replica 0's live state. Every process is forked from this one (`start_forked`).
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
    lighthouse = start_forked(_lighthouse, there, 1, 500, 1000, stderr=str(work / "stderr_lighthouse.txt"))
    there.close()
    procs = [lighthouse]
    restarted_at = None
    try:
        if not here.poll(timeout):
            raise TimeoutError(f"the torchft lighthouse did not start within {timeout:g} s")
        address = here.recv()

        def start(replica, kill, standby=False):
            rejoin = kill_step >= 0 and (replica == 0 or standby)
            return start_forked(torchft_replica, replica, address, steps, kill, str(log), str(work), standby,
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
        stop_forked(procs)                                    # the lighthouse, and any replica left
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
