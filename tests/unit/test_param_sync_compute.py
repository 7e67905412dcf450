"""The shard's compute calls (ParameterSyncServicer._compute / _compute_small): one at a
time and in submission order; a small slice's work runs on the event loop only while the
compute thread is idle, a large slice's never."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from shoal.param_sync.service import INLINE_BYTES, ParameterSyncServicer, ShardOptions


def test_small_work_runs_inline_only_when_the_compute_thread_is_idle() -> None:
    async def main() -> None:
        servicer = ParameterSyncServicer(ShardOptions(shard_index=0, storage_uri="file:///tmp"))
        small = SimpleNamespace(total_bytes=INLINE_BYTES)
        large = SimpleNamespace(total_bytes=INLINE_BYTES + 1)
        loop_thread = threading.get_ident()
        order: list[str] = []
        release = threading.Event()

        def record(name: str) -> int:
            order.append(name)
            return threading.get_ident()

        def blocked() -> int:
            release.wait(30)
            return record("blocked")

        try:
            assert await servicer._compute_small(small, record, "idle") == loop_thread
            assert await servicer._compute_small(large, record, "large") != loop_thread
            busy = asyncio.ensure_future(servicer._compute(blocked))
            await asyncio.sleep(0)
            assert servicer._computing == 1
            queued = asyncio.ensure_future(servicer._compute_small(small, record, "queued"))
            await asyncio.sleep(0.05)
            assert "queued" not in order  # behind the running call, not beside it
            release.set()
            assert await queued != loop_thread
            await busy
            for _ in range(100):  # the counter drops once the thread reports back
                if servicer._computing == 0:
                    break
                await asyncio.sleep(0.01)
            assert servicer._computing == 0
            assert await servicer._compute_small(small, record, "idle again") == loop_thread
            assert order == ["idle", "large", "blocked", "queued", "idle again"]
        finally:
            await servicer.close()

    asyncio.run(main())
