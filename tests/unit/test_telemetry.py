"""The telemetry helpers of shoal.runtime: which root spans are sampled, and the traceparent a
job record keeps."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc import aio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shoal.runtime import telemetry


def test_quiet_calls_start_no_trace_of_their_own_but_are_traced_inside_one() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=telemetry.quiet_roots_sampler())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("/shoal.v1.ParameterSyncService/GetJobProgress") as poll:
        assert not poll.is_recording()
        flags = int(telemetry.current_traceparent().rpartition("-")[2], 16)
        assert flags & 1 == 0, "propagated as not sampled"
    with tracer.start_as_current_span("/shoal.v1.JobSchedulerService/SubmitJob") as submit:
        assert submit.is_recording()
        traceparent = telemetry.current_traceparent()
        with tracer.start_as_current_span("/shoal.v1.ParameterSyncService/SyncStep") as step:
            assert step.is_recording()
    version, trace_id, span_id, flags = traceparent.split("-")
    assert (version, int(flags, 16) & 1) == ("00", 1)
    assert (trace_id, span_id) == (
        f"{submit.get_span_context().trace_id:032x}",
        f"{submit.get_span_context().span_id:016x}",
    )
    assert [s.name for s in exporter.get_finished_spans()] == [
        "/shoal.v1.ParameterSyncService/SyncStep",
        "/shoal.v1.JobSchedulerService/SubmitJob",
    ]
    assert telemetry.current_traceparent() == ""


def test_a_stored_traceparent_gives_back_the_context_and_junk_gives_a_new_trace() -> None:
    provider = TracerProvider()
    with provider.get_tracer("test").start_as_current_span("submit") as span:
        stored = telemetry.current_traceparent()
    parent = trace.get_current_span(telemetry.context_from_traceparent(stored))
    assert parent.get_span_context().span_id == span.get_span_context().span_id
    assert parent.get_span_context().is_remote
    for junk in ("", "junk", "00-zz-yy-01"):
        context = telemetry.context_from_traceparent(junk)
        assert not trace.get_current_span(context).get_span_context().is_valid


# -- the server interceptor: quiet calls outside a sampled trace skip the instrumentation --------

SAMPLED_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """A provider as setup_tracing installs it (the quiet-roots sampler), exporting to memory,
    made this process's provider for the test only."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=telemetry.quiet_roots_sampler())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    monkeypatch.setitem(telemetry._configured, "provider", provider)
    monkeypatch.delitem(telemetry._configured, "tracer", raising=False)
    return exporter


async def _serve(seen: list[dict]) -> tuple[aio.Server, aio.Channel]:
    tracer = trace.get_tracer("test")

    def look(context: Any) -> None:
        span = trace.get_current_span()
        with tracer.start_as_current_span("/shoal.v1.JobSchedulerService/SubmitJob") as child:
            seen.append(
                {
                    "valid": span.get_span_context().is_valid,
                    "recording": span.is_recording(),
                    "trace_id": telemetry.current_trace_id(),
                    "child_recording": child.is_recording(),
                    # the instrumentation wraps the servicer context in a proxy of its own
                    "instrumented": "OpenTelemetry" in type(context).__name__,
                }
            )

    async def unary(request: bytes, context: Any) -> bytes:
        look(context)
        return request

    async def streaming(requests: Any, context: Any) -> Any:
        async for request in requests:
            look(context)
            yield request

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(unary)
        for name in ("Boundary", "GetJob")  # quiet, not quiet
    }
    handlers["SyncStep"] = grpc.stream_stream_rpc_method_handler(streaming)
    server = aio.server(interceptors=telemetry.server_interceptors())  # type: ignore[arg-type]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, aio.insecure_channel(f"127.0.0.1:{port}")


async def test_a_quiet_call_outside_a_sampled_trace_gets_an_unsampled_span_and_no_record(
    installed: InMemorySpanExporter,
) -> None:
    seen: list[dict] = []
    server, channel = await _serve(seen)
    try:
        assert await channel.unary_unary("/t.T/Boundary")(b"x") == b"x"
        call = channel.stream_stream("/t.T/SyncStep")()
        await call.write(b"y")
        assert await call.read() == b"y"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    finally:
        await channel.close()
        await server.stop(None)
    # A valid, unsampled span is current in the handler (its trace id for the logs), and what
    # the handler starts under it is not sampled either; nothing is recorded.
    assert [s["valid"] and not s["recording"] and not s["child_recording"] for s in seen] == [
        True,
        True,
    ]
    assert not any(s["instrumented"] for s in seen)
    assert (
        all(len(s["trace_id"]) == 32 for s in seen) and seen[0]["trace_id"] != seen[1]["trace_id"]
    )
    assert installed.get_finished_spans() == ()


async def test_a_quiet_call_inside_a_sampled_trace_and_other_calls_are_instrumented(
    installed: InMemorySpanExporter,
) -> None:
    seen: list[dict] = []
    server, channel = await _serve(seen)
    try:
        await channel.unary_unary("/t.T/Boundary")(
            b"x", metadata=(("traceparent", SAMPLED_PARENT),)
        )
        await channel.unary_unary("/t.T/GetJob")(b"x")
    finally:
        await channel.close()
        await server.stop(None)
    assert [s["recording"] and s["child_recording"] and s["instrumented"] for s in seen] == [
        True,
        True,
    ]
    spans = {s.name: s for s in installed.get_finished_spans()}
    boundary = spans["/t.T/Boundary"]
    assert f"{boundary.context.trace_id:032x}" == SAMPLED_PARENT.split("-")[1]
    assert boundary.attributes["rpc.method"] == "Boundary"  # the instrumentation's span
    assert (
        spans["/t.T/GetJob"].parent is None
        and spans["/t.T/GetJob"].attributes["rpc.system"] == "grpc"
    )
