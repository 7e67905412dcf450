"""OpenTelemetry set-up shared by every shoal process.

Traces are exported by OTLP/gRPC when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the standard
variable; ``OTEL_EXPORTER_OTLP_INSECURE=true`` for a plaintext collector such as Jaeger
all-in-one); otherwise spans are still created (so trace ids appear in logs and propagate) but
not exported. Context crosses gRPC hops through the OpenTelemetry gRPC interceptors (W3C
``traceparent`` metadata) and into child processes through the ``TRACEPARENT`` environment
variable (:func:`inject_env`, :func:`extract_env`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

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

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = os.environ.get("OTEL_EXPORTER_OTLP_INSECURE", "true").lower() == "true"
        provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=endpoint, insecure=insecure),
                schedule_delay_millis=500,
            )
        )
    trace.set_tracer_provider(provider)
    _configured["provider"] = provider
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call at process exit)."""
    provider = _configured.pop("provider", None)
    if provider is not None:
        provider.shutdown()  # type: ignore[attr-defined]


def server_interceptors() -> list[object]:
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


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
