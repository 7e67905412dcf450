"""Bearer-token authentication and role-based authorization for every shoal service.

A tokens file maps tokens to principals and roles, one per line::

    # token                       principal   role
    5f1c...e9                     alice       user
    sha256:4b2a...                scheduler   service
    c0ff...ee                     root        admin

A token may be given as ``sha256:<hex>`` so that the file holds no secret. Roles are ordered:
``admin`` may do everything, ``service`` what services do to each other, ``user`` the job API.
A call without a token, or with an unknown one, fails with UNAUTHENTICATED; a known token with
a role that the method does not allow fails with PERMISSION_DENIED. Neither runs the handler.
Health checking and server reflection need no token.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shoal.runtime.errors import InvalidField


class Role(enum.Enum):
    USER = "user"
    SERVICE = "service"
    ADMIN = "admin"


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN


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


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class TokenTable:
    """Token digests (sha256 hex) to principals."""

    by_digest: Mapping[str, Principal]

    @classmethod
    def parse(cls, text: str, *, source: str = "<tokens>") -> TokenTable:
        entries: dict[str, Principal] = {}
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            where = f"{source}:{lineno}"
            if len(parts) != 3:
                raise InvalidField(
                    f"tokens file line {where}", raw.strip(), "must be 'TOKEN PRINCIPAL ROLE'"
                )
            token, name, role_name = parts
            try:
                role = Role(role_name)
            except ValueError:
                raise InvalidField(
                    f"role at {where}", role_name, "must be one of user, service, admin"
                ) from None
            digest = (
                token.removeprefix("sha256:").lower()
                if token.startswith("sha256:")
                else (_digest(token))
            )
            if len(digest) != 64:
                raise InvalidField(f"token at {where}", token[:12] + "...", "is not a sha256 hex")
            entries[digest] = Principal(name, role)
        return cls(entries)

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise InvalidField("tokens_file", str(p), f"cannot be read: {exc.strerror}") from exc
        return cls.parse(text, source=str(p))

    def authenticate(self, token: str) -> Principal | None:
        digest = _digest(token)
        for known, principal in self.by_digest.items():
            if hmac.compare_digest(known, digest):
                return principal
        return None


def new_token() -> str:
    """A fresh random bearer token (256 bits)."""
    return secrets.token_hex(32)


def write_tokens_file(path: str | Path, entries: list[tuple[str, str, Role]]) -> None:
    """Write a tokens file (mode 0600) for (token, principal, role) entries."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# token principal role"] + [f"{t} {n} {r.value}" for t, n, r in entries]
    p.touch(mode=0o600, exist_ok=True)
    p.chmod(0o600)
    p.write_text("\n".join(lines) + "\n")


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

# Paths that never need a token.
PUBLIC_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
