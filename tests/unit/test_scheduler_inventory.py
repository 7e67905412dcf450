"""The scheduler's Inventory: host views cached per host equal the views rebuilt from scratch
after any sequence of inventory events."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from shoal.scheduler.placement import DeviceView, HostState, HostView
from shoal.scheduler.reconcile.inventory import Inventory
from shoal.v1 import resources_pb2


def from_scratch(inventory: Inventory) -> dict[str, HostView]:
    """The views as the loop built them before the cache: every host, every device."""
    by_device = {(a.host_id, a.device_id): a.learner_id for a in inventory.ledger.values()}
    views = {}
    for host in inventory.hosts.values():
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
                owner = "<unhealthy>"
            devices.append(DeviceView(d.device_id, owner))
        views[host.host_id] = HostView(host.host_id, tuple(devices), state)
    return views


HOSTS = [f"h{i}" for i in range(4)]


@st.composite
def hosts(draw: st.DrawFn) -> resources_pb2.Host:
    host = resources_pb2.Host(
        host_id=draw(st.sampled_from(HOSTS)),
        cordoned=draw(st.booleans()),
        draining=draw(st.booleans()),
        state=draw(
            st.sampled_from([resources_pb2.HOST_STATE_READY, resources_pb2.HOST_STATE_LOST])
        ),
    )
    for d in range(draw(st.integers(0, 4))):
        unhealthy = draw(st.booleans())
        host.devices.add(
            device_id=str(d),
            health=resources_pb2.DEVICE_HEALTH_UNHEALTHY
            if unhealthy
            else resources_pb2.DEVICE_HEALTH_HEALTHY,
        )
    return host


@st.composite
def allocations(draw: st.DrawFn) -> resources_pb2.Allocation:
    return resources_pb2.Allocation(
        allocation_id=f"a{draw(st.integers(0, 6))}",
        host_id=draw(st.sampled_from([*HOSTS, "elsewhere"])),
        device_id=str(draw(st.integers(0, 4))),
        learner_id=f"l{draw(st.integers(0, 3))}",
    )


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_cached_host_views_equal_the_views_built_from_scratch(data: st.DataObject) -> None:
    inventory = Inventory()
    inventory.reset(
        data.draw(st.lists(hosts(), max_size=4)), data.draw(st.lists(allocations(), max_size=4))
    )
    for _ in range(data.draw(st.integers(1, 20))):
        op = data.draw(st.sampled_from(["put", "lose", "allocated", "released", "reset", "view"]))
        if op == "put":
            inventory.put_host(data.draw(hosts()))
        elif op == "lose":
            inventory.lose_host(data.draw(hosts()))
        elif op == "allocated":
            inventory.allocated(data.draw(st.lists(allocations(), max_size=3)))
        elif op == "released":
            inventory.released([f"a{i}" for i in data.draw(st.lists(st.integers(0, 6)))])
        elif op == "reset":
            inventory.reset(
                data.draw(st.lists(hosts(), max_size=4)),
                data.draw(st.lists(allocations(), max_size=4)),
            )
        views = {v.host_id: v for v in inventory.host_views()}
        expected = from_scratch(inventory)
        # A device two allocations name is never free either way; which learner is named
        # may differ, so compare "allocated or not" and the rest exactly.
        assert views.keys() == expected.keys()
        for host_id, view in views.items():
            want = expected[host_id]
            assert (view.state, [d.device_id for d in view.devices]) == (
                want.state,
                [d.device_id for d in want.devices],
            )
            assert [d.allocated_to is None for d in view.devices] == [
                d.allocated_to is None for d in want.devices
            ]
