"""Liveness of a learner's calls that wait on its job's coordinator (issue 12).

A coordinator that hangs without closing its connections (SIGSTOP, a long stall, a half-open
partition) never fails the calls waiting on it: the kernel keeps the TCP connection up, so gRPC
sees nothing wrong, and a learner blocked in ``Boundary`` (or in a tensor stream on the
coordinator's own shard) would wait for as long as the pause lasts, even after the scheduler
moved the coordinator role to another shard. No fixed deadline fits ``Boundary``: it
legitimately waits through a recovery, a checkpoint, or a joiner's admission.

So a call is *watched* instead: once it has been pending for ``after_s``, the learner asks the
other shards where the job's coordinator is (``FindCoordinator``, one shard every
``every_s``, in turn: a cheap, bounded call), and when one names a newer coordinator than the
one followed the call is cancelled and :class:`CoordinatorMoved` raised; the caller switches to
the new coordinator and goes on there. A call that finishes is never cancelled, however long it
took, and a probe that fails (that shard is down too) only moves on to the next shard.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["WATCH_AFTER_S", "WATCH_EVERY_S", "CoordinatorMoved", "watched"]

T = TypeVar("T")

#: How long a call waits on the coordinator before the learner starts asking where it is.
WATCH_AFTER_S = 2.0
#: Seconds between those questions (each one asks one shard, with a deadline of its own).
WATCH_EVERY_S = 2.0


class CoordinatorMoved(Exception):
    """The job's coordinator role moved to another shard while a call waited on the old one;
    the call was cancelled."""


async def watched(
    call: Awaitable[T],
    moved: Callable[[], Awaitable[bool]],
    *,
    after_s: float = WATCH_AFTER_S,
    every_s: float = WATCH_EVERY_S,
) -> T:
    """Await ``call``; while it is pending past ``after_s``, await ``moved()`` every
    ``every_s`` (it must not raise: True means the coordinator moved). Then ``call`` is
    cancelled and :class:`CoordinatorMoved` raised, unless it finished meanwhile (its outcome
    wins)."""
    if after_s <= 0 or every_s <= 0:
        raise ValueError(f"after_s ({after_s}) and every_s ({every_s}) must be > 0")
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=after_s)
        while not done:
            if await moved() and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise CoordinatorMoved("the job's coordinator moved while a call waited on it")
            done, _ = await asyncio.wait({task}, timeout=every_s)
        return task.result()
    finally:
        if not task.done():  # cancelled from outside (the backend closing)
            task.cancel()
