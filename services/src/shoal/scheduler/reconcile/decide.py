"""The cycle's observing and deciding, as pure functions: records in, decisions out.

Nothing here does I/O, reads a clock or changes its arguments; the loop
(:meth:`shoal.scheduler.reconcile.loop.Reconciler.cycle`) calls them in order and applies what
they return:

1. :func:`observe` -- every learner the jobs hold, against the inventory and the exits the
   agents reported: the learners placement must count (:class:`LearnerView`), and per job the
   exits to process, the lost learners to evict and the PENDING learners a dead worker left.
2. :func:`demands` -- the active jobs as the policy sees them; then the pure policy and
   placement (``shoal.scheduler.placement.plan``) decide shares, starts and retires.
3. :func:`targets` -- each active job's new target size and queue position.
4. :func:`decide` -- the work of each job (:class:`JobWork`): the plan's lost learners and
   retires, the saves, and each job's housekeeping (learners to stop, restart or retire from a
   draining host; a job to finish or to requeue).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shoal.scheduler.jobs import (
    ACTIVE_STATES,
    HOLDING,
    STARTED_STATES,
    JobRecord,
    LearnerPhase,
    LearnerRecord,
)
from shoal.scheduler.placement import LearnerView, Plan, Start
from shoal.scheduler.policy import JobDemand
from shoal.scheduler.reconcile.config import ReconcileConfig
from shoal.scheduler.reconcile.work import JobWork
from shoal.v1 import job_pb2 as S, resources_pb2

__all__ = [
    "Observed",
    "decide",
    "demand",
    "demands",
    "index",
    "job_of",
    "lost_reason",
    "observe",
    "starts_by_job",
    "targets",
]

#: Not a host incarnation (an int64): a host ``observe`` has not looked up yet.
_UNSEEN = -(2**64)

_PHASE = operator.attrgetter("phase")
_HOST = operator.attrgetter("host_id")
_ID = operator.itemgetter(0)

#: Job states in which every learner is stopped.
_STOPPING_STATES = frozenset({S.JOB_STATE_CANCELLING, S.JOB_STATE_CANCELLED, S.JOB_STATE_FAILED})
#: Active job states whose RUNNING learners need no housekeeping (on hosts not draining).
_QUIET_STATES = ACTIVE_STATES - _STOPPING_STATES - {S.JOB_STATE_COMPLETED}


@dataclass
class Observed:
    """What :func:`observe` saw: the learners that hold (or are about to hold) a device, and
    per job the exits, the lost learners and the PENDING learners to drop."""

    current: list[LearnerView] = field(default_factory=list)
    work: dict[str, JobWork] = field(default_factory=dict)
    by_id: dict[str, LearnerView] | None = None
    """``current`` by learner id (:func:`index`), when :func:`observe` was asked for it."""
    groups: dict[str, tuple[LearnerView, ...]] | None = None
    """job id -> its learners in ``current`` (together there, in that order), for each job
    with any, when :func:`observe` was given a ``cache``."""
    calm: dict[str, tuple[str, ...]] | None = None
    """job id -> the ids of the hosts its learners are on, for each job with learners, every
    one of them RUNNING and none with observed work (exit, lost, dropped), when
    :func:`observe` was given a ``cache`` (what :func:`decide`'s housekeeping reads)."""


_Row = tuple[str, str, str, LearnerPhase, int]
"""(learner id, host id, device id, phase, host incarnation): a learner as observe reads it."""

ObserveCache = dict[
    str,
    tuple[
        list[_Row],
        tuple[LearnerView, ...],
        frozenset[tuple[str, int]],
        tuple[str, ...],
        tuple[str, ...] | None,
        frozenset[str],
    ],
]
"""job id -> (its learners' fields as :func:`observe` last read them, the views it made of
them, the (host id, host incarnation) pairs they were on, their learner ids, their hosts if
every one is RUNNING else None, their hosts), for the jobs that gave no work and had no
PENDING learner. After a call it holds exactly that call's such jobs, as read in that call
(``Observing`` takes their hosts and phases from it)."""


def lost_reason(lr: LearnerRecord, host: resources_pb2.Host | None) -> str:
    """Why a learner is lost (its host is gone, lost, or restarted since it started), or
    ``""`` when it is not."""
    if host is None:
        return f"host {lr.host_id} is not in the inventory"
    if host.state == resources_pb2.HOST_STATE_LOST:
        return f"host {lr.host_id} lost"
    if lr.host_incarnation and host.incarnation > lr.host_incarnation:
        return (
            f"host {lr.host_id} restarted (incarnation {lr.host_incarnation} -> {host.incarnation})"
        )
    return ""


def observe(
    records: Mapping[str, JobRecord],
    hosts: Mapping[str, resources_pb2.Host],
    exits: Mapping[str, resources_pb2.Learner],
    busy: Collection[str],
    *,
    cache: ObserveCache | None = None,
    index: bool = False,
) -> Observed:
    """Step 1: every learner of every job, as placement must count it. A PENDING learner of a
    job whose worker is not running (``busy``: the job ids with a worker) was left by a worker
    that failed: it is dropped; one of a busy job holds its device. A learner whose exit an
    agent reported (``exits``, by learner id) is processed and still counts, as leaving; a
    learner on a lost (or restarted) host is lost and does not count.

    ``cache`` (the caller's, kept between calls; left holding this call's entries): every
    learner's fields are read on every call, job by job, as a list of (learner id, host id,
    device id, phase, host incarnation); a job whose list equals the one the cache kept for it
    (the same values: the fields are immutable strings, ints and enum members), none of whose
    learners has a reported exit and whose hosts are still live at the same incarnations gets
    the views and the (empty) work the cache kept -- the values this function would compute
    again from the same inputs (a job that had work or a PENDING learner is never kept). With
    ``cache``, ``Observed.groups`` and ``Observed.calm`` are filled; with ``index``,
    ``Observed.by_id``."""
    seen = Observed()
    groups: dict[str, tuple[LearnerView, ...]] | None = None
    calm: dict[str, tuple[str, ...]] = {}
    fresh: ObserveCache = {}
    if cache is not None:
        groups = seen.groups = {}
        seen.calm = calm
    work = seen.work

    def w(job_id: str) -> JobWork:
        jw = work.get(job_id)
        if jw is None:
            jw = work[job_id] = JobWork()
        return jw

    current = seen.current
    add = current.append
    view = tuple.__new__  # LearnerView is a named tuple: built without its Python __new__
    pending, retiring, stopping = LearnerPhase.PENDING, LearnerPhase.RETIRING, LearnerPhase.STOPPING
    running = LearnerPhase.RUNNING
    lost_state = resources_pb2.HOST_STATE_LOST
    exit_of = exits.get if exits else None
    exit_ids = exits.keys()
    # host id -> its incarnation, None if it is gone or lost: each host's protobuf read once
    # per call, not once per learner on it.
    live: dict[str, int | None] = {}
    ok: set[tuple[str, int]] | None = None
    last_host, incarnation = None, None
    for record in records.values():
        learners = record.learners
        if not learners:
            continue
        job_id = record.job_id
        rows: list[_Row] | None = None
        if cache is not None:
            rows = [
                (lr.learner_id, lr.host_id, lr.device_id, lr.phase, lr.host_incarnation)
                for lr in learners.values()
            ]
            hit = cache.get(job_id)
            if (
                hit is not None
                and hit[0] == rows
                and (exit_of is None or exit_ids.isdisjoint(hit[3]))
            ):
                if ok is None:
                    # (host id, incarnation) of every live host: a learner on one, started on
                    # that incarnation, is not lost (each host's protobuf read once per call).
                    ok = {
                        (host_id, host.incarnation)
                        for host_id, host in hosts.items()
                        if host.state != lost_state
                    }
                taken = ok.issuperset(hit[2])
                if not taken:
                    for host_id, started in hit[2]:  # the check learner by learner, per host
                        now_at = live.get(host_id, _UNSEEN)
                        if now_at == _UNSEEN:
                            host = hosts.get(host_id)
                            now_at = (
                                None
                                if host is None or host.state == lost_state
                                else host.incarnation
                            )
                            live[host_id] = now_at
                        if now_at is None or (started and now_at > started):
                            break  # a learner lost: observed below, learner by learner
                    else:
                        taken = True  # (none lost: a host without an incarnation, say)
                if taken:
                    views = hit[1]
                    fresh[job_id] = hit
                    if views:
                        current.extend(views)
                        groups[job_id] = views  # type: ignore[index]
                    if hit[4] is not None:
                        calm[job_id] = hit[4]
                    continue
        start = len(current)
        job_busy = job_id in busy
        had_pending = False
        for lr in learners.values():
            phase = lr.phase
            if phase is pending:
                had_pending = True
                if not job_busy:
                    w(job_id).drop_pending.append(lr.learner_id)
                    continue
                add(view(LearnerView, (lr.learner_id, job_id, lr.host_id, lr.device_id, False)))
                continue
            if exit_of is not None:
                exit_ = exit_of(lr.learner_id)
                if exit_ is not None:
                    w(job_id).exits.append(exit_)
                    add(view(LearnerView, (lr.learner_id, job_id, lr.host_id, lr.device_id, True)))
                    continue
            host_id = lr.host_id
            if host_id != last_host:  # a job's learners are mostly on few hosts, together
                last_host = host_id
                incarnation = live.get(host_id, _UNSEEN)
                if incarnation == _UNSEEN:
                    host = hosts.get(host_id)
                    incarnation = (
                        None if host is None or host.state == lost_state else host.incarnation
                    )
                    live[host_id] = incarnation
            # The common case inline (a live host, the incarnation the learner started on);
            # lost_reason says why otherwise.
            if incarnation is None or (lr.host_incarnation and incarnation > lr.host_incarnation):
                w(job_id).lost.append((lr.learner_id, lost_reason(lr, hosts.get(host_id))))
                continue
            leaving = phase is retiring or phase is stopping
            add(view(LearnerView, (lr.learner_id, job_id, host_id, lr.device_id, leaving)))
        if rows is None:
            continue
        views = () if len(current) == start else tuple(current[start:])
        if views:
            groups[job_id] = views  # type: ignore[index]
        if not had_pending and job_id not in work:
            # (A frozenset: the check against the live hosts' pairs uses the hashes it keeps.)
            where = frozenset([(row[1], row[4]) for row in rows])
            on: tuple[str, ...] | None = None
            if [row[3] for row in rows].count(running) == len(rows):
                on = tuple(dict.fromkeys([row[1] for row in rows]))
                calm[job_id] = on
            fresh[job_id] = (
                rows,
                views,
                where,
                tuple([row[0] for row in rows]),
                on,
                frozenset([row[1] for row in rows]),
            )
    if cache is not None:
        cache.clear()
        cache.update(fresh)
    if index:
        seen.by_id = dict(zip(map(_ID, current), current, strict=True))
    return seen


def index(current: Iterable[LearnerView]) -> dict[str, LearnerView]:
    """Learner id -> view (``Observed.by_id``)."""
    return {view[0]: view for view in current}


def demand(r: JobRecord) -> JobDemand:
    """One job as the share policy sees it (every field it reads is in :func:`demands`'
    cache key: keep them in step)."""
    spec = r.job.spec
    return JobDemand(
        job_id=r.job_id,
        priority=spec.priority,
        submit_seq=r.submit_seq,
        min_workers=spec.min_workers,
        max_workers=spec.max_workers,
        last_shrunk_at=r.last_shrunk_at,
        previous_priority=r.decided_priority,
    )


DemandCache = dict[str, tuple[tuple[object, ...], JobDemand]]
"""job id -> (what its demand was built from, the demand): see :func:`demands`."""


def demands(records: Mapping[str, JobRecord], cache: DemandCache | None = None) -> list[JobDemand]:
    """Step 2: the active jobs, as the share policy sees them.

    ``cache`` (the loop's, kept between cycles): a job whose fields are those its cached
    demand was built from gets that demand again (a ``JobDemand`` is immutable: the same
    value), not a new one validated again; the cache is left holding the active jobs only."""
    if cache is None:
        return [demand(r) for r in records.values() if r.active]
    out: list[JobDemand] = []
    fresh: DemandCache = {}
    for r in records.values():
        job = r.job
        if job.state not in ACTIVE_STATES:
            continue
        spec = job.spec
        key = (
            spec.priority,
            r.submit_seq,
            spec.min_workers,
            spec.max_workers,
            r.last_shrunk_at,
            r.decided_priority,
        )
        job_id = job.job_id
        hit = cache.get(job_id)
        d = hit[1] if hit is not None and hit[0] == key else demand(r)
        fresh[job_id] = (key, d)
        out.append(d)
    cache.clear()
    cache.update(fresh)
    return out


def targets(records: Mapping[str, JobRecord], decided: Plan) -> dict[str, tuple[int, int]]:
    """Step 3: job id -> (target workers, queue position) of every active job. The position
    is 1-based in the plan's queue for a QUEUED job, 0 otherwise."""
    queue_pos = {job_id: i + 1 for i, job_id in enumerate(decided.queue)}
    share_of = decided.shares.get
    queued = S.JOB_STATE_QUEUED
    out: dict[str, tuple[int, int]] = {}
    for record in records.values():
        job = record.job  # (each field of the protobuf read once)
        state = job.state
        if state not in ACTIVE_STATES:
            continue
        job_id = job.job_id
        out[job_id] = (share_of(job_id, 0), queue_pos.get(job_id, 0) if state == queued else 0)
    return out


def starts_by_job(decided: Plan) -> dict[str, list[Start]]:
    """The plan's starts, grouped by job (in the plan's order)."""
    out: dict[str, list[Start]] = {}
    for start in decided.starts:
        out.setdefault(start.job_id, []).append(start)
    return out


def job_of(records: Mapping[str, JobRecord], learner_id: str) -> str | None:
    """The job that holds ``learner_id``, if any."""
    for record in records.values():
        if learner_id in record.learners:
            return record.job_id
    return None


def _copy(work: JobWork) -> JobWork:
    return JobWork(
        exits=list(work.exits),
        lost=list(work.lost),
        drop_pending=list(work.drop_pending),
        retires=list(work.retires),
        stops=list(work.stops),
        starts=list(work.starts),
        restarts=list(work.restarts),
        finish=work.finish,
        requeue=work.requeue,
        save=work.save,
        retry=work.retry,
    )


def decide(
    records: Mapping[str, JobRecord],
    hosts: Mapping[str, resources_pb2.Host],
    observed: Observed,
    decided: Plan,
    config: ReconcileConfig,
    *,
    changed: Iterable[str] = (),
    moved: Collection[str] = (),
    held: Collection[str] = (),
    now: float,
) -> dict[str, JobWork]:
    """Step 4: the work of each job, in the order the jobs get it (the observed work first).

    ``changed``: jobs whose target or queue position changed (saved); ``moved``: jobs whose
    coordinator moved (saved, with the new address); ``held``: jobs whose coordinator is
    unreachable (not requeued while their learners wait for it). The timeouts are the
    config's: a COMPLETED job's learners are stopped after ``finish_grace_s``, a RETIRING
    learner after ``retire_timeout_s``, a STOPPING one is stopped again after twice
    ``stop_grace_s`` plus ``call_timeout_s``."""
    work = {job_id: _copy(jw) for job_id, jw in observed.work.items()}

    def w(job_id: str) -> JobWork:
        return work.setdefault(job_id, JobWork())

    for learner_id in decided.lost:
        job_id = job_of(records, learner_id)
        if job_id is not None:
            w(job_id).lost.append((learner_id, "its device is no longer in the inventory"))
    changed = set(changed)
    if changed:
        for record in records.values():
            if record.active and record.job_id in changed:
                w(record.job_id).save = True
    for retire in decided.retires:
        # Learners of jobs that are not active are stopped below, not retired.
        owner = records.get(retire.job_id)
        chosen = owner.learners.get(retire.learner_id) if owner is not None else None
        if owner is not None and owner.active and chosen is not None and chosen.phase in HOLDING:
            w(retire.job_id).retires.append(retire.learner_id)
    starts = starts_by_job(decided)
    draining: dict[str, bool] = {}  # host id -> draining, each host's protobuf read once
    calm = observed.calm or {}
    drains: set[str] | None = None  # the draining hosts (read when a calm job comes)

    for record in records.values():
        job_id = record.job_id
        jw = work.get(job_id)
        if jw is None:
            on = calm.get(job_id)
            if on is not None and record.job.state in _QUIET_STATES:
                # The common case (what _housekeeping's first check finds, from what observe
                # read of the learners in this cycle): every learner RUNNING, an active job,
                # no host of it draining; then nothing to do but a move's save.
                if drains is None:
                    drains = {h for h, host in hosts.items() if host.draining}
                if drains.isdisjoint(on):
                    if job_id in moved:
                        w(job_id).save = True  # (no RETIRING learner to retire again)
                    continue
            remaining = list(record.learners.values())
        else:
            gone = {lid for lid, _ in jw.lost} | {e.learner_id for e in jw.exits}
            remaining = [lr for lr in record.learners.values() if lr.learner_id not in gone]
        for kind, lid in _housekeeping(record, remaining, hosts, draining, work, config, now):
            getattr(w(job_id), kind).append(lid)
        if job_id in moved:
            w(job_id).save = True  # its coordinator moved: persist the new address
            # A retire told to the old coordinator may be gone with it: tell the new one too
            # (RetireLearners is idempotent), or the learner would train on until the retire
            # timeout stops it, holding its device.
            again = [
                lr.learner_id
                for lr in remaining
                if lr.phase is LearnerPhase.RETIRING and lr.learner_id not in w(job_id).retires
            ]
            w(job_id).retires.extend(again)
        if remaining:  # a learner live or PENDING: nothing to finish or requeue
            continue
        if not record.active:
            if record.state == S.JOB_STATE_CANCELLING or (record.opened and not record.closed):
                w(job_id).finish = True
        if record.state in STARTED_STATES and not starts.get(job_id) and job_id not in held:
            w(job_id).requeue = True
    return work


def _housekeeping(
    record: JobRecord,
    remaining: Sequence[LearnerRecord],
    hosts: Mapping[str, resources_pb2.Host],
    draining: dict[str, bool],
    work: Mapping[str, JobWork],
    config: ReconcileConfig,
    now: float,
) -> list[tuple[str, str]]:
    """(``"stops"`` | ``"restarts"`` | ``"retires"``, learner id) for each learner of the job
    whose phase, age or host asks for it."""
    out: list[tuple[str, str]] = []
    state = record.state
    stopping_now = state in _STOPPING_STATES
    completed = state == S.JOB_STATE_COMPLETED
    if not stopping_now and not completed and state in ACTIVE_STATES:
        # The common case first: an active job's RUNNING learners on hosts not draining need
        # nothing (the loop below would find the same, learner by learner).
        # (In C: the phases listed and counted by identity, the hosts put in a set.)
        if list(map(_PHASE, remaining)).count(LearnerPhase.RUNNING) == len(remaining):
            for host_id in set(map(_HOST, remaining)):
                drains = draining.get(host_id)
                if drains is None:
                    host = hosts.get(host_id)
                    drains = draining[host_id] = host is not None and host.draining
                if drains:
                    break
            else:
                return out
    retiring = list(work[record.job_id].retires) if record.job_id in work else []
    for lr in remaining:
        age = now - lr.phase_since
        if lr.phase is LearnerPhase.PENDING:
            continue
        if stopping_now and lr.phase is not LearnerPhase.STOPPING:
            out.append(("stops", lr.learner_id))
        elif completed and lr.phase is not LearnerPhase.STOPPING:
            if age >= config.finish_grace_s:
                out.append(("stops", lr.learner_id))
        elif lr.phase is LearnerPhase.RETIRING:
            if age >= config.retire_timeout_s:
                out.append(("stops", lr.learner_id))
        elif lr.phase is LearnerPhase.STOPPING:
            if age >= 2 * config.stop_grace_s + config.call_timeout_s:
                out.append(("stops", lr.learner_id))
        elif lr.phase is LearnerPhase.STARTING and record.active:
            out.append(("restarts", lr.learner_id))
        elif lr.phase in HOLDING and record.active:
            host = hosts.get(lr.host_id)
            if host is not None and host.draining and lr.learner_id not in retiring:
                out.append(("retires", lr.learner_id))
                retiring.append(lr.learner_id)
    return out
