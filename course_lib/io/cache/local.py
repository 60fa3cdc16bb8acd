"""Tier 1 of the caches in front of the object store: a byte-budgeted local-disk cache (docs/formulas.md §10.3).

`ShardCache`: whole shards as files on local disk under a byte budget, with an eviction policy. The rule
when a shard of n bytes arrives: if n exceeds the whole budget it is passed through uncached (nothing is evicted for
it, and it was fetched only because the caller needed it anyway); otherwise `lru`/`mru` evict until it fits and
`pin` keeps it only if it fits without evicting:

    lru   evict the least recently used. On the same scan every epoch with C < D shards cached it never hits:
          between two reads of a shard D − 1 > C − 1 others were read, so it was evicted (formulas §10.3)
    mru   evict the most recently used: a scan keeps most of the shards it read first, and hits ≈ C of D per epoch
    pin   keep the first C shards admitted, never evict: C/D of any order hits (with C ≥ D: everything)

The hit rates each policy reaches on each access pattern are derived in `hit_rates`.
"""
from __future__ import annotations

import collections
import threading
import urllib.parse
from pathlib import Path

from ...core.files import atomic_write

POLICIES = ("lru", "mru", "pin")


class CacheTooSmall(ValueError):
    """The byte budget cannot hold even one shard."""


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
