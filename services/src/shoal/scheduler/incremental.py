"""Incremental placement: the decision after an event, touching only what the event changed.

``plan()`` (placement.py) is the full cycle: it rebuilds every index (hosts, devices, who sits
where, what each job holds, the free devices) from the observed state, O(hosts x devices +
learners + jobs log jobs) per call. :class:`IncrementalPlanner` keeps those indices between
decisions and updates them per event, so that ``decide(now)`` equals
``plan(planner.jobs(), planner.hosts(), planner.learners(), config, now=now)`` -- the same
shares, starts, retires, queue, capacity, holds and lost learners -- while doing:

* per event (``submit`` / ``update_job`` / ``remove_job``, ``add_learner`` /
  ``retire_learner`` / ``remove_learner``, ``put_host`` / ``remove_host``): O(1) for a job or
  a learner, O(devices + learners of the host) for a host; the jobs whose held count or demand
  changed are marked.
* per decision: the shares, ``compute_shares`` over all jobs, O(jobs log jobs) (a water-filling:
  one submit changes every share in principle; ~10 ms at 5,000 jobs); reused when nothing
  changed since the last decision and no hold can expire in between. Then shrink and grow
  only for the *candidates*: the jobs whose share changed, the jobs marked by events, and the
  jobs still off their share after the last decision (retiring learners not yet gone, devices
  not yet free). Every other job held exactly its share and still does, so it gets no
  decision, as in ``plan()``. Free devices are indexed only when some candidate is below its
  share, from the per-host free lists kept by the events (O(hosts with a free device)).

The caller reports what happened as events, including the decisions it acted on (a Start
becomes ``add_learner``, a Retire ``retire_learner`` and, for the hold-time rule,
``update_job`` with ``last_shrunk_at``; an exit ``remove_learner``), and keeps running the full
``plan()`` periodically as the safety net: ``resync`` replaces the state by the observed one.
Invalid events raise ``ValueError`` naming the field and the value, and change nothing.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping

from shoal.scheduler.placement import (
    HostState,
    HostView,
    LearnerView,
    PlacementConfig,
    Plan,
    Retire,
    Start,
    _choose_retires,
    _choose_starts,
    _FreeIndex,
    plan,
)
from shoal.scheduler.policy import Allocation, JobDemand, admission_key, compute_shares

__all__ = ["IncrementalPlanner"]


class IncrementalPlanner:
    """Placement state kept between decisions, updated by events (see the module docstring)."""

    def __init__(
        self,
        config: PlacementConfig,
        jobs: Iterable[JobDemand] = (),
        inventory: Iterable[HostView] = (),
        current: Iterable[LearnerView] = (),
    ) -> None:
        self.config = config
        self.resync(jobs, inventory, current)

    # -- state --------------------------------------------------------------------------------

    def resync(
        self,
        jobs: Iterable[JobDemand],
        inventory: Iterable[HostView],
        current: Iterable[LearnerView],
        *,
        validated: bool = False,
    ) -> None:
        """Replace the whole state by the observed one (the safety net's resync), in bulk.
        ``validated``: the caller has just run ``plan()`` over this very input (the safety
        net does), so it is not run again here.

        Raises:
            ValueError: as ``plan()`` for the same input; the state is then unchanged.
        """
        jobs = list(jobs)
        inventory = list(inventory)
        current = list(current)
        # Validate exactly as the full cycle does before touching anything (plan raises the
        # same errors for the same input).
        if not validated:
            plan(jobs, inventory, current, self.config)
        self._jobs: dict[str, JobDemand] = {j.job_id: j for j in jobs}
        # The jobs in admission order and their sort keys, kept by the job events (a bisection
        # and a list insert or delete, instead of sorting every job at each decision).
        key = admission_key(self.config.policy)
        self._order: list[JobDemand] = sorted(self._jobs.values(), key=key)
        self._keys: list[tuple[int, int, str]] = [key(j) for j in self._order]
        self._hosts: dict[str, HostView] = {}
        self._live_devices: dict[str, frozenset[str]] = {}
        self._learners: dict[str, LearnerView] = {}
        self._seq: dict[str, int] = {}
        self._ids = itertools.count()
        self._on_host: dict[str, set[str]] = {}  # every learner naming the host, lost or not
        self._lost: set[str] = set()
        self._occupied: dict[str, dict[str, str]] = {}  # host -> device -> live learner
        self._held: dict[str, dict[str, LearnerView]] = {}  # job -> live, not retiring
        self._counts: dict[str, int] = {}  # job -> len(self._held[job]), for the policy
        self._free: dict[str, list[str]] = {}  # READY host -> free device ids
        self._cap: dict[str, int] = {}  # host -> its devices counted in the capacity
        self.capacity = 0
        for host in inventory:
            self._set_host(host)
        for learner in current:
            self._learners[learner.learner_id] = learner
            self._seq[learner.learner_id] = next(self._ids)
            self._on_host.setdefault(learner.host_id, set()).add(learner.learner_id)
            self._place(learner)
        for host_id in self._hosts:
            self._refresh(host_id)
        self._version = 0
        self._cached: tuple[int, float, Allocation] | None = None
        self._shares: Mapping[str, int] = {}
        self._off: set[str] = set(self._jobs) | set(self._held)
        self._dirty: set[str] = set()

    def jobs(self) -> list[JobDemand]:
        return list(self._jobs.values())

    def hosts(self) -> list[HostView]:
        return list(self._hosts.values())

    def learners(self) -> list[LearnerView]:
        """Every learner, in the order they were added (``plan()``'s ``current``)."""
        return list(self._learners.values())

    def differs_from(
        self,
        jobs: Iterable[JobDemand],
        inventory: Iterable[HostView],
        current: Iterable[LearnerView],
        *,
        keys: set[tuple[str, str, str, str, bool]] | None = None,
        by_id: Mapping[str, LearnerView] | None = None,
    ) -> list[str]:
        """What of the planner's input state differs from the given one (the safety net's
        check beside the decision): the job ids, host ids and learner ids that differ; ``[]``
        when the state is the same (the learners' order aside). ``keys``: ``current`` as
        (learner id, job id, host id, device id, retiring) tuples, if the caller has them;
        ``by_id``: ``current`` by learner id, if the caller has it (the learners are then
        compared as two dicts, not as two sets built of 80,000 tuples: the same answer, the
        ids being unique in both)."""
        out: list[str] = []
        wanted = {j.job_id: j for j in jobs}
        if wanted != self._jobs:
            out += sorted(
                j for j in wanted.keys() | self._jobs.keys() if wanted.get(j) != self._jobs.get(j)
            )
        hosts = {h.host_id: h for h in inventory}
        if hosts != self._hosts:
            out += sorted(
                f"host {h}"
                for h in hosts.keys() | self._hosts.keys()
                if hosts.get(h) != self._hosts.get(h)
            )
        if by_id is not None and by_id == self._learners:
            return out
        # A LearnerView is the tuple (learner id, job id, host id, device id, retiring).
        seen = keys if keys is not None else set(current)
        kept = set(self._learners.values())
        if seen != kept:
            out += sorted({f"learner {k[0]} of {k[1]}" for k in seen ^ kept})
        return out

    # -- job events ---------------------------------------------------------------------------

    def submit(self, job: JobDemand) -> None:
        """A job was submitted, or its demand changed (priority, min / max, last shrink)."""
        old = self._jobs.get(job.job_id)
        if old is not None:
            self._unorder(old)
        self._jobs[job.job_id] = job
        key = admission_key(self.config.policy)(job)
        i = bisect.bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._order.insert(i, job)
        self._touch(job.job_id)

    update_job = submit

    def remove_job(self, job_id: str) -> None:
        """A job finished or was cancelled: its learners that remain are retired."""
        if job_id not in self._jobs:
            raise ValueError(f"job_id ({job_id!r}) is not known")
        self._unorder(self._jobs.pop(job_id))
        self._touch(job_id)

    def _unorder(self, job: JobDemand) -> None:
        i = bisect.bisect_left(self._keys, admission_key(self.config.policy)(job))
        del self._keys[i]
        del self._order[i]

    # -- learner events -----------------------------------------------------------------------

    def add_learner(self, learner: LearnerView) -> None:
        """A learner was started (or its start decided: it holds its device from now on)."""
        lid = learner.learner_id
        if lid in self._learners:
            raise ValueError(f"learner_id ({lid!r}) is given more than once")
        self._check_free(learner)
        self._learners[lid] = learner
        self._seq[lid] = next(self._ids)
        self._on_host.setdefault(learner.host_id, set()).add(lid)
        self._place(learner)
        self._refresh(learner.host_id)
        self._touch(learner.job_id)

    def retire_learner(self, learner_id: str) -> None:
        """A learner was asked to retire: it keeps its device, no longer counts as held."""
        old = self._learner(learner_id)
        if old.retiring:
            return
        new = LearnerView(old.learner_id, old.job_id, old.host_id, old.device_id, True)
        self._unplace(old)
        self._learners[learner_id] = new
        self._place(new)
        self._touch(old.job_id)

    def remove_learner(self, learner_id: str) -> None:
        """A learner's exit was observed (or it was evicted): its device is free again."""
        old = self._learner(learner_id)
        self._unplace(old)
        del self._learners[learner_id]
        del self._seq[learner_id]
        self._on_host[old.host_id].discard(learner_id)
        self._refresh(old.host_id)
        self._touch(old.job_id)

    # -- host events --------------------------------------------------------------------------

    def put_host(self, host: HostView) -> None:
        """A host joined, or changed (state, devices, the ledger's allocations on it)."""
        if host.repeated is not None:
            raise ValueError(
                f"device_id ({host.repeated!r}) is given more than once on host {host.host_id}"
            )
        live = host.device_ids if host.state is not HostState.LOST else frozenset()
        seen: dict[str, str] = {}
        for lid in sorted(self._on_host.get(host.host_id, ()), key=self._seq.__getitem__):
            device = self._learners[lid].device_id
            if device in live:
                if device in seen:
                    raise ValueError(
                        f"device ({host.host_id}, {device}) is held by two learners: "
                        f"{seen[device]} and {lid}"
                    )
                seen[device] = lid
        self._rehost(host.host_id, host)

    def remove_host(self, host_id: str) -> None:
        """A host left the inventory: its learners are lost."""
        if host_id not in self._hosts:
            raise ValueError(f"host_id ({host_id!r}) is not known")
        self._rehost(host_id, None)

    # -- the decision -------------------------------------------------------------------------

    def decide(self, now: float = 0.0) -> Plan:
        """The decisions for the state as the events left it: equal to ``plan()`` over
        ``jobs()``, ``hosts()``, ``learners()`` (see the module docstring for the cost)."""
        allocation = self._allocation(now)
        shares = allocation.shares
        before = self._shares
        candidates = self._off | self._dirty
        if shares is not before:
            candidates.update(j for j, s in shares.items() if before.get(j) != s)
            candidates.update(j for j in before if j not in shares)
        self._shares = shares
        self._dirty = set()

        known = [self._jobs[j] for j in candidates if j in self._jobs]
        known.sort(key=admission_key(self.config.policy))
        unknown = sorted(j for j in candidates if j not in self._jobs)
        off: set[str] = set()
        retires: list[Retire] = []
        growing: list[JobDemand] = []
        for job in known:
            held = self._held.get(job.job_id)
            count = len(held) if held else 0
            share = shares.get(job.job_id, 0)
            if count != share:
                off.add(job.job_id)
            if held and count > share:
                excess = count - share
                chosen = _choose_retires(job.job_id, list(held.values()), excess, self._hosts)
                retires.extend(chosen)
            elif count < share:
                growing.append(job)
        for job_id in unknown:
            held = self._held.get(job_id)
            if held:
                off.add(job_id)
                retires.extend(_choose_retires(job_id, list(held.values()), len(held), self._hosts))
        starts: list[Start] = []
        if growing and self._free:
            index = _FreeIndex(self._free)
            for job in growing:
                if index.total == 0:
                    break
                held = self._held.get(job.job_id)
                mine = list(held.values()) if held else []
                starts.extend(
                    _choose_starts(job.job_id, mine, shares[job.job_id] - len(mine), index)
                )
        self._off = off
        return Plan(
            shares=shares,
            starts=tuple(starts),
            retires=tuple(retires),
            queue=allocation.queue,
            capacity=self.capacity,
            held=allocation.held,
            lost=tuple(sorted(self._lost, key=self._seq.__getitem__)),
        )

    # -- internals ----------------------------------------------------------------------------

    def _allocation(self, now: float) -> Allocation:
        cached = self._cached
        hold = self.config.hold_time
        if cached is not None and cached[0] == self._version:
            if cached[1] == now or not (self._hold_possible(cached[1]) or self._hold_possible(now)):
                return cached[2]
        allocation = compute_shares(
            self._order,
            self.capacity,
            self.config.policy,
            now=now,
            hold_time=hold,
            sticky_rounding=self.config.sticky_rounding,
            fair_fraction=self.config.fair_fraction,
            service_thresholds=self.config.service_thresholds,
            service_decay=self.config.service_decay,
            rescale_horizon=self.config.rescale_horizon,
            held=self._counts,
            ordered=True,
        )
        self._cached = (self._version, now, allocation)
        return allocation

    def _hold_possible(self, now: float) -> bool:
        """Whether a hold may apply at ``now`` (otherwise the shares do not depend on it)."""
        hold = self.config.hold_time
        if hold <= 0:
            return False
        return any(
            j.last_shrunk_at is not None and now - j.last_shrunk_at < hold
            for j in self._jobs.values()
        )

    def _touch(self, job_id: str) -> None:
        self._dirty.add(job_id)
        self._version += 1

    def _learner(self, learner_id: str) -> LearnerView:
        learner = self._learners.get(learner_id)
        if learner is None:
            raise ValueError(f"learner_id ({learner_id!r}) is not known")
        return learner

    def _check_free(self, learner: LearnerView) -> None:
        devices = self._live_devices.get(learner.host_id)
        if devices is None or learner.device_id not in devices:
            return  # lost from the start: it holds nothing
        other = self._occupied.get(learner.host_id, {}).get(learner.device_id)
        if other is not None:
            raise ValueError(
                f"device ({learner.host_id}, {learner.device_id}) is held by two learners: "
                f"{other} and {learner.learner_id}"
            )

    def _place(self, learner: LearnerView) -> None:
        lid = learner.learner_id
        devices = self._live_devices.get(learner.host_id)
        if devices is None or learner.device_id not in devices:
            self._lost.add(lid)
            return
        self._occupied.setdefault(learner.host_id, {})[learner.device_id] = lid
        if not learner.retiring:
            job_id = learner.job_id
            self._held.setdefault(job_id, {})[lid] = learner
            self._counts[job_id] = self._counts.get(job_id, 0) + 1

    def _unplace(self, learner: LearnerView) -> None:
        lid = learner.learner_id
        if lid in self._lost:
            self._lost.discard(lid)
            return
        on_host = self._occupied.get(learner.host_id)
        if on_host is not None and on_host.get(learner.device_id) == lid:
            del on_host[learner.device_id]
            if not on_host:
                del self._occupied[learner.host_id]
        job_id = learner.job_id
        held = self._held.get(job_id)
        if held is not None and held.pop(lid, None) is not None:
            if held:
                self._counts[job_id] -= 1
            else:
                del self._held[job_id]
                del self._counts[job_id]

    def _set_host(self, host: HostView) -> None:
        self._hosts[host.host_id] = host
        if host.state is HostState.LOST:
            self._live_devices.pop(host.host_id, None)
        else:
            self._live_devices[host.host_id] = host.device_ids

    def _rehost(self, host_id: str, host: HostView | None) -> None:
        """Swap a host's view, re-classifying the learners on it (lost or live)."""
        on_host = sorted(self._on_host.get(host_id, ()), key=self._seq.__getitem__)
        for lid in on_host:
            self._unplace(self._learners[lid])
        if host is None:
            del self._hosts[host_id]
            self._live_devices.pop(host_id, None)
        else:
            self._set_host(host)
        for lid in on_host:
            learner = self._learners[lid]
            self._place(learner)
            self._touch(learner.job_id)
        self._refresh(host_id)
        self._version += 1

    def _refresh(self, host_id: str) -> None:
        """Recompute the host's part of the capacity and its free devices."""
        self.capacity -= self._cap.pop(host_id, 0)
        self._free.pop(host_id, None)
        host = self._hosts.get(host_id)
        if host is None or host.state is HostState.LOST:
            return
        on_host = self._occupied.get(host_id, {})
        cap = len(on_host)
        if host.state is HostState.READY:
            ids = [d for d in host.unallocated if d not in on_host]
            if ids:
                cap += len(ids)
                self._free[host_id] = ids
        self._cap[host_id] = cap
        self.capacity += cap
