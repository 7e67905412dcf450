"""Leader election with fencing, over any :class:`~shoal.runtime.store.Store`.

Design (etcd ``clientv3/concurrency/election.go``): every candidate grants itself a lease and
puts its own key ``/shoal/v1/election/<name>/<lease id in hex>`` attached to that lease, with
its ``candidate_id`` as the value (services use their gRPC address, so clients can find the
leader). The candidate whose key has the **lowest create_revision leads**; the others wait until
every key created before theirs is gone. This hands leadership over in arrival order, without a
herd of compare-and-set retries, and lets anyone read the whole line-up with one ``list``.

Fencing: the leader's key and its create_revision form the :class:`~shoal.runtime.store.Fence`
checked by every leader write (``store.put(..., fence=leadership.fence)``). Once the leader's
key is gone (lease expired or revoked, key deleted) its fenced writes fail with ``FencedOut``,
even if the deposed leader has not noticed yet, so it can never overwrite its successor.

Local deadline (client-go ``leaderelection``'s ``RenewDeadline``): the lease is refreshed every
``ttl / 3``. The time of the last successful refresh is taken *before* the request is sent, so
the server-side expiry is always later than ``last_ok + ttl``. When ``now - last_ok >= ttl -
margin`` the leadership is considered lost: :attr:`Leadership.lost` is set and
:meth:`Leadership.check` raises :class:`LeadershipLost`, *before* the lease can expire on the
server and a successor can be elected. This covers a leader that cannot reach etcd and one whose
process was frozen (SIGSTOP, a long GC pause, a suspended VM): after it resumes, the first
``check()`` fails, so services call it before every batch of fenced writes::

    election = LeaderElection(store, "scheduler", candidate_id="10.0.0.5:7070", ttl=5.0)
    async with await election.campaign() as leadership:
        while True:
            leadership.check()                      # raises LeadershipLost
            await store.put(key, value, fence=leadership.fence)
            ...

``lost`` is also set when the leader's key disappears (deleted by hand, lease revoked) and when
the lease turns out to be expired. A lost leadership is final: campaign again for a new one.

Metrics (:mod:`shoal.runtime.metrics`; no-ops unless the process serves metrics), labelled by
``election`` (the election name, which is the service's name): ``shoal_leader`` is 1 while this
process leads and 0 otherwise, ``shoal_leader_changes_total{change="gained"|"lost"}`` counts
this process winning and losing leadership.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

import tenacity

from shoal.contract.keys import ELECTION_PREFIX
from shoal.runtime.metrics import meter
from shoal.runtime.retrying import resumed, store_outage, stream_wait
from shoal.runtime.store import (
    Fence,
    KeyValue,
    LeaseExpired,
    Store,
    StoreError,
    StoreUnavailable,
    WatchEvent,
)

__all__ = ["DEFAULT_PREFIX", "LeaderElection", "Leadership", "LeadershipLost"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PREFIX = ELECTION_PREFIX  # the key schema: shoal.contract.keys

# Longest real-time sleep of the keep-alive loop: with an injected clock, a jump of the clock
# is noticed within this many seconds.
_TICK = 0.05
# Bound on releasing a lease after leadership ends (best effort: it expires anyway).
_RELEASE_TIMEOUT = 2.0

_meter = meter(__name__)
_LEADING = _meter.create_up_down_counter(
    "shoal_leader", description="1 while this process leads the election, 0 while it does not"
)
_CHANGES = _meter.create_counter(
    "shoal_leader_changes",
    description="Times this process gained (change=gained) or lost (change=lost) leadership",
)


def _note_leadership(election: str, *, gained: bool) -> None:
    labels = {"election": election}
    _LEADING.add(1 if gained else -1, labels)
    _CHANGES.add(1, {**labels, "change": "gained" if gained else "lost"})


class LeadershipLost(Exception):
    """This candidate is no longer (guaranteed to be) the leader; stop acting as one."""


class _Retry(Exception):
    """Internal: start the campaign over with a new lease."""


class _LeaseKeeper:
    """Keeps one lease alive and tracks the local deadline of the last successful refresh."""

    def __init__(
        self,
        store: Store,
        lease_id: int,
        *,
        ttl: float,
        margin: float,
        clock: Callable[[], float],
        granted_at: float,
        label: str,
    ) -> None:
        self.store = store
        self.lease_id = lease_id
        self._ttl = ttl
        self._margin = margin
        self._interval = ttl / 3
        self._clock = clock
        self._last_ok = granted_at
        self._label = label
        self.lost = asyncio.Event()
        self.reason = ""
        self.on_lost: Callable[[], None] | None = None  # set once the lease is a leadership
        self._tasks: set[asyncio.Task[Any]] = set()
        self._release: asyncio.Task[None] | None = None

    @property
    def deadline(self) -> float:
        """Local time (by ``clock``) after which the lease is no longer trusted."""
        return self._last_ok + self._ttl - self._margin

    def start(self) -> None:
        self.bind(asyncio.get_running_loop().create_task(self._run(), name=f"{self._label}-ka"))

    def bind(self, task: asyncio.Task[Any]) -> None:
        """Cancel ``task`` when the lease is lost."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def alive(self) -> bool:
        """Whether the lease is still trusted; marks it lost once the deadline has passed."""
        if self.lost.is_set():
            return False
        now = self._clock()
        if now >= self.deadline:
            self.expire(
                f"lease {self.lease_id:x} not renewed for {now - self._last_ok:.2f} s "
                f"(ttl {self._ttl} s, margin {self._margin} s)"
            )
            return False
        return True

    def expire(self, reason: str) -> None:
        """Mark the lease lost, stop refreshing it and revoke it in the background."""
        if self.lost.is_set():
            return
        self.reason = reason
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost()
        log.info("%s: %s", self._label, reason)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # check() called outside the event loop
            loop = None
        current = asyncio.current_task() if loop is not None else None
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        if loop is not None:
            self._release = loop.create_task(self._revoke(), name=f"{self._label}-release")

    async def released(self) -> None:
        """Wait until the background revoke (started by :meth:`expire`) is done."""
        if self._release is not None:
            await asyncio.shield(self._release)

    async def _revoke(self) -> None:
        try:
            async with asyncio.timeout(_RELEASE_TIMEOUT):
                await self.store.revoke_lease(self.lease_id)
        except (StoreError, TimeoutError) as exc:
            log.debug("%s: revoking lease %x failed: %s", self._label, self.lease_id, exc)

    async def _run(self) -> None:
        next_refresh = self._last_ok + self._interval
        while self.alive():
            now = self._clock()
            if now < next_refresh:
                await asyncio.sleep(min(min(next_refresh, self.deadline) - now, _TICK))
                continue
            sent_at = now
            try:
                async with asyncio.timeout(max(self.deadline - now, 0.001)):
                    await self.store.refresh_lease(self.lease_id)
            except LeaseExpired:
                self.expire(f"lease {self.lease_id:x} expired")
                return
            except (StoreError, TimeoutError) as exc:
                log.warning("%s: refreshing lease %x failed: %s", self._label, self.lease_id, exc)
                next_refresh = self._clock() + max(self._interval / 4, _TICK)
            else:
                self._last_ok = sent_at
                next_refresh = sent_at + self._interval


