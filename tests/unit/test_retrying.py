"""shoal.contract.retrying.resumed: a stream's sessions retried by tenacity, the backoff starting
over after a session that delivered items, cancellation never retried. Waits are recorded by an
injected sleep (no real time passes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import tenacity

from shoal.contract.retrying import backoff, resumed


class Broke(Exception):
    pass


class Fatal(Exception):
    pass


class Script:
    """Sessions played from a script: each is (items, then how it ends: an exception or None)."""

    def __init__(self, *sessions: tuple[list[int], BaseException | None]) -> None:
        self.sessions = list(sessions)
        self.opened = 0
        self.closed = 0
        self.sleeps: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 6))

    def open(self) -> AsyncIterator[int]:
        items, end = self.sessions[self.opened]
        self.opened += 1
        return self._session(items, end)

    async def _session(self, items: list[int], end: BaseException | None) -> AsyncIterator[int]:
        try:
            for item in items:
                yield item
            if end is not None:
                raise end
        finally:
            self.closed += 1

    def stream(self, **kwargs: object) -> AsyncIterator[int]:
        options: dict[str, object] = {
            "retry": lambda exc: isinstance(exc, Broke),
            "wait": backoff(0.05, 0.4),
            "sleep": self.sleep,
        }
        options.update(kwargs)
        return resumed(self.open, **options)  # type: ignore[arg-type]


async def drain(stream: AsyncIterator[int]) -> list[int]:
    return [item async for item in stream]


async def test_a_session_failing_before_its_first_item_backs_off_more_each_time() -> None:
    script = Script(
        ([], Broke()), ([], Broke()), ([], Broke()), ([], Broke()), ([], Broke()), ([1, 2], None)
    )
    assert await drain(script.stream()) == [1, 2]
    assert script.sleeps == [0.05, 0.1, 0.2, 0.4, 0.4]  # doubling, capped
    assert script.closed == script.opened == 6


async def test_the_backoff_starts_over_after_a_session_delivered_items() -> None:
    script = Script(
        ([], Broke()),
        ([], Broke()),
        ([], Broke()),
        ([1], Broke()),  # delivered, then broke: the waits start over
        ([], Broke()),
        ([2], None),
    )
    assert await drain(script.stream()) == [1, 2]
    assert script.sleeps == [0.05, 0.1, 0.2, 0.05, 0.1]


async def test_a_break_after_items_is_raised_unless_resume_allows_it() -> None:
    script = Script(([1], Broke()), ([2], None))
    received: list[int] = []
    with pytest.raises(Broke):
        async for item in script.stream(resume=lambda exc: False):
            received.append(item)
    assert received == [1]
    assert script.opened == 1 and script.closed == 1


async def test_an_error_that_is_not_transient_is_raised_at_once() -> None:
    script = Script(([], Fatal()), ([1], None))
    with pytest.raises(Fatal):
        await drain(script.stream())
    assert script.opened == 1 and script.sleeps == []


async def test_the_stop_gives_up_with_the_last_error_and_starts_over_per_sequence() -> None:
    script = Script(([], Broke()), ([7], Broke()), ([], Broke()), ([], Broke()))
    with pytest.raises(Broke):
        await drain(script.stream(stop=lambda: tenacity.stop_after_attempt(2)))
    # sequence 1: attempt 1 broke, attempt 2 delivered 7 then broke; sequence 2: that break is
    # attempt 1, the next open attempt 2, which breaks: stop.
    assert script.opened == 3
    assert script.sleeps == [0.05, 0.05]


async def test_a_session_that_ends_is_opened_again_only_with_reopen_on_end() -> None:
    script = Script(([1], None), ([], None), ([2], Fatal()))
    received: list[int] = []
    with pytest.raises(Fatal):
        async for item in script.stream(reopen_on_end=True):
            received.append(item)
    # the first session delivered 1 and ended (reopened at once, no wait); the second ended
    # with nothing (a failed attempt: one wait); the third delivered 2, then failed for good.
    assert received == [1, 2]
    assert script.sleeps == [0.05]
    assert script.closed == 3


async def test_a_cancellation_while_opening_is_not_retried() -> None:
    opened = asyncio.Event()
    attempts = 0

    async def session() -> AsyncIterator[int]:
        nonlocal attempts
        attempts += 1
        opened.set()
        await asyncio.Event().wait()  # blocks until cancelled
        yield 0

    async def consume() -> None:
        async for _ in resumed(session, retry=lambda exc: True, wait=backoff(0.05, 1.0)):
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(opened.wait(), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    assert attempts == 1  # a retry-everything predicate still does not retry a cancellation


async def test_closing_the_stream_closes_the_open_session() -> None:
    script = Script(([1, 2, 3], None))
    async with contextlib.aclosing(script.stream()) as stream:
        async for item in stream:
            assert item == 1
            break
    assert script.closed == 1
