"""The services' retry policies, named once. Every retry goes through tenacity: calls with
``tenacity.AsyncRetrying`` where they are made, long-lived streams (store watches, leader
observations) through :func:`shoal.contract.retrying.resumed`; this module holds the waits
and the predicates they share (docs/architecture.md, "Retries")."""

from __future__ import annotations

import tenacity

from shoal.contract.errors import StoreUnavailable
from shoal.contract.retrying import backoff, resumed, transient

__all__ = [
    "STREAM_CAP_S",
    "STREAM_FIRST_S",
    "backoff",
    "resumed",
    "store_outage",
    "stream_wait",
    "transient",
]

# A store watch or a leader observation that broke is opened again after 0.05 s, doubling up
# to 1 s (EtcdStore(watch_backoff_max=...) sets its own cap); the waits start over once a
# session works again.
STREAM_FIRST_S = 0.05
STREAM_CAP_S = 1.0


def stream_wait(cap: float = STREAM_CAP_S) -> tenacity.wait_exponential:
    """The wait between the sessions of a store stream: 0.05 s doubling up to ``cap``."""
    return backoff(STREAM_FIRST_S, cap)


def store_outage(exc: BaseException) -> bool:
    """A store outage (:class:`StoreUnavailable`): transient, retried; other store errors (a
    closed store, a refused request) are not."""
    return isinstance(exc, StoreUnavailable)
