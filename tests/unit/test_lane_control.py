"""The same-host lane's control channel: its framing (``shoal.contract.lane_control``), the
shard's loop that serves one lane's connection (``shoal.param_sync.lane_control``) and the
learner's end (``shoal.learner.grpc_lane.LaneControl``), over a real Unix socket pair. The
loop is driven with calls of the test's own (the real SyncStep and Boundary through it are in
``tests/integration/test_shm_lane.py``): a SyncStep and a Boundary in flight at once are each
answered to their caller, under the lane's principal; a learner that closes the connection,
or sends a second call of a method before its answer, has its calls cancelled and the
connection closed; a message too long or of no method ends it too; the learner's callers see
a failure as gRPC's error, and a connection that ends as LaneError. The learner's end used
from a thread (the trainer's: ``send``, ``take``) reads the same: both calls sent in one write,
each answer to its caller, one that does not come in time leaves the call in flight, an answer
read by the thread while the loop waits for the other wakes the loop's caller, and a close wakes
every waiting caller. The blocking end of a lane
with no tensors (``DirectControl``, a collective-mode learner's trainer thread) reads the same
replies: an answer, a failure as gRPC's error (the connection stays), and an answer that does
not come in time closes it (the shard cancels the call), as does anything the protocol does not
allow."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio

from shoal.contract import lane_control
from shoal.contract.lane_control import BOUNDARY, SYNC_STEP
from shoal.contract.shm import LaneError
from shoal.learner.grpc_lane import DirectControl, LaneControl, NoAnswer
from shoal.param_sync.lane_control import LaneControlHandlers
from shoal.runtime.auth import Principal, Role, current_principal
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

KEY = ("job-a", "job-a-l1")
PRINCIPAL = Principal("job-a-l1", Role.LEARNER, job_id="job-a", learner_id="job-a-l1")


def reader_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_requests_and_replies_read_back_as_written() -> None:
    reader = reader_of(
        lane_control.request(SYNC_STEP, b"header") + lane_control.request(BOUNDARY, b"")
    )
    assert await lane_control.read_request(reader) == (SYNC_STEP, b"header")
    assert await lane_control.read_request(reader) == (BOUNDARY, b"")
    assert await lane_control.read_request(reader) is None  # closed between two
    answer = await lane_control.read_reply(reader_of(lane_control.answer(SYNC_STEP, b"params")))
    assert answer == lane_control.Reply(SYNC_STEP, body=b"params") and not answer.failed
    failed = await lane_control.read_reply(
        reader_of(lane_control.failure(BOUNDARY, 9, "stale", [("shoal-reason", "X"), ("k", "v")]))
    )
    assert failed.failed and (failed.method, failed.code, failed.details) == (BOUNDARY, 9, "stale")
    assert failed.metadata == (("shoal-reason", "X"), ("k", "v"))


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "closed the lane's control connection"),
        (b"Z", "unknown method"),
        (SYNC_STEP + b"Z" + lane_control.LENGTH.pack(0), "unknown status"),
        (SYNC_STEP + lane_control.ANSWER + b"\x00\x00", "inside a message's length"),
        (
            SYNC_STEP + lane_control.ANSWER + lane_control.LENGTH.pack(10) + b"abc",
            "inside a message",
        ),
        (
            SYNC_STEP
            + lane_control.ANSWER
            + lane_control.LENGTH.pack(lane_control.MAX_MESSAGE_BYTES + 1),
            "the most is",
        ),
        (SYNC_STEP + lane_control.FAILURE + lane_control.LENGTH.pack(2) + b"{}", "does not parse"),
        (
            SYNC_STEP
            + lane_control.FAILURE
            + lane_control.LENGTH.pack(42)
            + b'{"code": 0, "details": "", "metadata": []}',
            "with code 0",
        ),
    ],
)
async def test_a_reply_the_protocol_does_not_allow_is_an_error(data: bytes, why: str) -> None:
    with pytest.raises(lane_control.ControlError, match=why):
        await lane_control.read_reply(reader_of(data))
    # The blocking reader says the same of the same bytes.
    with pytest.raises(lane_control.ControlError, match=why):
        lane_control.recv_reply(socket_with(data))


_PEERS: list[socket.socket] = []


def socket_with(data: bytes) -> socket.socket:
    """An end of a socket pair whose other end wrote ``data`` and shut its writing down
    (what is sent to it is taken and dropped)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.sendall(data)
    theirs.shutdown(socket.SHUT_WR)
    _PEERS.append(theirs)
    return ours


