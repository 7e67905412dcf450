"""``shoal-healthcheck HOST:PORT``: one gRPC health check (grpc.health.v1 ``Check``) of a shoal
service, for container health checks and scripts.

Every shoal server reports SERVING for ``""`` and for each service it serves once it has
started (a standby replica too: it serves and redirects), and NOT_SERVING while it shuts down
(see :mod:`shoal.runtime.server`). Health checking needs no token.

TLS when ``--tls-ca`` (or SHOAL_TLS_CA, the variable the service itself reads) is set, with the
process's certificate (``--tls-cert``/``--tls-key``, SHOAL_TLS_CERT/KEY) for a server that
requires client certificates; so in a container the check runs with the service's own files.
Exit status: 0 when the answer is SERVING; 1 when the service answers anything else or cannot
be reached within ``--timeout``; 2 for bad arguments. One line on stderr says why it failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal.client.tls import channel_credentials
from shoal.contract import environment
from shoal.contract.errors import InvalidField
from shoal.runtime.config import parse_host_port, parse_number

__all__ = ["build_parser", "check", "main"]

SERVING = health_pb2.HealthCheckResponse.SERVING


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal-healthcheck",
        description="Ask a shoal service for its gRPC health (exit 0 when SERVING).",
    )
    parser.add_argument("address", help="HOST:PORT of the service, e.g. 127.0.0.1:7000")
    parser.add_argument(
        "--service",
        default="",
        help="gRPC service name to ask about (default: the whole server)",
    )
    parser.add_argument("--timeout", default="3", help="seconds to wait for the answer")
    parser.add_argument("--tls-ca", default=os.environ.get(environment.TLS_CA), help="CA (PEM)")
    parser.add_argument("--tls-cert", default=os.environ.get(environment.TLS_CERT))
    parser.add_argument("--tls-key", default=os.environ.get(environment.TLS_KEY))
    return parser


def check(
    address: str,
    *,
    service: str = "",
    timeout: float = 3.0,
    tls: tuple[str, str | None, str | None] | None = None,
) -> str:
    """The health status name the server at ``address`` reports for ``service`` (over TLS
    with ``tls`` = (ca, cert, key)).

    Raises grpc.RpcError when it cannot be reached or does not answer in time.
    """
    if tls is not None:
        creds = channel_credentials(*tls)
        channel = grpc.secure_channel(address, creds)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        parse_host_port("address", ns.address)
        timeout = float(parse_number("timeout", ns.timeout, float))
        if timeout <= 0:
            raise InvalidField("timeout", ns.timeout, "must be > 0")
    except InvalidField as exc:
        print(f"shoal-healthcheck: {exc}", file=sys.stderr)
        return 2
    what = f"{ns.address} ({ns.service or 'server'})"
    tls = (ns.tls_ca, ns.tls_cert, ns.tls_key) if ns.tls_ca else None
    try:
        status = check(ns.address, service=ns.service, timeout=timeout, tls=tls)
    except ValueError as exc:  # a TLS file that cannot be read
        print(f"shoal-healthcheck: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
        print(f"shoal-healthcheck: {what}: {code}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"shoal-healthcheck: {what}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
