"""Saving a checkpoint: snapshot the training state (a consistent copy, cheap, on the training thread), persist it
(every rank writes its pair of files into a staging directory; rank 0 writes meta.json and the manifest last once
an all-reduce says every rank succeeded) and publish it with one rename. The layout is described in
`course_lib.resilience.checkpoint`."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from ...core.files import atomic_write, fsync_dir
from ...memory import alloc_category, now, placed
from ..state import CHECKPOINT, TrainingState, data_position, rng_state, training_state
from .fileformat import FORMAT, MANIFEST, META, CheckpointError, _sha256, list_checkpoints, step_name


# ============================================================================================ snapshot and persist
@dataclass
class Snapshot:
    """A host copy of one rank's training state at `step`: what `persist` writes (CheckFreq's snapshot())."""
    step: int
    rank: int
    world_size: int
    tensors: dict = field(repr=False)        # file key -> host tensor
    index: dict = field(repr=False)          # file key -> {"key", "shape", "start", "dtype"}
    rng: dict = field(repr=False)            # numpy and Python generator state (JSON)
    meta: dict = field(repr=False)           # what meta.json says besides the tensor table
    seconds: float = 0.0                     # time the copy took (the training stall of an asynchronous save)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the snapshot (pieces and generator states)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def snapshot(state: TrainingState, step: int, *, data: dict | None = None, into: Snapshot | None = None,
             copy: bool = True) -> Snapshot:
    """Copy every piece `state` holds (and the generators) into host memory; `into`: reuse its buffers.
    copy=False keeps views of the live tensors instead (whatever they hold when they are written)."""
    t0 = now()
    tensors, index = {}, {}
    pieces = state.pieces if state.writes else []
    rng_tensors, rng = rng_state()
    reuse = into is not None and set(into.tensors) == {f"{p.key}@{p.start}" for p in pieces} | set(rng_tensors)
    with torch.no_grad(), alloc_category(CHECKPOINT), placed("host"):
        for name, t in [(f"{p.key}@{p.start}", p.tensor) for p in pieces] + list(rng_tensors.items()):
            tensors[name] = t if not copy else into.tensors[name].copy_(t) if reuse else t.clone()
    for p in pieces:
        index[f"{p.key}@{p.start}"] = {"key": p.key, "shape": list(p.shape), "start": p.start,
                                       "dtype": str(p.tensor.dtype).removeprefix("torch.")}
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params" and _jsonable(v)}
              for g in state.optimizer.param_groups] if state.optimizer is not None else []
    meta = {"format": FORMAT, "step": int(step), "world_size": state.world_size, "kind": state.kind,
            "config": state.config, "data": data or {"step": int(step)}, "param_groups": groups}
    return Snapshot(int(step), state.rank, state.world_size, tensors, index, rng, meta, now() - t0)


def _jsonable(v) -> bool:
    return isinstance(v, (bool, int, float, str, type(None))) or \
        (isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float)) for x in v))


def agree_run_id(comm=None) -> str:
    """A fresh id every rank agrees on (rank 0 draws it): names this run's staging directories, so a staging
    directory an earlier, crashed attempt left behind is never mistaken for this one's."""
    run_id = uuid.uuid4().hex[:16]
    if comm is not None and comm.world_size > 1:
        buf = torch.frombuffer(bytearray(run_id.encode()), dtype=torch.uint8).clone()
        run_id = bytes(comm.broadcast(buf, 0, tag="ckpt").tolist()).decode()
    return run_id


