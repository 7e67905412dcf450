"""A learner's connection to its job on the parameter-sync shards: one :class:`ShardSession`,
held by each backend that talks to them (the ``"grpc"`` backend, ``grpc_backend.py``, and the
``"collective"`` backend, ``collective.py``), which delegate to it instead of one inheriting
the other.

The session owns what both need and neither decides: the asyncio loop on a background thread
that gRPC runs on (the trainer calls in from its own thread), the channels with the
credentials and the token, the job's shard routing (from Join, or a Boundary after a
promotion), and the coordinator followed. Control calls (Join, Boundary, GetJobProgress,
ReportEpochMetrics) go through :meth:`ShardSession.control`: retried while the coordinator is
unreachable, watched while they hang, and a coordinator that moved (its shard was lost, another
took the role over) found through the other shards (``FindCoordinator``) and followed. See
docs/data-plane.md, "Coordinator failover".

What differs between the backends is theirs and passed in: the Join each sends (the session
calls :attr:`ShardSession.rejoin` to re-Join a coordinator it followed), what their tensors
are, and how an iteration is synchronized.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc
import tenacity
from grpc import aio

from shoal.client.tls import TLSFiles, channel_credentials
from shoal.contract.errors import decode_rpc_error
from shoal.contract.shm import LaneError
from shoal.contract.wire import TensorMeta
from shoal.learner.grpc_calls import (
    _RETRYABLE,
    MAX_MESSAGE_BYTES,
    _Shard,
    _translate,
    stream_methods,
)
from shoal.learner.grpc_lane import (
    ClientLane,
    DirectControl,
    LaneControl,
    NoAnswer,
    close_lane,
    open_lane,
    traced,
)
from shoal.learner.liveness import WATCH_AFTER_S, WATCH_EVERY_S, CoordinatorMoved, watched
from shoal.learner.tracing import trace_metadata
from shoal.v1 import (
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)

__all__ = ["ShardSession"]

log = logging.getLogger("shoal.learner.grpc")
T = TypeVar("T")


class _Followed(Exception):
    """A control call's try found the coordinator moved and followed it: ask the new one at
    once, with a fresh retry window."""


class _Unanswered(Exception):
    """A control call's try got no usable answer (the coordinator unreachable, or answering
    from a fenced epoch) and no move was found: ask again after a pause."""


#: How long a learner waits for the role to move when the coordinator it follows says "job not
#: found" while another shard still knows the job (its shard restarted): the scheduler takes
#: the role over --coordinator-grace (2 s) after the loss; where it does not (failover off, the
#: checkpoint path), the learner leaves after this and is replaced.
JOB_LOST_WAIT_S = 6.0


class _Window:
    """How long a control call keeps retrying an unreachable coordinator (restarted by each
    move followed)."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self.restart()

    def restart(self) -> None:
        self._ends = time.monotonic() + self._seconds
        self._job_lost_ends: float | None = None

    def over(self) -> bool:
        return time.monotonic() > self._ends

    def job_lost_over(self) -> bool:
        """Whether the coordinator has said "job not found" for longer than
        :data:`JOB_LOST_WAIT_S` (counted from the first such answer in this window)."""
        now = time.monotonic()
        if self._job_lost_ends is None:
            self._job_lost_ends = now + JOB_LOST_WAIT_S
        return now > min(self._job_lost_ends, self._ends)


class _Pauses:
    """tenacity's wait of a control call: none after a followed move; otherwise 0.1 s doubling
    to 2 s, counted over the pauses taken (a move neither grows nor resets it)."""

    def __init__(self) -> None:
        self._next = 0.1

    def __call__(self, state: tenacity.RetryCallState) -> float:
        assert state.outcome is not None
        if isinstance(state.outcome.exception(), _Followed):
            return 0.0
        pause, self._next = self._next, min(self._next * 2, 2.0)
        return pause


def _log_pause(state: tenacity.RetryCallState) -> None:
    assert state.outcome is not None and state.next_action is not None
    exc = state.outcome.exception()
    if isinstance(exc, _Unanswered):
        log.warning("%s; retrying in %.1f s", exc, state.next_action.sleep)


