"""Authentication and role-based authorization for every shoal service.

Who a caller is (its :class:`Principal`) comes from its bearer token, in one of two forms:

* **Opaque tokens** of users, services and admins, known by their sha256 digest. They come from
  a tokens file (``--tokens-file``; re-read within seconds when it changes) and from etcd
  (``/shoal/v1/auth/tokens/<sha256>``, a :class:`shoal.v1.auth_pb2.TokenRecord`), which every
  service watches, so adding or revoking a user takes effect on every replica within seconds
  (``shoal-service auth add-user | revoke | list``). A tokens file has one token per line::

      # token                       principal   role
      5f1c...e9                     alice       user
      sha256:4b2a...                scheduler   service
      c0ff...ee                     root        admin

  A token may be given as ``sha256:<hex>`` so that the file holds no secret.

* **Learner credentials**: signed tokens (JWT, EdDSA over Ed25519, PyJWT) that the job
  scheduler mints for each learner it starts, naming the job, the learner and the start
  (allocation) they were minted for, with an expiry. Every service verifies them with the
  scheduler's public keys (published in etcd under ``/shoal/v1/auth/learner-keys/<key id>``,
  or given with ``--learner-public-keys``), without a store round trip. The private key
  stays with the scheduler: a service that can verify credentials cannot mint them.

Roles: ``admin`` may do everything, ``service`` what services do to each other, ``user`` the job
API for its own jobs, ``learner`` the data-plane calls of its own job and reading that job. A
call without a token, or with an unknown, expired or forged one, fails with UNAUTHENTICATED; a
known token whose role the method does not allow fails with PERMISSION_DENIED. Neither runs the
handler. Health checking and server reflection need no token.

:meth:`Credentials.authenticate` (a token in, a principal or None out) is the function other
front ends (the dashboard) reuse; :func:`principal_from_metadata` does the same from gRPC
metadata.

Layout: :mod:`shoal.runtime.principals` (roles, principals, the roles of methods) and
:mod:`shoal.runtime.learner_tokens` (the learner JWTs) are re-exported here; this module keeps
the opaque tokens and :class:`Credentials`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tenacity

from shoal.contract import ids
from shoal.contract.errors import InvalidField, Unauthenticated
from shoal.contract.keys import AUTH_PREFIX, LEARNER_KEYS_PREFIX, TOKENS_PREFIX
from shoal.runtime.learner_tokens import (
    DEFAULT_LEARNER_TOKEN_TTL_S,
    LEARNER_ALGORITHM,
    LEARNER_AUDIENCE,
    LEARNER_ISSUER,
    LearnerTokenSigner,
    LearnerTokenVerifier,
    key_id,
    learner_principal_name,
    load_public_keys,
    looks_like_learner_token,
    public_key_pem,
)
from shoal.runtime.principals import (
    ADMINS,
    ANONYMOUS,
    LEARNERS,
    PUBLIC_SERVICES,
    SERVICES,
    USERS_AND_SERVICES,
    Authenticator,
    MethodRoles,
    Principal,
    Role,
    current_principal,
    set_current_principal,
    token_digest,
)

if TYPE_CHECKING:
    from shoal.runtime.store import Store
    from shoal.v1 import auth_pb2

log = logging.getLogger(__name__)


__all__ = [
    "ADMINS",
    "ANONYMOUS",
    "AUTH_PREFIX",
    "DEFAULT_LEARNER_TOKEN_TTL_S",
    "LEARNERS",
    "LEARNER_ALGORITHM",
    "LEARNER_AUDIENCE",
    "LEARNER_ISSUER",
    "LEARNER_KEYS_PREFIX",
    "PUBLIC_SERVICES",
    "SERVICES",
    "TOKENS_PREFIX",
    "USERS_AND_SERVICES",
    "Authenticator",
    "Credentials",
    "LearnerTokenSigner",
    "LearnerTokenVerifier",
    "MethodRoles",
    "Principal",
    "Role",
    "TokenTable",
    "bearer_token",
    "current_principal",
    "key_id",
    "learner_principal_name",
    "load_public_keys",
    "looks_like_learner_token",
    "new_token",
    "principal_from_metadata",
    "public_key_pem",
    "publish_learner_key",
    "role_to_proto",
    "set_current_principal",
    "token_digest",
    "write_tokens_file",
]

_digest = token_digest


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
                role = None
            if role is None or role is Role.LEARNER:
                raise InvalidField(
                    f"role at {where}", role_name, "must be one of user, service, admin"
                )
            if not ids.is_valid(ids.IdKind.PRINCIPAL, name):
                raise InvalidField(
                    f"principal at {where}", name, ids.describe(ids.IdKind.PRINCIPAL)
                )
            digest = (
                token.removeprefix("sha256:").lower()
                if token.startswith("sha256:")
                else (_digest(token))
            )
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
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
        return self.by_digest.get(_digest(token))


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


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry of call metadata."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def principal_from_metadata(
    authenticator: Authenticator, metadata: Iterable[tuple[str, Any]] | None
) -> Principal:
    """The caller named by the call's bearer token; :class:`Unauthenticated` otherwise."""
    token = bearer_token(metadata)
    if token is None:
        raise Unauthenticated("missing bearer token: send 'authorization: Bearer <token>'")
    principal = authenticator.authenticate(token)
    if principal is None:
        raise Unauthenticated("unknown, expired or revoked bearer token")
    return principal


