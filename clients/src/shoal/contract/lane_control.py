"""The same-host lane's control channel (docs/data-plane.md, "The lane's control channel"):
the framing both ends of it share.

The Unix connection a learner fetched its lane's descriptor over (``lane_handoff``) stays
open when the shard offered the lane with ``keep``, and from then on carries the lane's
SyncSteps instead of gRPC: the header alone (the bytes are in the segment), one call at a
time, in turns:

* learner -> shard: a :data:`LENGTH` prefix and a serialized ``SyncStepRequest`` (its header
  says ``shared_memory``);
* shard -> learner: a kind byte, a :data:`LENGTH` prefix and the payload: :data:`ANSWER` and
  the serialized ``SyncStepResponse`` gRPC would have carried, or :data:`FAILURE` and the
  status gRPC would have ended the call with (:func:`failure`: code, details, trailing
  metadata; JSON).

Only the learner the lane was opened for can hold that connection (the token came on its
authenticated gRPC channel, the peer is checked by ``SO_PEERCRED``), and the shard speaks on
it only for that lane. A message beyond :data:`MAX_MESSAGE_BYTES`, a request before the answer
to the one before it, or anything the shard cannot read ends the connection (the learner goes
back to gRPC); so does either end closing it, which cancels a SyncStep in flight as a
cancelled gRPC call would.

Nothing here imports gRPC or torch.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ANSWER",
    "FAILURE",
    "LENGTH",
    "MAX_MESSAGE_BYTES",
    "ControlError",
    "Reply",
    "answer",
    "failure",
    "read_reply",
    "read_request",
    "request",
]

#: The prefix of every message: its payload's length (big-endian, unsigned, 4 bytes).
LENGTH = struct.Struct(">I")
#: The most a message may carry: a lane header names tensors, it carries none of their bytes.
MAX_MESSAGE_BYTES = 4 << 20
#: A reply's kinds: the answer, or the status of a call that failed.
ANSWER = b"A"
FAILURE = b"E"


class ControlError(ConnectionError):
    """The other end sent what the protocol does not allow (the connection must end)."""


@dataclass(frozen=True)
class Reply:
    """One reply: the answer's bytes, or a failed call's status."""

    body: bytes = b""
    code: int = 0  # a failure's gRPC status code (0: an answer)
    details: str = ""
    metadata: tuple[tuple[str, str], ...] = ()

    @property
    def failed(self) -> bool:
        return self.code != 0


def request(body: bytes) -> bytes:
    """A learner's request: a serialized ``SyncStepRequest``."""
    return LENGTH.pack(len(body)) + body


def answer(body: bytes) -> bytes:
    """The shard's reply with the answer (a serialized ``SyncStepResponse``)."""
    return ANSWER + LENGTH.pack(len(body)) + body


def failure(code: int, details: str, metadata: Sequence[tuple[str, str]] = ()) -> bytes:
    """The shard's reply for a call that failed with this status (``code`` > 0)."""
    if code <= 0:
        raise ValueError(f"code ({code}) must be a failing status code (> 0)")
    body = json.dumps(
        {"code": code, "details": details, "metadata": [list(kv) for kv in metadata]}
    ).encode()
    return FAILURE + LENGTH.pack(len(body)) + body


async def _payload(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ControlError("the connection ended inside a message's length") from None
        return None
    (size,) = LENGTH.unpack(head)
    if size > MAX_MESSAGE_BYTES:
        raise ControlError(f"a message of {size} bytes (the most is {MAX_MESSAGE_BYTES})")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ControlError("the connection ended inside a message") from None


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """The next request's body; None when the learner closed the connection between two."""
    return await _payload(reader)


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    """The shard's reply. :class:`ControlError` when the connection ended before it, or the
    reply is not one of the protocol's."""
    kind = await reader.read(1)
    if not kind:
        raise ControlError("the shard closed the lane's control connection")
    if kind not in (ANSWER, FAILURE):
        raise ControlError(f"a reply of unknown kind {kind!r}")
    body = await _payload(reader)
    if body is None:
        raise ControlError("the connection ended inside a reply")
    if kind == ANSWER:
        return Reply(body=body)
    try:
        status = json.loads(body)
        code = int(status["code"])
        details = str(status["details"])
        metadata = tuple((str(k), str(v)) for k, v in status["metadata"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ControlError(f"a failure reply that does not parse: {exc}") from None
    if code <= 0:
        raise ControlError(f"a failure reply with code {code}")
    return Reply(code=code, details=details, metadata=metadata)
