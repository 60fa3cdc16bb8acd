"""On real gloo ranks: the streaming dataset equals one process's reader and trains like it; the distributed cache
makes the store send one copy per dataset, books peer bytes on the ledger exactly, and moves only a departed
rank's shards — also when a middle rank leaves and the survivors are renumbered (owners are keyed by node)."""
import pytest
import torch

from course_lib import optim
from course_lib.core.data import load_tokens
from course_lib.core.model import GPT, get_config
from course_lib.distributed.launch import launch
from course_lib.io import cache as K
from course_lib.io import shards as H
from course_lib.io import store as S
from course_lib.io import stream as R
from course_lib.io.workers import cache_worker, stream_worker
from course_lib.train import TrainConfig, optimizer_kwargs, run

pytestmark = pytest.mark.integration
BUCKET = "rank-data"


@pytest.fixture(scope="module")
def env():
    with S.ObjectStore() as st:
        index, blobs = H.build_shards(load_tokens("train")[:120_000], seq_len=32, num_shards=12)
        H.upload_shards(st.access(), BUCKET, index, blobs)
        yield st, index


@pytest.mark.parametrize("world_size", [2, 3])
def test_streaming_ranks_equal_the_single_process_reader_and_train_like_it(env, world_size):
    store, index = env
    cfg = get_config("nano").replace(seq_len=32)
    tc = TrainConfig(steps=3, batch_size=world_size * 4, seed=0, data_seed=0)
    out = launch(stream_worker, world_size, store.access(), BUCKET, index, micro_batch_size=4, seed=7,
                 shuffle_buffer=100, prefetch=3, workers=2, part_bytes=8192, concurrency=3, keep_steps=5,
                 train_steps=3, cfg=cfg, tc=tc, timeout=240)
    assert sorted(i for r in out for i in r["ids"]) == list(range(index.num_samples))
    single = R.GlobalBatches(H.StoreShardSource(store.access(), BUCKET, index), index, micro_batch_size=4,
                             dp_size=world_size, seed=7, shuffle_buffer=100)
    for step in range(5):
        gx, _ = single.get(step)
        assert torch.equal(torch.cat([r["batches"][step][0] for r in out]), gx)
    model = GPT(cfg, seed=0)
    ref = run(model, optim.build(model, **optimizer_kwargs(tc)), single, steps=3)
    for s in range(3):
        assert abs(sum(r["losses"][s] for r in out) / world_size - ref.losses[s]) < 1e-5


def test_distributed_cache_sends_one_copy_and_only_the_departed_ranks_shards_move(env, tmp_path):
    store, index = env
    keys, shard = index.keys(), index.shard_bytes
    n, epochs = 3, 2
    own = K.owners(K.Rendezvous(range(n)), keys)
    budget = max(sum(shard for k in keys if own[k] == r) for r in range(n))
    store.stats.reset()
    out = launch(cache_worker, n, store.access(), BUCKET, index, str(tmp_path), budget=budget, epochs=epochs,
                 seed=3, timeout=240)
    assert store.stats.bytes_out == index.nbytes == sum(r["store_total"] for r in out)   # one copy per dataset
    expect = sum(shard for e in range(epochs) for r in range(n) for s in R.epoch_shards(len(keys), e, 3, r, n)
                 if own[keys[s]] != r)
    assert sum(r["shard_bytes_sent"] for r in out) == sum(r["peer_bytes"] for r in out) == expect
    assert sorted(k for r in out for k in r["cached"]) == sorted(keys)
    after = K.Rendezvous(range(n - 1))
    budget = max(sum(shard for k in keys if after.owner(k) == r) for r in range(n - 1))
    store.stats.reset()
    launch(cache_worker, n - 1, store.access(), BUCKET, index, str(tmp_path), budget=budget, epochs=1, seed=3,
           first_epoch=epochs, timeout=240)
    assert store.stats.bytes_out == shard * sum(1 for k in keys if own[k] == n - 1)


def test_a_middle_rank_leaves_and_only_its_nodes_shards_move(env, tmp_path):
    store, index = env
    keys, shard = index.keys(), index.shard_bytes
    nodes = ["a", "b", "c", "d"]
    survivors = ["a", "c", "d"]                        # rank 1 ("b") died; "c" and "d" are now ranks 1 and 2
    own = K.owners(K.Rendezvous(nodes), keys)
    budget = max(sum(shard for k in keys if own[k] == n) for n in nodes)
    store.stats.reset()
    out = launch(cache_worker, 4, store.access(), BUCKET, index, str(tmp_path), budget=budget, epochs=1, seed=5,
                 nodes=nodes, timeout=240)
    assert store.stats.bytes_out == index.nbytes == sum(r["store_total"] for r in out)
    after = K.Rendezvous(survivors)
    budget = max(sum(shard for k in keys if after.owner(k) == n) for n in survivors)
    store.stats.reset()
    out = launch(cache_worker, 3, store.access(), BUCKET, index, str(tmp_path), budget=budget, epochs=1, seed=5,
                 first_epoch=1, nodes=survivors, timeout=240)
    lost = [k for k in keys if own[k] == "b"]
    assert sorted(K.moved_keys(K.Rendezvous(nodes), after, keys)) == sorted(lost)
    assert store.stats.bytes_out == shard * len(lost) == sum(r["store_total"] for r in out)
