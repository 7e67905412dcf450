"""The data plane's etcd contract: where a job's coordinator is published when it moves.

A job's coordinator is, by default, the shard the scheduler's hash rule picks
(``shoal.scheduler.reconcile.coordinator_index``). When the role moves to another shard (the
coordinator's shard was lost and a successor took over: the scheduler's leader calls
``TakeOverJob`` on it, then writes this key, fenced by its leadership), the record is a
``shoal.v1.CoordinatorRecordState`` (``address`` host:port, ``index`` I, ``epoch`` E) under::

    /shoal/v1/parameter-sync/coordinators/<job_id>

``epoch`` increases by at least one on each move; a reader keeps the entry with the highest
epoch it has seen and ignores older ones. The scheduler reads (and watches) the key and falls
back to its hash rule when the key is absent, and deletes it when the job ends (COMPLETED,
FAILED, CANCELLED). Records written before ``CoordinatorRecordState`` are a UTF-8 JSON object
(``{"address": ..., "index": ..., "epoch": ...}``): :func:`decode_coordinator` still reads them
(:func:`is_legacy` tells them apart) and a new scheduler leader rewrites them in protobuf
(``shoal.scheduler.reconcile.registry.migrate_legacy_moves``). :func:`decode_coordinator`
rejects anything else with an error naming the field and the value.

This module imports neither grpc nor torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from shoal.contract import ids, stored
from shoal.contract.keys import COORDINATORS_PREFIX, SHARDS_PREFIX  # the key schema
from shoal.v1 import job_pb2

__all__ = [
    "COORDINATORS_PREFIX",
    "SHARDS_PREFIX",
    "CoordinatorRecord",
    "InvalidCoordinatorRecord",
    "coordinator_key",
    "decode_coordinator",
    "encode_coordinator",
    "is_legacy",
]


class InvalidCoordinatorRecord(ValueError):
    """A stored value that is not a coordinator record the contract describes."""


@dataclass(frozen=True, slots=True)
class CoordinatorRecord:
    """Where a job's coordinator lives now."""

    address: str
    index: int
    epoch: int

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address or ":" not in self.address:
            raise InvalidCoordinatorRecord(f"address ({self.address!r}) must be 'host:port'")
        for name in ("index", "epoch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidCoordinatorRecord(f"{name} ({value!r}) must be an integer >= 0")


def coordinator_key(job_id: str) -> str:
    """The etcd key of ``job_id``'s coordinator record (the job id is checked)."""
    ids.check(ids.IdKind.JOB, job_id)
    return COORDINATORS_PREFIX + job_id


def encode_coordinator(record: CoordinatorRecord) -> bytes:
    """The record as the ``CoordinatorRecordState`` stored under :func:`coordinator_key`."""
    return job_pb2.CoordinatorRecordState(
        address=record.address, index=record.index, epoch=record.epoch
    ).SerializeToString()


def is_legacy(value: bytes) -> bool:
    """Whether ``value`` is a record in the JSON encoding used before
    ``CoordinatorRecordState`` (``shoal.contract.stored``)."""
    return stored.is_legacy_json(value)


def decode_coordinator(value: bytes | str) -> CoordinatorRecord:
    """Parse a stored value, a ``CoordinatorRecordState`` or a legacy JSON object;
    :class:`InvalidCoordinatorRecord` names what is wrong."""
    if isinstance(value, str) or is_legacy(value):
        return _decode_json(value)
    state = stored.parse(
        job_pb2.CoordinatorRecordState, value, "coordinator record", InvalidCoordinatorRecord
    )
    return CoordinatorRecord(address=state.address, index=state.index, epoch=state.epoch)


def _decode_json(value: bytes | str) -> CoordinatorRecord:
    """A record in the JSON encoding written before ``CoordinatorRecordState``."""
    try:
        data = json.loads(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidCoordinatorRecord(f"coordinator record ({value!r:.80}) is not JSON") from exc
    if not isinstance(data, dict):
        raise InvalidCoordinatorRecord(f"coordinator record ({data!r:.80}) is not an object")
    missing = [k for k in ("address", "index", "epoch") if k not in data]
    if missing:
        raise InvalidCoordinatorRecord(f"coordinator record lacks {', '.join(missing)}")
    return CoordinatorRecord(address=data["address"], index=data["index"], epoch=data["epoch"])
