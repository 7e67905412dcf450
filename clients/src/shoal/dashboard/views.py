"""What the dashboard's pages show, as JSON-ready dicts built from the API's messages.

Pure functions of protobuf messages (no I/O, no web framework), so every view is unit-tested
without a cluster. The browser draws what these return and nothing else.

Metrics are drawn generically: every numeric field of ``IterationMetric`` that is not one of
its coordinates (epoch, iteration, generation, world size, samples) is a series, and so is
every entry of any ``map<string, double>`` field (``EpochMetric.values`` today; a user-metrics
map on ``IterationMetric`` tomorrow). A metric the API starts returning appears on the page
without a change here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shoal.client.metrics import (
    EPOCH_COORDINATES,
    ITERATION_COORDINATES,
    finite as _finite,
    global_iteration as _global_iteration,
    metric_values as _numbers,
    seconds,
)
from shoal.v1 import job_pb2, resources_pb2

__all__ = [
    "ITERATION_COORDINATES",
    "allocation_chart",
    "cluster_view",
    "epoch_series",
    "iteration_series",
    "job_row",
    "learners_of",
    "rescale_markers",
    "seconds",
]


def _name(enum: Any, value: int, prefix: str) -> str:
    try:
        return str(enum.Name(value)).removeprefix(prefix).lower()
    except ValueError:
        return str(value)


_FINAL = (job_pb2.JOB_STATE_COMPLETED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED)


def job_state(value: int) -> str:
    return _name(job_pb2.JobState, value, "JOB_STATE_")


# -- jobs ---------------------------------------------------------------------------------------


def job_row(job: job_pb2.Job) -> dict[str, Any]:
    """One job as the jobs table shows it (the columns of ``shoal jobs list``, and more)."""
    p = job.progress
    per_epoch = p.iterations_per_epoch
    total = per_epoch * job.spec.epochs
    return {
        "job_id": job.job_id,
        "name": job.spec.name,
        "owner": job.owner,
        "state": job_state(job.state),
        "state_reason": job.state_reason,
        "final": job.state
        in (job_pb2.JOB_STATE_COMPLETED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED),
        "priority": job.spec.priority,
        "max_workers": job.spec.max_workers,
        "min_workers": job.spec.min_workers or 1,
        "allocated_workers": job.allocated_workers,
        "target_workers": job.target_workers,
        "world_size": p.world_size,
        "epoch": p.epoch + (1 if per_epoch else 0),
        "epochs": job.spec.epochs,
        "completed_iterations": p.completed_iterations,
        "total_iterations": total,
        "progress": (min(1.0, p.completed_iterations / total) if total else 0.0),
        "last_loss": _finite(p.last_loss) if p.completed_iterations else None,
        "samples_per_second": _finite(p.samples_per_second),
        "sync_mode": _name(job_pb2.SyncMode, job.effective_sync_mode, "SYNC_MODE_"),
        "queue_position": job.queue_position,
        "create_time": seconds(job.create_time),
        "start_time": seconds(job.start_time),
        "end_time": seconds(job.end_time),
    }


# -- GPUs per job over time ---------------------------------------------------------------------


def allocation_chart(
    events: Iterable[job_pb2.AllocationEvent],
    jobs: Mapping[str, job_pb2.Job],
    *,
    now: float | None = None,
    capacity: int = 0,
) -> dict[str, Any]:
    """The stacked step chart of GPUs per job: one x per change (and ``now`` when given), one
    row of learner counts per job, each value holding from its x until the next.

    ``jobs`` names the jobs (job id -> job); events of jobs not in it are left out, so a user
    sees only the jobs the API showed them."""
    ordered = [e for e in events if e.job_id in jobs]
    if not ordered:
        return {"t": [], "jobs": [], "capacity": capacity}
    # A job in a final state holds no GPU, even when its history has not recorded the last
    # release yet: it drops to 0 when it ended (or at its last change, when that is later).
    last: dict[str, job_pb2.AllocationEvent] = {}
    for e in sorted(ordered, key=lambda e: seconds(e.time)):
        last[e.job_id] = e
    for job_id, e in last.items():
        job = jobs[job_id]
        if e.workers and job.state in _FINAL:
            end = job_pb2.AllocationEvent(job_id=job_id, workers=0)
            end.time.CopyFrom(job.end_time if seconds(job.end_time) > seconds(e.time) else e.time)
            ordered.append(end)
    ordered.sort(key=lambda e: (seconds(e.time), e.job_id))
    times = sorted({seconds(e.time) for e in ordered})
    if now is not None and now > times[-1]:
        times.append(now)
    index = {t: i for i, t in enumerate(times)}
    order: list[str] = []
    rows: dict[str, list[int]] = {}
    for e in ordered:
        if e.job_id not in rows:
            order.append(e.job_id)
            rows[e.job_id] = [0] * len(times)
        row = rows[e.job_id]
        for i in range(index[seconds(e.time)], len(times)):
            row[i] = e.workers
    series = [
        {
            "job_id": job_id,
            "name": jobs[job_id].spec.name,
            "state": job_state(jobs[job_id].state),
            "values": rows[job_id],
        }
        for job_id in order
    ]
    return {"t": times, "jobs": series, "capacity": capacity}


# -- the cluster --------------------------------------------------------------------------------


def host_state(host: resources_pb2.Host) -> str:
    """ready, cordoned, draining or lost: what an operator needs to know first."""
    if host.state == resources_pb2.HOST_STATE_LOST:
        return "lost"
    if host.draining:
        return "draining"
    if host.cordoned:
        return "cordoned"
    return _name(resources_pb2.HostState, host.state, "HOST_STATE_")


def cluster_view(
    hosts: Iterable[resources_pb2.Host], visible_jobs: Mapping[str, job_pb2.Job]
) -> dict[str, Any]:
    """Hosts, their devices and which job holds each. A device held by a job the caller may
    not see shows as busy, without the job's id or learner."""
    out = []
    total = busy = 0
    for host in sorted(hosts, key=lambda h: h.host_id):
        devices = []
        for d in sorted(host.devices, key=lambda d: (d.index, d.device_id)):
            a = d.allocation
            held = bool(a.allocation_id or a.job_id)
            mine = held and a.job_id in visible_jobs
            devices.append(
                {
                    "device_id": d.device_id,
                    "index": d.index,
                    "model": d.model,
                    "simulated": d.simulated,
                    "healthy": d.health != resources_pb2.DEVICE_HEALTH_UNHEALTHY,
                    "utilization_percent": _finite(d.utilization_percent),
                    "busy": held,
                    "job_id": a.job_id if mine else "",
                    "job_name": visible_jobs[a.job_id].spec.name if mine else "",
                    "learner_id": a.learner_id if mine else "",
                }
            )
        if host.state != resources_pb2.HOST_STATE_LOST:
            total += len(devices)
            busy += sum(1 for d in devices if d["busy"])
        out.append(
            {
                "host_id": host.host_id,
                "state": host_state(host),
                "agent_address": host.agent_address,
                "resource_group": host.resource_group or "default",
                "incarnation": host.incarnation,
                "last_heartbeat": seconds(host.last_heartbeat_time),
                "devices": devices,
            }
        )
    return {"hosts": out, "gpus_total": total, "gpus_busy": busy}


