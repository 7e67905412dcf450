"""The telemetry helpers of shoal.runtime: which root spans are sampled, and the traceparent a
job record keeps."""

from __future__ import annotations

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
