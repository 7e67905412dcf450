"""Who calls and what they may call: the :class:`Principal` of a call (set for its handler by
the auth interceptor), its :class:`Role`, and :class:`MethodRoles`, the roles each method of a
service allows.

Part of :mod:`shoal.runtime.auth`, which re-exports every name here.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


class Role(enum.Enum):
    USER = "user"
    SERVICE = "service"
    ADMIN = "admin"
    LEARNER = "learner"


@dataclass(frozen=True)
class Principal:
    """Who is calling. Learners carry the job and learner (and start) their credential was
    minted for; every other principal has them empty."""

    name: str
    role: Role
    job_id: str = ""
    learner_id: str = ""
    start: str = ""

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    @property
    def is_learner(self) -> bool:
        return self.role is Role.LEARNER


# The principal of the call being handled; set by the auth interceptor for the handler.
_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "shoal_principal", default=None
)

ANONYMOUS = Principal("anonymous", Role.ADMIN)


def current_principal() -> Principal:
    """The caller of the RPC being handled (ANONYMOUS, an admin, when auth is disabled)."""
    principal = _current.get()
    return principal if principal is not None else ANONYMOUS


def set_current_principal(principal: Principal | None) -> contextvars.Token[Principal | None]:
    return _current.set(principal)


def token_digest(token: str) -> str:
    """The sha256 (lowercase hex) under which a token is known."""
    return hashlib.sha256(token.encode()).hexdigest()


_digest = token_digest


class Authenticator(Protocol):
    """Anything that turns a bearer token into a principal (None: not a known credential)."""

    def authenticate(self, token: str) -> Principal | None: ...


@dataclass(frozen=True)
class MethodRoles:
    """Which roles may call which methods of a service.

    ``default`` applies to methods not in ``methods``. Admin may always call.
    Method names are short (``"SubmitJob"``); the service is the gRPC full service name.
    """

    service: str
    default: frozenset[Role]
    methods: Mapping[str, frozenset[Role]] = None  # type: ignore[assignment]

    def allowed(self, method: str) -> frozenset[Role]:
        roles = (self.methods or {}).get(method, self.default)
        return roles | {Role.ADMIN}


USERS_AND_SERVICES = frozenset({Role.USER, Role.SERVICE})
SERVICES = frozenset({Role.SERVICE})
ADMINS = frozenset({Role.ADMIN})
LEARNERS = frozenset({Role.LEARNER})

# Paths that never need a token.
PUBLIC_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
