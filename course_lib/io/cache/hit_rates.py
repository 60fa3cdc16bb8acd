"""The hit rates the tier-1 cache (`local.ShardCache`) must reach: the order an epoch reads the shards in, and the
exact hit rate of each policy on each order (docs/formulas.md §10.3).

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
"""
from __future__ import annotations

import numpy as np

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
