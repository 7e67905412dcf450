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
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import hashlib
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shoal.contract import ids
from shoal.contract.errors import InvalidField, Unauthenticated

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    from shoal.runtime.store import Store
    from shoal.v1 import auth_pb2

log = logging.getLogger(__name__)


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
# Learner credentials: Ed25519-signed JWTs minted by the scheduler
# --------------------------------------------------------------------------------------------

LEARNER_ISSUER = "shoal-job-scheduler"
LEARNER_AUDIENCE = "shoal-learner"
LEARNER_ALGORITHM = "EdDSA"
DEFAULT_LEARNER_TOKEN_TTL_S = 30 * 24 * 3600.0
"""How long a learner credential is valid at most. It is refused earlier when its job ends:
the coordinator forgets the job and the scheduler no longer lists the learner."""


def looks_like_learner_token(token: str) -> bool:
    """JWTs (base64url JSON, so starting with ``eyJ``, three parts); opaque tokens are hex."""
    return token.startswith("eyJ") and token.count(".") == 2


def learner_principal_name(job_id: str, learner_id: str) -> str:
    return f"learner:{job_id}/{learner_id}"


def key_id(raw_public_key: bytes) -> str:
    """The id of a learner signing key: the first 16 hex digits of its public key's sha256."""
    return hashlib.sha256(raw_public_key).hexdigest()[:16]


