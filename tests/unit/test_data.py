import hashlib

import pytest
import torch

from course_lib.core.data import CORPUS_PATH, CORPUS_SHA256, ByteTokenizer, ShardedBatches, load_corpus, load_tokens


def test_corpus_is_shipped_small_and_unchanged():
    data = load_corpus()
    assert CORPUS_PATH.stat().st_size <= 5 * 2**20
    assert hashlib.sha256(data).hexdigest() == CORPUS_SHA256
    assert (CORPUS_PATH.parent / "README.md").exists() and (CORPUS_PATH.parent / "LICENSE-PSF.txt").exists()


def test_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    for text in ["hello", "naïve ≠ 𝔘nicode", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 256


def test_splits_partition_the_corpus():
    assert len(load_tokens("train")) + len(load_tokens("val")) == len(load_corpus())
    with pytest.raises(ValueError):
        load_tokens("test")


@pytest.mark.parametrize("world_size, accum", [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_ranks_and_microsteps_together_see_exactly_the_global_batch(world_size, accum):
    b = 2
    ref = ShardedBatches(32, world_size * b * accum, seed=7)
    for step in (0, 5):
        X, Y = ref.global_batch(step)
        parts = [ShardedBatches(32, b, world_size=world_size, rank=r, num_microbatches=accum, seed=7).get(step, m)
                 for m in range(accum) for r in range(world_size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), X)
        assert torch.equal(torch.cat([p[1] for p in parts]), Y)
    assert torch.equal(X[:, 1:], Y[:, :-1])   # targets are inputs shifted by one


def test_batches_are_deterministic_and_vary_with_step():
    a, b = ShardedBatches(16, 4, seed=1), ShardedBatches(16, 4, seed=1)
    assert torch.equal(a.get(3)[0], b.get(3)[0])
    assert not torch.equal(a.get(3)[0], a.get(4)[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=16, micro_batch_size=0), "micro_batch_size"),
    (dict(seq_len=16, micro_batch_size=2, world_size=2, rank=2), "outside"),
    (dict(seq_len=10**7, micro_batch_size=1), "too long"),
])
def test_bad_sampler_input_says_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardedBatches(**kwargs)
    with pytest.raises(ValueError, match="micro-step"):
        ShardedBatches(16, 2).get(0, micro=1)
