"""The client side of the object store a data loader needs: ranged GETs through boto3 with bounded retries
(exponential backoff with full jitter, as AWS advises for 503 SlowDown: M. Brooker, "Exponential Backoff And
Jitter", AWS Architecture Blog, 2015), per-client counters, and a closed-loop throughput measurement.
"""
from __future__ import annotations

import collections
import contextlib
import os
import random
import threading
import time
from dataclasses import dataclass, field

from .model import CREDENTIALS, REGION, ObjectNotFound, StoreError, StoreThrottled, StoreUnavailable


# =============================================================================================== clients
@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and full jitter: before retry k (k = 1, 2, …) sleep a uniform
    random time in [0, min(cap_s, base_s·2^(k−1))]; give up after `max_attempts` attempts or `deadline_s`."""
    max_attempts: int = 5
    base_s: float = 0.02
    cap_s: float = 0.5
    deadline_s: float = 10.0

    def __post_init__(self):
        if self.max_attempts < 1 or self.base_s < 0 or self.cap_s < self.base_s or self.deadline_s <= 0:
            raise ValueError(f"RetryPolicy needs max_attempts >= 1, 0 <= base_s <= cap_s, deadline_s > 0: {self}")

    def ceiling(self, retry: int) -> float:
        """The largest sleep before retry number `retry` (1-based)."""
        return min(self.cap_s, self.base_s * 2 ** (retry - 1))

    def backoff(self, retry: int, rng: random.Random) -> float:
        return rng.uniform(0.0, self.ceiling(retry))


@dataclass
class ClientStats:
    """What this process's client did: attempts, retries and the sleeps before them (thread-safe)."""
    attempts: int = 0
    retries: int = 0
    sleeps: list = field(default_factory=list)
    errors: collections.Counter = field(default_factory=collections.Counter)
    bytes_in: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                if k == "sleep":
                    self.sleeps.append(v)
                elif k == "error":
                    self.errors[v] += 1
                else:
                    setattr(self, k, getattr(self, k) + v)


_RETRYABLE_CODES = {"SlowDown", "503", "ServiceUnavailable", "InternalError", "500", "RequestTimeout", "Throttling"}
_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}


