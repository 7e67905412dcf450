"""The scheduler's control loop: turn (jobs, inventory, policy) into learners, level-triggered.

Only the leader runs it (:meth:`Reconciler.lead`, for as long as its leadership holds). It is
triggered by events (submit, cancel, update, and the resource-manager's WatchInventory:
HOST_UP, HOST_LOST, HOST_CHANGED, RELEASED, LEARNER_EXITED, a new SNAPSHOT) and by a periodic
resync; every cycle recomputes the decisions from what it observes, so a missed event costs at
most one resync interval.

A cycle (:meth:`Reconciler.cycle`, synchronous, no I/O; its observing and deciding are the
pure functions of :mod:`shoal.scheduler.reconcile.decide`, which it applies):

1. builds the observed state: the inventory (hosts, devices, the ledger) and every learner the
   jobs hold; learners on lost hosts (or on an older incarnation of their host) are lost;
2. runs the pure policy + placement (``shoal.scheduler.placement.plan``);
3. turns the plan and the housekeeping each job needs (exits to process, learners to stop,
   a cancel to finish, a data plane to close, a job to requeue) into one :class:`JobWork` per
   job, and hands each to a worker task, at most one per job (a job is never reconciled twice
   at once). A busy job is skipped (and looked at again when its worker ends); a job whose last
   attempt failed with a transient error waits out an exponential backoff.

A worker does the I/O of its job, in this order: process learner exits (ReleaseDevices only
after the agent reported the exit; a non-zero exit of a learner that was not leaving is a
failure: EvictLearner), evict lost learners and release their devices, check completion
(GetJobProgress.done), retire (RetireLearners on the coordinator), stop (StopLearner), grow
(OpenJob before the first learner, AcquireDevices fenced, StartLearner), and finish jobs
(CANCELLING -> CANCELLED, CloseJob). Every change is written to etcd (fenced) before the next
step relies on it; learners are written as PENDING before their devices are acquired, so a new
leader can tell its predecessor's allocations from orphans. When a worker ends, the loop runs
again at once, so a device freed by an exit goes to the waiting job without waiting for the
resync.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.duration_pb2 import Duration
from opentelemetry import context as otel_context, trace

from shoal.contract.data_plane import (
    CoordinatorRecord,
    coordinator_key,
    encode_coordinator,
)
from shoal.contract.errors import NotLeader, ShoalError, StoreError, Unavailable
from shoal.runtime.election import Leadership, LeadershipLost
from shoal.scheduler.artifacts import Storage
from shoal.scheduler.health import JobHealth, VerdictKind, assess, lost_reason
from shoal.scheduler.jobs import (
    HOLDING,
    LEAVING,
    STARTED_STATES,
    STATE_HISTORY_LIMIT,
    JobRecord,
    LearnerPhase,
    LearnerRecord,
    StateChange,
    state_name,
)
from shoal.scheduler.placement import (
    Start,
    plan,
)
from shoal.scheduler.reconcile import decide
from shoal.scheduler.reconcile.config import ELECTION, ReconcileConfig
from shoal.scheduler.reconcile.inventory import Inventory
from shoal.scheduler.reconcile.peers import (
    TRANSIENT_CODES,
    UNREACHABLE,
    FencedOutByPeer,
    Peers,
    PermanentFailure,
    check_fenced,
    describe,
)
from shoal.scheduler.reconcile.registry import CoordinatorMoves, ShardRegistry
from shoal.scheduler.reconcile.rules import coordinator_index, learner_env, resolve_sync_mode
from shoal.scheduler.reconcile.work import Backoff, JobWork
from shoal.scheduler.store import JobTable, StoreConflict
from shoal.scheduler.tracing import RescaleTracker, job_context
from shoal.v1 import (
    host_agent_service_pb2 as ha_pb2,
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    resource_manager_service_pb2 as rm_pb2,
    resources_pb2,
)

if TYPE_CHECKING:
    from shoal.scheduler.metrics import SchedulerMetrics


log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)

T = TypeVar("T")

S = job_pb2


class Reconciler:
    """The control loop of one leader term (see the module docstring)."""

    def __init__(
        self,
        table: JobTable,
        peers: Peers,
        storage: Storage,
        config: ReconcileConfig,
        *,
        clock: Callable[[], float] = time.time,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.table = table
        self.peers = peers
        self.storage = storage
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self.registry = None if config.sync_shards else ShardRegistry(table.store)
        self.inventory = Inventory()
        self.exits: dict[str, resources_pb2.Learner] = {}
        self.members: dict[str, tuple[str, ...]] = {}
        self._wake = asyncio.Event()
        self._causes: list[str] = []
        self._busy: dict[str, asyncio.Task[None]] = {}
        self._backoff: dict[str, Backoff] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._leadership: Leadership | None = None
        self._token = resources_pb2.FencingToken()
        self._deposed = asyncio.Event()
        self._progress_saved: dict[str, float] = {}
        self._last_sweep = 0.0
        self._orphans_busy = False
        self.health: dict[str, JobHealth] = {}
        self.moves = CoordinatorMoves(table.store, self._coordinator_moved)
        self._moved: set[str] = set()
        self._takeover_tried: dict[str, float] = {}
        self.cycles = 0
        self.rescales = RescaleTracker(clock=clock)
        self._triggered_at: float | None = None

    def _reset(self) -> None:
        self.inventory = Inventory()
        self.exits = {}
        self.members = {}
        self._wake = asyncio.Event()
        self._causes = []
        self._busy = {}
        self._backoff = {}
        self._tasks = set()
        self._deposed = asyncio.Event()
        self._progress_saved = {}
        self._last_sweep = 0.0
        self._orphans_busy = False
        self.health = {}
        self.moves = CoordinatorMoves(self.table.store, self._coordinator_moved)
        self._moved = set()
        self._takeover_tried = {}

    # -- triggers -------------------------------------------------------------------------------

    def trigger(self, cause: str = "") -> None:
        """Ask for a cycle soon (events: submit, cancel, update, inventory changes)."""
        if cause and cause not in self._causes:
            self._causes.append(cause)
            del self._causes[:-8]
        if self._triggered_at is None:
            self._triggered_at = self.clock()  # where the next decision's span begins
        self._wake.set()

    @property
    def fencing_token(self) -> resources_pb2.FencingToken:
        return self._token

    def shards(self) -> tuple[str, ...]:
        """The parameter-sync shards in shard order (the flag, else the etcd registry)."""
        if self.config.sync_shards:
            return self.config.sync_shards
        return self.registry.shards() if self.registry is not None else ()

    # -- leadership term ------------------------------------------------------------------------

    async def lead(self, leadership: Leadership | None) -> None:
        """Run the loop until leadership is lost (or the task is cancelled).

        ``leadership`` None runs without an election (single replica, tests). Everything
        but the jobs (which ``JobTable.become_leader`` loaded) is observed afresh."""
        self._reset()
        self._leadership = leadership
        if leadership is not None:
            self._token = resources_pb2.FencingToken(
                election=ELECTION,
                holder=leadership.candidate_id,
                revision=leadership.fence.create_revision,
            )
        loop_tasks = [
            asyncio.create_task(self._watch_inventory(), name="scheduler-inventory"),
            asyncio.create_task(self._loop(), name="scheduler-loop"),
            asyncio.create_task(self._progress_loop(), name="scheduler-progress"),
            asyncio.create_task(self._watch_rescales(), name="scheduler-rescales"),
            asyncio.create_task(self.moves.run(), name="scheduler-coordinators"),
        ]
        if self.registry is not None:
            loop_tasks.append(asyncio.create_task(self.registry.run(), name="scheduler-shards"))
        waiters = [asyncio.create_task(self._deposed.wait())]
        if leadership is not None:
            waiters.append(asyncio.create_task(leadership.lost.wait()))
        try:
            done, _ = await asyncio.wait(
                [*loop_tasks, *waiters], return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if task in loop_tasks and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            everything = [*loop_tasks, *waiters, *self._busy.values(), *self._tasks]
            for task in everything:
                task.cancel()
            await asyncio.gather(*everything, return_exceptions=True)
            self._busy.clear()
            self._tasks.clear()
            self.rescales.close_all("leadership ended")
            log.info("reconcile loop stopped")

    def _check_leader(self) -> None:
        if self._deposed.is_set():
            raise LeadershipLost("deposed")
        if self._leadership is not None:
            self._leadership.check()

    def _depose(self, why: str) -> None:
        if not self._deposed.is_set():
            log.warning("stepping down: %s", why)
            self.table.leading = False
            self._deposed.set()

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.resync_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            if not self.inventory.synced:
                continue
            try:
                self._check_leader()
            except LeadershipLost as exc:
                self._depose(str(exc))
                return
            try:
                # A trace of its own: a cycle looks at every job (workers and rescales link it).
                with _tracer.start_as_current_span(
                    "scheduling cycle", context=otel_context.Context()
                ):
                    self.cycle()
            except Exception:
                log.exception("reconcile cycle failed")
            now = self.clock()
            if now - self._last_sweep >= self.config.agent_sweep_s:
                self._last_sweep = now
                self._spawn(self._sweep_agents(), "scheduler-agent-sweep")

    # -- the cycle (pure decisions + dispatch) -------------------------------------------------

    def cycle(self) -> None:
        """One reconcile cycle: observe, plan, dispatch (no I/O; see the module docstring).
        The decisions are the pure functions of ``decide``; this applies them."""
        self.cycles += 1
        now = self.clock()
        causes, self._causes = self._causes, []
        decided_from, self._triggered_at = self._triggered_at or now, None
        records = self.table.records
        hosts = self.inventory.hosts

        observed = decide.observe(records, hosts, self.exits, busy=self._busy)
        demands = decide.demands(records)
        # Placement must not see a device twice; lost learners were left out by observe.
        targets_before = {r.job_id: r.job.target_workers for r in records.values()}
        decided = plan(
            demands, self.inventory.host_views(), observed.current, self.config.placement, now=now
        )
        changed = []
        for job_id, (target, position) in decide.targets(records, decided).items():
            record = records[job_id]
            record.decided_priority = record.job.spec.priority
            if self.metrics is not None:
                self.metrics.target_changed(job_id, record.job.target_workers, target, now)
            if (record.job.target_workers, record.job.queue_position) != (target, position):
                record.job.target_workers = target
                record.job.queue_position = position
                changed.append(job_id)
        moved = self._moved & records.keys()
        self._moved -= moved
        held = {job_id for job_id, health in self.health.items() if health.down}
        work = decide.decide(
            records,
            hosts,
            observed,
            decided,
            self.config,
            changed=changed,
            moved=moved,
            held=held,
            now=now,
        )
        starts_by_job = decide.starts_by_job(decided)

        # Rescales (traces only): jobs whose target changed or whose learners change.
        self.rescales.decided(
            [
                (
                    r,
                    targets_before.get(r.job_id, 0),
                    r.job.target_workers,
                    bool(starts_by_job.get(r.job_id))
                    or bool(r.job_id in work and (work[r.job_id].retires or work[r.job_id].lost)),
                )
                for r in records.values()
                if r.active
            ],
            causes=causes,
            decided_from=min(decided_from, now),
            cycle=trace.get_current_span().get_span_context(),
        )

        # 4. Dispatch: one worker per job at a time; backoff after transient errors.
        dispatched = 0
        for job_id in [*work, *(j for j in starts_by_job if j not in work)]:
            target_record = records.get(job_id)
            if target_record is None or job_id in self._busy:
                continue
            record = target_record
            jw = work.get(job_id) or JobWork()
            # No learner starts while the job's coordinator is unreachable: it could not sync.
            held = self._held(job_id)
            starts = starts_by_job.get(job_id, []) if record.active and not held else []
            if jw.empty() and not starts:
                continue
            backoff = self._backoff.get(job_id)
            if backoff is not None and backoff.until > now:
                self._wake_at(backoff.until)
                continue
            jw.starts = self._pending_learners(record, starts, now)
            self._busy[job_id] = self._spawn(
                self._run_worker(record, jw, causes), f"scheduler-job-{job_id}"
            )
            dispatched += 1

        # Exits of learners no job knows are of no use; orphans are freed by the sweep.
        known = {lid for r in records.values() for lid in r.learners}
        for learner_id in [lid for lid in self.exits if lid not in known]:
            del self.exits[learner_id]
        self._release_orphans(known)
        self.rescales.check_all(records)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(
                {
                    "shoal.cycle": self.cycles,
                    "shoal.cycle.causes": causes,
                    "shoal.cycle.jobs": len(records),
                    "shoal.cycle.jobs_active": len(demands),
                    "shoal.cycle.jobs_queued": len(decided.queue),
                    "shoal.cycle.starts": len(decided.starts),
                    "shoal.cycle.retires": len(decided.retires),
                    "shoal.cycle.jobs_with_work": len(work),
                    "shoal.cycle.workers_dispatched": dispatched,
                    "shoal.cycle.rescales_open": len(self.rescales.open),
                }
            )

    def _coordinator_moved(self, job_id: str, moved: CoordinatorRecord) -> None:
        """The parameter-sync tier moved a job's coordinator (a shard failed over): talk to
        the new one from now on (progress, retire, evict, close; new learners are told it)."""
        record = self.table.records.get(job_id)
        if record is None or record.final:
            return
        if (record.coordinator_address, record.coordinator_index) == (moved.address, moved.index):
            return
        log.warning(
            "job %s: coordinator moved from %s to shard %d (%s), epoch %d",
            job_id,
            self._shard_name(record),
            moved.index,
            moved.address,
            moved.epoch,
        )
        record.coordinator_address = moved.address
        record.coordinator_index = moved.index
        health = self.health.get(job_id)
        if health is not None:
            health.unreachable_since = None  # the new coordinator answers for it now
            health.unreachable_why = ""
        self._moved.add(job_id)
        self.trigger(f"job {job_id} coordinator moved to shard {moved.index}")

    def _held(self, job_id: str) -> bool:
        """Whether the job's coordinator is unreachable (no learner may start)."""
        health = self.health.get(job_id)
        return health is not None and health.down

    def _pending_learners(
        self, record: JobRecord, starts: Sequence[Start], now: float
    ) -> list[LearnerRecord]:
        """Record the decided starts as PENDING learners (synchronously: the next cycle sees
        their devices as taken)."""
        out = []
        for start in starts:
            host = self.inventory.hosts.get(start.host_id)
            device = self.inventory.device(start.host_id, start.device_id)
            lr = LearnerRecord(
                learner_id=record.next_learner_id(),
                host_id=start.host_id,
                device_id=start.device_id,
                agent_address=host.agent_address if host is not None else "",
                host_incarnation=host.incarnation if host is not None else 0,
                simulated=bool(device.simulated) if device is not None else True,
                created_at=now,
                phase_since=now,
            )
            record.learners[lr.learner_id] = lr
            out.append(lr)
        return out

    def _wake_at(self, when: float) -> None:
        delay = max(0.0, when - self.clock())
        asyncio.get_running_loop().call_later(delay, self.trigger)

    # -- the worker of one job --------------------------------------------------------------------

    async def _run_worker(self, record: JobRecord, work: JobWork, causes: list[str]) -> None:
        job_id = record.job_id
        before = record.workers()
        try:
            self._check_leader()
            # In the job's trace (its submit), linked to the cycle that dispatched it: it
            # reaches the peers through the gRPC interceptors and the learners through
            # TRACEPARENT.
            cycle = trace.get_current_span().get_span_context()
            with _tracer.start_as_current_span(
                "reconcile job",
                context=job_context(record),
                attributes={"shoal.job_id": job_id},
                links=[trace.Link(cycle)] if cycle.is_valid else None,
            ):
                await self._work(record, work, causes)
            self._backoff.pop(job_id, None)
        except (LeadershipLost, NotLeader, FencedOutByPeer) as exc:
            self._depose(f"job {job_id}: {exc}")
        except StoreConflict as exc:
            log.error("job %s: %s; reloading it from the store", job_id, exc)
            with contextlib.suppress(ShoalError):
                await self.table.reload(job_id)
            self._note_backoff(job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            transient = isinstance(exc, Unavailable | TimeoutError) or (
                isinstance(exc, grpc.aio.AioRpcError) and exc.code() in TRANSIENT_CODES
            )
            if not transient:
                log.exception("job %s: reconcile failed", job_id)
            else:
                log.info("job %s: transient failure, backing off: %s", job_id, describe(exc))
            self._note_backoff(job_id)
        finally:
            self._busy.pop(job_id, None)
            with contextlib.suppress(Exception):
                await self._note_allocation(record, before, work, causes)
            self.trigger()

    def _note_backoff(self, job_id: str) -> None:
        prev = self._backoff.get(job_id)
        delay = (
            self.config.backoff_initial_s
            if prev is None
            else min(prev.delay * 2, self.config.backoff_max_s)
        )
        self._backoff[job_id] = Backoff(self.clock() + delay, delay)
        self._wake_at(self.clock() + delay)

    async def _note_allocation(
        self, record: JobRecord, before: int, work: JobWork, causes: list[str]
    ) -> None:
        """Record an allocation event when the job's worker count changed."""
        if not self.table.leading or self.table.records.get(record.job_id) is not record:
            return
        history = self.table.histories.get(record.job_id)
        last = history[-1].workers if history else 0
        workers = record.workers()
        if workers == last:
            return
        parts = []
        if workers > before:
            parts.append(f"{workers - before} learner(s) started")
        if work.retires:
            parts.append(f"{len(work.retires)} learner(s) retiring")
        if work.lost:
            parts.append(f"{len(work.lost)} learner(s) lost ({work.lost[0][1]})")
        if work.exits:
            parts.append(f"{len(work.exits)} learner(s) exited")
        if work.stops:
            parts.append(f"{len(work.stops)} learner(s) stopped")
        if not record.active:
            parts.append(f"job {state_name(record.state)}")
        reason = "; ".join(parts) or "allocation changed"
        if causes:
            reason += f" (after: {', '.join(causes)})"
        await self.table.add_allocation_event(record, workers, record.job.target_workers, reason)
        record.sync_counts()
        if record.state == S.JOB_STATE_RUNNING and record.job.state_reason.startswith("running on"):
            # The reason tells how many learners run now, not how many ran when it started.
            record.job.state_reason = f"running on {workers} learner(s)"
            self.table.publish(record, S.JOB_EVENT_KIND_STATE)

    async def _work(self, record: JobRecord, work: JobWork, causes: list[str]) -> None:
        if work.retry:
            await self._retry(record, work.retry)
            return
        dirty = work.save
        if work.drop_pending:
            for lid in work.drop_pending:
                record.learners.pop(lid, None)
            dirty = True
        if work.exits:
            await self._process_exits(record, work.exits)
            dirty = False
        if work.lost:
            await self._process_lost(record, work.lost)
            dirty = False
        if work.retires and record.active:
            with self.rescales.phase(record.job_id, "drain", work.retires):
                await self._retire(record, work.retires)
            dirty = False
        if work.stops:
            await self._stop(record, work.stops)
            dirty = False
        if self._held(record.job_id) and (work.starts or work.restarts):
            # Its coordinator turned out unreachable while this work ran (an evict above):
            # learners started now could not sync. They start once it answers again.
            for lr in work.starts:
                if record.learners.get(lr.learner_id) is lr and lr.phase is LearnerPhase.PENDING:
                    del record.learners[lr.learner_id]
            work.starts, work.restarts = [], []
            dirty = True
        if work.restarts and record.active:
            with self.rescales.phase(record.job_id, "start", work.restarts):
                await self._start_learners(
                    record,
                    [record.learners[lid] for lid in work.restarts if lid in record.learners],
                )
        if work.starts:
            with self.rescales.phase(record.job_id, "start", [lr.learner_id for lr in work.starts]):
                await self._grow(record, work.starts)
            dirty = False
        if work.finish:
            await self._finish(record)
            dirty = False
        if work.requeue and record.state in STARTED_STATES and not record.learners:
            await self._transition(
                record,
                S.JOB_STATE_QUEUED,
                "all its learners were preempted or lost; waiting "
                "for devices (it resumes from its latest state)",
            )
            dirty = False
        if dirty:
            await self.table.save(record)

    # -- exits, losses --------------------------------------------------------------------------

    async def _release(self, allocation_ids: Sequence[str]) -> None:
        ids = [a for a in allocation_ids if a]
        if not ids:
            return
        request = rm_pb2.ReleaseDevicesRequest(fencing_token=self._token, allocation_ids=ids)
        try:
            await self.peers.rm_call("ReleaseDevices", request, self.config.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            check_fenced(exc)
            raise
        self.inventory.released(ids)

    async def _evict(self, record: JobRecord, learner_id: str, reason: str) -> None:
        if not record.opened or not record.coordinator_address:
            return
        request = ps_pb2.EvictLearnerRequest(
            job_id=record.job_id, learner_id=learner_id, reason=reason, fencing_token=self._token
        )
        try:
            await self.peers.shard(record.coordinator_address).EvictLearner(
                request, timeout=self.config.call_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            check_fenced(exc)
            if exc.code() in UNREACHABLE:
                # The coordinator is down: its membership is gone with it (a re-open starts
                # afresh). Waiting for it here would keep every exit unprocessed, and the job
                # reported with learners that no longer run.
                log.info("job %s: evict %s: %s", record.job_id, learner_id, describe(exc))
                self._unreachable(record, exc)
                return
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def _process_exits(
        self, record: JobRecord, exits: Sequence[resources_pb2.Learner]
    ) -> None:
        """Exits the agents reported: evict a learner that died while its job runs (its
        iteration must be re-run), release its device (only now), forget it. A clean exit of
        a learner that was not leaving means the job may be done; a failure of one counts
        (once per batch: a whole generation dying at once is one failure)."""
        now = self.clock()
        check_done = False
        failures: list[str] = []
        for learner in exits:
            lr = record.learners.get(learner.learner_id)
            if lr is None:
                self.exits.pop(learner.learner_id, None)
                continue
            leaving = lr.phase in LEAVING or not record.active
            why = learner.exit_reason or f"exit code {learner.exit_code}"
            ended = learner.end_time.seconds + learner.end_time.nanos / 1e9
            self.rescales.exited(record.job_id, lr.learner_id, ended or None)
            # A learner its agent reports FAILED with code 0 ended without training.
            failed = learner.exit_code != 0 or learner.state == resources_pb2.LEARNER_STATE_FAILED
            if failed and record.active:
                await self._evict(record, lr.learner_id, f"exited: {why}")
            if not leaving:
                if not failed:
                    check_done = True
                else:
                    failures.append(f"learner {lr.learner_id} on host {lr.host_id} failed: {why}")
            with self.rescales.phase(record.job_id, "device free", [lr.learner_id]):
                await self._release([lr.allocation_id])
            record.forget_learner(lr.learner_id, exit_code=learner.exit_code, reason=why, now=now)
            self.exits.pop(learner.learner_id, None)
        if failures:
            record.failures += 1
            record.last_failure = failures[-1]
            if len(failures) > 1:
                record.last_failure += f" (and {len(failures) - 1} more)"
        recovering = (
            record.state == S.JOB_STATE_RUNNING
            and self._held(record.job_id)
            and not record.workers()
        )
        if recovering:
            # Its learners died and its coordinator does not answer: its data plane is down.
            # Said at once (not after the grace): never RUNNING with no learner.
            health = self._health(record)
            health.entered_recovery()
            reason = lost_reason(health, self._shard_name(record))
            log.warning("job %s recovering: %s", record.job_id, reason)
            record.transition(S.JOB_STATE_RECOVERING, reason, now)
        await self.table.save(record)
        if recovering:
            self.table.publish(record, S.JOB_EVENT_KIND_STATE)
        if check_done and record.state in STARTED_STATES:
            await self._poll_progress(record)
        if (
            record.active
            and record.failures >= self.config.max_learner_failures
            and record.state != S.JOB_STATE_COMPLETED
        ):
            await self._fail(
                record,
                f"{record.failures} learner failures without progress; last: {record.last_failure}",
            )

    async def _process_lost(self, record: JobRecord, lost: Sequence[tuple[str, str]]) -> None:
        now = self.clock()
        for learner_id, why in lost:
            lr = record.learners.get(learner_id)
            if lr is None:
                continue
            if record.active and lr.phase is not LearnerPhase.PENDING:
                await self._evict(record, learner_id, why)
            self.rescales.lost(record.job_id, learner_id)
            with self.rescales.phase(record.job_id, "device free", [learner_id]):
                await self._release([lr.allocation_id])
            record.forget_learner(learner_id, exit_code=None, reason=why, now=now)
            self.exits.pop(learner_id, None)
        await self.table.save(record)

    # -- retire, stop -----------------------------------------------------------------------------

    async def _retire(self, record: JobRecord, learner_ids: Sequence[str]) -> None:
        ids = [lid for lid in learner_ids if lid in record.learners]
        if not ids:
            return
        now = self.clock()
        if not record.opened:
            await self._stop(record, ids)
            return
        request = ps_pb2.RetireLearnersRequest(
            job_id=record.job_id, learner_ids=ids, fencing_token=self._token
        )
        try:
            await self.peers.shard(record.coordinator_address).RetireLearners(
                request, timeout=self.config.call_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            check_fenced(exc)
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            # Not members (yet): no iteration of theirs can be lost; stop them directly.
            await self._stop(record, ids)
            return
        for lid in ids:
            lr = record.learners.get(lid)
            if lr is not None and lr.phase in HOLDING:
                lr.set_phase(LearnerPhase.RETIRING, now)
        record.last_shrunk_at = now
        await self.table.save(record)

    async def _stop(self, record: JobRecord, learner_ids: Sequence[str]) -> None:
        now = self.clock()
        grace = Duration()
        grace.FromMilliseconds(int(self.config.stop_grace_s * 1000))
        targets = [record.learners[lid] for lid in learner_ids if lid in record.learners]
        for lr in targets:
            if record.active and lr.phase in HOLDING:
                record.last_shrunk_at = now
            lr.set_phase(LearnerPhase.STOPPING, now)
        await self.table.save(record)

        async def stop(lr: LearnerRecord) -> resources_pb2.Learner | None:
            request = ha_pb2.StopLearnerRequest(learner_id=lr.learner_id, grace=grace)
            try:
                response = await self.peers.agent(lr.agent_address).StopLearner(
                    request, timeout=self.config.stop_grace_s + self.config.call_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    # The agent never started it (or forgot it): it runs nowhere.
                    return resources_pb2.Learner(
                        learner_id=lr.learner_id,
                        state=resources_pb2.LEARNER_STATE_FAILED,
                        exit_code=-1,
                        exit_reason="not running on its agent",
                    )
                log.info("StopLearner %s: %s", lr.learner_id, describe(exc))
                return None
            learner = response.learner
            if learner.state in (
                resources_pb2.LEARNER_STATE_SUCCEEDED,
                resources_pb2.LEARNER_STATE_FAILED,
            ):
                return learner
            return None

        results = await asyncio.gather(*(stop(lr) for lr in targets))
        exited = [r for r in results if r is not None]
        for learner in exited:
            self.exits.setdefault(learner.learner_id, learner)
        if exited:
            await self._process_exits(record, exited)

    # -- grow ---------------------------------------------------------------------------------

    async def _ensure_open(self, record: JobRecord, placed: Sequence[LearnerRecord]) -> None:
        shards = self.shards()
        if not shards:
            raise Unavailable("no parameter-sync shard is known yet (registry incomplete)")
        if record.coordinator_index < 0 or not record.coordinator_address:
            moved = self.moves.get(record.job_id)
            if moved is not None:
                record.coordinator_index = moved.index
                record.coordinator_address = moved.address
            else:
                record.coordinator_index = coordinator_index(record.job_id, len(shards))
                record.coordinator_address = shards[record.coordinator_index]
        if record.job.effective_sync_mode == job_pb2.SYNC_MODE_UNSPECIFIED:
            record.job.effective_sync_mode = resolve_sync_mode(  # type: ignore[assignment]
                record.job.spec.sync_mode, [(lr.host_id, lr.simulated) for lr in placed]
            )
        if record.opened:
            return
        request = ps_pb2.OpenJobRequest(
            job_id=record.job_id,
            spec=record.job.spec,
            storage_uri=self.storage.uri,  # the root: shards write jobs/<job_id>/ under it
            shard_addresses=list(shards),
            fencing_token=self._token,
            owner=record.owner,
        )
        try:
            response = await self.peers.shard(record.coordinator_address).OpenJob(
                request, timeout=self.config.call_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            check_fenced(exc)
            if exc.code() in UNREACHABLE and record.state in STARTED_STATES:
                self._health(
                    record
                ).last_error = f"OpenJob: {self._shard_name(record)} unreachable: {exc.code().name}"
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
                raise PermanentFailure(
                    f"OpenJob on {record.coordinator_address} failed: {describe(exc)}"
                ) from exc
            raise
        record.opened = True
        record.closed = False
        if response.HasField("progress"):
            record.job.progress.CopyFrom(response.progress)
        health = self.health.get(record.job_id)
        if health is not None:
            health.reopened(response.progress.completed_iterations)
        if record.state == S.JOB_STATE_RECOVERING:
            await self._recovering(
                record,
                f"data plane re-opened on coordinator {self._shard_name(record)}, resumed at "
                f"iteration {response.progress.completed_iterations}"
                + (" (from the latest checkpoint)" if response.resumed else " (from the start)")
                + "; waiting for the first committed iteration",
            )

    async def _grow(self, record: JobRecord, pending: list[LearnerRecord]) -> None:
        job_id = record.job_id

        def drop_pending() -> None:
            for lr in pending:
                if record.learners.get(lr.learner_id) is lr and lr.phase is LearnerPhase.PENDING:
                    del record.learners[lr.learner_id]

        try:
            await self._ensure_open(record, pending)
            await self.table.save(record)  # the PENDING learners, before acquiring
            claims = [
                rm_pb2.DeviceClaim(
                    job_id=job_id,
                    learner_id=lr.learner_id,
                    host_id=lr.host_id,
                    device_id=lr.device_id,
                )
                for lr in pending
            ]
            request_id = hashlib.sha256(
                ",".join(lr.learner_id for lr in pending).encode()
            ).hexdigest()[:32]
            request = rm_pb2.AcquireDevicesRequest(
                fencing_token=self._token, claims=claims, request_id=request_id
            )
            try:
                response = await self.peers.rm_call(
                    "AcquireDevices", request, self.config.call_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                check_fenced(exc)
                raise
        except PermanentFailure as exc:
            drop_pending()
            await self._fail(record, str(exc))
            return
        except BaseException:
            drop_pending()
            with contextlib.suppress(Exception):
                await self.table.save(record)
            raise
        now = self.clock()
        self.inventory.allocated(response.allocations)
        by_learner = {a.learner_id: a for a in response.allocations}
        for lr in pending:
            allocation = by_learner.get(lr.learner_id)
            if allocation is None:
                continue
            lr.allocation_id = allocation.allocation_id
            if allocation.host_incarnation:
                lr.host_incarnation = allocation.host_incarnation
            if lr.phase is LearnerPhase.PENDING:
                lr.set_phase(LearnerPhase.STARTING, now)
        drop_pending()  # any claim the response did not answer
        await self.table.save(record)
        if record.active:
            await self._start_learners(
                record, [lr for lr in pending if lr.phase is LearnerPhase.STARTING]
            )

    async def _start_learners(self, record: JobRecord, learners: Sequence[LearnerRecord]) -> None:
        if not learners:
            return
        if not record.opened:
            await self._ensure_open(record, learners)
        spec = record.job.spec
        storage_uri = self.storage.uri
        mint = self.config.learner_credentials

        async def start(lr: LearnerRecord) -> BaseException | None:
            request = ha_pb2.StartLearnerRequest(
                learner_id=lr.learner_id,
                job_id=record.job_id,
                device_id=lr.device_id,
                artifact_id=spec.artifact_id,
                entry_point=spec.entry_point,
                args=list(spec.args),
                env=learner_env(
                    record,
                    lr.learner_id,
                    shards=self.shards(),
                    storage_uri=storage_uri,
                    token=mint(record.job_id, lr.learner_id, lr.allocation_id) if mint else None,
                    trace_every=self.config.trace_every,
                    collective_timeout_s=self.config.collective_timeout_s,
                ),
                allocation_id=lr.allocation_id,
                fencing_token=self._token,
            )
            try:
                await self.peers.agent(lr.agent_address).StartLearner(
                    request, timeout=self.config.start_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                check_fenced(exc)
                return exc
            if lr.phase is LearnerPhase.STARTING:
                lr.set_phase(LearnerPhase.RUNNING, self.clock())
            return None

        results = await asyncio.gather(*(start(lr) for lr in learners))
        started = sum(1 for r in results if r is None)
        if started and record.state == S.JOB_STATE_QUEUED:
            self.health.pop(record.job_id, None)  # a fresh stall timeout from now
            record.transition(
                S.JOB_STATE_RUNNING, f"running on {record.workers()} learner(s)", self.clock()
            )
            await self.table.save(record)
            self.table.publish(record, S.JOB_EVENT_KIND_STATE)
        else:
            await self.table.save(record)
        for lr, result in zip(learners, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError) and result.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.PERMISSION_DENIED,
            ):
                await self._fail(
                    record,
                    f"StartLearner {lr.learner_id} on host {lr.host_id} failed: {describe(result)}",
                )
                return
        errors = [r for r in results if r is not None]
        if errors:
            raise errors[0]

    # -- completion, failure, finish ------------------------------------------------------------

    async def _transition(self, record: JobRecord, target: int, reason: str) -> None:
        record.transition(target, reason, self.clock())
        await self.table.save(record)
        self.table.publish(record, S.JOB_EVENT_KIND_STATE)
        self.trigger(f"job {record.job_id} {state_name(target)}")

    async def _poll_progress(self, record: JobRecord) -> ps_pb2.GetJobProgressResponse | None:
        if not record.opened or not record.coordinator_address:
            return None
        try:
            response = await self.peers.shard(record.coordinator_address).GetJobProgress(
                ps_pb2.GetJobProgressRequest(job_id=record.job_id),
                timeout=self.config.call_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in UNREACHABLE and record.state in STARTED_STATES:
                self._unreachable(record, exc)
                return None
            if exc.code() == grpc.StatusCode.NOT_FOUND and record.active:
                # The coordinator lost the job (a restarted shard): open it again, which
                # resumes it from its latest checkpoint, before the next learner starts.
                log.warning("job %s: unknown to its coordinator; re-opening it", record.job_id)
                health = self._health(record)
                lost_at = health.lost_at if health.down else health.iterations
                health.reopened(health.iterations)
                health.entered_recovery()
                record.opened = False
                if record.state in STARTED_STATES:
                    await self._recovering(
                        record,
                        f"coordinator {self._shard_name(record)} lost the job's state (it "
                        f"restarted) after iteration {lost_at}; re-opening the job from its "
                        "latest checkpoint",
                    )
                else:
                    await self.table.save(record)
                self.trigger(f"job {record.job_id} data plane lost")
                return None
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        if record.state in STARTED_STATES:
            # A coordinator that recovers the job itself (a shard lost) says so and why
            # (fields of GetJobProgressResponse a coordinator without them leaves unset).
            recovering = bool(getattr(response, "recovering", False))
            why = str(getattr(response, "recovery_reason", "") or "a shard was lost")
            self._health(record).polled(
                response.progress.completed_iterations,
                self.clock(),
                why if recovering else None,
            )
        self.members[record.job_id] = tuple(response.member_learner_ids)
        if self.metrics is not None and response.HasField("progress"):
            self.metrics.world_size(record.job_id, response.progress.world_size, self.clock())
        self.rescales.observe(
            record, response.member_learner_ids, response.progress.completed_iterations
        )
        if response.HasField("progress") and response.progress != record.job.progress:
            if response.progress.completed_iterations > record.job.progress.completed_iterations:
                record.failures = 0
            record.job.progress.CopyFrom(response.progress)
            self.table.publish(record, S.JOB_EVENT_KIND_PROGRESS)
            now = self.clock()
            if now - self._progress_saved.get(record.job_id, 0.0) >= (
                self.config.progress_persist_s
            ):
                self._progress_saved[record.job_id] = now
                await self.table.save(record)
        if response.done and record.state in STARTED_STATES:
            await self._complete(record)
        return response

    # -- data-plane health (shoal.scheduler.health) ---------------------------------------------

    def _health(self, record: JobRecord) -> JobHealth:
        health = self.health.get(record.job_id)
        if health is None:
            health = self.health[record.job_id] = JobHealth(
                iterations=record.job.progress.completed_iterations, progress_at=self.clock()
            )
        return health

    def _shard_name(self, record: JobRecord) -> str:
        if record.coordinator_index >= 0:
            return f"shard {record.coordinator_index} ({record.coordinator_address})"
        return record.coordinator_address or "(none yet)"

    def _unreachable(self, record: JobRecord, exc: grpc.aio.AioRpcError) -> None:
        if record.state in STARTED_STATES:
            detail = (exc.details() or "").splitlines()[0][:200] if exc.details() else ""
            why = f"{self._shard_name(record)} unreachable: {exc.code().name}"
            self._health(record).unreachable(why + (f" ({detail})" if detail else ""), self.clock())

    async def _recovering(self, record: JobRecord, reason: str) -> None:
        """Say that the job is RECOVERING and why (a transition from RUNNING; a new reason in
        RECOVERING, recorded in the history too)."""
        if record.state == S.JOB_STATE_RUNNING:
            log.warning("job %s recovering: %s", record.job_id, reason)
            self._health(record).entered_recovery()
            await self._transition(record, S.JOB_STATE_RECOVERING, reason)
        elif record.state == S.JOB_STATE_RECOVERING and record.job.state_reason != reason:
            log.info("job %s: %s", record.job_id, reason)
            record.job.state_reason = reason
            record.history.append(StateChange(self.clock(), record.state, record.state, reason))
            del record.history[:-STATE_HISTORY_LIMIT]
            await self.table.save(record)
            self.table.publish(record, S.JOB_EVENT_KIND_STATE)

    async def _assess(self, record: JobRecord) -> None:
        """Act on the job's data-plane health (one verdict per poll; none while a worker
        holds the job: the next poll looks again)."""
        if record.state not in STARTED_STATES:
            self.health.pop(record.job_id, None)
            return
        if record.job_id in self._busy:
            return
        health = self._health(record)
        if (
            health.unreachable_since is not None
            and self.clock() - health.unreachable_since >= self.config.health.unreachable_grace_s
            and await self._take_over(record)
        ):
            return
        verdict = assess(
            record.state,
            health,
            now=self.clock(),
            config=self.config.health,
            recoveries=record.recoveries,
            coordinator=self._shard_name(record),
        )
        if verdict is None:
            return
        if verdict.kind is VerdictKind.RECOVERING:
            await self._recovering(record, verdict.reason)
            self.trigger(f"job {record.job_id} data plane down")
        elif verdict.kind is VerdictKind.RECOVERED:
            log.info("job %s: %s", record.job_id, verdict.reason)
            health.running()
            await self._transition(
                record,
                S.JOB_STATE_RUNNING,
                f"{verdict.reason}; running on {record.workers()} learner(s)",
            )
        elif verdict.kind is VerdictKind.FAIL:
            await self._fail(record, verdict.reason)
        else:
            self._busy[record.job_id] = self._spawn(
                self._run_worker(record, JobWork(retry=verdict.reason), []),
                f"scheduler-job-{record.job_id}",
            )

    async def _take_over(self, record: JobRecord) -> bool:
        """Coordinator failover: the job's coordinator shard has been unreachable for the
        grace. Make the next shard after it that answers the job's coordinator (TakeOverJob,
        coordinator epoch + 1): it fences the shards left, rebuilds the coordinator's state and
        promotes the lost slice's replica, with no rewind. Then publish the move in etcd
        (``shoal.contract.data_plane``, fenced by this scheduler's leadership); the watch
        re-points the job. False (the checkpoint path goes on) in collective mode, with
        failover off, when no shard could take over (their states differ, all unreachable),
        or when tried less than a grace ago."""
        job_id = record.job_id
        if (
            not self.config.health.coordinator_failover
            or not record.opened
            or record.coordinator_index < 0
            or record.job.effective_sync_mode != job_pb2.SYNC_MODE_PARAMETER_SERVER
        ):
            return False
        now = self.clock()
        if now - self._takeover_tried.get(job_id, -1e18) < max(
            2.0, self.config.health.unreachable_grace_s
        ):
            return False
        self._takeover_tried[job_id] = now
        shards = self.shards()
        lost = record.coordinator_index
        if len(shards) < 2 or lost >= len(shards):
            return False
        known = self.moves.get(job_id)
        epoch = (known.epoch if known is not None else 0) + 1
        request = ps_pb2.TakeOverJobRequest(
            job_id=job_id,
            spec=record.job.spec,
            storage_uri=self.storage.uri,
            shard_addresses=list(shards),
            fencing_token=self._token,
            owner=record.owner,
            lost_shard_index=lost,
            coordinator_epoch=epoch,
        )
        for step in range(1, len(shards)):
            index = (lost + step) % len(shards)
            try:
                await self.peers.shard(shards[index]).TakeOverJob(
                    request, timeout=self.config.call_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in UNREACHABLE:
                    continue
                log.warning(
                    "job %s: shard %d cannot take the coordinator role over: %s",
                    job_id,
                    index,
                    describe(exc),
                )
                return False
            moved = CoordinatorRecord(address=shards[index], index=index, epoch=epoch)
            value = encode_coordinator(moved)
            try:
                await self.table.store.put(coordinator_key(job_id), value, fence=self.table.fence)
            except StoreError as exc:  # this leader follows it anyway; the next finds the shard
                log.warning("job %s: coordinator move not published: %s", job_id, exc)
            log.warning(
                "job %s: coordinator shard %d lost; shard %d took the role over (epoch %d)",
                job_id,
                lost,
                index,
                epoch,
            )
            self.moves.apply(coordinator_key(job_id), value)
            return True
        return False

    async def _retry(self, record: JobRecord, reason: str) -> None:
        """A stalled job starts over from its latest checkpoint: stop its learners, close its
        data plane on every shard (whatever answers), and let the next cycle open it again
        (OpenJob resumes from the checkpoint) and start learners."""
        if record.state not in STARTED_STATES:
            return
        log.warning("job %s: %s", record.job_id, reason)
        record.recoveries += 1
        health = self._health(record)
        health.restarted(self.clock())
        await self._recovering(record, reason)
        live = [lid for lid, lr in record.learners.items() if lr.phase is not LearnerPhase.PENDING]
        if live:
            await self._stop(record, live)
        if record.opened:
            await self._close_everywhere(record)
        record.opened = False
        record.closed = False
        # The coordinator may answer again (a fresh shard): the next open finds out.
        health.unreachable_since = None
        await self.table.save(record)

    async def _close_everywhere(self, record: JobRecord) -> None:
        """CloseJob on every shard that answers (a dead coordinator cannot tell its peers)."""
        request = ps_pb2.CloseJobRequest(job_id=record.job_id, fencing_token=self._token)

        async def close(address: str) -> None:
            try:
                await self.peers.shard(address).CloseJob(
                    request, timeout=min(5.0, self.config.call_timeout_s)
                )
            except grpc.aio.AioRpcError as exc:
                check_fenced(exc)
                log.debug("CloseJob %s on %s: %s", record.job_id, address, describe(exc))

        addresses = dict.fromkeys([record.coordinator_address, *self.shards()])
        await asyncio.gather(*(close(a) for a in addresses if a))

    async def _complete(self, record: JobRecord) -> None:
        now = self.clock()
        for lr in record.learners.values():
            if lr.phase in HOLDING:
                lr.set_phase(LearnerPhase.RETIRING, now)  # they get DONE at their boundary
        await self._transition(record, S.JOB_STATE_COMPLETED, "all epochs ran")

    async def _fail(self, record: JobRecord, reason: str) -> None:
        if record.active:
            log.warning("job %s failed: %s", record.job_id, reason)
            await self._transition(record, S.JOB_STATE_FAILED, reason)

    async def _finish(self, record: JobRecord) -> None:
        if record.learners:
            return
        if record.opened and not record.closed:
            try:
                await self.peers.shard(record.coordinator_address).CloseJob(
                    ps_pb2.CloseJobRequest(job_id=record.job_id, fencing_token=self._token),
                    timeout=self.config.call_timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                check_fenced(exc)
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            record.closed = True
            await self.table.save(record)
        if record.state == S.JOB_STATE_CANCELLING:
            await self._transition(record, S.JOB_STATE_CANCELLED, "cancelled")

    # -- progress -------------------------------------------------------------------------------

    async def _progress_loop(self) -> None:
        """Poll the coordinators of running jobs every resync interval (PROGRESS events;
        completion)."""
        limit = asyncio.Semaphore(32)

        async def poll(record: JobRecord) -> None:
            async with limit:
                try:
                    if record.opened:
                        await self._poll_progress(record)
                    await self._assess(record)
                except (grpc.aio.AioRpcError, Unavailable, TimeoutError, StoreConflict) as exc:
                    log.debug("progress of %s: %s", record.job_id, describe(exc))
                except (NotLeader, FencedOutByPeer, LeadershipLost) as exc:
                    self._depose(str(exc))

        while True:
            started = [r for r in self.table.records.values() if r.state in STARTED_STATES]
            for job_id in [j for j in self.health if j not in self.table.records]:
                del self.health[job_id]
            if started:
                await asyncio.gather(*(poll(r) for r in started))
            await asyncio.sleep(self.config.resync_interval_s)

    async def _watch_rescales(self) -> None:
        """While a rescale waits on a coordinator (a drain, a join, a first step), ask it for
        the job's membership every ``rescale_poll_s``: the phases end within that of the
        event. For the traces only: nothing here changes a job (``_poll_progress`` does)."""

        async def poll(record: JobRecord) -> None:
            try:
                response = await self.peers.shard(record.coordinator_address).GetJobProgress(
                    ps_pb2.GetJobProgressRequest(job_id=record.job_id),
                    timeout=self.config.call_timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                log.debug("membership of %s: %s", record.job_id, describe(exc))
                return
            self.rescales.observe(
                record, response.member_learner_ids, response.progress.completed_iterations
            )

        while True:
            await asyncio.sleep(self.config.rescale_poll_s)
            waiting = [self.table.records.get(job_id) for job_id in self.rescales.awaiting()]
            records = [r for r in waiting if r is not None and r.opened and r.coordinator_address]
            if records:
                await asyncio.gather(*(poll(r) for r in records))

    # -- inventory watch ------------------------------------------------------------------------

    async def _watch_inventory(self) -> None:
        delay = self.config.backoff_initial_s
        while True:
            call = self.peers.rm().WatchInventory(rm_pb2.WatchInventoryRequest())
            try:
                async for event in call:
                    self.on_inventory(event)
                    delay = self.config.backoff_initial_s
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and self.peers.rm_failed(exc):
                    log.info("inventory watch: following the resource-manager leader")
                    self.inventory.synced = False
                    continue
                log.info("inventory watch interrupted: %s", describe(exc))
            finally:
                call.cancel()
            self.inventory.synced = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.backoff_max_s)

    def on_inventory(self, event: rm_pb2.WatchInventoryResponse) -> None:
        """Apply one WatchInventory event and trigger a cycle."""
        kind = event.kind
        K = rm_pb2
        if kind == K.INVENTORY_EVENT_KIND_SNAPSHOT:
            self.inventory.reset(event.hosts, event.allocations)
            self._adopt_after_snapshot()
            self._last_sweep = 0.0  # look for exits missed while not watching
            self.trigger("inventory snapshot")
        elif kind == K.INVENTORY_EVENT_KIND_HOST_UP:
            for host in event.hosts:
                before = self.inventory.hosts.get(host.host_id)
                if before is not None and (before.incarnation, before.agent_address) != (
                    host.incarnation,
                    host.agent_address,
                ):
                    # The agent came back: no channel left in reconnect backoff from its outage.
                    self.peers.forget(before.agent_address)
                    self.peers.forget(host.agent_address)
                self.inventory.put_host(host)
            self.trigger(", ".join(f"host {h.host_id} up" for h in event.hosts))
        elif kind == K.INVENTORY_EVENT_KIND_HOST_LOST:
            for host in event.hosts:
                self.inventory.lose_host(host)
            # The resource-manager drops a lost host's allocations from its ledger.
            self.inventory.released(a.allocation_id for a in event.allocations)
            self.trigger(", ".join(f"host {h.host_id} lost" for h in event.hosts))
        elif kind == K.INVENTORY_EVENT_KIND_HOST_CHANGED:
            for host in event.hosts:
                self.inventory.put_host(host)
            self.trigger(", ".join(f"host {h.host_id} changed" for h in event.hosts))
        elif kind == K.INVENTORY_EVENT_KIND_ALLOCATED:
            self.inventory.allocated(event.allocations)
        elif kind == K.INVENTORY_EVENT_KIND_RELEASED:
            self.inventory.released(a.allocation_id for a in event.allocations)
            self.trigger("devices released")
        elif kind == K.INVENTORY_EVENT_KIND_LEARNER_EXITED:
            learner = event.learner
            self.exits[learner.learner_id] = learner
            self.trigger(f"learner {learner.learner_id} exited ({learner.exit_code})")

    def _adopt_after_snapshot(self) -> None:
        """After a (new) snapshot: PENDING learners of idle jobs whose allocation exists were
        acquired by a predecessor that died before writing it down: adopt them."""
        by_learner = {a.learner_id: a for a in self.inventory.ledger.values()}
        for record in self.table.records.values():
            if record.job_id in self._busy:
                continue
            for lr in record.learners.values():
                allocation = by_learner.get(lr.learner_id)
                if lr.phase is LearnerPhase.PENDING and allocation is not None:
                    lr.allocation_id = allocation.allocation_id
                    lr.host_incarnation = allocation.host_incarnation or lr.host_incarnation
                    lr.set_phase(LearnerPhase.STARTING, self.clock())

    def _release_orphans(self, known: set[str]) -> None:
        """Free ledger allocations that no job's learner holds (a predecessor's leftovers)."""
        if self._orphans_busy:
            return
        orphans = [
            a.allocation_id for a in self.inventory.ledger.values() if a.learner_id not in known
        ]
        if not orphans:
            return

        async def release() -> None:
            self._orphans_busy = True
            try:
                log.info("releasing %d orphan allocation(s): %s", len(orphans), orphans)
                await self._release(orphans)
            except FencedOutByPeer as exc:
                self._depose(str(exc))
            except Exception as exc:
                log.info("releasing orphans failed: %s", describe(exc))
            finally:
                self._orphans_busy = False

        self._spawn(release(), "scheduler-orphans")

    async def _sweep_agents(self) -> None:
        """Ask the agents about the learners we think are running: exits we missed (a watch
        gap, a fail-over) are found here."""
        by_agent: dict[str, list[LearnerRecord]] = {}
        for record in self.table.records.values():
            for lr in record.learners.values():
                if lr.phase in (LearnerPhase.RUNNING, *LEAVING) and lr.agent_address:
                    host = self.inventory.hosts.get(lr.host_id)
                    if host is not None and host.state != resources_pb2.HOST_STATE_LOST:
                        by_agent.setdefault(lr.agent_address, []).append(lr)

        async def sweep(address: str, learners: list[LearnerRecord]) -> None:
            try:
                response = await self.peers.agent(address).ListLearners(
                    ha_pb2.ListLearnersRequest(), timeout=self.config.call_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                log.debug("sweep of agent %s: %s", address, describe(exc))
                return
            seen = {learner.learner_id: learner for learner in response.learners}
            now = self.clock()
            found = False
            for lr in learners:
                learner = seen.get(lr.learner_id)
                if learner is None:
                    if now - lr.phase_since > self.config.start_timeout_s:
                        self.exits.setdefault(
                            lr.learner_id,
                            resources_pb2.Learner(
                                learner_id=lr.learner_id,
                                state=resources_pb2.LEARNER_STATE_FAILED,
                                exit_code=-1,
                                exit_reason="unknown to its agent",
                            ),
                        )
                        found = True
                elif learner.state in (
                    resources_pb2.LEARNER_STATE_SUCCEEDED,
                    resources_pb2.LEARNER_STATE_FAILED,
                ):
                    self.exits.setdefault(lr.learner_id, learner)
                    found = True
            if found:
                self.trigger(f"agent {address} reported exits")

        await asyncio.gather(*(sweep(a, ls) for a, ls in by_agent.items()))
