"""A job's story in its trace, exported to a real OTLP receiver by every real process.

The test runs an OTLP/gRPC TraceService (the one Jaeger or any collector implements) and an
embedded local cluster (etcd, resource-manager, job-scheduler, one parameter-sync shard, one host
agent with two simulated GPUs, real PyTorch learner processes) exporting to it. Job 1 runs on two
learners; job 2 arrives and job 1 is rescaled to one (fairshare), job 2 runs on the freed device.

Asserted, from the spans received: job 1's trace (rooted at its SubmitJob) holds spans of the
job-scheduler, the resource-manager, the host agent's StartLearner, the parameter-sync shard and
the learners (start-up, join, iterations with a sync child whose SyncStep the shard traced);
job 1's shrink is a ``rescale`` span whose phases are decision, drain, retire, device free in
this order, and job 2's start one with decision, start, join, first step, linked to the shrink
that freed its device, with job 2's learner below its start phase; scheduling cycles are spans
of their own; and in every trace every parent is there (one root per trace).
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from shoal.client import Client
from shoal.cluster.local import ClusterSpec, LocalCluster
from shoal.scheduler.tracing import PHASES
from shoal.v1 import job_pb2
from tests.support import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAIN = """\
import signal, sys, time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from shoal.learner import ElasticTrainer

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped: exit cleanly, spans flushed
torch.set_num_threads(1)


def get_datasets():
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x.sum(1) > 0).long()), None


def paced_loss(output, target):
    time.sleep(0.05)  # a few iterations per second: the job outlives the test's steps
    return nn.functional.cross_entropy(output, target)


torch.manual_seed(0)
trainer = ElasticTrainer(nn.Linear(8, 2), get_datasets, paced_loss, ("SGD", {"lr": 0.1}))
trainer.train(epochs=1000, batch_size=32)
"""


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, object]
    links: tuple[str, ...]


def _value(v) -> object:  # an OTLP AnyValue
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for scope in rs.scope_spans:
                for s in scope.spans:
                    got.append(
                        Span(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=tuple(link.span_id.hex() for link in s.links),
                        )
                    )
        with self.lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> Traces:
        with self.lock:
            return Traces(list(self.spans))


@dataclass
class Traces:
    spans: list[Span]
    by_trace: dict[str, list[Span]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        by_trace: dict[str, list[Span]] = defaultdict(list)
        for s in self.spans:
            by_trace[s.trace_id].append(s)
        self.by_trace = dict(by_trace)

    def job_trace(self, job_id: str) -> list[Span]:
        """The trace whose root is the job's SubmitJob."""
        for s in self.spans:
            if s.name.endswith("/SubmitJob") and s.attributes.get("shoal.job_id") == job_id:
                return self.by_trace[s.trace_id]
        return []

    @staticmethod
    def children(trace: list[Span], parent: Span) -> list[Span]:
        return sorted(
            (s for s in trace if s.parent_id == parent.span_id),
            key=lambda s: (s.start, PHASES.index(s.name) if s.name in PHASES else 99),
        )

    @staticmethod
    def below(trace: list[Span], top: Span) -> set[str]:
        """The names of the spans under ``top``."""
        ids = {s.span_id: s for s in trace}
        out = set()
        for s in trace:
            span = s
            while span.parent_id in ids:
                span = ids[span.parent_id]
                if span.span_id == top.span_id:
                    out.add(s.name)
                    break
        return out

    def rescale(self, trace: list[Span], before: int, after: int) -> Span | None:
        return next(
            (
                s
                for s in trace
                if s.name == "rescale"
                and s.attributes.get("shoal.rescale.from_workers") == before
                and s.attributes.get("shoal.rescale.to_workers") == after
                and s.attributes.get("shoal.rescale.outcome") == "completed"
            ),
            None,
        )

    def phases(self, trace: list[Span], rescale: Span | None) -> list[str]:
        return [s.name for s in self.children(trace, rescale)] if rescale else []


@pytest.fixture
def receiver():
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield receiver
    server.stop(0)


