"""The reconcile loop's incremental cycle against its full cycle (``Reconciler.cycle`` with
``incremental_placement`` on and off), over the same in-memory job table and inventory: after
random events, made as the loop's callers make them (a write marks the record, the inventory
names the hosts, exits and workers come and go), both give every job the same work (the same
exits, lost learners, retires, stops, restarts, starts on the same devices, finishes,
requeues, saves) and the same targets -- the incremental one observing and deciding only the
jobs in its scope. No process, no gRPC: the workers a cycle dispatches are recorded, not run.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import example, given, settings, strategies as st

from shoal.runtime.store import MemoryStore
from shoal.scheduler.artifacts import Storage
from shoal.scheduler.jobs import JobRecord, LearnerPhase
from shoal.scheduler.placement import PlacementConfig
from shoal.scheduler.policy import Policy
from shoal.scheduler.reconcile.config import ReconcileConfig
from shoal.scheduler.reconcile.loop import Reconciler
from shoal.scheduler.reconcile.peers import Peers
from shoal.scheduler.reconcile.work import JobWork
from shoal.scheduler.store import JobTable
from shoal.v1 import job_pb2, resources_pb2

HOSTS = ["h0", "h1", "h2", "h3"]
JOBS = ["j0", "j1", "j2", "j3", "j4"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def build(
    incremental: bool, clock: Clock, *, service_thresholds: tuple[float, ...] = ()
) -> tuple[Reconciler, list[tuple[str, JobWork]]]:
    table = JobTable(MemoryStore())
    table.leading = True
    for i, job_id in enumerate(JOBS):
        job = job_pb2.Job(job_id=job_id, state=job_pb2.JOB_STATE_QUEUED)
        job.spec.priority = 5000
        job.spec.min_workers = 1
        job.spec.max_workers = 3 + i
        job.spec.batch_size = 32
        table.records[job_id] = JobRecord(job=job, submit_seq=i)
    r = Reconciler(
        table,
        Peers(["127.0.0.1:1"], ["127.0.0.1:2"], token=None),
        Storage("memory://incremental-cycle"),
        ReconcileConfig(
            sync_shards=("127.0.0.1:2",),
            placement=PlacementConfig(
                policy=Policy.PRIORITY, hold_time=0.0, service_thresholds=service_thresholds
            ),
            resync_interval_s=1.0,
            incremental_placement=incremental,
            placement_check_interval_s=1e9,  # never: the incremental path alone is compared
            retire_timeout_s=5.0,
            finish_grace_s=5.0,
            stop_grace_s=1.0,
            call_timeout_s=1.0,
        ),
        clock=clock,
    )
    r._reset()
    hosts = []
    for h in HOSTS:
        host = resources_pb2.Host(host_id=h, incarnation=1, agent_address=f"{h}:1")
        for d in range(2):
            host.devices.add(device_id=str(d))
        hosts.append(host)
    r.inventory.reset(hosts, [])
    dispatched: list[tuple[str, JobWork]] = []

    async def nothing() -> None:
        return None

    def run_worker(record: JobRecord, jw: JobWork, causes: Any) -> Any:
        dispatched.append((record.job_id, jw))
        return nothing()

    r._run_worker = run_worker  # type: ignore[method-assign]
    return r, dispatched


def summary(dispatched: list[tuple[str, JobWork]]) -> dict[str, tuple[object, ...]]:
    out = {}
    for job_id, jw in dispatched:
        out[job_id] = (
            sorted(e.learner_id for e in jw.exits),
            sorted(lid for lid, _ in jw.lost),
            sorted(jw.drop_pending),
            sorted(jw.retires),
            sorted(jw.stops),
            sorted(jw.restarts),
            sorted((lr.learner_id, lr.host_id, lr.device_id) for lr in jw.starts),
            jw.finish,
            jw.requeue,
            jw.save,
        )
    return out


async def settle(r: Reconciler, dispatched: list[tuple[str, JobWork]]) -> None:
    """What a worker leaves behind, simplified: a PENDING learner it was given is started
    (RUNNING, its device allocated), the job is RUNNING; it ends (not busy, its record
    written)."""
    for job_id, jw in dispatched:
        record = r.table.records[job_id]
        for lr in jw.starts:
            lr.set_phase(LearnerPhase.RUNNING, r.clock())
            lr.allocation_id = f"a-{lr.learner_id}"
            r.inventory.allocated(
                [
                    resources_pb2.Allocation(
                        allocation_id=lr.allocation_id,
                        job_id=job_id,
                        learner_id=lr.learner_id,
                        host_id=lr.host_id,
                        device_id=lr.device_id,
                        host_incarnation=1,
                    )
                ]
            )
        if jw.starts and record.job.state == job_pb2.JOB_STATE_QUEUED:
            record.job.state = job_pb2.JOB_STATE_RUNNING
    tasks = list(r._tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for job_id in list(r._busy):
        r._busy.pop(job_id)
        r.table.mark(job_id)
    dispatched.clear()


def apply(r: Reconciler, clock: Clock, event: tuple[str, int, int]) -> None:
    """One event, as the loop's callers make it (records written: marked)."""
    what, a, b = event
    records = r.table.records
    job_id = JOBS[a % len(JOBS)]
    record = records[job_id]
    learners = sorted(record.learners)
    if what == "tick":
        clock.now += [0.5, 10.0][b % 2]  # 10 s: past every grace and timeout here
    elif what == "priority":
        record.job.spec.priority = [100, 5000, 20000][b % 3]
        r.table.mark(job_id)
    elif what == "max" and record.active:
        record.job.spec.max_workers = max(record.job.spec.min_workers, 1 + b % 6)
        r.table.mark(job_id)
    elif what == "min" and record.active:  # a big min queues jobs (8 devices in all)
        record.job.spec.min_workers = 1 + b % 5
        record.job.spec.max_workers = max(record.job.spec.max_workers, 1 + b % 5)
        r.table.mark(job_id)
    elif what == "cancel" and record.active:
        record.job.state = job_pb2.JOB_STATE_CANCELLING
        r.table.mark(job_id)
    elif what == "exit_reported" and learners:
        lid = learners[b % len(learners)]
        r.exits[lid] = resources_pb2.Learner(learner_id=lid, exit_code=0)
    elif what == "exit_processed" and learners:
        lid = learners[b % len(learners)]
        lr = record.learners.pop(lid)
        r.exits.pop(lid, None)
        r.table.mark(job_id)
        if lr.allocation_id:
            r.inventory.released([lr.allocation_id])
    elif what == "retiring" and learners:
        lr = record.learners[learners[b % len(learners)]]
        if lr.phase is LearnerPhase.RUNNING:
            lr.set_phase(LearnerPhase.RETIRING, clock.now)
            r.table.mark(job_id)
    elif what == "host_lost":
        host = resources_pb2.Host()
        host.CopyFrom(r.inventory.hosts[HOSTS[b % len(HOSTS)]])
        host.state = resources_pb2.HOST_STATE_LOST
        r.inventory.lose_host(host)
    elif what == "host_back":
        host = resources_pb2.Host()
        host.CopyFrom(r.inventory.hosts[HOSTS[b % len(HOSTS)]])
        host.state = resources_pb2.HOST_STATE_READY
        host.draining = False
        r.inventory.put_host(host)
    elif what == "draining":
        host = resources_pb2.Host()
        host.CopyFrom(r.inventory.hosts[HOSTS[b % len(HOSTS)]])
        host.draining = True
        r.inventory.put_host(host)


