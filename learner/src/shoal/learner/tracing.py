"""OpenTelemetry traces of a learner process: start-up, join, sampled iterations.

Tracing is on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the host agent passes its own
environment on, so learners export wherever their agent does) and the OpenTelemetry SDK and OTLP
exporter are importable (``pip install 'shoal-learner[tracing]'``; a host that runs the shoal
services has them). The spans belong to service ``learner`` and continue the trace named by
``TRACEPARENT`` (the host agent's StartLearner, itself in the job's trace):

``learner start-up``
    from the process's start to the first call to the backend: interpreter, imports, model,
    datasets.
``learner join``
    from joining the job to the first assignment: the Join call (and the initial upload of the
    first learner), then the wait for the boundary that admits it.
``iteration`` (sampled)
    one iteration this learner ran: the learner's first, then every ``SHOAL_TRACE_EVERY``-th
    global iteration (default 100; 0: only the first), so that all learners trace the same
    ones. Children: ``boundary`` (the wait for the assignment), ``pull parameters`` (when told
    to), ``compute`` (forward and backward) and ``sync`` (the gradient exchange; with the
    ``grpc`` backend the shards' ``SyncStep`` spans are its children).
``learner retire`` / ``learner finish``
    the last boundary, which answered RETIRE or DONE.

Without an endpoint nothing is installed and :class:`LearnerTracing` is disabled: an iteration
costs a few function calls (about 1.5 us), no clock read and no span. Spans are sent every
500 ms and flushed at exit (for at most 3 s); a learner killed with SIGKILL, or with SIGTERM
while the script keeps Python's default handler, loses the spans it had not sent.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from typing import Any

from opentelemetry import context as otel_context, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shoal.learner.backend import Assignment, SyncBackend
from shoal.learner.env import DEFAULT_TRACE_EVERY, LearnerEnv

__all__ = [
    "DEFAULT_TRACE_EVERY",
    "SERVICE_NAME",
    "LearnerTracing",
    "trace_metadata",
]

log = logging.getLogger("shoal.learner.tracing")

#: ``service.name`` of the learners' spans.
SERVICE_NAME = "learner"
#: Longest wait for the last spans at exit.
FLUSH_TIMEOUT_MS = 3000

_PROPAGATOR = TraceContextTextMapPropagator()
_IMPORTED_NS = time.time_ns()
_installed: dict[str, Any] = {}
_active: dict[str, bool] = {}  # set once a LearnerTracing that traces exists in this process
_NOTHING = contextlib.nullcontext()


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current span (``traceparent``), or nothing when no span is
    recording in this thread (the common, unsampled case: one context lookup; none when the
    learner does not trace)."""
    if not _active or not trace.get_current_span().is_recording():
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return tuple(carrier.items())


def _install(env: LearnerEnv) -> bool:
    """Install a TracerProvider exporting to ``env.otlp_endpoint`` (once per process). Keeps
    one the script installed itself. False when the SDK is missing."""
    if _installed:
        return True
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        _installed["foreign"] = True  # the script configured OpenTelemetry itself
        return True
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK or OTLP exporter is "
            "not installed (pip install 'shoal-learner[tracing]'): no learner spans"
        )
        return False
    attributes = {"service.name": SERVICE_NAME}
    if env.learner_id:
        attributes["service.instance.id"] = env.learner_id
        attributes["shoal.learner_id"] = env.learner_id
    if env.job_id:
        attributes["shoal.job_id"] = env.job_id
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    insecure = os.environ.get("OTEL_EXPORTER_OTLP_INSECURE", "true").lower() == "true"
    processor = BatchSpanProcessor(
        OTLPSpanExporter(endpoint=env.otlp_endpoint, insecure=insecure),
        schedule_delay_millis=500,
    )
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    atexit.register(_flush_at_exit, provider)
    _installed["provider"] = provider
    return True


def _flush_at_exit(provider: Any) -> None:
    """Send the spans still queued, for at most FLUSH_TIMEOUT_MS (the exporter retries an
    unreachable collector for up to OTEL_EXPORTER_OTLP_TIMEOUT)."""
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(FLUSH_TIMEOUT_MS / 1000)


