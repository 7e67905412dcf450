"""The same-host lane's control channel: its framing (``shoal.contract.lane_control``) and the
shard's loop that serves one lane's connection (``shoal.param_sync.lane_control``), over a
real Unix socket pair. The loop is driven with a call of the test's own (the real SyncStep
through it is in ``tests/integration/test_shm_lane.py``): an answer goes back; a learner that
closes the connection, or sends again before its answer, has its call cancelled and the
connection closed; a message too long ends it too."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

import pytest

from shoal.contract import lane_control
from shoal.param_sync.lane_control import LaneControlHandlers
from shoal.runtime.auth import Principal, Role, current_principal

KEY = ("job-a", "job-a-l1")
PRINCIPAL = Principal("job-a-l1", Role.LEARNER, job_id="job-a", learner_id="job-a-l1")


def reader_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_requests_and_replies_read_back_as_written() -> None:
    reader = reader_of(lane_control.request(b"header") + lane_control.request(b""))
    assert await lane_control.read_request(reader) == b"header"
    assert await lane_control.read_request(reader) == b""
    assert await lane_control.read_request(reader) is None  # closed between two
    answer = await lane_control.read_reply(reader_of(lane_control.answer(b"params")))
    assert not answer.failed and answer.body == b"params"
    failed = await lane_control.read_reply(
        reader_of(lane_control.failure(9, "stale", [("shoal-reason", "X"), ("k", "v")]))
    )
    assert failed.failed and (failed.code, failed.details) == (9, "stale")
    assert failed.metadata == (("shoal-reason", "X"), ("k", "v"))


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "closed the lane's control connection"),
        (b"Z" + lane_control.LENGTH.pack(0), "unknown kind"),
        (lane_control.ANSWER + b"\x00\x00", "inside a message's length"),
        (lane_control.ANSWER + lane_control.LENGTH.pack(10) + b"abc", "inside a message"),
        (
            lane_control.ANSWER + lane_control.LENGTH.pack(lane_control.MAX_MESSAGE_BYTES + 1),
            "the most is",
        ),
        (lane_control.FAILURE + lane_control.LENGTH.pack(2) + b"{}", "does not parse"),
        (
            lane_control.FAILURE + lane_control.LENGTH.pack(42) + b'{"code": 0, "details": "", '
            b'"metadata": []}',
            "with code 0",
        ),
    ],
)
async def test_a_reply_the_protocol_does_not_allow_is_an_error(data: bytes, why: str) -> None:
    with pytest.raises(lane_control.ControlError, match=why):
        await lane_control.read_reply(reader_of(data))


def test_a_failure_must_fail() -> None:
    with pytest.raises(ValueError, match="code"):
        lane_control.failure(0, "ok")


class Host(LaneControlHandlers):
    """The loop's host with a call of the test's: held until ``release`` is set."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.principals: list[Principal] = []
        self.release = asyncio.Event()
        self.called = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def _lane_control_call(self, key: tuple[str, str], body: bytes) -> bytes:
        self.bodies.append(body)
        self.principals.append(current_principal())
        self.called.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return lane_control.answer(b"answer to " + body)


@pytest.fixture
async def served() -> AsyncIterator[
    tuple[Host, asyncio.Task[None], asyncio.StreamReader, asyncio.StreamWriter]
]:
    shard_end, learner_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host = Host()
    task = asyncio.ensure_future(host._serve_lane_control(KEY, PRINCIPAL, shard_end))  # type: ignore[arg-type]
    reader, writer = await asyncio.open_unix_connection(sock=learner_end)
    yield host, task, reader, writer
    writer.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_call_is_answered_under_the_lanes_principal(served) -> None:
    host, task, reader, writer = served
    host.release.set()
    for body in (b"one", b"two"):
        writer.write(lane_control.request(body))
        reply = await asyncio.wait_for(lane_control.read_reply(reader), 30)
        assert reply.body == b"answer to " + body
    assert host.bodies == [b"one", b"two"] and host.principals == [PRINCIPAL, PRINCIPAL]
    assert current_principal() != PRINCIPAL  # set in the loop's task only
    writer.close()  # between two calls: the loop ends quietly
    await asyncio.wait_for(task, 30)


async def test_a_learner_that_closes_mid_call_has_its_call_cancelled(served, caplog) -> None:
    host, task, _, writer = served
    caplog.set_level(logging.INFO, logger="shoal.param_sync.service")
    writer.write(lane_control.request(b"held"))
    await asyncio.wait_for(host.called.wait(), 30)
    writer.close()
    await asyncio.wait_for(host.cancelled.wait(), 30)
    await asyncio.wait_for(task, 30)
    assert "closed after 0 calls" in caplog.text


async def test_a_second_request_before_the_answer_ends_the_connection(served, caplog) -> None:
    host, task, reader, writer = served
    writer.write(lane_control.request(b"held") + lane_control.request(b"again"))
    await asyncio.wait_for(host.cancelled.wait(), 30)
    await asyncio.wait_for(task, 30)
    assert await reader.read() == b""  # closed, nothing answered
    assert host.bodies == [b"held"]
    assert "sent a second request on its lane's control before the answer" in caplog.text


async def test_a_message_too_long_ends_the_connection(served) -> None:
    host, task, reader, writer = served
    writer.write(lane_control.LENGTH.pack(lane_control.MAX_MESSAGE_BYTES + 1))
    await asyncio.wait_for(task, 30)
    assert await reader.read() == b"" and host.bodies == []
