"""Load shedding on a real in-process server: past --max-concurrent-calls, unary calls are
refused at once with RESOURCE_EXHAUSTED (ERROR_REASON_OVERLOADED); streams and health checks
are never shed; the flag is validated."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal.runtime.auth import USERS_AND_SERVICES, MethodRoles
from shoal.runtime.config import ServerConfig, add_server_flags, server_config_from_args
from shoal.runtime.errors import InvalidField
from shoal.runtime.server import ServiceBinding, create_server
from shoal.v1 import job_pb2, job_scheduler_service_pb2 as js, job_scheduler_service_pb2_grpc

SERVICE = "shoal.v1.JobSchedulerService"


class Slow(job_scheduler_service_pb2_grpc.JobSchedulerServiceServicer):
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def GetJob(self, request, context):
        self.started += 1
        await self.release.wait()
        return js.GetJobResponse(job=job_pb2.Job(job_id=request.job_id))

    async def WatchJob(self, request, context):
        yield js.WatchJobResponse(event=job_pb2.JobEvent(job=job_pb2.Job(job_id=request.job_id)))


async def test_calls_over_the_limit_are_shed_at_once_and_the_rest_are_served() -> None:
    slow = Slow()
    config = ServerConfig(service_name="job-scheduler", allow_no_auth=True, max_concurrent_calls=3)
    add = job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server
    server = await create_server(
        config, [ServiceBinding(SERVICE, add, slow, MethodRoles(SERVICE, USERS_AND_SERVICES))]
    )
    channel = aio.insecure_channel(server.address)
    stub = job_scheduler_service_pb2_grpc.JobSchedulerServiceStub(channel)
    try:
        calls = [
            asyncio.ensure_future(stub.GetJob(js.GetJobRequest(job_id=f"job-{i}"), timeout=30))
            for i in range(10)
        ]

        # Three are taken; the seven others are refused without waiting for a deadline.
        async def seven_refused() -> None:
            while sum(c.done() for c in calls) < 7:
                await asyncio.wait(
                    [c for c in calls if not c.done()], return_when=asyncio.FIRST_COMPLETED
                )

        await asyncio.wait_for(seven_refused(), timeout=20)
        refused = [c.exception() for c in calls if c.done()]
        assert len(refused) == 7 and slow.started == 3
        for exc in refused:
            assert isinstance(exc, aio.AioRpcError)
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-calls 3" in exc.details()
            assert dict(exc.trailing_metadata())["shoal-error-reason"] == "ERROR_REASON_OVERLOADED"
        # Streams and health checks are not shed, even now.
        watched = [r async for r in stub.WatchJob(js.WatchJobRequest(job_id="w"))]
        assert watched[0].event.job.job_id == "w"
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        slow.release.set()
        served = await asyncio.gather(*(c for c in calls if not c.done()))
        assert len({r.job.job_id for r in served}) == 3
        # Capacity is back: a new call is served.
        again = await stub.GetJob(js.GetJobRequest(job_id="job-x"), timeout=10)
        assert again.job.job_id == "job-x"
    finally:
        await channel.close()
        await server.stop(0)


def test_max_concurrent_calls_is_validated_naming_the_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_server_flags(parser, {})
    ns = parser.parse_args(["--insecure-no-auth", "--max-concurrent-calls", "many"])
    with pytest.raises(InvalidField, match="max_concurrent_calls"):
        server_config_from_args("x", ns)
    with pytest.raises(InvalidField, match=r"max_concurrent_calls \(-1\)"):
        ServerConfig(service_name="x", allow_no_auth=True, max_concurrent_calls=-1)
    ns = parser.parse_args(["--insecure-no-auth", "--max-concurrent-calls", "64"])
    assert server_config_from_args("x", ns).max_concurrent_calls == 64
