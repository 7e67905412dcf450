"""The reconcile loop's full cycle made cheaper (2026-11-26) against the code it replaced:
the functions as they were before (``ref_*``, copied verbatim from that version; the views
they build are ``LearnerView`` named tuples now) and the new ones, on the same randomized
cluster states, must give the same observation, demands, work and plan (or raise the same
error). The new ones: ``decide.observe`` (each host read once per call; then a view reused
by learner id, now by job: below), ``decide.demands`` with its cache (a demand
reused when its fields are the same), ``decide.decide`` (each host's draining flag read once;
the finish / requeue checks on the remaining learners), ``placement.plan`` (learner ids checked
one by one only when some repeat), ``Inventory.orphans`` (a plain index of the ledger).

The second round (2026-11-27): ``decide.observe`` with its per-job cache (every learner read,
a job's views, groups and calm flag taken from the cache when its fields are the same values),
``plan`` by job with its memo over a sequence of states (groups, host views, demands kept,
changed, dropped), ``decide.decide`` from such an observation (calm jobs), ``decide.targets``
(each protobuf field read once), ``Inventory.held_by`` (no orphan, job by job) and the
safety net's kept index updated in place. Nothing here times anything."""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Collection, Iterable, Mapping, Sequence

from hypothesis import given, settings, strategies as st

from shoal.scheduler.jobs import (
    HOLDING,
    LEAVING,
    STARTED_STATES,
    JobRecord,
    LearnerPhase,
    LearnerRecord,
)
from shoal.scheduler.placement import (
    DeviceView,
    HostState,
    HostView,
    LearnerView,
    PlacementConfig,
    Plan,
    PlanMemo,
    Retire,
    Start,
    _choose_retires,
    _choose_starts,
    _FreeIndex,
    plan,
)
from shoal.scheduler.policy import JobDemand, Policy, admission_key, compute_shares
from shoal.scheduler.reconcile import decide as D
from shoal.scheduler.reconcile.config import ReconcileConfig
from shoal.scheduler.reconcile.decide import (
    _STOPPING_STATES,
    Observed,
    _copy,
    job_of,
    lost_reason,
    starts_by_job,
)
from shoal.scheduler.reconcile.inventory import Inventory
from shoal.scheduler.reconcile.work import JobWork
from shoal.v1 import job_pb2 as S, resources_pb2

# -- the code as it was (verbatim but for the names) ------------------------------------------


def ref_observe(
    records: Mapping[str, JobRecord],
    hosts: Mapping[str, resources_pb2.Host],
    exits: Mapping[str, resources_pb2.Learner],
    busy: Collection[str],
) -> Observed:
    """Step 1: every learner of every job, as placement must count it. A PENDING learner of a
    job whose worker is not running (``busy``: the job ids with a worker) was left by a worker
    that failed: it is dropped; one of a busy job holds its device. A learner whose exit an
    agent reported (``exits``, by learner id) is processed and still counts, as leaving; a
    learner on a lost (or restarted) host is lost and does not count."""
    seen = Observed()

    def w(job_id: str) -> JobWork:
        return seen.work.setdefault(job_id, JobWork())

    current = seen.current
    add = current.append
    pending, lost_state = LearnerPhase.PENDING, resources_pb2.HOST_STATE_LOST
    for record in records.values():
        job_id = record.job_id
        job_busy = job_id in busy
        for lr in record.learners.values():
            phase = lr.phase
            if phase is pending:
                if not job_busy:
                    w(job_id).drop_pending.append(lr.learner_id)
                    continue
                add(LearnerView(lr.learner_id, job_id, lr.host_id, lr.device_id))
                continue
            exit_ = exits.get(lr.learner_id) if exits else None
            if exit_ is not None:
                w(job_id).exits.append(exit_)
                add(LearnerView(lr.learner_id, job_id, lr.host_id, lr.device_id, True))
                continue
            host = hosts.get(lr.host_id)
            # The common case inline (a live host, the incarnation the learner started on);
            # lost_reason says why otherwise.
            if (
                host is None
                or host.state == lost_state
                or (lr.host_incarnation and host.incarnation > lr.host_incarnation)
            ):
                w(job_id).lost.append((lr.learner_id, lost_reason(lr, host)))
                continue
            add(LearnerView(lr.learner_id, job_id, lr.host_id, lr.device_id, phase in LEAVING))
    return seen