def test_the_blocking_reader_reads_what_the_async_one_does() -> None:
    answer = lane_control.answer(BOUNDARY, b"params" * 10)
    failure = lane_control.failure(BOUNDARY, 9, "stale", [("shoal-reason", "X")])
    sock = socket_with(answer + failure)
    assert lane_control.recv_reply(sock) == lane_control.Reply(BOUNDARY, body=b"params" * 10)
    failed = lane_control.recv_reply(sock)
    assert (failed.code, failed.details, failed.metadata) == (9, "stale", (("shoal-reason", "X"),))
    with pytest.raises(lane_control.ControlError, match="closed the lane's control connection"):
        lane_control.recv_reply(sock)


def test_a_failure_must_fail_and_a_method_be_known() -> None:
    with pytest.raises(ValueError, match="code"):
        lane_control.failure(SYNC_STEP, 0, "ok")
    with pytest.raises(ValueError, match="method"):
        lane_control.request(b"X", b"")


class Host(LaneControlHandlers):
    """The loop's host with calls of the test's: each held until its method's event is set."""

    def __init__(self) -> None:
        self.bodies: list[tuple[bytes, bytes]] = []
        self.principals: list[Principal] = []
        self.release = {SYNC_STEP: asyncio.Event(), BOUNDARY: asyncio.Event()}
        self.called = asyncio.Event()
        self.cancelled: list[bytes] = []

    async def _lane_control_call(self, key: tuple[str, str], method: bytes, body: bytes) -> bytes:
        self.bodies.append((method, body))
        self.principals.append(current_principal())
        self.called.set()
        try:
            await self.release[method].wait()
        except asyncio.CancelledError:
            self.cancelled.append(method)
            raise
        if body == b"fail":
            return lane_control.failure(method, 9, "refused", [("shoal-reason", "R")])
        return lane_control.answer(method, b"answer to " + body)


@pytest.fixture
async def served() -> AsyncIterator[tuple[Host, asyncio.Task[None], LaneControl]]:
    shard_end, learner_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host = Host()
    task = asyncio.ensure_future(host._serve_lane_control(KEY, PRINCIPAL, shard_end))  # type: ignore[arg-type]
    control = LaneControl(learner_end)
    yield host, task, control
    control.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_syncstep_and_a_boundary_in_flight_are_each_answered(served) -> None:
    host, task, control = served
    sync = asyncio.ensure_future(control._call(SYNC_STEP, b"s1"))
    boundary = asyncio.ensure_future(control._call(BOUNDARY, b"b1"))
    await asyncio.wait_for(_calls(host, 2), 30)
    host.release[BOUNDARY].set()  # the later call is answered first
    assert await asyncio.wait_for(boundary, 30) == b"answer to b1"
    assert not sync.done()
    host.release[SYNC_STEP].set()
    assert await asyncio.wait_for(sync, 30) == b"answer to s1"
    assert await control._call(SYNC_STEP, b"s2") == b"answer to s2"
    assert control.calls == 3 and host.principals == [PRINCIPAL] * 3
    assert current_principal() != PRINCIPAL  # set in the loop's task only
    # A failure is gRPC's error, with its trailers; the connection stays.
    with pytest.raises(aio.AioRpcError) as info:
        await control._call(BOUNDARY, b"fail")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == "refused"
    assert tuple(info.value.trailing_metadata()) == (("shoal-reason", "R"),)
    assert not control.closed
    control.close()  # between two calls: the loop ends quietly
    await asyncio.wait_for(task, 30)


async def test_a_learner_that_closes_mid_call_has_its_calls_cancelled(served, caplog) -> None:
    host, task, control = served
    caplog.set_level(logging.INFO, logger="shoal.param_sync.service")
    sync = asyncio.ensure_future(control._call(SYNC_STEP, b"held"))
    boundary = asyncio.ensure_future(control._call(BOUNDARY, b"held too"))
    await asyncio.wait_for(_calls(host, 2), 30)
    sync.cancel()  # the learner gives up its SyncStep: the connection closes
    await asyncio.wait_for(task, 30)
    assert sorted(host.cancelled) == sorted([SYNC_STEP, BOUNDARY])
    with pytest.raises(LaneError, match="control connection"):
        await boundary  # the other call ends too
    assert control.closed and "closed after 0 calls" in caplog.text
    with pytest.raises(LaneError):
        await control.sync_step(b"")


