# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The shard's side of a same-host lane's control channel (docs/data-plane.md, "The lane's
control channel"; the framing: ``shoal.contract.lane_control``). Part of the
ParameterSyncService servicer (``service.py``).

OpenSharedLane offers the lane's descriptor with ``keep``: the Unix connection the learner
fetched it over then serves that lane's SyncSteps, one at a time, through the very handler
gRPC calls (:meth:`DataHandlers.SyncStep`), under the principal that opened the lane (the
OpenSharedLane caller: the same roles may call SyncStep), with the identifiers checked as the
interceptor checks them, and failures mapped to the status gRPC would have ended the call
with (``ERRORS``). Beyond that the connection speaks only for its lane: a header naming
another job or learner, or one without ``shared_memory``, is refused.

The connection ends when the learner closes it (a SyncStep in flight is cancelled, as a
cancelled gRPC call is), when it breaks the protocol (a second request before the answer, a
message too long or unreadable), and when the lane goes (``Lane.close``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

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
        set_current_principal(principal)  # this task's context only
        reader, writer = await asyncio.open_unix_connection(sock=conn)
        pending: asyncio.Future[bytes | None] = asyncio.ensure_future(
            lane_control.read_request(reader)
        )
        call: asyncio.Future[bytes] | None = None
        answered = 0
        try:
            while True:
                body = await pending
                if body is None:
                    return  # the learner closed it between two calls
                call = asyncio.ensure_future(self._lane_control_call(key, body))
                pending = asyncio.ensure_future(lane_control.read_request(reader))
                await asyncio.wait((call, pending), return_when=asyncio.FIRST_COMPLETED)
                if not call.done():
                    # The learner closed the connection, or sent again before its answer:
                    # the call is cancelled, as gRPC cancels a call its client gave up.
                    error = pending.exception()
                    if error is not None:
                        log.info("job %s: control of learner %s's lane ended: %s", *key, error)
                    elif pending.result() is not None:
                        log.warning(
                            "job %s: learner %s sent a second request on its lane's control "
                            "before the answer; closing it",
                            *key,
                        )
                    return
                writer.write(call.result())
                call = None
                answered += 1
        except (lane_control.ControlError, ConnectionError) as exc:
            log.info("job %s: control of learner %s's lane ended: %s", *key, exc)
        finally:
            for task in (call, pending):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            writer.close()
            log.info("job %s: control of learner %s's lane closed after %d calls", *key, answered)

    async def _lane_control_call(self: _S, key: tuple[str, str], body: bytes) -> bytes:
        """One SyncStep through the lane's control: the reply's bytes (never raises but
        for cancellation)."""
        try:
            try:
                frame = decode_frame(ps_pb2.SyncStepRequest, body)
            except Exception as exc:  # (protobuf's DecodeError, a bad varint)
                raise InvalidField(
                    "request", f"{len(body)} bytes", f"does not parse: {exc}"
                ) from None
            header = frame.header
            if header is None:
                raise InvalidField(
                    "request", "a chunk or trailer", "must be a SyncStep header on the control"
                )
            check_request_ids(frame)
            if (header.job_id, header.sender_id) != key:
                raise PermissionDenied(
                    f"the control of learner {key[1]!r}'s lane of job {key[0]!r} speaks for "
                    f"it only, not for learner {header.sender_id!r} of job {header.job_id!r}"
                )
            if not header.shared_memory:
                raise InvalidField(
                    "header.shared_memory", False, "must be set (the bytes are in the lane)"
                )
            messages = [m async for m in self.SyncStep(_only(frame), None)]
            if len(messages) != 1:
                raise RuntimeError(f"a lane SyncStep answered {len(messages)} messages")
            self.metrics.lane_control_call(key[0])
            return lane_control.answer(messages[0])
        except Exception as exc:
            mapped = ERRORS.lookup(exc)
            if mapped is None:
                log.exception("job %s: lane control call of learner %s failed", *key)
                return lane_control.failure(_INTERNAL, f"internal error ({type(exc).__name__})", ())
            return lane_control.failure(mapped.code.value[0], mapped.message, mapped.metadata)


async def _only(frame: Frame) -> AsyncIterator[Frame]:
    yield frame
