# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The coordinator's guard against a shard's generation floor drifting above its generation
(``generation_floor.py`` decides; this part asks the shards and applies the decision). Part of
the ParameterSyncService servicer (``service.py``).

Two ways in: a learner's Boundary reporting that a shard refused its SyncStep as stale below a
floor above the coordinator's generation (:meth:`FloorGuard._stale_refusal`: a hint, checked
with that shard), and the watchdog's probe of the shards (:meth:`FloorGuard._apply_floors`
with the floors their ``GetShardStatus`` reported, and this shard's own)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from shoal.param_sync.generation_floor import DriftAction, decide_on_floors, epoch_of
from shoal.param_sync.servicer_common import _CoordinatedJob
from shoal.runtime.errors import InvalidField, ShoalError
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")

#: At most one GetShardStatus per shard in this time for learners' refusal reports, while the
#: coordinator's generation stays the same: a learner that reports refusals over and over (or
#: lies) costs the shard a probe every quarter second at most.
CHECK_INTERVAL_S = 0.25


class FloorGuard:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    async def _stale_refusal(
        self: _S, job: _CoordinatedJob, refusal: ps_pb2.StaleRefusal, learner: str
    ) -> None:
        """A learner's Boundary says shard ``refusal.shard_index`` refused its SyncStep as
        stale with floor ``refusal.generation_floor``. When that floor is above this
        coordinator's generation, ask the shard for its floor (the learner's word is only a
        hint) and act on what it says. Checked before anything changes: a bad index is
        INVALID_ARGUMENT naming the field."""
        coord = job.coord
        sharding = coord.shape.sharding
        if coord.collective is not False or sharding is None:
            return  # only parameter-server shards keep a floor
        i = refusal.shard_index
        if not 0 <= i < sharding.num_shards:
            raise InvalidField(
                "stale_refusal.shard_index",
                i,
                f"is not a shard of job {coord.job_id!r} ({sharding.num_shards} shards)",
            )
        if refusal.generation_floor < 0:
            raise InvalidField(
                "stale_refusal.generation_floor", refusal.generation_floor, "must be >= 0"
            )
        if refusal.generation_floor <= coord.generation or not sharding.tensors[i]:
            return  # an older generation refused: the ordinary end of a superseded iteration
        async with job.floor_lock:
            if refusal.generation_floor <= coord.generation:
                return  # another learner's report was acted on meanwhile
            generation, now = coord.generation, time.monotonic()
            last = job.floor_checked.get(i)
            if last is not None and last[0] == generation and now - last[1] < CHECK_INTERVAL_S:
                return
            job.floor_checked[i] = (generation, now)
            floors = await self._floors_of(job, [i])
            log.debug(
                "job %s: learner %s reports shard %d refused generation %d as stale (floor %d); "
                "the shard says its floor is %s",
                coord.job_id,
                learner,
                i,
                generation,
                refusal.generation_floor,
                floors.get(i, "unknown"),
            )
            await self._apply_floors(job, floors)

    async def _floors_of(self: _S, job: _CoordinatedJob, shards: Iterable[int]) -> dict[int, int]:
        """The generation floors of ``shards`` that hold the job's slice (this shard's read
        directly); a shard that does not answer is left out (the watchdog handles it)."""
        floors: dict[int, int] = {}
        for i in shards:
            try:
                status = await self._shard_status(job.coord.settings, i)
            except ShoalError as exc:
                log.info("job %s: floor of shard %d not known: %s", job.coord.job_id, i, exc)
                continue
            if status.holds_job and status.initialized:
                floors[i] = int(status.generation_floor)
        return floors

    async def _apply_floors(self: _S, job: _CoordinatedJob, floors: Mapping[int, int]) -> None:
        """Act on the shards' floors (``generation_floor.decide_on_floors``): re-issue the
        running iteration above a drifted floor of this coordinator's epoch (logged once per
        drift, counted in ``shoal_sync_generation_drifts_total``); say once that a floor of a
        later epoch means another coordinator exists, and do nothing else."""
        if not floors:
            return
        coord = job.coord
        async with job.cond:
            if self._coordinated.get(coord.job_id) is not job or job.deposed:
                return
            if coord.recovery is not None:  # a shard is being recovered: its end re-freezes
                return
            generation = coord.generation
            decision = decide_on_floors(generation=generation, epoch=job.epoch, floors=floors)
            if decision.action is DriftAction.OTHER_EPOCH:
                seen = (decision.shard, epoch_of(decision.floor))
                if seen not in job.foreign_floors:
                    job.foreign_floors.add(seen)
                    log.warning(
                        "job %s: shard %d is at generation %d of coordinator epoch %d, above "
                        "this coordinator's (generation %d, epoch %d): another coordinator holds "
                        "the job; not re-issuing (the shards fence this one)",
                        coord.job_id,
                        decision.shard,
                        decision.floor,
                        seen[1],
                        generation,
                        job.epoch,
                    )
                return
            if decision.action is not DriftAction.REISSUE:
                return
            running, k = coord.running, coord.completed
            task = coord.reissue_at(decision.generation)
            if coord.generation == generation:
                return  # every shard is ready for the running iteration: it commits first
            self.metrics.generation_drift(coord.job_id)
            log.warning(
                "job %s: shard %d's generation floor (%d) is above this coordinator's generation "
                "(%d): it refuses %s as stale; %s generation %d",
                coord.job_id,
                decision.shard,
                decision.floor,
                generation,
                f"iteration {k}" if running else "the next iteration",
                f"iteration {k} aborted and re-issued at" if task is not None else "continuing at",
                coord.generation,
            )
            self._kick(job)
            job.cond.notify_all()
