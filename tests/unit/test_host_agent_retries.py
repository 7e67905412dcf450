"""The host agent's retries (tenacity): the warm pool spawns a process that died before it was
ready again after a wait that doubles and starts over once one comes up; the link retries its
registration the same way. Waits are recorded, not slept."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from shoal.host_agent import service as service_module, warm as warm_module
from shoal.host_agent.service import ResourceManagerLink, _Reregister
from shoal.host_agent.warm import WarmPool
from tests.support import async_wait_until


def record_waits(monkeypatch: pytest.MonkeyPatch, module: object) -> list[float]:
    """Replace ``module.backoff`` by one that records its waits and sleeps none."""
    recorded: list[float] = []
    real = module.backoff  # type: ignore[attr-defined]

    def recording(first: float, cap: float):  # type: ignore[no-untyped-def]
        inner = real(first, cap)

        def record(state):  # type: ignore[no-untyped-def]
            recorded.append(inner(state))
            return 0.0

        return record

    monkeypatch.setattr(module, "backoff", recording)
    return recorded


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    return record_waits(monkeypatch, warm_module)


async def test_the_warm_pool_backs_off_on_processes_that_die_and_starts_over_after_one_is_ready(
    tmp_path, waits: list[float]
) -> None:
    pool = WarmPool(tmp_path, python="python3", env={}, size=2)
    outcomes = [False, False, True, False, False, False, True]  # died, died, ready, ...

    async def spawn_one():  # type: ignore[no-untyped-def]
        if not outcomes.pop(0):
            return None
        ready = SimpleNamespace(process=SimpleNamespace(returncode=None))
        pool._ready.append(ready)  # type: ignore[arg-type]
        return ready

    pool._spawn_one = spawn_one  # type: ignore[method-assign]
    pool.start()
    try:
        await async_wait_until(lambda: pool.ready() == 2, timeout=10)
        assert outcomes == []
        assert waits == [1.0, 2.0, 1.0, 2.0, 4.0]  # doubling; from 1 s again after a ready one
    finally:
        assert pool._task is not None
        pool._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pool._task  # cancelled while waiting: not retried


async def test_the_link_retries_registration_with_a_backoff_capped_by_the_grace_it_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits = record_waits(monkeypatch, service_module)
    link = ResourceManagerLink(None, [], None)  # type: ignore[arg-type]
    registrations = [False, False, False, True, False, False, False, True]
    heartbeats = 0
    beating = asyncio.Event()

    async def register():  # type: ignore[no-untyped-def]
        if not registrations.pop(0):
            raise ConnectionError("refused")
        return "rm:1", SimpleNamespace(lost_after_ms=400)  # a grace of 0.4 s: cap 0.1 s

    async def heartbeat(address, response):  # type: ignore[no-untyped-def]
        nonlocal heartbeats
        heartbeats += 1
        if heartbeats == 1:
            raise _Reregister("the stream ended")
        beating.set()
        await asyncio.Event().wait()

    link._register = register  # type: ignore[method-assign]
    link._heartbeat = heartbeat  # type: ignore[method-assign]
    task = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(beating.wait(), timeout=10)
        # 2 s cap before the first registration; then from 0.05 s again, capped at 0.1 s.
        assert waits == [0.05, 0.1, 0.2, 0.05, 0.1, 0.1]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
