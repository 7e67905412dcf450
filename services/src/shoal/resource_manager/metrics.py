"""The resource manager's metrics (see docs/operations.md, "Reading metrics").

Observable gauges read the leader's in-memory inventory at scrape time. Only the leader
reports them: a standby's inventory is neither current nor fed by heartbeats, so it exports
no points for these gauges (``shoal_leader{election="resource-manager"}`` tells which replica
leads); summing over every replica therefore never counts a GPU twice.

==================================  ========  ============================================
metric                              labels    meaning
==================================  ========  ============================================
``shoal_gpus_total``                host      devices of a host that is not lost
``shoal_gpus_allocated``            host      of those, devices allocated to a learner
``shoal_gpus_idle``                 host      of those, healthy unallocated devices on a
                                              schedulable host (what a new learner can get)
``shoal_host_heartbeat_lag_seconds`` host     seconds since the last heartbeat of a ready
                                              host (lost hosts are not reported)
==================================  ========  ============================================

``total - allocated - idle`` is what is unusable now: unhealthy devices, cordoned or draining
hosts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from shoal.resource_manager.core import DeviceHealth, Liveness, Scheduling
from shoal.runtime.metrics import meter, observer

if TYPE_CHECKING:
    from shoal.resource_manager.service import ResourceManager

__all__ = ["gpu_counts", "heartbeat_lags", "register_metrics"]

Point = tuple[float, Mapping[str, str]]


def gpu_counts(rm: ResourceManager) -> dict[str, dict[str, int]]:
    """``{"total" | "allocated" | "idle": {host: count}}`` from the leader's inventory
    (empty on a standby)."""
    out: dict[str, dict[str, int]] = {"total": {}, "allocated": {}, "idle": {}}
    if not rm.became_leader.is_set():
        return out
    inventory = rm.inventory
    taken: set[tuple[str, str]] = {(a.host_id, a.device_id) for a in inventory.allocations()}
    for host in inventory.hosts(include_lost=False):
        usable = host.liveness is Liveness.READY and host.scheduling is Scheduling.SCHEDULABLE
        allocated = idle = 0
        for device in host.devices:
            if (host.host_id, device.device_id) in taken:
                allocated += 1
            elif usable and device.health is not DeviceHealth.UNHEALTHY:
                idle += 1
        out["total"][host.host_id] = len(host.devices)
        out["allocated"][host.host_id] = allocated
        out["idle"][host.host_id] = idle
    return out


def heartbeat_lags(rm: ResourceManager) -> dict[str, float]:
    """Seconds since each ready host's last heartbeat, as the leader sees it (a new leader
    counts from when it took over)."""
    if not rm.became_leader.is_set():
        return {}
    inventory = rm.inventory
    return {
        host.host_id: inventory.silence(host.host_id)
        for host in inventory.hosts(include_lost=False)
        if host.liveness is Liveness.READY
    }


def register_metrics(rm: ResourceManager) -> None:
    """Create the resource manager's instruments over ``rm`` (once per process)."""
    m = meter(__name__)

    def gpus(kind: str) -> Iterator[Point]:
        for host, count in gpu_counts(rm)[kind].items():
            yield float(count), {"host": host}

    for kind, text in (
        ("total", "Devices (GPU slots) of each host that is not lost"),
        ("allocated", "Devices of each host allocated to a learner"),
        ("idle", "Healthy unallocated devices of each ready, schedulable host"),
    ):
        m.create_observable_gauge(
            f"shoal_gpus_{kind}",
            callbacks=[observer(functools.partial(gpus, kind), what=f"shoal_gpus_{kind}")],
            description=f"{text} (reported by the resource-manager leader only)",
        )
    m.create_observable_gauge(
        "shoal_host_heartbeat_lag",
        callbacks=[
            observer(
                lambda: ((lag, {"host": host}) for host, lag in heartbeat_lags(rm).items()),
                what="shoal_host_heartbeat_lag_seconds",
            )
        ],
        unit="s",
        description="Seconds since the last heartbeat of each ready host "
        "(reported by the resource-manager leader only)",
    )
