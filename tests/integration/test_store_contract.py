"""The Store contract, run against MemoryStore and EtcdStore (a real etcd), plus what only the
etcd store has to survive: restarts, dropped connections, compaction, member failure."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import tenacity

from shoal.runtime.etcd_server import EtcdCluster, EtcdServer, EtcdTLS
from shoal.runtime.store import (
    DeleteOp,
    EtcdStore,
    Expect,
    Fence,
    FencedOut,
    LeaseExpired,
    MemoryStore,
    PutOp,
    Store,
    StoreError,
    StoreUnavailable,
    WatchEvent,
)
from tests.support import async_wait_until

T = TypeVar("T")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Harness:
    """A store under test; ``pass_time`` lets leases run out (a fake clock for MemoryStore,
    nothing for etcd, whose leases expire in real time)."""

    store: Store
    clock: FakeClock | None

    def pass_time(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)


@pytest.fixture(params=["memory", "etcd"])
async def h(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "memory":
        clock = FakeClock()
        harness = Harness(MemoryStore(clock=clock), clock)
    else:
        etcd: EtcdServer = request.getfixturevalue("etcd")
        harness = Harness(EtcdStore(etcd.endpoints, timeout=3.0), None)
    try:
        yield harness
    finally:
        await harness.store.close()


class WatchCollector:
    """Consumes a watch in a background task, recording the events."""

    def __init__(self, store: Store, prefix: str, start_revision: int) -> None:
        self.events: list[WatchEvent] = []
        self._gen = store.watch(prefix, start_revision)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        async for event in self._gen:
            self.events.append(event)

    def keys(self, kind: str | None = None) -> list[str]:
        return [e.key for e in self.events if kind is None or e.kind == kind]

    async def wait_for(self, n: int, timeout: float = 10.0) -> list[WatchEvent]:
        await async_wait_until(
            lambda: len(self.events) >= n or self._task.done(),
            timeout=timeout,
            what=f"{n} watch events (have {self.events})",
        )
        if self._task.done():
            self._task.result()  # surface an error from the watch
        return self.events

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._gen.aclose()


@pytest.fixture
async def watches() -> AsyncIterator[Callable[[Store, str, int], WatchCollector]]:
    made: list[WatchCollector] = []

    def make(store: Store, prefix: str, start_revision: int) -> WatchCollector:
        made.append(WatchCollector(store, prefix, start_revision))
        return made[-1]

    yield make
    for collector in made:
        await collector.close()


# -- get / put / revisions ----------------------------------------------------------------------


async def test_get_returns_none_for_a_missing_key(h: Harness) -> None:
    assert await h.store.get("/t/missing") is None


async def test_put_returns_the_new_revision_and_get_reports_create_and_mod_revisions(
    h: Harness,
) -> None:
    first = await h.store.put("/t/a", b"1")
    kv = await h.store.get("/t/a")
    assert kv is not None
    assert (kv.key, kv.value, kv.create_revision, kv.mod_revision) == ("/t/a", b"1", first, first)

    second = await h.store.put("/t/a", b"2")
    assert second > first
    kv = await h.store.get("/t/a")
    assert kv is not None
    assert (kv.value, kv.create_revision, kv.mod_revision) == (b"2", first, second)


async def test_values_are_bytes_kept_exactly(h: Harness) -> None:
    value = bytes(range(256)) * 4
    await h.store.put("/t/bin", value)
    kv = await h.store.get("/t/bin")
    assert kv is not None and kv.value == value


async def test_a_recreated_key_gets_a_new_create_revision(h: Harness) -> None:
    first = await h.store.put("/t/a", b"1")
    assert await h.store.delete("/t/a")
    second = await h.store.put("/t/a", b"1")
    kv = await h.store.get("/t/a")
    assert kv is not None and kv.create_revision == second > first


# -- compare-and-set ------------------------------------------------------------------------------


async def test_compare_and_set_with_zero_creates_only_a_missing_key(h: Harness) -> None:
    assert await h.store.compare_and_set("/t/a", b"first", 0)
    assert not await h.store.compare_and_set("/t/a", b"second", 0)
    kv = await h.store.get("/t/a")
    assert kv is not None and kv.value == b"first"


async def test_compare_and_set_with_the_current_revision_succeeds(h: Harness) -> None:
    revision = await h.store.put("/t/a", b"1")
    assert await h.store.compare_and_set("/t/a", b"2", revision)
    kv = await h.store.get("/t/a")
    assert kv is not None and kv.value == b"2" and kv.mod_revision > revision


async def test_compare_and_set_with_a_stale_revision_fails_and_leaves_the_value(
    h: Harness,
) -> None:
    stale = await h.store.put("/t/a", b"1")
    await h.store.put("/t/a", b"2")
    assert not await h.store.compare_and_set("/t/a", b"3", stale)
    kv = await h.store.get("/t/a")
    assert kv is not None and kv.value == b"2"


async def test_compare_and_set_on_a_missing_key_with_a_revision_fails(h: Harness) -> None:
    assert not await h.store.compare_and_set("/t/missing", b"x", 5)
    assert await h.store.get("/t/missing") is None


# -- delete ----------------------------------------------------------------------------------------


async def test_delete_reports_whether_a_key_was_deleted(h: Harness) -> None:
    await h.store.put("/t/a", b"1")
    assert await h.store.delete("/t/a")
    assert await h.store.get("/t/a") is None
    assert not await h.store.delete("/t/a")


async def test_delete_with_expected_revision_deletes_only_that_version(h: Harness) -> None:
    stale = await h.store.put("/t/a", b"1")
    current = await h.store.put("/t/a", b"2")
    assert not await h.store.delete("/t/a", expected_revision=stale)
    assert await h.store.get("/t/a") is not None
    assert await h.store.delete("/t/a", expected_revision=current)
    assert await h.store.get("/t/a") is None


# -- list ---------------------------------------------------------------------------------------


async def test_list_returns_exactly_the_keys_under_the_prefix_sorted_with_the_read_revision(
    h: Harness,
) -> None:
    for key in ["/p/b", "/p/a/x", "/p0", "/p", "/pa", "/q/a", "/p/a", "/o/p/a"]:
        last = await h.store.put(key, key.encode())
    kvs, revision = await h.store.list("/p/")
    assert [kv.key for kv in kvs] == ["/p/a", "/p/a/x", "/p/b"]
    assert [kv.value for kv in kvs] == [b"/p/a", b"/p/a/x", b"/p/b"]
    assert revision == last


async def test_list_of_an_empty_prefix_returns_no_keys_and_the_current_revision(
    h: Harness,
) -> None:
    revision = await h.store.put("/other", b"x")
    assert await h.store.list("/nothing/") == ([], revision)


# -- fencing -----------------------------------------------------------------------------------


async def test_fenced_writes_succeed_while_the_fence_key_is_unchanged(h: Harness) -> None:
    created = await h.store.put("/leader", b"me")
    fence = Fence("/leader", created)
    await h.store.put("/leader", b"me, renewed")  # a change of value keeps create_revision
    revision = await h.store.put("/t/a", b"1", fence=fence)
    assert await h.store.compare_and_set("/t/a", b"2", revision, fence=fence)
    assert await h.store.transaction([PutOp("/t/b", b"3")], fence=fence) is not None
    assert await h.store.delete("/t/b", fence=fence)
    kv = await h.store.get("/t/a")
    assert kv is not None and kv.value == b"2"


async def test_fenced_writes_fail_with_fenced_out_after_the_fence_key_is_recreated(
    h: Harness,
) -> None:
    old = Fence("/leader", await h.store.put("/leader", b"old"))
    revision = await h.store.put("/t/a", b"by old", fence=old)
    await h.store.delete("/leader")
    await h.store.put("/leader", b"new")  # a successor's key: same name, new create_revision

    with pytest.raises(FencedOut):
        await h.store.put("/t/a", b"stale write", fence=old)
    with pytest.raises(FencedOut):
        await h.store.compare_and_set("/t/a", b"stale write", revision, fence=old)
    with pytest.raises(FencedOut):
        await h.store.delete("/t/a", fence=old)
    with pytest.raises(FencedOut):
        await h.store.transaction([PutOp("/t/a", b"stale write")], fence=old)
    kv = await h.store.get("/t/a")
    assert kv is not None and kv.value == b"by old"


async def test_fenced_write_fails_when_the_fence_key_is_gone(h: Harness) -> None:
    fence = Fence("/leader", await h.store.put("/leader", b"me"))
    await h.store.delete("/leader")
    with pytest.raises(FencedOut) as caught:
        await h.store.put("/t/a", b"x", fence=fence)
    assert caught.value.actual_create_revision is None
    assert await h.store.get("/t/a") is None


async def test_a_failed_fence_takes_precedence_over_a_failed_comparison(h: Harness) -> None:
    fence = Fence("/leader", await h.store.put("/leader", b"me"))
    stale = await h.store.put("/t/a", b"1")
    await h.store.put("/t/a", b"2")
    assert not await h.store.compare_and_set("/t/a", b"3", stale, fence=fence)
    await h.store.delete("/leader")
    with pytest.raises(FencedOut):
        await h.store.compare_and_set("/t/a", b"3", stale, fence=fence)


# -- transactions ------------------------------------------------------------------------------


async def test_transaction_applies_all_ops_in_one_revision_when_expectations_hold(
    h: Harness,
) -> None:
    base = await h.store.put("/t/a", b"1")
    await h.store.put("/t/gone", b"x")
    revision = await h.store.transaction(
        [PutOp("/t/a", b"2"), PutOp("/t/b", b"3"), DeleteOp("/t/gone")],
        expect=[Expect("/t/a", base), Expect("/t/b", 0)],
    )
    assert revision is not None
    kvs, _ = await h.store.list("/t/")
    assert [(kv.key, kv.value, kv.mod_revision) for kv in kvs] == [
        ("/t/a", b"2", revision),
        ("/t/b", b"3", revision),
    ]


async def test_transaction_writes_nothing_when_an_expectation_fails(h: Harness) -> None:
    await h.store.put("/t/a", b"1")
    before = await h.store.list("/t/")
    result = await h.store.transaction(
        [PutOp("/t/a", b"2"), PutOp("/t/b", b"3")], expect=[Expect("/t/a", 0)]
    )
    assert result is None
    assert await h.store.list("/t/") == before


# -- leases -------------------------------------------------------------------------------------


async def test_lease_expiry_deletes_the_attached_keys(h: Harness) -> None:
    lease = await h.store.grant_lease(1)
    await h.store.put("/t/leased", b"x", lease=lease)
    await h.store.put("/t/kept", b"y")
    kv = await h.store.get("/t/leased")
    assert kv is not None and kv.lease == lease

    h.pass_time(5)
    await async_wait_until(
        lambda: _missing(h.store, "/t/leased"), timeout=10, what="the leased key to expire"
    )
    assert await h.store.get("/t/kept") is not None
    with pytest.raises(LeaseExpired):
        await h.store.refresh_lease(lease)


async def _missing(store: Store, key: str) -> bool:
    return await store.get(key) is None


async def test_refresh_lease_returns_the_remaining_ttl(h: Harness) -> None:
    lease = await h.store.grant_lease(5)
    remaining = await h.store.refresh_lease(lease)
    assert 0 < remaining <= 5


async def test_revoke_lease_deletes_its_keys_and_later_use_raises_lease_expired(
    h: Harness,
) -> None:
    lease = await h.store.grant_lease(30)
    await h.store.put("/t/a", b"x", lease=lease)
    await h.store.revoke_lease(lease)
    assert await h.store.get("/t/a") is None
    with pytest.raises(LeaseExpired):
        await h.store.refresh_lease(lease)
    with pytest.raises(LeaseExpired):
        await h.store.put("/t/b", b"x", lease=lease)
    await h.store.revoke_lease(lease)  # already gone: no error


# -- watch --------------------------------------------------------------------------------------


async def test_watch_from_a_past_revision_replays_the_history_in_order(
    h: Harness, watches: Callable[[Store, str, int], WatchCollector]
) -> None:
    r1 = await h.store.put("/w/a", b"1")
    r2 = await h.store.put("/w/b", b"2")
    r3 = await h.store.put("/w/a", b"3")
    assert await h.store.delete("/w/b")
    await h.store.put("/elsewhere", b"x")

    events = await watches(h.store, "/w/", r2).wait_for(3)
    assert [(e.kind, e.key, e.value) for e in events] == [
        ("put", "/w/b", b"2"),
        ("put", "/w/a", b"3"),
        ("delete", "/w/b", b""),
    ]
    assert events[0].mod_revision == r2 and events[1].mod_revision == r3
    assert events[2].mod_revision > r3
    assert r1 < r2


async def test_watch_delivers_live_changes_in_revision_order_without_gaps(
    h: Harness, watches: Callable[[Store, str, int], WatchCollector]
) -> None:
    _, revision = await h.store.list("/w/")
    collector = watches(h.store, "/w/", revision + 1)
    written: list[int] = []
    for i in range(30):
        written.append(await h.store.put(f"/w/{i % 4}", str(i).encode()))
        if i % 10 == 9:
            await h.store.put("/not-watched", b"x")
    events = await collector.wait_for(30)
    assert [e.mod_revision for e in events] == written
    assert [e.value for e in events] == [str(i).encode() for i in range(30)]


async def test_watch_sees_every_op_of_a_transaction_at_one_revision(
    h: Harness, watches: Callable[[Store, str, int], WatchCollector]
) -> None:
    _, revision = await h.store.list("/w/")
    collector = watches(h.store, "/w/", revision + 1)
    await h.store.put("/w/c", b"0")
    txn = await h.store.transaction([PutOp("/w/a", b"1"), PutOp("/w/b", b"2"), DeleteOp("/w/c")])
    events = await collector.wait_for(4)
    assert [(e.kind, e.key, e.mod_revision) for e in events[1:]] == [
        ("put", "/w/a", txn),
        ("put", "/w/b", txn),
        ("delete", "/w/c", txn),
    ]


async def test_watch_sees_lease_expiry_as_deletes(
    h: Harness, watches: Callable[[Store, str, int], WatchCollector]
) -> None:
    lease = await h.store.grant_lease(1)
    revision = await h.store.put("/w/leased", b"x", lease=lease)
    collector = watches(h.store, "/w/", revision)
    await collector.wait_for(1)
    h.pass_time(5)
    events = await collector.wait_for(2)
    assert [(e.kind, e.key) for e in events] == [("put", "/w/leased"), ("delete", "/w/leased")]


async def test_watch_from_a_compacted_revision_resyncs_with_the_full_listing(
    h: Harness, watches: Callable[[Store, str, int], WatchCollector]
) -> None:
    first = await h.store.put("/w/a", b"1")
    await h.store.put("/w/b", b"2")
    await h.store.delete("/w/a")
    current = await h.store.put("/w/c", b"3")
    await h.store.compact(current)

    collector = watches(h.store, "/w/", first)
    events = await collector.wait_for(1)
    resync = events[0]
    assert resync.kind == "resync"
    assert resync.mod_revision >= current
    assert [(kv.key, kv.value) for kv in resync.kvs] == [("/w/b", b"2"), ("/w/c", b"3")]

    after = await h.store.put("/w/d", b"4")
    events = await collector.wait_for(2)
    assert [(e.kind, e.key, e.mod_revision) for e in events[1:]] == [("put", "/w/d", after)]


async def test_a_closed_watch_stops_delivering(h: Harness) -> None:
    _, revision = await h.store.list("/w/")
    events = h.store.watch("/w/", revision + 1)
    await h.store.put("/w/a", b"1")
    first = await asyncio.wait_for(anext(events), 10)
    assert first.key == "/w/a"
    await events.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(events)


# -- etcd only: faults ----------------------------------------------------------------------


async def test_etcd_watch_resumes_across_an_etcd_restart_without_gaps_or_duplicates(
    etcd: EtcdServer,
    etcd_store: EtcdStore,
    watches: Callable[[Store, str, int], WatchCollector],
) -> None:
    _, revision = await etcd_store.list("/w/")
    collector = watches(etcd_store, "/w/", revision + 1)
    before = [await etcd_store.put(f"/w/{i}", b"before") for i in range(3)]
    await collector.wait_for(3)

    await asyncio.to_thread(etcd.stop)
    with pytest.raises(StoreUnavailable):
        await etcd_store.get("/w/0")
    await asyncio.to_thread(etcd.restart)

    after = [await _retry_unavailable(lambda: etcd_store.put("/w/3", b"after"))]
    after += [await etcd_store.put(f"/w/{i}", b"after") for i in range(4, 7)]
    events = await collector.wait_for(7)  # a duplicate would show before the last one
    assert [e.mod_revision for e in events] == before + after
    assert collector.keys() == [f"/w/{i}" for i in range(7)]


async def _retry_unavailable(call: Callable[[], Awaitable[T]], timeout: float = 10.0) -> T:
    """``call()``, retried (tenacity) 0.05 s apart while the store is unavailable, for at most
    ``timeout`` seconds."""
    async for attempt in tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(StoreUnavailable),
        wait=tenacity.wait_fixed(0.05),
        stop=tenacity.stop_after_delay(timeout),
        reraise=True,
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable")


async def test_etcd_watch_resumes_after_a_dropped_connection_and_replays_what_it_missed(
    etcd: EtcdServer,
    etcd_store: EtcdStore,
    tcp_proxy: Any,
    watches: Callable[[Store, str, int], WatchCollector],
) -> None:
    proxy = await tcp_proxy(etcd.endpoint)
    async with EtcdStore([proxy.endpoint], timeout=3.0) as watched:
        _, revision = await etcd_store.list("/w/")
        collector = watches(watched, "/w/", revision + 1)
        r1 = await etcd_store.put("/w/a", b"1")
        await collector.wait_for(1)

        proxy.cut()
        missed = [await etcd_store.put("/w/b", b"2"), await etcd_store.put("/w/a", b"3")]
        proxy.allow()
        events = await collector.wait_for(3)
        later = await etcd_store.put("/w/c", b"4")
        events = await collector.wait_for(4)
        assert [e.mod_revision for e in events] == [r1, *missed, later]
        assert proxy.connections >= 2


async def test_etcd_watch_resyncs_when_history_was_compacted_while_it_was_disconnected(
    etcd: EtcdServer,
    etcd_store: EtcdStore,
    tcp_proxy: Any,
    watches: Callable[[Store, str, int], WatchCollector],
) -> None:
    proxy = await tcp_proxy(etcd.endpoint)
    async with EtcdStore([proxy.endpoint], timeout=3.0) as watched:
        _, revision = await etcd_store.list("/w/")
        collector = watches(watched, "/w/", revision + 1)
        await etcd_store.put("/w/a", b"1")
        await collector.wait_for(1)

        proxy.cut()
        await etcd_store.put("/w/b", b"2")
        await etcd_store.delete("/w/a")
        current = await etcd_store.put("/w/c", b"3")
        await etcd_store.compact(current)
        proxy.allow()

        events = await collector.wait_for(2)
        assert events[1].kind == "resync"
        assert [(kv.key, kv.value) for kv in events[1].kvs] == [("/w/b", b"2"), ("/w/c", b"3")]
        later = await etcd_store.put("/w/d", b"4")
        events = await collector.wait_for(3)
        assert (events[2].kind, events[2].key, events[2].mod_revision) == ("put", "/w/d", later)


async def test_etcd_list_reads_page_by_page_at_one_revision(etcd: EtcdServer) -> None:
    async with EtcdStore(etcd.endpoints, list_page_size=2) as store:
        for i in range(7):
            revision = await store.put(f"/l/{i}", str(i).encode())
        await store.put("/l0", b"outside")
        kvs, listed_at = await store.list("/l/")
        assert [kv.key for kv in kvs] == [f"/l/{i}" for i in range(7)]
        assert listed_at == revision + 1


async def test_etcd_store_raises_store_unavailable_while_etcd_is_down(
    etcd: EtcdServer, etcd_store: EtcdStore
) -> None:
    await etcd_store.put("/t/a", b"1")
    await asyncio.to_thread(etcd.stop)
    with pytest.raises(StoreUnavailable):
        await etcd_store.get("/t/a")
    with pytest.raises(StoreUnavailable):
        await etcd_store.put("/t/a", b"2")
    await asyncio.to_thread(etcd.restart)
    kv = await _retry_unavailable(lambda: etcd_store.get("/t/a"))
    assert kv is not None and kv.value == b"1"


async def test_etcd_store_speaks_mutual_tls(tmp_path: Path, tls_files: Any) -> None:
    tls = EtcdTLS(tls_files.server_cert, tls_files.server_key, client_ca_file=tls_files.ca_cert)
    with EtcdServer(tls=tls, unsafe_no_fsync=True, log_dir=tmp_path) as server:
        assert server.member.client_url.startswith("https://")
        async with EtcdStore(
            server.endpoints,
            ca_cert=tls_files.ca_cert,
            cert_key=tls_files.client_key,
            cert_cert=tls_files.client_cert,
        ) as store:
            revision = await store.put("/t/a", b"secret")
            kv = await store.get("/t/a")
            assert kv is not None and kv.mod_revision == revision
        async with EtcdStore(server.endpoints, ca_cert=tls_files.ca_cert, timeout=2) as anonymous:
            with pytest.raises(StoreError):
                await anonymous.get("/t/a")  # no client certificate: refused


async def test_etcd_store_fails_over_to_another_member_when_one_dies(
    etcd_cluster: EtcdCluster, watches: Callable[[Store, str, int], WatchCollector]
) -> None:
    async with EtcdStore(etcd_cluster.endpoints, timeout=3.0) as store:
        revision = await store.put("/t/a", b"1")
        collector = watches(store, "/t/", revision)
        await collector.wait_for(1)

        await asyncio.to_thread(etcd_cluster.members[0].kill)
        kv = await store.get("/t/a")  # a read fails over at once
        assert kv is not None and kv.value == b"1"
        later = await _retry_unavailable(lambda: store.put("/t/b", b"2"))
        events = await collector.wait_for(2)
        assert [(e.key, e.mod_revision) for e in events] == [("/t/a", revision), ("/t/b", later)]
