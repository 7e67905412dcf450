"""The job-scheduler's traces: one trace per job, a span per scheduling cycle, rescales.

**A job's trace.** SubmitJob's server span is the root: its W3C traceparent is stored in the job
record (``JobRecord.traceparent``, persisted, so a new leader continues the same trace), and
everything the scheduler later does for the job is parented to it (:func:`job_context`): each
worker run (``reconcile job``) and each ``rescale``. Through the gRPC interceptors and
TRACEPARENT the resource-manager's allocation calls, the host agent's StartLearner, the
learners (start-up, join, sampled iterations) and the parameter-sync shards' handling of their
calls join that trace.

**Scheduling cycles** (``scheduling cycle``) are traces of their own (a cycle looks at every
job); a worker run and a rescale link to the cycle that decided them.

**A rescale** is a change of one job's learners: its target number of workers changed, or the
cycle decided to start, retire or replace some of its learners. Its span (``rescale``, child of
the job's root) begins at the event that led to the decision and ends when the job has settled:
every learner that left has exited and its device is free, every learner that came has joined
and taken part in a committed iteration, and the job holds its target. Its children are the
phases, in this order when they happen (a shrink has the first four, a grow the first and the
last three, a move all):

=============== ==============================================================================
decision        the event that triggered the cycle (a submit, an exit, a host) -> the cycle's
                decision
drain           RetireLearners sent -> the leaving learners are no longer members (they
                finished their iteration and its sync; seen by polling the coordinator)
retire          -> the last leaving learner's process exited (the agent's exit time)
device free     -> the scheduler released the devices (the exit's report + ReleaseDevices)
start           AcquireDevices + StartLearner of the new learners (the agent's StartLearner and
                the learners' own spans are below it)
join            -> every new learner is a member of the job's generation
first step      -> an iteration with the new learners was committed
=============== ==============================================================================

drain, retire, join and first step are waits the scheduler observes: their ends are the times it
saw them, polling the coordinator every ``poll_s`` (100 ms) while a rescale waits on one. The
phase spans are emitted with those times when they end; the rescale span when it ends. A rescale
still open after ``timeout_s`` ends with an error; one cut short (the job ended, leadership was
lost) ends with ``shoal.rescale.outcome`` saying why.

Pure bookkeeping over an OpenTelemetry tracer: no gRPC, no I/O, an injected clock.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import context as otel_context, trace
from opentelemetry.trace import Link, Span, Status, StatusCode

from shoal.runtime.telemetry import context_from_traceparent
from shoal.scheduler.jobs import JobRecord, LearnerPhase, state_name

__all__ = [
    "PHASES",
    "Rescale",
    "RescaleTracker",
    "job_context",
]

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: The phases of a rescale, in the order they happen.
PHASES = ("decision", "drain", "retire", "device free", "start", "join", "first step")

_SETTLED = frozenset({LearnerPhase.RUNNING})
_NOTHING = contextlib.nullcontext()


def job_context(record: JobRecord) -> otel_context.Context:
    """The context of the job's trace (its submit); a new trace for a record without one."""
    return context_from_traceparent(record.traceparent)


def _guarded(method: F) -> F:
    """Tracing never breaks scheduling: a failure of the tracker is logged and swallowed."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception:
            log.exception("rescale tracing failed in %s", method.__name__)
            return None

    return wrapper  # type: ignore[return-value]


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


@dataclass
class _Leaving:
    """A learner that leaves the job in this rescale."""

    retire_sent: float | None = None  # RetireLearners sent (None: stopped or lost)
    drained: float | None = None
    exited: float | None = None
    released: float | None = None


@dataclass
class _Joining:
    """A learner that joins the job in this rescale."""

    started: float | None = None  # StartLearner returned
    joined: float | None = None
    joined_at: int = -1  # the job's completed iterations when it was first seen a member
    stepped: float | None = None


@dataclass
class Rescale:
    """One job's rescale in progress (see the module docstring)."""

    job_id: str
    from_workers: int
    to_workers: int
    opened_at: float
    span: Span
    causes: list[str] = field(default_factory=list)
    leaving: dict[str, _Leaving] = field(default_factory=dict)
    joining: dict[str, _Joining] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    drain: Span | None = None
    device_free: Span | None = None
    retire_emitted: bool = False
    join_emitted: bool = False
    step_emitted: bool = False
    last_end: float = 0.0

    @property
    def context(self) -> otel_context.Context:
        return trace.set_span_in_context(self.span)

    def awaits_coordinator(self) -> bool:
        """Whether a phase end is to be seen at the coordinator (drained, joined, stepped)."""
        if any(lv.retire_sent is not None and lv.drained is None for lv in self.leaving.values()):
            return True
        return any(jn.started is not None and jn.stepped is None for jn in self.joining.values())


