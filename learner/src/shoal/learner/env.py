"""The learner's environment contract: every variable a learner process reads, in one place.

The host-agent sets these when it starts a learner on the cluster; a standalone run
(``python train.py``) sets none of them and gets the defaults below, which select the
``local`` backend (one process, no cluster). One function per variable, each with its default;
each takes an optional ``environ`` mapping (``os.environ`` when omitted) so tests need not
patch the process environment. A malformed value raises ``ValueError`` naming the variable.

:class:`LearnerEnv` reads them all at once; it is what backend factories receive.

=========================== ======================= =============================================
Variable                    Default                 Meaning
=========================== ======================= =============================================
SHOAL_JOB_ID                unset (standalone)      The job this learner belongs to.
SHOAL_LEARNER_ID            unset                   This learner's id, unique within the job.
SHOAL_GENERATION            0                       Membership generation the learner was
                                                    started for (the coordinator may admit it
                                                    to a later one).
SHOAL_SYNC_ENDPOINTS        empty                   Comma-separated ``host:port`` of the job's
                                                    parameter-sync shards, in shard order.
SHOAL_COORDINATOR           first sync endpoint     ``host:port`` of the shard coordinating
                                                    the job.
SHOAL_SYNC_BACKEND          ``local`` without a     Name of the sync backend in the registry
                            job id, else            (``backend.get_backend``).
                            ``parameter_server``
SHOAL_MAX_BATCH_PER_DEVICE  unset (no limit)        Most samples one forward/backward pass
                                                    holds; larger shares are accumulated in
                                                    micro-batches.
SHOAL_STORAGE_URI           unset (no storage)      fsspec URI for checkpoints, metrics and
                                                    the final model.
SHOAL_TOKEN                 unset                   This learner's credential for the shoal
                                                    services: minted by the scheduler for this
                                                    job and learner only (never a service token).
SHOAL_TLS_CA                unset (plaintext)       CA of the cluster's certificates: with it the
                                                    learner talks TLS to the parameter-sync shards.
SHOAL_TLS_CERT              unset                   Client certificate and key the host agent
SHOAL_TLS_KEY               unset                   gives its learners (mutual TLS).
TRACEPARENT                 unset                   W3C trace context of the span that started
                                                    this learner (OpenTelemetry).
SHOAL_TRACE_EVERY           100                     Iterations traced: the learner's first, then
                                                    every N-th global iteration (0: only the
                                                    first). See ``shoal.learner.tracing``.
OTEL_EXPORTER_OTLP_ENDPOINT unset (no tracing)      OTLP/gRPC collector for the learner's spans.
SHOAL_EPOCHS                unset                   Job settings; when set they win over the
SHOAL_BATCH_SIZE            unset                   script's arguments (on the cluster the job,
SHOAL_SEED                  unset                   not the script, decides them).
SHOAL_BATCH_RULE            unset (fixed batch)     ``linear``, ``sqrt`` or ``adascale``: the job
                                                    opted in to the adaptive batch; the learning
                                                    rate is scaled by this rule from
                                                    SHOAL_BATCH_SIZE to the batch the
                                                    coordinator assigns.
SHOAL_DATASET_URIS          empty                   Comma-separated dataset URIs of the job
                                                    (``shoal submit --dataset``): ``file://``,
                                                    ``s3://``, ``gs://``... read through fsspec
                                                    (``shoal.learner.data``); handed to
                                                    ``get_datasets`` when it takes an argument.
SHOAL_COLLECTIVE_OVERLAP    ``on``                  Collective mode: gradient buckets are sent
                                                    while backward runs (``off``: after it).
                                                    Read by ``shoal.learner.collective``.
SHOAL_COLLECTIVE_AHEAD      ``on``                  Collective mode: the update is applied once
                                                    the vote is sent, and the next iteration's
                                                    forward and backward run while the answer
                                                    travels; an update the answer does not
                                                    commit is taken back (``off``: applied
                                                    once the answer came). Read by
                                                    ``shoal.learner.collective``.
SHOAL_PS_OVERLAP            ``on``                  Parameter-server mode: gradients stream to
                                                    the shards while backward runs (``off``:
                                                    after it). Read by
                                                    ``shoal.learner.ps_overlap``.
SHOAL_INLINE_KB             ``256``                 Parameter-server mode: a gradient bundle of
                                                    at most this many KiB goes to its shard as
                                                    one message (the bytes in the header), and
                                                    answers may come so; 0..4096, 0: chunks
                                                    only. Read by ``shoal.learner.grpc_calls``.
SHOAL_BOUNDARY_AHEAD        ``on``                  Parameter-server mode: the next Boundary
                                                    goes beside the SyncStep, held by the
                                                    coordinator until the iteration commits
                                                    (``off``: sent after the SyncStep). Read
                                                    by ``shoal.learner.grpc_backend``.
SHOAL_PS_EARLY_FORWARD      ``off``                 Parameter-server mode: the next forward
                                                    starts once every shard's answer header
                                                    arrived, loading each module's parameters
                                                    as they complete (``on``). Read by
                                                    ``shoal.learner.early_forward``.
SHOAL_TRAIN_MARKER          unset                   File the learner touches when the script
                                                    calls ``Trainer.train()``; the host agent
                                                    fails a learner that exits 0 without it.
=========================== ======================= =============================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shoal.contract import environment

__all__ = [
    "CLUSTER_DEFAULT_BACKEND",
    "DEFAULT_TRACE_EVERY",
    "LOCAL_BACKEND",
    "LearnerEnv",
    "batch_size",
    "coordinator",
    "dataset_uris",
    "epochs",
    "generation",
    "job_id",
    "learner_id",
    "max_batch_per_device",
    "otlp_endpoint",
    "seed",
    "storage_uri",
    "switch",
    "sync_backend",
    "sync_endpoints",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "token",
    "trace_every",
    "traceparent",
]

#: Backend used when no job id is set (standalone).
LOCAL_BACKEND = "local"
#: Backend used by default on the cluster (a job id is set).
CLUSTER_DEFAULT_BACKEND = "parameter_server"
#: Default of SHOAL_TRACE_EVERY.
DEFAULT_TRACE_EVERY = 100


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _str(name: str, environ: Mapping[str, str] | None) -> str | None:
    value = _env(environ).get(name, "").strip()
    return value or None


def switch(name: str, default: str, environ: Mapping[str, str] | None = None) -> bool:
    """An ``on``/``off`` variable (``default`` when unset): whether it is ``on``. Anything
    else is a ValueError naming the variable and the value."""
    raw = _env(environ).get(name, default).strip().lower()
    if raw not in ("on", "off"):
        raise ValueError(f"{name} ({raw!r}) must be 'on' or 'off'")
    return raw == "on"


def _int(name: str, environ: Mapping[str, str] | None, minimum: int) -> int | None:
    raw = _str(name, environ)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} ({raw!r}) must be an integer") from None
    if value < minimum:
        raise ValueError(f"{name} ({value}) must be >= {minimum}")
    return value


def _endpoint(name: str, value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} ({value!r}) must be host:port")
    return value


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_JOB_ID: the job this learner belongs to; ``None`` when running standalone."""
    return _str(environment.JOB_ID, environ)


