"""Will the GPUs starve? Tokens per second a training step consumes against tokens per second each data tier
delivers, and which tier a dataset needs — all *modeled* (a stated cluster, typical figures, labelled as such).

Consumption of one node (formulas §5.3: training FLOPs per token ≈ 6N + 12·L·T·d):

    tokens/s = gpus · MFU · peak FLOP/s / (6N + 12·L·T·d)          bytes/s = tokens/s · bytes per token

Delivery of a tier, in tokens/s = its bytes/s ÷ bytes per token:
    object store, one sample per GET, one at a time     S/(α + S/B_conn)              (formulas §10.2, c = 1)
    object store, large shards, c ranged GETs at once   min(c·S/(α + S/B_conn), B_nic) (formulas §10.2)
    tier 1, local NVMe cache                           the drives' rate (formulas §6.3 link ceiling)
    tier 2, a peer's cache over the cluster network     the NIC (formulas §9.1)

Which tier a dataset needs is decided by where it *fits* (formulas §10.3: a cache smaller than what an epoch scans
gains nothing from LRU): the node's RAM keeps a dataset read straight from the store after its first epoch; a
larger one needs the local-disk cache; one larger than a node's drives needs the cache spread over the nodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .store import CLOUD_S3, CloudModel

TB = 1e12


@dataclass(frozen=True)
class NodeModel:
    """One node of a modeled cluster (defaults: IBM Vela, formulas §10.5 — 8 × A100, 1.5 TB DRAM, ~12 TB NVMe cache)."""
    gpus: int = 8
    peak_flops: float = 312e12          # A100 dense bf16 [typical: NVIDIA A100 data sheet]
    mfu: float = 0.40                   # model FLOPs utilization [typical]
    ram_bytes: float = 1.5 * TB         # formulas §10.5
    local_cache_bytes: float = 12 * TB  # formulas §10.5 (~12 TB of local cache per node, from 4 × 3.2 TB NVMe)
    nvme_bytes_per_s: float = 4 * 7.9e9 # 4 drives at the Gen4 x4 link ceiling (formulas §6.3)
    nic_bytes_per_s: float = 12.5e9     # 100 GbE to the other nodes (formulas §9.1)
    store: CloudModel = CLOUD_S3


@dataclass(frozen=True)
class Workload:
    """What is trained: matmul parameters N, layers L, sequence T, width d, and bytes per token of the data."""
    name: str
    n_params: float
    n_layer: int
    seq_len: int
    d_model: int
    bytes_per_token: float

    @property
    def flops_per_token(self) -> float:
        """6N + 12·L·T·d (formulas §5.3)."""
        return 6 * self.n_params + 12 * self.n_layer * self.seq_len * self.d_model

    @property
    def sample_bytes(self) -> float:
        return self.seq_len * self.bytes_per_token


def consumed_tokens_per_s(node: NodeModel, work: Workload) -> float:
    return node.gpus * node.mfu * node.peak_flops / work.flops_per_token


def tier_rates(node: NodeModel, work: Workload, *, shard_bytes: float = 16e6, concurrency: int = 16) -> dict:
    """{tier: tokens/s it delivers to one node} (modeled)."""
    store, b = node.store, work.bytes_per_token
    return {
        "store, one sample per GET (c=1)": store.throughput(work.sample_bytes, 1) / b,
        f"store, {shard_bytes / 1e6:g} MB ranges, c={concurrency}": store.throughput(shard_bytes, concurrency) / b,
        "tier 1: local NVMe cache": node.nvme_bytes_per_s / b,
        "tier 2: peers' caches over the NIC": node.nic_bytes_per_s / b,
    }


def tier_for(dataset_bytes: float, node: NodeModel) -> str:
    """The nearest tier that holds the whole dataset, so that every epoch after the first is served without the
    store: RAM (read straight from the store; the page cache keeps it), local disk, or the nodes' caches pooled."""
    if dataset_bytes <= node.ram_bytes:
        return "object store (kept in RAM)"
    if dataset_bytes <= node.local_cache_bytes:
        return "tier 1: local disk cache"
    return "tier 2: distributed cache"


def nodes_to_pool(dataset_bytes: float, node: NodeModel) -> int:
    """Nodes whose local caches together hold the dataset (one copy, spread by owner)."""
    return math.ceil(dataset_bytes / node.local_cache_bytes)


__all__ = ["NodeModel", "Workload", "consumed_tokens_per_s", "tier_rates", "tier_for", "nodes_to_pool", "TB"]
