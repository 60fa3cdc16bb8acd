"""Tier-1 cache policies reach the hit rates derived in course_lib.io.cache (formulas §10.3), owner maps move only
a departed node's keys (formulas §10.4), and bad budgets are refused. No store needed: a counting source."""
import collections

import numpy as np
import pytest

from course_lib.io import cache as K


class CountingSource:
    def __init__(self, size=100):
        self.size, self.fetches = size, 0

    def fetch(self, key):
        self.fetches += 1
        return key.encode().ljust(self.size, b".")


def _run(tmp_path, policy, pattern, D, C, epochs, seed=0):
    src = CountingSource()
    cs = K.CachedSource(K.ShardCache(tmp_path / f"{policy}-{pattern}-{D}-{C}", C * 100, policy), src)
    rows = K.run_epochs(cs, [f"k{i}" for i in range(D)], pattern=pattern, epochs=epochs, seed=seed,
                        counter=lambda: src.fetches * src.size)
    return rows


@pytest.mark.parametrize("D, C", [(24, 6), (10, 9), (7, 3), (5, 5), (5, 8)])
@pytest.mark.parametrize("policy, pattern", [("lru", "sequential"), ("lru", "back_and_forth"), ("pin", "sequential"),
                                             ("pin", "back_and_forth"), ("pin", "shuffled"), ("mru", "sequential")])
def test_hit_rate_per_epoch_equals_the_derived_value_exactly(tmp_path, D, C, policy, pattern):
    rows = _run(tmp_path, policy, pattern, D, C, epochs=8)
    for e, row in enumerate(rows):
        want = K.analytic_hit_rate(pattern, policy, C, D, e)
        assert row["store_bytes"] == row["misses"] * 100
        if want is None:                     # MRU after epoch C − 1: C − 1 or C hits
            assert policy == "mru" and C - 1 <= row["hits"] <= C
        else:
            assert row["hits"] == round(want * D), (e, row)


def test_lru_on_a_repeated_scan_smaller_than_the_data_never_hits_however_large(tmp_path):
    for C in (1, 10, 23):
        assert [r["hits"] for r in _run(tmp_path, "lru", "sequential", 24, C, epochs=4)] == [0, 0, 0, 0]


def test_lru_on_shuffled_epochs_has_the_poisson_binomial_mean_not_c_over_d():
    """Monte Carlo over many epochs of a plain LRU model: mean and variance of the hits per epoch are those of
    independent Bernoulli((C−i)/(D−i)), i < C — the derivation in the module docstring."""
    rng = np.random.default_rng(0)
    for D, C in [(7, 3), (24, 6)]:
        cache, hits = collections.OrderedDict(), []
        for _ in range(20_000):
            h = 0
            for k in rng.permutation(D):
                if k in cache:
                    cache.move_to_end(k)
                    h += 1
                else:
                    if len(cache) >= C:
                        cache.popitem(last=False)
                    cache[k] = 1
            hits.append(h)
        p = K.lru_shuffled_hit_probabilities(C, D)
        mean, var = sum(p), sum(q * (1 - q) for q in p)
        h = np.array(hits[1:])
        assert abs(h.mean() - mean) < 5 * np.sqrt(var / len(h))
        assert abs(h.var() - var) < 0.05 * var
        assert mean < 0.5 * C                       # far below C/D · D = C


def test_poisson_binomial_interval_brackets_the_distribution():
    lo, hi = K.poisson_binomial_interval([0.5] * 20, tail=1e-3)
    assert 0 < lo < 10 < hi < 20
    assert K.poisson_binomial_interval([1.0] * 5) == (5, 5)
    assert K.poisson_binomial_interval([0.0] * 5) == (0, 0)


def test_cache_survives_a_restart_and_keeps_its_budget(tmp_path):
    c = K.ShardCache(tmp_path, 300, "lru")
    for k in "abcd":
        c.put(k, b"x" * 100)
    assert sorted(c.keys()) == ["b", "c", "d"] and c.used == 300 and c.evictions == 1
    again = K.ShardCache(tmp_path, 300, "lru")
    assert sorted(again.keys()) == ["b", "c", "d"] and again.get("c") == b"x" * 100
    with pytest.raises(K.CacheTooSmall, match="already holds"):
        K.ShardCache(tmp_path, 200, "lru")


def test_budget_smaller_than_one_shard_is_refused_with_the_fix(tmp_path):
    with pytest.raises(K.CacheTooSmall, match="at least 100 bytes"):
        K.ShardCache(tmp_path, 99, "lru", min_item_bytes=100)
    with pytest.raises(K.CacheTooSmall, match="smaller than one shard"):
        K.ShardCache(tmp_path / "b", 50, "pin", min_item_bytes=51)
    with pytest.raises(ValueError, match="unknown cache policy"):
        K.ShardCache(tmp_path / "c", 50, "fifo")


