"""The names of the environment variables the job scheduler and host agent give a learner and
the learner reads (``shoal.learner.env`` documents each one's meaning and default).

One constant per variable, so that the side that writes a variable
(``shoal.scheduler.reconcile.rules.learner_env``) and the side that reads it
(``shoal.learner.env``) cannot drift apart. This module imports nothing beyond the standard
library.
"""

from __future__ import annotations

__all__ = [
    "BATCH_RULE",
    "BATCH_SIZE",
    "BOUNDARY_AHEAD",
    "COLLECTIVE_AHEAD",
    "COLLECTIVE_OVERLAP",
    "COLLECTIVE_TIMEOUT_S",
    "COORDINATOR",
    "DATASET_URIS",
    "EPOCHS",
    "GENERATION",
    "INLINE_KB",
    "JOB_ID",
    "LANE_CONTROL",
    "LEARNER_ID",
    "LEARNER_VARIABLES",
    "LOG_LEVEL",
    "MAX_BATCH_PER_DEVICE",
    "PREFIX",
    "PS_EARLY_FORWARD",
    "PS_OVERLAP",
    "SEED",
    "STORAGE_URI",
    "SYNC_BACKEND",
    "SYNC_ENDPOINTS",
    "TLS_CA",
    "TLS_CERT",
    "TLS_KEY",
    "TOKEN",
    "TRACE_EVERY",
    "TRAIN_MARKER",
]

#: Every shoal variable starts with it (a job's own ``env`` may not set such a variable).
PREFIX = "SHOAL_"

JOB_ID = "SHOAL_JOB_ID"
LEARNER_ID = "SHOAL_LEARNER_ID"
GENERATION = "SHOAL_GENERATION"
SYNC_ENDPOINTS = "SHOAL_SYNC_ENDPOINTS"
COORDINATOR = "SHOAL_COORDINATOR"
SYNC_BACKEND = "SHOAL_SYNC_BACKEND"
MAX_BATCH_PER_DEVICE = "SHOAL_MAX_BATCH_PER_DEVICE"
TRAIN_MARKER = "SHOAL_TRAIN_MARKER"
STORAGE_URI = "SHOAL_STORAGE_URI"
TOKEN = "SHOAL_TOKEN"
TLS_CA = "SHOAL_TLS_CA"
TLS_CERT = "SHOAL_TLS_CERT"
TLS_KEY = "SHOAL_TLS_KEY"
TRACE_EVERY = "SHOAL_TRACE_EVERY"
COLLECTIVE_TIMEOUT_S = "SHOAL_COLLECTIVE_TIMEOUT_S"
#: ``on`` (default) or ``off``: a collective-mode learner sends its gradient buckets while
#: backward runs (read by ``shoal.learner.collective`` itself, like the shared-memory lane's
#: ``SHOAL_SHM_LANE``; not part of what the scheduler writes).
COLLECTIVE_OVERLAP = "SHOAL_COLLECTIVE_OVERLAP"
#: ``on`` (default) or ``off``: a collective-mode learner applies its update once its vote
#: is sent and runs the next iteration's forward and backward while the answer travels,
#: taking the update back if the answer does not commit it (read by
#: ``shoal.learner.collective`` itself; not part of what the scheduler writes).
COLLECTIVE_AHEAD = "SHOAL_COLLECTIVE_AHEAD"
#: ``on`` (default) or ``off``: a parameter-server learner streams its gradients to the shards
#: while backward runs (read by ``shoal.learner.ps_overlap`` itself, like
#: ``SHOAL_COLLECTIVE_OVERLAP``; not part of what the scheduler writes).
PS_OVERLAP = "SHOAL_PS_OVERLAP"
#: ``on`` or ``off`` (default): a parameter-server learner starts the next iteration's forward
#: once every shard's answer header arrived, on the parameters already received (read by
#: ``shoal.learner.early_forward`` itself; not part of what the scheduler writes).
PS_EARLY_FORWARD = "SHOAL_PS_EARLY_FORWARD"
#: KiB, 0..4096 (default 256; 0: off): a parameter-server learner sends a gradient bundle of
#: at most this size to a shard as one message (the bytes in the header) and reads answers sent
#: so (read by ``shoal.learner.grpc_calls`` itself; not part of what the scheduler writes).
INLINE_KB = "SHOAL_INLINE_KB"
#: ``on`` (default) or ``off``: a parameter-server learner sends its next Boundary beside the
#: SyncStep instead of after it, and the coordinator holds it until the iteration is committed
#: (read by ``shoal.learner.grpc_backend`` itself; not part of what the scheduler writes).
BOUNDARY_AHEAD = "SHOAL_BOUNDARY_AHEAD"
#: ``on`` (default) or ``off``: a learner with a same-host lane sends its SyncStep headers on
#: the lane's control connection instead of gRPC, and a collective-mode learner on its
#: coordinator's host its Boundaries (read by ``shoal.learner.grpc_lane`` itself; not part of
#: what the scheduler writes).
LANE_CONTROL = "SHOAL_LANE_CONTROL"
EPOCHS = "SHOAL_EPOCHS"
BATCH_SIZE = "SHOAL_BATCH_SIZE"
#: Set only for a job with an adaptive batch: how the learning rate follows the batch.
BATCH_RULE = "SHOAL_BATCH_RULE"
SEED = "SHOAL_SEED"
DATASET_URIS = "SHOAL_DATASET_URIS"
#: Read by every shoal process (services, learners, the dashboard): the logging level.
LOG_LEVEL = "SHOAL_LOG_LEVEL"

#: The variables of a learner's contract (what ``shoal.learner.env`` reads).
LEARNER_VARIABLES = frozenset(
    {
        JOB_ID,
        LEARNER_ID,
        GENERATION,
        SYNC_ENDPOINTS,
        COORDINATOR,
        SYNC_BACKEND,
        MAX_BATCH_PER_DEVICE,
        TRAIN_MARKER,
        STORAGE_URI,
        TOKEN,
        TLS_CA,
        TLS_CERT,
        TLS_KEY,
        TRACE_EVERY,
        COLLECTIVE_TIMEOUT_S,
        EPOCHS,
        BATCH_SIZE,
        BATCH_RULE,
        SEED,
        DATASET_URIS,
    }
)
