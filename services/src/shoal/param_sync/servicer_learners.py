# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The coordinator's RPCs for learners and users: Join, InitializeParameters, Boundary,
RetireLearners, SetGlobalBatch, EvictLearner, CreateCheckpoint, ReportEpochMetrics, GetJobProgress,
GetMembership. Part of the ParameterSyncService servicer (``service.py``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from shoal.contract import faults
from shoal.contract.wire import Frame, TensorMeta
from shoal.param_sync import checkpoint as ckpt
from shoal.param_sync.authz import authorize
from shoal.param_sync.coordinator import Action, Coordinator, JobSettings, check_user_metrics
from shoal.param_sync.servicer_common import (
    _collect,
    _CoordinatedJob,
    _draining,
    _first_header,
    _json_number,
    _optimizer_config,
    _progress_proto,
)
from shoal.param_sync.shard import Contribution, build_optimizer, shard_file_name
from shoal.runtime.auth import current_principal
from shoal.runtime.errors import (
    FailedPrecondition,
    InvalidField,
    ShoalError,
    StaleGeneration,
    Unavailable,
)
from shoal.v1 import job_pb2, parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")


class LearnerHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    # -- Join / InitializeParameters ----------------------------------------------------------

    async def Join(self: _S, request: ps_pb2.JoinRequest, context: Any) -> Any:
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
        if job.collective_takeover is not None:  # collective failover: the learners' state
            if not collective:
                raise InvalidField(
                    "sync_mode", request.sync_mode, "differs from the job's (COLLECTIVE)"
                )
            await self._rejoin_collective(job, request, layout, optimizer)
            return self._join_response(coord, False, collective=True)
        async with job.configure_lock:
            sharding = coord.shape.plan_sharding(layout, optimizer, request.dataset_size)
            if job.takeover is not None and coord.shape.layout is None:
                if collective:
                    raise FailedPrecondition(
                        f"job {request.job_id!r} was taken over from a lost coordinator in "
                        "parameter-server mode; a collective job resumes from its checkpoint"
                    )
                await self._complete_takeover(job, layout, optimizer, request.dataset_size)
            coord.set_mode(collective)
            if coord.shape.layout is None:
                build_optimizer(optimizer, [])  # refuse a bad optimizer before any state
                if not collective:  # in collective mode the learners hold the state
                    await self._configure_all(coord.settings, layout, optimizer, sharding)
                coord.shape.fix_layout(layout, optimizer, request.dataset_size, sharding)
            async with job.cond:
                initialize = coord.join(request.learner_id)
                job.cond.notify_all()
        return self._join_response(coord, initialize, collective=collective)

    def _join_response(
        self: _S, coord: Coordinator, initialize: bool, *, collective: bool
    ) -> ps_pb2.JoinResponse:
        s = coord.settings
        assert coord.shape.sharding is not None
        return ps_pb2.JoinResponse(
            initialize=initialize,
            shards=[
                ps_pb2.ShardSlice(shard_index=i, address=address, tensor_names=names)
                for i, (address, names) in enumerate(
                    zip(s.shard_addresses, coord.shape.sharding.tensors, strict=True)
                )
            ],
            batch_size=s.batch_size,
            epochs=s.epochs,
            seed=s.seed,
            rendezvous_address=self._rendezvous(s) if collective else "",
            rendezvous_prefix=self._rendezvous_prefix(s.job_id) if collective else "",
        )

    async def InitializeParameters(
        self: _S, request_iterator: AsyncIterator[Frame], context: Any
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
            await _collect(frames, sj, upload, header)
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

    def _deposed(self: _S, job_id: str) -> Unavailable:
        return Unavailable(
            f"shard {self.options.shard_index} no longer coordinates job {job_id!r}: ask the "
            "other shards (FindCoordinator)"
        )

    async def Boundary(self: _S, request: ps_pb2.BoundaryRequest, context: Any) -> Any:
        authorize(
            current_principal(), "Boundary", job_id=request.job_id, learner_id=request.learner_id
        )
        user = check_user_metrics(request.metric_sums, request.metric_samples)
        job = self._job(request.job_id)
        coord = job.coord
        if request.HasField("stale_refusal"):  # a shard refused its SyncStep as stale
            await self._stale_refusal(job, request.stale_refusal, request.learner_id)
        async with job.cond:
            # A Boundary sent beside its SyncStep (`ahead`, parameter-server mode): held until
            # the iteration it reports is committed and the commit delivered, or is no longer
            # the one running (then answered as a Boundary after a failed SyncStep would be).
            # It waits without notifying: the decision loop below would wake every waiter.
            while request.ahead and coord.reported_running(
                request.learner_id, request.generation, request.completed_iteration
            ):
                if job.deposed:
                    raise self._deposed(request.job_id)
                await job.cond.wait()
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
                elif coord.collective and faults.armed(
                    faults.STOP_AFTER_VOTE, request.completed_iteration
                ):
                    faults.stop(faults.STOP_AFTER_VOTE)  # a vote in flight (test fault point)
            if request.HasField("checkpoint_file"):
                self._checkpoint_file(job, request.learner_id, request.checkpoint_file)
            while True:
                if job.deposed:
                    raise self._deposed(request.job_id)
                decision = coord.decide(request.learner_id)
                self._kick(job)
                # A decision may have frozen a generation or marked the job initialized:
                # let every waiting learner look again.
                job.cond.notify_all()
                if decision.action is not Action.WAIT:
                    break
                await job.cond.wait()
        # Written before the answer: once a learner is answered, it never reports the loss of
        # the iteration it finished again, so a coordinator killed after answering but before
        # the write would lose the record (a takeover recovers only the loss reports of a
        # Boundary that failed). docs/data-plane.md, "Generations and boundaries".
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
            if coord.routing_epoch and coord.shape.sharding is not None:
                response.routing_epoch = coord.routing_epoch
                response.shards.extend(
                    ps_pb2.ShardSlice(shard_index=i, address=address, tensor_names=names)
                    for i, (address, names) in enumerate(
                        zip(s.shard_addresses, coord.shape.sharding.tensors, strict=True)
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
                    batch_start=a.batch_start,
                    global_batch=a.global_batch,
                    gradient_noise_scale=a.gradient_noise_scale,
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
        self: _S, job: _CoordinatedJob, learner: str, report: ps_pb2.CheckpointFile
    ) -> None:
        """Collective mode: a learner wrote the shard file of the held checkpoint (or says why
        it could not: ``report.error``)."""
        coord = job.coord
        expected = self._checkpoint_directory(coord.settings, report.global_iteration)
        if (
            report.directory != expected
            or report.file != shard_file_name(0)
            or not (report.sha256 or report.error)
        ):
            raise InvalidField(
                "checkpoint_file",
                f"{report.directory}/{report.file}",
                f"must be {shard_file_name(0)} in {expected}, with its sha256 or its error",
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

    # -- membership changes -------------------------------------------------------------------

    async def RetireLearners(self: _S, request: ps_pb2.RetireLearnersRequest, context: Any) -> Any:
        authorize(current_principal(), "RetireLearners", job_id=request.job_id)
        job = self._job(request.job_id)
        self._check_fence(request.job_id, request.fencing_token)
        async with job.cond:
            effective = job.coord.retire(list(request.learner_ids))
            job.cond.notify_all()
        log.info("job %s: retiring %s", request.job_id, list(request.learner_ids))
        return ps_pb2.RetireLearnersResponse(effective_generation=effective)

    async def SetGlobalBatch(self: _S, request: ps_pb2.SetGlobalBatchRequest, context: Any) -> Any:
        authorize(current_principal(), "SetGlobalBatch", job_id=request.job_id)
        job = self._job(request.job_id)
        self._check_fence(request.job_id, request.fencing_token)
        async with job.cond:
            current = job.coord.shape.global_batch
            job.coord.set_global_batch(request.global_batch)
            job.cond.notify_all()
        if request.global_batch != current:
            log.info(
                "job %s: global batch %d from the next boundary (was %d)",
                request.job_id,
                request.global_batch,
                current,
            )
        return ps_pb2.SetGlobalBatchResponse(current_global_batch=current)

    async def EvictLearner(self: _S, request: ps_pb2.EvictLearnerRequest, context: Any) -> Any:
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

    async def CreateCheckpoint(
        self: _S, request: ps_pb2.CreateCheckpointRequest, context: Any
    ) -> Any:
        authorize(current_principal(), "CreateCheckpoint", job_id=request.job_id)
        job = self._job(request.job_id)
        coord = job.coord
        async with job.cond:
            if not coord.initialized or coord.shape.layout is None:
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
        self: _S, request: ps_pb2.ReportEpochMetricsRequest, context: Any
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
        await self._as_holder(job, ckpt.append_line, uri, line)
        return ps_pb2.ReportEpochMetricsResponse()

    async def GetJobProgress(self: _S, request: ps_pb2.GetJobProgressRequest, context: Any) -> Any:
        authorize(
            current_principal(),
            "GetJobProgress",
            job_id=request.job_id,
            owner=self._owner(request.job_id),
        )
        job = self._job(request.job_id)
        coord = job.coord
        return ps_pb2.GetJobProgressResponse(
            progress=_progress_proto(coord.progress()),
            member_learner_ids=list(coord.members),
            done=coord.done,
            recovering=bool(coord.recovering),
            recovery_reason=coord.recovering,
            checkpoint_error=job.checkpoint_error,
            latest_checkpoint=coord.last_checkpoint,
        )

    async def GetMembership(self: _S, request: ps_pb2.GetMembershipRequest, context: Any) -> Any:
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
