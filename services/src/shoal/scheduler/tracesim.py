"""Trace replay for job completion times: a workload through the real policy and placement.

``shoal simulate`` reads a workload (a CSV file, format below), replays it on a simulated
cluster through ``shoal.scheduler.simulator.Simulator`` (``placement.plan`` and
``policy.compute_shares``, the code the scheduler runs) once per policy, and reports job
completion times (JCT) side by side.

Workload CSV (UTF-8, a header line, ``#`` lines are comments, one job a row):

    job_id          unique name
    submit_s        submit time, seconds from the start of the trace (>= 0)
    iterations      iterations to run to completion (>= 1)
    batch           global batch, samples per iteration (>= 1)
    min_workers     fewest learners (>= 1)
    max_workers     most learners (>= min_workers)
    priority        1 .. 1000000
    overhead_s      the job's *true* iteration-time curve (``ThroughputCurve``): seconds per
    compute_s       iteration = overhead + compute / w + (w > 1) * (sync + sync_per_worker
    sync_s          * (w - 1)); overhead + compute > 0, all >= 0
    sync_per_worker_s
    rescale_pause_s seconds without progress after each start or change of world size (>= 0)

The replay. Time advances from event to event: a submit, a job finishing, or a scheduling
tick every ``interval_s`` (the scheduler's periodic resync; attained service and the learned
models change between ticks). At each event the simulator runs the scheduling cycles to their
fixed point (ideal actors: a started learner runs at once, a retired one exits at once). A job
with w learners runs ``1 / T(w)`` iterations per second of its true curve, except during the
rescale pause after any change of w (including its start). The policy never sees the true
curve: each job has an online ``ThroughputModel`` (the prior until it runs) that observes the
true iteration time at every world size the job ran at, and the pause of every rescale, as the
scheduler learns them from progress polls; ``JobDemand.throughput`` is its fitted curve and
``attained_service`` the device-seconds the job held. Deterministic: no randomness.

Reported per policy: mean, median and 95th-percentile JCT (finish - submit), makespan (the
last finish), utilisation (device-seconds held by jobs over devices x makespan), rescales
(changes of a running job's world size) and the worst slowdown (JCT over the job's time alone
on the cluster at its best world size within its max: a fairness measure).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shoal.scheduler.placement import HostView, PlacementConfig
from shoal.scheduler.policy import JobDemand, Policy
from shoal.scheduler.simulator import Simulator
from shoal.scheduler.throughput import ThroughputCurve, ThroughputModel

__all__ = [
    "COLUMNS",
    "PolicyRun",
    "TraceJob",
    "TraceResult",
    "parse_policies",
    "read_trace",
    "replay",
]

COLUMNS = (
    "job_id",
    "submit_s",
    "iterations",
    "batch",
    "min_workers",
    "max_workers",
    "priority",
    "overhead_s",
    "compute_s",
    "sync_s",
    "sync_per_worker_s",
    "rescale_pause_s",
)
MAX_JOBS = 100_000
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One row of a workload."""

    job_id: str
    submit_s: float
    iterations: int
    min_workers: int
    max_workers: int
    priority: int
    curve: ThroughputCurve
    rescale_pause_s: float

    def alone_s(self, gpus: int) -> float:
        """The job's run time alone on ``gpus`` devices at its best world size (one pause)."""
        best = self.curve.best_world_size(max(self.min_workers, min(self.max_workers, gpus)))
        best = max(best, self.min_workers)
        return self.rescale_pause_s + self.iterations * self.curve.iteration_time(best)


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """What to replay: a policy and its options, under a display name."""

    name: str
    policy: Policy
    service_thresholds: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class TraceResult:
    """The outcome of one policy on one workload (seconds)."""

    name: str
    jct: dict[str, float]
    makespan: float
    utilisation: float
    rescales: int
    worst_slowdown: float

    @property
    def mean_jct(self) -> float:
        return sum(self.jct.values()) / len(self.jct) if self.jct else 0.0

    def percentile(self, q: float) -> float:
        """The q-th percentile JCT (nearest rank)."""
        values = sorted(self.jct.values())
        if not values:
            return 0.0
        rank = max(1, math.ceil(q / 100 * len(values)))
        return values[rank - 1]

    def summary(self) -> dict[str, float | int | str]:
        return {
            "policy": self.name,
            "jobs": len(self.jct),
            "mean_jct_s": round(self.mean_jct, 1),
            "p50_jct_s": round(self.percentile(50), 1),
            "p95_jct_s": round(self.percentile(95), 1),
            "makespan_s": round(self.makespan, 1),
            "utilisation": round(self.utilisation, 3),
            "rescales": self.rescales,
            "worst_slowdown": round(self.worst_slowdown, 2),
        }


