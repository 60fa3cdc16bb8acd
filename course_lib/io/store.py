"""An S3-compatible object store on loopback, a modeled cloud store injected into its server path, and the client
side a data loader needs: ranged GETs with bounded retries (exponential backoff with full jitter).

    with ObjectStore() as store:                  # moto's S3 server on 127.0.0.1, a free port; gone after the block
        s3 = store.access()                       # endpoint + dummy credentials; `.client` is a real boto3 client
        s3.client.create_bucket(Bucket="data")
        store.model = INJECTED_CLOUD              # every response now pays α and the rates below (modeled)
        store.faults.slow_down(2)                 # the next 2 GETs answer 503 SlowDown

The server is moto's `ThreadedMotoServer`, with its WSGI application wrapped by `ServerHooks` (a server-side hook,
no proxy): the hook counts the object bytes the store sends (egress), and can hold each response so that it
behaves like a cloud store — first byte after α, then at most B_conn bytes/s per connection, and all connections
together at most B_nic (a FIFO link). Through it, throughput with c concurrent requests of S bytes follows
docs/formulas.md §10.2:

    X(c) = min( c·S / (α + S/B_conn),  B_nic )          saturating at c* = B_nic·(α + S/B_conn)/S

Every number that comes out of the injected model is *modeled* (a calibrated stand-in for a cloud store), never a
measurement of one. Retries follow AWS's advice for 503 SlowDown: back off exponentially, with jitter, a bounded
number of times (M. Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015: "full jitter").
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from ..costmodel import Link

REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}   # moto accepts any
CHUNK = 16 * 1024           # bytes per paced write of the modeled store (the pacing granularity)

# werkzeug logs every request at INFO; moto's server is chatty too. The course shows its own counters instead.
for _name in ("werkzeug", "moto", "botocore", "s3fs", "aiobotocore"):
    logging.getLogger(_name).setLevel(logging.ERROR)


# =============================================================================================== errors
class StoreError(RuntimeError):
    """Something about the object store went wrong; the message says what and what to do."""


class ObjectNotFound(StoreError, KeyError):
    """The bucket or key does not exist (not retried: asking again cannot make it appear)."""

    def __str__(self):              # KeyError would quote the message
        return self.args[0]


class StoreUnavailable(StoreError):
    """No answer from the server within the retry budget: it is down, unreachable or hung."""


class StoreThrottled(StoreError):
    """The server kept answering 503 SlowDown (or 500) after every retry."""


# =============================================================================================== the cloud model
@dataclass(frozen=True)
class CloudModel:
    """A cloud object store as the α–β model of docs/formulas.md §10.2 (always *modeled*).

    first_byte_s: α, from request to first byte. conn_bytes_per_s: B_conn, the streaming rate of one request.
    nic_bytes_per_s: B_nic, the rate of the client's network link (all requests share it).
    """
    name: str
    first_byte_s: float
    conn_bytes_per_s: float
    nic_bytes_per_s: float
    source: str = ""

    def __post_init__(self):
        if not (self.first_byte_s >= 0 and self.conn_bytes_per_s > 0 and self.nic_bytes_per_s > 0):
            raise ValueError(f"CloudModel needs α >= 0 and positive rates, got {self}")

    @property
    def link(self) -> Link:
        """One request as an α–β link (formulas §9.3): t(S) = α + S/B_conn."""
        return Link(self.name, self.first_byte_s, self.conn_bytes_per_s, self.source, kind="modeled")

    def request_time(self, nbytes: float) -> float:
        return self.link.time(nbytes)

    def throughput(self, nbytes: float, concurrency: int) -> float:
        """X(c) = min(c·S/(α + S/B_conn), B_nic), bytes/s (formulas §10.2)."""
        return min(concurrency * nbytes / self.request_time(nbytes), self.nic_bytes_per_s)

    def saturating_concurrency(self, nbytes: float) -> float:
        """c* = B_nic·(α + S/B_conn)/S: requests in flight needed to fill the link (formulas §10.2)."""
        return self.nic_bytes_per_s * self.request_time(nbytes) / nbytes

    def scaled(self, factor: float, name: str | None = None) -> "CloudModel":
        """Every rate (and so every size that matters, like n½ = α·B_conn) divided by `factor`, times kept: the
        same curves in units `factor` times smaller, small enough for a laptop to serve."""
        return CloudModel(name or f"{self.name}, rates ÷{factor:g}", self.first_byte_s,
                          self.conn_bytes_per_s / factor, self.nic_bytes_per_s / factor,
                          f"{self.source}; every rate divided by {factor:g}, times kept")

    def label(self) -> str:
        return (f"{self.name} (modeled: α = {self.first_byte_s * 1e3:.0f} ms, B_conn = {self.conn_bytes_per_s / 1e6:.3g} "
                f"MB/s, B_nic = {self.nic_bytes_per_s / 1e6:.4g} MB/s)")


# formulas §10.1: one request per 85–90 MB/s; ~15 requests fill a 10 Gb/s NIC. First byte: AWS quotes 100–200 ms
# as the consistent figure; we take 50 ms ("tens of ms") for the request of a warm connection. Modeled.
CLOUD_S3 = CloudModel("cloud object store", 0.050, 85e6, 1.25e9,
                      "formulas §10.1: 85 MB/s per request, 10 Gb/s NIC; first byte 'tens of ms' (AWS: 100–200 ms)")
# What the server injects in notebook 11: the same store with every rate ÷100 (10 Gb/s → 12.5 MB/s), so one
# moto server on 2 cores can serve it; n½ = α·B_conn and c* ≈ B_nic/B_conn keep their real ratios.
INJECTED_CLOUD = CLOUD_S3.scaled(100, "cloud store at 1:100")


# =============================================================================================== the server hooks
@dataclass
class Fault:
    """One injected fault. kind: 'slowdown' (503 SlowDown) | 'error' (500) | 'delay' (hold the response `seconds`)
    | 'corrupt' (flip one byte of the body). Applies to the next `count` object GETs matching `key` (None: any)."""
    kind: str
    count: int
    key: str | None = None
    seconds: float = 0.0


class FaultPlan:
    """The faults the server will inject, consumed in order by matching object GETs (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[Fault] = []
        self.injected = collections.Counter()          # kind -> how many times it fired

    def _add(self, fault: Fault) -> None:
        if fault.count < 1:
            raise ValueError(f"a fault needs count >= 1, got {fault.count}")
        with self._lock:
            self._pending.append(fault)

    def slow_down(self, count: int = 1, key: str | None = None) -> None:
        """The next `count` GETs (of `key`) answer 503 SlowDown, as S3 does when a prefix is over its request rate."""
        self._add(Fault("slowdown", count, key))

    def server_error(self, count: int = 1, key: str | None = None) -> None:
        self._add(Fault("error", count, key))

    def delay(self, seconds: float, count: int = 1, key: str | None = None) -> None:
        """The next `count` GETs wait `seconds` before answering (a slow or hung server)."""
        self._add(Fault("delay", count, key, seconds))

    def corrupt(self, count: int = 1, key: str | None = None) -> None:
        """The next `count` GETs of `key` return the right length with one byte flipped (bit rot on the way)."""
        self._add(Fault("corrupt", count, key))

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()

    def take(self, key: str) -> Fault | None:
        with self._lock:
            for f in self._pending:
                if f.key is None or f.key == key:
                    f.count -= 1
                    if f.count == 0:
                        self._pending.remove(f)
                    self.injected[f.kind] += 1
                    return f
        return None


@dataclass
class ServerStats:
    """What the server sent: object bytes per key (egress) and request counts (thread-safe updates)."""
    bytes_out: int = 0
    gets: int = 0
    requests: collections.Counter = field(default_factory=collections.Counter)   # method -> count
    by_key: collections.Counter = field(default_factory=collections.Counter)     # key -> bytes
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _count(self, method: str, key: str | None, nbytes: int) -> None:
        with self._lock:
            self.requests[method] += 1
            if key is not None and method == "GET":
                self.gets += 1
                self.bytes_out += nbytes
                self.by_key[key] += nbytes

    def reset(self) -> None:
        with self._lock:
            self.bytes_out = self.gets = 0
            self.requests.clear()
            self.by_key.clear()

    def snapshot(self) -> dict:
        with self._lock:
            return {"bytes_out": self.bytes_out, "gets": self.gets, "requests": dict(self.requests)}


_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
             b'<Message>We encountered an internal error. Please try again.</Message></Error>')


