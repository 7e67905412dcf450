"""Per-job authorization of every ParameterSyncService method (pure: no grpc, no I/O).

The server interceptor has already checked the caller's role against :data:`ROLES` (which
roles may call a method at all). Each handler then calls :func:`authorize` once, at the top,
as soon as it knows the job (and, for the tensor streams, after their header), before it
touches any state:

* **services and admins** (the scheduler, the other shards) may call every method for every
  job;
* a **learner** (a credential the scheduler minted for one learner of one job) may call the
  data-plane methods (:data:`LEARNER_METHODS`) of *its own job only*, and wherever a request
  names a learner (Join, Boundary, the streams' ``sender_id``, PullParameters,
  ReportEpochMetrics) only *as itself*. So a learner can never join, speak for or read another
  job, and a job's membership only ever holds learners the scheduler started for it: nobody
  else holds a credential for that job;
* a **user** may read (:data:`OWNER_READS`) the progress and membership of the jobs it owns
  (``OpenJobRequest.owner``), nothing else.

Anything else is PERMISSION_DENIED, whether the job exists or not (a rogue learns nothing),
and changes nothing.

:func:`check_storage_uri` and :func:`check_job_directory` keep every path a request names
inside the storage the operator configured (``--storage-uri``) and inside the job's own part
of it.
"""

from __future__ import annotations

from shoal.contract import ids
from shoal.runtime.auth import Principal, Role
from shoal.runtime.errors import InvalidField, PermissionDenied

__all__ = [
    "LEARNER_METHODS",
    "OWNER_READS",
    "SERVICE_METHODS",
    "authorize",
    "check_job_directory",
    "check_storage_uri",
]

#: What a learner's credential may call (for its own job).
LEARNER_METHODS = frozenset(
    {
        "Join",
        "InitializeParameters",
        "Boundary",
        "SyncStep",
        "PullParameters",
        "CreateCheckpoint",
        "ReportEpochMetrics",
        "GetJobProgress",
        "GetMembership",
        "FindCoordinator",
        "OpenSharedLane",
    }
)
#: What a user may call, for the jobs it owns.
OWNER_READS = frozenset({"GetJobProgress", "GetMembership"})
#: Only services (the scheduler and the shards) and admins.
SERVICE_METHODS = frozenset(
    {
        "OpenJob",
        "CloseJob",
        "RetireLearners",
        "SetGlobalBatch",
        "EvictLearner",
        "ConfigureShard",
        "ShardReady",
        "ResolveIteration",
        "SaveShard",
        "LoadShard",
        "GetShardStatus",
        "Replicate",
        "TransferSlice",
        "TakeOverJob",
        "SetCoordinator",
    }
)


def authorize(
    principal: Principal,
    method: str,
    *,
    job_id: str,
    learner_id: str | None = None,
    owner: str | None = None,
) -> None:
    """Allow ``principal`` to call ``method`` for ``job_id`` (as ``learner_id`` when the
    request names one), or raise :class:`PermissionDenied` saying why. ``owner``: the job's
    owner when this shard knows it (its coordinator), else None."""
    if principal.role in (Role.SERVICE, Role.ADMIN):
        return
    if principal.role is Role.LEARNER:
        if method not in LEARNER_METHODS:
            raise PermissionDenied(
                f"{method} is not a data-plane call: {principal.name} may not call it"
            )
        if principal.job_id != job_id:
            raise PermissionDenied(
                f"{principal.name} holds a credential for job {principal.job_id!r}, not for "
                f"job {job_id!r}"
            )
        if learner_id is not None and learner_id != principal.learner_id:
            raise PermissionDenied(
                f"{principal.name} may not act as learner {learner_id!r} of job {job_id!r}"
            )
        return
    if principal.role is Role.USER and method in OWNER_READS:
        if owner and principal.name == owner:
            return
        raise PermissionDenied(
            f"{principal.name} may read only the jobs it owns; job {job_id!r} is not one of them"
        )
    raise PermissionDenied(
        f"{method} of job {job_id!r} needs a credential of one of the job's learners or of a "
        f"service; {principal.name} is a {principal.role.value}"
    )


def _normalized(uri: str) -> str:
    return uri.rstrip("/")


def check_storage_uri(requested: str, configured: str | None) -> str:
    """The storage URI a job may use: the shard's configured one (``--storage-uri``) when
    ``requested`` is empty or the same; anything else is refused (INVALID_ARGUMENT)."""
    if not configured:
        raise InvalidField(
            "storage_uri", requested, "cannot be used: this shard has no --storage-uri configured"
        )
    if requested and _normalized(requested) != _normalized(configured):
        raise InvalidField(
            "storage_uri",
            requested,
            f"is not the storage this shard is configured with ({configured}); leave it empty",
        )
    return _normalized(configured)


def check_job_directory(
    field_name: str, directory: str, *, storage_uri: str | None, job_id: str
) -> None:
    """``directory`` must be a checkpoint directory of ``job_id`` under ``storage_uri``:
    ``<storage>/jobs/<job_id>/checkpoints/<name>`` with a valid checkpoint name."""
    ids.check(ids.IdKind.JOB, job_id)
    if not storage_uri:
        raise InvalidField(field_name, directory, "cannot be used: no storage is configured")
    prefix = f"{_normalized(storage_uri)}/jobs/{job_id}/checkpoints/"
    name = directory[len(prefix) :].rstrip("/") if directory.startswith(prefix) else ""
    if not ids.is_valid(ids.IdKind.CHECKPOINT, name):
        raise InvalidField(field_name, directory, f"must be a checkpoint directory under {prefix}")
