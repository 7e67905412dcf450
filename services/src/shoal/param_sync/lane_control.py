# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The shard's side of a same-host lane's control channel (docs/data-plane.md, "The lane's
control channel"; the framing: ``shoal.contract.lane_control``). Part of the
ParameterSyncService servicer (``service.py``).

OpenSharedLane offers the lane's descriptor with ``keep``: the Unix connection the learner
fetched it over then serves that lane's SyncSteps and its learner's Boundaries (at most one
of each in flight) through the very handlers gRPC calls (:meth:`DataHandlers.SyncStep`,
:meth:`LearnerHandlers.Boundary`), under the principal that opened the lane (the
OpenSharedLane caller: the same roles may call both), with the identifiers checked as the
interceptor checks them, and failures mapped to the status gRPC would have ended the call
with (``ERRORS``). Beyond that the connection speaks only for its lane's learner: a request
naming another job or learner, or a SyncStep header without ``shared_memory``, is refused.

The connection ends when the learner closes it (the calls in flight are cancelled, as
cancelled gRPC calls are), when it breaks the protocol (a second call of a method before the
answer to the first, a message too long or unreadable), and when the lane goes
(``Lane.close``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from shoal.contract import lane_control
from shoal.contract.wire import Frame, decode_frame
from shoal.param_sync.servicer_common import ERRORS
from shoal.runtime.auth import Principal, set_current_principal
from shoal.runtime.errors import InvalidField, PermissionDenied
from shoal.runtime.validation import check_request_ids
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S
    from shoal.param_sync.shm_lane import Lane

log = logging.getLogger("shoal.param_sync.service")

_INTERNAL = 13  # grpc.StatusCode.INTERNAL's number


class LaneControlHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    def _lane_control_keeper(
        self: _S, key: tuple[str, str], lane: Lane, principal: Principal
    ) -> Callable[[socket.socket], None]:
        """What takes the lane's handoff connection once its descriptor went (``keep``)."""

        def keep(conn: socket.socket) -> None:
            if self._lanes.get(key) is not lane or lane.control is not None:
                conn.close()  # the lane went (or was replaced) meanwhile
                return
            lane.control = asyncio.get_running_loop().create_task(
                self._serve_lane_control(key, principal, conn)
            )

        return keep

    async def _serve_lane_control(
        self: _S, key: tuple[str, str], principal: Principal, conn: socket.socket
    ) -> None:
        set_current_principal(principal)  # this task's context only (its calls copy it)
        reader, writer = await asyncio.open_unix_connection(sock=conn)
        calls: dict[bytes, asyncio.Task[bytes]] = {}  # in flight, by method
        answered = [0]

        def reply(method: bytes, task: asyncio.Task[bytes]) -> None:
            if calls.get(method) is task:
                del calls[method]
            if not task.cancelled() and not writer.is_closing():
                writer.write(task.result())  # (never raises: failures are replies too)
                answered[0] += 1

        try:
            while True:
                got = await lane_control.read_request(reader)
                if got is None:
                    return  # the learner closed it
                method, body = got
                if method in calls:
                    log.warning(
                        "job %s: learner %s sent a second %s call on its lane's control "
                        "before the answer to the first; closing it",
                        *key,
                        _NAMES[method],
                    )
                    return
                task = asyncio.ensure_future(self._lane_control_call(key, method, body))
                calls[method] = task
                task.add_done_callback(functools.partial(reply, method))
        except (lane_control.ControlError, ConnectionError) as exc:
            log.info("job %s: control of learner %s's lane ended: %s", *key, exc)
        finally:
            # The calls still in flight are cancelled, as gRPC cancels a call its client gave up.
            pending = list(calls.values())
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task
            writer.close()
            log.info(
                "job %s: control of learner %s's lane closed after %d calls", *key, answered[0]
            )

    async def _lane_control_call(
        self: _S, key: tuple[str, str], method: bytes, body: bytes
    ) -> bytes:
        """One call through the lane's control: the reply's bytes (never raises but for
        cancellation)."""
        try:
            if method == lane_control.SYNC_STEP:
                answer = await self._lane_sync_step(key, body)
            else:
                answer = await self._lane_boundary(key, body)
            self.metrics.lane_control_call(key[0], _NAMES[method])
            return lane_control.answer(method, answer)
        except Exception as exc:
            mapped = ERRORS.lookup(exc)
            if mapped is None:
                log.exception("job %s: lane control call of learner %s failed", *key)
                return lane_control.failure(
                    method, _INTERNAL, f"internal error ({type(exc).__name__})", ()
                )
            return lane_control.failure(
                method, mapped.code.value[0], mapped.message, mapped.metadata
            )

    async def _lane_sync_step(self: _S, key: tuple[str, str], body: bytes) -> bytes:
        try:
            frame = decode_frame(ps_pb2.SyncStepRequest, body)
        except Exception as exc:  # (protobuf's DecodeError, a bad varint)
            raise InvalidField("request", f"{len(body)} bytes", f"does not parse: {exc}") from None
        header = frame.header
        if header is None:
            raise InvalidField(
                "request", "a chunk or trailer", "must be a SyncStep header on the control"
            )
        check_request_ids(frame)
        _speaks_for(key, header.job_id, header.sender_id)
        if not header.shared_memory:
            raise InvalidField(
                "header.shared_memory", False, "must be set (the bytes are in the lane)"
            )
        messages = [m async for m in self.SyncStep(_only(frame), None)]
        if len(messages) != 1:
            raise RuntimeError(f"a lane SyncStep answered {len(messages)} messages")
        return messages[0]

    async def _lane_boundary(self: _S, key: tuple[str, str], body: bytes) -> bytes:
        try:
            request = ps_pb2.BoundaryRequest.FromString(body)
        except DecodeError as exc:
            raise InvalidField("request", f"{len(body)} bytes", f"does not parse: {exc}") from None
        check_request_ids(request)
        _speaks_for(key, request.job_id, request.learner_id)
        reply = await self.Boundary(request, None)
        return bytes(reply.SerializeToString())


def _speaks_for(key: tuple[str, str], job_id: str, learner_id: str) -> None:
    if (job_id, learner_id) != key:
        raise PermissionDenied(
            f"the control of learner {key[1]!r}'s lane of job {key[0]!r} speaks for it only, "
            f"not for learner {learner_id!r} of job {job_id!r}"
        )


_NAMES = {lane_control.SYNC_STEP: "SyncStep", lane_control.BOUNDARY: "Boundary"}


async def _only(frame: Frame) -> AsyncIterator[Frame]:
    yield frame
