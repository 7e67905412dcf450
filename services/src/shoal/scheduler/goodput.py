"""What the scheduler learns of each job's throughput from its progress polls. No grpc, no I/O.

The reconcile loop polls every running job's coordinator (``GetJobProgress``) and hands the
``JobProgress`` to :meth:`GoodputTracker.observe`. From successive polls the tracker derives:

* iteration times: between two polls of the same generation and world size where the
  completed iterations advanced, ``(update_time - previous update_time) / iterations``
  seconds per iteration at that world size (``update_time`` is when the last iteration
  committed, so idle gaps between polls do not count);
* rescale pauses: when the generation (or the world size) changed between two polls that
  both saw progress, the elapsed time less the iterations run at the new world size's
  predicted time;
* attained service: device-seconds, the world size reported integrated over time.

With an iteration time the tracker also takes the learners' compute/sync split that the poll
carries (``JobProgress.compute_seconds`` / ``sync_seconds``, when they are for the same world
size).

A rewind (fewer completed iterations, a retry from a checkpoint) or a clock going back starts
over from that poll without an observation.

Persistence: :meth:`GoodputTracker.state` is a job's ``ThroughputState`` (the running means
with their counts, the rescale pause, the attained service; at most ``MAX_POINTS`` world
sizes, the most observed kept), which the reconcile loop stores in etcd
(``JobTable.save_throughput``); a new leader restores every job's from there
(:meth:`restore`) before its first decision, so a failover loses at most what was learned
since the last save.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass, field, replace

from shoal.contract.noise_scale import MIN_SAMPLES as NOISE_MIN_SAMPLES
from shoal.scheduler.adaptive_batch import AdaptiveBounds, choose_batch, iteration_time
from shoal.scheduler.policy import JobDemand
from shoal.scheduler.throughput import (
    PRIOR,
    PRIOR_PAUSE_S,
    Sample,
    ThroughputCurve,
    ThroughputModel,
)
from shoal.v1 import job_pb2

__all__ = ["MAX_POINTS", "GoodputTracker", "describe"]

MAX_POINTS = 64
"""The most ThroughputPoints a Job carries (measured ones first, then predicted)."""


@dataclass
class _Anchor:
    generation: int
    world_size: int
    iterations: int
    at: float
    batch: int = 0


@dataclass
class _Track:
    model: ThroughputModel
    anchor: _Anchor | None = None
    service: float = 0.0
    service_at: float | None = None
    service_world: int = 0
    observations: dict[int, int] = field(default_factory=dict)  # iteration times fed, by w
    batch_plan: _BatchPlan | None = None  # an adaptive job's batch at its world size


@dataclass(frozen=True)
class _BatchPlan:
    """The batch an adaptive job runs at ``world_size``: picked from the prediction when it
    got there (``measured_from`` = the observations at that size then; the batch in use while
    nothing at all was measured), picked once more when ``BATCH_REVIEW_AFTER`` more were
    measured (``final``), then kept until the world size changes: a batch changes at most
    twice per world size, never on the fit's noise."""

    world_size: int
    batch: int
    measured_from: int
    final: bool = False


BATCH_REVIEW_AFTER = 3
"""Measured iteration times at a new world size after which its batch is picked once more."""


