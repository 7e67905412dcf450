"""Identifiers that become paths, keys or file names: one pattern per kind, in one place.

Every service checks every identifier it receives against these patterns before using it
(the services' server interceptor walks each request with :data:`FIELD_KINDS`), so that a
``job_id`` of ``../../etc`` can never name a directory outside storage, a learner id with a NUL
byte can never reach ``/proc``, and a host id with a Cyrillic look-alike letter can never
shadow a real host. The patterns are ASCII only and never start with a dot, so that no value is
``.`` or ``..`` and none hides as a dotfile.

==================  ==========================================  =========================
kind                pattern                                     examples
==================  ==========================================  =========================
job_id              ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``        ``job-4f1c2a9b03de``
learner_id          ``[A-Za-z0-9][A-Za-z0-9._-]{0,159}``        ``job-4f1c2a9b03de-l7``
host_id             ``[A-Za-z0-9][A-Za-z0-9._-]{0,252}``        ``host-1``, ``gpu-07.dc2``
device_id           ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``        ``gpu0``
resource_group      ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``        ``a100``
artifact_id         ``[0-9a-f]{64}`` (a lowercase sha256)       ``9f86d0...``
checkpoint_name     ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``        ``iter-460``
principal           ``[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}``      ``alice``, ``bob@example.org``
==================  ==========================================  =========================

This module imports neither grpc nor protobuf: :func:`check` works on plain strings, and
:data:`FIELD_KINDS` names the request fields (by their proto field name) that hold each kind.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping

from shoal.contract.errors import InvalidIdentifier

__all__ = [
    "FIELD_KINDS",
    "PATTERNS",
    "IdKind",
    "InvalidIdentifier",
    "check",
    "describe",
    "is_valid",
]


class IdKind(enum.Enum):
    """The kinds of identifiers; the value is the canonical field name."""

    JOB = "job_id"
    LEARNER = "learner_id"
    HOST = "host_id"
    DEVICE = "device_id"
    RESOURCE_GROUP = "resource_group"
    ARTIFACT = "artifact_id"
    CHECKPOINT = "checkpoint_name"
    PRINCIPAL = "principal"


def _name(max_length: int, extra: str = "") -> re.Pattern[str]:
    return re.compile(rf"[A-Za-z0-9][A-Za-z0-9._{extra}-]{{0,{max_length - 1}}}", re.ASCII)


#: The pattern of each kind (use with ``fullmatch``; :func:`check` does).
PATTERNS: Mapping[IdKind, re.Pattern[str]] = {
    IdKind.JOB: _name(128),
    IdKind.LEARNER: _name(160),
    IdKind.HOST: _name(253),
    IdKind.DEVICE: _name(128),
    IdKind.RESOURCE_GROUP: _name(128),
    IdKind.ARTIFACT: re.compile(r"[0-9a-f]{64}", re.ASCII),
    IdKind.CHECKPOINT: _name(128),
    IdKind.PRINCIPAL: _name(128, "@+"),
}

_RULES: Mapping[IdKind, str] = {
    IdKind.ARTIFACT: "must be a sha256 in lowercase hex (64 characters of 0-9a-f)",
    IdKind.PRINCIPAL: (
        "must be 1 to 128 characters of [A-Za-z0-9._@+-], starting with a letter or digit"
    ),
}

#: Request fields (proto field names) that hold identifiers, and their kind. A repeated field
#: of strings holds one identifier per entry. The services' interceptor checks every one of
#: these in every request message (at any depth) and refuses the call with INVALID_ARGUMENT.
FIELD_KINDS: Mapping[str, IdKind] = {
    "job_id": IdKind.JOB,
    "learner_id": IdKind.LEARNER,
    "learner_ids": IdKind.LEARNER,
    "member_learner_ids": IdKind.LEARNER,
    "stop_learner_ids": IdKind.LEARNER,
    "sender_id": IdKind.LEARNER,
    "host_id": IdKind.HOST,
    "device_id": IdKind.DEVICE,
    "resource_group": IdKind.RESOURCE_GROUP,
    "artifact_id": IdKind.ARTIFACT,
}


# InvalidIdentifier is defined with the other errors, in shoal.contract.errors.


def describe(kind: IdKind) -> str:
    """The rule of ``kind`` in words ("must be 1 to 128 characters of ..."), for messages."""
    return _rule(kind)


def _rule(kind: IdKind) -> str:
    rule = _RULES.get(kind)
    if rule is not None:
        return rule
    longest = PATTERNS[kind].pattern.rsplit(",", 1)[1].rstrip("}")
    return (
        f"must be 1 to {int(longest) + 1} characters of [A-Za-z0-9._-], starting with a "
        "letter or digit"
    )


def is_valid(kind: IdKind, value: object) -> bool:
    """Whether ``value`` is a string matching the pattern of ``kind``."""
    return isinstance(value, str) and PATTERNS[kind].fullmatch(value) is not None


def check(
    kind: IdKind, value: object, *, field_name: str | None = None, allow_empty: bool = False
) -> str:
    """``value`` if it is a valid identifier of ``kind`` (or empty, with ``allow_empty``);
    :class:`InvalidIdentifier` naming ``field_name`` (default: the kind's name) otherwise."""
    if allow_empty and value == "":
        return ""
    if not is_valid(kind, value):
        raise InvalidIdentifier(field_name or kind.value, value, _rule(kind))
    return str(value)