# --- reading -----------------------------------------------------------------------------------


def _field(row: dict[str, str], name: str, line: int, kind: type[int] | type[float]) -> float:
    text = (row.get(name) or "").strip()
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"line {line}: {name} ({text!r}) must be a number") from None
    if not math.isfinite(value):
        raise ValueError(f"line {line}: {name} ({text!r}) must be finite")
    return value


def read_trace(text: str) -> list[TraceJob]:
    """Parse a workload CSV (see the module docstring).

    Raises:
        ValueError: a missing column, a bad value or a duplicate id; the message names the
            line, the column and the value.
    """
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"the header lacks column(s) {', '.join(missing)}")
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for n, row in enumerate(reader, start=2):
        job_id = (row.get("job_id") or "").strip()
        if not job_id:
            raise ValueError(f"line {n}: job_id ({job_id!r}) must not be empty")
        if job_id in seen:
            raise ValueError(f"line {n}: job_id ({job_id!r}) is given twice")
        seen.add(job_id)
        ints = {c: int(_field(row, c, n, int)) for c in COLUMNS[2:7]}
        floats = {c: float(_field(row, c, n, float)) for c in (COLUMNS[1], *COLUMNS[7:])}
        for name, low in (("iterations", 1), ("batch", 1), ("min_workers", 1), ("priority", 1)):
            if ints[name] < low:
                raise ValueError(f"line {n}: {name} ({ints[name]}) must be >= {low}")
        if ints["priority"] > 1_000_000:
            raise ValueError(f"line {n}: priority ({ints['priority']}) must be <= 1000000")
        if ints["max_workers"] < ints["min_workers"]:
            raise ValueError(
                f"line {n}: max_workers ({ints['max_workers']}) must be >= min_workers "
                f"({ints['min_workers']})"
            )
        for name, value in floats.items():
            if value < 0:
                raise ValueError(f"line {n}: {name} ({value}) must be >= 0")
        try:
            curve = ThroughputCurve(
                overhead=floats["overhead_s"],
                compute=floats["compute_s"],
                sync=floats["sync_s"],
                sync_per_worker=floats["sync_per_worker_s"],
                batch=ints["batch"],
            )
        except ValueError as exc:
            raise ValueError(f"line {n}: {exc}") from None
        jobs.append(
            TraceJob(
                job_id=job_id,
                submit_s=floats["submit_s"],
                iterations=ints["iterations"],
                min_workers=ints["min_workers"],
                max_workers=ints["max_workers"],
                priority=ints["priority"],
                curve=curve,
                rescale_pause_s=floats["rescale_pause_s"],
            )
        )
        if len(jobs) > MAX_JOBS:
            raise ValueError(f"the trace has more than {MAX_JOBS} jobs")
    if not jobs:
        raise ValueError("the trace has no jobs")
    return jobs


def parse_policies(text: str, service_thresholds: Sequence[float]) -> list[PolicyRun]:
    """``fifo,fairshare,priority,goodput,priority+las,...``: a name, ``+las`` for the
    attained-service classes (``service_thresholds``)."""
    runs: list[PolicyRun] = []
    for raw in text.split(","):
        token = raw.strip().lower()
        if not token:
            continue
        name, _, extra = token.partition("+")
        try:
            policy = Policy(name)
        except ValueError:
            raise ValueError(
                f"policies ({raw.strip()!r}) must name fifo, fairshare, priority or goodput, "
                "optionally with +las"
            ) from None
        if extra not in ("", "las") or (extra and policy is Policy.FIFO):
            raise ValueError(
                f"policies ({raw.strip()!r}): only +las may follow a policy other than fifo"
            )
        if extra and not service_thresholds:
            raise ValueError(f"policies ({raw.strip()!r}): +las needs service thresholds")
        runs.append(PolicyRun(token, policy, tuple(service_thresholds) if extra else ()))
    if not runs:
        raise ValueError(f"policies ({text!r}) must name at least one policy")
    return runs


# --- replay ------------------------------------------------------------------------------------


@dataclass
class _Running:
    job: TraceJob
    model: ThroughputModel
    done: float = 0.0  # iterations completed
    workers: int = 0
    paused_until: float = 0.0
    service: float = 0.0


