"""Retries, once for both sides: the backoff shape and the one retry tenacity has no construct
for, a long-lived stream opened again when it breaks.

Everything that retries in shoal goes through tenacity: a call (``tenacity.AsyncRetrying``
where it is made: the client's unary calls, a campaign, a conflict reload) or a stream, through
:func:`resumed` here. A stream (an etcd watch, a leader observation, a server stream read by
the client) is a series of *sessions*; its backoff must start over once a session has
delivered something, and a ``yield`` must never sit inside a tenacity attempt (the attempt
would capture the consumer's ``GeneratorExit``). So tenacity retries only "open a session and
get its first item"; a session that broke after delivering items counts as the first failed
attempt of a fresh retry sequence (one first wait, then growing again).

No grpc here (``shoal.contract`` is imported by every process): the caller passes what is
transient.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import tenacity

__all__ = ["SessionEnded", "backoff", "resumed", "transient"]

T = TypeVar("T")

# Never retried, whatever a predicate says: a cancellation, a generator's close, an exit.
_NEVER = (asyncio.CancelledError, GeneratorExit, KeyboardInterrupt, SystemExit)


def backoff(first: float, cap: float) -> tenacity.wait_exponential:
    """Wait ``first`` seconds after the first failed attempt, doubling, at most ``cap``."""
    return tenacity.wait_exponential(multiplier=first, max=cap)


def transient(predicate: Callable[[BaseException], bool]) -> Callable[[BaseException], bool]:
    """``predicate``, but never true for a cancellation or a close (those always propagate)."""

    def retryable(exc: BaseException) -> bool:
        return not isinstance(exc, _NEVER) and predicate(exc)

    return retryable


class SessionEnded(Exception):
    """A session of a stream that reopens when it ends ended before its first item."""


class _End:
    """The first item of a session that ended without one."""


async def resumed(
    open_session: Callable[[], AsyncIterator[T]],
    *,
    retry: Callable[[BaseException], bool],
    wait: tenacity.wait.WaitBaseT,
    stop: Callable[[], tenacity.stop.StopBaseT] = lambda: tenacity.stop_never,
    resume: Callable[[BaseException], bool] | None = None,
    reopen_on_end: bool = False,
    before_sleep: Callable[[tenacity.RetryCallState], None] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> AsyncGenerator[T, None]:
    """The items of ``open_session()``, opened again after it breaks.

    A session that fails before its first item is retried by tenacity: while ``retry(error)``,
    waiting ``wait`` (``before_sleep`` runs first), until ``stop()`` (a new stop for every
    retry sequence, so a deadline can start over); then the last error is raised. A session
    that fails after delivering items is opened again only if ``resume(error)`` (default:
    ``retry``), and that failure is the first failed attempt of a fresh sequence: the backoff
    starts over. A session that ends normally ends the stream, unless ``reopen_on_end`` (then
    it is opened again at once if it delivered items, and counts as failed with
    :class:`SessionEnded` if not). Cancellation is never retried; closing the stream closes
    the open session."""
    retryable = transient(lambda exc: isinstance(exc, SessionEnded) or retry(exc))
    resumable = transient(resume if resume is not None else retry)
    broke: BaseException | None = None  # how the last session broke after its items
    while True:
        session: AsyncIterator[T] | None = None
        first: T | _End = _End()
        async for attempt in tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(retryable),
            wait=wait,
            stop=stop(),
            before_sleep=before_sleep,
            sleep=sleep,
            reraise=True,
        ):
            with attempt:
                if broke is not None:
                    error, broke = broke, None
                    raise error  # the first failed attempt of this sequence
                session = open_session()
                try:
                    first = await anext(session)
                except StopAsyncIteration:
                    first = _End()
                    if reopen_on_end:
                        raise SessionEnded("the stream ended before its first item") from None
                except BaseException:
                    await _close(session)
                    raise
        assert session is not None
        if isinstance(first, _End):
            return
        try:
            yield first
            async for item in session:
                yield item
        except Exception as exc:
            if not resumable(exc):
                raise
            broke = exc
        else:
            if not reopen_on_end:
                return
        finally:
            await _close(session)


async def _close(session: AsyncIterator[object]) -> None:
    aclose = getattr(session, "aclose", None)
    if aclose is not None:
        await aclose()
