"""A streaming dataset over token shards in an object store, from scratch: every dp rank reads a disjoint set of
shards, mixes their samples in a shuffle buffer, and fetches ahead with prefetching threads.

The order of every epoch is decided before any byte is read (WebDataset's and tf.data's shuffle buffer, run on
sample *ids*):

    epoch e:   shards permuted by Generator(seed, e)          [s7 s2 s9 s0 s4 s1 …]
    rank r:    takes every dp_size-th of them                  rank 0: s7 s9 s4 …   rank 1: s2 s0 s1 …
    buffer:    streams its shards' samples through a buffer of B; each incoming sample evicts a uniformly random
               resident one (Generator(seed, e, r)), which is emitted; at the end of the epoch the buffer drains

So over an epoch every sample is seen exactly once across the ranks (the shards partition the data), and rank r's
stream is a pure function of (seed, epoch, dp_rank, dp_size) — its position is one integer, the number of samples it
has consumed, and resuming from it is exact (notebook 10's bitwise resume). The bytes come later: a prefetch pool
fetches the shards in the order the stream will first need them, `prefetch` shards ahead, each through the source
(concurrent ranged GETs from the store, or a cache tier in front of it).

`get(step, micro)` makes it a drop-in for `course_lib.core.data.ShardedBatches` in `train.run`: micro-batch `micro` of
`step` on this rank is samples [(step·num_microbatches + micro)·b, … + b) of its stream (b = micro_batch_size), and the
global batch of a step, as one process sees it (`GlobalBatches`), is the ranks' micro-batches in rank order — so
N ranks each averaging their gradient train exactly like one process on the global batch (formulas §2.3).
"""
from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .shards import ShardIndex


def _generator(*words: int) -> np.random.Generator:
    """A PCG64 generator seeded by a tuple of integers (the same stream on every platform and process)."""
    return np.random.Generator(np.random.PCG64(list(words)))


def epoch_shards(num_shards: int, epoch: int, seed: int, dp_rank: int, dp_size: int) -> list:
    """The shard numbers rank `dp_rank` reads in `epoch`, in reading order: a seeded permutation, every dp_size-th."""
    perm = _generator(seed, epoch).permutation(num_shards)
    return [int(s) for s in perm[dp_rank::dp_size]]


def shuffle_buffer(items: list, buffer_size: int, rng: np.random.Generator) -> list:
    """Stream `items` through a buffer of `buffer_size`: once it is full, each incoming item replaces a uniformly
    random resident, which is emitted; the rest drain in random order. buffer_size 1 keeps the order."""
    buf, out = [], []
    for item in items:
        if len(buf) < buffer_size:
            buf.append(item)
            continue
        j = int(rng.integers(buffer_size))
        out.append(buf[j])
        buf[j] = item
    while buf:
        j = int(rng.integers(len(buf)))
        buf[j], buf[-1] = buf[-1], buf[j]                 # swap to the end, then pop: O(1) per item
        out.append(buf.pop())
    return out


def epoch_order(index: ShardIndex, epoch: int, *, seed: int, dp_rank: int, dp_size: int,
                buffer_size: int) -> list:
    """Global sample ids rank `dp_rank` yields in `epoch`, in order (id = shard · samples_per_shard + row)."""
    P = index.samples_per_shard
    incoming = [s * P + i for s in epoch_shards(index.num_shards, epoch, seed, dp_rank, dp_size) for i in range(P)]
    return shuffle_buffer(incoming, max(1, buffer_size), _generator(seed, epoch, dp_rank, 1))


def dp_coordinates(dp) -> tuple[int, int]:
    """(dp_rank, dp_size) from a Mesh (its dp axis) or a Communicator (its rank and size)."""
    from ..distributed.comm import Communicator
    from ..distributed.mesh import Mesh
    if isinstance(dp, Mesh):
        return dp.dp_rank, dp.size("dp")
    if isinstance(dp, Communicator):
        return dp.rank, dp.world_size
    raise TypeError(f"dp must be a course_lib.distributed.mesh.Mesh or a Communicator (ctx.comm), "
                    f"got {type(dp).__name__}")


