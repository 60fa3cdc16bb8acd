"""Checkpoints that survive crashes, full disks and flipped bits, and that say so when one does not.

One directory per checkpoint, named for the optimizer steps it completed:

    step_00000012/
      rank_00000.safetensors   this rank's pieces of the training state (`state.py`) and its random generators;
                               safetensors: a JSON header and raw bytes, nothing is unpickled on load
      rank_00000.json          its index: each tensor's global name, global shape and start; RNG scalars; the
                               file's bytes and sha256
      rank_00001.…             one pair per rank (DDP: only rank 0's holds model and optimizer tensors)
      meta.json                step, world size, layout, model config, data position, optimizer hyper-parameters,
                               shape and dtype of every global tensor
      MANIFEST.json            bytes and sha256 of every file above, written LAST

Writing is atomic twice over. A file: write a temporary name, fsync it, rename it over the final name, fsync the
directory (a rename is durable only once its directory is). A checkpoint: every file goes into a staging
directory `.tmp-step_00000012-<run id>`, the manifest last, and one rename publishes it as `step_00000012`. A crash
or a full disk at any moment leaves the complete new checkpoint or none, and never touches the previous one;
loaders only look at `step_*`.

Loading verifies before it trusts: the manifest must exist, every file must have the size and sha256 it lists,
every tensor the shape its index and meta.json give. The newest checkpoint that passes is loaded and every one
skipped is reported with what was wrong. An intact checkpoint of another model fails, naming the parameter.
With several ranks, each writes its own pair of files; rank 0 writes meta.json and the manifest once every rank
has written (one all-reduce says whether all succeeded), so saving on N ranks and loading on M (resharding) both
work: see `state.py`. The cost of a save is δ in Young's interval √(2δM) (docs/formulas.md §8.3).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from ..files import atomic_write, disk_full, fsync_dir  # noqa: F401  (re-exported: notebook 10 and lab 10 use them here)
from ..memory import alloc_category, now, placed
from .state import CHECKPOINT, Piece, ResumedBatches, TrainingState, data_position, rng_state, set_rng_state, \
    training_state

FORMAT = "course-checkpoint/1"
MANIFEST, META = "MANIFEST.json", "meta.json"
_STEP = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or loaded; the message says why and what survived."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint on disk failed verification; `.reason` says how."""

    def __init__(self, path, reason: str):
        super().__init__(f"checkpoint {Path(path).name} is unusable: {reason}")
        self.path, self.reason = Path(path), reason


class NoCheckpoint(CheckpointError):
    """No usable checkpoint in the directory."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint that does not fit this model, optimizer or data (another config)."""


class CheckpointWarning(UserWarning):
    """Loading skipped a corrupt checkpoint and fell back to an older one."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """Published checkpoints in `root`, newest first (staging directories and strays are not checkpoints)."""
    root = Path(root)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()] \
        if root.is_dir() else []
    return sorted(found, reverse=True)


def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


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


# ============================================================================================ verify and load
def _header(blob: bytes, name: str, path) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON): each tensor's shape."""
    try:
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + n])
    except ValueError:
        raise CorruptCheckpoint(path, f"{name} has no readable safetensors header") from None
    header.pop("__metadata__", None)
    return header


