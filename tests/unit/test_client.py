"""The typed client and the CLI against in-process servers on the runtime: leader discovery,
retries, idempotent submit, uploads, one-line errors, JSON output."""

from __future__ import annotations

import asyncio
import hashlib
import json

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from typer.testing import CliRunner

from shoal.cli.main import app
from shoal.client import AsyncClient, Client, ClientConfig, ShoalClientError, pack_directory
from shoal.runtime.auth import USERS_AND_SERVICES, MethodRoles
from shoal.runtime.config import ServerConfig
from shoal.runtime.errors import InvalidField, JobNotFound, NotLeader
from shoal.runtime.server import ServiceBinding, create_server
from shoal.v1 import job_pb2, job_scheduler_service_pb2 as js, job_scheduler_service_pb2_grpc
from shoal.v1.resources_pb2 import LogLine

SERVICE = "shoal.v1.JobSchedulerService"


class FakeScheduler(job_scheduler_service_pb2_grpc.JobSchedulerServiceServicer):
    """Just enough of a scheduler to exercise the client; a standby points at the leader."""

    def __init__(self, leader_address: str | None = None) -> None:
        self.leader_address = leader_address
        self.jobs: dict[str, job_pb2.Job] = {}
        self.by_request: dict[str, str] = {}
        self.artifacts: dict[str, bytes] = {}

    def _lead(self) -> None:
        if self.leader_address is not None:
            raise NotLeader("job-scheduler", self.leader_address)

    async def SubmitJob(self, request, context):
        self._lead()
        if not request.spec.name:
            raise InvalidField("spec.name", request.spec.name, "must not be empty")
        if request.request_id in self.by_request:
            return js.SubmitJobResponse(job=self.jobs[self.by_request[request.request_id]])
        job = job_pb2.Job(
            job_id=f"job-{len(self.jobs) + 1}", spec=request.spec, state=job_pb2.JOB_STATE_QUEUED
        )
        self.jobs[job.job_id] = job
        self.by_request[request.request_id] = job.job_id
        return js.SubmitJobResponse(job=job)

    async def GetJob(self, request, context):
        self._lead()
        if request.job_id not in self.jobs:
            raise JobNotFound(request.job_id)
        return js.GetJobResponse(job=self.jobs[request.job_id])

    async def ListJobs(self, request, context):
        self._lead()
        ids = sorted(self.jobs)
        start = int(request.page_token or 0)
        page = ids[start : start + request.page_size]
        token = str(start + request.page_size) if start + request.page_size < len(ids) else ""
        return js.ListJobsResponse(jobs=[self.jobs[i] for i in page], next_page_token=token)

    async def UploadArtifact(self, request_iterator, context):
        self._lead()
        header, data = None, bytearray()
        async for message in request_iterator:
            if message.WhichOneof("content") == "header":
                header = message.header
            else:
                data.extend(message.chunk)
        digest = hashlib.sha256(data).hexdigest()
        if header is None or (header.sha256 and header.sha256 != digest):
            raise InvalidField("header.sha256", header.sha256 if header else None, "does not match")
        self.artifacts[digest] = bytes(data)
        return js.UploadArtifactResponse(artifact_id=digest, size_bytes=len(data))


@pytest.fixture
async def cluster():
    config = ServerConfig(service_name="fake", allow_no_auth=True)
    roles = MethodRoles(SERVICE, USERS_AND_SERVICES)
    add = job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server
    leader = FakeScheduler()
    lead = await create_server(config, [ServiceBinding(SERVICE, add, leader, roles)])
    standby = await create_server(
        config, [ServiceBinding(SERVICE, add, FakeScheduler(lead.address), roles)]
    )
    yield lead, standby, leader
    await standby.stop(0)
    await lead.stop(0)


async def test_any_endpoint_works_because_the_client_follows_the_leader_hint(cluster):
    _lead, standby, leader = cluster
    config = ClientConfig(scheduler=(standby.address,))
    async with AsyncClient(config) as client:
        job = await client.submit_job(job_pb2.JobSpec(name="a"), request_id="r1")
        again = await client.submit_job(job_pb2.JobSpec(name="a"), request_id="r1")
    assert job.job_id == again.job_id
    assert list(leader.jobs) == [job.job_id]


async def test_list_jobs_walks_every_page(cluster):
    lead, _, _leader = cluster
    async with AsyncClient(ClientConfig(scheduler=(lead.address,))) as client:
        for i in range(7):
            await client.submit_job(job_pb2.JobSpec(name=f"j{i}"))
        jobs = [j async for j in client.list_jobs(page_size=3)]
    assert len(jobs) == 7 == len({j.job_id for j in jobs})