class StreamingBatches:
    """This rank's stream of samples and micro-batches; see the module docstring.

    source: anything with `fetch(key) -> bytes` (a `StoreShardSource`, a cache tier). dp: a Mesh or Communicator
    (or give dp_rank and dp_size). prefetch: shards fetched ahead of the one being read (0: fetch on demand, in the
    caller's thread — the single-process reader). workers: threads fetching shards at once. epochs: where the
    stream ends (None: never); prefetching never reaches past it.
    """

    def __init__(self, source, index: ShardIndex, *, micro_batch_size: int, num_microbatches: int = 1, dp=None,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle_buffer: int = 256, prefetch: int = 4,
                 workers: int = 4, epochs: int | None = None):
        if dp is not None:
            dp_rank, dp_size = dp_coordinates(dp)
        for name, v, low in (("micro_batch_size", micro_batch_size, 1), ("num_microbatches", num_microbatches, 1),
                             ("dp_size", dp_size, 1), ("shuffle_buffer", shuffle_buffer, 1),
                             ("prefetch", prefetch, 0), ("workers", workers, 0)):
            if not isinstance(v, int) or v < low:
                raise ValueError(f"StreamingBatches: {name} must be an integer >= {low}, got {v!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"StreamingBatches: dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        if index.num_shards % dp_size:
            raise ValueError(f"{index.num_shards} shards cannot be split evenly over {dp_size} dp ranks, so an epoch "
                             f"could not give every rank the same number of samples. Build the shards with a multiple "
                             f"of {dp_size} (e.g. 24 or 48 shards serve 1, 2, 3, 4, 6 and 8 ranks)")
        if prefetch > 0 and workers == 0:
            raise ValueError("prefetch > 0 needs workers >= 1 (threads that fetch ahead)")
        self.source, self.index = source, index
        self.micro_batch_size, self.num_microbatches, self.seed = micro_batch_size, num_microbatches, seed
        self.dp_rank, self.dp_size, self.buffer_size = dp_rank, dp_size, shuffle_buffer
        self.prefetch, self.workers, self.epochs = prefetch, workers, epochs
        self.seq_len = index.seq_len
        self.samples_per_epoch = index.num_samples // dp_size           # this rank's share of one epoch
        self.position = 0                                                # samples consumed by next_batch()
        self._orders: dict = {}                                          # epoch -> (ids, shard first/last use)
        self._loaded: dict = {}                                          # (epoch, shard) -> Future[tensor]
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="prefetch") if workers else None
        self.issued: list = []                                           # (epoch, shard) of every fetch started

    # ------------------------------------------------------------------ the plan
    def _order(self, epoch: int):
        with self._lock:
            if epoch not in self._orders:
                ids = epoch_order(self.index, epoch, seed=self.seed, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                  buffer_size=self.buffer_size)
                first, last = {}, {}
                for i, sid in enumerate(ids):
                    s = sid // self.index.samples_per_shard
                    first.setdefault(s, i)
                    last[s] = i
                by_need = sorted(first, key=first.get)                   # shards in order of first use
                self._orders[epoch] = (ids, first, last, by_need)
                for old in [e for e in self._orders if e < epoch - 1]:   # keep the plan of two epochs at most
                    del self._orders[old]
            return self._orders[epoch]

    def sample_ids(self, start: int, count: int) -> list:
        """Global ids of this rank's samples at stream positions [start, start + count)."""
        out = []
        for p in range(start, start + count):
            epoch, i = divmod(p, self.samples_per_epoch)
            out.append(self._order(epoch)[0][i])
        return out

    # ------------------------------------------------------------------ the bytes
    def _load(self, epoch: int, shard: int) -> Future:
        key = (epoch, shard)
        with self._lock:
            fut = self._loaded.get(key)
            if fut is None:
                info = self.index.shards[shard]
                fetch = lambda: self.index.decode(self.source.fetch(info.key))   # noqa: E731
                if self._pool is None:
                    fut = Future()
                    fut.set_result(fetch())
                else:
                    fut = self._pool.submit(fetch)
                self._loaded[key] = fut
                self.issued.append(key)
            return fut

    def _prefetch_from(self, position: int) -> None:
        """Make sure the next `prefetch` shards after the one at `position` are being fetched (across epochs)."""
        epoch, i = divmod(position, self.samples_per_epoch)
        ids, first, _, by_need = self._order(epoch)
        current = ids[i] // self.index.samples_per_shard
        todo = [(epoch, s) for s in by_need[by_need.index(current) + 1:] if first[s] > i][: self.prefetch]
        if len(todo) < self.prefetch and (self.epochs is None or epoch + 1 < self.epochs):
            todo += [(epoch + 1, s) for s in self._order(epoch + 1)[3][: self.prefetch - len(todo)]]
        for e, s in todo:
            self._load(e, s)

    def _release_before(self, position: int) -> None:
        """Drop shards whose last sample lies before `position`: the buffer will not ask for them again."""
        epoch, i = divmod(position, self.samples_per_epoch)
        with self._lock:
            for (e, s) in list(self._loaded):
                if e < epoch or (e == epoch and self._orders.get(e) and self._orders[e][2][s] < i):
                    del self._loaded[(e, s)]

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Samples at stream positions [start, start + count): (count, seq_len + 1) int64 tokens."""
        rows = []
        P = self.index.samples_per_shard
        if self.epochs is not None and start + count > self.epochs * self.samples_per_epoch:
            raise IndexError(f"the stream ends after {self.epochs} epoch(s) ({self.epochs * self.samples_per_epoch} "
                             f"samples on this rank); position {start + count - 1} is past it")
        for p in range(start, start + count):
            epoch, i = divmod(p, self.samples_per_epoch)
            sid = self._order(epoch)[0][i]
            if self.prefetch:
                self._prefetch_from(p)
            rows.append(self._load(epoch, sid // P).result()[sid % P])
        self._release_before(start + count)
        return torch.stack(rows)

    # ------------------------------------------------------------------ the ShardedBatches interface
    def get(self, step: int, micro: int = 0):
        """This rank's (x, y) for `step` and accumulation micro-step `micro`: each (micro_batch_size, seq_len)."""
        if not 0 <= micro < self.num_microbatches:
            raise ValueError(f"micro-step {micro} is outside 0..{self.num_microbatches - 1}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        b = self.micro_batch_size
        w = self.samples((step * self.num_microbatches + micro) * b, b)     # (b, T+1)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()            # x, y: (b, T)

    @property
    def fetched(self) -> int:
        """Shard fetches started so far (prefetched ones included)."""
        return len(self.issued)

    @property
    def steps_per_epoch(self) -> float:
        return self.samples_per_epoch / (self.micro_batch_size * self.num_microbatches)

    # ------------------------------------------------------------------ iteration and exact resume
    def next_batch(self):
        """The next micro-batch of the stream (for loops that do not count steps); advances `position`."""
        w = self.samples(self.position, self.micro_batch_size)
        self.position += self.micro_batch_size
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def fingerprint(self) -> str:
        """What a saved position is valid for: the shards (their checksums) and the way they are read."""
        h = hashlib.sha256(self.index.to_json())
        h.update(repr((self.seed, self.dp_rank, self.dp_size, self.buffer_size)).encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict:
        return {"position": self.position, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint():
            raise ValueError("this stream position was saved for other shards, another seed, rank, dp size or "
                             "shuffle buffer; build the StreamingBatches exactly as when it was saved")
        self.position = int(state["position"])
        with self._lock:
            self._loaded.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        with self._lock:
            self._loaded.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GlobalBatches:
    """The single-process reader: for each step, the global batch every rank's stream together would give —
    micro-step `micro` is the dp ranks' micro-batches concatenated in rank order — read shard by shard in the
    caller's thread, no prefetch. `get(step, micro)` → (dp_size · micro_batch_size, seq_len) x and y."""

    def __init__(self, source, index: ShardIndex, *, micro_batch_size: int, dp_size: int, num_microbatches: int = 1,
                 seed: int = 0, shuffle_buffer: int = 256):
        self.ranks = [StreamingBatches(source, index, micro_batch_size=micro_batch_size,
                                       num_microbatches=num_microbatches, dp_rank=r, dp_size=dp_size, seed=seed,
                                       shuffle_buffer=shuffle_buffer, prefetch=0, workers=0) for r in range(dp_size)]
        self.micro_batch_size = dp_size * micro_batch_size
        self.num_microbatches, self.seq_len = num_microbatches, index.seq_len

    def get(self, step: int, micro: int = 0):
        xs, ys = zip(*(r.get(step, micro) for r in self.ranks))
        return torch.cat(xs), torch.cat(ys)


__all__ = ["StreamingBatches", "GlobalBatches", "epoch_shards", "shuffle_buffer", "epoch_order", "dp_coordinates"]
