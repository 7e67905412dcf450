"""Client channels between shoal services: bearer token, trace propagation, size limits, TLS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from shoal.runtime import telemetry
from shoal.runtime.server import grpc_options

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


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
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    trace: bool = True,
) -> aio.Channel:
    """An aio channel to another shoal service (mTLS when cert and key are given)."""
    interceptors: list[Any] = []
    if trace:
        interceptors.extend(telemetry.client_interceptors())
    if token:
        interceptors.extend(bearer_interceptors(token))
    options = grpc_options(max_message_bytes)
    if tls_ca:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes(),
            private_key=Path(tls_key).read_bytes() if tls_key else None,
            certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
        )
        return aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    return aio.insecure_channel(address, options=options, interceptors=interceptors)
