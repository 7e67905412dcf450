"""How a shoal record stored in etcd is encoded: one protobuf message per key, and the JSON of
earlier releases still read until a leader rewrites it.

The scheduler's job records (``JobRecordState``) and the coordinator records
(``CoordinatorRecordState``, ``shoal.contract.data_plane``) were JSON documents before they
were messages. A serialized message never starts with ``{`` (that byte would be field 15 as a
group), so :func:`is_legacy_json` tells the two apart by the first byte; :func:`parse` reads a
message and names what it is not.

This module imports neither grpc nor torch (protobuf only).
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

__all__ = ["is_legacy_json", "parse"]

M = TypeVar("M", bound=Message)


def is_legacy_json(data: bytes) -> bool:
    """Whether ``data`` is a record in the JSON encoding of an earlier release."""
    return data[:1] == b"{"


def parse(message: type[M], data: bytes, what: str, error: type[ValueError] = ValueError) -> M:
    """``message`` parsed from ``data``; bytes that are not one raise ``error`` naming ``what``,
    the size and the message type."""
    try:
        return message.FromString(data)
    except DecodeError as exc:
        raise error(
            f"{what} ({len(data)} bytes) is not a {message.DESCRIPTOR.name}: {exc}"
        ) from None