@dataclass
class GoodputTracker:
    """Per-job throughput models and attained service, fed by progress polls."""

    _jobs: dict[str, _Track] = field(default_factory=dict)
    # The jobs whose model or attained service changed since ``take_changed`` (the reconcile
    # loop's incremental cycles give only those jobs' demands to the planner again).
    _changed: set[str] = field(default_factory=set)

    def take_changed(self) -> set[str]:
        """The jobs whose annotation (curve, service, pause) may have changed since the last
        call."""
        out, self._changed = self._changed, set()
        return out

    def model(self, job_id: str) -> ThroughputModel | None:
        track = self._jobs.get(job_id)
        return None if track is None else track.model

    def jobs(self) -> set[str]:
        """The jobs with a model."""
        return set(self._jobs)

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._changed.add(job_id)

    def state(self, job_id: str) -> job_pb2.ThroughputState | None:
        """What was learned of ``job_id`` as stored (None: nothing yet). Bounded: at most
        ``MAX_POINTS`` world sizes (the most observed ones)."""
        track = self._jobs.get(job_id)
        if track is None:
            return None
        samples = track.model.samples()
        if len(samples) > MAX_POINTS:
            kept = sorted(samples, key=lambda s: (-s.count, s.world_size))[:MAX_POINTS]
            samples = sorted(kept, key=lambda s: s.world_size)
        pause, pauses = track.model.pause_state()
        out = job_pb2.ThroughputState(
            rescale_pause_seconds=pause,
            rescale_pause_count=pauses,
            attained_device_seconds=track.service,
        )
        for s in samples:
            out.samples.add(
                world_size=s.world_size,
                seconds_per_iteration=s.seconds,
                count=s.count,
                compute_seconds=s.compute_s,
                sync_seconds=s.sync_s,
                split_count=s.split_count,
            )
        return out

    def restore(self, job_id: str, batch: int, state: job_pb2.ThroughputState) -> None:
        """Take up a stored ``state`` of ``job_id`` (global batch ``batch``): the model and
        the attained service go on from it; the next poll anchors afresh. Invalid entries are
        skipped (at most ``MAX_POINTS`` samples are read)."""
        model = ThroughputModel(batch=max(1, batch))
        model.restore(
            [
                Sample(
                    s.world_size,
                    s.seconds_per_iteration,
                    s.count,
                    s.compute_seconds,
                    s.sync_seconds,
                    s.split_count,
                )
                for s in state.samples[:MAX_POINTS]
            ],
            (state.rescale_pause_seconds, state.rescale_pause_count),
        )
        service = state.attained_device_seconds
        valid = math.isfinite(service) and service >= 0
        self._jobs[job_id] = _Track(model, service=service if valid else 0.0)
        self._changed.add(job_id)

    def observe(self, job_id: str, batch: int, progress: job_pb2.JobProgress, now: float) -> None:
        """One progress poll of ``job_id`` (global batch ``batch``) at ``now`` (unix s)."""
        self._changed.add(job_id)
        track = self._jobs.get(job_id)
        if track is None:
            track = self._jobs[job_id] = _Track(ThroughputModel(batch=max(1, batch)))
        if track.service_at is not None and now > track.service_at:
            track.service += track.service_world * (now - track.service_at)
        track.service_at = now
        track.service_world = max(0, progress.world_size)

        at = progress.update_time.ToNanoseconds() / 1e9 if progress.HasField("update_time") else now
        in_use = progress.global_batch or batch
        point = _Anchor(
            progress.generation,
            progress.world_size,
            progress.completed_iterations,
            at,
            in_use,
        )
        last = track.anchor
        if point.world_size < 1 or not math.isfinite(at):
            return
        if (
            last is None
            or point.iterations < last.iterations
            or at < last.at
            or (last.batch and last.batch != point.batch)
        ):
            # First poll, a rewind, a clock step or a change of the (adaptive) batch between
            # the polls: start over.
            track.anchor = point
            return
        done = point.iterations - last.iterations
        if done == 0:
            return  # no progress since: keep the anchor (a pause is measured when it ends)
        elapsed = at - last.at
        if point.generation == last.generation and point.world_size == last.world_size:
            seconds, compute_s = elapsed / done, progress.compute_seconds
            if in_use != track.model.batch:
                seconds, compute_s = _at_declared_batch(
                    track.model, point.world_size, in_use, seconds, compute_s
                )
            track.model.observe(
                point.world_size,
                seconds,
                compute_s=compute_s,
                sync_s=progress.sync_seconds,
            )
            track.observations[point.world_size] = track.observations.get(point.world_size, 0) + 1
        else:
            expected = done * track.model.curve().iteration_time(point.world_size)
            track.model.observe_pause(max(0.0, elapsed - expected))
        track.anchor = point

    def observe_job(self, job: job_pb2.Job, progress: job_pb2.JobProgress, now: float) -> None:
        """The reconcile loop's hook: observe a poll of ``job`` and set ``job.throughput``
        (and, when its spec opts in to the adaptive batch, ``job.adaptive_batch_size``: the
        batch ``shoal.scheduler.adaptive_batch`` picks at the world size it runs at)."""
        self.observe(job.job_id, job.spec.batch_size, progress, now)
        model = self.describe(job.job_id, job.spec.max_workers)
        if model is not None:
            job.throughput.CopyFrom(model)
        bounds = AdaptiveBounds.of(job.spec)
        track = self._jobs.get(job.job_id)
        if bounds is not None and track is not None:
            job.adaptive_batch_size = self._plan_batch(track, job, progress, bounds)

    @staticmethod
    def _plan_batch(
        track: _Track, job: job_pb2.Job, progress: job_pb2.JobProgress, bounds: AdaptiveBounds
    ) -> int:
        """An adaptive job's batch (:class:`_BatchPlan`): picked when its world size changes
        (the rescale boundary), reviewed once after measurements there, else kept."""
        world = progress.world_size or job.target_workers or 1
        seen = track.observations.get(world, 0)
        plan = track.batch_plan
        if plan is not None and plan.world_size == world:
            if plan.final or seen < plan.measured_from + BATCH_REVIEW_AFTER:
                return plan.batch
        current = progress.global_batch or (plan.batch if plan is not None else None)
        if not track.observations:
            # Nothing measured yet: the prior alone is no reason to leave the declared batch.
            track.batch_plan = _BatchPlan(world, current or bounds.declared, seen)
            return track.batch_plan.batch
        pick = choose_batch(
            track.model.curve(), world, bounds, measured_noise_scale(progress), current=current
        )
        review = plan is not None and plan.world_size == world
        track.batch_plan = _BatchPlan(world, pick, seen, final=review)
        return pick

    def annotate(self, demands: Sequence[JobDemand]) -> list[JobDemand]:
        """``demands`` with each job's predicted curve, attained service and rescale pause
        filled in (a job not polled yet: the priors and no service, as ``shoal simulate``
        assumes); the
        models of jobs no longer among them are dropped (the jobs ended)."""
        self.retain({d.job_id for d in demands})
        return [self.annotate_one(d) for d in demands]

    def retain(self, job_ids: Container[str]) -> None:
        """Drop the models of the jobs not in ``job_ids`` (the jobs ended), as
        :meth:`annotate` does, without annotating anything."""
        for job_id in [j for j in self._jobs if j not in job_ids]:
            del self._jobs[job_id]

    def annotate_one(self, d: JobDemand) -> JobDemand:
        """One job's demand annotated as :meth:`annotate` does (no model is dropped)."""
        curve, service = self.demand(d.job_id)
        track = self._jobs.get(d.job_id)
        pause = track.model.pause_s if track is not None else PRIOR_PAUSE_S
        return replace(
            d, throughput=curve or PRIOR, attained_service=service, rescale_pause_s=pause
        )

    def demand(self, job_id: str) -> tuple[ThroughputCurve | None, float]:
        """(predicted curve, attained device-seconds) for the policy; (None, 0) if unknown."""
        track = self._jobs.get(job_id)
        if track is None:
            return None, 0.0
        return track.model.curve(), track.service

    def describe(self, job_id: str, max_workers: int) -> job_pb2.ThroughputModel | None:
        """The API view of the job's model (None before its first poll)."""
        track = self._jobs.get(job_id)
        if track is None:
            return None
        return describe(track.model, max_workers, attained=track.service)


