"""Checks for Lab 11 (a consistent-hash ring as the owner map of the distributed shard cache).

  * check_ring_moves: removing a node moves exactly that node's keys; adding one moves keys only to the newcomer;
    with virtual nodes no node owns more than twice its fair share (formulas §10.4, Karger et al. STOC 1997); a
    ring built alike in another process (another hash seed: each torchrun rank has its own) gives every key the
    same owner;
  * check_ring_cache: the ring drives a distributed cache of whole shards in front of a real S3 server (moto on
    loopback): store bytes and hit rates equal the analytic values on three access patterns — a cold epoch (every
    shard from the store once, 0% hits), a warm epoch (0 bytes, 100%), and an epoch after a node leaves (exactly
    the departed node's shards, hit rate 1 − moved/D).
"""
from __future__ import annotations

import builtins
import contextlib
import tempfile

from ..core.data import load_tokens
from ..io import cache as K
from ..io import shards as H
from ..io import store as S
from . import check

KEYS = [f"shards/shard-{i:05d}.bin" for i in range(2000)]


def _salted(obj) -> bool:
    """Whether Python's hash() of obj depends on the process's hash seed (str and bytes, and tuples holding them)."""
    if isinstance(obj, (str, bytes)):
        return True
    return isinstance(obj, (tuple, frozenset)) and any(_salted(x) for x in obj)


@contextlib.contextmanager
def another_hash_seed():
    """Inside this block hash() answers as in another process: Python salts the hash of str and bytes per process
    (PYTHONHASHSEED), and under torchrun every rank is its own process. (A real second process would have to import
    torch and the learner's notebook; swapping builtins.hash sees the same thing for the learner's hash() calls.)"""
    real = builtins.hash
    builtins.hash = lambda obj: real(("another process", obj)) if _salted(obj) else real(obj)
    try:
        yield
    finally:
        builtins.hash = real


def _owners(c, ring, keys, what: str) -> dict:
    """{key: ring.owner(key)}; an IndexError (a key past the last point) becomes the wrap-around hint."""
    out = {}
    for k in keys:
        try:
            out[k] = ring.owner(k)
        except IndexError as e:
            c.expect(False, f"{what}: owner({k!r}) raised IndexError ({e}): its hash lies after the last point on "
                     f"the ring", hint="the ring wraps around: past the last point, a key belongs to the FIRST point "
                                       "(index % number of points)")
    return out


def _points_of(ring, count: int):
    """The ring's point list if it keeps one of `count` integers (any attribute name), else None."""
    for v in vars(ring).values():
        if isinstance(v, (list, tuple)) and len(v) == count and all(isinstance(h, int) for h in v):
            return list(v)
    return None


