# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""Coordinator failover in collective mode, the servicer's side: ``TakeOverJob`` of a
collective job (:meth:`CollectiveTakeoverHandlers._take_over_collective`) and the learners'
re-``Join`` that brings the job's state back (:meth:`~._rejoin_collective`). The decisions are
in ``takeover_collective.py`` (pure); docs/data-plane.md, "Coordinator failover in collective
mode". Part of the ParameterSyncService servicer (``service.py``)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shoal.contract.wire import TensorMeta
from shoal.param_sync.coordinator import JobSettings, OptimizerConfig
from shoal.param_sync.servicer_common import _CoordinatedJob, _progress_proto
from shoal.param_sync.shard import build_optimizer
from shoal.param_sync.takeover_collective import CollectiveTakeover, LearnerState, apply_resume
from shoal.runtime.errors import Unavailable
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")


class CollectiveTakeoverHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    async def _take_over_collective(
        self: _S,
        settings: JobSettings,
        *,
        owner: str,
        lost: int,
        epoch: int,
        move: ps_pb2.SetCoordinatorRequest,
    ) -> ps_pb2.TakeOverJobResponse:
        """Become the coordinator of a collective job (called by TakeOverJob under the open
        lock): fence every shard left with the epoch (so that FindCoordinator names this one
        and a woken old coordinator is refused; they hold nothing of the job to settle), read
        the bookkeeping from storage, and wait for the learners' re-Joins, which bring the
        state (:meth:`_rejoin_collective`)."""
        await self._move_role_here(settings, lost, move)
        job_holder = uuid.uuid4().hex
        coord, last_checkpoint, recorded = await self._successor(settings, job_holder, epoch)
        coord.set_mode(True)
        coord.completed = max(recorded + 1, last_checkpoint, 0)  # until the learners say
        job = _CoordinatedJob(coord, owner=owner, epoch=epoch, holder=job_holder)
        job.collective_takeover = CollectiveTakeover(
            lost=lost,
            generation=move.min_generation,
            last_checkpoint=last_checkpoint,
            recorded=recorded,
        )
        coord.recovering = (
            f"coordinator shard {lost} lost at iteration {coord.completed}; shard "
            f"{self.options.shard_index} took over, waiting for the learners to re-join "
            "(collective mode: they hold the state)"
        )
        self._coordinated[settings.job_id] = job
        self._start_deposing(job, lost)
        log.warning(
            "job %s: took over as coordinator (epoch %d) from lost shard %d at iteration %d "
            "(collective mode)",
            settings.job_id,
            epoch,
            lost,
            coord.completed,
        )
        return ps_pb2.TakeOverJobResponse(progress=_progress_proto(coord.progress()))

    async def _rejoin_collective(
        self: _S,
        job: _CoordinatedJob,
        request: ps_pb2.JoinRequest,
        layout: Sequence[TensorMeta],
        optimizer: OptimizerConfig,
    ) -> None:
        """A learner (re-)joins a collective job taken over: report what it holds, wait until
        the takeover's decision (commit the voted iteration or run it again) is known, apply
        it to the coordinator once, and join the learner, marked as holding the state when it
        does (the others receive it by broadcast when the group forms)."""
        takeover = job.collective_takeover
        assert takeover is not None
        coord = job.coord
        cs = request.collective_state
        state = LearnerState(
            state_step=int(cs.state_step) if request.HasField("collective_state") else -1,
            holds_pending=cs.holds_pending,
            generation=int(cs.generation),
            world_size=int(cs.world_size),
        )
        coord.shape.plan_sharding(layout, optimizer, request.dataset_size)  # checks it
        build_optimizer(optimizer, [])  # refuse a bad optimizer before any state
        async with job.cond:
            takeover.report(request.learner_id, state)
            job.cond.notify_all()
            while takeover.poll() is None:
                deadline = takeover.deadline
                assert deadline is not None
                try:
                    async with asyncio.timeout(max(deadline - takeover.clock(), 0.0) + 0.05):
                        await job.cond.wait()
                except TimeoutError:
                    pass
                if job.deposed:
                    raise Unavailable(
                        f"shard {self.options.shard_index} no longer coordinates job "
                        f"{request.job_id!r}: ask the other shards (FindCoordinator)"
                    )
            resume = takeover.resume
            assert resume is not None
            if job.collective_takeover is takeover and coord.shape.layout is None:
                apply_resume(
                    coord,
                    takeover,
                    layout=layout,
                    optimizer=optimizer,
                    dataset_size=request.dataset_size,
                )
                coord.recovering = ""
                log.warning(
                    "job %s: collective takeover: continuing at iteration %d (%s); %d "
                    "learner(s) hold the state: %s",
                    coord.job_id,
                    resume.completed,
                    f"iteration {resume.completed - 1} committed from the learners' votes"
                    if resume.committed
                    else "no iteration in flight was committed",
                    len(resume.holders),
                    sorted(resume.holders),
                )
            coord.shape.plan_sharding(layout, optimizer, request.dataset_size)  # the job's layout
            coord.join(request.learner_id)
            # A holder at the decision, while the job is still there (a learner that re-joins
            # later, whatever it holds, receives the state as a joiner).
            if request.learner_id in resume.holders and coord.completed == resume.completed:
                coord.synced.add(request.learner_id)
            job.cond.notify_all()
