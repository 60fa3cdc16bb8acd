"""Flat buffers: many tensors laid end to end in one 1-D buffer, so that one collective moves all of them.

Every data-parallel technique of the course sends gradients or parameters in flat buffers: DDP all-reduces buckets
of gradients, ZeRO-1/2 reduce-scatter the gradient buckets and all-gather the parameter buckets, FSDP all-gathers a
unit's parameters and reduce-scatters its gradients. One rule decides what goes into a bucket, and one class lays
tensors out in a buffer:

    bucket_params(params, cap_bytes)   THE bucketing rule (PyTorch DDP's, Li et al. VLDB 2020 §3.2.3): walk the
                                       parameters in reverse registration order — backward produces the last layers'
                                       gradients first — and close a bucket once it holds at least `cap_bytes`;
                                       one dtype per bucket; a parameter larger than the cap gets a bucket of its own
    FlatBuffer(tensors, shards=N)      offsets of each tensor in the buffer; the buffer is padded with zeros to a
                                       multiple of N so it splits into N equal shards (rank r owns shard r)

        tensors:   [ a (5) ][ b (3) ][ c (6) ]                 numel 14
        N = 4:     [ a a a a | a b b b | c c c c | c c 0 0 ]    padded 16, shard size 4; rank 2 owns c[0:4]
"""
from __future__ import annotations

import torch


def padded_numel(numel: int, shards: int) -> int:
    """`numel` rounded up to a multiple of `shards`, so that the shards are equal (the padding holds zeros)."""
    return -(-numel // shards) * shards


def bucket_params(params, cap_bytes: int | None) -> list[list[torch.Tensor]]:
    """Group `params` into buckets by THE rule: reverse order, a bucket closes once it holds >= cap_bytes, one dtype
    per bucket (a bucket is one flat buffer). cap_bytes=None: one bucket per dtype."""
    if cap_bytes is not None and (not isinstance(cap_bytes, int) or isinstance(cap_bytes, bool) or cap_bytes <= 0):
        raise ValueError(f"bucket_cap_bytes must be a positive number of bytes (or None for one bucket), "
                         f"got {cap_bytes!r}")
    done, open_ = [], {}                        # open_: dtype -> [tensors, bytes] of the bucket being filled
    for p in reversed(list(params)):
        bucket = open_.setdefault(p.dtype, [[], 0])
        bucket[0].append(p)
        bucket[1] += p.numel() * p.element_size()
        if cap_bytes is not None and bucket[1] >= cap_bytes:
            done.append(open_.pop(p.dtype)[0])
    return done + [b[0] for b in open_.values() if b[0]]


class FlatBuffer:
    """The layout of `tensors` laid end to end (in the given order), padded to a multiple of `shards`.

    It holds no data itself: `new()` makes a zeroed buffer of the layout, `view(buf, i)` is tensor i's slot in any
    such buffer, `pack(buf, tensors)` copies tensors into their slots (None counts as zeros), `shard(buf, r)` is
    rank r's equal slice.
    """

    def __init__(self, tensors=None, *, shapes=None, dtype: torch.dtype | None = None, shards: int = 1):
        """Lay out `tensors` — or, without tensors, slots of the given `shapes` and `dtype`."""
        tensors = list(tensors) if tensors is not None else None
        if tensors is not None:
            if len({t.dtype for t in tensors}) > 1:
                raise ValueError("FlatBuffer: every tensor of one flat buffer must share a dtype")
            shapes, dtype = [t.shape for t in tensors], (tensors[0].dtype if tensors else dtype)
        if not shapes:
            raise ValueError("FlatBuffer needs at least one tensor (or shape)")
        if not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards must be a positive integer, got {shards!r}")
        self.tensors = tensors
        self.dtype = dtype or torch.get_default_dtype()
        self.shapes = [torch.Size(s) if not isinstance(s, int) else torch.Size([s]) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.shapes))]
        self.numel = sum(self.numels)
        self.shards = shards
        self.padded = padded_numel(self.numel, shards)
        self.shard_numel = self.padded // shards
        self._index = {id(t): i for i, t in enumerate(tensors or ())}

    @property
    def nbytes(self) -> int:
        """Bytes of the padded buffer in the tensors' dtype."""
        return self.padded * torch.tensor([], dtype=self.dtype).element_size()

    def index(self, tensor: torch.Tensor) -> int:
        return self._index[id(tensor)]

    def new(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed buffer of this layout (allocate it under the memory category it is for)."""
        return torch.zeros(self.padded, dtype=dtype or self.dtype)

    def view(self, buf: torch.Tensor, i: int | torch.Tensor) -> torch.Tensor:
        """Tensor i's slot in `buf`, with tensor i's shape (a view: writing it writes the buffer)."""
        i = i if isinstance(i, int) else self.index(i)
        return buf[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.shapes[i])

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [self.view(buf, i) for i in range(len(self.shapes))]

    def pack(self, buf: torch.Tensor, tensors) -> torch.Tensor:
        """Copy `tensors` (one per slot; None means zeros) into `buf`; returns buf."""
        for i, t in enumerate(tensors):
            slot = self.view(buf, i)
            slot.copy_(t) if t is not None else slot.zero_()
        return buf

    def shard(self, buf: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s equal slice of `buf` (a view)."""
        if not 0 <= rank < self.shards:
            raise ValueError(f"rank {rank} is outside 0..{self.shards - 1}")
        return buf[rank * self.shard_numel:(rank + 1) * self.shard_numel]





@torch.no_grad()
def broadcast_tensors(comm, tensors, src: int = 0, *, tag: str = "broadcast", backend: bool = False) -> None:
    """Make every rank's `tensors` equal to rank `src`'s with ONE broadcast: their bytes are laid end to end in a
    uint8 buffer (so mixed dtypes travel together), sent down the binomial tree of `collectives.broadcast_tree` (or
    the backend's own broadcast), and copied back into place. Every data-parallel wrapper starts this way."""
    from ..memory import alloc_category
    from .collectives import broadcast_tree
    tensors = [t for t in tensors if t.numel()]
    if comm.world_size == 1 or not tensors:
        return
    with alloc_category("comm"):
        flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])   # (total bytes,)
    if backend:
        comm.broadcast(flat, src, tag=tag)
    else:
        broadcast_tree(comm, flat, src, tag=tag)
    if comm.rank != src:
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            t.copy_(flat[off:off + n].view(t.dtype).view_as(t))
            off += n


__all__ = ["FlatBuffer", "bucket_params", "padded_numel", "broadcast_tensors"]
