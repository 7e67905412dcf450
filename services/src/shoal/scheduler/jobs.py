"""The job core of the scheduler, pure (no grpc, no I/O): spec validation, the job state machine
with its transition table and recorded history, the job and learner records the scheduler
persists, the allocation history, and ListJobs pagination.

Everything here is a function of its arguments (the clock is passed in as ``now``, unix seconds)
and is unit-tested without a network. ``shoal.scheduler.store`` persists :class:`JobRecord` and
the allocation history; ``shoal.scheduler.service`` and ``shoal.scheduler.reconcile`` drive them.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from shoal.contract import ids
from shoal.contract.errors import (
    ArtifactNotFound,
    FailedPrecondition,
    InvalidField,
    InvalidTransition,
    PermissionDenied,
)
from shoal.runtime.auth import Principal, Role
from shoal.v1 import job_pb2

__all__ = [
    "ACTIVE_STATES",
    "DEFAULT_PRIORITY",
    "FINAL_STATES",
    "MAX_PRIORITY",
    "STARTED_STATES",
    "TRANSITIONS",
    "ArtifactNotFound",
    "InvalidTransition",
    "JobRecord",
    "LearnerPhase",
    "LearnerRecord",
    "PastLearner",
    "StateChange",
    "append_allocation_event",
    "can_see",
    "check_transition",
    "decode_page_token",
    "encode_page_token",
    "new_job_record",
    "page_jobs",
    "spec_digest",
    "state_name",
    "timestamp",
    "validate_page_size",
    "validate_spec",
    "validate_update",
]

S = job_pb2  # short alias for the enum values below

DEFAULT_PRIORITY = 5000
MAX_PRIORITY = 1_000_000
NAME_MAX = 128
MAX_WORKERS_LIMIT = 100_000
ENTRY_POINT_MAX = 1024
ARG_MAX = 8192
ARGS_MAX = 1024
URI_MAX = 4096
DATASET_URIS_MAX = 1024
ENV_MAX = 256
ENV_VALUE_MAX = 32 * 1024
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
STATE_HISTORY_LIMIT = 100
PAST_LEARNERS_LIMIT = 1000

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables the scheduler or the host-agent set for every learner; a job may not override them.
_RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "TRACEPARENT", "TRACESTATE"})
_RESERVED_ENV_PREFIX = "SHOAL_"

# --------------------------------------------------------------------------------------------
# States
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_text(name: str, value: str, limit: int, *, allow_empty: bool = False) -> None:
    if not value and not allow_empty:
        raise InvalidField(name, value, "must not be empty")
    if len(value) > limit:
        raise InvalidField(name, value[:40] + "...", f"must be at most {limit} characters")
    if "\0" in value:
        raise InvalidField(name, value, "must not contain NUL characters")


def validate_spec(
    spec: job_pb2.JobSpec, *, principal: Principal, user_priority_limit: int = MAX_PRIORITY
) -> job_pb2.JobSpec:
    """Check a submitted spec; return a normalized copy (defaults applied).

    Defaults: ``priority`` 0 -> 5000, ``min_workers`` 0 -> 1, ``sync_mode`` UNSPECIFIED ->
    AUTO. Raises :class:`InvalidField` naming the first bad field (``spec.<field>``) and its
    value. The artifact's existence is checked by the caller (it needs storage).
    """
    _check_text("spec.name", spec.name, NAME_MAX)
    if spec.name.strip() != spec.name or not spec.name.isprintable():
        raise InvalidField(
            "spec.name", spec.name, "must be printable, without leading or trailing spaces"
        )
    _check_text("spec.entry_point", spec.entry_point, ENTRY_POINT_MAX)
    parts = spec.entry_point.replace("\\", "/").split("/")
    if spec.entry_point.startswith("/") or ".." in parts:
        raise InvalidField(
            "spec.entry_point", spec.entry_point, "must be a relative path inside the artifact"
        )
    if not ids.is_valid(ids.IdKind.ARTIFACT, spec.artifact_id):
        raise InvalidField(
            "spec.artifact_id", spec.artifact_id, "must be a sha256 in lowercase hex (64 chars)"
        )
    if len(spec.args) > ARGS_MAX:
        raise InvalidField("spec.args", len(spec.args), f"must hold at most {ARGS_MAX} entries")
    for i, arg in enumerate(spec.args):
        _check_text(f"spec.args[{i}]", arg, ARG_MAX, allow_empty=True)
    if len(spec.dataset_uris) > DATASET_URIS_MAX:
        raise InvalidField(
            "spec.dataset_uris",
            len(spec.dataset_uris),
            f"must hold at most {DATASET_URIS_MAX} entries",
        )
    for i, uri in enumerate(spec.dataset_uris):
        _check_text(f"spec.dataset_uris[{i}]", uri, URI_MAX)
        if uri.strip() != uri or "," in uri:
            raise InvalidField(
                f"spec.dataset_uris[{i}]", uri, "must not contain commas or surrounding spaces"
            )
    if spec.batch_size < 1:
        raise InvalidField("spec.batch_size", spec.batch_size, "must be >= 1")
    if spec.epochs < 1:
        raise InvalidField("spec.epochs", spec.epochs, "must be >= 1")
    min_workers = spec.min_workers or 1
    if spec.min_workers < 0:
        raise InvalidField("spec.min_workers", spec.min_workers, "must be >= 1 (0 means 1)")
    if spec.max_workers < min_workers:
        raise InvalidField(
            "spec.max_workers", spec.max_workers, f"must be >= spec.min_workers ({min_workers})"
        )
    if spec.max_workers > MAX_WORKERS_LIMIT:
        raise InvalidField("spec.max_workers", spec.max_workers, f"must be <= {MAX_WORKERS_LIMIT}")
    priority = spec.priority or DEFAULT_PRIORITY
    _check_priority("spec.priority", priority, principal, user_priority_limit)
    if spec.sync_mode not in job_pb2.SyncMode.values():
        raise InvalidField(
            "spec.sync_mode",
            spec.sync_mode,
            "must be one of PARAMETER_SERVER (1), COLLECTIVE (2), AUTO (3)",
        )
    if spec.checkpoint_every < 0:
        raise InvalidField("spec.checkpoint_every", spec.checkpoint_every, "must be >= 0")
    if spec.keep_checkpoints < 0:
        raise InvalidField(
            "spec.keep_checkpoints", spec.keep_checkpoints, "must be >= 0 (0: the default, 3)"
        )
    if spec.keep_every_nth_checkpoint < 0:
        raise InvalidField(
            "spec.keep_every_nth_checkpoint",
            spec.keep_every_nth_checkpoint,
            "must be >= 0 (0: none kept for good)",
        )
    if spec.max_batch_per_device < 0:
        raise InvalidField(
            "spec.max_batch_per_device", spec.max_batch_per_device, "must be >= 0 (0: no limit)"
        )
    if len(spec.env) > ENV_MAX:
        raise InvalidField("spec.env", len(spec.env), f"must hold at most {ENV_MAX} variables")
    for key in sorted(spec.env):
        if not _ENV_NAME.match(key):
            raise InvalidField(f"spec.env[{key!r}]", key, "is not a valid variable name")
        if key.startswith(_RESERVED_ENV_PREFIX) or key in _RESERVED_ENV:
            raise InvalidField(
                f"spec.env[{key!r}]", key, "is reserved for the learner contract (SHOAL_*)"
            )
        _check_text(f"spec.env[{key!r}]", spec.env[key], ENV_VALUE_MAX, allow_empty=True)

    out = job_pb2.JobSpec()
    out.CopyFrom(spec)
    out.min_workers = min_workers
    out.priority = priority
    if out.sync_mode == job_pb2.SYNC_MODE_UNSPECIFIED:
        out.sync_mode = job_pb2.SYNC_MODE_AUTO
    return out


def _check_priority(name: str, value: int, principal: Principal, user_limit: int) -> None:
    if not 1 <= value <= MAX_PRIORITY:
        raise InvalidField(name, value, f"must be in 1..{MAX_PRIORITY}")
    if principal.role is Role.USER and value > user_limit:
        raise PermissionDenied(
            f"{name} ({value}) is above the limit for users ({user_limit}); "
            f"{principal.name} has role user"
        )


def validate_update(
    job: job_pb2.Job,
    *,
    priority: int | None,
    max_workers: int | None,
    principal: Principal,
    user_priority_limit: int = MAX_PRIORITY,
) -> None:
    """Check an UpdateJob against the job (state, then fields)."""
    if job.state not in ACTIVE_STATES:
        raise FailedPrecondition(
            f"job {job.job_id!r} is {state_name(job.state)}: only QUEUED, RUNNING or "
            "RECOVERING jobs can be updated"
        )
    if priority is not None:
        _check_priority("priority", priority, principal, user_priority_limit)
    if max_workers is not None:
        if max_workers < job.spec.min_workers:
            raise InvalidField(
                "max_workers", max_workers, f"must be >= min_workers ({job.spec.min_workers})"
            )
        if max_workers > MAX_WORKERS_LIMIT:
            raise InvalidField("max_workers", max_workers, f"must be <= {MAX_WORKERS_LIMIT}")


def can_see(principal: Principal, owner: str, job_id: str = "") -> bool:
    """A job is visible to its owner, to admins and to services, and to the learners whose
    credential was minted for it (``job_id``; never in listings, where it is empty)."""
    if principal.role is Role.LEARNER:
        return bool(job_id) and principal.job_id == job_id
    return principal.role in (Role.ADMIN, Role.SERVICE) or principal.name == owner


def spec_digest(spec: job_pb2.JobSpec) -> str:
    """The sha256 of a validated spec's deterministic serialization: what a repeated SubmitJob
    with the same request_id must match."""
    return hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


class LearnerPhase(enum.Enum):
    """Where one learner of a job stands, as the scheduler tracks it."""

    PENDING = "pending"
    """Decided (a device chosen); the allocation is being acquired. Written before acquiring,
    so that a new leader can tell its own allocations from orphans."""
    STARTING = "starting"
    """The device is allocated; StartLearner has not been confirmed yet."""
    RUNNING = "running"
    """The agent started the process."""
    RETIRING = "retiring"
    """The coordinator was asked to retire it at its next boundary; it still holds its device
    until its exit is reported."""
    STOPPING = "stopping"
    """StopLearner was sent (cancel, or a retire that took too long)."""


HOLDING = frozenset({LearnerPhase.STARTING, LearnerPhase.RUNNING})
LEAVING = frozenset({LearnerPhase.RETIRING, LearnerPhase.STOPPING})


@dataclass
class LearnerRecord:
    """One learner of a job: where it runs and how far the scheduler got with it."""

    learner_id: str
    host_id: str
    device_id: str
    agent_address: str = ""
    host_incarnation: int = 0
    allocation_id: str = ""
    phase: LearnerPhase = LearnerPhase.PENDING
    simulated: bool = False
    created_at: float = 0.0
    phase_since: float = 0.0

    def set_phase(self, phase: LearnerPhase, now: float) -> None:
        self.phase = phase
        self.phase_since = now

    def to_dict(self) -> dict[str, Any]:
        return {
            "learner_id": self.learner_id,
            "host_id": self.host_id,
            "device_id": self.device_id,
            "agent_address": self.agent_address,
            "host_incarnation": self.host_incarnation,
            "allocation_id": self.allocation_id,
            "phase": self.phase.value,
            "simulated": self.simulated,
            "created_at": self.created_at,
            "phase_since": self.phase_since,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LearnerRecord:
        return cls(
            learner_id=d["learner_id"],
            host_id=d["host_id"],
            device_id=d["device_id"],
            agent_address=d.get("agent_address", ""),
            host_incarnation=int(d.get("host_incarnation", 0)),
            allocation_id=d.get("allocation_id", ""),
            phase=LearnerPhase(d.get("phase", "pending")),
            simulated=bool(d.get("simulated", False)),
            created_at=float(d.get("created_at", 0.0)),
            phase_since=float(d.get("phase_since", 0.0)),
        )


@dataclass(frozen=True)
class PastLearner:
    """A learner that is gone; kept (bounded) so that its logs can still be found."""

    learner_id: str
    host_id: str
    agent_address: str
    exit_code: int | None
    reason: str
    ended_at: float


@dataclass(frozen=True)
class StateChange:
    """One entry of a job's state history."""

    time: float
    from_state: int
    to_state: int
    reason: str


