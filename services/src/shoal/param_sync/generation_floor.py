"""The guard against a shard's generation floor drifting above its coordinator's generation
(issue 12; docs/data-plane.md, "Generation floor drift"). Pure: no I/O, no gRPC.

A parameter-server shard refuses every contribution of a generation below its *floor* (the
lowest generation it accepts: ``ShardJob.min_generation``) as stale. The floor follows the
coordinator: an abort of generation g raises it to g + 1 once the coordinator has moved past
g, a new coordinator's ``SetCoordinator`` raises it to its first generation (``epoch << 32``).
If anything ever raises a floor above the generation the coordinator runs (the cause of
issue 12's livelock was one such way, fixed at ``takeover.pending_on_move``), the coordinator
would re-issue the same generation at every boundary and the shard would refuse it for ever.

The guard: the coordinator learns the shards' floors (its own slice's directly, the others by
``GetShardStatus``, when a learner's Boundary reports a stale refusal and at every probe of
its watchdog) and :func:`decide_on_floors` says what to do:

* every floor at or below its generation: nothing (a refusal of an older generation is the
  ordinary end of a superseded iteration);
* a floor of its own coordinator epoch (or an earlier one) above its generation: continue in
  generation ``floor`` (the highest such floor), the lowest generation that shard accepts, so
  never in a later epoch; the running iteration is aborted (no shard stepped it) and re-issued
  there;
* a floor of a *later* epoch (``floor >> 32 > epoch``): another coordinator exists. Never jump
  epochs: this coordinator is deposed, the shards fence its calls and it must never commit;
  it does nothing but say so.

Bounded: only floors the shards themselves report count (a learner's report is a hint that
makes the coordinator ask; a learner cannot move a floor, since a SyncStep of a generation the
coordinator has not frozen is refused before it is kept), only service-role callers move a
floor (``authz.py``), and a target is never in a later epoch.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["EPOCH_SHIFT", "DriftAction", "FloorDecision", "decide_on_floors", "epoch_of"]

#: Generation numbers are ``epoch << EPOCH_SHIFT`` + a count within the coordinator epoch.
EPOCH_SHIFT = 32


def epoch_of(generation: int) -> int:
    """The coordinator epoch a generation number belongs to."""
    return generation >> EPOCH_SHIFT


class DriftAction(enum.Enum):
    """What a coordinator does about the floors it learned (:func:`decide_on_floors`)."""

    NONE = "none"  # no floor above its generation
    REISSUE = "re-issue"  # continue in FloorDecision.generation (a floor of its epoch drifted)
    OTHER_EPOCH = "other epoch"  # a floor of a later epoch: another coordinator exists


@dataclass(frozen=True)
class FloorDecision:
    action: DriftAction
    generation: int = -1  # REISSUE: the generation to continue in
    shard: int = -1  # the shard whose floor decided (REISSUE, OTHER_EPOCH)
    floor: int = -1  # that shard's floor


NOTHING = FloorDecision(DriftAction.NONE)


def decide_on_floors(*, generation: int, epoch: int, floors: Mapping[int, int]) -> FloorDecision:
    """The coordinator of coordinator epoch ``epoch`` runs ``generation``; ``floors`` are the
    generation floors the shards reported (shard index -> floor). See the module docstring."""
    if generation < 0 or epoch < 0:
        raise ValueError(f"generation ({generation}) and epoch ({epoch}) must be >= 0")
    ahead = {i: f for i, f in floors.items() if f > generation}
    if not ahead:
        return NOTHING
    foreign = {i: f for i, f in ahead.items() if epoch_of(f) > epoch}
    if foreign:
        shard = max(foreign, key=lambda i: (foreign[i], -i))
        return FloorDecision(DriftAction.OTHER_EPOCH, shard=shard, floor=foreign[shard])
    shard = max(ahead, key=lambda i: (ahead[i], -i))
    floor = ahead[shard]
    # floor > generation, and floor is of this epoch or an earlier one: so is the target.
    return FloorDecision(DriftAction.REISSUE, generation=floor, shard=shard, floor=floor)
