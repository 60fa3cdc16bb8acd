"""The stream's plan: a shuffle buffer emits a permutation, ranks partition every epoch exactly, the order is a pure
function of (seed, epoch, rank), and positions resume exactly. In-memory shards, no store."""
import hashlib

import numpy as np
import pytest
import torch

from course_lib.core.data import load_tokens
from course_lib.io import shards as H
from course_lib.io import stream as R


class MemorySource:
    def __init__(self, blobs):
        self.blobs, self.fetches = blobs, 0

    def fetch(self, key):
        self.fetches += 1
        return self.blobs[key]


@pytest.fixture(scope="module")
def built():
    return H.build_shards(load_tokens("train")[:60_000], seq_len=16, num_shards=12)


def test_build_shards_makes_equal_shards_of_whole_samples_with_checksums(built):
    index, blobs = built
    assert index.num_shards == 12 and all(len(b) == index.shard_bytes for b in blobs.values())
    assert index.num_samples * 17 + index.tokens_dropped == 60_000
    assert all(hashlib.sha256(blobs[s.key]).hexdigest() == s.sha256 for s in index.shards)
    samples = index.decode(blobs[index.shards[1].key])                  # (P, T+1)
    first = load_tokens("train")[index.samples_per_shard * 17: index.samples_per_shard * 17 + 17]
    assert torch.equal(samples[0], first)
    assert H.ShardIndex.from_json(index.to_json()) == index


def test_shuffle_buffer_is_a_permutation_and_size_one_keeps_the_order():
    items = list(range(500))
    for b in (1, 7, 100, 1000):
        out = R.shuffle_buffer(items, b, np.random.default_rng(0))
        assert sorted(out) == items
        assert (out == items) == (b == 1)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_every_sample_exactly_once_per_epoch_across_ranks(built, dp_size):
    index, _ = built
    for epoch in range(3):
        ids = [i for r in range(dp_size)
               for i in R.epoch_order(index, epoch, seed=5, dp_rank=r, dp_size=dp_size, buffer_size=64)]
        assert sorted(ids) == list(range(index.num_samples))
    a = R.epoch_order(index, 0, seed=5, dp_rank=0, dp_size=dp_size, buffer_size=64)
    assert a == R.epoch_order(index, 0, seed=5, dp_rank=0, dp_size=dp_size, buffer_size=64)
    assert a != R.epoch_order(index, 1, seed=5, dp_rank=0, dp_size=dp_size, buffer_size=64)


def test_prefetching_stream_equals_the_single_process_reader(built):
    index, blobs = built
    single = R.GlobalBatches(MemorySource(blobs), index, micro_batch_size=3, dp_size=3, num_microbatches=2, seed=1,
                             shuffle_buffer=50)
    ranks = [R.StreamingBatches(MemorySource(blobs), index, micro_batch_size=3, num_microbatches=2, dp_rank=r,
                                dp_size=3, seed=1, shuffle_buffer=50, prefetch=3, workers=2) for r in range(3)]
    steps = int(2.5 * ranks[0].steps_per_epoch)                          # across two epoch boundaries
    for step in range(steps):
        for micro in range(2):
            gx, gy = single.get(step, micro)
            xs, ys = zip(*(r.get(step, micro) for r in ranks))
            assert torch.equal(torch.cat(xs), gx) and torch.equal(torch.cat(ys), gy)
            assert torch.equal(gx[:, 1:], gy[:, :-1])
    for r in ranks:
        r.close()


def test_resume_from_a_state_dict_is_exact_and_rejects_another_setup(built):
    index, blobs = built
    make = lambda **kw: R.StreamingBatches(MemorySource(blobs), index, micro_batch_size=4, dp_rank=1, dp_size=2,  # noqa: E731
                                           seed=2, shuffle_buffer=32, **kw)
    a = make()
    for _ in range(37):
        a.next_batch()
    state = a.state_dict()
    want = [a.next_batch() for _ in range(40)]
    b = make(prefetch=0, workers=0)
    b.load_state_dict(state)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(want, [b.next_batch() for _ in range(40)]))
    other = R.StreamingBatches(MemorySource(blobs), index, micro_batch_size=4, dp_rank=0, dp_size=2, seed=2,
                               shuffle_buffer=32)
    with pytest.raises(ValueError, match="saved for other shards"):
        other.load_state_dict(state)


def test_each_shard_is_fetched_once_per_epoch_and_prefetch_stops_at_the_end(built):
    index, blobs = built
    src = MemorySource(blobs)
    s = R.StreamingBatches(src, index, micro_batch_size=5, dp_rank=0, dp_size=4, seed=0, prefetch=2, workers=2,
                           epochs=2)
    s.samples(0, 2 * s.samples_per_epoch)
    s.close()
    assert src.fetches == 2 * index.num_shards // 4
    with pytest.raises(IndexError, match="ends after 2 epoch"):
        s.samples(2 * s.samples_per_epoch, 1)


def test_bad_stream_settings_are_refused_before_any_fetch(built):
    index, blobs = built
    with pytest.raises(ValueError, match="multiple of 5"):
        R.StreamingBatches(MemorySource(blobs), index, micro_batch_size=2, dp_rank=0, dp_size=5)
    with pytest.raises(ValueError, match="dp_rank 3 is outside"):
        R.StreamingBatches(MemorySource(blobs), index, micro_batch_size=2, dp_rank=3, dp_size=3)
    with pytest.raises(ValueError, match="too few"):
        H.build_shards(load_tokens("train")[:100], seq_len=64, num_shards=8)