def test_single_flight_fetches_a_miss_once_for_many_threads(tmp_path):
    import threading
    import time
    c = K.ShardCache(tmp_path, 1000, "lru")
    calls = []

    def slow(key):
        calls.append(key)
        time.sleep(0.05)
        return b"v" * 10
    threads = [threading.Thread(target=c.get_or_fetch, args=("k", slow)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["k"]


@pytest.mark.parametrize("policy", ["lru", "mru", "pin"])
def test_a_shard_larger_than_the_budget_is_passed_through_uncached_and_evicts_nothing(tmp_path, policy):
    c = K.ShardCache(tmp_path, 300, policy)
    for k in "ab":
        assert c.put(k, b"x" * 100)
    src = CountingSource(size=301)
    assert c.get_or_fetch("big", src.fetch) == b"big".ljust(301, b".")
    assert src.fetches == 1 and c.passed_through == 1 and c.evictions == 0
    assert sorted(c.keys()) == ["a", "b"] and c.used == 200 and not c.put("big", b"y" * 301)


def test_single_flight_decides_under_one_lock_so_a_late_miss_cannot_fetch_again(tmp_path):
    """A thread whose lookup missed just before the leader stored the shard must not lead a second fetch. The
    slow `get` below widens that window; the decision (hit, join, lead) is taken under one lock, so it is harmless."""
    import threading
    import time

    class SlowMiss(K.ShardCache):
        def get(self, key):
            data = super().get(key)
            if data is None:
                time.sleep(0.05)            # the leader finishes its whole fetch meanwhile
            return data

    c, calls = SlowMiss(tmp_path, 1000, "lru"), []

    def fetch(key):
        calls.append(key)
        return b"v" * 10
    late = threading.Thread(target=c.get_or_fetch, args=("k", fetch))
    late.start()
    time.sleep(0.01)
    assert c.get_or_fetch("k", fetch) == b"v" * 10
    late.join()
    assert calls == ["k"]


def test_many_threads_on_many_keys_fetch_each_key_once(tmp_path):
    import random
    import threading
    import time
    c, calls, lock = K.ShardCache(tmp_path, 10_000, "lru"), collections.Counter(), threading.Lock()

    def fetch(key):
        with lock:
            calls[key] += 1
        time.sleep(random.random() / 1000)
        return key.encode() * 10
    keys = [f"k{i}" for i in range(40)]

    def reader(seed):
        order = random.Random(seed).sample(keys, len(keys))
        for k in order:
            assert c.get_or_fetch(k, fetch) == k.encode() * 10
    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == collections.Counter(keys) and c.hits + c.misses == 8 * len(keys)


def test_owners_keyed_by_node_move_only_the_departed_nodes_shards_when_a_middle_rank_leaves():
    """Survivors are renumbered 0 … n−2 when rank 2 of 5 dies. Keyed by node identity only node 2's keys move;
    keyed by rank number, every key whose owner's rank number now belongs to another node moves too."""
    keys = [f"shards/shard-{i:05d}.bin" for i in range(2000)]
    nodes = [f"node{i}" for i in range(5)]
    survivors = nodes[:2] + nodes[3:]
    before, after = K.Rendezvous(nodes), K.Rendezvous(survivors)
    assert sorted(K.moved_keys(before, after, keys)) == sorted(k for k in keys if before.owner(k) == "node2")
    by_rank_before, by_rank_after = K.Rendezvous(range(5)), K.Rendezvous(range(4))
    moved_by_rank = [k for k in keys if nodes[by_rank_before.owner(k)] != survivors[by_rank_after.owner(k)]]
    assert len(moved_by_rank) > 2 * len(K.moved_keys(before, after, keys))


@pytest.mark.parametrize("n", [3, 4, 8])
def test_rendezvous_moves_only_the_departed_nodes_keys_and_mod_n_moves_most(n):
    keys = [f"shards/shard-{i:05d}.bin" for i in range(2000)]
    before, after = K.Rendezvous(range(n)), K.Rendezvous(range(n - 1))
    moved = K.moved_keys(before, after, keys)
    assert sorted(moved) == sorted(k for k in keys if before.owner(k) == n - 1)
    assert abs(len(moved) / len(keys) - 1 / n) < 4 * np.sqrt((1 / n) * (1 - 1 / n) / len(keys))
    mod = K.moved_keys(K.ModN(range(n)), K.ModN(range(n - 1)), keys)
    assert len(mod) / len(keys) > 0.5


@pytest.mark.parametrize("D, C", [(24, 6), (10, 9), (7, 3), (30, 1)])
def test_lru_on_shuffled_epochs_hits_exactly_where_the_rule_says(tmp_path, D, C):
    keys = [f"k{i}" for i in range(D)]
    rows = _run(tmp_path, "lru", "shuffled", D, C, epochs=6, seed=11)
    orders = [K.access_pattern("shuffled", keys, e, 11) for e in range(6)]
    assert [r["hits"] for r in rows[1:]] == [K.lru_hits_after(orders[e - 1], orders[e], C) for e in range(1, 6)]
