"""Trace replay: drive ``plan`` over timed events and record the allocation over time.

The simulator plays the reconcile loop with ideal actors: a started learner runs at once, a
retired learner exits at once (its device is free for the next round), a lost host's learners
vanish. After the events of each instant it runs plan / apply rounds until a plan has no
decisions, then records a ``Sample``: the learners each job holds. The timeline is the step
chart of the reference scenario ("GPUs per job over time").
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from shoal.scheduler.placement import (
    HostState,
    HostView,
    LearnerView,
    PlacementConfig,
    Plan,
    plan,
)
from shoal.scheduler.policy import JobDemand

__all__ = [
    "Event",
    "Finish",
    "HostDown",
    "HostUp",
    "Sample",
    "SetPriority",
    "SimulationResult",
    "Simulator",
    "Submit",
    "simulate",
]


@dataclass(frozen=True, slots=True)
class Submit:
    """Job ``job`` is submitted at ``at`` (its ``current`` and ``last_shrunk_at`` are ignored)."""

    at: float
    job: JobDemand


@dataclass(frozen=True, slots=True)
class Finish:
    """Job ``job_id`` finishes (or is cancelled) at ``at``; its learners exit."""

    at: float
    job_id: str


@dataclass(frozen=True, slots=True)
class SetPriority:
    """The priority of job ``job_id`` becomes ``priority`` at ``at``."""

    at: float
    job_id: str
    priority: int


@dataclass(frozen=True, slots=True)
class HostDown:
    """Host ``host_id`` is lost at ``at``; its learners are gone."""

    at: float
    host_id: str


@dataclass(frozen=True, slots=True)
class HostUp:
    """Host ``host_id`` is ready again at ``at``, with all its devices free."""

    at: float
    host_id: str


Event = Submit | Finish | SetPriority | HostDown | HostUp


@dataclass(frozen=True, slots=True)
class Sample:
    """The allocation once the decisions at ``at`` have settled."""

    at: float
    workers: Mapping[str, int]
    """Learners held per running job (jobs holding none are left out)."""
    queue: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """The timeline and how much work it took."""

    timeline: tuple[Sample, ...]
    rounds: int
    starts: int
    retires: int

    def series(self, job_id: str) -> list[tuple[float, int]]:
        """(time, workers) of one job, one point per sample: the step chart of that job."""
        return [(s.at, s.workers.get(job_id, 0)) for s in self.timeline]


@dataclass
class Simulator:
    """Mutable simulation state; ``step`` applies events, ``settle`` runs the loop."""

    hosts: dict[str, HostView]
    config: PlacementConfig
    jobs: dict[str, JobDemand] = field(default_factory=dict)
    learners: dict[str, LearnerView] = field(default_factory=dict)
    rounds: int = 0
    starts: int = 0
    retires: int = 0
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def apply_event(self, event: Event) -> None:
        """Change the observed state as ``event`` says."""
        if isinstance(event, Submit):
            self.jobs[event.job.job_id] = replace(event.job, current=0, last_shrunk_at=None)
        elif isinstance(event, Finish):
            self.jobs.pop(event.job_id, None)
            self._drop(lambda x: x.job_id == event.job_id)
        elif isinstance(event, SetPriority):
            self.jobs[event.job_id] = replace(self.jobs[event.job_id], priority=event.priority)
        elif isinstance(event, HostDown):
            self.hosts[event.host_id] = replace(self.hosts[event.host_id], state=HostState.LOST)
            self._drop(lambda x: x.host_id == event.host_id)
        else:
            self.hosts[event.host_id] = replace(self.hosts[event.host_id], state=HostState.READY)

    def _drop(self, gone: Callable[[LearnerView], bool]) -> None:
        self.learners = {k: v for k, v in self.learners.items() if not gone(v)}

    def cycle(self, now: float) -> Plan:
        """One plan over the current state, its decisions applied by ideal actors."""
        result = plan(
            list(self.jobs.values()),
            list(self.hosts.values()),
            list(self.learners.values()),
            self.config,
            now=now,
        )
        self.rounds += 1
        for retire in result.retires:
            self.learners.pop(retire.learner_id)  # exits at its next boundary, at once here
            job = self.jobs.get(retire.job_id)
            if job is not None:
                self.jobs[retire.job_id] = replace(job, last_shrunk_at=now)
        for start in result.starts:
            learner_id = f"{start.job_id}/l{next(self._ids)}"
            self.learners[learner_id] = LearnerView(
                learner_id, start.job_id, start.host_id, start.device_id
            )
        self.starts += len(result.starts)
        self.retires += len(result.retires)
        return result

    def settle(self, now: float, max_rounds: int = 100) -> Sample:
        """Cycle until a plan has no decisions (bounded) and sample the allocation."""
        for _ in range(max_rounds):
            result = self.cycle(now)
            if not result.decisions:
                break
        else:
            raise RuntimeError(f"no fixed point after max_rounds ({max_rounds}) at {now}")
        workers = Counter(x.job_id for x in self.learners.values())
        return Sample(now, dict(sorted(workers.items())), result.queue)


def simulate(
    hosts: Sequence[HostView],
    events: Sequence[Event],
    config: PlacementConfig,
    *,
    incremental: bool = False,
) -> SimulationResult:
    """Replay ``events`` (stably sorted by time) and sample after each instant.

    ``incremental``: every event and every acted-on decision goes to an
    ``IncrementalPlanner`` and each round is its ``decide`` instead of a full ``plan``: the
    same result (the planner's decisions equal plan's), at the cost of what changed."""
    if incremental:
        return _simulate_incremental(hosts, events, config)
    sim = Simulator({h.host_id: h for h in hosts}, config)
    timeline: list[Sample] = []
    ordered = sorted(events, key=lambda e: e.at)
    for at, group in itertools.groupby(ordered, key=lambda e: e.at):
        for event in group:
            sim.apply_event(event)
        timeline.append(sim.settle(at))
    return SimulationResult(tuple(timeline), sim.rounds, sim.starts, sim.retires)


def _simulate_incremental(
    hosts: Sequence[HostView], events: Sequence[Event], config: PlacementConfig
) -> SimulationResult:
    """``simulate`` through an ``IncrementalPlanner`` (same semantics as ``Simulator``)."""
    from shoal.scheduler.incremental import IncrementalPlanner

    views = {h.host_id: h for h in hosts}
    planner = IncrementalPlanner(config, inventory=views.values())
    jobs: dict[str, JobDemand] = {}
    by_job: dict[str, dict[str, LearnerView]] = {}
    by_host: dict[str, set[str]] = {}
    ids = itertools.count()
    rounds = starts = retires = 0
    timeline: list[Sample] = []

    def drop(learner_id: str) -> None:
        learner = by_job[job_of[learner_id]].pop(learner_id)
        by_host[learner.host_id].discard(learner_id)
        del job_of[learner_id]
        planner.remove_learner(learner_id)

    job_of: dict[str, str] = {}
    ordered = sorted(events, key=lambda e: e.at)
    for at, group in itertools.groupby(ordered, key=lambda e: e.at):
        for event in group:
            if isinstance(event, Submit):
                job = replace(event.job, current=0, last_shrunk_at=None)
                jobs[job.job_id] = job
                planner.submit(job)
            elif isinstance(event, Finish):
                if jobs.pop(event.job_id, None) is not None:
                    planner.remove_job(event.job_id)
                for learner_id in list(by_job.get(event.job_id, ())):
                    drop(learner_id)
            elif isinstance(event, SetPriority):
                jobs[event.job_id] = replace(jobs[event.job_id], priority=event.priority)
                planner.update_job(jobs[event.job_id])
            elif isinstance(event, HostDown):
                views[event.host_id] = replace(views[event.host_id], state=HostState.LOST)
                for learner_id in sorted(by_host.get(event.host_id, ())):
                    drop(learner_id)
                planner.put_host(views[event.host_id])
            else:
                views[event.host_id] = replace(views[event.host_id], state=HostState.READY)
                planner.put_host(views[event.host_id])
        for _ in range(100):
            result = planner.decide(at)
            rounds += 1
            for retire in result.retires:
                drop(retire.learner_id)  # exits at its next boundary, at once here
                job = jobs.get(retire.job_id)
                if job is not None:
                    jobs[retire.job_id] = replace(job, last_shrunk_at=at)
                    planner.update_job(jobs[retire.job_id])
            for start in result.starts:
                learner_id = f"{start.job_id}/l{next(ids)}"
                learner = LearnerView(learner_id, start.job_id, start.host_id, start.device_id)
                by_job.setdefault(start.job_id, {})[learner_id] = learner
                by_host.setdefault(start.host_id, set()).add(learner_id)
                job_of[learner_id] = start.job_id
                planner.add_learner(learner)
            starts += len(result.starts)
            retires += len(result.retires)
            if not result.decisions:
                break
        else:
            raise RuntimeError(f"no fixed point after max_rounds (100) at {at}")
        workers = {j: len(held) for j, held in sorted(by_job.items()) if held}
        timeline.append(Sample(at, workers, result.queue))
    return SimulationResult(tuple(timeline), rounds, starts, retires)
