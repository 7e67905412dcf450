# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The side effects of a coordinator's decisions (its task executor): commits and aborts on
every shard, checkpoints, the batch schedule and the metrics file. The watch of the other
shards and the recovery after a shard loss are ``servicer_recovery.py``. Part of the
ParameterSyncService servicer (``service.py``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import safetensors.torch

from shoal.contract import faults
from shoal.contract.batch_schedule import BatchSchedule
from shoal.param_sync import checkpoint as ckpt, holder
from shoal.param_sync.coordinator import (
    CheckpointTask,
    Coordinator,
    JobSettings,
    RecoverTask,
    ResolveTask,
    RewindTask,
    ScheduleTask,
)
from shoal.param_sync.servicer_common import (
    _CoordinatedJob,
    _json_number,
    _nothing,
    _silence,
)
from shoal.param_sync.shard import model_from_shard_files, shard_file_name
from shoal.runtime.errors import (
    FailedPrecondition,
    StorageFull,
    Unavailable,
)
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")

T = TypeVar("T")


SCHEDULE_FILE = "batch_schedule.json"
"""A job with an adaptive batch: its batch schedule, under the job's storage, rewritten at each
change before a learner runs at the new batch (a successor coordinator reads it back)."""


def schedule_uri(settings: JobSettings) -> str:
    return ckpt.job_uri(settings.storage_uri, settings.job_id, SCHEDULE_FILE)


def read_schedule(settings: JobSettings) -> BatchSchedule | None:
    """The stored batch schedule of an adaptive job (None: none stored, or the job's batch is
    fixed). A file that does not parse is logged and ignored (the scheduler's next pick
    starts a new one) rather than trusted."""
    if not settings.adaptive:
        return None
    data = ckpt.read_bytes(schedule_uri(settings))
    if data is None:
        return None
    try:
        return BatchSchedule.from_json(data)
    except ValueError as exc:
        log.error("job %s: stored batch schedule ignored: %s", settings.job_id, exc)
        return None


class CoordinatorTasks:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    # -- side effects of the coordinator ------------------------------------------------------

    async def _as_holder(
        self: _S,
        job: _CoordinatedJob,
        write: Callable[..., T],
        *args: Any,
        inline: bool = False,
    ) -> T:
        """``write(*args)`` in a thread, if the job's storage mark still names this
        coordinator (holder.py; checked in the same thread just before): a coordinator
        superseded while it was paused writes nothing, steps down and raises UNAVAILABLE.
        ``inline``: in the event loop's own thread instead (a small write on the local
        filesystem, where the hop to a thread and back costs more than the write)."""
        s = job.coord.settings
        try:
            if inline:
                return holder.as_holder(s.storage_uri, s.job_id, job.holder, write, *args)
            return await asyncio.to_thread(
                holder.as_holder, s.storage_uri, s.job_id, job.holder, write, *args
            )
        except holder.Superseded as exc:
            self._note_successor(job, exc)
            await self._step_down(job, str(exc))
            raise Unavailable(
                f"shard {self.options.shard_index} no longer coordinates job {s.job_id!r}: "
                f"{exc}; ask the other shards (FindCoordinator)"
            ) from exc

    async def _renew_records(self: _S, storage_uri: str, job_id: str, job_holder: str) -> None:
        """``holder.renew_records`` in a thread, for a coordinator taking the job (OpenJob,
        TakeOverJob): superseded meanwhile (another took it after this one marked it), it
        takes nothing and says so as UNAVAILABLE."""
        try:
            await asyncio.to_thread(holder.renew_records, storage_uri, job_id, job_holder)
        except holder.Superseded as exc:
            raise Unavailable(
                f"shard {self.options.shard_index} did not take job {job_id!r}: another "
                f"coordinator took it meanwhile: {exc}"
            ) from exc

    def _note_successor(self: _S, job: _CoordinatedJob, exc: holder.Superseded) -> None:
        """Remember the coordinator the job's mark names (when it is a shard of the job at a
        newer epoch than this shard knows), so FindCoordinator here points the learners to
        it before its SetCoordinator arrives, not back to this deposed one."""
        s = job.coord.settings
        shard, epoch = exc.shard, exc.epoch
        if shard is None or epoch is None or not 0 <= shard < len(s.shard_addresses):
            return
        _, known = self._coordinator_at.get(s.job_id, ("", 0))
        if epoch > max(known, job.epoch):
            self._coordinator_at[s.job_id] = (s.shard_addresses[shard], epoch)

    def _kick(self: _S, job: _CoordinatedJob) -> None:
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
        self: _S,
        job: _CoordinatedJob,
        task: ResolveTask | CheckpointTask | RewindTask | RecoverTask | ScheduleTask,
        future: asyncio.Future[Any],
    ) -> None:
        ok, result = True, None
        try:
            if job.deposed:  # stepped down (SetCoordinator, or storage names another)
                raise Unavailable(
                    f"shard {self.options.shard_index} no longer coordinates job "
                    f"{job.coord.job_id!r}: {task} not run"
                )
            if isinstance(task, ResolveTask):
                await self._resolve_everywhere(job.coord, task)
                if task.commit:
                    self.metrics.iteration_committed(job.coord.job_id)
            elif isinstance(task, RecoverTask):
                await self._recover(job, task)
            elif isinstance(task, ScheduleTask):
                uri = schedule_uri(job.coord.settings)
                await self._as_holder(job, ckpt.atomic_write, uri, task.schedule_json.encode())
            elif isinstance(task, RewindTask):
                s = job.coord.settings
                log.warning(
                    "job %s: no learner holds the state any more; continuing from iteration %d",
                    s.job_id,
                    task.iteration,
                )
                await self._as_holder(
                    job,
                    self._truncate_metrics,
                    s,
                    task.iteration,
                    job.coord.shape.epoch_of(task.iteration),
                )
            else:
                result = await self._checkpoint_through_shard_loss(job, task)
        except Exception as exc:
            ok = False
            # a storage refusal (or a step-down) was logged in words where it happened: no traceback
            quiet = isinstance(exc, (ckpt.StorageError, StorageFull, Unavailable))
            log.error(
                "job %s: %s failed: %s",
                job.coord.job_id,
                task,
                exc,
                exc_info=None if quiet else exc,
            )
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

    async def _resolve_everywhere(self: _S, coord: Coordinator, task: ResolveTask) -> None:
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

    async def _checkpoint(self: _S, job: _CoordinatedJob, task: CheckpointTask) -> tuple[str, int]:
        coord = job.coord
        s = coord.settings
        directory = self._checkpoint_directory(s, task.iteration)
        manifest = await asyncio.to_thread(ckpt.read_manifest, directory)
        if manifest is None:
            assert coord.shape.sharding is not None and coord.shape.layout is not None
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
                if report.error:  # the storage refused the learner's write; nothing is left
                    raise ckpt.StorageError(
                        f"the learner's write of {report.file}: {report.error}",
                        full=report.storage_full,
                    )
                files = [(0, report, [m.name for m in coord.shape.layout])]
            else:
                request = ps_pb2.SaveShardRequest(
                    job_id=s.job_id, directory=directory, global_iteration=task.iteration
                )
                await self._as_holder(
                    job, _nothing
                )  # a superseded coordinator writes no shard file
                # Every shard's write ends before a failure is raised: a failed checkpoint's
                # files are deleted after it, and none is written after that.
                results = await asyncio.gather(
                    *(self._call_shard(s, i, "SaveShard", request) for i in active),
                    return_exceptions=True,
                )
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
                saved = list(results)
                files = [
                    (i, r, list(coord.shape.sharding.tensors[i]))
                    for i, r in zip(active, saved, strict=True)
                ]
            assert coord.shape.optimizer is not None
            progress = coord.progress()
            progress.pop("update_time")
            manifest = {
                "job_id": s.job_id,
                "iteration": task.iteration,
                "epoch": task.epoch,
                "generation": coord.generation,
                "batch_size": s.batch_size,
                **({"batch_schedule": coord.shape.schedule.to_json()} if s.adaptive else {}),
                "epochs": s.epochs,
                "seed": s.seed,
                "checkpoint_every": s.checkpoint_every,
                "dataset_size": coord.shape.dataset_size,
                "optimizer": {
                    "name": coord.shape.optimizer.name,
                    "hyperparameters_json": coord.shape.optimizer.hyperparameters_json,
                    "clip_grad_norm": coord.shape.optimizer.clip_grad_norm,
                    "skip_nonfinite": coord.shape.optimizer.skip_nonfinite,
                    "param_groups_json": coord.shape.optimizer.param_groups_json,
                    "measure_grad_norm": coord.shape.optimizer.measure_grad_norm,
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
                    for m in coord.shape.layout
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
            await self._as_holder(job, ckpt.write_manifest_and_latest, directory, manifest)
            log.info("job %s: checkpoint %s written", s.job_id, directory)
            await self._prune_checkpoints(s)
        elif not coord.collective and await self._as_holder(job, ckpt.advance_latest, directory):
            # written before, but its commit stopped between the manifest and ``latest``
            log.info("job %s: latest now names %s", s.job_id, directory)
        if task.final:
            await self._as_holder(job, self._write_model, s, directory, manifest)
        return directory, task.iteration

    @staticmethod
    async def _prune_checkpoints(s: JobSettings) -> None:
        """Retention (JobSpec.keep_checkpoints): a failure to delete never fails the job."""
        try:
            deleted, reclaimed = await asyncio.to_thread(
                ckpt.prune_checkpoints, s.storage_uri, s.job_id, s.keep_checkpoints, s.keep_every
            )
        except (ckpt.StorageError, OSError) as exc:
            log.warning("job %s: old checkpoints not deleted: %s", s.job_id, exc)
            return
        if deleted:
            log.info(
                "job %s: deleted checkpoints %s (keeping %d, and every %s), %d bytes reclaimed",
                s.job_id,
                ", ".join(deleted),
                s.keep_checkpoints or ckpt.DEFAULT_KEEP,
                f"{s.keep_every}th" if s.keep_every else "none",
                reclaimed,
            )

    @staticmethod
    def _write_model(settings: JobSettings, directory: str, manifest: dict[str, Any]) -> None:
        model = model_from_shard_files(directory, manifest)
        uri = ckpt.job_uri(settings.storage_uri, settings.job_id, "model.safetensors")
        ckpt.atomic_write(uri, safetensors.torch.save(model))

    async def _flush_metrics(self: _S, job: _CoordinatedJob) -> None:
        async with job.metrics_lock:
            # Records a failed write kept (a full disk) go first, in order: none is lost.
            records = job.unwritten_metrics + job.coord.take_metrics()
            job.unwritten_metrics = []
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
                # Local storage: the mark's read and the append (a few syscalls, ~20 us) run
                # inline; every commit makes them (collective mode: every iteration).
                await self._as_holder(
                    job, ckpt.append_line, uri, "\n".join(lines), inline=ckpt.is_local(uri)
                )
            except ckpt.StorageError as exc:
                job.unwritten_metrics = records  # written with the next flush
                log.error(
                    "job %s: %d iteration records not written yet: %s", s.job_id, len(records), exc
                )
