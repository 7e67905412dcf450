"""The learner's side of the same-host shared-memory lane (docs/data-plane.md, "The same-host
lane").

When a shard of the job runs on the learner's host (same :func:`shoal.contract.shm.host_id`)
and has the lane on, :func:`open_lane` gets this learner's lane from it (``OpenSharedLane``),
fetches the nameless segment's descriptor from the shard's Unix socket with the reply's
one-time token (``shoal.contract.lane_handoff``), checks it and maps it. A SyncStep to that
shard then writes the gradients into the segment's in-region and sends only the header
(``shared_memory``); the shard answers with a header naming where in the out-region it wrote
the new parameters. The header goes on the Unix connection the descriptor came over, kept
open as the lane's control channel (:class:`LaneControl`, ``shoal.contract.lane_control``),
and so do the learner's Boundaries when the job's coordinator runs in that shard's process
(``ShardSession``), unless the iteration is traced (its calls are gRPC calls with spans) or
``SHOAL_LANE_CONTROL`` is ``off``; then gRPC carries them. In the plain case the trainer's
thread sends them and reads their answers itself (``GrpcBackend._sync_direct``: the
connection is usable from any thread). (A collective-mode learner's lane
with no tensors keeps its connection as a blocking socket, :class:`DirectControl`: its votes
are sent and answered on the trainer's thread.) Anything that does not work (another
host, another user, another network namespace, an old shard that offers a named segment, a
refusal) leaves the learner on gRPC streams for that shard; a control connection that ends
leaves the learner on gRPC for that lane's headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import select
import socket
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from grpc import aio

from shoal.contract import environment, lane_control
from shoal.contract.lane_handoff import fetch_fd_keeping, take_segment
from shoal.contract.shm import SHM_DIR, LaneError, Segment, host_id
from shoal.contract.wire import BundleError, Frame, TensorMeta, decode_frame, validate_layout
from shoal.learner.env import switch
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

T = TypeVar("T")

__all__ = [
    "ClientLane",
    "DirectControl",
    "LaneControl",
    "NoAnswer",
    "lane_control_enabled",
    "lane_refused",
    "open_lane",
    "traced",
    "wait_any",
]

log = logging.getLogger("shoal.learner.grpc")

#: The shard's answer to a lane SyncStep when it has no lane of this learner (it restarted,
#: or dropped the lane): the learner sends that iteration as chunks and opens a new lane.
_NO_LANE = "no shared-memory lane"


def lane_refused(exc: aio.AioRpcError) -> bool:
    """Whether a lane SyncStep failed only because the shard has no lane of this learner."""
    return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and _NO_LANE in (exc.details() or "")


def lane_control_enabled() -> bool:
    """``SHOAL_LANE_CONTROL``: ``on`` (the default) or ``off``."""
    return switch(environment.LANE_CONTROL, "on")


def shm_lane_enabled() -> bool:
    """``SHOAL_SHM_LANE``: anything but ``off``, ``false`` or ``0`` (unset: on)."""
    return os.environ.get("SHOAL_SHM_LANE", "on").strip().lower() not in ("off", "false", "0")


def traced(metadata: Any) -> bool:
    """Whether call ``metadata`` carries a trace context (a sampled iteration, whose calls go
    over gRPC so that the shard records their spans)."""
    return bool(metadata) and any(key == "traceparent" for key, _ in metadata)


_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class LaneControl:
    """The learner's end of its lane's control connection: a SyncStep and a Boundary at a
    time, safe to use from any thread. The trainer's thread sends a SyncStep with the
    Boundary beside it and reads their answers itself (:meth:`send`, :meth:`take`;
    ``GrpcBackend.sync``: no hop to the session's loop and back); the loop's calls are
    :meth:`sync_step` and :meth:`boundary`. Whoever waits for an answer reads what came on
    the connection (the loop, while one of its calls waits: a reader of the socket's), and
    each reply is kept for its method's caller. The socket is non-blocking; a thread waits
    for it with ``poll``."""

    #: The longest one wait for the socket lasts before a waiting thread looks again whether
    #: the connection was closed meanwhile (by another thread).
    SLICE_S = 0.5

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._lock = threading.Lock()  # what follows, and every read of the socket
        self._sending = threading.Lock()  # a request's bytes go whole, one after another
        self._in_flight: set[bytes] = set()  # methods sent whose answer was not taken
        self._kept: dict[bytes, lane_control.Reply] = {}
        self._buffer = bytearray()
        # The loop's calls waiting, by method, and the loop reading for them.
        self._waiting: dict[bytes, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._why = "the lane's control connection is closed"
        self.calls = 0  # answered through it
        self.closed = False

    # -- from any thread ----------------------------------------------------------------------

    def send(self, *requests: tuple[bytes, bytes]) -> None:
        """Send ``requests`` (method, serialized request) in one write. :class:`LaneError`
        when the connection is closed or ends (then it stays closed); RuntimeError when a
        call of that method is in flight already."""
        data = b"".join(lane_control.request(method, body) for method, body in requests)
        with self._lock:
            if self.closed:
                raise LaneError(self._why)
            for method, _ in requests:
                if method in self._in_flight:
                    raise RuntimeError(
                        f"a {method!r} call is in flight on the lane's control already"
                    )
            self._in_flight.update(method for method, _ in requests)
        try:
            with self._sending:
                view = memoryview(data)
                while view:
                    try:
                        view = view[self._sock.send(view) :]
                    except BlockingIOError:
                        self._poll(select.POLLOUT, self.SLICE_S)
        except (OSError, ValueError) as exc:  # (ValueError: closed meanwhile)
            self.close(f"the lane's control connection ended: {exc}")
            raise LaneError(self._why) from None

    def take(self, method: bytes, wait_s: float | None) -> bytes:
        """The answer to the ``method`` call sent (its serialized response), waiting on this
        thread: the :class:`grpc.aio.AioRpcError` gRPC would have raised (the connection
        stays open); :class:`LaneError` when the connection is closed or ends;
        :class:`NoAnswer` when none came within ``wait_s`` (None: however long; the call
        stays in flight: take it again, or close the connection)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            body = self.answered(method)
            if body is not None:
                return body
            left = self.SLICE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise NoAnswer(f"no answer on the lane's control connection within {wait_s} s")
            wait_any([self], min(left, self.SLICE_S))

    def answered(self, method: bytes) -> bytes | None:
        """:meth:`take` without waiting: None when the answer has not come yet."""
        reply = self._taken(method)
        return None if reply is None else self._answered(reply)

    def close(self, why: str = "the lane's control connection was closed") -> None:
        """Close it; every caller waiting gets :class:`LaneError` (an answer still due is
        read by nobody)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._why = why
            waiting = list(self._waiting.values())
            loop = self._loop
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # (wakes a thread waiting in poll)
        if loop is None or loop.is_closed():
            self._sock.close()
        elif _running() is loop:
            self._release(loop, waiting)
        else:  # the loop reads it: it stops reading it first, then closes it
            try:
                loop.call_soon_threadsafe(self._release, loop, waiting)
            except RuntimeError:  # (the loop closed meanwhile)
                self._sock.close()

    # -- on the session's loop ----------------------------------------------------------------

    async def sync_step(self, body: bytes) -> Frame:
        """The shard's answer to the serialized ``SyncStepRequest`` ``body``: the frame gRPC
        would have carried, or the :class:`grpc.aio.AioRpcError` it would have raised."""
        reply = await self._call(lane_control.SYNC_STEP, body)
        return decode_frame(ps_pb2.SyncStepResponse, reply)

    async def boundary(self, request: ps_pb2.BoundaryRequest) -> ps_pb2.BoundaryResponse:
        """The coordinator's answer to ``request`` (it runs in the lane's shard process), or
        the :class:`grpc.aio.AioRpcError` gRPC would have raised."""
        reply = await self._call(lane_control.BOUNDARY, request.SerializeToString())
        return ps_pb2.BoundaryResponse.FromString(reply)

    async def _call(self, method: bytes, body: bytes) -> bytes:
        """:class:`LaneError` when the connection is gone (then it stays closed); a call
        cancelled closes it too (its answer may still come on it), which ends the other
        method's call in flight with :class:`LaneError`."""
        self.send((method, body))
        try:
            return await self.answer(method)
        except aio.AioRpcError:  # (the call failed: the connection stays)
            raise
        except BaseException:
            self.close()
            raise

    async def answer(self, method: bytes) -> bytes:
        """:meth:`take`, waiting on the loop: the loop reads the connection meanwhile."""
        loop = asyncio.get_running_loop()
        while True:
            reply = self._taken(method)
            if reply is not None:
                return self._answered(reply)
            waiting = loop.create_future()
            with self._lock:
                if self.closed or method in self._kept:
                    continue
                self._waiting[method] = waiting
                if self._loop is None:
                    self._loop = loop
                    loop.add_reader(self._sock.fileno(), self._read)
            try:
                await waiting
            finally:
                with self._lock:
                    if self._waiting.get(method) is waiting:
                        del self._waiting[method]
                    reading = not self._waiting and self._loop is loop
                    if reading:
                        self._loop = None
                if reading and self._sock.fileno() != -1:  # (else _release stopped it)
                    loop.remove_reader(self._sock.fileno())

    # -- inside -------------------------------------------------------------------------------

    def _taken(self, method: bytes) -> lane_control.Reply | None:
        """``method``'s reply when it was read (taken off the kept ones); :class:`LaneError`
        when the connection is closed; RuntimeError when no such call is in flight."""
        with self._lock:
            reply = self._kept.pop(method, None)
            if reply is not None:
                self._in_flight.discard(method)
                return reply
            if self.closed:
                raise LaneError(self._why)
            if method not in self._in_flight:
                raise RuntimeError(f"no {method!r} call is in flight on the lane's control")
            return None

    def _answered(self, reply: lane_control.Reply) -> bytes:
        if reply.failed:
            raise _rpc_error(reply)
        self.calls += 1
        return reply.body

    def _poll(self, events: int, timeout_s: float) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), events)
        poller.poll(timeout_s * 1000)

    def _fileno(self) -> int:
        return -1 if self.closed else self._sock.fileno()

    def _read(self) -> None:
        """Read what came (not waiting), keep each whole reply for its caller and wake the
        loop's callers of those; the connection is closed when it ended or broke the
        protocol."""
        with self._lock:
            if self.closed:
                return
            why = ""
            try:
                while True:
                    data = self._sock.recv(1 << 16)
                    if not data:
                        raise lane_control.ControlError(
                            "the shard closed the lane's control connection"
                        )
                    self._buffer += data
                    if len(data) < 1 << 16:
                        break
            except (BlockingIOError, InterruptedError):
                pass
            except (lane_control.ControlError, OSError) as exc:
                why = str(exc)
            woken = []
            try:
                for reply in lane_control.split_replies(self._buffer):
                    if reply.method not in self._in_flight or reply.method in self._kept:
                        raise lane_control.ControlError(f"a reply to no {reply.method!r} call")
                    self._kept[reply.method] = reply
                    if reply.method in self._waiting:
                        woken.append(self._waiting[reply.method])
            except lane_control.ControlError as exc:
                why = why or str(exc)
            loop = self._loop
        if why:
            self.close(f"the lane's control connection ended: {why}")
        elif woken and loop is not None:
            if _running() is loop:
                _wake(woken)
            else:  # (read by another thread while the loop waits too)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_wake, woken)

    def _release(
        self, loop: asyncio.AbstractEventLoop, waiting: list[asyncio.Future[None]]
    ) -> None:
        """Closed: the loop stops reading the socket, closes it and wakes its callers (on
        the loop)."""
        with self._lock:
            reading = self._loop is loop
            self._loop = None
        if reading and self._sock.fileno() != -1:
            loop.remove_reader(self._sock.fileno())
        self._sock.close()
        _wake(waiting)