async def test_errors_carry_code_reason_and_message(cluster):
    lead, _, _ = cluster
    async with AsyncClient(ClientConfig(scheduler=(lead.address,))) as client:
        with pytest.raises(ShoalClientError) as info:
            await client.submit_job(job_pb2.JobSpec(name=""))
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.reason == "ERROR_REASON_INVALID_FIELD"
    assert "spec.name ('')" in info.value.message


async def test_upload_directory_is_content_addressed_and_deterministic(cluster, tmp_path):
    lead, _, leader = cluster
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "train.py").write_text("print('hi')\n")
    (tmp_path / "m" / "sub").mkdir()
    (tmp_path / "m" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 9000)
    assert pack_directory(tmp_path / "m") == pack_directory(tmp_path / "m")
    # No clock in the archive: the gzip header's time (bytes 4-7) is zero, not the second it
    # was packed in (two packs a second apart were different artifacts).
    assert pack_directory(tmp_path / "m")[4:8] == b"\0\0\0\0"
    seen = []
    async with AsyncClient(ClientConfig(scheduler=(lead.address,))) as client:
        artifact = await client.upload_directory(
            tmp_path / "m", progress=lambda d, t: seen.append((d, t))
        )
    assert artifact == hashlib.sha256(pack_directory(tmp_path / "m")).hexdigest()
    assert artifact in leader.artifacts
    assert seen[-1][0] == seen[-1][1]


async def test_the_sync_client_wraps_the_async_one(cluster):
    _lead, standby, _ = cluster
    result: dict[str, object] = {}

    def work() -> None:  # a plain thread: no running event loop, as in a user's script
        with Client(ClientConfig(scheduler=(standby.address,))) as client:
            job = client.submit_job(job_pb2.JobSpec(name="sync"))
            result["got"] = client.get_job(job.job_id).spec.name
            result["listed"] = [j.job_id for j in client.list_jobs()]

    # The servers live on this test's event loop: run the blocking client beside it.
    await asyncio.wait_for(asyncio.to_thread(work), timeout=30)
    assert result["got"] == "sync"
    assert result["listed"]


def test_cli_errors_are_one_line_and_json_output_parses(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.delenv("SHOAL_ENDPOINTS", raising=False)
    runner = CliRunner()
    result = runner.invoke(app, ["jobs", "get", "x"])
    assert result.exit_code == 1
    assert "no scheduler endpoint" in result.output
    assert "Traceback" not in result.output
    result = runner.invoke(app, ["submit", str(tmp_path / "missing")])
    assert result.exit_code == 1
    assert "is not a directory" in result.output


async def test_cli_submit_and_list_as_json(cluster, tmp_path, monkeypatch):
    lead, _, _ = cluster
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "train.py").write_text("print('hi')\n")
    monkeypatch.setenv("SHOAL_ENDPOINTS", lead.address)
    runner = CliRunner()

    def invoke(args: list[str]):
        return runner.invoke(app, args)

    result = await asyncio.to_thread(
        invoke, ["-o", "json", "submit", str(tmp_path / "m"), "--max-workers", "4", "--epochs", "2"]
    )
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)
    assert job["spec"]["max_workers"] == 4
    result = await asyncio.to_thread(invoke, ["-o", "json", "jobs", "list"])
    assert [j["job_id"] for j in json.loads(result.stdout)] == [job["job_id"]]


class FailingOverScheduler(job_scheduler_service_pb2_grpc.JobSchedulerServiceServicer):
    """A leader whose streams break after two items (it lost its leadership): from then on it
    points at the new leader. The new leader replays from the start, as a fresh stream does."""

    def __init__(self, events: list[job_pb2.JobEvent], lines: list, break_after: int) -> None:
        self.events, self.lines, self.break_after = events, lines, break_after
        self.leader_address: str | None = None
        self.opened = 0

    async def WatchJob(self, request, context):
        self.opened += 1
        if self.leader_address is not None:
            raise NotLeader("job-scheduler", self.leader_address)
        for i, event in enumerate(self.events):
            if i == self.break_after:
                self.leader_address = self.successor
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed")
            yield js.WatchJobResponse(event=event)

    async def StreamJobLogs(self, request, context):
        if self.leader_address is not None:
            raise NotLeader("job-scheduler", self.leader_address)
        for i, line in enumerate(self.lines):
            if i == self.break_after:
                self.leader_address = self.successor
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed")
            yield js.StreamJobLogsResponse(lines=[line])


