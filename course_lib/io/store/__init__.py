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

The store's parts, one subject each (every name below is importable from here, as notebooks and checks do):

    store_model    errors; `CloudModel` (α, B_conn, B_nic), `CLOUD_S3`, `INJECTED_CLOUD`
    store_server   `ObjectStore` (moto on loopback), `ServerHooks` (egress counter, pacing, faults), `FaultPlan`
    store_client   `S3Access` (boto3 with retries), `RetryPolicy`, `ClientStats`, `throughput`
"""
from __future__ import annotations

from .client import ClientStats, RetryPolicy, S3Access, throughput
from .model import (
                          CHUNK,
                          CLOUD_S3,
                          CREDENTIALS,
                          INJECTED_CLOUD,
                          REGION,
                          CloudModel,
                          ObjectNotFound,
                          StoreError,
                          StoreThrottled,
                          StoreUnavailable,
)
from .server import Fault, FaultPlan, ObjectStore, ServerHooks, ServerStats

__all__ = ["ObjectStore", "S3Access", "CloudModel", "CLOUD_S3", "INJECTED_CLOUD", "RetryPolicy", "ServerHooks",
           "FaultPlan", "StoreError", "ObjectNotFound", "StoreUnavailable", "StoreThrottled", "throughput",
           "ClientStats", "Fault", "ServerStats", "CHUNK", "CREDENTIALS", "REGION"]
