"""The skeleton every service process shares: serve until a signal, lead while elected.

* :func:`run_service` -- create the gRPC server (``shoal.runtime.server``), start the service's
  background work, serve until SIGTERM/SIGINT, stop gracefully, and shut the metrics and the
  tracing down, whatever happens.
* :func:`lead_forever` -- campaign, lead one term, step down, resign, campaign again, for as
  long as the process runs (the scheduler and the resource manager elect a leader this way).
* :func:`follow_leader` -- report the elected leader's address after every change (what a
  standby tells its callers in ``shoal-leader``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import tenacity

from shoal.contract.errors import StoreError
from shoal.runtime import metrics, telemetry
from shoal.runtime.config import ServerConfig
from shoal.runtime.election import LeaderElection, Leadership
from shoal.runtime.errors import ErrorTable
from shoal.runtime.retrying import transient
from shoal.runtime.server import RunningServer, ServiceBinding, create_server, run_until_signalled
from shoal.runtime.store import Store

__all__ = ["follow_leader", "lead_forever", "run_service"]

log = logging.getLogger(__name__)


async def run_service(
    server: ServerConfig,
    bindings: Sequence[ServiceBinding],
    *,
    errors: ErrorTable,
    started: Callable[[RunningServer], object] | None = None,
    stopping: Callable[[], Awaitable[None]] | None = None,
    closed: Callable[[], Awaitable[None]] | None = None,
    credentials_store: Store | None = None,
    announce: bool = False,
) -> None:
    """Serve ``bindings`` until SIGTERM/SIGINT.

    ``started(running)`` runs once the server listens (start the background work; it may be
    async). On a signal, ``stopping()`` runs while the server still drains its calls; it runs
    again when serving ends however it ends (so it must be idempotent), then ``closed()``
    (release what the service owns: its store, its channels), then the metrics and the tracing
    are shut down. ``announce`` prints ``LISTENING <port>`` for a supervisor that reads it."""
    running = await create_server(
        server, bindings, errors=errors, credentials_store=credentials_store
    )
    try:
        if started is not None:
            result = started(running)
            if asyncio.iscoroutine(result):
                await result
        if announce:
            print(f"LISTENING {running.port}", flush=True)
        await run_until_signalled(running, on_stop=stopping)
    finally:
        try:
            if stopping is not None:
                await stopping()
            if closed is not None:
                await closed()
        finally:
            metrics.shutdown_metrics()
            telemetry.shutdown_tracing()


async def lead_forever(
    election: LeaderElection,
    term: Callable[[Leadership], Awaitable[None]],
    *,
    step_down: Callable[[Leadership], None],
    expected: tuple[type[BaseException], ...] = (),
    pause_s: float = 0.0,
    retry_s: float = 0.0,
    closing: Callable[[], bool] = lambda: False,
) -> None:
    """Campaign; run ``term(leadership)`` (it returns, or raises, when the leadership ends);
    ``step_down(leadership)``; resign (so that another replica leads at once); campaign again,
    until ``closing()`` or the task is cancelled.

    A term that ends with one of ``expected`` is logged as a warning, any other error with its
    traceback; neither stops the campaigning. ``pause_s`` is waited after every term,
    ``retry_s`` more after one that failed (or a campaign that failed)."""
    while not closing():
        leadership = await _campaign(election, retry_s, closing)
        if leadership is None:
            return  # closing
        failed = False
        try:
            await term(leadership)
        except asyncio.CancelledError:
            raise
        except expected as exc:
            log.warning("%s: leadership term ended: %s", election.name, exc)
        except Exception:
            failed = True
            log.exception("%s: leadership term failed", election.name)
        finally:
            step_down(leadership)
            with contextlib.suppress(Exception):
                await asyncio.shield(leadership.resign())
        log.info("%s: no longer the leader; campaigning again", election.name)
        await asyncio.sleep(pause_s + (retry_s if failed else 0.0))


async def _campaign(
    election: LeaderElection, retry_s: float, closing: Callable[[], bool]
) -> Leadership | None:
    """``election.campaign()`` (which rides out store outages itself), tried again after any
    other error every ``max(retry_s, 0.1)`` seconds (logged with its traceback: campaigning
    never stops) until it wins; None once ``closing()``."""

    def failed(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None
        exc = state.outcome.exception()
        log.error("%s: campaign failed; campaigning again", election.name, exc_info=exc)

    try:
        async for attempt in tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(transient(lambda exc: isinstance(exc, Exception))),
            wait=tenacity.wait_fixed(max(retry_s, 0.1)),
            stop=lambda _state: closing(),
            before_sleep=failed,
            reraise=True,
        ):
            with attempt:
                return await election.campaign()
    except Exception:
        if closing():
            return None
        raise
    return None


async def follow_leader(
    election: LeaderElection, on_leader: Callable[[str | None], None], *, retry_s: float = 0.5
) -> None:
    """Call ``on_leader(address)`` with the leader's candidate id now and after every change
    (None: nobody leads), forever; a store error is logged and the watch started again after
    ``retry_s`` (tenacity; ``observe`` itself retries store outages with backoff)."""

    def retries(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None
        exc = state.outcome.exception()
        log.warning("observing the %s leader failed (retrying): %s", election.name, exc)

    async for attempt in tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(StoreError),
        wait=tenacity.wait_fixed(retry_s),
        before_sleep=retries,
    ):
        with attempt:
            async with contextlib.aclosing(election.observe()) as leaders:  # type: ignore[type-var]
                async for leader in leaders:
                    on_leader(leader)