# --------------------------------------------------------------------------------------------
# Credentials: what every service authenticates with (file + etcd + learner keys)
# --------------------------------------------------------------------------------------------


_ROLE_FROM_PROTO = {1: Role.USER, 2: Role.SERVICE, 3: Role.ADMIN}
_ROLE_TO_PROTO = {v: k for k, v in _ROLE_FROM_PROTO.items()}


def role_to_proto(role: Role) -> auth_pb2.PrincipalRole.ValueType:
    """The ``PrincipalRole`` of a role (UNSPECIFIED for a learner: the API names no such role)."""
    from shoal.v1 import auth_pb2

    return auth_pb2.PrincipalRole.ValueType(_ROLE_TO_PROTO.get(role, 0))


@dataclass
class Credentials:
    """Every credential a service accepts, kept current without a restart.

    * ``tokens_file``: re-read when its modification time or size changes (checked at most
      every ``file_poll_s`` seconds, on the next call); a file that no longer parses is
      logged and the previous table kept.
    * etcd (:meth:`watch`): ``/shoal/v1/auth/tokens/`` and ``/shoal/v1/auth/learner-keys/``,
      listed then watched; while etcd is unreachable the last known records stay in force.
    * ``learner_keys``: learner public keys given at start (``--learner-public-keys``).
    """

    tokens_file: str | Path | None = None
    learner_keys: Iterable[bytes] = ()
    clock: Callable[[], float] = time.time
    file_poll_s: float = 2.0
    _file_table: TokenTable = field(default_factory=lambda: TokenTable({}))
    _file_stamp: tuple[float, int] | None = None
    _next_poll: float = 0.0
    _store_tokens: dict[str, Principal] = field(default_factory=dict)
    _static_keys: list[bytes] = field(default_factory=list)
    _store_keys: dict[str, bytes] = field(default_factory=dict)
    _learners: LearnerTokenVerifier = field(init=False)
    synced: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._static_keys = list(self.learner_keys)
        self._learners = LearnerTokenVerifier(clock=self.clock)
        self._rebuild_keys()
        if self.tokens_file is not None:
            self._file_table = TokenTable.load(self.tokens_file)
            self._file_stamp = self._stamp()
            self._next_poll = time.monotonic() + self.file_poll_s

    # -- authenticate -------------------------------------------------------------------------

    def authenticate(self, token: str) -> Principal | None:
        """The principal of ``token``, or None when no credential source knows it."""
        if looks_like_learner_token(token):
            return self._learners.verify(token)
        self._maybe_reload()
        digest = token_digest(token)
        return self._file_table.by_digest.get(digest) or self._store_tokens.get(digest)

    @property
    def learner_key_ids(self) -> frozenset[str]:
        return self._learners.key_ids

    def add_learner_key(self, raw_public_key: bytes) -> None:
        """Trust one more learner signing key (a scheduler in this process)."""
        self._static_keys.append(raw_public_key)
        self._rebuild_keys()

    # -- tokens file --------------------------------------------------------------------------

    def _stamp(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.tokens_file)  # type: ignore[arg-type]
        except OSError:
            return None
        return (st.st_mtime, st.st_size)

    def _maybe_reload(self) -> None:
        if self.tokens_file is None or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + self.file_poll_s
        stamp = self._stamp()
        if stamp is None or stamp == self._file_stamp:
            return
        try:
            self._file_table = TokenTable.load(self.tokens_file)
        except InvalidField as exc:
            log.error(
                "tokens file %s not reloaded (the previous one stays): %s", self.tokens_file, exc
            )
        else:
            log.info(
                "tokens file %s reloaded: %d tokens",
                self.tokens_file,
                len(self._file_table.by_digest),
            )
        self._file_stamp = stamp

    # -- etcd ---------------------------------------------------------------------------------

    def _rebuild_keys(self) -> None:
        self._learners.replace([*self._static_keys, *self._store_keys.values()])

    def apply(self, key: str, value: bytes | None) -> None:
        """One etcd record changed (``value`` None: deleted)."""
        from shoal.v1 import auth_pb2

        if key.startswith(TOKENS_PREFIX):
            digest = key[len(TOKENS_PREFIX) :]
            if value is None:
                self._store_tokens.pop(digest, None)
                return
            record = auth_pb2.TokenRecord.FromString(value)
            role = _ROLE_FROM_PROTO.get(record.role)
            if role is None or not ids.is_valid(ids.IdKind.PRINCIPAL, record.principal):
                log.warning("ignoring token record %s: bad principal or role", key)
                self._store_tokens.pop(digest, None)
                return
            self._store_tokens[digest] = Principal(record.principal, role)
        elif key.startswith(LEARNER_KEYS_PREFIX):
            kid = key[len(LEARNER_KEYS_PREFIX) :]
            if value is None:
                self._store_keys.pop(kid, None)
            else:
                raw = auth_pb2.LearnerSigningKey.FromString(value).ed25519_public_key
                if len(raw) == 32 and key_id(raw) == kid:
                    self._store_keys[kid] = raw
                else:
                    log.warning("ignoring learner key %s: not a 32-byte key with that id", key)
            self._rebuild_keys()

    def _replace_all(self, kvs: Iterable[Any]) -> None:
        self._store_tokens.clear()
        self._store_keys.clear()
        for kv in kvs:
            try:
                self.apply(kv.key, kv.value)
            except Exception as exc:  # a corrupt record must not stop the others
                log.warning("ignoring auth record %s: %s", kv.key, exc)
        self._rebuild_keys()

    async def watch(self, store: Store, *, retry_s: float = 1.0) -> None:
        """List then watch the auth records in ``store`` until cancelled."""
        from shoal.runtime.store import StoreError, StoreUnavailable

        async def session() -> None:
            kvs, revision = await store.list(AUTH_PREFIX)
            self._replace_all(kvs)
            self.synced.set()
            async for event in store.watch(AUTH_PREFIX, revision + 1):
                if event.kind == "resync":
                    self._replace_all(event.kvs)
                    continue
                try:
                    self.apply(event.key, event.value if event.kind == "put" else None)
                except Exception as exc:
                    log.warning("ignoring auth record %s: %s", event.key, exc)
            raise StoreUnavailable("the watch of the auth records ended")  # list again

        def retries(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None
            exc = state.outcome.exception()
            if isinstance(exc, (StoreError, OSError)):
                log.warning("auth records: etcd unreachable (%s); the last known stay", exc)
            else:
                log.error("auth records watch failed; retrying", exc_info=exc)

        # Any error (never a cancellation: it is no Exception) retried every retry_s, forever.
        async for attempt in tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(Exception),
            wait=tenacity.wait_fixed(retry_s),
            before_sleep=retries,
        ):
            with attempt:
                await session()


async def publish_learner_key(
    store: Store, raw_public_key: bytes, *, publisher: str, retry_s: float = 1.0
) -> None:
    """Publish a learner verification key under ``/shoal/v1/auth/learner-keys/<key id>``
    (retrying while the store is unreachable), so every service trusts the credentials it
    signs."""
    from google.protobuf.timestamp_pb2 import Timestamp

    from shoal.runtime.store import StoreError
    from shoal.v1 import auth_pb2

    created = Timestamp()
    created.GetCurrentTime()
    record = auth_pb2.LearnerSigningKey(
        ed25519_public_key=raw_public_key, create_time=created, publisher=publisher
    )
    key = LEARNER_KEYS_PREFIX + key_id(raw_public_key)

    def unreachable(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None
        log.warning("cannot publish learner key %s yet: %s", key, state.outcome.exception())

    async for attempt in tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(StoreError),
        wait=tenacity.wait_fixed(retry_s),
        before_sleep=unreachable,
        reraise=True,
    ):
        with attempt:
            if await store.get(key) is None:
                await store.put(key, record.SerializeToString())
                log.info("published learner key %s", key)
