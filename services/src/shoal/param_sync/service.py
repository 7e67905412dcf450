"""The ParameterSyncService servicer: thin handlers over the coordinator (``coordinator.py``)
and the shard slices (``shard.py``).

One process is one shard. For the jobs it coordinates (those opened on it with ``OpenJob``) it
also holds their :class:`~shoal.param_sync.coordinator.Coordinator`. Calls between the
coordinator and the shards (ConfigureShard, ShardReady, ResolveIteration, SaveShard,
LoadShard, GetMembership, CloseJob) go over gRPC with the service token, or straight to the
local implementation when the other end is this process.

Tensor math (summing contributions, the optimizer step, encoding, checkpoint files) runs on
one compute thread, one call at a time, so the event loop keeps receiving other learners'
streams meanwhile (numpy and torch release the GIL).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import safetensors.torch
from google.protobuf import timestamp_pb2
from grpc import aio

from shoal.contract.errors import decode_rpc_error
from shoal.contract.wire import (
    DEFAULT_CHUNK_BYTES,
    Frame,
    TensorMeta,
    encode_header,
    frame_decoder,
    serialize,
)
from shoal.param_sync import checkpoint as ckpt, faults
from shoal.param_sync.authz import (
    authorize,
    check_job_directory,
    check_storage_uri,
)
from shoal.param_sync.coordinator import (
    Action,
    CheckpointTask,
    Coordinator,
    JobSettings,
    OptimizerConfig,
    RecoverTask,
    ResolveTask,
    RewindTask,
    check_user_metrics,
)
from shoal.param_sync.metrics import SyncMetrics
from shoal.param_sync.shard import (
    Contribution,
    Encoded,
    ShardJob,
    build_optimizer,
    model_from_shard_files,
    shard_file_name,
)
from shoal.param_sync.sharding import Sharding
from shoal.param_sync.takeover import (
    ShardState,
    TakeoverPlan,
    plan_takeover,
    sharding_after_takeover,
)
from shoal.runtime.auth import (
    LEARNERS,
    SERVICES,
    USERS_AND_SERVICES,
    MethodRoles,
    current_principal,
)
from shoal.runtime.channels import connect
from shoal.runtime.config import TLSConfig
from shoal.runtime.errors import (
    DEFAULT_TABLE,
    Aborted,
    ErrorTable,
    FailedPrecondition,
    FencedOut,
    InvalidField,
    JobNotFound,
    NotFound,
    ShoalError,
    StaleGeneration,
    Unavailable,
)
from shoal.v1 import (
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
    resources_pb2,
)

__all__ = [
    "ERRORS",
    "ROLES",
    "SERVICE_NAME",
    "ParameterSyncServicer",
    "ShardOptions",
    "add_servicer",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE_NAME = "shoal.v1.ParameterSyncService"

#: Learners (their own credentials, or service tokens) call the data-plane methods; users may
#: read their own jobs' progress and membership; the scheduler and the shards (service tokens)
#: call the rest. Per job, each handler checks ``authz.authorize`` at its top.
ROLES = MethodRoles(
    SERVICE_NAME,
    SERVICES,
    {
        **{
            name: LEARNERS | SERVICES
            for name in (
                "Join",
                "InitializeParameters",
                "Boundary",
                "SyncStep",
                "PullParameters",
                "CreateCheckpoint",
                "ReportEpochMetrics",
                "FindCoordinator",
            )
        },
        "GetJobProgress": LEARNERS | USERS_AND_SERVICES,
        "GetMembership": LEARNERS | USERS_AND_SERVICES,
    },
)


#: The service's error table: storage failures (a checkpoint that cannot be written or read)
#: are UNAVAILABLE (retry later); everything else is the runtime's base table.
ERRORS: ErrorTable = DEFAULT_TABLE.extend({ckpt.StorageError: grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class ShardOptions:
    """What the servicer needs beyond the server config."""

    shard_index: int
    storage_uri: str
    service_token: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_bundle_bytes: int = 16 * 1024 * 1024 * 1024
    peer_message_bytes: int = 64 * 1024 * 1024
    rendezvous_port: int = 0  # of the collective-mode store (0: a free port)
    tls: TLSConfig | None = None  # of this process: peer channels are mutual TLS with it
    # Seconds between a coordinator's probes of the other shards of its parameter-server jobs
    # (GetShardStatus); a shard that fails ``shard_probe_misses`` probes in a row, or answers
    # without its slice, starts a recovery (Coordinator.shard_lost).
    shard_probe_s: float = 1.0
    shard_probe_misses: int = 3
    # Primary-backup replication of the slices of the parameter-server jobs this shard
    # coordinates (each slice's backup is the next active shard): the backup keeps the same
    # sums and applies the same commit, so a restarted shard is restored from it without
    # losing a committed iteration. Off: a restarted shard rewinds the job to its checkpoint.
    replication: bool = True
    # Seconds a lost shard may stay unreachable, once its loss was detected, before its
    # backup takes its slice over (a restart within it is restored in place instead).
    promote_after_s: float = 2.0


# ------------------------------------------------------------------------------------------
# wire
# ------------------------------------------------------------------------------------------


def add_servicer(servicer: object, server: aio.Server) -> None:
    """Like the generated ``add_ParameterSyncServiceServicer_to_server``, but the tensor
    streams use the hand codec of ``shoal.contract.wire`` (pre-encoded chunk messages are
    sent as they are; received ones are decoded to zero-copy frames)."""
    unary: dict[str, tuple[Any, Any]] = {
        "OpenJob": (ps_pb2.OpenJobRequest, ps_pb2.OpenJobResponse),
        "CloseJob": (ps_pb2.CloseJobRequest, ps_pb2.CloseJobResponse),
        "Join": (ps_pb2.JoinRequest, ps_pb2.JoinResponse),
        "Boundary": (ps_pb2.BoundaryRequest, ps_pb2.BoundaryResponse),
        "RetireLearners": (ps_pb2.RetireLearnersRequest, ps_pb2.RetireLearnersResponse),
        "EvictLearner": (ps_pb2.EvictLearnerRequest, ps_pb2.EvictLearnerResponse),
        "CreateCheckpoint": (ps_pb2.CreateCheckpointRequest, ps_pb2.CreateCheckpointResponse),
        "ReportEpochMetrics": (
            ps_pb2.ReportEpochMetricsRequest,
            ps_pb2.ReportEpochMetricsResponse,
        ),
        "GetJobProgress": (ps_pb2.GetJobProgressRequest, ps_pb2.GetJobProgressResponse),
        "GetMembership": (ps_pb2.GetMembershipRequest, ps_pb2.GetMembershipResponse),
        "ConfigureShard": (ps_pb2.ConfigureShardRequest, ps_pb2.ConfigureShardResponse),
        "ShardReady": (ps_pb2.ShardReadyRequest, ps_pb2.ShardReadyResponse),
        "ResolveIteration": (ps_pb2.ResolveIterationRequest, ps_pb2.ResolveIterationResponse),
        "SaveShard": (ps_pb2.SaveShardRequest, ps_pb2.SaveShardResponse),
        "LoadShard": (ps_pb2.LoadShardRequest, ps_pb2.LoadShardResponse),
        "GetShardStatus": (ps_pb2.GetShardStatusRequest, ps_pb2.GetShardStatusResponse),
        "TransferSlice": (ps_pb2.TransferSliceRequest, ps_pb2.TransferSliceResponse),
        "TakeOverJob": (ps_pb2.TakeOverJobRequest, ps_pb2.TakeOverJobResponse),
        "SetCoordinator": (ps_pb2.SetCoordinatorRequest, ps_pb2.SetCoordinatorResponse),
        "FindCoordinator": (ps_pb2.FindCoordinatorRequest, ps_pb2.FindCoordinatorResponse),
    }
    handlers: dict[str, grpc.RpcMethodHandler] = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=req.FromString,
            response_serializer=resp.SerializeToString,
        )
        for name, (req, resp) in unary.items()
    }
    handlers["InitializeParameters"] = grpc.stream_unary_rpc_method_handler(
        servicer.InitializeParameters,  # type: ignore[attr-defined]
        request_deserializer=frame_decoder(ps_pb2.InitializeParametersRequest),
        response_serializer=ps_pb2.InitializeParametersResponse.SerializeToString,
    )
    handlers["SyncStep"] = grpc.stream_stream_rpc_method_handler(
        servicer.SyncStep,  # type: ignore[attr-defined]
        request_deserializer=frame_decoder(ps_pb2.SyncStepRequest),
        response_serializer=serialize,
    )
    handlers["Replicate"] = grpc.stream_unary_rpc_method_handler(
        servicer.Replicate,  # type: ignore[attr-defined]
        request_deserializer=ps_pb2.ReplicateRequest.FromString,
        response_serializer=ps_pb2.ReplicateResponse.SerializeToString,
    )
    handlers["PullParameters"] = grpc.unary_stream_rpc_method_handler(
        servicer.PullParameters,  # type: ignore[attr-defined]
        request_deserializer=ps_pb2.PullParametersRequest.FromString,
        response_serializer=serialize,
    )
    generic = grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _progress_proto(progress: dict[str, Any]) -> job_pb2.JobProgress:
    fields = dict(progress)
    update = fields.pop("update_time")
    return job_pb2.JobProgress(**fields, update_time=_timestamp(update))


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else "NaN"


# ------------------------------------------------------------------------------------------
# per-job state
# ------------------------------------------------------------------------------------------


@dataclass
class _CoordinatedJob:
    coord: Coordinator
    owner: str = ""  # the principal that submitted the job (may read its progress)
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    configure_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    metrics_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    started: set[Any] = field(default_factory=set)
    task_results: dict[Any, asyncio.Future[Any]] = field(default_factory=dict)
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    # Collective mode: checkpoint files reported by learners, by iteration.
    checkpoint_files: dict[int, asyncio.Future[ps_pb2.CheckpointFile]] = field(default_factory=dict)
    # Parameter-server mode: the probe of the other shards (started by OpenJob).
    watchdog: asyncio.Task[None] | None = None
    # The coordinator epoch this shard coordinates the job in (0: opened by OpenJob; a
    # TakeOverJob's otherwise). Sent with every coordinator-to-shard call that changes state.
    epoch: int = 0
    # A takeover waiting for the first learner's Join (which brings the layout).
    takeover: _TakeOver | None = None
    # Another shard took the role over at a higher epoch (SetCoordinator): every waiting
    # Boundary fails UNAVAILABLE, so that its learner looks for the new coordinator.
    deposed: bool = False


@dataclass(frozen=True)
class _TakeOver:
    lost: int  # the lost coordinator's shard
    completed: int  # the iterations every shard left holds
    last_checkpoint: int  # the latest checkpoint's iteration (-1: none)
    generation: int  # the first generation number of the new coordinator
    collect_last: bool  # the last committed iteration is not in iterations.jsonl yet
    held: dict[int, tuple[str, ...]]  # the tensors each shard left holds (not the lost one)


@dataclass
class _ShardSlice:
    job: ShardJob
    backup_address: str = ""  # the shard that keeps this slice's replica ("" none)
    futures: dict[tuple[int, int], asyncio.Future[Encoded]] = field(default_factory=dict)
    memberships: dict[int, frozenset[str]] = field(default_factory=dict)


def _silence(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class ParameterSyncServicer:
    """All RPCs of one shard process (see the module docstring). Not a subclass of the
    generated servicer: the tensor streams take and give the hand codec's frames and bytes
    (:func:`add_servicer` registers them so)."""

    def __init__(
        self,
        options: ShardOptions,
        *,
        clock: Callable[[], float] = time.time,
        metrics: SyncMetrics | None = None,
    ) -> None:
        self.options = options
        self._clock = clock
        self.metrics = metrics if metrics is not None else SyncMetrics()
        self._coordinated: dict[str, _CoordinatedJob] = {}
        self._slices: dict[str, _ShardSlice] = {}
        # Replicas this shard keeps of other shards' slices: (job, whose index) -> state.
        self._replicas: dict[tuple[str, int], ShardJob] = {}
        self._fences: dict[tuple[str, str], int] = {}
        # Where each job's coordinator is, as told by SetCoordinator: (address, epoch).
        self._coordinator_at: dict[str, tuple[str, int]] = {}
        self._open_lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="param-sync")
        self._channels: dict[str, tuple[aio.Channel, ps_grpc.ParameterSyncServiceStub]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._rendezvous_store: Any = None  # torch.distributed.TCPStore, on first use
        self._rendezvous_secret = secrets.token_bytes(32)

    def _rendezvous_prefix(self, job_id: str) -> str:
        """The job's key prefix in the rendezvous store: a secret only its learners get
        (JoinResponse.rendezvous_prefix). The TCPStore has no TLS and no access control;
        with unguessable prefixes, a process that reaches it cannot find or overwrite a
        job's keys (it can still flood the store: keep it on a trusted network)."""
        digest = hmac.new(self._rendezvous_secret, job_id.encode(), hashlib.sha256)
        return f"{job_id}-{digest.hexdigest()[:32]}"

    def _rendezvous(self, settings: JobSettings) -> str:
        """host:port of the torch.distributed TCPStore this process hosts for the process
        groups of its collective-mode jobs (started on first use; keys are prefixed by job
        and generation, so jobs and generations never meet)."""
        if self._rendezvous_store is None:
            import datetime

            import torch.distributed as dist

            self._rendezvous_store = dist.TCPStore(
                "0.0.0.0",
                self.options.rendezvous_port,
                is_master=True,
                wait_for_workers=False,
                multi_tenant=True,
                timeout=datetime.timedelta(seconds=60),
            )
            log.info("collective rendezvous store on port %d", self._rendezvous_store.port)
        me = settings.shard_addresses[self.options.shard_index]
        host = me.rsplit(":", 1)[0]
        return f"{host}:{self._rendezvous_store.port}"

    async def close(self) -> None:
        for job in self._coordinated.values():
            if job.watchdog is not None:
                job.watchdog.cancel()
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- helpers ------------------------------------------------------------------------------

    async def _compute(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def _stub(self, address: str) -> ps_grpc.ParameterSyncServiceStub:
        entry = self._channels.get(address)
        if entry is None:
            channel = connect(
                address,
                token=self.options.service_token,
                tls=self.options.tls,
                max_message_bytes=self.options.peer_message_bytes,
            )
            entry = (channel, ps_grpc.ParameterSyncServiceStub(channel))
            self._channels[address] = entry
        return entry[1]

    async def _peer_call(self, address: str, method: str, request: Any, timeout: float) -> Any:
        try:
            return await getattr(self._stub(address), method)(request, timeout=timeout)
        except aio.AioRpcError as exc:
            code = exc.code()
            text = f"{method} on shard {address}: {exc.details()}"
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound("job state on shard", address) from exc
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                if decode_rpc_error(exc).reason == "ERROR_REASON_STALE_GENERATION":
                    raise StaleGeneration(text) from exc
                raise FailedPrecondition(text) from exc
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidField(method, address, f"refused: {exc.details()}") from exc
            raise Unavailable(text) from exc

    def _owner(self, job_id: str) -> str | None:
        job = self._coordinated.get(job_id)
        return job.owner if job is not None else None

    def _job(self, job_id: str) -> _CoordinatedJob:
        job = self._coordinated.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def _slice(self, job_id: str) -> _ShardSlice:
        part = self._slices.get(job_id)
        if part is None:
            raise JobNotFound(job_id)
        return part

    def _check_fence(self, job_id: str, token: resources_pb2.FencingToken) -> None:
        if not token.election:
            return
        key = (job_id, token.election)
        seen = self._fences.get(key, 0)
        if token.revision < seen:
            raise FencedOut(
                f"fencing_token.revision ({token.revision}) of {token.election!r} is older "
                f"than the current leader's ({seen})"
            )
        self._fences[key] = token.revision

    def _check_coordinator_epoch(self, job_id: str, epoch: int) -> None:
        """Refuse a coordinator's call from an epoch older than the job's current coordinator
        (a paused old coordinator that woke up after the role moved: it must not commit)."""
        if epoch < 0:
            raise InvalidField("coordinator_epoch", epoch, "must be >= 0")
        address, known = self._coordinator_at.get(job_id, ("", 0))
        if epoch < known:
            raise FencedOut(
                f"coordinator_epoch ({epoch}) of job {job_id!r} is older than the current "
                f"coordinator's ({known}, {address})"
            )

    # -- OpenJob / CloseJob -------------------------------------------------------------------

    async def OpenJob(self, request: ps_pb2.OpenJobRequest, context: Any) -> Any:
        authorize(current_principal(), "OpenJob", job_id=request.job_id)
        spec = request.spec
        if not request.job_id:
            raise InvalidField("job_id", "", "must not be empty")
        storage = check_storage_uri(request.storage_uri, self.options.storage_uri)
        settings = JobSettings(
            job_id=request.job_id,
            batch_size=spec.batch_size,
            epochs=spec.epochs,
            seed=spec.seed,
            checkpoint_every=spec.checkpoint_every,
            keep_checkpoints=spec.keep_checkpoints,
            storage_uri=storage,
            shard_addresses=tuple(request.shard_addresses),
        )
        if len(settings.shard_addresses) <= self.options.shard_index:
            raise InvalidField(
                "shard_addresses",
                list(settings.shard_addresses),
                f"must include this shard (index {self.options.shard_index})",
            )
        async with self._open_lock:
            self._check_fence(request.job_id, request.fencing_token)
            existing = self._coordinated.get(request.job_id)
            if existing is not None:
                coord = existing.coord
                return ps_pb2.OpenJobResponse(
                    progress=_progress_proto(coord.progress()), resumed=coord.resumed
                )
            job = _CoordinatedJob(Coordinator(settings, clock=self._clock), owner=request.owner)
            await self._fence_the_shards(job)
            found = await asyncio.to_thread(ckpt.latest_checkpoint, storage, request.job_id)
            if found is not None:
                await self._resume(job, *found)
            job.coord.generation = max(job.coord.generation, job.epoch << 32)
            self._coordinated[request.job_id] = job
            job.watchdog = asyncio.create_task(self._watch_shards(job))
            log.info(
                "job %s opened (%s), %d shards",
                request.job_id,
                f"resumed at iteration {job.coord.completed}" if found else "new",
                settings.num_shards,
            )
            return ps_pb2.OpenJobResponse(
                progress=_progress_proto(job.coord.progress()), resumed=job.coord.resumed
            )

    # -- coordinator failover -----------------------------------------------------------------

    async def _fence_the_shards(self, job: _CoordinatedJob) -> None:
        """A job opened anew (OpenJob) where the coordinator role had moved before (a takeover,
        then the checkpoint path or a lost successor): the shards that still fence the job at
        an epoch would refuse this coordinator's calls. Take the next epoch on every shard that
        answers (none had one: nothing to do, epoch 0), with generations above its floor."""
        s = job.coord.settings
        request = ps_pb2.FindCoordinatorRequest(job_id=s.job_id)
        me = self.options.shard_index

        async def epoch_of(i: int) -> int:
            if i == me:
                return self._coordinator_at.get(s.job_id, ("", 0))[1]
            reply = await self._peer_call(s.shard_addresses[i], "FindCoordinator", request, 2.0)
            return int(reply.coordinator_epoch)

        found = await asyncio.gather(
            *(epoch_of(i) for i in range(s.num_shards)), return_exceptions=True
        )
        top = max((e for e in found if isinstance(e, int)), default=0)
        if top == 0:
            return
        job.epoch = top + 1
        move = ps_pb2.SetCoordinatorRequest(
            job_id=s.job_id,
            coordinator_address=s.shard_addresses[me],
            coordinator_epoch=job.epoch,
            min_generation=job.epoch << 32,
        )
        await asyncio.gather(
            *(self._call_shard(s, i, "SetCoordinator", move) for i in range(s.num_shards)),
            return_exceptions=True,
        )
        log.warning("job %s: opened at coordinator epoch %d", s.job_id, job.epoch)

    async def TakeOverJob(self, request: ps_pb2.TakeOverJobRequest, context: Any) -> Any:
        """Become the coordinator of a job whose coordinator shard is lost (see the proto):
        fence the shards left with the new epoch, check they hold one state, and wait for the
        learners to re-join (the first Join brings the layout: :meth:`_complete_takeover`)."""
        authorize(current_principal(), "TakeOverJob", job_id=request.job_id)
        if not request.job_id:
            raise InvalidField("job_id", "", "must not be empty")
        spec = request.spec
        storage = check_storage_uri(request.storage_uri, self.options.storage_uri)
        settings = JobSettings(
            job_id=request.job_id,
            batch_size=spec.batch_size,
            epochs=spec.epochs,
            seed=spec.seed,
            checkpoint_every=spec.checkpoint_every,
            keep_checkpoints=spec.keep_checkpoints,
            storage_uri=storage,
            shard_addresses=tuple(request.shard_addresses),
        )
        me = self.options.shard_index
        if len(settings.shard_addresses) <= me:
            raise InvalidField(
                "shard_addresses",
                list(settings.shard_addresses),
                f"must include this shard (index {me})",
            )
        lost = request.lost_shard_index
        if not 0 <= lost < settings.num_shards or lost == me:
            raise InvalidField(
                "lost_shard_index", lost, f"must be another shard of the {settings.num_shards}"
            )
        epoch = request.coordinator_epoch
        if epoch < 1:
            raise InvalidField("coordinator_epoch", epoch, "must be >= 1")
        async with self._open_lock:
            self._check_fence(request.job_id, request.fencing_token)
            existing = self._coordinated.get(request.job_id)
            if existing is not None:
                if existing.epoch == epoch:  # a retried call
                    return ps_pb2.TakeOverJobResponse(
                        progress=_progress_proto(existing.coord.progress())
                    )
                if existing.epoch > epoch:
                    raise FencedOut(
                        f"coordinator_epoch ({epoch}) of job {request.job_id!r} is older than "
                        f"this shard's ({existing.epoch})"
                    )
                raise FailedPrecondition(
                    f"shard {me} coordinates job {request.job_id!r} already (epoch "
                    f"{existing.epoch}): close it first"
                )
            self._check_coordinator_epoch(request.job_id, epoch)
            generation = epoch << 32  # above every generation of an earlier coordinator
            move = ps_pb2.SetCoordinatorRequest(
                job_id=request.job_id,
                coordinator_address=settings.shard_addresses[me],
                coordinator_epoch=epoch,
                min_generation=generation,
                keep_pending=True,
            )
            others = [i for i in range(settings.num_shards) if i != lost]
            results = await asyncio.gather(
                *(self._call_shard(settings, i, "SetCoordinator", move) for i in others),
                return_exceptions=True,
            )
            states: dict[int, ShardState] = {}
            for i, result in zip(others, results, strict=True):
                if isinstance(result, Unavailable):  # taken to hold nothing (takeover.py)
                    log.warning("job %s: takeover: shard %d is down", request.job_id, i)
                elif isinstance(result, BaseException):
                    log.warning(
                        "job %s: takeover: shard %d did not accept the move: %s",
                        request.job_id,
                        i,
                        result,
                    )
                    raise result
                else:
                    states[i] = _shard_state(result)
            plan = plan_takeover(request.job_id, states)
            await self._settle_takeover(settings, epoch, plan)
            completed = plan.completed
            found = await asyncio.to_thread(ckpt.latest_checkpoint, storage, request.job_id)
            last_checkpoint = int(found[1]["iteration"]) if found is not None else -1
            recorded = await asyncio.to_thread(self._last_recorded, settings)
            coord = Coordinator(settings, clock=self._clock)
            coord.completed = completed  # reported before the first learner re-joins
            job = _CoordinatedJob(coord, owner=request.owner, epoch=epoch)
            job.takeover = _TakeOver(
                lost,
                completed,
                last_checkpoint,
                generation,
                recorded < completed - 1,
                {i: st.tensors for i, st in states.items() if st.completed >= 0},
            )
            coord.recovering = (
                f"coordinator shard {lost} lost at iteration {completed}; shard {me} took "
                "over, waiting for the learners to re-join"
            )
            self._coordinated[request.job_id] = job
            job.watchdog = asyncio.create_task(self._watch_shards(job))
            deposer = asyncio.create_task(self._depose(job, lost))
            job.background.add(deposer)
            deposer.add_done_callback(job.background.discard)
            log.warning(
                "job %s: took over as coordinator (epoch %d) from lost shard %d at iteration %d",
                request.job_id,
                epoch,
                lost,
                completed,
            )
            return ps_pb2.TakeOverJobResponse(progress=_progress_proto(coord.progress()))

    async def _settle_takeover(self, settings: JobSettings, epoch: int, plan: TakeoverPlan) -> None:
        """Bring the shards left to one state (``takeover.plan_takeover``): commit an iteration
        the lost coordinator committed on some of them only, drop sums nobody committed."""

        def resolve(commit: bool, at: tuple[int, int]) -> ps_pb2.ResolveIterationRequest:
            return ps_pb2.ResolveIterationRequest(
                job_id=settings.job_id,
                generation=at[0],
                iteration=at[1],
                commit=commit,
                grad_norm=plan.grad_norm if commit else 0.0,
                coordinator_epoch=epoch,
            )

        calls = [
            self._call_shard(settings, i, "ResolveIteration", resolve(True, at))
            for i, at in plan.commits.items()
        ] + [
            self._call_shard(settings, i, "ResolveIteration", resolve(False, at))
            for i, at in plan.aborts.items()
        ]
        await asyncio.gather(*calls)
        if plan.commits:
            log.warning(
                "job %s: takeover: iteration %d was committed on some shards only; committed it "
                "on shard(s) %s too",
                settings.job_id,
                plan.completed - 1,
                sorted(plan.commits),
            )

    async def _depose(self, job: _CoordinatedJob, lost: int) -> None:
        """Tell the lost coordinator's shard, once it answers again (it was paused or
        partitioned rather than dead), that the role moved: it steps down, and the learners
        still waiting on it look for this coordinator. Until then its calls are fenced."""
        s = job.coord.settings
        while self._coordinated.get(s.job_id) is job and not job.coord.done:
            request = ps_pb2.SetCoordinatorRequest(
                job_id=s.job_id,
                coordinator_address=s.shard_addresses[self.options.shard_index],
                coordinator_epoch=job.epoch,
                min_generation=job.coord.generation,
            )
            try:
                await self._peer_call(s.shard_addresses[lost], "SetCoordinator", request, 2.0)
            except ShoalError:
                await asyncio.sleep(self.options.shard_probe_s)
                continue
            log.info(
                "job %s: the lost coordinator shard %d answered; it stepped down", s.job_id, lost
            )
            return

    async def _complete_takeover(
        self,
        job: _CoordinatedJob,
        layout: Sequence[TensorMeta],
        optimizer: OptimizerConfig,
        dataset_size: int,
    ) -> None:
        """The first learner re-joined a taken-over job: with its layout, check that the shards
        left are configured as the job's sharding says (same tensors, same optimizer; they
        refuse otherwise), point them at this coordinator, and recover the lost shard's slice
        (its replica is promoted, or it is restored if it came back)."""
        takeover = job.takeover
        assert takeover is not None
        coord = job.coord
        coord.plan_sharding(layout, optimizer, dataset_size)  # checks the layout
        s = coord.settings
        sharding = sharding_after_takeover(layout, takeover.held, takeover.lost, s.num_shards)
        build_optimizer(optimizer, [])
        empty = frozenset(i for i, names in enumerate(sharding.tensors) if not names)
        await self._configure_all(s, layout, optimizer, sharding, skip=empty | {takeover.lost})
        async with job.cond:
            tasks = coord.take_over(
                layout=layout,
                optimizer=optimizer,
                dataset_size=dataset_size,
                completed=takeover.completed,
                generation=takeover.generation - 1,
                last_checkpoint=takeover.last_checkpoint,
                lost_shard=takeover.lost,
                collect_last=takeover.collect_last,
                sharding=sharding,
            )
            job.takeover = None
            log.warning("job %s: takeover: %s; recovering", coord.job_id, coord.recovering)
            del tasks
            self._kick(job)
            job.cond.notify_all()

    async def SetCoordinator(self, request: ps_pb2.SetCoordinatorRequest, context: Any) -> Any:
        authorize(current_principal(), "SetCoordinator", job_id=request.job_id)
        return await self._local_SetCoordinator(request)

    async def _local_SetCoordinator(self, request: ps_pb2.SetCoordinatorRequest) -> Any:
        if not request.coordinator_address or ":" not in request.coordinator_address:
            raise InvalidField(
                "coordinator_address", request.coordinator_address, "must be 'host:port'"
            )
        self._check_coordinator_epoch(request.job_id, request.coordinator_epoch)
        self._coordinator_at[request.job_id] = (
            request.coordinator_address,
            request.coordinator_epoch,
        )
        mine = self._coordinated.get(request.job_id)
        if mine is not None and mine.epoch < request.coordinator_epoch:
            # This shard coordinated the job before (it was paused or partitioned, and the
            # role moved meanwhile): step down; its learners find the new coordinator.
            log.warning(
                "job %s: coordinator role moved to %s (epoch %d); stepping down (epoch %d)",
                request.job_id,
                request.coordinator_address,
                request.coordinator_epoch,
                mine.epoch,
            )
            del self._coordinated[request.job_id]
            if mine.watchdog is not None:
                mine.watchdog.cancel()
            async with mine.cond:
                mine.deposed = True
                mine.cond.notify_all()
        part = self._slices.get(request.job_id)
        if part is None:
            return ps_pb2.SetCoordinatorResponse(completed_iterations=-1, pending_iteration=-1)
        sj = part.job
        sj.coordinator_address = request.coordinator_address
        pending = sj.pending
        kept = (-1, -1)
        if pending is not None and request.keep_pending:  # the successor resolves it
            kept = (pending.generation, pending.iteration)
        elif pending is not None:  # never committed: the new coordinator runs it again
            await self._compute(sj.abort, pending.generation, pending.iteration)
        sj.min_generation = max(sj.min_generation, request.min_generation)
        part.memberships.clear()
        self._fail_waiters(
            part, Aborted(f"job {request.job_id!r}: its coordinator moved; ask Boundary again")
        )
        return ps_pb2.SetCoordinatorResponse(
            completed_iterations=sj.completed if sj.initialized else -1,
            tensor_names=sj.names if sj.initialized else [],
            pending_generation=kept[0],
            pending_iteration=kept[1],
            last_grad_norm=sj.last_grad_norm,
        )

    async def FindCoordinator(self, request: ps_pb2.FindCoordinatorRequest, context: Any) -> Any:
        authorize(current_principal(), "FindCoordinator", job_id=request.job_id)
        job = self._coordinated.get(request.job_id)
        if job is not None:
            me = job.coord.settings.shard_addresses[self.options.shard_index]
            return ps_pb2.FindCoordinatorResponse(
                coordinator_address=me, coordinator_epoch=job.epoch
            )
        known = self._coordinator_at.get(request.job_id)
        if known is not None:
            return ps_pb2.FindCoordinatorResponse(
                coordinator_address=known[0], coordinator_epoch=known[1]
            )
        part = self._slices.get(request.job_id)
        if part is not None:
            return ps_pb2.FindCoordinatorResponse(coordinator_address=part.job.coordinator_address)
        return ps_pb2.FindCoordinatorResponse()

    async def _resume(self, job: _CoordinatedJob, directory: str, manifest: dict[str, Any]) -> None:
        coord = job.coord
        s = coord.settings
        for name, mine in (("batch_size", s.batch_size), ("seed", s.seed)):
            if int(manifest.get(name, mine)) != mine:
                raise InvalidField(
                    f"spec.{name}", mine, f"differs from the checkpoint's ({manifest[name]})"
                )
        layout = [
            TensorMeta(
                d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"], d["buffer"]
            )
            for d in manifest["layout"]
        ]
        optimizer = OptimizerConfig(**manifest["optimizer"])
        progress = manifest.get("progress", {})
        coord.restore(
            layout=layout,
            optimizer=optimizer,
            dataset_size=int(manifest["dataset_size"]),
            completed=int(manifest["iteration"]),
            samples_processed=int(progress.get("samples_processed", 0)),
            generation=int(manifest.get("generation", 0)),
            last_loss=float(progress.get("last_loss", math.nan)),
        )
        assert coord.layout is not None and coord.sharding is not None
        await self._configure_all(s, coord.layout, optimizer, coord.sharding)
        await self._load_everywhere(coord, directory)
        await asyncio.to_thread(
            self._truncate_metrics,
            s,
            coord.completed,
            coord.completed // coord.iterations_per_epoch,
        )

    @staticmethod
    def _last_recorded(settings: JobSettings) -> int:
        """The highest global iteration in the job's iterations.jsonl (-1: none)."""
        uri = ckpt.job_uri(settings.storage_uri, settings.job_id, "metrics", "iterations.jsonl")
        data = ckpt.read_bytes(uri)
        last = -1
        for line in (data or b"").decode(errors="replace").splitlines():
            try:
                last = max(last, int(json.loads(line).get("global_iteration", -1)))
            except (ValueError, AttributeError):
                continue
        return last

    @staticmethod
    def _truncate_metrics(settings: JobSettings, completed: int, epochs_done: int) -> None:
        """After a resume, drop the records of the iterations (and epoch evaluations) that
        will be run again, so that each is recorded once."""
        for name, field_name, limit in (
            ("iterations.jsonl", "global_iteration", completed),
            ("epochs.jsonl", "epoch", epochs_done),
        ):
            uri = ckpt.job_uri(settings.storage_uri, settings.job_id, "metrics", name)
            data = ckpt.read_bytes(uri)
            if data is None:
                continue
            kept = []
            for line in data.decode().splitlines():
                try:
                    if int(json.loads(line).get(field_name, -1)) < limit:
                        kept.append(line)
                except (ValueError, AttributeError):
                    continue
            ckpt.atomic_write(uri, "".join(k + "\n" for k in kept).encode())

    async def CloseJob(self, request: ps_pb2.CloseJobRequest, context: Any) -> Any:
        authorize(current_principal(), "CloseJob", job_id=request.job_id)
        self._check_fence(request.job_id, request.fencing_token)
        job = self._coordinated.pop(request.job_id, None)
        part = self._slices.pop(request.job_id, None)
        self._coordinator_at.pop(request.job_id, None)
        replicas = [key for key in self._replicas if key[0] == request.job_id]
        for key in replicas:
            del self._replicas[key]
        if job is None and part is None and not replicas:
            raise JobNotFound(request.job_id)
        if part is not None:
            self._fail_waiters(part, Aborted(f"job {request.job_id!r} was closed"))
        self.metrics.forget(request.job_id)
        if job is not None:
            if job.watchdog is not None:
                job.watchdog.cancel()
            async with job.cond:
                job.coord.done = True
                job.cond.notify_all()
            for i, address in enumerate(job.coord.settings.shard_addresses):
                if i == self.options.shard_index:
                    continue
                with contextlib.suppress(ShoalError):
                    await self._peer_call(
                        address, "CloseJob", ps_pb2.CloseJobRequest(job_id=request.job_id), 10.0
                    )
        return ps_pb2.CloseJobResponse()

    # -- shards of a coordinated job ----------------------------------------------------------

    def _active(self, coord: Coordinator) -> list[int]:
        assert coord.sharding is not None
        return [i for i, names in enumerate(coord.sharding.tensors) if names]

    async def _call_shard(
        self, settings: JobSettings, index: int, method: str, request: Any
    ) -> Any:
        job = self._coordinated.get(settings.job_id)
        if job is not None and "coordinator_epoch" in request.DESCRIPTOR.fields_by_name:
            request.coordinator_epoch = job.epoch  # fenced on the shard (SetCoordinator)
        if index == self.options.shard_index:
            local = getattr(self, f"_local_{method}")
            return await local(request)
        timeout = 600.0 if method in ("SaveShard", "LoadShard", "TransferSlice") else 60.0
        return await self._peer_call(settings.shard_addresses[index], method, request, timeout)

    async def _configure_all(
        self,
        settings: JobSettings,
        layout: Sequence[TensorMeta],
        optimizer: OptimizerConfig,
        sharding: Sharding,
        *,
        skip: frozenset[int] = frozenset(),
    ) -> None:
        by_name = {m.name: m for m in layout}
        me = settings.shard_addresses[self.options.shard_index]
        backups = self._backups(sharding)
        spec = _optimizer_spec(optimizer)
        calls = []
        for i, names in enumerate(sharding.tensors):
            if i in skip:
                continue
            request = ps_pb2.ConfigureShardRequest(
                job_id=settings.job_id,
                shard_index=i,
                tensors=[by_name[n].to_proto() for n in names],
                optimizer=spec,
                coordinator_address=me,
                active_shards=sharding.active_shards,
            )
            b = backups.get(i)
            if b is not None and b not in skip:
                request.backup_address = settings.shard_addresses[b]
                replica = ps_pb2.ConfigureShardRequest()
                replica.CopyFrom(request)
                replica.replica = True
                replica.backup_address = ""
                calls.append(self._call_shard(settings, b, "ConfigureShard", replica))
            elif b is not None:
                request.backup_address = settings.shard_addresses[b]
            calls.append(self._call_shard(settings, i, "ConfigureShard", request))
        await asyncio.gather(*calls)

    def _backups(self, sharding: Sharding) -> dict[int, int]:
        """Each active shard's backup: the next active shard (cyclically); none with
        replication off or fewer than two active shards."""
        active = [i for i, names in enumerate(sharding.tensors) if names]
        if not self.options.replication or len(active) < 2:
            return {}
        return {i: active[(n + 1) % len(active)] for n, i in enumerate(active)}

    async def _load_everywhere(self, coord: Coordinator, directory: str) -> None:
        """LoadShard of a checkpoint on every active shard and every replica."""
        s = coord.settings
        assert coord.sharding is not None
        calls = [
            self._call_shard(
                s, i, "LoadShard", ps_pb2.LoadShardRequest(job_id=s.job_id, directory=directory)
            )
            for i in self._active(coord)
        ]
        for i, b in self._backups(coord.sharding).items():
            request = ps_pb2.LoadShardRequest(
                job_id=s.job_id, directory=directory, replica=True, shard_index=i
            )
            calls.append(self._call_shard(s, b, "LoadShard", request))
        await asyncio.gather(*calls)

    # -- Join / InitializeParameters ----------------------------------------------------------

    async def Join(self, request: ps_pb2.JoinRequest, context: Any) -> Any:
        authorize(current_principal(), "Join", job_id=request.job_id, learner_id=request.learner_id)
        job = self._job(request.job_id)
        coord = job.coord
        if not request.learner_id:
            raise InvalidField("learner_id", "", "must not be empty")
        layout = [TensorMeta.from_proto(t) for t in request.layout]
        optimizer = _optimizer_config(request.optimizer)
        if request.sync_mode not in (
            job_pb2.SYNC_MODE_UNSPECIFIED,
            job_pb2.SYNC_MODE_PARAMETER_SERVER,
            job_pb2.SYNC_MODE_COLLECTIVE,
        ):
            raise InvalidField(
                "sync_mode", request.sync_mode, "must be PARAMETER_SERVER or COLLECTIVE"
            )
        collective = request.sync_mode == job_pb2.SYNC_MODE_COLLECTIVE
        async with job.configure_lock:
            sharding = coord.plan_sharding(layout, optimizer, request.dataset_size)
            if job.takeover is not None and coord.layout is None:
                if collective:
                    raise FailedPrecondition(
                        f"job {request.job_id!r} was taken over from a lost coordinator in "
                        "parameter-server mode; a collective job resumes from its checkpoint"
                    )
                await self._complete_takeover(job, layout, optimizer, request.dataset_size)
            coord.set_mode(collective)
            if coord.layout is None:
                build_optimizer(optimizer, [])  # refuse a bad optimizer before any state
                if not collective:  # in collective mode the learners hold the state
                    await self._configure_all(coord.settings, layout, optimizer, sharding)
                coord.fix_layout(layout, optimizer, request.dataset_size, sharding)
            async with job.cond:
                initialize = coord.join(request.learner_id)
                job.cond.notify_all()
        s = coord.settings
        assert coord.sharding is not None
        return ps_pb2.JoinResponse(
            initialize=initialize,
            shards=[
                ps_pb2.ShardSlice(shard_index=i, address=address, tensor_names=names)
                for i, (address, names) in enumerate(
                    zip(s.shard_addresses, coord.sharding.tensors, strict=True)
                )
            ],
            batch_size=s.batch_size,
            epochs=s.epochs,
            seed=s.seed,
            rendezvous_address=self._rendezvous(s) if collective else "",
            rendezvous_prefix=self._rendezvous_prefix(s.job_id) if collective else "",
        )

    async def InitializeParameters(
        self, request_iterator: AsyncIterator[Frame], context: Any
    ) -> Any:
        frames = aiter(request_iterator)
        async with _draining(frames):
            header = await _first_header(frames)
            authorize(
                current_principal(),
                "InitializeParameters",
                job_id=header.job_id,
                learner_id=header.sender_id,
            )
            part = self._slice(header.job_id)
            sj = part.job
            matched = sj.check_stream(
                header, everything=True, max_bytes=self.options.max_bundle_bytes
            )
            upload = Contribution(
                learner=header.sender_id,
                generation=header.generation,
                iteration=header.iteration,
                num_samples=0,
                loss_sum=0.0,
                learning_rate=0.0,
                metas=matched,
                total_bytes=header.total_bytes,
            )
            await _collect(frames, sj, upload)
        accepted = await self._compute(sj.initialize, upload)
        if accepted and part.backup_address:
            # The replica starts from the same values before anyone can run an iteration.
            try:
                await self._send_slice(sj, part.backup_address, replica=True, kind="state")
            except ShoalError as exc:  # the backup is down: its probe will find it
                log.error(
                    "job %s: slice not replicated to %s: %s", sj.job_id, part.backup_address, exc
                )
        return ps_pb2.InitializeParametersResponse(accepted=accepted)

    # -- Boundary -----------------------------------------------------------------------------

    async def Boundary(self, request: ps_pb2.BoundaryRequest, context: Any) -> Any:
        authorize(
            current_principal(), "Boundary", job_id=request.job_id, learner_id=request.learner_id
        )
        user = check_user_metrics(request.metric_sums, request.metric_samples)
        job = self._job(request.job_id)
        coord = job.coord
        async with job.cond:
            if request.iteration_failed:
                if coord.fail(request.learner_id, request.generation):
                    log.warning(
                        "job %s: learner %s's collective failed in generation %d; iteration "
                        "%d aborted, the group re-forms",
                        coord.job_id,
                        request.learner_id,
                        request.generation,
                        coord.completed,
                    )
            elif request.completed_iteration >= 0:
                committed = coord.completed
                if coord.collective:  # the round runs from the first vote to the commit
                    self.metrics.round_started(
                        coord.job_id, request.generation, request.completed_iteration
                    )
                coord.report(
                    request.learner_id,
                    request.generation,
                    request.completed_iteration,
                    request.loss_sum,
                    request.num_samples,
                    user,
                )
                if coord.completed > committed:  # a collective commit: the last vote
                    self.metrics.round_committed(
                        coord.job_id, request.generation, request.completed_iteration
                    )
                    self.metrics.iteration_committed(coord.job_id)
            if request.HasField("checkpoint_file"):
                self._checkpoint_file(job, request.learner_id, request.checkpoint_file)
            while True:
                if job.deposed:
                    raise Unavailable(
                        f"shard {self.options.shard_index} no longer coordinates job "
                        f"{request.job_id!r}: ask the other shards (FindCoordinator)"
                    )
                decision = coord.decide(request.learner_id)
                self._kick(job)
                # A decision may have frozen a generation or marked the job initialized:
                # let every waiting learner look again.
                job.cond.notify_all()
                if decision.action is not Action.WAIT:
                    break
                await job.cond.wait()
        await self._flush_metrics(job)
        response = ps_pb2.BoundaryResponse(
            pull_parameters=decision.pull,
            completed_iterations=coord.completed,
            coordinator_epoch=job.epoch,
        )
        s = coord.settings
        if decision.action is Action.CHECKPOINT:
            assert decision.checkpoint is not None
            response.action = ps_pb2.BOUNDARY_ACTION_CHECKPOINT
            response.completed_iterations = decision.checkpoint.iteration
            response.checkpoint_directory = self._checkpoint_directory(
                s, decision.checkpoint.iteration
            )
            return response
        if decision.restore is not None:
            response.checkpoint_directory = self._checkpoint_directory(s, decision.restore)
        if decision.action is Action.RUN:
            a = decision.assignment
            assert a is not None
            if coord.routing_epoch and coord.sharding is not None:
                response.routing_epoch = coord.routing_epoch
                response.shards.extend(
                    ps_pb2.ShardSlice(shard_index=i, address=address, tensor_names=names)
                    for i, (address, names) in enumerate(
                        zip(s.shard_addresses, coord.sharding.tensors, strict=True)
                    )
                )
            response.action = ps_pb2.BOUNDARY_ACTION_RUN
            response.assignment.CopyFrom(
                ps_pb2.Assignment(
                    generation=a.generation,
                    epoch=a.epoch,
                    iteration=a.iteration,
                    global_iteration=a.global_iteration,
                    rank=a.rank,
                    world_size=a.world_size,
                    sample_start=a.sample_start,
                    sample_end=a.sample_end,
                    batch_samples=a.batch_samples,
                )
            )
        elif decision.action is Action.RETIRE:
            response.action = ps_pb2.BOUNDARY_ACTION_RETIRE
        else:
            response.action = ps_pb2.BOUNDARY_ACTION_DONE
        return response

    @staticmethod
    def _checkpoint_directory(settings: JobSettings, iteration: int) -> str:
        return ckpt.job_uri(
            settings.storage_uri, settings.job_id, "checkpoints", ckpt.checkpoint_name(iteration)
        )

    def _checkpoint_file(
        self, job: _CoordinatedJob, learner: str, report: ps_pb2.CheckpointFile
    ) -> None:
        """Collective mode: a learner wrote the shard file of the held checkpoint."""
        coord = job.coord
        expected = self._checkpoint_directory(coord.settings, report.global_iteration)
        if report.directory != expected or report.file != shard_file_name(0) or not report.sha256:
            raise InvalidField(
                "checkpoint_file",
                f"{report.directory}/{report.file}",
                f"must be {shard_file_name(0)} in {expected}, with its sha256",
            )
        if not coord.checkpoint_file_written(learner, report.global_iteration):
            log.warning(
                "job %s: ignoring checkpoint file %s from %s (not the writer of a held checkpoint)",
                coord.job_id,
                report.file,
                learner,
            )
            return
        future = job.checkpoint_files.setdefault(
            report.global_iteration, asyncio.get_running_loop().create_future()
        )
        if not future.done():
            future.set_result(report)

    # -- side effects of the coordinator ------------------------------------------------------

    def _kick(self, job: _CoordinatedJob) -> None:
        """Start the side effects the coordinator asked for (called with ``job.cond`` held)."""
        for task in job.coord.holds:
            if task in job.started:
                continue
            job.started.add(task)
            future = job.task_results.setdefault(task, asyncio.get_running_loop().create_future())
            future.add_done_callback(_silence)
            runner = asyncio.create_task(self._run_task(job, task, future))
            job.background.add(runner)
            runner.add_done_callback(job.background.discard)

    async def _run_task(
        self,
        job: _CoordinatedJob,
        task: ResolveTask | CheckpointTask | RewindTask | RecoverTask,
        future: asyncio.Future[Any],
    ) -> None:
        ok, result = True, None
        try:
            if isinstance(task, ResolveTask):
                await self._resolve_everywhere(job.coord, task)
                if task.commit:
                    self.metrics.iteration_committed(job.coord.job_id)
            elif isinstance(task, RecoverTask):
                await self._recover(job, task)
            elif isinstance(task, RewindTask):
                s, ipe = job.coord.settings, job.coord.iterations_per_epoch
                log.warning(
                    "job %s: no learner holds the state any more; continuing from iteration %d",
                    s.job_id,
                    task.iteration,
                )
                await asyncio.to_thread(
                    self._truncate_metrics, s, task.iteration, task.iteration // ipe
                )
            else:
                result = await self._checkpoint_through_shard_loss(job, task)
        except Exception as exc:
            ok = False
            log.error("job %s: %s failed: %s", job.coord.job_id, task, exc, exc_info=exc)
            if not future.done():
                future.set_exception(exc)
        else:
            if not future.done():
                future.set_result(result)
        async with job.cond:
            job.started.discard(task)
            job.task_results.pop(task, None)
            follow = job.coord.task_done(task, ok=ok)
            del follow  # a deferred commit is one of the coordinator's holds now
            self._kick(job)
            job.cond.notify_all()

    # -- shard loss (parameter-server mode) ----------------------------------------------------

    async def _shard_status(
        self, settings: JobSettings, index: int
    ) -> ps_pb2.GetShardStatusResponse:
        request = ps_pb2.GetShardStatusRequest(job_id=settings.job_id, shard_index=index)
        if index == self.options.shard_index:
            return await self._local_GetShardStatus(request)
        timeout = max(2.0, 2 * self.options.shard_probe_s)
        return await self._peer_call(
            settings.shard_addresses[index], "GetShardStatus", request, timeout
        )

    async def _watch_shards(self, job: _CoordinatedJob) -> None:
        """Probe the other shards of a parameter-server job every ``shard_probe_s``: a shard
        that answers without its slice (it restarted), or misses ``shard_probe_misses``
        probes in a row, starts a recovery (:meth:`Coordinator.shard_lost`)."""
        coord = job.coord
        misses: dict[int, int] = {}
        while self._coordinated.get(coord.job_id) is job and not coord.done:
            await asyncio.sleep(self.options.shard_probe_s)
            if (
                coord.collective is not False
                or coord.sharding is None
                or not coord.initialized
                or coord.recovery is not None
            ):
                continue
            for i in self._active(coord):
                if i == self.options.shard_index:
                    continue
                reason = ""
                before = (coord.completed, coord.commit_in_flight)
                try:
                    status = await self._shard_status(coord.settings, i)
                except (Unavailable, NotFound) as exc:
                    misses[i] = misses.get(i, 0) + 1
                    if misses[i] >= self.options.shard_probe_misses:
                        reason = "unreachable"
                        log.warning("job %s: shard %d: %s", coord.job_id, i, exc)
                except ShoalError as exc:
                    log.warning("job %s: probe of shard %d: %s", coord.job_id, i, exc)
                    continue
                else:
                    misses[i] = 0
                    if not status.holds_job or not status.initialized:
                        reason = "lost its state (restarted)"
                    elif (
                        status.completed_iterations != before[0]
                        and (coord.completed, coord.commit_in_flight) == (before[0], False)
                        and not before[1]
                    ):
                        # No commit was delivered during the probe, yet the shard is at
                        # another iteration: it missed a commit (unreachable then).
                        reason = f"missed a commit (at iteration {status.completed_iterations})"
                if reason:
                    misses[i] = 0
                    async with job.cond:
                        if coord.shard_lost(i, reason):
                            log.warning("job %s: %s; recovering", coord.job_id, coord.recovering)
                            self._kick(job)
                            job.cond.notify_all()
                    break

    async def _restore_from_replicas(self, job: _CoordinatedJob, task: RecoverTask) -> bool:
        """Restore the lost shard from the replicas: its own slice from its backup, the
        replica it kept from that slice's primary, all at the coordinator's iteration; then
        every learner pulls and the job goes on with no committed iteration lost. False (and
        the caller rewinds to the checkpoint) when a copy is not there or not current."""
        coord = job.coord
        s = coord.settings
        assert coord.layout is not None and coord.optimizer is not None
        assert coord.sharding is not None
        backups = self._backups(coord.sharding)
        lost = task.shard_index
        if not backups:
            return False
        iteration = coord.completed
        for i in self._active(coord):
            if i == lost:
                continue
            status = await self._shard_status(s, i)
            if not (status.holds_job and status.completed_iterations == iteration):
                log.warning("job %s: shard %d is not at iteration %d", s.job_id, i, iteration)
                return False
        await self._configure_all(s, coord.layout, coord.optimizer, coord.sharding)
        target = s.shard_addresses[lost]
        transfers = []
        for i, b in backups.items():
            if i == lost:  # its own slice, from the replica its backup keeps
                transfers.append(
                    (
                        b,
                        ps_pb2.TransferSliceRequest(
                            job_id=s.job_id,
                            shard_index=i,
                            from_replica=True,
                            target_address=target,
                            target_replica=False,
                            global_iteration=iteration,
                        ),
                    )
                )
            elif b == lost:  # the replica it kept, from the slice's primary
                transfers.append(
                    (
                        i,
                        ps_pb2.TransferSliceRequest(
                            job_id=s.job_id,
                            shard_index=i,
                            from_replica=False,
                            target_address=target,
                            target_replica=True,
                            global_iteration=iteration,
                        ),
                    )
                )
        try:
            await asyncio.gather(
                *(self._call_shard(s, at, "TransferSlice", r) for at, r in transfers)
            )
        except (FailedPrecondition, NotFound, InvalidField) as exc:
            log.warning(
                "job %s: no current replica to restore shard %d from: %s", s.job_id, lost, exc
            )
            return False
        async with job.cond:
            log.warning(
                "job %s: %s; shard %d restored from its replicas at iteration %d, nothing lost",
                s.job_id,
                f"shard {task.shard_index} {task.reason}",
                lost,
                iteration,
            )
            coord.rewind(task, iteration, generation=coord.generation)
            self._kick(job)
            job.cond.notify_all()
        return True

    async def _promote(self, job: _CoordinatedJob, task: RecoverTask) -> bool:
        """The lost shard stays down: its backup merges the replica it kept into its own
        slice, the slices are re-replicated over the shards left, and every learner re-routes
        (BoundaryResponse.shards) and pulls. Nothing committed is lost. False when there is no
        current replica (the caller keeps waiting, or rewinds once the shard is back)."""
        coord = job.coord
        s = coord.settings
        assert coord.layout is not None and coord.optimizer is not None
        assert coord.sharding is not None
        lost = task.shard_index
        iteration = coord.completed
        if not coord.sharding.tensors[lost]:  # promoted already: finish re-replicating
            return await self._finish_promotion(job, task, iteration)
        b = self._backups(coord.sharding).get(lost)
        if b is None:
            return False
        for i in self._active(coord):
            if i != lost:
                status = await self._shard_status(s, i)
                if not (status.holds_job and status.completed_iterations == iteration):
                    return False
        old, old_epoch = coord.sharding, coord.routing_epoch
        new = coord.promote(lost, b)
        try:
            by_name = {m.name: m for m in coord.layout}
            absorb = ps_pb2.ConfigureShardRequest(
                job_id=s.job_id,
                shard_index=b,
                tensors=[by_name[n].to_proto() for n in new.tensors[b]],
                optimizer=_optimizer_spec(coord.optimizer),
                coordinator_address=s.shard_addresses[self.options.shard_index],
                active_shards=new.active_shards,
                absorb_replicas=[lost],
            )
            await self._call_shard(s, b, "ConfigureShard", absorb)
        except (FailedPrecondition, NotFound, InvalidField) as exc:
            coord.sharding, coord.routing_epoch = old, old_epoch
            log.warning("job %s: shard %d cannot take over shard %d: %s", s.job_id, b, lost, exc)
            return False
        except BaseException:
            coord.sharding, coord.routing_epoch = old, old_epoch
            raise
        log.warning(
            "job %s: shard %d promoted to hold the slice of shard %d at iteration %d",
            s.job_id,
            b,
            lost,
            iteration,
        )
        return await self._finish_promotion(job, task, iteration)

    async def _finish_promotion(
        self, job: _CoordinatedJob, task: RecoverTask, iteration: int
    ) -> bool:
        """After a promotion: configure the shards left (not those holding nothing, the lost
        ones among them), re-replicate every slice to its backup, and let the learners go on
        in a new generation (they re-route and pull). Raises while a shard left does not
        answer (the caller tries again; a promotion is not done twice)."""
        coord = job.coord
        s = coord.settings
        assert coord.layout is not None and coord.optimizer is not None
        assert coord.sharding is not None
        new = coord.sharding
        empty = frozenset(i for i, names in enumerate(new.tensors) if not names)
        await self._configure_all(s, coord.layout, coord.optimizer, new, skip=empty)
        await asyncio.gather(
            *(
                self._call_shard(
                    s,
                    i,
                    "TransferSlice",
                    ps_pb2.TransferSliceRequest(
                        job_id=s.job_id,
                        shard_index=i,
                        target_address=s.shard_addresses[q],
                        target_replica=True,
                        global_iteration=iteration,
                    ),
                )
                for i, q in self._backups(new).items()
            )
        )
        async with job.cond:
            log.warning(
                "job %s: %s; its slice re-homed at iteration %d, nothing lost",
                s.job_id,
                f"shard {task.shard_index} {task.reason}",
                iteration,
            )
            coord.rewind(task, iteration, generation=coord.generation)
            self._kick(job)
            job.cond.notify_all()
        return True

    async def _checkpoint_through_shard_loss(
        self, job: _CoordinatedJob, task: CheckpointTask
    ) -> tuple[str, int]:
        """Parameter-server mode: a shard unreachable or restarted while the checkpoint is
        written does not make it a failed (skipped) checkpoint: it is written again while it is
        held. The probe meanwhile finds the shard; if it is back with its slice the next try
        succeeds, if it lost it the rewind drops the checkpoint (and this gives up)."""
        coord = job.coord
        while True:
            try:
                return await self._checkpoint(job, task)
            except (Unavailable, NotFound) as exc:
                if (
                    coord.collective
                    or task not in coord.holds
                    or self._coordinated.get(coord.job_id) is not job
                ):
                    raise
                log.warning("job %s: checkpoint %s waits for a shard: %s", coord.job_id, task, exc)
            await asyncio.sleep(self.options.shard_probe_s)

    async def _recover(self, job: _CoordinatedJob, task: RecoverTask) -> None:
        """Wait for the lost shard to answer. If it holds its slice at the coordinator's
        iteration nothing was lost; otherwise configure it again (a restarted shard comes
        back as an empty spare) and rewind every shard to the latest checkpoint. Never fails:
        while it cannot finish (no checkpoint, storage errors) the job stays recovering with
        the reason in GetJobProgress, and it tries again."""
        coord = job.coord
        s = coord.settings
        base = coord.recovering
        since: float | None = None
        promote_after = self.options.promote_after_s
        while self._coordinated.get(s.job_id) is job:
            try:
                try:
                    status = await self._shard_status(s, task.shard_index)
                except Unavailable:
                    # Still down: after a grace, its backup takes its slice over.
                    now = time.monotonic()
                    since = now if since is None else since
                    if now - since >= promote_after and await self._promote(job, task):
                        return
                    raise
                since = None
                if job.epoch > 0:
                    # After a takeover the lost shard may be the old coordinator, paused and
                    # back: it steps down and points its slice here before it takes part.
                    await self._call_shard(
                        s,
                        task.shard_index,
                        "SetCoordinator",
                        ps_pb2.SetCoordinatorRequest(
                            job_id=s.job_id,
                            coordinator_address=s.shard_addresses[self.options.shard_index],
                            coordinator_epoch=job.epoch,
                            min_generation=coord.generation,
                        ),
                    )
                if status.holds_job and status.initialized:
                    if status.completed_iterations == coord.completed:
                        async with job.cond:
                            log.info(
                                "job %s: shard %d is back, nothing lost", s.job_id, task.shard_index
                            )
                            coord.recovered(task)
                            self._kick(job)
                            job.cond.notify_all()
                        return
                if await self._restore_from_replicas(job, task):
                    return
                found = await asyncio.to_thread(ckpt.latest_checkpoint, s.storage_uri, s.job_id)
                if found is None:
                    raise FailedPrecondition("no checkpoint to rewind to")
                directory, manifest = found
                assert coord.layout is not None and coord.optimizer is not None
                assert coord.sharding is not None
                await self._configure_all(s, coord.layout, coord.optimizer, coord.sharding)
                await self._load_everywhere(coord, directory)
                iteration = int(manifest["iteration"])
                await asyncio.to_thread(
                    self._truncate_metrics, s, iteration, iteration // coord.iterations_per_epoch
                )
                async with job.cond:
                    log.warning(
                        "job %s: %s; every shard rewound to the checkpoint after %d iterations",
                        s.job_id,
                        base,
                        iteration,
                    )
                    coord.rewind(task, iteration, generation=int(manifest.get("generation", 0)))
                    self._kick(job)
                    job.cond.notify_all()
                return
            except Unavailable:  # still down: the promotion above decides
                coord.recovering = f"{base}; waiting for it"
            except Exception as exc:  # never give up on the job: report and try again
                coord.recovering = f"{base}; waiting: {exc}"
                log.warning("job %s: recovering: %s", s.job_id, coord.recovering)
            await asyncio.sleep(self.options.shard_probe_s)

    async def _resolve_everywhere(self, coord: Coordinator, task: ResolveTask) -> None:
        request = ps_pb2.ResolveIterationRequest(
            job_id=coord.job_id,
            generation=task.generation,
            iteration=task.iteration,
            commit=task.commit,
            grad_norm=task.grad_norm,
        )
        active = self._active(coord)
        if task.commit and faults.armed("commit-partial", task.iteration):
            others = [i for i in active if i != self.options.shard_index]
            await self._call_shard(coord.settings, others[0], "ResolveIteration", request)
            faults.die("commit-partial")
        calls = [self._call_shard(coord.settings, i, "ResolveIteration", request) for i in active]
        # The replicas are not told: each applies its sums when the next ones arrive, or is
        # settled when it is used (ShardJob.keep_pending, ShardJob.settle).
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def _checkpoint(self, job: _CoordinatedJob, task: CheckpointTask) -> tuple[str, int]:
        coord = job.coord
        s = coord.settings
        directory = self._checkpoint_directory(s, task.iteration)
        manifest = await asyncio.to_thread(ckpt.read_manifest, directory)
        if manifest is None:
            assert coord.sharding is not None and coord.layout is not None
            active = self._active(coord)
            files: list[tuple[int, Any, list[str]]]
            if coord.collective:
                # A learner holding the state writes it as one shard file (the writer is
                # chosen at the boundaries; it reports the file with its next Boundary).
                waiting = job.checkpoint_files.setdefault(
                    task.iteration, asyncio.get_running_loop().create_future()
                )
                try:
                    while True:
                        done, _ = await asyncio.wait({waiting}, timeout=1.0)
                        if done:
                            report = waiting.result()
                            break
                        if task not in coord.holds:  # abandoned: every holder died
                            raise FailedPrecondition(
                                f"checkpoint after {task.iteration} iterations of job "
                                f"{s.job_id!r}: no learner holding the state is left"
                            )
                finally:
                    job.checkpoint_files.pop(task.iteration, None)
                files = [(0, report, [m.name for m in coord.layout])]
            else:
                request = ps_pb2.SaveShardRequest(
                    job_id=s.job_id, directory=directory, global_iteration=task.iteration
                )
                saved = await asyncio.gather(
                    *(self._call_shard(s, i, "SaveShard", request) for i in active)
                )
                files = [
                    (i, r, list(coord.sharding.tensors[i]))
                    for i, r in zip(active, saved, strict=True)
                ]
            assert coord.optimizer is not None
            progress = coord.progress()
            progress.pop("update_time")
            manifest = {
                "job_id": s.job_id,
                "iteration": task.iteration,
                "epoch": task.epoch,
                "generation": coord.generation,
                "batch_size": s.batch_size,
                "epochs": s.epochs,
                "seed": s.seed,
                "checkpoint_every": s.checkpoint_every,
                "dataset_size": coord.dataset_size,
                "optimizer": {
                    "name": coord.optimizer.name,
                    "hyperparameters_json": coord.optimizer.hyperparameters_json,
                    "clip_grad_norm": coord.optimizer.clip_grad_norm,
                    "skip_nonfinite": coord.optimizer.skip_nonfinite,
                },
                "layout": [
                    {
                        "name": m.name,
                        "dtype": m.dtype,
                        "shape": list(m.shape),
                        "offset": m.offset,
                        "nbytes": m.nbytes,
                        "buffer": m.buffer,
                    }
                    for m in coord.layout
                ],
                "progress": {
                    **progress,
                    "completed_iterations": task.iteration,
                    "last_loss": _json_number(progress["last_loss"]),
                },
                "shards": [
                    {
                        "index": i,
                        "file": shard_file_name(i),
                        "size": r.size_bytes,
                        "sha256": r.sha256,
                        "tensors": names,
                    }
                    for i, r, names in files
                ],
                "time": self._clock(),
            }
            await asyncio.to_thread(ckpt.write_manifest_and_latest, directory, manifest)
            log.info("job %s: checkpoint %s written", s.job_id, directory)
            await self._prune_checkpoints(s)
        if task.final:
            await asyncio.to_thread(self._write_model, s, directory, manifest)
        return directory, task.iteration

    @staticmethod
    async def _prune_checkpoints(s: JobSettings) -> None:
        """Retention (JobSpec.keep_checkpoints): a failure to delete never fails the job."""
        try:
            deleted, reclaimed = await asyncio.to_thread(
                ckpt.prune_checkpoints, s.storage_uri, s.job_id, s.keep_checkpoints
            )
        except (ckpt.StorageError, OSError) as exc:
            log.warning("job %s: old checkpoints not deleted: %s", s.job_id, exc)
            return
        if deleted:
            log.info(
                "job %s: deleted checkpoints %s (keeping %d), %d bytes reclaimed",
                s.job_id,
                ", ".join(deleted),
                s.keep_checkpoints or ckpt.DEFAULT_KEEP,
                reclaimed,
            )

    @staticmethod
    def _write_model(settings: JobSettings, directory: str, manifest: dict[str, Any]) -> None:
        model = model_from_shard_files(directory, manifest)
        uri = ckpt.job_uri(settings.storage_uri, settings.job_id, "model.safetensors")
        ckpt.atomic_write(uri, safetensors.torch.save(model))

    async def _flush_metrics(self, job: _CoordinatedJob) -> None:
        async with job.metrics_lock:
            records = job.coord.take_metrics()
            if not records:
                return
            s = job.coord.settings
            uri = ckpt.job_uri(s.storage_uri, s.job_id, "metrics", "iterations.jsonl")
            lines = [
                json.dumps(
                    {
                        **r,
                        "loss": _json_number(r["loss"]),
                        "samples_per_second": _json_number(r["samples_per_second"]),
                    }
                )
                for r in records
            ]
            try:
                await asyncio.to_thread(ckpt.append_line, uri, "\n".join(lines))
            except ckpt.StorageError as exc:
                log.error("job %s: metrics not written: %s", s.job_id, exc)

    # -- SyncStep / PullParameters ------------------------------------------------------------

    async def SyncStep(
        self, request_iterator: AsyncIterator[Frame], context: Any
    ) -> AsyncIterator[bytes]:
        frames = aiter(request_iterator)
        async with _draining(frames):
            header = await _first_header(frames)
            authorize(
                current_principal(), "SyncStep", job_id=header.job_id, learner_id=header.sender_id
            )
            part = self._slice(header.job_id)
            sj = part.job
            matched = sj.check_stream(
                header, everything=False, max_bytes=self.options.max_bundle_bytes
            )
            g, k, learner = header.generation, header.iteration, header.sender_id
            if header.num_samples < 0:
                raise InvalidField("header.num_samples", header.num_samples, "must be >= 0")
            sj.check_iteration(g, k)
            self.metrics.round_started(header.job_id, g, k)
            members = await self._members(part, g)
            if learner not in members:
                raise StaleGeneration(
                    f"learner {learner!r} is not a member of generation {g} of job "
                    f"{header.job_id!r}"
                )
            contribution = Contribution(
                learner=learner,
                generation=g,
                iteration=k,
                num_samples=header.num_samples,
                loss_sum=header.loss_sum,
                learning_rate=header.learning_rate,
                metas=matched,
                total_bytes=header.total_bytes,
            )
            await _collect(frames, sj, contribution)
        future = part.futures.get((g, k))
        if future is None:
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(_silence)
            part.futures[(g, k)] = future
        ready = await self._compute(sj.accumulate, contribution, members)
        self._fail_superseded(part)
        if ready:
            notify = asyncio.create_task(self._shard_ready(sj, g, k))
            self._background.add(notify)
            notify.add_done_callback(self._background.discard)
        encoded = await asyncio.shield(future)
        yield encode_header(ps_pb2.SyncStepResponse, encoded.header)
        for i in range(encoded.count):
            yield encoded.chunk(i)

    async def _members(self, part: _ShardSlice, generation: int) -> frozenset[str]:
        """The members of ``generation`` (asked from the coordinator once: a generation's
        member list never changes; a superseded generation is refused there)."""
        members = part.memberships.get(generation)
        if members is None:
            sj = part.job
            request = ps_pb2.GetMembershipRequest(job_id=sj.job_id, generation=generation)
            if sj.job_id in self._coordinated:
                reply = await self.GetMembership(request, None)
            else:
                reply = await self._peer_call(
                    sj.coordinator_address, "GetMembership", request, 30.0
                )
            members = frozenset(reply.member_learner_ids)
            part.memberships = {
                gen: value for gen, value in part.memberships.items() if gen >= generation
            }
            part.memberships[generation] = members
        return members

    async def _shard_ready(self, sj: ShardJob, generation: int, iteration: int) -> None:
        clips = sj.optimizer_config.needs_norm
        request = ps_pb2.ShardReadyRequest(
            job_id=sj.job_id,
            shard_index=sj.shard_index,
            generation=generation,
            iteration=iteration,
            grad_sq_norm=await self._compute(sj.grad_sq_norm) if clips else 0.0,
        )
        part = self._slices.get(sj.job_id)
        if part is not None and part.backup_address:
            # The backup holds the very sums before the coordinator may commit them.
            try:
                await self._send_slice(
                    sj, part.backup_address, replica=True, kind="sums", at=(generation, iteration)
                )
            except Exception as exc:
                log.error(
                    "job %s: sums of iteration %d not replicated to %s: %s",
                    sj.job_id,
                    iteration,
                    part.backup_address,
                    exc,
                )
        try:
            if sj.job_id in self._coordinated:
                await self._local_ShardReady(request)
            else:
                await self._peer_call(sj.coordinator_address, "ShardReady", request, 30.0)
        except StaleGeneration as exc:
            log.info("shard ready for a superseded iteration: %s", exc)
        except Exception as exc:
            log.error("ShardReady for job %s failed: %s", sj.job_id, exc)

    def _fail_superseded(self, part: _ShardSlice) -> None:
        floor = part.job.min_generation
        for key in [key for key in part.futures if key[0] < floor]:
            future = part.futures.pop(key)
            if not future.done():
                future.set_exception(_aborted(part.job.job_id, *key))

    def _fail_waiters(self, part: _ShardSlice, exc: Exception) -> None:
        for future in part.futures.values():
            if not future.done():
                future.set_exception(exc)
        part.futures.clear()

    async def PullParameters(
        self, request: ps_pb2.PullParametersRequest, context: Any
    ) -> AsyncIterator[bytes]:
        authorize(
            current_principal(),
            "PullParameters",
            job_id=request.job_id,
            learner_id=request.learner_id or None,
        )
        part = self._slice(request.job_id)
        sj = part.job
        if not sj.initialized:
            raise FailedPrecondition(
                f"shard {sj.shard_index} of job {request.job_id!r} has no parameters yet"
            )
        if request.generation > 0:
            members = await self._members(part, request.generation)
            if request.learner_id not in members:
                raise StaleGeneration(
                    f"learner {request.learner_id!r} is not a member of generation "
                    f"{request.generation} of job {request.job_id!r}"
                )
        encoded = await self._compute(sj.current)
        yield encode_header(ps_pb2.PullParametersResponse, encoded.header)
        for chunk in encoded.chunks:
            yield chunk

    # -- membership changes -------------------------------------------------------------------

    async def RetireLearners(self, request: ps_pb2.RetireLearnersRequest, context: Any) -> Any:
        authorize(current_principal(), "RetireLearners", job_id=request.job_id)
        job = self._job(request.job_id)
        self._check_fence(request.job_id, request.fencing_token)
        async with job.cond:
            effective = job.coord.retire(list(request.learner_ids))
            job.cond.notify_all()
        log.info("job %s: retiring %s", request.job_id, list(request.learner_ids))
        return ps_pb2.RetireLearnersResponse(effective_generation=effective)

    async def EvictLearner(self, request: ps_pb2.EvictLearnerRequest, context: Any) -> Any:
        authorize(current_principal(), "EvictLearner", job_id=request.job_id)
        job = self._job(request.job_id)
        self._check_fence(request.job_id, request.fencing_token)
        async with job.cond:
            aborted, _ = job.coord.evict(request.learner_id)
            self._kick(job)
            job.cond.notify_all()
        await self._flush_metrics(job)
        log.warning(
            "job %s: learner %s evicted (%s); aborted iteration %d",
            request.job_id,
            request.learner_id,
            request.reason or "no reason given",
            aborted,
        )
        return ps_pb2.EvictLearnerResponse(aborted_iteration=aborted)

    # -- checkpoints, metrics, progress -------------------------------------------------------

    async def CreateCheckpoint(self, request: ps_pb2.CreateCheckpointRequest, context: Any) -> Any:
        authorize(current_principal(), "CreateCheckpoint", job_id=request.job_id)
        job = self._job(request.job_id)
        coord = job.coord
        async with job.cond:
            if not coord.initialized or coord.layout is None:
                raise FailedPrecondition(f"job {request.job_id!r} has no parameters yet")
            while True:
                await job.cond.wait_for(lambda: not coord.commit_in_flight)
                task = coord.begin_checkpoint()
                if task is not None:
                    break
                await job.cond.wait()
            self._kick(job)
            future = job.task_results[task]
        directory, iteration = await asyncio.shield(future)
        return ps_pb2.CreateCheckpointResponse(uri=directory, global_iteration=iteration)

    async def ReportEpochMetrics(
        self, request: ps_pb2.ReportEpochMetricsRequest, context: Any
    ) -> Any:
        authorize(
            current_principal(),
            "ReportEpochMetrics",
            job_id=request.job_id,
            learner_id=request.learner_id,
        )
        job = self._job(request.job_id)
        if request.learner_id in job.coord.evicted:
            raise StaleGeneration(f"learner {request.learner_id!r} was evicted")
        s = job.coord.settings
        line = json.dumps(
            {
                "epoch": request.epoch,
                "values": {k: _json_number(v) for k, v in request.values.items()},
                "time": self._clock(),
            }
        )
        uri = ckpt.job_uri(s.storage_uri, s.job_id, "metrics", "epochs.jsonl")
        await asyncio.to_thread(ckpt.append_line, uri, line)
        return ps_pb2.ReportEpochMetricsResponse()

    async def GetJobProgress(self, request: ps_pb2.GetJobProgressRequest, context: Any) -> Any:
        authorize(
            current_principal(),
            "GetJobProgress",
            job_id=request.job_id,
            owner=self._owner(request.job_id),
        )
        coord = self._job(request.job_id).coord
        return ps_pb2.GetJobProgressResponse(
            progress=_progress_proto(coord.progress()),
            member_learner_ids=list(coord.members),
            done=coord.done,
            recovering=bool(coord.recovering),
            recovery_reason=coord.recovering,
        )

    async def GetMembership(self, request: ps_pb2.GetMembershipRequest, context: Any) -> Any:
        authorize(
            current_principal(),
            "GetMembership",
            job_id=request.job_id,
            owner=self._owner(request.job_id),
        )
        coord = self._job(request.job_id).coord
        members, iteration = coord.membership(request.generation)
        return ps_pb2.GetMembershipResponse(
            generation=request.generation, iteration=iteration, member_learner_ids=members
        )

    # -- coordinator -> shard -----------------------------------------------------------------

    async def ConfigureShard(self, request: ps_pb2.ConfigureShardRequest, context: Any) -> Any:
        authorize(current_principal(), "ConfigureShard", job_id=request.job_id)
        return await self._local_ConfigureShard(request)

    async def _local_ConfigureShard(self, request: ps_pb2.ConfigureShardRequest) -> Any:
        self._check_coordinator_epoch(request.job_id, request.coordinator_epoch)
        if request.replica:
            return await self._configure_replica(request)
        if request.shard_index != self.options.shard_index:
            raise InvalidField(
                "shard_index",
                request.shard_index,
                f"is not this shard's ({self.options.shard_index})",
            )
        tensors = [TensorMeta.from_proto(t) for t in request.tensors]
        optimizer = _optimizer_config(request.optimizer)
        existing = self._slices.get(request.job_id)
        if existing is not None and request.absorb_replicas:
            await self._absorb(request, tensors, optimizer, existing)
            return ps_pb2.ConfigureShardResponse()
        if existing is not None:
            if existing.job.same_configuration(tensors, optimizer):
                existing.backup_address = request.backup_address
                if request.coordinator_address:
                    existing.job.coordinator_address = request.coordinator_address
                return ps_pb2.ConfigureShardResponse()
            if existing.job.initialized:
                raise FailedPrecondition(
                    f"shard {self.options.shard_index} already holds parameters of job "
                    f"{request.job_id!r} with another layout or optimizer"
                )
        job = await self._compute(
            lambda: ShardJob(
                request.job_id,
                request.shard_index,
                tensors,
                optimizer,
                coordinator_address=request.coordinator_address,
                active_shards=request.active_shards,
                chunk_bytes=self.options.chunk_bytes,
            )
        )
        self._slices[request.job_id] = _ShardSlice(job, backup_address=request.backup_address)
        return ps_pb2.ConfigureShardResponse()

    async def _absorb(
        self,
        request: ps_pb2.ConfigureShardRequest,
        tensors: list[TensorMeta],
        optimizer: OptimizerConfig,
        existing: _ShardSlice,
    ) -> None:
        """A promotion: this shard's slice grows by the replicas it kept of lost shards,
        restored at the same iteration; the learners waiting on the old slice are aborted."""
        old = existing.job
        replicas = [self._replica(request.job_id, i) for i in request.absorb_replicas]
        held = set(old.names) | {n for r in replicas for n in r.names}
        if held != {m.name for m in tensors}:
            raise InvalidField(
                "tensors", len(tensors), "must be this shard's tensors plus the absorbed ones"
            )

        def merged() -> ShardJob:
            for r in replicas:
                # The same global norm this slice's last commit used (every shard's is).
                r.settle(old.completed, old.last_grad_norm)
            blobs = [old.state_bytes(old.completed)]
            blobs += [r.state_bytes(old.completed) for r in replicas]
            job = ShardJob(
                request.job_id,
                self.options.shard_index,
                tensors,
                optimizer,
                coordinator_address=request.coordinator_address,
                active_shards=request.active_shards,
                chunk_bytes=self.options.chunk_bytes,
            )
            job.absorb(blobs)
            job.min_generation = old.min_generation
            return job

        job = await self._compute(merged)
        self._fail_waiters(existing, _aborted(request.job_id, -1, job.completed))
        self._slices[request.job_id] = _ShardSlice(job, backup_address=request.backup_address)
        for i in request.absorb_replicas:
            self._replicas.pop((request.job_id, i), None)
        log.warning(
            "job %s: shard %d took over the slice of shard(s) %s at iteration %d",
            request.job_id,
            self.options.shard_index,
            list(request.absorb_replicas),
            job.completed,
        )

    async def _configure_replica(self, request: ps_pb2.ConfigureShardRequest) -> Any:
        if request.shard_index == self.options.shard_index or request.shard_index < 0:
            raise InvalidField(
                "shard_index", request.shard_index, "must be another shard's (replica = true)"
            )
        tensors = [TensorMeta.from_proto(t) for t in request.tensors]
        optimizer = OptimizerConfig(
            request.optimizer.name, request.optimizer.hyperparameters_json or "{}"
        )
        key = (request.job_id, request.shard_index)
        existing = self._replicas.get(key)
        if existing is not None and existing.same_configuration(tensors, optimizer):
            return ps_pb2.ConfigureShardResponse()
        self._replicas[key] = await self._compute(
            lambda: ShardJob(
                request.job_id,
                request.shard_index,
                tensors,
                optimizer,
                coordinator_address=request.coordinator_address,
                active_shards=request.active_shards,
                chunk_bytes=self.options.chunk_bytes,
            )
        )
        return ps_pb2.ConfigureShardResponse()

    def _replica(self, job_id: str, shard_index: int) -> ShardJob:
        replica = self._replicas.get((job_id, shard_index))
        if replica is None:
            raise NotFound(f"replica of shard {shard_index} of job", job_id)
        return replica

    # -- replication --------------------------------------------------------------------------

    async def _send_slice(
        self,
        sj: ShardJob,
        address: str,
        *,
        replica: bool,
        kind: str,
        at: tuple[int, int] | None = None,
    ) -> int:
        """Stream ``sj``'s state (``kind="state"``) or its sums of ``at`` (``"sums"``) to the
        shard at ``address`` (Replicate), to keep as a replica or as its own slice."""
        if kind == "state":
            blob = await self._compute(sj.state_bytes, sj.completed)
            wire_kind = ps_pb2.REPLICATE_KIND_STATE
        else:
            assert at is not None
            blob = await self._compute(sj.pending_bytes, *at)
            wire_kind = ps_pb2.REPLICATE_KIND_SUMS
        step = self.options.chunk_bytes
        view = memoryview(blob)

        def messages() -> Any:
            for start in range(0, max(len(blob), 1), step):
                yield ps_pb2.ReplicateRequest(
                    job_id=sj.job_id,
                    shard_index=sj.shard_index,
                    replica=replica,
                    kind=wire_kind,
                    chunk=bytes(view[start : start + step]),
                )

        try:
            reply = await self._stub(address).Replicate(messages(), timeout=600.0)
        except aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(f"Replicate on {address}: {exc.details()}") from exc
            raise Unavailable(f"Replicate on {address}: {exc.details()}") from exc
        return int(reply.global_iteration)

    async def Replicate(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        first: ps_pb2.ReplicateRequest | None = None
        parts: list[bytes] = []
        async for message in request_iterator:
            if first is None:
                first = message
                authorize(current_principal(), "Replicate", job_id=message.job_id)
            parts.append(message.chunk)
        if first is None:
            raise InvalidField("stream", "empty", "must carry at least one message")
        blob = b"".join(parts)
        if first.replica:
            target = self._replica(first.job_id, first.shard_index)
        else:
            if first.shard_index != self.options.shard_index:
                raise InvalidField(
                    "shard_index",
                    first.shard_index,
                    f"is not this shard's ({self.options.shard_index})",
                )
            target = self._slice(first.job_id).job
        if first.kind == ps_pb2.REPLICATE_KIND_SUMS and first.replica:
            # Acknowledged once the bytes are here: taking them (and applying the previous
            # iteration's) runs on the compute thread after this answer, in arrival order, so
            # the primary's ShardReady does not wait for the replica's step. Anything that
            # uses the replica later (a settle, a transfer) queues behind it.
            job_id = first.job_id
            taken = asyncio.ensure_future(self._compute(target.keep_pending, blob))
            self._background.add(taken)

            def done(future: asyncio.Future[int]) -> None:
                self._background.discard(future)
                if not future.cancelled() and future.exception() is not None:
                    log.error("job %s: replica did not take sums: %s", job_id, future.exception())

            taken.add_done_callback(done)
            return ps_pb2.ReplicateResponse(global_iteration=-1)
        elif first.kind == ps_pb2.REPLICATE_KIND_STATE:
            iteration = await self._compute(target.load_state_bytes, blob)
            if not first.replica:
                part = self._slices[first.job_id]
                self._fail_waiters(part, _aborted(first.job_id, -1, iteration))
                part.memberships.clear()
        else:
            raise InvalidField("kind", first.kind, "must be SUMS (to a replica) or STATE")
        return ps_pb2.ReplicateResponse(global_iteration=iteration)

    async def TransferSlice(self, request: ps_pb2.TransferSliceRequest, context: Any) -> Any:
        authorize(current_principal(), "TransferSlice", job_id=request.job_id)
        return await self._local_TransferSlice(request)

    async def _local_TransferSlice(self, request: ps_pb2.TransferSliceRequest) -> Any:
        self._check_coordinator_epoch(request.job_id, request.coordinator_epoch)
        if request.from_replica:
            source = self._replica(request.job_id, request.shard_index)
            await self._compute(source.settle, request.global_iteration)
        else:
            source = self._slice(request.job_id).job
            if request.shard_index != self.options.shard_index:
                raise InvalidField(
                    "shard_index",
                    request.shard_index,
                    f"is not this shard's ({self.options.shard_index})",
                )
        if not source.initialized or source.completed != request.global_iteration:
            raise FailedPrecondition(
                f"slice {request.shard_index} of job {request.job_id!r} here is at iteration "
                f"{source.completed}, not {request.global_iteration}"
            )
        iteration = await self._send_slice(
            source, request.target_address, replica=request.target_replica, kind="state"
        )
        return ps_pb2.TransferSliceResponse(global_iteration=iteration)

    async def ShardReady(self, request: ps_pb2.ShardReadyRequest, context: Any) -> Any:
        authorize(current_principal(), "ShardReady", job_id=request.job_id)
        return await self._local_ShardReady(request)

    async def _local_ShardReady(self, request: ps_pb2.ShardReadyRequest) -> Any:
        job = self._job(request.job_id)
        async with job.cond:
            job.coord.shard_ready(
                request.shard_index, request.generation, request.iteration, request.grad_sq_norm
            )
            self._kick(job)
            job.cond.notify_all()
        return ps_pb2.ShardReadyResponse()

    async def ResolveIteration(self, request: ps_pb2.ResolveIterationRequest, context: Any) -> Any:
        authorize(current_principal(), "ResolveIteration", job_id=request.job_id)
        return await self._local_ResolveIteration(request)

    async def _local_ResolveIteration(self, request: ps_pb2.ResolveIterationRequest) -> Any:
        self._check_coordinator_epoch(request.job_id, request.coordinator_epoch)
        part = self._slice(request.job_id)
        sj = part.job
        key = (request.generation, request.iteration)
        if request.commit:
            encoded = await self._compute(sj.commit, *key, request.grad_norm)
            future = part.futures.pop(key, None)
            if encoded is not None and future is not None and not future.done():
                future.set_result(encoded)
            self.metrics.round_committed(request.job_id, *key)
        else:
            await self._compute(sj.abort, *key)
            self.metrics.round_aborted(request.job_id, request.generation)
            part.memberships.pop(request.generation, None)
            self._fail_superseded(part)
        return ps_pb2.ResolveIterationResponse()

    async def SaveShard(self, request: ps_pb2.SaveShardRequest, context: Any) -> Any:
        authorize(current_principal(), "SaveShard", job_id=request.job_id)
        check_job_directory(
            "directory",
            request.directory,
            storage_uri=self.options.storage_uri,
            job_id=request.job_id,
        )
        return await self._local_SaveShard(request)

    async def _local_SaveShard(self, request: ps_pb2.SaveShardRequest) -> Any:
        self._check_coordinator_epoch(request.job_id, request.coordinator_epoch)
        sj = self._slice(request.job_id).job
        if faults.armed("save-shard", request.global_iteration):
            faults.die("save-shard")
        uri, size, digest = await self._compute(
            sj.save, request.directory, request.global_iteration
        )
        return ps_pb2.SaveShardResponse(uri=uri, size_bytes=size, sha256=digest)

    async def LoadShard(self, request: ps_pb2.LoadShardRequest, context: Any) -> Any:
        authorize(current_principal(), "LoadShard", job_id=request.job_id)
        check_job_directory(
            "directory",
            request.directory,
            storage_uri=self.options.storage_uri,
            job_id=request.job_id,
        )
        return await self._local_LoadShard(request)

    async def _local_LoadShard(self, request: ps_pb2.LoadShardRequest) -> Any:
        if request.replica:
            replica = self._replica(request.job_id, request.shard_index)
            iteration = await self._compute(replica.load, request.directory)
            return ps_pb2.LoadShardResponse(global_iteration=iteration)
        part = self._slice(request.job_id)
        iteration = await self._compute(part.job.load, request.directory)
        self._fail_waiters(part, _aborted(request.job_id, -1, iteration))
        part.memberships.clear()
        self.metrics.forget(request.job_id)
        return ps_pb2.LoadShardResponse(global_iteration=iteration)

    async def GetShardStatus(self, request: ps_pb2.GetShardStatusRequest, context: Any) -> Any:
        authorize(current_principal(), "GetShardStatus", job_id=request.job_id)
        return await self._local_GetShardStatus(request)

    async def _local_GetShardStatus(self, request: ps_pb2.GetShardStatusRequest) -> Any:
        if request.shard_index != self.options.shard_index:
            raise InvalidField(
                "shard_index",
                request.shard_index,
                f"is not this shard's ({self.options.shard_index})",
            )
        part = self._slices.get(request.job_id)
        if part is None:
            return ps_pb2.GetShardStatusResponse(holds_job=False, completed_iterations=-1)
        return ps_pb2.GetShardStatusResponse(
            holds_job=True,
            initialized=part.job.initialized,
            completed_iterations=part.job.completed,
        )


def _shard_state(reply: ps_pb2.SetCoordinatorResponse) -> ShardState:
    pending = None
    if reply.pending_iteration >= 0:
        pending = (int(reply.pending_generation), int(reply.pending_iteration))
    return ShardState(
        int(reply.completed_iterations), tuple(reply.tensor_names), pending, reply.last_grad_norm
    )


def _optimizer_config(spec: ps_pb2.OptimizerSpec) -> OptimizerConfig:
    clip = spec.clip_grad_norm
    if not (math.isfinite(clip) and clip >= 0):
        raise InvalidField("optimizer.clip_grad_norm", clip, "must be a finite number >= 0")
    return OptimizerConfig(spec.name, spec.hyperparameters_json or "{}", clip, spec.skip_nonfinite)


def _aborted(job_id: str, generation: int, iteration: int) -> Aborted:
    return Aborted(
        f"iteration {iteration} of generation {generation} of job {job_id!r} was aborted "
        "(a member was evicted or the job was restored): ask Boundary again"
    )


@contextlib.asynccontextmanager
async def _draining(frames: AsyncIterator[Frame], limit_s: float = 10.0) -> AsyncIterator[None]:
    """On an error, read (and drop) the rest of the request stream before the handler fails:
    a gRPC client still writing when the server ends the call gets INTERNAL instead of the
    server's status. Bounded in time, so a client that never stops cannot hold the handler."""
    try:
        yield
    except Exception:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(limit_s):
                async for _ in frames:
                    pass
        raise


async def _first_header(frames: AsyncIterator[Frame]) -> ps_pb2.TensorBundleHeader:
    try:
        first = await anext(frames)
    except StopAsyncIteration:
        raise InvalidField("header", None, "must be the first message of the stream") from None
    if first.header is None:
        raise InvalidField("header", "chunk", "must be the first message of the stream")
    return first.header


async def _collect(frames: AsyncIterator[Frame], sj: ShardJob, contribution: Contribution) -> None:
    async for frame in frames:
        if frame.chunk is None:
            raise InvalidField("chunk", "header", "only the first message may be a header")
        sj.take_chunk(contribution, frame.chunk)
    sj.check_complete(contribution)


def _optimizer_spec(optimizer: OptimizerConfig) -> ps_pb2.OptimizerSpec:
    """What a shard needs to step its slice the way every other shard does (clipping and
    non-finite skipping included: a promoted backup must decide as the others do)."""
    return ps_pb2.OptimizerSpec(
        name=optimizer.name,
        hyperparameters_json=optimizer.hyperparameters_json,
        clip_grad_norm=optimizer.clip_grad_norm,
        skip_nonfinite=optimizer.skip_nonfinite,
    )
