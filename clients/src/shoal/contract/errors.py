"""Every shoal domain error, once, and the error trailer both sides of a call read.

This module imports only the standard library, so that a pure core (``resource_manager.core``,
``scheduler.jobs``), a client, a learner and every service may raise and catch these errors
without loading grpc, protobuf, aetcd or torch (a test checks it). How a server turns them into
a gRPC status (AIP-193, etcd's ``toGRPCErrorMap``) is the server's business:
:mod:`shoal.runtime.errors` holds that table.

A handler raises a :class:`ShoalError`; the server's error interceptor sends its status code,
its message and, in the trailing metadata key ``shoal-error-reason``
(:data:`REASON_METADATA_KEY`), the machine-readable ``shoal.v1.ErrorReason`` value name. A
standby adds the leader's address in ``shoal-leader`` (:data:`LEADER_METADATA_KEY`). Whoever
receives a failed call reads both with :func:`decode_rpc_error`.

The state store's errors (:class:`StoreError` and its subclasses) are here too: a deposed
leader's write fails with the same :class:`FencedOut` that a service raises for a caller's
stale fencing token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

REASON_METADATA_KEY = "shoal-error-reason"
LEADER_METADATA_KEY = "shoal-leader"
#: A parameter-sync shard's refusal of a stale generation carries the lowest generation it
#: accepts (its generation floor), as a decimal integer (:class:`StaleGeneration`).
GENERATION_FLOOR_METADATA_KEY = "shoal-generation-floor"

#: The names of ``shoal.v1.ErrorReason`` (protos/shoal/v1/errors.proto); a unit test keeps this
#: set equal to the enum, so a typo in a ``reason`` fails at once without importing protobuf.
REASONS = frozenset(
    {
        "ERROR_REASON_UNSPECIFIED",
        "ERROR_REASON_INVALID_FIELD",
        "ERROR_REASON_JOB_NOT_FOUND",
        "ERROR_REASON_HOST_NOT_FOUND",
        "ERROR_REASON_DEVICE_NOT_FOUND",
        "ERROR_REASON_DEVICE_BUSY",
        "ERROR_REASON_HOST_UNAVAILABLE",
        "ERROR_REASON_NOT_LEADER",
        "ERROR_REASON_FENCED_OUT",
        "ERROR_REASON_STALE_GENERATION",
        "ERROR_REASON_LAYOUT_MISMATCH",
        "ERROR_REASON_TOO_LARGE",
        "ERROR_REASON_WRONG_STATE",
        "ERROR_REASON_UNAUTHENTICATED",
        "ERROR_REASON_PERMISSION_DENIED",
        "ERROR_REASON_ARTIFACT_NOT_FOUND",
        "ERROR_REASON_LEARNER_NOT_FOUND",
        "ERROR_REASON_STORE_UNAVAILABLE",
        "ERROR_REASON_ITERATION_ABORTED",
        "ERROR_REASON_ALREADY_EXISTS",
        "ERROR_REASON_QUOTA_EXCEEDED",
        "ERROR_REASON_OVERLOADED",
        "ERROR_REASON_STORAGE_FULL",
        "ERROR_REASON_STALE_COORDINATOR",
    }
)


def check_reason(reason: str) -> str:
    """``reason`` if it is an ``ErrorReason`` value name, else ValueError naming it."""
    if reason not in REASONS:
        raise ValueError(f"reason ({reason!r}) is not a shoal.v1.ErrorReason value name")
    return reason


# --------------------------------------------------------------------------------------------
# Identifiers (shoal.contract.ids validates; the servers map this to INVALID_ARGUMENT)
# --------------------------------------------------------------------------------------------


class InvalidIdentifier(ValueError):
    """An identifier does not match its kind's pattern. ``str()`` names the field and the value
    (shortened when long) and the rule, like every shoal validation message."""

    def __init__(self, field_name: str, value: object, rule: str) -> None:
        shown = value
        if isinstance(value, str) and len(value) > 64:
            shown = value[:40] + f"...({len(value)} characters)"
        super().__init__(f"{field_name} ({shown!r}) {rule}")
        self.field_name = field_name
        self.value = value
        self.rule = rule


# --------------------------------------------------------------------------------------------
# The state store's errors (shoal.runtime.store raises them)
# --------------------------------------------------------------------------------------------


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    """The store could not be reached or did not answer in time; the caller may retry.

    For a write the outcome is unknown: it may or may not have been applied.
    """


class LeaseExpired(StoreError):
    """The lease does not exist (any more): it expired or was revoked."""

    def __init__(self, lease_id: int, detail: str = "") -> None:
        extra = f" ({detail})" if detail else ""
        super().__init__(f"lease {lease_id:x} has expired or was revoked{extra}")
        self.lease_id = lease_id


# --------------------------------------------------------------------------------------------
# Domain errors: each carries its ErrorReason; the server's table gives the status code
# --------------------------------------------------------------------------------------------


class ShoalError(Exception):
    """Base of all domain errors. ``reason`` is an ``ErrorReason`` value name."""

    reason: str = "ERROR_REASON_UNSPECIFIED"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        check_reason(self.reason)  # fail fast on a typo

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidField(ShoalError):
    """A request field has a bad value. The message names the field and the value."""

    reason = "ERROR_REASON_INVALID_FIELD"

    def __init__(self, field_name: str, value: object, rule: str) -> None:
        super().__init__(f"{field_name} ({value!r}) {rule}")
        self.field_name = field_name
        self.value = value


class NotFound(ShoalError):
    reason = "ERROR_REASON_UNSPECIFIED"

    def __init__(self, kind: str, name: str, *, reason: str | None = None) -> None:
        super().__init__(f"{kind} {name!r} not found", reason=reason)


class JobNotFound(NotFound):
    reason = "ERROR_REASON_JOB_NOT_FOUND"

    def __init__(self, job_id: str) -> None:
        super().__init__("job", job_id)


class HostNotFound(NotFound):
    reason = "ERROR_REASON_HOST_NOT_FOUND"

    def __init__(self, host_id: str) -> None:
        super().__init__("host", host_id)
        self.host_id = host_id


class DeviceNotFound(NotFound):
    """A device the call names does not exist. The resource manager names the host
    (``host_id``); a host agent lists the devices it has (``known``)."""

    reason = "ERROR_REASON_DEVICE_NOT_FOUND"

    def __init__(
        self, device_id: str, known: Iterable[str] | None = None, *, host_id: str | None = None
    ) -> None:
        if host_id is not None:
            super().__init__(f"device on host {host_id!r}:", device_id)
        else:
            super().__init__("device", device_id)
            self.args = (
                f"device {device_id!r} not found on this host (it has: {', '.join(known or ())})",
            )
        self.host_id = host_id
        self.device_id = device_id


class LearnerNotFound(NotFound):
    reason = "ERROR_REASON_LEARNER_NOT_FOUND"

    def __init__(self, learner_id: str) -> None:
        super().__init__("learner", learner_id)


class ArtifactNotFound(NotFound):
    """The artifact named in a spec or a download does not exist (NOT_FOUND); ``where`` says
    where it was looked for, when the caller knows."""

    reason = "ERROR_REASON_ARTIFACT_NOT_FOUND"

    def __init__(self, artifact_id: str, where: str | None = None) -> None:
        super().__init__("artifact", artifact_id)
        if where is not None:
            self.args = (f"artifact {artifact_id!r} not found ({where})",)


class FailedPrecondition(ShoalError):
    """The system is not in a state that allows the operation."""

    reason = "ERROR_REASON_WRONG_STATE"


class FencedOut(FailedPrecondition, StoreError):
    """A write was refused because its writer is no longer the leader: a caller's fencing
    token is stale, or -- raised by the store, built with
    :meth:`of_fence` -- the fence's leader key is gone or belongs to a new leader."""

    reason = "ERROR_REASON_FENCED_OUT"

    def __init__(
        self,
        message: str,
        *,
        fence: Any = None,
        actual_create_revision: int | None = None,
    ) -> None:
        super().__init__(message)
        self.fence = fence
        self.actual_create_revision = actual_create_revision

    @classmethod
    def of_fence(cls, fence: Any, actual_create_revision: int | None) -> FencedOut:
        """The store's refusal of a write fenced by ``fence`` (a ``shoal.runtime.store.Fence``):
        its key now has ``actual_create_revision``, or is gone (``None``)."""
        now = (
            "is gone"
            if actual_create_revision is None
            else f"has create_revision {actual_create_revision}"
        )
        return cls(
            f"fenced out: leader key {fence.key!r} was expected with create_revision "
            f"{fence.create_revision} but {now}",
            fence=fence,
            actual_create_revision=actual_create_revision,
        )


