"""In-memory checkpoints on peers (Gemini), and a driver that brings a job back after a rank is killed.

Wang et al., "GEMINI: Fast Failure Recovery in Distributed Training with In-Memory Checkpoints", SOSP'23. Writing
to remote storage is slow, so Gemini checkpoints into CPU memory instead: every machine keeps its own state and a
replica of another machine's, so that losing one machine loses no checkpoint. Here, with ranks for machines:

    rank r's host memory    [ own state of r at step s | replica of rank r−1's state at step s ]
                            for the last two snapshot steps (one can be half written when a rank dies)
    every `every` steps     each rank copies its state into host memory and sends the same bytes to rank r+1
                            (a ring shift: each rank sends its S_r bytes once; no disk)

    rank 2 is SIGKILLed ──► the launcher reports "rank 2 exited with code -9" (SIGKILL) ──► the driver treats
    machine 2's memory as lost and relaunches all ranks ──► ranks 0, 1, 3 restore from their own copy; the new
    rank 2 receives its state from rank 3's replica ──► training continues from the snapshot step

At most `every` steps of work are lost, and since the restored state is bit for bit the snapshot, the run ends
with exactly the parameters of an uninterrupted one. The host memory is a shared-memory file system (/dev/shm:
RAM, not disk) that outlives the training processes, like the memory of Gemini's per-machine agent.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from ..core.files import atomic_write
from ..distributed.launch import LaunchError, LaunchTimeout, launch
from ..memory import now
from ..train import Probe
from .checkpoint import _fill, snapshot
from .state import ResumedBatches, set_rng_state, training_state


class HostMemory:
    """Every rank's host memory for in-memory checkpoints: `root/rank_<r>/<own|replica>_<step>.bin`, on a RAM file
    system, surviving the processes that write it. `lose(r)` is machine r failing: its memory is gone."""

    def __init__(self, root=None):
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None      # RAM; elsewhere a temporary directory
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="course-gemini-", dir=base))

    def _dir(self, rank: int) -> Path:
        return self.root / f"rank_{rank}"

    def write(self, rank: int, kind: str, step: int, blob: bytes) -> None:
        d = self._dir(rank)
        d.mkdir(parents=True, exist_ok=True)
        # a half-written copy is never visible; no fsync: the copies live in RAM, which a crash loses anyway
        atomic_write(d / f"{kind}_{step:08d}.bin", blob, durable=False)

    def read(self, rank: int, kind: str, step: int) -> bytes:
        return (self._dir(rank) / f"{kind}_{step:08d}.bin").read_bytes()

    def steps(self, rank: int, kind: str) -> list:
        """Snapshot steps rank `rank` holds of `kind` ('own' or 'replica'), newest first."""
        found = [int(m.group(1)) for p in self._dir(rank).glob(f"{kind}_*.bin")
                 if (m := re.fullmatch(rf"{kind}_(\d+)\.bin", p.name))] if self._dir(rank).is_dir() else []
        return sorted(found, reverse=True)

    def prune(self, rank: int, kind: str, keep: int = 2) -> None:
        for step in self.steps(rank, kind)[keep:]:
            with contextlib.suppress(FileNotFoundError):
                (self._dir(rank) / f"{kind}_{step:08d}.bin").unlink()

    def nbytes(self, rank: int) -> int:
        return sum(p.stat().st_size for p in self._dir(rank).glob("*.bin")) if self._dir(rank).is_dir() else 0

    def lose(self, rank: int) -> None:
        """Machine `rank` failed: everything in its memory is gone."""
        shutil.rmtree(self._dir(rank), ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ============================================================================================ pack and exchange
def pack(state, step: int) -> bytes:
    """One rank's state at `step` as safetensors bytes, its index and generators in the header's metadata."""
    snap = snapshot(state, step)
    meta = {"step": str(step), "index": json.dumps(snap.index), "rng": json.dumps(snap.rng)}
    return safetensors.torch.save(snap.tensors, metadata=meta)


def unpack(blob: bytes) -> tuple[int, dict, dict, dict]:
    """(step, index, rng, tensors) of `pack`'s bytes."""
    n = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8:8 + n])["__metadata__"]
    return int(meta["step"]), json.loads(meta["index"]), json.loads(meta["rng"]), safetensors.torch.load(blob)


def load_packed(blob: bytes, model, optimizer, what: str):
    """Fill `model` and `optimizer` (creating the optimizer state a fresh one lacks) from `pack`'s bytes; returns
    (their TrainingState, the tensors, the generators' metadata) — setting the generators is the caller's choice."""
    _, index, rng, tensors = unpack(blob)
    template = {e["key"]: (e["shape"], getattr(torch, e["dtype"])) for e in index.values()}
    state = training_state(model, optimizer, template=template)
    sources = {}
    for fkey, e in index.items():
        sources.setdefault(e["key"], []).append((e["start"], tensors[fkey]))
    with torch.no_grad():
        for piece in state.pieces:
            _fill(piece, sources.get(piece.key, []), Path(what))
    return state, tensors, rng