def check_ring_moves(ring_cls, vnodes: int = 64) -> None:
    with check("ring_moves") as c:
        for n in (3, 4, 5):
            ring, smaller, larger = (ring_cls(range(n), vnodes), ring_cls(range(n - 1), vnodes),
                                     ring_cls(range(n + 1), vnodes))
            owner = _owners(c, ring, KEYS, f"{n} nodes")
            c.expect(set(owner.values()) <= set(range(n)), f"owners {sorted(set(owner.values()), key=repr)[:6]} are "
                     f"not nodes of range({n})", hint="owner(key) must return one of the nodes you were given, as "
                     "given (the node itself, not a string or a point)")
            counts = [list(owner.values()).count(r) for r in range(n)]
            c.expect(max(counts) < len(KEYS), f"with {n} nodes every key went to node {counts.index(max(counts))}",
                     hint="each point's hash must depend on its node and its index: stable_hash(node, v)")
            after = _owners(c, smaller, KEYS, f"{n - 1} nodes")
            moved = [k for k in KEYS if after[k] != owner[k]]
            lost = [k for k in KEYS if owner[k] == n - 1]
            points = _points_of(ring, n * vnodes)
            unsorted = ("your ring's points are not sorted: bisect finds the first point after a hash only in a sorted "
                        "list") if points is not None and points != sorted(points) else None
            c.expect(sorted(moved) == sorted(lost), f"with node {n - 1} gone, {len(moved)} keys changed owner; only "
                     f"its {len(lost)} keys should",
                     hint=unsorted or "a key's owner is the first ring point clockwise of its hash (bisect on the "
                          "sorted points), not a hash mod the number of nodes: removing a node's points only hands "
                          "its arcs to the next points")
            grown = _owners(c, larger, KEYS, f"{n + 1} nodes")
            gained = [k for k in KEYS if grown[k] != owner[k]]
            c.expect(all(grown[k] == n for k in gained), "adding a node moved keys between old nodes",
                     hint=unsorted or "keys may only move to the newcomer: its points take over parts of other "
                                      "nodes' arcs, nothing else changes")
            share = max(counts) / len(KEYS)
            c.expect(share <= 2 / n, f"with {vnodes} virtual nodes one of {n} nodes owns {share:.0%} of the keys "
                     f"(fair share {1 / n:.0%})", hint="give every node `vnodes` points on the ring: "
                                                       "stable_hash(node, v) for v in range(vnodes)")
            with another_hash_seed():                       # the same ring, built as another rank would build it
                elsewhere = _owners(c, ring_cls(range(n), vnodes), KEYS, "in another process")
            differ = sum(elsewhere[k] != owner[k] for k in KEYS)
            c.expect(differ == 0, f"a ring built alike in another process (another hash seed, as each rank has "
                     f"under torchrun) gives {differ} of {len(KEYS)} keys another owner",
                     hint="Python's hash() of a string differs per process: hash with "
                          "course_lib.io.cache.stable_hash (K.stable_hash) for both the points and the keys")
        c.passed(f"only the departed node's keys move (n = 3, 4, 5); largest share ≤ {share:.0%} for {n} nodes; the "
                 f"same owners in another process")


def _cached_epochs(ring_before, ring_after, index, blobs, store):
    """One process standing in for the nodes: node r's cache holds the shards the ring gives it; a read goes to
    the owner's cache, and on a miss the owner fetches from the store. Returns per epoch (hits, store bytes)."""
    s3 = store.access()
    source = H.StoreShardSource(s3, "lab11", index)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lab11-") as root:
        caches = {r: K.ShardCache(f"{root}/node{r}", index.nbytes, "lru") for r in ring_before.nodes}
        for ring in (ring_before, ring_before, ring_after):
            store.stats.reset()
            hits = 0
            for key in K.access_pattern("shuffled", index.keys(), len(rows)):
                cache = caches[ring.owner(key)]
                before = cache.hits
                cache.get_or_fetch(key, source.fetch)
                hits += cache.hits - before
            rows.append((hits, store.stats.bytes_out))
    return rows


def check_ring_cache(ring_cls, nodes: int = 4, vnodes: int = 64) -> None:
    with check("ring_cache") as c:
        index, blobs = H.build_shards(load_tokens("train")[:100_000], seq_len=32, num_shards=24)
        ring, after = ring_cls(range(nodes), vnodes), ring_cls(range(nodes - 1), vnodes)
        with S.ObjectStore() as store:
            H.upload_shards(store.access(), "lab11", index, blobs)
            rows = _cached_epochs(ring, after, index, blobs, store)
        D, shard = index.num_shards, index.shard_bytes
        moved = sum(1 for k in index.keys() if ring.owner(k) != after.owner(k))
        lost = sum(1 for k in index.keys() if ring.owner(k) == nodes - 1)
        want = [(0, D * shard), (D, 0), (D - lost, lost * shard)]
        names = ["cold epoch", "warm epoch", f"after node {nodes - 1} left"]
        for name, got, exp in zip(names, rows, want):
            c.expect(got == exp, f"{name}: {got[0]} hits and {got[1]:,} store bytes; expected {exp[0]} hits and "
                     f"{exp[1]:,} bytes", hint="a shard must have one owner in every epoch, and only the departed "
                     "node's shards may change owner")
        c.expect(moved == lost, f"{moved} shards changed owner, the departed node owned {lost}",
                 hint="see check_ring_moves")
        c.passed(f"store bytes {[r[1] for r in rows]} and hit rates {[f'{r[0] / D:.0%}' for r in rows]} as derived "
                 f"(cold, warm, after a leave: {lost} of {D} shards moved)")