def timestamp(t: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(round(t * 1e9))
    return ts


@dataclass
class JobRecord:
    """A job as the scheduler persists it: the public :class:`job_pb2.Job` plus what the
    scheduler needs to resume it after a fail-over (learners, coordinator, history).

    Serialized as one JSON document (``to_bytes``): the ``Job`` in the protobuf JSON mapping
    and the scheduler's own fields beside it (see docs/scheduler.md).
    """

    job: job_pb2.Job
    submit_seq: int
    request_id: str = ""
    coordinator_index: int = -1
    coordinator_address: str = ""
    opened: bool = False
    closed: bool = False
    learner_seq: int = 0
    learners: dict[str, LearnerRecord] = field(default_factory=dict)
    past_learners: list[PastLearner] = field(default_factory=list)
    history: list[StateChange] = field(default_factory=list)
    last_shrunk_at: float | None = None
    failures: int = 0
    last_failure: str = ""
    recoveries: int = 0
    """Automatic retries from the latest checkpoint after a stall (``shoal.scheduler.health``);
    bounded by the scheduler's ``--max-recoveries``."""
    traceparent: str = ""
    """W3C traceparent of the job's submit: the job's trace (``shoal.scheduler.tracing``)."""
    spec_digest: str = ""
    """``spec_digest`` of the spec as submitted (later updates do not change it); empty in
    records written before it existed."""
    # Not serialized: the store revision the record was read or last written at.
    revision: int = 0
    # Not serialized: the priority the last scheduling cycle decided the job's share with
    # (None on a new leader). A change of it turns sticky rounding off for a cycle (policy.py).
    decided_priority: int | None = None

    FORMAT = 1

    # -- identity ---------------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def owner(self) -> str:
        return self.job.owner

    @property
    def state(self) -> int:
        return self.job.state

    @property
    def active(self) -> bool:
        return self.job.state in ACTIVE_STATES

    @property
    def final(self) -> bool:
        return self.job.state in FINAL_STATES

    # -- state machine ----------------------------------------------------------------------

    def transition(self, target: int, reason: str, now: float) -> StateChange:
        """Move to ``target`` if the table allows it; record it; set the times."""
        check_transition(self.job_id, self.job.state, target)
        change = StateChange(now, self.job.state, target, reason)
        self.history.append(change)
        del self.history[:-STATE_HISTORY_LIMIT]
        self.job.state = target  # type: ignore[assignment]
        self.job.state_reason = reason
        if target == S.JOB_STATE_RUNNING and not self.job.HasField("start_time"):
            self.job.start_time.CopyFrom(timestamp(now))
        if target in FINAL_STATES:
            self.job.end_time.CopyFrom(timestamp(now))
            self.job.queue_position = 0
            self.job.target_workers = 0
        if target != S.JOB_STATE_QUEUED:
            self.job.queue_position = 0
        return change

    # -- learners ---------------------------------------------------------------------------

    def next_learner_id(self) -> str:
        self.learner_seq += 1
        return f"{self.job_id}-l{self.learner_seq}"

    def workers(self) -> int:
        """Learners that hold a device and are not leaving (STARTING or RUNNING): the job's
        allocation as the API reports it (``allocated_workers``, allocation events)."""
        return sum(1 for lr in self.learners.values() if lr.phase in HOLDING)

    def holding(self) -> int:
        """Learners that hold a device now (allocated, whatever their phase)."""
        return sum(1 for lr in self.learners.values() if lr.phase is not LearnerPhase.PENDING)

    def forget_learner(
        self, learner_id: str, *, exit_code: int | None, reason: str, now: float
    ) -> LearnerRecord | None:
        learner = self.learners.pop(learner_id, None)
        if learner is not None and learner.phase is not LearnerPhase.PENDING:
            self.past_learners.append(
                PastLearner(
                    learner_id, learner.host_id, learner.agent_address, exit_code, reason, now
                )
            )
            del self.past_learners[:-PAST_LEARNERS_LIMIT]
        return learner

    def sync_counts(self) -> None:
        self.job.allocated_workers = self.workers()

    # -- views ------------------------------------------------------------------------------

    def public(self) -> job_pb2.Job:
        """A copy of the public Job (what the API returns)."""
        out = job_pb2.Job()
        out.CopyFrom(self.job)
        out.allocated_workers = self.workers()
        return out

    # -- serialization ----------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        doc = {
            "format": self.FORMAT,
            "job": json_format.MessageToDict(self.job, preserving_proto_field_name=True),
            "submit_seq": self.submit_seq,
            "request_id": self.request_id,
            "coordinator_index": self.coordinator_index,
            "coordinator_address": self.coordinator_address,
            "opened": self.opened,
            "closed": self.closed,
            "learner_seq": self.learner_seq,
            "learners": [lr.to_dict() for lr in self.learners.values()],
            "past_learners": [p.__dict__ for p in self.past_learners],
            "history": [
                {"time": h.time, "from": h.from_state, "to": h.to_state, "reason": h.reason}
                for h in self.history
            ],
            "last_shrunk_at": self.last_shrunk_at,
            "failures": self.failures,
            "last_failure": self.last_failure,
            "recoveries": self.recoveries,
            "traceparent": self.traceparent,
            "spec_digest": self.spec_digest,
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, revision: int = 0) -> JobRecord:
        doc = json.loads(data)
        if doc.get("format") != cls.FORMAT:
            raise ValueError(f"job record format ({doc.get('format')!r}) is not {cls.FORMAT}")
        job = json_format.ParseDict(doc["job"], job_pb2.Job(), ignore_unknown_fields=True)
        learners = [LearnerRecord.from_dict(d) for d in doc.get("learners", [])]
        return cls(
            job=job,
            submit_seq=int(doc["submit_seq"]),
            request_id=doc.get("request_id", ""),
            coordinator_index=int(doc.get("coordinator_index", -1)),
            coordinator_address=doc.get("coordinator_address", ""),
            opened=bool(doc.get("opened", False)),
            closed=bool(doc.get("closed", False)),
            learner_seq=int(doc.get("learner_seq", 0)),
            learners={lr.learner_id: lr for lr in learners},
            past_learners=[PastLearner(**p) for p in doc.get("past_learners", [])],
            history=[
                StateChange(h["time"], h["from"], h["to"], h["reason"])
                for h in doc.get("history", [])
            ],
            last_shrunk_at=doc.get("last_shrunk_at"),
            failures=int(doc.get("failures", 0)),
            last_failure=doc.get("last_failure", ""),
            recoveries=int(doc.get("recoveries", 0)),
            traceparent=doc.get("traceparent", ""),
            spec_digest=doc.get("spec_digest", ""),
            revision=revision,
        )


