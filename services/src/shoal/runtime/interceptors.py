"""The server interceptor every shoal service runs: authentication, authorization, the principal
of the call, and the mapping of domain errors to status codes (one error table per service).

It wraps each method handler so that the checks run in the handler's own task (the principal is
a context variable the handler can read) and before any of the handler's code.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from grpc import aio
from opentelemetry import trace

from shoal.runtime.auth import (
    PUBLIC_SERVICES,
    MethodRoles,
    Principal,
    Role,
    TokenTable,
    set_current_principal,
)
from shoal.runtime.errors import (
    REASON_METADATA_KEY,
    ErrorTable,
    PermissionDenied,
    Unauthenticated,
)

log = logging.getLogger(__name__)


def split_method(full_method: str) -> tuple[str, str]:
    """'/shoal.v1.X/Y' -> ('shoal.v1.X', 'Y')."""
    _, service, method = full_method.split("/", 2)
    return service, method


def bearer_token(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class ShoalServerInterceptor(aio.ServerInterceptor):
    """Auth + error mapping. ``tokens=None`` disables auth (every caller is an admin)."""

    def __init__(
        self,
        *,
        tokens: TokenTable | None,
        roles: Mapping[str, MethodRoles],
        errors: ErrorTable,
    ) -> None:
        self._tokens = tokens
        self._roles = roles
        self._errors = errors

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
        token = bearer_token(context.invocation_metadata())
        if token is None:
            raise Unauthenticated("missing bearer token: send 'authorization: Bearer <token>'")
        principal = self._tokens.authenticate(token)
        if principal is None:
            raise Unauthenticated("unknown bearer token")
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
                f"{service}/{method} needs role {names}; {principal.name} has {have}"
            )
        return principal

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
            try:
                set_current_principal(authorize(context))
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
                if result is not None:
                    async for item in result:
                        yield item
            except aio.AbortError:
                raise
            except Exception as exc:
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
        try:
            set_current_principal(authorize(context))
            return await behavior(request, context)
        except aio.AbortError:
            raise
        except Exception as exc:
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