async def test_a_second_call_of_a_method_before_its_answer_ends_the_connection(
    served, caplog
) -> None:
    host, task, control = served
    control._sock.sendall(  # (what LaneControl never sends)
        lane_control.request(SYNC_STEP, b"held") + lane_control.request(SYNC_STEP, b"again")
    )
    await asyncio.wait_for(task, 30)
    # The first was cancelled (if it had started at all), the second never ran; no answer.
    assert host.bodies in ([], [(SYNC_STEP, b"held")]) and host.cancelled in ([], [SYNC_STEP])
    with pytest.raises(LaneError, match="control connection"):
        await control.sync_step(b"")
    assert "sent a second SyncStep call on its lane's control" in caplog.text


@pytest.mark.parametrize(
    "data",
    [
        SYNC_STEP + lane_control.LENGTH.pack(lane_control.MAX_MESSAGE_BYTES + 1),
        b"Q" + lane_control.LENGTH.pack(0),
    ],
)
async def test_a_message_the_protocol_does_not_allow_ends_the_connection(served, data) -> None:
    host, task, control = served
    control._sock.sendall(data)
    await asyncio.wait_for(task, 30)
    assert host.bodies == []
    with pytest.raises(LaneError, match="control connection"):
        await control.sync_step(b"")  # the learner's end sees it closed


async def _calls(host: Host, n: int) -> None:
    while len(host.bodies) < n:
        host.called.clear()
        await host.called.wait()


class BoundaryHost(Host):
    """Answers a Boundary as a coordinator would (a ``BoundaryResponse``), or fails it when
    its learner is "fail"; each held until released, as in :class:`Host`."""

    async def _lane_control_call(self, key: tuple[str, str], method: bytes, body: bytes) -> bytes:
        reply = await super()._lane_control_call(key, method, body)
        request = ps_pb2.BoundaryRequest.FromString(body)
        if request.learner_id == "fail":
            return lane_control.failure(method, 9, "refused", [("shoal-reason", "R")])
        answer = ps_pb2.BoundaryResponse(completed_iterations=len(self.bodies), coordinator_epoch=3)
        assert reply  # (the held call's own answer, dropped)
        return lane_control.answer(method, answer.SerializeToString())


