"""Domain errors and the per-service error table (AIP-193, etcd's ``toGRPCErrorMap``).

Handlers raise domain exceptions; the runtime's error interceptor maps them to a gRPC status
code in one place, with the machine-readable :class:`shoal.v1.errors_pb2.ErrorReason` in the
trailing metadata key ``shoal-error-reason``. Unmapped exceptions become INTERNAL and are
logged with the trace id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from shoal.contract import ids
from shoal.runtime import store
from shoal.v1 import errors_pb2

REASON_METADATA_KEY = "shoal-error-reason"
LEADER_METADATA_KEY = "shoal-leader"


class ShoalError(Exception):
    """Base of all domain errors. ``reason`` is an ``ErrorReason`` value name."""

    reason: str = "ERROR_REASON_UNSPECIFIED"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        errors_pb2.ErrorReason.Value(self.reason)  # fail fast on a typo

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


class FailedPrecondition(ShoalError):
    """The system is not in a state that allows the operation."""

    reason = "ERROR_REASON_WRONG_STATE"


class FencedOut(FailedPrecondition):
    reason = "ERROR_REASON_FENCED_OUT"


class StaleGeneration(FailedPrecondition):
    reason = "ERROR_REASON_STALE_GENERATION"


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


BASE_TABLE: dict[type[BaseException], grpc.StatusCode] = {
    InvalidField: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StorageFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    NotLeader: grpc.StatusCode.UNAVAILABLE,
    Aborted: grpc.StatusCode.ABORTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    # The state store's errors, raised through from etcd: a deposed leader's write, an
    # unreachable store (retry), a lease that expired under a leader.
    store.FencedOut: grpc.StatusCode.FAILED_PRECONDITION,
    store.StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    store.LeaseExpired: grpc.StatusCode.UNAVAILABLE,
    # An identifier that does not match its pattern (shoal.contract.ids).
    ids.InvalidIdentifier: grpc.StatusCode.INVALID_ARGUMENT,
}

# Reasons of errors that are not ShoalErrors.
FOREIGN_REASONS: dict[type[BaseException], str] = {
    ids.InvalidIdentifier: "ERROR_REASON_INVALID_FIELD",
    store.FencedOut: "ERROR_REASON_FENCED_OUT",
    store.StoreUnavailable: "ERROR_REASON_STORE_UNAVAILABLE",
    store.LeaseExpired: "ERROR_REASON_STORE_UNAVAILABLE",
}


@dataclass(frozen=True)
class MappedError:
    code: grpc.StatusCode
    message: str
    metadata: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ErrorTable:
    """Maps exception types to status codes. The most specific class in the MRO wins.

    Each service builds one with :meth:`extend` from :data:`BASE_TABLE` plus its own errors.
    """

    entries: Mapping[type[BaseException], grpc.StatusCode] = field(
        default_factory=lambda: dict(BASE_TABLE)
    )

    def extend(self, more: Mapping[type[BaseException], grpc.StatusCode]) -> ErrorTable:
        return ErrorTable({**self.entries, **more})

    def lookup(self, exc: BaseException) -> MappedError | None:
        for klass in type(exc).__mro__:
            code = self.entries.get(klass)
            if code is None:
                continue
            metadata: list[tuple[str, str]] = []
            if isinstance(exc, ShoalError):
                metadata.append((REASON_METADATA_KEY, exc.reason))
                message = exc.message
            else:
                message = str(exc) or type(exc).__name__
                if klass in FOREIGN_REASONS:
                    metadata.append((REASON_METADATA_KEY, FOREIGN_REASONS[klass]))
            if isinstance(exc, NotLeader) and exc.leader:
                metadata.append((LEADER_METADATA_KEY, exc.leader))
            return MappedError(code, message, tuple(metadata))
        return None


DEFAULT_TABLE = ErrorTable()
