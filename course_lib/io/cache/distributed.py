"""Tier 2 of the caches in front of the object store — `DistributedShardCache`: each shard has one owner rank
(rendezvous hashing, `owner_maps.Rendezvous`); the owner keeps it in its tier-1 cache and serves it to the other ranks
over send/recv on the traffic ledger, so the store sends each shard once per dataset; when a rank leaves, only the
shards it owned move (formulas §10.4).
"""
from __future__ import annotations

import hashlib
import threading

import torch

from ..shards import ShardIndex
from .local import ShardCache
from .owner_maps import Rendezvous

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
