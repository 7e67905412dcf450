"""The server bootstrap, in process on port 0: auth, roles, the error table, health, streaming."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal.runtime.auth import USERS_AND_SERVICES, MethodRoles, Role, current_principal
from shoal.runtime.channels import connect
from shoal.runtime.config import ServerConfig
from shoal.runtime.errors import DEFAULT_TABLE, InvalidField, JobNotFound, NotLeader
from shoal.runtime.server import ServiceBinding, create_server
from shoal.v1 import job_pb2, job_scheduler_service_pb2 as js, job_scheduler_service_pb2_grpc
from tests.support import make_tokens

SERVICE = "shoal.v1.JobSchedulerService"


class RecordingScheduler(job_scheduler_service_pb2_grpc.JobSchedulerServiceServicer):
    """Records which handlers ran and who called them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def GetJob(self, request, context):
        self.calls.append(("GetJob", current_principal().name))
        if request.job_id == "bad":
            raise InvalidField("job_id", request.job_id, "is not a valid job id")
        if request.job_id == "missing":
            raise JobNotFound(request.job_id)
        if request.job_id == "standby":
            raise NotLeader("job-scheduler", "10.0.0.7:7000")
        if request.job_id == "boom":
            raise RuntimeError("kaboom")
        return js.GetJobResponse(
            job=job_pb2.Job(job_id=request.job_id, owner=current_principal().name)
        )

    async def WatchJob(self, request, context):
        self.calls.append(("WatchJob", current_principal().name))
        for kind in (job_pb2.JOB_EVENT_KIND_STATE, job_pb2.JOB_EVENT_KIND_PROGRESS):
            yield js.WatchJobResponse(event=job_pb2.JobEvent(kind=kind))
        raise JobNotFound(request.job_id)

    async def CancelJob(self, request, context):
        self.calls.append(("CancelJob", current_principal().name))
        return js.CancelJobResponse()


ROLES = MethodRoles(
    service=SERVICE,
    default=USERS_AND_SERVICES,
    methods={"CancelJob": frozenset({Role.SERVICE})},
)


@pytest.fixture
async def served(tmp_path):
    tokens = make_tokens(tmp_path / "tokens")
    servicer = RecordingScheduler()
    config = ServerConfig(service_name="test", tokens_file=str(tmp_path / "tokens"))
    running = await create_server(
        config,
        [
            ServiceBinding(
                SERVICE,
                job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server,
                servicer,
                ROLES,
            )
        ],
        errors=DEFAULT_TABLE,
    )
    yield running, servicer, tokens
    await running.stop(0)


def stub(address: str, token: str | None) -> tuple[aio.Channel, object]:
    channel = connect(address, token=token, trace=False)
    return channel, job_scheduler_service_pb2_grpc.JobSchedulerServiceStub(channel)


async def call_code(coro) -> grpc.StatusCode:
    try:
        await coro
    except aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_a_call_without_a_token_is_unauthenticated_and_runs_no_handler(served):
    running, servicer, _ = served
    channel, s = stub(running.address, None)
    async with channel:
        assert (
            await call_code(s.GetJob(js.GetJobRequest(job_id="j")))
            == grpc.StatusCode.UNAUTHENTICATED
        )
    assert servicer.calls == []