def measured_noise_scale(progress: job_pb2.JobProgress) -> float | None:
    """The job's measured gradient noise scale once it averages ``MIN_SAMPLES`` (10)
    iterations' estimates; None (the scheduler's prior phi = B0) before, or when it is 0
    (not measured: no estimate with a positive |G|^2)."""
    phi = progress.gradient_noise_scale
    if progress.gradient_noise_samples < NOISE_MIN_SAMPLES or not (math.isfinite(phi) and phi > 0):
        return None
    return phi


def _at_declared_batch(
    model: ThroughputModel, world_size: int, batch: int, seconds: float, compute_s: float
) -> tuple[float, float]:
    """An iteration time (and the learners' compute seconds) measured at an adaptive batch
    ``batch`` as it would be at the model's (declared) batch: the compute the learners
    reported scales with the batch, the rest does not; without a report, the model's own
    ratio ``T(w, B0) / T(w, B)`` (``shoal.scheduler.adaptive_batch.iteration_time``)."""
    ratio = model.batch / batch
    if compute_s > 0 and math.isfinite(compute_s):
        compute_s = min(compute_s, seconds)
        return seconds - compute_s * (1 - ratio), compute_s * ratio
    curve = model.curve()
    factor = iteration_time(curve, world_size, model.batch) / iteration_time(
        curve, world_size, batch
    )
    return seconds * factor, compute_s


def describe(
    model: ThroughputModel, max_workers: int, *, attained: float = 0.0
) -> job_pb2.ThroughputModel:
    """``model`` as a ThroughputModel message: the curve, the pause, and points at the world
    sizes measured and at 1 .. max_workers predicted (at most ``MAX_POINTS`` in all)."""
    curve = model.curve()
    observed = model.observed()
    split = model.split()
    sizes = list(observed)
    for w in range(1, max(1, max_workers) + 1):
        if len(sizes) >= MAX_POINTS:
            break
        if w not in observed:
            sizes.append(w)
    out = job_pb2.ThroughputModel(
        overhead_seconds=curve.overhead,
        compute_seconds=curve.compute,
        sync_seconds=curve.sync,
        sync_per_worker_seconds=curve.sync_per_worker,
        rescale_pause_seconds=model.pause_s,
        rescale_pause_measured=model.pause_measured,
        attained_device_seconds=attained,
    )
    for w in sorted(sizes):
        seen = observed.get(w)
        compute_s, sync_s = split.get(w, (0.0, 0.0))
        out.points.add(
            world_size=w,
            samples_per_second=curve.batch / seen if seen else curve.samples_per_second(w),
            speedup=curve.speedup(w),
            observed=seen is not None,
            compute_seconds=compute_s,
            sync_seconds=sync_s,
        )
    return out
