"""The etcd key schema: every prefix under which a shoal process keeps state, in one place.

Everything lives under ``/shoal/v1/``::

    /shoal/v1/election/<name>/...                          leader elections (shoal.runtime.election)
    /shoal/v1/auth/tokens/<sha256>                         users' tokens (shoal.v1.TokenRecord)
    /shoal/v1/auth/learner-keys/<key id>                   learner-credential public keys
    /shoal/v1/job-scheduler/jobs/<job_id>                  jobs
    /shoal/v1/job-scheduler/requests/<sha256>              idempotent SubmitJob requests
    /shoal/v1/job-scheduler/allocations/...                allocation history
    /shoal/v1/resource-manager/hosts/<host_id>             hosts (shoal.v1.Host)
    /shoal/v1/resource-manager/allocations/<host>/<device> allocations (shoal.v1.Allocation)
    /shoal/v1/resource-manager/requests/<quoted id>        idempotent AcquireDevices requests
    /shoal/v1/parameter-sync/shards/<index>                each shard's address, leased
    /shoal/v1/parameter-sync/coordinators/<job_id>         a job's moved coordinator (JSON)

The value formats are the owners' (see each module named above and ``shoal.contract.data_plane``).
This module imports nothing beyond the standard library.
"""

from __future__ import annotations

__all__ = [
    "AUTH_PREFIX",
    "COORDINATORS_PREFIX",
    "ELECTION_PREFIX",
    "LEARNER_KEYS_PREFIX",
    "PARAMETER_SYNC_PREFIX",
    "RESOURCE_MANAGER_ALLOCATIONS",
    "RESOURCE_MANAGER_HOSTS",
    "RESOURCE_MANAGER_PREFIX",
    "RESOURCE_MANAGER_REQUESTS",
    "ROOT",
    "SCHEDULER_ALLOCATIONS",
    "SCHEDULER_JOBS",
    "SCHEDULER_PREFIX",
    "SCHEDULER_REQUESTS",
    "SCHEDULER_THROUGHPUT",
    "SHARDS_PREFIX",
    "TOKENS_PREFIX",
    "election_prefix",
    "shard_key",
]

ROOT = "/shoal/v1/"

#: Leader elections: ``<prefix><name>/`` (``job-scheduler``, ``resource-manager``).
ELECTION_PREFIX = ROOT + "election/"

AUTH_PREFIX = ROOT + "auth/"
#: Users' and services' tokens, by sha256 digest (a ``shoal.v1.TokenRecord``).
TOKENS_PREFIX = AUTH_PREFIX + "tokens/"
#: The public keys learner credentials are verified with (a ``shoal.v1.LearnerSigningKey``).
LEARNER_KEYS_PREFIX = AUTH_PREFIX + "learner-keys/"

SCHEDULER_PREFIX = ROOT + "job-scheduler/"
SCHEDULER_JOBS = SCHEDULER_PREFIX + "jobs/"
SCHEDULER_REQUESTS = SCHEDULER_PREFIX + "requests/"
SCHEDULER_ALLOCATIONS = SCHEDULER_PREFIX + "allocations/"
SCHEDULER_THROUGHPUT = SCHEDULER_PREFIX + "throughput/"  # learned throughput models, per job

RESOURCE_MANAGER_PREFIX = ROOT + "resource-manager/"
RESOURCE_MANAGER_HOSTS = RESOURCE_MANAGER_PREFIX + "hosts/"
RESOURCE_MANAGER_ALLOCATIONS = RESOURCE_MANAGER_PREFIX + "allocations/"
RESOURCE_MANAGER_REQUESTS = RESOURCE_MANAGER_PREFIX + "requests/"

PARAMETER_SYNC_PREFIX = ROOT + "parameter-sync/"
#: Each shard's registration: ``<prefix><index>`` = its address (UTF-8 ``host:port``), leased.
SHARDS_PREFIX = PARAMETER_SYNC_PREFIX + "shards/"
#: A job's coordinator when it is not the hash rule's: ``<prefix><job_id>`` = JSON record.
COORDINATORS_PREFIX = PARAMETER_SYNC_PREFIX + "coordinators/"


def election_prefix(name: str) -> str:
    """The keys of one election (its candidates' leased keys)."""
    return f"{ELECTION_PREFIX}{name}/"


def shard_key(shard_index: int) -> str:
    """The registration key of parameter-sync shard ``shard_index``."""
    return f"{SHARDS_PREFIX}{shard_index}"
