# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""A coordinator's watch of its job's other shards and its recovery after one is lost
(parameter-server mode): restore the lost slice from its replicas, or promote the backup, or
load the latest checkpoint everywhere; the rules are the coordinator's
(``coordinator_recovery.py``), this executes them. Part of the ParameterSyncService servicer
(``service.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from shoal.param_sync import checkpoint as ckpt
from shoal.param_sync.coordinator import (
    CheckpointTask,
    JobSettings,
    RecoverTask,
)
from shoal.param_sync.servicer_common import (
    _CoordinatedJob,
    _optimizer_spec,
)
from shoal.runtime.errors import (
    FailedPrecondition,
    InvalidField,
    NotFound,
    ShoalError,
    StorageFull,
    Unavailable,
)
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")


class ShardLossHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    async def _shard_status(
        self: _S, settings: JobSettings, index: int
    ) -> ps_pb2.GetShardStatusResponse:
        request = ps_pb2.GetShardStatusRequest(job_id=settings.job_id, shard_index=index)
        if index == self.options.shard_index:
            return await self._local_GetShardStatus(request)
        timeout = max(2.0, 2 * self.options.shard_probe_s)
        return await self._peer_call(
            settings.shard_addresses[index], "GetShardStatus", request, timeout
        )

    async def _watch_shards(self: _S, job: _CoordinatedJob) -> None:
        """Probe the other shards of a parameter-server job every ``shard_probe_s``: a shard
        that answers without its slice (it restarted), or misses ``shard_probe_misses``
        probes in a row, starts a recovery (:meth:`Coordinator.shard_lost`); a generation
        floor above the coordinator's generation (its own slice's included) is acted on by the
        floor guard (:meth:`~shoal.param_sync.servicer_floor.FloorGuard._apply_floors`)."""
        coord = job.coord
        misses: dict[int, int] = {}
        while self._coordinated.get(coord.job_id) is job and not coord.done:
            await asyncio.sleep(self.options.shard_probe_s)
            if (
                coord.collective is not False
                or coord.shape.sharding is None
                or not coord.initialized
                or coord.recovery is not None
            ):
                continue
            floors: dict[int, int] = {}
            for i in self._active(coord):
                if i == self.options.shard_index:
                    floors.update(await self._floors_of(job, [i]))
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
                    if status.holds_job and status.initialized:
                        floors[i] = int(status.generation_floor)
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
            else:
                # A shard whose floor drifted above the coordinator's generation refuses every
                # contribution: re-issue above it (servicer_floor.py).
                await self._apply_floors(job, floors)

    async def _restore_from_replicas(self: _S, job: _CoordinatedJob, task: RecoverTask) -> bool:
        """Restore the lost shard from the replicas: its own slice from its backup, the
        replica it kept from that slice's primary, all at the coordinator's iteration; then
        every learner pulls and the job goes on with no committed iteration lost. False (and
        the caller rewinds to the checkpoint) when a copy is not there or not current."""
        coord = job.coord
        s = coord.settings
        assert coord.shape.layout is not None and coord.shape.optimizer is not None
        assert coord.shape.sharding is not None
        backups = self._backups(coord.shape.sharding)
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
        await self._configure_all(
            s, coord.shape.layout, coord.shape.optimizer, coord.shape.sharding
        )
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

    async def _promote(self: _S, job: _CoordinatedJob, task: RecoverTask) -> bool:
        """The lost shard stays down: its backup merges the replica it kept into its own
        slice, the slices are re-replicated over the shards left, and every learner re-routes
        (BoundaryResponse.shards) and pulls. Nothing committed is lost. False when there is no
        current replica (the caller keeps waiting, or rewinds once the shard is back)."""
        coord = job.coord
        s = coord.settings
        assert coord.shape.layout is not None and coord.shape.optimizer is not None
        assert coord.shape.sharding is not None
        lost = task.shard_index
        iteration = coord.completed
        if not coord.shape.sharding.tensors[lost]:  # promoted already: finish re-replicating
            return await self._finish_promotion(job, task, iteration)
        b = self._backups(coord.shape.sharding).get(lost)
        if b is None:
            return False
        for i in self._active(coord):
            if i != lost:
                status = await self._shard_status(s, i)
                if not (status.holds_job and status.completed_iterations == iteration):
                    return False
        old, old_epoch = coord.shape.sharding, coord.routing_epoch
        new = coord.promote(lost, b)
        try:
            by_name = {m.name: m for m in coord.shape.layout}
            absorb = ps_pb2.ConfigureShardRequest(
                job_id=s.job_id,
                shard_index=b,
                tensors=[by_name[n].to_proto() for n in new.tensors[b]],
                optimizer=_optimizer_spec(coord.shape.optimizer),
                coordinator_address=s.shard_addresses[self.options.shard_index],
                active_shards=new.active_shards,
                absorb_replicas=[lost],
            )
            await self._call_shard(s, b, "ConfigureShard", absorb)
        except (FailedPrecondition, NotFound, InvalidField) as exc:
            coord.shape.sharding, coord.routing_epoch = old, old_epoch
            log.warning("job %s: shard %d cannot take over shard %d: %s", s.job_id, b, lost, exc)
            return False
        except BaseException:
            coord.shape.sharding, coord.routing_epoch = old, old_epoch
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
        self: _S, job: _CoordinatedJob, task: RecoverTask, iteration: int
    ) -> bool:
        """After a promotion: configure the shards left (not those holding nothing, the lost
        ones among them), re-replicate every slice to its backup, and let the learners go on
        in a new generation (they re-route and pull). Raises while a shard left does not
        answer (the caller tries again; a promotion is not done twice)."""
        coord = job.coord
        s = coord.settings
        assert coord.shape.layout is not None and coord.shape.optimizer is not None
        assert coord.shape.sharding is not None
        new = coord.shape.sharding
        empty = frozenset(i for i, names in enumerate(new.tensors) if not names)
        await self._configure_all(s, coord.shape.layout, coord.shape.optimizer, new, skip=empty)
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
        self: _S, job: _CoordinatedJob, task: CheckpointTask
    ) -> tuple[str, int]:
        """Parameter-server mode: a shard unreachable or restarted while the checkpoint is
        written does not make it a failed (skipped) checkpoint: it is written again while it is
        held. The probe meanwhile finds the shard; if it is back with its slice the next try
        succeeds, if it lost it the rewind drops the checkpoint (and this gives up)."""
        coord = job.coord
        s = coord.settings
        pause = self.options.shard_probe_s
        while True:
            try:
                result = await self._checkpoint(job, task)
            except (Unavailable, NotFound) as exc:
                if (
                    coord.collective
                    or task not in coord.holds
                    or self._coordinated.get(coord.job_id) is not job
                ):
                    raise
                log.warning("job %s: checkpoint %s waits for a shard: %s", coord.job_id, task, exc)
                pause = self.options.shard_probe_s
            except (ckpt.StorageError, StorageFull) as exc:
                # The storage refused the write (a full disk): nothing of it was committed
                # and its files are deleted. Said in GetJobProgress.checkpoint_error until a
                # checkpoint commits. A periodic checkpoint is skipped (training goes on, the
                # next one tries again); the final one is retried while held (backing off up
                # to a minute): the job is not done before its final state is stored.
                full = isinstance(exc, StorageFull) or getattr(exc, "full", False)
                job.checkpoint_error = (
                    f"checkpoint after {task.iteration} iterations failed: "
                    f"{'storage full: ' if full else ''}{exc} (storage {s.storage_uri})"
                )
                log.error("job %s: %s", coord.job_id, job.checkpoint_error)
                await self._discard_checkpoint(s, task.iteration)
                if (
                    not task.final
                    or task not in coord.holds
                    or self._coordinated.get(coord.job_id) is not job
                ):
                    raise
                pause = min(60.0, max(pause * 2, 1.0))
                if coord.collective:
                    # A learner holding the state writes it again after the pause (any of
                    # them: the one that failed is asked like the others).
                    await asyncio.sleep(pause)
                    if task not in coord.holds or self._coordinated.get(coord.job_id) is not job:
                        raise  # dropped (a rewind) or the role moved meanwhile: not ours now
                    async with job.cond:
                        coord.checkpoint_write_failed(task)
                        job.cond.notify_all()
                    continue
            else:
                job.checkpoint_error = ""
                return result
            await asyncio.sleep(pause)

    async def _discard_checkpoint(self: _S, s: JobSettings, iteration: int) -> None:
        """Delete what a failed checkpoint write left (no manifest: never committed)."""
        directory = self._checkpoint_directory(s, iteration)
        try:
            if await asyncio.to_thread(ckpt.discard_incomplete, directory):
                log.info("job %s: deleted the incomplete checkpoint %s", s.job_id, directory)
        except ckpt.StorageError as exc:
            log.warning("job %s: %s", s.job_id, exc)

    async def _recover(self: _S, job: _CoordinatedJob, task: RecoverTask) -> None:
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
                assert coord.shape.layout is not None and coord.shape.optimizer is not None
                assert coord.shape.sharding is not None
                await self._configure_all(
                    s, coord.shape.layout, coord.shape.optimizer, coord.shape.sharding
                )
                await self._load_everywhere(coord, directory)
                iteration = int(manifest["iteration"])
                await self._as_holder(
                    job, self._truncate_metrics, s, iteration, coord.shape.epoch_of(iteration)
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
