"""Identifier checks of whole request messages, by field name (``shoal.contract.ids``).

The server interceptor runs :func:`check_request_ids` on every request message of every method
of every service (each message of a request stream too) before the handler sees it, so a new
method that takes a ``job_id`` is covered without anyone remembering to check it. Empty values
pass (a field that is not set); handlers still say which fields are required.

Each message type is planned once (which of its fields hold identifiers, which sub-messages may
hold some), so a check visits only those fields; the field path for the error message is built
only when a check fails.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from shoal.contract import ids
from shoal.contract.errors import InvalidField

__all__ = ["check_request_ids"]

_MAX_DEPTH = 32

# (field name, id kind or None, repeated, sub-message plan key or None)
_Step = tuple[str, ids.IdKind | None, bool, str | None]
_PLANS: dict[str, tuple[_Step, ...]] = {}


def _plan(desc: Any) -> tuple[_Step, ...]:
    plan = _PLANS.get(desc.full_name)
    if plan is not None:
        return plan
    _PLANS[desc.full_name] = ()  # a recursive type: planned as it is being planned
    steps: list[_Step] = []
    for fd in desc.fields:
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            sub = fd.message_type
            if sub is None or sub.GetOptions().map_entry:
                continue  # maps (env, labels, values) hold no identifiers
            if _plan(sub) or sub.full_name == desc.full_name:
                steps.append((fd.name, None, fd.is_repeated, sub.full_name))
            continue
        kind = ids.FIELD_KINDS.get(fd.name)
        if kind is not None and fd.type == FieldDescriptor.TYPE_STRING:
            steps.append((fd.name, kind, fd.is_repeated, None))
    plan = tuple(steps)
    _PLANS[desc.full_name] = plan
    return plan


def check_request_ids(message: Any) -> None:
    """Raise :class:`InvalidField` (naming the field path and the value) for the first
    identifier field of ``message`` that does not match its kind's pattern. A decoded tensor
    frame (an object with a protobuf ``header``) is checked by its header."""
    if not isinstance(message, Message):
        header = getattr(message, "header", None)
        if not isinstance(header, Message):
            return
        message = header
    bad = _first_bad(message, "", 0)
    if bad is not None:
        where, kind, value = bad
        raise InvalidField(where, _short(value), ids.describe(kind))


def _first_bad(message: Message, path: str, depth: int) -> tuple[str, ids.IdKind, str] | None:
    if depth > _MAX_DEPTH:
        return None
    for name, kind, repeated, sub in _plan(message.DESCRIPTOR):
        if sub is not None:
            if repeated:
                for i, item in enumerate(getattr(message, name)):
                    bad = _first_bad(item, f"{path}{name}[{i}].", depth + 1)
                    if bad is not None:
                        return bad
            elif message.HasField(name):
                bad = _first_bad(getattr(message, name), f"{path}{name}.", depth + 1)
                if bad is not None:
                    return bad
            continue
        assert kind is not None
        if repeated:
            for i, value in enumerate(getattr(message, name)):
                if value and not ids.is_valid(kind, value):
                    return f"{path}{name}[{i}]", kind, value
        else:
            value = getattr(message, name)
            if value and not ids.is_valid(kind, value):
                return f"{path}{name}", kind, value
    return None


def _short(value: str) -> str:
    return value if len(value) <= 64 else value[:40] + f"...({len(value)} characters)"
