"""What a rank must keep to resume training bit for bit, described as pieces of named global tensors.

A training job's state is the model's parameters (and persistent buffers), the optimizer's state, the random
number generators and the data position. Under data parallelism every rank holds all of it; under ZeRO-1/2 every
rank holds the parameters but only its shard of the optimizer state; under FSDP only its shards of both. One
description covers every case: each tensor is a *global* tensor with a name and a shape, and a rank holds *pieces*
of it, ranges [start, start + numel) of its elements in row-major (flattened) order:

    global tensor   model/blocks.0.mlp.fc_in.weight      shape (256, 64) = 16,384 elements
    FSDP, 4 ranks   rank r keeps rows [64r, 64r + 64)  →  piece [4096·r, 4096·r + 4096)
    ZeRO, 4 ranks   each bucket's 4 equal shards cut through tensors: a piece wherever rank r's shard meets it
    optimizer       optim/exp_avg/blocks.0.mlp.fc_in.weight: pieces exactly where the parameter's pieces are;
                    optim/step/<name> (a 0-d tensor) is a one-element piece every holder of the parameter has

A checkpoint stores pieces with their (name, shape, start); loading fills whatever pieces the loading ranks hold
from whatever pieces were saved, so 4 ranks can save and 2 load (resharding) — the idea of
torch.distributed.checkpoint's chunk metadata, written out for the course's three layouts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from ..memory import register_category

CHECKPOINT = register_category("checkpoint", "#64B5CD")   # host copies a checkpoint takes (snapshot buffers)


@dataclass
class Piece:
    """Elements [start, start + numel) of global tensor `key` (shape `shape`), held by this rank in `tensor` (a
    1-D view of the live storage: writing it writes the model or the optimizer)."""
    key: str
    shape: tuple
    start: int
    tensor: torch.Tensor = field(repr=False)

    @property
    def numel(self) -> int:
        return self.tensor.numel()


@dataclass
class TrainingState:
    """Every piece of training state this rank holds. kind: 'single' (one process), 'replicated' (DDP: every rank
    holds everything, rank 0 writes it), 'zero' (ZeRO-1/2 ShardedOptimizer) or 'fsdp' (ZeRO-3)."""
    kind: str
    rank: int
    world_size: int
    pieces: list
    shapes: dict = field(default_factory=dict, repr=False)  # every global parameter of the job: key -> shape
    config: dict | None = None                               # the model's config (GPTConfig.as_dict()), if it has one
    comm: object = field(default=None, repr=False)
    optimizer: object = field(default=None, repr=False)    # the torch optimizer whose param_groups are saved
    _finish: object = field(default=None, repr=False)

    @property
    def writes(self) -> bool:
        """Does this rank write its pieces? (With replicated state one copy is enough.)"""
        return self.kind != "replicated" or self.rank == 0

    @property
    def nbytes(self) -> int:
        return sum(p.numel * p.tensor.element_size() for p in self.pieces)

    def finish_load(self) -> None:
        """After the pieces were filled: ZeRO-1/2 all-gathers the parameter shards into every rank's full copy."""
        if self._finish is not None:
            self._finish()


# ============================================================================================ the three layouts
def _names(module) -> dict:
    return {id(p): n for n, p in module.named_parameters()}


def _param_map(model, optimizer):
    """(kind, comm, torch optimizer, module, maps): maps[i] lists, for the i-th tensor the torch optimizer steps,
    the (name, global shape, start in the global tensor, first, last) ranges it covers, in its own coordinates."""
    from ..parallel.fsdp import FSDP
    from ..parallel.zero import ShardedOptimizer
    if isinstance(model, FSDP):
        names, maps = _names(model.module), {}
        for unit in model.units:
            for g in unit.groups:
                for i, shard in enumerate(g.shards):
                    lo = g.bounds[i][0]
                    maps[id(shard)] = [(names[id(shard)], tuple(g.shapes[i]), lo * g.row_numel[i], 0, shard.numel())]
        return "fsdp", model.comm, optimizer, model.module, maps
    if isinstance(optimizer, ShardedOptimizer):
        inner = getattr(model, "module", model)
        names, maps, r = _names(inner), {}, optimizer.comm.rank
        for b in optimizer.buckets:
            s = b.layout.shard_numel
            ranges = []
            for p, o, n in zip(b.params, b.layout.offsets, b.layout.numels):
                lo, hi = max(o, r * s), min(o + n, (r + 1) * s)     # my shard of the bucket ∩ this parameter
                if lo < hi:
                    ranges.append((names[id(p)], tuple(p.shape), lo - o, lo - r * s, hi - r * s))
            maps[id(b.shard)] = ranges
        return "zero", optimizer.comm, optimizer.optimizer, inner, maps
    inner = getattr(model, "module", model)
    comm = getattr(model, "comm", None)
    kind = "replicated" if comm is not None and comm.world_size > 1 else "single"
    maps = {id(p): [(n, tuple(p.shape), 0, 0, p.numel())] for n, p in inner.named_parameters()}
    return kind, comm, optimizer, inner, maps


