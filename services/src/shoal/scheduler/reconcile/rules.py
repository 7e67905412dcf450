"""Pure rules the loop's workers apply: the coordinator shard of a job, the sync mode in effect, a
learner's environment contract. No I/O."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from shoal.contract import environment
from shoal.runtime import telemetry
from shoal.scheduler.jobs import (
    JobRecord,
)
from shoal.v1 import (
    job_pb2,
)

# Learner environment: the backend names of the learner's registry.
SYNC_BACKENDS = {
    job_pb2.SYNC_MODE_PARAMETER_SERVER: "parameter_server",
    job_pb2.SYNC_MODE_COLLECTIVE: "collective",
}

#: SHOAL_BATCH_RULE's value for each JobSpec.adaptive_batch.rule.
BATCH_RULES = {
    job_pb2.BATCH_SCALING_RULE_LINEAR: "linear",
    job_pb2.BATCH_SCALING_RULE_SQRT: "sqrt",
    job_pb2.BATCH_SCALING_RULE_ADASCALE: "adascale",
}


def coordinator_index(job_id: str, shards: int) -> int:
    """The job's coordinator shard: a stable hash of the job id modulo the shard count."""
    digest = hashlib.sha256(job_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % shards


def resolve_sync_mode(requested: int, devices: Sequence[tuple[str, bool]]) -> int:
    """The sync mode in effect. AUTO (or unset): COLLECTIVE when every placed device is a real
    GPU on one host, else PARAMETER_SERVER. ``devices``: (host id, simulated) per learner."""
    if requested in (job_pb2.SYNC_MODE_PARAMETER_SERVER, job_pb2.SYNC_MODE_COLLECTIVE):
        return requested
    hosts = {host for host, _ in devices}
    if devices and len(hosts) == 1 and not any(sim for _, sim in devices):
        return job_pb2.SYNC_MODE_COLLECTIVE
    return job_pb2.SYNC_MODE_PARAMETER_SERVER


def learner_env(
    record: JobRecord,
    learner_id: str,
    *,
    shards: Sequence[str],
    storage_uri: str,
    token: str | None,
    trace_every: int | None = None,
    collective_timeout_s: float | None = None,
) -> dict[str, str]:
    """The environment contract of one learner (see docs/scheduler.md and
    ``shoal.learner.env``); the job's own ``env`` first, so the contract wins."""
    spec = record.job.spec
    env = dict(spec.env)
    env.update(
        {
            environment.JOB_ID: record.job_id,
            environment.LEARNER_ID: learner_id,
            environment.SYNC_ENDPOINTS: ",".join(shards),
            environment.COORDINATOR: record.coordinator_address,
            environment.STORAGE_URI: storage_uri,
            environment.BATCH_SIZE: str(spec.batch_size),
            environment.EPOCHS: str(spec.epochs),
            environment.SEED: str(spec.seed),
            environment.SYNC_BACKEND: SYNC_BACKENDS.get(
                record.job.effective_sync_mode, SYNC_BACKENDS[job_pb2.SYNC_MODE_PARAMETER_SERVER]
            ),
        }
    )
    if spec.max_batch_per_device > 0:
        env[environment.MAX_BATCH_PER_DEVICE] = str(spec.max_batch_per_device)
    if spec.HasField("adaptive_batch"):
        env[environment.BATCH_RULE] = BATCH_RULES.get(spec.adaptive_batch.rule, "linear")
    if spec.dataset_uris:
        env[environment.DATASET_URIS] = ",".join(spec.dataset_uris)
    if token:
        env[environment.TOKEN] = token
    if trace_every is not None:
        env[environment.TRACE_EVERY] = str(trace_every)
    if collective_timeout_s is not None:
        env[environment.COLLECTIVE_TIMEOUT_S] = f"{collective_timeout_s:g}"
    telemetry.inject_env(env)
    return env
