"""The resource-manager replica: leader election, durable state in etcd, the liveness loop and
the inventory watch fan-out over :mod:`shoal.resource_manager.core`.

State in the store (serialized protobufs, see docs/resource-manager.md)::

    /shoal/v1/resource-manager/hosts/<host_id>                  shoal.v1.Host
    /shoal/v1/resource-manager/allocations/<host_id>/<device_id> shoal.v1.Allocation
    /shoal/v1/resource-manager/requests/<quoted request_id>     shoal.v1.AcquireDevicesResponse

Allocations are keyed by device, and every write is one etcd transaction that (1) is fenced by
this replica's leader key, (2) expects every key it touches at the revision this replica last
saw (an allocation key must not exist yet), and (3) for AcquireDevices / ReleaseDevices, expects
the job-scheduler's leader key at the revision it was verified at. So even a replica whose
memory were stale could never give a device out twice: etcd refuses the write, the replica
reloads its state and recomputes once.

The keys and the transaction of a change are in :mod:`shoal.resource_manager.store`, the gRPC
handlers in :mod:`shoal.resource_manager.handlers`; both are re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

from shoal.contract.keys import election_prefix
from shoal.resource_manager import core
from shoal.resource_manager.core import Change, Event, EventKind, Inventory
from shoal.resource_manager.handlers import (
    ROLES,
    SERVICE_NAME,
    ResourceManagerServicer,
    bindings,
)
from shoal.resource_manager.store import (
    ALLOCATIONS,
    HOSTS,
    PREFIX,
    REQUESTS,
    Loaded,
    allocation_key,
    change_ops,
    host_key,
    parse_state,
    request_key,
)
from shoal.runtime.config import ServerConfig
from shoal.runtime.election import LeaderElection, Leadership, LeadershipLost
from shoal.runtime.errors import (
    DEFAULT_TABLE,
    ErrorTable,
    FencedOut,
    InvalidField,
    NotLeader,
    Unavailable,
)
from shoal.runtime.service import follow_leader, lead_forever
from shoal.runtime.store import (
    Expect,
    FencedOut as StoreFencedOut,
    PutOp,
    Store,
    StoreError,
    StoreUnavailable,
)
from shoal.v1 import (
    resource_manager_service_pb2 as rm_pb2,
    resources_pb2,
)

__all__ = [
    "ALLOCATIONS",
    "ELECTION_NAME",
    "ERRORS",
    "HOSTS",
    "PREFIX",
    "REQUESTS",
    "ROLES",
    "SERVICE_NAME",
    "Loaded",
    "ResourceManager",
    "ResourceManagerConfig",
    "ResourceManagerServicer",
    "allocation_key",
    "bindings",
    "change_ops",
    "host_key",
    "parse_state",
    "request_key",
]

log = logging.getLogger(__name__)

ELECTION_NAME = "resource-manager"

# Every core error derives from a runtime domain error already in the base table.
ERRORS: ErrorTable = DEFAULT_TABLE.extend({})

T = TypeVar("T")

# A write is tried this many times: once, then once more on the reloaded state after a conflict.
_WRITE_ATTEMPTS = 2


class _WriteConflict(Exception):
    """A write's compare-and-set failed: the state changed under it (reload, recompute)."""


def _log_conflict(state: tenacity.RetryCallState) -> None:
    log.info("write conflict (attempt %d): reloading the state", state.attempt_number)


@dataclass(frozen=True)
class ResourceManagerConfig:
    """The resource manager's settings (built once in ``main``)."""

    server: ServerConfig
    heartbeat_interval_s: float = 1.0
    host_grace_s: float = 3.0
    host_restart_grace_s: float = 30.0
    election_ttl_s: float = 5.0
    scheduler_election: str = "job-scheduler"
    watch_queue_size: int = 1024

    def __post_init__(self) -> None:
        if not 0.01 <= self.heartbeat_interval_s <= 60:
            raise InvalidField(
                "heartbeat_interval_s", self.heartbeat_interval_s, "must be in 0.01..60"
            )
        if not self.heartbeat_interval_s < self.host_grace_s <= 3600:
            raise InvalidField(
                "host_grace_s",
                self.host_grace_s,
                f"must be > heartbeat_interval_s ({self.heartbeat_interval_s}) and <= 3600",
            )
        if not 0 <= self.host_restart_grace_s <= 3600:
            raise InvalidField(
                "host_restart_grace_s", self.host_restart_grace_s, "must be in 0..3600"
            )
        if not 1 <= self.election_ttl_s <= 600:
            raise InvalidField("election_ttl_s", self.election_ttl_s, "must be in 1..600")
        if not self.scheduler_election or "/" in self.scheduler_election:
            raise InvalidField(
                "scheduler_election", self.scheduler_election, "must be a name without '/'"
            )
        if self.watch_queue_size < 1:
            raise InvalidField("watch_queue_size", self.watch_queue_size, "must be >= 1")


