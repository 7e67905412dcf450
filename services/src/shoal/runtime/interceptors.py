"""The server interceptor every shoal service runs: authentication, authorization, the principal
of the call, the identifier check of every request message, and the mapping of domain errors to
status codes (one error table per service).

It wraps each method handler so that the checks run in the handler's own task (the principal is
a context variable the handler can read) and before any of the handler's code. In this order:
the bearer token (UNAUTHENTICATED), the certificate the caller connected with when the server
requires client certificates (a service token is accepted only over a ``service:``
certificate, and a ``learner:`` certificate carries only learner credentials:
PERMISSION_DENIED), the method's roles (PERMISSION_DENIED), then every identifier field of
every request message (``shoal.runtime.validation``: INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from grpc import aio
from opentelemetry import trace

from shoal.runtime.auth import (
    PUBLIC_SERVICES,
    Authenticator,
    MethodRoles,
    Principal,
    Role,
    bearer_token,
    principal_from_metadata,
    set_current_principal,
)
from shoal.runtime.errors import (
    REASON_METADATA_KEY,
    ErrorTable,
    InvalidField,
    PermissionDenied,
    ShoalError,
)
from shoal.runtime.validation import check_request_ids

__all__ = ["ShoalServerInterceptor", "bearer_token", "peer_certificate_identity", "split_method"]

log = logging.getLogger(__name__)


def split_method(full_method: str) -> tuple[str, str]:
    """'/shoal.v1.X/Y' -> ('shoal.v1.X', 'Y')."""
    _, service, method = full_method.split("/", 2)
    return service, method


def peer_certificate_identity(context: Any) -> tuple[str, str] | None:
    """(kind, name) of the client certificate the call came with (its common name is
    ``KIND:NAME``, as ``shoal.runtime.pki`` issues them), or None without one."""
    try:
        auth = context.auth_context() or {}
    except Exception:
        return None
    names = auth.get("x509_common_name") or ()
    for raw in names:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        kind, sep, name = text.partition(":")
        return (kind, name) if sep else ("", text)
    return None


class ShoalServerInterceptor(aio.ServerInterceptor):
    """Auth + error mapping. ``tokens=None`` disables auth (every caller is an admin).

    ``tokens`` is any :class:`~shoal.runtime.auth.Authenticator` (a
    :class:`~shoal.runtime.auth.Credentials` in the services). ``bind_certificates``: the
    server requires client certificates, so check that the credential fits the certificate.
    """

    def __init__(
        self,
        *,
        tokens: Authenticator | None,
        roles: Mapping[str, MethodRoles],
        errors: ErrorTable,
        bind_certificates: bool = False,
    ) -> None:
        self._tokens = tokens
        self._roles = roles
        self._errors = errors
        self._bind = bind_certificates

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        service, method = split_method(handler_call_details.method)
        if service in PUBLIC_SERVICES:
            # Health and reflection: no token, and their handlers stream with context.write,
            # which must not be wrapped in a generator.
            return handler
        return _wrap(handler, lambda ctx: self._authorize(ctx, service, method), self)

    def _authorize(
        self, context: aio.ServicerContext, service: str, method: str
    ) -> Principal | None:
        if self._tokens is None:
            return None
        principal = principal_from_metadata(self._tokens, context.invocation_metadata())
        if self._bind:
            self._check_certificate(context, principal)
        policy = self._roles.get(service)
        if policy is None:
            # A service without a declared policy is for admins only: fail closed.
            allowed: frozenset[Role] = frozenset()
        else:
            allowed = policy.allowed(method)
        if principal.role not in allowed and not principal.is_admin:
            names = ", ".join(sorted(r.value for r in allowed)) or "admin"
            have = principal.role.value
            raise PermissionDenied(
                f"{service}/{method} needs role {names}; the caller ({principal.name!r}) "
                f"has role {have}"
            )
        return principal

    @staticmethod
    def _check_certificate(context: aio.ServicerContext, principal: Principal) -> None:
        peer = peer_certificate_identity(context)
        if peer is None:
            return
        kind, name = peer
        if principal.role is Role.SERVICE and kind != "service":
            raise PermissionDenied(
                f"a service credential must come over a service certificate; this call came "
                f"over {kind or 'an unnamed'} certificate {name!r}"
            )
        if kind == "learner" and principal.role is not Role.LEARNER:
            raise PermissionDenied(
                f"a learner certificate ({name!r}) carries only learner credentials, not "
                f"{principal.role.value} {principal.name!r}"
            )

    async def abort_with(self, context: aio.ServicerContext, exc: BaseException) -> None:
        mapped = self._errors.lookup(exc)
        if mapped is None:
            span = trace.get_current_span().get_span_context()
            trace_id = f"{span.trace_id:032x}" if span.is_valid else "-"
            log.exception("unhandled error (trace %s)", trace_id, exc_info=exc)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal error ({type(exc).__name__}); trace id {trace_id}",
                trailing_metadata=((REASON_METADATA_KEY, "ERROR_REASON_UNSPECIFIED"),),
            )
            return
        await context.abort(mapped.code, mapped.message, trailing_metadata=mapped.metadata)


def _wrap(
    handler: grpc.RpcMethodHandler,
    authorize: Callable[[aio.ServicerContext], Principal | None],
    owner: ShoalServerInterceptor,
) -> grpc.RpcMethodHandler:
    if handler.response_streaming:
        behavior = handler.unary_stream or handler.stream_stream

        async def stream_behavior(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            refused = True
            try:
                set_current_principal(authorize(context))
                refused = False
                result = behavior(_checked(request, handler.request_streaming), context)
                if inspect.isawaitable(result):
                    result = await result
                if result is not None:
                    async for item in result:
                        yield item
            except aio.AbortError:
                raise
            except Exception as exc:
                if handler.request_streaming and (refused or isinstance(exc, _RefusedMessage)):
                    await _drain(request)
                await owner.abort_with(context, exc)

        factory = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_stream_rpc_method_handler
        )
        return factory(
            stream_behavior,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    behavior = handler.unary_unary or handler.stream_unary

    async def unary_behavior(request: Any, context: aio.ServicerContext) -> Any:
        refused = True
        try:
            set_current_principal(authorize(context))
            refused = False
            return await behavior(_checked(request, handler.request_streaming), context)
        except aio.AbortError:
            raise
        except Exception as exc:
            if handler.request_streaming and (refused or isinstance(exc, _RefusedMessage)):
                await _drain(request)
            await owner.abort_with(context, exc)

    factory = (
        grpc.unary_unary_rpc_method_handler
        if handler.unary_unary
        else grpc.stream_unary_rpc_method_handler
    )
    return factory(
        unary_behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _checked(request: Any, streaming: bool) -> Any:
    """The request with its identifiers checked: at once for a message, as each one arrives
    for a request stream."""
    if not streaming:
        check_request_ids(request)
        return request
    return _checked_stream(request)


class _RefusedMessage(InvalidField):
    """A message of a request stream with a bad identifier (the interceptor refused it, so it
    drains the stream before the call ends; the handler's own errors end it as they did)."""

    def __init__(self, original: InvalidField) -> None:
        ShoalError.__init__(self, original.message)
        self.field_name = original.field_name
        self.value = original.value


async def _checked_stream(requests: Any) -> AsyncIterator[Any]:
    async for message in requests:
        try:
            check_request_ids(message)
        except InvalidField as exc:
            raise _RefusedMessage(exc) from None
        yield message


async def _drain(requests: Any, limit_s: float = 2.0) -> None:
    """Read (and drop) what is left of a refused request stream (bad credential, role or
    identifier) before the call ends: a gRPC client still writing when the server ends the call
    gets INTERNAL instead of the server's status. Bounded in time, so a client that never stops
    cannot hold the handler."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(limit_s):
            async for _ in requests:
                pass
