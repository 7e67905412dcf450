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

The servicer is one class assembled from parts, one module each: ``servicer_jobs.py`` (the
scheduler's calls, coordinator failover), ``servicer_learners.py`` (the coordinator's RPCs for
learners and users), ``servicer_tasks.py`` (the coordinator's side effects: recovery,
checkpoints, metrics), ``servicer_data.py`` (the tensor streams of the shard's own slice),
``servicer_peers.py`` (coordinator-to-shard and shard-to-shard calls, replication) and
``servicer_common.py`` (per-job state and helpers). This module keeps the wiring (roles,
errors, options, the codec registration) and the state and helpers every part uses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc import aio

from shoal.contract.errors import StaleCoordinator, decode_rpc_error
from shoal.contract.lane_handoff import HandoffServer
from shoal.contract.shm import ATTACH_WINDOW_S, SHM_DIR, host_id
from shoal.contract.wire import (
    DEFAULT_CHUNK_BYTES,
    frame_decoder,
    serialize,
)
from shoal.param_sync.coordinator import (
    JobSettings,
)
from shoal.param_sync.lane_control import LaneControlHandlers
from shoal.param_sync.metrics import SyncMetrics
from shoal.param_sync.replica_lane import RecvLane, ReplicaLaneHandlers, SendLane
from shoal.param_sync.servicer_common import (
    ERRORS,
    _CoordinatedJob,
    _ShardSlice,
)
from shoal.param_sync.servicer_data import DataHandlers
from shoal.param_sync.servicer_floor import FloorGuard
from shoal.param_sync.servicer_jobs import JobHandlers
from shoal.param_sync.servicer_learners import LearnerHandlers
from shoal.param_sync.servicer_peers import PeerHandlers, decode_replicate
from shoal.param_sync.servicer_recovery import ShardLossHandlers
from shoal.param_sync.servicer_takeover import TakeoverHandlers
from shoal.param_sync.servicer_takeover_collective import CollectiveTakeoverHandlers
from shoal.param_sync.servicer_tasks import CoordinatorTasks
from shoal.param_sync.shard import (
    DEFAULT_STEP_GROUP_BYTES,
    ShardJob,
)
from shoal.param_sync.shm_lane import Lane, LaneHandlers, SharedAnswer
from shoal.runtime.auth import (
    LEARNERS,
    SERVICES,
    USERS_AND_SERVICES,
    MethodRoles,
)
from shoal.runtime.channels import connect
from shoal.runtime.config import TLSConfig
from shoal.runtime.errors import (
    FailedPrecondition,
    FencedOut,
    InvalidField,
    JobNotFound,
    NotFound,
    StaleGeneration,
    StorageFull,
    Unavailable,
)
from shoal.v1 import (
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

#: Work on a slice of at most this many bytes on the hot path (a contribution summed, the
#: commit's step, a lane's answer written) runs in the event loop when the compute thread is
#: idle (``ParameterSyncServicer._compute_small``).
INLINE_COMPUTE_BYTES = 256 << 10

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
                "OpenSharedLane",
            )
        },
        "GetJobProgress": LEARNERS | USERS_AND_SERVICES,
        "GetMembership": LEARNERS | USERS_AND_SERVICES,
    },
)


@dataclass(frozen=True)
class ShardOptions:
    """What the servicer needs beyond the server config."""

    shard_index: int
    storage_uri: str
    service_token: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # The commit steps a slice in groups of about this many bytes, in layout order, and the
    # SyncStep answers send each chunk once stepped (0: the whole slice at once).
    step_group_bytes: int = DEFAULT_STEP_GROUP_BYTES
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
    # The same-host shared-memory lane (shm_lane.py): learners on this host may move their
    # SyncStep bytes through a nameless segment instead of gRPC chunks (``shm_dir`` only
    # enters the host id). A lane whose descriptor was not fetched within
    # ``shm_fetch_window_s`` of OpenSharedLane is dropped.
    shm_lane: bool = True
    shm_dir: str = SHM_DIR
    shm_fetch_window_s: float = ATTACH_WINDOW_S


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
        "SetGlobalBatch": (ps_pb2.SetGlobalBatchRequest, ps_pb2.SetGlobalBatchResponse),
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
        "OpenSharedLane": (ps_pb2.OpenSharedLaneRequest, ps_pb2.OpenSharedLaneResponse),
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
        request_deserializer=decode_replicate,
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


