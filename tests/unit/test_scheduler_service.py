"""JobSchedulerService in process (port 0, MemoryStore, real auth): validation, idempotent
submit, ownership, cancel / update, pagination, watch, artifacts, model, metrics, allocation
history, and a standby's answers. The reconcile loop is replaced by a recorder of triggers."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc import aio

from shoal.runtime.channels import connect
from shoal.runtime.config import ServerConfig
from shoal.runtime.errors import LEADER_METADATA_KEY, REASON_METADATA_KEY
from shoal.runtime.server import RunningServer, create_server
from shoal.runtime.store import MemoryStore
from shoal.scheduler.artifacts import ArtifactStore, Storage
from shoal.scheduler.service import ERRORS, ApiConfig, JobApi, binding
from shoal.scheduler.store import JobTable
from shoal.v1 import job_pb2, job_scheduler_service_pb2 as js, job_scheduler_service_pb2_grpc
from tests.support import async_wait_until, make_tokens

MAX_ARTIFACT = 64 * 1024
QUOTA = 3 * MAX_ARTIFACT


@dataclass
class Bed:
    server: RunningServer
    store: MemoryStore
    table: JobTable
    storage: Storage
    tokens: dict[str, str]
    triggers: list[str]
    channels: dict[str, aio.Channel]

    def stub(self, who: str = "user") -> job_scheduler_service_pb2_grpc.JobSchedulerServiceStub:
        if who not in self.channels:
            self.channels[who] = connect(self.server.address, token=self.tokens[who], trace=False)
        return job_scheduler_service_pb2_grpc.JobSchedulerServiceStub(self.channels[who])


@pytest.fixture
async def bed(tmp_path: Path) -> AsyncIterator[Bed]:
    tokens = make_tokens(tmp_path / "tokens")
    store = MemoryStore()
    table = JobTable(store, history_limit=3)
    await table.become_leader(None)
    storage = Storage((tmp_path / "storage").as_uri())
    triggers: list[str] = []
    api = JobApi(
        table,
        ArtifactStore(storage, max_bytes=MAX_ARTIFACT, quota_bytes=QUOTA),
        trigger=triggers.append,
        config=ApiConfig(user_priority_limit=50_000),
    )
    config = ServerConfig(service_name="job-scheduler", tokens_file=str(tmp_path / "tokens"))
    server = await create_server(config, [binding(api)], errors=ERRORS)
    b = Bed(server, store, table, storage, tokens, triggers, {})
    yield b
    for channel in b.channels.values():
        await channel.close()
    await server.stop(0)
    await store.close()


def upload_messages(data: bytes, **header: object) -> list[js.UploadArtifactRequest]:
    head = js.ArtifactHeader(name="model.tar.gz", size_bytes=len(data))
    for key, value in header.items():
        setattr(head, key, value)
    chunks = [data[i : i + 16 * 1024] for i in range(0, len(data), 16 * 1024)]
    return [
        js.UploadArtifactRequest(header=head),
        *(js.UploadArtifactRequest(chunk=c) for c in chunks),
    ]


async def upload(bed: Bed, data: bytes = b"model-bytes" * 100, who: str = "user") -> str:
    response = await bed.stub(who).UploadArtifact(iter(upload_messages(data)))
    return response.artifact_id


def spec(artifact_id: str, **overrides: object) -> job_pb2.JobSpec:
    s = job_pb2.JobSpec(
        name="mnist",
        entry_point="train.py",
        artifact_id=artifact_id,
        batch_size=64,
        epochs=1,
        max_workers=4,
    )
    for key, value in overrides.items():
        setattr(s, key, value)
    return s


async def submit(bed: Bed, artifact: str, who: str = "user", request_id: str = "", **kw: object):
    response = await bed.stub(who).SubmitJob(
        js.SubmitJobRequest(request_id=request_id, spec=spec(artifact, **kw))
    )
    return response.job


def reason(exc: grpc.aio.AioRpcError) -> str | None:
    return dict(exc.trailing_metadata() or ()).get(REASON_METADATA_KEY)


async def listed(bed: Bed, who: str = "admin") -> list[job_pb2.Job]:
    return list((await bed.stub(who).ListJobs(js.ListJobsRequest(page_size=1000))).jobs)


# -- artifacts -------------------------------------------------------------------------------


async def test_an_artifact_is_stored_under_its_sha256_and_downloads_back(bed: Bed) -> None:
    data = bytes(range(256)) * 200
    response = await bed.stub().UploadArtifact(
        iter(upload_messages(data, sha256=hashlib.sha256(data).hexdigest()))
    )
    assert response.artifact_id == hashlib.sha256(data).hexdigest()
    assert response.size_bytes == len(data)
    # The layout a host-agent's --artifact-dir reads: <dir>/<sha256>.tar.gz
    stored = Path(bed.storage.path("artifacts", f"{response.artifact_id}.tar.gz"))
    assert stored.read_bytes() == data
    messages = [
        m
        async for m in bed.stub().DownloadArtifact(
            js.DownloadArtifactRequest(artifact_id=response.artifact_id)
        )
    ]
    assert messages[0].header.size_bytes == len(data)
    assert messages[0].header.name == "model.tar.gz"
    assert b"".join(m.chunk for m in messages[1:]) == data


@pytest.mark.parametrize(
    ("messages", "code", "field_name"),
    [
        (
            upload_messages(b"x" * (MAX_ARTIFACT + 1)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "header.size_bytes",
        ),
        (
            upload_messages(b"x" * (MAX_ARTIFACT + 1), size_bytes=0),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "artifact",
        ),
        (
            upload_messages(b"abc", sha256="0" * 64),
            grpc.StatusCode.INVALID_ARGUMENT,
            "header.sha256",
        ),
        (
            upload_messages(b"abc", size_bytes=4),
            grpc.StatusCode.INVALID_ARGUMENT,
            "header.size_bytes",
        ),
        (upload_messages(b"abc")[1:], grpc.StatusCode.INVALID_ARGUMENT, "header"),
    ],
)
async def test_a_bad_upload_is_refused_and_stores_nothing(
    bed: Bed, messages: list[js.UploadArtifactRequest], code: grpc.StatusCode, field_name: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await bed.stub().UploadArtifact(iter(messages))
    assert caught.value.code() == code
    assert (caught.value.details() or "").startswith(field_name)
    stored = (
        bed.storage.fs.find(bed.storage.path("artifacts"))
        if bed.storage.fs.exists(bed.storage.path("artifacts"))
        else []
    )
    assert stored == []


async def test_downloading_an_unknown_artifact_is_not_found(bed: Bed) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in bed.stub().DownloadArtifact(
            js.DownloadArtifactRequest(artifact_id="0" * 64)
        ):
            pass
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert reason(caught.value) == "ERROR_REASON_ARTIFACT_NOT_FOUND"


# -- submit ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field_name"),
    [
        ({"min_workers": 5, "max_workers": 4}, "spec.max_workers"),
        ({"batch_size": -8}, "spec.batch_size"),
        ({"sync_mode": 9}, "spec.sync_mode"),
        ({"name": ""}, "spec.name"),
        ({"epochs": 0}, "spec.epochs"),
        ({"priority": 2_000_000}, "spec.priority"),
    ],
)
async def test_an_invalid_spec_is_refused_naming_the_field_and_nothing_is_stored(
    bed: Bed, overrides: dict[str, object], field_name: str
) -> None:
    artifact = await upload(bed)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, artifact, request_id="r1", **overrides)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith(field_name)
    assert reason(caught.value) == "ERROR_REASON_INVALID_FIELD"
    assert await listed(bed) == []
    assert (await bed.store.list("/shoal/v1/job-scheduler/"))[0] == []
    assert bed.triggers == []


async def test_a_spec_naming_a_missing_artifact_is_not_found(bed: Bed) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, "0" * 64)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert reason(caught.value) == "ERROR_REASON_ARTIFACT_NOT_FOUND"
    assert await listed(bed) == []


async def test_a_submit_is_queued_with_defaults_and_triggers_a_reconcile(bed: Bed) -> None:
    job = await submit(bed, await upload(bed), priority=0, min_workers=0)
    assert job.state == job_pb2.JOB_STATE_QUEUED
    assert job.owner == "alice"
    assert (job.spec.priority, job.spec.min_workers) == (5000, 1)
    assert job.spec.sync_mode == job_pb2.SYNC_MODE_AUTO
    assert job.create_time.seconds > 0
    assert bed.triggers == [f"job {job.job_id} submitted"]


async def test_a_retried_submit_with_the_same_request_id_returns_the_same_job(bed: Bed) -> None:
    artifact = await upload(bed)
    first = await submit(bed, artifact, request_id="req-1")
    again = await submit(bed, artifact, request_id="req-1")
    await upload(bed, who="other")  # the same bytes: bob owns them too
    other_user = await submit(bed, artifact, who="other", request_id="req-1")
    assert again.job_id == first.job_id
    assert other_user.job_id != first.job_id
    assert sorted(j.job_id for j in await listed(bed)) == sorted([first.job_id, other_user.job_id])


async def test_a_user_cannot_submit_above_the_user_priority_limit(bed: Bed) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, await upload(bed), priority=60_000)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "spec.priority (60000)" in (caught.value.details() or "")


# -- ownership -------------------------------------------------------------------------------


async def test_another_user_gets_not_found_for_a_job_and_an_admin_sees_it(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    calls = [
        lambda s: s.GetJob(js.GetJobRequest(job_id=job.job_id)),
        lambda s: s.CancelJob(js.CancelJobRequest(job_id=job.job_id)),
        lambda s: s.UpdateJob(js.UpdateJobRequest(job_id=job.job_id, priority=10)),
        lambda s: s.GetAllocationHistory(js.GetAllocationHistoryRequest(job_id=job.job_id)),
        lambda s: s.GetJobMetrics(js.GetJobMetricsRequest(job_id=job.job_id)),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as theirs:
            await call(bed.stub("other"))
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await bed.stub("other").GetJob(js.GetJobRequest(job_id="job-nonexistent"))
        assert theirs.value.code() == grpc.StatusCode.NOT_FOUND
        assert reason(theirs.value) == reason(missing.value) == "ERROR_REASON_JOB_NOT_FOUND"
    assert [j.job_id for j in await listed(bed, "other")] == []
    assert (await bed.stub("admin").GetJob(js.GetJobRequest(job_id=job.job_id))).job.owner == (
        "alice"
    )
    assert [j.job_id for j in await listed(bed, "user")] == [job.job_id]
    still = (await bed.stub("user").GetJob(js.GetJobRequest(job_id=job.job_id))).job
    assert still.state == job_pb2.JOB_STATE_QUEUED and still.spec.priority == 5000


async def test_calls_without_a_valid_token_are_unauthenticated(bed: Bed) -> None:
    async with connect(bed.server.address, token="wrong", trace=False) as channel:
        stub = job_scheduler_service_pb2_grpc.JobSchedulerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ListJobs(js.ListJobsRequest())
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


# -- cancel, update ----------------------------------------------------------------------------


async def test_cancelling_a_queued_job_ends_it_and_a_second_cancel_is_a_no_op(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    cancelled = (await bed.stub().CancelJob(js.CancelJobRequest(job_id=job.job_id))).job
    assert cancelled.state == job_pb2.JOB_STATE_CANCELLED
    assert cancelled.state_reason == "cancelled by alice"
    assert cancelled.end_time.seconds > 0
    again = (await bed.stub().CancelJob(js.CancelJobRequest(job_id=job.job_id))).job
    assert again == cancelled
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await bed.stub().UpdateJob(js.UpdateJobRequest(job_id=job.job_id, priority=10))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(caught.value) == "ERROR_REASON_WRONG_STATE"


async def test_cancelling_a_running_job_moves_it_to_cancelling(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    record = bed.table.records[job.job_id]
    record.transition(job_pb2.JOB_STATE_RUNNING, "running", 1.0)
    await bed.table.save(record)
    got = (await bed.stub().CancelJob(js.CancelJobRequest(job_id=job.job_id))).job
    assert got.state == job_pb2.JOB_STATE_CANCELLING
    stored = await JobTable(bed.store).get(job.job_id)  # a standby's view: from the store
    assert stored is not None and stored.state == job_pb2.JOB_STATE_CANCELLING


async def test_update_changes_priority_and_max_workers_and_triggers_a_reconcile(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    got = (
        await bed.stub().UpdateJob(
            js.UpdateJobRequest(job_id=job.job_id, priority=10000, max_workers=8)
        )
    ).job
    assert (got.spec.priority, got.spec.max_workers) == (10000, 8)
    assert bed.triggers[-1] == (
        f"priority of {job.job_id} changed to 10000; max_workers of {job.job_id} changed to 8"
    )
    only_max = (
        await bed.stub().UpdateJob(js.UpdateJobRequest(job_id=job.job_id, max_workers=2))
    ).job
    assert (only_max.spec.priority, only_max.spec.max_workers) == (10000, 2)


@pytest.mark.parametrize(
    ("request_fields", "code", "text"),
    [
        ({"max_workers": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_workers (0)"),
        ({"priority": 0}, grpc.StatusCode.INVALID_ARGUMENT, "priority (0)"),
        ({"priority": 1_000_001}, grpc.StatusCode.INVALID_ARGUMENT, "priority (1000001)"),
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "priority (None)"),
        ({"priority": 60_000}, grpc.StatusCode.PERMISSION_DENIED, "priority (60000)"),
    ],
)
async def test_a_bad_update_is_refused_and_changes_nothing(
    bed: Bed, request_fields: dict[str, int], code: grpc.StatusCode, text: str
) -> None:
    job = await submit(bed, await upload(bed))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await bed.stub().UpdateJob(js.UpdateJobRequest(job_id=job.job_id, **request_fields))
    assert caught.value.code() == code
    assert text in (caught.value.details() or "")
    after = (await bed.stub().GetJob(js.GetJobRequest(job_id=job.job_id))).job
    assert after == job


async def test_an_admin_may_raise_priority_above_the_user_limit(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    got = (
        await bed.stub("admin").UpdateJob(js.UpdateJobRequest(job_id=job.job_id, priority=900_000))
    ).job
    assert got.spec.priority == 900_000


# -- list --------------------------------------------------------------------------------------


async def test_list_jobs_pages_newest_first_and_filters_by_state(bed: Bed) -> None:
    artifact = await upload(bed)
    ids = [(await submit(bed, artifact, name=f"job{i}")).job_id for i in range(5)]
    await bed.stub().CancelJob(js.CancelJobRequest(job_id=ids[1]))
    seen: list[str] = []
    token = ""
    while True:
        page = await bed.stub().ListJobs(js.ListJobsRequest(page_size=2, page_token=token))
        assert len(page.jobs) <= 2
        seen.extend(j.job_id for j in page.jobs)
        token = page.next_page_token
        if not token:
            break
    assert seen == list(reversed(ids))
    queued = await bed.stub().ListJobs(js.ListJobsRequest(states=[job_pb2.JOB_STATE_QUEUED]))
    assert [j.job_id for j in queued.jobs] == [ids[4], ids[3], ids[2], ids[0]]
    for bad in (js.ListJobsRequest(page_size=1001), js.ListJobsRequest(page_token="nope")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await bed.stub().ListJobs(bad)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- watch -------------------------------------------------------------------------------------


async def test_watch_sends_the_current_state_then_changes_until_the_job_ends(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    call = bed.stub().WatchJob(js.WatchJobRequest(job_id=job.job_id))
    first = await call.read()
    assert first.event.kind == job_pb2.JOB_EVENT_KIND_STATE
    assert first.event.job.state == job_pb2.JOB_STATE_QUEUED
    record = bed.table.records[job.job_id]
    event = await bed.table.add_allocation_event(record, 2, 4, "2 learner(s) started")
    second = await call.read()
    assert second.event.kind == job_pb2.JOB_EVENT_KIND_ALLOCATION
    assert second.event.allocation == event
    await bed.stub().CancelJob(js.CancelJobRequest(job_id=job.job_id))
    last = await call.read()
    assert last.event.kind == job_pb2.JOB_EVENT_KIND_STATE
    assert last.event.job.state == job_pb2.JOB_STATE_CANCELLED
    assert await call.read() == aio.EOF


# -- allocation history --------------------------------------------------------------------------


async def test_allocation_history_is_per_job_bounded_persisted_and_visible_to_owners(
    bed: Bed,
) -> None:
    artifact = await upload(bed)
    await upload(bed, who="other")
    mine = await submit(bed, artifact)
    theirs = await submit(bed, artifact, who="other")
    for workers in (1, 4, 8, 4):
        await bed.table.add_allocation_event(bed.table.records[mine.job_id], workers, 8, "x")
    await bed.table.add_allocation_event(bed.table.records[theirs.job_id], 2, 2, "y")
    history = await bed.stub().GetAllocationHistory(
        js.GetAllocationHistoryRequest(job_id=mine.job_id)
    )
    assert [e.workers for e in history.events] == [4, 8, 4]  # history_limit=3, oldest first
    all_mine = await bed.stub().GetAllocationHistory(js.GetAllocationHistoryRequest())
    assert {e.job_id for e in all_mine.events} == {mine.job_id}
    everything = await bed.stub("admin").GetAllocationHistory(js.GetAllocationHistoryRequest())
    assert {e.job_id for e in everything.events} == {mine.job_id, theirs.job_id}
    times = [(e.time.seconds, e.time.nanos) for e in everything.events]
    assert times == sorted(times)
    successor = JobTable(bed.store)
    await successor.become_leader(None)
    assert [e.workers for e in await successor.history(mine.job_id)] == [4, 8, 4]


# -- model, metrics ------------------------------------------------------------------------------


async def test_download_model_streams_the_final_model_once_it_exists(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    request = js.DownloadModelRequest(job_id=job.job_id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in bed.stub().DownloadModel(request):
            pass
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    data = b"safetensors" * 200_000
    path = Path(bed.storage.model_path(job.job_id))
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    messages = [m async for m in bed.stub().DownloadModel(request)]
    assert messages[0].header.name == "model.safetensors"
    assert messages[0].header.size_bytes == len(data)
    assert b"".join(m.chunk for m in messages[1:]) == data


async def test_metrics_are_read_from_the_jobs_jsonl_files(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    folder = Path(bed.storage.path("jobs", job.job_id, "metrics"))
    folder.mkdir(parents=True)
    lines = [
        json.dumps(
            {
                "epoch": 0,
                "iteration": i,
                "generation": 1,
                "world_size": 4,
                "loss": 1.0 / (i + 1),
                "samples": 64,
                "samples_per_second": 1000.0,
                "time": f"2025-01-01T00:00:0{i}Z",
            }
        )
        for i in range(5)
    ]
    (folder / "iterations.jsonl").write_text("\n".join(lines) + '\n{"epoch": 0, "itera')
    (folder / "epochs.jsonl").write_text(
        json.dumps({"epoch": 0, "values": {"accuracy": 0.97}, "time": 1735689600.5}) + "\n"
    )
    got = await bed.stub().GetJobMetrics(js.GetJobMetricsRequest(job_id=job.job_id))
    assert [m.iteration for m in got.iterations] == [0, 1, 2, 3, 4]
    assert got.iterations[2].loss == pytest.approx(1 / 3)
    assert got.iterations[4].time.seconds == 1735689604
    assert dict(got.epochs[0].values) == {"accuracy": pytest.approx(0.97)}
    assert got.epochs[0].time.seconds == 1735689600
    later = await bed.stub().GetJobMetrics(
        js.GetJobMetricsRequest(job_id=job.job_id, after_iteration=3)
    )
    assert [m.iteration for m in later.iterations] == [3, 4]


async def test_metrics_of_a_job_that_wrote_none_are_empty(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    got = await bed.stub().GetJobMetrics(js.GetJobMetricsRequest(job_id=job.job_id))
    assert list(got.iterations) == [] and list(got.epochs) == []


# -- standby --------------------------------------------------------------------------------------


async def test_a_standby_refuses_mutations_with_the_leader_address_and_serves_reads(
    bed: Bed,
) -> None:
    artifact = await upload(bed)
    job = await submit(bed, artifact)
    bed.table.step_down()
    bed.table.leader_address = "10.0.0.9:7000"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, artifact)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    trailers = dict(caught.value.trailing_metadata() or ())
    assert trailers[LEADER_METADATA_KEY] == "10.0.0.9:7000"
    assert trailers[REASON_METADATA_KEY] == "ERROR_REASON_NOT_LEADER"
    got = await bed.stub().GetJob(js.GetJobRequest(job_id=job.job_id))
    assert got.job.job_id == job.job_id
    assert [j.job_id for j in await listed(bed, "user")] == [job.job_id]


async def test_a_watcher_is_told_when_its_replica_stops_leading(bed: Bed) -> None:
    job = await submit(bed, await upload(bed))
    call = bed.stub().WatchJob(js.WatchJobRequest(job_id=job.job_id))
    await call.read()
    await async_wait_until(lambda: bed.table._subscribers.get(job.job_id), timeout=5)
    bed.table.step_down()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


# -- security: request ids, artifact owners and quota, learner credentials -------------------


async def test_a_request_id_reused_with_another_spec_is_already_exists_naming_the_job(
    bed: Bed,
) -> None:
    artifact = await upload(bed)
    first = await submit(bed, artifact, request_id="req-7")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, artifact, request_id="req-7", max_workers=2)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert first.job_id in (caught.value.details() or "")
    assert reason(caught.value) == "ERROR_REASON_ALREADY_EXISTS"
    # The same spec again is the retry it was meant for; an update since does not matter.
    await bed.stub().UpdateJob(js.UpdateJobRequest(job_id=first.job_id, priority=100))
    assert (await submit(bed, artifact, request_id="req-7")).job_id == first.job_id
    assert len(await listed(bed)) == 1


async def test_only_its_owners_admins_and_services_download_an_artifact_or_run_it(
    bed: Bed,
) -> None:
    artifact = await upload(bed, b"alice's code" * 10)

    async def download(who: str) -> grpc.StatusCode:
        try:
            async for _ in bed.stub(who).DownloadArtifact(
                js.DownloadArtifactRequest(artifact_id=artifact)
            ):
                pass
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    assert await download("user") == grpc.StatusCode.OK
    assert await download("admin") == grpc.StatusCode.OK
    assert await download("service") == grpc.StatusCode.OK  # the host agents
    assert await download("other") == grpc.StatusCode.NOT_FOUND  # as if it did not exist
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(bed, artifact, who="other")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert await listed(bed) == []
    # Uploading the same bytes makes bob an owner too.
    assert await upload(bed, b"alice's code" * 10, who="other") == artifact
    assert await download("other") == grpc.StatusCode.OK


async def test_an_upload_over_the_users_quota_is_resource_exhausted_and_stores_nothing(
    bed: Bed,
) -> None:
    blobs = [bytes([i]) * (MAX_ARTIFACT - 100) for i in range(4)]
    for blob in blobs[:3]:
        await upload(bed, blob)
    before = sorted(p.name for p in Path(bed.storage.path("artifacts")).iterdir())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await upload(bed, blobs[3])
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason(caught.value) == "ERROR_REASON_QUOTA_EXCEEDED"
    message = caught.value.details() or ""
    assert "quota of 'alice'" in message and "MiB used of" in message
    assert sorted(p.name for p in Path(bed.storage.path("artifacts")).iterdir()) == before
    # Bytes one owns already cost nothing (the header names their sha256, as the client's
    # does); another user has a quota of their own; admins have none.
    digest = hashlib.sha256(blobs[0]).hexdigest()
    await bed.stub().UploadArtifact(iter(upload_messages(blobs[0], sha256=digest)))
    await upload(bed, blobs[3], who="other")
    for blob in blobs:
        await upload(bed, blob, who="admin")


async def test_a_learner_reads_only_its_own_job_while_it_is_one_of_its_learners(
    bed: Bed,
) -> None:
    from shoal.runtime.auth import LearnerTokenSigner
    from shoal.scheduler.jobs import LearnerRecord

    signer = LearnerTokenSigner.generate()
    assert bed.server.credentials is not None
    bed.server.credentials.add_learner_key(signer.public_key_raw)
    artifact = await upload(bed)
    mine, other = await submit(bed, artifact), await submit(bed, artifact)
    learner = f"{mine.job_id}-l1"

    async def as_learner(learner_id: str, call):  # type: ignore[no-untyped-def]
        token = signer.mint(job_id=mine.job_id, learner_id=learner_id)
        channel = connect(bed.server.address, token=token, trace=False)
        try:
            await call(job_scheduler_service_pb2_grpc.JobSchedulerServiceStub(channel))
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await channel.close()

    def get(job_id: str):  # type: ignore[no-untyped-def]
        return lambda s: s.GetJob(js.GetJobRequest(job_id=job_id))

    # Not (yet) one of the job's learners: nothing.
    assert await as_learner(learner, get(mine.job_id)) == grpc.StatusCode.NOT_FOUND
    record = bed.table.records[mine.job_id]
    record.learners[learner] = LearnerRecord(learner, "h1", "gpu0")
    assert await as_learner(learner, get(mine.job_id)) == grpc.StatusCode.OK
    assert await as_learner(learner, get(other.job_id)) == grpc.StatusCode.NOT_FOUND
    assert await as_learner(f"{mine.job_id}-l2", get(mine.job_id)) == grpc.StatusCode.NOT_FOUND
    for call in (
        lambda s: s.ListJobs(js.ListJobsRequest()),
        lambda s: s.CancelJob(js.CancelJobRequest(job_id=mine.job_id)),
        lambda s: s.SubmitJob(js.SubmitJobRequest(spec=spec(artifact))),
        lambda s: s.GetAllocationHistory(js.GetAllocationHistoryRequest()),
    ):
        assert await as_learner(learner, call) == grpc.StatusCode.PERMISSION_DENIED
    # The credential dies with the job.
    await bed.stub("admin").CancelJob(js.CancelJobRequest(job_id=mine.job_id))
    assert await as_learner(learner, get(mine.job_id)) == grpc.StatusCode.NOT_FOUND
    assert (await bed.stub().GetJob(js.GetJobRequest(job_id=mine.job_id))).job.state in (
        job_pb2.JOB_STATE_CANCELLED,
        job_pb2.JOB_STATE_CANCELLING,
    )


async def test_during_an_etcd_outage_reads_serve_the_last_known_state_marked_stale(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoal.runtime.store import StoreUnavailable

    artifact = await upload(bed)
    job = await submit(bed, artifact)

    async def down(*args: object, **kwargs: object) -> object:
        raise StoreUnavailable("etcd: connection refused")

    with monkeypatch.context() as patch:  # etcd goes away: the leader loses its lease
        patch.setattr(bed.store, "get", down)
        patch.setattr(bed.store, "list", down)
        bed.table.step_down()
        call = bed.stub().GetJob(js.GetJobRequest(job_id=job.job_id))
        got = await call
        assert got.job.job_id == job.job_id
        stale = dict(await call.trailing_metadata())["shoal-stale-as-of"]
        assert stale.endswith("+00:00")
        assert [j.job_id for j in await listed(bed)] == [job.job_id]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await submit(bed, artifact)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "etcd" in refused.value.details() and "unreachable" in refused.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as unknown:  # unknown jobs stay unknown
            await bed.stub().GetJob(js.GetJobRequest(job_id="job-nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    # etcd is back: reads come from the store again, with no stale mark; writes follow the
    # leader (this replica, once it leads again)
    call = bed.stub().GetJob(js.GetJobRequest(job_id=job.job_id))
    assert (await call).job.job_id == job.job_id
    assert "shoal-stale-as-of" not in dict(await call.trailing_metadata())
    with pytest.raises(grpc.aio.AioRpcError) as standby:
        await submit(bed, artifact)
    assert reason(standby.value) == "ERROR_REASON_NOT_LEADER"
    await bed.table.become_leader(None)
    assert (await submit(bed, artifact)).job_id


async def test_a_store_that_hangs_without_quorum_still_gets_a_stale_answer_in_time(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An etcd member without quorum holds a read until its own timeout; the replica that led
    answers from its last known state after STORE_PROBE_TIMEOUT_S instead of the caller's
    deadline running out."""
    artifact = await upload(bed)
    job = await submit(bed, artifact)

    async def hangs(*args: object, **kwargs: object) -> object:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    monkeypatch.setattr(bed.store, "get", hangs)
    bed.table.step_down()
    call = bed.stub().GetJob(js.GetJobRequest(job_id=job.job_id), timeout=10)
    assert (await call).job.job_id == job.job_id
    assert "shoal-stale-as-of" in dict(await call.trailing_metadata())