async def test_the_blocking_end_votes_and_gives_up_on_a_late_answer() -> None:
    shard_end, learner_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host = BoundaryHost()
    task = asyncio.ensure_future(host._serve_lane_control(KEY, PRINCIPAL, shard_end))  # type: ignore[arg-type]
    direct = DirectControl(learner_end)
    vote = ps_pb2.BoundaryRequest(job_id="job-a", learner_id="job-a-l1", generation=4)
    host.release[BOUNDARY].set()
    # (blocking: on a thread of its own, as the trainer's thread beside the backend's loop)
    answer = await asyncio.to_thread(direct.boundary, vote, wait_s=30)
    assert (answer.completed_iterations, answer.coordinator_epoch) == (1, 3)
    assert host.bodies == [(BOUNDARY, vote.SerializeToString())] and direct.calls == 1
    with pytest.raises(aio.AioRpcError) as info:
        await asyncio.to_thread(
            direct.boundary, ps_pb2.BoundaryRequest(learner_id="fail"), wait_s=30
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == "refused" and not direct.closed  # the connection stays
    # An answer that does not come within the wait: the connection is closed, and the shard
    # cancels the call it held.
    host.release[BOUNDARY].clear()
    with pytest.raises(NoAnswer, match=r"within 0\.2 s"):
        await asyncio.to_thread(direct.boundary, vote, wait_s=0.2)
    assert direct.closed
    await asyncio.wait_for(task, 30)
    assert host.cancelled == [BOUNDARY] and direct.calls == 1
    with pytest.raises(LaneError, match="closed"):
        direct.boundary(vote, wait_s=30)


async def test_the_blocking_end_closes_on_what_the_protocol_does_not_allow() -> None:
    for data, why in [
        (b"", "closed the lane's control connection"),
        (lane_control.answer(SYNC_STEP, b""), "a reply to no b'S' call"),
    ]:
        direct = DirectControl(socket_with(data))
        with pytest.raises(LaneError, match=why):
            direct.boundary(ps_pb2.BoundaryRequest(), wait_s=30)
        assert direct.closed


def test_replies_split_off_a_buffer_whole_and_in_order() -> None:
    answer = lane_control.answer(SYNC_STEP, b"params" * 10)
    failure = lane_control.failure(BOUNDARY, 9, "stale", [("shoal-reason", "X")])
    buffer = bytearray(answer + failure[:5])
    assert lane_control.split_replies(buffer) == [
        lane_control.Reply(SYNC_STEP, body=b"params" * 10)
    ]
    assert buffer == failure[:5]  # (the reply not whole yet stays)
    buffer += failure[5:]
    (failed,) = lane_control.split_replies(buffer)
    assert (failed.code, failed.details, failed.metadata) == (9, "stale", (("shoal-reason", "X"),))
    assert buffer == b"" and lane_control.split_replies(buffer) == []
    for data, why in [
        (b"Z" + lane_control.ANSWER + lane_control.LENGTH.pack(0), "unknown method"),
        (SYNC_STEP + b"Z" + lane_control.LENGTH.pack(0), "unknown status"),
        (
            SYNC_STEP
            + lane_control.ANSWER
            + lane_control.LENGTH.pack(lane_control.MAX_MESSAGE_BYTES + 1),
            "the most is",
        ),
    ]:
        with pytest.raises(lane_control.ControlError, match=why):
            lane_control.split_replies(bytearray(data))


async def test_the_trainers_thread_sends_both_calls_and_reads_each_answer(served) -> None:
    host, _task, control = served
    # (blocking: on a thread of its own, as the trainer's thread beside the backend's loop)
    await asyncio.to_thread(control.send, (SYNC_STEP, b"s1"), (BOUNDARY, b"b1"))
    await asyncio.wait_for(_calls(host, 2), 30)
    with pytest.raises(RuntimeError, match="in flight"):
        control.send((SYNC_STEP, b"again"))  # (nothing sent)
    with pytest.raises(NoAnswer, match=r"within 0\.2 s"):
        await asyncio.to_thread(control.take, SYNC_STEP, 0.2)
    assert not control.closed  # still in flight: taken later
    host.release[BOUNDARY].set()
    assert await asyncio.to_thread(control.take, BOUNDARY, 30) == b"answer to b1"
    host.release[SYNC_STEP].set()
    assert await asyncio.to_thread(control.take, SYNC_STEP, 30) == b"answer to s1"
    with pytest.raises(RuntimeError, match="no b'S' call"):
        control.take(SYNC_STEP, 30)
    # A failure is gRPC's error; the connection stays.
    await asyncio.to_thread(control.send, (BOUNDARY, b"fail"))
    with pytest.raises(aio.AioRpcError) as info:
        await asyncio.to_thread(control.take, BOUNDARY, 30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and not control.closed
    # An answer the thread read while the loop waits for the other method's: each gets its own.
    host.release[SYNC_STEP].clear()
    on_loop = asyncio.ensure_future(control._call(SYNC_STEP, b"s2"))
    await asyncio.to_thread(control.send, (BOUNDARY, b"b2"))
    await asyncio.wait_for(_calls(host, 5), 30)
    assert await asyncio.to_thread(control.take, BOUNDARY, 30) == b"answer to b2"
    host.release[SYNC_STEP].set()
    assert await asyncio.wait_for(on_loop, 30) == b"answer to s2"
    assert control.calls == 4 and host.principals == [PRINCIPAL] * 5


async def test_a_connection_closed_while_a_thread_waits_wakes_it(served) -> None:
    host, task, control = served
    await asyncio.to_thread(control.send, (SYNC_STEP, b"held"))
    await asyncio.wait_for(_calls(host, 1), 30)
    waiting = asyncio.ensure_future(asyncio.to_thread(control.take, SYNC_STEP, None))
    on_loop = asyncio.ensure_future(control._call(BOUNDARY, b"held too"))
    await asyncio.wait_for(_calls(host, 2), 30)
    control.close("closed by the test")  # (as a failed sync does: its answers read by nobody)
    with pytest.raises(LaneError, match="closed by the test"):
        await asyncio.wait_for(waiting, 30)
    with pytest.raises(LaneError, match="closed by the test"):
        await asyncio.wait_for(on_loop, 30)
    await asyncio.wait_for(task, 30)  # the shard cancels both calls
    assert sorted(host.cancelled) == sorted([SYNC_STEP, BOUNDARY])
    with pytest.raises(LaneError):
        control.send((SYNC_STEP, b""))