class RescaleTracker:
    """The rescales in progress, one per job at most, and their spans.

    The reconcile loop calls :meth:`decided` from each cycle, wraps the calls of a phase in
    :meth:`phase`, reports exits (:meth:`exited`, :meth:`lost`) and the coordinator's
    membership (:meth:`observe`), and calls :meth:`check` to end settled rescales.
    """

    def __init__(
        self,
        tracer: trace.Tracer | None = None,
        *,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 600.0,
    ) -> None:
        self.tracer = tracer if tracer is not None else trace.get_tracer(__name__)
        self.clock = clock
        self.timeout_s = timeout_s
        self.open: dict[str, Rescale] = {}

    # -- decisions ------------------------------------------------------------------------------

    @_guarded
    def decided(
        self,
        changes: Iterable[tuple[JobRecord, int, int, bool]],
        *,
        causes: Sequence[str],
        decided_from: float,
        cycle: trace.SpanContext | None = None,
    ) -> None:
        """The cycle's decisions: (record, previous target, new target, learners to start,
        retire or replace) for each active job. A job whose target changed, or that has
        learners to start, retire or replace, gets a rescale. When one is open already, a new
        target in the same direction is one more decision in it, and a reversal (a grow
        becomes a shrink) ends it as superseded and opens another. Shrinking jobs come first,
        so a growing job's rescale links to the rescales that free its devices."""
        now = self.clock()
        chosen = [
            (record, before, target)
            for record, before, target, planned in changes
            if target != before or (planned and record.job_id not in self.open)
        ]
        chosen.sort(key=lambda c: c[2] >= c[0].workers())
        freeing: list[Link] = []
        for record, before, target in chosen:
            links = [Link(cycle)] if cycle is not None and cycle.is_valid else []
            growing = target > record.workers()
            if growing:
                links += freeing
            rescale = self.open.get(record.job_id)
            if rescale is not None and (
                _sign(rescale.to_workers - rescale.from_workers) * _sign(target - record.workers())
                < 0
            ):
                self._close(rescale, f"superseded (new target {target})")
                rescale = None
            if rescale is None:
                span = self.tracer.start_span(
                    "rescale",
                    context=job_context(record),
                    start_time=_ns(decided_from),
                    links=links,
                    attributes={
                        "shoal.job_id": record.job_id,
                        "shoal.rescale.from_workers": record.workers(),
                        "shoal.rescale.to_workers": target,
                    },
                )
                rescale = Rescale(record.job_id, record.workers(), target, decided_from, span)
                self.open[record.job_id] = rescale
            rescale.to_workers = target
            rescale.causes.extend(c for c in causes if c not in rescale.causes)
            self._emit(
                rescale,
                "decision",
                decided_from,
                now,
                {
                    "shoal.rescale.causes": list(causes),
                    "shoal.target_workers": target,
                    "shoal.previous_target_workers": before,
                },
                links=links,
            )
            if not growing and rescale.span.get_span_context().is_valid:
                freeing.append(Link(rescale.span.get_span_context()))

    # -- phases ---------------------------------------------------------------------------------

    def phase(
        self, job_id: str, name: str, learner_ids: Sequence[str]
    ) -> contextlib.AbstractContextManager[Any]:
        """Run the calls of phase ``name`` ("drain", "device free" or "start") for
        ``learner_ids`` inside its span; nothing when the job has no rescale in progress.
        What the block raises goes through (recorded on the span); the tracker's own failures
        never do."""
        if name not in ("drain", "device free", "start"):
            raise ValueError(f"phase ({name!r}) must be drain, device free or start")
        try:
            rescale = self.open.get(job_id)
            if rescale is None or not learner_ids:
                return _NOTHING
            if name == "drain":
                span, done = self._begin_drain(rescale, learner_ids), None
            elif name == "device free":
                ids = [lid for lid in learner_ids if lid in rescale.leaving]
                if not ids:
                    return _NOTHING
                span, done = self._begin_device_free(rescale, ids), self._end_device_free
            else:
                span, done = self._begin_start(rescale, learner_ids), self._end_start
        except Exception:
            log.exception("rescale tracing of job %s failed (%s)", job_id, name)
            return _NOTHING
        return self._scope(span, rescale, learner_ids, done)

    @contextlib.contextmanager
    def _scope(
        self,
        span: Span,
        rescale: Rescale,
        learner_ids: Sequence[str],
        done: Callable[[Span, Rescale, Sequence[str]], None] | None,
    ) -> Iterator[None]:
        try:
            with trace.use_span(span, end_on_exit=False):
                yield
        finally:
            if done is not None:
                try:
                    done(span, rescale, learner_ids)
                except Exception:
                    log.exception("rescale tracing of job %s failed", rescale.job_id)

    def _begin_drain(self, rescale: Rescale, learner_ids: Sequence[str]) -> Span:
        now = self.clock()
        for lid in learner_ids:
            leaving = rescale.leaving.setdefault(lid, _Leaving())
            if leaving.retire_sent is None:
                leaving.retire_sent = now
        if rescale.drain is None:
            rescale.drain = self.tracer.start_span(
                "drain",
                context=rescale.context,
                start_time=_ns(now),
                attributes={"shoal.job_id": rescale.job_id},
            )
            rescale.retire_emitted = False
        rescale.drain.set_attribute("shoal.learner_ids", sorted(rescale.leaving))
        return rescale.drain  # it ends when the coordinator no longer lists them

    def _begin_device_free(self, rescale: Rescale, learner_ids: Sequence[str]) -> Span:
        now = self.clock()
        if rescale.device_free is None:
            # From the exit the scheduler is now told about: the report's way is part of it.
            leaving = [rescale.leaving[lid] for lid in learner_ids]
            begin = min(max(lv.exited or now, lv.drained or 0.0) for lv in leaving)
            rescale.device_free = self.tracer.start_span(
                "device free",
                context=rescale.context,
                start_time=_ns(min(begin, now)),
                attributes={"shoal.job_id": rescale.job_id},
            )
        return rescale.device_free

    def _end_device_free(self, span: Span, rescale: Rescale, learner_ids: Sequence[str]) -> None:
        end = self.clock()
        for lid in learner_ids:
            rescale.leaving[lid].released = end
        span.set_attribute(
            "shoal.learner_ids",
            sorted(lid for lid, lv in rescale.leaving.items() if lv.released is not None),
        )
        if rescale.device_free is span and all(
            lv.released is not None for lv in rescale.leaving.values()
        ):
            span.end(end_time=_ns(end))
            rescale.device_free = None
            rescale.last_end = max(rescale.last_end, end)

    def _begin_start(self, rescale: Rescale, learner_ids: Sequence[str]) -> Span:
        for lid in learner_ids:
            rescale.joining.setdefault(lid, _Joining())
        rescale.join_emitted = rescale.step_emitted = False
        return self.tracer.start_span(
            "start",
            context=rescale.context,
            start_time=_ns(self.clock()),
            attributes={"shoal.job_id": rescale.job_id, "shoal.learner_ids": list(learner_ids)},
        )

    def _end_start(self, span: Span, rescale: Rescale, learner_ids: Sequence[str]) -> None:
        end = self.clock()
        for lid in learner_ids:
            if lid in rescale.joining:
                rescale.joining[lid].started = end
        span.end(end_time=_ns(end))
        rescale.last_end = max(rescale.last_end, end)

    # -- observations ---------------------------------------------------------------------------

    @_guarded
    def exited(self, job_id: str, learner_id: str, end_time: float | None) -> None:
        """The agent reported the learner's exit (``end_time``: when the process ended)."""
        rescale = self.open.get(job_id)
        if rescale is None:
            return
        now = self.clock()
        leaving = rescale.leaving.get(learner_id)
        if leaving is None:
            joining = rescale.joining.pop(learner_id, None)
            if joining is not None:
                rescale.failed.append(learner_id)  # a new learner died before its first step
                self._progress(rescale)
            return
        exited = min(end_time or now, now)
        if leaving.retire_sent is not None:
            exited = max(exited, leaving.retire_sent)
        leaving.exited = exited
        # An exit before the coordinator was seen to let it go ends its drain there, unless
        # that drain's span has ended already (at the later sighting): phases never overlap.
        if leaving.drained is None or (rescale.drain is not None and leaving.drained > exited):
            leaving.drained = exited
        self._progress(rescale)

    @_guarded
    def lost(self, job_id: str, learner_id: str) -> None:
        """The learner is gone without an exit (its host was lost): it leaves at once."""
        rescale = self.open.get(job_id)
        if rescale is None:
            return
        if rescale.joining.pop(learner_id, None) is not None:
            rescale.failed.append(learner_id)
        now = self.clock()
        leaving = rescale.leaving.setdefault(learner_id, _Leaving())
        leaving.drained = leaving.drained or now
        leaving.exited = leaving.exited or now
        self._progress(rescale)

    @_guarded
    def observe(self, record: JobRecord, members: Sequence[str], completed: int) -> None:
        """What the coordinator said: the members of the job's current generation and its
        completed iterations."""
        rescale = self.open.get(record.job_id)
        if rescale is None:
            return
        now = self.clock()
        current = set(members)
        for lid, leaving in rescale.leaving.items():
            if leaving.retire_sent is not None and leaving.drained is None and lid not in current:
                leaving.drained = now
        for lid, joining in rescale.joining.items():
            if joining.started is None:
                continue
            if joining.joined is None and lid in current:
                joining.joined, joining.joined_at = now, completed
            elif joining.joined is not None and joining.stepped is None:
                if completed > joining.joined_at:
                    joining.stepped = now
        self._progress(rescale)
        self.check(record)

    def awaiting(self) -> list[str]:
        """Jobs whose rescale waits for something only the coordinator can tell."""
        return [job_id for job_id, r in self.open.items() if r.awaits_coordinator()]

    # -- phase ends -----------------------------------------------------------------------------

    def _progress(self, rescale: Rescale) -> None:
        """Emit the wait phases that have ended."""
        draining = {lid: lv for lid, lv in rescale.leaving.items() if lv.retire_sent is not None}
        if rescale.drain is not None and all(lv.drained is not None for lv in draining.values()):
            drained = max(lv.drained or 0.0 for lv in draining.values())
            rescale.drain.end(end_time=_ns(drained))
            rescale.drain = None
            rescale.last_end = max(rescale.last_end, drained)
        if (
            draining
            and rescale.drain is None
            and not rescale.retire_emitted
            and all(lv.exited is not None for lv in draining.values())
        ):
            drained = max(lv.drained or 0.0 for lv in draining.values())
            exited = max(lv.exited or 0.0 for lv in draining.values())
            self._emit(rescale, "retire", drained, max(exited, drained), {})
            rescale.retire_emitted = True
        joining = rescale.joining
        if not joining or any(jn.started is None for jn in joining.values()):
            return
        started = max(jn.started or 0.0 for jn in joining.values())
        if not rescale.join_emitted and all(jn.joined is not None for jn in joining.values()):
            joined = max(jn.joined or 0.0 for jn in joining.values())
            self._emit(rescale, "join", started, max(joined, started), {})
            rescale.join_emitted = True
        if (
            rescale.join_emitted
            and not rescale.step_emitted
            and all(jn.stepped is not None for jn in joining.values())
        ):
            joined = max(jn.joined or 0.0 for jn in joining.values())
            stepped = max(jn.stepped or 0.0 for jn in joining.values())
            self._emit(rescale, "first step", joined, max(stepped, joined), {})
            rescale.step_emitted = True

    def _emit(
        self,
        rescale: Rescale,
        name: str,
        start: float,
        end: float,
        attributes: dict[str, Any],
        *,
        links: Sequence[Link] = (),
    ) -> None:
        ids = {
            "retire": [lid for lid, lv in rescale.leaving.items() if lv.retire_sent is not None],
            "join": list(rescale.joining),
            "first step": list(rescale.joining),
        }.get(name)
        if ids is not None:
            attributes = {**attributes, "shoal.learner_ids": sorted(ids)}
        self.tracer.start_span(
            name,
            context=rescale.context,
            start_time=_ns(start),
            links=links,
            attributes={"shoal.job_id": rescale.job_id, **attributes},
        ).end(end_time=_ns(end))
        rescale.last_end = max(rescale.last_end, end)

    # -- completion -----------------------------------------------------------------------------

    @_guarded
    def check(self, record: JobRecord) -> None:
        """End the job's rescale if it has settled (or the job is no longer active, or the
        rescale timed out)."""
        rescale = self.open.get(record.job_id)
        if rescale is None:
            return
        now = self.clock()
        if not record.active:
            self._close(rescale, f"job {state_name(record.state)}")
            return
        if now - rescale.opened_at > self.timeout_s:
            self._close(rescale, f"not settled after {self.timeout_s:g} s", error=True)
            return
        for lid in [lid for lid in rescale.joining if lid not in record.learners]:
            if rescale.joining[lid].stepped is None:
                del rescale.joining[lid]
                rescale.failed.append(lid)
        self._progress(rescale)
        leaving_done = all(lv.released is not None for lv in rescale.leaving.values())
        joining_done = all(jn.stepped is not None for jn in rescale.joining.values())
        settled = all(lr.phase in _SETTLED for lr in record.learners.values()) and (
            record.workers() == record.job.target_workers
        )
        if leaving_done and joining_done and settled and rescale.drain is None:
            self._close(rescale, "completed", end=max(rescale.last_end, rescale.opened_at))

    @_guarded
    def check_all(self, records: dict[str, JobRecord]) -> None:
        """:meth:`check` every open rescale; a job that is gone ends its rescale."""
        for job_id in list(self.open):
            record = records.get(job_id)
            if record is None:
                self._close(self.open[job_id], "job forgotten")
            else:
                self.check(record)

    @_guarded
    def close_all(self, outcome: str) -> None:
        """End every open rescale (leadership ended)."""
        for rescale in list(self.open.values()):
            self._close(rescale, outcome)

    def _close(
        self, rescale: Rescale, outcome: str, *, end: float | None = None, error: bool = False
    ) -> None:
        self.open.pop(rescale.job_id, None)
        now = self.clock()
        for span in (rescale.drain, rescale.device_free):
            if span is not None:
                span.set_attribute("shoal.incomplete", True)
                span.end(end_time=_ns(now))
        rescale.drain = rescale.device_free = None
        span = rescale.span
        span.set_attributes(
            {
                "shoal.rescale.to_workers": rescale.to_workers,
                "shoal.rescale.outcome": outcome,
                "shoal.rescale.causes": rescale.causes,
                "shoal.rescale.leaving": sorted(rescale.leaving),
                "shoal.rescale.joining": sorted(rescale.joining),
            }
        )
        if rescale.failed:
            span.set_attribute("shoal.rescale.failed_learners", rescale.failed)
        if error:
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end(end_time=_ns(now if end is None else end))
