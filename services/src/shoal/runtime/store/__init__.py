"""The state store: one interface, an etcd implementation and an in-memory one.

Every piece of durable control-plane state lives in a :class:`Store` under ``/shoal/v1/...``
as serialized protobuf bytes. The interface is etcd's data model, reduced to what the services
need (PyTorch ``RendezvousBackend`` with its fencing token, Ray ``Storage``):

* every write bumps a store-wide **revision**; a key carries the revision that created it
  (``create_revision``) and the one that last changed it (``mod_revision``);
* :meth:`Store.compare_and_set` writes only if the key's ``mod_revision`` is still the one the
  caller read (``0`` = the key must not exist), so read-modify-write loops are safe;
* a :class:`Fence` makes a write conditional on a leader key still being the one it was when
  leadership was won (same ``create_revision``); a deposed leader's write fails with
  :class:`FencedOut` instead of overwriting its successor;
* :meth:`Store.watch` streams changes from a revision, resumes by itself after a dropped
  connection or an etcd restart (from the last seen revision + 1, so without gaps or
  duplicates) and, when the history it needs was compacted, emits one ``"resync"`` event that
  carries the full current listing of the prefix, then goes on from there;
* leases (a TTL; keys attached to a lease are deleted when it expires) back liveness keys and
  leader election.

:class:`MemoryStore` implements the same contract in process (asyncio, an injectable clock for
lease expiry) for unit tests; :class:`EtcdStore` talks to etcd v3 over gRPC. The contract test
suite (``tests/integration/test_store_contract.py``) runs against both.

Using ``EtcdStore`` (close it, or use it as an async context manager)::

    async with EtcdStore(["127.0.0.1:2379"]) as store:
        kv = await store.get("/shoal/v1/jobs/j1")
        if kv is None:
            created = await store.compare_and_set("/shoal/v1/jobs/j1", data, 0)
        kvs, revision = await store.list("/shoal/v1/jobs/")
        async with contextlib.aclosing(store.watch("/shoal/v1/jobs/", revision + 1)) as events:
            async for event in events:
                ...

Why not ``aetcd.Client``: :class:`EtcdStore` uses aetcd's generated etcd v3 stubs and
messages (``aetcd.rpc``) on its own ``grpc.aio`` channels, because ``aetcd.Client`` speaks to
one ``host:port`` without TLS, and its shared watcher turns a dropped stream into an error on
every watch, where this store needs per-watch resume from a revision, endpoint failover and
per-call deadlines.

One module per part: ``base`` (the data model and the interface), ``memory``
(:class:`MemoryStore`), ``etcd`` (:class:`EtcdStore`); the errors are
``shoal.contract.errors``'. Every name is importable from here.
"""

from shoal.contract.errors import FencedOut, LeaseExpired, StoreError, StoreUnavailable
from shoal.runtime.store.base import (
    DeleteOp,
    Expect,
    Fence,
    KeyValue,
    Op,
    PutOp,
    Store,
    WatchEvent,
)
from shoal.runtime.store.etcd import EtcdStore
from shoal.runtime.store.memory import MemoryStore

__all__ = [
    "DeleteOp",
    "EtcdStore",
    "Expect",
    "Fence",
    "FencedOut",
    "KeyValue",
    "LeaseExpired",
    "MemoryStore",
    "Op",
    "PutOp",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "WatchEvent",
]
