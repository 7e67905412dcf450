"""The retries of the leader observation and of the auth-records watch (tenacity): store outages
retried with a growing wait that starts over once the store answers, other errors raised to
follow_leader, which starts again; a cancellation is never retried."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from shoal.contract.errors import StoreError, StoreUnavailable
from shoal.runtime import retrying
from shoal.runtime.election import LeaderElection
from shoal.runtime.service import follow_leader
from shoal.runtime.store import KeyValue, MemoryStore
from tests.support import async_wait_until


class FlakyStore(MemoryStore):
    """A memory store whose ``list`` fails with the queued errors first."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[BaseException] = []
        self.lists = 0

    async def list(self, prefix: str) -> tuple[list[KeyValue], int]:
        self.lists += 1
        if self.failures:
            raise self.failures.pop(0)
        return await super().list(prefix)

    def end_watches(self) -> None:
        """End every open watch (here only the observation's), as a store that closes one."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits between sessions, recorded; each takes no time."""
    recorded: list[float] = []
    wait = retrying.stream_wait

    def recording(cap: float = retrying.STREAM_CAP_S):  # type: ignore[no-untyped-def]
        inner = wait(cap)

        def record(state):  # type: ignore[no-untyped-def]
            recorded.append(round(inner(state), 6))
            return 0.0

        return record

    monkeypatch.setattr("shoal.runtime.election.stream_wait", recording)
    return recorded


async def test_observe_retries_store_outages_with_a_backoff_that_starts_over_once_it_lists(
    waits: list[float],
) -> None:
    store = FlakyStore()
    election = LeaderElection(store, "svc", "a", ttl=5.0)
    await store.put(f"{election.prefix}1", b"a")  # a candidate key: "a" leads
    store.failures = [StoreUnavailable("down")] * 3
    async with contextlib.aclosing(election.observe()) as leaders:
        assert await asyncio.wait_for(anext(leaders), timeout=10) == "a"
        assert waits == [0.05, 0.1, 0.2]
        # The watch ends (the store ends it) and the next listings fail: the waits start over
        # from the first, because the session before listed.
        following = asyncio.ensure_future(anext(leaders))
        await async_wait_until(lambda: store._watchers, timeout=10, what="the watch")
        store.failures = [StoreUnavailable("down again")] * 2
        store.end_watches()
        await async_wait_until(
            lambda: not store.failures and store._watchers, timeout=10, what="a new watch"
        )
        await store.delete(f"{election.prefix}1")
        assert await asyncio.wait_for(following, timeout=10) is None
    # The ended watch was the first failed attempt of a fresh sequence (0.05 s, not 0.4 s),
    # then two outages.
    assert waits == [0.05, 0.1, 0.2, 0.05, 0.1, 0.2]
    await store.close()


async def test_observe_raises_a_store_error_that_is_not_an_outage(waits: list[float]) -> None:
    store = FlakyStore()
    store.failures = [StoreError("permission denied")]
    election = LeaderElection(store, "svc", "a", ttl=5.0)
    async with contextlib.aclosing(election.observe()) as leaders:
        with pytest.raises(StoreError, match="permission denied"):
            await asyncio.wait_for(anext(leaders), timeout=10)
    assert waits == [] and store.lists == 1
    await store.close()


async def test_follow_leader_starts_the_observation_again_after_a_store_error() -> None:
    store = FlakyStore()
    election = LeaderElection(store, "svc", "a", ttl=5.0)
    await store.put(f"{election.prefix}1", b"a")
    store.failures = [StoreError("refused"), StoreError("refused")]
    seen: list[str | None] = []
    follower = asyncio.create_task(follow_leader(election, seen.append, retry_s=0.01))
    try:
        await async_wait_until(lambda: seen == ["a"], timeout=10)
        assert store.lists == 3  # two refused, then listed
    finally:
        follower.cancel()
        with pytest.raises(asyncio.CancelledError):
            await follower  # cancelled, not retried
        await store.close()


async def test_a_cancelled_observation_is_not_retried() -> None:
    store = FlakyStore()
    election = LeaderElection(store, "svc", "a", ttl=5.0)
    await store.put(f"{election.prefix}1", b"a")
    listed = asyncio.Event()

    async def consume() -> None:
        async with contextlib.aclosing(election.observe()) as leaders:
            async for _ in leaders:
                listed.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(listed.wait(), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    assert store.lists == 1
    await store.close()