def _raw_public(public: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class LearnerTokenSigner:
    """The scheduler's signing key: mints one credential per learner it starts."""

    def __init__(self, private_key: Ed25519PrivateKey, *, clock: Callable[[], float] = time.time):
        self._key = private_key
        self._clock = clock
        self.public_key_raw = _raw_public(private_key.public_key())
        self.kid = key_id(self.public_key_raw)

    @classmethod
    def generate(cls, *, clock: Callable[[], float] = time.time) -> LearnerTokenSigner:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.generate(), clock=clock)

    @classmethod
    def load(cls, path: str | Path) -> LearnerTokenSigner:
        """Read a PEM (PKCS#8) Ed25519 private key, as :meth:`save` writes it."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        p = Path(path)
        try:
            key = serialization.load_pem_private_key(p.read_bytes(), password=None)
        except OSError as exc:
            raise InvalidField(
                "learner_signing_key", str(p), f"cannot be read: {exc.strerror}"
            ) from exc
        except ValueError as exc:
            raise InvalidField("learner_signing_key", str(p), f"is not a PEM key: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise InvalidField(
                "learner_signing_key", str(p), f"must be an Ed25519 key, not {type(key).__name__}"
            )
        return cls(key)

    def save(self, path: str | Path) -> None:
        """Write the private key as PEM (PKCS#8), mode 0600."""
        from cryptography.hazmat.primitives import serialization

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        data = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        p.chmod(0o600)

    def mint(
        self,
        *,
        job_id: str,
        learner_id: str,
        start: str = "",
        ttl_s: float = DEFAULT_LEARNER_TOKEN_TTL_S,
    ) -> str:
        """A credential for one learner of one job (and one start of it), valid ``ttl_s``."""
        import jwt

        ids.check(ids.IdKind.JOB, job_id)
        ids.check(ids.IdKind.LEARNER, learner_id)
        now = int(self._clock())
        claims = {
            "iss": LEARNER_ISSUER,
            "aud": LEARNER_AUDIENCE,
            "sub": learner_principal_name(job_id, learner_id),
            "job": job_id,
            "lrn": learner_id,
            "start": start,
            "iat": now,
            "exp": now + int(ttl_s),
            "jti": secrets.token_hex(8),
        }
        return jwt.encode(claims, self._key, algorithm=LEARNER_ALGORITHM, headers={"kid": self.kid})


class LearnerTokenVerifier:
    """Verifies learner credentials with the public keys it knows (by key id).

    A verified credential is remembered (up to ``cache_size`` of them) with its validity, so a
    learner's later calls cost a dict lookup, not a signature check; any change of the keys
    forgets every credential verified so far."""

    def __init__(
        self,
        keys: Mapping[str, bytes] | None = None,
        *,
        clock: Callable[[], float] = time.time,
        leeway_s: float = 30.0,
        cache_size: int = 4096,
    ) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._clock = clock
        self._leeway = leeway_s
        self._cache: OrderedDict[str, tuple[Principal, float, float]] = OrderedDict()
        self._cache_size = cache_size
        for raw in (keys or {}).values():
            self.add(raw)

    @property
    def key_ids(self) -> frozenset[str]:
        return frozenset(self._keys)

    def add(self, raw_public_key: bytes) -> str:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        kid = key_id(raw_public_key)
        self._keys[kid] = Ed25519PublicKey.from_public_bytes(raw_public_key)
        return kid

    def remove(self, kid: str) -> None:
        self._keys.pop(kid, None)
        self._cache.clear()

    def replace(self, raw_keys: Iterable[bytes]) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        keys = {key_id(raw): Ed25519PublicKey.from_public_bytes(raw) for raw in raw_keys}
        if set(keys) != set(self._keys):
            self._cache.clear()
        self._keys = keys

    def verify(self, token: str) -> Principal | None:
        """The learner the credential names, or None (unknown key, bad signature, expired,
        malformed claims)."""
        cached = self._cache.get(token)
        if cached is not None:
            principal, iat, exp = cached
            now = self._clock()
            if now <= exp + self._leeway and now + self._leeway >= iat:
                self._cache.move_to_end(token)
                return principal
            del self._cache[token]
            return None
        found, iat, exp = self._verify(token)
        if found is not None:
            self._cache[token] = (found, iat, exp)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return found

    def _verify(self, token: str) -> tuple[Principal | None, float, float]:
        import jwt

        none: tuple[Principal | None, float, float] = (None, 0.0, 0.0)

        try:
            kid = jwt.get_unverified_header(token).get("kid")
            key = self._keys.get(kid) if isinstance(kid, str) else None
            if key is None:
                return none
            claims = jwt.decode(
                token,
                key,
                algorithms=[LEARNER_ALGORITHM],
                audience=LEARNER_AUDIENCE,
                issuer=LEARNER_ISSUER,
                options={"verify_exp": False, "verify_iat": False, "require": ["exp", "iat"]},
            )
        except jwt.PyJWTError:
            return none
        now = self._clock()
        exp, iat = claims.get("exp"), claims.get("iat")
        if not isinstance(exp, int | float) or not isinstance(iat, int | float):
            return none
        if now > exp + self._leeway or now + self._leeway < iat:
            return none
        job, learner, start = claims.get("job"), claims.get("lrn"), claims.get("start", "")
        if not isinstance(job, str) or not isinstance(learner, str):
            return none
        if not ids.is_valid(ids.IdKind.JOB, job) or not ids.is_valid(ids.IdKind.LEARNER, learner):
            return none
        principal = Principal(
            learner_principal_name(job, learner),
            Role.LEARNER,
            job_id=job,
            learner_id=learner,
            start=start if isinstance(start, str) else "",
        )
        return principal, float(iat), float(exp)


def load_public_keys(path: str | Path) -> list[bytes]:
    """Raw Ed25519 public keys from a PEM file holding one or more ``PUBLIC KEY`` blocks."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InvalidField(
            "learner_public_keys", str(p), f"cannot be read: {exc.strerror}"
        ) from exc
    out = []
    end = "-----END PUBLIC KEY-----"
    for block in text.split(end)[:-1]:
        try:
            key = serialization.load_pem_public_key((block.strip() + "\n" + end + "\n").encode())
        except ValueError as exc:
            raise InvalidField("learner_public_keys", str(p), f"has a bad key: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise InvalidField("learner_public_keys", str(p), "must hold Ed25519 keys only")
        out.append(_raw_public(key))
    if not out:
        raise InvalidField("learner_public_keys", str(p), "holds no PUBLIC KEY block")
    return out


def public_key_pem(raw_public_key: bytes) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key = Ed25519PublicKey.from_public_bytes(raw_public_key)
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


# --------------------------------------------------------------------------------------------
# Credentials: what every service authenticates with (file + etcd + learner keys)
# --------------------------------------------------------------------------------------------

AUTH_PREFIX = "/shoal/v1/auth/"
TOKENS_PREFIX = AUTH_PREFIX + "tokens/"
LEARNER_KEYS_PREFIX = AUTH_PREFIX + "learner-keys/"

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
        from shoal.runtime.store import StoreError

        while True:
            try:
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
            except asyncio.CancelledError:
                raise
            except (StoreError, OSError) as exc:
                log.warning("auth records: etcd unreachable (%s); the last known stay", exc)
            except Exception:
                log.exception("auth records watch failed; retrying")
            await asyncio.sleep(retry_s)


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
    while True:
        try:
            if await store.get(key) is None:
                await store.put(key, record.SerializeToString())
                log.info("published learner key %s", key)
            return
        except StoreError as exc:
            log.warning("cannot publish learner key %s yet: %s", key, exc)
            await asyncio.sleep(retry_s)


# --------------------------------------------------------------------------------------------
# Roles of methods
# --------------------------------------------------------------------------------------------


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
