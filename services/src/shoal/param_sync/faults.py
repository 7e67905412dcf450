"""Fault points for the data plane's failure tests (issue 12): a shard process started with
``SHOAL_TEST_FAULT=<point>@<global iteration>`` SIGKILLs itself when it reaches that point at
that iteration, so that a test can kill a shard at an exact moment no outside signal can hit
(between two shards' commits, in the middle of a checkpoint). Unset (always, outside tests),
every point is a no-op costing one comparison.

Points:

* ``commit-partial``: the coordinator delivers iteration k's commit to one other shard only,
  then dies (a coordinator lost in the middle of a commit: shards left at k and k + 1).
* ``save-shard``: a shard asked to write its checkpoint file for iteration k dies before it
  writes (a shard lost during a checkpoint write).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

__all__ = ["POINTS", "armed", "die", "parse"]

log = logging.getLogger("shoal.param_sync.faults")

POINTS = frozenset({"commit-partial", "save-shard"})
ENV = "SHOAL_TEST_FAULT"


def parse(value: str) -> tuple[str, int] | None:
    """``<point>@<iteration>`` (None for an empty value); a clear error naming the variable
    and the value otherwise."""
    if not value:
        return None
    point, _, at = value.partition("@")
    if point not in POINTS or not at.isdigit():
        raise ValueError(
            f"{ENV} ({value!r}) must be <point>@<global iteration>, point one of {sorted(POINTS)}"
        )
    return point, int(at)


_ARMED = parse(os.environ.get(ENV, ""))


def armed(point: str, iteration: int) -> bool:
    """Whether this process must die at ``point`` of ``iteration``."""
    return _ARMED is not None and _ARMED == (point, iteration)


def die(point: str) -> NoReturn:
    """SIGKILL this process (no cleanup, as a lost host)."""
    log.warning("test fault %s: SIGKILL", point)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(137)  # not reached
