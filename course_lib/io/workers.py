"""Rank workers of notebook 11, its lab checks and tests: `launch(worker, N, …)` runs them on real ranks.

    stream_worker   every rank streams its share of one epoch from the store (prefetch threads, ranged GETs),
                    then trains a few steps with DDP on the stream through `train.run`
    cache_worker    every rank streams `epochs` epochs through the tier-2 distributed cache (or tier 1 alone)

Both return plain dicts (picklable) of what the caller asserts: sample ids, batches, bytes from the ledger and from
the clients' counters.
"""
from __future__ import annotations

import os
import time

from .cache import CachedSource, DistributedShardCache, ShardCache
from .shards import ShardIndex, StoreShardSource
from .stream import StreamingBatches, epoch_shards


def stream_worker(ctx, access, bucket: str, index: ShardIndex, *, micro_batch_size: int, seed: int,
                  shuffle_buffer: int, prefetch: int, workers: int, part_bytes: int, concurrency: int,
                  keep_steps: int, train_steps: int = 0, cfg=None, tc=None) -> dict:
    source = StoreShardSource(access, bucket, index, part_bytes=part_bytes, concurrency=concurrency)
    stream = StreamingBatches(source, index, micro_batch_size=micro_batch_size, dp=ctx.comm, seed=seed,
                              shuffle_buffer=shuffle_buffer, prefetch=prefetch, workers=workers)
    n, b = stream.samples_per_epoch, micro_batch_size
    t0 = time.perf_counter()
    batches = [stream.get(s) for s in range(n // b)]            # the whole epoch, batch by batch
    if n % b:
        stream.samples(n - n % b, n % b)
    seconds = time.perf_counter() - t0
    issued = list(stream.issued)                                # (epoch, shard): this epoch's, and some ahead
    out = {"ids": stream.sample_ids(0, n), "shards": epoch_shards(index.num_shards, 0, seed, stream.dp_rank,
                                                                   stream.dp_size),
           "batches": batches[:keep_steps], "seconds": seconds, "issued": issued, "losses": [], "tokens_per_s": None}
    stream.close()
    if train_steps:
        from .. import optim
        from ..core.model import GPT
        from ..parallel.dp import apply_dp
        from ..train import optimizer_kwargs, run
        model = apply_dp(GPT(cfg, seed=tc.seed), ctx.comm, kind="bucket")
        with StreamingBatches(source, index, micro_batch_size=micro_batch_size, dp=ctx.comm, seed=seed,
                              shuffle_buffer=shuffle_buffer, prefetch=prefetch, workers=workers) as train_stream:
            r = run(model, optim.build(model.module, **optimizer_kwargs(tc)), train_stream, steps=train_steps)
        out.update(losses=r.losses, tokens_per_s=r.tokens_per_second)
    out["total_bytes"], out["requests"], out["shards_fetched"] = source.stats.bytes, source.stats.requests, \
        source.stats.shards
    source.close()
    return out


def cache_worker(ctx, access, bucket: str, index: ShardIndex, root: str, *, budget: int, epochs: int, seed: int,
                 first_epoch: int = 0, distributed: bool = True, policy: str = "lru", owner_map=None, nodes=None,
                 prefetch: int = 2) -> dict:
    """Stream epochs first_epoch … first_epoch + epochs − 1 of this rank's share through the caches. Rank r runs on
    node `nodes[r]` (default: the rank number) and keeps its tier-1 cache in root/node-<node>, which survives between
    launches like a node's local drive.

    'store_bytes' is what this rank's store client received during each epoch's reads; 'store_total' is all it
    received until every rank closed the tier-2 cache — an owner keeps serving its peers after its own epochs end,
    and a shard it fetches for them then falls in no epoch of its own."""
    node = nodes[ctx.rank] if nodes is not None else ctx.rank
    cache = ShardCache(os.path.join(root, f"node-{node}"), budget, policy, min_item_bytes=index.shard_bytes)
    store = StoreShardSource(access, bucket, index)
    if distributed:
        source = DistributedShardCache(ctx.comm, cache, store, index, owner_map=owner_map, nodes=nodes)
    else:
        source = CachedSource(cache, store)
    stream = StreamingBatches(source, index, micro_batch_size=1, dp=ctx.comm, seed=seed, prefetch=prefetch,
                              workers=max(1, prefetch), epochs=first_epoch + epochs)
    n = stream.samples_per_epoch
    per_epoch = []
    for e in range(first_epoch, first_epoch + epochs):
        before = store.stats.bytes
        stream.samples(e * n, n)
        per_epoch.append(store.stats.bytes - before)
    stream.close()                                   # waits for this rank's prefetches still in flight
    if distributed:
        source.close()                               # returns once every peer has stopped asking this rank
    store.close()
    return {"store_bytes": per_epoch, "store_total": store.stats.bytes, "store_shards": store.stats.shards,
            "peer_bytes": getattr(source, "peer_bytes", 0),
            "shard_bytes_sent": ctx.comm.ledger.bytes_sent(group="cache"),
            "request_bytes_sent": ctx.comm.ledger.bytes_sent(group="cache_req"),
            "cached": cache.keys(), "hits": cache.hits, "misses": cache.misses, "retries": access.stats.retries}


__all__ = ["stream_worker", "cache_worker"]
