"""The placement decision of each reconcile cycle: incremental after events, full as the
periodic safety net.

The loop observes every job's records each cycle anyway (``decide.observe``: the learners, the
exits, the lost ones) and the inventory keeps which hosts changed since the last cycle. From
those, :class:`Placing` turns what changed since the previous cycle into events of
:class:`~shoal.scheduler.incremental.IncrementalPlanner`:

* a job submitted, cancelled or finished, its priority, min / max, last shrink, throughput
  model or attained service changed: ``submit`` / ``update_job`` / ``remove_job`` (the active
  jobs' demands, compared with the ones given last cycle);
* a learner started (a PENDING record), retiring or stopping, its exit reported, lost, gone:
  ``add_learner`` / ``retire_learner`` / ``remove_learner`` (the observed learners, compared
  with the ones given last cycle);
* a host joined, lost, changed (state, devices, health), dropped by a snapshot, an allocation
  made or released on it: ``put_host`` / ``remove_host`` (``Inventory.take_changed``: only
  the hosts an event touched; their views are rebuilt, no other host's).

and decides with ``planner.decide(now)`` -- no ``placement.plan``, no walk of every host and
device. The first cycle of a leader's term, and then every ``resync_interval_s`` at the
latest, is the *safety net*: the full ``plan`` over the observed state; when the planner's
decision for the same state differs, a warning names the jobs (once per such cycle) and the
full plan is the one acted on; the planner is then ``resync``-ed from the observed state. A
missed or wrong event can so never make a wrong decision stick for longer than one resync
interval. An event the planner refuses (``ValueError``) falls back to the full cycle at once.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence

from shoal.scheduler.incremental import IncrementalPlanner
from shoal.scheduler.placement import LearnerView, PlacementConfig, Plan, plan
from shoal.scheduler.policy import JobDemand
from shoal.scheduler.reconcile.inventory import Inventory

__all__ = ["Placing", "diverging_jobs"]

log = logging.getLogger(__name__)


def diverging_jobs(a: Plan, b: Plan) -> list[str]:
    """The jobs (and learners, for ``lost``) on which two plans' decisions differ; ``[]`` when
    they are the same (the order of starts, retires and lost learners aside)."""
    out: set[str] = set()
    for job_id in a.shares.keys() | b.shares.keys():
        if a.shares.get(job_id) != b.shares.get(job_id):
            out.add(job_id)
    out.update(s.job_id for s in set(a.starts) ^ set(b.starts))
    out.update(r.job_id for r in set(a.retires) ^ set(b.retires))
    if a.queue != b.queue:
        out.update(j for i, j in enumerate(a.queue) if i >= len(b.queue) or b.queue[i] != j)
        out.update(j for i, j in enumerate(b.queue) if i >= len(a.queue) or a.queue[i] != j)
    out.update(a.held ^ b.held)
    out.update(f"learner {lid} (lost)" for lid in set(a.lost) ^ set(b.lost))
    if a.capacity != b.capacity:
        out.add(f"<capacity {a.capacity} != {b.capacity}>")
    return sorted(out)


class Placing:
    """The placement step of the loop's cycles (see the module docstring). One per
    :class:`~shoal.scheduler.reconcile.loop.Reconciler`; :meth:`reset` when a term begins."""

    def __init__(
        self, config: PlacementConfig, *, resync_interval_s: float, incremental: bool = True
    ) -> None:
        self.config = config
        self.resync_interval_s = resync_interval_s
        self.incremental = incremental
        self.planner: IncrementalPlanner | None = None
        self.incremental_cycles = 0  # decisions taken from the planner
        self.full_cycles = 0  # decisions taken from the full plan
        self.divergences = 0  # safety-net cycles where the planner's decision differed
        self.last_divergence: list[str] = []
        self._demands: dict[str, JobDemand] = {}  # as given to the planner last cycle
        self._learners: set[tuple[str, str, str, str, bool]] = set()  # given last cycle
        self._hosts: set[str] = set()  # the hosts the planner knows
        self._last_full = -math.inf

    def reset(self) -> None:
        """A new leadership term: the next cycle is a full one and resyncs the planner."""
        self.planner = None
        self._demands = {}
        self._learners = set()
        self._hosts = set()
        self._last_full = -math.inf

    def decide(
        self,
        demands: Sequence[JobDemand],
        inventory: Inventory,
        current: Sequence[LearnerView],
        now: float,
    ) -> Plan:
        """The cycle's plan: the planner's after events, the full one on the safety net."""
        if not self.incremental:
            self.full_cycles += 1
            return plan(demands, inventory.host_views(), current, self.config, now=now)
        changed = inventory.take_changed()
        # The safety net: the term's first cycle, then every resync interval (or when the
        # clock went back).
        if self.planner is None or not 0 <= now - self._last_full < self.resync_interval_s:
            return self._full(demands, inventory, current, changed, now)
        try:
            self._events(demands, inventory, current, changed)
            decided = self.planner.decide(now)
        except ValueError as exc:
            log.warning("incremental placement refused an event (%s): full cycle", exc)
            return self._full(demands, inventory, current, set(), now, compare=False)
        self.incremental_cycles += 1
        return decided

    # -- the safety net -----------------------------------------------------------------------

    def _full(
        self,
        demands: Sequence[JobDemand],
        inventory: Inventory,
        current: Sequence[LearnerView],
        changed: set[str],
        now: float,
        *,
        compare: bool = True,
    ) -> Plan:
        # Until this cycle succeeds (plan raises on an invalid observed state, as it always
        # did), the next one is a full one too: the planner may hold half of the events.
        self._last_full = -math.inf
        views = inventory.host_views()
        full = plan(demands, views, current, self.config, now=now)  # raises as before
        self.full_cycles += 1
        if compare and self.planner is not None:
            try:
                self._events(demands, inventory, current, changed)
                differ = diverging_jobs(self.planner.decide(now), full)
            except ValueError as exc:
                differ = [f"<event refused: {exc}>"]
            if differ:
                self.divergences += 1
                self.last_divergence = differ
                log.warning(
                    "incremental placement diverged from the full cycle on %s: the full plan "
                    "is used and the planner resynced (an event was missed)",
                    ", ".join(differ),
                )
        if self.planner is None:
            self.planner = IncrementalPlanner(self.config)
        self.planner.resync(demands, views, current, validated=True)  # plan() just ran on it
        self._demands = {d.job_id: d for d in demands}
        self._learners = set(map(_KEY, current))
        self._hosts = {v.host_id for v in views}
        self._last_full = now
        return full

    # -- events -------------------------------------------------------------------------------

    def _events(
        self,
        demands: Sequence[JobDemand],
        inventory: Inventory,
        current: Sequence[LearnerView],
        changed: set[str],
    ) -> None:
        """Give the planner what changed since the last cycle, as events."""
        planner = self.planner
        assert planner is not None
        # The learners as tuples, diffed as sets (hashing and comparing in C: the loop observes
        # every learner each cycle, and only the few that changed become events).
        learners = set(map(_KEY, current))
        gone = self._learners - learners
        came = learners - self._learners
        came_by_id = {t[0]: t for t in came}
        retired: list[str] = []
        # Learners gone (exited and processed, lost, dropped) first: they free devices.
        for old in sorted(gone):
            new = came_by_id.get(old[0])
            if new is not None and not old[4] and new[4] and old[:4] == new[:4]:
                retired.append(old[0])  # the same learner, asked to retire
                del came_by_id[old[0]]
            else:
                planner.remove_learner(old[0])
        for host_id in sorted(changed):
            view = inventory.view(host_id)
            if view is not None:
                planner.put_host(view)
                self._hosts.add(host_id)
            elif host_id in self._hosts:
                planner.remove_host(host_id)
                self._hosts.discard(host_id)
        for lid in retired:
            planner.retire_learner(lid)
        for new in sorted(came_by_id.values()):
            planner.add_learner(LearnerView(*new))
        self._learners = learners
        wanted = {d.job_id: d for d in demands}
        for job_id in [j for j in self._demands if j not in wanted]:
            planner.remove_job(job_id)
        for job_id, demand in wanted.items():
            if self._demands.get(job_id) != demand:
                planner.submit(demand)
        self._demands = wanted


_KEY = operator.attrgetter("learner_id", "job_id", "host_id", "device_id", "retiring")
"""A learner view as a tuple (what the event diff compares)."""
