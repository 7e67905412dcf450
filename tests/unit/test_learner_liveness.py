"""A learner's calls on a coordinator that hangs (issue 12): ``shoal.learner.liveness.watched``
and the shard session's use of it (both backends on the shards hold one), against real
in-process gRPC servers: a coordinator whose Boundary never answers (a SIGSTOPped process looks
so to its clients: the connection stays open) and a shard that says the role moved."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc import aio

from shoal.contract.errors import REASON_METADATA_KEY
from shoal.learner.liveness import CoordinatorMoved, watched
from shoal.learner.shard_session import ShardSession
from shoal.v1 import (
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)

# -- watched ------------------------------------------------------------------------------------


def test_a_call_that_answers_is_never_probed() -> None:
    probes = 0

    async def moved() -> bool:
        nonlocal probes
        probes += 1
        return True

    async def call() -> str:
        await asyncio.sleep(0.01)
        return "answer"

    assert asyncio.run(watched(call(), moved, after_s=1.0, every_s=1.0)) == "answer"
    assert probes == 0


def test_a_hanging_call_is_cancelled_once_the_coordinator_moved() -> None:
    probes = 0
    cancelled = False

    async def moved() -> bool:
        nonlocal probes
        probes += 1
        return probes == 3

    async def hang() -> None:
        nonlocal cancelled
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled = True
            raise

    with pytest.raises(CoordinatorMoved):
        asyncio.run(watched(hang(), moved, after_s=0.01, every_s=0.01))
    assert (probes, cancelled) == (3, True)


def test_a_call_that_finishes_while_probed_keeps_its_outcome() -> None:
    done = asyncio.Event

    async def main() -> str:
        finished = done()

        async def moved() -> bool:
            finished.set()  # the call ends during the probe
            await asyncio.sleep(0.05)
            return True

        async def call() -> str:
            await finished.wait()
            return "late answer"

        return await watched(call(), moved, after_s=0.01, every_s=0.01)

    assert asyncio.run(main()) == "late answer"


def test_an_error_of_the_call_is_raised_as_is() -> None:
    async def moved() -> bool:
        return False

    async def fail() -> None:
        await asyncio.sleep(0.05)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(watched(fail(), moved, after_s=0.01, every_s=0.01))


@pytest.mark.parametrize(("after", "every"), [(0.0, 1.0), (1.0, -1.0)])
def test_watch_periods_must_be_positive(after: float, every: float) -> None:
    async def moved() -> bool:
        return False

    async def main() -> None:
        call = asyncio.sleep(0)
        try:
            await watched(call, moved, after_s=after, every_s=every)
        finally:
            call.close()

    with pytest.raises(ValueError, match=f"after_s \\({after}\\) and every_s \\({every}\\)"):
        asyncio.run(main())


# -- the shard session on a frozen coordinator --------------------------------------------------


class _Frozen(ps_grpc.ParameterSyncServiceServicer):
    """The old coordinator: takes the Boundary call and never answers it."""

    def __init__(self) -> None:
        self.waiting = 0
        self.cancelled = 0

    async def Boundary(self, request, context):
        self.waiting += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def FindCoordinator(self, request, context):
        return ps_pb2.FindCoordinatorResponse()


class _Successor(ps_grpc.ParameterSyncServiceServicer):
    """A shard that took the role over at epoch 1 (after ``moved_after`` questions)."""

    def __init__(self, moved_after: int) -> None:
        self.address = ""
        self.asked = 0
        self.moved_after = moved_after
        self.boundaries: list[ps_pb2.BoundaryRequest] = []

    async def FindCoordinator(self, request, context):
        self.asked += 1
        if self.asked <= self.moved_after:
            return ps_pb2.FindCoordinatorResponse(coordinator_address="old:1")
        return ps_pb2.FindCoordinatorResponse(coordinator_address=self.address, coordinator_epoch=1)

    async def Boundary(self, request, context):
        self.boundaries.append(request)
        return ps_pb2.BoundaryResponse(action=ps_pb2.BOUNDARY_ACTION_DONE, coordinator_epoch=1)


async def _serve(servicer: ps_grpc.ParameterSyncServiceServicer) -> tuple[aio.Server, str]:
    server = aio.server()
    ps_grpc.add_ParameterSyncServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _session_with(*servicers: ps_grpc.ParameterSyncServiceServicer):
    """A shard session whose own event loop also serves ``servicers`` (one server each):
    the session's coordinator is the first, every server is a sync endpoint."""
    session = ShardSession(job_id="j", learner_id="l0", coordinator="unset:1")
    served = [session.run(_serve(s)) for s in servicers]
    session.coordinator = served[0][1]
    session.endpoints = tuple(address for _, address in served)
    session.watch_after_s = session.watch_every_s = 0.1
    return session, [server for server, _ in served], [address for _, address in served]