event = st.tuples(
    st.sampled_from(
        [
            "tick",
            "priority",
            "max",
            "min",
            "cancel",
            "exit_reported",
            "exit_processed",
            "retiring",
            "host_lost",
            "host_back",
            "draining",
        ]
    ),
    st.integers(0, 20),
    st.integers(0, 20),
)


@settings(max_examples=100, deadline=None)
@given(batches=st.lists(st.lists(event, max_size=3), min_size=1, max_size=10))
# A timer due on a job no event names (a retire that times out; a cancelled job's stops and
# finish), a queue, a host drained then lost, an exit reported then processed.
@example(batches=[[("retiring", 0, 0)], [("tick", 0, 1)], [("tick", 0, 1)]])
@example(batches=[[("cancel", 1, 0)], [("tick", 0, 1)], [("exit_processed", 1, 0)], []])
@example(batches=[[("max", 0, 5), ("max", 1, 5), ("max", 2, 5)], [("priority", 4, 2)], []])
@example(batches=[[("min", 0, 4), ("min", 1, 4)], [("min", 2, 4)], [("cancel", 0, 0)], []])
@example(batches=[[("draining", 0, 0)], [("host_lost", 0, 0)], [("host_back", 0, 0)], []])
@example(batches=[[("exit_reported", 2, 0)], [], [("exit_processed", 2, 0)], []])
def test_the_incremental_cycle_gives_every_job_the_work_of_the_full_cycle(
    batches: list[list[tuple[str, int, int]]],
) -> None:
    async def run() -> None:
        clocks = Clock(), Clock()
        inc, inc_work = build(True, clocks[0])
        full, full_work = build(False, clocks[1])
        for _ in range(2):  # the term's first cycle (full in both), the starts settled
            for r, work in ((inc, inc_work), (full, full_work)):
                r.cycle()
                await settle(r, work)
        for batch in batches:
            for e in batch:
                apply(inc, clocks[0], e)
                apply(full, clocks[1], e)
            inc.cycle()
            full.cycle()
            assert summary(inc_work) == summary(full_work), batch
            targets = {
                j: (rec.job.target_workers, rec.job.queue_position)
                for j, rec in full.table.records.items()
            }
            assert {
                j: (rec.job.target_workers, rec.job.queue_position)
                for j, rec in inc.table.records.items()
            } == targets
            await settle(inc, inc_work)
            await settle(full, full_work)
        assert inc.placing.incremental_cycles == len(batches) + 1  # all but the first
        assert inc.jobs_looked_at <= len(JOBS)

    asyncio.run(run())


def test_a_progress_poll_changes_a_demand_only_where_the_policy_reads_it() -> None:
    """PRIORITY without service classes reads no goodput annotation: a poll (the job's
    attained service changed) gives the planner no event. With service classes it does."""

    async def run(thresholds: tuple[float, ...]) -> float:
        r, work = build(True, Clock(), service_thresholds=thresholds)
        for _ in range(2):
            r.cycle()
            await settle(r, work)
        r.goodput.restore("j1", 32, job_pb2.ThroughputState(attained_device_seconds=42.0))
        r.cycle()
        await settle(r, work)
        assert r.placing.planner is not None
        (demand,) = [d for d in r.placing.planner.jobs() if d.job_id == "j1"]
        return demand.attained_service

    assert asyncio.run(run(())) == 0.0
    assert asyncio.run(run((1e9,))) == 42.0
