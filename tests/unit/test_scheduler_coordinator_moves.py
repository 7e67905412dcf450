"""The scheduler follows the coordinator moves the parameter-sync tier publishes in etcd
(shoal.contract.data_plane; shoal.scheduler.reconcile.CoordinatorMoves), here over the
in-memory store that shares the etcd store's contract tests."""

from __future__ import annotations

import asyncio
import contextlib

from shoal.contract.data_plane import CoordinatorRecord, coordinator_key, encode_coordinator
from shoal.runtime.store import MemoryStore
from shoal.scheduler.reconcile import CoordinatorMoves
from tests.support import async_wait_until

JOB = "job-0123456789ab"


def record(address: str, index: int, epoch: int) -> bytes:
    return encode_coordinator(CoordinatorRecord(address=address, index=index, epoch=epoch))


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