def training_state(model, optimizer, *, template: dict | None = None) -> TrainingState:
    """The pieces this rank holds of `model` (plain, a DDP wrapper or FSDP) and `optimizer` (a torch optimizer or a
    ZeRO ShardedOptimizer). `template` ({key: (shape, dtype)} of a checkpoint) creates optimizer state a fresh
    optimizer does not have yet, so that loading has somewhere to write it."""
    kind, comm, opt, inner, maps = _param_map(model, optimizer)
    rank, world_size = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    local = [t for group in opt.param_groups for t in group["params"]] if opt is not None else []   # what it steps
    if template is not None:
        _materialize(opt, local, maps, template)
    pieces = []
    if kind == "zero":                  # the parameters: my shard of every bucket (the rest is all-gathered)
        for b in optimizer.buckets:
            for name, shape, start, lo, hi in maps[id(b.shard)]:
                pieces.append(Piece(f"model/{name}", shape, start, b.shard.detach()[lo:hi]))
    else:
        for _, p in inner.named_parameters():   # FSDP: the module's parameters ARE this rank's shards
            for name, shape, start, lo, hi in maps[id(p)]:
                pieces.append(Piece(f"model/{name}", shape, start, p.detach().reshape(-1)[lo:hi]))
    persistent = set(inner.state_dict())
    for n, buf in inner.named_buffers():
        if n in persistent:
            pieces.append(Piece(f"model/{n}", tuple(buf.shape), 0, buf.detach().reshape(-1)))
    for t in local:                     # the optimizer's state, cut exactly like the tensor it belongs to
        for k, v in opt.state.get(t, {}).items():
            if not torch.is_tensor(v):
                raise TypeError(f"optimizer state {k!r} is a {type(v).__name__}; only tensor state is checkpointed")
            for name, shape, start, lo, hi in maps[id(t)]:
                if v.shape == t.shape:
                    pieces.append(Piece(f"optim/{k}/{name}", shape, start, v.detach().reshape(-1)[lo:hi]))
                elif v.dim() == 0:      # e.g. AdamW's step counter: one per tensor, every holder keeps a copy
                    pieces.append(Piece(f"optim/{k}/{name}", (), 0, v.detach().reshape(1)))
                else:
                    raise TypeError(f"optimizer state {k!r} of {name} has shape {tuple(v.shape)}: neither the "
                                    f"parameter's shape nor a scalar, so it cannot be cut like the parameter")
    pieces = [p for p in pieces if p.numel]
    shapes = {f"model/{name}": shape for ranges in maps.values() for name, shape, *_ in ranges}
    if kind == "zero":                  # my shard's ranges miss parameters other ranks own; every rank holds all
        shapes.update((f"model/{n}", tuple(p.shape)) for n, p in inner.named_parameters())
    shapes.update((p.key, p.shape) for p in pieces if p.key.startswith("model/"))
    config = getattr(inner, "config", None)
    config = config.as_dict() if hasattr(config, "as_dict") else None
    finish = (lambda: _all_gather_buckets(optimizer)) if kind == "zero" else None
    return TrainingState(kind, rank, world_size, pieces, shapes, config, comm, opt, finish)


def _all_gather_buckets(optimizer) -> None:
    """ZeRO-1/2 after loading: each rank filled its shard of every bucket; the all-gather fills the rest."""
    from ..distributed.collectives import all_gather_ring
    for b in optimizer.buckets:
        all_gather_ring(optimizer.comm, b.shard.detach(), b.padded, tag="ckpt_load", out=b.flat)


def _materialize(opt, local, maps, template) -> None:
    """Give every tensor of a fresh optimizer the state the checkpoint has (zeros, overwritten by loading)."""
    for t in local:
        if opt.state.get(t):
            continue
        names = {name for name, *_ in maps[id(t)]}
        state = {}
        for key, (shape, dtype) in template.items():
            kind, _, rest = key.partition("/")
            k, _, name = rest.partition("/")
            if kind == "optim" and name in names and k not in state:
                state[k] = torch.zeros((), dtype=dtype) if tuple(shape) == () else torch.zeros_like(t, dtype=dtype)
        if state:
            opt.state[t] = state


# ============================================================================================ random numbers
def rng_state() -> tuple[dict, dict]:
    """This process's generators: (tensors, json). torch's CPU generator, numpy's global MT19937, Python's."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    tensors = {"rng/torch": torch.get_rng_state(), "rng/numpy": torch.from_numpy(keys.astype(np.int64))}
    return tensors, {"numpy": [kind, int(pos), int(has_gauss), float(cached)],
                     "python": [version, list(internal), gauss_next]}


def set_rng_state(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    kind, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["rng/numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = meta["python"]
    random.setstate((version, tuple(internal), gauss_next))


# ============================================================================================ the data position
class ResumedBatches:
    """`batches` from step `start` on: get(step, micro) is batches.get(start + step, micro), so `train.run(...,
    steps=N - start)` continues where the checkpoint stopped. `ShardedBatches` draws every step's global batch from
    a generator seeded by the step, so the step number is the whole data position."""

    def __init__(self, batches, start: int):
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be a non-negative step number, got {start!r}")
        self.batches, self.start = batches, start

    def get(self, step: int, micro: int = 0):
        return self.batches.get(self.start + step, micro)

    def __getattr__(self, name):
        if name in ("batches", "start"):
            raise AttributeError(name)
        return getattr(self.batches, name)


def data_position(batches, step: int) -> dict:
    """What identifies the data stream and where it stands (JSON): enough to refuse resuming on other data."""
    inner = batches.batches if isinstance(batches, ResumedBatches) else batches
    pos = {"step": int(step), "kind": type(inner).__name__}
    for attr in ("seed", "seq_len", "global_batch_size", "num_microbatches", "split"):
        if hasattr(inner, attr):
            pos[attr] = getattr(inner, attr)
    return pos


__all__ = ["Piece", "TrainingState", "training_state", "rng_state", "set_rng_state", "ResumedBatches",
           "data_position", "CHECKPOINT"]
