"""JobSchedulerService: :class:`JobApi`, the scheduler's API core (its thin gRPC handlers are in
:mod:`shoal.scheduler.handlers`, re-exported here).

:class:`JobApi` never touches grpc: it validates (``shoal.scheduler.jobs``), reads and writes
jobs through :class:`~shoal.scheduler.store.JobTable`, and asks the reconcile loop for a cycle
after every change. Each handler reads the caller (``current_principal``), calls the core and
wraps the answer; domain errors are raised and mapped to status codes by :data:`ERRORS`.

Who may do what: every method is open to the user and service roles (admins always); a learner
(a credential the scheduler minted for one learner of one job) may read its own job (GetJob,
WatchJob, GetJobMetrics, GetAllocationHistory) while the job runs and the learner is one of
its learners, and nothing else. A job is visible to the principal that submitted it, to admins
and to services; anyone else gets NOT_FOUND, exactly as for a job that does not exist. An
artifact is downloadable by its owners (who uploaded it), admins and services only, and a job
may run only an artifact its submitter owns. A SubmitJob whose request_id was used before for
a different spec fails with ALREADY_EXISTS naming the job it created.

Mutating calls (SubmitJob, CancelJob, UpdateJob, UploadArtifact) and WatchJob need the leader;
a standby answers UNAVAILABLE with the leader's address in ``shoal-leader``. Reads (GetJob,
ListJobs, GetAllocationHistory, GetJobMetrics, DownloadArtifact, DownloadModel, StreamJobLogs)
are answered by any replica, from etcd and storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from opentelemetry import trace

from shoal.runtime import telemetry
from shoal.runtime.auth import (
    Principal,
)
from shoal.runtime.errors import (
    AlreadyExists,
    InvalidField,
    JobNotFound,
    NotFound,
    NotLeader,
    PermissionDenied,
)
from shoal.scheduler import checkpoints
from shoal.scheduler.artifacts import ArtifactStore, Storage, read_jsonl_metrics
from shoal.scheduler.handlers import (
    ERRORS,
    ROLES,
    SERVICE_NAME,
    STALE_TRAILER,
    SchedulerServicer,
    binding,
)
from shoal.scheduler.jobs import (
    FINAL_STATES,
    MAX_PRIORITY,
    ArtifactNotFound,
    JobRecord,
    LearnerPhase,
    can_see,
    new_job_record,
    page_jobs,
    spec_digest,
    timestamp,
    validate_spec,
    validate_update,
)
from shoal.scheduler.reconcile.peers import Peers
from shoal.scheduler.store import SERVICE, JobTable, StoreConflict
from shoal.v1 import (
    host_agent_service_pb2 as ha_pb2,
    job_pb2,
    job_scheduler_service_pb2 as js_pb2,
    resources_pb2,
)

__all__ = [
    "ERRORS",
    "ROLES",
    "SERVICE_NAME",
    "STALE_TRAILER",
    "ApiConfig",
    "JobApi",
    "SchedulerServicer",
    "binding",
]

log = logging.getLogger(__name__)

REQUEST_ID_MAX = 128
LOG_BATCH = 500
S = job_pb2


@dataclass(frozen=True)
class ApiConfig:
    """Settings of the API core."""

    user_priority_limit: int = MAX_PRIORITY
    log_poll_s: float = 1.0
    call_timeout_s: float = 10.0


class JobApi:
    """The API core: what each RPC does, without grpc."""

    def __init__(
        self,
        table: JobTable,
        artifacts: ArtifactStore,
        *,
        trigger: Callable[[str], None],
        peers: Peers | None = None,
        config: ApiConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.table = table
        self.artifacts = artifacts
        self.storage: Storage = artifacts.storage
        self.trigger = trigger
        self.peers = peers
        self.config = config or ApiConfig()
        self.clock = clock

    # -- helpers ------------------------------------------------------------------------------

    async def visible(self, principal: Principal, job_id: str) -> JobRecord:
        """The job if the caller may see it; NOT_FOUND otherwise (whether it exists or not)."""
        record = await self.table.get(job_id) if job_id else None
        if record is None or not can_see(principal, record.owner, record.job_id):
            raise JobNotFound(job_id)
        if principal.is_learner and (record.final or principal.learner_id not in record.learners):
            raise JobNotFound(job_id)  # a learner's credential dies with it and with the job
        return record

    @staticmethod
    def _same_request(existing: JobRecord, request_id: str, spec: job_pb2.JobSpec) -> job_pb2.Job:
        """The job a repeated SubmitJob names, if it asked for the same spec."""
        if existing.spec_digest and existing.spec_digest != spec_digest(spec):
            raise AlreadyExists(
                f"request_id {request_id!r} was already used to submit job {existing.job_id} "
                "with a different spec; use a new request_id to submit another job"
            )
        return existing.public()

    @staticmethod
    def _check_request_id(request_id: str) -> None:
        if len(request_id) > REQUEST_ID_MAX:
            raise InvalidField(
                "request_id", request_id[:40] + "...", f"must be at most {REQUEST_ID_MAX} chars"
            )

    # -- jobs ---------------------------------------------------------------------------------

    async def submit(
        self, principal: Principal, request_id: str, spec: job_pb2.JobSpec
    ) -> job_pb2.Job:
        await self.table.require_writable()
        self._check_request_id(request_id)
        clean = validate_spec(
            spec, principal=principal, user_priority_limit=self.config.user_priority_limit
        )
        owner = principal.name
        if request_id:
            async with self.table.request_lock(owner, request_id):
                existing = await self.table.find_request(owner, request_id)
                if existing is not None:
                    return self._same_request(existing, request_id, clean)
                record = await self._create(principal, request_id, clean)
                if record is None:  # raced with a submit that has just stored it
                    existing = await self.table.find_request(owner, request_id)
                    if existing is None:
                        raise StoreConflict(f"request_id {request_id!r} is taken but unreadable")
                    return self._same_request(existing, request_id, clean)
        else:
            record = await self._create(principal, "", clean)
            if record is None:
                raise StoreConflict("a new job id collided; retry")
        self.table.publish(record, S.JOB_EVENT_KIND_STATE)
        self.trigger(f"job {record.job_id} submitted")
        return record.public()

    async def _create(
        self, principal: Principal, request_id: str, spec: job_pb2.JobSpec
    ) -> JobRecord | None:
        # Checked after validation, so that a bad spec is reported first. Someone else's
        # artifact is as unknown as one that does not exist.
        if not await self.artifacts.visible_to(
            principal, spec.artifact_id
        ) or not await self.artifacts.exists(spec.artifact_id):
            raise ArtifactNotFound(spec.artifact_id)
        resume = None
        if spec.resume_from:
            resume = await self._resume_source(principal, spec)
        record = new_job_record(
            spec,
            job_id=self.table.new_job_id(),
            owner=principal.name,
            submit_seq=self.table.next_seq(),
            request_id=request_id,
            now=self.clock(),
        )
        # The job's trace is its submit's: the scheduler's later work for it continues it.
        record.traceparent = telemetry.current_traceparent()
        trace.get_current_span().set_attribute("shoal.job_id", record.job_id)
        if resume is not None:  # before the job exists: it never starts without it
            copied = await checkpoints.copy_checkpoint(
                self.storage, resume[0], resume[1], record.job_id
            )
            log.info(
                "job %s resumes from %s/%s (%d bytes copied)",
                record.job_id,
                resume[0],
                resume[1].name,
                copied,
            )
        created = await self.table.create(record)
        return record if created else None

    async def _resume_source(
        self, principal: Principal, spec: job_pb2.JobSpec
    ) -> tuple[str, job_pb2.JobCheckpoint]:
        """The job and checkpoint ``spec.resume_from`` names, checked: the caller must see
        the job (NOT_FOUND otherwise, as for any job), the checkpoint must be complete, the
        new job's batch size and seed must be the checkpoint's (the data order depends on
        them), and its epochs more than the checkpoint has done (else nothing is left to
        train)."""
        source, name = checkpoints.parse_resume_from(spec.resume_from)
        await self.visible(principal, source)
        checkpoint, manifest = await checkpoints.choose_checkpoint(self.storage, source, name)
        for field, mine in (("batch_size", spec.batch_size), ("seed", spec.seed)):
            theirs = manifest.get(field)
            if theirs is not None and int(theirs) != mine:
                raise InvalidField(
                    f"spec.{field}",
                    mine,
                    f"must equal that of checkpoint {source}/{checkpoint.name} ({theirs})",
                )
        if checkpoint.epoch >= spec.epochs:
            raise InvalidField(
                "spec.epochs",
                spec.epochs,
                f"must be more than the {checkpoint.epoch} epochs checkpoint "
                f"{source}/{checkpoint.name} has done",
            )
        return source, checkpoint

    async def get(self, principal: Principal, job_id: str) -> job_pb2.Job:
        return (await self.visible(principal, job_id)).public()

    async def list_jobs(
        self, principal: Principal, *, page_size: int, page_token: str, states: Sequence[int]
    ) -> tuple[list[job_pb2.Job], str]:
        records = [r for r in await self.table.all() if can_see(principal, r.owner)]
        seqs = {r.job_id: r.submit_seq for r in records}
        return page_jobs(
            [r.public() for r in records],
            seqs,
            states=list(states),
            page_size=page_size,
            page_token=page_token,
        )

    async def cancel(self, principal: Principal, job_id: str, request_id: str) -> job_pb2.Job:
        await self.table.require_writable()
        self._check_request_id(request_id)
        record = await self.visible(principal, job_id)
        if record.final or record.state == S.JOB_STATE_CANCELLING:
            return record.public()  # cancelling again (or a finished job) is a no-op
        now = self.clock()
        target = (
            S.JOB_STATE_CANCELLED
            if record.state == S.JOB_STATE_QUEUED
            else (S.JOB_STATE_CANCELLING)
        )
        reason = f"cancelled by {principal.name}"

        def mutate(r: JobRecord) -> None:
            r.transition(target, reason, now)

        await self.table.update(record, mutate)
        self.table.publish(record, S.JOB_EVENT_KIND_STATE)
        self.trigger(f"job {job_id} cancelled")
        return record.public()

    async def update(
        self,
        principal: Principal,
        job_id: str,
        *,
        priority: int | None,
        max_workers: int | None,
        request_id: str,
    ) -> job_pb2.Job:
        await self.table.require_writable()
        self._check_request_id(request_id)
        record = await self.visible(principal, job_id)
        if priority is None and max_workers is None:
            raise InvalidField("priority", None, "or max_workers must be set")
        limit = self.config.user_priority_limit

        def mutate(r: JobRecord) -> None:
            validate_update(
                r.job,
                priority=priority,
                max_workers=max_workers,
                principal=principal,
                user_priority_limit=limit,
            )
            if priority is not None:
                r.job.spec.priority = priority
            if max_workers is not None:
                r.job.spec.max_workers = max_workers

        await self.table.update(record, mutate)
        changes = []
        if priority is not None:
            changes.append(f"priority of {job_id} changed to {priority}")
        if max_workers is not None:
            changes.append(f"max_workers of {job_id} changed to {max_workers}")
        self.trigger("; ".join(changes))
        return record.public()

    async def watch(self, principal: Principal, job_id: str) -> AsyncIterator[job_pb2.JobEvent]:
        self.table.require_leader()
        record = await self.visible(principal, job_id)
        async with self.table.subscribe(job_id) as sub:
            yield job_pb2.JobEvent(
                kind=S.JOB_EVENT_KIND_STATE, job=record.public(), time=timestamp(self.clock())
            )
            if record.final:
                return
            while True:
                event = await sub.queue.get()
                if event.kind == S.JOB_EVENT_KIND_UNSPECIFIED:
                    raise NotLeader(SERVICE, self.table.leader_address)
                yield event
                if event.kind == S.JOB_EVENT_KIND_STATE and event.job.state in FINAL_STATES:
                    return

    async def allocation_history(
        self, principal: Principal, job_id: str
    ) -> list[job_pb2.AllocationEvent]:
        if job_id:
            await self.visible(principal, job_id)
            return await self.table.history(job_id)
        if principal.is_learner:
            raise PermissionDenied(f"{principal.name} may read only its own job: name its job_id")
        events: list[job_pb2.AllocationEvent] = []
        for record in await self.table.all():
            if can_see(principal, record.owner):
                events.extend(await self.table.history(record.job_id))
        events.sort(key=lambda e: (e.time.seconds, e.time.nanos, e.job_id))
        return events

    # -- artifacts, model, metrics ------------------------------------------------------------

    async def upload(
        self,
        header: js_pb2.ArtifactHeader,
        chunks: AsyncIterator[bytes],
        principal: Principal | None = None,
    ) -> js_pb2.UploadArtifactResponse:
        await self.table.require_writable()
        info = await self.artifacts.upload(
            name=header.name,
            declared_size=header.size_bytes,
            declared_sha256=header.sha256,
            chunks=chunks,
            owner=principal,
        )
        return js_pb2.UploadArtifactResponse(
            artifact_id=info.artifact_id, size_bytes=info.size_bytes
        )

    async def download_artifact(
        self, artifact_id: str, principal: Principal | None = None
    ) -> tuple[js_pb2.ArtifactHeader, AsyncIterator[bytes]]:
        self.artifacts.check_id(artifact_id)
        if principal is not None and not await self.artifacts.visible_to(principal, artifact_id):
            raise ArtifactNotFound(artifact_id)
        info, chunks = await self.artifacts.download(artifact_id)
        header = js_pb2.ArtifactHeader(
            name=info.name, size_bytes=info.size_bytes, sha256=info.artifact_id
        )
        return header, chunks

    async def download_model(
        self, principal: Principal, job_id: str
    ) -> tuple[js_pb2.ArtifactHeader, AsyncIterator[bytes]]:
        await self.visible(principal, job_id)
        path = self.storage.model_path(job_id)
        if not await self.storage.exists(path):
            raise NotFound("model of job", job_id)
        size = await self.storage.size(path)
        header = js_pb2.ArtifactHeader(name="model.safetensors", size_bytes=size)
        return header, self.storage.read_chunks(path)

    async def metrics(
        self, principal: Principal, job_id: str, after_iteration: int
    ) -> js_pb2.GetJobMetricsResponse:
        await self.visible(principal, job_id)
        if after_iteration < 0:
            raise InvalidField("after_iteration", after_iteration, "must be >= 0")
        iterations, epochs = await asyncio.gather(
            self.storage.read_metrics(job_id, "iterations.jsonl"),
            self.storage.read_metrics(job_id, "epochs.jsonl"),
        )
        return js_pb2.GetJobMetricsResponse(
            iterations=read_jsonl_metrics(iterations, job_pb2.IterationMetric)[after_iteration:],
            epochs=read_jsonl_metrics(epochs, job_pb2.EpochMetric),
        )

    async def checkpoints(
        self, principal: Principal, job_id: str, *, page_size: int, page_token: str
    ) -> js_pb2.ListCheckpointsResponse:
        await self.visible(principal, job_id)
        listed = await checkpoints.list_checkpoints(self.storage, job_id)
        page, token = checkpoints.page_checkpoints(
            listed, page_size=page_size, page_token=page_token
        )
        return js_pb2.ListCheckpointsResponse(checkpoints=page, next_page_token=token)

    async def download_checkpoint(
        self, principal: Principal, job_id: str, checkpoint: str, file: str
    ) -> tuple[js_pb2.ArtifactHeader, AsyncIterator[bytes]]:
        await self.visible(principal, job_id)
        path, sha256 = await checkpoints.checkpoint_file_path(
            self.storage, job_id, checkpoint, file
        )
        if not await self.storage.exists(path):
            raise NotFound(f"file of checkpoint {checkpoint!r}", file)
        size = await self.storage.size(path)
        header = js_pb2.ArtifactHeader(name=file, size_bytes=size, sha256=sha256)
        return header, self.storage.read_chunks(path)

    # -- logs ---------------------------------------------------------------------------------

    async def logs(
        self, principal: Principal, request: js_pb2.StreamJobLogsRequest
    ) -> AsyncIterator[list[resources_pb2.LogLine]]:
        """Batches of log lines: the backlog of every learner merged by time (the last
        ``tail_lines`` of it), then, with ``follow``, new lines as they come, from learners
        that start later too, until the job has ended and its learners' streams are done."""
        record = await self.visible(principal, request.job_id)
        if request.tail_lines < 0:
            raise InvalidField("tail_lines", request.tail_lines, "must be >= 0 (0: all)")
        if self.peers is None:
            return
        wanted = request.learner_id
        sources = _log_sources(record)
        if wanted and wanted not in sources:
            raise NotFound("learner", wanted, reason="ERROR_REASON_LEARNER_NOT_FOUND")
        if wanted:
            sources = {wanted: sources[wanted]}

        last: dict[str, int] = {}
        backlog_parts = await asyncio.gather(
            *(self._read_log(lid, addr, None, follow=False) for lid, addr in sources.items())
        )
        backlog = [line for part in backlog_parts for line in part]
        for line in backlog:
            last[line.learner_id] = max(last.get(line.learner_id, -1), line.offset)
        backlog.sort(key=lambda ln: (ln.time.seconds, ln.time.nanos, ln.learner_id, ln.offset))
        if request.tail_lines:
            backlog = backlog[-request.tail_lines :]
        for i in range(0, len(backlog), LOG_BATCH):
            yield backlog[i : i + LOG_BATCH]
        if not request.follow:
            return

        queue: asyncio.Queue[resources_pb2.LogLine] = asyncio.Queue(10_000)
        followers: dict[str, asyncio.Task[None]] = {}
        heard: set[str] = set()  # learners whose agent answered with lines

        async def follow(learner_id: str, address: str) -> None:
            await self._read_log(
                learner_id, address, last.get(learner_id), follow=True, sink=queue, last=last
            )

        def start_followers(current: JobRecord | None) -> None:
            for lid, addr in (_log_sources(current) if current else sources).items():
                if wanted and lid != wanted:
                    continue
                task = followers.get(lid)
                if task is None or (task.done() and _follow_again(current, lid, heard)):
                    followers[lid] = asyncio.create_task(follow(lid, addr))

        try:
            start_followers(None)
            while True:
                batch = await _drain(queue, self.config.log_poll_s)
                if batch:
                    yield batch
                    continue
                current = await self.table.get(record.job_id)
                if current is None:
                    return
                heard.update(last)
                start_followers(current)
                if current.final and all(t.done() for t in followers.values()):
                    rest = await _drain(queue, 0)
                    if rest:
                        yield rest
                    return
        finally:
            for task in followers.values():
                task.cancel()
            await asyncio.gather(*followers.values(), return_exceptions=True)

    async def _read_log(
        self,
        learner_id: str,
        address: str,
        after: int | None,
        *,
        follow: bool,
        sink: asyncio.Queue[resources_pb2.LogLine] | None = None,
        last: dict[str, int] | None = None,
    ) -> list[resources_pb2.LogLine]:
        """A learner's lines from its agent (after byte offset ``after``); into ``sink``
        when following (``last`` keeps the offset of the last line sent). Errors (the host is
        gone) end the stream quietly."""
        assert self.peers is not None
        out: list[resources_pb2.LogLine] = []
        request = ha_pb2.StreamLearnerLogsRequest(
            learner_id=learner_id, offset=max(after or 0, 0), follow=follow
        )
        timeout = None if follow else self.config.call_timeout_s
        async for response in self.peers.learner_log_responses(address, request, timeout):
            for line in response.lines:
                if after is not None and line.offset <= after:
                    continue  # resumed at the last line seen: already sent
                if not line.learner_id:
                    line.learner_id = learner_id
                if sink is not None:
                    await sink.put(line)
                    if last is not None:
                        last[learner_id] = max(last.get(learner_id, -1), line.offset)
                else:
                    out.append(line)
        return out


