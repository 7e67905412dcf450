"""Is a running job's data plane alive and making progress? Pure decisions (no grpc, no I/O).

The reconciler keeps one :class:`JobHealth` per RUNNING or RECOVERING job, in memory, fed by
its GetJobProgress polls of the job's coordinator shard; :func:`assess` turns it into at most
one :class:`Verdict` per poll:

- ``RECOVERING``: the coordinator has been unreachable for ``unreachable_grace_s`` (a shard
  killed, its host lost, partitioned). No learner is started for the job while it stays
  unreachable (they could not sync); the job's state says which shard and at which iteration.
- ``RECOVERED``: a RECOVERING job committed an iteration again: back to RUNNING.
- ``RETRY``: no iteration committed for ``stall_timeout_s`` while the job was RUNNING or
  RECOVERING: its learners are stopped, its data plane closed on every shard and opened again,
  which resumes it from its latest checkpoint. Counted in the job record (``recoveries``).
- ``FAIL``: the same, after ``max_recoveries`` retries: a terminal FAILED with the reason.
- ``STALLED``: a RUNNING job whose coordinator answers but that committed no iteration for
  ``stall_notice_s``: its state stays RUNNING (the stall timeout decides), its reason says it
  is stalled and since when, so that "RUNNING" never hides a job that does not train.
- ``RESUMED``: a job said to be stalled committed an iteration again: its reason says so.

Every verdict carries the reason the job's ``state_reason`` shows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shoal.contract.errors import InvalidField
from shoal.v1 import job_pb2

__all__ = ["HealthConfig", "JobHealth", "Verdict", "VerdictKind", "assess", "lost_reason"]

S = job_pb2


@dataclass(frozen=True)
class HealthConfig:
    """The scheduler's data-plane health settings (``--stall-timeout``, ``--max-recoveries``,
    ``--coordinator-grace``)."""

    stall_timeout_s: float = 300.0
    """No committed iteration for this long: retry from the latest checkpoint. 0: never."""
    max_recoveries: int = 3
    """Automatic retries from the latest checkpoint before the job goes FAILED."""
    unreachable_grace_s: float = 2.0
    """A coordinator unreachable for this long puts its job in RECOVERING (and, with
    ``coordinator_failover``, moves a parameter-server job's coordinator role to another
    shard first)."""
    stall_notice_s: float = 30.0
    """No committed iteration for this long while the coordinator answers: the RUNNING job's
    reason says it is stalled (``--stall-notice``). 0: never."""
    coordinator_failover: bool = True
    """Move the coordinator role of a parameter-server job to the next shard when its shard is
    unreachable for the grace (``--coordinator-failover``); off: the checkpoint path."""

    def __post_init__(self) -> None:
        if not self.stall_timeout_s >= 0:
            raise InvalidField("stall_timeout_s", self.stall_timeout_s, "must be >= 0 (0: never)")
        if self.max_recoveries < 0:
            raise InvalidField("max_recoveries", self.max_recoveries, "must be >= 0")
        if not self.stall_notice_s >= 0:
            raise InvalidField("stall_notice_s", self.stall_notice_s, "must be >= 0 (0: never)")
        if not self.unreachable_grace_s >= 0:
            raise InvalidField("unreachable_grace_s", self.unreachable_grace_s, "must be >= 0")


@dataclass
class JobHealth:
    """What the scheduler has seen of one job's data plane (in memory: a new leader starts
    afresh, giving every job a full stall timeout)."""

    iterations: int
    """Completed iterations at the last successful poll."""
    progress_at: float
    """When ``iterations`` last grew (or when watching began, or the last retry)."""
    unreachable_since: float | None = None
    unreachable_why: str = ""
    lost_at: int | None = None
    """Iterations completed when the data plane was lost (for the reasons)."""
    baseline: int | None = None
    """While RECOVERING: iterations at the first successful poll of the re-formed data plane
    (lowered by a rewind to a checkpoint); an iteration beyond it means the job trains again."""
    last_error: str = ""
    """The last failure to reach the data plane that does not hold learner starts (an OpenJob
    that could not reach the coordinator), for the reasons; cleared by a successful poll."""
    coordinator_recovering: str | None = None
    """The coordinator's own word that it is recovering the job (a shard lost; its
    ``recovery_reason``), or None."""
    stalled_since: float | None = None
    """When the job's last committed iteration was, if its reason says it is stalled (the
    ``progress_at`` of the STALLED verdict); None: not said."""
    checkpoint_error: str = ""
    """The coordinator's word that the job's last checkpoint could not be written (its
    ``checkpoint_error``: a full disk), as last reported in the job's state reason."""

    def polled(self, iterations: int, now: float, recovering: str | None = None) -> None:
        """A successful poll: the coordinator answers (``recovering``: its reason, when it
        says it is recovering the job from a shard loss)."""
        self.unreachable_since = None
        self.unreachable_why = ""
        self.last_error = ""
        if iterations > self.iterations:
            self.progress_at = now
        if self.coordinator_recovering is not None and recovering is None:
            self.baseline = iterations  # its recovery ended: count from here
        elif self.baseline is None or iterations < self.baseline:
            self.baseline = iterations
        if recovering is not None and self.lost_at is None:
            self.lost_at = self.iterations
        self.coordinator_recovering = recovering
        self.iterations = iterations

    def unreachable(self, why: str, now: float) -> None:
        """A poll that could not reach the coordinator."""
        if self.unreachable_since is None:
            self.unreachable_since = now
            self.lost_at = self.iterations
        self.unreachable_why = why

    def reopened(self, iterations: int) -> None:
        """The job was (re-)opened: the data plane answers again, at ``iterations`` (its
        checkpoint's)."""
        self.unreachable_since = None
        self.unreachable_why = ""
        self.last_error = ""
        self.baseline = iterations
        self.iterations = iterations

    def entered_recovery(self) -> None:
        """The job went RECOVERING: what counts as training again is measured from the next
        successful poll (or re-open), not from before the loss."""
        self.baseline = None
        self.stalled_since = None  # the RECOVERING reason says more

    def running(self) -> None:
        """The job is RUNNING again: a later loss reports its own iteration."""
        self.lost_at = None

    def restarted(self, now: float) -> None:
        """A retry from the checkpoint began: a fresh stall timeout."""
        self.progress_at = now
        self.baseline = None
        self.stalled_since = None

    @property
    def down(self) -> bool:
        """Learners must not be started: they could not reach the coordinator."""
        return self.unreachable_since is not None