def learners_of(job_id: str, hosts: Iterable[resources_pb2.Host]) -> list[dict[str, Any]]:
    """The learners a job holds now, with host and device, from the allocation ledger."""
    out = []
    for host in hosts:
        for d in host.devices:
            a = d.allocation
            if a.job_id == job_id and a.learner_id:
                out.append(
                    {
                        "learner_id": a.learner_id,
                        "host_id": host.host_id,
                        "device_id": d.device_id,
                        "device_index": d.index,
                        "host_state": host_state(host),
                        "since": seconds(a.create_time),
                    }
                )
    return sorted(out, key=lambda r: (r["host_id"], r["device_index"], r["learner_id"]))


# -- a job's metrics ----------------------------------------------------------------------------


def iteration_series(
    metrics: Sequence[job_pb2.IterationMetric], per_epoch: int, *, offset: int = 0
) -> dict[str, Any]:
    """Per-iteration series: x (the 1-based global iteration), the world size, and one list
    per metric (loss, throughput, and whatever else the API returns), aligned with x.
    ``offset`` is the number of iterations the caller already has (incremental updates)."""
    xs: list[int] = []
    world: list[int] = []
    times: list[float] = []
    series: dict[str, list[float | None]] = {}
    for i, m in enumerate(metrics):
        xs.append(_global_iteration(m, per_epoch, offset + i))
        world.append(m.world_size)
        times.append(seconds(m.time))
        values = _numbers(m, ITERATION_COORDINATES)
        for name in series.keys() - values.keys():
            series[name].append(None)
        for name, value in values.items():
            series.setdefault(name, [None] * i).append(value)
    return {"x": xs, "world_size": world, "time": times, "series": series, "count": len(xs)}


def epoch_series(metrics: Sequence[job_pb2.EpochMetric]) -> dict[str, Any]:
    """Per-epoch series: x (the 1-based epoch) and one list per metric name, aligned with x."""
    xs: list[int] = []
    series: dict[str, list[float | None]] = {}
    for i, m in enumerate(metrics):
        xs.append(m.epoch + 1)
        values = _numbers(m, EPOCH_COORDINATES)
        for name in series.keys() - values.keys():
            series[name].append(None)
        for name, value in values.items():
            series.setdefault(name, [None] * i).append(value)
    return {"x": xs, "series": series}


def rescale_markers(
    metrics: Sequence[job_pb2.IterationMetric],
    per_epoch: int,
    allocations: Sequence[job_pb2.AllocationEvent] = (),
    *,
    previous_world: int = 0,
    offset: int = 0,
) -> list[dict[str, Any]]:
    """Where the job was rescaled, on its iteration axis: the first iteration run by a new
    world size. Each marker has x (global iteration), epoch_x (epochs completed when it
    happened, fractional: on the axis where the evaluation after epoch k is at k), from/to
    world sizes and the reason of the allocation change that preceded it."""
    events = sorted(allocations, key=lambda e: seconds(e.time))
    out = []
    world = previous_world
    for i, m in enumerate(metrics):
        if world and m.world_size != world:
            when = seconds(m.time)
            reason = ""
            for e in events:
                if seconds(e.time) <= when:
                    reason = e.reason
            out.append(
                {
                    "x": _global_iteration(m, per_epoch, offset + i),
                    "epoch_x": m.epoch + (m.iteration / per_epoch if per_epoch else 0.0),
                    "from": world,
                    "to": m.world_size,
                    "reason": reason,
                    "time": when,
                }
            )
        world = m.world_size
    return out