def _as_tensor(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def ring_shift(comm, blob: bytes, *, tag: str = "gemini") -> bytes:
    """Send `blob` to rank r+1 and receive rank r−1's: the replica traffic (each rank sends its bytes once)."""
    n, r = comm.world_size, comm.rank
    size = comm.sendrecv(torch.tensor([len(blob)]), (r + 1) % n, torch.zeros(1, dtype=torch.int64), (r - 1) % n,
                         tag=tag)
    out = torch.empty(int(size.item()), dtype=torch.uint8)
    comm.sendrecv(_as_tensor(blob), (r + 1) % n, out, (r - 1) % n, tag=tag)
    return out.numpy().tobytes()


# ============================================================================================ snapshot and restore
class PeerCheckpointProbe(Probe):
    """Every `every` steps: this rank's state into its host memory and, through a ring shift, into rank r+1's as a
    replica. Keeps the last two snapshot steps of each."""
    name = "peer"

    def __init__(self, memory: HostMemory, every: int, *, start_step: int = 0):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        self.memory, self.every, self.start_step = memory, every, start_step
        self.events: list[dict] = []

    def start(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.comm = training_state(model, optimizer).comm
        if self.comm is None or self.comm.world_size < 2:
            raise ValueError("in-memory checkpoints on peers need at least 2 ranks (a replica lives on another)")

    def after_step(self, step):
        s = self.start_step + step + 1
        if s % self.every == 0:
            self.events.append(protect(self.memory, training_state(self.model, self.optimizer), s))

    def finish(self):
        return self.events


def protect(memory: HostMemory, state, step: int) -> dict:
    """Snapshot `state` into this rank's host memory and send it to rank r+1 as its replica (every rank calls it)."""
    t0 = now()
    blob = pack(state, step)
    memory.write(state.rank, "own", step, blob)
    replica = ring_shift(state.comm, blob)
    memory.write(state.rank, "replica", step, replica)
    for kind in ("own", "replica"):
        memory.prune(state.rank, kind)
    return {"step": step, "bytes": len(blob), "t": (t0, now())}


def restore_from_peers(memory: HostMemory, model, optimizer, *, batches=None):
    """Restore every rank to the newest snapshot step that survives: its own copy, or (for a rank whose memory
    was lost) the replica on rank r+1, sent over the network. Returns a `checkpoint.Resumed`-like record, or None
    when no step survives (both copies of some rank's state are gone): then fall back to disk."""
    from .checkpoint import Resumed
    state = training_state(model, optimizer)
    comm, r, n = state.comm, state.rank, state.world_size
    mine = torch.full((4,), -1, dtype=torch.int64)
    for i, s in enumerate(memory.steps(r, "own")[:2]):
        mine[i] = s
    for i, s in enumerate(memory.steps(r, "replica")[:2]):
        mine[2 + i] = s
    table = comm.all_gather(torch.empty(4 * n, dtype=torch.int64), mine, tag="gemini").view(n, 4).tolist()
    own = [set(row[:2]) - {-1} for row in table]
    replica_of = [set(table[(q + 1) % n][2:]) - {-1} for q in range(n)]   # rank q's state, held by q+1
    alive = [s for s in sorted(set().union(*own, *replica_of), reverse=True)
             if all(s in own[q] or s in replica_of[q] for q in range(n))]
    if not alive:
        return None
    step = alive[0]
    handles, sizes = [], {}
    for q in (q for q in range(n) if step not in own[q]):      # the lost ranks: their successor sends the replica
        if r == (q + 1) % n:
            blob = memory.read(r, "replica", step)
            handles += [comm.isend(torch.tensor([len(blob)]), q, tag="gemini_restore")]
            handles += [comm.isend(_as_tensor(blob), q, tag="gemini_restore")]
        if r == q:
            sizes[q] = torch.zeros(1, dtype=torch.int64)
            comm.recv(sizes[q], (q + 1) % n, tag="gemini_restore")
            received = comm.recv(torch.empty(int(sizes[q].item()), dtype=torch.uint8), (q + 1) % n,
                                 tag="gemini_restore")
    for h in handles:
        h.wait()
    source = "own memory" if step in own[r] else f"rank {(r + 1) % n}'s replica"
    blob = memory.read(r, "own", step) if step in own[r] else received.numpy().tobytes()
    state, tensors, rng = load_packed(blob, model, optimizer, f"in-memory step {step}")
    set_rng_state(tensors, rng)
    state.finish_load()
    protect(memory, state, step)          # the lost machine's memory held a replica too: rebuild both copies
    return Resumed(step, None, [], ResumedBatches(batches, step) if batches is not None else None,
                   {"source": source, "bytes": len(blob)})


def resilient_worker(ctx, attempt: int, memory: HostMemory, cfg, tc, *, stage: int = 3, steps: int, every: int,
                     kill=(), note=None) -> dict:
    """Train `cfg` with ZeRO-`stage` (compose.apply_zero) for `steps` steps with a peer snapshot every `every`;
    in attempt > 0 restore from peers first. kill: [(rank, step), ...] — in attempt 0 each of those ranks is
    SIGKILLed in that step's backward (`note`: a file that receives the time of death). Returns this rank's final
    state pieces, the step it started from, where its state came from, and timings (perf_counter)."""
    from .. import optim
    from ..core.model import GPT
    from ..distributed.mesh import data_parallel_batches
    from ..parallel.zero import apply_zero
    from ..train import optimizer_kwargs, run
    from .checkpoint import CheckpointError
    from .failures import KillAt
    up = now()
    model = apply_zero(GPT(cfg, seed=tc.seed), ctx.comm, stage)
    opt = optim.build(model, **optimizer_kwargs(tc))
    batches = data_parallel_batches(ctx.comm, cfg.seq_len, tc.batch_size, seed=tc.data_seed)
    start, source, nbytes = 0, None, 0
    if attempt > 0:
        resumed = restore_from_peers(memory, model, opt, batches=batches)
        if resumed is None:
            raise CheckpointError("no snapshot step survived in host memory (a rank and the peer holding its "
                                  "replica were both lost): restart from the last checkpoint on disk")
        start, batches, source, nbytes = resumed.step, resumed.batches, resumed.meta["source"], resumed.meta["bytes"]
    restored = now()
    probes = [PeerCheckpointProbe(memory, every, start_step=start)]
    if attempt == 0:
        probes += [KillAt(rank, step, start_step=start, note=note) for rank, step in kill]
    r = run(model, opt, batches, steps=steps - start, probes=probes)
    state = {(p.key, p.start): p.tensor.clone() for p in training_state(model, opt).pieces}
    return {"state": state, "start": start, "source": source, "restored_bytes": nbytes, "up": up, "restored": restored,
            "windows": r.windows, "snapshots": r["peer"], "sent": ctx.comm.ledger.by("tag")}


# ============================================================================================ the driver
@dataclass
class Failure:
    """A rank that died: in which attempt, which rank, how (e.g. 'killed by SIGKILL'), when it was detected."""
    attempt: int
    rank: int
    how: str
    detected: float          # perf_counter when the launcher reported it
    message: str = field(default="", repr=False)


@dataclass
class Recovery:
    """What `run_with_recovery` returns: the last attempt's results, the failures survived, each launch's span."""
    results: list
    failures: list
    launches: list           # (t0, t1) of every launch, perf_counter

    @property
    def attempts(self) -> int:
        return len(self.launches)


_DIED = re.compile(r"rank (\d+) exited with code (-?\d+) without reporting a result")


def dead_ranks(error: LaunchError) -> dict:
    """{rank: exit code} of the ranks that died without a word (killed, or os._exit) in a LaunchError."""
    found = {}
    for text in error.failures.values():
        if m := _DIED.search(text):
            found[int(m.group(1))] = int(m.group(2))
    return found


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


def run_with_recovery(worker, world_size: int, *args, max_restarts: int = 1, timeout: float = 120,
                      on_failure=None, **kwargs) -> Recovery:
    """launch(worker, world_size, attempt, *args) until it succeeds. When ranks die (killed by a signal, or
    exited without a result) the job is relaunched — every rank, attempt + 1 — after `on_failure({rank: code})`
    (e.g. `memory.lose`). A worker that raises is a bug, not a failure: that LaunchError is raised at once, as is
    a timeout (a hang) and a failure after `max_restarts` restarts."""
    failures, launches = [], []
    for attempt in range(max_restarts + 1):
        t0 = now()
        try:
            results = launch(worker, world_size, attempt, *args, timeout=timeout, **kwargs)
        except LaunchTimeout:
            raise
        except LaunchError as e:
            launches.append((t0, now()))
            dead = dead_ranks(e)
            if not dead:
                raise
            failures += [Failure(attempt, r, describe_exit(c), now(), str(e).splitlines()[0]) for r, c in dead.items()]
            if attempt == max_restarts:
                raise LaunchError(f"gave up after {max_restarts} restart(s): " + "; ".join(
                    f"rank {f.rank} {f.how} in attempt {f.attempt}" for f in failures), e.failures) from e
            if on_failure is not None:
                on_failure(dead)
            continue
        launches.append((t0, now()))
        return Recovery(results, failures, launches)
    raise AssertionError("unreachable")


__all__ = ["HostMemory", "PeerCheckpointProbe", "protect", "restore_from_peers", "resilient_worker", "pack", "unpack",
           "load_packed", "ring_shift", "run_with_recovery", "Recovery", "Failure", "dead_ranks", "describe_exit"]
