"""Cache tiers in front of the object store, and the hit rates they must reach (docs/formulas.md §10.3, §10.4).

    local        tier 1: `ShardCache`, whole shards on local disk under a byte budget (LRU, MRU, pinning), single
                 flight on a miss; `CachedSource` puts it in front of a source
    hit_rates    the access patterns of an epoch and each policy's exact hit rate on them (derived there)
    owner_maps   owner maps: rendezvous hashing and h(key) mod N, and which keys move when a node leaves
    distributed  tier 2: `DistributedShardCache`, a cache spread over the ranks, misses served by the owner peer
"""
from .distributed import STOP, DistributedShardCache
from .hit_rates import (
                        PATTERNS,
                        access_pattern,
                        analytic_hit_rate,
                        lru_hits_after,
                        lru_shuffled_hit_probabilities,
                        poisson_binomial_interval,
                        run_epochs,
)
from .local import POLICIES, CachedSource, CacheTooSmall, ShardCache
from .owner_maps import ModN, Rendezvous, moved_keys, owners, stable_hash

__all__ = ["ShardCache", "CachedSource", "CacheTooSmall", "POLICIES", "PATTERNS", "access_pattern",
           "analytic_hit_rate", "lru_shuffled_hit_probabilities", "lru_hits_after", "poisson_binomial_interval",
           "run_epochs", "Rendezvous", "ModN", "stable_hash", "owners", "moved_keys", "DistributedShardCache", "STOP"]