class VerdictKind(enum.Enum):
    RECOVERING = "recovering"
    RECOVERED = "recovered"
    RETRY = "retry"
    FAIL = "fail"
    STALLED = "stalled"
    RESUMED = "resumed"


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    reason: str


def lost_reason(health: JobHealth, coordinator: str) -> str:
    """Why a job whose coordinator is unreachable is RECOVERING."""
    return (
        f"coordinator {coordinator} lost after iteration {health.lost_at} "
        f"({health.unreachable_why}); waiting for the data plane to come back, then "
        "resuming from the latest checkpoint"
    )


def assess(
    state: int,
    health: JobHealth,
    *,
    now: float,
    config: HealthConfig,
    recoveries: int,
    coordinator: str,
) -> Verdict | None:
    """The one thing to do about a RUNNING or RECOVERING job now, if anything.

    ``recoveries``: the automatic retries the job already had; ``coordinator``: how to name its
    coordinator shard in reasons (``shard 1 (127.0.0.1:4000)``).
    """
    if state not in (S.JOB_STATE_RUNNING, S.JOB_STATE_RECOVERING):
        return None
    stalled_for = now - health.progress_at
    if config.stall_timeout_s > 0 and stalled_for >= config.stall_timeout_s:
        where = f"no iteration committed for {stalled_for:.0f} s (at iteration {health.iterations}"
        trouble = health.unreachable_why if health.down else health.last_error
        where += f"; {trouble})" if trouble else ")"
        if recoveries >= config.max_recoveries:
            return Verdict(
                VerdictKind.FAIL,
                f"{where}; gave up after {recoveries} automatic retr"
                f"{'y' if recoveries == 1 else 'ies'} from the latest checkpoint "
                f"(--max-recoveries {config.max_recoveries})",
            )
        return Verdict(
            VerdictKind.RETRY,
            f"{where}; retrying from the latest checkpoint (retry {recoveries + 1} of "
            f"{config.max_recoveries})",
        )
    if (
        state == S.JOB_STATE_RUNNING
        and health.stalled_since is not None
        and health.progress_at > health.stalled_since
    ):
        paused = health.progress_at - health.stalled_since
        return Verdict(
            VerdictKind.RESUMED,
            f"training again (iteration {health.iterations}) after {paused:.0f} s without a "
            "committed iteration",
        )
    if (
        state == S.JOB_STATE_RUNNING
        and config.stall_notice_s > 0
        and health.stalled_since is None
        and not health.down
        and health.coordinator_recovering is None
        and stalled_for >= config.stall_notice_s
    ):
        retry = (
            f"; retried from the latest checkpoint after {config.stall_timeout_s:.0f} s "
            "(--stall-timeout)"
            if config.stall_timeout_s > 0
            else ""
        )
        trouble = f" ({health.last_error})" if health.last_error else ""
        return Verdict(
            VerdictKind.STALLED,
            f"stalled: no iteration committed for {stalled_for:.0f} s (at iteration "
            f"{health.iterations}){trouble}; the coordinator {coordinator} answers{retry}",
        )
    if state == S.JOB_STATE_RUNNING and health.coordinator_recovering is not None:
        return Verdict(
            VerdictKind.RECOVERING,
            f"coordinator {coordinator} is recovering the job: {health.coordinator_recovering}",
        )
    if (
        state == S.JOB_STATE_RUNNING
        and health.unreachable_since is not None
        and now - health.unreachable_since >= config.unreachable_grace_s
    ):
        return Verdict(VerdictKind.RECOVERING, lost_reason(health, coordinator))
    if (
        state == S.JOB_STATE_RECOVERING
        and not health.down
        and health.coordinator_recovering is None
        and health.baseline is not None
        and health.iterations > health.baseline
    ):
        lost = f" (lost after iteration {health.lost_at})" if health.lost_at is not None else ""
        return Verdict(
            VerdictKind.RECOVERED,
            f"recovered{lost}: resumed at iteration {health.baseline}, training again "
            f"(iteration {health.iterations})",
        )
    return None
