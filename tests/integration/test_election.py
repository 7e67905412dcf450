"""Leader election with fencing: contenders in separate processes on a real etcd (kill, SIGSTOP),
in-process elections on etcd (deposed leaders, etcd unreachable), and the same logic on
MemoryStore with an injected clock."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import pytest

from shoal.runtime.election import LeaderElection, Leadership, LeadershipLost
from shoal.runtime.etcd_server import EtcdServer
from shoal.runtime.store import (
    EtcdStore,
    Expect,
    Fence,
    FencedOut,
    KeyValue,
    MemoryStore,
    Op,
    Store,
    StoreUnavailable,
    WatchEvent,
)
from tests.support import async_wait_until

CONTENDER = Path(__file__).with_name("_election_contender.py")
TTL = 2.0
OWNER_KEY = "/shoal/v1/test/owner"
ELECTION_PREFIX = "/shoal/v1/election/svc/"


# --------------------------------------------------------------------------------------------
# Separate processes on a real etcd
# --------------------------------------------------------------------------------------------


class Contender:
    """``_election_contender.py`` in a subprocess; its output lines with arrival times."""

    def __init__(self, endpoints: Sequence[str], name: str, candidate_id: str) -> None:
        self.id = candidate_id
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(CONTENDER),
                "--endpoints",
                ",".join(endpoints),
                "--name",
                name,
                "--id",
                candidate_id,
                "--key",
                OWNER_KEY,
                "--ttl",
                str(TTL),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def __repr__(self) -> str:
        return f"Contender({self.id!r}, lines={[line for _, line in self.lines]})"

    def first(self, prefix: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if line.startswith(prefix)), None)

    def has(self, prefix: str) -> bool:
        return self.first(prefix) is not None

    def count(self, prefix: str) -> int:
        return sum(line.startswith(prefix) for _, line in self.lines)

    def written_revisions(self) -> list[int]:
        return [int(line.split()[2]) for _, line in self.lines if line.startswith("WRITE OK")]

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)


@pytest.fixture
def contenders(etcd: EtcdServer) -> Iterator[Callable[[str], Contender]]:
    started: list[Contender] = []

    def start(candidate_id: str) -> Contender:
        started.append(Contender(etcd.endpoints, "svc", candidate_id))
        return started[-1]

    yield start
    for contender in started:
        contender.close()


async def _leader_and_waiting_follower(
    etcd_store: EtcdStore, contenders: Callable[[str], Contender]
) -> tuple[Contender, Contender]:
    a = contenders("a")
    await async_wait_until(lambda: a.count("WRITE OK") >= 2, timeout=30, what=f"a leads: {a}")
    b = contenders("b")

    async def both_candidates() -> bool:
        kvs, _ = await etcd_store.list(ELECTION_PREFIX)
        return len(kvs) == 2

    await async_wait_until(both_candidates, timeout=30, what=f"b's candidate key: {b}")
    assert not b.has("LEADER")
    return a, b


async def _assert_no_write_of_a_after_its_leadership_ended(store: Store, a: Contender) -> None:
    """From etcd's history: every write by ``a`` precedes the deletion of its leader key, and
    only ``b`` wrote after it (so no deposed write ever landed)."""
    end = await store.put("/shoal/v1/~end", b"")
    events: list[WatchEvent] = []
    async with asyncio.timeout(10), contextlib.aclosing(store.watch("/shoal/v1/", 1)) as stream:
        async for event in stream:
            if event.mod_revision >= end:
                break
            events.append(event)
    a_key = next(e.key for e in events if e.key.startswith(ELECTION_PREFIX) and e.value == b"a")
    a_gone = next(e.mod_revision for e in events if e.kind == "delete" and e.key == a_key)
    writes = [(e.mod_revision, e.value) for e in events if e.key == OWNER_KEY]
    by_a = [rev for rev, value in writes if value != b"b"]
    assert set(a.written_revisions()) <= set(by_a)  # (a may die before printing its last)
    assert by_a and max(by_a) < a_gone, writes
    assert {value for rev, value in writes if rev > a_gone} == {b"b"}, writes


async def test_when_the_leader_process_is_killed_the_follower_leads_within_ttl_plus_1s(
    etcd_store: EtcdStore, contenders: Callable[[str], Contender]
) -> None:
    a, b = await _leader_and_waiting_follower(etcd_store, contenders)

    killed_at = time.monotonic()
    a.signal(signal.SIGKILL)
    await async_wait_until(lambda: b.has("LEADER"), timeout=TTL + 5, what=f"b leads: {b}")
    found = b.first("LEADER")
    assert found is not None
    assert found[0] - killed_at <= TTL + 1.0, f"b led {found[0] - killed_at:.2f} s after the kill"

    await async_wait_until(lambda: b.has("WRITE OK"), what=f"b writes: {b}")
    await _assert_no_write_of_a_after_its_leadership_ended(etcd_store, a)


async def test_a_leader_frozen_longer_than_its_ttl_stops_acting_after_it_resumes(
    etcd_store: EtcdStore, contenders: Callable[[str], Contender]
) -> None:
    a, b = await _leader_and_waiting_follower(etcd_store, contenders)

    a.signal(signal.SIGSTOP)
    # b can only lead once a's lease has expired, i.e. a was frozen for longer than its TTL.
    await async_wait_until(lambda: b.has("LEADER"), timeout=TTL + 5, what=f"b leads: {b}")
    await async_wait_until(lambda: b.count("WRITE OK") >= 2, what=f"b writes: {b}")
    resumed_at = time.monotonic()
    a.signal(signal.SIGCONT)

    await async_wait_until(lambda: a.has("EXIT"), timeout=15, what=f"a gives up: {a}")
    after_resume = [line for t, line in a.lines if t >= resumed_at]
    assert after_resume[0].startswith("LOST"), a  # no write attempted after resuming
    assert a.has("PROBE FENCED"), a  # and fencing refuses one that ignores the check
    assert not b.has("WRITE FENCED") and not b.has("LOST"), b
    await _assert_no_write_of_a_after_its_leadership_ended(etcd_store, a)


# --------------------------------------------------------------------------------------------
# In process on a real etcd
# --------------------------------------------------------------------------------------------


async def _candidates(store: Store, prefix: str, n: int) -> bool:
    """Whether exactly ``n`` candidates are in the election."""
    kvs, _ = await store.list(prefix)
    return len(kvs) == n


@contextlib.asynccontextmanager
async def _campaigning(election: LeaderElection) -> AsyncIterator[asyncio.Task[Leadership]]:
    """A campaign running in a task; cancelled (and its leadership resigned) on exit."""
    task = asyncio.get_running_loop().create_task(election.campaign())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            leadership = await task
            await leadership.resign()


async def test_a_deposed_leaders_fenced_write_is_rejected_once_its_key_is_deleted(
    etcd_store: EtcdStore,
) -> None:
    a = LeaderElection(etcd_store, "svc", "a", ttl=TTL)
    b = LeaderElection(etcd_store, "svc", "b", ttl=TTL)
    async with await a.campaign() as la, _campaigning(b) as b_task:
        await etcd_store.put(OWNER_KEY, b"a", fence=la.fence)
        await async_wait_until(lambda: _candidates(etcd_store, a.prefix, 2), what="2 candidates")

        assert await etcd_store.delete(la.key)  # an operator removes it; or it expired
        lb = await asyncio.wait_for(b_task, 10)
        assert lb.candidate_id == "b" and await b.leader() == "b"

        with pytest.raises(FencedOut):
            await etcd_store.put(OWNER_KEY, b"a, deposed", fence=la.fence)
        await etcd_store.put(OWNER_KEY, b"b", fence=lb.fence)
        await asyncio.wait_for(la.lost.wait(), 10)
        with pytest.raises(LeadershipLost):
            la.check()
        kv = await etcd_store.get(OWNER_KEY)
        assert kv is not None and kv.value == b"b"


async def test_a_leader_whose_lease_is_gone_loses_leadership_and_is_fenced_out(
    etcd_store: EtcdStore,
) -> None:
    a = LeaderElection(etcd_store, "svc", "a", ttl=TTL)
    b = LeaderElection(etcd_store, "svc", "b", ttl=TTL)
    async with await a.campaign() as la, _campaigning(b) as b_task:
        await async_wait_until(lambda: _candidates(etcd_store, a.prefix, 2))
        await etcd_store.revoke_lease(la.lease_id)  # as if it had expired
        lb = await asyncio.wait_for(b_task, 10)
        await asyncio.wait_for(la.lost.wait(), 10)
        assert not la.is_leader and lb.is_leader
        with pytest.raises(FencedOut):
            await etcd_store.put(OWNER_KEY, b"a", fence=la.fence)


async def test_a_leader_that_cannot_reach_etcd_reports_lost_from_its_local_deadline(
    etcd: EtcdServer, etcd_store: EtcdStore
) -> None:
    a = LeaderElection(etcd_store, "svc", "a", ttl=TTL)
    la = await a.campaign()
    etcd.pause()
    try:
        # etcd is frozen: no answer can arrive; only the local deadline can end leadership.
        await asyncio.wait_for(la.lost.wait(), TTL + 5)
        assert "not renewed" in la.reason
        with pytest.raises(LeadershipLost):
            la.check()
    finally:
        etcd.resume()
    await la.resign()


async def test_a_leader_keeps_leadership_across_a_quick_etcd_restart(
    etcd: EtcdServer, etcd_store: EtcdStore
) -> None:
    ttl = 6.0  # local deadline 4.5 s after a renewal; renewals every 2 s
    la = await LeaderElection(etcd_store, "svc", "a", ttl=ttl).campaign()
    await asyncio.to_thread(etcd.restart)
    back = time.monotonic()
    # The next renewal after the restart moves the deadline past back + ttl - margin.
    await async_wait_until(lambda: la.deadline >= back + ttl * 3 / 4, timeout=ttl, what="renewal")
    la.check()
    await etcd_store.put(OWNER_KEY, b"a", fence=la.fence)
    await la.resign()


async def test_observe_on_etcd_follows_the_leader(etcd_store: EtcdStore) -> None:
    a = LeaderElection(etcd_store, "svc", "a", ttl=TTL)
    b = LeaderElection(etcd_store, "svc", "b", ttl=TTL)
    seen: list[str | None] = []

    async def observe() -> None:
        async for leader in a.observe():
            seen.append(leader)

    watcher = asyncio.get_running_loop().create_task(observe())
    try:
        await async_wait_until(lambda: seen == [None])
        la = await a.campaign()
        await async_wait_until(lambda: seen == [None, "a"], what=f"a observed: {seen}")
        async with _campaigning(b) as b_task:
            await async_wait_until(lambda: _candidates(etcd_store, a.prefix, 2))
            await la.resign()
            await asyncio.wait_for(b_task, 10)
            await async_wait_until(lambda: seen == [None, "a", "b"], what=f"b observed: {seen}")
        await async_wait_until(lambda: seen[-1] is None, what=f"nobody leads: {seen}")
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


# --------------------------------------------------------------------------------------------
# MemoryStore with an injected clock
# --------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class PartitionedStore(Store):
    """A view of a shared store whose lease refreshes fail while ``partitioned`` is set."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.partitioned = False

    def _check(self) -> None:
        if self.partitioned:
            raise StoreUnavailable("partitioned (test)")

    async def get(self, key: str) -> KeyValue | None:
        self._check()
        return await self.inner.get(key)

    async def put(
        self, key: str, value: bytes, *, lease: int = 0, fence: Fence | None = None
    ) -> int:
        self._check()
        return await self.inner.put(key, value, lease=lease, fence=fence)

    async def compare_and_set(
        self,
        key: str,
        value: bytes,
        expected_revision: int,
        *,
        lease: int = 0,
        fence: Fence | None = None,
    ) -> bool:
        self._check()
        return await self.inner.compare_and_set(
            key, value, expected_revision, lease=lease, fence=fence
        )

    async def delete(
        self, key: str, *, expected_revision: int | None = None, fence: Fence | None = None
    ) -> bool:
        self._check()
        return await self.inner.delete(key, expected_revision=expected_revision, fence=fence)

    async def transaction(
        self, ops: Sequence[Op], *, expect: Sequence[Expect] = (), fence: Fence | None = None
    ) -> int | None:
        self._check()
        return await self.inner.transaction(ops, expect=expect, fence=fence)

    async def list(self, prefix: str) -> tuple[list[KeyValue], int]:
        self._check()
        return await self.inner.list(prefix)

    async def watch(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        async with contextlib.aclosing(self.inner.watch(prefix, start_revision)) as events:
            async for event in events:
                yield event

    async def grant_lease(self, ttl: float) -> int:
        self._check()
        return await self.inner.grant_lease(ttl)

    async def refresh_lease(self, lease_id: int) -> float:
        self._check()
        return await self.inner.refresh_lease(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        self._check()
        await self.inner.revoke_lease(lease_id)

    async def compact(self, revision: int) -> None:
        await self.inner.compact(revision)

    async def close(self) -> None:
        pass


MEM_TTL = 3.0  # fake seconds: keep-alive every 1.0, local deadline 2.25 after a renewal


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def mem(clock: FakeClock) -> AsyncIterator[MemoryStore]:
    store = MemoryStore(clock=clock, sweep_interval=0.01)
    yield store
    await store.close()


def _election(store: Store, clock: FakeClock, candidate_id: str) -> LeaderElection:
    return LeaderElection(store, "svc", candidate_id, ttl=MEM_TTL, clock=clock)


async def test_memory_candidates_lead_in_the_order_they_arrived(
    mem: MemoryStore, clock: FakeClock
) -> None:
    a, b, c = (_election(mem, clock, x) for x in "abc")
    la = await a.campaign()
    async with _campaigning(b) as b_task:
        await async_wait_until(lambda: _candidates(mem, a.prefix, 2))
        async with _campaigning(c) as c_task:
            await async_wait_until(lambda: _candidates(mem, a.prefix, 3))
            assert await a.leader() == "a" and not b_task.done() and not c_task.done()

            await la.resign()
            lb = await asyncio.wait_for(b_task, 5)
            assert await a.leader() == "b" and not c_task.done()
            await lb.resign()
            lc = await asyncio.wait_for(c_task, 5)
            assert lc.candidate_id == "c"
            assert lc.fence.create_revision > lb.fence.create_revision > la.fence.create_revision


async def test_memory_leadership_holds_while_the_lease_is_renewed(
    mem: MemoryStore, clock: FakeClock
) -> None:
    a, b = _election(mem, clock, "a"), _election(mem, clock, "b")
    la = await a.campaign()
    async with _campaigning(b) as b_task:
        for _ in range(4 * int(MEM_TTL / 0.5)):  # four TTLs in steps of half a second
            clock.advance(0.5)
            # A renewal is due at most 1.0 after the last one: then 1.25 s of slack remain.
            await async_wait_until(lambda: la.deadline - clock() > 1.25, timeout=5)
            la.check()
        assert not b_task.done() and await a.leader() == "a"
    await la.resign()


async def test_memory_leader_that_cannot_renew_reports_lost_before_its_lease_expires(
    mem: MemoryStore, clock: FakeClock
) -> None:
    view = PartitionedStore(mem)
    a = LeaderElection(view, "svc", "a", ttl=MEM_TTL, clock=clock)
    la = await a.campaign()
    view.partitioned = True
    lost_margin = la.deadline - clock()
    clock.advance(lost_margin - 0.01)
    la.check()  # still within the local deadline
    clock.advance(0.01)
    with pytest.raises(LeadershipLost):
        la.check()
    assert la.lost.is_set()
    # The lease has not expired in the store yet: a successor cannot have been elected.
    assert await mem.get(la.key) is not None
    clock.advance(MEM_TTL)
    await async_wait_until(lambda: _missing(mem, la.key), what="the lease to expire")


async def _missing(store: Store, key: str) -> bool:
    return await store.get(key) is None


async def test_memory_lost_is_set_by_the_keepalive_without_anyone_calling_check(
    mem: MemoryStore, clock: FakeClock
) -> None:
    view = PartitionedStore(mem)
    la = await LeaderElection(view, "svc", "a", ttl=MEM_TTL, clock=clock).campaign()
    view.partitioned = True
    clock.advance(MEM_TTL)
    await asyncio.wait_for(la.lost.wait(), 5)


async def test_memory_leader_frozen_past_its_ttl_is_fenced_out_and_the_follower_leads(
    mem: MemoryStore, clock: FakeClock
) -> None:
    a, b = _election(mem, clock, "a"), _election(mem, clock, "b")
    la = await a.campaign()
    async with _campaigning(b) as b_task:
        await async_wait_until(lambda: _candidates(mem, a.prefix, 2))
        clock.advance(2 * MEM_TTL)  # everything was frozen; both leases ran out meanwhile
        with pytest.raises(LeadershipLost):
            la.check()
        lb = await asyncio.wait_for(b_task, 10)  # b campaigns again with a new lease
        with pytest.raises(FencedOut):
            await mem.put(OWNER_KEY, b"a", fence=la.fence)
        await mem.put(OWNER_KEY, b"b", fence=lb.fence)


async def test_memory_leader_loses_leadership_when_its_key_is_deleted(
    mem: MemoryStore, clock: FakeClock
) -> None:
    la = await _election(mem, clock, "a").campaign()
    await mem.delete(la.key)
    await asyncio.wait_for(la.lost.wait(), 5)
    assert "deleted" in la.reason
    with pytest.raises(FencedOut):
        await mem.put(OWNER_KEY, b"a", fence=la.fence)


async def test_memory_cancelled_campaign_withdraws_the_candidate(
    mem: MemoryStore, clock: FakeClock
) -> None:
    a, b = _election(mem, clock, "a"), _election(mem, clock, "b")
    la = await a.campaign()
    async with _campaigning(b):
        await async_wait_until(lambda: _candidates(mem, a.prefix, 2))
    await async_wait_until(lambda: _candidates(mem, a.prefix, 1))
    assert await a.leader() == "a"
    await la.resign()
    assert await a.leader() is None


async def test_memory_observe_reports_every_leader_change_and_none_when_nobody_leads(
    mem: MemoryStore, clock: FakeClock
) -> None:
    a, b = _election(mem, clock, "a"), _election(mem, clock, "b")
    async with contextlib.aclosing(a.observe()) as changes:
        assert await anext(changes) is None
        la = await a.campaign()
        assert await asyncio.wait_for(anext(changes), 5) == "a"
        async with _campaigning(b) as b_task:
            await async_wait_until(lambda: _candidates(mem, a.prefix, 2))
            await la.resign()
            assert await asyncio.wait_for(anext(changes), 5) == "b"
            lb = await asyncio.wait_for(b_task, 5)
            await lb.resign()
            assert await asyncio.wait_for(anext(changes), 5) is None


def test_election_rejects_bad_settings(mem: MemoryStore) -> None:
    with pytest.raises(ValueError, match="margin"):
        LeaderElection(mem, "svc", "a", ttl=2.0, margin=1.5)
    with pytest.raises(ValueError, match="name"):
        LeaderElection(mem, "a/b", "a")
    with pytest.raises(ValueError, match="ttl"):
        LeaderElection(mem, "svc", "a", ttl=0)
