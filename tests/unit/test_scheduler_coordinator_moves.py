"""The scheduler follows the coordinator moves the parameter-sync tier publishes in etcd
(shoal.contract.data_plane; shoal.scheduler.reconcile.CoordinatorMoves), here over the
in-memory store that shares the etcd store's contract tests."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from shoal.contract.data_plane import (
    CoordinatorRecord,
    coordinator_key,
    decode_coordinator,
    encode_coordinator,
    is_legacy,
)
from shoal.runtime.store import Fence, FencedOut, MemoryStore
from shoal.scheduler.reconcile import CoordinatorMoves, migrate_legacy_moves
from tests.support import async_wait_until

JOB = "job-0123456789ab"


def record(address: str, index: int, epoch: int) -> bytes:
    return encode_coordinator(CoordinatorRecord(address=address, index=index, epoch=epoch))


def legacy(address: str, index: int, epoch: int) -> bytes:
    """A record as releases before CoordinatorRecordState wrote it."""
    return json.dumps({"address": address, "index": index, "epoch": epoch}, sort_keys=True).encode()


def test_only_a_newer_epoch_moves_the_coordinator() -> None:
    seen: list[tuple[str, CoordinatorRecord]] = []
    moves = CoordinatorMoves(MemoryStore(), lambda job, rec: seen.append((job, rec)))
    moves.apply(coordinator_key(JOB), record("10.0.0.2:7300", 1, 2))
    moves.apply(coordinator_key(JOB), record("10.0.0.1:7300", 0, 1))  # older: ignored
    moves.apply(coordinator_key(JOB), record("10.0.0.1:7300", 0, 2))  # same epoch: ignored
    assert [(j, r.index, r.epoch) for j, r in seen] == [(JOB, 1, 2)]
    moves.apply(coordinator_key(JOB), record("10.0.0.3:7300", 2, 3))
    assert moves.get(JOB) == CoordinatorRecord("10.0.0.3:7300", 2, 3)
    assert len(seen) == 2


def test_a_malformed_record_or_key_is_ignored_and_changes_nothing() -> None:
    seen: list[tuple[str, CoordinatorRecord]] = []
    moves = CoordinatorMoves(MemoryStore(), lambda job, rec: seen.append((job, rec)))
    moves.apply(coordinator_key(JOB), record("10.0.0.2:7300", 1, 2))
    for bad in (b"not json", b"[]", b'{"address": "x:1", "index": -1, "epoch": 9}', b"{}"):
        moves.apply(coordinator_key(JOB), bad)
    moves.apply(moves.prefix + "../etc", record("10.0.0.9:1", 0, 99))
    assert len(seen) == 1 and moves.get(JOB) == CoordinatorRecord("10.0.0.2:7300", 1, 2)


def test_a_legacy_json_record_moves_the_coordinator_like_a_protobuf_one() -> None:
    seen: list[CoordinatorRecord] = []
    moves = CoordinatorMoves(MemoryStore(), lambda job, rec: seen.append(rec))
    moves.apply(coordinator_key(JOB), legacy("10.0.0.2:7300", 1, 2))
    moves.apply(coordinator_key(JOB), record("10.0.0.3:7300", 2, 3))
    assert seen == [
        CoordinatorRecord("10.0.0.2:7300", 1, 2),
        CoordinatorRecord("10.0.0.3:7300", 2, 3),
    ]


async def test_a_new_leader_rewrites_legacy_records_as_protobuf_and_leaves_the_rest() -> None:
    store = MemoryStore()
    old, new, bad = JOB, "job-0123456789ac", "job-0123456789ad"
    await store.put(coordinator_key(old), legacy("10.0.0.2:7300", 1, 2))
    await store.put(coordinator_key(new), record("10.0.0.3:7300", 2, 5))
    await store.put(coordinator_key(bad), b'{"address": "nohost"}')
    new_revision = (await store.get(coordinator_key(new))).mod_revision  # type: ignore[union-attr]
    try:
        assert await migrate_legacy_moves(store, None) == 1
        kv = await store.get(coordinator_key(old))
        assert kv is not None and not is_legacy(kv.value)
        assert decode_coordinator(kv.value) == CoordinatorRecord("10.0.0.2:7300", 1, 2)
        untouched = await store.get(coordinator_key(new))
        assert untouched is not None and untouched.mod_revision == new_revision
        unreadable = await store.get(coordinator_key(bad))
        assert unreadable is not None and unreadable.value == b'{"address": "nohost"}'
        assert await migrate_legacy_moves(store, None) == 0  # nothing left to rewrite
    finally:
        await store.close()


async def test_a_deposed_leader_migrates_nothing() -> None:
    store = MemoryStore()
    await store.put(coordinator_key(JOB), legacy("10.0.0.2:7300", 1, 2))
    stale = Fence(key="/shoal/v1/job-scheduler/leader", create_revision=999)
    try:
        with pytest.raises(FencedOut):
            await migrate_legacy_moves(store, stale)
        kv = await store.get(coordinator_key(JOB))
        assert kv is not None and is_legacy(kv.value)
    finally:
        await store.close()


async def test_moves_are_listed_then_watched_and_a_deleted_key_is_forgotten() -> None:
    store = MemoryStore()
    await store.put(coordinator_key(JOB), record("10.0.0.2:7300", 1, 1))
    seen: list[CoordinatorRecord] = []
    moves = CoordinatorMoves(store, lambda job, rec: seen.append(rec))
    task = asyncio.create_task(moves.run())
    try:
        await async_wait_until(lambda: len(seen) == 1, what="the listing")
        await store.put(coordinator_key(JOB), record("10.0.0.1:7300", 0, 2))
        await async_wait_until(lambda: len(seen) == 2, what="the watch")
        assert seen[-1].index == 0
        await store.delete(coordinator_key(JOB))
        await async_wait_until(lambda: moves.get(JOB) is None, what="forgotten")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()
