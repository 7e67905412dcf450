"""Fault points for the data plane's failure tests (issue 12): the one mechanism by which a
shard or learner process is made to fail at an exact moment no outside signal can hit (between
two shards' commits, in the middle of a checkpoint write, between two learners' votes). A
process started with ``SHOAL_TEST_FAULT=<point>@<argument>`` fails when it reaches ``<point>``;
unset (always, outside tests), every point is a no-op costing one comparison. A malformed value
is refused when the process starts, naming the variable and the value.

Standard library only (no grpc, no torch): the shards (``shoal.param_sync``) and the learner
(``shoal.learner``, which must not import services) share this one implementation (it was
``shoal.param_sync.faults`` before the learner needed it).

Points:

* ``commit-partial@<k>``: the coordinator delivers iteration k's commit to one other shard
  only, then SIGKILLs itself (a coordinator lost in the middle of a commit: shards left at k
  and k + 1).
* ``save-shard@<k>``: a shard asked to write its checkpoint file for iteration k SIGKILLs
  itself before it writes (a shard lost during a checkpoint write).
* ``snapshot-sent@<k>``: a primary SIGKILLs itself once its backup (on its host) answered
  the first snapshot of its slice at k or more completed iterations (the backup may not have
  taken it out of the segment yet: docs/data-plane.md, "The replica's steps deferred").
* ``stop-after-vote@<k>``: the coordinator of a collective job stops itself (SIGSTOP) once
  the first learner's commit vote for iteration k has arrived and before the last one (k not
  committed), so that the test can SIGKILL it with a vote in flight (the successor's "run k
  again" path, tests/integration/test_collective_coordinator_failover.py).
* ``stop-before-vote@<k>`` (a collective-mode learner): the learner stops itself (SIGSTOP)
  once its all-reduce of iteration k succeeded, before it votes, so that the test can SIGKILL
  it and evict it with the other members' votes in (their update applied ahead is taken back:
  tests/integration/test_collective_training.py).
* ``raise-floor@<k>``: the first SyncStep of global iteration k that reaches the shard finds
  the shard's generation floor raised above the running generation (the held sums of the
  iteration dropped, the floor set to the running generation + 1, as the SetCoordinator bug of
  issue 12's livelock did), without the coordinator being told: the shard refuses the
  iteration as stale until the coordinator's floor guard re-issues it above the floor
  (docs/data-plane.md, "Generation floor drift"). Once per process.
* ``hold-answer@<k>`` (a learner with ``SHOAL_PS_EARLY_FORWARD=on``): the learner holds the
  rest of every shard's SyncStep answer of global iteration k after its header (sync returns,
  the next forward starts with every tensor of the answer still pending) until the trainer
  first waits for one of them, or 60 s.
* ``drop-answer@<k>`` (same): as ``hold-answer``, then the last shard's answer fails as if
  that shard died while answering (the learner cancels the call): the trainer must abandon
  the iteration it started and pull the parameters. Both act each time the learner receives
  iteration k's answers (once, unless k is re-issued); both are the learner's view of a slow
  or lost answer, made on the learner's side (``grpc_backend.py``), not a shard dying.
* ``stop-before-rename@<trigger file>``: armed while the trigger file exists and holds parts
  of a file's path (whitespace-separated, e.g. ``shard-1.safetensors`` or
  ``<job id>/ shard-1.safetensors``): the thread writing a file whose path contains every
  part stops the process (SIGSTOP) once the file's temporary copy is written, before the
  rename, so that the test can SIGKILL it (or another process) at exactly that point. Reached
  by a shard's checkpoint file (``shoal.param_sync.checkpoint.atomic_write``, the copy synced
  too; tests/chaos, tests/integration/test_coordinator_failover.py) and by a collective-mode
  learner's (``shoal.learner.collective_checkpoint.write_checkpoint_file``;
  tests/integration/test_collective_coordinator_failover.py). The test arms and disarms it at
  run time by writing and removing the trigger file.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import NoReturn

__all__ = [
    "DROP_ANSWER",
    "ENV",
    "HOLD_ANSWER",
    "POINTS",
    "RAISE_FLOOR",
    "STOP_AFTER_VOTE",
    "STOP_BEFORE_RENAME",
    "STOP_BEFORE_VOTE",
    "armed",
    "armed_from",
    "die",
    "fire_once",
    "parse",
    "stop",
    "stop_before_rename",
]

log = logging.getLogger("shoal.faults")

#: The points at a global iteration that kill the process.
KILL_POINTS = frozenset({"commit-partial", "save-shard", "snapshot-sent"})
STOP_AFTER_VOTE = "stop-after-vote"
STOP_BEFORE_VOTE = "stop-before-vote"
#: The point that raises a shard's generation floor at a global iteration (once).
RAISE_FLOOR = "raise-floor"
#: A learner's points at the answer of a global iteration (early forward; once each).
HOLD_ANSWER = "hold-answer"
DROP_ANSWER = "drop-answer"
#: The points whose argument is a global iteration.
ITERATION_POINTS = KILL_POINTS | {
    STOP_AFTER_VOTE,
    STOP_BEFORE_VOTE,
    RAISE_FLOOR,
    HOLD_ANSWER,
    DROP_ANSWER,
}
#: The point that stops the process before a checkpoint file's rename (argument: a trigger
#: file).
STOP_BEFORE_RENAME = "stop-before-rename"
POINTS = ITERATION_POINTS | {STOP_BEFORE_RENAME}
ENV = "SHOAL_TEST_FAULT"


def parse(value: str) -> tuple[str, int | str] | None:
    """``<point>@<argument>`` (None for an empty value): the iteration of an iteration point, the
    trigger file of ``stop-before-rename``. A clear error naming the variable and the value
    otherwise."""
    if not value:
        return None
    point, _, at = value.partition("@")
    if point in ITERATION_POINTS and at.isascii() and at.isdigit():
        return point, int(at)
    if point == STOP_BEFORE_RENAME and at:
        return point, at
    raise ValueError(
        f"{ENV} ({value!r}) must be <point>@<global iteration> with point one of "
        f"{sorted(ITERATION_POINTS)}, or {STOP_BEFORE_RENAME}@<trigger file>"
    )


_ARMED = parse(os.environ.get(ENV, ""))


def armed(point: str, iteration: int) -> bool:
    """Whether this process must fail at ``point`` of ``iteration``."""
    return _ARMED is not None and _ARMED == (point, iteration)


def armed_from(point: str, iteration: int) -> bool:
    """Whether this process must fail at ``point`` of an iteration up to ``iteration`` (the
    first time it reaches the point at or after the armed iteration)."""
    return (
        _ARMED is not None
        and _ARMED[0] == point
        and isinstance(_ARMED[1], int)
        and _ARMED[1] <= iteration
    )


_FIRED: set[tuple[str, int]] = set()


def fire_once(point: str, iteration: int) -> bool:
    """Whether this process reaches ``point`` of ``iteration`` armed, the first time only."""
    if not armed(point, iteration) or (point, iteration) in _FIRED:
        return False
    _FIRED.add((point, iteration))
    log.warning("test fault %s at iteration %d", point, iteration)
    return True


def die(point: str) -> NoReturn:
    """SIGKILL this process (no cleanup, as a lost host)."""
    log.warning("test fault %s: SIGKILL", point)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(137)  # not reached


def stop(point: str) -> None:
    """SIGSTOP this process (every thread; it goes on where it was if sent SIGCONT)."""
    log.warning("test fault %s: SIGSTOP", point)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP)


def stop_before_rename(path: str) -> None:
    """The ``stop-before-rename`` point, reached when the temporary copy of the file at
    ``path`` is written: stop the process (SIGSTOP) if the trigger file exists and
    every part it holds is in ``path``; nothing otherwise."""
    if _ARMED is None or _ARMED[0] != STOP_BEFORE_RENAME:
        return
    try:
        with open(str(_ARMED[1])) as f:
            parts = f.read().split()
    except OSError:
        return
    if parts and all(part in path for part in parts):
        log.warning("test fault %s: SIGSTOP before renaming %s", STOP_BEFORE_RENAME, path)
        sys.stderr.flush()
        # Directed at this thread, so that it stops before its next instruction: a SIGSTOP
        # sent to the process may be taken by another thread, and this one renames meanwhile.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
