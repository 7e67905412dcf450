"""A job's answer segment on a shard (``param_sync/shm_lane.py``, :class:`SharedAnswer`): the
answers of one commit to all the job's lanes on the host are one copy into it, started by
the first; an answer whose call is cancelled leaves that copy to the others; the next commit
copies again; a copy that fails fails every answer waiting for it, and the next answer of
that commit copies again. A small answer is copied at once (``write_now``) unless a copy is
in flight."""

from __future__ import annotations

import asyncio

import pytest

from shoal.contract.shm import Segment
from shoal.param_sync.shm_lane import SharedAnswer


def answers() -> SharedAnswer:
    return SharedAnswer(Segment.create(4096, read_only=True), 64)


async def test_one_commit_is_copied_once_for_all_its_answers() -> None:
    shared = answers()
    copies: list[bytes] = []
    gate = asyncio.Event()

    def copying(value: bytes):
        async def copy(region: memoryview) -> None:
            await gate.wait()
            region[:] = value
            copies.append(value)

        return copy

    first = [asyncio.ensure_future(shared.write((7, 1, 0), copying(b"abcd"), 4)) for _ in range(4)]
    await asyncio.sleep(0)
    first[0].cancel()  # its learner gave up: the copy goes on for the others
    gate.set()
    await asyncio.gather(*first[1:])
    assert copies == [b"abcd"] and shared.written == (7, 1, 0)
    assert bytes(shared.segment.region(64, 4, lo=64, hi=4096, what="x")) == b"abcd"
    await shared.write((7, 1, 0), copying(b"none"), 4)  # a late answer of the same commit
    assert copies == [b"abcd"]
    await shared.write((7, 1, 1), copying(b"efgh"), 4)  # the next commit
    assert copies == [b"abcd", b"efgh"] and shared.written == (7, 1, 1)
    shared.close()


async def test_a_failed_copy_fails_every_answer_waiting_for_it_and_the_next_tries_again() -> None:
    shared = answers()

    async def broken(region: memoryview) -> None:
        await asyncio.sleep(0)
        raise OSError("the compute thread died")

    waiting = [shared.write((7, 2, 5), broken, 4) for _ in range(3)]
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results) and shared.written is None

    async def fine(region: memoryview) -> None:
        region[:] = b"ok!!"

    await shared.write((7, 2, 5), fine, 4)
    assert shared.written == (7, 2, 5)
    with pytest.raises(Exception, match="outside"):  # an answer larger than the segment
        await shared.write((7, 2, 6), broken, 8192)
    shared.close()


async def test_a_small_answer_is_copied_at_once_unless_a_copy_is_in_flight() -> None:
    shared = answers()
    copies: list[bytes] = []

    def now(value: bytes):
        def copy(region: memoryview) -> None:
            region[:] = value
            copies.append(value)

        return copy

    # Nothing in flight: copied right here, no await between (the others see it written).
    assert shared.write_now((7, 3, 0), now(b"abcd"), 4)
    assert copies == [b"abcd"] and shared.written == (7, 3, 0)
    assert shared.write_now((7, 3, 0), now(b"none"), 4)  # the same commit: already there
    assert copies == [b"abcd"]
    # A copy started by write() and still running: not now (the caller waits with write()).
    gate = asyncio.Event()

    async def held(region: memoryview) -> None:
        await gate.wait()
        region[:] = b"efgh"
        copies.append(b"efgh")

    writing = asyncio.ensure_future(shared.write((7, 3, 1), held, 4))
    await asyncio.sleep(0)
    assert not shared.write_now((7, 3, 1), now(b"xxxx"), 4)
    assert not shared.write_now((7, 3, 2), now(b"yyyy"), 4)  # (nor a later commit over it)
    gate.set()
    await writing
    assert copies == [b"abcd", b"efgh"] and shared.written == (7, 3, 1)
    assert shared.write_now((7, 3, 2), now(b"ijkl"), 4)  # done: the next commit at once
    assert bytes(shared.segment.region(64, 4, lo=64, hi=4096, what="x")) == b"ijkl"
    shared.close()
