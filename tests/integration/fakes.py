"""In-process gRPC fakes of the services the job-scheduler drives, faithful to their protos.

* :class:`FakeResourceManager`: hosts, the allocation ledger (all-or-nothing AcquireDevices,
  idempotent by request id, fenced: a token older than the newest one seen is refused with
  FAILED_PRECONDITION / ERROR_REASON_FENCED_OUT), WatchInventory (SNAPSHOT, then HOST_UP,
  HOST_LOST with the allocations it held, which leave the ledger as the real one does,
  ALLOCATED, RELEASED, LEARNER_EXITED).
* :class:`FakeHostAgent`: StartLearner (idempotent by learner id, records the environment),
  StopLearner (the learner exits with -15), ListLearners, StreamLearnerLogs (follow-able);
  every exit is reported to the resource-manager, as a real agent does by heartbeat.
* :class:`FakeParameterSync`: S shards sharing one data plane. OpenJob, RetireLearners (the
  learner exits with code 0 at its "next boundary"), EvictLearner, GetJobProgress (progress
  advances while the job has members), CloseJob.

:class:`FakeCluster` wires them: ``await FakeCluster.start(hosts=2, gpus=4, shards=2)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from google.protobuf.timestamp_pb2 import Timestamp

from shoal.contract.errors import StaleCoordinator
from shoal.runtime.auth import SERVICES, USERS_AND_SERVICES, MethodRoles
from shoal.runtime.config import ServerConfig
from shoal.runtime.errors import FailedPrecondition, FencedOut, InvalidField, NotFound, Unavailable
from shoal.runtime.server import RunningServer, ServiceBinding, create_server
from shoal.v1 import (
    host_agent_service_pb2 as ha_pb2,
    host_agent_service_pb2_grpc,
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc,
    resource_manager_service_pb2 as rm_pb2,
    resource_manager_service_pb2_grpc,
    resources_pb2,
)

K = rm_pb2


def _now() -> Timestamp:
    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


def _config(name: str) -> ServerConfig:
    return ServerConfig(service_name=name, allow_no_auth=True)


class _Fencing:
    """Accepts the newest token seen; refuses older ones."""

    def __init__(self) -> None:
        self.newest = 0
        self.refused = 0

    def check(self, token: resources_pb2.FencingToken) -> None:
        if token.revision < self.newest:
            self.refused += 1
            raise FencedOut(
                f"fencing_token (revision {token.revision}) is older than {self.newest}"
            )
        self.newest = token.revision


# --------------------------------------------------------------------------------------------
# Resource manager
# --------------------------------------------------------------------------------------------


class FakeResourceManager(resource_manager_service_pb2_grpc.ResourceManagerServiceServicer):
    def __init__(self) -> None:
        self.hosts: dict[str, resources_pb2.Host] = {}
        self.ledger: dict[str, resources_pb2.Allocation] = {}
        self.requests: dict[str, list[resources_pb2.Allocation]] = {}
        self.watchers: set[asyncio.Queue[rm_pb2.WatchInventoryResponse]] = set()
        self.fencing = _Fencing()
        self.acquired = 0
        self.released_ids: list[str] = []
        self._ids = itertools.count(1)

    # -- test controls ------------------------------------------------------------------------

    def emit(self, event: rm_pb2.WatchInventoryResponse) -> None:
        for queue in self.watchers:
            queue.put_nowait(event)

    def add_host(self, host_id: str, agent_address: str, gpus: int) -> resources_pb2.Host:
        old = self.hosts.get(host_id)
        incarnation = old.incarnation + 1 if old is not None else 1
        host = resources_pb2.Host(
            host_id=host_id,
            agent_address=agent_address,
            incarnation=incarnation,
            state=resources_pb2.HOST_STATE_READY,
            resource_group="default",
            devices=[
                resources_pb2.Device(
                    device_id=f"gpu{i}",
                    index=i,
                    uuid=f"GPU-{host_id}-{i}",
                    model="simulated",
                    health=resources_pb2.DEVICE_HEALTH_HEALTHY,
                    simulated=True,
                )
                for i in range(gpus)
            ],
            register_time=_now(),
        )
        self.hosts[host_id] = host
        self.emit(rm_pb2.WatchInventoryResponse(kind=K.INVENTORY_EVENT_KIND_HOST_UP, hosts=[host]))
        return host

    def lose_host(self, host_id: str) -> None:
        host = self.hosts[host_id]
        host.state = resources_pb2.HOST_STATE_LOST
        held = [a for a in self.ledger.values() if a.host_id == host_id]
        for a in held:
            del self.ledger[a.allocation_id]
        self.emit(
            rm_pb2.WatchInventoryResponse(
                kind=K.INVENTORY_EVENT_KIND_HOST_LOST, hosts=[host], allocations=held
            )
        )

    def learner_exited(self, learner: resources_pb2.Learner) -> None:
        self.emit(
            rm_pb2.WatchInventoryResponse(
                kind=K.INVENTORY_EVENT_KIND_LEARNER_EXITED, learner=learner
            )
        )

    def allocations_of(self, job_id: str) -> list[resources_pb2.Allocation]:
        return [a for a in self.ledger.values() if a.job_id == job_id]

    # -- RPCs ---------------------------------------------------------------------------------

    def _listed_hosts(self) -> list[resources_pb2.Host]:
        out = []
        for host in self.hosts.values():
            copy = resources_pb2.Host()
            copy.CopyFrom(host)
            for device in copy.devices:
                for a in self.ledger.values():
                    if a.host_id == host.host_id and a.device_id == device.device_id:
                        device.allocation.CopyFrom(a)
            out.append(copy)
        return out

    async def ListHosts(self, request, context):  # type: ignore[no-untyped-def]
        return rm_pb2.ListHostsResponse(hosts=self._listed_hosts())

    async def GetHost(self, request, context):  # type: ignore[no-untyped-def]
        if request.host_id not in self.hosts:
            raise NotFound("host", request.host_id, reason="ERROR_REASON_HOST_NOT_FOUND")
        host = next(h for h in self._listed_hosts() if h.host_id == request.host_id)
        return rm_pb2.GetHostResponse(host=host)

    async def ListAllocations(self, request, context):  # type: ignore[no-untyped-def]
        allocations = [
            a for a in self.ledger.values() if not request.job_id or a.job_id == request.job_id
        ]
        return rm_pb2.ListAllocationsResponse(allocations=allocations)

    async def AcquireDevices(self, request, context):  # type: ignore[no-untyped-def]
        self.fencing.check(request.fencing_token)
        if request.request_id and request.request_id in self.requests:
            return rm_pb2.AcquireDevicesResponse(allocations=self.requests[request.request_id])
        if not request.claims:
            raise InvalidField("claims", [], "must name at least one device")
        busy = {(a.host_id, a.device_id) for a in self.ledger.values()}
        learners = {a.learner_id for a in self.ledger.values()}
        new = []
        for i, claim in enumerate(request.claims):
            host = self.hosts.get(claim.host_id)
            if host is None:
                raise NotFound("host", claim.host_id, reason="ERROR_REASON_HOST_NOT_FOUND")
            if not any(d.device_id == claim.device_id for d in host.devices):
                raise NotFound("device", claim.device_id, reason="ERROR_REASON_DEVICE_NOT_FOUND")
            if host.state != resources_pb2.HOST_STATE_READY or host.cordoned:
                raise FailedPrecondition(
                    f"host {claim.host_id!r} is unavailable", reason="ERROR_REASON_HOST_UNAVAILABLE"
                )
            if (claim.host_id, claim.device_id) in busy:
                raise FailedPrecondition(
                    f"claims[{i}]: device {claim.device_id} of {claim.host_id} is busy",
                    reason="ERROR_REASON_DEVICE_BUSY",
                )
            if claim.learner_id in learners:
                raise FailedPrecondition(f"learner {claim.learner_id} already holds a device")
            busy.add((claim.host_id, claim.device_id))
            learners.add(claim.learner_id)
            new.append(
                resources_pb2.Allocation(
                    allocation_id=f"a-{next(self._ids)}",
                    job_id=claim.job_id,
                    learner_id=claim.learner_id,
                    host_id=claim.host_id,
                    device_id=claim.device_id,
                    host_incarnation=host.incarnation,
                    create_time=_now(),
                )
            )
        for a in new:
            self.ledger[a.allocation_id] = a
        self.acquired += len(new)
        if request.request_id:
            self.requests[request.request_id] = new
        self.emit(
            rm_pb2.WatchInventoryResponse(kind=K.INVENTORY_EVENT_KIND_ALLOCATED, allocations=new)
        )
        return rm_pb2.AcquireDevicesResponse(allocations=new)

    async def ReleaseDevices(self, request, context):  # type: ignore[no-untyped-def]
        self.fencing.check(request.fencing_token)
        freed = [self.ledger.pop(a) for a in request.allocation_ids if a in self.ledger]
        self.released_ids.extend(a.allocation_id for a in freed)
        if freed:
            self.emit(
                rm_pb2.WatchInventoryResponse(
                    kind=K.INVENTORY_EVENT_KIND_RELEASED, allocations=freed
                )
            )
        return rm_pb2.ReleaseDevicesResponse(
            released_allocation_ids=[a.allocation_id for a in freed]
        )

    async def WatchInventory(self, request, context):  # type: ignore[no-untyped-def]
        queue: asyncio.Queue[rm_pb2.WatchInventoryResponse] = asyncio.Queue()
        self.watchers.add(queue)
        try:
            yield rm_pb2.WatchInventoryResponse(
                kind=K.INVENTORY_EVENT_KIND_SNAPSHOT,
                hosts=self._listed_hosts(),
                allocations=list(self.ledger.values()),
            )
            while True:
                yield await queue.get()
        finally:
            self.watchers.discard(queue)


# --------------------------------------------------------------------------------------------
# Host agent
# --------------------------------------------------------------------------------------------


@dataclass
class FakeLearner:
    learner: resources_pb2.Learner
    request: ha_pb2.StartLearnerRequest
    lines: list[resources_pb2.LogLine] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.learner.state in (
            resources_pb2.LEARNER_STATE_STARTING,
            resources_pb2.LEARNER_STATE_RUNNING,
        )


class FakeHostAgent(host_agent_service_pb2_grpc.HostAgentServiceServicer):
    def __init__(self, host_id: str, rm: FakeResourceManager) -> None:
        self.host_id = host_id
        self.rm = rm
        self.learners: dict[str, FakeLearner] = {}
        self.starts = 0
        self.alive = True
        self.fencing = _Fencing()
        self.hold_starts: asyncio.Event | None = None  # StartLearner waits for it when set
        self.unknown_log_requests = 0  # StreamLearnerLogs of learners it did not know

    def running(self, job_id: str | None = None) -> list[FakeLearner]:
        return [
            fl
            for fl in self.learners.values()
            if fl.running and (job_id is None or fl.learner.job_id == job_id)
        ]

    def log(self, learner_id: str, text: str) -> None:
        fl = self.learners[learner_id]
        offset = sum(len(ln.text) + 1 for ln in fl.lines)
        fl.lines.append(
            resources_pb2.LogLine(
                learner_id=learner_id,
                stream=resources_pb2.LOG_STREAM_STDOUT,
                text=text,
                time=_now(),
                offset=offset,
            )
        )
        fl.changed.set()

    def exit(self, learner_id: str, code: int, reason: str = "", *, report: bool = True) -> None:
        fl = self.learners.get(learner_id)
        if fl is None or not fl.running:
            return
        learner = fl.learner
        learner.state = (
            resources_pb2.LEARNER_STATE_SUCCEEDED
            if code == 0
            else resources_pb2.LEARNER_STATE_FAILED
        )
        learner.exit_code = code
        learner.exit_reason = reason or f"exited with code {code}"
        learner.pid = 0
        learner.end_time.CopyFrom(_now())
        fl.changed.set()
        if report and self.alive:
            self.rm.learner_exited(learner)

    def die(self) -> None:
        """The host is gone: learners vanish without reports."""
        self.alive = False
        for lid in list(self.learners):
            self.exit(lid, -9, "host died", report=False)

    async def StartLearner(self, request, context):  # type: ignore[no-untyped-def]
        self.fencing.check(request.fencing_token)
        if self.hold_starts is not None:
            await self.hold_starts.wait()
        existing = self.learners.get(request.learner_id)
        if existing is not None:
            return ha_pb2.StartLearnerResponse(learner=existing.learner)
        if not request.entry_point:
            raise InvalidField("entry_point", "", "must not be empty")
        if request.entry_point == "missing.py":
            raise NotFound("entry point", request.entry_point)
        for fl in self.running():
            if fl.learner.device_id == request.device_id:
                raise FailedPrecondition(f"device {request.device_id} is busy")
        learner = resources_pb2.Learner(
            learner_id=request.learner_id,
            job_id=request.job_id,
            host_id=self.host_id,
            device_id=request.device_id,
            state=resources_pb2.LEARNER_STATE_RUNNING,
            pid=10000 + self.starts,
            start_time=_now(),
        )
        self.learners[request.learner_id] = FakeLearner(learner, request)
        self.starts += 1
        self.log(request.learner_id, f"learner {request.learner_id} started")
        return ha_pb2.StartLearnerResponse(learner=learner)

    async def StopLearner(self, request, context):  # type: ignore[no-untyped-def]
        fl = self.learners.get(request.learner_id)
        if fl is None:
            raise NotFound("learner", request.learner_id, reason="ERROR_REASON_LEARNER_NOT_FOUND")
        self.exit(request.learner_id, -15, "stopped (SIGTERM)")
        return ha_pb2.StopLearnerResponse(learner=fl.learner)

    async def ListLearners(self, request, context):  # type: ignore[no-untyped-def]
        return ha_pb2.ListLearnersResponse(
            learners=[
                fl.learner
                for fl in self.learners.values()
                if not request.job_id or fl.learner.job_id == request.job_id
            ]
        )

    async def StreamLearnerLogs(self, request, context):  # type: ignore[no-untyped-def]
        fl = self.learners.get(request.learner_id)
        if fl is None:
            self.unknown_log_requests += 1
            raise NotFound("learner", request.learner_id, reason="ERROR_REASON_LEARNER_NOT_FOUND")
        sent = 0
        while True:
            fl.changed.clear()
            lines = [ln for ln in fl.lines[sent:] if ln.offset >= request.offset]
            sent = len(fl.lines)
            if lines:
                yield ha_pb2.StreamLearnerLogsResponse(lines=lines)
            if not request.follow or not fl.running:
                return
            await fl.changed.wait()

    async def GetDeviceStatus(self, request, context):  # type: ignore[no-untyped-def]
        return ha_pb2.GetDeviceStatusResponse(devices=list(self.rm.hosts[self.host_id].devices))


# --------------------------------------------------------------------------------------------
# Parameter sync
# --------------------------------------------------------------------------------------------


@dataclass
class FakeSyncJob:
    job_id: str
    spec: job_pb2.JobSpec
    storage_uri: str
    shard_addresses: list[str]
    progress: job_pb2.JobProgress = field(default_factory=job_pb2.JobProgress)
    retiring: set[str] = field(default_factory=set)
    evicted: list[str] = field(default_factory=list)
    done: bool = False
    checkpoint_error: str = ""  # GetJobProgressResponse.checkpoint_error
    latest_checkpoint: int = -1  # GetJobProgressResponse.latest_checkpoint
    closed: bool = False
    opened: int = 0


class FakeParameterSync:
    """The data plane shared by the shard servers."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.jobs: dict[str, FakeSyncJob] = {}
        self.fencing = _Fencing()
        self.open_calls: list[tuple[int, str]] = []
        self.open_epochs: list[tuple[str, int]] = []  # job, OpenJobRequest.coordinator_epoch
        # OpenJob calls refused as a shard that knows a newer coordinator epoch would.
        self.stale_opens = 0
        # Overridable where the learners are real processes on real agents: who runs for a
        # job, and how a learner leaves at its boundary.
        self.members_hook: Callable[[str], list[str]] | None = None
        self.leave_hook: Callable[[str, int, str], None] | None = None
        # Shards that are "dead": every call to them fails with UNAVAILABLE.
        self.down: set[int] = set()
        # Whether the shards take a lost coordinator's role over (TakeOverJob; otherwise they
        # refuse it, as a data plane that cannot: the scheduler's checkpoint path).
        self.takeover = False
        self.takeover_calls: list[tuple[int, str, int, int]] = []  # shard, job, lost, epoch
        self.takeover_modes: list[int] = []  # TakeOverJobRequest.sync_mode of each call
        # Who coordinates each job whose role moved (a takeover), and at which epoch: what
        # every shard answers FindCoordinator with. A TakeOverJob below it, or at it on
        # another shard, is refused (STALE_COORDINATOR), as the real shards do.
        self.coordinators: dict[str, tuple[int, int]] = {}

    def members(self, job_id: str) -> list[str]:
        if self.members_hook is not None:
            return sorted(self.members_hook(job_id))
        return sorted(fl.learner.learner_id for fl in self.cluster.running(job_id))

    def leave(self, learner_id: str, code: int, reason: str) -> None:
        if self.leave_hook is not None:
            self.leave_hook(learner_id, code, reason)
        else:
            self.cluster.exit_learner(learner_id, code, reason)

    def tick(self) -> None:
        """One iteration of every open job with members."""
        for job in self.jobs.values():
            members = [m for m in self.members(job.job_id) if m not in job.retiring]
            if job.closed or job.done or not members:
                continue
            p = job.progress
            p.completed_iterations += 1
            p.samples_processed += job.spec.batch_size
            p.world_size = len(members)
            p.iteration += 1
            p.last_loss = 1.0 / (1 + p.completed_iterations)
            p.update_time.GetCurrentTime()
            # Retiring learners leave at the boundary.
            for lid in sorted(job.retiring):
                self.leave(lid, 0, "retired")
            job.retiring.clear()

    def finish(self, job_id: str) -> None:
        """All epochs ran: every learner gets DONE at its boundary and exits 0."""
        job = self.jobs[job_id]
        job.done = True
        for lid in self.members(job_id):
            self.leave(lid, 0, "done")


