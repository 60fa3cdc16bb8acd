"""The loopback S3 server and its clients: egress counted at the server, the modeled store never faster than its
model, 503 SlowDown retried with bounded full-jitter backoff, corrupted shards re-fetched, a dead or hung server
a clear error within the retry budget, and bad input refused with the fix. One server for the module."""
import socket
import time

import fsspec
import pytest

from course_lib.core.data import load_tokens
from course_lib.io import cache as K
from course_lib.io import shards as H
from course_lib.io import store as S

BUCKET = "test-data"


@pytest.fixture(scope="module")
def store():
    with S.ObjectStore() as st:
        yield st
    assert not st.running


@pytest.fixture(scope="module")
def uploaded(store):
    index, blobs = H.build_shards(load_tokens("train")[:80_000], seq_len=32, num_shards=8)
    H.upload_shards(store.access(), BUCKET, index, blobs)
    return index, blobs


def test_server_is_on_loopback_and_gone_after_the_block():
    with S.ObjectStore() as st:
        url = st.endpoint_url
        assert url.startswith("http://127.0.0.1:")
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0          # nothing listens any more


def test_store_is_stopped_when_the_block_raises():
    with pytest.raises(KeyboardInterrupt):
        with S.ObjectStore() as st:
            raise KeyboardInterrupt
    assert not st.running


