"""The same-host lane's control channel (docs/data-plane.md, "The lane's control channel"):
the framing both ends of it share.

The Unix connection a learner fetched its lane's descriptor over (``lane_handoff``) stays
open when the shard offered the lane with ``keep``, and from then on carries the lane's
calls instead of gRPC: its SyncSteps (the header alone: the bytes are in the segment) and,
when the job's coordinator runs in that shard's process, its Boundaries. At most one call of
each method is in flight at a time (a Boundary is sent beside its SyncStep):

* learner -> shard: the method byte (:data:`SYNC_STEP` or :data:`BOUNDARY`), a :data:`LENGTH`
  prefix and the serialized request (a ``SyncStepRequest`` whose header says
  ``shared_memory``, or a ``BoundaryRequest``);
* shard -> learner, as each call ends: the method byte, a status byte and a :data:`LENGTH`
  prefixed payload: :data:`ANSWER` and the serialized response gRPC would have carried, or
  :data:`FAILURE` and the status gRPC would have ended the call with (:func:`failure`: code,
  details, trailing metadata; JSON).

Only the learner the lane was opened for can hold that connection (the token came on its
authenticated gRPC channel, the peer is checked by ``SO_PEERCRED``), and the shard speaks on
it only for that lane's learner. An unknown method, a message beyond
:data:`MAX_MESSAGE_BYTES`, a second call of a method before the answer to the first, or
anything the shard cannot read ends the connection (the learner goes back to gRPC); so does
either end closing it, which cancels the calls in flight as cancelled gRPC calls would be.

Nothing here imports gRPC or torch.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ANSWER",
    "BOUNDARY",
    "FAILURE",
    "LENGTH",
    "MAX_MESSAGE_BYTES",
    "METHODS",
    "SYNC_STEP",
    "ControlError",
    "Reply",
    "answer",
    "failure",
    "read_reply",
    "read_request",
    "recv_reply",
    "request",
    "split_replies",
]

#: The prefix of every payload: its length (big-endian, unsigned, 4 bytes).
LENGTH = struct.Struct(">I")
#: The most a message may carry: a lane header names tensors, it carries none of their bytes.
MAX_MESSAGE_BYTES = 4 << 20
#: The methods: a SyncStep of the lane, a Boundary of its learner.
SYNC_STEP = b"S"
BOUNDARY = b"B"
METHODS = frozenset({SYNC_STEP, BOUNDARY})
#: A reply's status: the answer, or the status of a call that failed.
ANSWER = b"A"
FAILURE = b"E"


class ControlError(ConnectionError):
    """The other end sent what the protocol does not allow (the connection must end)."""


@dataclass(frozen=True)
class Reply:
    """One reply: the answer's bytes, or a failed call's status."""

    method: bytes
    body: bytes = b""
    code: int = 0  # a failure's gRPC status code (0: an answer)
    details: str = ""
    metadata: tuple[tuple[str, str], ...] = ()

    @property
    def failed(self) -> bool:
        return self.code != 0


def _method(method: bytes) -> bytes:
    if method not in METHODS:
        raise ValueError(f"method ({method!r}) must be one of {sorted(METHODS)}")
    return method


def request(method: bytes, body: bytes) -> bytes:
    """A learner's request: ``method`` and the serialized request."""
    return _method(method) + LENGTH.pack(len(body)) + body


def answer(method: bytes, body: bytes) -> bytes:
    """The shard's reply to a ``method`` call with its answer (a serialized response)."""
    return _method(method) + ANSWER + LENGTH.pack(len(body)) + body


def failure(
    method: bytes, code: int, details: str, metadata: Sequence[tuple[str, str]] = ()
) -> bytes:
    """The shard's reply to a ``method`` call that failed with this status (``code`` > 0)."""
    if code <= 0:
        raise ValueError(f"code ({code}) must be a failing status code (> 0)")
    body = json.dumps(
        {"code": code, "details": details, "metadata": [list(kv) for kv in metadata]}
    ).encode()
    return _method(method) + FAILURE + LENGTH.pack(len(body)) + body


