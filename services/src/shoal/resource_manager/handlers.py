"""The resource manager's thin gRPC handlers: validate, call the replica
(:class:`~shoal.resource_manager.service.ResourceManager`) and the core, render; and the roles
each method allows.

:mod:`shoal.resource_manager.service` re-exports every name here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from shoal.resource_manager import core
from shoal.resource_manager.core import Change, Inventory
from shoal.runtime.auth import ADMINS, SERVICES, USERS_AND_SERVICES, MethodRoles
from shoal.runtime.errors import InvalidField
from shoal.v1 import (
    resource_manager_service_pb2 as rm_pb2,
    resource_manager_service_pb2_grpc as rm_grpc,
)

if TYPE_CHECKING:
    from shoal.resource_manager.service import ResourceManager

log = logging.getLogger(__name__)

SERVICE_NAME = "shoal.v1.ResourceManagerService"

ROLES = MethodRoles(
    service=SERVICE_NAME,
    default=USERS_AND_SERVICES,
    methods={
        "RegisterHost": SERVICES,
        "Heartbeat": SERVICES,
        "AcquireDevices": SERVICES,
        "ReleaseDevices": SERVICES,
        "CordonHost": ADMINS,
        "DrainHost": ADMINS,
    },
)


class ResourceManagerServicer(rm_grpc.ResourceManagerServiceServicer):
    """Thin handlers: validate, call the replica / core, render."""

    def __init__(self, rm: ResourceManager) -> None:
        self.rm = rm

    @property
    def _inv(self) -> Inventory:
        return self.rm.inventory

    async def RegisterHost(
        self, request: rm_pb2.RegisterHostRequest, context: Any
    ) -> rm_pb2.RegisterHostResponse:
        reg = core.registration_from_proto(request)
        record = await self.rm.mutate(lambda: self._inv.register(reg))
        self._inv.mark_seen(reg.host_id)
        self.rm.publish(self._inv.observe_registration_learners(reg))
        log.info(
            "host %r registered from %s: incarnation %d, %d devices",
            record.host_id,
            record.agent_address,
            record.incarnation,
            len(record.devices),
        )
        return rm_pb2.RegisterHostResponse(
            incarnation=record.incarnation,
            heartbeat_interval_ms=int(self.rm.config.heartbeat_interval_s * 1000),
            lost_after_ms=int(self.rm.config.host_grace_s * 1000),
        )

    async def Heartbeat(
        self, request_iterator: AsyncIterator[rm_pb2.HeartbeatRequest], context: Any
    ) -> AsyncIterator[rm_pb2.HeartbeatResponse]:
        async for beat in request_iterator:
            self.rm.require_leader()
            outcome = self._inv.heartbeat(
                beat.host_id,
                beat.incarnation,
                [core.learner_from_proto(learner) for learner in beat.learners],
                [core.device_stats_from_proto(d) for d in beat.devices],
            )
            self.rm.publish(outcome.events)
            if beat.stopping:
                self._inv.note_stopping(beat.host_id, self.rm.config.host_restart_grace_s)
                log.info(
                    "host %r is stopping to restart: declared lost only after %g s of silence",
                    beat.host_id,
                    self.rm.config.host_restart_grace_s,
                )
            if outcome.health_changes:
                await self._persist_health(beat.host_id, outcome.health_changes)
            yield rm_pb2.HeartbeatResponse(
                sequence=beat.sequence, stop_learner_ids=outcome.stop_learner_ids
            )

    async def _persist_health(
        self, host_id: str, changes: Sequence[tuple[str, core.DeviceHealth]]
    ) -> None:
        await self.rm.mutate(lambda: (self._inv.set_device_health(host_id, changes), None))

    async def ListHosts(
        self, request: rm_pb2.ListHostsRequest, context: Any
    ) -> rm_pb2.ListHostsResponse:
        self.rm.require_leader()
        page, token = self._inv.list_hosts(
            request.page_size, request.page_token, include_lost=request.include_lost
        )
        return rm_pb2.ListHostsResponse(
            hosts=[core.host_to_proto(h, self._inv) for h in page], next_page_token=token
        )

    async def GetHost(self, request: rm_pb2.GetHostRequest, context: Any) -> rm_pb2.GetHostResponse:
        self.rm.require_leader()
        _require("host_id", request.host_id)
        host = self._inv.host(request.host_id)
        return rm_pb2.GetHostResponse(host=core.host_to_proto(host, self._inv))

    async def CordonHost(
        self, request: rm_pb2.CordonHostRequest, context: Any
    ) -> rm_pb2.CordonHostResponse:
        _require("host_id", request.host_id)
        await self.rm.mutate(lambda: (self._inv.cordon(request.host_id, request.cordon), None))
        host = self._inv.host(request.host_id)
        return rm_pb2.CordonHostResponse(host=core.host_to_proto(host, self._inv))

    async def DrainHost(
        self, request: rm_pb2.DrainHostRequest, context: Any
    ) -> rm_pb2.DrainHostResponse:
        _require("host_id", request.host_id)
        await self.rm.mutate(lambda: (self._inv.drain(request.host_id), None))
        host = self._inv.host(request.host_id)
        return rm_pb2.DrainHostResponse(host=core.host_to_proto(host, self._inv))

    async def AcquireDevices(
        self, request: rm_pb2.AcquireDevicesRequest, context: Any
    ) -> rm_pb2.AcquireDevicesResponse:
        _require_token(request)
        claims = [core.claim_from_proto(c) for c in request.claims]

        def compute() -> tuple[Change, tuple[core.AllocationRecord, ...]]:
            outcome = self._inv.acquire(claims, request.request_id)
            return outcome.change, outcome.allocations

        allocations = await self.rm.mutate(compute, token=request.fencing_token)
        return rm_pb2.AcquireDevicesResponse(
            allocations=[core.allocation_to_proto(a) for a in allocations]
        )

    async def ReleaseDevices(
        self, request: rm_pb2.ReleaseDevicesRequest, context: Any
    ) -> rm_pb2.ReleaseDevicesResponse:
        _require_token(request)
        ids = list(request.allocation_ids)

        def compute() -> tuple[Change, list[str]]:
            change = self._inv.release(ids)
            return change, [a.allocation_id for a in change.delete_allocations]

        released = await self.rm.mutate(compute, token=request.fencing_token)
        return rm_pb2.ReleaseDevicesResponse(released_allocation_ids=released)

    async def ListAllocations(
        self, request: rm_pb2.ListAllocationsRequest, context: Any
    ) -> rm_pb2.ListAllocationsResponse:
        self.rm.require_leader()
        return rm_pb2.ListAllocationsResponse(
            allocations=[core.allocation_to_proto(a) for a in self._inv.allocations(request.job_id)]
        )

    async def WatchInventory(
        self, request: rm_pb2.WatchInventoryRequest, context: Any
    ) -> AsyncIterator[rm_pb2.WatchInventoryResponse]:
        async for item in self.rm.watch():
            yield item


def _require(field_name: str, value: str) -> None:
    if not value:
        raise InvalidField(field_name, value, "must not be empty")


def _require_token(
    request: rm_pb2.AcquireDevicesRequest | rm_pb2.ReleaseDevicesRequest,
) -> None:
    if not request.HasField("fencing_token"):
        raise InvalidField("fencing_token", None, "is required (the scheduler's leadership)")


def bindings(rm: ResourceManager) -> Sequence[Any]:
    from shoal.runtime.server import ServiceBinding

    return [
        ServiceBinding(
            SERVICE_NAME,
            rm_grpc.add_ResourceManagerServiceServicer_to_server,  # type: ignore[arg-type]
            ResourceManagerServicer(rm),
            ROLES,
        )
    ]
