"""The learner's spans (shoal.learner.tracing): what is traced, which iterations are sampled,
that the sync of a sampled iteration carries its trace context to the backend, and that
nothing happens without an OTLP endpoint. In-memory exporter, standalone training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch import nn
from torch.utils.data import TensorDataset

from shoal.learner import (
    Assignment,
    ElasticTrainer,
    LearnerEnv,
    LocalBackend,
    env,
    tracing,
    trainer as trainer_module,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def make_tracing(exporter: InMemorySpanExporter, every: int) -> tracing.LearnerTracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    parent = tracing._PROPAGATOR.extract({"traceparent": TRACEPARENT})
    return tracing.LearnerTracing(
        provider.get_tracer("test"),
        parent=parent,
        every=every,
        attributes={"shoal.learner_id": "job-1-l1"},
    )


class ScriptedBackend:
    """Answers the boundaries it was given (then DONE)."""

    def __init__(self, assignments: list[Assignment]) -> None:
        self.assignments = list(assignments)

    def next_assignment(self) -> Assignment | None:
        return self.assignments.pop(0) if self.assignments else None


def run(step: int, world: int = 2) -> Assignment:
    return Assignment(1, 0, step, step, 0, world, step * 10, step * 10 + 10)


def names(spans: list[ReadableSpan]) -> list[str]:
    return [s.name for s in spans]


def test_the_first_iteration_and_every_nth_global_one_are_traced_with_their_boundary(
    exporter: InMemorySpanExporter,
) -> None:
    t = make_tracing(exporter, every=4)
    backend = ScriptedBackend([run(k) for k in range(5, 13)] + [Assignment.retirement(1, 13)])
    t.begin_join()
    seen = []
    while (a := t.next_assignment(backend)) is not None and not a.retire:  # type: ignore[arg-type]
        with t.phase("sync"):
            seen.append(bool(tracing.trace_metadata()))
        t.end_iteration()
    spans = exporter.get_finished_spans()
    iterations = [s for s in spans if s.name == "iteration"]
    assert [s.attributes["shoal.iteration.step"] for s in iterations] == [5, 8, 12]
    assert seen == [True, False, False, True, False, False, False, True]
    assert [s.attributes["shoal.iteration.first"] for s in iterations] == [True, False, False]
    start_up, join = spans[0], spans[1]
    assert names([start_up, join]) == ["learner start-up", "learner join"]
    assert join.end_time == iterations[0].start_time, "the first iteration begins at admission"
    for span in spans:
        assert f"{span.context.trace_id:032x}" == TRACEPARENT.split("-")[1]
    by_parent: dict[int, list[str]] = {}
    for span in spans:
        if span.parent is not None:
            by_parent.setdefault(span.parent.span_id, []).append(span.name)
    assert by_parent[iterations[0].context.span_id] == ["sync"]
    assert sorted(by_parent[iterations[1].context.span_id]) == ["boundary", "sync"]
    assert names(spans)[-1] == "learner retire"


def test_disabled_tracing_only_passes_the_calls_through(exporter: InMemorySpanExporter) -> None:
    t = tracing.LearnerTracing(None)
    assert not t.enabled
    backend = ScriptedBackend([run(0)])
    t.begin_join()
    assert t.next_assignment(backend) == run(0)  # type: ignore[arg-type]
    with t.phase("sync"):
        assert tracing.trace_metadata() == ()
    t.end_iteration()
    t.close()
    assert tracing.LearnerTracing.from_env(LearnerEnv()).enabled is False


def test_trainer_traces_start_up_join_and_sampled_iterations_with_compute_and_sync(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = make_tracing(exporter, every=3)
    monkeypatch.setattr(trainer_module.LearnerTracing, "from_env", lambda _env: made)
    carried: list[tuple[int, bool]] = []

    class Backend(LocalBackend):
        def sync(self, assignment: Assignment, contribution: Any, *, lr: float | None = None):
            carried.append((assignment.step, bool(tracing.trace_metadata())))
            return super().sync(assignment, contribution, lr=lr)

    torch.manual_seed(0)
    x = torch.randn(70, 4)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    result = ElasticTrainer(
        nn.Linear(4, 2),
        lambda: (data, None),
        nn.CrossEntropyLoss(),
        ("SGD", {"lr": 0.1}),
        backend=Backend(),
        device="cpu",
        env=LearnerEnv(),
    ).train(epochs=1, batch_size=10)
    assert result.completed and len(result.history) == 7
    spans = exporter.get_finished_spans()
    iterations = [s for s in spans if s.name == "iteration"]
    assert [s.attributes["shoal.iteration.step"] for s in iterations] == [0, 3, 6]
    assert carried == [(k, k % 3 == 0) for k in range(7)]
    for it in iterations:
        children = sorted(
            s.name for s in spans if s.parent and s.parent.span_id == it.context.span_id
        )
        # The first comes right after the join (its boundary is the admission, in the join).
        first = it is iterations[0]
        assert children == (["compute", "sync"] if first else ["boundary", "compute", "sync"])
    assert names(spans)[:2] == ["learner start-up", "learner join"]
    assert names(spans)[-1] == "learner finish"


def test_a_failing_iteration_ends_its_span_marked_incomplete(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = make_tracing(exporter, every=100)
    monkeypatch.setattr(trainer_module.LearnerTracing, "from_env", lambda _env: made)

    class Broken(LocalBackend):
        def sync(self, assignment: Assignment, contribution: Any, *, lr: float | None = None):
            raise RuntimeError("shard gone")

    data = TensorDataset(torch.randn(20, 4), torch.zeros(20, dtype=torch.long))
    trainer = ElasticTrainer(
        nn.Linear(4, 2),
        lambda: (data, None),
        nn.CrossEntropyLoss(),
        "SGD",
        backend=Broken(),
        device="cpu",
        env=LearnerEnv(),
    )
    with pytest.raises(RuntimeError, match="shard gone"):
        trainer.train(epochs=1, batch_size=10)
    (iteration,) = [s for s in exporter.get_finished_spans() if s.name == "iteration"]
    assert iteration.attributes["shoal.incomplete"] is True
    (sync,) = [s for s in exporter.get_finished_spans() if s.name == "sync"]
    assert sync.parent is not None and sync.parent.span_id == iteration.context.span_id


def test_the_sampling_period_and_the_endpoint_come_from_the_environment() -> None:
    assert env.trace_every({}) == env.DEFAULT_TRACE_EVERY == 100
    assert env.trace_every({"SHOAL_TRACE_EVERY": "0"}) == 0
    with pytest.raises(ValueError, match=r"SHOAL_TRACE_EVERY \(-1\) must be >= 0"):
        env.trace_every({"SHOAL_TRACE_EVERY": "-1"})
    read = LearnerEnv.from_environ(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "SHOAL_TRACE_EVERY": "7"}
    )
    assert (read.otlp_endpoint, read.trace_every) == ("http://collector:4317", 7)


def test_the_start_up_span_begins_when_the_process_started() -> None:
    import time

    started = tracing._process_start_ns()
    assert started <= time.time_ns()
    assert time.time_ns() - started < 3600 * 10**9  # this test process is younger than that
