"""The store in process memory (:class:`MemoryStore`), for unit tests of the services: one
etcd's contract, with an injectable clock for lease expiry."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

from shoal.contract.errors import FencedOut, LeaseExpired, StoreError
from shoal.runtime.store.base import DeleteOp, Expect, Fence, KeyValue, Op, PutOp, Store, WatchEvent


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
