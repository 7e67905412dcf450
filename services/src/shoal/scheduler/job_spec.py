"""Job specs, pure (no grpc, no I/O): SubmitJob's and UpdateJob's validation with its limits,
who may see a job, and the digest a repeated SubmitJob must match.

Part of the job core: :mod:`shoal.scheduler.jobs` re-exports every name here.
"""

from __future__ import annotations

import hashlib
import re

from shoal.contract import ids
from shoal.contract.errors import (
    FailedPrecondition,
    InvalidField,
    PermissionDenied,
)
from shoal.runtime.auth import Principal, Role
from shoal.scheduler.job_states import ACTIVE_STATES, state_name
from shoal.v1 import job_pb2

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
MAX_GLOBAL_BATCH = 1 << 20

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables the scheduler or the host-agent set for every learner; a job may not override them.
_RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "TRACEPARENT", "TRACESTATE"})
_RESERVED_ENV_PREFIX = "SHOAL_"


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
    if spec.HasField("adaptive_batch"):
        _check_adaptive_batch(spec)
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


def _check_adaptive_batch(spec: job_pb2.JobSpec) -> None:
    """The bounds of an opt-in adaptive batch: 1 <= min <= batch_size <= max <= limit, and a
    known learning-rate rule."""
    ab = spec.adaptive_batch
    if ab.min_global_batch < 1:
        raise InvalidField(
            "spec.adaptive_batch.min_global_batch", ab.min_global_batch, "must be >= 1"
        )
    if ab.max_global_batch > MAX_GLOBAL_BATCH:
        raise InvalidField(
            "spec.adaptive_batch.max_global_batch",
            ab.max_global_batch,
            f"must be <= {MAX_GLOBAL_BATCH}",
        )
    if ab.max_global_batch < ab.min_global_batch:
        raise InvalidField(
            "spec.adaptive_batch.max_global_batch",
            ab.max_global_batch,
            f"must be >= spec.adaptive_batch.min_global_batch ({ab.min_global_batch})",
        )
    if not ab.min_global_batch <= spec.batch_size <= ab.max_global_batch:
        raise InvalidField(
            "spec.batch_size",
            spec.batch_size,
            f"must be within spec.adaptive_batch [{ab.min_global_batch}, {ab.max_global_batch}]",
        )
    if ab.rule not in (
        job_pb2.BATCH_SCALING_RULE_LINEAR,
        job_pb2.BATCH_SCALING_RULE_SQRT,
        job_pb2.BATCH_SCALING_RULE_ADASCALE,
    ):
        raise InvalidField(
            "spec.adaptive_batch.rule",
            ab.rule,
            "must be one of LINEAR (1), SQRT (2), ADASCALE (3)",
        )


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