class ServerHooks:
    """WSGI middleware around moto's application: egress counters, the modeled cloud store, injected faults.

    Pacing of one response of S bytes that arrived at t₀ (only while `model` is set): the first byte leaves at
    t₀ + α; chunk k (16 KiB) leaves no earlier than its connection allows (t₀ + α + bytes so far/B_conn) and no
    earlier than the shared link is free (each chunk books CHUNK/B_nic of it, first come first served).
    """

    def __init__(self, app):
        self.app = app
        self.model: CloudModel | None = None
        self.faults = FaultPlan()
        self.stats = ServerStats()
        self.stopping = threading.Event()
        self._nic_lock = threading.Lock()
        self._nic_free = 0.0

    @staticmethod
    def _object_key(environ) -> str | None:
        """'bucket/key' for an object request (path-style URL), None for bucket or service requests."""
        parts = environ.get("PATH_INFO", "").lstrip("/").split("/", 1)
        return f"{parts[0]}/{parts[1]}" if len(parts) == 2 and parts[1] else None

    def __call__(self, environ, start_response):
        t0 = time.perf_counter()
        method, key = environ.get("REQUEST_METHOD", "GET"), self._object_key(environ)
        fault = self.faults.take(key) if (method == "GET" and key is not None) else None
        if fault is not None and fault.kind == "delay":
            self.stopping.wait(fault.seconds)             # interruptible: stopping the server ends the wait
        if fault is not None and fault.kind in ("slowdown", "error"):
            self.stats._count(method, None, 0)
            body = _SLOWDOWN if fault.kind == "slowdown" else _INTERNAL
            start_response("503 Slow Down" if fault.kind == "slowdown" else "500 Internal Server Error",
                           [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        captured = {}

        def capture(status, headers, exc_info=None):
            captured["status"], captured["headers"] = status, headers
            return lambda data: None
        result = self.app(environ, capture)
        try:
            body = b"".join(result)
        finally:
            if hasattr(result, "close"):
                result.close()
        ok = captured["status"].startswith("2")
        if fault is not None and fault.kind == "corrupt" and ok and body:
            body = bytearray(body)
            body[len(body) // 2] ^= 0xFF                  # same length, one byte wrong: only a checksum sees it
            body = bytes(body)
        self.stats._count(method, key if ok else None, len(body) if ok else 0)
        model = self.model
        if model is None or method != "GET" or key is None or not ok:
            start_response(captured["status"], captured["headers"])
            return [body]
        self.stopping.wait(max(0.0, t0 + model.first_byte_s - time.perf_counter()))
        start_response(captured["status"], captured["headers"])
        return self._paced(body, t0 + model.first_byte_s, model)

    def _paced(self, body: bytes, t_first: float, model: CloudModel):
        sent = 0
        for i in range(0, len(body), CHUNK):
            chunk = body[i:i + CHUNK]
            sent += len(chunk)
            conn_done = t_first + sent / model.conn_bytes_per_s
            with self._nic_lock:                          # the shared link, first come first served
                nic_done = max(self._nic_free, time.perf_counter()) + len(chunk) / model.nic_bytes_per_s
                done = max(conn_done, nic_done)
                self._nic_free = done
            if self.stopping.wait(max(0.0, done - time.perf_counter())):
                return
            yield chunk


# =============================================================================================== the server
class ObjectStore:
    """moto's S3 server on 127.0.0.1 at a free port, started by `with` and stopped (state wiped) when it ends —
    also on an exception or a KeyboardInterrupt. `model` and `faults` act on the server side.

    moto keeps every bucket in this process's memory, shared by all its servers: two ObjectStores running at once
    see the same buckets, and the buckets are wiped when the last one stops."""
    _running = 0
    _running_lock = threading.Lock()

    def __init__(self, *, model: CloudModel | None = None):
        self._server = None
        self._hooks: ServerHooks | None = None
        self._model = model
        self.endpoint_url: str | None = None

    # -- lifecycle
    def start(self) -> "ObjectStore":
        if self._server is not None:
            raise StoreError("this ObjectStore is already running; use one `with ObjectStore() as store:` block")
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from werkzeug.serving import make_server
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

        hooks = ServerHooks(DomainDispatcherApplication(create_backend_app))
        hooks.model = self._model

        class _HookedServer(ThreadedMotoServer):
            def _server_entry(self):              # moto's own entry, with its application wrapped in the hooks
                self._server = make_server(self._ip_address, self._port, hooks, True,
                                           request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        server = _HookedServer(ip_address="127.0.0.1", port=0, verbose=False)   # loopback only, a free port
        server.start()
        host, port = server.get_host_and_port()
        self._server, self._hooks = server, hooks
        self.endpoint_url = f"http://{host}:{port}"
        with ObjectStore._running_lock:
            ObjectStore._running += 1
        atexit.register(self.stop)        # a notebook that never reaches its last cell still stops it on exit
        return self

    def stop(self) -> None:
        """Wipe every bucket (moto keeps them in this process's memory) and stop the server. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        atexit.unregister(self.stop)
        self._hooks.stopping.set()                       # release any paced or delayed response at once
        with ObjectStore._running_lock:
            ObjectStore._running -= 1
            last = ObjectStore._running == 0
        if last:
            with contextlib.suppress(Exception):
                req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
                urllib.request.urlopen(req, timeout=5).read()
        server.stop()

    def __enter__(self) -> "ObjectStore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._server is not None

    def _require(self) -> ServerHooks:
        if self._hooks is None or self._server is None:
            raise StoreError("the ObjectStore is not running: use it inside `with ObjectStore() as store:`")
        return self._hooks

    # -- server-side knobs
    @property
    def model(self) -> CloudModel | None:
        return self._hooks.model if self._hooks else self._model

    @model.setter
    def model(self, value: CloudModel | None) -> None:
        if value is not None and not isinstance(value, CloudModel):
            raise TypeError(f"model must be a CloudModel or None, got {type(value).__name__}")
        self._model = value
        if self._hooks is not None:
            self._hooks.model = value

    @contextlib.contextmanager
    def modeled(self, model: CloudModel):
        """`with store.modeled(INJECTED_CLOUD):` — the modeled cloud store inside the block only."""
        before, self.model = self.model, model
        try:
            yield model
        finally:
            self.model = before

    @property
    def faults(self) -> FaultPlan:
        return self._require().faults

    @property
    def stats(self) -> ServerStats:
        return self._require().stats

    # -- clients
    def access(self, **options) -> "S3Access":
        self._require()
        return S3Access(self.endpoint_url, **options)


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
        from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, \
            HTTPClientError, ReadTimeoutError
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
    access.client                                         # build the client outside the timed region
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(len(b) for b in pool.map(lambda k: access.get(bucket, k), jobs))
    return total / (time.perf_counter() - t0), total


__all__ = ["ObjectStore", "S3Access", "CloudModel", "CLOUD_S3", "INJECTED_CLOUD", "RetryPolicy", "ServerHooks",
           "FaultPlan", "StoreError", "ObjectNotFound", "StoreUnavailable", "StoreThrottled", "throughput"]
