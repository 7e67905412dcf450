"""The warm pool refills after a take that finds its ready process dead (``WarmPool.take``): the
process died but its watcher had not removed it yet, so the take removed it, and the watcher,
finding it gone, did not wake the pool; nothing did, and the pool stayed empty (seen in CI:
``test_warm_learners``' second warm process never came). Real pool loop, a fake spawn."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

from shoal.host_agent.warm import WarmPool, WarmProcess
from tests.support import async_wait_until


def fake_pool(tmp_path) -> tuple[WarmPool, list[WarmProcess]]:
    pool = WarmPool(tmp_path, python=sys.executable, env={}, size=1)
    spawned: list[WarmProcess] = []

    async def spawn_one() -> WarmProcess:  # ready at once, and no watcher of its own
        warm = WarmProcess(
            process=SimpleNamespace(returncode=None, pid=10_000 + len(spawned)),  # type: ignore[arg-type]
            token=f"t{len(spawned)}",
            started=0.0,
        )
        spawned.append(warm)
        pool._ready.append(warm)
        return warm

    pool._spawn_one = spawn_one  # type: ignore[method-assign]
    return pool, spawned


async def test_a_process_found_dead_by_a_take_is_replaced(tmp_path) -> None:
    pool, spawned = fake_pool(tmp_path)
    pool.start()
    try:
        await async_wait_until(lambda: pool.ready() == 1, timeout=10, what="the first process")
        spawned[0].process.returncode = -9  # killed; its watcher has not run yet
        assert pool.take() is None  # found dead: the learner starts cold
        assert pool.died == 1 and pool.taken == 0
        await async_wait_until(lambda: pool.ready() == 1, timeout=10, what="a replacement")
        assert len(spawned) == 2 and pool._ready == [spawned[1]]
        assert pool.take() is spawned[1] and pool.taken == 1
        await async_wait_until(lambda: len(spawned) == 3, timeout=10, what="refilled again")
    finally:
        pool._task.cancel()  # type: ignore[union-attr]
        await asyncio.gather(pool._task, return_exceptions=True)  # type: ignore[arg-type]
