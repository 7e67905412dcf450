"""State and helpers shared by the parts of the ParameterSyncService servicer
(``service.py`` and ``servicer_*.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import timestamp_pb2

from shoal.contract.wire import Frame
from shoal.param_sync import checkpoint as ckpt
from shoal.param_sync.coordinator import Coordinator, OptimizerConfig
from shoal.param_sync.shard import Contribution, ShardJob
from shoal.param_sync.shard_encoding import Encoded
from shoal.param_sync.takeover_collective import CollectiveTakeover
from shoal.runtime.errors import DEFAULT_TABLE, Aborted, ErrorTable, InvalidField
from shoal.v1 import job_pb2, parameter_sync_service_pb2 as ps_pb2

#: The service's error table: storage failures (a checkpoint that cannot be written or read)
#: are UNAVAILABLE (retry later); everything else is the runtime's base table.
ERRORS: ErrorTable = DEFAULT_TABLE.extend({ckpt.StorageError: grpc.StatusCode.UNAVAILABLE})


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
    # Collective mode: a takeover whose state comes from the re-joining learners
    # (servicer_takeover_collective.py); kept after its decision (later Joins read it).
    collective_takeover: CollectiveTakeover | None = None
    # Another shard took the role over at a higher epoch (SetCoordinator), or storage names
    # another holder (holder.py): every waiting Boundary fails UNAVAILABLE, so that its
    # learner looks for the new coordinator.
    deposed: bool = False
    # This coordinator's token in the job's storage mark (holder.py): it writes the job's
    # files only while the mark names it.
    holder: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Why the last checkpoint write failed (a full disk), in words; "" once one commits.
    checkpoint_error: str = ""
    # Iteration records whose write to metrics/iterations.jsonl failed: written first next time.
    unwritten_metrics: list[dict[str, Any]] = field(default_factory=list)
    # The generation floor guard (servicer_floor.py): one check at a time; per shard, the
    # coordinator generation and time of its last check on a learner's report; the (shard,
    # epoch) of floors of a later coordinator epoch already logged.
    floor_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    floor_checked: dict[int, tuple[int, float]] = field(default_factory=dict)
    foreign_floors: set[tuple[int, int]] = field(default_factory=set)


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


def _nothing() -> None:
    return None


def _optimizer_config(spec: ps_pb2.OptimizerSpec) -> OptimizerConfig:
    clip = spec.clip_grad_norm
    if not (math.isfinite(clip) and clip >= 0):
        raise InvalidField("optimizer.clip_grad_norm", clip, "must be a finite number >= 0")
    return OptimizerConfig(
        spec.name,
        spec.hyperparameters_json or "{}",
        clip,
        spec.skip_nonfinite,
        spec.param_groups_json,
        spec.measure_grad_norm,
    )


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


async def _collect(
    frames: AsyncIterator[Frame],
    sj: ShardJob,
    contribution: Contribution,
    header: ps_pb2.TensorBundleHeader,
    *,
    trailer: bool = False,
) -> None:
    """Keep a stream's chunks (no copy), or the bytes its header carries inline (checked by
    :meth:`ShardJob.check_stream`; then no chunk may follow). With ``trailer`` (SyncStep) the
    last message may be a ``TensorBundleTrailer``, checked and applied to ``contribution`` by
    the shard (:meth:`ShardJob.take_trailer`)."""
    ended = False
    inline = sj.take_inline(contribution, header)
    async for frame in frames:
        if frame.trailer is not None and trailer:
            if ended:
                raise InvalidField("trailer", "a second trailer", "at most one may end a stream")
            sj.take_trailer(contribution, frame.trailer)
            ended = True
            continue
        if frame.chunk is None:
            raise InvalidField("chunk", "header", "only the first message may be a header")
        if ended:
            raise InvalidField(
                "chunk", f"{frame.chunk.nbytes} bytes", "must not follow the trailer"
            )
        if inline:
            raise InvalidField(
                "chunk",
                f"{frame.chunk.nbytes} bytes",
                f"must not follow a header with inline_data ({len(header.inline_data)} bytes)",
            )
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
        param_groups_json=optimizer.param_groups_json,
        measure_grad_norm=optimizer.measure_grad_norm,
    )