def persist(snap: Snapshot, root, *, comm=None, run_id: str | None = None, keep: int = 3) -> Path:
    """Write `snap` as checkpoint `step_<step>` in `root` (CheckFreq's persist()); every rank of `comm` calls it
    with its own snapshot of the same step. Returns the published directory, or raises CheckpointError and leaves
    every earlier checkpoint as it was."""
    root = Path(root)
    final = root / step_name(snap.step)
    staging = root / f".tmp-{final.name}-{run_id or agree_run_id(comm)}"
    error = None
    try:
        staging.mkdir(parents=True, exist_ok=True)
        blob = safetensors.torch.save(snap.tensors)        # header + raw bytes: no pickle to run on load
        atomic_write(staging / f"rank_{snap.rank:05d}.safetensors", blob)
        index = {"format": FORMAT, "rank": snap.rank, "step": snap.step, "tensors": snap.index, "rng": snap.rng,
                 "file": {"bytes": len(blob), "sha256": _sha256(blob)}}
        atomic_write(staging / f"rank_{snap.rank:05d}.json", json.dumps(index).encode())
    except OSError as e:
        error = e
    failed = _ranks_that_failed(comm, error is not None)      # every rank learns the same list
    if not failed:
        if snap.rank == 0:
            try:
                _publish(staging, final, snap, keep)
            except OSError as e:
                error = e
        published = error is None
        if comm is not None and comm.world_size > 1:         # rank 0 tells the others whether it published
            published = not comm.broadcast(torch.tensor([0 if published else 1]), 0, tag="ckpt").item()
        failed = [] if published else [0]
    if failed:
        if snap.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        previous = [p.name for s, p in list_checkpoints(root) if s != snap.step][:1]
        raise CheckpointError(f"checkpoint {final.name} was not written: rank(s) {failed} failed"
                              + (f" ({error.strerror or error})" if error is not None else "")
                              + f"; {'the previous checkpoint ' + previous[0] if previous else 'no earlier checkpoint'}"
                              f" is untouched") from error
    return final


def _ranks_that_failed(comm, failed_here: bool) -> list:
    if comm is None or comm.world_size == 1:
        return [0] if failed_here else []
    flags = torch.zeros(comm.world_size, dtype=torch.int64)
    flags[comm.rank] = int(failed_here)
    return torch.nonzero(comm.all_reduce(flags, "sum", tag="ckpt")).flatten().tolist()


def _publish(staging: Path, final: Path, snap: Snapshot, keep: int) -> None:
    """Rank 0, once every rank wrote its files: meta.json, then MANIFEST.json, then one rename."""
    files, tensors = {}, {}
    for path in sorted(staging.glob("rank_*.json")):
        blob = path.read_bytes()
        index = json.loads(blob)
        files[path.name] = {"bytes": len(blob), "sha256": _sha256(blob)}
        files[path.with_suffix(".safetensors").name] = index["file"]
        for entry in index["tensors"].values():
            tensors[entry["key"]] = {"shape": entry["shape"], "dtype": entry["dtype"]}
    meta = json.dumps({**snap.meta, "tensors": dict(sorted(tensors.items()))}, indent=1).encode()
    atomic_write(staging / META, meta)
    files[META] = {"bytes": len(meta), "sha256": _sha256(meta)}
    manifest = {"format": FORMAT, "step": snap.step, "files": files}
    atomic_write(staging / MANIFEST, json.dumps(manifest, indent=1).encode())    # last: it vouches for the rest
    aside = None
    if final.exists():                   # the same step saved again (a resumed job): swap, then drop the old one
        aside = final.with_name(f".old-{final.name}-{staging.name.rsplit('-', 1)[-1]}")
        os.rename(final, aside)
    os.rename(staging, final)            # publish: one atomic rename
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    for _, old in list_checkpoints(final.parent)[keep:]:    # only now that the new one is durable
        shutil.rmtree(old, ignore_errors=True)


def save(root, model, optimizer, *, step: int, batches=None, comm=None, keep: int = 3) -> Path:
    """Synchronous checkpoint of `model` and `optimizer` (plain, DDP, ZeRO-1/2 or FSDP) after `step` optimizer
    steps: snapshot, then persist, both on the caller's time. Every rank calls it."""
    state = training_state(model, optimizer)
    data = data_position(batches, step) if batches is not None else None
    return persist(snapshot(state, step, data=data), root, comm=comm or state.comm, keep=keep)