def verify(path) -> dict:
    """Check checkpoint directory `path` against its manifest; return {file name: bytes}, or raise
    CorruptCheckpoint saying what is wrong."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpoint(path, f"no {MANIFEST}: the save never finished, or the manifest was deleted, so "
                                      f"nothing in it can be trusted") from None
    except ValueError:
        raise CorruptCheckpoint(path, f"{MANIFEST} is not valid JSON") from None
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(path, f"format {manifest.get('format')!r} is not {FORMAT!r}")
    data = {}
    for name, want in manifest["files"].items():
        try:
            blob = (path / name).read_bytes()
        except FileNotFoundError:
            raise CorruptCheckpoint(path, f"{name} is listed in the manifest but missing") from None
        if len(blob) != want["bytes"]:
            how = "truncated" if len(blob) < want["bytes"] else "grew"
            raise CorruptCheckpoint(path, f"{name} is {len(blob):,} bytes, the manifest says {want['bytes']:,} "
                                          f"({how})")
        if _sha256(blob) != want["sha256"]:
            raise CorruptCheckpoint(path, f"{name}'s sha256 differs from the manifest's: its bytes changed after "
                                          f"they were written (a flipped bit, a partial overwrite)")
        data[name] = blob
    if META not in data:
        raise CorruptCheckpoint(path, f"the manifest does not list {META}")
    tensors = json.loads(data[META])["tensors"]
    for name in [n for n in data if n.startswith("rank_") and n.endswith(".json")]:
        file = name.removesuffix(".json") + ".safetensors"
        header = _header(data.get(file, b""), file, path)
        for fkey, entry in json.loads(data[name])["tensors"].items():
            shape, want = header.get(fkey, {}).get("shape"), tensors.get(entry["key"], {}).get("shape")
            total = 1
            for d in want or ():
                total *= d
            if shape is None or want is None or want != entry["shape"] or len(shape) != 1 \
                    or entry["start"] + shape[0] > total:
                raise CorruptCheckpoint(path, f"wrong shapes: {file} holds {fkey} as {shape}, but its index and "
                                              f"{META} describe {entry['key']} as {entry['shape']} and {want}")
    return data


def find_latest(root, *, warn: bool = True) -> tuple[Path, dict, list]:
    """The newest checkpoint in `root` that verifies: (path, {file: bytes}, skipped), skipped = [(name, reason)]
    for every newer one that did not. Warns (CheckpointWarning) when it had to fall back."""
    skipped = []
    for _, path in list_checkpoints(root):
        try:
            data = verify(path)
        except CorruptCheckpoint as e:
            skipped.append((path.name, e.reason))
            continue
        if skipped and warn:
            warnings.warn("; ".join(f"checkpoint {n} is unusable: {r}" for n, r in skipped)
                          + f"; falling back to {path.name}", CheckpointWarning, stacklevel=2)
        return path, data, skipped
    why = "".join(f"\n  {n}: {r}" for n, r in skipped)
    raise NoCheckpoint(f"no usable checkpoint in {root}" + (f"; every one failed verification:{why}" if why else
                                                             " (none was ever published there)"))


@dataclass
class Resumed:
    """What `load` restored: the step to continue from, where from, what was skipped, the data from there on."""
    step: int
    path: Path
    skipped: list
    batches: object = None
    meta: dict = field(default_factory=dict, repr=False)


def load(root, model, optimizer, *, batches=None, comm=None, warn: bool = True) -> Resumed:
    """Load the newest good checkpoint in `root` into `model` and `optimizer` (built as for a fresh run, on any
    number of ranks: pieces are re-cut to this layout). Every rank calls it; rank 0 picks the checkpoint."""
    state = training_state(model, optimizer)
    comm = comm or state.comm
    path, data, skipped, chosen = None, None, [], -1
    if state.rank == 0:
        with contextlib.suppress(NoCheckpoint):
            path, data, skipped = find_latest(root, warn=warn)
            chosen = int(json.loads(data[META])["step"])
    if comm is not None and comm.world_size > 1:
        chosen = int(comm.broadcast(torch.tensor([chosen]), 0, tag="ckpt").item())
    if chosen < 0:
        find_latest(root, warn=False)   # raises NoCheckpoint with the reasons
    if data is None:
        path = Path(root) / step_name(chosen)
        data = verify(path)
    meta = json.loads(data[META])
    template = {k: (v["shape"], getattr(torch, v["dtype"])) for k, v in meta["tensors"].items()}
    state = training_state(model, optimizer, template=template)
    _check_fits(meta, state, path)
    sources = _sources(data)
    mine = f"rank_{state.rank:05d}"
    if mine + ".json" in data:          # resharded onto more ranks: the new ones keep their own generators
        set_rng_state(safetensors.torch.load(data[mine + ".safetensors"]), json.loads(data[mine + ".json"])["rng"])
    with torch.no_grad():
        for piece in state.pieces:
            _fill(piece, sources.get(piece.key, []), path)
    state.finish_load()
    if state.optimizer is not None:
        for group, saved in zip(state.optimizer.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    step = int(meta["step"])
    if batches is not None:
        _check_data(meta["data"], data_position(batches, step), path)
        batches = ResumedBatches(batches, step)
    return Resumed(step, path, skipped, batches, meta)


def _sources(data: dict) -> dict:
    """{global key: [(start, saved 1-D tensor), ...]} over every rank file of a verified checkpoint."""
    sources = {}
    for name in sorted(n for n in data if n.endswith(".safetensors")):
        index = json.loads(data[name.removesuffix(".safetensors") + ".json"])
        tensors = safetensors.torch.load(data[name])
        for fkey, entry in index["tensors"].items():
            sources.setdefault(entry["key"], []).append((entry["start"], tensors[fkey]))
    return sources


def consolidate(path) -> dict:
    """Every global tensor of checkpoint `path` (verified first), assembled in full in this process: the
    one-process view of a sharded checkpoint, for comparing runs on different numbers of ranks."""
    path = Path(path)
    data = verify(path)
    sources, out = _sources(data), {}
    for key, v in json.loads(data[META])["tensors"].items():
        out[key] = torch.zeros(v["shape"], dtype=getattr(torch, v["dtype"]))
        _fill(Piece(key, tuple(v["shape"]), 0, out[key].view(-1)), sources.get(key, []), path)
    return out


def _what(key: str) -> str:
    kind, _, rest = key.partition("/")
    if kind == "model":
        return f"parameter '{rest}'"
    k, _, name = rest.partition("/")
    return f"optimizer state '{k}' of '{name}'"


def _check_fits(meta: dict, state: TrainingState, path) -> None:
    have = {k: tuple(v["shape"]) for k, v in meta["tensors"].items()}
    mine = {**state.shapes, **{p.key: tuple(p.shape) for p in state.pieces}}
    diff = ""
    if meta.get("config") and state.config:
        fields = [f"{k} = {meta['config'][k]} there, {state.config.get(k)} here" for k in meta["config"]
                  if meta["config"][k] != state.config.get(k)]
        diff = f" (the checkpoint's model config differs: {'; '.join(fields)})" if fields else ""
    missing = [k for k in mine if k not in have]
    if missing:
        raise CheckpointMismatch(f"{path.name} was saved from another model: this one has {_what(missing[0])}, the "
                                 f"checkpoint does not{_more(missing)}{diff}")
    wrong = [k for k in mine if have[k] != mine[k]]      # in the model's order: the first one named is the first
    if wrong:
        k = wrong[0]
        raise CheckpointMismatch(f"{path.name} was saved from another model: {_what(k)} has shape {list(have[k])} "
                                 f"in the checkpoint and {list(mine[k])} in this model{_more(wrong)}{diff}")
    extra = sorted(k for k in have if k.startswith("model/") and k not in mine)
    if extra:
        raise CheckpointMismatch(f"{path.name} was saved from another model: it has {_what(extra[0])}, which this "
                                 f"model lacks{_more(extra)}{diff}")


def _more(keys: list) -> str:
    return f" (and {len(keys) - 1} more tensor(s) like it)" if len(keys) > 1 else ""


def _check_data(saved: dict, here: dict, path) -> None:
    for k in ("kind", "seed", "seq_len", "global_batch_size", "split"):
        if k in saved and k in here and saved[k] != here[k]:
            raise CheckpointMismatch(f"{path.name} was saved with other data: {k} = {saved[k]!r} there, {here[k]!r} "
                                     f"here; resuming would not continue the same data stream")


def _fill(piece, sources: list, path) -> None:
    """Copy into `piece` every overlapping range of the saved pieces of the same global tensor."""
    a, b = piece.start, piece.start + piece.numel
    covered = torch.zeros(piece.numel, dtype=torch.bool)
    for start, saved in sources:
        lo, hi = max(a, start), min(b, start + saved.numel())
        if lo < hi:
            piece.tensor[lo - a:hi - a].copy_(saved[lo - start:hi - start])
            covered[lo - a:hi - a] = True
    if not bool(covered.all()):
        raise CheckpointError(f"{path.name} does not hold all of {_what(piece.key)}: elements "
                              f"[{a}, {b}) are needed, {int(covered.sum())} of them were saved")


__all__ = ["save", "load", "snapshot", "persist", "verify", "find_latest", "list_checkpoints", "atomic_write",
           "fsync_dir", "disk_full", "consolidate", "agree_run_id", "step_name", "Snapshot", "Resumed", "CheckpointError",
           "CorruptCheckpoint", "CheckpointMismatch", "NoCheckpoint", "CheckpointWarning", "FORMAT"]
