# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The scheduler's side of a shard: OpenJob and CloseJob (with the resume from a checkpoint),
and the coordinator's calls to the shards of a job it coordinates. The coordinator's failover
is ``servicer_takeover.py``. Part of the ParameterSyncService servicer (``service.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shoal.contract.batch_schedule import BatchSchedule
from shoal.contract.wire import TensorMeta
from shoal.param_sync import checkpoint as ckpt, holder
from shoal.param_sync.authz import authorize, check_storage_uri
from shoal.param_sync.coordinator import Coordinator, JobSettings, OptimizerConfig
from shoal.param_sync.servicer_common import (
    _CoordinatedJob,
    _optimizer_spec,
    _progress_proto,
)
from shoal.param_sync.sharding import Sharding
from shoal.runtime.auth import current_principal
from shoal.runtime.errors import (
    Aborted,
    InvalidField,
    JobNotFound,
    ShoalError,
)
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")


class JobHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    # -- OpenJob / CloseJob -------------------------------------------------------------------

    async def OpenJob(self: _S, request: ps_pb2.OpenJobRequest, context: Any) -> Any:
        authorize(current_principal(), "OpenJob", job_id=request.job_id)
        if not request.job_id:
            raise InvalidField("job_id", "", "must not be empty")
        storage = check_storage_uri(request.storage_uri, self.options.storage_uri)
        settings = _job_settings(request, storage)
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
                    progress=_progress_proto(coord.progress()),
                    resumed=coord.resumed,
                    coordinator_epoch=existing.epoch,
                )
            job = _CoordinatedJob(Coordinator(settings, clock=self._clock), owner=request.owner)
            self._opening[request.job_id] = job
            try:
                await self._fence_the_shards(job, request.coordinator_epoch)
                # The job's files are this coordinator's from now on (holder.py), before it
                # reads any of them; a paused predecessor's append lands in no file it reads.
                await asyncio.to_thread(
                    holder.mark_holder,
                    storage,
                    request.job_id,
                    job.holder,
                    shard=self.options.shard_index,
                    epoch=job.epoch,
                )
                await self._renew_records(storage, request.job_id, job.holder)
                found = await asyncio.to_thread(ckpt.latest_checkpoint, storage, request.job_id)
                if found is not None:
                    await self._resume(job, *found)
            finally:
                self._opening.pop(request.job_id, None)
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
                progress=_progress_proto(job.coord.progress()),
                resumed=job.coord.resumed,
                coordinator_epoch=job.epoch,
            )

    async def _resume(
        self: _S, job: _CoordinatedJob, directory: str, manifest: dict[str, Any]
    ) -> None:
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
        schedule = None
        if s.adaptive and "batch_schedule" in manifest:
            try:
                schedule = BatchSchedule.from_json(manifest["batch_schedule"])
            except ValueError as exc:
                raise InvalidField(
                    "checkpoint.batch_schedule", str(manifest["batch_schedule"])[:80], str(exc)
                ) from exc
        coord.restore(
            layout=layout,
            optimizer=optimizer,
            dataset_size=int(manifest["dataset_size"]),
            completed=int(manifest["iteration"]),
            samples_processed=int(progress.get("samples_processed", 0)),
            generation=int(manifest.get("generation", 0)),
            last_loss=float(progress.get("last_loss", math.nan)),
            schedule=schedule,
        )
        assert coord.shape.layout is not None and coord.shape.sharding is not None
        await self._configure_all(s, coord.shape.layout, optimizer, coord.shape.sharding)
        await self._load_everywhere(coord, directory)
        await self._as_holder(
            job,
            self._truncate_metrics,
            s,
            coord.completed,
            coord.shape.epoch_of(coord.completed),
        )

    @staticmethod
    def _last_recorded(settings: JobSettings) -> int:
        """The highest global iteration in the job's iterations.jsonl (-1: none)."""
        uri = ckpt.job_uri(settings.storage_uri, settings.job_id, "metrics", "iterations.jsonl")
        data = ckpt.read_records(uri)
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
            data = ckpt.read_records(uri)
            if data is None:
                continue
            kept = []
            for line in data.decode().splitlines():
                try:
                    if int(json.loads(line).get(field_name, -1)) < limit:
                        kept.append(line)
                except (ValueError, AttributeError):
                    continue
            ckpt.rewrite_records(uri, "".join(k + "\n" for k in kept).encode())

    async def CloseJob(self: _S, request: ps_pb2.CloseJobRequest, context: Any) -> Any:
        authorize(current_principal(), "CloseJob", job_id=request.job_id)
        self._check_fence(request.job_id, request.fencing_token)
        job = self._coordinated.pop(request.job_id, None)
        part = self._slices.pop(request.job_id, None)
        self._drop_lanes(request.job_id)
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

    def _active(self: _S, coord: Coordinator) -> list[int]:
        assert coord.shape.sharding is not None
        return [i for i, names in enumerate(coord.shape.sharding.tensors) if names]

    async def _call_shard(
        self: _S, settings: JobSettings, index: int, method: str, request: Any
    ) -> Any:
        job = self._coordinated.get(settings.job_id) or self._opening.get(settings.job_id)
        if job is not None and "coordinator_epoch" in request.DESCRIPTOR.fields_by_name:
            request.coordinator_epoch = job.epoch  # fenced on the shard (SetCoordinator)
        if index == self.options.shard_index:
            local = getattr(self, f"_local_{method}")
            return await local(request)
        timeout = 600.0 if method in ("SaveShard", "LoadShard", "TransferSlice") else 60.0
        return await self._peer_call(settings.shard_addresses[index], method, request, timeout)

    async def _configure_all(
        self: _S,
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

    def _backups(self: _S, sharding: Sharding) -> dict[int, int]:
        """Each active shard's backup: the next active shard (cyclically); none with
        replication off or fewer than two active shards."""
        active = [i for i, names in enumerate(sharding.tensors) if names]
        if not self.options.replication or len(active) < 2:
            return {}
        return {i: active[(n + 1) % len(active)] for n, i in enumerate(active)}

    async def _load_everywhere(self: _S, coord: Coordinator, directory: str) -> None:
        """LoadShard of a checkpoint on every active shard and every replica."""
        s = coord.settings
        assert coord.shape.sharding is not None
        calls = [
            self._call_shard(
                s, i, "LoadShard", ps_pb2.LoadShardRequest(job_id=s.job_id, directory=directory)
            )
            for i in self._active(coord)
        ]
        for i, b in self._backups(coord.shape.sharding).items():
            request = ps_pb2.LoadShardRequest(
                job_id=s.job_id, directory=directory, replica=True, shard_index=i
            )
            calls.append(self._call_shard(s, b, "LoadShard", request))
        await asyncio.gather(*calls)


def _job_settings(
    request: ps_pb2.OpenJobRequest | ps_pb2.TakeOverJobRequest, storage: str
) -> JobSettings:
    """The settings of the job an OpenJob or TakeOverJob names (``storage``: its checked
    storage URI)."""
    spec = request.spec
    return JobSettings(
        job_id=request.job_id,
        batch_size=spec.batch_size,
        epochs=spec.epochs,
        seed=spec.seed,
        checkpoint_every=spec.checkpoint_every,
        keep_checkpoints=spec.keep_checkpoints,
        keep_every=spec.keep_every_nth_checkpoint,
        storage_uri=storage,
        shard_addresses=tuple(request.shard_addresses),
        min_batch=spec.adaptive_batch.min_global_batch,
        max_batch=spec.adaptive_batch.max_global_batch,
    )
