"""The server side of shoal's errors: the table from domain errors to gRPC status codes
(AIP-193, etcd's ``toGRPCErrorMap``).

The errors themselves live in :mod:`shoal.contract.errors` (standard library only, so pure
cores, clients and learners import them without grpc). Handlers raise them; the runtime's error
interceptor maps them to a gRPC status code here, in one place, with the machine-readable
:class:`shoal.v1.errors_pb2.ErrorReason` in the trailing metadata key ``shoal-error-reason``.
Unmapped exceptions become INTERNAL and are logged with the trace id.

The error names are re-exported from this module so that ``from shoal.runtime.errors import
InvalidField`` keeps working; new code imports them from :mod:`shoal.contract.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from shoal.contract.errors import (
    GENERATION_FLOOR_METADATA_KEY,
    LEADER_METADATA_KEY,
    REASON_METADATA_KEY,
    Aborted,
    AlreadyExists,
    ArtifactNotFound,
    DeviceBusy,
    DeviceNotFound,
    FailedPrecondition,
    FencedOut,
    HostNotFound,
    HostUnavailable,
    InvalidField,
    InvalidIdentifier,
    InvalidTransition,
    JobNotFound,
    LearnerNotFound,
    LeaseExpired,
    NotFound,
    NotLeader,
    Overloaded,
    PermissionDenied,
    QuotaExceeded,
    ShoalError,
    StaleGeneration,
    StaleIncarnation,
    StorageFull,
    StoreConflict,
    StoreError,
    StoreUnavailable,
    TooLarge,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "BASE_TABLE",
    "DEFAULT_TABLE",
    "FOREIGN_REASONS",
    "GENERATION_FLOOR_METADATA_KEY",
    "LEADER_METADATA_KEY",
    "REASON_METADATA_KEY",
    "Aborted",
    "AlreadyExists",
    "ArtifactNotFound",
    "DeviceBusy",
    "DeviceNotFound",
    "ErrorTable",
    "FailedPrecondition",
    "FencedOut",
    "HostNotFound",
    "HostUnavailable",
    "InvalidField",
    "InvalidIdentifier",
    "InvalidTransition",
    "JobNotFound",
    "LearnerNotFound",
    "LeaseExpired",
    "MappedError",
    "NotFound",
    "NotLeader",
    "Overloaded",
    "PermissionDenied",
    "QuotaExceeded",
    "ShoalError",
    "StaleGeneration",
    "StaleIncarnation",
    "StorageFull",
    "StoreConflict",
    "StoreError",
    "StoreUnavailable",
    "TooLarge",
    "Unauthenticated",
    "Unavailable",
]


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
    # The state store's errors, raised through from etcd: a deposed leader's write (a
    # FencedOut, so a FailedPrecondition above), an unreachable store (retry), a lease that
    # expired under a leader.
    StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    LeaseExpired: grpc.StatusCode.UNAVAILABLE,
    # An identifier that does not match its pattern (shoal.contract.ids).
    InvalidIdentifier: grpc.StatusCode.INVALID_ARGUMENT,
}

# Reasons of errors that are not ShoalErrors.
FOREIGN_REASONS: dict[type[BaseException], str] = {
    InvalidIdentifier: "ERROR_REASON_INVALID_FIELD",
    StoreUnavailable: "ERROR_REASON_STORE_UNAVAILABLE",
    LeaseExpired: "ERROR_REASON_STORE_UNAVAILABLE",
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
            if isinstance(exc, StaleGeneration) and exc.floor is not None:
                metadata.append((GENERATION_FLOOR_METADATA_KEY, str(int(exc.floor))))
            return MappedError(code, message, tuple(metadata))
        return None


DEFAULT_TABLE = ErrorTable()