def ref_demand(r: JobRecord) -> JobDemand:
    return JobDemand(
        job_id=r.job_id,
        priority=r.job.spec.priority,
        submit_seq=r.submit_seq,
        min_workers=r.job.spec.min_workers,
        max_workers=r.job.spec.max_workers,
        last_shrunk_at=r.last_shrunk_at,
        previous_priority=r.decided_priority,
    )


def ref_decide(
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

    for record in records.values():
        job_id = record.job_id
        jw = work.get(job_id)
        gone = {lid for lid, _ in jw.lost} | {e.learner_id for e in jw.exits} if jw else set()
        remaining = [lr for lr in record.learners.values() if lr.learner_id not in gone]
        for learner_id in ref_housekeeping(record, remaining, hosts, work, config, now):
            kind, lid = learner_id
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
        live = [lr for lr in remaining if lr.phase is not LearnerPhase.PENDING]
        pending = [lr for lr in remaining if lr.phase is LearnerPhase.PENDING]
        if not record.active and not live and not pending:
            if record.state == S.JOB_STATE_CANCELLING or (record.opened and not record.closed):
                w(job_id).finish = True
        if (
            record.state in STARTED_STATES
            and not live
            and not pending
            and not starts.get(job_id)
            and job_id not in held
        ):
            w(job_id).requeue = True
    return work


def ref_housekeeping(
    record: JobRecord,
    remaining: Sequence[LearnerRecord],
    hosts: Mapping[str, resources_pb2.Host],
    work: Mapping[str, JobWork],
    config: ReconcileConfig,
    now: float,
) -> list[tuple[str, str]]:
    """(``"stops"`` | ``"restarts"`` | ``"retires"``, learner id) for each learner of the job
    whose phase, age or host asks for it."""
    out: list[tuple[str, str]] = []
    retiring = list(work[record.job_id].retires) if record.job_id in work else []
    state = record.state
    stopping_now = state in _STOPPING_STATES
    completed = state == S.JOB_STATE_COMPLETED
    if not stopping_now and not completed and record.active:
        # The common case first: an active job's RUNNING learners on hosts not draining need
        # nothing (the loop below would find the same, learner by learner).
        if all(
            lr.phase is LearnerPhase.RUNNING
            and not ((host := hosts.get(lr.host_id)) is not None and host.draining)
            for lr in remaining
        ):
            return out
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


def ref_plan(
    jobs: Sequence[JobDemand],
    inventory: Sequence[HostView],
    current: Sequence[LearnerView],
    config: PlacementConfig,
    *,
    now: float = 0.0,
) -> Plan:
    """The shares and the Start / Retire decisions for one cycle (see the module docstring).

    Raises:
        ValueError: a host id or a device id on one host given twice, a learner id given
            twice, two learners on one device, or any error of ``compute_shares``.
    """
    hosts: dict[str, HostView] = {}
    live_devices: dict[str, frozenset[str]] = {}  # device ids of the hosts that are not LOST
    for host in inventory:
        host_id = host.host_id
        if host_id in hosts:
            raise ValueError(f"host_id ({host_id!r}) is given more than once")
        hosts[host_id] = host
        if host.repeated is not None:
            raise ValueError(
                f"device_id ({host.repeated!r}) is given more than once on host {host_id}"
            )
        if host.state is not HostState.LOST:
            live_devices[host_id] = host.device_ids

    # Who sits where; which learners are gone with their host; what each job holds (learners
    # not retiring). One pass over the learners.
    learner_ids: set[str] = set()
    occupied: dict[str, dict[str, str]] = {}  # host -> device -> learner
    held_by_job: dict[str, list[LearnerView]] = {}
    lost: list[str] = []
    for learner in current:
        learner_id = learner.learner_id
        if learner_id in learner_ids:
            raise ValueError(f"learner_id ({learner_id!r}) is given more than once")
        learner_ids.add(learner_id)
        host_id, device_id = learner.host_id, learner.device_id
        devices = live_devices.get(host_id)
        if devices is None or device_id not in devices:
            lost.append(learner_id)
            continue
        on_host = occupied.get(host_id)
        if on_host is None:
            occupied[host_id] = {device_id: learner_id}
        elif device_id in on_host:
            raise ValueError(
                f"device ({host_id}, {device_id}) is held by two learners: "
                f"{on_host[device_id]} and {learner_id}"
            )
        else:
            on_host[device_id] = learner_id
        if not learner.retiring:
            job_held = held_by_job.get(learner.job_id)
            if job_held is None:
                held_by_job[learner.job_id] = [learner]
            else:
                job_held.append(learner)

    # Capacity and free devices: per host, not per device, where nothing is in the way.
    capacity = 0
    free: dict[str, Sequence[str]] = {}
    for host in inventory:
        state = host.state
        if state is HostState.LOST:
            continue
        on_host = occupied.get(host.host_id)
        if on_host:
            capacity += len(on_host)
        if state is HostState.READY:
            ids: Sequence[str]
            if on_host:
                ids = [d for d in host.unallocated if d not in on_host]
            else:
                ids = host.unallocated
            if ids:
                capacity += len(ids)
                free[host.host_id] = ids

    counts = {job_id: len(held) for job_id, held in held_by_job.items()}
    order = sorted(jobs, key=admission_key(config.policy))
    allocation = compute_shares(
        order,
        capacity,
        config.policy,
        now=now,
        hold_time=config.hold_time,
        sticky_rounding=config.sticky_rounding,
        fair_fraction=config.fair_fraction,
        service_thresholds=config.service_thresholds,
        service_decay=config.service_decay,
        rescale_horizon=config.rescale_horizon,
        held=counts,
        ordered=True,
    )

    # Shrink.
    retires: list[Retire] = []
    for job in order:
        held = held_by_job.get(job.job_id, [])
        excess = len(held) - allocation.share(job.job_id)
        if excess > 0:
            retires.extend(_choose_retires(job.job_id, held, excess, hosts))
    known = {job.job_id for job in jobs}
    for job_id in sorted(set(held_by_job) - known):
        held = held_by_job[job_id]
        retires.extend(_choose_retires(job_id, held, len(held), hosts))

    # Grow, onto free devices only, in admission order.
    index = _FreeIndex(free)
    starts: list[Start] = []
    for job in order:
        if index.total == 0:
            break
        need = allocation.share(job.job_id) - counts.get(job.job_id, 0)
        if need > 0:
            starts.extend(_choose_starts(job.job_id, held_by_job.get(job.job_id, []), need, index))

    return Plan(
        shares=allocation.shares,
        starts=tuple(starts),
        retires=tuple(retires),
        queue=allocation.queue,
        capacity=capacity,
        held=allocation.held,
        lost=tuple(lost),
    )


def ref_targets(records: Mapping[str, JobRecord], decided: Plan) -> dict[str, tuple[int, int]]:
    queue_pos = {job_id: i + 1 for i, job_id in enumerate(decided.queue)}
    out: dict[str, tuple[int, int]] = {}
    for record in records.values():
        if not record.active:
            continue
        target = decided.shares.get(record.job_id, 0)
        position = queue_pos.get(record.job_id, 0) if record.state == S.JOB_STATE_QUEUED else 0
        out[record.job_id] = (target, position)
    return out


def ref_orphans(inventory: Inventory, known: Collection[str]) -> list[str]:
    return [a.allocation_id for a in inventory.ledger.values() if a.learner_id not in known]


# -- randomized cluster states ------------------------------------------------------------------

HOSTS = ["h0", "h1", "h2", "h3", "h4"]  # h4 is never in the inventory
STATES = [
    S.JOB_STATE_QUEUED,
    S.JOB_STATE_RUNNING,
    S.JOB_STATE_RUNNING,
    S.JOB_STATE_RECOVERING,
    S.JOB_STATE_CANCELLING,
    S.JOB_STATE_COMPLETED,
    S.JOB_STATE_FAILED,
    S.JOB_STATE_CANCELLED,
]
PHASES = list(LearnerPhase) + [LearnerPhase.RUNNING] * 4
CONFIG = ReconcileConfig(
    sync_shards=("shard-0:1",),
    finish_grace_s=30.0,
    retire_timeout_s=60.0,
    stop_grace_s=10.0,
    call_timeout_s=10.0,
)
NOW = 1000.0


def cluster(rnd: random.Random) -> tuple[dict[str, JobRecord], dict[str, resources_pb2.Host]]:
    hosts = {}
    for h in HOSTS[:4]:
        if rnd.random() < 0.1:
            continue  # gone from the inventory
        host = resources_pb2.Host(
            host_id=h,
            incarnation=rnd.choice([1, 1, 1, 2]),
            state=rnd.choice(
                [resources_pb2.HOST_STATE_READY] * 4 + [resources_pb2.HOST_STATE_LOST]
            ),
            draining=rnd.random() < 0.15,
        )
        for d in range(4):
            host.devices.add(device_id=str(d))
        hosts[h] = host
    records = {}
    n = 0
    for j in range(rnd.randint(0, 6)):
        job = S.Job(job_id=f"j{j}", state=rnd.choice(STATES))  # type: ignore[arg-type]
        job.spec.priority = rnd.choice([100, 5000])
        job.spec.min_workers = rnd.randint(1, 2)
        job.spec.max_workers = job.spec.min_workers + rnd.randint(0, 4)
        record = JobRecord(
            job=job,
            submit_seq=j,
            opened=rnd.random() < 0.5,
            closed=rnd.random() < 0.3,
            last_shrunk_at=rnd.choice([None, 990.0]),
            decided_priority=rnd.choice([None, 100, 5000]),
        )
        for _ in range(rnd.randint(0, 6)):
            lid = f"l{n}"
            n += 1
            record.learners[lid] = LearnerRecord(
                learner_id=lid,
                host_id=rnd.choice(HOSTS),
                device_id=str(rnd.randint(0, 3)),
                host_incarnation=rnd.choice([0, 1, 1, 2]),
                phase=rnd.choice(PHASES),
                phase_since=rnd.choice([NOW, NOW - 20.0, NOW - 100.0]),
            )
        records[job.job_id] = record
    return records, hosts


def mutate(rnd: random.Random, records: dict[str, JobRecord]) -> None:
    """Change some learners in place (what a reused view must notice)."""
    for record in records.values():
        for lr in record.learners.values():
            r = rnd.random()
            if r < 0.1:
                lr.host_id = rnd.choice(HOSTS)
            elif r < 0.2:
                lr.device_id = str(rnd.randint(0, 3))
            elif r < 0.3:
                lr.phase = rnd.choice(PHASES)
        if rnd.random() < 0.2:
            record.job.spec.priority += 1
        if rnd.random() < 0.1:
            record.last_shrunk_at = NOW


def exits_and_busy(
    rnd: random.Random, records: Mapping[str, JobRecord]
) -> tuple[dict[str, resources_pb2.Learner], set[str]]:
    ids = [lid for r in records.values() for lid in r.learners]
    exits = {lid: resources_pb2.Learner(learner_id=lid) for lid in ids if rnd.random() < 0.15}
    busy = {j for j in records if rnd.random() < 0.3}
    return exits, busy


def change_a_host(rnd: random.Random, hosts: dict[str, resources_pb2.Host]) -> None:
    """Lose a host, restart it (a new incarnation) or drop it, sometimes."""
    if not hosts or rnd.random() < 0.6:
        return
    host_id = rnd.choice(sorted(hosts))
    r = rnd.random()
    if r < 0.2:
        del hosts[host_id]
        return
    host = resources_pb2.Host()
    host.CopyFrom(hosts[host_id])
    if r < 0.6:
        host.state = resources_pb2.HOST_STATE_LOST
    else:
        host.incarnation += 1
    hosts[host_id] = host


def host_views(hosts: Mapping[str, resources_pb2.Host]) -> list[HostView]:
    return [
        HostView(
            h.host_id,
            tuple(DeviceView(d.device_id) for d in h.devices),
            HostState.LOST
            if h.state == resources_pb2.HOST_STATE_LOST
            else HostState.CORDONED
            if h.draining
            else HostState.READY,
        )
        for h in hosts.values()
    ]


def summary(work: Mapping[str, JobWork]) -> dict[str, tuple[object, ...]]:
    return {
        job_id: (
            [e.learner_id for e in w.exits],
            list(w.lost),
            list(w.drop_pending),
            list(w.retires),
            list(w.stops),
            list(w.restarts),
            w.finish,
            w.requeue,
            w.save,
        )
        for job_id, w in work.items()
    }


# -- the tests --------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_observe_demands_decide_are_those_of_the_code_they_replaced(seed: int) -> None:
    rnd = random.Random(seed)
    records, hosts = cluster(rnd)
    exits, busy = exits_and_busy(rnd, records)
    seen: D.ObserveCache = {}
    before = D.observe(records, hosts, exits, busy, cache=seen)  # an earlier one, then changes
    cache: D.DemandCache = {}
    D.demands(records, cache)
    views_before = host_views(hosts)
    wanted_before = [ref_demand(r) for r in records.values() if r.active]
    memo = PlanMemo()
    with contextlib.suppress(ValueError):
        plan(
            wanted_before,
            views_before,
            before.current,
            PlacementConfig(policy=Policy.PRIORITY),
            now=NOW,
            groups=before.groups,
            memo=memo,
        )
    for _ in range(rnd.choice([0, 1, 1, 2])):  # or no change at all: every job from the cache
        mutate(rnd, records)
        exits, busy = exits_and_busy(rnd, records)
        change_a_host(rnd, hosts)

    old = ref_observe(records, hosts, exits, busy)
    for new in (
        D.observe(records, hosts, exits, busy),
        D.observe(records, hosts, exits, busy, cache=seen, index=rnd.random() < 0.5),
        D.observe(records, hosts, exits, busy, cache=seen),  # the cache as the last call left it
    ):
        assert new.current == old.current
        assert all(type(v) is LearnerView for v in new.current)
        assert new.by_id is None or new.by_id == D.index(new.current)
        assert summary(new.work) == summary(old.work)
        assert list(new.work) == list(old.work)  # the same order
        if new.groups is None:
            continue
        # Each job's learners, together and in order; the jobs with every learner RUNNING and
        # no observed work, with their hosts.
        assert list(itertools.chain.from_iterable(new.groups.values())) == new.current
        assert all(v[1] == job_id for job_id, group in new.groups.items() for v in group)
        assert new.calm == {
            r.job_id: tuple(dict.fromkeys(lr.host_id for lr in r.learners.values()))
            for r in records.values()
            if r.learners
            and all(lr.phase is LearnerPhase.RUNNING for lr in r.learners.values())
            and r.job_id not in old.work
        }
    assert set(seen) <= set(records)

    wanted = [ref_demand(r) for r in records.values() if r.active]
    assert D.demands(records) == wanted
    assert D.demands(records, cache) == wanted
    assert D.demands(records, cache) == wanted  # the cache as the last call left it
    assert set(cache) == {d.job_id for d in wanted}

    views = host_views(hosts)
    if views == views_before and rnd.random() < 0.5:
        views = views_before  # the same objects (what plan's memo takes again)
    config = PlacementConfig(policy=Policy.PRIORITY)
    try:
        decided = ref_plan(wanted, views, old.current, config, now=NOW)
    except ValueError:  # two learners on one device: plan is tested below
        decided = Plan(shares={}, starts=(), retires=(), queue=(), capacity=0)
    # The plan from the groups and the memo of the earlier plan: the same, or the same error.
    expected: Plan | str
    try:
        expected = ref_plan(wanted, views, old.current, config, now=NOW)
    except ValueError as exc:
        expected = str(exc)
    try:
        got: Plan | str = plan(
            wanted, views, new.current, config, now=NOW, groups=new.groups, memo=memo
        )
    except ValueError as exc:
        got = str(exc)
    assert got == expected
    ids = list(records)
    changed = rnd.sample(ids, k=min(len(ids), 2))
    moved = rnd.sample(ids, k=min(len(ids), 1))
    held = rnd.sample(ids, k=min(len(ids), 1))
    assert list(D.targets(records, decided).items()) == list(ref_targets(records, decided).items())
    args = (records, hosts, old, decided, CONFIG)
    kwargs = {"changed": changed, "moved": moved, "held": held, "now": NOW}
    want = ref_decide(*args, **kwargs)  # type: ignore[arg-type]
    assert summary(D.decide(*args, **kwargs)) == summary(want)  # type: ignore[arg-type]
    # From the observation with the cache (its calm jobs skip the housekeeping's reads).
    got_work = D.decide(records, hosts, new, decided, CONFIG, **kwargs)  # type: ignore[arg-type]
    assert summary(got_work) == summary(want)
    assert list(got_work) == list(want)  # the order the jobs get their work in


@settings(max_examples=300, deadline=None)
@given(
    learners=st.lists(
        st.tuples(
            st.sampled_from(["l0", "l1", "l2", "l3", "l4", "l5", "l6", "l7"]),
            st.sampled_from(["j0", "j1", "j2"]),
            st.sampled_from(["h0", "h1", "h2", "h9"]),
            st.sampled_from(["0", "1", "2", "7"]),
            st.booleans(),
        ),
        max_size=10,
    ),
    states=st.lists(st.sampled_from(list(HostState)), min_size=3, max_size=3),
    policy=st.sampled_from(list(Policy)),
)
def test_plan_is_that_of_the_code_it_replaced(
    learners: list[tuple[str, str, str, str, bool]], states: list[HostState], policy: Policy
) -> None:
    """The same plan, or the same error (a learner id given twice, two learners on one
    device: whichever comes first)."""
    current = [LearnerView(*t) for t in learners]
    views = [HostView.with_devices(f"h{i}", 3, state) for i, state in enumerate(states)]
    jobs = [
        JobDemand(job_id=f"j{i}", priority=100 * (i + 1), submit_seq=i, max_workers=4)
        for i in range(3)
    ]
    config = PlacementConfig(policy=policy)
    try:
        expected: Plan | str = ref_plan(jobs, views, current, config, now=NOW)
    except ValueError as exc:
        expected = str(exc)
    try:
        got: Plan | str = plan(jobs, views, current, config, now=NOW)
    except ValueError as exc:
        got = str(exc)
    assert got == expected
    # By job (a job's learners not together: the groups do not add up, learner by learner),
    # twice with one memo (the second time every group and the inventory taken again).
    groups: dict[str, tuple[LearnerView, ...]] = {}
    for job_id, group in itertools.groupby(current, key=lambda v: v.job_id):
        groups[job_id] = tuple(group)
    memo = PlanMemo()
    for _ in range(2):
        try:
            got = plan(jobs, views, current, config, now=NOW, groups=groups, memo=memo)
        except ValueError as exc:
            got = str(exc)
        assert got == expected


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_inventorys_orphans_are_the_ledgers(seed: int) -> None:
    rnd = random.Random(seed)
    inventory = Inventory()

    def allocation(i: int) -> resources_pb2.Allocation:
        return resources_pb2.Allocation(
            allocation_id=f"a{i}",
            job_id=rnd.choice(["j0", "j1", "j2"]),
            learner_id=f"l{rnd.randint(0, 9)}",
            host_id="h0",
            device_id=str(i),
        )

    inventory.reset(
        [resources_pb2.Host(host_id="h0")], [allocation(i) for i in range(rnd.randint(0, 5))]
    )
    for _ in range(10):
        if rnd.random() < 0.5:
            inventory.allocated([allocation(rnd.randint(0, 9))])  # new or replacing
        else:
            inventory.released([f"a{rnd.randint(0, 9)}"])
        known = {f"l{i}" for i in range(10) if rnd.random() < 0.5}
        assert inventory.orphans(known) == ref_orphans(inventory, known)
        # The check job by job (the full cycle's common case): true only when no allocation
        # is an orphan, and then exactly when each is held by a learner of its own job.
        records = {}
        for j in ("j0", "j1"):
            record = JobRecord(job=S.Job(job_id=j), submit_seq=0)
            for lid in sorted(known):
                if rnd.random() < 0.7:
                    record.learners[lid] = LearnerRecord(
                        learner_id=lid, host_id="h0", device_id="0"
                    )
            records[j] = record
        every = {lid for r in records.values() for lid in r.learners}
        by_own_job = all(
            a.learner_id in records[a.job_id].learners if a.job_id in records else False
            for a in inventory.ledger.values()
        )
        assert inventory.held_by(records) == by_own_job
        if by_own_job:
            assert ref_orphans(inventory, every) == []


@settings(max_examples=200, deadline=None)
@given(
    kept=st.lists(
        st.tuples(
            st.sampled_from(["l0", "l1", "l2", "l3", "l4", "l5"]),
            st.sampled_from(["j0", "j1"]),
            st.sampled_from(["h0", "h1"]),
            st.sampled_from(["0", "1", "2"]),
            st.booleans(),
        ),
        max_size=6,
        unique_by=(lambda t: t[0], lambda t: (t[2], t[3])),
    ),
    seen=st.lists(
        st.tuples(
            st.sampled_from(["l0", "l1", "l2", "l3", "l4", "l5"]),
            st.sampled_from(["j0", "j1"]),
            st.sampled_from(["h0", "h1"]),
            st.sampled_from(["0", "1", "2"]),
            st.booleans(),
        ),
        max_size=6,
        unique_by=lambda t: t[0],
    ),
)
def test_the_planners_check_by_learner_id_is_the_check_by_sets(
    kept: list[tuple[str, str, str, str, bool]], seen: list[tuple[str, str, str, str, bool]]
) -> None:
    """``differs_from(..., by_id=)`` (the safety net's check now) names what the check over
    two sets of learner tuples names."""
    from shoal.scheduler.incremental import IncrementalPlanner

    jobs = [
        JobDemand(job_id=j, priority=100, submit_seq=i, max_workers=4)
        for i, j in enumerate(["j0", "j1"])
    ]
    hosts = [HostView.with_devices(h, 3) for h in ("h0", "h1")]
    planner = IncrementalPlanner(
        PlacementConfig(policy=Policy.PRIORITY), jobs, hosts, [LearnerView(*t) for t in kept]
    )
    current = [LearnerView(*t) for t in seen]
    assert planner.differs_from(
        jobs, hosts, current, by_id=D.index(current)
    ) == planner.differs_from(jobs, hosts, current)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_full_observations_index_is_the_per_job_index(seed: int) -> None:
    """``Observing.full`` indexes every record inline: the same index (jobs to look at, jobs
    per host, hosts per job, learner -> job, learner ids per job) as ``_index`` job by job."""
    from shoal.scheduler.reconcile.observing import Observing

    rnd = random.Random(seed)
    records, hosts = cluster(rnd)
    exits, busy = exits_and_busy(rnd, records)
    full = Observing()
    for _ in range(3):  # the index kept and updated by the next full observation
        full.full(records, hosts, exits, busy)
        one_by_one = Observing()
        for record in records.values():
            one_by_one._index(record)
        for name in ("attention", "_on_host", "_hosts_of", "_learner_job", "_ids_of"):
            assert getattr(full, name) == getattr(one_by_one, name), name
        mutate(rnd, records)
        for job_id in list(records):
            r = rnd.random()
            if r < 0.1:
                del records[job_id]
            elif r < 0.2:
                records[job_id].learners.clear()
            elif r < 0.3 and records[job_id].learners:  # a learner id of another job
                other = rnd.choice([lid for rec in records.values() for lid in rec.learners])
                records[job_id].learners[other] = LearnerRecord(
                    learner_id=other, host_id="h0", device_id="0"
                )
        exits, busy = exits_and_busy(rnd, records)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_plan_by_job_with_one_memo_over_many_cycles(seed: int) -> None:
    """``plan(groups=, memo=)`` over a sequence of states (jobs' groups kept, changed, added,
    dropped; hosts kept or changed; now and then a learner lost or two on one device): each
    time the plan, or the error, of the code it replaced."""
    rnd = random.Random(seed)
    config = PlacementConfig(policy=rnd.choice(list(Policy)))
    jobs = [
        JobDemand(job_id=f"j{i}", priority=100 * (i + 1), submit_seq=i, max_workers=5)
        for i in range(4)
    ]
    views = [HostView.with_devices(f"h{i}", 4) for i in range(3)]
    groups: dict[str, tuple[LearnerView, ...]] = {}
    memo = PlanMemo()
    n = 0
    for _ in range(8):
        if rnd.random() < 0.3:  # a demand changed (plan's memo keeps the admission order)
            k = rnd.randrange(len(jobs))
            jobs = list(jobs)
            jobs[k] = JobDemand(
                job_id=f"j{k}", priority=rnd.choice([100, 200, 300]), submit_seq=k, max_workers=5
            )
        r = rnd.random()
        if r < 0.3:  # hosts: another state, or another object with the same value
            i = rnd.randrange(len(views))
            views = list(views)
            views[i] = HostView.with_devices(f"h{i}", 4, rnd.choice(list(HostState)))
        for job in jobs:
            r = rnd.random()
            if r < 0.3:  # another group (learners on devices picked at random: may collide)
                group = []
                for _ in range(rnd.randint(0, 3)):
                    n += 1
                    host = rnd.choice(["h0", "h1", "h2", "h9"])
                    group.append(
                        LearnerView(
                            f"l{n}", job.job_id, host, str(rnd.randint(0, 4)), rnd.random() < 0.2
                        )
                    )
                if group:
                    groups[job.job_id] = tuple(group)
                else:
                    groups.pop(job.job_id, None)
            elif r < 0.4:
                groups.pop(job.job_id, None)
        current = list(itertools.chain.from_iterable(groups.values()))
        try:
            expected: Plan | str = ref_plan(jobs, views, current, config, now=NOW)
        except ValueError as exc:
            expected = str(exc)
        try:
            got: Plan | str = plan(
                jobs, views, current, config, now=NOW, groups=dict(groups), memo=memo
            )
        except ValueError as exc:
            got = str(exc)
        assert got == expected