def replay(
    jobs: Sequence[TraceJob],
    run: PolicyRun,
    *,
    gpus: int,
    gpus_per_host: int = 4,
    interval_s: float = 60.0,
    hold_time_s: float = 30.0,
    fair_fraction: float = 0.5,
    rescale_horizon_s: float = 0.0,
    max_events: int = 1_000_000,
) -> TraceResult:
    """Replay ``jobs`` under ``run`` on ``gpus`` devices (hosts of ``gpus_per_host``)."""
    if gpus < 1:
        raise ValueError(f"gpus ({gpus}) must be >= 1")
    if gpus_per_host < 1:
        raise ValueError(f"gpus_per_host ({gpus_per_host}) must be >= 1")
    if not (interval_s > 0 and math.isfinite(interval_s)):
        raise ValueError(f"interval_s ({interval_s}) must be > 0")
    too_big = [j.job_id for j in jobs if j.min_workers > gpus]
    if too_big:
        raise ValueError(f"job {too_big[0]!r} needs more than the {gpus} gpus (min_workers)")
    hosts = [
        HostView.with_devices(f"h{i:04d}", min(gpus_per_host, gpus - i * gpus_per_host))
        for i in range(math.ceil(gpus / gpus_per_host))
    ]
    config = PlacementConfig(
        policy=run.policy,
        hold_time=hold_time_s,
        fair_fraction=fair_fraction,
        service_thresholds=run.service_thresholds,
        rescale_horizon=rescale_horizon_s,
    )
    sim = Simulator({h.host_id: h for h in hosts}, config)
    pending = sorted(jobs, key=lambda j: (j.submit_s, j.job_id))
    running: dict[str, _Running] = {}
    finished: dict[str, float] = {}
    seq = {j.job_id: i for i, j in enumerate(pending)}
    now = 0.0
    next_tick = 0.0
    busy = 0.0
    rescales = 0
    for _ in range(max_events):
        # 1. What happens at `now`: submits, then a scheduling round.
        while pending and pending[0].submit_s <= now + _EPS:
            job = pending.pop(0)
            running[job.job_id] = _Running(job, ThroughputModel(batch=job.curve.batch))
            sim.jobs[job.job_id] = JobDemand(
                job_id=job.job_id,
                priority=job.priority,
                submit_seq=seq[job.job_id],
                min_workers=job.min_workers,
                max_workers=job.max_workers,
            )
        for job_id, r in running.items():
            sim.jobs[job_id] = replace(
                sim.jobs[job_id],
                throughput=r.model.curve(),
                attained_service=r.service,
                rescale_pause_s=r.model.pause_s,
            )
        sample = sim.settle(now)
        for job_id, r in running.items():
            w = sample.workers.get(job_id, 0)
            if w != r.workers:
                if w > 0:
                    r.paused_until = now + r.job.rescale_pause_s
                    if r.workers > 0:
                        rescales += 1
                        r.model.observe_pause(r.job.rescale_pause_s)
                r.workers = w
        if not running and not pending:
            break
        # 2. The next event: a submit, a finish, or the next tick.
        if now + _EPS >= next_tick:
            next_tick = now + interval_s
        candidates = [next_tick]
        if pending:
            candidates.append(pending[0].submit_s)
        for r in running.values():
            if r.workers > 0:
                start = max(now, r.paused_until)
                left = (r.job.iterations - r.done) * r.job.curve.iteration_time(r.workers)
                candidates.append(start + left)
        until = max(min(candidates), now)
        # 3. Advance every running job to `until`.
        ended: list[str] = []
        for job_id, r in running.items():
            if r.workers == 0:
                continue
            busy += r.workers * (until - now)
            r.service += r.workers * (until - now)
            start = max(now, r.paused_until)
            if until > start:
                t = r.job.curve.iteration_time(r.workers)
                r.done += (until - start) / t
                r.model.observe(r.workers, t)
            if r.done >= r.job.iterations - 1e-6:
                ended.append(job_id)
        now = until
        for job_id in ended:
            finished[job_id] = now
            del running[job_id]
            sim.jobs.pop(job_id, None)
            sim.learners = {k: v for k, v in sim.learners.items() if v.job_id != job_id}
    else:
        raise RuntimeError(f"the replay did not end within max_events ({max_events})")
    jct = {j.job_id: finished[j.job_id] - j.submit_s for j in jobs}
    makespan = max(finished.values(), default=0.0)
    slowdowns = [jct[j.job_id] / j.alone_s(gpus) for j in jobs]
    return TraceResult(
        name=run.name,
        jct=jct,
        makespan=makespan,
        utilisation=busy / (gpus * makespan) if makespan > 0 else 0.0,
        rescales=rescales,
        worst_slowdown=max(slowdowns, default=0.0),
    )
