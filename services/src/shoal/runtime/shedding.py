"""Load shedding: past ``--max-concurrent-calls`` calls in flight, a server refuses new unary
calls at once with RESOURCE_EXHAUSTED (``ERROR_REASON_OVERLOADED``) instead of queueing them
until their deadlines expire.

A server under 10x its normal request load then answers every call it takes in normal time and
tells the rest to back off, and its own background work (the resource manager's liveness loop,
the scheduler's reconcile loop) keeps running, so no host is declared lost because the control
plane was busy. Exempt, always served: streaming responses (watches, logs, heartbeats, the
gradient stream: they are long-lived and counted by their own limits), RegisterHost (a host's
liveness must never be shed), health checks and reflection. ``0`` (the default) turns shedding
off.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from shoal.contract.errors import REASON_METADATA_KEY, Overloaded

log = logging.getLogger(__name__)

EXEMPT_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
EXEMPT_METHODS = frozenset({"RegisterHost", "Heartbeat"})


class LoadShedder(aio.ServerInterceptor):
    """Counts unary calls in flight; refuses the ones over ``limit`` (see the module doc)."""

    def __init__(self, limit: int, service_name: str) -> None:
        if limit < 0:
            raise ValueError(f"limit ({limit}) must be >= 0")
        self.limit = limit
        self.service_name = service_name
        self.in_flight = 0
        self.shed = 0  # calls refused so far

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or self.limit == 0 or handler.response_streaming:
            return handler
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        if service in EXEMPT_SERVICES or method in EXEMPT_METHODS:
            return handler
        behavior = handler.unary_unary or handler.stream_unary

        async def guarded(request: Any, context: aio.ServicerContext) -> Any:
            if self.in_flight >= self.limit:
                self.shed += 1
                if self.shed == 1 or self.shed % 1000 == 0:
                    log.warning(
                        "overloaded: %d calls in flight; shedding (%d shed so far)",
                        self.in_flight,
                        self.shed,
                    )
                context.set_trailing_metadata(((REASON_METADATA_KEY, Overloaded.reason),))
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.service_name} is overloaded: {self.in_flight} calls in flight "
                    f"(--max-concurrent-calls {self.limit}); retry after a short backoff",
                )
            self.in_flight += 1
            try:
                return await behavior(request, context)
            finally:
                self.in_flight -= 1

        factory = (
            grpc.unary_unary_rpc_method_handler
            if handler.unary_unary
            else grpc.stream_unary_rpc_method_handler
        )
        return factory(
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
