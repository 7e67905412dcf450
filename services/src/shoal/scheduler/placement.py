"""Placement: from (jobs, inventory, current learners) to Start / Retire decisions, purely.

``plan(jobs, inventory, current, config, now=...)`` is level-triggered: it is recomputed from
the observed state on every reconcile cycle, and the same observed state gives the same
decisions. Once the decisions of a plan are applied (started learners appear in ``current``,
retired ones are marked ``retiring``), the next plan has no decisions until something else
changes (a learner exits, a job is submitted, a host is lost...).

The model
    * A *device* is one GPU slot of a host, named by ``(host_id, device_id)``.
    * A host is READY, CORDONED (its learners keep running; nothing new is placed on it) or
      LOST (its learners are gone). Learners on a lost host, or on a host or device the
      inventory does not list, are reported in ``Plan.lost`` for the reconcile loop to evict;
      they count for nothing else.
    * ``current`` lists every learner the scheduler knows about, starting, running or
      retiring. A retiring learner (asked to retire, not yet exited) still occupies its
      device: the device becomes free only once the reconcile loop has seen the exit and
      dropped the learner from ``current``. A job's *held* count is its learners that are not
      retiring.
    * A device is free when its host is READY, no learner in ``current`` is on it and the
      resource-manager has not allocated it (``DeviceView.allocated_to is None``).
    * The capacity given to the policy is the devices of READY hosts (less those the
      resource-manager allocated to a learner the scheduler does not know, which it cannot
      free), plus the devices of CORDONED hosts that learners occupy (a cordoned host's
      capacity goes away as its learners leave).

The decisions
    * Shares: ``compute_shares`` over the jobs, with ``current`` replaced by the held count
      observed here (the value passed in ``JobDemand.current`` is ignored).
    * Shrink: a job holding more than its share retires the difference, taken first from
      cordoned hosts, then from the hosts where it has the fewest learners (ties: host id),
      so it stays packed; on a host, the greatest learner ids first. A job already retiring
      enough learners gets no more retires. Learners of a job that is not in ``jobs`` are all
      retired.
    * Grow: only free devices are handed out, to the jobs below their share in admission
      order (highest priority first, then submit order; FIFO: submit order). A job waits
      while the devices it needs are still held by learners that are retiring. Each job's
      new learners are packed: first onto the hosts where it already runs (most of its
      learners first), then, if one host can take all the rest, the host with the fewest free
      devices that can (best fit, keeping whole hosts free for larger jobs), else the host
      with the most free devices, repeatedly. Ties go to the smaller host id; on a host,
      devices are taken in natural order of their ids.

``shoal.scheduler.incremental.IncrementalPlanner`` gives the same plan from indices kept
between decisions and updated per event (the decision after an event touches only the jobs
and hosts it changed); ``plan`` stays the full cycle and the reference.

The caller's part (the reconcile loop): record ``last_shrunk_at = now`` on every job that got
a Retire (the hold-time rule reads it), ask those learners to retire and mark them retiring,
reserve the devices of the Starts and add the starting learners to ``current``, evict the
``lost`` learners, and drop a learner from ``current`` once its exit is observed.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from shoal.scheduler.policy import JobDemand, Policy, admission_key, compute_shares

__all__ = [
    "DeviceView",
    "HostState",
    "HostView",
    "LearnerView",
    "PlacementConfig",
    "Plan",
    "Retire",
    "Start",
    "plan",
]


class HostState(enum.Enum):
    """Whether a host can receive new learners."""

    READY = "ready"
    """Alive and schedulable."""
    CORDONED = "cordoned"
    """Alive; its learners keep running, but nothing new is placed on it."""
    LOST = "lost"
    """Declared lost by the resource-manager: its learners are gone."""


@dataclass(frozen=True, slots=True)
class DeviceView:
    """One device (GPU slot) of a host.

    Attributes:
        device_id: unique within its host (e.g. "0" or "gpu3").
        allocated_to: the learner id the resource-manager has allocated the device to, or
            None. A device allocated to a learner absent from ``current`` is never free and
            does not count in the capacity.
    """

    device_id: str
    allocated_to: str | None = None


@dataclass(frozen=True, slots=True)
class HostView:
    """One host of the inventory, as the resource-manager sees it."""

    host_id: str
    devices: tuple[DeviceView, ...]
    state: HostState = HostState.READY
    # Derived once, when the view is built (a view never changes; a changed host is a new
    # view), so that a full cycle does not recompute them for every unchanged host.
    device_ids: frozenset[str] = field(init=False, repr=False, compare=False)
    """The ids of its devices."""
    unallocated: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """The ids of its devices the resource-manager has not allocated, in order."""
    repeated: str | None = field(init=False, repr=False, compare=False)
    """A device id given more than once (``plan`` rejects the host), or None."""

    def __post_init__(self) -> None:
        ids = [d.device_id for d in self.devices]
        unique = frozenset(ids)
        twice = None
        if len(unique) != len(ids):
            twice = next(d for d, n in Counter(ids).items() if n > 1)
        object.__setattr__(self, "device_ids", unique)
        object.__setattr__(
            self, "unallocated", tuple(d.device_id for d in self.devices if d.allocated_to is None)
        )
        object.__setattr__(self, "repeated", twice)

    @classmethod
    def with_devices(cls, host_id: str, count: int, state: HostState = HostState.READY) -> HostView:
        """A host with ``count`` unallocated devices named "0" .. str(count - 1)."""
        return cls(host_id, tuple(DeviceView(str(d)) for d in range(count)), state)


class LearnerView(NamedTuple):
    """One learner the scheduler knows about (starting, running or retiring).

    A named tuple (learner id, job id, host id, device id, retiring): the reconcile loop's
    full cycle builds one per learner (80,000 at 10,000 hosts x 8 GPUs), and a tuple is
    several times cheaper to build than a frozen dataclass; it equals the loop's
    ``LearnerKey`` tuple of the same fields."""

    learner_id: str
    job_id: str
    host_id: str
    device_id: str
    retiring: bool = False
    """True once the scheduler asked it to retire and until its exit is observed."""


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """Scheduling configuration, built once and validated."""

    policy: Policy = Policy.FAIRSHARE
    hold_time: float = 0.0
    """Seconds during which a job just shrunk is not shrunk again (see policy.py)."""
    sticky_rounding: bool = True
    """Spare units of the rounding go first to jobs already holding them (see policy.py)."""
    fair_fraction: float = 0.5
    """GOODPUT: no job below this fraction of its PRIORITY share (see policy.py)."""
    service_thresholds: tuple[float, ...] = ()
    """Attained-service classes, device-seconds (empty: off; see policy.py)."""
    service_decay: int = 2
    """Weight divisor per attained-service class reached (see policy.py)."""
    rescale_horizon: float = 0.0
    """GOODPUT: resize a running job only if the gain over this many seconds beats its pause
    (0: off; see policy.py)."""

    def __post_init__(self) -> None:
        if self.hold_time < 0:
            raise ValueError(f"hold_time ({self.hold_time}) must be >= 0")
        # The same checks as compute_shares, made once, when the configuration is built.
        compute_shares(
            [],
            0,
            self.policy,
            fair_fraction=self.fair_fraction,
            service_thresholds=self.service_thresholds,
            service_decay=self.service_decay,
            rescale_horizon=self.rescale_horizon,
        )


@dataclass(frozen=True, slots=True)
class Start:
    """Start a learner of ``job_id`` pinned to ``device_id`` of ``host_id``."""

    job_id: str
    host_id: str
    device_id: str


@dataclass(frozen=True, slots=True)
class Retire:
    """Ask ``learner_id`` of ``job_id`` to retire at its next iteration boundary."""

    job_id: str
    learner_id: str


@dataclass(frozen=True, slots=True)
class Plan:
    """The decisions of one scheduling cycle.

    Attributes:
        shares: target learner count of every job (0 for queued jobs).
        starts: learners to start, in admission order of their jobs.
        retires: learners to retire, in admission order of their jobs (unknown jobs last).
        queue: jobs waiting for their minimum, in the order they will be admitted.
        capacity: the device count the shares were computed on.
        held: jobs kept above their share by the hold-time rule.
        lost: ids of learners on lost or unknown hosts or devices (to be evicted).
    """

    shares: Mapping[str, int]
    starts: tuple[Start, ...] = ()
    retires: tuple[Retire, ...] = ()
    queue: tuple[str, ...] = ()
    capacity: int = 0
    held: frozenset[str] = field(default_factory=frozenset)
    lost: tuple[str, ...] = ()

    @property
    def decisions(self) -> tuple[Start | Retire, ...]:
        """Retires first (they free devices), then starts."""
        return (*self.retires, *self.starts)


def _natural_key(name: str) -> tuple[int, str]:
    return (len(name), name)


class _FreeIndex:
    """Free devices per READY host, indexed by free count for O(devices per host) queries.

    ``buckets[k]`` is a heap of the ids of hosts with k free devices. Counts only go down
    during a plan, so an entry is stale exactly when its host's count is no longer k; stale
    entries are dropped lazily when they reach the top.
    """

    def __init__(self, free: Mapping[str, Sequence[str]]) -> None:
        # Device ids are kept reversed so that the next one to hand out is at the end.
        self.free = {h: sorted(d, key=_natural_key, reverse=True) for h, d in free.items() if d}
        self.total = sum(len(d) for d in self.free.values())
        top = max((len(d) for d in self.free.values()), default=0)
        self.buckets: list[list[str]] = [[] for _ in range(top + 1)]
        for h in sorted(self.free):
            self.buckets[len(self.free[h])].append(h)  # sorted lists are heaps

    def count(self, host: str) -> int:
        devices = self.free.get(host)
        return len(devices) if devices else 0

    def take(self, host: str, n: int) -> list[str]:
        devices = self.free[host]
        taken = [devices.pop() for _ in range(min(n, len(devices)))]
        self.total -= len(taken)
        if devices:
            heapq.heappush(self.buckets[len(devices)], host)
        return taken

    def _top(self, k: int) -> str | None:
        bucket = self.buckets[k]
        while bucket and self.count(bucket[0]) != k:
            heapq.heappop(bucket)
        return bucket[0] if bucket else None

    def best_host(self, need: int) -> str | None:
        """The fullest-fitting host: fewest free devices >= need, else the most free."""
        for k in range(min(need, len(self.buckets)), len(self.buckets)):
            if k and (host := self._top(k)) is not None:
                return host
        for k in range(min(need, len(self.buckets)) - 1, 0, -1):
            if (host := self._top(k)) is not None:
                return host
        return None


_Digest = tuple[
    tuple[LearnerView, ...],
    list[LearnerView],
    tuple[tuple[str, tuple[str, ...]], ...],
    tuple[str, ...],
]


class PlanMemo:
    """What ``plan`` derived from its inputs, kept by the caller between calls (see ``plan``'s
    ``memo``): per job, from its group of learners (the group as ``plan`` was given it, its
    learners not retiring, the devices they are on per host); from the inventory (the host
    views as given, then by id, the device ids of the hosts not LOST, the unallocated devices
    of the READY hosts); the demands in admission order."""

    __slots__ = ("hosts", "inventory", "jobs", "live_devices", "order", "scan", "spare")

    def __init__(self) -> None:
        self.jobs: dict[str, _Digest] = {}
        # (the policy, the demands as given, them in admission order)
        self.order: tuple[Policy, list[JobDemand], list[JobDemand]] | None = None
        # The last scan: (the live_devices it checked against, the groups, host -> occupied
        # device -> job, job -> learners not retiring, the learner ids); updated by the next
        # one (_scan_groups).
        self.scan: (
            tuple[
                Mapping[str, frozenset[str]],
                dict[str, tuple[LearnerView, ...]],
                dict[str, dict[str, str]],
                dict[str, list[LearnerView]],
                set[str],
            ]
            | None
        ) = None
        self.inventory: list[HostView] | None = None
        self.hosts: dict[str, HostView] = {}
        self.live_devices: dict[str, frozenset[str]] = {}
        self.spare: list[tuple[str, tuple[str, ...]]] = []


def plan(
    jobs: Sequence[JobDemand],
    inventory: Sequence[HostView],
    current: Sequence[LearnerView],
    config: PlacementConfig,
    *,
    now: float = 0.0,
    groups: Mapping[str, tuple[LearnerView, ...]] | None = None,
    memo: PlanMemo | None = None,
) -> Plan:
    """The shares and the Start / Retire decisions for one cycle (see the module docstring).

    ``groups`` (optional, with ``memo``): ``current`` split by job -- job id -> that job's
    learners, each group together in ``current`` and in its order, the groups in the order of
    ``current`` (what the reconcile loop's observation gives: ``Observed.groups``). The pass
    over the learners then goes job by job: what it derives from a group (its learners not
    retiring, the devices they are on per host) is kept in ``memo`` (the caller's, kept
    between calls; left holding this call's groups) and taken again when the very same group
    (the same tuple object: immutable, of immutable views) comes back; the devices are checked
    per host against the inventory on every call. Anything unusual (a learner lost, two on one
    device, a learner id given twice, groups that do not add up to ``current``) falls back to
    the pass learner by learner: the same plan, or the same error, either way.

    Raises:
        ValueError: a host id or a device id on one host given twice, a learner id given
            twice, two learners on one device, or any error of ``compute_shares``.
    """
    since: tuple[Mapping[str, frozenset[str]], list[str]] | None = None
    again = _hosts_again(memo, inventory) if memo is not None else None
    if again is not None:
        # The same host views but a few (immutable; the same objects): what was derived
        # from them last time, those few derived again. ``since``: what the last scan was
        # checked against, the hosts changed since.
        hosts, live_devices, spare, changed_hosts = again
        if changed_hosts:
            since = (memo.live_devices, changed_hosts)  # type: ignore[union-attr]
    else:
        hosts, live_devices, spare = _hosts(inventory)
    if memo is not None:
        memo.inventory = list(inventory)
        memo.hosts, memo.live_devices, memo.spare = hosts, live_devices, spare

    # Who sits where; which learners are gone with their host; what each job holds (learners
    # not retiring). One pass over the learners.
    # Learner ids given twice are looked for learner by learner (and named, in order) only
    # when the set of them says there are some.
    scanned = None
    if groups is not None and memo is not None:  # (it checks the ids are all different too)
        scanned = _scan_groups(groups, len(current), live_devices, memo, since)
    if scanned is not None:
        occupied, held_by_job = scanned
        lost: list[str] = []
    else:
        check_ids = len(set(map(operator.itemgetter(0), current))) != len(current)
        occupied, held_by_job, lost = _scan(current, live_devices, check_ids)

    # Capacity: the occupied devices (every one on a host that is not LOST: a learner on
    # another is lost), and the free ones: the unallocated devices of READY hosts that no
    # learner occupies.
    capacity = sum(map(len, occupied.values()))
    free: dict[str, Sequence[str]] = {}
    for host_id, unallocated in spare:
        on_host = occupied.get(host_id)
        ids: Sequence[str] = (
            [d for d in unallocated if d not in on_host] if on_host else unallocated
        )
        if ids:
            capacity += len(ids)
            free[host_id] = ids

    counts = {job_id: len(held) for job_id, held in held_by_job.items()}
    last = memo.order if memo is not None else None
    if last is not None and last[0] is config.policy and last[1] == jobs:
        order = last[2]  # the same demands (immutable), in the same order: the same order
    else:
        order = sorted(jobs, key=admission_key(config.policy))
        if memo is not None:
            memo.order = (config.policy, list(jobs), order)
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


def _hosts(
    inventory: Sequence[HostView],
) -> tuple[dict[str, HostView], dict[str, frozenset[str]], list[tuple[str, tuple[str, ...]]]]:
    """(host id -> view, host id -> device ids of the hosts not LOST, (host id, unallocated
    device ids) of the READY hosts with any, in the inventory's order); raises on a host id
    given twice or a device id given twice on a host."""
    hosts: dict[str, HostView] = {}
    live_devices: dict[str, frozenset[str]] = {}  # device ids of the hosts that are not LOST
    spare: list[tuple[str, tuple[str, ...]]] = []
    for host in inventory:
        host_id = host.host_id
        if host_id in hosts:
            raise ValueError(f"host_id ({host_id!r}) is given more than once")
        hosts[host_id] = host
        if host.repeated is not None:
            raise ValueError(
                f"device_id ({host.repeated!r}) is given more than once on host {host_id}"
            )
        state = host.state
        if state is not HostState.LOST:
            live_devices[host_id] = host.device_ids
            if state is HostState.READY and host.unallocated:
                spare.append((host_id, host.unallocated))
    return hosts, live_devices, spare


def _hosts_again(
    memo: PlanMemo, inventory: Sequence[HostView]
) -> (
    tuple[
        dict[str, HostView], dict[str, frozenset[str]], list[tuple[str, tuple[str, ...]]], list[str]
    ]
    | None
):
    """``_hosts`` of ``inventory`` from what the memo derived from the last one, when it
    differs from it only in a few views (other objects for the same host ids, at the same
    places, none with a repeated device id): (..., the ids of the hosts changed); None
    otherwise (everything derived again, by ``_hosts``)."""
    old = memo.inventory
    if old is None or len(old) != len(inventory):
        return None
    changed = list(itertools.compress(itertools.count(), map(operator.is_not, old, inventory)))
    if not changed:
        return memo.hosts, memo.live_devices, memo.spare, []
    if len(changed) > _FEW_HOSTS:
        return None
    hosts, live_devices = dict(memo.hosts), dict(memo.live_devices)
    respare = False
    ready = HostState.READY
    for i in changed:
        was, host = old[i], inventory[i]
        host_id = host.host_id
        if host_id != was.host_id or host.repeated is not None:
            return None  # (_hosts raises on a repeated device id, in the inventory's order)
        hosts[host_id] = host
        if host.state is HostState.LOST:
            live_devices.pop(host_id, None)
        else:
            live_devices[host_id] = host.device_ids
        if (was.state is ready and was.unallocated) or (host.state is ready and host.unallocated):
            respare = True
    spare = memo.spare
    if respare:
        spare = [
            (h.host_id, h.unallocated) for h in inventory if h.state is ready and h.unallocated
        ]
    return hosts, live_devices, spare, [inventory[i].host_id for i in changed]


#: At most this many hosts changed: ``_hosts_again`` derives them again, not every host.
_FEW_HOSTS = 256


def _scan(
    current: Sequence[LearnerView], live_devices: Mapping[str, frozenset[str]], check_ids: bool
) -> tuple[dict[str, dict[str, str]], dict[str, list[LearnerView]], list[str]]:
    """``plan``'s pass over the learners, one by one: (host -> device -> learner, job -> its
    learners not retiring, the lost learners)."""
    learner_ids: set[str] = set()
    occupied: dict[str, dict[str, str]] = {}  # host -> device -> learner
    held_by_job: dict[str, list[LearnerView]] = {}
    lost: list[str] = []
    # A job's learners come together, mostly on few hosts: the last host's and the last
    # job's entries are looked up again only when the host or the job changes.
    last_host: str | None = None
    devices: frozenset[str] | None = None
    on_host: dict[str, str] | None = None
    last_job: str | None = None
    job_held: list[LearnerView] | None = None
    for learner in current:
        learner_id, job_id, host_id, device_id, retiring = learner
        if check_ids:
            if learner_id in learner_ids:
                raise ValueError(f"learner_id ({learner_id!r}) is given more than once")
            learner_ids.add(learner_id)
        if host_id != last_host:
            last_host = host_id
            devices = live_devices.get(host_id)
            on_host = occupied.get(host_id)
        if devices is None or device_id not in devices:
            lost.append(learner_id)
            continue
        if on_host is None:
            on_host = occupied[host_id] = {device_id: learner_id}
        elif device_id in on_host:
            raise ValueError(
                f"device ({host_id}, {device_id}) is held by two learners: "
                f"{on_host[device_id]} and {learner_id}"
            )
        else:
            on_host[device_id] = learner_id
        if not retiring:
            if job_id != last_job:
                last_job = job_id
                job_held = held_by_job.get(job_id)
                if job_held is None:
                    job_held = held_by_job[job_id] = []
            job_held.append(learner)  # type: ignore[union-attr]
    return occupied, held_by_job, lost


def _scan_groups(
    groups: Mapping[str, tuple[LearnerView, ...]],
    count: int,
    live_devices: Mapping[str, frozenset[str]],
    memo: PlanMemo,
    since: tuple[Mapping[str, frozenset[str]], list[str]] | None = None,
) -> tuple[dict[str, dict[str, str]], dict[str, list[LearnerView]]] | None:
    """``plan``'s pass over the learners, job by job (see ``plan``'s ``groups``): (host ->
    occupied device -> its job, job -> its learners not retiring), or None when a learner is
    lost, two are on one device, or the groups do not add up to ``count`` learners (the
    caller then makes the pass learner by learner).

    When the last call's scan was made against the same host views (``live_devices`` the
    very object the memo derived from them), or against those that ``since`` names (the
    ``live_devices`` of then, the hosts changed since), it is updated, not redone: the
    devices of the jobs whose group is gone or another object, and of the jobs on a changed
    host, are taken out, and their groups put back in, with the same checks (every other
    job's devices were checked against these hosts, and against every other job's, when
    they were put in)."""
    if sum(map(len, groups.values())) != count:
        return None
    last, memo.scan = memo.scan, None  # (until this scan completes)
    digests = memo.jobs
    recheck: list[str] = []
    if last is not None and last[0] is not live_devices:
        if since is not None and last[0] is since[0]:
            recheck = since[1]
        else:
            last = None
    if last is None:
        occupied: dict[str, dict[str, str]] = {}
        held_by_job: dict[str, list[LearnerView]] = {}
        ids: set[str] = set()
        fresh: dict[str, _Digest] = {}
        for job_id, group in groups.items():
            known = digests.get(job_id)
            if known is None or known[0] is not group:
                known = _digest(job_id, group)
                if known is None:
                    return None
            fresh[job_id] = known
            if not _occupy(occupied, job_id, known[2], live_devices):
                return None
            ids.update(known[3])
            if known[1]:
                held_by_job[job_id] = known[1]
        memo.jobs = fresh
        if len(ids) != count:
            return None  # a learner id given twice
    else:
        _, before, occupied, held_by_job, ids = last
        changed = [job_id for job_id, group in groups.items() if before.get(job_id) is not group]
        if recheck:  # the jobs on the hosts changed since the last scan
            on_changed: set[str] = set()
            for host_id in recheck:
                on_host = occupied.get(host_id)
                if on_host:
                    on_changed.update(on_host.values())
            on_changed.difference_update(changed)
            on_changed.intersection_update(groups.keys())
            changed += sorted(on_changed)
        gone = before.keys() - groups.keys()
        for job_id in [*gone, *changed]:
            old = digests.get(job_id)
            if old is not None:  # (the digest of the group last scanned)
                ids.difference_update(old[3])
                for host_id, devices in old[2]:
                    on_host = occupied[host_id]
                    for device_id in devices:
                        del on_host[device_id]
                    if not on_host:
                        del occupied[host_id]
            held_by_job.pop(job_id, None)
        for job_id in gone:
            del digests[job_id]
        for job_id in changed:
            group = groups[job_id]
            known = digests.get(job_id)
            if known is None or known[0] is not group:
                known = _digest(job_id, group)
                if known is None:
                    return None
                digests[job_id] = known
            if not _occupy(occupied, job_id, known[2], live_devices):
                return None
            ids.update(known[3])
            if known[1]:
                held_by_job[job_id] = known[1]
        if len(ids) != count:
            return None  # a learner id given twice
    memo.scan = (live_devices, dict(groups), occupied, held_by_job, ids)
    return occupied, held_by_job


def _occupy(
    occupied: dict[str, dict[str, str]],
    job_id: str,
    per_host: tuple[tuple[str, tuple[str, ...]], ...],
    live_devices: Mapping[str, frozenset[str]],
) -> bool:
    """Put one job's devices in ``occupied``; False if one is not a live host's device (a
    learner lost) or is occupied already."""
    for host_id, devices in per_host:
        live = live_devices.get(host_id)
        if live is None or not live.issuperset(devices):
            return False  # a learner lost
        on_host = occupied.get(host_id)
        if on_host is None:
            occupied[host_id] = dict.fromkeys(devices, job_id)
        elif on_host.keys().isdisjoint(devices):
            on_host.update(dict.fromkeys(devices, job_id))
        else:
            return False  # two learners on one device
    return True


def _digest(job_id: str, group: tuple[LearnerView, ...]) -> _Digest | None:
    """What ``_scan_groups`` keeps of one job's group; None if a learner in it is of another
    job or two of them are on one device."""
    held = []
    on: dict[str, list[str]] = {}
    for learner in group:
        if learner[1] != job_id:
            return None
        devices = on.get(learner[2])
        if devices is None:
            on[learner[2]] = [learner[3]]
        else:
            devices.append(learner[3])
        if not learner[4]:
            held.append(learner)
    per_host = tuple((host_id, tuple(devices)) for host_id, devices in on.items())
    if any(len(set(devices)) != len(devices) for _, devices in per_host):
        return None
    return group, held, per_host, tuple(map(_LEARNER_ID, group))


_LEARNER_ID = operator.itemgetter(0)


def _choose_retires(
    job_id: str, held: list[LearnerView], count: int, hosts: Mapping[str, HostView]
) -> list[Retire]:
    """``count`` of ``held``: cordoned hosts first, then the hosts with the fewest of them."""
    per_host: dict[str, list[LearnerView]] = {}
    for learner in held:
        per_host.setdefault(learner.host_id, []).append(learner)

    def host_order(host_id: str) -> tuple[bool, int, str]:
        ready = hosts[host_id].state is HostState.READY
        return (ready, len(per_host[host_id]), host_id)

    chosen: list[Retire] = []
    for host_id in sorted(per_host, key=host_order):
        for learner in sorted(per_host[host_id], key=lambda x: x.learner_id, reverse=True):
            if len(chosen) == count:
                return chosen
            chosen.append(Retire(job_id, learner.learner_id))
    return chosen


def _choose_starts(
    job_id: str, held: list[LearnerView], need: int, index: _FreeIndex
) -> list[Start]:
    """Up to ``need`` free devices for ``job_id``, packed onto as few hosts as possible."""
    starts: list[Start] = []
    mine = Counter(learner.host_id for learner in held)
    for host_id in sorted(mine, key=lambda h: (-mine[h], -index.count(h), h)):
        if need == 0:
            return starts
        if index.count(host_id):
            taken = index.take(host_id, need)
            starts.extend(Start(job_id, host_id, d) for d in taken)
            need -= len(taken)
    while need > 0 and (best := index.best_host(need)) is not None:
        taken = index.take(best, need)
        starts.extend(Start(job_id, best, d) for d in taken)
        need -= len(taken)
    return starts
