# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The coordinator's failover, the scheduler's side: TakeOverJob (a shard becomes the
coordinator of a job whose coordinator shard is lost: fence the shards left, bring them to one
state, wait for the learners' re-Joins), SetCoordinator and FindCoordinator (how the shards
learn and tell where a job's coordinator is, fenced by epoch), and OpenJob's fencing of a job
whose role had moved before. The rules are pure functions in ``takeover.py``; collective jobs'
takeover is ``servicer_takeover_collective.py``. Part of the ParameterSyncService servicer
(``service.py``)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shoal.contract.errors import StaleCoordinator
from shoal.contract.wire import TensorMeta
from shoal.param_sync import checkpoint as ckpt, holder
from shoal.param_sync.authz import authorize, check_storage_uri
from shoal.param_sync.coordinator import Coordinator, JobSettings, OptimizerConfig
from shoal.param_sync.servicer_common import _CoordinatedJob, _progress_proto, _TakeOver
from shoal.param_sync.servicer_jobs import _job_settings
from shoal.param_sync.servicer_tasks import read_schedule
from shoal.param_sync.shard import build_optimizer
from shoal.param_sync.takeover import (
    PendingAction,
    ShardState,
    TakeoverPlan,
    pending_on_move,
    plan_takeover,
    sharding_after_takeover,
)
from shoal.runtime.auth import current_principal
from shoal.runtime.errors import (
    Aborted,
    FailedPrecondition,
    InvalidField,
    ShoalError,
    Unavailable,
)
from shoal.v1 import job_pb2, parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")


class TakeoverHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    async def _fence_the_shards(self: _S, job: _CoordinatedJob, floor: int) -> None:
        """A job opened anew (OpenJob) where the coordinator role had moved before (a takeover,
        then the checkpoint path or a lost successor): the shards that still fence the job at
        an epoch would refuse this coordinator's calls. Take an epoch above every one the
        shards that answer know, and at least ``floor`` (the scheduler's: above every epoch it
        gave, so a shard that did not answer in time is covered too), on every shard, with
        generations above its floor. None known and no floor: nothing to do, epoch 0."""
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
        if top == 0 and floor <= 0:
            return
        job.epoch = max(top + 1, floor)
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

    async def TakeOverJob(self: _S, request: ps_pb2.TakeOverJobRequest, context: Any) -> Any:
        """Become the coordinator of a job whose coordinator shard is lost (see the proto):
        fence the shards left with the new epoch, check they hold one state, and wait for the
        learners to re-join (the first Join brings the layout: :meth:`_complete_takeover`)."""
        authorize(current_principal(), "TakeOverJob", job_id=request.job_id)
        if not request.job_id:
            raise InvalidField("job_id", "", "must not be empty")
        storage = check_storage_uri(request.storage_uri, self.options.storage_uri)
        settings = _job_settings(request, storage)
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
                    raise StaleCoordinator(
                        f"coordinator_epoch ({epoch}) of job {request.job_id!r} is older than "
                        f"this shard's ({existing.epoch})"
                    )
                raise FailedPrecondition(
                    f"shard {me} coordinates job {request.job_id!r} already (epoch "
                    f"{existing.epoch}): close it first"
                )
            self._check_coordinator_epoch(request.job_id, epoch)
            address, known = self._coordinator_at.get(request.job_id, ("", 0))
            if known == epoch and address != settings.shard_addresses[me]:
                # Another shard took the role over at this epoch already (a scheduler leader
                # died before it published that move): one epoch names one coordinator.
                raise StaleCoordinator(
                    f"coordinator_epoch ({epoch}) of job {request.job_id!r} is held by "
                    f"{address} already: take a higher one"
                )
            # Until the job is coordinated here, its learners and the scheduler are told to retry
            # (UNAVAILABLE), not that it is unknown: the move below names this shard already.
            with self._taking_over_job(request.job_id):
                generation = epoch << 32  # above every generation of an earlier coordinator
                move = ps_pb2.SetCoordinatorRequest(
                    job_id=request.job_id,
                    coordinator_address=settings.shard_addresses[me],
                    coordinator_epoch=epoch,
                    min_generation=generation,
                    keep_pending=True,
                )
                if request.sync_mode == job_pb2.SYNC_MODE_COLLECTIVE:  # the learners hold it
                    return await self._take_over_collective(
                        settings, owner=request.owner, lost=lost, epoch=epoch, move=move
                    )
                moved = await self._move_role_here(settings, lost, move)
                states = {i: _shard_state(answer) for i, answer in moved.items()}
                plan = plan_takeover(request.job_id, states)
                await self._settle_takeover(settings, epoch, plan)
                completed = plan.completed
                job_holder = uuid.uuid4().hex
                coord, last_checkpoint, recorded = await self._successor(
                    settings, job_holder, epoch
                )
                coord.completed = completed  # reported before the first learner re-joins
                job = _CoordinatedJob(coord, owner=request.owner, epoch=epoch, holder=job_holder)
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
                self._start_deposing(job, lost)
                log.warning(
                    "job %s: took over as coordinator (epoch %d) from lost shard %d "
                    "at iteration %d",
                    request.job_id,
                    epoch,
                    lost,
                    completed,
                )
                return ps_pb2.TakeOverJobResponse(progress=_progress_proto(coord.progress()))

    async def _settle_takeover(
        self: _S, settings: JobSettings, epoch: int, plan: TakeoverPlan
    ) -> None:
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

    async def _move_role_here(
        self: _S, settings: JobSettings, lost: int, move: ps_pb2.SetCoordinatorRequest
    ) -> dict[int, ps_pb2.SetCoordinatorResponse]:
        """Tell every shard but the lost coordinator's that the role moved here (``move``
        carries the new epoch and generation floor), all at once. Returns the answers of the
        shards that took it; a shard that is down is taken to hold nothing of the job
        (takeover.py) and left out; any other refusal ends the takeover (raised)."""
        others = [i for i in range(settings.num_shards) if i != lost]
        results = await asyncio.gather(
            *(self._call_shard(settings, i, "SetCoordinator", move) for i in others),
            return_exceptions=True,
        )
        answers: dict[int, ps_pb2.SetCoordinatorResponse] = {}
        for i, result in zip(others, results, strict=True):
            if isinstance(result, Unavailable):
                log.warning("job %s: takeover: shard %d is down", settings.job_id, i)
            elif isinstance(result, BaseException):
                log.warning(
                    "job %s: takeover: shard %d did not accept the move: %s",
                    settings.job_id,
                    i,
                    result,
                )
                raise result
            else:
                answers[i] = result
        return answers

    async def _successor(
        self: _S, settings: JobSettings, job_holder: str, epoch: int
    ) -> tuple[Coordinator, int, int]:
        """A new coordinator for a job taken over, with what storage says of it: marks the
        job's files as ``job_holder``'s first and renews its record files (holder.py: a paused
        old coordinator that wakes writes nothing this successor reads), then returns it (with
        the adaptive batch's schedule, if any, so positions go on in samples), the latest
        checkpoint's iteration and the last recorded iteration (-1: none)."""
        await asyncio.to_thread(
            holder.mark_holder,
            settings.storage_uri,
            settings.job_id,
            job_holder,
            shard=self.options.shard_index,
            epoch=epoch,
        )
        await self._renew_records(settings.storage_uri, settings.job_id, job_holder)
        found = await asyncio.to_thread(
            ckpt.latest_checkpoint, settings.storage_uri, settings.job_id
        )
        last_checkpoint = int(found[1]["iteration"]) if found is not None else -1
        recorded = await asyncio.to_thread(self._last_recorded, settings)
        coord = Coordinator(settings, clock=self._clock)
        schedule = await asyncio.to_thread(read_schedule, settings)
        if schedule is not None:
            coord.shape.schedule = schedule
        return coord, last_checkpoint, recorded

    def _start_deposing(self: _S, job: _CoordinatedJob, lost: int) -> None:
        """Run :meth:`_depose` in the background of ``job`` (cancelled when it closes)."""
        deposer = asyncio.create_task(self._depose(job, lost))
        job.background.add(deposer)
        deposer.add_done_callback(job.background.discard)

    async def _depose(self: _S, job: _CoordinatedJob, lost: int) -> None:
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
        self: _S,
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
        coord.shape.plan_sharding(layout, optimizer, dataset_size)  # checks the layout
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

    async def _step_down(self: _S, job: _CoordinatedJob, why: str) -> None:
        """This shard coordinated ``job`` before and the role moved meanwhile (it was paused
        or partitioned; ``why``: how it learned it): stop coordinating it; its waiting learners
        are answered UNAVAILABLE and find the new coordinator. Not called with ``job.cond``
        held."""
        job_id = job.coord.job_id
        if job.deposed:
            return
        log.warning("job %s: %s; stepping down (epoch %d)", job_id, why, job.epoch)
        if self._coordinated.get(job_id) is job:
            del self._coordinated[job_id]
        if job.watchdog is not None:
            job.watchdog.cancel()
        async with job.cond:
            job.deposed = True
            job.cond.notify_all()

    async def SetCoordinator(self: _S, request: ps_pb2.SetCoordinatorRequest, context: Any) -> Any:
        authorize(current_principal(), "SetCoordinator", job_id=request.job_id)
        return await self._local_SetCoordinator(request)

    async def _local_SetCoordinator(self: _S, request: ps_pb2.SetCoordinatorRequest) -> Any:
        if not request.coordinator_address or ":" not in request.coordinator_address:
            raise InvalidField(
                "coordinator_address", request.coordinator_address, "must be 'host:port'"
            )
        self._check_coordinator_epoch(request.job_id, request.coordinator_epoch)
        told = (request.coordinator_address, request.coordinator_epoch)
        moved = self._coordinator_at.get(request.job_id) != told
        self._coordinator_at[request.job_id] = told
        mine = self._coordinated.get(request.job_id)
        if mine is not None and mine.epoch < request.coordinator_epoch:
            # This shard coordinated the job before (it was paused or partitioned, and the
            # role moved meanwhile): step down; its learners find the new coordinator.
            await self._step_down(
                mine,
                f"coordinator role moved to {request.coordinator_address} "
                f"(epoch {request.coordinator_epoch})",
            )
        part = self._slices.get(request.job_id)
        if part is None:
            return ps_pb2.SetCoordinatorResponse(completed_iterations=-1, pending_iteration=-1)
        sj = part.job
        sj.coordinator_address = request.coordinator_address
        pending = sj.pending
        kept = (-1, -1)
        action = pending_on_move(
            None if pending is None else pending.generation,
            keep=request.keep_pending,
            min_generation=request.min_generation,
        )
        if action is PendingAction.KEEP_FOR_SUCCESSOR:  # the successor resolves it
            assert pending is not None
            kept = (pending.generation, pending.iteration)
        elif action is PendingAction.ABORT:  # never committed: the new coordinator runs it again
            assert pending is not None
            log.warning(
                "job %s: sums of iteration %d (generation %d) dropped: the coordinator moved "
                "to %s (epoch %d, generations from %d)",
                request.job_id,
                pending.iteration,
                pending.generation,
                request.coordinator_address,
                request.coordinator_epoch,
                request.min_generation,
            )
            await self._compute(sj.abort, pending.generation, pending.iteration)
        sj.min_generation = max(sj.min_generation, request.min_generation)
        if moved or action is PendingAction.ABORT:
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

    async def FindCoordinator(
        self: _S, request: ps_pb2.FindCoordinatorRequest, context: Any
    ) -> Any:
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


def _shard_state(reply: ps_pb2.SetCoordinatorResponse) -> ShardState:
    pending = None
    if reply.pending_iteration >= 0:
        pending = (int(reply.pending_generation), int(reply.pending_iteration))
    return ShardState(
        int(reply.completed_iterations), tuple(reply.tensor_names), pending, reply.last_grad_norm
    )