def _process_start_ns() -> int:
    """When this process started (Linux: /proc/self/stat against CLOCK_BOOTTIME, 10 ms
    resolution); elsewhere, when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - started_s
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_NS
    now = time.time_ns()
    if not 0 <= age_s < 86400:
        return _IMPORTED_NS
    return now - int(age_s * 1e9)


class LearnerTracing:
    """The spans of one ``ElasticTrainer.train`` (see the module docstring).

    ``LearnerTracing.from_env(env)`` is disabled (every method returns at once) without an
    endpoint. The trainer calls :meth:`begin_join`, then :meth:`next_assignment` in place of
    ``backend.next_assignment``, wraps the parts of an iteration in :meth:`phase`, ends it with
    :meth:`end_iteration` and calls :meth:`close` last.
    """

    def __init__(
        self,
        tracer: trace.Tracer | None,
        *,
        parent: otel_context.Context | None = None,
        every: int = DEFAULT_TRACE_EVERY,
        started_ns: int | None = None,
        attributes: dict[str, str] | None = None,
    ) -> None:
        self.tracer = tracer
        self.enabled = tracer is not None
        if self.enabled:
            _active["yes"] = True
        self.parent = parent if parent is not None else otel_context.Context()
        self.every = every
        self.started_ns = started_ns if started_ns is not None else time.time_ns()
        self.attributes = dict(attributes or {})
        self._join: trace.Span | None = None
        self._join_token: object | None = None
        self._iteration: trace.Span | None = None
        self._iterations = 0  # iterations this learner ran (the first is always traced)

    @classmethod
    def from_env(cls, env: LearnerEnv) -> LearnerTracing:
        if not env.otlp_endpoint or not _install(env):
            return cls(None)
        carrier = {"traceparent": env.traceparent} if env.traceparent else {}
        parent = _PROPAGATOR.extract(carrier, context=otel_context.Context())
        attributes = {k: v for k, v in (("shoal.job_id", env.job_id),) if v}
        if env.learner_id:
            attributes["shoal.learner_id"] = env.learner_id
        return cls(
            trace.get_tracer("shoal.learner"),
            parent=parent,
            every=env.trace_every,
            started_ns=_process_start_ns(),
            attributes=attributes,
        )

    # -- start-up and join ----------------------------------------------------------------------

    def begin_join(self) -> None:
        """The learner is ready to join: end ``learner start-up``, begin ``learner join`` (the
        current span until the first assignment, so the Join call carries it)."""
        if self.tracer is None:
            return
        now = time.time_ns()
        self.tracer.start_span(
            "learner start-up",
            context=self.parent,
            start_time=min(self.started_ns, now),
            attributes={**self.attributes, "process.pid": os.getpid()},
        ).end(end_time=now)
        self._join = self.tracer.start_span(
            "learner join", context=self.parent, start_time=now, attributes=self.attributes
        )
        self._join_token = otel_context.attach(trace.set_span_in_context(self._join))

    def _end_join(self, end_ns: int, assignment: Assignment | None = None) -> None:
        if self._join is None:
            return
        if self._join_token is not None:
            otel_context.detach(self._join_token)  # type: ignore[arg-type]
            self._join_token = None
        if assignment is not None:
            self._join.set_attributes(
                {
                    "shoal.generation": assignment.generation,
                    "shoal.iteration.step": assignment.step,
                    "shoal.rank": assignment.rank,
                    "shoal.world_size": assignment.world_size,
                }
            )
        self._join.end(end_time=end_ns)
        self._join = None

    # -- boundaries and iterations --------------------------------------------------------------

    def next_assignment(self, backend: SyncBackend) -> Assignment | None:
        """``backend.next_assignment()``, timed: ends the join at the first answer, records
        the last boundary (RETIRE or DONE), and begins the span of a sampled iteration."""
        if self.tracer is None:
            return backend.next_assignment()
        start = time.time_ns()
        a = backend.next_assignment()
        end = time.time_ns()
        first = self._join is not None
        self._end_join(end, a)
        if a is None or a.retire:
            name = "learner finish" if a is None else "learner retire"
            self.tracer.start_span(
                name, context=self.parent, start_time=start, attributes=self.attributes
            ).end(end_time=end)
            return a
        self._iterations += 1
        if self._iterations == 1 or (self.every > 0 and a.step % self.every == 0):
            attributes: dict[str, Any] = {
                **self.attributes,
                "shoal.iteration.step": a.step,
                "shoal.iteration.epoch": a.epoch,
                "shoal.iteration.index": a.iteration,
                "shoal.generation": a.generation,
                "shoal.rank": a.rank,
                "shoal.world_size": a.world_size,
                "shoal.iteration.first": self._iterations == 1,
            }
            self._iteration = self.tracer.start_span(
                "iteration",
                context=self.parent,
                start_time=end if first else start,
                attributes=attributes,
            )
            if not first:
                self.tracer.start_span(
                    "boundary",
                    context=trace.set_span_in_context(self._iteration),
                    start_time=start,
                ).end(end_time=end)
        return a

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A child span of the sampled iteration, current while the block runs (so a
        backend's calls carry it); nothing when the iteration is not sampled."""
        if self._iteration is None or self.tracer is None:
            return _NOTHING
        return self.tracer.start_as_current_span(
            name, context=trace.set_span_in_context(self._iteration)
        )

    def end_iteration(self, *, aborted: bool = False) -> None:
        """The iteration's sync is done (or it was aborted: it will be issued again)."""
        span, self._iteration = self._iteration, None
        if span is not None:
            if aborted:
                span.set_attribute("shoal.iteration.aborted", True)
            span.end()

    def close(self) -> None:
        """End whatever is still open (training raised or the process is exiting)."""
        if self.tracer is None:
            return
        now = time.time_ns()
        if self._iteration is not None:
            self._iteration.set_attribute("shoal.incomplete", True)
            self._iteration.end(end_time=now)
            self._iteration = None
        if self._join is not None:
            self._join.set_attribute("shoal.incomplete", True)
            self._end_join(now)
