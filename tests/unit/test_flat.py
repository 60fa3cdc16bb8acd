"""The course's one flat-buffer layout and its one bucketing rule (course_lib.distributed.flat)."""
import pytest
import torch

from course_lib.distributed.flat import FlatBuffer, bucket_params, padded_numel


def _params(*numels, dtype=torch.float32):
    return [torch.zeros(n, dtype=dtype) for n in numels]


def test_buckets_walk_backwards_and_close_once_they_hold_at_least_the_cap():
    a, b, c, d, e = _params(10, 20, 5, 40, 1)               # 4 bytes each: 40, 80, 20, 160, 4
    buckets = bucket_params([a, b, c, d, e], cap_bytes=100)
    assert [[t.numel() for t in bk] for bk in buckets] == [[1, 40], [5, 20], [10]]   # 164 ≥ 100; 100 ≥ 100; rest
    assert all(sum(t.numel() * 4 for t in bk) >= 100 for bk in buckets[:-1])


def test_a_tensor_larger_than_the_cap_gets_a_bucket_of_its_own_and_none_means_one_bucket():
    small, big = _params(2, 1000)
    assert [[t.numel() for t in bk] for bk in bucket_params([small, big], 64)] == [[1000], [2]]
    assert len(bucket_params(_params(3, 4, 5), None)) == 1


def test_one_dtype_per_bucket():
    f = _params(8)[0]
    h = _params(8, dtype=torch.bfloat16)[0]
    buckets = bucket_params([f, h, f.clone()], None)
    assert sorted(len(bk) for bk in buckets) == [1, 2] and all(len({t.dtype for t in bk}) == 1 for bk in buckets)


@pytest.mark.parametrize("cap", [0, -1, 1.5, True])
def test_bad_cap_says_what_to_change(cap):
    with pytest.raises(ValueError, match="bucket_cap_bytes"):
        bucket_params(_params(3), cap)


def test_layout_pads_to_a_multiple_of_the_shards_and_views_write_the_buffer():
    a = torch.arange(5.0)
    b = torch.arange(6.0).view(2, 3)
    c = torch.arange(3.0)
    fb = FlatBuffer([a, b, c], shards=4)
    assert (fb.numel, fb.padded, fb.shard_numel) == (14, 16, 4) and padded_numel(14, 4) == 16
    buf = fb.pack(fb.new(), [a, b, None])
    assert torch.equal(fb.view(buf, b), b) and torch.equal(fb.view(buf, 2), torch.zeros(3))
    assert buf[14:].abs().sum() == 0                         # the padding holds zeros
    fb.view(buf, 0).fill_(7)
    assert torch.equal(buf[:5], torch.full((5,), 7.0))
    assert torch.equal(fb.shard(buf, 2), buf[8:12])
    with pytest.raises(ValueError, match="outside"):
        fb.shard(buf, 4)


def test_a_layout_from_shapes_needs_no_tensors():
    fb = FlatBuffer(shapes=[(2, 3), 4], dtype=torch.bfloat16, shards=3)
    assert fb.numel == 10 and fb.padded == 12 and fb.new().dtype == torch.bfloat16
    with pytest.raises(ValueError, match="share a dtype"):
        FlatBuffer([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
