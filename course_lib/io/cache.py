"""Cache tiers in front of the object store, and the hit rates they must reach (docs/formulas.md §10.3, §10.4).

Tier 1 — `ShardCache`: whole shards as files on local disk under a byte budget, with an eviction policy. The rule
when a shard of n bytes arrives: if n exceeds the whole budget it is passed through uncached (nothing is evicted for
it, and it was fetched only because the caller needed it anyway); otherwise `lru`/`mru` evict until it fits and
`pin` keeps it only if it fits without evicting:

    lru   evict the least recently used. On the same scan every epoch with C < D shards cached it never hits:
          between two reads of a shard D − 1 > C − 1 others were read, so it was evicted (formulas §10.3)
    mru   evict the most recently used: a scan keeps most of the shards it read first, and hits ≈ C of D per epoch
    pin   keep the first C shards admitted, never evict: C/D of any order hits (with C ≥ D: everything)

Exact hit rates for the course's access patterns (D equal shards, C = ⌊budget / shard⌋, epoch ≥ 1):

    pattern                      lru                               mru      pin
    cold (epoch 0)               0                                 0        0
    C ≥ D                        1                                 1        1
    same order every epoch       0                                 C/D (*)  C/D
    back and forth               C/D                               —        C/D
    new permutation each epoch   Σ_{i<C} (C−i)/(D−i) / D  (mean)   —        C/D

(*) for epochs 1 … C−1: after epoch 0 MRU holds shards 0 … C−2 and D−1; by induction epoch k starts with 0 … C−1−k
and the last k shards, all of which it reads (C hits) while the misses in between only churn one slot. Later the
head runs out and an epoch hits C − 1 for D − C epochs, then C again: ≈ C/D (formulas §10.3).

[derived] The last LRU entry: in a fresh permutation the item read i-th (i < C) is uniform over the D − i not yet
read; the cache holds this epoch's i reads plus the C − i most recent of the previous epoch, so it hits with
probability (C − i)/(D − i), independently of the earlier reads; from i = C on the cache holds only this epoch's
reads, which will not come again. So the hits of an epoch are independent Bernoulli trials (a Poisson-binomial
count) with mean Σ (C−i)/(D−i) — for C ≪ D about C²/(2D), far below the C/D that *independent* random reads give.

Tier 2 — `DistributedShardCache`: each shard has one owner rank (rendezvous hashing, Thaler & Ravishankar 1998);
the owner keeps it in its tier-1 cache and serves it to the other ranks over send/recv on the traffic ledger, so the
store sends each shard once per dataset; when a rank leaves, only the shards it owned move (formulas §10.4).
"""
from __future__ import annotations

import collections
import hashlib
import threading
import urllib.parse
from pathlib import Path

import numpy as np
import torch

from ..core.files import atomic_write
from .shards import ShardIndex

POLICIES = ("lru", "mru", "pin")


class CacheTooSmall(ValueError):
    """The byte budget cannot hold even one shard."""


