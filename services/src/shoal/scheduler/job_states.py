"""The job state machine, pure: the transition table (job.proto's JobState comment), the state
sets the scheduler acts on, and the check every state change goes through.

Part of the job core: :mod:`shoal.scheduler.jobs` re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Mapping

from shoal.contract.errors import InvalidTransition
from shoal.v1 import job_pb2

S = job_pb2  # short alias for the enum values below


#: The job state machine (job.proto's JobState comment). Anything else is refused.
TRANSITIONS: Mapping[int, frozenset[int]] = {
    S.JOB_STATE_QUEUED: frozenset({S.JOB_STATE_RUNNING, S.JOB_STATE_CANCELLED, S.JOB_STATE_FAILED}),
    S.JOB_STATE_RUNNING: frozenset(
        {
            S.JOB_STATE_QUEUED,  # all its learners were preempted or lost: waits for devices
            S.JOB_STATE_RECOVERING,  # its data plane is down, or it stalled
            S.JOB_STATE_COMPLETED,
            S.JOB_STATE_FAILED,
            S.JOB_STATE_CANCELLING,
        }
    ),
    S.JOB_STATE_RECOVERING: frozenset(
        {
            S.JOB_STATE_RUNNING,  # an iteration committed again
            S.JOB_STATE_QUEUED,
            S.JOB_STATE_COMPLETED,
            S.JOB_STATE_FAILED,  # out of automatic retries
            S.JOB_STATE_CANCELLING,
        }
    ),
    S.JOB_STATE_CANCELLING: frozenset({S.JOB_STATE_CANCELLED}),
    S.JOB_STATE_COMPLETED: frozenset(),
    S.JOB_STATE_FAILED: frozenset(),
    S.JOB_STATE_CANCELLED: frozenset(),
}
#: Jobs the policy gives devices to.
ACTIVE_STATES = frozenset({S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING, S.JOB_STATE_RECOVERING})
#: Jobs that hold (or are getting back) a data plane and learners.
STARTED_STATES = frozenset({S.JOB_STATE_RUNNING, S.JOB_STATE_RECOVERING})
#: Jobs that will never run again.
FINAL_STATES = frozenset({S.JOB_STATE_COMPLETED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED})


def state_name(state: int) -> str:
    """``JOB_STATE_RUNNING`` -> ``RUNNING`` (for messages)."""
    try:
        return job_pb2.JobState.Name(state).removeprefix("JOB_STATE_")  # type: ignore[arg-type]
    except ValueError:
        return str(state)


# InvalidTransition and ArtifactNotFound are defined in shoal.contract.errors (imported
# above, exported here).


def invalid_transition(job_id: str, current: int, target: int) -> InvalidTransition:
    """The error of a job that cannot go from ``current`` to ``target`` (FAILED_PRECONDITION,
    WRONG_STATE): the message names both states and the ones allowed."""
    allowed = ", ".join(sorted(state_name(s) for s in TRANSITIONS.get(current, ()))) or "none"
    return InvalidTransition(
        f"job {job_id!r} cannot go from {state_name(current)} to {state_name(target)} "
        f"(allowed from {state_name(current)}: {allowed})",
        current=current,
        target=target,
    )


def check_transition(job_id: str, current: int, target: int) -> None:
    """Raise :class:`InvalidTransition` unless ``current -> target`` is in the table."""
    if target not in TRANSITIONS.get(current, frozenset()):
        raise invalid_transition(job_id, current, target)