def wait_any(controls: Sequence[LaneControl], timeout_s: float) -> None:
    """Wait on this thread until something came on one of ``controls`` (at most
    ``timeout_s``), then read what came on each (:meth:`LaneControl.answered` tells)."""
    poller = select.poll()
    for control in controls:
        fd = control._fileno()
        if fd != -1:
            poller.register(fd, select.POLLIN)
    try:
        poller.poll(timeout_s * 1000)
    except OSError:  # (interrupted: read what came, the caller waits again)
        pass
    for control in controls:
        control._read()


def _running() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _wake(waiting: Sequence[asyncio.Future[None]]) -> None:
    for future in waiting:
        if not future.done():
            future.set_result(None)


def _rpc_error(reply: lane_control.Reply) -> aio.AioRpcError:
    """The error gRPC would have raised for a call that ended as ``reply`` (failed) says."""
    code = _STATUS.get(reply.code, grpc.StatusCode.UNKNOWN)
    return aio.AioRpcError(
        code, aio.Metadata(), aio.Metadata(*reply.metadata), details=reply.details
    )


class NoAnswer(LaneError):
    """No answer came on a :class:`DirectControl` within the wait (it is closed)."""


class DirectControl:
    """The control connection of a lane with no tensors (a collective-mode learner's, to its
    coordinator's shard), used by the one thread that votes, blocking: a Boundary sent and
    its answer read on the trainer's thread, with no hop to the backend's event loop and back
    (docs/data-plane.md, "Collective mode: a lane for the control only"). Nothing else reads
    the connection. Whatever goes wrong on it closes it (an answer still due would be read
    by nobody), and the caller asks again on gRPC."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._wait_s: float | None = None  # the socket's timeout (set when it changes)
        self.calls = 0  # answered through it
        self.closed = False

    def boundary(
        self, request: ps_pb2.BoundaryRequest, *, wait_s: float
    ) -> ps_pb2.BoundaryResponse:
        """The coordinator's answer to ``request``; the :class:`grpc.aio.AioRpcError` gRPC
        would have raised (the connection stays open); :class:`LaneError` when the connection
        is closed or ends; :class:`NoAnswer` when none came within ``wait_s`` (it is closed
        then)."""
        self.send_boundary(request, wait_s=wait_s)
        return self.boundary_answer(wait_s=wait_s)

    def send_boundary(self, request: ps_pb2.BoundaryRequest, *, wait_s: float) -> None:
        """Send ``request`` without waiting for its answer (:meth:`boundary_answer` reads it:
        the vote ahead); errors as :meth:`boundary`'s."""
        data = lane_control.request(lane_control.BOUNDARY, request.SerializeToString())
        self._io(lambda: self._sock.sendall(data), wait_s)

    def boundary_answer(self, *, wait_s: float) -> ps_pb2.BoundaryResponse:
        """The answer to the Boundary sent last, within ``wait_s``; errors as
        :meth:`boundary`'s."""
        reply = self._io(lambda: lane_control.recv_reply(self._sock), wait_s)
        if reply.method != lane_control.BOUNDARY:
            self.close()
            raise LaneError(f"a reply to no {reply.method!r} call on the lane's control connection")
        if reply.failed:
            raise _rpc_error(reply)
        self.calls += 1
        return ps_pb2.BoundaryResponse.FromString(reply.body)

    def _io(self, call: Callable[[], T], wait_s: float) -> T:
        if self.closed:
            raise LaneError("the lane's control connection is closed")
        try:
            if wait_s != self._wait_s:
                self._sock.settimeout(wait_s)
                self._wait_s = wait_s
            return call()
        except TimeoutError:
            self.close()
            raise NoAnswer(
                f"no answer on the lane's control connection within {wait_s} s"
            ) from None
        except OSError as exc:  # ControlError too (a ConnectionError)
            self.close()
            raise LaneError(f"the lane's control connection ended: {exc}") from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()


