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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal, Self, TypeVar

import grpc
from aetcd import rpc

from shoal.contract.errors import FencedOut, LeaseExpired, StoreError, StoreUnavailable

__all__ = [
    "DeleteOp",
    "EtcdStore",
    "Expect",
    "Fence",
    "FencedOut",
    "KeyValue",
    "LeaseExpired",
    "MemoryStore",
    "PutOp",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "WatchEvent",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyValue:
    """One key as stored. ``lease`` is the id of the lease the key is attached to (0: none)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class WatchEvent:
    """A change under a watched prefix.

    ``put``: ``key`` now holds ``value`` since ``mod_revision``. ``delete``: ``key`` was deleted
    at ``mod_revision`` (``value`` is empty). ``resync``: the watch could not resume (the
    history it needed was compacted); ``kvs`` is the full listing of the prefix at revision
    ``mod_revision`` (``key`` is the prefix); the consumer replaces its view with it and the
    watch goes on with changes after ``mod_revision``.
    """

    kind: Literal["put", "delete", "resync"]
    key: str
    value: bytes
    mod_revision: int
    kvs: tuple[KeyValue, ...] = ()


@dataclass(frozen=True)
class Fence:
    """A fencing token: the leader key and the ``create_revision`` it had when leadership was won.

    A fenced write succeeds only if ``key`` still exists with that ``create_revision``; it
    fails with :class:`FencedOut` once the key is gone or was re-created by another leader.
    """

    key: str
    create_revision: int


@dataclass(frozen=True)
class PutOp:
    """Put ``value`` under ``key`` (attached to ``lease`` unless 0) in :meth:`Store.transaction`."""

    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class DeleteOp:
    """Delete ``key`` (a no-op if absent) in :meth:`Store.transaction`."""

    key: str


@dataclass(frozen=True)
class Expect:
    """A condition of :meth:`Store.transaction`: ``key``'s ``mod_revision`` equals
    ``mod_revision`` (``0``: the key must not exist)."""

    key: str
    mod_revision: int


Op = PutOp | DeleteOp


# The store's errors live with every other shoal error in shoal.contract.errors (imported
# above and re-exported here): StoreError, FencedOut, StoreUnavailable, LeaseExpired.


# --------------------------------------------------------------------------------------------
# Interface
# --------------------------------------------------------------------------------------------


class Store(ABC):
    """A revisioned key-value store with compare-and-set, fencing, watches and leases.

    Keys are ``str`` (UTF-8 in etcd), values ``bytes``. Revisions start at 1 for an empty store
    and every write that changes something bumps the revision by one (all ops of one
    transaction share one revision), as in etcd.
    """

    @abstractmethod
    async def get(self, key: str) -> KeyValue | None:
        """The key, or None if it does not exist."""

    @abstractmethod
    async def put(
        self, key: str, value: bytes, *, lease: int = 0, fence: Fence | None = None
    ) -> int:
        """Write ``key`` unconditionally (but fenced, if ``fence``); returns the new revision.

        Raises :class:`FencedOut`, or :class:`LeaseExpired` if ``lease`` does not exist.
        """

    @abstractmethod
    async def compare_and_set(
        self,
        key: str,
        value: bytes,
        expected_revision: int,
        *,
        lease: int = 0,
        fence: Fence | None = None,
    ) -> bool:
        """Write ``key`` only if its ``mod_revision`` is ``expected_revision`` (0: only if the key
        does not exist). Returns whether it was written. :class:`FencedOut` takes precedence
        over a failed comparison."""

    @abstractmethod
    async def delete(
        self, key: str, *, expected_revision: int | None = None, fence: Fence | None = None
    ) -> bool:
        """Delete ``key`` (only if its ``mod_revision`` is ``expected_revision``, when given).
        Returns whether a key was deleted."""

    @abstractmethod
    async def transaction(
        self,
        ops: Sequence[Op],
        *,
        expect: Sequence[Expect] = (),
        fence: Fence | None = None,
    ) -> int | None:
        """Apply ``ops`` atomically (one revision) if every :class:`Expect` holds.

        Returns the store revision after the transaction, or None if an expectation failed
        (nothing was written). Raises :class:`FencedOut` if the fence failed.
        """

    @abstractmethod
    async def list(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys starting with ``prefix`` (sorted by key) and the revision they were read at.

        Watch from ``revision + 1`` to follow changes after the listing without a gap.
        """

    @abstractmethod
    def watch(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        """Changes to keys starting with ``prefix`` with ``mod_revision >= start_revision``
        (``start_revision <= 0``: from now on), in revision order.

        Never ends by itself: it resumes after connection loss and store restarts, and emits a
        ``"resync"`` event when the needed history was compacted. Stop it by breaking out of
        the loop and closing the generator (``contextlib.aclosing``) or cancelling the task.
        """

    @abstractmethod
    async def grant_lease(self, ttl: float) -> int:
        """A new lease that expires ``ttl`` seconds from now unless refreshed; returns its id.

        etcd counts whole seconds (``ttl`` is rounded up) and enforces a minimum (about 2 s
        with default settings)."""

    @abstractmethod
    async def refresh_lease(self, lease_id: int) -> float:
        """Restart the lease's TTL; returns the remaining TTL in seconds.

        Raises :class:`LeaseExpired` if it no longer exists."""

    @abstractmethod
    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease and delete its keys now (no error if it is already gone)."""

    @abstractmethod
    async def compact(self, revision: int) -> None:
        """Discard the history before ``revision``; watches from earlier revisions then resync."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections; running watches end."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


# --------------------------------------------------------------------------------------------
# In-memory implementation
# --------------------------------------------------------------------------------------------


@dataclass
class _MemLease:
    ttl: float
    expires_at: float
    keys: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _MemWatcher:
    prefix: str
    start_revision: int
    queue: asyncio.Queue[WatchEvent | None]


class MemoryStore(Store):
    """The store in process memory, for unit tests of the services.

    Behaves like a single etcd: revisions, compare-and-set, fencing, transactions, watches with
    history (from any revision after the last compaction), leases. Leases expire by ``clock``
    (inject a fake one to control time); expiry is applied at the start of every operation and
    by a background sweep every ``sweep_interval`` seconds (None: only on operations, or call
    :meth:`expire_leases`). ``history_limit`` bounds the kept watch history (older revisions are
    compacted automatically).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        sweep_interval: float | None = 0.05,
        history_limit: int = 100_000,
    ) -> None:
        self._clock = clock
        self._sweep_interval = sweep_interval
        self._history_limit = history_limit
        self._revision = 1
        self._compacted = 0
        self._kvs: dict[str, KeyValue] = {}
        self._history: list[WatchEvent] = []
        self._leases: dict[int, _MemLease] = {}
        self._lease_ids = itertools.count(1)
        self._watchers: set[_MemWatcher] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def revision(self) -> int:
        """The current store revision."""
        return self._revision

    # -- internals ---------------------------------------------------------------------------

    async def _enter(self) -> None:
        if self._closed:
            raise StoreError("the memory store is closed")
        await asyncio.sleep(0)  # yield like a real store would
        self.expire_leases()

    def _check_fence(self, fence: Fence | None) -> None:
        if fence is None:
            return
        kv = self._kvs.get(fence.key)
        if kv is None or kv.create_revision != fence.create_revision:
            raise FencedOut.of_fence(fence, None if kv is None else kv.create_revision)

    def _expect_holds(self, expect: Expect) -> bool:
        kv = self._kvs.get(expect.key)
        return (kv.mod_revision if kv is not None else 0) == expect.mod_revision

    def _apply(self, ops: Sequence[Op]) -> tuple[int, int]:
        """Apply ``ops`` as one revision; returns (revision, number of keys deleted)."""
        for op in ops:
            if isinstance(op, PutOp) and op.lease and op.lease not in self._leases:
                raise LeaseExpired(op.lease, f"writing {op.key!r}")
        events: list[WatchEvent] = []
        deleted = 0
        revision = self._revision + 1
        for op in ops:
            old = self._kvs.get(op.key)
            if old is not None and old.lease and old.lease in self._leases:
                self._leases[old.lease].keys.discard(op.key)
            if isinstance(op, PutOp):
                create = old.create_revision if old is not None else revision
                self._kvs[op.key] = KeyValue(op.key, op.value, create, revision, op.lease)
                if op.lease:
                    self._leases[op.lease].keys.add(op.key)
                events.append(WatchEvent("put", op.key, op.value, revision))
            elif old is not None:
                del self._kvs[op.key]
                deleted += 1
                events.append(WatchEvent("delete", op.key, b"", revision))
        if events:
            self._revision = revision
            self._publish(events)
        return self._revision, deleted

    def _publish(self, events: list[WatchEvent]) -> None:
        self._history.extend(events)
        if len(self._history) > self._history_limit:
            dropped = self._history[: len(self._history) - self._history_limit]
            del self._history[: len(dropped)]
            self._compacted = max(self._compacted, dropped[-1].mod_revision + 1)
        for watcher in self._watchers:
            for event in events:
                if event.key.startswith(watcher.prefix) and (
                    event.mod_revision >= watcher.start_revision
                ):
                    watcher.queue.put_nowait(event)

    def _listing(self, prefix: str) -> list[KeyValue]:
        return sorted(
            (kv for key, kv in self._kvs.items() if key.startswith(prefix)), key=lambda kv: kv.key
        )

    def _ensure_sweeper(self) -> None:
        if self._sweep_interval is None or self._closed:
            return
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        assert self._sweep_interval is not None
        while not self._closed and self._leases:
            await asyncio.sleep(self._sweep_interval)
            self.expire_leases()

    def expire_leases(self) -> int:
        """Expire every lease whose deadline (by ``clock``) has passed, deleting its keys (one
        revision per lease, as etcd does). Returns how many leases expired."""
        now = self._clock()
        expired = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            lease = self._leases.pop(lease_id)
            self._apply([DeleteOp(key) for key in sorted(lease.keys)])
        return len(expired)

    # -- Store -------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        await self._enter()
        return self._kvs.get(key)

    async def put(
        self, key: str, value: bytes, *, lease: int = 0, fence: Fence | None = None
    ) -> int:
        await self._enter()
        self._check_fence(fence)
        revision, _ = self._apply([PutOp(key, bytes(value), lease)])
        return revision

    async def compare_and_set(
        self,
        key: str,
        value: bytes,
        expected_revision: int,
        *,
        lease: int = 0,
        fence: Fence | None = None,
    ) -> bool:
        await self._enter()
        self._check_fence(fence)
        if not self._expect_holds(Expect(key, expected_revision)):
            return False
        self._apply([PutOp(key, bytes(value), lease)])
        return True

    async def delete(
        self, key: str, *, expected_revision: int | None = None, fence: Fence | None = None
    ) -> bool:
        await self._enter()
        self._check_fence(fence)
        if expected_revision is not None and not self._expect_holds(Expect(key, expected_revision)):
            return False
        _, deleted = self._apply([DeleteOp(key)])
        return deleted > 0

    async def transaction(
        self,
        ops: Sequence[Op],
        *,
        expect: Sequence[Expect] = (),
        fence: Fence | None = None,
    ) -> int | None:
        await self._enter()
        self._check_fence(fence)
        if not all(self._expect_holds(e) for e in expect):
            return None
        revision, _ = self._apply(list(ops))
        return revision

    async def list(self, prefix: str) -> tuple[list[KeyValue], int]:
        await self._enter()
        return self._listing(prefix), self._revision

    async def watch(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        await self._enter()
        self._ensure_sweeper()
        backlog: list[WatchEvent]
        if start_revision <= 0:
            start_revision = self._revision + 1
            backlog = []
        elif start_revision < self._compacted:
            backlog = [
                WatchEvent("resync", prefix, b"", self._revision, tuple(self._listing(prefix)))
            ]
            start_revision = self._revision + 1
        else:
            backlog = [
                e
                for e in self._history
                if e.mod_revision >= start_revision and e.key.startswith(prefix)
            ]
        # Registered in the same step as the backlog was taken: no gap, no duplicate.
        watcher = _MemWatcher(prefix, start_revision, asyncio.Queue())
        self._watchers.add(watcher)
        try:
            for event in backlog:
                yield event
            while True:
                item = await watcher.queue.get()
                if item is None:
                    return
                yield item
        finally:
            self._watchers.discard(watcher)

    async def grant_lease(self, ttl: float) -> int:
        await self._enter()
        if ttl <= 0:
            raise ValueError(f"ttl ({ttl}) must be > 0")
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = _MemLease(ttl, self._clock() + ttl)
        self._ensure_sweeper()
        return lease_id

    async def refresh_lease(self, lease_id: int) -> float:
        await self._enter()
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseExpired(lease_id)
        lease.expires_at = self._clock() + lease.ttl
        return lease.ttl

    async def revoke_lease(self, lease_id: int) -> None:
        await self._enter()
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._apply([DeleteOp(key) for key in sorted(lease.keys)])

    async def compact(self, revision: int) -> None:
        await self._enter()
        if revision > self._revision:
            raise StoreError(
                f"compact revision ({revision}) is beyond the current revision ({self._revision})"
            )
        self._compacted = max(self._compacted, revision)
        self._history = [e for e in self._history if e.mod_revision >= self._compacted]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
            self._sweeper = None


# --------------------------------------------------------------------------------------------
# etcd implementation
# --------------------------------------------------------------------------------------------

_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)

# Errors that show the request never reached the server, so even a write may go elsewhere.
_NOT_SENT_MARKERS = (
    "failed to connect",
    "connection refused",
    "connect failed",
    "no route to host",
    "dns resolution failed",
    "name resolution",
)


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """etcd's [key, range_end) for every key starting with ``prefix``."""
    key = prefix.encode()
    if not key:
        return b"\0", b"\0"
    end = bytearray(key)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return key, bytes(end[: i + 1])
    return key, b"\0"  # all 0xff: no upper bound


def _kv(pb: rpc.KeyValue) -> KeyValue:
    return KeyValue(
        key=pb.key.decode(),
        value=bytes(pb.value),
        create_revision=pb.create_revision,
        mod_revision=pb.mod_revision,
        lease=pb.lease,
    )


def _put_op(op: PutOp) -> rpc.RequestOp:
    return rpc.RequestOp(
        request_put=rpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease)
    )


def _delete_op(key: str) -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key.encode()))


