"""OpenTelemetry set-up shared by every shoal process.

Traces are exported by OTLP/gRPC when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the standard
variable; ``OTEL_EXPORTER_OTLP_INSECURE=true`` for a plaintext collector such as Jaeger
all-in-one); otherwise spans are still created (so trace ids appear in logs and propagate) but
not exported. Context crosses gRPC hops through the OpenTelemetry gRPC interceptors (W3C
``traceparent`` metadata) and into child processes through the ``TRACEPARENT`` environment
variable (:func:`inject_env`, :func:`extract_env`).

Calls that run every iteration or every poll (``Boundary``, ``SyncStep``, ``GetJobProgress``,
heartbeats, ...) are traced only inside a trace that is already sampled (a learner's sampled
iteration, a reconcile of a job): on their own they would start one trace each, many per
second, and bury the traces that tell a job's story (:data:`QUIET_METHODS`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
from grpc import aio
from opentelemetry import context as otel_context, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_configured: dict[str, object] = {}


def setup_tracing(service_name: str, *, endpoint: str | None = None) -> object | None:
    """Install a TracerProvider for this process (once). Returns it, or None if already set.

    ``endpoint`` overrides ``OTEL_EXPORTER_OTLP_ENDPOINT``.
    """
    if "provider" in _configured:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}), sampler=quiet_roots_sampler()
    )
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = os.environ.get("OTEL_EXPORTER_OTLP_INSECURE", "true").lower() == "true"
        processor = BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, insecure=insecure),
            schedule_delay_millis=_schedule_delay_ms(),
        )
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _configured["provider"] = provider
    return provider


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush and stop the exporter (call at process exit). Spans still queued are sent for at
    most ``timeout_s`` seconds, so an unreachable collector cannot hold the exit up long."""
    provider = _configured.pop("provider", None)
    if provider is not None:
        _bounded(provider.shutdown, timeout_s)  # type: ignore[attr-defined]


def _bounded(call: Callable[[], object], timeout_s: float) -> None:
    """Run ``call`` (an exporter's flush or shutdown, which retries an unreachable collector
    for up to OTEL_EXPORTER_OTLP_TIMEOUT) for at most ``timeout_s`` seconds."""
    worker = threading.Thread(target=call, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)


def _schedule_delay_ms() -> float:
    """How long finished spans wait before they are sent: ``OTEL_BSP_SCHEDULE_DELAY`` (ms),
    else 500 ms (the SDK's default of 5 s makes traces slow to appear)."""
    raw = os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "").strip()
    try:
        value = float(raw) if raw else 500.0
    except ValueError:
        value = 500.0
    return value if value > 0 else 500.0


def server_interceptors() -> list[object]:
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [_QuietCalls(aio_server_interceptor())]


class _QuietCalls(aio.ServerInterceptor):
    """The OpenTelemetry server interceptor (``inner``), except for a quiet call
    (:data:`QUIET_METHODS`) that comes without a ``traceparent`` to a process whose tracer
    provider :func:`setup_tracing` installed: the quiet-roots sampler always drops such a
    call's span (a root of a quiet method), so the call gets exactly that span, a
    non-recording one from the same tracer with a fresh trace id, current while its handler
    runs (calls it makes stay unsampled, its trace id is in its error logs), and none of the
    instrumentation's work for a span nobody records: its attributes, the metadata and peer
    parsed per call, its servicer-context proxy (~0.1 ms of Python per call, two calls per
    learner per iteration). Any other call, or any call in another set-up (a provider of the
    script's own, no provider), goes through ``inner`` as before."""

    def __init__(self, inner: aio.ServerInterceptor) -> None:
        self._inner = inner

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        name = handler_call_details.method
        tracer = _quiet_tracer()
        if (
            tracer is None
            or name.rpartition("/")[2] not in QUIET_METHODS
            or _has_traceparent(handler_call_details.invocation_metadata)
        ):
            return await self._inner.intercept_service(continuation, handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else _under_unsampled_span(handler, tracer, name)


def _quiet_tracer() -> Any:
    """The tracer of the provider :func:`setup_tracing` installed, while it is this process's
    provider (None otherwise)."""
    provider = _configured.get("provider")
    if provider is None or trace.get_tracer_provider() is not provider:
        return None
    tracer = _configured.get("tracer")
    if tracer is None:
        tracer = _configured["tracer"] = trace.get_tracer(__name__, tracer_provider=provider)  # type: ignore[arg-type]
    return tracer


def _has_traceparent(metadata: Any) -> bool:
    return any(key == "traceparent" for key, _ in metadata or ())


def _under_unsampled_span(handler: Any, tracer: Any, name: str) -> Any:
    """``handler`` with a root span of ``name`` (unsampled: see :class:`_QuietCalls`) current
    in its task while it runs, as the OpenTelemetry interceptor would start it."""

    def enter() -> tuple[Any, object]:
        span = tracer.start_span(name, context=otel_context.Context(), kind=trace.SpanKind.SERVER)
        return span, otel_context.attach(trace.set_span_in_context(span, otel_context.Context()))

    def leave(span: Any, token: object) -> None:
        otel_context.detach(token)  # type: ignore[arg-type]
        span.end()

    if handler.response_streaming:
        behavior = handler.unary_stream or handler.stream_stream

        async def streaming(request: Any, context: Any) -> Any:
            span, token = enter()
            try:
                async for item in behavior(request, context):
                    yield item
            finally:
                leave(span, token)

        factory = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_stream_rpc_method_handler
        )
        wrapped: Any = streaming
    else:
        behavior = handler.unary_unary or handler.stream_unary

        async def unary(request: Any, context: Any) -> Any:
            span, token = enter()
            try:
                return await behavior(request, context)
            finally:
                leave(span, token)

        factory = (
            grpc.unary_unary_rpc_method_handler
            if handler.unary_unary
            else grpc.stream_unary_rpc_method_handler
        )
        wrapped = unary
    return factory(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def client_interceptors() -> list[object]:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())