class Leadership:
    """Proof of leadership; valid until :attr:`lost` is set. An async context manager that
    resigns on exit."""

    def __init__(
        self,
        election: LeaderElection,
        keeper: _LeaseKeeper,
        key: str,
        create_revision: int,
        revision: int,
    ) -> None:
        self.candidate_id = election.candidate_id
        self.fence = Fence(key, create_revision)
        self.lease_id = keeper.lease_id
        self.lost = keeper.lost
        self._election = election
        self._keeper = keeper
        self._revision = revision
        keeper.on_lost = lambda: _note_leadership(election.name, gained=False)

    def __repr__(self) -> str:
        state = f"lost: {self.reason}" if self.lost.is_set() else "leading"
        return f"Leadership({self.candidate_id!r}, key={self.fence.key!r}, {state})"

    @property
    def key(self) -> str:
        """The leader key (this candidate's key under the election prefix)."""
        return self.fence.key

    @property
    def reason(self) -> str:
        """Why leadership was lost ("" while leading)."""
        return self._keeper.reason

    @property
    def deadline(self) -> float:
        """The local time (by the election's clock) at which leadership lapses unless renewed."""
        return self._keeper.deadline

    @property
    def is_leader(self) -> bool:
        """Whether leadership still holds (same test as :meth:`check`, without raising)."""
        return self._keeper.alive()

    def check(self) -> None:
        """Raise :class:`LeadershipLost` unless this is still the leader by the local deadline.

        Call it before every batch of leader actions: after the process was frozen, this is
        what stops it before it acts on stale leadership."""
        if not self._keeper.alive():
            raise LeadershipLost(
                f"{self.candidate_id!r} lost leadership of {self._election.name!r}: "
                f"{self._keeper.reason}"
            )

    async def resign(self) -> None:
        """Give up leadership now: stop renewing and revoke the lease (which deletes the key),
        so a successor takes over without waiting for the TTL."""
        self._keeper.expire("resigned")
        await self._keeper.released()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.resign()

    def _start_monitor(self) -> None:
        task = asyncio.get_running_loop().create_task(
            self._monitor(), name=f"{self._election.name}-monitor"
        )
        self._keeper.bind(task)

    async def _monitor(self) -> None:
        """Notice the leader key disappearing (deleted by hand, lease revoked or expired)."""
        key = self.fence.key
        try:
            async with contextlib.aclosing(
                self._election.store.watch(self._election.prefix, self._revision)
            ) as events:
                async for event in events:
                    gone = (event.kind == "delete" and event.key == key) or (
                        event.kind == "resync"
                        and not any(
                            kv.key == key and kv.create_revision == self.fence.create_revision
                            for kv in event.kvs
                        )
                    )
                    if gone:
                        self._keeper.expire(f"leader key {key!r} was deleted")
                        return
        except StoreError as exc:
            # Without the watch, a deleted key would go unnoticed: stop trusting leadership.
            self._keeper.expire(f"watching the leader key failed: {exc}")


