"""What the scheduler's control loop is configured with (built once in ``main``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.scheduler.health import HealthConfig
from shoal.scheduler.placement import (
    PlacementConfig,
)

ELECTION = "job-scheduler"


@dataclass(frozen=True)
class ReconcileConfig:
    """What the control loop needs; built once in ``main`` (validated there)."""

    sync_shards: tuple[str, ...]
    """The shards in shard order; empty: read the registry the shards keep in etcd."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    resync_interval_s: float = 1.0
    incremental_placement: bool = True
    """After an event observe only the jobs that changed (``observing.py``) and decide with
    the incremental planner (``placing.py``), the full cycle every
    ``placement_check_interval_s`` as the safety net; False: the full cycle every cycle."""
    placement_check_interval_s: float | None = None
    """Seconds between the safety net's full cycles (None: ``resync_interval_s``)."""
    call_timeout_s: float = 10.0
    start_timeout_s: float = 60.0
    stop_grace_s: float = 10.0
    retire_timeout_s: float = 600.0
    finish_grace_s: float = 30.0
    max_learner_failures: int = 3
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    progress_persist_s: float = 5.0
    agent_sweep_s: float = 10.0
    learner_credentials: Callable[[str, str, str], str] | None = None
    """Mints each learner's SHOAL_TOKEN: (job id, learner id, allocation id) -> a credential
    valid for that learner of that job only (``LearnerTokenSigner.mint``). None: learners get
    no token (a cluster without auth)."""
    rescale_poll_s: float = 0.1
    """While a rescale waits on a coordinator (drain, join, first step), how often the job's
    progress is polled: the precision of those phases' ends in the traces."""
    trace_every: int | None = None
    """SHOAL_TRACE_EVERY for the learners (None: their default)."""
    collective_timeout_s: float | None = None
    """SHOAL_COLLECTIVE_TIMEOUT_S for the learners (None: their default)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """When a job is RECOVERING, retried from its checkpoint, or FAILED for making no
    progress (``shoal.scheduler.health``)."""