def spec(artifact: str, name: str) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(
        name=name,
        entry_point="train.py",
        artifact_id=artifact,
        batch_size=32,
        epochs=1000,
        max_workers=2,
        sync_mode=job_pb2.SYNC_MODE_PARAMETER_SERVER,
    )


def test_a_jobs_trace_follows_it_through_every_service_and_its_rescale(receiver, tmp_path: Path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "train.py").write_text(TRAIN)
    cluster_spec = ClusterSpec(
        state_dir=tmp_path / "cluster",
        hosts=1,
        gpus_per_host=2,
        shards=1,
        replicas=1,
        heartbeat_interval_s=0.3,
        extra_env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "SHOAL_TRACE_EVERY": "10",
        },
    )
    with LocalCluster(cluster_spec) as cluster, Client(cluster.client_config()) as client:
        try:
            artifact = client.upload_directory(app)
            j1 = client.submit_job(spec(artifact, "first")).job_id

            def job(job_id: str, workers: int, iterations: int) -> bool:
                got = client.get_job(job_id)
                return (
                    got.state == job_pb2.JOB_STATE_RUNNING
                    and got.allocated_workers == workers
                    and got.progress.completed_iterations >= iterations
                )

            wait_until(lambda: job(j1, 2, 3), timeout=90, interval=0.2, what="job 1 on 2")
            wait_until(  # job 1's start is over: both learners took a step
                lambda: (t := receiver.snapshot()).rescale(t.job_trace(j1), 0, 2),
                timeout=30,
                interval=0.2,
                what="job 1's first rescale (0 -> 2)",
            )
            j2 = client.submit_job(spec(artifact, "second")).job_id
            wait_until(
                lambda: job(j1, 1, 0) and job(j2, 1, 2),
                timeout=90,
                interval=0.2,
                what="fairshare: job 1 on 1 learner, job 2 on the other",
            )

            def story_told() -> bool:
                t = receiver.snapshot()
                one, two = t.job_trace(j1), t.job_trace(j2)
                return bool(
                    t.rescale(one, 2, 1)
                    and t.rescale(two, 0, 1)
                    and any(s.name == "sync" for s in one)
                    and any(s.service == "learner" and s.name == "iteration" for s in two)
                )

            wait_until(story_told, timeout=30, interval=0.2, what="the rescale spans")
            client.cancel_job(j1)
            client.cancel_job(j2)
            for job_id in (j1, j2):
                wait_until(
                    lambda j=job_id: client.get_job(j).state == job_pb2.JOB_STATE_CANCELLED,
                    timeout=60,
                    interval=0.2,
                    what=f"{job_id} cancelled",
                )
        except BaseException:
            for log in sorted(cluster.logs.glob("*.log")):
                if not log.name.startswith("shoal-etcd"):
                    print(f"===== {log.name}\n{log.read_text(errors='replace')[-3000:]}")
            print("===== spans of the scheduler (not cycles)")
            for s in receiver.snapshot().spans:
                if s.service == "job-scheduler" and s.name != "scheduling cycle":
                    print(s.trace_id[:8], s.span_id, s.parent_id, s.name, s.attributes)
            raise
    # Every process has exited, so every span was sent (services and learners flush at exit).
    traces = receiver.snapshot()

    # -- job 1's trace: every service, the learners' start-up, join and sampled iterations --
    one = traces.job_trace(j1)
    services = {s.service for s in one}
    assert {"job-scheduler", "resource-manager", "host-agent", "learner"} <= services, services
    assert "parameter-sync-0" in services
    names = {(s.service, s.name) for s in one}
    for expected in [
        ("job-scheduler", "/shoal.v1.JobSchedulerService/SubmitJob"),
        ("job-scheduler", "reconcile job"),
        ("resource-manager", "/shoal.v1.ResourceManagerService/AcquireDevices"),
        ("resource-manager", "/shoal.v1.ResourceManagerService/ReleaseDevices"),
        ("host-agent", "/shoal.v1.HostAgentService/StartLearner"),
        ("learner", "learner start-up"),
        ("learner", "learner join"),
        ("learner", "iteration"),
        ("parameter-sync-0", "/shoal.v1.ParameterSyncService/Join"),
        ("parameter-sync-0", "/shoal.v1.ParameterSyncService/RetireLearners"),
    ]:
        assert expected in names, expected
    iterations = [s for s in one if s.service == "learner" and s.name == "iteration"]
    synced = [
        (it, sync)
        for it in iterations
        for sync in traces.children(one, it)
        if sync.name == "sync" and sync.service == "learner"
    ]
    assert synced, "an iteration span with its sync call"
    _, sync = synced[0]
    # (a learner's first sync with a shard on its host opens the shared-memory lane first;
    # the next Boundary goes beside the SyncStep: docs/data-plane.md, "The Boundary sent ahead")
    boundary = "/shoal.v1.ParameterSyncService/Boundary"
    calls = [c.name for c in traces.children(one, sync)]
    assert [c for c in calls if c != boundary][-1] == "/shoal.v1.ParameterSyncService/SyncStep"
    assert set(calls) <= {
        "/shoal.v1.ParameterSyncService/OpenSharedLane",
        "/shoal.v1.ParameterSyncService/SyncStep",
        boundary,
    }, calls
    assert any(boundary in [c.name for c in traces.children(one, s)] for _, s in synced), (
        "a Boundary sent ahead, inside its sync's span"
    )
    assert any(i.attributes["shoal.iteration.first"] for i in iterations)
    steps = {i.attributes["shoal.iteration.step"] for i in iterations}
    assert any(step % 10 == 0 and step > 0 for step in steps), steps  # SHOAL_TRACE_EVERY=10

    # -- the rescales --
    shrink = traces.rescale(one, 2, 1)
    assert shrink is not None
    assert traces.phases(one, shrink) == ["decision", "drain", "retire", "device free"]
    phases = traces.children(one, shrink)
    assert all(a.start <= b.start and a.end <= b.end for a, b in itertools.pairwise(phases))
    assert shrink.start == phases[0].start and shrink.end == phases[-1].end
    drain, freed = phases[1], phases[3]
    assert "/shoal.v1.ParameterSyncService/RetireLearners" in traces.below(one, drain)
    assert "/shoal.v1.ResourceManagerService/ReleaseDevices" in traces.below(one, freed)
    assert traces.phases(one, traces.rescale(one, 0, 2)) == [
        "decision",
        "start",
        "join",
        "first step",
    ]

    two = traces.job_trace(j2)
    grow = traces.rescale(two, 0, 1)
    assert traces.phases(two, grow) == ["decision", "start", "join", "first step"]
    assert grow is not None and shrink.span_id in grow.links, "linked to the shrink that freed it"
    start = traces.children(two, grow)[1]
    assert {
        "/shoal.v1.ResourceManagerService/AcquireDevices",
        "/shoal.v1.HostAgentService/StartLearner",
        "learner start-up",
        "learner join",
        "iteration",
    } <= traces.below(two, start)

    # -- scheduling cycles: traces of their own, linked from the work they dispatched --
    cycles = [s for s in traces.spans if s.name == "scheduling cycle"]
    assert cycles and all(not c.parent_id and c.service == "job-scheduler" for c in cycles)
    assert all("shoal.cycle.jobs" in c.attributes for c in cycles)
    assert any(c.attributes["shoal.cycle.workers_dispatched"] >= 1 for c in cycles)
    cycle_ids = {c.span_id for c in cycles}
    workers = [s for s in one if s.name == "reconcile job"]
    assert workers and all(set(w.links) <= cycle_ids and w.links for w in workers)

    # -- consistency: one root per trace, every parent present --
    for trace_id, spans in traces.by_trace.items():
        ids = {s.span_id for s in spans}
        roots = [s for s in spans if not s.parent_id]
        dangling = [(s.service, s.name) for s in spans if s.parent_id and s.parent_id not in ids]
        assert not dangling, (trace_id, dangling)
        assert len(roots) == 1, (trace_id, [(s.service, s.name) for s in roots])