async def test_a_call_with_an_unknown_token_is_unauthenticated_and_runs_no_handler(served):
    running, servicer, _ = served
    channel, s = stub(running.address, "not-a-real-token")
    async with channel:
        assert (
            await call_code(s.GetJob(js.GetJobRequest(job_id="j")))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        code = await call_code(_drain(s.WatchJob(js.WatchJobRequest(job_id="j"))))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert servicer.calls == []


async def test_a_user_calling_a_service_only_method_is_denied_and_runs_no_handler(served):
    running, servicer, tokens = served
    channel, s = stub(running.address, tokens["user"])
    async with channel:
        code = await call_code(s.CancelJob(js.CancelJobRequest(job_id="j")))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert servicer.calls == []


async def test_the_right_role_reaches_the_handler_with_its_principal(served):
    running, servicer, tokens = served
    for who, name in (("user", "alice"), ("service", "scheduler"), ("admin", "root")):
        channel, s = stub(running.address, tokens[who])
        async with channel:
            reply = await s.GetJob(js.GetJobRequest(job_id="j"))
        assert reply.job.owner == name
    channel, s = stub(running.address, tokens["service"])
    async with channel:
        await s.CancelJob(js.CancelJobRequest(job_id="j"))
    assert servicer.calls[-1] == ("CancelJob", "scheduler")


@pytest.mark.parametrize(
    ("job_id", "code", "reason", "text"),
    [
        ("bad", grpc.StatusCode.INVALID_ARGUMENT, "ERROR_REASON_INVALID_FIELD", "job_id ('bad')"),
        ("missing", grpc.StatusCode.NOT_FOUND, "ERROR_REASON_JOB_NOT_FOUND", "job 'missing'"),
        ("standby", grpc.StatusCode.UNAVAILABLE, "ERROR_REASON_NOT_LEADER", "10.0.0.7:7000"),
        ("boom", grpc.StatusCode.INTERNAL, "ERROR_REASON_UNSPECIFIED", "internal error"),
    ],
)
async def test_domain_errors_map_to_status_codes_with_a_reason(served, job_id, code, reason, text):
    running, _, tokens = served
    channel, s = stub(running.address, tokens["user"])
    async with channel:
        with pytest.raises(aio.AioRpcError) as info:
            await s.GetJob(js.GetJobRequest(job_id=job_id))
    err = info.value
    assert err.code() == code
    assert text in err.details()
    trailing = dict(err.trailing_metadata() or ())
    assert trailing["shoal-error-reason"] == reason
    if job_id == "standby":
        assert trailing["shoal-leader"] == "10.0.0.7:7000"


async def test_a_streaming_handler_streams_then_maps_its_error(served):
    running, _, tokens = served
    channel, s = stub(running.address, tokens["user"])
    received = []
    async with channel:
        with pytest.raises(aio.AioRpcError) as info:
            async for item in s.WatchJob(js.WatchJobRequest(job_id="gone")):
                received.append(item.event.kind)
    assert received == [job_pb2.JOB_EVENT_KIND_STATE, job_pb2.JOB_EVENT_KIND_PROGRESS]
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_health_reports_serving_without_a_token_and_not_serving_after_stop(served):
    running, _, _ = served
    async with aio.insecure_channel(running.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await running.set_serving(False)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_messages_over_the_size_limit_are_refused(tmp_path):
    config = ServerConfig(service_name="t", allow_no_auth=True, max_message_bytes=1024 * 1024)
    servicer = RecordingScheduler()
    running = await create_server(
        config,
        [
            ServiceBinding(
                SERVICE,
                job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server,
                servicer,
                ROLES,
            )
        ],
    )
    try:
        async with aio.insecure_channel(running.address) as channel:
            s = job_scheduler_service_pb2_grpc.JobSchedulerServiceStub(channel)
            code = await call_code(s.GetJob(js.GetJobRequest(job_id="x" * (2 * 1024 * 1024))))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert servicer.calls == []
    finally:
        await running.stop(0)


async def _drain(call) -> None:
    async for _ in call:
        pass


def test_store_errors_map_to_status_codes_with_their_reasons():
    from shoal.runtime import store

    fenced = DEFAULT_TABLE.lookup(store.FencedOut.of_fence(store.Fence("/k", 3), 5))
    assert fenced.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ("shoal-error-reason", "ERROR_REASON_FENCED_OUT") in fenced.metadata
    down = DEFAULT_TABLE.lookup(store.StoreUnavailable("etcd down"))
    assert down.code == grpc.StatusCode.UNAVAILABLE
