"""Preemption latency: from the scheduler's decision to preempt learners of a running job to
the devices being free, against that job's iteration time.

A ``LocalCluster`` (1 host x 4 simulated GPUs, 1 parameter-sync shard, 1 replica of each
service) in a temporary directory. Job 1 (examples/digits, priority 5000, max 4 workers) trains
on 4 learners. Then job 2 (priority 10000, max 4) is submitted: under the PRIORITY policy the
exact shares are 2.67 / 1.33, and sticky rounding gives the spare unit to job 1 (it already
holds more than its floor), so 2 of job 1's learners are preempted (retired at an iteration
boundary, their processes exit, the devices are released) and job 2 starts on them. The number
preempted is read from job 1's allocation event, not assumed.
Each repeat cancels job 2 afterwards and waits for job 1 to be back on 4.

Measured from the wall time just before ``SubmitJob`` of job 2 (the decision follows within one
reconcile pass), all on one host (one clock):

* **decision**: the allocation-history event of job 1 with fewer workers (its ``time``);
* **released**: polling ``ListHosts`` (~20 ms apart plus the calls' own time), the first poll
  where job 1 holds only its new share of devices (the others free or already job 2's);
* **job 2 allocated**: the first poll where job 2 holds its devices;
* **job 2 trains**: job 2's ``progress.world_size`` reaches its share;
* **job 2 granted -> first iteration**: from job 2's allocation event (the devices granted) to
  the completion time of its first committed iteration (``GetJobMetrics``): what a new learner
  costs, with ``--warm-learners 0`` (every learner a new interpreter) or ``auto`` (one warm
  learner process per device, shoal.host_agent.warm).

With ``--state-dir DIR`` the cluster's files (``DIR/logs/*.log``) are kept for a breakdown.

Job 1's iteration time: consecutive ``GetJobMetrics`` iteration timestamps at world size 4
before the submit.

    .venv/bin/python bench/bench_preemption.py [--repeats 3] [--warm-learners 0|auto|N] \
        [--full-exit] [--state-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HOLD = 4  # GPUs on the one host


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def ts(t: Any) -> float:
    return t.seconds + t.nanos / 1e9


def held(client: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for host in client.list_hosts():
        for d in host.devices:
            job = d.allocation.job_id
            out[job] = out.get(job, 0) + 1
    return out


def wait(what: str, check: Any, timeout: float, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def iteration_time(client: Any, job: str, before: float) -> tuple[float, int]:
    """Mean seconds between consecutive iterations of ``job`` at world size 4 that completed
    before ``before`` (same generation), and how many intervals that is."""
    its = [
        m
        for m in client.get_metrics(job).iterations
        if m.world_size == HOLD and ts(m.time) < before
    ]
    gaps = [
        ts(b.time) - ts(a.time) for a, b in itertools.pairwise(its) if a.generation == b.generation
    ]
    gaps = gaps[-50:]  # the recent ones
    return (statistics.mean(gaps) if gaps else float("nan")), len(gaps)


def spec_of(name: str, artifact: str, env: dict[str, str], **kw: Any) -> Any:
    from shoal.cluster.scenario import job_spec

    spec = job_spec(name, artifact, **kw)
    spec.env.update(env)
    return spec


def one_preemption(
    client: Any, artifact: str, job1: str, repeat: int, env: dict[str, str]
) -> dict[str, float]:
    t_iter, n_gaps = iteration_time(client, job1, time.time())
    hist_before = len(client.allocation_history(job1))
    t0 = time.time()
    job2 = client.submit_job(
        spec_of(
            f"job-2-{repeat}",
            artifact,
            env,
            epochs=500,
            batch_size=64,
            max_workers=HOLD,
            priority=10000,
        )
    ).job_id
    released = allocated = trains = None
    keep = share2 = None  # job 1's new target and job 2's share, from the decision event
    deadline = time.monotonic() + 30
    while trains is None and time.monotonic() < deadline:
        now = time.time()
        if keep is None:
            shrink = [e for e in client.allocation_history(job1)[hist_before:] if e.workers < HOLD]
            if shrink:
                keep = shrink[0].workers
                share2 = HOLD - keep
        h = held(client)
        if keep is not None and released is None and h.get(job1, 0) <= keep:
            released = now - t0
        if share2 is not None and allocated is None and h.get(job2, 0) >= share2:
            allocated = now - t0
        if allocated is not None and client.get_job(job2).progress.world_size >= share2:
            trains = time.time() - t0
        time.sleep(0.02)
    events = client.allocation_history(job1)[hist_before:]
    shrink = [e for e in events if e.workers < HOLD]
    decision = ts(shrink[0].time) - t0 if shrink else float("nan")
    ev2 = [e for e in client.allocation_history(job2) if e.workers > 0]
    ev2_first = ts(ev2[0].time) - t0 if ev2 else float("nan")
    first_iteration = float("nan")
    its2: list[Any] = []
    deadline = time.monotonic() + 60
    while not its2 and time.monotonic() < deadline:
        its2 = client.get_metrics(job2).iterations
        if not its2:
            time.sleep(0.05)
    if its2:
        first_iteration = min(ts(m.time) for m in its2) - t0
    result = {
        "iteration_s": t_iter,
        "gaps": n_gaps,
        "decision_event_s": decision,
        "released_poll_s": released if released is not None else float("nan"),
        "job2_event_s": ev2_first,
        "job2_allocated_poll_s": allocated if allocated is not None else float("nan"),
        "job2_trains_s": trains if trains is not None else float("nan"),
        "job2_first_iteration_s": first_iteration,
        "preempted": float(share2 or 0),
        "events": [(round(ts(e.time) - t0, 3), e.workers, e.reason) for e in events],
    }
    client.cancel_job(job2)
    wait(
        "job 1 back on 4 learners",
        lambda: (
            (j := client.get_job(job1)).allocated_workers == HOLD and j.progress.world_size == HOLD
        ),
        timeout=60,
    )
    time.sleep(2)  # a few iterations at 4 for the next iteration-time sample
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--warm-learners", default="0", help="the host agent's --warm-learners (0, auto or N)"
    )
    parser.add_argument("--state-dir", help="keep the cluster's files here (default: a temp dir)")
    parser.add_argument(
        "--full-exit",
        action="store_true",
        help="learners tear the interpreter down at exit (LEARNER_FULL_EXIT=1: as before "
        "the fast exit)",
    )
    args = parser.parse_args()
    warm = None if args.warm_learners == "auto" else int(args.warm_learners)
    from shoal.client import Client
    from shoal.cluster.local import ClusterSpec, LocalCluster

    env = {"LEARNER_FULL_EXIT": "1"} if args.full_exit else {}

    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="shoal-preempt-") as tmp:
        state = Path(args.state_dir) if args.state_dir else Path(tmp)
        spec = ClusterSpec(
            state_dir=state,
            hosts=1,
            gpus_per_host=HOLD,
            shards=1,
            replicas=1,
            warm_learners=warm,
        )
        t_start = time.monotonic()
        with LocalCluster(spec) as cluster, Client(cluster.client_config()) as client:
            print(f"cluster up in {time.monotonic() - t_start:.1f} s", flush=True)
            artifact = client.upload_directory(REPO / "examples" / "digits")
            job1 = client.submit_job(
                spec_of("job-1", artifact, env, epochs=2000, batch_size=64, max_workers=HOLD)
            ).job_id
            wait(
                "job 1 on 4 learners",
                lambda: client.get_job(job1).progress.world_size == HOLD,
                timeout=120,
            )
            time.sleep(3)  # some iterations at 4 for the iteration time
            for r in range(args.repeats):
                row = one_preemption(client, artifact, job1, r, env)
                rows.append(row)
                print(
                    f"  [{r}] iteration {row['iteration_s'] * 1e3:.0f} ms "
                    f"({row['gaps']} intervals); decision event +{row['decision_event_s']:.3f} s, "
                    f"released (poll) +{row['released_poll_s']:.3f} s, job 2 event "
                    f"+{row['job2_event_s']:.3f} s, job 2 allocated (poll) "
                    f"+{row['job2_allocated_poll_s']:.3f} s, job 2 trains "
                    f"+{row['job2_trains_s']:.3f} s, job 2 first iteration "
                    f"+{row['job2_first_iteration_s']:.3f} s",
                    flush=True,
                )
                for event in row["events"]:
                    print(f"      job 1 event {event}", flush=True)
            client.cancel_job(job1)
    print(f"\nwarm learners: {args.warm_learners}; full exit: {args.full_exit}")
    print(
        "| repeat | job 1 iteration (ms) | preempted | decision event (s) | job 1's devices "
        "released, poll (s) | released / iteration | job 2 allocated (s) | job 2 trains (s) | "
        "job 2 granted -> first iteration (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r, row in enumerate(rows):
        print(
            f"| {r} | {row['iteration_s'] * 1e3:.0f} | {row['preempted']:.0f} | "
            f"{row['decision_event_s']:.3f} | "
            f"{row['released_poll_s']:.3f} | "
            f"{row['released_poll_s'] / row['iteration_s']:.1f} | "
            f"{row['job2_allocated_poll_s']:.3f} | {row['job2_trains_s']:.3f} | "
            f"{row['job2_first_iteration_s'] - row['job2_event_s']:.3f} |"
        )
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
