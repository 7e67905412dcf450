"""Credentials: opaque tokens (file, etcd records watched), learner credentials (Ed25519 JWTs
minted by the scheduler, verified without a store), and the roles of methods."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import jwt
import pytest

from shoal.runtime.auth import (
    LEARNER_KEYS_PREFIX,
    TOKENS_PREFIX,
    Credentials,
    LearnerTokenSigner,
    LearnerTokenVerifier,
    Principal,
    Role,
    TokenTable,
    load_public_keys,
    new_token,
    principal_from_metadata,
    public_key_pem,
    publish_learner_key,
    role_to_proto,
    token_digest,
    write_tokens_file,
)
from shoal.runtime.errors import InvalidField, Unauthenticated
from shoal.runtime.store import MemoryStore
from shoal.v1 import auth_pb2
from tests.support import async_wait_until


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- learner credentials -----------------------------------------------------------------------


def test_a_learner_credential_names_its_job_learner_and_start_and_verifies_without_a_store():
    clock = Clock()
    signer = LearnerTokenSigner.generate(clock=clock)
    token = signer.mint(job_id="job-1", learner_id="job-1-l3", start="alloc-9", ttl_s=3600)
    verifier = LearnerTokenVerifier({signer.kid: signer.public_key_raw}, clock=clock)
    principal = verifier.verify(token)
    assert principal == Principal(
        "learner:job-1/job-1-l3",
        Role.LEARNER,
        job_id="job-1",
        learner_id="job-1-l3",
        start="alloc-9",
    )
    assert jwt.get_unverified_header(token)["alg"] == "EdDSA"


def test_an_expired_forged_or_unknown_learner_credential_authenticates_nobody():
    clock = Clock()
    signer = LearnerTokenSigner.generate(clock=clock)
    other = LearnerTokenSigner.generate(clock=clock)
    verifier = LearnerTokenVerifier({"k": signer.public_key_raw}, clock=clock, leeway_s=0)
    token = signer.mint(job_id="job-1", learner_id="l1", ttl_s=60)
    assert verifier.verify(token) is not None
    clock.now += 61
    assert verifier.verify(token) is None  # expired
    clock.now -= 61
    assert verifier.verify(other.mint(job_id="job-1", learner_id="l1")) is None  # unknown key
    header, payload, signature = token.split(".")
    forged = jwt.utils.base64url_encode(
        jwt.utils.base64url_decode(payload).replace(b"job-1", b"job-2")
    ).decode()
    assert verifier.verify(f"{header}.{forged}.{signature}") is None  # bad signature
    unsigned = jwt.encode(
        {"job": "job-2", "lrn": "l1", "exp": 2e9, "iat": 1}, key=None, algorithm="none"
    )
    assert verifier.verify(unsigned) is None  # alg none
    hs = jwt.encode(
        {
            "job": "job-2",
            "lrn": "l1",
            "exp": 2e9,
            "iat": 1,
            "aud": "shoal-learner",
            "iss": "shoal-job-scheduler",
        },
        key=signer.public_key_raw,
        algorithm="HS256",
        headers={"kid": signer.kid},
    )
    assert verifier.verify(hs) is None  # algorithm confusion: the public key as an HMAC key
    with pytest.raises(ValueError):
        signer.mint(job_id="../x", learner_id="l1")


def test_a_signing_key_round_trips_through_pem_files(tmp_path: Path) -> None:
    signer = LearnerTokenSigner.generate()
    signer.save(tmp_path / "key.pem")
    assert (tmp_path / "key.pem").stat().st_mode & 0o777 == 0o600
    again = LearnerTokenSigner.load(tmp_path / "key.pem")
    assert again.kid == signer.kid
    (tmp_path / "pub.pem").write_text(
        public_key_pem(signer.public_key_raw)
        + public_key_pem(LearnerTokenSigner.generate().public_key_raw)
    )
    assert load_public_keys(tmp_path / "pub.pem")[0] == signer.public_key_raw
    (tmp_path / "bad.pem").write_text("nothing here")
    with pytest.raises(InvalidField, match="learner_public_keys"):
        load_public_keys(tmp_path / "bad.pem")
    with pytest.raises(InvalidField, match="learner_signing_key"):
        LearnerTokenSigner.load(tmp_path / "bad.pem")


# -- tokens --------------------------------------------------------------------------------------


def test_the_tokens_file_refuses_a_learner_role_and_a_principal_that_is_a_path() -> None:
    with pytest.raises(InvalidField, match="role"):
        TokenTable.parse(f"{new_token()} bob learner")
    with pytest.raises(InvalidField, match="principal"):
        TokenTable.parse(f"{new_token()} ../bob user")


def test_missing_unknown_and_known_tokens_in_metadata() -> None:
    token = new_token()
    table = TokenTable.parse(f"{token} alice user")
    with pytest.raises(Unauthenticated, match="missing"):
        principal_from_metadata(table, [])
    with pytest.raises(Unauthenticated, match="unknown"):
        principal_from_metadata(table, [("authorization", "Bearer nope")])
    assert principal_from_metadata(table, [("authorization", f"Bearer {token}")]).name == "alice"


def test_a_user_added_to_the_tokens_file_is_known_within_the_poll_interval(tmp_path: Path):
    alice, bob = new_token(), new_token()
    path = tmp_path / "tokens"
    write_tokens_file(path, [(alice, "alice", Role.USER)])
    creds = Credentials(tokens_file=path, file_poll_s=0.0)
    assert creds.authenticate(bob) is None
    write_tokens_file(path, [(alice, "alice", Role.USER), (bob, "bob", Role.USER)])
    os.utime(path, (time.time() + 5, time.time() + 5))  # a new mtime even within a second
    assert creds.authenticate(bob) == Principal("bob", Role.USER)
    path.write_text("this line is broken\n")
    os.utime(path, (time.time() + 10, time.time() + 10))
    assert creds.authenticate(bob) == Principal("bob", Role.USER)  # the last good table stays


async def test_users_and_learner_keys_in_the_store_take_effect_and_are_revoked_by_watch():
    store = MemoryStore()
    creds = Credentials()
    carol = new_token()
    signer = LearnerTokenSigner.generate()
    learner = signer.mint(job_id="job-1", learner_id="l1")
    task = asyncio.create_task(creds.watch(store))
    try:
        await async_wait_until(creds.synced.is_set, what="first listing")
        assert creds.authenticate(carol) is None
        record = auth_pb2.TokenRecord(principal="carol", role=role_to_proto(Role.ADMIN))
        await store.put(TOKENS_PREFIX + token_digest(carol), record.SerializeToString())
        await async_wait_until(lambda: creds.authenticate(carol) is not None, what="carol")
        assert creds.authenticate(carol) == Principal("carol", Role.ADMIN)
        await publish_learner_key(store, signer.public_key_raw, publisher="test")
        await async_wait_until(lambda: creds.authenticate(learner) is not None, what="key")
        # A record that names a path or no role authenticates nobody.
        bad = auth_pb2.TokenRecord(principal="../x", role=role_to_proto(Role.USER))
        await store.put(TOKENS_PREFIX + token_digest("t2"), bad.SerializeToString())
        await store.put(LEARNER_KEYS_PREFIX + "not-the-id", b"\x0a\x01x")
        # Revoking: delete the records.
        await store.delete(TOKENS_PREFIX + token_digest(carol))
        await store.delete(LEARNER_KEYS_PREFIX + signer.kid)
        await async_wait_until(
            lambda: creds.authenticate(carol) is None and creds.authenticate(learner) is None,
            what="revoked",
        )
        assert creds.authenticate("t2") is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