def _job_lost(exc: aio.AioRpcError) -> bool:
    """Whether the coordinator followed answered that it does not know the job: its shard was
    restarted (a fresh process holds no job) and the role has not moved yet, or has moved and
    this learner has not heard. While another shard still knows the job it is asked again for
    up to :data:`JOB_LOST_WAIT_S` (after asking where the coordinator is); when none does, the
    call fails at once, as before."""
    return (
        exc.code() == grpc.StatusCode.NOT_FOUND
        and decode_rpc_error(exc).reason == "ERROR_REASON_JOB_NOT_FOUND"
    )


#: How long a watched call waits before its first liveness probe after a Boundary that already
#: waited ``watch_after_s`` on the control connection (:meth:`ShardSession.boundary_direct`).
WATCH_SOON_S = 0.05


class ShardSession:
    """One learner's connection to its job's shards and coordinator (see the module docstring).

    ``coordinator`` is the first coordinator followed; ``sync_endpoints`` are every shard
    (SHOAL_SYNC_ENDPOINTS), asked where the coordinator is when it does not answer.
    ``channel_options`` are extra gRPC channel options. ``retry_s`` bounds how long a control
    call retries while the coordinator is unreachable.
    """

    #: A call pending on the coordinator this long starts the liveness probes, one each
    #: ``watch_every_s`` (``shoal.learner.liveness``).
    watch_after_s: float = WATCH_AFTER_S
    watch_every_s: float = WATCH_EVERY_S

    def __init__(
        self,
        *,
        job_id: str,
        learner_id: str,
        coordinator: str,
        token: str | None = None,
        retry_s: float = 30.0,
        channel_options: Sequence[tuple[str, Any]] = (),
        tls: TLSFiles | None = None,
        sync_endpoints: Sequence[str] = (),
        what: str = "grpc backend",
    ) -> None:
        for name, value in (
            ("job_id", job_id),
            ("learner_id", learner_id),
            ("coordinator", coordinator),
        ):
            if not value:
                raise ValueError(f"{name} ({value!r}) must be set for the {what}")
        self.job_id = job_id
        self.learner_id = learner_id
        self.coordinator = coordinator
        self._boundaries_on = ""  # the address whose lane control last carried a Boundary
        self._what = what
        # Every shard (SHOAL_SYNC_ENDPOINTS): asked where the coordinator is when it does not
        # answer (its shard was lost and another took the role over, FindCoordinator).
        self.endpoints = tuple(sync_endpoints)
        self.coordinator_epoch = 0
        # A shard refused this learner's generation: the coordinator that issued it may have
        # been replaced (and fenced); the next control call asks the shards first.
        self.recheck_coordinator = False
        # How to Join again (the owner's Join, with its fields), set by the owner before its
        # first Join: after following a moved coordinator it is called before any other
        # control call. ``_rejoin`` says one is due; ``_probe_turn`` which shard the next
        # liveness probe asks (shoal.learner.liveness).
        self.rejoin: Callable[[Any], Awaitable[Any]] | None = None
        self._rejoin = False
        self._probe_turn = 0
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._tls = tls
        self.retry_s = retry_s
        self._options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *channel_options,
        ]
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="shoal-grpc-backend", daemon=True
        )
        self._thread.start()
        self._channels: dict[str, aio.Channel] = {}
        # A stub per address (building one makes a multi-callable per method: ~20 us, every
        # Boundary otherwise).
        self._stubs: dict[str, ps_grpc.ParameterSyncServiceStub] = {}
        # Which shard holds which tensors, and the coordinator's routing epoch of it (0: as
        # the Join said; a new coordinator's routing starts afresh).
        self.shards: list[_Shard] = []
        self.routing_epoch = 0
        # A collective-mode learner's lane with no tensors to the coordinator's shard, for its
        # control connection (:meth:`open_coordinator_control`): (address, lane).
        self.control_lane: tuple[str, ClientLane] | None = None
        self._control_tried: set[str] = set()  # the addresses it was asked of
        # The address whose control connection was closed because an answer took longer than
        # ``watch_after_s``: asked for a new one only once a Boundary got an answer there.
        self._control_stalled = ""
        # The next watched call starts asking where the coordinator is at once (it is asked
        # again after a Boundary that already waited ``watch_after_s`` on the control).
        self._watch_soon = False
        self.control_answers = 0  # control calls answered on a lane's control connection
        self.closed = False

    # -- plumbing -----------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the session's loop and wait for its result (from any other thread)."""
        return self.start(coro).result()

    def start(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the session's loop (from any other thread); its future."""
        if self.closed:
            coro.close()
            raise RuntimeError(f"the {self._what} is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def channel(self, address: str) -> aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            if self._tls is not None:
                creds = channel_credentials(self._tls.ca, self._tls.cert, self._tls.key)
                channel = aio.secure_channel(address, creds, options=self._options)
            else:
                channel = aio.insecure_channel(address, options=self._options)
            self._channels[address] = channel
        return channel

    def coordinator_stub(self) -> ps_grpc.ParameterSyncServiceStub:
        return self.stub(self.coordinator)

    def stub(self, address: str) -> ps_grpc.ParameterSyncServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = ps_grpc.ParameterSyncServiceStub(self.channel(address))
        return stub

    def md(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the token, plus the trace context when the calling thread has a span
        recording (the join, a sampled iteration: ``shoal.learner.tracing``)."""
        return self.metadata + trace_metadata()

    def route(self, slices: Sequence[ps_pb2.ShardSlice], layout: Sequence[TensorMeta]) -> None:
        """Which shard holds which tensors of ``layout`` (from Join, or a Boundary after a
        promotion)."""
        index = {m.name: j for j, m in enumerate(layout)}
        for old in self.shards:  # a slice may have moved or grown: lanes are asked anew
            if old.lane is not None:
                old.lane.close()
        self.shards = []
        for s in slices:
            if not s.tensor_names:
                continue
            channel = self.channel(s.address)
            self.shards.append(
                _Shard(
                    s.shard_index,
                    s.address,
                    sorted(index[n] for n in s.tensor_names),
                    ps_grpc.ParameterSyncServiceStub(channel),
                    stream_methods(channel),
                )
            )

    # -- control calls and following the coordinator ------------------------------------------

    async def join(self, request: ps_pb2.JoinRequest, metadata: Any = None) -> ps_pb2.JoinResponse:
        """Join (or re-Join) the coordinator followed; no re-Join is due after it."""
        reply = await self.control("Join", request, metadata)
        self._rejoin = False
        return reply

    async def control(self, method: str, request: Any, metadata: Any = None) -> Any:
        """A unary control call to the coordinator, retried while it is unreachable. Meanwhile
        the other shards are asked whether the coordinator moved (its shard was lost and
        another took the role over): then the learner joins the new one and asks it. An answer
        from a coordinator older than one already followed is refused (it was fenced). A call
        that hangs (a frozen coordinator) is watched: the shards are asked where the
        coordinator is while it waits, and it is dropped for the new one (``watch``).

        The retries are tenacity's: each try is :meth:`_ask`; after a followed move the next
        try goes at once with a fresh window of ``retry_s``, otherwise after a pause of 0.1 s
        doubling to 2 s; an UNAVAILABLE or DEADLINE_EXCEEDED past the window (or any other
        error) ends the call."""
        if self.recheck_coordinator:
            self.recheck_coordinator = False
            await self.find_coordinator(metadata)
        window = _Window(self.retry_s)
        # The first try outside tenacity (building its machinery costs ~13 us, every Boundary):
        # one that asks again replays its outcome as tenacity's first attempt, so the pauses,
        # their logs and the tries after it are tenacity's, exactly as before.
        try:
            return await self._ask(method, request, metadata, window)
        except (_Followed, _Unanswered) as exc:
            first: BaseException | None = exc
        async for attempt in tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type((_Followed, _Unanswered)),
            wait=_Pauses(),
            before_sleep=_log_pause,
            reraise=True,
        ):
            with attempt:
                if first is not None:
                    replayed, first = first, None
                    raise replayed
                return await self._ask(method, request, metadata, window)
        raise AssertionError("unreachable")

    async def _ask(self, method: str, request: Any, metadata: Any, window: _Window) -> Any:
        """One try of :meth:`control`: its reply, or :class:`_Followed` / :class:`_Unanswered`
        (try again), or the call's error translated (give up)."""
        if self._rejoin and method != "Join" and self.rejoin is not None:
            await self.rejoin(metadata)
        try:
            control = self._coordinator_control(method, metadata)
            reply = None
            if control is not None:
                asked = self.coordinator
                try:
                    reply = await self.watch(control.boundary(request))
                    self.control_answers += 1
                except LaneError:  # its control ended: this try on gRPC, unless meanwhile
                    if self.coordinator != asked or self._rejoin:  # the role moved (a probe
                        raise CoordinatorMoved from None  # followed it): Join there first
            if reply is None:
                call = getattr(self.coordinator_stub(), method)
                reply = await self.watch(call(request, metadata=metadata or self.metadata))
        except CoordinatorMoved:
            window.restart()
            raise _Followed from None
        except aio.AioRpcError as exc:
            if _job_lost(exc):
                retry = not window.job_lost_over() and await self._job_known_elsewhere(metadata)
            else:
                retry = exc.code() in _RETRYABLE and not window.over()
            if not retry:
                raise _translate(exc) from exc
            why = exc.details()
        else:
            epoch = getattr(reply, "coordinator_epoch", None)
            if epoch is None or epoch >= self.coordinator_epoch:
                if epoch is not None:
                    self.coordinator_epoch = epoch
                return reply
            why = (
                f"coordinator {self.coordinator} answered from epoch {epoch}, older than "
                f"{self.coordinator_epoch}"
            )
        if await self.find_coordinator(metadata) or (self._rejoin and method != "Join"):
            window.restart()
            raise _Followed
        raise _Unanswered(why)

    async def open_coordinator_control(self, metadata: Any = None) -> None:
        """Make sure a lane with no tensors to the coordinator's shard is open, for its
        control connection (a collective-mode learner on that shard's host: its Boundaries go
        there; docs/data-plane.md, "The lane's control channel"). Asked once per coordinator
        address, and once more after its connection ended; a shard that refuses (another
        host, ``--shm-lane off``, an older shard) is not asked again."""
        held = self.control_lane
        if held is not None:
            address, lane = held
            if address == self.coordinator and lane.direct is not None and not lane.direct.closed:
                return
            self.control_lane = None
            lane.close()
            if address == self.coordinator and address != self._control_stalled:
                self._control_tried.discard(address)  # it ended: ask once more
        if self.coordinator in self._control_tried:
            return
        self._control_tried.add(self.coordinator)
        address = self.coordinator
        opened = await open_lane(
            self.coordinator_stub(),
            job_id=self.job_id,
            learner_id=self.learner_id,
            metadata=metadata or self.metadata,
            address=address,
            control_only=True,
        )
        if opened is not None:  # (open_lane holds a control-only lane's connection as direct)
            if self.closed:
                opened.close()
            else:
                self.control_lane = (address, opened)

    def boundary_direct(
        self, request: ps_pb2.BoundaryRequest, metadata: Any = None
    ) -> ps_pb2.BoundaryResponse | None:
        """A Boundary on the control connection of the lane :meth:`open_coordinator_control`
        opened, from the calling thread (the trainer's: no hop to the loop and back), or None
        when there is none or the call is not for it (traced, a re-Join or a coordinator
        check due) or it did not get an answer: then the caller asks through :meth:`control`
        (again: a Boundary is answered alike however often it comes). Called only between
        two of the owner's calls into the loop, so nothing else touches the session
        meanwhile. An answer that took over ``watch_after_s`` is not awaited (the loop's
        :meth:`watch` asks the shards where the coordinator is): that connection is closed,
        and a new one is asked for only once a Boundary got an answer there."""
        direct = self.send_boundary(request, metadata)
        return None if direct is None else self.boundary_answer(direct)

    def send_boundary(
        self, request: ps_pb2.BoundaryRequest, metadata: Any = None
    ) -> DirectControl | None:
        """The first half of :meth:`boundary_direct`: ``request`` sent, its answer left to
        :meth:`boundary_answer` on the connection returned (the vote ahead); None when it was
        not sent there."""
        held = self.control_lane
        if (
            held is None
            or held[0] != self.coordinator
            or self._rejoin
            or self.recheck_coordinator
            or traced(metadata)
        ):
            return None
        direct = held[1].direct
        if direct is None or direct.closed:
            return None
        sent = self._direct_call(
            held[0], lambda wait_s: direct.send_boundary(request, wait_s=wait_s) or True
        )
        return direct if sent else None

    def boundary_answer(self, direct: DirectControl) -> ps_pb2.BoundaryResponse | None:
        """The second half of :meth:`boundary_direct`: the answer on ``direct``, or None (the
        caller asks through :meth:`control`)."""
        reply = self._direct_call(self.coordinator, direct.boundary_answer)
        return reply if reply is not None and self.accept(reply) else None

    def _direct_call(self, address: str, call: Callable[..., T]) -> T | None:
        try:
            return call(wait_s=self.watch_after_s)
        except LaneError as exc:
            if isinstance(exc, NoAnswer):
                self._control_stalled = address
                self._watch_soon = True
            log.info("a Boundary goes on gRPC: %s", exc)
            return None
        except aio.AioRpcError:
            return None  # (control() asks again and takes the error as it would have)

    def accept(self, reply: ps_pb2.BoundaryResponse) -> bool:
        """Whether a Boundary's ``reply`` that came on a lane's control connection, read
        outside :meth:`control`, holds: not when a fenced coordinator sent it (then the
        caller asks through :meth:`control`, which finds the new one)."""
        if reply.coordinator_epoch < self.coordinator_epoch:
            return False
        self.coordinator_epoch = reply.coordinator_epoch
        self.control_answers += 1
        return True

    def boundary_goes_to(self, address: str) -> bool:
        """Whether a Boundary not traced may go on the control connection of the lane to
        the shard at ``address`` from the trainer's thread, beside its SyncStep: the
        coordinator runs in that shard's process and no re-Join or coordinator check is due
        (:meth:`control` makes those first)."""
        return address == self.coordinator and not self._rejoin and not self.recheck_coordinator

    def answered_at(self, address: str) -> None:
        """A Boundary got its answer from ``address`` through :meth:`control`: a control
        connection closed there for a slow answer may be asked for again."""
        if address and address == self._control_stalled:
            self._control_stalled = ""
            self._control_tried.discard(address)

    def _coordinator_control(self, method: str, metadata: Any) -> LaneControl | None:
        """For a Boundary not traced: the control connection of this learner's lane to a
        shard in the coordinator's process (docs/data-plane.md, "The lane's control
        channel"), when one is open (a collective-mode learner's lane with no tensors is
        used from its trainer's thread instead: :meth:`boundary_direct`)."""
        if method != "Boundary" or traced(metadata):
            return None
        for shard in self.shards:
            lane = shard.lane
            if shard.address == self.coordinator and lane is not None:
                control = lane.control
                if control is not None and not control.closed:
                    self.boundaries_on(shard.address)
                    return control
        return None

    def boundaries_on(self, address: str) -> None:
        """A Boundary goes on the control connection of the lane to the shard at
        ``address`` (logged when that changes)."""
        if self._boundaries_on != address:
            self._boundaries_on = address
            log.info(
                "Boundaries go on the control connection of the lane to shard %s "
                "(the coordinator's process)",
                address,
            )

    def watch_soon(self) -> None:
        """The next :meth:`watch` looks after ``WATCH_SOON_S`` (its call waited already)."""
        self._watch_soon = True

    async def watch(self, call: Awaitable[T], *, soon: bool = False) -> T:
        """``call`` (an RPC, or a gather of streams) watched for a coordinator that hangs
        (``shoal.learner.liveness``): raises CoordinatorMoved once the shards name a new one.
        ``soon``: the call was waited on already (the first look comes after
        ``WATCH_SOON_S``)."""
        waited_on = self.coordinator
        after_s = WATCH_SOON_S if self._watch_soon or soon else self.watch_after_s
        self._watch_soon = False
        try:
            return await watched(
                call, self._probe_coordinator, after_s=after_s, every_s=self.watch_every_s
            )
        except CoordinatorMoved:
            log.warning(
                "a call waited on coordinator %s, which hangs, after the role moved: dropped it "
                "to follow %s",
                waited_on,
                self.coordinator,
            )
            raise

    def _candidates(self) -> list[str]:
        """The shards to ask where the coordinator is: all known but the one followed."""
        candidates = dict.fromkeys([*(s.address for s in self.shards), *self.endpoints])
        candidates.pop(self.coordinator, None)
        return list(candidates)

    async def _probe_coordinator(self) -> bool:
        """One liveness probe while a call waits on the coordinator: ask one other shard (in
        turn) where the coordinator is; True if it named a newer one (now followed)."""
        candidates = self._candidates()
        if not candidates:
            return False
        address = candidates[self._probe_turn % len(candidates)]
        self._probe_turn += 1
        return await self._ask_where(address, self.metadata, timeout=2.0)

    async def find_coordinator(self, metadata: Any = None) -> bool:
        """Ask the other shards where the job's coordinator is; switch to it (True) when one
        names a newer coordinator than the one followed."""
        for address in self._candidates():
            if await self._ask_where(address, metadata or self.metadata, timeout=5.0):
                return True
        return False

    async def _job_known_elsewhere(self, metadata: Any = None) -> bool:
        """Whether another shard still knows the job (names a coordinator for it): then the
        coordinator followed lost it by restarting and the role moves, or has moved; when none
        does, the job's whole data plane is gone (the scheduler resumes it from its checkpoint
        with new learners) and the learner leaves at once."""
        request = ps_pb2.FindCoordinatorRequest(job_id=self.job_id)
        for address in self._candidates():
            stub = ps_grpc.ParameterSyncServiceStub(self.channel(address))
            try:
                reply = await stub.FindCoordinator(
                    request, metadata=metadata or self.metadata, timeout=5.0
                )
            except aio.AioRpcError:
                continue
            if reply.coordinator_address:
                return True
        return False

    async def _ask_where(self, address: str, metadata: Any, *, timeout: float) -> bool:
        """FindCoordinator on the shard at ``address``; follow a newer coordinator it names
        (True: Join it before the next control call)."""
        stub = ps_grpc.ParameterSyncServiceStub(self.channel(address))
        request = ps_pb2.FindCoordinatorRequest(job_id=self.job_id)
        try:
            reply = await stub.FindCoordinator(request, metadata=metadata, timeout=timeout)
        except aio.AioRpcError as exc:
            log.info("FindCoordinator on %s: %s", address, exc.details())
            return False
        if reply.coordinator_epoch <= self.coordinator_epoch or not reply.coordinator_address:
            return False
        log.warning(
            "coordinator moved: %s -> %s (epoch %d)",
            self.coordinator,
            reply.coordinator_address,
            reply.coordinator_epoch,
        )
        self.coordinator = reply.coordinator_address
        self.coordinator_epoch = reply.coordinator_epoch
        self.routing_epoch = 0  # the new coordinator's routing starts afresh
        self._rejoin = self.rejoin is not None
        return True

    # -- the calls both backends make alike ---------------------------------------------------

    async def completed(self, md: Any = None) -> int:
        """The job's completed iterations (GetJobProgress; 0 when it does not answer)."""
        request = ps_pb2.GetJobProgressRequest(job_id=self.job_id)
        try:
            reply = await self.control("GetJobProgress", request, md)
        except Exception:  # informational only
            return 0
        return int(reply.progress.completed_iterations)

    def report_epoch_metrics(self, epoch: int, values: dict[str, float]) -> None:
        """ReportEpochMetrics, best effort: never stop training for metrics."""
        request = ps_pb2.ReportEpochMetricsRequest(
            job_id=self.job_id, learner_id=self.learner_id, epoch=epoch, values=values
        )
        try:
            self.run(self.control("ReportEpochMetrics", request))
        except Exception as exc:  # metrics are best effort: never stop training for them
            log.warning("epoch %d metrics not recorded: %s", epoch, exc)

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the same-host lanes, close the channels and stop the loop (once)."""
        if self.closed:
            return

        async def shutdown() -> None:
            lanes = [s for s in self.shards if s.lane is not None]
            await asyncio.gather(
                *(
                    close_lane(
                        s.stub,
                        s.lane,
                        job_id=self.job_id,
                        learner_id=self.learner_id,
                        md=self.metadata,
                    )
                    for s in lanes
                ),
                return_exceptions=True,
            )
            for s in lanes:
                s.lane = None
            held, self.control_lane = self.control_lane, None
            if held is not None:
                with contextlib.suppress(Exception):
                    await close_lane(
                        self.stub(held[0]),
                        held[1],
                        job_id=self.job_id,
                        learner_id=self.learner_id,
                        md=self.metadata,
                    )
            for channel in self._channels.values():
                await channel.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=5)
        self.closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()