class FakeShard(parameter_sync_service_pb2_grpc.ParameterSyncServiceServicer):
    def __init__(self, index: int, sync: FakeParameterSync) -> None:
        self.index = index
        self.sync = sync

    def _up(self) -> None:
        if self.index in self.sync.down:
            raise Unavailable(f"fake shard {self.index} is down")

    def _job(self, job_id: str) -> FakeSyncJob:
        self._up()
        job = self.sync.jobs.get(job_id)
        if job is None or job.closed:
            raise NotFound("job", job_id, reason="ERROR_REASON_JOB_NOT_FOUND")
        return job

    async def OpenJob(self, request, context):  # type: ignore[no-untyped-def]
        self._up()
        self.sync.fencing.check(request.fencing_token)
        self.sync.open_calls.append((self.index, request.job_id))
        self.sync.open_epochs.append((request.job_id, request.coordinator_epoch))
        if self.sync.stale_opens > 0:
            self.sync.stale_opens -= 1
            raise StaleCoordinator(
                f"coordinator_epoch ({request.coordinator_epoch}) of job {request.job_id!r} is "
                "older than the current coordinator's"
            )
        job = self.sync.jobs.get(request.job_id)
        if job is None or job.closed:
            job = FakeSyncJob(
                request.job_id, request.spec, request.storage_uri, list(request.shard_addresses)
            )
            self.sync.jobs[request.job_id] = job
        job.opened += 1
        return ps_pb2.OpenJobResponse(
            progress=job.progress,
            resumed=job.opened > 1,
            coordinator_epoch=request.coordinator_epoch,  # the floor it was given: taken
        )

    async def CloseJob(self, request, context):  # type: ignore[no-untyped-def]
        self._up()
        self.sync.fencing.check(request.fencing_token)
        self._job(request.job_id).closed = True
        return ps_pb2.CloseJobResponse()

    async def RetireLearners(self, request, context):  # type: ignore[no-untyped-def]
        self.sync.fencing.check(request.fencing_token)
        job = self._job(request.job_id)
        job.retiring.update(request.learner_ids)
        return ps_pb2.RetireLearnersResponse(effective_generation=job.progress.generation + 1)

    async def EvictLearner(self, request, context):  # type: ignore[no-untyped-def]
        self.sync.fencing.check(request.fencing_token)
        job = self._job(request.job_id)
        job.evicted.append(request.learner_id)
        return ps_pb2.EvictLearnerResponse(aborted_iteration=job.progress.completed_iterations)

    async def TakeOverJob(self, request, context):  # type: ignore[no-untyped-def]
        self._up()
        self.sync.fencing.check(request.fencing_token)
        if not self.sync.takeover:
            raise FailedPrecondition("this fake data plane does not fail its coordinator over")
        job = self._job(request.job_id)
        self.sync.takeover_calls.append(
            (self.index, request.job_id, request.lost_shard_index, request.coordinator_epoch)
        )
        self.sync.takeover_modes.append(request.sync_mode)
        index, epoch = self.sync.coordinators.get(request.job_id, (-1, 0))
        if request.coordinator_epoch < epoch or (
            request.coordinator_epoch == epoch and index != self.index
        ):
            raise StaleCoordinator(
                f"coordinator_epoch ({request.coordinator_epoch}) of job {request.job_id!r} is "
                f"not above the current coordinator's ({epoch}, shard {index})"
            )
        self.sync.coordinators[request.job_id] = (self.index, request.coordinator_epoch)
        return ps_pb2.TakeOverJobResponse(progress=job.progress)

    async def FindCoordinator(self, request, context):  # type: ignore[no-untyped-def]
        self._up()
        index, epoch = self.sync.coordinators.get(request.job_id, (-1, 0))
        if index < 0:
            return ps_pb2.FindCoordinatorResponse()
        return ps_pb2.FindCoordinatorResponse(
            coordinator_address=self.sync.cluster.shard_addresses[index], coordinator_epoch=epoch
        )

    async def GetJobProgress(self, request, context):  # type: ignore[no-untyped-def]
        job = self._job(request.job_id)
        return ps_pb2.GetJobProgressResponse(
            progress=job.progress,
            member_learner_ids=self.sync.members(request.job_id),
            done=job.done,
            checkpoint_error=job.checkpoint_error,
            latest_checkpoint=job.latest_checkpoint,
        )


