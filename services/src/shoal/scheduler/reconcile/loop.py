"""The scheduler's control loop: turn (jobs, inventory, policy) into learners, level-triggered.

Only the leader runs it (:meth:`Reconciler.lead`, for as long as its leadership holds). It is
triggered by events (submit, cancel, update, and the resource-manager's WatchInventory:
HOST_UP, HOST_LOST, HOST_CHANGED, RELEASED, LEARNER_EXITED, a new SNAPSHOT) and by a periodic
resync; every cycle recomputes the decisions from what it observes, so a missed event costs at
most one resync interval.

A cycle (:meth:`Reconciler.cycle`, synchronous, no I/O; its observing and deciding are the
pure functions of :mod:`shoal.scheduler.reconcile.decide`, which it applies):

1. builds the observed state: the inventory (hosts, devices, the ledger) and every learner the
   jobs hold; learners on lost hosts (or on an older incarnation of their host) are lost.
   After an event only the jobs that changed are observed again (the job table's dirty set,
   exits, workers, changed hosts: :mod:`shoal.scheduler.reconcile.observing`), the rest of
   the observed view is kept; a full cycle reads every learner, reusing per job what it
   derived last time when the values read are the same (``decide.observe``'s cache; the plan
   goes by job too: ``placement.plan``'s ``groups``);
2. runs the pure policy + placement: after an event the incremental planner, given what
   changed as events; the full ``shoal.scheduler.placement.plan`` on the safety net (the
   term's first cycle, then every ``placement_check_interval_s``), which observes every
   record and logs and overrides an observed view or a planner that disagrees
   (:mod:`shoal.scheduler.reconcile.placing`); after an event the rest of the cycle looks only
   at the jobs in scope (changed, with a timer or work due, or given another share);
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
import gc
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import context as otel_context, trace

from shoal.contract.data_plane import (
    CoordinatorRecord,
)
from shoal.runtime.election import Leadership, LeadershipLost
from shoal.scheduler.artifacts import Storage
from shoal.scheduler.goodput import GoodputTracker
from shoal.scheduler.health import JobHealth
from shoal.scheduler.jobs import (
    JobRecord,
    LearnerRecord,
)
from shoal.scheduler.placement import Plan, Start
from shoal.scheduler.policy import JobDemand, Policy
from shoal.scheduler.reconcile import decide
from shoal.scheduler.reconcile.config import ELECTION, ReconcileConfig
from shoal.scheduler.reconcile.inventory import Inventory
from shoal.scheduler.reconcile.lifecycle import JobLifecycle
from shoal.scheduler.reconcile.observing import Observing
from shoal.scheduler.reconcile.peers import (
    Peers,
)
from shoal.scheduler.reconcile.placing import Placing
from shoal.scheduler.reconcile.registry import CoordinatorMoves, ShardRegistry
from shoal.scheduler.reconcile.watch import InventoryWatch
from shoal.scheduler.reconcile.work import Backoff, JobWork
from shoal.scheduler.reconcile.workers import JobWorkers
from shoal.scheduler.store import JobTable
from shoal.scheduler.tracing import RescaleTracker
from shoal.v1 import (
    resources_pb2,
)

if TYPE_CHECKING:
    from shoal.scheduler.metrics import SchedulerMetrics


log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)

T = TypeVar("T")


class Reconciler(JobWorkers, JobLifecycle, InventoryWatch):
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
        self.placing = Placing(
            config.placement,
            resync_interval_s=(
                config.resync_interval_s
                if config.placement_check_interval_s is None
                else config.placement_check_interval_s
            ),
            incremental=config.incremental_placement,
        )
        self.observing = Observing()  # the kept observed view (incremental cycles)
        # Whether the policy reads the goodput annotations of a demand (throughput curve and
        # rescale pause: GOODPUT; attained service: the service classes). When it does not,
        # demands go unannotated, so a progress poll changes no demand (and no decision).
        placement = config.placement
        self._annotated = placement.policy is Policy.GOODPUT or bool(placement.service_thresholds)
        self._touched: set[str] = set()  # jobs to observe again next cycle
        self._demand_cache: decide.DemandCache = {}  # the demands of the last full cycle
        self._seen: decide.ObserveCache = {}  # what the last full cycle observed, per job
        self._last_shares: Mapping[str, int] = {}
        self._last_queue: list[str] = []
        self._last_held: set[str] = set()
        self._orphans_checked = 0.0
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
        self.jobs_looked_at = 0  # the last cycle's jobs in scope (all of them on a full one)
        self.rescales = RescaleTracker(clock=clock)
        self.goodput = GoodputTracker()  # throughput models and attained service (goodput.py)
        self._throughput_saved: dict[str, float] = {}  # job -> when its model was last stored
        self._batch_sent: dict[str, int] = {}  # job -> the adaptive batch last told its coordinator
        self._triggered_at: float | None = None

    def _reset(self) -> None:
        self.inventory = Inventory()
        self.placing.reset()  # a term starts from a full cycle and a resync of the planner
        self.observing.reset()
        self._touched = set()
        self._demand_cache = {}
        self._seen = {}
        self._last_shares = {}
        self._last_queue = []
        self._last_held = set()
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
        self._restore_throughput()

    def _restore_throughput(self) -> None:
        """Go on from the throughput models stored in etcd (``JobTable.become_leader`` read
        them): every active job's model as the last leader saved it, so the first decision
        of this term is the one the last leader would have made. A state left for a job that
        ended (or is unknown) is deleted."""
        self.goodput = GoodputTracker()
        self._throughput_saved = {}
        for job_id, state in self.table.throughput.items():
            record = self.table.records.get(job_id)
            if record is None or record.final:
                self._throughput_saved[job_id] = 0.0  # the cycle deletes it
                continue
            self.goodput.restore(job_id, record.job.spec.batch_size, state)
            self._throughput_saved[job_id] = self.clock()
        if self.table.throughput:
            log.info("throughput models of %d jobs restored", len(self.goodput.jobs()))

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
        self._spawn(self._migrate_coordinator_moves(), "scheduler-migrate-coordinators")
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
        The decisions are the pure functions of ``decide``; this applies them.

        Python's cyclic garbage collector is paused for the cycle (synchronous, bounded): a
        full cycle's temporaries (a dict per host, a list per job, ...) would otherwise
        trigger dozens of young collections and, every few cycles, a full one over the whole
        heap (~0.1 s at 80,000 learners), having been promoted while still in use. Freed by
        reference counting when the cycle ends, they are never scanned; what is left is
        collected as usual after it."""
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            self._cycle()
        finally:
            if paused:
                gc.enable()

    def _cycle(self) -> None:
        self.cycles += 1
        now = self.clock()
        causes, self._causes = self._causes, []
        decided_from, self._triggered_at = self._triggered_at or now, None
        records = self.table.records
        hosts = self.inventory.hosts

        # Placement must not see a device twice; lost learners were left out by observe.
        # After events only the jobs that changed are observed again and decided by the
        # incremental planner; every placement check interval (and with
        # --incremental-placement off: every cycle) the full cycle, the safety net:
        # observing.py, placing.py.
        observed, decided, scope = self._observe_and_place(records, now)
        self.jobs_looked_at = len(scope)
        targets_before: dict[str, int] = {}  # the jobs given another target: the one before
        changed = []
        for job_id, (target, position) in decide.targets(scope, decided).items():
            record = records[job_id]
            job = record.job
            priority = job.spec.priority
            if record.decided_priority != priority:
                # The next cycle's demand of it carries the priority decided now.
                self._touched.add(job_id)
            record.decided_priority = priority
            if self.metrics is not None:
                self.metrics.target_changed(job_id, job.target_workers, target, now)
            if job.target_workers != target or job.queue_position != position:
                targets_before[job_id] = job.target_workers
                job.target_workers = target
                job.queue_position = position
                changed.append(job_id)
                self.table.mark(job_id)
        moved = self._moved & records.keys()
        self._moved -= moved
        held = {job_id for job_id, health in self.health.items() if health.down}
        work = decide.decide(
            scope,
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

        # Rescales (traces only): jobs whose target changed or whose learners change (the
        # tracker looks at no other job: the others are not listed, in the scope's order).
        learners_change = {j for j, jw in work.items() if jw.retires or jw.lost}
        learners_change.update(j for j, s in starts_by_job.items() if s)
        candidates = targets_before.keys() | learners_change
        self.rescales.decided(
            [
                (
                    r,
                    targets_before.get(job_id, r.job.target_workers),
                    r.job.target_workers,
                    job_id in learners_change,
                )
                for job_id, r in scope.items()
                if job_id in candidates and r.active
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
            if jw.starts:
                self.table.mark(job_id)  # PENDING learners added in memory
            self._busy[job_id] = self._spawn(
                self._run_worker(record, jw, causes), f"scheduler-job-{job_id}"
            )
            dispatched += 1

        # Exits of learners no job knows are of no use; orphans are freed by the sweep.
        if scope is records:
            # A full cycle: every allocation against every job. The common case (no exit
            # reported, every allocation held by a learner of its job) checked job by job.
            if self.exits or not self.inventory.held_by(records):
                known = set(itertools.chain.from_iterable(r.learners for r in records.values()))
                for learner_id in [lid for lid in self.exits if lid not in known]:
                    del self.exits[learner_id]
                self._release_orphans(known)
            self._orphans_checked = now
        else:
            for learner_id in list(self.exits):
                owner = records.get(self.observing.job_of(learner_id) or "")
                if owner is None or learner_id not in owner.learners:
                    if decide.job_of(records, learner_id) is None:
                        del self.exits[learner_id]
            if now - self._orphans_checked >= self.config.resync_interval_s:
                # At most once per resync interval, against the kept learner index.
                self._orphans_checked = now
                self._release_orphans(self.observing)
        self.rescales.check_all(records)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(
                {
                    "shoal.cycle": self.cycles,
                    "shoal.cycle.causes": causes,
                    "shoal.cycle.jobs": len(records),
                    "shoal.cycle.jobs_looked_at": len(scope),
                    "shoal.cycle.jobs_queued": len(decided.queue),
                    "shoal.cycle.starts": len(decided.starts),
                    "shoal.cycle.retires": len(decided.retires),
                    "shoal.cycle.jobs_with_work": len(work),
                    "shoal.cycle.workers_dispatched": dispatched,
                    "shoal.cycle.rescales_open": len(self.rescales.open),
                }
            )

    def _observe_and_place(
        self, records: dict[str, JobRecord], now: float
    ) -> tuple[decide.Observed, Plan, dict[str, JobRecord]]:
        """Steps 1-2 of the cycle: (what was observed, the plan, the jobs the rest of the cycle
        looks at). A full cycle observes every record and returns them all; an incremental
        one observes again only the jobs that changed (the table's dirty set, the goodput
        models polled, exits, workers, changed hosts) and returns the jobs the plan or their
        state may give work to."""
        hosts = self.inventory.hosts
        placing = self.placing
        if not placing.incremental:
            observed = decide.observe(records, hosts, self.exits, busy=self._busy, cache=self._seen)
            demands = self._demands(records)
            decided = placing.decide(
                demands, self.inventory, observed.current, now, groups=observed.groups
            )
            self._last_shares = decided.shares
            return observed, decided, records
        changed_hosts = self.inventory.take_changed()
        dirty = self.table.take_dirty() | self._touched
        self._touched = set()
        changes = self.observing.update(
            records, hosts, self.exits, self._busy, dirty=dirty, changed_hosts=changed_hosts
        )
        demand_changes: dict[str, JobDemand | None] = {}
        gone: set[tuple[str, str, str, str, bool]] = set()
        came: set[tuple[str, str, str, str, bool]] = set()
        for before, after in changes.values():
            if before != after:
                gone.update(before)
                came.update(after)
        # The demands of the jobs observed again and of those whose throughput model or
        # attained service a progress poll changed (their records need no new look).
        polled = self.goodput.take_changed()
        for job_id in changes.keys() | (polled if self._annotated else set()):
            record = records.get(job_id)
            demand_changes[job_id] = (
                self._annotate(decide.demand(record))
                if record is not None and record.active
                else None
            )
        gone, came = gone - came, came - gone
        if placing.due(now):
            observed = self.observing.full(records, hosts, self.exits, self._busy)
            demands = self._demands(records)
            decided = placing.full(
                demands,
                self.inventory,
                observed.current,
                now,
                gone=gone,
                came=came,
                demand_changes=demand_changes,
                changed_hosts=changed_hosts,
                current_by_id=self.observing.views,
                groups=observed.groups,
            )
            self._last_shares = decided.shares
            return observed, decided, records
        for job_id, demand in demand_changes.items():
            if demand is None and job_id in self._throughput_saved:
                self.goodput.forget(job_id)  # the job ended: its stored model goes too
                del self._throughput_saved[job_id]
                self._spawn(self._forget_throughput(job_id), f"forget-throughput-{job_id}")
        decided = placing.step(
            self.inventory,
            now,
            gone=gone,
            came=came,
            demand_changes=demand_changes,
            changed_hosts=changed_hosts,
            fallback=lambda: (self._demands(records), self.observing.current()),
        )
        observed = decide.Observed(work=dict(self.observing.work))
        # The jobs the rest of the cycle looks at: those observed again, those with a timer
        # or observed work, those the plan starts, retires, loses or gives another share or
        # queue position, the moved, held and backed-off ones.
        last, self._last_shares = self._last_shares, decided.shares
        scope_ids = set(changes)
        scope_ids |= self.observing.attention
        scope_ids |= observed.work.keys()
        scope_ids.update(s.job_id for s in decided.starts)
        scope_ids.update(r.job_id for r in decided.retires)
        scope_ids.update(filter(None, map(self.observing.job_of, decided.lost)))
        if decided.shares is not last:
            scope_ids.update(j for j, n in decided.shares.items() if last.get(j) != n)
            scope_ids.update(j for j in last if j not in decided.shares)
        scope_ids.update(decided.queue)
        scope_ids.update(self._last_queue)
        self._last_queue = list(decided.queue)
        held = {job_id for job_id, health in self.health.items() if health.down}
        scope_ids |= held | self._last_held | self._moved | self._backoff.keys()
        self._last_held = held
        return observed, decided, {j: records[j] for j in scope_ids if j in records}

    def _annotate(self, demand: JobDemand) -> JobDemand:
        """One job's demand as the cycle gives it to placement (see ``_annotated``)."""
        return self.goodput.annotate_one(demand) if self._annotated else demand

    def _demands(self, records: dict[str, JobRecord]) -> list[JobDemand]:
        """Every active job's demand, annotated (when the policy reads it); the stored models
        of ended jobs go."""
        plain = decide.demands(records, self._demand_cache)
        if self._annotated:
            demands = self.goodput.annotate(plain)  # also forgets the models of ended jobs
        else:  # the policy reads no annotation: only forget the models of ended jobs
            self.goodput.retain({d.job_id for d in plain})
            demands = plain
        modelled = self.goodput.jobs()
        for job_id in [j for j in self._throughput_saved if j not in modelled]:
            # The job ended (annotate forgot its model): its stored state goes too.
            del self._throughput_saved[job_id]
            self._spawn(self._forget_throughput(job_id), f"forget-throughput-{job_id}")
        return demands

    def _coordinator_moved(self, job_id: str, moved: CoordinatorRecord) -> None:
        """The parameter-sync tier moved a job's coordinator (a shard failed over): talk to
        the new one from now on (progress, retire, evict, close; new learners are told it)."""
        record = self.table.records.get(job_id)
        if record is not None and record.final:  # left by a leader that died before deleting
            self._spawn(self._forget_coordinator_move(job_id), f"forget-coordinator-{job_id}")
            return
        if record is None:
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