@dataclass
class ClientLane:
    """A mapped lane segment and its two regions (as the shard gave them, checked)."""

    segment: Segment
    in_offset: int
    in_capacity: int
    out_offset: int
    rounds: int = 0  # SyncSteps that went through it
    control: LaneControl | None = None  # its control connection, while open
    direct: DirectControl | None = None  # instead, that of a lane with no tensors
    # The job's answer segment on that shard, mapped read-only, and where its answers lie
    # (None: the answers are in this lane's out-region).
    answers: Segment | None = None
    answers_offset: int = 0

    @property
    def answer_segment(self) -> Segment:
        """The segment the shard's answers are in."""
        return self.segment if self.answers is None else self.answers

    def write(self, metas: Sequence[TensorMeta], sources: Sequence[np.ndarray], total: int) -> int:
        """Copy a bundle's bytes (``sources[j]`` at ``metas[j].offset``) into the in-region;
        returns the offset the header must name."""
        view = self.segment.region(
            self.in_offset,
            total,
            lo=self.in_offset,
            hi=self.in_offset + self.in_capacity,
            what="bundle",
        )
        target = np.frombuffer(view, dtype=np.uint8)
        for m, source in zip(metas, sources, strict=True):
            target[m.offset : m.end] = source
        return self.in_offset

    def answer_views(
        self, header: ps_pb2.TensorBundleHeader, metas: Sequence[TensorMeta]
    ) -> list[torch.Tensor]:
        """The shard's answer as tensors viewing the out-region (no copy): ``metas[j]`` at
        ``header.shared_memory_offset + metas[j].offset``. The range must lie in the
        out-region and the layout be well formed (:class:`LaneError` otherwise). The shard
        writes that range again only with its answer to this learner's next contribution (in
        a shared answer segment, to the next contributions of all the job's members: so after
        this learner's too). Those of a shared answer segment are read-only."""
        segment = self.answer_segment
        view = segment.region(
            header.shared_memory_offset,
            header.total_bytes,
            lo=self.out_offset if self.answers is None else self.answers_offset,
            hi=segment.size,
            what="header.shared_memory_offset",
        )
        try:
            validate_layout(metas, header.total_bytes, what="header.tensors")
        except BundleError as exc:
            raise LaneError(str(exc)) from None
        flat = np.frombuffer(view, dtype=np.uint8)
        out: list[torch.Tensor] = []
        for m in metas:
            if m.numel == 0:
                out.append(torch.empty(m.shape, dtype=m.torch_dtype))
                continue
            with warnings.catch_warnings():  # a read-only answer: nothing writes to it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(flat[m.offset : m.end])
            out.append(raw.view(m.torch_dtype).view(m.shape))
        self.rounds += 1
        return out

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        if self.direct is not None:
            self.direct.close()
        self.segment.close()
        if self.answers is not None:
            self.answers.close()