def _shutdown(session: ShardSession, servers: list[aio.Server]) -> None:
    for server in servers:
        session.run(server.stop(None))
    session.close()


def _boundary_through(
    *servicers: ps_grpc.ParameterSyncServiceServicer, retry_s: float | None = None
) -> ps_pb2.BoundaryResponse:
    """One control Boundary of a fresh session whose shards are ``servicers`` (the first
    coordinates; ``retry_s``: the session's retry window, if given); the session and its
    servers are shut down after, whatever the call did."""
    session, servers, _ = _session_with(*servicers)
    if retry_s is not None:
        session.retry_s = retry_s
    try:
        request = ps_pb2.BoundaryRequest(job_id="j", learner_id="l0")
        return session.run(asyncio.wait_for(session.control("Boundary", request), 60))
    finally:
        _shutdown(session, servers)


def test_a_boundary_blocked_on_a_frozen_coordinator_follows_the_successor() -> None:
    """Without the watch this Boundary waits forever (the frozen server keeps the call)."""
    frozen, successor = _Frozen(), _Successor(moved_after=2)
    session, servers, (_, new) = _session_with(frozen, successor)
    successor.address = new
    try:
        request = ps_pb2.BoundaryRequest(job_id="j", learner_id="l0", completed_iteration=7)
        reply = session.run(asyncio.wait_for(session.control("Boundary", request), 60))
        assert reply.action == ps_pb2.BOUNDARY_ACTION_DONE
        assert (session.coordinator, session.coordinator_epoch) == (new, 1)
        # The report the frozen coordinator never took reached the successor, once.
        assert [b.completed_iteration for b in successor.boundaries] == [7]
        assert frozen.waiting == 1
        assert successor.asked == 3  # two probes saw no move, the third followed it
    finally:
        _shutdown(session, servers)
    assert frozen.cancelled == 1  # the learner dropped its call


def test_a_slow_boundary_of_a_live_coordinator_is_not_dropped() -> None:
    """Probes that find no move change nothing: the call waits for its answer."""

    class Slow(_Successor):
        async def Boundary(self, request, context):
            await asyncio.sleep(0.8)
            return await super().Boundary(request, context)

    coordinator, other = Slow(moved_after=0), _Successor(moved_after=10**6)
    session, servers, (a, _) = _session_with(coordinator, other)
    coordinator.address = a
    session.coordinator_epoch = 1
    try:
        request = ps_pb2.BoundaryRequest(job_id="j", learner_id="l0")
        reply = session.run(asyncio.wait_for(session.control("Boundary", request), 60))
        assert reply.action == ps_pb2.BOUNDARY_ACTION_DONE
        assert session.coordinator == a
        assert other.asked >= 2 and len(coordinator.boundaries) == 1
    finally:
        _shutdown(session, servers)


# -- the retries of a control call (tenacity) ------------------------------------------------