# --------------------------------------------------------------------------------------------
# The cluster
# --------------------------------------------------------------------------------------------


class FakeCluster:
    """A resource-manager, host agents with ``gpus`` simulated GPUs each, and sync shards."""

    def __init__(self) -> None:
        self.rm = FakeResourceManager()
        self.agents: dict[str, FakeHostAgent] = {}
        self.agent_servers: dict[str, RunningServer] = {}
        self.sync = FakeParameterSync(self)
        self.shards: list[FakeShard] = []
        self.servers: list[RunningServer] = []
        self.rm_address = ""
        self.shard_addresses: list[str] = []
        self._ticker: asyncio.Task[None] | None = None
        self.tick_interval = 0.02

    @classmethod
    async def start(cls, *, hosts: int = 2, gpus: int = 4, shards: int = 2) -> FakeCluster:
        self = cls()
        server = await create_server(
            _config("fake-rm"),
            [
                ServiceBinding(
                    "shoal.v1.ResourceManagerService",
                    resource_manager_service_pb2_grpc.add_ResourceManagerServiceServicer_to_server,
                    self.rm,
                    MethodRoles("shoal.v1.ResourceManagerService", USERS_AND_SERVICES),
                )
            ],
        )
        self.servers.append(server)
        self.rm_address = server.address
        for i in range(shards):
            shard = FakeShard(i, self.sync)
            server = await create_server(
                _config(f"fake-shard-{i}"),
                [
                    ServiceBinding(
                        "shoal.v1.ParameterSyncService",
                        parameter_sync_service_pb2_grpc.add_ParameterSyncServiceServicer_to_server,
                        shard,
                        MethodRoles("shoal.v1.ParameterSyncService", SERVICES),
                    )
                ],
            )
            self.servers.append(server)
            self.shards.append(shard)
            self.shard_addresses.append(server.address)
        for i in range(hosts):
            await self.add_host(f"h{i + 1}", gpus)
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def add_host(self, host_id: str, gpus: int) -> FakeHostAgent:
        agent = FakeHostAgent(host_id, self.rm)
        server = await create_server(
            _config(f"fake-agent-{host_id}"),
            [
                ServiceBinding(
                    "shoal.v1.HostAgentService",
                    host_agent_service_pb2_grpc.add_HostAgentServiceServicer_to_server,
                    agent,
                    MethodRoles("shoal.v1.HostAgentService", SERVICES),
                )
            ],
        )
        self.agents[host_id] = agent
        self.agent_servers[host_id] = server
        self.servers.append(server)
        self.rm.add_host(host_id, server.address, gpus)
        return agent

    def lose_host(self, host_id: str) -> None:
        self.agents[host_id].die()
        self.rm.lose_host(host_id)

    def running(self, job_id: str | None = None) -> list[FakeLearner]:
        return [fl for agent in self.agents.values() for fl in agent.running(job_id)]

    def workers(self, job_id: str) -> int:
        return len(self.running(job_id))

    def learner(self, learner_id: str) -> FakeLearner | None:
        for agent in self.agents.values():
            if learner_id in agent.learners:
                return agent.learners[learner_id]
        return None

    def exit_learner(self, learner_id: str, code: int, reason: str = "") -> None:
        for agent in self.agents.values():
            if learner_id in agent.learners:
                agent.exit(learner_id, code, reason)

    @property
    def starts(self) -> int:
        return sum(agent.starts for agent in self.agents.values())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval)
            self.sync.tick()

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for server in self.servers:
            await server.stop(0)


async def chunked(data: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def monotonic() -> float:
    return time.monotonic()
