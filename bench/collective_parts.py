"""Where a collective iteration's time goes, part by part (``bench_collective.py --parts``).

Timers wrapped around the functions of one learner iteration and of the coordinator's Boundary
handler (``time.perf_counter``, ~0.1 us each: they do not change what they measure). Each
process appends its totals to ``<prefix>.<process>`` as JSON lines (the learner at exit, the
shard every 50 Boundaries: the bench kills it); :func:`report` turns them into milliseconds per
iteration. A bench tool only: nothing in shoal imports it.

Parts (nested ones are inside the one above them):

* learner ``train``: the whole loop; ``compute``: fetch, forward, backward (the overlap hooks
  launching the buckets included); ``sync``: everything after it, of which ``reduce`` (the
  all-reduces and the wait for them), ``boundary (caller)``: the Boundary vote as the
  trainer's thread waits for it (the hop to the session's event loop thread and back
  included), ``boundary (loop): Boundary``: the same call inside that loop (the RPC; the
  other control calls are listed by their method), ``boundary (direct)``: the vote on the
  trainer's thread over the control-only lane (``ShardSession.boundary_direct``; a vote it
  does not answer goes on to the two above), ``apply``: the optimizer step at the commit;
* shard ``Boundary``: the coordinator's handler, of which ``flush``: the iteration record
  written before the answer (the storage mark checked, the line appended), ``report`` and
  ``decide``: the coordinator's state machine (a commit reports every member's loss from
  inside the last vote's ``report``: those calls are nested and counted too).
"""

from __future__ import annotations

import atexit
import collections
import functools
import inspect
import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "SHOAL_BENCH_PARTS"

_totals: collections.Counter[str] = collections.Counter()
_counts: collections.Counter[str] = collections.Counter()


def _wrap(owner: Any, name: str, key: str, *, dump_every: int = 0, out: str = "") -> None:
    """Time ``owner.name`` under ``key`` (``{0}`` in it: the call's first argument after
    ``self``, e.g. a control call's method)."""
    f = getattr(owner, name)
    clock = time.thread_time if os.environ.get("SHOAL_BENCH_PARTS_CPU") else time.perf_counter
    key_of = key
    if inspect.iscoroutinefunction(f):

        @functools.wraps(f)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            began = clock()
            try:
                return await f(*args, **kwargs)
            finally:
                key = key_of.format(*args[1:2])
                _totals[key] += clock() - began
                _counts[key] += 1
                if dump_every and _counts[key] % dump_every == 0:
                    _dump(out)

        setattr(owner, name, timed_async)
        return

    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = clock()
        try:
            return f(*args, **kwargs)
        finally:
            _totals[key] += clock() - began
            _counts[key] += 1

    setattr(owner, name, timed)


def _dump(path: str) -> None:
    Path(path).write_text(json.dumps({"totals": dict(_totals), "counts": dict(_counts)}))


def install_learner() -> None:
    """In a learner process, before ``train``: wrap its parts (when ``SHOAL_BENCH_PARTS``)."""
    prefix = os.environ.get(ENV)
    if not prefix:
        return
    from shoal.learner import collective, collective_ahead, shard_session, trainer

    _wrap(trainer.ElasticTrainer, "train", "learner train")
    _wrap(trainer.ElasticTrainer, "_compute", "learner compute")
    _wrap(collective.CollectiveBackend, "sync", "learner sync")
    _wrap(collective, "reduce_contribution", "learner sync: reduce")
    _wrap(collective.CollectiveBackend, "_run", "learner sync: boundary (caller)")
    _wrap(shard_session.ShardSession, "control", "learner sync: boundary (loop): {0}")
    _wrap(shard_session.ShardSession, "boundary_direct", "learner sync: boundary (direct)")
    _wrap(collective.CollectiveBackend, "_apply", "learner sync: apply")
    _wrap(collective.CollectiveBackend, "_answer_ahead", "learner sync: answer ahead")
    _wrap(collective.CollectiveBackend, "_send_ahead", "learner sync: send ahead")
    _wrap(collective_ahead.StateCopy, "take", "learner sync: send ahead: copy")
    _wrap(collective.CollectiveBackend, "report_epoch", "learner report_epoch")
    name = os.environ.get("SHOAL_LEARNER_ID", "learner")
    atexit.register(_dump, f"{prefix}.{name}")


def install_shard() -> None:
    """In the shard process, before it serves (when ``SHOAL_BENCH_PARTS``)."""
    prefix = os.environ.get(ENV)
    if not prefix:
        return
    from shoal.param_sync import coordinator, servicer_learners, servicer_tasks

    out = f"{prefix}.shard"
    _wrap(servicer_learners.LearnerHandlers, "Boundary", "shard Boundary", dump_every=50, out=out)
    _wrap(servicer_tasks.CoordinatorTasks, "_flush_metrics", "shard Boundary: flush")
    _wrap(coordinator.Coordinator, "report", "shard Boundary: report")
    _wrap(coordinator.Coordinator, "decide", "shard Boundary: decide")


def report(prefix: Path) -> list[tuple[str, float, int]]:
    """(part, ms per iteration, calls) from every process's file; per iteration = per
    ``learner sync`` call of that learner (the shard's: per Boundary of one learner)."""
    rows: list[tuple[str, float, int]] = []
    iterations = 0
    for path in sorted(prefix.parent.glob(prefix.name + ".*")):
        data = json.loads(path.read_text())
        totals, counts = data["totals"], data["counts"]
        who = path.suffix[1:]
        if who != "shard":
            iterations = max(iterations, counts.get("learner sync", 0))
        for key in sorted(totals):
            rows.append((f"{who}: {key}", totals[key], counts[key]))
    return [(k, t * 1e3 / max(iterations, 1), c) for k, t, c in rows]