#: Seconds the learner waits for the shard's socket to hand the descriptor.
FETCH_TIMEOUT_S = 10.0


def _take_segment(
    address: str, token: bytes, size: int, nonce: bytes
) -> tuple[Segment, socket.socket]:
    """Fetch the descriptor, check and map the segment behind it, close the descriptor; the
    segment and the connection it came over."""
    fd, sock = fetch_fd_keeping(address, token, timeout=FETCH_TIMEOUT_S)
    try:
        return Segment.from_fd(fd, size, nonce), sock
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(fd)


async def open_lane(
    stub: Any,
    *,
    job_id: str,
    learner_id: str,
    metadata: Any,
    address: str,
    shm_dir: str = SHM_DIR,
    control: bool = True,
    control_only: bool = False,
) -> ClientLane | None:
    """This learner's lane on the shard behind ``stub``, or None (stay on gRPC streams);
    with ``control``, its headers go on the lane's control connection. ``control_only``
    (a collective-mode learner, to its coordinator's shard): a lane with no tensor region,
    for its control connection only, held as a :class:`DirectControl` (``lane.direct``)."""
    mine = host_id(shm_dir)
    if not mine:
        return None
    request = ps_pb2.OpenSharedLaneRequest(
        job_id=job_id,
        learner_id=learner_id,
        host_id=mine,
        fetch_fd=True,
        shared_answer=not control_only,
        control_only=control_only,
    )
    try:
        # (A control-only lane is asked for on the way to a Boundary: a coordinator that hangs
        # must not hold that up for long; the Boundary's own watch then finds where it went.)
        timeout = 2.0 if control_only else 10.0
        reply = await stub.OpenSharedLane(request, metadata=metadata, timeout=timeout)
    except aio.AioRpcError as exc:  # an older shard (UNIMPLEMENTED), a shard going away
        log.info("no shared-memory lane to shard %s: %s", address, exc.details() or exc.code())
        return None
    if reply.refused:
        log.info("no shared-memory lane to shard %s: %s", address, reply.refused)
        return None
    if not reply.socket_address:  # an older shard: a named segment, which this learner skips
        log.info("no shared-memory lane to shard %s: it offers a named segment", address)
        # Have it drop the segment now (its name would stay up to 30 s, the memory till the
        # job ends).
        close = ps_pb2.OpenSharedLaneRequest(job_id=job_id, learner_id=learner_id, close=True)
        with contextlib.suppress(aio.AioRpcError):
            await stub.OpenSharedLane(close, metadata=metadata, timeout=2.0)
        return None
    if not 0 < reply.in_offset <= reply.in_offset + reply.in_capacity <= reply.out_offset:
        log.warning("shard %s offered a malformed lane: %s", address, reply)
        return None
    try:
        segment, sock = await asyncio.to_thread(
            _take_segment, reply.socket_address, reply.token, reply.size, reply.nonce
        )
    except (OSError, LaneError) as exc:  # another network namespace, another user, refused
        log.info("no shared-memory lane to shard %s: %s", address, exc)
        return None
    lane = ClientLane(segment, reply.in_offset, reply.in_capacity, reply.out_offset)
    why = ""
    if reply.answer_token:  # the answers are in the job's answer segment on that shard
        try:
            lane.answers = await asyncio.to_thread(
                functools.partial(
                    take_segment,
                    reply.socket_address,
                    reply.answer_token,
                    reply.answer_size,
                    reply.answer_nonce,
                    read_only=True,  # (it must be sealed so)
                    timeout=FETCH_TIMEOUT_S,
                )
            )
        except (OSError, LaneError) as exc:
            why = f"its answer segment: {exc}"
        lane.answers_offset = reply.answer_offset
        if lane.answers is not None and not 0 < reply.answer_offset <= lane.answers.size:
            why = f"answer_offset ({reply.answer_offset}) is outside its answer segment"
    if reply.out_offset > segment.size:
        why = f"out_offset ({reply.out_offset}) is outside its segment ({segment.size} bytes)"
    if why:
        log.info("no shared-memory lane to shard %s: %s", address, why)
        sock.close()
        lane.close()
        return None
    if control_only:  # (its one caller is the trainer's thread, blocking)
        lane.direct = DirectControl(sock)
        log.info("control connection to shard %s open: the Boundaries go on it", address)
        return lane
    if control:
        lane.control = LaneControl(sock)
    else:
        sock.close()
    log.info(
        "shared-memory lane to shard %s open (%d bytes): tensors move through it, %s carries "
        "the headers",
        address,
        reply.size,
        "its control connection" if control else "gRPC",
    )
    return lane


async def close_lane(stub: Any, lane: ClientLane, *, job_id: str, learner_id: str, md: Any) -> None:
    """Tell the shard to drop the lane (best effort) and unmap it."""
    request = ps_pb2.OpenSharedLaneRequest(job_id=job_id, learner_id=learner_id, close=True)
    try:
        await stub.OpenSharedLane(request, metadata=md, timeout=2.0)
    except aio.AioRpcError:
        pass  # the shard drops it with the job, or when it exits
    finally:
        lane.close()