# =============================================================================================== tier 1
class ShardCache:
    """Whole shards as files in `directory`, at most `budget_bytes` of them, evicted by `policy`.

    Files that are already in `directory` (a cache that survived a restart) count as cached, oldest file first.
    `hits`/`misses`/`evictions` count lookups; `passed_through` counts shards larger than the whole budget, handed
    to the caller and not kept. `get_or_fetch` fetches a miss once however many threads ask for it together (single
    flight, decided under one lock: a thread either finds the shard, joins the fetch in flight or leads a new one),
    so the store never sends the same shard twice for one miss.
    """

    def __init__(self, directory, budget_bytes: int, policy: str = "lru", *, min_item_bytes: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; choose one of {POLICIES}")
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
        if min_item_bytes is not None and budget_bytes < min_item_bytes:
            raise CacheTooSmall(_too_small(budget_bytes, min_item_bytes))
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget, self.policy = budget_bytes, policy
        self._entries: collections.OrderedDict = collections.OrderedDict()   # key -> bytes; oldest use first
        self._lock = threading.Lock()
        self._inflight: dict = {}                                            # key -> _Flight
        self.hits = self.misses = self.evictions = self.passed_through = 0
        files = sorted((p for p in self.directory.iterdir() if p.suffix == ".bin"), key=lambda p: p.stat().st_mtime)
        for p in files:
            self._entries[urllib.parse.unquote(p.stem)] = p.stat().st_size
        if self.used > self.budget:
            raise CacheTooSmall(f"{self.directory} already holds {self.used:,} bytes of shards, more than the budget "
                                f"of {self.budget:,}; give a larger budget or an empty directory")

    def _path(self, key: str) -> Path:
        return self.directory / (urllib.parse.quote(key, safe="") + ".bin")

    @property
    def used(self) -> int:
        return sum(self._entries.values())

    def keys(self) -> list:
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def _lookup(self, key: str) -> bytes | None:
        """The cached bytes (a hit, now the most recently used) or None (a miss); call with the lock held."""
        if key not in self._entries:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return self._path(key).read_bytes()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._lookup(key)

    def put(self, key: str, data: bytes) -> bool:
        """Store `data` under `key` if the policy admits it; True if it is cached afterwards. A shard larger than the
        whole budget is never admitted: it is passed through (False), and nothing is evicted for it."""
        n = len(data)
        with self._lock:
            if key in self._entries:
                return True
            if n > self.budget:
                self.passed_through += 1
                return False
            if self.policy == "pin" and self.used + n > self.budget:
                return False                                   # pinned shards stay; the newcomer is not kept
            while self.used + n > self.budget:
                victim = next(iter(self._entries)) if self.policy == "lru" else next(reversed(self._entries))
                del self._entries[victim]
                self._path(victim).unlink(missing_ok=True)
                self.evictions += 1
            # a crash never leaves half a shard under its name; no fsync: a cache of what the store holds durably
            atomic_write(self._path(key), data, durable=False)
            self._entries[key] = n
            return True

    def get_or_fetch(self, key: str, fetch) -> bytes:
        with self._lock:                                       # one decision: hit, join the flight, or lead one
            data = self._lookup(key)
            if data is not None:
                return data
            flight = self._inflight.get(key)
            leader = flight is None
            if leader:
                flight = self._inflight[key] = _Flight()
        if not leader:                                         # someone is fetching it: take their copy
            flight.done.wait()
            return flight.data if flight.data is not None else fetch(key)   # the leader's fetch failed: retry
        try:
            flight.data = fetch(key)
            self.put(key, flight.data)
            return flight.data
        finally:
            with self._lock:
                del self._inflight[key]
            flight.done.set()

    def counters(self) -> tuple[int, int]:
        return self.hits, self.misses


class _Flight:
    """One fetch in flight: the followers wait for `done` and share `data` (None if the leader's fetch raised)."""

    def __init__(self):
        self.done, self.data = threading.Event(), None


def _too_small(budget: int, item: int) -> str:
    return (f"cache budget {budget:,} bytes is smaller than one shard ({item:,} bytes): it could never keep a shard. "
            f"Give at least {item:,} bytes (C = budget // shard bytes shards fit)")


class CachedSource:
    """Tier 1 in front of a source: `fetch(key)` reads the local cache, and on a miss the source (the store)."""

    def __init__(self, cache: ShardCache, source):
        self.cache, self.source = cache, source

    def fetch(self, key: str) -> bytes:
        return self.cache.get_or_fetch(key, self.source.fetch)


# =============================================================================================== access patterns
PATTERNS = ("sequential", "back_and_forth", "shuffled")


def access_pattern(pattern: str, keys: list, epoch: int, seed: int = 0) -> list:
    """The order an epoch reads `keys`: the same every epoch, reversed every other epoch, or a new permutation."""
    if pattern == "sequential":
        return list(keys)
    if pattern == "back_and_forth":
        return list(keys) if epoch % 2 == 0 else list(reversed(keys))
    if pattern == "shuffled":
        perm = np.random.Generator(np.random.PCG64([seed, epoch, 7])).permutation(len(keys))
        return [keys[i] for i in perm]
    raise ValueError(f"unknown access pattern {pattern!r}; choose one of {PATTERNS}")


def lru_shuffled_hit_probabilities(capacity: int, items: int) -> list:
    """P(hit) of the i-th read of a fresh permutation under LRU: (C − i)/(D − i) for i < C, else 0 (see above)."""
    C, D = min(capacity, items), items
    return [(C - i) / (D - i) for i in range(C)] + [0.0] * (D - C)


def lru_hits_after(previous: list, order: list, capacity: int) -> int:
    """The exact hits of LRU (C = `capacity` items) reading the permutation `order` right after the permutation
    `previous` of the same D keys, by the rule derived above: read i < C hits iff its key is among the C − i most
    recent keys of `previous` not yet read in `order`; from read C on, nothing hits. No cache is simulated."""
    if capacity >= len(order):
        return len(order)
    read, hits = set(), 0
    for i, key in enumerate(order[:capacity]):
        hits += key in [k for k in reversed(previous) if k not in read][:capacity - i]
        read.add(key)
    return hits


def analytic_hit_rate(pattern: str, policy: str, capacity: int, items: int, epoch: int) -> float | None:
    """Exact hit rate of an epoch (the mean, for LRU on shuffled epochs); None where the course derives none."""
    C, D = capacity, items
    if epoch == 0:
        return 0.0
    if C >= D:
        return 1.0
    if policy == "pin":
        return C / D
    if policy == "lru":
        return {"sequential": 0.0, "back_and_forth": C / D,
                "shuffled": sum(lru_shuffled_hit_probabilities(C, D)) / D}.get(pattern)
    if policy == "mru" and pattern == "sequential" and epoch < C:
        return C / D                  # epoch k < C starts with shards 0..C−1−k and the last k: all C hit
    return None


def poisson_binomial_interval(probabilities: list, *, tail: float = 1e-6) -> tuple[int, int]:
    """[lo, hi] such that a sum of independent Bernoulli(p_i) falls below lo, or above hi, each with probability
    < `tail` (exact distribution by dynamic programming)."""
    dist = np.zeros(len(probabilities) + 1)
    dist[0] = 1.0
    for p in probabilities:
        dist[1:] = dist[1:] * (1 - p) + dist[:-1] * p
        dist[0] *= 1 - p
    cdf = np.cumsum(dist)
    lo = int(np.searchsorted(cdf, tail))                      # P(X < lo) < tail
    hi = int(len(dist) - 1 - np.searchsorted(np.cumsum(dist[::-1]), tail))
    return lo, hi


def run_epochs(source, keys: list, *, pattern: str, epochs: int, seed: int = 0, counter=None) -> list:
    """Read every key once per epoch in the pattern's order through `source` (a CachedSource); per epoch return
    {'hits', 'misses', 'store_bytes'} — store bytes from `counter()` (e.g. the server's egress) before/after."""
    cache = source.cache
    rows = []
    for e in range(epochs):
        h0, m0 = cache.counters()
        b0 = counter() if counter else 0
        for key in access_pattern(pattern, keys, e, seed):
            source.fetch(key)
        h1, m1 = cache.counters()
        rows.append({"hits": h1 - h0, "misses": m1 - m0, "store_bytes": (counter() - b0) if counter else None})
    return rows


# =============================================================================================== owner maps
def _hash64(*parts) -> int:
    """A 64-bit hash that is the same in every process (Python's hash() of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest(), "big")


stable_hash = _hash64


class Rendezvous:
    """Highest-random-weight hashing: `key` belongs to the node with the largest h(key, node) (formulas §10.4).
    Removing a node moves exactly its own keys; no ring, no virtual nodes."""

    def __init__(self, nodes):
        self.nodes = list(nodes)
        if not self.nodes:
            raise ValueError("an owner map needs at least one node")

    def owner(self, key: str):
        return max(self.nodes, key=lambda n: _hash64(key, n))


class ModN:
    """h(key) mod N: balanced, but a change of N reassigns almost every key ((N−1)/N of them, formulas §10.4)."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    def owner(self, key: str):
        return self.nodes[_hash64(key) % len(self.nodes)]


def owners(owner_map, keys: list) -> dict:
    return {k: owner_map.owner(k) for k in keys}


def moved_keys(before, after, keys: list) -> list:
    """Keys whose owner differs between two owner maps."""
    return [k for k in keys if before.owner(k) != after.owner(k)]


# =============================================================================================== tier 2
STOP = -1


class DistributedShardCache:
    """Tier 2 over the ranks of `comm` (collective: every rank builds it, and every rank must `close()` it).

    fetch(key): the owner (owner_map, default `Rendezvous(nodes)`) reads its tier-1 `cache`, or on a miss the
    `store` source (and keeps the shard); any other rank sends the owner the shard number (8 bytes, group
    'cache_req') and receives the shard (group 'cache'), both through the traffic ledger. Each rank runs one server
    thread per peer; a requester holds at most one request per owner at a time, so replies cannot cross.

    `nodes[r]` is rank r's stable identity — the machine whose local drive holds its tier-1 cache (default: the rank
    number). Owners are chosen among nodes, not rank numbers: when a middle rank leaves and the survivors are
    renumbered, a survivor keeps its node name, so only the departed node's shards move (formulas §10.4).
    """

    def __init__(self, comm, cache: ShardCache, store, index: ShardIndex, *, owner_map=None, nodes=None):
        self.comm, self.cache, self.store, self.index = comm, cache, store, index
        self.rank, self.world_size = comm.rank, comm.world_size
        self.nodes = list(range(self.world_size)) if nodes is None else list(nodes)
        if len(self.nodes) != self.world_size or len(set(self.nodes)) != self.world_size:
            raise ValueError(f"nodes must name each of the {self.world_size} ranks once, got {self.nodes!r}")
        self._rank_of = {node: r for r, node in enumerate(self.nodes)}
        self.owner_map = owner_map or Rendezvous(self.nodes)
        bad = [n for n in self.owner_map.nodes if n not in self._rank_of]
        if bad:
            raise ValueError(f"the owner map names nodes {bad} that are not this job's nodes {self.nodes}")
        self._number = {k: i for i, k in enumerate(index.keys())}
        # Two groups, so that on every pair of ranks requests and replies never share a channel.
        self.req = comm.new_group(range(self.world_size), name="cache_req")
        self.data = comm.new_group(range(self.world_size), name="cache")
        self._peer_locks = {p: threading.Lock() for p in range(self.world_size)}
        self.peer_fetches = self.peer_bytes = self.local_fetches = 0
        self._servers = [threading.Thread(target=self._serve, args=(p,), daemon=True, name=f"cache-server-{p}")
                         for p in range(self.world_size) if p != self.rank]
        for t in self._servers:
            t.start()

    def _local(self, key: str) -> bytes:
        return self.cache.get_or_fetch(key, self.store.fetch)

    def _serve(self, peer: int) -> None:
        request = torch.empty(1, dtype=torch.int64)
        while True:
            self.req.recv(request, peer, tag="cache request")
            number = int(request.item())
            if number == STOP:
                return
            blob = self._local(self.index.shards[number].key)
            self.data.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), peer, tag="shard")

    def owner(self, key: str) -> int:
        """The rank that serves `key`: the rank of its owner node."""
        return self._rank_of[self.owner_map.owner(key)]

    def fetch(self, key: str) -> bytes:
        owner = self.owner(key)
        if owner == self.rank:
            self.local_fetches += 1
            return self._local(key)
        info = self.index.info(key)
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        with self._peer_locks[owner]:                          # one request in flight per owner
            self.req.send(torch.tensor([self._number[key]], dtype=torch.int64), owner, tag="cache request")
            self.data.recv(buf, owner, tag="shard")
        blob = buf.numpy().tobytes()
        if hashlib.sha256(blob).hexdigest() != info.sha256:
            raise RuntimeError(f"shard {key} from rank {owner} fails its sha256: the peer's cache is damaged")
        self.peer_fetches += 1
        self.peer_bytes += len(blob)
        return blob

    def close(self) -> None:
        """Tell every peer this rank will ask nothing more, then wait until every peer has said the same."""
        for p in range(self.world_size):
            if p != self.rank:
                with self._peer_locks[p]:
                    self.req.send(torch.tensor([STOP], dtype=torch.int64), p, tag="cache request")
        for t in self._servers:
            t.join()
        self.comm.barrier()


__all__ = ["ShardCache", "CachedSource", "CacheTooSmall", "POLICIES", "PATTERNS", "access_pattern",
           "analytic_hit_rate", "lru_shuffled_hit_probabilities", "lru_hits_after", "poisson_binomial_interval",
           "run_epochs",
           "Rendezvous", "ModN", "stable_hash", "owners", "moved_keys", "DistributedShardCache"]