def learner_id(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_LEARNER_ID: this learner's id within the job; ``None`` when unset."""
    return _str(environment.LEARNER_ID, environ)


def generation(environ: Mapping[str, str] | None = None) -> int:
    """SHOAL_GENERATION: the membership generation the learner was started for (default 0)."""
    value = _int(environment.GENERATION, environ, 0)
    return 0 if value is None else value


def sync_endpoints(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """SHOAL_SYNC_ENDPOINTS: ``host:port`` of each parameter-sync shard, comma-separated, in
    shard order (default: none)."""
    raw = _str(environment.SYNC_ENDPOINTS, environ)
    if raw is None:
        return ()
    parts = [p.strip() for p in raw.split(",")]
    if any(not p for p in parts):
        raise ValueError(f"SHOAL_SYNC_ENDPOINTS ({raw!r}) has an empty entry")
    return tuple(_endpoint(environment.SYNC_ENDPOINTS, p) for p in parts)


def coordinator(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_COORDINATOR: ``host:port`` of the coordinating shard (default: the first sync
    endpoint, ``None`` when there is none)."""
    raw = _str(environment.COORDINATOR, environ)
    if raw is not None:
        return _endpoint(environment.COORDINATOR, raw)
    endpoints = sync_endpoints(environ)
    return endpoints[0] if endpoints else None


def sync_backend(environ: Mapping[str, str] | None = None) -> str:
    """SHOAL_SYNC_BACKEND: registry name of the sync backend (default ``local`` without a job
    id, ``parameter_server`` with one)."""
    raw = _str(environment.SYNC_BACKEND, environ)
    if raw is not None:
        return raw
    return LOCAL_BACKEND if job_id(environ) is None else CLUSTER_DEFAULT_BACKEND


def max_batch_per_device(environ: Mapping[str, str] | None = None) -> int | None:
    """SHOAL_MAX_BATCH_PER_DEVICE: most samples per forward/backward pass (default: no limit)."""
    return _int(environment.MAX_BATCH_PER_DEVICE, environ, 1)


def train_marker(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_TRAIN_MARKER: the file touched when the script calls ``Trainer.train()`` (set by
    the host agent; unset standalone)."""
    return _str(environment.TRAIN_MARKER, environ)


def storage_uri(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_STORAGE_URI: fsspec URI for checkpoints, metrics and the final model (default:
    none, so a standalone run writes nothing)."""
    return _str(environment.STORAGE_URI, environ)


def token(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_TOKEN: bearer token presented to the shoal services (default: none)."""
    return _str(environment.TOKEN, environ)


def tls_ca(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_TLS_CA: the cluster CA (PEM file); set: talk TLS to the shards (default: none)."""
    return _str(environment.TLS_CA, environ)


def tls_cert(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_TLS_CERT: this learner's client certificate (PEM file), for mutual TLS."""
    return _str(environment.TLS_CERT, environ)


def tls_key(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_TLS_KEY: the key of SHOAL_TLS_CERT (PEM file)."""
    return _str(environment.TLS_KEY, environ)


def traceparent(environ: Mapping[str, str] | None = None) -> str | None:
    """TRACEPARENT: W3C trace context of the span that started this learner (default: none)."""
    return _str("TRACEPARENT", environ)


def trace_every(environ: Mapping[str, str] | None = None) -> int:
    """SHOAL_TRACE_EVERY: trace the learner's first iteration and every N-th global iteration
    (default 100; 0 traces only the first)."""
    value = _int(environment.TRACE_EVERY, environ, 0)
    return DEFAULT_TRACE_EVERY if value is None else value


def otlp_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """OTEL_EXPORTER_OTLP_ENDPOINT: where the learner sends its spans (default: nowhere, and
    no span is made)."""
    return _str("OTEL_EXPORTER_OTLP_ENDPOINT", environ)


def epochs(environ: Mapping[str, str] | None = None) -> int | None:
    """SHOAL_EPOCHS: the job's number of epochs; overrides the script's (default: unset)."""
    return _int(environment.EPOCHS, environ, 1)


def batch_size(environ: Mapping[str, str] | None = None) -> int | None:
    """SHOAL_BATCH_SIZE: the job's global batch size B; overrides the script's (default:
    unset)."""
    return _int(environment.BATCH_SIZE, environ, 1)


def batch_rule(environ: Mapping[str, str] | None = None) -> str | None:
    """SHOAL_BATCH_RULE: ``linear``, ``sqrt`` or ``adascale`` when the job has an adaptive
    batch (default: unset, the batch is fixed)."""
    value = _str(environment.BATCH_RULE, environ)
    if value is not None and value not in ("linear", "sqrt", "adascale"):
        raise ValueError(
            f"{environment.BATCH_RULE} ({value!r}) must be 'linear', 'sqrt' or 'adascale'"
        )
    return value


def seed(environ: Mapping[str, str] | None = None) -> int | None:
    """SHOAL_SEED: the job's data-order seed; overrides the script's (default: unset)."""
    return _int(environment.SEED, environ, 0)


def dataset_uris(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """SHOAL_DATASET_URIS: the job's dataset URIs, comma-separated (default: none). Each must
    name a scheme (``s3://bucket/key``) or be an absolute path."""
    raw = _str(environment.DATASET_URIS, environ)
    if raw is None:
        return ()
    uris = tuple(u.strip() for u in raw.split(","))
    for uri in uris:
        if not uri or (not uri.startswith("/") and "://" not in uri):
            raise ValueError(
                f"SHOAL_DATASET_URIS ({raw!r}) holds {uri!r}: each URI must name a scheme "
                "(s3://bucket/key, file:///path) or be an absolute path"
            )
    return uris


@dataclass(frozen=True)
class LearnerEnv:
    """All of the contract read at once (see the module docstring for each field)."""

    job_id: str | None = None
    learner_id: str | None = None
    generation: int = 0
    sync_endpoints: tuple[str, ...] = ()
    coordinator: str | None = None
    sync_backend: str = LOCAL_BACKEND
    max_batch_per_device: int | None = None
    storage_uri: str | None = None
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    traceparent: str | None = None
    trace_every: int = DEFAULT_TRACE_EVERY
    otlp_endpoint: str | None = None
    epochs: int | None = None
    batch_size: int | None = None
    seed: int | None = None
    dataset_uris: tuple[str, ...] = ()
    batch_rule: str | None = None

    @property
    def standalone(self) -> bool:
        """True when no job id is set: a plain ``python train.py`` run."""
        return self.job_id is None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LearnerEnv:
        """Read every variable of the contract (``os.environ`` when ``environ`` is None)."""
        return cls(
            job_id=job_id(environ),
            learner_id=learner_id(environ),
            generation=generation(environ),
            sync_endpoints=sync_endpoints(environ),
            coordinator=coordinator(environ),
            sync_backend=sync_backend(environ),
            max_batch_per_device=max_batch_per_device(environ),
            storage_uri=storage_uri(environ),
            token=token(environ),
            tls_ca=tls_ca(environ),
            tls_cert=tls_cert(environ),
            tls_key=tls_key(environ),
            traceparent=traceparent(environ),
            trace_every=trace_every(environ),
            otlp_endpoint=otlp_endpoint(environ),
            epochs=epochs(environ),
            batch_size=batch_size(environ),
            seed=seed(environ),
            dataset_uris=dataset_uris(environ),
            batch_rule=batch_rule(environ),
        )
