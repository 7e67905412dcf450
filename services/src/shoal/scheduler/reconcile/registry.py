"""What the parameter-sync tier publishes in etcd, mirrored by the scheduler: the shard registry
(``<prefix><index>`` = address under a lease) and the coordinators it moved
(``shoal.contract.data_plane``), each kept from an etcd watch by :func:`follow_prefix`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from shoal.contract import ids
from shoal.contract.data_plane import (
    COORDINATORS_PREFIX,
    SHARDS_PREFIX,
    CoordinatorRecord,
    InvalidCoordinatorRecord,
    decode_coordinator,
    encode_coordinator,
    is_legacy,
)
from shoal.contract.errors import StoreError
from shoal.runtime.store import Fence, Store

log = logging.getLogger(__name__)

SHARD_REGISTRY = SHARDS_PREFIX  # written by the shards (param_sync/main.py)


class ShardRegistry:
    """The shard list from the registry the shards keep in etcd (``<prefix><index>`` = address
    under a lease). The last known address of every index is kept (a shard that restarts keeps
    its place in the order); the list is usable once the indices 0..S-1 are all known."""

    def __init__(self, store: Store, prefix: str = SHARD_REGISTRY) -> None:
        self.store = store
        self.prefix = prefix
        self.addresses: dict[int, str] = {}

    def shards(self) -> tuple[str, ...]:
        count = len(self.addresses)
        if sorted(self.addresses) != list(range(count)):
            return ()
        return tuple(self.addresses[i] for i in range(count))

    def _put(self, key: str, value: bytes) -> None:
        try:
            index = int(key.removeprefix(self.prefix))
        except ValueError:
            return
        if index >= 0 and value:
            self.addresses[index] = value.decode()

    async def run(self) -> None:
        await follow_prefix(self.store, self.prefix, self._put, what="shard registry")


class CoordinatorMoves:
    """Where the parameter-sync tier moved jobs' coordinators (``shoal.contract.data_plane``:
    ``/shoal/v1/parameter-sync/coordinators/<job_id>`` = address, index, epoch), kept from an
    etcd watch. Only a record with a higher epoch than the one known replaces it; each such
    move is reported to ``on_move``. A job without a record keeps the hash rule
    (:func:`coordinator_index`)."""

    def __init__(
        self,
        store: Store,
        on_move: Callable[[str, CoordinatorRecord], None],
        prefix: str = COORDINATORS_PREFIX,
    ) -> None:
        self.store = store
        self.on_move = on_move
        self.prefix = prefix
        self.records: dict[str, CoordinatorRecord] = {}

    def get(self, job_id: str) -> CoordinatorRecord | None:
        return self.records.get(job_id)

    def apply(self, key: str, value: bytes) -> None:
        """One stored value (a listing or a watch event)."""
        job_id = key.removeprefix(self.prefix)
        if not ids.is_valid(ids.IdKind.JOB, job_id):
            log.warning("coordinator record %r: the key does not end in a job id", key)
            return
        try:
            record = decode_coordinator(value)
        except InvalidCoordinatorRecord as exc:
            log.warning("coordinator record of %s ignored: %s", job_id, exc)
            return
        known = self.records.get(job_id)
        if known is not None and record.epoch <= known.epoch:
            return  # an older (or the same) move: the newest one wins
        self.records[job_id] = record
        self.on_move(job_id, record)

    async def run(self) -> None:
        await follow_prefix(
            self.store,
            self.prefix,
            self.apply,
            lambda key: self.records.pop(key.removeprefix(self.prefix), None),
            what="coordinator records",
        )


async def migrate_legacy_moves(
    store: Store, fence: Fence | None, prefix: str = COORDINATORS_PREFIX
) -> int:
    """Rewrite the coordinator records still in the JSON encoding of earlier releases as
    ``CoordinatorRecordState`` (the scheduler's leader does it once a term: fenced, and
    compare-and-set on the revision read, so a move published meanwhile is never overwritten).
    A record that is not readable is left as it is (readers ignore it); one not rewritten now
    stays readable and the next leader tries again. Returns how many were rewritten."""
    kvs, _ = await store.list(prefix)
    legacy = [kv for kv in kvs if is_legacy(kv.value)]
    migrated = 0
    for kv in legacy:
        try:
            record = decode_coordinator(kv.value)
        except InvalidCoordinatorRecord as exc:
            log.warning("coordinator record %s not migrated: %s", kv.key, exc)
            continue
        if await store.compare_and_set(
            kv.key, encode_coordinator(record), kv.mod_revision, fence=fence
        ):
            migrated += 1
    if legacy:
        log.info("migrated %d of %d coordinator records to protobuf", migrated, len(legacy))
    return migrated


async def follow_prefix(
    store: Store,
    prefix: str,
    put: Callable[[str, bytes], object],
    delete: Callable[[str], object] | None = None,
    *,
    what: str,
) -> None:
    """Mirror the keys under ``prefix`` forever: ``put(key, value)`` for each key listed and
    each one written later (a watch from the listing's revision; a resync lists again),
    ``delete(key)`` for each one deleted. An unreachable store is logged and retried every
    second."""
    while True:
        try:
            kvs, revision = await store.list(prefix)
            for kv in kvs:
                put(kv.key, kv.value)
            async with contextlib.aclosing(store.watch(prefix, revision + 1)) as events:
                async for event in events:
                    if event.kind == "put":
                        put(event.key, event.value)
                    elif event.kind == "delete" and delete is not None:
                        delete(event.key)
                    elif event.kind == "resync":
                        for kv in event.kvs:
                            put(kv.key, kv.value)
        except StoreError as exc:
            log.info("%s: %s", what, exc)
        await asyncio.sleep(1.0)
