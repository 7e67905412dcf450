"""Following the job's coordinator (part of the ``"grpc"`` backend, ``grpc_backend.py``):
control calls retried while it is unreachable, watched while they hang, and a coordinator
that moved (its shard was lost, another took the role over) found through the other shards
(``FindCoordinator``) and followed. See docs/data-plane.md, "Coordinator failover".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from grpc import aio

from shoal.learner.grpc_calls import _RETRYABLE, _translate
from shoal.learner.liveness import CoordinatorMoved, watched
from shoal.v1 import (
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)

__all__ = ["CoordinatorFollowing"]

log = logging.getLogger("shoal.learner.grpc")
T = TypeVar("T")


class CoordinatorFollowing:
    """Mixin of :class:`~shoal.learner.grpc_backend.GrpcBackend` (its attributes are the
    backend's)."""

    coordinator: str
    _coordinator_epoch: int
    _recheck_coordinator: bool
    _rejoin: bool
    _probe_turn: int
    _retry_s: float
    _metadata: Any
    _endpoints: tuple[str, ...]
    _shards: list[Any]
    _setup: Any
    _routing_epoch: int
    watch_after_s: float
    watch_every_s: float

    async def _control(self, method: str, request: Any, metadata: Any = None) -> Any:
        """A unary control call to the coordinator, retried while it is unreachable. Meanwhile
        the other shards are asked whether the coordinator moved (its shard was lost and
        another took the role over): then the learner joins the new one and asks it. An answer
        from a coordinator older than one already followed is refused (it was fenced). A call
        that hangs (a frozen coordinator) is watched: the shards are asked where the
        coordinator is while it waits, and it is dropped for the new one (``_watch``)."""
        deadline = time.monotonic() + self._retry_s
        delay = 0.1
        if self._recheck_coordinator:
            self._recheck_coordinator = False
            await self._find_coordinator(metadata)
        while True:
            if self._rejoin and method != "Join" and self._setup is not None:
                await self._join(self._setup, metadata)
            try:
                call = getattr(self._coordinator_stub(), method)
                reply = await self._watch(call(request, metadata=metadata or self._metadata))
            except CoordinatorMoved:
                deadline = time.monotonic() + self._retry_s
                continue
            except aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE or time.monotonic() > deadline:
                    raise _translate(exc) from exc
                why = exc.details()
            else:
                epoch = getattr(reply, "coordinator_epoch", None)
                if epoch is None or epoch >= self._coordinator_epoch:
                    if epoch is not None:
                        self._coordinator_epoch = epoch
                    return reply
                why = (
                    f"coordinator {self.coordinator} answered from epoch {epoch}, older than "
                    f"{self._coordinator_epoch}"
                )
            if await self._find_coordinator(metadata) or (self._rejoin and method != "Join"):
                deadline = time.monotonic() + self._retry_s
                continue
            log.warning("%s; retrying in %.1f s", why, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _watch(self, call: Awaitable[T]) -> T:
        """``call`` (an RPC, or a gather of streams) watched for a coordinator that hangs
        (``shoal.learner.liveness``): raises CoordinatorMoved once the shards name a new one."""
        waited_on = self.coordinator
        try:
            return await watched(
                call,
                self._probe_coordinator,
                after_s=self.watch_after_s,
                every_s=self.watch_every_s,
            )
        except CoordinatorMoved:
            log.warning(
                "a call waited on coordinator %s, which hangs, after the role moved: dropped it "
                "to follow %s",
                waited_on,
                self.coordinator,
            )
            raise

    def _candidates(self) -> list[str]:
        """The shards to ask where the coordinator is: all known but the one followed."""
        candidates = dict.fromkeys([*(s.address for s in self._shards), *self._endpoints])
        candidates.pop(self.coordinator, None)
        return list(candidates)

    async def _probe_coordinator(self) -> bool:
        """One liveness probe while a call waits on the coordinator: ask one other shard (in
        turn) where the coordinator is; True if it named a newer one (now followed)."""
        candidates = self._candidates()
        if not candidates:
            return False
        address = candidates[self._probe_turn % len(candidates)]
        self._probe_turn += 1
        return await self._ask_where(address, self._metadata, timeout=2.0)

    async def _find_coordinator(self, metadata: Any = None) -> bool:
        """Ask the other shards where the job's coordinator is; switch to it (True) when one
        names a newer coordinator than the one followed."""
        for address in self._candidates():
            if await self._ask_where(address, metadata or self._metadata, timeout=5.0):
                return True
        return False

    async def _ask_where(self, address: str, metadata: Any, *, timeout: float) -> bool:
        """FindCoordinator on the shard at ``address``; follow a newer coordinator it names
        (True: Join it before the next control call)."""
        stub = ps_grpc.ParameterSyncServiceStub(self._channel(address))
        request = ps_pb2.FindCoordinatorRequest(job_id=self.job_id)
        try:
            reply = await stub.FindCoordinator(request, metadata=metadata, timeout=timeout)
        except aio.AioRpcError as exc:
            log.info("FindCoordinator on %s: %s", address, exc.details())
            return False
        if reply.coordinator_epoch <= self._coordinator_epoch or not reply.coordinator_address:
            return False
        log.warning(
            "coordinator moved: %s -> %s (epoch %d)",
            self.coordinator,
            reply.coordinator_address,
            reply.coordinator_epoch,
        )
        self.coordinator = reply.coordinator_address
        self._coordinator_epoch = reply.coordinator_epoch
        self._routing_epoch = 0  # the new coordinator's routing starts afresh
        self._rejoin = self._setup is not None
        return True
