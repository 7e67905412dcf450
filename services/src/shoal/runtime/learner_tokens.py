"""Learner credentials: Ed25519-signed JWTs (EdDSA, PyJWT) the job scheduler mints for each
learner it starts, and their verification with the scheduler's public keys, without a store
round trip.

Part of :mod:`shoal.runtime.auth`, which re-exports every name here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.contract import ids
from shoal.contract.errors import InvalidField
from shoal.runtime.principals import Principal, Role

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

log = logging.getLogger(__name__)


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