def test_egress_counter_equals_the_bytes_clients_received(store, uploaded):
    index, blobs = uploaded
    s3 = store.access()
    store.stats.reset()
    src = H.StoreShardSource(s3, BUCKET, index, part_bytes=4096, concurrency=4)
    for key in index.keys()[:3]:
        assert src.fetch(key) == blobs[key]
    parts = -(-index.shard_bytes // 4096)
    assert store.stats.bytes_out == 3 * index.shard_bytes == src.stats.bytes
    assert store.stats.gets == 3 * parts == src.stats.requests
    src.close()


def test_index_is_verified_against_the_objects(store, uploaded):
    index, blobs = uploaded
    s3 = store.access()
    assert H.load_index(s3, BUCKET) == index
    bad, bad_blobs = H.build_shards(load_tokens("train")[:20_000], seq_len=32, num_shards=2, prefix="bad")
    H.upload_shards(s3, BUCKET, bad, bad_blobs, prefix="bad")
    s3.client.delete_object(Bucket=BUCKET, Key=bad.shards[0].key)
    with pytest.raises(H.ShardIndexMismatch, match="1 of 2 shards: bad/shard-00000.bin \\(missing\\)"):
        H.load_index(s3, BUCKET, prefix="bad")


def test_unknown_bucket_and_key_name_what_exists(store, uploaded):
    s3 = store.access()
    with pytest.raises(S.ObjectNotFound, match=f"buckets there: .*'{BUCKET}'"):
        s3.get("no-such-bucket", "x")
    with pytest.raises(S.ObjectNotFound, match="no object 'nope' in bucket"):
        s3.get(BUCKET, "nope")
    with pytest.raises(S.ObjectNotFound, match="no object"):
        H.load_index(s3, BUCKET, prefix="missing-prefix")
    with pytest.raises(ValueError, match="not on loopback"):
        S.S3Access("http://10.0.0.1:9000")


def test_slowdown_is_retried_with_bounded_full_jitter_backoff(store, uploaded):
    index, blobs = uploaded
    key = index.keys()[0]
    s3 = store.access(retry=S.RetryPolicy(max_attempts=4, base_s=0.01, cap_s=0.03), seed=3)
    store.faults.slow_down(3, key=f"{BUCKET}/{key}")
    store.stats.reset()
    assert s3.get(BUCKET, key) == blobs[key]
    assert (s3.stats.attempts, s3.stats.retries) == (4, 3) and store.stats.requests["GET"] == 4
    assert all(0 <= x <= min(0.03, 0.01 * 2 ** k) for k, x in enumerate(s3.stats.sleeps))
    store.faults.slow_down(4, key=f"{BUCKET}/{key}")
    with pytest.raises(S.StoreThrottled, match="all 4 attempts"):
        s3.get(BUCKET, key)
    store.faults.server_error(1)
    assert s3.get(BUCKET, key) == blobs[key]                        # a 500 is retried too
    store.faults.clear()


def test_corrupted_shard_is_detected_and_refetched_then_given_up(store, uploaded):
    index, blobs = uploaded
    key = index.keys()[1]
    src = H.StoreShardSource(store.access(), BUCKET, index, part_bytes=1 << 20, max_refetch=2)
    store.faults.corrupt(2, key=f"{BUCKET}/{key}")
    assert src.fetch(key) == blobs[key] and src.stats.refetches == 2
    store.faults.corrupt(3, key=f"{BUCKET}/{key}")
    with pytest.raises(H.ChecksumMismatch, match="after 3 fetches"):
        src.fetch(key)


def test_dead_and_hung_servers_fail_clearly_within_the_budget(store, uploaded):
    index, _ = uploaded
    with socket.socket() as sock:                                   # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = S.S3Access(f"http://127.0.0.1:{port}", connect_timeout=0.5, retry=S.RetryPolicy(max_attempts=3))
    _ = dead.client                                                 # built outside the timed part
    t0 = time.perf_counter()
    with pytest.raises(S.StoreUnavailable, match="Is the server running"):
        dead.get(BUCKET, "x")
    assert time.perf_counter() - t0 < 10
    hung = store.access(read_timeout=0.2, retry=S.RetryPolicy(max_attempts=2, deadline_s=2))
    _ = hung.client
    store.faults.delay(30, count=2, key=f"{BUCKET}/{index.keys()[2]}")
    t0 = time.perf_counter()
    with pytest.raises(S.StoreUnavailable, match="ReadTimeoutError"):
        hung.get(BUCKET, index.keys()[2])
    assert time.perf_counter() - t0 < 10
    store.faults.clear()


def test_modeled_store_is_never_faster_than_its_model(store, uploaded):
    s3 = store.access()
    s3.put(BUCKET, "bench", b"b" * 48 * 1024)
    model = S.CloudModel("test", 0.02, 1e6, 4e6)
    with store.modeled(model):
        for c in (1, 4, 8):
            x, total = S.throughput(s3, BUCKET, ["bench"] * c, c)
            assert total == c * 48 * 1024
            assert x <= 1.02 * model.throughput(48 * 1024, c)
    assert store.model is None
    assert abs(model.saturating_concurrency(1e6) - 4e6 * (0.02 + 1.0) / 1e6) < 1e-12
    assert S.CLOUD_S3.throughput(16e6, 1000) == S.CLOUD_S3.nic_bytes_per_s


def test_fsspec_caches_fetch_the_dataset_once_and_keep_all_of_it(store, uploaded, tmp_path):
    index, blobs = uploaded
    s3 = store.access()
    for kind in ("simplecache", "blockcache"):
        fs = fsspec.filesystem(kind, target_protocol="s3", target_options=s3.storage_options(),
                               cache_storage=str(tmp_path / kind))
        sent = []
        for _ in range(2):
            before = store.stats.bytes_out
            for key in index.keys():
                with fs.open(f"{BUCKET}/{key}", "rb") as f:
                    assert f.read() == blobs[key]
            sent.append(store.stats.bytes_out - before)
        assert sent == [index.nbytes, 0]


def test_tier1_counts_match_the_server(store, uploaded, tmp_path):
    index, _ = uploaded
    src = H.StoreShardSource(store.access(), BUCKET, index)
    cs = K.CachedSource(K.ShardCache(tmp_path, 3 * index.shard_bytes, "pin", min_item_bytes=index.shard_bytes), src)
    store.stats.reset()
    rows = K.run_epochs(cs, index.keys(), pattern="shuffled", epochs=3, seed=1, counter=lambda: store.stats.bytes_out)
    assert [r["hits"] for r in rows] == [0, 3, 3]
    assert [r["store_bytes"] for r in rows] == [8 * index.shard_bytes, 5 * index.shard_bytes, 5 * index.shard_bytes]
