"""JobSchedulerService's thin gRPC handlers over :class:`~shoal.scheduler.service.JobApi`: each
reads the caller (``current_principal``), calls the core and wraps the answer; domain errors
are raised and mapped to status codes by :data:`ERRORS`. Also the roles each method allows and
the ``shoal-stale-as-of`` trailer of reads answered from the last known state.

:mod:`shoal.scheduler.service` re-exports every name here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import grpc

from shoal.runtime.auth import (
    LEARNERS,
    USERS_AND_SERVICES,
    MethodRoles,
    current_principal,
    role_to_proto,
)
from shoal.runtime.errors import (
    DEFAULT_TABLE,
    ErrorTable,
    InvalidField,
)
from shoal.runtime.server import ServiceBinding
from shoal.scheduler.store import STALE_AS_OF, StoreConflict
from shoal.v1 import (
    job_scheduler_service_pb2 as js_pb2,
    job_scheduler_service_pb2_grpc,
)

if TYPE_CHECKING:
    from shoal.scheduler.service import JobApi

log = logging.getLogger(__name__)

SERVICE_NAME = "shoal.v1.JobSchedulerService"
ROLES = MethodRoles(
    SERVICE_NAME,
    USERS_AND_SERVICES,
    {
        name: USERS_AND_SERVICES | LEARNERS
        for name in ("GetJob", "WatchJob", "GetJobMetrics", "GetAllocationHistory")
    },
)
ERRORS: ErrorTable = DEFAULT_TABLE.extend({StoreConflict: grpc.StatusCode.UNAVAILABLE})


STALE_TRAILER = "shoal-stale-as-of"


def _mark_stale(context) -> None:  # type: ignore[no-untyped-def]
    """A read answered from the last known state (etcd unreachable) says so, and as of when,
    in the ``shoal-stale-as-of`` trailer (RFC 3339, UTC)."""
    as_of = STALE_AS_OF.get()
    if as_of is not None:
        stamp = datetime.fromtimestamp(as_of, tz=UTC).isoformat(timespec="milliseconds")
        context.set_trailing_metadata(((STALE_TRAILER, stamp),))


class SchedulerServicer(job_scheduler_service_pb2_grpc.JobSchedulerServiceServicer):
    """Thin handlers: read the caller, call :class:`JobApi`, wrap the answer."""

    def __init__(self, api: JobApi) -> None:
        self.api = api

    async def SubmitJob(self, request, context):  # type: ignore[no-untyped-def]
        job = await self.api.submit(current_principal(), request.request_id, request.spec)
        return js_pb2.SubmitJobResponse(job=job)

    async def GetJob(self, request, context):  # type: ignore[no-untyped-def]
        job = await self.api.get(current_principal(), request.job_id)
        _mark_stale(context)
        return js_pb2.GetJobResponse(job=job)

    async def ListJobs(self, request, context):  # type: ignore[no-untyped-def]
        jobs, token = await self.api.list_jobs(
            current_principal(),
            page_size=request.page_size,
            page_token=request.page_token,
            states=list(request.states),
        )
        _mark_stale(context)
        return js_pb2.ListJobsResponse(jobs=jobs, next_page_token=token)

    async def WatchJob(self, request, context):  # type: ignore[no-untyped-def]
        async for event in self.api.watch(current_principal(), request.job_id):
            yield js_pb2.WatchJobResponse(event=event)

    async def CancelJob(self, request, context):  # type: ignore[no-untyped-def]
        job = await self.api.cancel(current_principal(), request.job_id, request.request_id)
        return js_pb2.CancelJobResponse(job=job)

    async def UpdateJob(self, request, context):  # type: ignore[no-untyped-def]
        job = await self.api.update(
            current_principal(),
            request.job_id,
            priority=request.priority if request.HasField("priority") else None,
            max_workers=request.max_workers if request.HasField("max_workers") else None,
            request_id=request.request_id,
        )
        return js_pb2.UpdateJobResponse(job=job)

    async def UploadArtifact(self, request_iterator, context):  # type: ignore[no-untyped-def]
        await self.api.table.require_writable()  # before reading: a standby consumes nothing
        messages = request_iterator.__aiter__()
        try:
            first = await messages.__anext__()
        except StopAsyncIteration:
            first = None
        if first is None or first.WhichOneof("content") != "header":
            raise InvalidField("header", None, "must be sent in the first message")

        async def chunks() -> AsyncIterator[bytes]:
            async for message in messages:
                if message.WhichOneof("content") != "chunk":
                    raise InvalidField("header", message.header.name, "may only be sent first")
                yield message.chunk

        return await self.api.upload(first.header, chunks(), current_principal())

    async def DownloadArtifact(self, request, context):  # type: ignore[no-untyped-def]
        header, chunks = await self.api.download_artifact(request.artifact_id, current_principal())
        yield js_pb2.DownloadArtifactResponse(header=header)
        async for chunk in chunks:
            yield js_pb2.DownloadArtifactResponse(chunk=chunk)

    async def DownloadModel(self, request, context):  # type: ignore[no-untyped-def]
        header, chunks = await self.api.download_model(current_principal(), request.job_id)
        yield js_pb2.DownloadModelResponse(header=header)
        async for chunk in chunks:
            yield js_pb2.DownloadModelResponse(chunk=chunk)

    async def StreamJobLogs(self, request, context):  # type: ignore[no-untyped-def]
        async for lines in self.api.logs(current_principal(), request):
            yield js_pb2.StreamJobLogsResponse(lines=lines)

    async def GetJobMetrics(self, request, context):  # type: ignore[no-untyped-def]
        reply = await self.api.metrics(current_principal(), request.job_id, request.after_iteration)
        _mark_stale(context)
        return reply

    async def GetAllocationHistory(self, request, context):  # type: ignore[no-untyped-def]
        events = await self.api.allocation_history(current_principal(), request.job_id)
        _mark_stale(context)
        return js_pb2.GetAllocationHistoryResponse(events=events)

    async def GetCallerIdentity(self, request, context):  # type: ignore[no-untyped-def]
        principal = current_principal()
        return js_pb2.GetCallerIdentityResponse(
            principal=principal.name, role=role_to_proto(principal.role)
        )

    async def ListCheckpoints(self, request, context):  # type: ignore[no-untyped-def]
        return await self.api.checkpoints(
            current_principal(),
            request.job_id,
            page_size=request.page_size,
            page_token=request.page_token,
        )

    async def DownloadCheckpoint(self, request, context):  # type: ignore[no-untyped-def]
        header, chunks = await self.api.download_checkpoint(
            current_principal(), request.job_id, request.checkpoint, request.file
        )
        yield js_pb2.DownloadCheckpointResponse(header=header)
        async for chunk in chunks:
            yield js_pb2.DownloadCheckpointResponse(chunk=chunk)


def binding(api: JobApi) -> ServiceBinding:
    """The service binding for ``create_server``."""
    return ServiceBinding(
        SERVICE_NAME,
        job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server,  # type: ignore[arg-type]
        SchedulerServicer(api),
        ROLES,
    )
