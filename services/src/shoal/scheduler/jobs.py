"""The job core of the scheduler, pure (no grpc, no I/O): spec validation, the job state machine
with its transition table and recorded history, the job and learner records the scheduler
persists and the allocation history. Spec validation is in :mod:`shoal.scheduler.job_spec` and
ListJobs pagination in :mod:`shoal.scheduler.paging`, the state machine in
:mod:`shoal.scheduler.job_states`; all are re-exported here.

Everything here is a function of its arguments (the clock is passed in as ``now``, unix seconds)
and is unit-tested without a network. ``shoal.scheduler.store`` persists :class:`JobRecord` and
the allocation history; ``shoal.scheduler.service`` and ``shoal.scheduler.reconcile`` drive them.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from shoal.contract import stored
from shoal.contract.errors import (
    ArtifactNotFound,
    InvalidTransition,
)
from shoal.scheduler.job_spec import (
    ARG_MAX,
    ARGS_MAX,
    DATASET_URIS_MAX,
    DEFAULT_PRIORITY,
    ENTRY_POINT_MAX,
    ENV_MAX,
    ENV_VALUE_MAX,
    MAX_PRIORITY,
    MAX_WORKERS_LIMIT,
    NAME_MAX,
    URI_MAX,
    can_see,
    spec_digest,
    validate_spec,
    validate_update,
)
from shoal.scheduler.job_states import (
    ACTIVE_STATES,
    FINAL_STATES,
    STARTED_STATES,
    TRANSITIONS,
    check_transition,
    invalid_transition,
    state_name,
)
from shoal.scheduler.paging import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    decode_page_token,
    encode_page_token,
    page_jobs,
    validate_page_size,
)
from shoal.v1 import job_pb2

__all__ = [
    "ACTIVE_STATES",
    "ARGS_MAX",
    "ARG_MAX",
    "DATASET_URIS_MAX",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_PRIORITY",
    "ENTRY_POINT_MAX",
    "ENV_MAX",
    "ENV_VALUE_MAX",
    "FINAL_STATES",
    "MAX_PAGE_SIZE",
    "MAX_PRIORITY",
    "MAX_WORKERS_LIMIT",
    "NAME_MAX",
    "STARTED_STATES",
    "TRANSITIONS",
    "URI_MAX",
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
    "invalid_transition",
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

STATE_HISTORY_LIMIT = 100
PAST_LEARNERS_LIMIT = 1000

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

    def to_proto(self) -> job_pb2.LearnerRecordState:
        return job_pb2.LearnerRecordState(
            learner_id=self.learner_id,
            host_id=self.host_id,
            device_id=self.device_id,
            agent_address=self.agent_address,
            host_incarnation=self.host_incarnation,
            allocation_id=self.allocation_id,
            phase=self.phase.value,
            simulated=self.simulated,
            created_at=self.created_at,
            phase_since=self.phase_since,
        )

    @classmethod
    def from_proto(cls, m: job_pb2.LearnerRecordState) -> LearnerRecord:
        try:
            phase = LearnerPhase(m.phase or "pending")
        except ValueError:
            raise ValueError(f"learner {m.learner_id!r}: phase ({m.phase!r}) is unknown") from None
        return cls(
            learner_id=m.learner_id,
            host_id=m.host_id,
            device_id=m.device_id,
            agent_address=m.agent_address,
            host_incarnation=m.host_incarnation,
            allocation_id=m.allocation_id,
            phase=phase,
            simulated=m.simulated,
            created_at=m.created_at,
            phase_since=m.phase_since,
        )

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

    Stored as a ``shoal.v1.JobRecordState`` (``to_bytes``): the ``Job`` and the scheduler's
    own fields beside it (see docs/scheduler.md). Records of the earlier JSON encoding are still
    read (``from_bytes``), and a new leader rewrites them.
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
        """The record as stored: a ``shoal.v1.JobRecordState`` (protobuf)."""
        state = job_pb2.JobRecordState(
            job=self.job,
            submit_seq=self.submit_seq,
            request_id=self.request_id,
            coordinator_index=self.coordinator_index,
            coordinator_address=self.coordinator_address,
            opened=self.opened,
            closed=self.closed,
            learner_seq=self.learner_seq,
            learners=[lr.to_proto() for lr in self.learners.values()],
            past_learners=[
                job_pb2.PastLearnerState(
                    learner_id=p.learner_id,
                    host_id=p.host_id,
                    agent_address=p.agent_address,
                    exit_code=p.exit_code,
                    reason=p.reason,
                    ended_at=p.ended_at,
                )
                for p in self.past_learners
            ],
            history=[
                job_pb2.StateChangeState(
                    time=h.time, from_state=h.from_state, to_state=h.to_state, reason=h.reason
                )
                for h in self.history
            ],
            last_shrunk_at=self.last_shrunk_at,
            failures=self.failures,
            last_failure=self.last_failure,
            recoveries=self.recoveries,
            traceparent=self.traceparent,
            spec_digest=self.spec_digest,
        )
        return state.SerializeToString(deterministic=True)

    @staticmethod
    def is_legacy(data: bytes) -> bool:
        """Whether ``data`` is a record in the JSON encoding used before ``JobRecordState``
        (a new leader rewrites those: ``JobTable.become_leader``)."""
        return stored.is_legacy_json(data)

    @classmethod
    def from_bytes(cls, data: bytes, *, revision: int = 0) -> JobRecord:
        """Parse a stored record: a ``JobRecordState``, or the JSON document of records written
        before it. Raises ValueError (naming what is wrong) for anything else."""
        if cls.is_legacy(data):
            return cls._from_json(data, revision=revision)
        state = stored.parse(job_pb2.JobRecordState, data, "job record")
        if not state.job.job_id:
            raise ValueError("job record has no job_id")
        return cls(
            job=state.job,
            submit_seq=state.submit_seq,
            request_id=state.request_id,
            coordinator_index=state.coordinator_index,
            coordinator_address=state.coordinator_address,
            opened=state.opened,
            closed=state.closed,
            learner_seq=state.learner_seq,
            learners={lr.learner_id: LearnerRecord.from_proto(lr) for lr in state.learners},
            past_learners=[
                PastLearner(
                    learner_id=p.learner_id,
                    host_id=p.host_id,
                    agent_address=p.agent_address,
                    exit_code=p.exit_code if p.HasField("exit_code") else None,
                    reason=p.reason,
                    ended_at=p.ended_at,
                )
                for p in state.past_learners
            ],
            history=[
                StateChange(h.time, h.from_state, h.to_state, h.reason) for h in state.history
            ],
            last_shrunk_at=state.last_shrunk_at if state.HasField("last_shrunk_at") else None,
            failures=state.failures,
            last_failure=state.last_failure,
            recoveries=state.recoveries,
            traceparent=state.traceparent,
            spec_digest=state.spec_digest,
            revision=revision,
        )

    @classmethod
    def _from_json(cls, data: bytes, *, revision: int = 0) -> JobRecord:
        """A record in the JSON encoding of ``FORMAT`` 1 (before ``JobRecordState``)."""
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