def _mod_equals(expect: Expect) -> rpc.Compare:
    return rpc.Compare(
        key=expect.key.encode(),
        target=rpc.Compare.MOD,
        result=rpc.Compare.EQUAL,
        mod_revision=expect.mod_revision,
    )


def _strip_scheme(endpoint: str) -> str:
    for scheme in ("http://", "https://", "unix://"):
        if endpoint.startswith(scheme):
            return endpoint[len(scheme) :]
    return endpoint


def _read_file(path: str | Path | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


@dataclass
class _Stubs:
    channel: grpc.aio.Channel
    kv: rpc.KVStub
    lease: rpc.LeaseStub
    watch: rpc.WatchStub


class EtcdStore(Store):
    """The store on etcd v3 (one member or a cluster).

    ``endpoints`` are ``"host:port"`` (an ``http://``/``https://`` prefix is accepted). Calls go
    to the endpoint that answered last; on connection failure the next one is tried: reads and
    lease refreshes on any transient failure, writes only when the request cannot have reached
    the server (otherwise :class:`StoreUnavailable` is raised, because the write may have been
    applied). ``timeout`` bounds every call (seconds). TLS: ``ca_cert`` (server CA), and
    ``cert_cert``/``cert_key`` for a client certificate (mTLS); paths to PEM files.

    The gRPC channels reconnect with a backoff of at most ``reconnect_backoff_max`` seconds, so
    the store is usable soon after etcd comes back. :meth:`list` reads in pages of
    ``list_page_size`` keys, all at one revision. Channels are created on first use and belong
    to that event loop: use one store from one loop.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        ca_cert: str | Path | None = None,
        cert_key: str | Path | None = None,
        cert_cert: str | Path | None = None,
        timeout: float = 5.0,
        reconnect_backoff_max: float = 1.0,
        watch_backoff_max: float = 1.0,
        list_page_size: int = 1000,
    ) -> None:
        if not endpoints:
            raise ValueError("endpoints ([]) must name at least one etcd member")
        if timeout <= 0:
            raise ValueError(f"timeout ({timeout}) must be > 0")
        if (cert_key is None) != (cert_cert is None):
            raise ValueError(
                f"cert_key ({cert_key!r}) and cert_cert ({cert_cert!r}) must be given together"
            )
        if list_page_size < 1:
            raise ValueError(f"list_page_size ({list_page_size}) must be >= 1")
        self._list_page = list_page_size
        self._endpoints = [_strip_scheme(e) for e in endpoints]
        self._timeout = timeout
        self._watch_backoff_max = watch_backoff_max
        self._credentials: grpc.ChannelCredentials | None = None
        if ca_cert is not None or cert_cert is not None:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_file(ca_cert),
                private_key=_read_file(cert_key),
                certificate_chain=_read_file(cert_cert),
            )
        backoff_ms = max(int(reconnect_backoff_max * 1000), 100)
        self._options: list[tuple[str, int]] = [
            ("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
            ("grpc.min_reconnect_backoff_ms", min(100, backoff_ms)),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
            # Detect a dead or frozen server under a long-lived watch; etcd refuses pings more
            # often than every 5 s (--grpc-keepalive-min-time).
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            # Only while calls are open: etcd treats pings on an idle connection as abuse.
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
        ]
        self._stubs: dict[str, _Stubs] = {}
        self._preferred = 0
        self._closed = False

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    # -- plumbing ------------------------------------------------------------------------------

    def _stubs_for(self, endpoint: str) -> _Stubs:
        if self._closed:
            raise StoreError("the etcd store is closed")
        stubs = self._stubs.get(endpoint)
        if stubs is None:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(endpoint, self._credentials, self._options)
            else:
                channel = grpc.aio.insecure_channel(endpoint, self._options)
            stubs = _Stubs(
                channel, rpc.KVStub(channel), rpc.LeaseStub(channel), rpc.WatchStub(channel)
            )
            self._stubs[endpoint] = stubs
        return stubs

    def _error(self, exc: grpc.aio.AioRpcError, what: str, endpoint: str) -> StoreError:
        details = exc.details() or ""
        if exc.code() in _TRANSIENT_CODES:
            return StoreUnavailable(
                f"{what}: etcd at {endpoint} unavailable ({exc.code().name}: {details})"
            )
        return StoreError(f"{what}: etcd at {endpoint} failed ({exc.code().name}: {details})")

    async def _call(
        self, what: str, fn: Callable[[_Stubs], Awaitable[T]], *, idempotent: bool
    ) -> T:
        """Run ``fn`` against the preferred endpoint, failing over as the class doc says."""
        n = len(self._endpoints)
        last: tuple[StoreError, grpc.aio.AioRpcError] | None = None
        for attempt in range(n):
            index = (self._preferred + attempt) % n
            endpoint = self._endpoints[index]
            try:
                result = await fn(self._stubs_for(endpoint))
            except grpc.aio.AioRpcError as exc:
                error = self._error(exc, what, endpoint)
                if not isinstance(error, StoreUnavailable):
                    raise error from exc
                self._preferred = (index + 1) % n
                details = (exc.details() or "").lower()
                not_sent = exc.code() == grpc.StatusCode.UNAVAILABLE and any(
                    marker in details for marker in _NOT_SENT_MARKERS
                )
                if not (idempotent or not_sent):
                    raise error from exc
                last = (error, exc)
                continue
            self._preferred = index
            return result
        assert last is not None
        raise last[0] from last[1]

    async def _txn(
        self,
        what: str,
        compares: list[rpc.Compare],
        success: list[rpc.RequestOp],
        fence: Fence | None,
    ) -> rpc.TxnResponse:
        failure: list[rpc.RequestOp] = []
        if fence is not None:
            compares = [
                rpc.Compare(
                    key=fence.key.encode(),
                    target=rpc.Compare.CREATE,
                    result=rpc.Compare.EQUAL,
                    create_revision=fence.create_revision,
                ),
                *compares,
            ]
            # On failure, read the fence key in the same transaction to tell "fenced out"
            # from "a comparison failed".
            failure = [rpc.RequestOp(request_range=rpc.RangeRequest(key=fence.key.encode()))]
        request = rpc.TxnRequest(compare=compares, success=success, failure=failure)

        async def call(stubs: _Stubs) -> rpc.TxnResponse:
            return await stubs.kv.Txn(request, timeout=self._timeout)

        try:
            response = await self._call(what, call, idempotent=False)
        except StoreError as exc:
            cause = exc.__cause__
            if (
                isinstance(cause, grpc.aio.AioRpcError)
                and cause.code() == grpc.StatusCode.NOT_FOUND
                and "lease not found" in (cause.details() or "")
            ):
                lease = next((op.request_put.lease for op in success if op.request_put.lease), 0)
                raise LeaseExpired(lease, what) from cause
            raise
        if not response.succeeded and fence is not None:
            found = response.responses[0].response_range.kvs
            actual = found[0].create_revision if found else None
            if actual != fence.create_revision:
                raise FencedOut.of_fence(fence, actual)
        return response

    # -- Store ---------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        request = rpc.RangeRequest(key=key.encode())

        async def call(stubs: _Stubs) -> rpc.RangeResponse:
            return await stubs.kv.Range(request, timeout=self._timeout)

        response = await self._call(f"get {key!r}", call, idempotent=True)
        return _kv(response.kvs[0]) if response.kvs else None

    async def put(
        self, key: str, value: bytes, *, lease: int = 0, fence: Fence | None = None
    ) -> int:
        response = await self._txn(
            f"put {key!r}", [], [_put_op(PutOp(key, bytes(value), lease))], fence
        )
        return int(response.header.revision)

    async def compare_and_set(
        self,
        key: str,
        value: bytes,
        expected_revision: int,
        *,
        lease: int = 0,
        fence: Fence | None = None,
    ) -> bool:
        response = await self._txn(
            f"compare_and_set {key!r}",
            [_mod_equals(Expect(key, expected_revision))],
            [_put_op(PutOp(key, bytes(value), lease))],
            fence,
        )
        return bool(response.succeeded)

    async def delete(
        self, key: str, *, expected_revision: int | None = None, fence: Fence | None = None
    ) -> bool:
        compares = (
            [] if expected_revision is None else [_mod_equals(Expect(key, expected_revision))]
        )
        response = await self._txn(f"delete {key!r}", compares, [_delete_op(key)], fence)
        if not response.succeeded:
            return False
        return response.responses[0].response_delete_range.deleted > 0

    async def transaction(
        self,
        ops: Sequence[Op],
        *,
        expect: Sequence[Expect] = (),
        fence: Fence | None = None,
    ) -> int | None:
        success = [_put_op(op) if isinstance(op, PutOp) else _delete_op(op.key) for op in ops]
        response = await self._txn(
            f"transaction on {[op.key for op in ops]!r}",
            [_mod_equals(e) for e in expect],
            success,
            fence,
        )
        return int(response.header.revision) if response.succeeded else None

    async def list(self, prefix: str) -> tuple[list[KeyValue], int]:
        key, range_end = _prefix_range(prefix)
        for _ in range(3):  # restart if the snapshot revision is compacted between pages
            kvs: list[KeyValue] = []
            revision = 0
            start = key
            try:
                while True:
                    request = rpc.RangeRequest(
                        key=start, range_end=range_end, limit=self._list_page, revision=revision
                    )

                    async def call(
                        stubs: _Stubs, request: rpc.RangeRequest = request
                    ) -> rpc.RangeResponse:
                        return await stubs.kv.Range(request, timeout=self._timeout)

                    response = await self._call(f"list {prefix!r}", call, idempotent=True)
                    if revision == 0:
                        revision = int(response.header.revision)
                    kvs.extend(_kv(pb) for pb in response.kvs)
                    if not response.more or not response.kvs:
                        return kvs, revision
                    start = response.kvs[-1].key + b"\0"
            except StoreError as exc:
                if "compacted" not in str(exc):
                    raise
        raise StoreUnavailable(f"list {prefix!r}: history compacted while paging, 3 times")

    async def watch(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        key, range_end = _prefix_range(prefix)
        next_revision = start_revision
        if next_revision <= 0:
            _, current = await self.list(prefix)
            next_revision = current + 1
        delay = 0.05
        index = self._preferred
        while not self._closed:
            endpoint = self._endpoints[index % len(self._endpoints)]
            call = self._stubs_for(endpoint).watch.Watch()
            failed = True
            try:
                await call.write(
                    rpc.WatchRequest(
                        create_request=rpc.WatchCreateRequest(
                            key=key,
                            range_end=range_end,
                            start_revision=next_revision,
                            progress_notify=True,
                        )
                    )
                )
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        break
                    if response.compact_revision:
                        log.info(
                            "watch %r: revision %d compacted (at %d); resyncing",
                            prefix,
                            next_revision,
                            response.compact_revision,
                        )
                        kvs, revision = await self.list(prefix)
                        next_revision = revision + 1
                        failed = False
                        yield WatchEvent("resync", prefix, b"", revision, tuple(kvs))
                        break
                    if response.canceled:
                        failed = True
                        log.warning(
                            "watch %r canceled by etcd at %s: %s",
                            prefix,
                            endpoint,
                            response.cancel_reason,
                        )
                        break
                    if response.created:
                        delay = 0.05
                        failed = False
                        continue
                    if not response.events:
                        # A progress notification: everything up to header.revision was sent.
                        next_revision = max(next_revision, response.header.revision + 1)
                        continue
                    last = next_revision - 1
                    for event in response.events:
                        revision = event.kv.mod_revision
                        if revision < next_revision:
                            continue  # already delivered before a reconnect
                        last = max(last, revision)
                        if event.type == rpc.Event.DELETE:
                            yield WatchEvent("delete", event.kv.key.decode(), b"", revision)
                        else:
                            yield WatchEvent(
                                "put", event.kv.key.decode(), bytes(event.kv.value), revision
                            )
                    next_revision = last + 1
            except (grpc.aio.AioRpcError, StoreUnavailable) as exc:
                log.debug("watch %r on %s interrupted: %s", prefix, endpoint, exc)
                failed = True
            finally:
                call.cancel()
            if failed and not self._closed:
                index += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._watch_backoff_max)

    async def grant_lease(self, ttl: float) -> int:
        if ttl <= 0:
            raise ValueError(f"ttl ({ttl}) must be > 0")
        request = rpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl)))

        async def call(stubs: _Stubs) -> rpc.LeaseGrantResponse:
            return await stubs.lease.LeaseGrant(request, timeout=self._timeout)

        response = await self._call(f"grant lease ttl={ttl}", call, idempotent=False)
        if response.error:
            raise StoreError(f"grant lease ttl={ttl}: {response.error}")
        return int(response.ID)

    async def refresh_lease(self, lease_id: int) -> float:
        async def call(stubs: _Stubs) -> rpc.LeaseKeepAliveResponse:
            stream = stubs.lease.LeaseKeepAlive(timeout=self._timeout)
            try:
                await stream.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                response = await stream.read()
            finally:
                stream.cancel()
            if response is grpc.aio.EOF:
                raise StoreUnavailable(f"refresh lease {lease_id:x}: keep-alive stream closed")
            return response

        response = await self._call(f"refresh lease {lease_id:x}", call, idempotent=True)
        if response.TTL <= 0:
            raise LeaseExpired(lease_id)
        return float(response.TTL)

    async def revoke_lease(self, lease_id: int) -> None:
        request = rpc.LeaseRevokeRequest(ID=lease_id)

        async def call(stubs: _Stubs) -> rpc.LeaseRevokeResponse:
            return await stubs.lease.LeaseRevoke(request, timeout=self._timeout)

        try:
            await self._call(f"revoke lease {lease_id:x}", call, idempotent=True)
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == (
                grpc.StatusCode.NOT_FOUND
            ):
                return
            raise

    async def compact(self, revision: int) -> None:
        request = rpc.CompactionRequest(revision=revision, physical=True)

        async def call(stubs: _Stubs) -> rpc.CompactionResponse:
            return await stubs.kv.Compact(request, timeout=self._timeout)

        try:
            await self._call(f"compact to {revision}", call, idempotent=True)
        except StoreError as exc:
            if "has been compacted" in str(exc):
                return  # already compacted at or past this revision
            raise

    async def close(self) -> None:
        self._closed = True
        stubs, self._stubs = list(self._stubs.values()), {}
        for s in stubs:
            await s.channel.close()
