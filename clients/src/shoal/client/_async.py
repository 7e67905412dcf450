"""The asyncio client of shoal (``AsyncClient``); :mod:`shoal.client` also has a sync one."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import tenacity
from grpc import aio

from shoal.client.config import ClientConfig
from shoal.client.errors import ShoalClientError
from shoal.client.tls import channel_credentials
from shoal.contract.errors import decode_rpc_error
from shoal.contract.retrying import backoff, resumed
from shoal.v1 import (
    job_pb2,
    job_scheduler_service_pb2 as js,
    job_scheduler_service_pb2_grpc as js_grpc,
    resource_manager_service_pb2 as rm,
    resource_manager_service_pb2_grpc as rm_grpc,
    resources_pb2,
)

log = logging.getLogger("shoal.client")

CHUNK = 1024 * 1024
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# Between the attempts of a call or of opening a stream: 0.1 s, doubling, at most 1 s.
RETRY_WAIT = backoff(0.1, 1.0)
MAX_MESSAGE = 64 * 1024 * 1024
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def pack_directory(directory: str | Path) -> bytes:
    """A deterministic tar.gz of a model directory (sorted names, zeroed times and owners), so
    the same directory always has the same content address; what ``.gitignore`` and
    ``.shoalignore`` exclude is left out."""
    root = Path(directory)
    if not root.is_dir():
        raise ShoalClientError(
            "INVALID_ARGUMENT", f"model directory ({str(root)!r}) is not a directory"
        )
    from shoal.client.packing import pack

    return pack(root).data  # .gitignore / .shoalignore honoured (shoal.client.packing)


class _Endpoints:
    """A replicated service: try the known leader first, follow `shoal-leader` hints."""

    def __init__(self, addresses: Iterable[str], config: ClientConfig) -> None:
        self.addresses = list(addresses)
        self.current = 0
        self._config = config
        self._channels: dict[str, aio.Channel] = {}

    def channel(self, address: str | None = None) -> aio.Channel:
        address = address or self.addresses[self.current]
        if address not in self._channels:
            options = [
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                # find a restarted replica within a second (gRPC's default backoff: 120 s)
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ]
            if self._config.tls_ca or self._config.tls_cert:
                try:
                    creds = channel_credentials(
                        self._config.tls_ca, self._config.tls_cert, self._config.tls_key
                    )
                except ValueError as exc:
                    raise ShoalClientError("FAILED_PRECONDITION", str(exc)) from None
                self._channels[address] = aio.secure_channel(address, creds, options=options)
            else:
                self._channels[address] = aio.insecure_channel(address, options=options)
        return self._channels[address]

    def follow(self, err: aio.AioRpcError) -> bool:
        """Move to the leader named by the error, or to the next endpoint. True if moved."""
        leader = decode_rpc_error(err).leader
        if leader:
            if leader not in self.addresses:
                self.addresses.append(str(leader))
            self.current = self.addresses.index(str(leader))
            return True
        if len(self.addresses) > 1:
            self.current = (self.current + 1) % len(self.addresses)
            return True
        return False

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class AsyncClient:
    """Typed asyncio client over the generated stubs: deadlines, retries of idempotent calls,
    leader discovery (any endpoint works), bearer token."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        failover_s: float = 15.0,
    ) -> None:
        self.config = config
        self.timeout = timeout
        self.retries = retries
        # Retryable failures are retried for at least this long (when retries > 0), so that a
        # call or a stream outlives a leader failover (the election TTL, 5 s by default).
        self.failover_s = failover_s
        self._scheduler = _Endpoints(config.scheduler, config)
        self._rm = _Endpoints(config.resource_manager, config)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._scheduler.close()
        await self._rm.close()

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.config.token}"),) if self.config.token else ()

    async def _unary(
        self, endpoints: _Endpoints, stub_cls: Any, method: str, request: Any, *, idempotent: bool
    ) -> Any:
        if not endpoints.addresses:
            raise ShoalClientError("FAILED_PRECONDITION", "no resource-manager endpoint configured")

        def retryable(exc: BaseException) -> bool:
            if not isinstance(exc, aio.AioRpcError) or exc.code() not in RETRYABLE:
                return False
            # A standby did nothing, so moving to the leader is safe for any call.
            return idempotent or decode_rpc_error(exc).reason == "ERROR_REASON_NOT_LEADER"

        try:
            async for attempt in self._retrying(retryable, endpoints):
                with attempt:
                    stub = stub_cls(endpoints.channel())
                    return await getattr(stub, method)(
                        request, timeout=self.timeout, metadata=self.metadata
                    )
        except aio.AioRpcError as err:
            raise ShoalClientError.from_rpc(err, method, config=self.config) from None
        raise AssertionError("unreachable")

    def _retrying(
        self,
        retryable: Callable[[BaseException], bool],
        endpoints: _Endpoints,
    ) -> tenacity.AsyncRetrying:
        """The retry policy of a call: retry while ``retryable(error)``, until
        :meth:`_exhausted`, after ``endpoints.follow(error)`` (to the leader a standby named,
        or the next address), waiting 0.1 s doubling to 1 s between attempts."""
        give_up = asyncio.get_running_loop().time() + self.failover_s

        def follow(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None
            endpoints.follow(state.outcome.exception())  # type: ignore[arg-type]

        return tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(retryable),
            stop=lambda state: self._exhausted(state.attempt_number, give_up),
            wait=RETRY_WAIT,
            before_sleep=follow,
            reraise=True,
        )

    def _exhausted(self, attempt: int, give_up: float) -> bool:
        """No retry left: ``retries`` attempts made and the failover window is over."""
        if self.retries <= 0:
            return True
        return attempt > self.retries and asyncio.get_running_loop().time() >= give_up

    def _sched(self, method: str, request: Any, *, idempotent: bool = True) -> Any:
        return self._unary(
            self._scheduler, js_grpc.JobSchedulerServiceStub, method, request, idempotent=idempotent
        )

    def _rmcall(self, method: str, request: Any, *, idempotent: bool = True) -> Any:
        return self._unary(
            self._rm, rm_grpc.ResourceManagerServiceStub, method, request, idempotent=idempotent
        )

    async def _stream(
        self, method: str, request: Any, *, resume: bool = False
    ) -> AsyncIterator[Any]:
        """A server stream from the scheduler leader (re-resolved if it hits a standby).

        ``resume``: when the stream breaks after it delivered items (the leader failed over),
        open it again on the new leader and go on; the caller drops what it has already seen
        (watch, logs). One warning is logged per resume. Without it a broken stream raises."""
        loop = asyncio.get_running_loop()

        async def session() -> AsyncIterator[Any]:
            stub = js_grpc.JobSchedulerServiceStub(self._scheduler.channel())
            call = getattr(stub, method)(request, metadata=self.metadata)
            try:
                async for item in call:
                    yield item
            finally:
                call.cancel()  # a stream closed early ends its call (no-op once it is done)

        def retryable(exc: BaseException) -> bool:
            return isinstance(exc, aio.AioRpcError) and exc.code() in RETRYABLE

        def resumable(exc: BaseException) -> bool:
            if not (resume and retryable(exc)) or self.retries <= 0:
                return False
            log.warning(
                "%s: the stream broke (%s); resuming on the job-scheduler leader",
                method,
                exc.code().name,  # type: ignore[attr-defined]
            )
            return True

        def stop() -> Callable[[tenacity.RetryCallState], bool]:
            # The failover window starts over with every retry sequence (after items arrived).
            give_up = loop.time() + self.failover_s
            return lambda state: self._exhausted(state.attempt_number, give_up)

        def follow(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None
            self._scheduler.follow(state.outcome.exception())  # type: ignore[arg-type]

        # tenacity (shoal.contract.retrying.resumed) opens the stream until its first item: a
        # retryable failure moves to the leader a standby named (or the next address) and is
        # retried 0.1 s doubling to 1 s apart until _exhausted; a break after items starts
        # that over (with ``resume``) or raises.
        try:
            async for item in resumed(
                session,
                retry=retryable,
                resume=resumable,
                wait=RETRY_WAIT,
                stop=stop,
                before_sleep=follow,
            ):
                yield item
        except aio.AioRpcError as err:
            raise ShoalClientError.from_rpc(err, method, config=self.config) from None

    # -- jobs ---------------------------------------------------------------------------

    async def submit_job(
        self, spec: job_pb2.JobSpec, *, request_id: str | None = None
    ) -> job_pb2.Job:
        request = js.SubmitJobRequest(request_id=request_id or str(uuid.uuid4()), spec=spec)
        return (await self._sched("SubmitJob", request)).job  # idempotent by request_id

    async def get_job(self, job_id: str) -> job_pb2.Job:
        return (await self._sched("GetJob", js.GetJobRequest(job_id=job_id))).job

    async def list_jobs(
        self, *, states: Iterable[int] = (), page_size: int = 100
    ) -> AsyncIterator[job_pb2.Job]:
        token = ""
        while True:
            reply = await self._sched(
                "ListJobs",
                js.ListJobsRequest(
                    page_size=page_size,
                    page_token=token,
                    states=[job_pb2.JobState.ValueType(s) for s in states],
                ),
            )
            for job in reply.jobs:
                yield job
            token = reply.next_page_token
            if not token:
                return

    async def cancel_job(self, job_id: str) -> job_pb2.Job:
        request = js.CancelJobRequest(job_id=job_id, request_id=str(uuid.uuid4()))
        return (await self._sched("CancelJob", request)).job

    async def update_job(
        self, job_id: str, *, priority: int | None = None, max_workers: int | None = None
    ) -> job_pb2.Job:
        request = js.UpdateJobRequest(job_id=job_id, request_id=str(uuid.uuid4()))
        if priority is not None:
            request.priority = priority
        if max_workers is not None:
            request.max_workers = max_workers
        return (await self._sched("UpdateJob", request)).job

    async def watch_job(self, job_id: str) -> AsyncIterator[job_pb2.JobEvent]:
        """The job's events until it ends. Across a scheduler failover the watch resumes on the
        new leader; events older than the last one seen, and a repeat of it, are dropped."""
        last: job_pb2.JobEvent | None = None
        request = js.WatchJobRequest(job_id=job_id)
        async for reply in self._stream("WatchJob", request, resume=True):
            event = reply.event
            if last is not None and (
                event == last or event.time.ToNanoseconds() < last.time.ToNanoseconds()
            ):
                continue
            last = event
            yield event

    async def stream_logs(
        self, job_id: str, *, follow: bool = False, learner_id: str = "", tail_lines: int = 0
    ) -> AsyncIterator[resources_pb2.LogLine]:
        request = js.StreamJobLogsRequest(
            job_id=job_id, follow=follow, learner_id=learner_id, tail_lines=tail_lines
        )
        # A resumed stream (follow, after a scheduler failover) starts again from the whole log:
        # the lines already delivered (by learner and byte offset) are dropped, so none is lost
        # or repeated.
        seen: dict[str, int] = {}  # learner -> the largest offset delivered
        async for reply in self._stream("StreamJobLogs", request, resume=follow):
            for line in reply.lines:
                if follow and line.offset <= seen.get(line.learner_id, -1):
                    continue
                seen[line.learner_id] = line.offset
                yield line
            if follow and request.tail_lines:
                request.tail_lines = 0  # what a resumed stream asks for (sent on reopen only)

    async def get_metrics(
        self, job_id: str, *, after_iteration: int = 0
    ) -> js.GetJobMetricsResponse:
        return await self._sched(
            "GetJobMetrics", js.GetJobMetricsRequest(job_id=job_id, after_iteration=after_iteration)
        )

    async def allocation_history(self, job_id: str = "") -> list[job_pb2.AllocationEvent]:
        reply = await self._sched(
            "GetAllocationHistory", js.GetAllocationHistoryRequest(job_id=job_id)
        )
        return list(reply.events)

    # -- artifacts and models --------------------------------------------------------------

    async def upload_artifact(
        self, data: bytes, *, name: str = "", progress: Progress | None = None
    ) -> str:
        digest = hashlib.sha256(data).hexdigest()

        async def requests() -> AsyncIterator[js.UploadArtifactRequest]:
            header = js.ArtifactHeader(name=name, size_bytes=len(data), sha256=digest)
            yield js.UploadArtifactRequest(header=header)
            view = memoryview(data)
            for offset in range(0, len(data), CHUNK):
                yield js.UploadArtifactRequest(chunk=bytes(view[offset : offset + CHUNK]))
                if progress:
                    progress(min(offset + CHUNK, len(data)), len(data))

        def follow(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None
            self._scheduler.follow(state.outcome.exception())  # type: ignore[arg-type]

        # Content-addressed, so a retry is idempotent: up to ``retries`` more attempts, 0.2 s
        # apart, on the leader a standby named.
        try:
            async for attempt in tenacity.AsyncRetrying(
                retry=tenacity.retry_if_exception(
                    lambda e: isinstance(e, aio.AioRpcError) and e.code() in RETRYABLE
                ),
                stop=tenacity.stop_after_attempt(self.retries + 1),
                wait=tenacity.wait_fixed(0.2),
                before_sleep=follow,
                reraise=True,
            ):
                with attempt:
                    stub = js_grpc.JobSchedulerServiceStub(self._scheduler.channel())
                    reply = await stub.UploadArtifact(requests(), metadata=self.metadata)
                    return str(reply.artifact_id)
        except aio.AioRpcError as err:
            raise ShoalClientError.from_rpc(err, "UploadArtifact", config=self.config) from None
        raise AssertionError("unreachable")

    async def upload_directory(
        self, directory: str | Path, *, progress: Progress | None = None
    ) -> str:
        return await self.upload_artifact(
            pack_directory(directory), name=Path(directory).name, progress=progress
        )

    async def _download(
        self, method: str, request: Any, dest: Path, progress: Progress | None
    ) -> int:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        total = done = 0
        digest = hashlib.sha256()
        expected = ""
        with tmp.open("wb") as fh:
            async for reply in self._stream(method, request):
                if reply.WhichOneof("content") == "header":
                    total, expected = reply.header.size_bytes, reply.header.sha256
                    continue
                fh.write(reply.chunk)
                digest.update(reply.chunk)
                done += len(reply.chunk)
                if progress:
                    progress(done, total)
        if expected and digest.hexdigest() != expected:
            tmp.unlink()
            raise ShoalClientError("DATA_LOSS", f"download of {dest.name} failed its sha256 check")
        tmp.replace(dest)  # never leave a partial file under the final name
        return done

    async def download_model(
        self, job_id: str, dest: str | Path, *, progress: Progress | None = None
    ) -> int:
        return await self._download(
            "DownloadModel", js.DownloadModelRequest(job_id=job_id), Path(dest), progress
        )

    async def download_artifact(self, artifact_id: str, dest: str | Path) -> int:
        return await self._download(
            "DownloadArtifact",
            js.DownloadArtifactRequest(artifact_id=artifact_id),
            Path(dest),
            None,
        )

    # -- hosts -----------------------------------------------------------------------------

    async def list_hosts(self, *, include_lost: bool = False) -> list[resources_pb2.Host]:
        hosts: list[resources_pb2.Host] = []
        token = ""
        while True:
            reply = await self._rmcall(
                "ListHosts", rm.ListHostsRequest(page_token=token, include_lost=include_lost)
            )
            hosts.extend(reply.hosts)
            token = reply.next_page_token
            if not token:
                return hosts

    async def cordon_host(self, host_id: str, *, cordon: bool = True) -> resources_pb2.Host:
        reply = await self._rmcall(
            "CordonHost", rm.CordonHostRequest(host_id=host_id, cordon=cordon)
        )
        return reply.host

    async def drain_host(self, host_id: str) -> resources_pb2.Host:
        return (await self._rmcall("DrainHost", rm.DrainHostRequest(host_id=host_id))).host

    # -- identity, checkpoints and downloads as streams (the dashboard serves these) --------

    async def whoami(self) -> js.GetCallerIdentityResponse:
        """The principal and role this client's credentials map to."""
        return await self._sched("GetCallerIdentity", js.GetCallerIdentityRequest())

    async def list_checkpoints(self, job_id: str) -> list[js.JobCheckpoint]:
        """A job's complete checkpoints, oldest first."""
        out: list[js.JobCheckpoint] = []
        token = ""
        while True:
            reply = await self._sched(
                "ListCheckpoints", js.ListCheckpointsRequest(job_id=job_id, page_token=token)
            )
            out.extend(reply.checkpoints)
            token = reply.next_page_token
            if not token:
                return out

    async def stream_model(self, job_id: str) -> AsyncIterator[js.DownloadModelResponse]:
        """The raw DownloadModel stream: the header, then chunks."""
        async for reply in self._stream("DownloadModel", js.DownloadModelRequest(job_id=job_id)):
            yield reply

    async def stream_checkpoint_file(
        self, job_id: str, checkpoint: str, file: str
    ) -> AsyncIterator[js.DownloadCheckpointResponse]:
        """The raw DownloadCheckpoint stream of one file: the header, then chunks."""
        request = js.DownloadCheckpointRequest(job_id=job_id, checkpoint=checkpoint, file=file)
        async for reply in self._stream("DownloadCheckpoint", request):
            yield reply

    async def download_checkpoint_file(
        self, job_id: str, checkpoint: str, file: str, dest: str | Path
    ) -> int:
        """Write one file of a checkpoint to ``dest`` (checked against its sha256)."""
        request = js.DownloadCheckpointRequest(job_id=job_id, checkpoint=checkpoint, file=file)
        return await self._download("DownloadCheckpoint", request, Path(dest), None)
