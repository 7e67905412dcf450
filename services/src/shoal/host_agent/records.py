"""What the host agent knows of one learner (:class:`Learner`), what StartLearner asks for
(:class:`LaunchRequest`) and the checks of its fields, made before anything changes."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import timestamp_pb2

from shoal.contract import ids
from shoal.contract.errors import InvalidField
from shoal.host_agent.devices import DeviceInfo
from shoal.host_agent.logs import _LogWriter
from shoal.v1 import resources_pb2

__all__ = [
    "FAILED",
    "RUNNING",
    "STARTING",
    "STOPPING",
    "SUCCEEDED",
    "TERMINAL",
    "LaunchRequest",
    "Learner",
]

STARTING = resources_pb2.LEARNER_STATE_STARTING
RUNNING = resources_pb2.LEARNER_STATE_RUNNING
STOPPING = resources_pb2.LEARNER_STATE_STOPPING
SUCCEEDED = resources_pb2.LEARNER_STATE_SUCCEEDED
FAILED = resources_pb2.LEARNER_STATE_FAILED
TERMINAL = frozenset({SUCCEEDED, FAILED})


def _ts(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    if seconds:
        ts.FromNanoseconds(int(seconds * 1e9))
    return ts


@dataclass
class Learner:
    """One learner this agent started (kept until forgotten)."""

    learner_id: str
    job_id: str
    device: DeviceInfo
    directory: Path
    allocation_id: str = ""
    host_id: str = ""
    host_incarnation: int = 0
    state: resources_pb2.LearnerState.ValueType = STARTING
    pid: int = 0
    exit_code: int = 0
    exit_reason: str = ""
    start_time: float = 0.0
    end_time: float = 0.0
    stop_reason: str | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    # Heartbeat bookkeeping: the sequence that first carried the exit, and whether the
    # resource manager acknowledged it.
    exit_sent_seq: int | None = None
    exit_acked: bool = False
    warm_token: str = ""  # the warm process it started in ("" for a cold start)
    unpacked_ahead: bool = False  # its work/ is a copy of the artifact unpacked before it started
    process: asyncio.subprocess.Process | None = None
    writer: _LogWriter | None = None
    followers: int = 0  # log readers following it now (follow_log)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _build: asyncio.Task[str | None] | None = None  # its environment's build, while it runs

    @property
    def log_path(self) -> Path:
        return self.directory / "output.log"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def to_proto(self) -> resources_pb2.Learner:
        return resources_pb2.Learner(
            learner_id=self.learner_id,
            job_id=self.job_id,
            host_id=self.host_id,
            device_id=self.device.device_id,
            state=self.state,
            pid=self.pid if not self.terminal else 0,
            exit_code=self.exit_code,
            exit_reason=self.exit_reason,
            start_time=_ts(self.start_time),
            end_time=_ts(self.end_time),
            host_incarnation=self.host_incarnation,
        )


@dataclass(frozen=True)
class LaunchRequest:
    """What StartLearner asks for."""

    learner_id: str
    job_id: str
    device_id: str
    artifact_id: str
    entry_point: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    allocation_id: str = ""
    fencing_election: str = ""
    fencing_revision: int = 0


def _validate_id(field_name: str, value: str, kind: ids.IdKind) -> None:
    if not value:
        raise InvalidField(field_name, value, "must not be empty")
    if not ids.is_valid(kind, value):
        raise InvalidField(field_name, value, ids.describe(kind))


def _validate_entry_point(entry_point: str) -> None:
    if not entry_point:
        raise InvalidField("entry_point", entry_point, "must not be empty")
    parts = Path(entry_point).parts
    if Path(entry_point).is_absolute() or ".." in parts:
        raise InvalidField(
            "entry_point", entry_point, "must be a relative path inside the artifact"
        )


# Variables of the agent that learners do not inherit (its configuration and secrets).
_PRIVATE_ENV_PREFIXES = ("SHOAL_",)
_RESET_ENV = ("TRACEPARENT", "TRACESTATE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