class _Flaky(ps_grpc.ParameterSyncServiceServicer):
    """A coordinator whose Boundary fails with ``code`` ``failures`` times, then answers."""

    def __init__(
        self,
        failures: int,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        reason: str = "",
    ):
        self.failures, self.code, self.reason, self.calls = failures, code, reason, 0

    async def Boundary(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            if self.reason:
                context.set_trailing_metadata(((REASON_METADATA_KEY, self.reason),))
            await context.abort(self.code, f"try {self.calls} refused")
        return ps_pb2.BoundaryResponse(action=ps_pb2.BOUNDARY_ACTION_DONE)


def test_a_control_call_retries_an_unreachable_coordinator_with_doubling_pauses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    flaky = _Flaky(failures=3)
    caplog.set_level(logging.WARNING, logger="shoal.learner.grpc")
    reply = _boundary_through(flaky)
    assert reply.action == ps_pb2.BOUNDARY_ACTION_DONE and flaky.calls == 4
    pauses = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert pauses == [
        "try 1 refused; retrying in 0.1 s",
        "try 2 refused; retrying in 0.2 s",
        "try 3 refused; retrying in 0.4 s",
    ]


def test_a_control_call_gives_up_once_the_coordinator_stays_unreachable_past_retry_s() -> None:
    flaky = _Flaky(failures=10**6)
    with pytest.raises(RuntimeError, match="UNAVAILABLE: try"):
        _boundary_through(flaky, retry_s=0.5)
    assert flaky.calls >= 2  # retried within the window, then the last error was raised


def test_a_control_call_refused_by_the_coordinator_is_not_retried() -> None:
    flaky = _Flaky(failures=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(ValueError, match="try 1 refused"):
        _boundary_through(flaky)
    assert flaky.calls == 1


class _Holder(ps_grpc.ParameterSyncServiceServicer):
    """Another shard of the job that still holds its slice: it names the coordinator it knows
    (``address``; "" once it holds nothing of the job either)."""

    def __init__(self, address: str = "old:1") -> None:
        self.address = address

    async def FindCoordinator(self, request, context):
        return ps_pb2.FindCoordinatorResponse(coordinator_address=self.address)


def _job_not_found(failures: int) -> _Flaky:
    return _Flaky(failures, grpc.StatusCode.NOT_FOUND, reason="ERROR_REASON_JOB_NOT_FOUND")


def test_a_coordinator_that_restarted_without_the_job_is_asked_again_within_the_window() -> None:
    """A coordinator shard restarted by its supervisor holds no job and answers NOT_FOUND
    (job not found) until the role moves: while another shard still knows the job that is the
    coordinator lost, not the job, and the learner asks again within its window instead of
    exiting (seen in CI: both learners of a job exited that way in the second between a
    restart and the takeover)."""
    restarted = _job_not_found(failures=2)
    reply = _boundary_through(restarted, _Holder())
    assert reply.action == ps_pb2.BOUNDARY_ACTION_DONE and restarted.calls == 3


def test_a_job_no_shard_knows_fails_at_once_and_one_still_unknown_past_the_window_too() -> None:
    # Every shard restarted (the whole data plane died): no one to wait for, the learner
    # leaves at once and the scheduler resumes the job from its checkpoint.
    gone = _job_not_found(failures=10**6)
    with pytest.raises(ValueError, match="try 1 refused"):
        _boundary_through(gone, _Holder(address=""))
    assert gone.calls == 1
    # Another shard knows it but the coordinator never does: failed once the window is spent.
    stuck = _job_not_found(failures=10**6)
    with pytest.raises(ValueError, match="refused"):
        _boundary_through(stuck, _Holder(), retry_s=0.5)
    assert stuck.calls >= 2
    # Any other NOT_FOUND (an unknown learner: it must leave) is not asked again.
    unknown = _Flaky(failures=1, code=grpc.StatusCode.NOT_FOUND)
    with pytest.raises(ValueError, match="try 1 refused"):
        _boundary_through(unknown, _Holder())
    assert unknown.calls == 1
