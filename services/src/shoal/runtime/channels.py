"""Client channels between shoal services: bearer token, trace propagation, size limits, TLS.

Every channel from one shoal service to another (and to a peer of the same service) is made by
:func:`connect`, with the process's service token and its ``ServerConfig.tls``::

    connect(address, token=config.service_token, tls=config.tls)

With TLS configured the channel verifies the server against the cluster CA (``tls.ca_file``)
and presents the process's own certificate (``tls.cert_file``/``key_file``), so the hop is
mutually authenticated; without it the channel is plaintext. Nothing else in the services
opens a gRPC channel (a test checks that no other module calls ``insecure_channel`` or
``secure_channel``), except the etcd client (``shoal.runtime.store``, ``--etcd-ca``).
"""

from __future__ import annotations

from typing import Any

from grpc import aio

from shoal.client.tls import channel_credentials
from shoal.runtime import telemetry
from shoal.runtime.config import TLSConfig
from shoal.runtime.server import grpc_options

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# gRPC's default reconnect backoff grows to 120 s: a channel to a replica that was down once
# (a rolling restart, a failover) then refuses calls for up to minutes after the replica is
# back, and an agent stuck on it misses heartbeats although the leader serves. Capped at 1 s,
# a channel finds a restarted peer within about a second.
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class _BearerBase:
    """Adds ``authorization: Bearer <token>`` to every call. grpc.aio files each interceptor
    under one call kind only, so there is one subclass per kind."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: aio.ClientCallDetails) -> aio.ClientCallDetails:
        metadata = aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._header)
        return aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _BearerUU(_BearerBase, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _BearerUS(_BearerBase, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _BearerSU(_BearerBase, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request_iterator)


class _BearerSS(_BearerBase, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request_iterator)


def bearer_interceptors(token: str) -> list[Any]:
    return [kind(token) for kind in (_BearerUU, _BearerUS, _BearerSU, _BearerSS)]


def connect(
    address: str,
    *,
    token: str | None = None,
    tls: TLSConfig | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    trace: bool = True,
) -> aio.Channel:
    """An aio channel to another shoal service: TLS when ``tls`` (the process's
    ``ServerConfig.tls``) or ``tls_ca`` is given, mutual when there is a certificate too."""
    if tls is not None:
        tls_ca, tls_cert, tls_key = tls.ca_file, tls.cert_file, tls.key_file
    interceptors: list[Any] = []
    if trace:
        interceptors.extend(telemetry.client_interceptors())
    if token:
        interceptors.extend(bearer_interceptors(token))
    options = [*grpc_options(max_message_bytes), *RECONNECT_OPTIONS]
    if tls_ca or tls is not None:
        creds = channel_credentials(tls_ca, tls_cert, tls_key)
        return aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    return aio.insecure_channel(address, options=options, interceptors=interceptors)