class StaleCoordinator(FailedPrecondition):
    """A call was refused because its coordinator epoch for the job is older than the one the
    shard knows: the job's coordinator role moved since (parameter-sync failover). It fences a
    job's coordinator, never a scheduler's leadership (that is :class:`FencedOut`), so a
    scheduler that meets it keeps leading and retries with the job's newer epoch."""

    reason = "ERROR_REASON_STALE_COORDINATOR"


class StaleGeneration(FailedPrecondition):
    """A generation (or learner) that is no longer current. ``floor``: when a parameter-sync
    shard refuses a contribution below its generation floor, the lowest generation it accepts
    (sent in the ``shoal-generation-floor`` trailer, :data:`GENERATION_FLOOR_METADATA_KEY`)."""

    reason = "ERROR_REASON_STALE_GENERATION"

    def __init__(self, message: str, *, floor: int | None = None) -> None:
        super().__init__(message)
        self.floor = floor


class DeviceBusy(FailedPrecondition):
    reason = "ERROR_REASON_DEVICE_BUSY"


class HostUnavailable(FailedPrecondition):
    """The host is cordoned, draining or lost."""

    reason = "ERROR_REASON_HOST_UNAVAILABLE"


class StaleIncarnation(FailedPrecondition):
    """A heartbeat names an incarnation that is not the host's current one, or a lost host."""

    reason = "ERROR_REASON_WRONG_STATE"


