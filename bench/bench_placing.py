"""Time the reconcile loop's placement step (reconcile/placing.py) per cycle at 10,000 hosts x
8 GPUs and 5,000 jobs, steady state (every job at its share), one event per cycle:

  full        ``--incremental-placement off``: ``placement.plan`` over the observed state
  incremental the cycle after the event: the events derived from the observed changes (a diff
              of the demands and the learners the loop observed, the hosts the inventory says
              changed) applied to the planner, then its ``decide``
  safety net  the periodic full cycle with the check: full plan, the planner's decision
              compared with it, the planner resynced
  per-job     the loop's path now (``Placing.step``): the changes per job, as the kept
              observed view (reconcile/observing.py) names them, no diff of the whole state
  safety net  (``Placing.full``) agreeing: full plan + the planner's pending events, decision
  (full)      and input state compared, no resync; diverging: + the resync

The inputs are what the loop hands the step (demands, a real ``Inventory`` fed protos, the
observed learners); observing the records (``decide.observe``) is not timed (the loop does it
either way). CPU ms of this process, median of --repeat.

Run: .venv/bin/python bench/bench_placing.py [--hosts N] [--gpus G] [--jobs J] [--repeat R]
"""

from __future__ import annotations

import argparse
import operator
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from shoal.scheduler.placement import LearnerView, PlacementConfig, plan
from shoal.scheduler.policy import JobDemand, Policy
from shoal.scheduler.reconcile.inventory import Inventory
from shoal.scheduler.reconcile.placing import Placing, diverging_jobs
from shoal.v1 import resources_pb2


def cpu_ms(fn: Callable[[], object], repeat: int, undo: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append((time.process_time() - t) * 1000)
        undo()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=10_000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=5_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rnd = random.Random(7)
    config = PlacementConfig(policy=Policy.PRIORITY, hold_time=0.0)
    hosts = []
    for h in range(args.hosts):
        host = resources_pb2.Host(host_id=f"h{h:05d}", incarnation=1)
        for d in range(args.gpus):
            host.devices.add(device_id=str(d))
        hosts.append(host)
    inventory = Inventory()
    inventory.reset(hosts, [])
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
    # The steady state: every job holds what the full plan gives it.
    first = plan(jobs, inventory.host_views(), [], config)
    current = [
        LearnerView(f"l{i}", s.job_id, s.host_id, s.device_id) for i, s in enumerate(first.starts)
    ]
    print(f"{args.hosts} hosts x {args.gpus} GPUs, {args.jobs} jobs, {len(current)} learners")

    full = Placing(config, resync_interval_s=1e9, incremental=False)
    inc = Placing(config, resync_interval_s=1e9)
    inc.decide(jobs, inventory, current, 0.0)  # the term's first cycle (full + resync)
    inc.decide(jobs, inventory, current, 0.0)

    def row(name: str, fn: Callable[[], object], undo: Callable[[], object]) -> None:
        print(f"{name:<44} {cpu_ms(fn, args.repeat, undo):8.1f} ms")

    def steady() -> None:
        inc.decide(jobs, inventory, current, 0.0)

    exited = current[:-1]  # a learner's exit processed: it is no longer observed
    row(
        "full plan (off), a learner exited",
        lambda: full.decide(jobs, inventory, exited, 0.0),
        steady,
    )
    row(
        "whole-state diff (decide), a learner exited",
        lambda: inc.decide(jobs, inventory, exited, 0.0),
        steady,
    )
    last = jobs[-1]
    raised = [*jobs[:-1], replace(last, priority=20000)]
    row(
        "whole-state diff (decide), a priority change",
        lambda: inc.decide(raised, inventory, current, 0.0),
        steady,
    )
    lost = resources_pb2.Host()
    lost.CopyFrom(hosts[0])
    survivors = [v for v in current if v.host_id != lost.host_id]

    def lose() -> None:
        inventory.lose_host(lost)
        inc.decide(jobs, inventory, survivors, 0.0)

    def back() -> None:
        inventory.put_host(hosts[0])
        steady()

    row("whole-state diff (decide), a host lost", lose, back)
    net = Placing(config, resync_interval_s=0.0)
    net.decide(jobs, inventory, current, 0.0)
    row(
        "whole-state diff (decide), safety net",
        lambda: net.decide(jobs, inventory, current, 0.0),
        steady,
    )
    check = diverging_jobs(
        inc.decide(jobs, inventory, current, 0.0),
        plan(jobs, inventory.host_views(), current, config),
    )
    print(f"divergences: incremental {inc.divergences}, safety net {net.divergences}; {check}")

    # The loop's path now: the changes per job, as the kept observed view gives them
    # (reconcile/observing.py), no diff of the whole state.
    key = operator.attrgetter("learner_id", "job_id", "host_id", "device_id", "retiring")
    lp = Placing(config, resync_interval_s=1e9)
    lp.full(jobs, inventory, current, 0.0)  # the term's first cycle (full + resync)
    inventory.take_changed()

    def step(gone=(), came=(), demands=None, hosts_changed=()):  # type: ignore[no-untyped-def]
        return lp.step(
            inventory,
            0.0,
            gone=gone,
            came=came,
            demand_changes=demands or {},
            changed_hosts=hosts_changed,
            fallback=lambda: (jobs, current),
        )

    last_key = key(current[-1])
    row(
        "per-job changes (step), a learner exited",
        lambda: step(gone={last_key}),
        lambda: step(came={last_key}),
    )
    row(
        "per-job changes (step), a priority change",
        lambda: step(demands={last.job_id: raised[-1]}),
        lambda: step(demands={last.job_id: last}),
    )
    on_host = {key(v) for v in current if v.host_id == lost.host_id}

    def lose_step() -> None:
        inventory.lose_host(lost)
        step(gone=on_host, hosts_changed=inventory.take_changed())

    def back_step() -> None:
        inventory.put_host(hosts[0])
        step(came=on_host, hosts_changed=inventory.take_changed())

    row("per-job changes (step), a host lost", lose_step, back_step)
    lnet = Placing(config, resync_interval_s=0.0)
    lnet.full(jobs, inventory, current, 0.0)
    row(
        "safety net (full), agreeing: full + check",
        lambda: lnet.full(jobs, inventory, current, 0.0),
        lambda: None,
    )
    row(
        "safety net (full), diverging: + resync",
        lambda: lnet.full(raised, inventory, current, 0.0),  # the planner missed the change
        lambda: lnet.full(jobs, inventory, current, 0.0),
    )
    check = diverging_jobs(step(), plan(jobs, inventory.host_views(), current, config))
    print(
        f"loop path: divergences {lp.divergences}, resyncs {lp.resyncs}; safety net divergences "
        f"{lnet.divergences} (the diverging row's, on purpose), resyncs {lnet.resyncs}; {check}"
    )


if __name__ == "__main__":
    main()
