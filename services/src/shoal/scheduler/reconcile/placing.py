"""The placement decision of each reconcile cycle: incremental after events, full as the
periodic safety net.

The loop keeps its observed view per job (:mod:`shoal.scheduler.reconcile.observing`: after
an event only the jobs that changed are observed again) and the inventory keeps which hosts
changed since the last cycle. :class:`Placing` turns what changed since the previous cycle
into events of :class:`~shoal.scheduler.incremental.IncrementalPlanner`:

* a job submitted, cancelled or finished, its priority, min / max, last shrink, throughput
  model or attained service changed: ``submit`` / ``remove_job`` (the demands of the jobs
  observed again or polled);
* a learner started (a PENDING record), retiring or stopping, its exit reported, lost, gone:
  ``add_learner`` / ``retire_learner`` / ``remove_learner`` (per job observed again, its
  counted learners before and after);
* a host joined, lost, changed (state, devices, health), dropped by a snapshot, an allocation
  made or released on it: ``put_host`` / ``remove_host`` (``Inventory.take_changed``: only
  the hosts an event touched; their views are rebuilt, no other host's).

and decides with ``planner.decide(now)`` (:meth:`Placing.step`) -- no ``placement.plan``, no
walk of every host, device or learner. (:meth:`Placing.decide` derives the same changes by
diffing the whole observed state with the last cycle's: the first wired version, kept for
tests and the bench.) The first cycle of a leader's term, and then every
``resync_interval_s`` (the loop passes ``--placement-check-interval``) at the latest, is the
*safety net* (:meth:`Placing.full`): the full ``plan`` over the fully observed state; the
pending changes are given to the planner, and when its decision or its input state differs
from the full plan and the observed state, a warning names the jobs (once per such cycle),
the planner is ``resync``-ed, and the full plan is the one acted on (it always is on that
cycle). An agreeing planner is kept as it is. A missed or wrong event can so never make a
wrong decision stick for longer than one check interval. An event the planner refuses
(``ValueError``) falls back to the full cycle at once.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence

from shoal.scheduler.incremental import IncrementalPlanner
from shoal.scheduler.placement import LearnerView, PlacementConfig, Plan, PlanMemo, plan
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


LearnerKey = tuple[str, str, str, str, bool]


class Placing:
    """The placement step of the loop's cycles (see the module docstring). One per
    :class:`~shoal.scheduler.reconcile.loop.Reconciler`; :meth:`reset` when a term begins.

    Two ways to feed it: :meth:`decide` with the whole observed state (the changes are derived
    by diffing it with the last cycle's: O(jobs + learners)), or, as the loop does, :meth:`due`
    then :meth:`step` (after an event) or :meth:`full` (the safety net) with only what changed
    per job (``demand_changes``, ``learner_changes``) and the hosts the inventory says changed.
    """

    def __init__(
        self, config: PlacementConfig, *, resync_interval_s: float, incremental: bool = True
    ) -> None:
        self.config = config
        self.resync_interval_s = resync_interval_s
        self.incremental = incremental
        self.planner: IncrementalPlanner | None = None
        self.incremental_cycles = 0  # decisions taken from the planner
        self.full_cycles = 0  # decisions taken from the full plan
        self.divergences = 0  # safety-net cycles where the planner differed
        self.resyncs = 0  # planner rebuilds (the first, and after a divergence)
        self.last_divergence: list[str] = []
        self._demands: dict[str, JobDemand] = {}  # as given to the planner
        self._learners: set[LearnerKey] = set()  # given last cycle (decide's diff only)
        self._diffing = False  # fed by decide (it keeps _learners), not by step / full
        self._hosts: set[str] = set()  # the hosts the planner knows
        self._last_full = -math.inf
        # What plan derived from each job's group of learners (kept between full plans).
        self._memo = PlanMemo()

    def reset(self) -> None:
        """A new leadership term: the next cycle is a full one and resyncs the planner."""
        self.planner = None
        self._demands = {}
        self._learners = set()
        self._hosts = set()
        self._last_full = -math.inf
        self._memo = PlanMemo()

    def due(self, now: float) -> bool:
        """Whether the cycle at ``now`` must be a full one: incremental placement off, the
        term's first cycle, a resync interval since the last full one (or the clock went
        back)."""
        return (
            not self.incremental
            or self.planner is None
            or not 0 <= now - self._last_full < self.resync_interval_s
        )

    def decide(
        self,
        demands: Sequence[JobDemand],
        inventory: Inventory,
        current: Sequence[LearnerView],
        now: float,
        *,
        groups: Mapping[str, tuple[LearnerView, ...]] | None = None,
    ) -> Plan:
        """The cycle's plan from the whole observed state: the changes since the last cycle
        are found by diffing it (the demands, the learners as sets of tuples). ``groups``:
        ``current`` by job, if the caller has it (``Observed.groups``: see ``plan``)."""
        if not self.incremental:
            self.full_cycles += 1
            return plan(
                demands,
                inventory.host_views(),
                current,
                self.config,
                now=now,
                groups=groups,
                memo=self._memo,
            )
        self._diffing = True
        changed = inventory.take_changed()
        learners = set(map(_KEY, current))
        gone, came = self._learners - learners, learners - self._learners
        self._learners = learners
        wanted = {d.job_id: d for d in demands}
        demand_changes: dict[str, JobDemand | None] = {
            j: None for j in self._demands if j not in wanted
        }
        demand_changes.update((j, d) for j, d in wanted.items() if self._demands.get(j) != d)
        if self.due(now):
            return self.full(
                demands,
                inventory,
                current,
                now,
                gone=gone,
                came=came,
                demand_changes=demand_changes,
                changed_hosts=changed,
                groups=groups,
            )
        return self.step(
            inventory,
            now,
            gone=gone,
            came=came,
            demand_changes=demand_changes,
            changed_hosts=changed,
            fallback=lambda: (demands, current),
        )

    def step(
        self,
        inventory: Inventory,
        now: float,
        *,
        gone: Iterable[LearnerKey],
        came: Iterable[LearnerKey],
        demand_changes: Mapping[str, JobDemand | None],
        changed_hosts: Iterable[str],
        fallback: Callable[[], tuple[Sequence[JobDemand], Sequence[LearnerView]]],
    ) -> Plan:
        """A cycle after events: the changes given to the planner, its decision. An event
        it refuses (``ValueError``) makes this cycle a full one over ``fallback()`` (the
        whole observed state: demands, learners)."""
        planner = self.planner
        assert planner is not None, "step before the term's first full cycle"
        try:
            self._apply(inventory, gone, came, demand_changes, changed_hosts)
            decided = planner.decide(now)
        except ValueError as exc:
            log.warning("incremental placement refused an event (%s): full cycle", exc)
            demands, current = fallback()
            return self.full(demands, inventory, current, now, compare=False)
        self.incremental_cycles += 1
        return decided

    # -- the safety net -----------------------------------------------------------------------

    def full(
        self,
        demands: Sequence[JobDemand],
        inventory: Inventory,
        current: Sequence[LearnerView],
        now: float,
        *,
        gone: Iterable[LearnerKey] = (),
        came: Iterable[LearnerKey] = (),
        demand_changes: Mapping[str, JobDemand | None] | None = None,
        changed_hosts: Iterable[str] = (),
        compare: bool = True,
        current_keys: set[LearnerKey] | None = None,
        current_by_id: Mapping[str, LearnerView] | None = None,
        groups: Mapping[str, tuple[LearnerView, ...]] | None = None,
    ) -> Plan:
        """The full plan over the whole observed state (acted on). With ``compare`` and a
        planner, the pending changes are given to it first and its decision and its state are
        compared with the full plan and the observed state: on a difference one warning names
        the jobs and the planner is rebuilt (``resync``); without one it is kept as it is.
        ``current_keys``: ``current`` as tuples, if the caller has them (saves building them);
        ``current_by_id``: ``current`` by learner id, if the caller has it (a cheaper check);
        ``groups``: ``current`` by job, if the caller has it (see ``plan``)."""
        # Until this cycle succeeds (plan raises on an invalid observed state, as it always
        # did), the next one is a full one too: the planner may hold half of the events.
        self._last_full = -math.inf
        views = inventory.host_views()
        full = plan(  # raises as before
            demands, views, current, self.config, now=now, groups=groups, memo=self._memo
        )
        self.full_cycles += 1
        planner = self.planner
        rebuild = planner is None or not compare
        if planner is not None and not rebuild:
            try:
                self._apply(inventory, gone, came, demand_changes or {}, changed_hosts)
                differ = diverging_jobs(planner.decide(now), full)
                if not differ:
                    differ = planner.differs_from(
                        demands, views, current, keys=current_keys, by_id=current_by_id
                    )
            except ValueError as exc:
                differ = [f"<event refused: {exc}>"]
            if differ:
                rebuild = True
                self.divergences += 1
                self.last_divergence = differ
                log.warning(
                    "incremental placement diverged from the full cycle on %s: the full plan "
                    "is used and the planner resynced (an event was missed)",
                    ", ".join(differ[:20])
                    + (f" (+{len(differ) - 20})" if len(differ) > 20 else ""),
                )
        if rebuild:
            if self.planner is None:
                self.planner = IncrementalPlanner(self.config)
            self.planner.resync(demands, views, current, validated=True)  # plan() just ran
            self.resyncs += 1
            self._demands = {d.job_id: d for d in demands}
            self._hosts = {v.host_id for v in views}
        if self._diffing:
            self._learners = set(map(_KEY, current))
        self._last_full = now
        return full

    # -- events -------------------------------------------------------------------------------

    def _apply(
        self,
        inventory: Inventory,
        gone: Iterable[LearnerKey],
        came: Iterable[LearnerKey],
        demand_changes: Mapping[str, JobDemand | None],
        changed: Iterable[str],
    ) -> None:
        """Give the planner what changed since the last cycle, as events: the learners gone
        and come (keys), the hosts changed, the jobs whose demand changed (None: no longer
        active)."""
        planner = self.planner
        assert planner is not None
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
        for job_id, demand in demand_changes.items():
            if demand is None:
                if self._demands.pop(job_id, None) is not None:
                    planner.remove_job(job_id)
            elif self._demands.get(job_id) != demand:
                planner.submit(demand)
                self._demands[job_id] = demand


_KEY = operator.attrgetter("learner_id", "job_id", "host_id", "device_id", "retiring")
"""A learner view as a tuple (what the event diff compares)."""
