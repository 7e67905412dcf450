"""Job persistence of the scheduler in the state store (etcd), with fenced writes.

etcd layout (all values written by the leader, fenced by its election key)::

    /shoal/v1/job-scheduler/jobs/<job_id>          JobRecord (JSON: the Job in the protobuf
                                                   JSON mapping + learners, coordinator,
                                                   state history)
    /shoal/v1/job-scheduler/requests/<sha256>      job_id (UTF-8); the key is
                                                   sha256(owner + "\\0" + request_id)
    /shoal/v1/job-scheduler/allocations/<job_id>   GetAllocationHistoryResponse (protobuf
                                                   bytes): the job's allocation changes,
                                                   oldest first, bounded
    /shoal/v1/job-scheduler/throughput/<job_id>    ThroughputState (protobuf bytes): what the
                                                   leader learned of the job's throughput
                                                   (at most 64 world sizes); deleted when the
                                                   job ends

:class:`JobTable` is what the service and the reconcile loop use. On the leader it is a
write-through cache of every job (loaded once when leadership is won); on a standby it reads
the store on every call. It also carries the in-process event bus of ``WatchJob``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import DecodeError

from shoal.contract import keys
from shoal.contract.errors import NotLeader, StoreConflict, Unavailable
from shoal.runtime.store import (
    DeleteOp,
    Expect,
    Fence,
    FencedOut,
    PutOp,
    Store,
    StoreError,
    StoreUnavailable,
)
from shoal.scheduler.jobs import JobRecord, append_allocation_event, timestamp
from shoal.v1 import job_pb2, job_scheduler_service_pb2 as js_pb2

__all__ = [
    "ALLOCATIONS",
    "JOBS",
    "PREFIX",
    "REQUESTS",
    "THROUGHPUT",
    "JobTable",
    "StoreConflict",
    "Subscription",
    "request_key",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# The key schema is shoal.contract.keys.
PREFIX = keys.SCHEDULER_PREFIX
JOBS = keys.SCHEDULER_JOBS
REQUESTS = keys.SCHEDULER_REQUESTS
ALLOCATIONS = keys.SCHEDULER_ALLOCATIONS
THROUGHPUT = keys.SCHEDULER_THROUGHPUT

SERVICE = "job-scheduler"


# StoreConflict is defined in shoal.contract.errors (imported above).


def request_key(owner: str, request_id: str) -> str:
    digest = hashlib.sha256(f"{owner}\0{request_id}".encode()).hexdigest()
    return REQUESTS + digest


@dataclass(eq=False)
class Subscription:
    """One WatchJob's queue of events (bounded: a slow reader loses old progress events,
    never state or allocation events)."""

    job_id: str
    queue: asyncio.Queue[job_pb2.JobEvent] = field(default_factory=lambda: asyncio.Queue(1000))

    def put(self, event: job_pb2.JobEvent) -> None:
        if self.queue.full():
            dropped = self._drop_one_progress()
            if not dropped:
                return
        self.queue.put_nowait(event)

    def _drop_one_progress(self) -> bool:
        items: list[job_pb2.JobEvent] = []
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        dropped = False
        for item in items:
            if not dropped and item.kind == job_pb2.JOB_EVENT_KIND_PROGRESS:
                dropped = True
                continue
            self.queue.put_nowait(item)
        return dropped


# Set (to the unix time of the state served) when a read was answered from the last known
# state because the store is unreachable; the handlers put it in the ``shoal-stale-as-of``
# trailer. Each gRPC call runs in its own task, so the value never leaks between calls.
STALE_AS_OF: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "shoal_stale_as_of", default=None
)
STORE_PROBE_TIMEOUT_S = 2.0


class JobTable:
    """The jobs, persisted in ``store`` (see the module docstring).

    ``fence``: the leadership fence of every write; ``leader_address``: who leads (for the
    NotLeader answer of a standby). ``clock`` gives unix seconds.
    """

    def __init__(
        self,
        store: Store,
        *,
        history_limit: int = 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if history_limit < 1:
            raise ValueError(f"history_limit ({history_limit}) must be >= 1")
        self.store = store
        self.history_limit = history_limit
        self.clock = clock
        self.fence: Fence | None = None
        self.leading = False
        self.leader_address: str | None = None
        self.records: dict[str, JobRecord] = {}
        # The jobs whose record was created, written or reloaded (its revision changed) or
        # marked (``mark``) since ``take_dirty``: what the reconcile loop's incremental cycle
        # observes again (its periodic full cycle checks every record).
        self.dirty: set[str] = set()
        self.histories: dict[str, list[job_pb2.AllocationEvent]] = {}
        self._history_revs: dict[str, int] = {}
        # The throughput states read when leadership was won (the reconcile loop takes them).
        self.throughput: dict[str, job_pb2.ThroughputState] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._request_locks: dict[str, asyncio.Lock] = {}
        self._subscribers: dict[str, set[Subscription]] = {}
        self._last_seq = 0
        # What this replica knew when it last stopped leading: (unix time, jobs, histories).
        # Served, marked stale, while the store cannot be read (an etcd outage).
        self._last_known: (
            tuple[float, dict[str, JobRecord], dict[str, list[job_pb2.AllocationEvent]]] | None
        ) = None

    # -- leadership ---------------------------------------------------------------------------

    def require_leader(self) -> None:
        """Raise :class:`NotLeader` (UNAVAILABLE with the leader's address) on a standby."""
        if not self.leading:
            raise NotLeader(SERVICE, self.leader_address)

    async def require_writable(self) -> None:
        """As :meth:`require_leader`, but a standby first checks the store: while etcd is
        unreachable no replica can lead, and the caller is told so (UNAVAILABLE naming etcd)
        instead of being sent to a leader that cannot write either."""
        if self.leading:
            return
        try:
            await asyncio.wait_for(self.store.get(JOBS), STORE_PROBE_TIMEOUT_S)
        except (StoreError, TimeoutError) as exc:
            raise Unavailable(
                f"the state store (etcd) is unreachable ({exc or 'no answer'}): writes are "
                "refused until it is back; reads serve the last known state"
            ) from exc
        raise NotLeader(SERVICE, self.leader_address)

    async def become_leader(self, fence: Fence | None) -> None:
        """Load every job, allocation history and throughput state from the store; start
        acting on them."""
        self.fence = fence
        self.records, self.histories, self._history_revs = {}, {}, {}
        self.throughput = {}
        with self._translate("load jobs"):
            kvs, _ = await self.store.list(JOBS)
            hist, _ = await self.store.list(ALLOCATIONS)
            learned, _ = await self.store.list(THROUGHPUT)
        legacy: list[JobRecord] = []
        for kv in kvs:
            try:
                record = JobRecord.from_bytes(kv.value, revision=kv.mod_revision)
            except (ValueError, KeyError) as exc:
                log.error("skipping unreadable job record %s: %s", kv.key, exc)
                continue
            self.records[record.job_id] = record
            self.dirty.add(record.job_id)
            self._last_seq = max(self._last_seq, record.submit_seq)
            if JobRecord.is_legacy(kv.value):
                legacy.append(record)
        for kv in hist:
            job_id = kv.key.removeprefix(ALLOCATIONS)
            response = js_pb2.GetAllocationHistoryResponse.FromString(kv.value)
            self.histories[job_id] = list(response.events)
            self._history_revs[job_id] = kv.mod_revision
        for kv in learned:
            job_id = kv.key.removeprefix(THROUGHPUT)
            try:
                self.throughput[job_id] = job_pb2.ThroughputState.FromString(kv.value)
            except DecodeError as exc:
                log.error("skipping unreadable throughput state %s: %s", kv.key, exc)
        self.leading = True
        self._last_known = None
        log.info("loaded %d jobs from the store", len(self.records))
        await self._migrate(legacy)

    async def _migrate(self, legacy: list[JobRecord]) -> None:
        """Rewrite the records still in the JSON encoding of earlier releases as
        ``JobRecordState`` (fenced, compare-and-set like every write). One that cannot be
        written now stays readable and is rewritten by its next save."""
        migrated = 0
        for record in legacy:
            try:
                await self.save(record)
            except (StoreConflict, Unavailable) as exc:
                log.warning("job %s: record not migrated yet: %s", record.job_id, exc)
            else:
                migrated += 1
        if legacy:
            log.info("migrated %d of %d job records to JobRecordState", migrated, len(legacy))

    def step_down(self) -> None:
        if self.leading:
            self._last_known = (self.clock(), self.records, self.histories)
        self.leading = False
        self.fence = None
        self.records = {}
        self.histories = {}
        self._history_revs = {}
        for subs in self._subscribers.values():
            for sub in subs:
                sub.put(_closing_event(sub.job_id))

    # -- errors -------------------------------------------------------------------------------

    async def _read(self, awaitable: Awaitable[T]) -> T:
        """A standby's store read. With a last known state to fall back on, it is bounded by
        STORE_PROBE_TIMEOUT_S: an etcd member without quorum holds a read until its own
        timeout, longer than a client's deadline, and the stale answer must come first."""
        if self._last_known is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, STORE_PROBE_TIMEOUT_S)
        except TimeoutError as exc:
            raise StoreUnavailable(f"no answer within {STORE_PROBE_TIMEOUT_S} s") from exc

    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        try:
            yield
        except FencedOut as exc:
            self.leading = False
            raise NotLeader(SERVICE, None) from exc
        except StoreUnavailable as exc:
            raise Unavailable(f"{what}: the state store is unavailable ({exc})") from exc
        except StoreError as exc:
            raise Unavailable(f"{what}: the state store failed ({exc})") from exc

    @contextlib.contextmanager
    def _or_last_known(self) -> Iterator[list[bool]]:
        """Around a standby's store read: if the store is unreachable and this replica led
        before, the caller serves its last known state (``flag[0]`` becomes True and
        :data:`STALE_AS_OF` is set); otherwise the error goes up. A read that succeeds forgets
        the last known state (the store is the truth again)."""
        flag = [False]
        try:
            yield flag
        except Unavailable:
            if self._last_known is None:
                raise
            STALE_AS_OF.set(self._last_known[0])
            flag[0] = True
        else:
            self._last_known = None

    # -- reads --------------------------------------------------------------------------------

    async def get(self, job_id: str) -> JobRecord | None:
        """The job (leader: the live record; standby: read from the store)."""
        if self.leading:
            return self.records.get(job_id)
        if not job_id or "/" in job_id:
            return None
        kv = None
        with self._or_last_known() as stale:
            with self._translate(f"read job {job_id}"):
                kv = await self._read(self.store.get(JOBS + job_id))
        if stale[0] and self._last_known is not None:
            return self._last_known[1].get(job_id)
        return None if kv is None else JobRecord.from_bytes(kv.value, revision=kv.mod_revision)

    async def all(self) -> list[JobRecord]:
        if self.leading:
            return list(self.records.values())
        kvs = []
        with self._or_last_known() as stale:
            with self._translate("list jobs"):
                kvs, _ = await self._read(self.store.list(JOBS))
        if stale[0] and self._last_known is not None:
            return list(self._last_known[1].values())
        out = []
        for kv in kvs:
            with contextlib.suppress(ValueError, KeyError):
                out.append(JobRecord.from_bytes(kv.value, revision=kv.mod_revision))
        return out

    async def history(self, job_id: str) -> list[job_pb2.AllocationEvent]:
        if self.leading:
            return list(self.histories.get(job_id, ()))
        kv = None
        with self._or_last_known() as stale:
            with self._translate(f"read allocation history of {job_id}"):
                kv = await self._read(self.store.get(ALLOCATIONS + job_id))
        if stale[0] and self._last_known is not None:
            return list(self._last_known[2].get(job_id, ()))
        if kv is None:
            return []
        return list(js_pb2.GetAllocationHistoryResponse.FromString(kv.value).events)

    async def find_request(self, owner: str, request_id: str) -> JobRecord | None:
        with self._translate("read request index"):
            kv = await self.store.get(request_key(owner, request_id))
        if kv is None:
            return None
        return await self.get(kv.value.decode())

    # -- writes -------------------------------------------------------------------------------

    def lock(self, job_id: str) -> asyncio.Lock:
        return self._locks.setdefault(job_id, asyncio.Lock())

    def request_lock(self, owner: str, request_id: str) -> asyncio.Lock:
        return self._request_locks.setdefault(request_key(owner, request_id), asyncio.Lock())

    def new_job_id(self) -> str:
        return f"job-{uuid.uuid4().hex[:12]}"

    def next_seq(self) -> int:
        """A submit sequence: increasing, and about the submit time in nanoseconds."""
        self._last_seq = max(self._last_seq + 1, time.time_ns())
        return self._last_seq

    async def create(self, record: JobRecord) -> bool:
        """Store a new job (and its request index) atomically. False if the request id (or
        the job id) is already taken: nothing was written."""
        self.require_leader()
        ops: list[PutOp | DeleteOp] = [PutOp(JOBS + record.job_id, record.to_bytes())]
        expect = [Expect(JOBS + record.job_id, 0)]
        if record.request_id:
            key = request_key(record.owner, record.request_id)
            ops.append(PutOp(key, record.job_id.encode()))
            expect.append(Expect(key, 0))
        with self._translate(f"create job {record.job_id}"):
            revision = await self.store.transaction(ops, expect=expect, fence=self.fence)
        if revision is None:
            return False
        record.revision = revision
        self.records[record.job_id] = record
        self.dirty.add(record.job_id)
        return True

    async def save(self, record: JobRecord) -> None:
        """Write the live record as it is now (compare-and-set on its revision, fenced)."""
        self.require_leader()
        async with self.lock(record.job_id):
            await self._write(record, record.to_bytes())

    def mark(self, job_id: str) -> None:
        """Note that the live record of ``job_id`` changed in memory (not written yet)."""
        self.dirty.add(job_id)

    def take_dirty(self) -> set[str]:
        """The jobs created, written, reloaded or marked since the last call."""
        out, self.dirty = self.dirty, set()
        return out

    async def update(self, record: JobRecord, mutate: Callable[[JobRecord], T]) -> T:
        """Apply ``mutate`` to the job only if the change can be stored.

        ``mutate`` runs first on a copy (it may raise: nothing changes), the copy is written,
        then ``mutate`` runs again on the live record. ``mutate`` must be deterministic.
        """
        self.require_leader()
        async with self.lock(record.job_id):
            copy = JobRecord.from_bytes(record.to_bytes(), revision=record.revision)
            mutate(copy)
            await self._write(record, copy.to_bytes())
            try:
                return mutate(record)
            finally:
                self.dirty.add(record.job_id)

    async def _write(self, record: JobRecord, data: bytes) -> None:
        key = JOBS + record.job_id
        with self._translate(f"write job {record.job_id}"):
            revision = await self.store.transaction(
                [PutOp(key, data)], expect=[Expect(key, record.revision)], fence=self.fence
            )
        if revision is None:
            raise StoreConflict(
                f"job {record.job_id} changed in the store since revision {record.revision}"
            )
        record.revision = revision
        self.dirty.add(record.job_id)

    async def reload(self, job_id: str) -> JobRecord | None:
        """Replace the live record with the stored one (after a :class:`StoreConflict`)."""
        with self._translate(f"reload job {job_id}"):
            kv = await self.store.get(JOBS + job_id)
        self.dirty.add(job_id)
        if kv is None:
            self.records.pop(job_id, None)
            return None
        record = JobRecord.from_bytes(kv.value, revision=kv.mod_revision)
        self.records[job_id] = record
        return record

    async def add_allocation_event(
        self, record: JobRecord, workers: int, target: int, reason: str
    ) -> job_pb2.AllocationEvent:
        """Record an allocation change of the job (bounded history, persisted) and publish it."""
        self.require_leader()
        event = job_pb2.AllocationEvent(
            time=timestamp(self.clock()),
            job_id=record.job_id,
            workers=workers,
            target_workers=target,
            reason=reason,
        )
        async with self.lock("allocations/" + record.job_id):
            events = list(self.histories.get(record.job_id, ()))
            append_allocation_event(events, event, self.history_limit)
            key = ALLOCATIONS + record.job_id
            data = js_pb2.GetAllocationHistoryResponse(events=events).SerializeToString()
            with self._translate(f"write allocation history of {record.job_id}"):
                await self.store.put(key, data, fence=self.fence)
            self.histories[record.job_id] = events
        self.publish(record, job_pb2.JOB_EVENT_KIND_ALLOCATION, allocation=event)
        return event

    async def save_throughput(self, job_id: str, state: job_pb2.ThroughputState) -> None:
        """Store what was learned of the job's throughput (fenced; the last write wins)."""
        self.require_leader()
        with self._translate(f"write throughput state of {job_id}"):
            await self.store.put(THROUGHPUT + job_id, state.SerializeToString(), fence=self.fence)

    async def delete_throughput(self, job_id: str) -> None:
        """Forget the job's stored throughput state (it ended; fenced)."""
        self.require_leader()
        self.throughput.pop(job_id, None)
        with self._translate(f"delete throughput state of {job_id}"):
            await self.store.delete(THROUGHPUT + job_id, fence=self.fence)

    # -- WatchJob event bus -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def subscribe(self, job_id: str) -> AsyncIterator[Subscription]:
        sub = Subscription(job_id)
        self._subscribers.setdefault(job_id, set()).add(sub)
        try:
            yield sub
        finally:
            subs = self._subscribers.get(job_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subscribers[job_id]

    def publish(
        self,
        record: JobRecord,
        kind: int,
        *,
        allocation: job_pb2.AllocationEvent | None = None,
    ) -> None:
        subs = self._subscribers.get(record.job_id)
        if not subs:
            return
        event = job_pb2.JobEvent(kind=kind, job=record.public(), time=timestamp(self.clock()))  # type: ignore[arg-type]
        if allocation is not None:
            event.allocation.CopyFrom(allocation)
        for sub in subs:
            sub.put(event)


def _closing_event(job_id: str) -> job_pb2.JobEvent:
    """Tells a watcher that this replica stopped leading (its stream ends with NotLeader)."""
    return job_pb2.JobEvent(kind=job_pb2.JOB_EVENT_KIND_UNSPECIFIED, job=job_pb2.Job(job_id=job_id))
