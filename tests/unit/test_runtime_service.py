"""The shared service skeleton (shoal.runtime.service): lead_forever campaigns again after every
term, however it ends, stepping down and resigning each time; follow_leader reports the leader."""

from __future__ import annotations

import asyncio

from shoal.runtime.election import LeaderElection, Leadership, LeadershipLost
from shoal.runtime.service import follow_leader, lead_forever
from shoal.runtime.store import MemoryStore
from tests.support import async_wait_until


async def test_lead_forever_steps_down_resigns_and_campaigns_again_after_each_term() -> None:
    store = MemoryStore()
    election = LeaderElection(store, "svc", "a", ttl=5.0)
    observed: list[str | None] = []
    follower = asyncio.create_task(follow_leader(election, observed.append))
    terms: list[Leadership] = []
    stepped_down: list[Leadership] = []
    ends = [LeadershipLost("lost"), RuntimeError("bug"), None]

    async def term(leadership: Leadership) -> None:
        terms.append(leadership)
        end = ends[len(terms) - 1]
        if end is not None:
            raise end
        # the third term lasts until the lease is given up by someone else
        await leadership.lost.wait()

    leading = asyncio.create_task(
        lead_forever(
            election,
            term,
            step_down=stepped_down.append,
            expected=(LeadershipLost,),
            pause_s=0.01,
            retry_s=0.01,
            closing=lambda: len(terms) >= 3,
        )
    )
    try:
        await async_wait_until(lambda: len(terms) == 3, timeout=30)
        assert stepped_down == terms[:2]
        assert all(t.lost.is_set() for t in terms[:2])  # each earlier term resigned
        await async_wait_until(lambda: "a" in observed, timeout=30)
        await terms[2].resign()
        await asyncio.wait_for(leading, timeout=30)  # closing() holds: no fourth campaign
        assert stepped_down == terms
        await async_wait_until(lambda: observed[-1] is None, timeout=30)
    finally:
        for task in (leading, follower):
            task.cancel()
        await asyncio.gather(leading, follower, return_exceptions=True)
        await store.close()


class _FlakyElection(LeaderElection):
    """A campaign that fails with an unexpected error ``failures`` times, then campaigns."""

    def __init__(self, store: MemoryStore, failures: int) -> None:
        super().__init__(store, "svc", "a", ttl=5.0)
        self.failures = failures
        self.calls = 0

    async def campaign(self) -> Leadership:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(f"campaign bug {self.calls}")
        return await super().campaign()


async def test_a_failing_campaign_is_tried_again_until_it_wins_and_not_once_closing() -> None:
    store = MemoryStore()
    election = _FlakyElection(store, failures=2)
    terms: list[Leadership] = []

    async def term(leadership: Leadership) -> None:
        terms.append(leadership)

    leading = asyncio.create_task(
        lead_forever(
            election, term, step_down=lambda _: None, retry_s=0.01, closing=lambda: bool(terms)
        )
    )
    try:
        await asyncio.wait_for(leading, timeout=30)  # won on the third try, one term, closed
        assert election.calls == 3 and len(terms) == 1
        # Closing while the campaign keeps failing: lead_forever returns, nothing raised.
        closing = asyncio.Event()
        never = _FlakyElection(store, failures=10**6)
        stuck = asyncio.create_task(
            lead_forever(
                never, term, step_down=lambda _: None, retry_s=0.01, closing=closing.is_set
            )
        )
        await async_wait_until(lambda: never.calls >= 2, timeout=30)
        closing.set()
        await asyncio.wait_for(stuck, timeout=30)
        assert len(terms) == 1
    finally:
        leading.cancel()
        await asyncio.gather(leading, return_exceptions=True)
        await store.close()
