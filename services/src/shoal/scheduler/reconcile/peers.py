"""The services the scheduler calls, and what their errors mean.

:class:`Peers` pools the channels to the resource-manager (following its leader), the host
agents and the parameter-sync shards, with the service token. The outbound error table says
which status codes may succeed later (:data:`TRANSIENT_CODES`), which mean a shard cannot be
reached (:data:`UNREACHABLE`), and turns a peer's FENCED_OUT into :class:`FencedOutByPeer`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import tenacity
from grpc import aio

from shoal.contract.errors import decode_rpc_error
from shoal.runtime.channels import connect
from shoal.runtime.config import TLSConfig
from shoal.v1 import (
    host_agent_service_pb2 as ha_pb2,
    host_agent_service_pb2_grpc,
    parameter_sync_service_pb2_grpc,
    resource_manager_service_pb2_grpc,
)

log = logging.getLogger(__name__)

#: Status codes after which the same call may succeed later.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.FAILED_PRECONDITION,  # device busy, host cordoned: plan again
    }
)

#: Status codes that mean a shard could not be reached (dead, partitioned, overloaded).
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class Peers:
    """Channels to the resource-manager (following its leader), the host agents and the
    parameter-sync shards, with the service token."""

    def __init__(
        self,
        resource_managers: Sequence[str],
        sync_shards: Sequence[str],
        *,
        token: str | None,
        tls: TLSConfig | None = None,
        channel_factory: Callable[[str], aio.Channel] | None = None,
    ) -> None:
        if not resource_managers:
            raise ValueError("resource_managers ([]) must name at least one address")
        self._rm_addresses = list(resource_managers)
        self._rm_index = 0
        self._rm_override: str | None = None
        self.sync_shards = tuple(sync_shards)
        self._token = token
        self._factory = channel_factory or (lambda address: connect(address, token=token, tls=tls))
        self._channels: dict[str, aio.Channel] = {}
        self._closing: set[asyncio.Future[None]] = set()

    def channel(self, address: str) -> aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self._factory(address)
        return ch

    # -- resource-manager (leader-following) ----------------------------------------------------

    @property
    def rm_address(self) -> str:
        return self._rm_override or self._rm_addresses[self._rm_index % len(self._rm_addresses)]

    def rm(self) -> resource_manager_service_pb2_grpc.ResourceManagerServiceStub:
        return resource_manager_service_pb2_grpc.ResourceManagerServiceStub(
            self.channel(self.rm_address)
        )

    def rm_failed(self, exc: grpc.aio.AioRpcError) -> bool:
        """Point at the leader named in a standby's answer, or at the next address. Returns
        whether retrying at once makes sense (a leader was named)."""
        leader = decode_rpc_error(exc).leader
        if leader and leader != self.rm_address:
            self._rm_override = leader
            return True
        self._rm_override = None
        self._rm_index += 1
        return False

    async def rm_call(self, method: str, request: Any, timeout: float) -> Any:
        """Call the resource manager; on UNAVAILABLE try again at once on the leader a standby
        named, or the next address, once per address (then the error is raised)."""

        def next_replica(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None
            self.rm_failed(state.outcome.exception())  # type: ignore[arg-type]

        async for attempt in tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(
                lambda e: (
                    isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE
                )
            ),
            stop=tenacity.stop_after_attempt(len(self._rm_addresses) + 1),
            before_sleep=next_replica,
            reraise=True,
        ):
            with attempt:
                return await getattr(self.rm(), method)(request, timeout=timeout)
        raise AssertionError("unreachable")

    # -- agents and shards ------------------------------------------------------------------------

    def agent(self, address: str) -> host_agent_service_pb2_grpc.HostAgentServiceStub:
        return host_agent_service_pb2_grpc.HostAgentServiceStub(self.channel(address))

    def shard(self, address: str) -> parameter_sync_service_pb2_grpc.ParameterSyncServiceStub:
        return parameter_sync_service_pb2_grpc.ParameterSyncServiceStub(self.channel(address))

    def forget(self, address: str, *, close_after_s: float = 30.0) -> None:
        """Drop the cached channel to ``address``: its peer came back (a host agent registered
        again), and a channel that failed while it was down may still sit in gRPC's reconnect
        backoff, where a new one connects at once. Calls in flight on the old channel finish;
        it is closed ``close_after_s`` later."""
        old = self._channels.pop(address, None)
        if old is None:
            return

        async def close_later() -> None:
            try:
                await asyncio.sleep(close_after_s)
            finally:  # also when the pool closes first
                with contextlib.suppress(Exception):
                    await old.close()

        task = asyncio.ensure_future(close_later())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- host agents: reads for the API ------------------------------------------------------

    async def learner_log_responses(
        self, address: str, request: ha_pb2.StreamLearnerLogsRequest, timeout: float | None
    ) -> AsyncIterator[ha_pb2.StreamLearnerLogsResponse]:
        """The responses of the agent at ``address`` to StreamLearnerLogs. A failed call (the
        host is gone) ends the stream quietly (logged at debug): logs are best effort."""
        try:
            async for response in self.agent(address).StreamLearnerLogs(request, timeout=timeout):
                yield response
        except grpc.aio.AioRpcError as exc:
            log.debug("logs of %s at %s: %s", request.learner_id, address, exc.code().name)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        closing = list(self._closing)
        for task in closing:
            task.cancel()
        await asyncio.gather(*closing, return_exceptions=True)
        for ch in channels:
            with contextlib.suppress(Exception):
                await ch.close()


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class FencedOutByPeer(Exception):
    """A peer refused our fencing token: a newer scheduler leads."""


class PermanentFailure(Exception):
    """A call failed in a way retrying will not fix; the job fails with this reason."""


def check_fenced(exc: grpc.aio.AioRpcError) -> None:
    if decode_rpc_error(exc).reason == "ERROR_REASON_FENCED_OUT":
        raise FencedOutByPeer(describe(exc)) from exc