def _log_sources(record: JobRecord) -> dict[str, str]:
    """Learner id -> agent address of every learner of the job that ever ran."""
    sources = {p.learner_id: p.agent_address for p in record.past_learners if p.agent_address}
    for lr in record.learners.values():
        if lr.agent_address and lr.allocation_id:
            sources[lr.learner_id] = lr.agent_address
    return sources


def _follow_again(record: JobRecord | None, learner_id: str, heard: set[str]) -> bool:
    """Whether a follower whose stream ended without a line should ask the agent again: the
    learner is still starting or running (its agent did not know it yet when asked, e.g.
    before StartLearner, or while the artifact was fetched). A learner that is building its
    environment is known to its agent, whose lines then stream while pip runs."""
    if record is None or learner_id in heard:
        return False
    lr = record.learners.get(learner_id)
    return lr is not None and lr.phase in (LearnerPhase.STARTING, LearnerPhase.RUNNING)


async def _drain(
    queue: asyncio.Queue[resources_pb2.LogLine], wait: float
) -> list[resources_pb2.LogLine]:
    out: list[resources_pb2.LogLine] = []
    if queue.empty() and wait > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                out.append(await queue.get())
    while not queue.empty() and len(out) < LOG_BATCH:
        out.append(queue.get_nowait())
    return out
