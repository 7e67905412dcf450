"""The scheduler's channel pool (shoal.scheduler.reconcile.Peers): a peer that comes back gets a
fresh channel, not one left in gRPC's reconnect backoff from its outage."""

from __future__ import annotations

import asyncio

from shoal.scheduler.reconcile import Peers


class FakeChannel:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = asyncio.Event()

    async def close(self) -> None:
        self.closed.set()


async def test_a_forgotten_peer_gets_a_new_channel_and_the_old_one_closes_later() -> None:
    made: list[FakeChannel] = []

    def factory(address: str) -> FakeChannel:
        made.append(FakeChannel(address))
        return made[-1]

    peers = Peers(["rm:1"], [], token=None, channel_factory=factory)  # type: ignore[arg-type]
    first = peers.channel("agent:7")
    assert peers.channel("agent:7") is first  # cached
    peers.forget("agent:7", close_after_s=0.0)
    second = peers.channel("agent:7")
    assert second is not first and len(made) == 2
    await asyncio.wait_for(first.closed.wait(), timeout=5)  # calls in flight had their time
    assert not second.closed.is_set()
    peers.forget("never-used:1")  # nothing cached: nothing to do
    peers.forget("agent:7", close_after_s=3600.0)
    await asyncio.wait_for(peers.close(), timeout=5)  # no waiting for the delayed close...
    assert second.closed.is_set()  # ...which happens at once