class ParameterSyncServicer(
    JobHandlers,
    TakeoverHandlers,
    LearnerHandlers,
    CollectiveTakeoverHandlers,
    CoordinatorTasks,
    ShardLossHandlers,
    FloorGuard,
    DataHandlers,
    PeerHandlers,
    LaneHandlers,
    LaneControlHandlers,
    ReplicaLaneHandlers,
):
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
        # Jobs inside OpenJob (fencing the shards, loading the checkpoint): their calls to the
        # shards carry the epoch the opening took, before the job is coordinated.
        self._opening: dict[str, _CoordinatedJob] = {}
        # Jobs inside TakeOverJob: the shards were told this one coordinates them (and its
        # FindCoordinator may say so) before the job is in ``_coordinated``.
        self._taking_over: set[str] = set()
        self._slices: dict[str, _ShardSlice] = {}
        # Replicas this shard keeps of other shards' slices: (job, whose index) -> state.
        self._replicas: dict[tuple[str, int], ShardJob] = {}
        self._fences: dict[tuple[str, str], int] = {}
        # Where each job's coordinator is, as told by SetCoordinator: (address, epoch).
        self._coordinator_at: dict[str, tuple[str, int]] = {}
        self._open_lock = asyncio.Lock()
        # SyncStep refusals logged per job: (when the last line was, how many since).
        self._refusals: dict[str, tuple[float, int]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="param-sync")
        self._computing: set[concurrent.futures.Future[Any]] = set()  # submitted to it
        self._channels: dict[str, tuple[aio.Channel, ps_grpc.ParameterSyncServiceStub]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._rendezvous_store: Any = None  # torch.distributed.TCPStore, on first use
        self._rendezvous_secret = secrets.token_bytes(32)
        # Same-host lanes, by (job, learner); this host's id (shoal.contract.shm.host_id).
        self._lanes: dict[tuple[str, str], Lane] = {}
        self._shared_answers: dict[str, SharedAnswer] = {}  # by job (shm_lane.py)
        self._host_id = host_id(options.shm_dir) if options.shm_lane else ""
        # The Unix socket that hands the lanes' descriptors (started with the first lane).
        self._handoff = HandoffServer(on_refused=self.metrics.lane_handoff_refused)
        # Sums replicated through shared memory on this host (replica_lane.py): the segments
        # this shard sends from, by (job, backup address); those it reads, by (job, whose
        # index); the backups that take none (another host, an older version).
        self._replica_sends: dict[tuple[str, str], SendLane] = {}
        self._replica_recv: dict[tuple[str, int], RecvLane] = {}
        self._replica_no_shm: set[tuple[str, str]] = set()
        # Lane answers being written, by (job, generation, iteration): the replicas kept here
        # step that iteration after them (servicer_peers.py, ResolveIteration).
        self._lane_answers: dict[tuple[str, int, int], list[asyncio.Future[None]]] = {}

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
        self._drop_lanes()
        await self._handoff.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- helpers ------------------------------------------------------------------------------

    async def _compute(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the compute thread (one for the whole shard: the work on its
        tensors runs in submission order, never two at once)."""
        work = self._executor.submit(fn, *args)
        self._computing = {w for w in self._computing if not w.done()}
        self._computing.add(work)
        return await asyncio.wrap_future(work)

    async def _compute_small(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`_compute`, or ``fn(*args)`` right here in the event loop when it touches at
        most :data:`INLINE_COMPUTE_BYTES` and the compute thread has nothing in hand (so the
        order stays that of submission, and nothing runs beside it): for a small slice the
        two hand-offs between the threads cost more than the work."""
        if self._inline_compute(nbytes):
            return fn(*args)
        return await self._compute(fn, *args)

    def _inline_compute(self, nbytes: int) -> bool:
        """Whether work on ``nbytes`` runs right here in the event loop
        (:meth:`_compute_small`)."""
        if nbytes > INLINE_COMPUTE_BYTES:
            return False
        self._computing = {w for w in self._computing if not w.done()}
        return not self._computing

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
                reason = decode_rpc_error(exc).reason
                if reason == "ERROR_REASON_STALE_GENERATION":
                    raise StaleGeneration(text) from exc
                if reason == "ERROR_REASON_STALE_COORDINATOR":
                    raise StaleCoordinator(text) from exc
                raise FailedPrecondition(text) from exc
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidField(method, address, f"refused: {exc.details()}") from exc
            if (
                code == grpc.StatusCode.RESOURCE_EXHAUSTED
                and decode_rpc_error(exc).reason == "ERROR_REASON_STORAGE_FULL"
            ):
                raise StorageFull(text) from exc  # the shard's storage is full, not lost
            raise Unavailable(text) from exc

    def _owner(self, job_id: str) -> str | None:
        job = self._coordinated.get(job_id)
        return job.owner if job is not None else None

    def _job(self, job_id: str) -> _CoordinatedJob:
        job = self._coordinated.get(job_id)
        if job is None:
            if job_id in self._taking_over:
                # A learner that followed the move, or the scheduler, came before the takeover
                # finished: a moment later the job is here (a retryable status, not NOT_FOUND,
                # which a learner takes as fatal and the scheduler as "not a member").
                raise Unavailable(
                    f"job {job_id!r}: this shard is taking over as its coordinator; retry"
                )
            raise JobNotFound(job_id)
        return job

    @contextlib.contextmanager
    def _taking_over_job(self, job_id: str) -> Iterator[None]:
        """While this shard takes the coordinator role of ``job_id`` over (see ``_job``)."""
        self._taking_over.add(job_id)
        try:
            yield
        finally:
            self._taking_over.discard(job_id)

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
            raise StaleCoordinator(
                f"coordinator_epoch ({epoch}) of job {job_id!r} is older than the current "
                f"coordinator's ({known}, {address})"
            )
