"""Time one scheduling cycle (policy + placement) at 10,000 hosts x 8 GPUs and 5,000 jobs.

Run: .venv/bin/python bench/bench_scheduling.py [--hosts N] [--gpus G] [--jobs J] [--repeat R]

Scenarios (the same seeded jobs in each):
  policy only         compute_shares over all jobs
  cold cycle          plan() with every device free: every job is placed from scratch
  steady, no change   plan() once every job holds its share: the periodic resync (no decisions)
  steady, job done    one large job has finished: its devices go to the jobs below target
                      (and once more with sticky_rounding=False, to count the churn it avoids)
  steady, submit      a high-priority job arrives: shares shift, many small retires
  steady, host lost   one host is lost: its learners are reported, capacity shrinks
  replay              the simulator: all jobs submitted at t=0, then 20 instants of events
                      (finishes, submits, host down / up), settled after each instant; once
                      with a full plan() per round, once through the IncrementalPlanner
                      (simulate(..., incremental=True)); the two results are checked equal
  per event           from the steady state, one event at a time, side by side: "full" is
                      plan() over the whole state after the event (what every event cost
                      before), "incremental" is the event applied to an IncrementalPlanner
                      plus its decide(); both give the same Plan (checked)
Times are the median and the best wall-clock time of --repeat runs of one call, and the
median CPU time of this process over them, in milliseconds (on a shared machine the CPU time
is the steadier of the two); the replay is timed once, in total; an event is undone, untimed,
between runs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from shoal.scheduler.incremental import IncrementalPlanner
from shoal.scheduler.placement import (
    HostState,
    HostView,
    LearnerView,
    PlacementConfig,
    Plan,
    plan,
)
from shoal.scheduler.policy import JobDemand, Policy, compute_shares
from shoal.scheduler.simulator import Event, Finish, HostDown, HostUp, Submit, simulate

REPLAY_INSTANTS = 20


def make_jobs(count: int, rnd: random.Random) -> list[JobDemand]:
    jobs = []
    for i in range(count):
        lo = rnd.randint(1, 4)
        jobs.append(
            JobDemand(
                job_id=f"job{i:05d}",
                priority=rnd.choice([1000, 2500, 5000, 5000, 5000, 7500, 10000]),
                submit_seq=i,
                min_workers=lo,
                max_workers=lo + rnd.randint(0, 32),
            )
        )
    return jobs


def apply(result: Plan, current: list[LearnerView], tag: str) -> list[LearnerView]:
    """Ideal actors: retired learners exit, started ones run."""
    retired = {r.learner_id for r in result.retires}
    lost = set(result.lost)
    kept = [x for x in current if x.learner_id not in retired and x.learner_id not in lost]
    kept += [
        LearnerView(f"{tag}{i}", s.job_id, s.host_id, s.device_id)
        for i, s in enumerate(result.starts)
    ]
    return kept


Times = tuple[float, float, float]
"""(median wall ms, best wall ms, median CPU ms of this process)."""


def summary(wall: list[float], cpu: list[float]) -> Times:
    return (statistics.median(wall), min(wall), statistics.median(cpu))


def timed(fn: Callable[[], object], repeat: int) -> tuple[Times, object]:
    """The times of ``repeat`` calls, and the last result."""
    wall, cpu = [], []
    out: object = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    return summary(wall, cpu), out


def timed_event(
    planner: IncrementalPlanner,
    do: Callable[[], None],
    undo: Callable[[], None],
    repeat: int,
) -> tuple[Times, Times, Plan]:
    """(full ms, incremental ms) of one event, and its plan.

    Incremental: ``do()`` plus ``decide()``, timed. Full: ``plan()`` over the same state after
    the event. ``undo()`` and a decide (untimed) bring the steady state back between runs."""
    full_wall, full_cpu, inc_wall, inc_cpu = [], [], [], []
    out: Plan | None = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        do()
        out = planner.decide()
        inc_wall.append((time.perf_counter() - t0) * 1000)
        inc_cpu.append((time.process_time() - c0) * 1000)
        jobs, hosts, learners = planner.jobs(), planner.hosts(), planner.learners()
        t0, c0 = time.perf_counter(), time.process_time()
        reference = plan(jobs, hosts, learners, planner.config)
        full_wall.append((time.perf_counter() - t0) * 1000)
        full_cpu.append((time.process_time() - c0) * 1000)
        assert reference == out, "the incremental decision differs from the full cycle"
        undo()
        planner.decide()
    assert out is not None
    return summary(full_wall, full_cpu), summary(inc_wall, inc_cpu), out


def per_event_rows(
    jobs: list[JobDemand],
    hosts: list[HostView],
    current: list[LearnerView],
    config: PlacementConfig,
    repeat: int,
    gpus: int,
) -> list[tuple[str, Times, Plan | None]]:
    """Each event from the steady state, full cycle vs incremental (see the docstring)."""
    t0, c0 = time.perf_counter(), time.process_time()
    planner = IncrementalPlanner(config, jobs, hosts, current)
    first = planner.decide()
    build_ms = (time.perf_counter() - t0) * 1000
    build_cpu = (time.process_time() - c0) * 1000
    assert first.decisions == ()
    ms, _ = timed(planner.decide, repeat)
    rows: list[tuple[str, Times, Plan | None]] = [
        (
            "incremental: build from the steady state + first decide",
            (build_ms, build_ms, build_cpu),
            None,
        ),
        ("incremental: decide, no event (cached)", ms, None),
    ]
    by_job: dict[str, list[LearnerView]] = {}
    for x in current:
        by_job.setdefault(x.job_id, []).append(x)
    gone = current[len(current) // 2]
    big = max(jobs, key=lambda j: len(by_job.get(j.job_id, ())))
    urgent = JobDemand(
        job_id="urgent", priority=100_000, submit_seq=len(jobs), min_workers=64, max_workers=512
    )
    # The job of priority 5000 furthest below its max: a raise moves devices to it.
    bumped = max(jobs, key=lambda j: (j.priority == 5000, j.max_workers - first.shares[j.job_id]))
    lost = hosts[1]
    spare = HostView.with_devices("host-new", gpus)

    def re_add(learners: list[LearnerView]) -> None:
        for x in learners:
            planner.add_learner(x)

    def finish_big() -> None:
        planner.remove_job(big.job_id)
        for x in by_job[big.job_id]:
            planner.remove_learner(x.learner_id)

    def unfinish_big() -> None:
        planner.submit(big)
        re_add(by_job[big.job_id])

    on_lost = [x for x in current if x.host_id == lost.host_id]
    events: list[tuple[str, Callable[[], None], Callable[[], None]]] = [
        (
            "a learner exited",
            lambda: planner.remove_learner(gone.learner_id),
            lambda: planner.add_learner(gone),
        ),
        (f"a job finished (its {len(by_job[big.job_id])} learners exit)", finish_big, unfinish_big),
        (
            "a job submitted (prio 100000, max 512)",
            lambda: planner.submit(urgent),
            lambda: planner.remove_job("urgent"),
        ),
        (
            "a priority change (5000 -> 7500)",
            lambda: planner.update_job(
                replace(
                    bumped, priority=bumped.priority * 3 // 2, previous_priority=bumped.priority
                )
            ),
            lambda: planner.update_job(bumped),
        ),
        (
            f"a host lost ({len(on_lost)} learners)",
            lambda: planner.put_host(replace(lost, state=HostState.LOST)),
            lambda: planner.put_host(lost),
        ),
        (
            f"a host joined ({gpus} free devices)",
            lambda: planner.put_host(spare),
            lambda: planner.remove_host(spare.host_id),
        ),
    ]
    for name, do, undo in events:
        full_ms, inc_ms, out = timed_event(planner, do, undo, repeat)
        rows.append((f"per event, full cycle: {name}", full_ms, out))
        rows.append((f"per event, incremental: {name}", inc_ms, out))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=20240601)
    args = parser.parse_args()

    load0 = os.getloadavg()
    rnd = random.Random(args.seed)
    hosts = [HostView.with_devices(f"host{h:05d}", args.gpus) for h in range(args.hosts)]
    jobs = make_jobs(args.jobs, rnd)
    capacity = args.hosts * args.gpus
    rows: list[tuple[str, Times, Plan | None]] = []

    for policy in (Policy.PRIORITY, Policy.FAIRSHARE, Policy.FIFO):
        ms, _ = timed(lambda p=policy: compute_shares(jobs, capacity, p), args.repeat)
        rows.append((f"policy only ({policy.name})", ms, None))

    config = PlacementConfig(policy=Policy.PRIORITY, hold_time=60.0)
    ms, cold = timed(lambda: plan(jobs, hosts, [], config), args.repeat)
    assert isinstance(cold, Plan)
    rows.append(("cold cycle", ms, cold))

    current = apply(cold, [], "c")
    assert plan(jobs, hosts, current, config).decisions == ()
    ms, out = timed(lambda: plan(jobs, hosts, current, config), args.repeat)
    assert isinstance(out, Plan)
    rows.append(("steady, no change", ms, out))

    big = max(jobs, key=lambda j: cold.shares[j.job_id])
    done_jobs = [j for j in jobs if j is not big]
    done_current = [x for x in current if x.job_id != big.job_id]
    ms, out = timed(lambda: plan(done_jobs, hosts, done_current, config), args.repeat)
    assert isinstance(out, Plan)
    rows.append((f"steady, job done (frees {cold.shares[big.job_id]})", ms, out))

    # The same job-done event with plain largest-remainder rounding, for comparison.
    plain = replace(config, sticky_rounding=False)
    plain_current = apply(plan(jobs, hosts, [], plain), [], "p")
    plain_current = [x for x in plain_current if x.job_id != big.job_id]
    ms, out = timed(lambda: plan(done_jobs, hosts, plain_current, plain), args.repeat)
    assert isinstance(out, Plan)
    rows.append(("steady, job done, plain largest remainder", ms, out))

    counts: dict[str, int] = {}
    for x in current:
        counts[x.job_id] = counts.get(x.job_id, 0) + 1
    held_jobs = [replace(j, current=counts.get(j.job_id, 0)) for j in jobs]
    urgent = JobDemand(
        job_id="urgent", priority=100_000, submit_seq=args.jobs, min_workers=64, max_workers=512
    )
    ms, out = timed(lambda: plan([*held_jobs, urgent], hosts, current, config), args.repeat)
    assert isinstance(out, Plan)
    rows.append(("steady, submit (prio 100000, max 512)", ms, out))

    lost_hosts = [replace(hosts[0], state=HostState.LOST), *hosts[1:]]
    ms, out = timed(lambda: plan(jobs, lost_hosts, current, config), args.repeat)
    assert isinstance(out, Plan)
    rows.append(("steady, host lost", ms, out))

    rows.extend(per_event_rows(jobs, hosts, current, config, args.repeat, args.gpus))

    events: list[Event] = [Submit(0.0, j) for j in jobs]
    for k in range(1, REPLAY_INSTANTS + 1):
        t = float(k)
        if k % 10 == 0:
            events.append(HostDown(t, hosts[k].host_id))
        elif k % 10 == 5:
            events.append(HostUp(t, hosts[k - 5].host_id))
        elif k % 2:
            events.append(Finish(t, jobs[k * 7].job_id))
        else:
            lo = rnd.randint(1, 4)
            events.append(
                Submit(
                    t,
                    JobDemand(
                        job_id=f"late{k}",
                        priority=rnd.choice([5000, 10000]),
                        submit_seq=args.jobs + k,
                        min_workers=lo,
                        max_workers=lo + rnd.randint(0, 32),
                    ),
                )
            )
    replays = []
    for incremental in (False, True):
        t0, c0 = time.perf_counter(), time.process_time()
        replay = simulate(hosts, events, config, incremental=incremental)
        replay_ms = (time.perf_counter() - t0) * 1000
        replay_cpu = (time.process_time() - c0) * 1000
        replays.append(
            ("incremental" if incremental else "full cycles", replay, replay_ms, replay_cpu)
        )
    assert replays[0][1] == replays[1][1], "the incremental replay differs from the full one"

    table = Table(
        title=(
            f"one scheduling cycle: {args.hosts:,} hosts x {args.gpus} GPUs, {args.jobs:,} jobs "
            f"({args.repeat} runs each)"
        )
    )
    table.add_column("scenario")
    table.add_column("median ms", justify="right")
    table.add_column("best ms", justify="right")
    table.add_column("cpu ms", justify="right")
    table.add_column("starts", justify="right")
    table.add_column("retires", justify="right")
    table.add_column("queued", justify="right")
    for name, ms, result in rows:
        if result is None:
            table.add_row(name, f"{ms[0]:,.1f}", f"{ms[1]:,.1f}", f"{ms[2]:,.1f}", "", "", "")
        else:
            table.add_row(
                name,
                f"{ms[0]:,.1f}",
                f"{ms[1]:,.1f}",
                f"{ms[2]:,.1f}",
                f"{len(result.starts):,}",
                f"{len(result.retires):,}",
                f"{len(result.queue):,}",
            )
    for kind, replay, replay_ms, replay_cpu in replays:
        table.add_row(
            f"replay, {kind}: {len(events):,} events, {replay.rounds} cycles "
            f"({replay_ms / replay.rounds:,.1f} ms/cycle), total",
            f"{replay_ms:,.1f}",
            "",
            f"{replay_cpu:,.1f}",
            f"{replay.starts:,}",
            f"{replay.retires:,}",
            f"{len(replay.timeline[-1].queue):,}",
        )
    Console(width=140).print(table)
    print(f"load average before / after: {load0} / {os.getloadavg()}")


if __name__ == "__main__":
    main()
