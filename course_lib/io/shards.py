"""The corpus as fixed-size token shards in an object store: an index with a sha256 per shard, upload, and the
shard fetch a loader runs — concurrent ranged GETs, checked against the index, re-fetched when corrupted.

Layout (the nanoGPT-style `.bin` shard: raw little-endian uint16 token ids, no header):

    s3://BUCKET/PREFIX/index.json          seq_len, dtype, samples per shard, and per shard: key, bytes, sha256
    s3://BUCKET/PREFIX/shard-00000.bin     samples_per_shard samples of seq_len + 1 tokens each (x and y = x
    s3://BUCKET/PREFIX/shard-00001.bin     shifted by one come from the same sample), every shard the same size
    …

A sample never crosses a shard, so any shard can be read alone; the tokens that do not fill a last shard are left
out (the index records how many). Sample `i` of shard `s` has the global id `s · samples_per_shard + i`.
"""
from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .store import S3Access, StoreError

DTYPE = "uint16"               # token ids < 65,536: two bytes per token (the byte tokenizer needs only 256)
INDEX_NAME = "index.json"


class ShardIndexMismatch(StoreError):
    """The index and the objects in the store disagree (a missing shard, a wrong size)."""


class ChecksumMismatch(StoreError):
    """A shard's bytes kept failing its sha256 after every re-fetch."""


@dataclass(frozen=True)
class ShardInfo:
    key: str                   # object key in the bucket
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class ShardIndex:
    """What is in the store: every shard's key, size and checksum, and how to cut it into samples."""
    seq_len: int
    samples_per_shard: int
    shards: tuple
    dtype: str = DTYPE
    tokens_dropped: int = 0            # corpus tokens that did not fill a whole last shard
    corpus_sha256: str = ""

    @property
    def sample_tokens(self) -> int:
        return self.seq_len + 1

    @property
    def token_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def shard_bytes(self) -> int:
        return self.samples_per_shard * self.sample_tokens * self.token_bytes

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def num_samples(self) -> int:
        return self.num_shards * self.samples_per_shard

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def keys(self) -> list:
        return [s.key for s in self.shards]

    def info(self, key: str) -> ShardInfo:
        try:
            return self._by_key()[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a shard of this index ({self.num_shards} shards, e.g. "
                           f"{self.shards[0].key!r})") from None

    def _by_key(self) -> dict:
        cache = self.__dict__.get("_by_key_cache")
        if cache is None:
            cache = {s.key: s for s in self.shards}
            object.__setattr__(self, "_by_key_cache", cache)
        return cache

    def to_json(self) -> bytes:
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        return json.dumps(d, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ShardIndex:
        d = json.loads(data)
        d["shards"] = tuple(ShardInfo(**s) for s in d["shards"])
        return cls(**d)

    def decode(self, blob: bytes) -> torch.Tensor:
        """A shard's bytes as its samples: (samples_per_shard, seq_len + 1) int64 token ids."""
        if len(blob) != self.shard_bytes:
            raise ShardIndexMismatch(f"a shard has {len(blob):,} bytes, the index says {self.shard_bytes:,}")
        tokens = np.frombuffer(blob, dtype=np.dtype(self.dtype).newbyteorder("<"))
        return torch.from_numpy(tokens.astype(np.int64)).view(self.samples_per_shard, self.sample_tokens)


def build_shards(tokens: torch.Tensor, *, seq_len: int, num_shards: int, prefix: str = "shards",
                 corpus_sha256: str = "") -> tuple[ShardIndex, dict]:
    """Cut `tokens` (1-D ids) into `num_shards` equal shards of whole samples; return (index, {key: bytes})."""
    if seq_len < 1 or num_shards < 1:
        raise ValueError(f"seq_len and num_shards must be positive, got seq_len={seq_len}, num_shards={num_shards}")
    if tokens.numel() and int(tokens.max()) >= 2 ** 16:
        raise ValueError("token ids must fit uint16 (< 65,536) for this shard format")
    n_samples = tokens.numel() // (seq_len + 1)
    per_shard = n_samples // num_shards
    if per_shard < 1:
        raise ValueError(f"{tokens.numel():,} tokens make only {n_samples} samples of {seq_len + 1} tokens: too few "
                         f"for {num_shards} shards. Use fewer shards or a shorter seq_len")
    used = num_shards * per_shard * (seq_len + 1)
    body = tokens[:used].numpy().astype("<u2").reshape(num_shards, -1)      # (num_shards, per_shard·(T+1))
    blobs, infos = {}, []
    for s in range(num_shards):
        key = f"{prefix}/shard-{s:05d}.bin"
        blob = body[s].tobytes()
        blobs[key] = blob
        infos.append(ShardInfo(key, len(blob), hashlib.sha256(blob).hexdigest()))
    index = ShardIndex(seq_len, per_shard, tuple(infos), DTYPE, tokens.numel() - used, corpus_sha256)
    return index, blobs


def index_key(prefix: str) -> str:
    return f"{prefix}/{INDEX_NAME}"


def upload_shards(access: S3Access, bucket: str, index: ShardIndex, blobs: dict, *, prefix: str = "shards",
                  concurrency: int = 8) -> int:
    """Create the bucket if needed, PUT every shard (concurrently), then the index last (so a reader that finds
    the index finds every shard). Returns the bytes uploaded."""
    access.ensure_bucket(bucket)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda k: access.put(bucket, k, blobs[k]), index.keys()))
    access.put(bucket, index_key(prefix), index.to_json())
    return sum(len(b) for b in blobs.values())