class S3Access:
    """How a process talks to the store: the endpoint, dummy credentials, timeouts and the retry policy. Picklable
    and fork-safe: each process (each forked rank) builds its own boto3 client the first time it needs one."""

    def __init__(self, endpoint_url: str, *, connect_timeout: float = 2.0, read_timeout: float = 10.0,
                 max_pool_connections: int = 64, retry: RetryPolicy = RetryPolicy(), seed: int = 0):
        if not endpoint_url.startswith("http://127.") and not endpoint_url.startswith("http://localhost"):
            raise ValueError(f"endpoint {endpoint_url!r} is not on loopback: the course never sends traffic off "
                             f"this machine")
        self.endpoint_url = endpoint_url
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_pool_connections, self.retry, self.seed = max_pool_connections, retry, seed
        self.stats = ClientStats()
        self._client, self._pid, self._lock = None, None, threading.Lock()
        self._rng = random.Random(seed)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_client=None, _pid=None, _lock=None, stats=ClientStats())
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def client(self):
        """A boto3 S3 client for this process (botocore's own retries off: the course's policy retries)."""
        pid = os.getpid()
        if self._pid != pid:                              # first use, or a forked child: nothing inherited
            self._client, self._pid, self._lock = None, pid, threading.Lock()
        if self._client is None:
            with self._lock:
                if self._client is None:
                    import boto3
                    from botocore.config import Config
                    cfg = Config(connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                                 retries={"total_max_attempts": 1, "mode": "standard"},
                                 max_pool_connections=self.max_pool_connections, s3={"addressing_style": "path"},
                                 # botocore would check a whole-object CRC where the server keeps one, but no
                                 # ranged GET has one: the shard index's sha256 is the check, the same for both
                                 request_checksum_calculation="when_required",
                                 response_checksum_validation="when_required")
                    self._client = boto3.session.Session().client(
                        "s3", endpoint_url=self.endpoint_url, region_name=REGION, config=cfg, **CREDENTIALS)
        return self._client

    def close(self) -> None:
        """Close the boto3 client's connection pool (its sockets to the store). Idempotent; a later call to
        `client` builds a new one."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> S3Access:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def filesystem(self, **kw):
        """An s3fs filesystem on the same endpoint (what fsspec's caches sit on)."""
        import s3fs
        return s3fs.S3FileSystem(key=CREDENTIALS["aws_access_key_id"], secret=CREDENTIALS["aws_secret_access_key"],
                                 endpoint_url=self.endpoint_url, client_kwargs={"region_name": REGION},
                                 skip_instance_cache=True, use_listings_cache=False, **kw)

    def storage_options(self) -> dict:
        """`fsspec.open("simplecache::s3://…", s3=access.storage_options())`."""
        return {"key": CREDENTIALS["aws_access_key_id"], "secret": CREDENTIALS["aws_secret_access_key"],
                "endpoint_url": self.endpoint_url, "client_kwargs": {"region_name": REGION},
                "skip_instance_cache": True, "use_listings_cache": False}

    # -- calls with the course's retries
    def call(self, what: str, fn, *, bucket: str, key: str | None = None):
        """Run fn() (one S3 request) with the retry policy; translate failures into one clear error."""
        from botocore.exceptions import ClientError, HTTPClientError, ReadTimeoutError
        from botocore.exceptions import ConnectionError as BotoConnectionError
        policy, start, last = self.retry, time.perf_counter(), None
        for attempt in range(1, policy.max_attempts + 1):
            self.stats.add(attempts=1)
            try:
                return fn()
            except ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code in _NOT_FOUND or status == 404:
                    raise ObjectNotFound(self._not_found(code, bucket, key)) from None
                if code not in _RETRYABLE_CODES and status not in (500, 503):
                    raise StoreError(f"{what} s3://{bucket}/{key or ''} failed: {code}: {e}") from None
                last, kind = e, "throttled"
            except (BotoConnectionError, ReadTimeoutError, HTTPClientError) as e:
                last, kind = e, "unreachable"
            self.stats.add(error=kind)
            elapsed = time.perf_counter() - start
            if attempt == policy.max_attempts:
                break
            with self._lock:
                pause = policy.backoff(attempt, self._rng)
            if elapsed + pause > policy.deadline_s:
                break
            self.stats.add(retries=1, sleep=pause)
            time.sleep(pause)
        elapsed = time.perf_counter() - start
        target = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
        if kind == "throttled":
            raise StoreThrottled(f"{what} {target}: the store answered '{_code(last)}' to all {attempt} attempts in "
                                 f"{elapsed:.1f} s. Fewer concurrent requests, or a larger RetryPolicy"
                                 f"(max_attempts=…), let it recover.") from None
        raise StoreUnavailable(f"{what} {target}: no answer from the object store at {self.endpoint_url} after "
                               f"{attempt} attempt(s) in {elapsed:.1f} s ({type(last).__name__}). Is the server "
                               f"running? An ObjectStore stops when its `with` block ends.") from None

    def _not_found(self, code: str, bucket: str, key: str | None) -> str:
        try:
            buckets = sorted(b["Name"] for b in self.client.list_buckets().get("Buckets", []))
        except Exception:  # noqa: BLE001 - the hint is best effort
            buckets = []
        if code == "NoSuchBucket" or bucket not in buckets:
            return f"no bucket {bucket!r} on {self.endpoint_url}; buckets there: {buckets or 'none'}. " \
                   f"Upload the shards first (course_lib.io.shards.upload_shards) or fix the bucket name."
        return f"no object {key!r} in bucket {bucket!r}; check the key (shard keys come from the index: " \
               f"course_lib.io.shards.load_index)"

    def get(self, bucket: str, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """GET an object, or its bytes [start, end) with a Range header; retried per the policy."""
        kw = {"Range": f"bytes={start}-{end - 1}"} if start is not None else {}

        def once():
            body = self.client.get_object(Bucket=bucket, Key=key, **kw)["Body"]
            try:
                return body.read()
            finally:
                body.close()
        data = self.call("GET", once, bucket=bucket, key=key)
        self.stats.add(bytes_in=len(data))
        return data

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.call("PUT", lambda: self.client.put_object(Bucket=bucket, Key=key, Body=data), bucket=bucket, key=key)

    def size(self, bucket: str, key: str) -> int:
        return self.call("HEAD", lambda: self.client.head_object(Bucket=bucket, Key=key),
                         bucket=bucket, key=key)["ContentLength"]

    def ensure_bucket(self, bucket: str) -> None:
        """Create `bucket` if it is not there yet."""
        names = {b["Name"] for b in self.call("LIST", self.client.list_buckets, bucket=bucket).get("Buckets", [])}
        if bucket not in names:
            self.call("CREATE", lambda: self.client.create_bucket(Bucket=bucket), bucket=bucket)

    def first_byte(self, bucket: str, key: str) -> tuple[float, float, int]:
        """(seconds to the first body byte, seconds to the last, bytes) of one GET: latency and transfer apart."""
        t0 = time.perf_counter()
        body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
        first = body.read(1)
        t1 = time.perf_counter()
        rest = body.read()
        t2 = time.perf_counter()
        body.close()
        return t1 - t0, t2 - t0, len(first) + len(rest)


def _code(err) -> str:
    with contextlib.suppress(Exception):
        return err.response["Error"]["Code"]
    return type(err).__name__


# =============================================================================================== measurements
def throughput(access: S3Access, bucket: str, keys: list, concurrency: int, *, repeats: int = 1) -> tuple[float, int]:
    """GET every key `repeats` times with `concurrency` requests in flight (a closed loop: each worker starts its
    next GET when the last one ends); return (bytes/s, bytes)."""
    from concurrent.futures import ThreadPoolExecutor
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    jobs = [k for _ in range(repeats) for k in keys]
    _ = access.client                                     # build the client outside the timed region
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(len(b) for b in pool.map(lambda k: access.get(bucket, k), jobs))
    return total / (time.perf_counter() - t0), total