async def test_watch_and_logs_follow_a_scheduler_failover_without_losing_or_repeating(caplog):
    config = ServerConfig(service_name="fake", allow_no_auth=True)
    roles = MethodRoles(SERVICE, USERS_AND_SERVICES)
    add = job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server
    events = [
        job_pb2.JobEvent(kind=1, time=Timestamp(seconds=100 + i), job=job_pb2.Job(job_id="j"))
        for i in range(5)
    ]
    lines = [LogLine(learner_id="l1", text=f"line {i}", offset=10 * i) for i in range(5)]
    old = FailingOverScheduler(events, lines, break_after=2)
    new = FailingOverScheduler(events, lines, break_after=99)
    old_server = await create_server(config, [ServiceBinding(SERVICE, add, old, roles)])
    new_server = await create_server(config, [ServiceBinding(SERVICE, add, new, roles)])
    old.successor = new_server.address
    try:
        client_config = ClientConfig(scheduler=(old_server.address, new_server.address))
        async with AsyncClient(client_config, failover_s=10) as client:
            watched = [e async for e in client.watch_job("j")]
        old.leader_address = None  # the old replica leads again, and fails over again
        only_old = ClientConfig(scheduler=(old_server.address,))  # the hint finds the new one
        async with AsyncClient(only_old, failover_s=10) as client:
            followed = [ln async for ln in client.stream_logs("j", follow=True, tail_lines=3)]
    finally:
        await old_server.stop(0)
        await new_server.stop(0)
    assert [e.time.seconds for e in watched] == [100, 101, 102, 103, 104]
    # tail_lines applies to the first stream only (the fake ignores it: it sends everything)
    assert [ln.text for ln in followed] == [f"line {i}" for i in range(5)]
    resumes = [r for r in caplog.records if "resuming on the job-scheduler leader" in r.message]
    assert len(resumes) == 2  # one line per broken stream, nothing else


async def test_a_non_follow_stream_that_breaks_still_fails_loudly():
    config = ServerConfig(service_name="fake", allow_no_auth=True)
    roles = MethodRoles(SERVICE, USERS_AND_SERVICES)
    add = job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server
    lines = [LogLine(learner_id="l1", text=f"line {i}", offset=10 * i) for i in range(5)]
    old = FailingOverScheduler([], lines, break_after=2)
    server = await create_server(config, [ServiceBinding(SERVICE, add, old, roles)])
    old.successor = server.address
    try:
        async with AsyncClient(ClientConfig(scheduler=(server.address,)), failover_s=1) as client:
            with pytest.raises(ShoalClientError, match=r"UNAVAILABLE|Stream removed"):
                _ = [ln async for ln in client.stream_logs("j", follow=False)]
    finally:
        await server.stop(0)


async def test_cli_get_and_list_show_a_recovering_job_and_its_reason(cluster, monkeypatch):
    lead, _, leader = cluster
    reason = "coordinator shard 1 (127.0.0.1:7301) lost after iteration 286 (UNAVAILABLE)"
    leader.jobs["job-1"] = job_pb2.Job(
        job_id="job-1",
        spec=job_pb2.JobSpec(name="digits", max_workers=4, epochs=3),
        state=job_pb2.JOB_STATE_RECOVERING,
        state_reason=reason,
        allocated_workers=0,
    )
    monkeypatch.setenv("SHOAL_ENDPOINTS", lead.address)
    monkeypatch.setenv("COLUMNS", "300")
    runner = CliRunner()
    got = await asyncio.to_thread(runner.invoke, app, ["jobs", "get", "job-1"])
    assert got.exit_code == 0, got.output
    assert "recovering" in got.output and "0/4" in got.output
    assert f"reason: {reason}" in " ".join(got.output.split())
    listed = await asyncio.to_thread(runner.invoke, app, ["jobs", "list", "--state", "recovering"])
    assert listed.exit_code == 0, listed.output
    assert f"job-1 recovering: {reason}" in " ".join(listed.output.split())


async def test_a_stream_refused_before_its_first_item_is_retried_then_fails_with_the_error():
    config = ServerConfig(service_name="fake", allow_no_auth=True)
    roles = MethodRoles(SERVICE, USERS_AND_SERVICES)
    add = job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server
    standby = FailingOverScheduler([], [], break_after=99)
    server = await create_server(config, [ServiceBinding(SERVICE, add, standby, roles)])
    standby.leader_address = server.address  # a standby that names itself: never a leader
    try:
        client_config = ClientConfig(scheduler=(server.address,))
        async with AsyncClient(client_config, retries=2, failover_s=0) as client:
            with pytest.raises(ShoalClientError, match="UNAVAILABLE"):
                _ = [e async for e in client.watch_job("j")]
    finally:
        await server.stop(0)
    assert standby.opened == 3  # the first attempt and ``retries`` more, then the error