async def _payload(reader: asyncio.StreamReader) -> bytes:
    try:
        (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    except asyncio.IncompleteReadError:
        raise ControlError("the connection ended inside a message's length") from None
    if size > MAX_MESSAGE_BYTES:
        raise ControlError(f"a message of {size} bytes (the most is {MAX_MESSAGE_BYTES})")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ControlError("the connection ended inside a message") from None


async def _method_byte(reader: asyncio.StreamReader) -> bytes | None:
    method = await reader.read(1)
    if not method:
        return None
    if method not in METHODS:
        raise ControlError(f"a message of unknown method {method!r}")
    return method


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """The next request's method and body; None when the learner closed the connection
    between two. :class:`ControlError` for anything the protocol does not allow."""
    method = await _method_byte(reader)
    if method is None:
        return None
    return method, await _payload(reader)


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    """The shard's next reply. :class:`ControlError` when the connection ended before it, or
    the reply is not one of the protocol's."""
    method = await _method_byte(reader)
    if method is None:
        raise ControlError("the shard closed the lane's control connection")
    try:
        status = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        raise ControlError("the connection ended inside a reply") from None
    _check_status(status)
    return _reply(method, status, await _payload(reader))


def recv_reply(sock: socket.socket) -> Reply:
    """:func:`read_reply` from a blocking socket (its timeout applies to each receive:
    ``TimeoutError``)."""
    method = sock.recv(1)
    if not method:
        raise ControlError("the shard closed the lane's control connection")
    if method not in METHODS:
        raise ControlError(f"a message of unknown method {method!r}")
    status = _recv_exactly(sock, 1, "a reply")
    _check_status(status)
    (size,) = LENGTH.unpack(_recv_exactly(sock, LENGTH.size, "a message's length"))
    if size > MAX_MESSAGE_BYTES:
        raise ControlError(f"a message of {size} bytes (the most is {MAX_MESSAGE_BYTES})")
    return _reply(method, status, _recv_exactly(sock, size, "a message"))


def split_replies(buffer: bytearray) -> list[Reply]:
    """The replies read whole at the start of ``buffer`` (taken off it; a reply not whole
    yet stays). :class:`ControlError` for anything the protocol does not allow."""
    replies = []
    start = 0
    head = 2 + LENGTH.size  # method, status, length
    while len(buffer) - start >= head:
        method, status = bytes(buffer[start : start + 1]), bytes(buffer[start + 1 : start + 2])
        if method not in METHODS:
            raise ControlError(f"a message of unknown method {method!r}")
        _check_status(status)
        (size,) = LENGTH.unpack_from(buffer, start + 2)
        if size > MAX_MESSAGE_BYTES:
            raise ControlError(f"a message of {size} bytes (the most is {MAX_MESSAGE_BYTES})")
        if len(buffer) - start - head < size:
            break
        body = bytes(buffer[start + head : start + head + size])
        replies.append(_reply(method, status, body))
        start += head + size
    del buffer[:start]
    return replies


def _recv_exactly(sock: socket.socket, size: int, what: str) -> bytes:
    parts = []
    left = size
    while left:
        part = sock.recv(left)
        if not part:
            raise ControlError(f"the connection ended inside {what}")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _check_status(status: bytes) -> None:
    if status not in (ANSWER, FAILURE):
        raise ControlError(f"a reply of unknown status {status!r}")


def _reply(method: bytes, status: bytes, body: bytes) -> Reply:
    """A reply read whole: its answer, or its failure's status parsed."""
    if status == ANSWER:
        return Reply(method, body=body)
    try:
        parsed = json.loads(body)
        code = int(parsed["code"])
        details = str(parsed["details"])
        metadata = tuple((str(k), str(v)) for k, v in parsed["metadata"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ControlError(f"a failure reply that does not parse: {exc}") from None
    if code <= 0:
        raise ControlError(f"a failure reply with code {code}")
    return Reply(method, code=code, details=details, metadata=metadata)
