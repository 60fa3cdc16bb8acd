"""Training data from object storage (notebook 11): a real S3 API on loopback, token shards, a streaming dataset,
and the cache tiers in front of the store.

    store      ObjectStore: moto's S3 server on 127.0.0.1 (a context manager), server-side hooks that inject a
               modeled cloud store (first-byte latency, per-connection and NIC rates) and faults (503 SlowDown,
               slow and corrupted responses); boto3/s3fs clients; ranged GETs with bounded retries
    shards     the corpus as fixed-size token shards with an index and a sha256 per shard; upload and verify
    stream     StreamingBatches: rank/world shard partition, shuffle buffer, prefetching threads, resumable
               position; `get(step, micro)` like `ShardedBatches`, so `train.run` trains on it
    cache/     tier 1: a byte-budgeted local-disk cache (LRU, MRU, pinning) and its analytic hit rates;
               tier 2: a cache spread over the ranks (rendezvous hashing), misses served by the owner peer
    capacity   will the GPUs starve? tokens/s consumed vs delivered per tier, and which tier a dataset needs
    workers    the rank workers of notebook 11, its lab checks and tests: streaming, and the cached epochs

Formulas: docs/formulas.md §10 (object storage: §10.2 throughput vs concurrency, §10.3 hit rates, §10.4 hashing).
"""
