"""Owner maps: which node serves a shard — rendezvous hashing (highest random weight, Thaler & Ravishankar 1998),
against h(key) mod N; when a node leaves, rendezvous moves only the keys it owned, mod N almost all (formulas §10.4).
"""
from __future__ import annotations

import hashlib


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
