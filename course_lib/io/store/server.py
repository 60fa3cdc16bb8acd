"""The server side of the loopback object store: moto's S3 server on 127.0.0.1, its WSGI application wrapped by
`ServerHooks`, which counts the object bytes sent (egress), injects faults (`FaultPlan`: 503 SlowDown, 500, delays,
corrupted bodies) and, with a `CloudModel`, holds each response so the store behaves like a cloud one — first byte
after α, then at most B_conn bytes/s per connection, all connections together at most B_nic (a FIFO link).
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from .client import S3Access
from .model import CHUNK, CloudModel, StoreError

# werkzeug logs every request at INFO; moto's server is chatty too. The course shows its own counters instead.
for _name in ("werkzeug", "moto", "botocore", "s3fs", "aiobotocore"):
    logging.getLogger(_name).setLevel(logging.ERROR)


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
            if hasattr(result, "close"):       # WSGI (PEP 3333): a server calls the iterable's close() if it has one
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
        return self.paced(body, t0 + model.first_byte_s, model)

    def paced(self, body: bytes, t_first: float, model: CloudModel):
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
    def start(self) -> ObjectStore:
        if self._server is not None:
            raise StoreError("this ObjectStore is already running; use one `with ObjectStore() as store:` block")
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

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

    close = stop                                          # the course's one protocol: close() and `with`

    def __enter__(self) -> ObjectStore:
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
    def access(self, **options) -> S3Access:
        self._require()
        return S3Access(self.endpoint_url, **options)
