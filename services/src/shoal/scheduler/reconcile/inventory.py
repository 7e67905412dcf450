"""The resource-manager's view the scheduler keeps: hosts and the allocation ledger, as
WatchInventory last told them.

The placement views of the hosts (``host_views``) are cached per host and rebuilt only for the
hosts an event changed (put, lost, an allocation made or released on it): a cycle no longer
rebuilds 80,000 device views at 10,000 hosts x 8 GPUs when one host changed. Every change goes
through the methods below (the hosts and the ledger are read, never written, elsewhere)."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from typing import Any

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
        self._views: dict[str, HostView] = {}
        self._stale: set[str] = set()  # hosts whose view must be rebuilt
        self._changed: set[str] = set()  # hosts changed since take_changed (the planner's events)
        self._allocs_on: dict[str, set[str]] = {}  # host -> ids of the allocations on it
        self._holders: dict[str, str] = {}  # allocation id -> learner id, as the ledger's
        # job -> learner id -> how many of the ledger's allocations name that pair
        self._by_job: dict[str, dict[str, int]] = {}

    def _index(self, allocation: resources_pb2.Allocation) -> None:
        self._allocs_on.setdefault(allocation.host_id, set()).add(allocation.allocation_id)
        of_job = self._by_job.setdefault(allocation.job_id, {})
        of_job[allocation.learner_id] = of_job.get(allocation.learner_id, 0) + 1
        self._stale.add(allocation.host_id)
        self._changed.add(allocation.host_id)

    def _unindex(self, allocation: resources_pb2.Allocation) -> None:
        on_host = self._allocs_on.get(allocation.host_id)
        if on_host is not None:
            on_host.discard(allocation.allocation_id)
        of_job = self._by_job.get(allocation.job_id)
        if of_job is not None and allocation.learner_id in of_job:
            of_job[allocation.learner_id] -= 1
            if not of_job[allocation.learner_id]:
                del of_job[allocation.learner_id]
                if not of_job:
                    del self._by_job[allocation.job_id]
        self._stale.add(allocation.host_id)
        self._changed.add(allocation.host_id)

    def reset(
        self, hosts: Iterable[resources_pb2.Host], allocations: Iterable[resources_pb2.Allocation]
    ) -> None:
        self._changed.update(self.hosts)  # the hosts a snapshot drops are changed too
        self.hosts = {h.host_id: h for h in hosts}
        self.ledger = {a.allocation_id: a for a in allocations}
        # Allocations listed on the devices count too (a snapshot may carry them either way).
        for host in self.hosts.values():
            for device in host.devices:
                if device.HasField("allocation") and device.allocation.allocation_id:
                    self.ledger.setdefault(device.allocation.allocation_id, device.allocation)
        self._views = {}
        self._allocs_on = {}
        self._holders = {a.allocation_id: a.learner_id for a in self.ledger.values()}
        self._by_job = {}
        for a in self.ledger.values():
            self._allocs_on.setdefault(a.host_id, set()).add(a.allocation_id)
            of_job = self._by_job.setdefault(a.job_id, {})
            of_job[a.learner_id] = of_job.get(a.learner_id, 0) + 1
        self._stale = set(self.hosts)
        self._changed.update(self.hosts)
        self.synced = True

    def put_host(self, host: resources_pb2.Host) -> None:
        self.hosts[host.host_id] = host
        self._stale.add(host.host_id)
        self._changed.add(host.host_id)

    def lose_host(self, host: resources_pb2.Host) -> None:
        known = self.hosts.get(host.host_id)
        lost = resources_pb2.Host()
        lost.CopyFrom(known if known is not None else host)
        lost.state = resources_pb2.HOST_STATE_LOST
        self.hosts[host.host_id] = lost
        self._stale.add(host.host_id)
        self._changed.add(host.host_id)

    def allocated(self, allocations: Iterable[resources_pb2.Allocation]) -> None:
        for a in allocations:
            old = self.ledger.get(a.allocation_id)
            if old is not None:
                self._unindex(old)
            self.ledger[a.allocation_id] = a
            self._holders[a.allocation_id] = a.learner_id
            self._index(a)

    def released(self, allocation_ids: Iterable[str]) -> None:
        for allocation_id in allocation_ids:
            a = self.ledger.pop(allocation_id, None)
            if a is not None:
                del self._holders[allocation_id]
                self._unindex(a)

    def orphans(self, known: Container[str]) -> list[str]:
        """The ids of the ledger's allocations whose learner is not in ``known``, in the
        ledger's order (from a plain index: no protobuf read per allocation)."""
        holders = self._holders
        if isinstance(known, (set, frozenset)) and known.issuperset(holders.values()):
            return []  # the common case, in C
        return [a for a, learner_id in holders.items() if learner_id not in known]

    def held_by(self, records: Mapping[str, Any]) -> bool:
        """Whether every allocation of the ledger is held by a learner of the job it names
        (``records``: job id -> a record with ``learners`` by learner id). Then none is an
        orphan: ``orphans`` of the learner ids of every record is empty. Checked job by job,
        from a plain index (no set of every learner id built)."""
        for job_id, holders in self._by_job.items():
            record = records.get(job_id)
            if record is None or not record.learners.keys() >= holders.keys():
                return False
        return True

    def device(self, host_id: str, device_id: str) -> resources_pb2.Device | None:
        host = self.hosts.get(host_id)
        if host is None:
            return None
        return next((d for d in host.devices if d.device_id == device_id), None)

    def take_changed(self) -> set[str]:
        """The ids of the hosts changed (put, lost, dropped by a snapshot, an allocation made
        or released on them) since the last call: the incremental planner's host events."""
        changed, self._changed = self._changed, set()
        return changed

    def view(self, host_id: str) -> HostView | None:
        """One host's placement view (rebuilt if an event changed it), None if not known."""
        if host_id in self._stale:
            self._stale.discard(host_id)
            host = self.hosts.get(host_id)
            if host is None:
                self._views.pop(host_id, None)
            else:
                self._views[host_id] = self._view(host)
        return self._views.get(host_id)

    def host_views(self) -> list[HostView]:
        """The placement view of every host: the cached ones, those an event changed rebuilt."""
        for host_id in self._stale:
            host = self.hosts.get(host_id)
            if host is None:
                self._views.pop(host_id, None)
            else:
                self._views[host_id] = self._view(host)
        self._stale.clear()
        return list(self._views.values())

    def _view(self, host: resources_pb2.Host) -> HostView:
        by_device = {}
        for allocation_id in self._allocs_on.get(host.host_id, ()):
            a = self.ledger[allocation_id]
            by_device[a.device_id] = a.learner_id
        if host.state == resources_pb2.HOST_STATE_LOST:
            state = HostState.LOST
        elif host.cordoned or host.draining:
            state = HostState.CORDONED
        else:
            state = HostState.READY
        devices = []
        for d in host.devices:
            owner = by_device.get(d.device_id)
            if owner is None and d.health == resources_pb2.DEVICE_HEALTH_UNHEALTHY:
                owner = "<unhealthy>"  # never free, not capacity
            devices.append(DeviceView(d.device_id, owner))
        return HostView(host.host_id, tuple(devices), state)