def inject_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Add TRACEPARENT (and TRACESTATE) of the current span to ``env`` for a child process."""
    env = {} if env is None else env
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    if "traceparent" in carrier:
        env["TRACEPARENT"] = carrier["traceparent"]
    if "tracestate" in carrier:
        env["TRACESTATE"] = carrier["tracestate"]
    return env


def extract_env(environ: Mapping[str, str] | None = None) -> otel_context.Context:
    """The trace context a parent process passed in TRACEPARENT (or an empty one)."""
    environ = os.environ if environ is None else environ
    carrier = {}
    if environ.get("TRACEPARENT"):
        carrier["traceparent"] = environ["TRACEPARENT"]
    if environ.get("TRACESTATE"):
        carrier["tracestate"] = environ["TRACESTATE"]
    return _PROPAGATOR.extract(carrier)


def attach_env_context(environ: Mapping[str, str] | None = None) -> object:
    """Make the TRACEPARENT context current for this process; returns the detach token."""
    return otel_context.attach(extract_env(environ))


def current_trace_id() -> str:
    span = trace.get_current_span().get_span_context()
    return f"{span.trace_id:032x}" if span.is_valid else ""


#: gRPC methods (the last part of the span name ``/package.Service/Method``) that start no
#: trace of their own: they run every iteration or every poll. Inside a sampled trace they are
#: traced like any other call.
QUIET_METHODS = frozenset(
    {
        "Boundary",
        "SyncStep",
        "PullParameters",
        "ShardReady",
        "ResolveIteration",
        "GetMembership",
        "GetJobProgress",
        "ListLearners",
        "Heartbeat",
        "Check",  # grpc.health.v1.Health
        "Watch",  # grpc.health.v1.Health
    }
)


def quiet_roots_sampler() -> Any:
    """ParentBased: a span follows its parent's decision; a root span is sampled unless it is
    a call of :data:`QUIET_METHODS`."""
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_OFF,
        ALWAYS_ON,
        ParentBased,
        Sampler,
        SamplingResult,
    )

    class _QuietRoots(Sampler):
        def should_sample(  # type: ignore[no-untyped-def]
            self,
            parent_context,
            trace_id,
            name,
            kind=None,
            attributes=None,
            links=None,
            trace_state=None,
        ) -> SamplingResult:
            quiet = name.startswith("/") and name.rpartition("/")[2] in QUIET_METHODS
            chosen = ALWAYS_OFF if quiet else ALWAYS_ON
            return chosen.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )

        def get_description(self) -> str:
            return "QuietRoots"

    return ParentBased(root=_QuietRoots())


def current_traceparent() -> str:
    """The W3C traceparent of the current span ("" when there is none), to store with work
    that continues later (a job's record keeps its submit's)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> otel_context.Context:
    """A context whose parent is the span ``traceparent`` names; an empty context (a new
    trace) for "" or a malformed value."""
    if not traceparent:
        return otel_context.Context()
    return _PROPAGATOR.extract({"traceparent": traceparent}, context=otel_context.Context())
