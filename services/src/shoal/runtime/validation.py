"""Identifier checks of whole request messages, by field name (``shoal.contract.ids``).

The server interceptor runs :func:`check_request_ids` on every request message of every method
of every service (each message of a request stream too) before the handler sees it, so a new
method that takes a ``job_id`` is covered without anyone remembering to check it. Empty values
pass (a field that is not set); handlers still say which fields are required.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from shoal.contract import ids
from shoal.runtime.errors import InvalidField

__all__ = ["check_request_ids"]

_MAX_DEPTH = 32


def check_request_ids(message: Any) -> None:
    """Raise :class:`InvalidField` (naming the field path and the value) for the first
    identifier field of ``message`` that does not match its kind's pattern. A decoded tensor
    frame (an object with a protobuf ``header``) is checked by its header."""
    if not isinstance(message, Message):
        header = getattr(message, "header", None)
        if not isinstance(header, Message):
            return
        message = header
    _walk(message, "", 0)


def _walk(message: Message, path: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        return
    for fd, value in message.ListFields():
        name = f"{path}{fd.name}"
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                continue  # maps (env, labels, values) hold no identifiers
            if fd.is_repeated:
                for i, item in enumerate(value):
                    _walk(item, f"{name}[{i}].", depth + 1)
            else:
                _walk(value, f"{name}.", depth + 1)
            continue
        kind = ids.FIELD_KINDS.get(fd.name)
        if kind is None or fd.type != FieldDescriptor.TYPE_STRING:
            continue
        values = value if fd.is_repeated else (value,)
        for i, item in enumerate(values):
            if item == "" or ids.is_valid(kind, item):
                continue
            where = f"{name}[{i}]" if fd.is_repeated else name
            try:
                ids.check(kind, item, field_name=where)
            except ids.InvalidIdentifier as exc:
                raise InvalidField(where, _short(item), exc.rule) from None


def _short(value: str) -> str:
    return value if len(value) <= 64 else value[:40] + f"...({len(value)} characters)"
