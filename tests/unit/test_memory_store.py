"""MemoryStore beyond the shared contract (tests/integration/test_store_contract.py): lease
timing with an injected clock, history limits, closing, and a model-based check of revisions
and watch replay."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import pytest
from hypothesis import given, settings, strategies as st

from shoal.runtime.store import KeyValue, LeaseExpired, MemoryStore, StoreError


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def test_a_refreshed_lease_lives_for_its_ttl_after_the_refresh() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock, sweep_interval=None)
    lease = await store.grant_lease(10)
    await store.put("/k", b"v", lease=lease)
    clock.advance(8)
    assert await store.refresh_lease(lease) == 10
    clock.advance(9.9)
    assert await store.get("/k") is not None
    clock.advance(0.1)
    assert await store.get("/k") is None
    with pytest.raises(LeaseExpired):
        await store.refresh_lease(lease)


async def test_expire_leases_can_be_driven_by_hand_when_sweeping_is_off() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock, sweep_interval=None)
    one, two = await store.grant_lease(1), await store.grant_lease(5)
    await store.put("/a", b"", lease=one)
    await store.put("/b", b"", lease=one)
    await store.put("/c", b"", lease=two)
    before = store.revision
    clock.advance(2)
    assert store.expire_leases() == 1
    assert store.revision == before + 1  # one revision per expired lease, as in etcd
    assert [kv.key for kv in (await store.list("/"))[0]] == ["/c"]


async def test_moving_a_key_to_another_lease_detaches_it_from_the_first() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock, sweep_interval=None)
    short, long = await store.grant_lease(1), await store.grant_lease(100)
    await store.put("/k", b"1", lease=short)
    await store.put("/k", b"2", lease=long)
    clock.advance(2)
    kv = await store.get("/k")
    assert kv is not None and kv.lease == long


async def test_watches_older_than_the_history_limit_resync() -> None:
    store = MemoryStore(history_limit=5)
    first = await store.put("/w/a", b"0")
    for i in range(1, 10):
        await store.put(f"/w/{i % 3}", str(i).encode())
    events = store.watch("/w/", first)
    resync = await asyncio.wait_for(anext(events), 5)
    assert resync.kind == "resync"
    assert [kv.key for kv in resync.kvs] == ["/w/0", "/w/1", "/w/2", "/w/a"]
    await events.aclose()
    recent = store.watch("/w/", store.revision - 2)
    replay = [await asyncio.wait_for(anext(recent), 5) for _ in range(3)]
    assert [e.kind for e in replay] == ["put", "put", "put"]
    await recent.aclose()


async def test_close_ends_running_watches_and_refuses_further_use() -> None:
    store = MemoryStore()
    events = store.watch("/", 1)
    await store.put("/k", b"")
    assert (await asyncio.wait_for(anext(events), 5)).key == "/k"
    pending = asyncio.ensure_future(anext(events))
    await store.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, 5)
    with pytest.raises(StoreError):
        await store.get("/k")


# -- model-based: revisions, compare-and-set and watch replay -------------------------------


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes


@dataclass(frozen=True)
class Cas:
    key: str
    value: bytes
    stale: bool  # use an out-of-date revision


@dataclass(frozen=True)
class Delete:
    key: str


keys = st.sampled_from(["/m/a", "/m/b", "/m/c", "/n/a"])
values = st.binary(max_size=4)
operations = st.lists(
    st.one_of(
        st.builds(Put, keys, values),
        st.builds(Cas, keys, values, st.booleans()),
        st.builds(Delete, keys),
    ),
    max_size=30,
)


async def _run_model(ops: list[Put | Cas | Delete]) -> None:
    store = MemoryStore(sweep_interval=None)
    model: dict[str, KeyValue] = {}
    revision = store.revision
    for op in ops:
        current = model.get(op.key)
        if isinstance(op, Put):
            revision += 1
            assert await store.put(op.key, op.value) == revision
            created = current.create_revision if current else revision
            model[op.key] = KeyValue(op.key, op.value, created, revision)
        elif isinstance(op, Cas):
            expected = current.mod_revision if current else 0
            if op.stale:
                expected = expected - 1 if expected else 1
            ok = await store.compare_and_set(op.key, op.value, expected)
            assert ok == (not op.stale)
            if ok:
                revision += 1
                created = current.create_revision if current else revision
                model[op.key] = KeyValue(op.key, op.value, created, revision)
        else:
            deleted = await store.delete(op.key)
            assert deleted == (current is not None)
            if deleted:
                revision += 1
                del model[op.key]
        assert store.revision == revision
    kvs, listed_at = await store.list("/m/")
    assert listed_at == revision
    assert kvs == sorted(
        (kv for k, kv in model.items() if k.startswith("/m/")), key=lambda kv: kv.key
    )

    # Replaying the whole history of the prefix rebuilds the listing.
    end = await store.put("/m/~end", b"")
    replayed: dict[str, bytes] = {}
    seen: list[int] = []
    async with contextlib.aclosing(store.watch("/m/", 1)) as events:
        async for event in events:
            if event.mod_revision == end:
                break
            seen.append(event.mod_revision)
            if event.kind == "put":
                replayed[event.key] = event.value
            else:
                replayed.pop(event.key, None)
    assert seen == sorted(seen)
    assert replayed == {kv.key: kv.value for kv in kvs}


@settings(max_examples=60, deadline=None)
@given(operations)
def test_revisions_cas_and_watch_replay_follow_the_etcd_model(
    ops: list[Put | Cas | Delete],
) -> None:
    asyncio.run(_run_model(ops))
