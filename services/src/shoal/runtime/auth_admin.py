"""``shoal-service auth COMMAND``: the users and learner keys every service watches in etcd.

Every service lists and watches ``/shoal/v1/auth/`` (``shoal.runtime.auth.Credentials``), so
these take effect on every replica within seconds, without a restart::

    shoal-service auth --etcd HOST:PORT add-user alice [--role user|admin|service] [--token T]
    shoal-service auth --etcd HOST:PORT rotate alice         # a new token; the old ones go
    shoal-service auth --etcd HOST:PORT revoke alice         # every token of alice
    shoal-service auth --etcd HOST:PORT list
    shoal-service auth --etcd HOST:PORT learner-keys
    shoal-service auth --etcd HOST:PORT revoke-learner-key KEY_ID

``add-user`` and ``rotate`` print the new token once (only its sha256 is stored). With etcd
over TLS pass ``--etcd-ca`` (and ``--etcd-cert``/``--etcd-key`` for mTLS), or
SHOAL_ETCD_CA/CERT/KEY.
Exit status 0 on success, 2 on bad input (one line on stderr), 1 when etcd cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
from collections.abc import Mapping, Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from shoal.contract import ids
from shoal.contract.errors import InvalidField
from shoal.runtime.auth import (
    LEARNER_KEYS_PREFIX,
    TOKENS_PREFIX,
    Role,
    new_token,
    role_to_proto,
    token_digest,
)
from shoal.runtime.config import EtcdTLSConfig, ServerConfig, etcd_store
from shoal.runtime.store import StoreError
from shoal.v1 import auth_pb2

__all__ = ["main"]

_ROLE_NAMES = {1: "user", 2: "service", 3: "admin"}


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal-service auth", description=__doc__.split("\n")[0])
    parser.add_argument("--etcd", default=env.get("SHOAL_ETCD_ENDPOINTS", ""))
    parser.add_argument("--etcd-ca", default=env.get("SHOAL_ETCD_CA"))
    parser.add_argument("--etcd-cert", default=env.get("SHOAL_ETCD_CERT"))
    parser.add_argument("--etcd-key", default=env.get("SHOAL_ETCD_KEY"))
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add-user", help="add a principal's token (prints it once)")
    add.add_argument("name")
    add.add_argument("--role", choices=("user", "admin", "service"), default="user")
    add.add_argument("--token", help="use this token instead of a new random one")
    rotate = sub.add_parser("rotate", help="give a principal a new token, delete its old ones")
    rotate.add_argument("name")
    revoke = sub.add_parser("revoke", help="delete every token of a principal")
    revoke.add_argument("name")
    sub.add_parser("list", help="list the principals with tokens in etcd")
    sub.add_parser("learner-keys", help="list the keys that verify learner credentials")
    rk = sub.add_parser("revoke-learner-key", help="stop trusting a learner signing key")
    rk.add_argument("key_id")
    return parser


def _when(ts: Timestamp) -> str:
    if not ts.seconds:
        return "-"
    return dt.datetime.fromtimestamp(ts.seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def run(ns: argparse.Namespace) -> int:
    endpoints = tuple(e.strip() for e in ns.etcd.split(",") if e.strip())
    if not endpoints:
        raise InvalidField("etcd", ns.etcd, "must name at least one HOST:PORT (--etcd)")
    etcd_tls = EtcdTLSConfig(ns.etcd_ca, ns.etcd_cert, ns.etcd_key) if ns.etcd_ca else None
    config = ServerConfig("auth", allow_no_auth=True, etcd_endpoints=endpoints, etcd_tls=etcd_tls)
    async with etcd_store(config, timeout=5.0) as store:
        if ns.command == "rotate":
            kvs, _ = await store.list(TOKENS_PREFIX)
            old = [
                (kv.key, auth_pb2.TokenRecord.FromString(kv.value))
                for kv in kvs
                if auth_pb2.TokenRecord.FromString(kv.value).principal == ns.name
            ]
            if not old:
                raise InvalidField("name", ns.name, "has no token in etcd (add-user first)")
            token = new_token()
            record = auth_pb2.TokenRecord()
            record.CopyFrom(old[-1][1])
            record.create_time.GetCurrentTime()
            await store.put(TOKENS_PREFIX + token_digest(token), record.SerializeToString())
            for key, _ in old:
                await store.delete(key)
            print(token)
            print(f"rotated {ns.name}: {len(old)} old token(s) revoked", file=sys.stderr)
            return 0
        if ns.command == "add-user":
            ids.check(ids.IdKind.PRINCIPAL, ns.name, field_name="name")
            token = ns.token or new_token()
            if len(token) < 16 or any(c.isspace() for c in token) or token.startswith("eyJ"):
                raise InvalidField("token", "...", "must be 16+ characters without spaces")
            created = Timestamp()
            created.GetCurrentTime()
            record = auth_pb2.TokenRecord(
                principal=ns.name, role=role_to_proto(Role(ns.role)), create_time=created
            )
            await store.put(TOKENS_PREFIX + token_digest(token), record.SerializeToString())
            print(token)
            print(f"added {ns.role} {ns.name}: the token above is shown once", file=sys.stderr)
            return 0
        if ns.command in ("revoke", "list"):
            kvs, _ = await store.list(TOKENS_PREFIX)
            found = 0
            for kv in kvs:
                record = auth_pb2.TokenRecord.FromString(kv.value)
                digest = kv.key[len(TOKENS_PREFIX) :]
                if ns.command == "list":
                    role = _ROLE_NAMES.get(record.role, "?")
                    print(
                        f"{record.principal}\t{role}\tsha256:{digest[:12]}...\t"
                        f"{_when(record.create_time)}"
                    )
                elif record.principal == ns.name:
                    await store.delete(kv.key)
                    found += 1
            if ns.command == "revoke":
                if not found:
                    raise InvalidField("name", ns.name, "has no token in etcd")
                print(f"revoked {found} token(s) of {ns.name}", file=sys.stderr)
            return 0
        if ns.command == "learner-keys":
            kvs, _ = await store.list(LEARNER_KEYS_PREFIX)
            for kv in kvs:
                published = auth_pb2.LearnerSigningKey.FromString(kv.value)
                kid = kv.key[len(LEARNER_KEYS_PREFIX) :]
                print(f"{kid}\t{published.publisher}\t{_when(published.create_time)}")
            return 0
        if ns.command == "revoke-learner-key":
            if not await store.delete(LEARNER_KEYS_PREFIX + ns.key_id):
                raise InvalidField("key_id", ns.key_id, "is not a published learner key")
            print(f"revoked learner key {ns.key_id}", file=sys.stderr)
            return 0
    raise AssertionError(ns.command)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser(os.environ).parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return asyncio.run(run(ns))
    except (InvalidField, ids.InvalidIdentifier) as exc:
        print(f"shoal-service auth: {exc}", file=sys.stderr)
        return 2
    except StoreError as exc:
        print(f"shoal-service auth: etcd: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
