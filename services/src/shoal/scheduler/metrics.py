"""The job-scheduler's metrics (see docs/operations.md, "Reading metrics").

==================================  =========  ===========================================
metric                              labels     meaning
==================================  =========  ===========================================
``shoal_jobs``                      state      jobs in each state (QUEUED, RUNNING, RECOVERING,
                                               CANCELLING, COMPLETED, FAILED, CANCELLED)
``shoal_rescale_duration_seconds``  direction  histogram: from the decision to resize a
                                               running job (grow / shrink) to its
                                               coordinator reporting the job running at
                                               the new size
==================================  =========  ===========================================

Only the leader reports them: ``shoal_jobs`` reads the leader's job table (a standby exports
no points), and only the leader's reconcile loop decides and observes rescales
(``shoal_leader{election="job-scheduler"}`` tells which replica leads).

A rescale (:class:`RescaleTracker`) starts when the reconcile loop changes the target of a job
that already had one (a start from 0 and a requeue to 0 are not rescales) and ends when the
job's coordinator reports that world size (the scheduler polls it every resync interval, so a
duration is late by up to that interval). A target that changes again before it is reached
keeps the first decision's time; one that returns to where it started cancels the rescale;
so does the job leaving the active states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from opentelemetry.metrics import Meter

from shoal.runtime.metrics import DURATION_BUCKETS_S, meter, observer
from shoal.scheduler.jobs import TRANSITIONS, state_name
from shoal.scheduler.store import JobTable

__all__ = ["RescaleTracker", "SchedulerMetrics", "job_counts"]

Point = tuple[float, Mapping[str, str]]


def job_counts(table: JobTable) -> dict[str, int]:
    """Jobs by state name, every state present; empty on a standby."""
    if not table.leading:
        return {}
    counts = {state_name(state): 0 for state in TRANSITIONS}
    for record in list(table.records.values()):
        name = state_name(record.state)
        counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass
class _Rescale:
    since: float
    from_size: int
    target: int


class RescaleTracker:
    """Times rescales (see the module docstring); ``record(seconds, direction)`` gets each
    completed one. ``is_active(job_id)`` prunes the rescales of jobs that ended."""

    def __init__(
        self,
        record: Callable[[float, str], None],
        is_active: Callable[[str], bool] = lambda job_id: True,
    ) -> None:
        self._record = record
        self._is_active = is_active
        self._pending: dict[str, _Rescale] = {}

    @property
    def pending(self) -> dict[str, tuple[int, int]]:
        """job id -> (size at the decision, target) of the rescales in progress."""
        return {job: (r.from_size, r.target) for job, r in self._pending.items()}

    def target_changed(self, job_id: str, old: int, new: int, now: float) -> None:
        if old == new:
            return
        for stale in [j for j in self._pending if not self._is_active(j)]:
            del self._pending[stale]
        current = self._pending.get(job_id)
        if new <= 0 or (current is not None and new == current.from_size):
            self._pending.pop(job_id, None)
        elif current is not None:
            current.target = new
        elif old > 0:
            self._pending[job_id] = _Rescale(since=now, from_size=old, target=new)

    def world_size(self, job_id: str, size: int, now: float) -> None:
        current = self._pending.get(job_id)
        if current is None or size != current.target:
            return
        del self._pending[job_id]
        direction = "grow" if current.target > current.from_size else "shrink"
        self._record(max(0.0, now - current.since), direction)


class SchedulerMetrics:
    """The scheduler's instruments over its job table (create once per process, on the
    process that serves metrics). The reconcile loop calls :meth:`target_changed` and
    :meth:`world_size`."""

    def __init__(self, table: JobTable, *, otel_meter: Meter | None = None) -> None:
        self.table = table
        m = otel_meter if otel_meter is not None else meter(__name__)

        def jobs() -> Iterator[Point]:
            for state, count in job_counts(table).items():
                yield float(count), {"state": state}

        m.create_observable_gauge(
            "shoal_jobs",
            callbacks=[observer(jobs, what="shoal_jobs")],
            description="Jobs in each state (reported by the job-scheduler leader only)",
        )
        histogram = m.create_histogram(
            "shoal_rescale_duration",
            unit="s",
            description="Seconds from the decision to resize a running job to the job running "
            "at the new size, by direction (grow, shrink)",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS_S),
        )

        def is_active(job_id: str) -> bool:
            record = table.records.get(job_id)
            return record is not None and record.active

        self.rescales = RescaleTracker(
            lambda seconds, direction: histogram.record(seconds, {"direction": direction}),
            is_active,
        )

    def target_changed(self, job_id: str, old: int, new: int, now: float) -> None:
        self.rescales.target_changed(job_id, old, new, now)

    def world_size(self, job_id: str, size: int, now: float) -> None:
        self.rescales.world_size(job_id, size, now)