def load_index(access: S3Access, bucket: str, prefix: str = "shards", *, verify: bool = True,
               concurrency: int = 8) -> ShardIndex:
    """Read the index; with verify=True, HEAD every shard and raise one ShardIndexMismatch naming every shard that
    is missing or has another size than the index says."""
    index = ShardIndex.from_json(access.get(bucket, index_key(prefix)))
    if verify:
        def size_or_none(info):
            try:
                return access.size(bucket, info.key)
            except StoreError:
                return None
        with ThreadPoolExecutor(concurrency) as pool:
            sizes = list(pool.map(size_or_none, index.shards))
        bad = [f"{i.key} ({'missing' if n is None else f'{n:,} bytes, index says {i.nbytes:,}'})"
               for i, n in zip(index.shards, sizes) if n != i.nbytes]
        if bad:
            raise ShardIndexMismatch(
                f"the index s3://{bucket}/{index_key(prefix)} disagrees with the store for {len(bad)} of "
                f"{index.num_shards} shards: {', '.join(bad[:4])}{' …' if len(bad) > 4 else ''}. Re-upload the "
                f"shards and the index together (upload_shards).")
    return index


@dataclass
class FetchStats:
    shards: int = 0
    bytes: int = 0
    requests: int = 0
    refetches: int = 0               # whole-shard re-fetches after a checksum mismatch
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


class StoreShardSource:
    """Fetch a shard straight from the store: `ceil(nbytes / part_bytes)` ranged GETs in flight together (up to
    `concurrency`), joined and checked against the index's sha256; a mismatch is re-fetched up to `max_refetch`
    times, then raises ChecksumMismatch. Thread-safe: the loader's prefetch threads share one source."""

    def __init__(self, access: S3Access, bucket: str, index: ShardIndex, *, part_bytes: int = 64 * 1024,
                 concurrency: int = 4, max_refetch: int = 2):
        if part_bytes < 1 or concurrency < 1 or max_refetch < 0:
            raise ValueError("part_bytes and concurrency must be >= 1 and max_refetch >= 0")
        self.access, self.bucket, self.index = access, bucket, index
        self.part_bytes, self.concurrency, self.max_refetch = part_bytes, concurrency, max_refetch
        self.stats = FetchStats()
        self._pool = None
        self._pool_lock = threading.Lock()

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_pool=None, _pool_lock=None, stats=FetchStats())
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._pool_lock = threading.Lock()

    def _parts(self, nbytes: int) -> list:
        return [(a, min(a + self.part_bytes, nbytes)) for a in range(0, nbytes, self.part_bytes)]

    def _get_parts(self, key: str, nbytes: int) -> bytes:
        parts = self._parts(nbytes)
        self.stats.add(requests=len(parts))
        if len(parts) == 1 or self.concurrency == 1:
            return b"".join(self.access.get(self.bucket, key, a, b) for a, b in parts)
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="ranged-get")
        return b"".join(self._pool.map(lambda ab: self.access.get(self.bucket, key, *ab), parts))

    def fetch(self, key: str) -> bytes:
        info = self.index.info(key)
        for attempt in range(self.max_refetch + 1):
            blob = self._get_parts(key, info.nbytes)
            self.stats.add(bytes=len(blob))
            if len(blob) == info.nbytes and hashlib.sha256(blob).hexdigest() == info.sha256:
                self.stats.add(shards=1)
                return blob
            if attempt < self.max_refetch:
                self.stats.add(refetches=1)
        raise ChecksumMismatch(f"s3://{self.bucket}/{key}: sha256 of the bytes received differs from the index after "
                               f"{self.max_refetch + 1} fetches; the object in the store is damaged or the index is "
                               f"stale — re-upload it (upload_shards)")

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


__all__ = ["ShardIndex", "ShardInfo", "build_shards", "upload_shards", "load_index", "index_key",
           "StoreShardSource", "ShardIndexMismatch", "ChecksumMismatch", "DTYPE"]