def new_job_record(
    spec: job_pb2.JobSpec,
    *,
    job_id: str,
    owner: str,
    submit_seq: int,
    request_id: str,
    now: float,
) -> JobRecord:
    """A fresh QUEUED job for a validated spec."""
    job = job_pb2.Job(
        job_id=job_id,
        owner=owner,
        spec=spec,
        state=job_pb2.JOB_STATE_QUEUED,
        state_reason="submitted; waiting for devices",
        create_time=timestamp(now),
    )
    record = JobRecord(
        job=job, submit_seq=submit_seq, request_id=request_id, spec_digest=spec_digest(spec)
    )
    record.history.append(
        StateChange(now, S.JOB_STATE_UNSPECIFIED, S.JOB_STATE_QUEUED, "submitted")
    )
    return record


# --------------------------------------------------------------------------------------------
# Allocation history
# --------------------------------------------------------------------------------------------


def append_allocation_event(
    events: list[job_pb2.AllocationEvent], event: job_pb2.AllocationEvent, limit: int
) -> None:
    """Append ``event``, dropping the oldest ones beyond ``limit``."""
    events.append(event)
    del events[:-limit]


# --------------------------------------------------------------------------------------------
# ListJobs pagination
# --------------------------------------------------------------------------------------------


def validate_page_size(page_size: int) -> int:
    if page_size == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise InvalidField("page_size", page_size, f"must be in 1..{MAX_PAGE_SIZE} (0: 100)")
    return page_size