def _apply(state: dict[str, KeyValue], event: WatchEvent) -> None:
    """Update a listing of the election prefix with one watch event."""
    if event.kind == "resync":
        state.clear()
        state.update((kv.key, kv) for kv in event.kvs)
    elif event.kind == "delete":
        state.pop(event.key, None)
    else:
        old = state.get(event.key)
        created = old.create_revision if old is not None else event.mod_revision
        state[event.key] = KeyValue(event.key, event.value, created, event.mod_revision)


def _leader_of(state: dict[str, KeyValue]) -> str | None:
    if not state:
        return None
    return min(state.values(), key=lambda kv: kv.create_revision).value.decode()


async def _until_lost(coro: Coroutine[Any, Any, T], lost: asyncio.Event) -> T:
    """Run ``coro`` unless ``lost`` is set first (then raise :class:`_Retry`)."""
    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(lost.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, waiter):
            t.cancel()
        await asyncio.gather(task, waiter, return_exceptions=True)
    if task.done() and not task.cancelled():
        return task.result()
    raise _Retry("the lease was lost while waiting")


class LeaderElection:
    """One candidate in the election ``name``.

    ``ttl``: the lease TTL in seconds (etcd rounds it up to whole seconds, minimum about 2).
    ``margin``: how long before the lease could expire the leader stops trusting it (default
    ``ttl / 4``; must be in (0, ttl / 2]). ``clock``: monotonic seconds, injectable for tests
    (use the same clock as a :class:`~shoal.runtime.store.MemoryStore`).
    """

    def __init__(
        self,
        store: Store,
        name: str,
        candidate_id: str,
        ttl: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        margin: float | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        if not name or "/" in name:
            raise ValueError(f"name ({name!r}) must be non-empty and contain no '/'")
        if not candidate_id:
            raise ValueError(f"candidate_id ({candidate_id!r}) must be non-empty")
        if ttl <= 0:
            raise ValueError(f"ttl ({ttl}) must be > 0")
        margin = ttl / 4 if margin is None else margin
        if not 0 < margin <= ttl / 2:
            raise ValueError(f"margin ({margin}) must be > 0 and <= ttl / 2 ({ttl / 2})")
        self.store = store
        self.name = name
        self.candidate_id = candidate_id
        self.ttl = ttl
        self.margin = margin
        self._clock = clock
        self.prefix = f"{prefix.rstrip('/')}/{name}/"
        _LEADING.add(0, {"election": name})  # standbys export 0, not nothing

    def __repr__(self) -> str:
        return f"LeaderElection({self.name!r}, {self.candidate_id!r}, ttl={self.ttl})"

    async def campaign(self) -> Leadership:
        """Wait until this candidate leads; returns the :class:`Leadership`.

        Store outages are retried (with backoff) for as long as it takes; cancel the call to
        stop campaigning (the candidate key is then revoked). Other store errors (a closed
        store, for one) are raised."""

        def restarts(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None
            log.info("%r: campaign restarts: %s", self, state.outcome.exception())

        async for attempt in tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type((_Retry, StoreUnavailable, LeaseExpired)),
            wait=tenacity.wait_exponential(multiplier=0.05, max=max(self.ttl / 3, 0.05)),
            before_sleep=restarts,
            reraise=True,
        ):
            with attempt:
                return await self._campaign_once()
        raise AssertionError("unreachable")

    async def _campaign_once(self) -> Leadership:
        granted_at = self._clock()
        lease_id = await self.store.grant_lease(self.ttl)
        keeper = _LeaseKeeper(
            self.store,
            lease_id,
            ttl=self.ttl,
            margin=self.margin,
            clock=self._clock,
            granted_at=granted_at,
            label=f"election {self.name!r} candidate {self.candidate_id!r}",
        )
        keeper.start()
        try:
            key = f"{self.prefix}{lease_id:x}"
            create_revision = await self.store.put(key, self.candidate_id.encode(), lease=lease_id)
            revision = await _until_lost(self._wait_for_turn(key, create_revision), keeper.lost)
            if not keeper.alive():
                raise _Retry(keeper.reason)
            leadership = Leadership(self, keeper, key, create_revision, revision)
            _note_leadership(self.name, gained=True)
            leadership._start_monitor()
            log.info("%r leads with key %s (create_revision %d)", self, key, create_revision)
            return leadership
        except BaseException:
            keeper.expire("campaign abandoned")
            with contextlib.suppress(asyncio.CancelledError):
                await keeper.released()
            raise

    async def _wait_for_turn(self, key: str, create_revision: int) -> int:
        """Wait until ``key`` is the oldest under the prefix; returns the revision at which it
        became so."""
        kvs, revision = await self.store.list(self.prefix)
        state = {kv.key: kv for kv in kvs}

        def decided() -> bool:
            if key not in state:
                raise _Retry(f"candidate key {key!r} vanished (lease expired?)")
            return all(kv.create_revision >= create_revision for kv in state.values())

        if decided():
            return revision
        async with contextlib.aclosing(self.store.watch(self.prefix, revision + 1)) as events:
            async for event in events:
                _apply(state, event)
                if decided():
                    return event.mod_revision
        raise _Retry("watch ended")

    async def leader(self) -> str | None:
        """The current leader's candidate_id, or None if nobody leads."""
        kvs, _ = await self.store.list(self.prefix)
        return _leader_of({kv.key: kv for kv in kvs})

    async def observe(self) -> AsyncGenerator[str | None, None]:
        """Yield the leader's candidate_id now and after every change (None: nobody leads).

        Runs until closed; store outages are retried. Use ``contextlib.aclosing``."""
        unset = object()
        last: object = unset

        async def session() -> AsyncGenerator[str | None, None]:
            """List, then watch: the leader after the listing (so the backoff starts over
            once the store answers) and after every event."""
            kvs, revision = await self.store.list(self.prefix)
            state = {kv.key: kv for kv in kvs}
            yield _leader_of(state)
            async with contextlib.aclosing(self.store.watch(self.prefix, revision + 1)) as events:
                async for event in events:
                    _apply(state, event)
                    yield _leader_of(state)
            # The watch ended (a closed store raises on the next listing): list again, after
            # the first wait.
            raise StoreUnavailable(f"the watch of {self.prefix!r} ended")

        def retries(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None
            log.info("%r: observe retries: %s", self, state.outcome.exception())

        # Store outages retried (tenacity) 0.05 s doubling to 1 s apart; other errors raised.
        async with contextlib.aclosing(
            resumed(
                session,
                retry=store_outage,
                wait=stream_wait(),
                before_sleep=retries,
            )
        ) as leaders:
            async for current in leaders:
                if current != last:
                    last = current
                    yield current
