"""The work of one job: what one worker run does, computed by the cycle."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.scheduler.jobs import (
    LearnerRecord,
)
from shoal.v1 import (
    resources_pb2,
)


@dataclass
class JobWork:
    """What one worker run does for one job (computed by the cycle)."""

    exits: list[resources_pb2.Learner] = field(default_factory=list)
    lost: list[tuple[str, str]] = field(default_factory=list)  # (learner id, why)
    drop_pending: list[str] = field(default_factory=list)
    retires: list[str] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    starts: list[LearnerRecord] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)  # STARTING learners to (re)start
    finish: bool = False  # final / cancelling job without learners: close, CANCELLED
    requeue: bool = False
    save: bool = False  # only fields changed in memory (target, queue position)
    retry: str = ""  # stalled: stop everything, re-open from the latest checkpoint (reason)

    def empty(self) -> bool:
        return not (
            self.exits
            or self.lost
            or self.drop_pending
            or self.retires
            or self.stops
            or self.starts
            or self.restarts
            or self.finish
            or self.requeue
            or self.save
            or self.retry
        )


@dataclass
class Backoff:
    until: float
    delay: float