class InvalidTransition(FailedPrecondition):
    """A state change the transition table (of a host, a job) does not allow. ``current`` and
    ``target`` are the states, when the raiser gives them."""

    reason = "ERROR_REASON_WRONG_STATE"

    def __init__(self, message: str, *, current: Any = None, target: Any = None) -> None:
        super().__init__(message)
        self.current = current
        self.target = target


class TooLarge(ShoalError):
    reason = "ERROR_REASON_TOO_LARGE"


class AlreadyExists(ShoalError):
    """The request collides with an existing resource (a request_id reused with another
    request); the message names it."""

    reason = "ERROR_REASON_ALREADY_EXISTS"


class QuotaExceeded(ShoalError):
    """The caller's quota would be exceeded; the message says which, its use and its limit."""

    reason = "ERROR_REASON_QUOTA_EXCEEDED"


class Overloaded(ShoalError):
    """The server sheds the call: too many calls in flight (``--max-concurrent-calls``)."""

    reason = "ERROR_REASON_OVERLOADED"


class StorageFull(ShoalError):
    """The storage is full (ENOSPC, EDQUOT); the message says what could not be written."""

    reason = "ERROR_REASON_STORAGE_FULL"


class Unavailable(ShoalError):
    """Transient: the caller may retry (the store is unreachable, for example)."""

    reason = "ERROR_REASON_STORE_UNAVAILABLE"


class StoreConflict(ShoalError):
    """A record changed in the store behind the leader's back (a bug, or a second writer)."""

    reason = "ERROR_REASON_STORE_UNAVAILABLE"


class Aborted(ShoalError):
    reason = "ERROR_REASON_ITERATION_ABORTED"


class NotLeader(ShoalError):
    """This replica is a standby. ``leader`` is the leader's address, if known."""

    reason = "ERROR_REASON_NOT_LEADER"

    def __init__(self, service: str, leader: str | None) -> None:
        where = f"; the leader is at {leader}" if leader else "; no leader is elected yet"
        super().__init__(f"this {service} replica is not the leader{where}")
        self.leader = leader


class Unauthenticated(ShoalError):
    reason = "ERROR_REASON_UNAUTHENTICATED"


class PermissionDenied(ShoalError):
    reason = "ERROR_REASON_PERMISSION_DENIED"


# --------------------------------------------------------------------------------------------
# The receiving side: one decoder of a failed call's status and trailers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RpcErrorInfo:
    """What a failed call said. ``code`` is the call's status code as the library gave it
    (a ``grpc.StatusCode``), ``code_name`` its name (``"UNKNOWN"`` when absent); ``reason`` the
    ``ErrorReason`` name from ``shoal-error-reason`` (``""`` when the server sent none);
    ``leader`` the address from ``shoal-leader`` (``""`` when none); ``message`` the details;
    ``generation_floor`` the refusing shard's floor from ``shoal-generation-floor`` (None when
    absent or not a non-negative integer)."""

    code: Any
    code_name: str
    reason: str
    leader: str
    message: str
    generation_floor: int | None = None


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def decode_rpc_error(exc: Any) -> RpcErrorInfo:
    """Decode a failed gRPC call (``grpc.RpcError`` / ``grpc.aio.AioRpcError``: anything with
    ``code()``, ``details()`` and ``trailing_metadata()``). Values sent as bytes are decoded
    as UTF-8."""
    code = exc.code()
    trailers: dict[str, str] = {}
    for key, value in exc.trailing_metadata() or ():
        trailers.setdefault(str(key), _text(value))
    return RpcErrorInfo(
        code=code,
        code_name=getattr(code, "name", None) or "UNKNOWN",
        reason=trailers.get(REASON_METADATA_KEY, ""),
        leader=trailers.get(LEADER_METADATA_KEY, ""),
        message=exc.details() or "",
        generation_floor=_floor(trailers.get(GENERATION_FLOOR_METADATA_KEY, "")),
    )


def _floor(text: str) -> int | None:
    """A ``shoal-generation-floor`` trailer's value (None when absent or malformed: a hint,
    never trusted for more than that)."""
    if not text.isascii() or not text.isdigit() or len(text) > 20:
        return None
    return int(text)
