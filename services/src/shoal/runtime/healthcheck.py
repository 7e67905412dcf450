"""``shoal-healthcheck HOST:PORT``: one gRPC health check (grpc.health.v1 ``Check``) of a shoal
service, for container health checks and scripts.

Every shoal server reports SERVING for ``""`` and for each service it serves once it has
started (a standby replica too: it serves and redirects), and NOT_SERVING while it shuts down
(see :mod:`shoal.runtime.server`). Health checking needs no token.

Plaintext only, as compose/ runs the services (a TLS server would need its CA, and under mTLS
a client certificate).
Exit status: 0 when the answer is SERVING; 1 when the service answers anything else or cannot
be reached within ``--timeout``; 2 for bad arguments. One line on stderr says why it failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal.runtime.config import parse_host_port, parse_number
from shoal.runtime.errors import InvalidField

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
    return parser


def check(address: str, *, service: str = "", timeout: float = 3.0) -> str:
    """The health status name the server at ``address`` reports for ``service``.

    Raises grpc.RpcError when it cannot be reached or does not answer in time.
    """
    with grpc.insecure_channel(address) as channel:
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
    try:
        status = check(ns.address, service=ns.service, timeout=timeout)
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
