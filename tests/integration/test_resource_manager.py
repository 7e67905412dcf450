"""The resource manager on a real etcd: in process for the API contract (codes, roles, fencing,
watch, leadership), and as real processes with real host agents for host loss and failover."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from shoal.resource_manager.service import (
    ERRORS,
    ResourceManager,
    ResourceManagerConfig,
    bindings,
)
from shoal.resource_manager.store import host_key
from shoal.runtime.channels import connect
from shoal.runtime.config import ServerConfig
from shoal.runtime.election import DEFAULT_PREFIX, LeaderElection, Leadership
from shoal.runtime.errors import LEADER_METADATA_KEY, REASON_METADATA_KEY
from shoal.runtime.server import RunningServer, create_server
from shoal.runtime.store import EtcdStore
from shoal.v1 import (
    resource_manager_service_pb2 as rm,
    resource_manager_service_pb2_grpc as rm_grpc,
    resources_pb2,
)
from tests.integration._shoal_processes import (
    ELECTION_TTL_S,
    GRACE_S,
    ShoalProcesses,
)
from tests.support import async_wait_until, make_tokens

K = rm.InventoryEventKind


def metadata(exc: aio.AioRpcError, key: str) -> str | None:
    for k, v in exc.trailing_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


async def expect_error(coro, code: grpc.StatusCode, *words: str) -> aio.AioRpcError:
    with pytest.raises(aio.AioRpcError) as info:
        await coro
    exc = info.value
    assert exc.code() == code, f"{exc.code()} {exc.details()}"
    for word in words:
        assert word in (exc.details() or ""), exc.details()
    return exc


def device(i: int) -> resources_pb2.Device:
    return resources_pb2.Device(
        device_id=f"gpu{i}",
        index=i,
        uuid=f"GPU-{i}",
        model="sim",
        memory_bytes=1 << 30,
        health=resources_pb2.DEVICE_HEALTH_HEALTHY,
        simulated=True,
    )


def register_request(host_id: str, n: int = 4) -> rm.RegisterHostRequest:
    return rm.RegisterHostRequest(
        host_id=host_id, agent_address="127.0.0.1:9", devices=[device(i) for i in range(n)]
    )


def claim(host: str, dev: str, learner: str, job: str = "j1") -> rm.DeviceClaim:
    return rm.DeviceClaim(job_id=job, learner_id=learner, host_id=host, device_id=dev)


class Scheduler:
    """A job-scheduler leadership in the real election, to get fencing tokens from."""

    def __init__(self, store: EtcdStore, name: str) -> None:
        self.election = LeaderElection(store, "job-scheduler", name, ttl=5)
        self.leadership: Leadership | None = None

    async def lead(self) -> resources_pb2.FencingToken:
        self.leadership = await self.election.campaign()
        return self.token

    @property
    def token(self) -> resources_pb2.FencingToken:
        assert self.leadership is not None
        return resources_pb2.FencingToken(
            election="job-scheduler",
            holder=self.election.candidate_id,
            revision=self.leadership.fence.create_revision,
        )


# --------------------------------------------------------------------------------------------
# In process
# --------------------------------------------------------------------------------------------


class Replica:
    def __init__(self, rm_: ResourceManager, running: RunningServer, store: EtcdStore) -> None:
        self.rm = rm_
        self.running = running
        self.store = store

    @property
    def address(self) -> str:
        return self.running.address

    async def close(self) -> None:
        await self.rm.close()
        await self.running.stop(0)
        await self.store.close()


class Bed:
    """Resource-manager replicas in this process on one real etcd."""

    def __init__(self, endpoints: list[str], tmp: Path) -> None:
        self.endpoints = endpoints
        self.tokens_file = tmp / "tokens"
        self.tokens = make_tokens(self.tokens_file)
        self.replicas: list[Replica] = []
        self.channels: list[aio.Channel] = []
        self.store = EtcdStore(endpoints, timeout=3)

    async def replica(self, grace_s: float = 30.0) -> Replica:
        config = ResourceManagerConfig(
            server=ServerConfig("resource-manager", tokens_file=str(self.tokens_file)),
            heartbeat_interval_s=0.3,
            host_grace_s=grace_s,
            election_ttl_s=2.0,
        )
        store = EtcdStore(self.endpoints, timeout=3)
        rm_ = ResourceManager(config, store)
        running = await create_server(config.server, bindings(rm_), errors=ERRORS)
        rm_.start(running.address)
        replica = Replica(rm_, running, store)
        self.replicas.append(replica)
        return replica

    def stub(self, replica: Replica, role: str = "service") -> rm_grpc.ResourceManagerServiceStub:
        channel = connect(replica.address, token=self.tokens[role], trace=False)
        self.channels.append(channel)
        return rm_grpc.ResourceManagerServiceStub(channel)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        for replica in self.replicas:
            await replica.close()
        await self.store.close()


@pytest.fixture
async def bed(etcd, tmp_path) -> AsyncIterator[Bed]:
    bed = Bed(etcd.endpoints, tmp_path)
    try:
        yield bed
    finally:
        await bed.close()


@pytest.fixture
async def leader(bed: Bed) -> Replica:
    replica = await bed.replica()
    await asyncio.wait_for(replica.rm.became_leader.wait(), 10)
    return replica


@pytest.fixture
async def scheduler(bed: Bed) -> AsyncIterator[Scheduler]:
    sched = Scheduler(bed.store, "sched-a")
    await sched.lead()
    yield sched
    if sched.leadership is not None:
        await sched.leadership.resign()


async def ledger(stub) -> list[tuple[str, str, str]]:
    reply = await stub.ListAllocations(rm.ListAllocationsRequest())
    return sorted((a.host_id, a.device_id, a.learner_id) for a in reply.allocations)


async def test_bad_requests_return_the_right_codes_and_change_nothing(bed, leader, scheduler):
    svc = bed.stub(leader)
    await svc.RegisterHost(register_request("h1"))
    token = scheduler.token
    await svc.AcquireDevices(
        rm.AcquireDevicesRequest(fencing_token=token, claims=[claim("h1", "gpu0", "l0")])
    )
    before_hosts = await svc.ListHosts(rm.ListHostsRequest())
    before = await ledger(svc)

    bad_id = rm.RegisterHostRequest(host_id="no spaces", agent_address="127.0.0.1:9")
    exc = await expect_error(
        svc.RegisterHost(bad_id), grpc.StatusCode.INVALID_ARGUMENT, "host_id", "'no spaces'"
    )
    assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_INVALID_FIELD"
    bad_addr = rm.RegisterHostRequest(host_id="h2", agent_address="nowhere")
    await expect_error(
        svc.RegisterHost(bad_addr), grpc.StatusCode.INVALID_ARGUMENT, "agent_address"
    )

    exc = await expect_error(
        svc.GetHost(rm.GetHostRequest(host_id="h9")), grpc.StatusCode.NOT_FOUND, "'h9'"
    )
    assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_HOST_NOT_FOUND"
    await expect_error(
        svc.GetHost(rm.GetHostRequest()), grpc.StatusCode.INVALID_ARGUMENT, "host_id"
    )
    await expect_error(
        svc.ListHosts(rm.ListHostsRequest(page_token="bogus")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "page_token",
    )

    def acquire(*claims, tok=token):
        return svc.AcquireDevices(rm.AcquireDevicesRequest(fencing_token=tok, claims=list(claims)))

    exc = await expect_error(
        acquire(claim("h1", "gpu9", "x")), grpc.StatusCode.NOT_FOUND, "'gpu9'", "'h1'"
    )
    assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_DEVICE_NOT_FOUND"
    await expect_error(acquire(claim("h7", "gpu0", "x")), grpc.StatusCode.NOT_FOUND, "'h7'")
    exc = await expect_error(
        acquire(claim("h1", "gpu1", "x"), claim("h1", "gpu0", "y")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "'gpu0'",
        "'l0'",
    )
    assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_DEVICE_BUSY"
    await expect_error(
        acquire(claim("h1", "", "x")), grpc.StatusCode.INVALID_ARGUMENT, "claims[0].device_id"
    )
    await expect_error(
        svc.AcquireDevices(rm.AcquireDevicesRequest(claims=[claim("h1", "gpu1", "x")])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "fencing_token",
    )
    wrong = resources_pb2.FencingToken(election="other", revision=token.revision)
    await expect_error(
        acquire(claim("h1", "gpu1", "x"), tok=wrong),
        grpc.StatusCode.INVALID_ARGUMENT,
        "fencing_token.election",
    )
    stale = resources_pb2.FencingToken(election="job-scheduler", revision=token.revision - 1)
    exc = await expect_error(
        acquire(claim("h1", "gpu1", "x"), tok=stale), grpc.StatusCode.FAILED_PRECONDITION, "stale"
    )
    assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_FENCED_OUT"

    admin = bed.stub(leader, "admin")
    await expect_error(
        admin.CordonHost(rm.CordonHostRequest(host_id="h5", cordon=True)), grpc.StatusCode.NOT_FOUND
    )
    await expect_error(
        admin.DrainHost(rm.DrainHostRequest()), grpc.StatusCode.INVALID_ARGUMENT, "host_id"
    )

    assert await ledger(svc) == before
    assert await svc.ListHosts(rm.ListHostsRequest()) == before_hosts


async def test_heartbeats_from_unknown_hosts_or_stale_incarnations_are_refused(bed, leader):
    svc = bed.stub(leader)
    reply = await svc.RegisterHost(register_request("h1"))
    assert reply.incarnation == 1
    assert reply.heartbeat_interval_ms == 300

    async def beat(host_id: str, incarnation: int) -> rm.HeartbeatResponse:
        call = svc.Heartbeat()
        await call.write(rm.HeartbeatRequest(host_id=host_id, incarnation=incarnation, sequence=7))
        response = await call.read()
        call.cancel()
        if response is aio.EOF:
            await call  # raises the status
        return response

    assert (await beat("h1", 1)).sequence == 7
    exc = await expect_error(beat("ghost", 1), grpc.StatusCode.NOT_FOUND, "'ghost'")
    assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_HOST_NOT_FOUND"
    await expect_error(
        beat("h1", 5), grpc.StatusCode.FAILED_PRECONDITION, "stale", "register again"
    )


async def test_roles_users_read_services_allocate_admins_cordon(bed, leader, scheduler):
    svc, user, admin = bed.stub(leader), bed.stub(leader, "user"), bed.stub(leader, "admin")
    await svc.RegisterHost(register_request("h1"))
    assert len((await user.ListHosts(rm.ListHostsRequest())).hosts) == 1
    await expect_error(user.RegisterHost(register_request("h2")), grpc.StatusCode.PERMISSION_DENIED)
    request = rm.AcquireDevicesRequest(
        fencing_token=scheduler.token, claims=[claim("h1", "gpu0", "l")]
    )
    await expect_error(user.AcquireDevices(request), grpc.StatusCode.PERMISSION_DENIED)
    await expect_error(
        svc.CordonHost(rm.CordonHostRequest(host_id="h1", cordon=True)),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    cordoned = await admin.CordonHost(rm.CordonHostRequest(host_id="h1", cordon=True))
    assert cordoned.host.cordoned and not cordoned.host.draining
    exc = await expect_error(
        svc.AcquireDevices(request), grpc.StatusCode.FAILED_PRECONDITION, "cordoned"
    )
    assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_HOST_UNAVAILABLE"
    drained = await admin.DrainHost(rm.DrainHostRequest(host_id="h1"))
    assert drained.host.cordoned and drained.host.draining
    uncordoned = await admin.CordonHost(rm.CordonHostRequest(host_id="h1", cordon=False))
    assert not uncordoned.host.cordoned and not uncordoned.host.draining
    await svc.AcquireDevices(request)
    anonymous = connect(leader.address, trace=False)
    bed.channels.append(anonymous)
    await expect_error(
        rm_grpc.ResourceManagerServiceStub(anonymous).ListHosts(rm.ListHostsRequest()),
        grpc.StatusCode.UNAUTHENTICATED,
    )


async def test_acquire_is_all_or_nothing_idempotent_and_release_ignores_gone_ids(
    bed, leader, scheduler
):
    svc = bed.stub(leader)
    await svc.RegisterHost(register_request("h1"))
    await svc.RegisterHost(register_request("h2"))
    token = scheduler.token
    first = await svc.AcquireDevices(
        rm.AcquireDevicesRequest(
            fencing_token=token,
            request_id="r1",
            claims=[claim("h1", "gpu0", "a"), claim("h2", "gpu0", "b")],
        )
    )
    again = await svc.AcquireDevices(
        rm.AcquireDevicesRequest(
            fencing_token=token,
            request_id="r1",
            claims=[claim("h1", "gpu0", "a"), claim("h2", "gpu0", "b")],
        )
    )
    assert [a.allocation_id for a in again.allocations] == [
        a.allocation_id for a in first.allocations
    ]
    assert await ledger(svc) == [("h1", "gpu0", "a"), ("h2", "gpu0", "b")]
    # All or nothing: the second claim is busy, so the first is not allocated either.
    await expect_error(
        svc.AcquireDevices(
            rm.AcquireDevicesRequest(
                fencing_token=token, claims=[claim("h1", "gpu1", "c"), claim("h2", "gpu0", "d")]
            )
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert await ledger(svc) == [("h1", "gpu0", "a"), ("h2", "gpu0", "b")]
    ids = [a.allocation_id for a in first.allocations]
    released = await svc.ReleaseDevices(
        rm.ReleaseDevicesRequest(fencing_token=token, allocation_ids=[*ids, "gone"])
    )
    assert sorted(released.released_allocation_ids) == sorted(ids)
    released = await svc.ReleaseDevices(
        rm.ReleaseDevicesRequest(fencing_token=token, allocation_ids=ids)
    )
    assert list(released.released_allocation_ids) == []
    assert await ledger(svc) == []
    # The ledger in etcd is what the replica says.
    kvs, _ = await bed.store.list("/shoal/v1/resource-manager/allocations/")
    assert kvs == []


async def test_a_stale_fencing_token_is_refused_after_the_scheduler_fails_over(
    bed, leader, scheduler
):
    svc = bed.stub(leader)
    await svc.RegisterHost(register_request("h1"))
    old = scheduler.token
    successor = Scheduler(bed.store, "sched-b")
    waiting = asyncio.ensure_future(successor.lead())
    assert scheduler.leadership is not None
    await scheduler.leadership.resign()
    scheduler.leadership = None
    new = await asyncio.wait_for(waiting, 10)
    assert new.revision > old.revision
    try:
        exc = await expect_error(
            svc.AcquireDevices(
                rm.AcquireDevicesRequest(fencing_token=old, claims=[claim("h1", "gpu0", "l")])
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "stale",
            "sched-b",
        )
        assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_FENCED_OUT"
        await expect_error(
            svc.ReleaseDevices(rm.ReleaseDevicesRequest(fencing_token=old, allocation_ids=["x"])),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert await ledger(svc) == []
        await svc.AcquireDevices(
            rm.AcquireDevicesRequest(fencing_token=new, claims=[claim("h1", "gpu0", "l")])
        )
        assert await ledger(svc) == [("h1", "gpu0", "l")]
    finally:
        assert successor.leadership is not None
        await successor.leadership.resign()


async def test_watch_inventory_sends_a_snapshot_then_every_change(bed, leader, scheduler):
    svc, admin = bed.stub(leader), bed.stub(leader, "admin")
    await svc.RegisterHost(register_request("h1", 2))
    user = bed.stub(leader, "user")
    call = user.WatchInventory(rm.WatchInventoryRequest())
    snapshot = await call.read()
    assert snapshot.kind == K.INVENTORY_EVENT_KIND_SNAPSHOT
    assert [h.host_id for h in snapshot.hosts] == ["h1"] and list(snapshot.allocations) == []

    await svc.RegisterHost(register_request("h2", 2))
    await admin.CordonHost(rm.CordonHostRequest(host_id="h2", cordon=True))
    acquired = await svc.AcquireDevices(
        rm.AcquireDevicesRequest(fencing_token=scheduler.token, claims=[claim("h1", "gpu1", "l1")])
    )
    await svc.ReleaseDevices(
        rm.ReleaseDevicesRequest(
            fencing_token=scheduler.token, allocation_ids=[acquired.allocations[0].allocation_id]
        )
    )
    events = [await asyncio.wait_for(call.read(), 5) for _ in range(4)]
    call.cancel()
    assert [e.kind for e in events] == [
        K.INVENTORY_EVENT_KIND_HOST_UP,
        K.INVENTORY_EVENT_KIND_HOST_CHANGED,
        K.INVENTORY_EVENT_KIND_ALLOCATED,
        K.INVENTORY_EVENT_KIND_RELEASED,
    ]
    assert events[1].hosts[0].cordoned
    allocated = events[2]
    assert allocated.allocations[0].learner_id == "l1"
    assert allocated.hosts[0].devices[1].allocation.learner_id == "l1"
    assert events[3].allocations[0].allocation_id == acquired.allocations[0].allocation_id


async def test_a_standby_answers_not_leader_with_the_leader_address(bed, leader):
    standby = await bed.replica()
    await async_wait_until(lambda: standby.rm.leader_address == leader.address, timeout=10)
    stub = bed.stub(standby)
    for call in (
        stub.ListHosts(rm.ListHostsRequest()),
        stub.RegisterHost(register_request("h1")),
        stub.ListAllocations(rm.ListAllocationsRequest()),
    ):
        exc = await expect_error(
            call, grpc.StatusCode.UNAVAILABLE, "not the leader", leader.address
        )
        assert metadata(exc, LEADER_METADATA_KEY) == leader.address
        assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_NOT_LEADER"
    watch = stub.WatchInventory(rm.WatchInventoryRequest())
    exc = await expect_error(watch.read(), grpc.StatusCode.UNAVAILABLE)
    assert metadata(exc, LEADER_METADATA_KEY) == leader.address


async def test_a_leader_that_shuts_down_hands_over_without_waiting_for_its_lease(bed, leader):
    await bed.stub(leader).RegisterHost(register_request("h1"))
    standby = await bed.replica()
    await async_wait_until(lambda: standby.rm.leader_address == leader.address, timeout=10)
    started = time.monotonic()
    await leader.rm.close()  # what SIGTERM does
    await asyncio.wait_for(standby.rm.became_leader.wait(), 10)
    assert time.monotonic() - started < 2.0  # the lease TTL: it resigned, it did not expire
    host = (await bed.stub(standby).GetHost(rm.GetHostRequest(host_id="h1"))).host
    assert host.state == resources_pb2.HOST_STATE_READY


async def test_a_deposed_leader_stops_writing_and_its_watchers_are_told(bed, leader, scheduler):
    svc = bed.stub(leader)
    await svc.RegisterHost(register_request("h1"))
    watch = bed.stub(leader, "user").WatchInventory(rm.WatchInventoryRequest())
    assert (await watch.read()).kind == K.INVENTORY_EVENT_KIND_SNAPSHOT
    standby = await bed.replica()
    # Depose the leader behind its back: delete its election key.
    kvs, _ = await bed.store.list(f"{DEFAULT_PREFIX}resource-manager/")
    mine = min(kvs, key=lambda kv: kv.create_revision)
    assert mine.value.decode() == leader.address
    await bed.store.delete(mine.key)
    await asyncio.wait_for(standby.rm.became_leader.wait(), 10)
    await expect_error(watch.read(), grpc.StatusCode.UNAVAILABLE)
    await expect_error(
        svc.AcquireDevices(
            rm.AcquireDevicesRequest(
                fencing_token=scheduler.token, claims=[claim("h1", "gpu0", "l")]
            )
        ),
        grpc.StatusCode.UNAVAILABLE,
    )
    # The new leader rebuilt the host from etcd and serves it.
    new = bed.stub(standby)
    host = (await new.GetHost(rm.GetHostRequest(host_id="h1"))).host
    assert host.incarnation == 1 and host.state == resources_pb2.HOST_STATE_READY
    await new.AcquireDevices(
        rm.AcquireDevicesRequest(fencing_token=scheduler.token, claims=[claim("h1", "gpu0", "l")])
    )
    assert await ledger(new) == [("h1", "gpu0", "l")]


async def test_a_host_that_stops_heartbeating_is_declared_lost_with_its_allocations(bed, scheduler):
    replica = await bed.replica(grace_s=0.5)
    await asyncio.wait_for(replica.rm.became_leader.wait(), 10)
    svc = bed.stub(replica)
    watch = bed.stub(replica, "user").WatchInventory(rm.WatchInventoryRequest())
    await watch.read()
    await svc.RegisterHost(register_request("h1"))
    held = await svc.AcquireDevices(
        rm.AcquireDevicesRequest(fencing_token=scheduler.token, claims=[claim("h1", "gpu2", "l")])
    )
    while (
        event := await asyncio.wait_for(watch.read(), 5)
    ).kind != K.INVENTORY_EVENT_KIND_HOST_LOST:
        pass
    watch.cancel()
    assert [a.allocation_id for a in event.allocations] == [held.allocations[0].allocation_id]
    assert event.hosts[0].state == resources_pb2.HOST_STATE_LOST
    assert await ledger(svc) == []
    stored = await bed.store.get("/shoal/v1/resource-manager/hosts/h1")
    assert (
        stored is not None
        and resources_pb2.Host.FromString(stored.value).state == resources_pb2.HOST_STATE_LOST
    )
    again = await svc.RegisterHost(register_request("h1"))
    assert again.incarnation == 2


# --------------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------------


@pytest.fixture
async def shoal(tmp_path) -> AsyncIterator[ShoalProcesses]:
    procs = ShoalProcesses(tmp_path)
    try:
        yield procs
    except BaseException:
        print(procs.logs())
        raise
    finally:
        await procs.close()


async def _hosts(stub, include_lost: bool = False) -> dict[str, resources_pb2.Host]:
    try:
        reply = await stub.ListHosts(rm.ListHostsRequest(include_lost=include_lost), timeout=2)
    except aio.AioRpcError:
        return {}
    return {h.host_id: h for h in reply.hosts}


@pytest.mark.slow
async def test_agents_register_and_a_killed_agent_is_declared_lost_then_comes_back(shoal, etcd):
    store = EtcdStore(etcd.endpoints, timeout=3)
    sched = Scheduler(store, "sched-a")
    try:
        token = await sched.lead()
        manager = shoal.resource_manager(etcd.endpoints)
        agents = {h: shoal.host_agent(h, [manager.address]) for h in ("h1", "h2")}
        svc = shoal.rm_stub(manager.address)
        hosts = await async_wait_until(
            lambda: _hosts_if(svc, lambda hs: len(hs) == 2), timeout=30, what="two hosts"
        )
        for host in hosts.values():
            assert [d.device_id for d in host.devices] == ["gpu0", "gpu1", "gpu2", "gpu3"]
            assert all(d.simulated and d.uuid.startswith("GPU-") for d in host.devices)
            assert host.incarnation == 1 and host.agent_address == agents[host.host_id].address
        held = await svc.AcquireDevices(
            rm.AcquireDevicesRequest(
                fencing_token=token, claims=[claim("h1", "gpu0", "l0"), claim("h1", "gpu3", "l3")]
            )
        )
        watch = shoal.rm_stub(manager.address, "user").WatchInventory(rm.WatchInventoryRequest())
        assert (await watch.read()).kind == K.INVENTORY_EVENT_KIND_SNAPSHOT

        agents["h1"].kill()
        killed_at = time.monotonic()
        while (
            event := await asyncio.wait_for(watch.read(), GRACE_S + 5)
        ).kind != K.INVENTORY_EVENT_KIND_HOST_LOST:
            pass
        lost_after = time.monotonic() - killed_at
        print(f"host declared lost {lost_after:.2f} s after SIGKILL (grace {GRACE_S} s)")
        assert lost_after <= GRACE_S + 1.0
        assert [h.host_id for h in event.hosts] == ["h1"]
        assert sorted(a.allocation_id for a in event.allocations) == sorted(
            a.allocation_id for a in held.allocations
        )
        remaining = await _hosts(svc)
        assert list(remaining) == ["h2"]  # h2 kept heartbeating

        agents["h1"].start()
        while (
            event := await asyncio.wait_for(watch.read(), 30)
        ).kind != K.INVENTORY_EVENT_KIND_HOST_UP:
            pass
        assert event.hosts[0].host_id == "h1" and event.hosts[0].incarnation == 2
        watch.cancel()
        host = (await svc.GetHost(rm.GetHostRequest(host_id="h1"))).host
        assert host.incarnation == 2 and host.state == resources_pb2.HOST_STATE_READY
        assert all(not d.HasField("allocation") for d in host.devices)
    finally:
        if sched.leadership is not None:
            await sched.leadership.resign()
        await store.close()


async def _leads(stub) -> bool:
    try:
        await stub.ListHosts(rm.ListHostsRequest(), timeout=2)
    except aio.AioRpcError:
        return False
    return True


async def _hosts_if(stub, predicate) -> dict[str, resources_pb2.Host] | None:
    hosts = await _hosts(stub)
    return hosts if predicate(hosts) else None


@pytest.mark.slow
async def test_a_standby_takes_over_with_the_same_ledger_and_no_double_allocation(shoal, etcd):
    store = EtcdStore(etcd.endpoints, timeout=3)
    sched = Scheduler(store, "sched-a")
    try:
        token = await sched.lead()
        first = shoal.resource_manager(etcd.endpoints)
        svc_first = shoal.rm_stub(first.address)
        await async_wait_until(lambda: _leads(svc_first), timeout=30, what="a leader")
        second = shoal.resource_manager(etcd.endpoints)
        addresses = [first.address, second.address]
        for h in ("h1", "h2"):
            shoal.host_agent(h, addresses)
        await async_wait_until(
            lambda: _hosts_if(svc_first, lambda hs: len(hs) == 2), timeout=30, what="two hosts"
        )
        svc_second = shoal.rm_stub(second.address)

        async def standby_points_at_the_leader() -> str | None:
            try:
                await svc_second.ListHosts(rm.ListHostsRequest(), timeout=2)
            except aio.AioRpcError as exc:
                return metadata(exc, LEADER_METADATA_KEY)
            raise AssertionError("the second replica leads")

        assert (
            await async_wait_until(standby_points_at_the_leader, timeout=30, what="the standby")
            == first.address
        )

        await svc_first.AcquireDevices(
            rm.AcquireDevicesRequest(
                fencing_token=token,
                request_id="r1",
                claims=[claim("h1", "gpu1", "a"), claim("h2", "gpu2", "b")],
            )
        )
        before = await svc_first.ListAllocations(rm.ListAllocationsRequest())

        first.kill()
        killed_at = time.monotonic()
        await async_wait_until(
            lambda: _leads(svc_second),
            timeout=ELECTION_TTL_S + 5,
            what="the standby to lead",
        )
        took_over = time.monotonic() - killed_at
        print(
            f"standby leads {took_over:.2f} s after the leader's SIGKILL (ttl {ELECTION_TTL_S} s)"
        )
        assert took_over <= ELECTION_TTL_S + 1.0

        # Agents re-register with the new leader: it hears heartbeats from both, and neither is
        # declared lost (each got a fresh grace at the takeover).
        def heard(hs):
            return len(hs) == 2 and all(h.HasField("last_heartbeat_time") for h in hs.values())

        hosts = await async_wait_until(
            lambda: _hosts_if(svc_second, heard), timeout=10, what="re-registration"
        )
        assert all(
            h.incarnation == 1 and h.state == resources_pb2.HOST_STATE_READY for h in hosts.values()
        )
        after = await svc_second.ListAllocations(rm.ListAllocationsRequest())
        assert sorted(a.SerializeToString() for a in after.allocations) == sorted(
            a.SerializeToString() for a in before.allocations
        )
        exc = await expect_error(
            svc_second.AcquireDevices(
                rm.AcquireDevicesRequest(fencing_token=token, claims=[claim("h2", "gpu2", "c")])
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "'b'",
        )
        assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_DEVICE_BUSY"
        # The retried request id returns the allocations the old leader made.
        retried = await svc_second.AcquireDevices(
            rm.AcquireDevicesRequest(
                fencing_token=token,
                request_id="r1",
                claims=[claim("h1", "gpu1", "a"), claim("h2", "gpu2", "b")],
            )
        )
        assert sorted(a.allocation_id for a in retried.allocations) == sorted(
            a.allocation_id for a in before.allocations
        )
        # A stale scheduler token is refused by the new leader too.
        stale = resources_pb2.FencingToken(
            election="job-scheduler", holder="sched-a", revision=token.revision - 1
        )
        await expect_error(
            svc_second.AcquireDevices(
                rm.AcquireDevicesRequest(fencing_token=stale, claims=[claim("h1", "gpu0", "d")])
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "stale",
        )
        # Re-registering left no orphaned task behind (asyncio logged "Task exception was
        # never retrieved" / "Task was destroyed but it is pending" at each one).
        for proc in shoal.procs:
            if proc.name.startswith("agent-"):
                assert "never retrieved" not in proc.log(), proc.log()[-3000:]
                assert "destroyed but it is pending" not in proc.log(), proc.log()[-3000:]
    finally:
        if sched.leadership is not None:
            await sched.leadership.resign()
        await store.close()


async def test_a_write_conflict_reloads_the_state_and_recomputes_once(bed, leader, caplog):
    svc, admin = bed.stub(leader), bed.stub(leader, "admin")
    await svc.RegisterHost(register_request("h1"))
    # Another writer touches the host's record behind the leader's back: the leader's next
    # write on it fails its compare-and-set, reloads the state and succeeds on the recompute.
    record = await bed.store.get(host_key("h1"))
    assert record is not None
    await bed.store.put(host_key("h1"), record.value)
    caplog.set_level("INFO", logger="shoal.resource_manager.service")
    cordoned = await admin.CordonHost(rm.CordonHostRequest(host_id="h1", cordon=True))
    assert cordoned.host.cordoned
    assert any("write conflict (attempt 1)" in r.getMessage() for r in caplog.records)


async def test_a_write_that_conflicts_twice_answers_unavailable_and_writes_nothing(bed, leader):
    svc, admin = bed.stub(leader), bed.stub(leader, "admin")
    await svc.RegisterHost(register_request("h1"))
    store = leader.rm.store
    transaction = store.transaction
    attempts = 0

    async def always_conflicting(ops, *, expect=(), fence=None):
        nonlocal attempts
        attempts += 1
        await bed.store.put(host_key("h1"), (await bed.store.get(host_key("h1"))).value)
        return await transaction(ops, expect=expect, fence=fence)  # the expectation fails

    store.transaction = always_conflicting
    try:
        await expect_error(
            admin.CordonHost(rm.CordonHostRequest(host_id="h1", cordon=True)),
            grpc.StatusCode.UNAVAILABLE,
            "concurrent write twice",
        )
    finally:
        del store.transaction
    assert attempts == 2  # once, then once more on the reloaded state
    hosts = (await admin.ListHosts(rm.ListHostsRequest())).hosts
    assert [h.cordoned for h in hosts] == [False]
