"""A shard's small hot-path work (``ParameterSyncServicer._compute_small``): it runs in the
event loop itself when the compute thread has nothing in hand, on the compute thread when it
is larger than ``INLINE_COMPUTE_BYTES``, and behind work already in hand otherwise (the order
of submission is kept: never two at once on the shard's tensors)."""

from __future__ import annotations

import asyncio
import threading
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from shoal.param_sync.service import INLINE_COMPUTE_BYTES, ParameterSyncServicer


@pytest.fixture
def host() -> Iterator[types.SimpleNamespace]:
    """The methods on an object holding only what they use."""
    ns = types.SimpleNamespace(
        _executor=ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute"),
        _computing=set(),
    )
    ns._compute = types.MethodType(ParameterSyncServicer._compute, ns)
    ns._compute_small = types.MethodType(ParameterSyncServicer._compute_small, ns)
    ns._inline_compute = types.MethodType(ParameterSyncServicer._inline_compute, ns)
    yield ns
    ns._executor.shutdown(wait=True)


async def test_small_work_runs_in_the_loop_and_large_work_on_the_compute_thread(host) -> None:
    loop_thread = threading.get_ident()
    assert await host._compute_small(10, threading.get_ident) == loop_thread
    assert await host._compute_small(INLINE_COMPUTE_BYTES, threading.get_ident) == loop_thread
    large = await host._compute_small(INLINE_COMPUTE_BYTES + 1, threading.get_ident)
    assert large != loop_thread
    with pytest.raises(ZeroDivisionError):  # its errors are raised as the thread's would be
        await host._compute_small(10, lambda: 1 / 0)


async def test_small_work_waits_behind_work_in_hand(host) -> None:
    gate = threading.Event()
    order: list[str] = []

    def first() -> None:
        assert gate.wait(30)
        order.append("first")

    def second() -> int:
        order.append("second")
        return threading.get_ident()

    held = asyncio.ensure_future(host._compute(first))
    await asyncio.sleep(0)  # (a yield: the task submits its work)
    small = asyncio.ensure_future(host._compute_small(10, second))
    await asyncio.sleep(0)
    assert order == [] and not small.done()  # not run beside the work in hand
    gate.set()
    await held
    assert await small != threading.get_ident()  # it went to the compute thread, after
    assert order == ["first", "second"]
    assert await host._compute_small(10, threading.get_ident) == threading.get_ident()
