"""Time the reconcile loop's whole cycle (``Reconciler.cycle``: observe + plan + decide +
dispatch) at 10,000 hosts x 8 GPUs and 5,000 jobs, steady state (80,000 RUNNING learners, every
job at its share), one event per cycle, for:

  full         ``--incremental-placement off``: every record observed, ``placement.plan``,
               every job's work decided
  incremental  ``on``, a cycle after the event: only the jobs that changed observed again
               (the job table's dirty set, exits, workers, changed hosts), the incremental
               planner, the work of the jobs in scope
  safety net   ``on``, the periodic full cycle: the pending events given to the planner, a
               full observation and the full plan, both compared with the kept view and the
               planner (resynced only on a difference)

The loop is the real ``Reconciler`` over an in-memory job table and inventory (no process,
no gRPC: the workers a cycle dispatches are cancelled before they run). The events are what
the loop's callers do: a learner's exit processed (the record written without it, its device
released), a priority update (the record written), a host lost (the inventory's event).
CPU ms of this process (``time.process_time``) and wall ms, median of --repeat. The timed
region ends with a young garbage collection (``gc.collect(0)``): the loop pauses the collector
during a cycle (loop.py), so what the cycle left is collected here, inside the time, as it
would be right after the cycle (with code that does not pause it: a few hundred objects).

With --poll-round, only: the incremental cycle after a progress poll of every job (each job's
attained service changed). Under PRIORITY without service classes no demand changes; with
--annotated (service classes on: a threshold no job reaches) every demand is refreshed and
given to the planner.

Run: PYTHONPATH=clients/src:services/src python bench/bench_cycle.py [--hosts N] [--gpus G]
     [--jobs J] [--repeat R] [--poll-round [--annotated]]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable

from shoal.runtime.store import MemoryStore
from shoal.scheduler.artifacts import Storage
from shoal.scheduler.jobs import JobRecord, LearnerPhase, LearnerRecord
from shoal.scheduler.placement import PlacementConfig, plan
from shoal.scheduler.policy import JobDemand, Policy
from shoal.scheduler.reconcile.config import ReconcileConfig
from shoal.scheduler.reconcile.inventory import Inventory
from shoal.scheduler.reconcile.loop import Reconciler
from shoal.scheduler.reconcile.peers import Peers
from shoal.scheduler.store import JobTable
from shoal.v1 import job_pb2, resources_pb2


def build(args: argparse.Namespace, *, incremental: bool, check_s: float) -> Reconciler:
    rnd = random.Random(7)
    # --annotated: service classes on (a threshold no job reaches: the same shares), so the
    # policy reads the attained service and a progress poll changes the demands.
    thresholds = (1e12,) if getattr(args, "annotated", False) else ()
    config = PlacementConfig(policy=Policy.PRIORITY, hold_time=0.0, service_thresholds=thresholds)
    hosts = []
    for h in range(args.hosts):
        host = resources_pb2.Host(host_id=f"h{h:05d}", incarnation=1, agent_address="a:1")
        for d in range(args.gpus):
            host.devices.add(device_id=str(d))
        hosts.append(host)
    jobs = [
        JobDemand(
            job_id=f"j{i:05d}",
            priority=rnd.choice([100, 5000, 10000]),
            submit_seq=i,
            min_workers=1,
            max_workers=rnd.randint(1, 64),
        )
        for i in range(args.jobs)
    ]
    table = JobTable(MemoryStore())
    table.leading = True
    records: dict[str, JobRecord] = {}
    for demand in jobs:
        job = job_pb2.Job(job_id=demand.job_id, state=job_pb2.JOB_STATE_RUNNING)
        job.spec.priority = demand.priority
        job.spec.min_workers = demand.min_workers
        job.spec.max_workers = demand.max_workers
        job.spec.batch_size = 32
        records[demand.job_id] = JobRecord(job=job, submit_seq=demand.submit_seq, opened=True)
    reconciler = Reconciler(
        table,
        Peers(["127.0.0.1:1"], ["127.0.0.1:2"], token=None),
        Storage(f"file://{tempfile.mkdtemp(prefix='bench-cycle-')}"),
        ReconcileConfig(
            sync_shards=("127.0.0.1:2",),
            placement=config,
            resync_interval_s=1.0,
            incremental_placement=incremental,
            placement_check_interval_s=check_s,
        ),
        clock=lambda: 1000.0,
    )
    inventory = Inventory()
    inventory.reset(hosts, [])
    steady = plan(jobs, inventory.host_views(), [], config)
    allocations = []
    for start in steady.starts:
        record = records[start.job_id]
        lid = record.next_learner_id()
        alloc = f"a-{lid}"
        record.learners[lid] = LearnerRecord(
            learner_id=lid,
            host_id=start.host_id,
            device_id=start.device_id,
            agent_address="a:1",
            host_incarnation=1,
            allocation_id=alloc,
            phase=LearnerPhase.RUNNING,
        )
        allocations.append(
            resources_pb2.Allocation(
                allocation_id=alloc,
                job_id=start.job_id,
                learner_id=lid,
                host_id=start.host_id,
                device_id=start.device_id,
                host_incarnation=1,
            )
        )
    for job_id, share in steady.shares.items():
        records[job_id].job.target_workers = share
    table.records = records
    reconciler._reset()
    reconciler.inventory.reset(hosts, allocations)
    return reconciler


async def settle(r: Reconciler) -> None:
    """Cancel the workers a cycle dispatched (before they run) and free their jobs."""
    tasks = list(r._tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for job_id in list(r._busy):
        r._busy.pop(job_id)
        r.table.mark(job_id)


async def timed(
    r: Reconciler, event: Callable[[], object], undo: Callable[[], object], repeat: int
) -> tuple[float, float, int]:
    cpu, wall = [], []
    looked = 0
    for _ in range(repeat):
        event()
        t, w = time.process_time(), time.perf_counter()
        r.cycle()
        gc.collect(0)  # what the cycle left, collected now (the loop pauses gc in a cycle)
        cpu.append((time.process_time() - t) * 1000)
        wall.append((time.perf_counter() - w) * 1000)
        looked = r.jobs_looked_at
        await settle(r)
        undo()
        r.cycle()  # back to the steady state (not timed)
        await settle(r)
        r.cycle()
        await settle(r)
    return statistics.median(cpu), statistics.median(wall), looked


async def run(args: argparse.Namespace, name: str, incremental: bool, check_s: float) -> None:
    r = build(args, incremental=incremental, check_s=check_s)
    for _ in range(3):  # the term's first (full) cycle, then the targets' saves, then steady
        r.cycle()
        await settle(r)
    records = r.table.records
    learners = sum(len(rec.learners) for rec in records.values())

    def row(what: str, result: tuple[float, float, int]) -> None:
        cpu, wall, looked = result
        print(f"{name:<12} {what:<36} {cpu:8.1f} {wall:8.1f} {looked:8d}", flush=True)

    if name == "full":
        print(f"{args.hosts} hosts x {args.gpus} GPUs, {args.jobs} jobs, {learners} learners")
        print(f"{'path':<12} {'event':<36} {'cpu ms':>8} {'wall ms':>8} {'jobs':>8}")
    row("no change", await timed(r, lambda: None, lambda: None, args.repeat))

    # A learner's exit processed: the record written without it, its device released.
    victim = records["j00003"]
    lid, lr = next(iter(victim.learners.items()))
    alloc = r.inventory.ledger[lr.allocation_id]

    def exit_() -> None:
        del victim.learners[lid]
        r.table.mark(victim.job_id)  # what the worker's save does
        r.inventory.released([alloc.allocation_id])

    def exit_undo() -> None:
        for rec in records.values():  # the learner started on the freed device
            for other in [x for x, v in rec.learners.items() if v.phase is LearnerPhase.PENDING]:
                del rec.learners[other]
                r.table.mark(rec.job_id)
        victim.learners[lid] = lr
        r.table.mark(victim.job_id)
        r.inventory.allocated([alloc])

    row("a learner's exit processed", await timed(r, exit_, exit_undo, args.repeat))

    raised = records["j00007"]
    old = raised.job.spec.priority

    def priority() -> None:
        raised.job.spec.priority = old + 1
        r.table.mark(raised.job_id)

    def priority_undo() -> None:
        raised.job.spec.priority = old
        r.table.mark(raised.job_id)

    row("a priority change (+1)", await timed(r, priority, priority_undo, args.repeat))

    host = resources_pb2.Host()
    host.CopyFrom(r.inventory.hosts["h00011"])

    def lose() -> None:
        lost = resources_pb2.Host()
        lost.CopyFrom(host)
        lost.state = resources_pb2.HOST_STATE_LOST
        r.inventory.lose_host(lost)

    def back() -> None:
        r.inventory.put_host(host)

    row("a host lost (8 learners lost)", await timed(r, lose, back, args.repeat))
    placing = r.placing
    print(
        f"{name:<12} cycles: incremental {placing.incremental_cycles}, full "
        f"{placing.full_cycles}, planner divergences {placing.divergences}, observation "
        f"divergences {r.observing.divergences}, resyncs {placing.resyncs}",
        flush=True,
    )


async def poll_round(args: argparse.Namespace) -> None:
    """The incremental cycle after a progress-poll round of every job: each job's attained
    service changed (as a poll does), so each job's demand is refreshed and given to the
    planner (``submit``); no record is looked at again."""
    r = build(args, incremental=True, check_s=1e9)
    for _ in range(3):
        r.cycle()
        await settle(r)
    for n in range(args.repeat):
        for job_id in r.table.records:
            state = job_pb2.ThroughputState(attained_device_seconds=10.0 * (n + 1))
            r.goodput.restore(job_id, 32, state)
        t, w = time.process_time(), time.perf_counter()
        r.cycle()
        gc.collect(0)
        cpu = (time.process_time() - t) * 1000
        wall = (time.perf_counter() - w) * 1000
        print(
            f"incremental  a poll round of all {len(r.table.records)} jobs  {cpu:8.1f} "
            f"{wall:8.1f} {r.jobs_looked_at:8d}",
            flush=True,
        )
        await settle(r)
        r.cycle()
        await settle(r)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=10_000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=5_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--poll-round",
        action="store_true",
        help="only: the incremental cycle after a progress poll of every job",
    )
    ap.add_argument(
        "--annotated",
        action="store_true",
        help="service classes on (a threshold no job reaches): the policy reads the service",
    )
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    if args.poll_round:
        asyncio.run(poll_round(args))
        print(f"load average after: {os.getloadavg()}")
        return

    async def all_() -> None:
        await run(args, "full", False, 1.0)
        await run(args, "incremental", True, 1e9)
        await run(args, "safety net", True, 0.0)

    asyncio.run(all_())
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
