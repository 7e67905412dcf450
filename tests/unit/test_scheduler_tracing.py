"""The scheduler's rescale traces (shoal.scheduler.tracing) and the telemetry helpers they stand
on, without a network: an in-memory exporter, a fake clock, job records as the reconcile loop
leaves them."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from shoal.runtime import telemetry
from shoal.scheduler.jobs import JobRecord, LearnerPhase, LearnerRecord, new_job_record
from shoal.scheduler.tracing import PHASES, RescaleTracker, job_context
from shoal.v1 import job_pb2

SUBMIT_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tracker(exporter: InMemorySpanExporter, clock: Clock) -> RescaleTracker:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RescaleTracker(provider.get_tracer("test"), clock=clock, timeout_s=600)


def record(job_id: str, learners: dict[str, LearnerPhase], target: int) -> JobRecord:
    spec = job_pb2.JobSpec(name=job_id, max_workers=8)
    r = new_job_record(spec, job_id=job_id, owner="alice", submit_seq=1, request_id="", now=0)
    r.transition(job_pb2.JOB_STATE_RUNNING, "running", 1)
    r.traceparent = SUBMIT_TRACEPARENT
    r.job.target_workers = target
    for lid, phase in learners.items():
        r.learners[lid] = LearnerRecord(lid, "h1", f"gpu{len(r.learners)}", phase=phase)
    return r


def by_name(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def phases_of(exporter: InMemorySpanExporter, rescale: ReadableSpan) -> list[ReadableSpan]:
    rid = rescale.context.span_id
    children = [s for s in exporter.get_finished_spans() if s.parent and s.parent.span_id == rid]
    return sorted(children, key=lambda s: (s.start_time, PHASES.index(s.name)))


def test_a_shrink_is_one_span_in_the_jobs_trace_with_decision_drain_retire_and_device_free(
    tracker: RescaleTracker, exporter: InMemorySpanExporter, clock: Clock
) -> None:
    job = record("job-1", {"l1": LearnerPhase.RUNNING, "l2": LearnerPhase.RUNNING}, target=1)
    triggered = clock.now
    clock.tick(0.01)
    tracker.decided([(job, 2, 1, True)], causes=["job job-2 submitted"], decided_from=triggered)
    clock.tick(0.01)
    with tracker.phase("job-1", "drain", ["l2"]):  # RetireLearners
        assert trace.get_current_span().name == "drain"  # type: ignore[attr-defined]
    assert tracker.awaiting() == ["job-1"]
    clock.tick(0.5)
    tracker.observe(job, ["l1", "l2"], 10)  # still finishing its iteration
    clock.tick(0.2)
    tracker.observe(job, ["l1"], 11)  # the boundary retired it
    assert tracker.awaiting() == []
    job.learners["l2"].set_phase(LearnerPhase.RETIRING, clock.now)
    exited = clock.tick(0.3)
    clock.tick(0.6)  # the exit's report reaches the scheduler
    tracker.exited("job-1", "l2", exited)
    with tracker.phase("job-1", "device free", ["l2"]):  # ReleaseDevices
        clock.tick(0.05)
    del job.learners["l2"]
    tracker.check(job)

    (rescale,) = by_name(exporter, "rescale")
    assert rescale.parent is not None
    assert f"{rescale.context.trace_id:032x}" == SUBMIT_TRACEPARENT.split("-")[1]
    assert rescale.attributes["shoal.rescale.from_workers"] == 2
    assert rescale.attributes["shoal.rescale.to_workers"] == 1
    assert rescale.attributes["shoal.rescale.outcome"] == "completed"
    children = phases_of(exporter, rescale)
    assert [s.name for s in children] == ["decision", "drain", "retire", "device free"]
    decision, drain, retire, free = children
    assert decision.start_time == rescale.start_time == int(triggered * 1e9)
    assert drain.end_time == retire.start_time == int(1000.72 * 1e9)
    assert retire.end_time == int(exited * 1e9) == free.start_time
    assert free.end_time == rescale.end_time
    assert drain.attributes["shoal.learner_ids"] == ("l2",)
    assert tracker.open == {}


def test_an_exit_seen_after_its_drain_ended_never_moves_the_retire_before_the_drain_end(
    tracker: RescaleTracker, exporter: InMemorySpanExporter, clock: Clock
) -> None:
    """The learner exited before the scheduler saw the coordinator let it go: the drain span
    ended at that sighting, so the retire that follows starts there (an empty retire), not at
    the earlier exit (the phases overlapped, an e2e trace check caught it in CI)."""
    job = record("job-1", {"l1": LearnerPhase.RUNNING, "l2": LearnerPhase.RUNNING}, target=1)
    tracker.decided([(job, 2, 1, True)], causes=["submit"], decided_from=clock.now)
    clock.tick(0.01)
    with tracker.phase("job-1", "drain", ["l2"]):
        pass
    exited = clock.tick(0.2)  # the process ends ...
    sighted = clock.tick(0.3)  # ... the coordinator's membership is seen without it ...
    tracker.observe(job, ["l1"], 11)
    clock.tick(0.4)  # ... and then the agent's exit report arrives
    tracker.exited("job-1", "l2", exited)
    with tracker.phase("job-1", "device free", ["l2"]):
        clock.tick(0.05)
    del job.learners["l2"]
    tracker.check(job)

    (rescale,) = by_name(exporter, "rescale")
    decision, drain, retire, free = phases_of(exporter, rescale)
    assert drain.end_time == retire.start_time == retire.end_time == int(sighted * 1e9)
    for a, b in [(decision, drain), (drain, retire), (retire, free)]:
        assert a.start_time <= b.start_time and a.end_time <= b.end_time, (a.name, b.name)


def test_a_grow_has_decision_start_join_and_first_step_and_links_the_shrink_that_freed_it(
    tracker: RescaleTracker, exporter: InMemorySpanExporter, clock: Clock
) -> None:
    donor = record("job-1", {"l1": LearnerPhase.RUNNING, "l2": LearnerPhase.RUNNING}, 1)
    grower = record("job-2", {}, target=1)
    tracker.decided(
        [(grower, 0, 1, False), (donor, 2, 1, True)], causes=["submit"], decided_from=clock.now
    )
    clock.tick(2)  # job 1's learner drains and exits meanwhile
    grower.learners["job-2-l1"] = LearnerRecord("job-2-l1", "h1", "gpu1")
    with tracker.phase("job-2", "start", ["job-2-l1"]):  # AcquireDevices, StartLearner
        clock.tick(0.1)
    grower.learners["job-2-l1"].set_phase(LearnerPhase.RUNNING, clock.now)
    assert "job-2" in tracker.awaiting()
    clock.tick(3)  # the learner process starts and joins
    tracker.observe(grower, [], 0)
    clock.tick(0.1)
    tracker.observe(grower, ["job-2-l1"], 0)
    clock.tick(0.4)
    tracker.observe(grower, ["job-2-l1"], 1)

    rescales = {s.attributes["shoal.job_id"]: s for s in by_name(exporter, "rescale")}
    assert set(rescales) == {"job-2"}, "job 1's shrink is still open"
    grow = rescales["job-2"]
    assert [s.name for s in phases_of(exporter, grow)] == [
        "decision",
        "start",
        "join",
        "first step",
    ]
    shrink = tracker.open["job-1"].span.get_span_context()
    assert [link.context.span_id for link in grow.links] == [shrink.span_id]
    _, start, join, first = phases_of(exporter, grow)
    assert join.start_time == start.end_time and first.start_time == join.end_time
    assert first.end_time == grow.end_time


def test_a_rescale_cut_short_ends_with_its_open_phases_and_says_why(
    tracker: RescaleTracker, exporter: InMemorySpanExporter, clock: Clock
) -> None:
    job = record("job-1", {"l1": LearnerPhase.RUNNING, "l2": LearnerPhase.RUNNING}, target=1)
    tracker.decided([(job, 2, 1, True)], causes=[], decided_from=clock.now)
    with tracker.phase("job-1", "drain", ["l2"]):
        pass
    job.transition(job_pb2.JOB_STATE_CANCELLING, "cancelled", clock.tick())
    tracker.check(job)
    (rescale,) = by_name(exporter, "rescale")
    assert rescale.attributes["shoal.rescale.outcome"] == "job CANCELLING"
    (drain,) = by_name(exporter, "drain")
    assert drain.attributes["shoal.incomplete"] is True
    assert tracker.open == {}


def test_a_rescale_that_never_settles_times_out_as_an_error(
    tracker: RescaleTracker, exporter: InMemorySpanExporter, clock: Clock
) -> None:
    job = record("job-1", {}, target=2)  # no device for it, ever
    tracker.decided([(job, 0, 2, False)], causes=[], decided_from=clock.now)
    tracker.check(job)
    assert by_name(exporter, "rescale") == []
    clock.tick(601)
    tracker.check(job)
    (rescale,) = by_name(exporter, "rescale")
    assert rescale.status.status_code is StatusCode.ERROR
    assert "not settled after 600 s" in (rescale.status.description or "")


def test_only_changes_open_rescales_and_a_new_target_is_a_new_decision_in_the_open_one(
    tracker: RescaleTracker, exporter: InMemorySpanExporter, clock: Clock
) -> None:
    job = record("job-1", {"l1": LearnerPhase.RUNNING}, target=1)
    tracker.decided([(job, 1, 1, False)], causes=[], decided_from=clock.now)
    assert tracker.open == {}
    job.job.target_workers = 2
    tracker.decided([(job, 1, 2, False)], causes=["host h2 up"], decided_from=clock.now)
    tracker.decided([(job, 2, 2, True)], causes=[], decided_from=clock.tick())  # same rescale
    job.job.target_workers = 3
    tracker.decided([(job, 2, 3, False)], causes=["host h3 up"], decided_from=clock.tick())
    assert [s.name for s in exporter.get_finished_spans()] == ["decision", "decision"]
    tracker.close_all("leadership ended")
    (rescale,) = by_name(exporter, "rescale")
    assert rescale.attributes["shoal.rescale.to_workers"] == 3
    assert rescale.attributes["shoal.rescale.causes"] == ("host h2 up", "host h3 up")
    assert rescale.attributes["shoal.rescale.outcome"] == "leadership ended"


def test_a_reversal_supersedes_the_open_rescale_and_opens_another(
    tracker: RescaleTracker, exporter: InMemorySpanExporter, clock: Clock
) -> None:
    job = record("job-1", {}, target=2)
    tracker.decided([(job, 0, 2, True)], causes=["submit"], decided_from=clock.now)
    with tracker.phase("job-1", "start", ["l1", "l2"]):
        job.learners["l1"] = LearnerRecord("l1", "h1", "gpu0", phase=LearnerPhase.RUNNING)
        job.learners["l2"] = LearnerRecord("l2", "h1", "gpu1", phase=LearnerPhase.RUNNING)
    tracker.observe(job, ["l1"], 0)  # l2 has not joined yet when job 2 arrives
    job.job.target_workers = 1
    tracker.decided([(job, 2, 1, True)], causes=["job 2"], decided_from=clock.tick())
    (first,) = by_name(exporter, "rescale")
    assert first.attributes["shoal.rescale.outcome"] == "superseded (new target 1)"
    assert [s.name for s in phases_of(exporter, first)] == ["decision", "start"]
    second = tracker.open["job-1"]
    assert (second.from_workers, second.to_workers) == (2, 1)


def test_a_new_learner_that_dies_before_its_first_step_is_reported_as_failed(
    tracker: RescaleTracker, exporter: InMemorySpanExporter, clock: Clock
) -> None:
    job = record("job-1", {}, target=1)
    tracker.decided([(job, 0, 1, True)], causes=[], decided_from=clock.now)
    with tracker.phase("job-1", "start", ["job-1-l1"]):
        pass
    tracker.exited("job-1", "job-1-l1", clock.tick())
    job.learners["job-1-l2"] = LearnerRecord("job-1-l2", "h1", "gpu0")
    with tracker.phase("job-1", "start", ["job-1-l2"]):
        pass
    job.learners["job-1-l2"].set_phase(LearnerPhase.RUNNING, clock.now)
    tracker.observe(job, ["job-1-l2"], 4)
    tracker.observe(job, ["job-1-l2"], 5)
    (rescale,) = by_name(exporter, "rescale")
    assert rescale.attributes["shoal.rescale.failed_learners"] == ("job-1-l1",)
    assert [s.name for s in phases_of(exporter, rescale)] == [
        "decision",
        "start",
        "start",
        "join",
        "first step",
    ]


def test_the_job_context_continues_the_submit_and_a_record_without_one_starts_a_trace() -> None:
    job = record("job-1", {}, 1)
    parent = trace.get_current_span(job_context(job)).get_span_context()
    assert f"{parent.trace_id:032x}" == SUBMIT_TRACEPARENT.split("-")[1]
    job.traceparent = ""
    assert not trace.get_current_span(job_context(job)).get_span_context().is_valid
    assert not trace.get_current_span(telemetry.context_from_traceparent("junk")).is_recording()


def test_the_scheduler_passes_its_iteration_sampling_on_to_the_learners() -> None:
    from shoal.runtime.errors import InvalidField
    from shoal.scheduler.main import build_parser, config_from_args
    from shoal.scheduler.reconcile import learner_env

    args = ["--insecure-no-auth", "--resource-managers", "a:1", "--sync-shards", "b:2"]
    assert config_from_args(build_parser({}).parse_args(args)).trace_every is None
    ns = build_parser({"SHOAL_TRACE_EVERY": "7"}).parse_args(args)
    assert config_from_args(ns).trace_every == 7
    ns = build_parser({}).parse_args([*args, "--trace-every", "-1"])
    with pytest.raises(InvalidField, match=r"trace_every \(-1\) must be in 0\.\."):
        config_from_args(ns)
    job = record("job-1", {}, 1)
    env = learner_env(job, "job-1-l1", shards=["s:1"], storage_uri="file:///s", token=None)
    assert "SHOAL_TRACE_EVERY" not in env
    env = learner_env(
        job, "job-1-l1", shards=["s:1"], storage_uri="file:///s", token=None, trace_every=7
    )
    assert env["SHOAL_TRACE_EVERY"] == "7"


def test_a_failing_tracer_never_breaks_the_work_it_traces(
    exporter: InMemorySpanExporter, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def start_span(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("exporter bug")

    tracker = RescaleTracker(Broken(), clock=clock)  # type: ignore[arg-type]
    job = record("job-1", {"l1": LearnerPhase.RUNNING}, target=2)
    tracker.decided([(job, 1, 2, True)], causes=[], decided_from=clock.now)  # logged only
    assert "rescale tracing failed in decided" in caplog.text
    ran = []
    with tracker.phase("job-1", "start", ["l2"]):
        ran.append(True)
    assert ran == [True]

    good = RescaleTracker(TracerProvider().get_tracer("t"), clock=clock)
    good.decided([(job, 1, 2, True)], causes=[], decided_from=clock.now)
    with pytest.raises(ValueError, match="the call failed"):
        with good.phase("job-1", "start", ["l2"]):
            raise ValueError("the call failed")  # what the block raises goes through


def test_the_scheduler_passes_the_collective_timeout_on_to_the_learners() -> None:
    from shoal.runtime.errors import InvalidField
    from shoal.scheduler.main import build_parser, config_from_args
    from shoal.scheduler.reconcile import learner_env

    args = ["--insecure-no-auth", "--resource-managers", "a:1", "--sync-shards", "b:2"]
    assert config_from_args(build_parser({}).parse_args(args)).collective_timeout_s is None
    ns = build_parser({"SHOAL_COLLECTIVE_TIMEOUT_S": "12.5"}).parse_args(args)
    assert config_from_args(ns).collective_timeout_s == 12.5
    ns = build_parser({}).parse_args([*args, "--collective-timeout", "0"])
    with pytest.raises(InvalidField, match=r"collective_timeout_s \(0\.0\) must be in 1\.\."):
        config_from_args(ns)
    job = record("job-1", {}, 1)
    env = learner_env(job, "job-1-l1", shards=["s:1"], storage_uri="file:///s", token=None)
    assert "SHOAL_COLLECTIVE_TIMEOUT_S" not in env
    env = learner_env(
        job, "job-1-l1", shards=["s:1"], storage_uri="file:///s", token=None,
        collective_timeout_s=12.5,
    )  # fmt: skip
    assert env["SHOAL_COLLECTIVE_TIMEOUT_S"] == "12.5"