def _filter_key(states: Iterable[int]) -> str:
    text = ",".join(str(s) for s in sorted(set(states)))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def encode_page_token(submit_seq: int, job_id: str, states: Iterable[int]) -> str:
    """An opaque token: where the next page starts (after this job) and the filter it is for."""
    doc = json.dumps([submit_seq, job_id, _filter_key(states)], separators=(",", ":"))
    return base64.urlsafe_b64encode(doc.encode()).decode().rstrip("=")


def decode_page_token(token: str, states: Iterable[int]) -> tuple[int, str]:
    try:
        padded = token + "=" * (-len(token) % 4)
        seq, job_id, key = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(seq, int) or not isinstance(job_id, str) or not isinstance(key, str):
            raise ValueError("bad token fields")
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise InvalidField("page_token", token, "is not a token this API returned") from None
    if key != _filter_key(states):
        raise InvalidField("page_token", token, "was issued for a different states filter")
    return seq, job_id


def page_jobs(
    jobs: Sequence[job_pb2.Job],
    seqs: Mapping[str, int],
    *,
    states: Sequence[int],
    page_size: int,
    page_token: str,
) -> tuple[list[job_pb2.Job], str]:
    """One page of ``jobs`` (already filtered by visibility), newest first.

    ``seqs`` gives each job's submit sequence (the order). The token names the last job of the
    page, so pages stay consistent while jobs are submitted: new jobs appear only on a fresh
    first page, and none is skipped or repeated.
    """
    size = validate_page_size(page_size)
    for s in states:
        if s not in job_pb2.JobState.values() or s == S.JOB_STATE_UNSPECIFIED:
            raise InvalidField("states", s, "must name job states (QUEUED, RUNNING, ...)")
    wanted = frozenset(states)
    ordered = sorted(
        (j for j in jobs if not wanted or j.state in wanted),
        key=lambda j: (seqs[j.job_id], j.job_id),
        reverse=True,
    )
    if page_token:
        after = decode_page_token(page_token, states)
        ordered = [j for j in ordered if (seqs[j.job_id], j.job_id) < after]
    page = ordered[:size]
    token = ""
    if len(ordered) > size:
        last = page[-1]
        token = encode_page_token(seqs[last.job_id], last.job_id, states)
    return page, token
