"""The resource-manager's view the scheduler keeps: hosts and the allocation ledger, as
WatchInventory last told them."""

from __future__ import annotations

from collections.abc import Iterable

from shoal.scheduler.placement import (
    DeviceView,
    HostState,
    HostView,
)
from shoal.v1 import (
    resources_pb2,
)


class Inventory:
    """Hosts and the allocation ledger, as the resource-manager last told them."""

    def __init__(self) -> None:
        self.hosts: dict[str, resources_pb2.Host] = {}
        self.ledger: dict[str, resources_pb2.Allocation] = {}
        self.synced = False

    def reset(
        self, hosts: Iterable[resources_pb2.Host], allocations: Iterable[resources_pb2.Allocation]
    ) -> None:
        self.hosts = {h.host_id: h for h in hosts}
        self.ledger = {a.allocation_id: a for a in allocations}
        # Allocations listed on the devices count too (a snapshot may carry them either way).
        for host in self.hosts.values():
            for device in host.devices:
                if device.HasField("allocation") and device.allocation.allocation_id:
                    self.ledger.setdefault(device.allocation.allocation_id, device.allocation)
        self.synced = True

    def put_host(self, host: resources_pb2.Host) -> None:
        self.hosts[host.host_id] = host

    def lose_host(self, host: resources_pb2.Host) -> None:
        known = self.hosts.get(host.host_id)
        lost = resources_pb2.Host()
        lost.CopyFrom(known if known is not None else host)
        lost.state = resources_pb2.HOST_STATE_LOST
        self.hosts[host.host_id] = lost

    def allocated(self, allocations: Iterable[resources_pb2.Allocation]) -> None:
        for a in allocations:
            self.ledger[a.allocation_id] = a

    def released(self, allocation_ids: Iterable[str]) -> None:
        for a in allocation_ids:
            self.ledger.pop(a, None)

    def device(self, host_id: str, device_id: str) -> resources_pb2.Device | None:
        host = self.hosts.get(host_id)
        if host is None:
            return None
        return next((d for d in host.devices if d.device_id == device_id), None)

    def host_views(self) -> list[HostView]:
        by_device = {(a.host_id, a.device_id): a.learner_id for a in self.ledger.values()}
        views = []
        for host in self.hosts.values():
            if host.state == resources_pb2.HOST_STATE_LOST:
                state = HostState.LOST
            elif host.cordoned or host.draining:
                state = HostState.CORDONED
            else:
                state = HostState.READY
            devices = []
            for d in host.devices:
                owner = by_device.get((host.host_id, d.device_id))
                if owner is None and d.health == resources_pb2.DEVICE_HEALTH_UNHEALTHY:
                    owner = "<unhealthy>"  # never free, not capacity
                devices.append(DeviceView(d.device_id, owner))
            views.append(HostView(host.host_id, tuple(devices), state))
        return views
