"""The object store's errors, and the model of a cloud object store (α, B_conn, B_nic) that notebook 11 injects into
the loopback server (`course_lib.io.store`). Throughput with c concurrent requests of S bytes (docs/formulas.md
§10.2):

    X(c) = min( c·S / (α + S/B_conn),  B_nic )          saturating at c* = B_nic·(α + S/B_conn)/S

Every number that comes out of it is *modeled* (a calibrated stand-in for a cloud store), never a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.costmodel import Link

REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}   # moto accepts any
CHUNK = 16 * 1024           # bytes per paced write of the modeled store (the pacing granularity)


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

    def scaled(self, factor: float, name: str | None = None) -> CloudModel:
        """Every rate (and so every size that matters, like n½ = α·B_conn) divided by `factor`, times kept: the
        same curves in units `factor` times smaller, small enough for a laptop to serve."""
        return CloudModel(name or f"{self.name}, rates ÷{factor:g}", self.first_byte_s,
                          self.conn_bytes_per_s / factor, self.nic_bytes_per_s / factor,
                          f"{self.source}; every rate divided by {factor:g}, times kept")

    def label(self) -> str:
        return (f"{self.name} (modeled: α = {self.first_byte_s * 1e3:.0f} ms, "
                f"B_conn = {self.conn_bytes_per_s / 1e6:.3g} MB/s, B_nic = {self.nic_bytes_per_s / 1e6:.4g} MB/s)")


# formulas §10.1: one request per 85–90 MB/s; ~15 requests fill a 10 Gb/s NIC. First byte: AWS quotes 100–200 ms
# as the consistent figure; we take 50 ms ("tens of ms") for the request of a warm connection. Modeled.
CLOUD_S3 = CloudModel("cloud object store", 0.050, 85e6, 1.25e9,
                      "formulas §10.1: 85 MB/s per request, 10 Gb/s NIC; first byte 'tens of ms' (AWS: 100–200 ms)")
# What the server injects in notebook 11: the same store with every rate ÷100 (10 Gb/s → 12.5 MB/s), so one
# moto server on 2 cores can serve it; n½ = α·B_conn and c* ≈ B_nic/B_conn keep their real ratios.
INJECTED_CLOUD = CLOUD_S3.scaled(100, "cloud store at 1:100")
