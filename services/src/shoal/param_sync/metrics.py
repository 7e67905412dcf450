"""The parameter-sync shard's metrics (see docs/operations.md, "Reading metrics").

==========================================  ======  ======================================
metric                                      labels  meaning
==========================================  ======  ======================================
``shoal_sync_iterations_committed_total``   job_id  iterations of the job committed on
                                                    every shard; counted by the job's
                                                    coordinator shard only, so the sum
                                                    over shards is the job's count and
                                                    ``rate()`` of it the iteration rate
``shoal_sync_round_duration_seconds``       job_id  histogram, per shard: from the first
                                                    gradient stream of an iteration
                                                    reaching this shard to the iteration's
                                                    new parameters being ready on it
                                                    (waiting for the slowest learner and
                                                    the other shards, the commit and the
                                                    optimizer step included); aborted
                                                    rounds are not recorded
``shoal_sync_lane_streams_total``           job_id  SyncSteps whose bytes came through the
                                                    same-host shared-memory lane, per
                                                    shard (the others came as gRPC chunks)
``shoal_sync_lane_control_calls_total``     job_id, calls answered on a same-host lane's
                                            method  control connection instead of gRPC
                                                    (method: SyncStep or Boundary)
``shoal_sync_lane_handoffs_refused_total``  (none)  connections to this shard's lane
                                                    handoff socket that got no descriptor
                                                    (a wrong, used or expired token,
                                                    another user, a silent peer); 0 unless
                                                    something probes it
``shoal_sync_replica_snapshots_total``      job_id  snapshots of a primary's state this
                                                    shard took for the replica it keeps of
                                                    that slice (each drops the sums it
                                                    kept unstepped: docs/data-plane.md,
                                                    "The replica's steps deferred")
``shoal_sync_generation_drifts_total``      job_id  times the job's coordinator found a
                                                    shard's generation floor above its
                                                    generation and re-issued the running
                                                    iteration above it (docs/data-plane.md,
                                                    "Generation floor drift"); 0 unless
                                                    something is wrong
==========================================  ======  ======================================

A shard has no leadership: every shard reports the rounds it served; only a job's
coordinator counts its commits. The label is ``job_id``, not ``job``: Prometheus sets ``job``
on every scraped series (the scrape job) and would rename ours to ``exported_job``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from opentelemetry.metrics import Meter

from shoal.runtime.metrics import LATENCY_BUCKETS_S, meter

__all__ = ["SyncMetrics"]


class SyncMetrics:
    """Instruments and round timing of one shard process. No-ops (but the few dict updates)
    when the process serves no metrics."""

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, otel_meter: Meter | None = None
    ) -> None:
        m = otel_meter if otel_meter is not None else meter(__name__)
        self._clock = clock
        self._committed = m.create_counter(
            "shoal_sync_iterations_committed",
            description="Iterations committed on every shard of the job (counted by the "
            "job's coordinator shard)",
        )
        self._round = m.create_histogram(
            "shoal_sync_round_duration",
            unit="s",
            description="Seconds from an iteration's first gradient stream reaching this "
            "shard to its new parameters being ready here",
            explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS_S),
        )
        self._lane = m.create_counter(
            "shoal_sync_lane_streams",
            description="SyncSteps whose bytes came through the same-host shared-memory lane",
        )
        self._lane_control = m.create_counter(
            "shoal_sync_lane_control_calls",
            description="Calls answered on a same-host lane's control connection instead of "
            "gRPC (SyncStep, Boundary)",
        )
        self._handoff_refused = m.create_counter(
            "shoal_sync_lane_handoffs_refused",
            description="Connections to the shard's lane handoff socket that got no "
            "descriptor (a wrong, used or expired token, another user, a silent peer)",
        )
        self._snapshots = m.create_counter(
            "shoal_sync_replica_snapshots",
            description="Snapshots of a primary's state taken for the replica this shard "
            "keeps of its slice",
        )
        self._drift = m.create_counter(
            "shoal_sync_generation_drifts",
            description="Times the job's coordinator found a shard's generation floor above "
            "its generation and re-issued the running iteration above it",
        )
        # (job, generation, iteration) -> when its first contribution arrived on this shard
        self._started: dict[tuple[str, int, int], float] = {}

    def round_started(self, job_id: str, generation: int, iteration: int) -> None:
        """A gradient stream of (generation, iteration) reached this shard."""
        self._started.setdefault((job_id, generation, iteration), self._clock())

    def round_committed(self, job_id: str, generation: int, iteration: int) -> None:
        """(generation, iteration)'s new parameters are ready on this shard."""
        started = self._started.pop((job_id, generation, iteration), None)
        if started is not None:
            self._round.record(max(0.0, self._clock() - started), {"job_id": job_id})
        self._drop(job_id, lambda g, k: k <= iteration)

    def round_aborted(self, job_id: str, generation: int) -> None:
        """Every round of ``generation`` and older of the job is dropped."""
        self._drop(job_id, lambda g, k: g <= generation)

    def iteration_committed(self, job_id: str) -> None:
        """The coordinator delivered an iteration's commit to every shard of the job."""
        self._committed.add(1, {"job_id": job_id})

    def generation_drift(self, job_id: str) -> None:
        """The coordinator re-issued an iteration above a shard's drifted generation floor."""
        self._drift.add(1, {"job_id": job_id})

    def lane_stream(self, job_id: str) -> None:
        """A SyncStep's bytes came through the same-host lane."""
        self._lane.add(1, {"job_id": job_id})

    def lane_control_call(self, job_id: str, method: str) -> None:
        """A call was answered on a lane's control connection (not gRPC)."""
        self._lane_control.add(1, {"job_id": job_id, "method": method})

    def lane_handoff_refused(self) -> None:
        """A connection to the lane handoff socket got no descriptor."""
        self._handoff_refused.add(1)

    def replica_snapshot(self, job_id: str) -> None:
        """A replica kept here took a snapshot of its primary's state."""
        self._snapshots.add(1, {"job_id": job_id})

    def forget(self, job_id: str) -> None:
        """The job was closed or reloaded on this shard."""
        self._drop(job_id, lambda g, k: True)

    def _drop(self, job_id: str, which: Callable[[int, int], bool]) -> None:
        for key in [key for key in self._started if key[0] == job_id and which(key[1], key[2])]:
            del self._started[key]
