# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The coordinator-to-shard and shard-to-shard RPCs: ConfigureShard, ShardReady,
ResolveIteration, SaveShard, LoadShard, GetShardStatus, TransferSlice and the replication
of slices (Replicate). Part of the ParameterSyncService servicer (``service.py``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from shoal.contract import faults
from shoal.contract.wire import TensorMeta, serialize
from shoal.param_sync.authz import authorize, check_job_directory
from shoal.param_sync.checkpoint import StorageError
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.replica_lane import SNAPSHOT_EVERY, SlotSums, deferral_limit
from shoal.param_sync.servicer_common import _aborted, _optimizer_config, _ShardSlice
from shoal.param_sync.shard import ShardJob
from shoal.param_sync.shard_encoding import Encoded
from shoal.runtime.auth import current_principal
from shoal.runtime.errors import (
    FailedPrecondition,
    InvalidField,
    NotFound,
    StorageFull,
    Unavailable,
)
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")


class PeerHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    # -- coordinator -> shard -----------------------------------------------------------------

    async def ConfigureShard(self: _S, request: ps_pb2.ConfigureShardRequest, context: Any) -> Any:
        authorize(current_principal(), "ConfigureShard", job_id=request.job_id)
        return await self._local_ConfigureShard(request)

    async def _local_ConfigureShard(self: _S, request: ps_pb2.ConfigureShardRequest) -> Any:
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
                step_group_bytes=self.options.step_group_bytes,
            )
        )
        self._slices[request.job_id] = _ShardSlice(job, backup_address=request.backup_address)
        return ps_pb2.ConfigureShardResponse()

    async def _absorb(
        self: _S,
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
                step_group_bytes=self.options.step_group_bytes,
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

    async def _configure_replica(self: _S, request: ps_pb2.ConfigureShardRequest) -> Any:
        if request.shard_index == self.options.shard_index or request.shard_index < 0:
            raise InvalidField(
                "shard_index", request.shard_index, "must be another shard's (replica = true)"
            )
        tensors = [TensorMeta.from_proto(t) for t in request.tensors]
        # All of it (clipping, skipping, groups): the replica commits as the primary does.
        optimizer = _optimizer_config(request.optimizer)
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
                step_group_bytes=self.options.step_group_bytes,
            )
        )
        return ps_pb2.ConfigureShardResponse()

    def _replica(self: _S, job_id: str, shard_index: int) -> ShardJob:
        replica = self._replicas.get((job_id, shard_index))
        if replica is None:
            raise NotFound(f"replica of shard {shard_index} of job", job_id)
        return replica

    # -- replication --------------------------------------------------------------------------

    def _in_background(self: _S, work: Awaitable[Any], failure: str) -> asyncio.Future[Any]:
        """Run ``work`` as a task that is kept until it ends (returned); a failure is
        logged."""
        task = asyncio.ensure_future(work)
        self._background.add(task)

        def done(future: asyncio.Future[Any]) -> None:
            self._background.discard(future)
            if not future.cancelled() and future.exception() is not None:
                log.error("%s: %s", failure, future.exception())

        task.add_done_callback(done)
        return task

    async def _send_slice(
        self: _S,
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
            parts: list[Any] = [blob]
            wire_kind = ps_pb2.REPLICATE_KIND_STATE
        else:
            assert at is not None
            header, views = await self._compute(sj.pending_frames, *at)
            if replica and await self._replicate_sums_shm(
                sj.job_id, sj.shard_index, address, header, views
            ):
                return -1  # the backup on this host took them from shared memory
            parts = [header, *views]
            wire_kind = ps_pb2.REPLICATE_KIND_SUMS
        prefix = ps_pb2.ReplicateRequest(
            job_id=sj.job_id, shard_index=sj.shard_index, replica=replica, kind=wire_kind
        ).SerializeToString()
        messages = replicate_messages(prefix, parts, self.options.chunk_bytes)
        reply = await self._replicate_call(address, messages)
        return int(reply.global_iteration)

    async def _replicate_call(self: _S, address: str, messages: Any) -> ps_pb2.ReplicateResponse:
        """One Replicate call of the encoded ``messages`` to the shard at ``address``."""
        try:
            self._stub(address)  # opens the pooled channel
            replicate = self._channels[address][0].stream_unary(
                "/shoal.v1.ParameterSyncService/Replicate",
                request_serializer=serialize,  # the messages are encoded already
                response_deserializer=ps_pb2.ReplicateResponse.FromString,
            )
            reply: ps_pb2.ReplicateResponse = await replicate(messages, timeout=600.0)
        except aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(f"Replicate on {address}: {exc.details()}") from exc
            raise Unavailable(f"Replicate on {address}: {exc.details()}") from exc
        return reply

    async def Replicate(self: _S, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        first: ps_pb2.ReplicateRequest | None = None
        parts: list[memoryview] = []
        async for frame in request_iterator:
            if first is None:
                first = frame.header
                authorize(current_principal(), "Replicate", job_id=first.job_id)
            parts.append(frame.chunk)
        if first is None:
            raise InvalidField("stream", "empty", "must carry at least one message")
        blob: Any
        if first.shared_memory:  # SUMS from a primary on this host (replica_lane.py)
            if any(p.nbytes for p in parts):
                raise InvalidField("chunk", "...", "must not come with shared_memory")
            blob = await self._take_sums_shm(first)
        else:
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
            # A blob left in the primary's slot (replica_lane.py) is copied out there, and
            # checked to be still there after the copy.
            # Sums from a primary on this host, which sends snapshots, may be kept unstepped
            # (shard_replica.py, "deferred steps"); others are stepped at the commit.
            in_place = isinstance(blob, SlotSums)
            limit = deferral_limit(target) if in_place else 0
            args = (blob.view, blob.still_there, limit) if in_place else (blob, None, limit)
            taking = self._in_background(
                self._compute(target.keep_pending, *args),
                f"job {first.job_id}: replica did not take sums",
            )
            if in_place:
                self._taking(first.job_id, first.shard_index, taking)
            return ps_pb2.ReplicateResponse(
                global_iteration=-1,
                shared_memory_taken=first.shared_memory,
                shared_memory_deferred=in_place,
                replica_snapshots=limit > 0,
            )
        elif first.kind == ps_pb2.REPLICATE_KIND_STATE and isinstance(blob, SlotSums):
            # A snapshot of the primary's state (to a replica, in place: _take_sums_shm),
            # taken after the answer as sums are.
            taking = self._in_background(
                self._take_snapshot(target, blob),
                f"job {first.job_id}: replica did not take a snapshot",
            )
            self._taking(first.job_id, first.shard_index, taking)
            return ps_pb2.ReplicateResponse(
                global_iteration=-1, shared_memory_taken=True, shared_memory_deferred=True
            )
        elif first.kind == ps_pb2.REPLICATE_KIND_STATE:
            iteration = await self._compute(target.load_state_bytes, blob)
            if not first.replica:
                part = self._slices[first.job_id]
                self._fail_waiters(part, _aborted(first.job_id, -1, iteration))
                part.memberships.clear()
        else:
            raise InvalidField("kind", first.kind, "must be SUMS (to a replica) or STATE")
        return ps_pb2.ReplicateResponse(global_iteration=iteration)

    async def _take_snapshot(self: _S, replica: ShardJob, blob: SlotSums) -> None:
        if not await self._compute(replica.take_snapshot, blob.view, blob.still_there):
            return
        self.metrics.replica_snapshot(replica.job_id)
        if replica.snapshots_taken == 1:
            log.info(
                "job %s: the replica of shard %d kept here defers its steps (its primary on "
                "this host sends snapshots)",
                replica.job_id,
                replica.shard_index,
            )

    async def TransferSlice(self: _S, request: ps_pb2.TransferSliceRequest, context: Any) -> Any:
        authorize(current_principal(), "TransferSlice", job_id=request.job_id)
        return await self._local_TransferSlice(request)

    async def _local_TransferSlice(self: _S, request: ps_pb2.TransferSliceRequest) -> Any:
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

    async def ShardReady(self: _S, request: ps_pb2.ShardReadyRequest, context: Any) -> Any:
        authorize(current_principal(), "ShardReady", job_id=request.job_id)
        return await self._local_ShardReady(request)

    async def _local_ShardReady(self: _S, request: ps_pb2.ShardReadyRequest) -> Any:
        job = self._job(request.job_id)
        async with job.cond:
            job.coord.shard_ready(
                request.shard_index, request.generation, request.iteration, request.grad_sq_norm
            )
            self._kick(job)
            job.cond.notify_all()
        return ps_pb2.ShardReadyResponse()

    async def ResolveIteration(
        self: _S, request: ps_pb2.ResolveIterationRequest, context: Any
    ) -> Any:
        authorize(current_principal(), "ResolveIteration", job_id=request.job_id)
        return await self._local_ResolveIteration(request)

    async def _local_ResolveIteration(self: _S, request: ps_pb2.ResolveIterationRequest) -> Any:
        self._check_coordinator_epoch(request.job_id, request.coordinator_epoch)
        part = self._slice(request.job_id)
        sj = part.job
        key = (request.generation, request.iteration)
        if request.commit:
            # The learners' SyncStep answers start as soon as the commit starts: their header
            # at once, each chunk once its bytes are stepped (Encoded.ready); the commit stays
            # one compute task.
            future = part.futures.get(key)
            publish = None
            if future is not None:
                publish = _publisher(asyncio.get_running_loop(), future)
            encoded = await self._compute_small(
                sj.total_bytes, sj.commit, *key, request.grad_norm, publish
            )
            future = part.futures.pop(key, None)
            if encoded is not None and future is not None and not future.done():
                future.set_result(encoded)
            self.metrics.round_committed(request.job_id, *key)
            # The iteration is committed job-wide: the replicas kept here of other shards'
            # slices step now too (their sums of it arrived before this commit could be
            # decided), after this slice's step, while its learners receive the parameters.
            replicas = [r for (job, _), r in self._replicas.items() if job == request.job_id]
            answers = self._lane_answers_of(request.job_id, *key)
            if (request.iteration + 1) % SNAPSHOT_EVERY == 0:
                self._snapshot_to_backup(request.job_id)
            if replicas:
                self._in_background(
                    self._apply_replicas_after(answers, replicas, key, request.grad_norm),
                    f"job {request.job_id}: replicas did not step iteration {request.iteration}",
                )
        else:
            await self._compute(sj.abort, *key)
            self.metrics.round_aborted(request.job_id, request.generation)
            part.memberships.pop(request.generation, None)
            self._fail_superseded(part)
        return ps_pb2.ResolveIterationResponse()

    def _lane_answers_of(
        self: _S, job_id: str, generation: int, iteration: int
    ) -> list[asyncio.Future[None]]:
        """The lane answers of (generation, iteration) being written (resolved once each is),
        forgetting those of earlier iterations of the job."""
        for key in [k for k in self._lane_answers if k[0] == job_id and k[2] <= iteration]:
            if key[1:] != (generation, iteration):
                del self._lane_answers[key]
        return self._lane_answers.pop((job_id, generation, iteration), [])

    async def _apply_replicas_after(
        self: _S,
        answers: list[asyncio.Future[None]],
        replicas: list[ShardJob],
        key: tuple[int, int],
        grad_norm: float,
    ) -> None:
        """Step the replicas kept here for the committed ``key`` once this slice's lane answers
        of it are written (at most :data:`_ANSWERS_FIRST_S` later): they share one compute
        thread, and the learners wait for the answers, not for the replicas. (A replica that
        has not stepped yet is settled before anything else uses it: keep_pending, settle.)"""
        if answers:
            await asyncio.wait(answers, timeout=_ANSWERS_FIRST_S)
        await self._compute(_apply_replicated, replicas, *key, grad_norm)

    async def SaveShard(self: _S, request: ps_pb2.SaveShardRequest, context: Any) -> Any:
        authorize(current_principal(), "SaveShard", job_id=request.job_id)
        check_job_directory(
            "directory",
            request.directory,
            storage_uri=self.options.storage_uri,
            job_id=request.job_id,
        )
        return await self._local_SaveShard(request)

    async def _local_SaveShard(self: _S, request: ps_pb2.SaveShardRequest) -> Any:
        self._check_coordinator_epoch(request.job_id, request.coordinator_epoch)
        sj = self._slice(request.job_id).job
        if faults.armed("save-shard", request.global_iteration):
            faults.die("save-shard")
        try:
            uri, size, digest = await self._compute(
                sj.save, request.directory, request.global_iteration
            )
        except StorageError as exc:
            if exc.full:  # RESOURCE_EXHAUSTED: not taken for a lost shard by the coordinator
                raise StorageFull(str(exc)) from exc
            raise
        return ps_pb2.SaveShardResponse(uri=uri, size_bytes=size, sha256=digest)

    async def LoadShard(self: _S, request: ps_pb2.LoadShardRequest, context: Any) -> Any:
        authorize(current_principal(), "LoadShard", job_id=request.job_id)
        check_job_directory(
            "directory",
            request.directory,
            storage_uri=self.options.storage_uri,
            job_id=request.job_id,
        )
        return await self._local_LoadShard(request)

    async def _local_LoadShard(self: _S, request: ps_pb2.LoadShardRequest) -> Any:
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

    async def GetShardStatus(self: _S, request: ps_pb2.GetShardStatusRequest, context: Any) -> Any:
        authorize(current_principal(), "GetShardStatus", job_id=request.job_id)
        return await self._local_GetShardStatus(request)

    async def _local_GetShardStatus(self: _S, request: ps_pb2.GetShardStatusRequest) -> Any:
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
            generation_floor=part.job.min_generation,
        )


def _apply_replicated(
    replicas: list[ShardJob], generation: int, iteration: int, grad_norm: float
) -> None:
    for replica in replicas:
        replica.apply_replicated(generation, iteration, grad_norm)


#: Seconds the replicas' step waits for the lane answers of the same commit at most.
_ANSWERS_FIRST_S = 5.0

_REPLICATE_CHUNK_TAG = 0x2A  # ReplicateRequest.chunk: field 5, length-delimited


def _publisher(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[Encoded]
) -> Callable[[Encoded], None]:
    """What a commit calls (on the compute thread) with its encoding before it steps: binds
    the encoding to ``loop`` and resolves ``future`` with it there."""

    def resolve(encoded: Encoded) -> None:
        if not future.done():
            future.set_result(encoded)

    def publish(encoded: Encoded) -> None:
        encoded.bind(loop)
        loop.call_soon_threadsafe(resolve, encoded)

    return publish


def replicate_messages(prefix: bytes, parts: Sequence[Any], chunk_bytes: int) -> Iterator[bytes]:
    """The serialized ReplicateRequest messages of a blob given as byte-like ``parts``:
    each is ``prefix`` (the serialized fields 1-4) followed by the ``chunk`` field with the
    next ``chunk_bytes`` of the blob, written by hand so each payload byte is copied once
    (fields may come in any order in a protobuf message; the chunk comes last here)."""
    views = [memoryview(part).cast("B") for part in parts]
    pending: list[memoryview] = []
    size = 0
    for view in views:
        while view.nbytes:
            take = view[: chunk_bytes - size]
            pending.append(take)
            size += take.nbytes
            view = view[take.nbytes :]
            if size == chunk_bytes:
                yield _chunk_message(prefix, pending, size)
                pending, size = [], 0
    if pending or not any(v.nbytes for v in views):
        yield _chunk_message(prefix, pending, size)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if not value:
            out.append(bits)
            return bytes(out)
        out.append(bits | 0x80)


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position); value -1 when ``data`` ends inside the varint."""
    result = shift = 0
    while pos < len(data) and shift <= 63:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    return -1, pos


def _chunk_message(prefix: bytes, parts: list[memoryview], size: int) -> bytes:
    return b"".join((prefix, bytes((_REPLICATE_CHUNK_TAG,)), varint(size), *parts))


@dataclass(frozen=True)
class ReplicateFrame:
    """One decoded Replicate message: ``header``, the message without its chunk (named so
    that the identifier check of request streams, ``check_request_ids``, sees it as it sees
    a tensor frame's header), and the chunk."""

    header: ps_pb2.ReplicateRequest
    chunk: memoryview


def decode_replicate(data: bytes) -> ReplicateFrame:
    """gRPC deserializer of Replicate: the message without its chunk, and the chunk as a
    view into ``data`` (no copy) when it is the message's last field, as
    :func:`replicate_messages` writes it; otherwise through the protobuf runtime."""
    pos = 0
    while pos < len(data):
        start = pos
        tag, pos = read_varint(data, pos)
        if tag < 0:
            break
        wire = tag & 7
        if wire == 0:
            value, pos = read_varint(data, pos)
            if value < 0:
                break
        elif wire == 2:
            size, pos = read_varint(data, pos)
            if size < 0 or pos + size > len(data):
                break
            if tag == _REPLICATE_CHUNK_TAG and pos + size == len(data):
                message = ps_pb2.ReplicateRequest.FromString(data[:start])
                return ReplicateFrame(message, memoryview(data)[pos:])
            pos += size
        else:
            break
    message = ps_pb2.ReplicateRequest.FromString(data)
    chunk = memoryview(message.chunk)
    message.ClearField("chunk")
    return ReplicateFrame(message, chunk)
