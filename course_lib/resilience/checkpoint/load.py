"""Loading a checkpoint: verify before trusting (manifest, sizes, sha256, every tensor's shape), find the newest one
that passes (reporting each one skipped and why), check it fits this model and data, and fill this rank's pieces
from whichever ranks' files hold them — so a checkpoint saved on N ranks loads on M. The layout is described in
`course_lib.resilience.checkpoint`."""
from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from ..state import Piece, ResumedBatches, TrainingState, data_position, set_rng_state, training_state
from .fileformat import (
    FORMAT,
    MANIFEST,
    META,
    CheckpointError,
    CheckpointMismatch,
    CheckpointWarning,
    CorruptCheckpoint,
    NoCheckpoint,
    _sha256,
    list_checkpoints,
    step_name,
)


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
    data = verify_files(path)
    verify_shapes(path, data)
    return data


def verify_files(path: Path) -> dict:
    """The manifest exists and is this format; every file it lists is there with its size and sha256. Returns
    {file name: bytes}."""
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
    return data


def verify_shapes(path: Path, data: dict) -> None:
    """Every tensor piece in a rank's safetensors file has the shape its index and `meta.json` say."""
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
