"""The observed view of the reconcile loop, kept between cycles and updated per job.

``decide.observe`` looks at every learner of every job (80,000 at 10,000 hosts x 8 GPUs).
:class:`Observing` keeps what it saw per job -- the learners placement counts (as tuples, see
``placing.py``), the observed work (exits, lost learners, PENDING ones to drop) -- with an
index of the jobs on each host, and after an event observes again only the jobs that may have
changed:

* the jobs whose record was created, written or reloaded since the last cycle (the job table's
  dirty set: every write changes the record's etcd revision and marks it; the loop marks the
  jobs it changes in memory, and a job whose worker ended);
* the jobs whose learners' exits came or went (``exits``), every job with a worker and one
  whose worker ended (``busy``: a worker changes its record in memory between its writes, a
  learner's phase set before the save that marks the job), and the jobs with learners on a
  host the inventory says changed.

A change that bypasses all of these (a record mutated in memory, never written nor marked) is
not seen by :meth:`update`: the loop's periodic full cycle calls :meth:`full`, which observes
every record from scratch, compares it with the kept view, logs the jobs that differ (once per
such cycle; ``divergences`` counts them) and keeps the fresh view. From scratch: every learner
is read; what ``decide.observe`` derived from a job is reused only when the values it reads
now are those it read then (its cache), never because no event named the job.
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Collection, Iterable, Mapping

from shoal.scheduler.jobs import JobRecord, LearnerPhase
from shoal.scheduler.placement import LearnerView
from shoal.scheduler.reconcile import decide
from shoal.scheduler.reconcile.work import JobWork
from shoal.v1 import job_pb2 as S, resources_pb2

__all__ = ["LearnerKey", "Observing", "needs_attention"]

log = logging.getLogger(__name__)

LearnerKey = tuple[str, str, str, str, bool]
"""(learner id, job id, host id, device id, retiring): a learner as placement counts it."""

_PHASE = operator.attrgetter("phase")
_HOST = operator.attrgetter("host_id")

#: Job states whose learners need no timer: RUNNING / QUEUED jobs with every learner RUNNING.
_QUIET_STATES = frozenset({S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING})


def needs_attention(record: JobRecord) -> bool:
    """Whether the loop must look at the job every cycle, not only when it changes: a
    learner that is not RUNNING (a timeout, a restart or a PENDING one may be due), or a job
    neither QUEUED nor RUNNING that still has learners (a grace to wait out, learners to
    stop), is CANCELLING, or has a data plane to close. A finished job with nothing left does
    not (they stay in the table forever)."""
    learners = record.learners
    # (In C: the phases listed and counted by identity.)
    if list(map(_PHASE, learners.values())).count(LearnerPhase.RUNNING) != len(learners):
        return True
    if record.job.state in _QUIET_STATES:
        return False
    return (
        bool(record.learners)
        or record.job.state == S.JOB_STATE_CANCELLING
        or (record.opened and not record.closed)
    )


class Observing:
    """The per-job observed view (see the module docstring). :meth:`reset` on a new term."""

    def __init__(self) -> None:
        # What the last full observation read and made of each job (decide.observe's cache:
        # every learner is still read on every full observation; kept across terms, checked
        # by value).
        self._seen: decide.ObserveCache = {}
        self.reset()
        self.divergences = 0  # full cycles whose fresh view differed from the kept one
        self.last_divergence: list[str] = []

    def reset(self) -> None:
        self.learners: dict[str, tuple[LearnerView, ...]] = {}  # job -> its counted learners
        self.work: dict[str, JobWork] = {}  # job -> its observed work (non-empty only)
        self.attention: set[str] = set()  # jobs to look at every cycle (needs_attention)
        self._on_host: dict[str, set[str]] = {}  # host -> jobs with a learner on it
        self._hosts_of: dict[str, frozenset[str]] = {}  # job -> the hosts of its learners
        self._learner_job: dict[str, str] = {}  # learner id -> job (every learner of a record)
        self._ids_of: dict[str, tuple[str, ...]] = {}  # job -> its learner ids
        self._busy: frozenset[str] = frozenset()
        self._exits: frozenset[str] = frozenset()
        self.synced = False
        # The views of the last full observation, by learner id (the next one reuses them;
        # the planner's check compares them with its own).
        self.views: dict[str, LearnerView] = {}

    def job_of(self, learner_id: str) -> str | None:
        """The job that held ``learner_id`` when its record was last observed."""
        return self._learner_job.get(learner_id)

    def __contains__(self, learner_id: object) -> bool:
        """Whether a job's record held ``learner_id`` when last observed."""
        return learner_id in self._learner_job

    def current(self) -> list[LearnerView]:
        """Every counted learner, as ``decide.observe`` gives them (``Observed.current``)."""
        return list(itertools.chain.from_iterable(self.learners.values()))

    # -- one job ------------------------------------------------------------------------------

    def _forget(self, job_id: str) -> None:
        for lid in self._ids_of.pop(job_id, ()):
            self._learner_job.pop(lid, None)
        for host_id in self._hosts_of.pop(job_id, ()):
            jobs = self._on_host.get(host_id)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._on_host[host_id]
        self.learners.pop(job_id, None)
        self.work.pop(job_id, None)
        self.attention.discard(job_id)

    def _index(self, record: JobRecord) -> None:
        """The job's host index, learner ids and attention (not its observation)."""
        job_id = record.job_id
        if needs_attention(record):
            self.attention.add(job_id)
        if not record.learners:
            return
        ids = tuple(record.learners)
        self._ids_of[job_id] = ids
        self._learner_job.update(dict.fromkeys(ids, job_id))
        on = frozenset(map(_HOST, record.learners.values()))
        self._hosts_of[job_id] = on
        for host_id in on:
            self._on_host.setdefault(host_id, set()).add(job_id)

    def _index_all(self, records: Mapping[str, JobRecord]) -> None:
        """:meth:`_index` of every record (after :meth:`reset`), inline: the same index."""
        attention, ids_of, hosts_of = self.attention, self._ids_of, self._hosts_of
        on_host, learner_job = self._on_host, self._learner_job
        running = LearnerPhase.RUNNING
        for record in records.values():
            learners = record.learners
            if not learners:
                if needs_attention(record):
                    attention.add(record.job_id)
                continue
            job = record.job
            job_id = job.job_id
            values = learners.values()
            # needs_attention, for a job with learners: one not RUNNING, or a state that is
            # neither QUEUED nor RUNNING.
            if (
                list(map(_PHASE, values)).count(running) != len(learners)
                or job.state not in _QUIET_STATES
            ):
                attention.add(job_id)
            ids = tuple(learners)
            ids_of[job_id] = ids
            learner_job.update(dict.fromkeys(ids, job_id))
            on = frozenset(map(_HOST, values))
            hosts_of[job_id] = on
            for host_id in on:
                jobs = on_host.get(host_id)
                if jobs is None:
                    on_host[host_id] = {job_id}
                else:
                    jobs.add(job_id)

    def _reindex_all(self, records: Mapping[str, JobRecord]) -> bool:
        """:meth:`_index_all`'s index of every record, made by updating the kept one (after
        :meth:`reset` but for the host index, learner ids and hosts): every record's learner
        ids and hosts are read as they are now and compared with the kept ones; only the
        entries that differ are changed, those of the jobs gone or without learners dropped.
        The hosts and phases of a job this cycle's observation kept (``decide.observe``'s
        cache, refreshed by it just before: read in this cycle) are taken from it. The same
        index as a rebuild, unless a learner id is held by two jobs: False then (the caller
        rebuilds)."""
        attention, ids_of, hosts_of = self.attention, self._ids_of, self._hosts_of
        on_host, learner_job = self._on_host, self._learner_job
        running = LearnerPhase.RUNNING
        seen = self._seen  # what this cycle's observation read of the jobs it kept
        indexed: set[str] = set()
        count = 0
        for record in records.values():
            learners = record.learners
            if not learners:
                if needs_attention(record):
                    attention.add(record.job_id)
                continue
            job = record.job
            job_id = job.job_id
            values = learners.values()
            entry = seen.get(job_id)
            if entry is not None:  # its hosts, and whether every learner is RUNNING, as read
                on = entry[5]
                if entry[4] is None or job.state not in _QUIET_STATES:
                    attention.add(job_id)
            else:
                on = frozenset(map(_HOST, values))
                if (
                    list(map(_PHASE, values)).count(running) != len(learners)
                    or job.state not in _QUIET_STATES
                ):
                    attention.add(job_id)
            indexed.add(job_id)
            ids = tuple(learners)
            count += len(ids)
            old_ids = ids_of.get(job_id)
            if old_ids != ids:
                for lid in old_ids or ():
                    learner_job.pop(lid, None)
                ids_of[job_id] = ids
                learner_job.update(dict.fromkeys(ids, job_id))
            old_on = hosts_of.get(job_id)
            if old_on != on:
                old_on = old_on or frozenset()
                for host_id in old_on - on:
                    self._off_host(host_id, job_id)
                for host_id in on - old_on:
                    jobs = on_host.get(host_id)
                    if jobs is None:
                        on_host[host_id] = {job_id}
                    else:
                        jobs.add(job_id)
                hosts_of[job_id] = on
        for job_id in [j for j in ids_of if j not in indexed]:
            for lid in ids_of.pop(job_id):
                learner_job.pop(lid, None)
        for job_id in [j for j in hosts_of if j not in indexed]:
            for host_id in hosts_of.pop(job_id):
                self._off_host(host_id, job_id)
        return len(learner_job) == count

    def _off_host(self, host_id: str, job_id: str) -> None:
        jobs = self._on_host.get(host_id)
        if jobs is not None:
            jobs.discard(job_id)
            if not jobs:
                del self._on_host[host_id]

    def _put(
        self,
        job_id: str,
        record: JobRecord | None,
        hosts: Mapping[str, resources_pb2.Host],
        exits: Mapping[str, resources_pb2.Learner],
        busy: Collection[str],
    ) -> None:
        self._forget(job_id)
        if record is None:
            return
        seen = decide.observe({job_id: record}, hosts, exits, busy)
        if seen.current:
            self.learners[job_id] = tuple(seen.current)
        work = seen.work.get(job_id)
        if work is not None and not work.empty():
            self.work[job_id] = work
        self._index(record)

    # -- the cycle ----------------------------------------------------------------------------

    def update(
        self,
        records: Mapping[str, JobRecord],
        hosts: Mapping[str, resources_pb2.Host],
        exits: Mapping[str, resources_pb2.Learner],
        busy: Collection[str],
        *,
        dirty: Iterable[str],
        changed_hosts: Iterable[str],
    ) -> dict[str, tuple[tuple[LearnerKey, ...], tuple[LearnerKey, ...]]]:
        """Observe again the jobs that may have changed (see the module docstring); job id ->
        (its counted learners before, after) for each job observed again."""
        touched = set(dirty)
        now_exits = frozenset(exits)
        for lid in now_exits ^ self._exits:
            job_id = self._learner_job.get(lid)
            if job_id is not None:
                touched.add(job_id)
        self._exits = now_exits
        now_busy = frozenset(busy)
        touched |= now_busy | self._busy
        self._busy = now_busy
        for host_id in changed_hosts:
            touched |= self._on_host.get(host_id, set())
        out = {}
        for job_id in touched:
            before = self.learners.get(job_id, ())
            self._put(job_id, records.get(job_id), hosts, exits, busy)
            out[job_id] = (before, self.learners.get(job_id, ()))
        return out

    def full(
        self,
        records: Mapping[str, JobRecord],
        hosts: Mapping[str, resources_pb2.Host],
        exits: Mapping[str, resources_pb2.Learner],
        busy: Collection[str],
        *,
        compare: bool = True,
    ) -> decide.Observed:
        """Observe every record from scratch (the safety net); when the kept view differs, log
        the jobs once and keep the fresh one. Returns the full observation."""
        seen = decide.observe(records, hosts, exits, busy, cache=self._seen, index=True)
        views = self.views = seen.by_id or {}
        keys = seen.current  # the views are (learner id, job id, host id, device id, retiring)
        fresh = seen.groups or {}  # each job's views, as observe lists them (together)
        if compare and self.synced:
            differ = []
            # The same tuples per job (the common case: a cheap comparison of the reused
            # views) are the same sets; else the sets are compared, job by job.
            if fresh != self.learners and set(keys) != set(
                itertools.chain.from_iterable(self.learners.values())
            ):
                differ = sorted(
                    job_id
                    for job_id in fresh.keys() | self.learners.keys()
                    if set(fresh.get(job_id, ())) != set(self.learners.get(job_id, ()))
                )
            differ += sorted(
                job_id
                for job_id in seen.work.keys() | self.work.keys()
                if job_id not in differ
                and _work_key(seen.work.get(job_id)) != _work_key(self.work.get(job_id))
            )
            if differ:
                self.divergences += 1
                self.last_divergence = differ
                log.warning(
                    "incremental observation diverged from the full observation on %s: the full "
                    "one is used (a record changed without being written or marked)",
                    ", ".join(differ),
                )
        kept = (self._on_host, self._hosts_of, self._learner_job, self._ids_of)
        self.reset()
        self.views = views
        self.learners = fresh
        self.work = {j: w for j, w in seen.work.items() if not w.empty()}
        self._on_host, self._hosts_of, self._learner_job, self._ids_of = kept
        if not self._reindex_all(records):
            self._on_host, self._hosts_of, self._learner_job, self._ids_of = {}, {}, {}, {}
            self.attention = set()
            self._index_all(records)
        self._exits = frozenset(exits)
        self._busy = frozenset(busy)
        self.synced = True
        return seen


def _work_key(work: JobWork | None) -> tuple[object, ...]:
    if work is None or work.empty():
        return ()
    return (
        sorted(e.learner_id for e in work.exits),
        sorted(work.lost),
        sorted(work.drop_pending),
    )
