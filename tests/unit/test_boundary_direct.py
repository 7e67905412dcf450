"""A collective-mode learner's Boundary on the trainer's thread (``ShardSession.boundary_direct``)
over the control connection of its lane with no tensors: used only when nothing else is due
(a trace, a re-Join, a coordinator check), an answer from an older coordinator is not taken,
and one that does not come within ``watch_after_s`` closes that connection, starts the loop's
liveness probes at once and keeps the connection from being asked for again until a Boundary
got an answer there. The shard's end is a thread of the test's own on a real socket pair,
speaking the lane's control framing; the session never connects anywhere."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from shoal.contract import lane_control
from shoal.contract.shm import Segment
from shoal.learner.grpc_lane import ClientLane, DirectControl
from shoal.learner.shard_session import WATCH_SOON_S, ShardSession
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

COORDINATOR = "127.0.0.1:9"


class Peer(threading.Thread):
    """The shard's end: answers each Boundary with the next of ``epochs`` (None: no answer,
    and the connection is read until it ends)."""

    def __init__(self, sock: socket.socket, epochs: list[int | None]) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.epochs = epochs
        self.asked: list[ps_pb2.BoundaryRequest] = []

    def run(self) -> None:
        with self.sock:
            for epoch in self.epochs:
                method = self.sock.recv(1)
                if not method:
                    return
                (size,) = lane_control.LENGTH.unpack(self.sock.recv(lane_control.LENGTH.size))
                body = self.sock.recv(size, socket.MSG_WAITALL) if size else b""
                self.asked.append(ps_pb2.BoundaryRequest.FromString(body))
                if epoch is None:
                    while self.sock.recv(1 << 16):
                        pass
                    return
                answer = ps_pb2.BoundaryResponse(completed_iterations=7, coordinator_epoch=epoch)
                self.sock.sendall(lane_control.answer(method, answer.SerializeToString()))


@pytest.fixture
def session() -> Iterator[ShardSession]:
    s = ShardSession(job_id="j", learner_id="l", coordinator=COORDINATOR)
    try:
        yield s
    finally:
        s.close()


def hold_lane(session: ShardSession, epochs: list[int | None]) -> tuple[Peer, ClientLane]:
    learner_end, shard_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    lane = ClientLane(Segment.create(64), 64, 0, 64, direct=DirectControl(learner_end))
    session.control_lane = (COORDINATOR, lane)
    session._control_tried.add(COORDINATOR)  # (as open_coordinator_control leaves it)
    peer = Peer(shard_end, epochs)
    peer.start()
    return peer, lane


VOTE = ps_pb2.BoundaryRequest(job_id="j", learner_id="l", generation=2, completed_iteration=6)


def test_a_vote_goes_on_the_control_when_nothing_else_is_due(session: ShardSession) -> None:
    peer, lane = hold_lane(session, [2, 3, 1])
    session.coordinator_epoch = 2
    reply = session.boundary_direct(VOTE)
    assert reply is not None and reply.completed_iterations == 7
    assert peer.asked == [VOTE] and session.control_answers == 1
    # Not for it: a traced iteration's, a re-Join or a coordinator check due (gRPC then).
    assert session.boundary_direct(VOTE, (("traceparent", "00-ab-cd-01"),)) is None
    session._rejoin = True
    assert session.boundary_direct(VOTE) is None
    session._rejoin, session.recheck_coordinator = False, True
    assert session.boundary_direct(VOTE) is None
    session.recheck_coordinator = False
    assert len(peer.asked) == 1
    # A newer coordinator's answer is taken, an older one's is not (control() asks again).
    assert session.boundary_direct(VOTE) is not None and session.coordinator_epoch == 3
    assert session.boundary_direct(VOTE) is None and session.coordinator_epoch == 3
    assert session.control_answers == 2 and not lane.direct.closed  # type: ignore[union-attr]
    # A lane held for another address (the coordinator moved) is not used.
    session.coordinator = "127.0.0.1:10"
    assert session.boundary_direct(VOTE) is None and len(peer.asked) == 3


def test_an_answer_that_does_not_come_in_time_closes_the_connection(session: ShardSession) -> None:
    peer, lane = hold_lane(session, [None])
    session.watch_after_s = 0.2
    assert session.boundary_direct(VOTE) is None
    assert lane.direct is not None and lane.direct.closed
    peer.join(timeout=30)
    assert not peer.is_alive()  # the shard's end saw the connection end (its call cancelled)
    assert session._watch_soon  # the loop's watch of the call on gRPC probes at once
    # The lane is dropped and not asked for again while that coordinator has not answered...
    session.run(session.open_coordinator_control())
    assert session.control_lane is None and COORDINATOR in session._control_tried
    # ...and once a Boundary got its answer there, it is.
    session.answered_at(COORDINATOR)
    assert COORDINATOR not in session._control_tried
    assert WATCH_SOON_S < session.watch_after_s