# --------------------------------------------------------------------------------------------
# The inventory watch fan-out
# --------------------------------------------------------------------------------------------


class _Resync:
    """Queue marker: the watcher fell behind; send a fresh snapshot."""


class _Deposed:
    """Queue marker: this replica stopped leading; end the stream with NotLeader."""


_RESYNC = _Resync()
_DEPOSED = _Deposed()
_Item = rm_pb2.WatchInventoryResponse | _Resync | _Deposed


class _Watcher:
    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=size)

    def offer(self, item: _Item) -> None:
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            # Too slow: drop what is queued and resynchronize with a snapshot.
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(_RESYNC)


# --------------------------------------------------------------------------------------------
# The replica
# --------------------------------------------------------------------------------------------


class ResourceManager:
    """One resource-manager replica: campaigns for leadership, and while leading holds the
    inventory (rebuilt from the store), detects lost hosts and serves the API."""

    def __init__(
        self,
        config: ResourceManagerConfig,
        store: Store,
        *,
        inventory: Inventory | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.inventory = inventory or Inventory(grace_s=config.host_grace_s)
        self.leader_address: str | None = None
        self.address = ""
        self._election: LeaderElection | None = None
        self._leadership: Leadership | None = None
        self._lock = asyncio.Lock()
        self._revisions: dict[str, int] = {}
        self._stale = False  # a write's outcome is unknown: reload before the next one
        self._watchers: set[_Watcher] = set()
        self._tasks: list[asyncio.Task[Any]] = []
        self._closing = False
        self.became_leader = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, address: str) -> None:
        """Campaign for leadership as ``address`` (the advertised gRPC address)."""
        self.address = address
        self._election = LeaderElection(
            self.store, ELECTION_NAME, candidate_id=address, ttl=self.config.election_ttl_s
        )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(
                lead_forever(
                    self._election,
                    self._term,
                    step_down=lambda leadership: self._step_down(
                        leadership.reason or "leadership lost"
                    ),
                    expected=(StoreError, LeadershipLost),
                    retry_s=0.5,
                    closing=lambda: self._closing,
                ),
                name="rm-lead",
            ),
            loop.create_task(follow_leader(self._election, self._set_leader), name="rm-observe"),
        ]

    async def close(self) -> None:
        """Stop acting; resign leadership so that a standby takes over at once."""
        self._closing = True
        leadership = self._leadership
        self._step_down("shutting down")
        if leadership is not None:
            with contextlib.suppress(Exception):
                await leadership.resign()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def is_leader(self) -> bool:
        return self._leadership is not None and self._leadership.is_leader

    def _set_leader(self, leader: str | None) -> None:
        self.leader_address = leader

    async def _term(self, leadership: Leadership) -> None:
        """One term (``shoal.runtime.service.lead_forever`` campaigns, steps down and gives
        the lease up however it ends): take over, lead until leadership is lost."""
        checker: asyncio.Task[None] | None = None
        try:
            await self._take_over(leadership)
            checker = asyncio.get_running_loop().create_task(
                self._check_liveness(leadership), name="rm-liveness"
            )
            await leadership.lost.wait()
        finally:
            if checker is not None:
                checker.cancel()
                await asyncio.gather(checker, return_exceptions=True)

    async def _take_over(self, leadership: Leadership) -> None:
        """Rebuild the inventory from the store; every READY host gets a fresh grace."""
        async with self._lock:
            loaded = await self._read_state()
            leadership.check()
            self.inventory.load(loaded.hosts, loaded.allocations, loaded.requests)
            self._revisions = loaded.revisions
            self._stale = False
            self._leadership = leadership
            self.leader_address = self.address
        log.info(
            "leading %s: %d hosts, %d allocations rebuilt from the store",
            ELECTION_NAME,
            len(loaded.hosts),
            len(loaded.allocations),
        )
        self._broadcast(_RESYNC)
        self.became_leader.set()

    def _step_down(self, reason: str) -> None:
        if self._leadership is None:
            return
        log.warning("no longer leading %s: %s", ELECTION_NAME, reason)
        self._leadership = None
        self.became_leader.clear()
        if self.leader_address == self.address:
            self.leader_address = None
        self._broadcast(_DEPOSED)

    async def _read_state(self) -> Loaded:
        kvs, _ = await self.store.list(PREFIX)
        return parse_state(kvs)

    # -- leadership checks ---------------------------------------------------------------------

    def require_leader(self) -> Leadership:
        leadership = self._leadership
        if leadership is None or not leadership.is_leader:
            if leadership is not None:
                self._step_down(leadership.reason or "lease not renewed in time")
            leader = self.leader_address if self.leader_address != self.address else None
            raise NotLeader(ELECTION_NAME, leader)
        return leadership

    # -- writes --------------------------------------------------------------------------------

    async def mutate(
        self,
        compute: Callable[[], tuple[Change, T]],
        *,
        token: resources_pb2.FencingToken | None = None,
    ) -> T:
        """Compute a change against the current state, write it (fenced, compare-and-set) and
        apply it; on a conflict reload the state from the store and recompute once, at once
        (tenacity, no wait: the reload is what the retry needs)."""
        async with self._lock:
            try:
                async for attempt in tenacity.AsyncRetrying(
                    retry=tenacity.retry_if_exception_type(_WriteConflict),
                    stop=tenacity.stop_after_attempt(_WRITE_ATTEMPTS),
                    before_sleep=_log_conflict,
                    reraise=True,
                ):
                    with attempt:
                        return await self._mutate_once(compute, token)
            except _WriteConflict:
                raise Unavailable(
                    "the state changed under a concurrent write twice; retry"
                ) from None
        raise AssertionError("unreachable")

    async def _mutate_once(
        self, compute: Callable[[], tuple[Change, T]], token: resources_pb2.FencingToken | None
    ) -> T:
        """One compute-write-apply; raises :class:`_WriteConflict` (the state is then marked
        stale, so the next attempt reloads it) when a compare-and-set fails."""
        leadership = self.require_leader()
        if self._stale:
            await self._resync()
        scheduler_expect = [await self._verify_token(token)] if token is not None else []
        change, result = compute()
        if not change.writes:
            self._apply(change)
            return result
        ops, expects = change_ops(change, self._revisions)
        try:
            leadership.check()
            revision = await self.store.transaction(
                ops, expect=[*expects, *scheduler_expect], fence=leadership.fence
            )
        except (StoreFencedOut, LeadershipLost) as exc:
            self._step_down(str(exc))
            raise NotLeader(ELECTION_NAME, None) from exc
        except StoreUnavailable as exc:
            self._stale = True
            raise Unavailable(f"the store is unavailable: {exc}") from exc
        if revision is None:
            self._stale = True
            raise _WriteConflict()
        for op in ops:
            if isinstance(op, PutOp):
                self._revisions[op.key] = revision
            else:
                self._revisions.pop(op.key, None)
        self._apply(change)
        return result

    def _apply(self, change: Change) -> None:
        self.inventory.apply(change)
        self.publish(change.events)

    async def _resync(self) -> None:
        try:
            loaded = await self._read_state()
        except StoreUnavailable as exc:
            raise Unavailable(f"the store is unavailable: {exc}") from exc
        self.inventory.load(loaded.hosts, loaded.allocations, loaded.requests, keep_memory=True)
        self._revisions = loaded.revisions
        self._stale = False
        self._broadcast(_RESYNC)

    async def _verify_token(self, token: resources_pb2.FencingToken) -> Expect:
        """Check the caller's fencing token against the scheduler's election in the store:
        its leader key (the oldest key under the election prefix) must have the token's create
        revision. Returns the expectation that keeps the check true in the write."""
        election = self.config.scheduler_election
        if token.election != election:
            raise InvalidField("fencing_token.election", token.election, f"must be {election!r}")
        if token.revision <= 0:
            raise InvalidField("fencing_token.revision", token.revision, "must be > 0")
        try:
            kvs, _ = await self.store.list(election_prefix(election))
        except StoreUnavailable as exc:
            raise Unavailable(f"the store is unavailable: {exc}") from exc
        leader = min(kvs, key=lambda kv: kv.create_revision) if kvs else None
        if leader is None:
            raise FencedOut(
                f"fencing_token (revision {token.revision}) is stale: no {election} leader "
                "is elected"
            )
        holder = leader.value.decode(errors="replace")
        if leader.create_revision != token.revision or (token.holder and token.holder != holder):
            raise FencedOut(
                f"fencing_token (revision {token.revision}, holder {token.holder!r}) is stale: "
                f"the {election} leader is {holder!r} with revision {leader.create_revision}"
            )
        return Expect(leader.key, leader.mod_revision)

    # -- liveness ------------------------------------------------------------------------------

    async def _check_liveness(self, leadership: Leadership) -> None:
        """Declare hosts lost that stayed silent past the grace, unless the silence is on this
        replica's side: a loop that ran late (this process was paused or starved) or every
        host falling silent at once (this replica's network, not the hosts) gives every host
        a fresh grace instead. A second all-at-once silence with no beat in between is real."""
        tick = min(0.1, self.config.host_grace_s / 10)
        delay = tick
        loop = asyncio.get_running_loop()
        last_tick = loop.time()
        held_all_at: float | None = None  # inventory clock when an all-silent episode was held
        while not leadership.lost.is_set():
            await asyncio.sleep(delay)
            delay = tick
            now = loop.time()
            late, last_tick = now - last_tick - tick, now
            if late > self.config.host_grace_s / 2:
                log.warning(
                    "liveness check ran %.2f s late (this replica was paused or starved): "
                    "every host gets a fresh grace",
                    late,
                )
                self.inventory.refresh_liveness()
                continue
            expired = self.inventory.expired_hosts()
            ready = self.inventory.ready_hosts()
            if expired and len(ready) >= 2 and len(expired) == len(ready):
                if held_all_at is None or self.inventory.last_any_beat > held_all_at:
                    log.warning(
                        "all %d hosts went silent at once: suspecting this replica's side, "
                        "every host gets one more grace",
                        len(ready),
                    )
                    held_all_at = self.inventory.last_any_beat
                    self.inventory.refresh_liveness()
                    continue
            for host_id in expired:
                silence = self.inventory.silence(host_id)
                try:
                    await self.mutate(functools.partial(self._declare_lost, host_id))
                except (NotLeader, Unavailable) as exc:
                    log.warning("could not declare host %r lost (will retry): %s", host_id, exc)
                    delay = min(1.0, tick * 10)
                    break
                else:
                    log.warning(
                        "host %r declared lost after %.2f s without a heartbeat", host_id, silence
                    )

    def _declare_lost(self, host_id: str) -> tuple[Change, None]:
        if host_id not in self.inventory.expired_hosts():
            return Change(), None  # it came back while we waited for the lock
        return self.inventory.declare_lost(host_id), None

    # -- events --------------------------------------------------------------------------------

    def publish(self, events: Iterable[Event]) -> None:
        for event in events:
            self._broadcast(self.render(event))

    def _broadcast(self, item: _Item) -> None:
        for watcher in list(self._watchers):
            watcher.offer(item)

    def render(self, event: Event) -> rm_pb2.WatchInventoryResponse:
        out = rm_pb2.WatchInventoryResponse(kind=event.kind.value)
        for host_id in event.hosts:
            with contextlib.suppress(core.HostNotFound):
                out.hosts.append(core.host_to_proto(self.inventory.host(host_id), self.inventory))
        out.allocations.extend(core.allocation_to_proto(a) for a in event.allocations)
        if event.learner is not None:
            out.learner.CopyFrom(core.learner_to_proto(event.learner))
        return out

    def snapshot(self) -> rm_pb2.WatchInventoryResponse:
        return rm_pb2.WatchInventoryResponse(
            kind=EventKind.SNAPSHOT.value,
            hosts=[core.host_to_proto(h, self.inventory) for h in self.inventory.hosts()],
            allocations=[core.allocation_to_proto(a) for a in self.inventory.allocations()],
        )

    async def watch(self) -> AsyncIterator[rm_pb2.WatchInventoryResponse]:
        self.require_leader()
        watcher = _Watcher(self.config.watch_queue_size)
        # Snapshot and subscription in one step (no await between): no gap, no duplicate.
        first = self.snapshot()
        self._watchers.add(watcher)
        try:
            yield first
            while True:
                item = await watcher.queue.get()
                if isinstance(item, _Deposed):
                    raise NotLeader(ELECTION_NAME, self._other_leader())
                if isinstance(item, _Resync):
                    self.require_leader()
                    yield self.snapshot()
                    continue
                yield item
        finally:
            self._watchers.discard(watcher)

    def _other_leader(self) -> str | None:
        return self.leader_address if self.leader_address != self.address else None
