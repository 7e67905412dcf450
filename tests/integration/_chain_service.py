"""A service on shoal.runtime for the runtime's process tests, run as a subprocess.

``front``: JobSchedulerService.GetJob calls ResourceManagerService.GetHost on --downstream.
``back``: ResourceManagerService.GetHost answers (slowly with host id "slow", to test the
graceful shutdown). Prints "LISTENING <port>" once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from shoal.runtime import telemetry
from shoal.runtime.auth import USERS_AND_SERVICES, MethodRoles
from shoal.runtime.channels import connect
from shoal.runtime.config import add_server_flags, server_config_from_args
from shoal.runtime.server import ServiceBinding, create_server, run_until_signalled
from shoal.v1 import (
    job_pb2,
    job_scheduler_service_pb2,
    job_scheduler_service_pb2_grpc,
    resource_manager_service_pb2,
    resource_manager_service_pb2_grpc,
    resources_pb2,
)


class Front(job_scheduler_service_pb2_grpc.JobSchedulerServiceServicer):
    def __init__(self, downstream: str, token: str | None) -> None:
        self._channel = connect(downstream, token=token)
        self._rm = resource_manager_service_pb2_grpc.ResourceManagerServiceStub(self._channel)

    async def GetJob(self, request, context):
        host = await self._rm.GetHost(resource_manager_service_pb2.GetHostRequest(host_id="h1"))
        job = job_pb2.Job(job_id=request.job_id, state_reason=host.host.host_id)
        return job_scheduler_service_pb2.GetJobResponse(job=job)


class Back(resource_manager_service_pb2_grpc.ResourceManagerServiceServicer):
    async def GetHost(self, request, context):
        if request.host_id == "slow":
            print("SLOW-START", flush=True)
            await asyncio.sleep(1.0)
        return resource_manager_service_pb2.GetHostResponse(
            host=resources_pb2.Host(host_id=request.host_id)
        )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["front", "back"])
    parser.add_argument("--downstream")
    add_server_flags(parser, os.environ)
    ns = parser.parse_args()
    config = server_config_from_args(f"chain-{ns.role}", ns)
    telemetry.setup_tracing(f"chain-{ns.role}")
    if ns.role == "front":
        binding = ServiceBinding(
            "shoal.v1.JobSchedulerService",
            job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server,
            Front(ns.downstream, config.service_token),
            MethodRoles("shoal.v1.JobSchedulerService", USERS_AND_SERVICES),
        )
    else:
        binding = ServiceBinding(
            "shoal.v1.ResourceManagerService",
            resource_manager_service_pb2_grpc.add_ResourceManagerServiceServicer_to_server,
            Back(),
            MethodRoles("shoal.v1.ResourceManagerService", USERS_AND_SERVICES),
        )
    running = await create_server(config, [binding])
    print(f"LISTENING {running.port}", flush=True)
    await run_until_signalled(running)
    telemetry.shutdown_tracing()
    print("STOPPED", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
