"""Share policy: how many learners each job should hold, as a pure function.

``compute_shares(jobs, capacity, policy)`` turns the jobs' demands and the number of usable
devices into a target worker count per job and the ordered queue of jobs that must wait.

Admission
    Jobs are ranked by priority (highest first), then submit order (FIFO: submit order only),
    and admitted in that order while the sum of the admitted jobs' ``min_workers`` fits the
    capacity. The first job that does not fit stops admission: it and every job ranked after it
    wait in the queue, in rank order (no backfilling, so a large job is never starved by a
    stream of small ones). A running job that is no longer admitted (for example a
    higher-priority job arrived, or a host was lost) is preempted: its share is 0.

Shares of admitted jobs (weighted max-min water-filling)
    Every admitted job gets at least its min and at most its max; the rest of the capacity is
    filled level by level in proportion to the job's weight, and what a capped job cannot use
    goes to the others. Weights: FAIRSHARE 1 for every job, PRIORITY the job's priority. FIFO
    is the limit where each job outweighs every later one: jobs in submit order get as much
    as they want (up to max) before the next one gets more than its min. The continuous shares
    are computed exactly (integer arithmetic) and rounded to integers by the largest-remainder
    method; ties between equal remainders go to the higher priority, then the earlier submit,
    then the smaller job id.

Sticky rounding (``sticky_rounding=True``, the default)
    Plain largest remainder can move a device between two running jobs for nothing but a
    reordering of remainders: when a job finishes every exact share grows, yet a job can fall
    from the ceiling of its old share to the floor of its new one (capacity 11, priorities
    3/1/3/1: 4/2/4/1; the last job finishes, exact 4.71/1.57/4.71, plain LR gives 5/1/5 and
    shrinks the second job). With sticky rounding the units left after flooring go first to
    the jobs that already hold more than their floor (``current > floor``), by largest
    remainder, then to the others by largest remainder. Every share is still the floor or the
    ceiling of its exact share (so equal jobs still differ by at most one); only which jobs get
    the ceiling changes. ``sticky_rounding=False`` is the plain method.
    Sticky rounding never defeats a priority change: when a weight changed (under PRIORITY, an
    admitted job's ``previous_priority`` is set and differs from its ``priority``), what jobs
    hold says nothing about the new weights, so that computation rounds by plain largest
    remainder (4 devices, two jobs at 2/2, one raised from 5000 to 10000: 3/1, where sticky
    rounding would keep 2/2). Churn avoidance only chooses between roundings when no weight
    changed (a job ended, capacity moved).

GOODPUT (goodput-aware shares)
    Admission is PRIORITY's. Every admitted job first gets its *fairness floor*
    ``max(min_workers, floor(fair_fraction * s_i))``, where ``s_i`` is its PRIORITY
    water-filling share (plain largest remainder), capped at its max, or fewer devices where
    fewer are faster: the floor is the world size from min to that bound with the shortest
    predicted iteration. The guarantee is in throughput: with the default ``fair_fraction``
    0.5 no job runs slower than it would on half its fair share. The devices left go one at
    a time to the job with the largest weighted gain ``weight_i * (log S_i(k + 1) - log
    S_i(k))``, where ``S_i`` is the job's predicted speedup (``JobDemand.throughput``, the
    online model of ``shoal.scheduler.throughput``; linear without one), taken over the upper
    concave hull of the curve (a sync cost paid once from 2 learners on is spread over the
    steps it pays for). This greedily maximises ``sum(weight_i * log S_i)`` (weighted
    proportional fairness over speedups; Pollux, OSDI'21, uses a generalised mean of speedups
    for the same purpose): when jobs scale linearly the shares follow the weights as under
    PRIORITY (a 10000 job gets about twice the share of a 5000 job); a device goes elsewhere
    when it speeds its job up less. A device whose best gain is not positive stays free: a job
    that stops scaling stops growing. Ties go to the job least served for its weight, then to
    rank order, so equal jobs differ by at most one. Sticky rounding does not apply (no
    rounding); holds do, with PRIORITY's donors.
    Rescale cost (``rescale_horizon`` > 0): a change of a running job's world size costs it its
    ``rescale_pause_s``, so over the horizon H it runs ``H - pause`` seconds at the new size.
    The size the job holds is therefore valued ``-log(1 - pause / H)`` above its predicted log
    speedup (in the floor and in the hull): a job is resized only when the predicted gain over
    the horizon exceeds the pause (or when min, max, capacity or the other jobs' floors force
    it). ``rescale_horizon`` 0 (the default) turns this off.

Attained service (``service_thresholds``, ``service_decay``; FAIRSHARE, PRIORITY, GOODPUT)
    Tiresias-like least attained service, expressed through the weights: a job's class is the
    number of thresholds (device-seconds, increasing) its ``attained_service`` has reached,
    and its weight is multiplied by ``service_decay ** (len(thresholds) - class)``. A job that
    has received little service therefore gets a larger share, and a long job's weight drops
    by ``service_decay`` at each threshold. Bounds: a job changes class at most
    ``len(thresholds)`` times (classes only go up, so shares do not thrash), and a job's weight
    is never less than ``service_decay ** -len(thresholds)`` of a fresh job of the same
    priority (defaults 2 and no thresholds: the rule is off); every admitted job keeps its
    min, so no long job is starved. Admission is unchanged (priority, then submit order).

Anti-thrash (hold time): the exact rule
    A job is *held* when ``last_shrunk_at`` is set, ``now - last_shrunk_at < hold_time`` and its
    water-filling share is below ``min(current, max_workers)``. Held jobs are visited in rank
    order (priority, then submit order); each takes back units, one at a time, until it reaches
    ``min(current, max_workers)``, from *donors*: admitted jobs that are not held, nor shrunk
    within the hold time to a share not above what they hold (a job shrunk to its share gives
    nothing to another held job: it would be shrunk again a cycle later, within its hold
    time), whose priority is lower than or equal to the held job's priority, and that are
    above their ``min_workers``. The donor taken from is the most over-served one (highest
    share / weight; FIFO: the latest submitted), ties to the lower priority, then the later
    submit. Hence a held job, or one shrunk to its share, is shrunk again within its hold time
    only as far as
      * jobs of strictly higher priority need the devices for their water-filling shares, or
      * other admitted jobs need their ``min_workers`` (a hold never blocks admission), or
      * other held jobs ranked before it keep their own devices.
    Holds never change which jobs are admitted, and a preempted job (not admitted) is not held.
    ``hold_time == 0`` disables the rule. A job whose share is not below what it holds is never
    held (it takes nothing back); within its hold time it gives nothing either, unless its
    share is above what it holds (it is growing).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shoal.scheduler.throughput import ThroughputCurve

__all__ = [
    "Allocation",
    "JobDemand",
    "Policy",
    "admission_key",
    "compute_shares",
    "rank_key",
    "service_class",
]


class Policy(enum.Enum):
    """How the capacity is shared among admitted jobs."""

    FIFO = "fifo"
    """Jobs in submit order get as many workers as they want (up to max) before the next one."""
    FAIRSHARE = "fairshare"
    """Equal weights: max-min fair shares."""
    PRIORITY = "priority"
    """Weights proportional to the jobs' priorities."""
    GOODPUT = "goodput"
    """Devices to the jobs they speed up most (weighted by priority), above a fairness floor."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDemand:
    """What one job asks of the scheduler; validated on construction.

    Attributes:
        job_id: unique, non-empty.
        priority: > 0; higher is more important (the reference scenario uses 5000).
        submit_seq: submit order (smaller was submitted earlier).
        min_workers: the fewest learners the job can run with (>= 1).
        max_workers: the most learners the job can use (>= min_workers).
        current: learners the job holds now (not counting those already retiring).
        last_shrunk_at: when the scheduler last decided to shrink the job (same clock as
            ``now``), or None if never.
        previous_priority: the priority its current share was decided with, or None when
            unknown (a change of it turns sticky rounding off for that computation).
        throughput: the job's predicted iteration time per world size (GOODPUT reads its
            speedups; None: linear speedup, as if the job scaled perfectly).
        attained_service: device-seconds the job has held so far (the attained-service
            classes read it; >= 0).
        rescale_pause_s: the seconds a change of the job's world size costs it (measured;
            GOODPUT with a rescale horizon reads it; >= 0).
    """

    job_id: str
    priority: int
    submit_seq: int
    max_workers: int
    min_workers: int = 1
    current: int = 0
    last_shrunk_at: float | None = None
    previous_priority: int | None = None
    throughput: ThroughputCurve | None = None
    attained_service: float = 0.0
    rescale_pause_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ValueError(f"job_id ({self.job_id!r}) must be non-empty")
        who = f"for job {self.job_id}"
        if self.priority <= 0:
            raise ValueError(f"priority ({self.priority}) must be > 0 {who}")
        if self.min_workers < 1:
            raise ValueError(f"min_workers ({self.min_workers}) must be >= 1 {who}")
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"max_workers ({self.max_workers}) must be >= min_workers "
                f"({self.min_workers}) {who}"
            )
        if self.current < 0:
            raise ValueError(f"current ({self.current}) must be >= 0 {who}")
        if self.previous_priority is not None and self.previous_priority <= 0:
            raise ValueError(f"previous_priority ({self.previous_priority}) must be > 0 {who}")
        if not (self.attained_service >= 0 and math.isfinite(self.attained_service)):
            raise ValueError(f"attained_service ({self.attained_service}) must be >= 0 {who}")
        if not (self.rescale_pause_s >= 0 and math.isfinite(self.rescale_pause_s)):
            raise ValueError(f"rescale_pause_s ({self.rescale_pause_s}) must be >= 0 {who}")

    @property
    def priority_changed(self) -> bool:
        """The priority differs from the one its current share was decided with."""
        return self.previous_priority is not None and self.previous_priority != self.priority


@dataclass(frozen=True, slots=True)
class Allocation:
    """The result of ``compute_shares``.

    Attributes:
        shares: target worker count for every job given (0 for queued jobs).
        queue: the jobs that cannot get their minimum, in the order they will be admitted.
        held: admitted jobs kept above their water-filling share by the hold-time rule.
    """

    shares: Mapping[str, int]
    queue: tuple[str, ...] = ()
    held: frozenset[str] = field(default_factory=frozenset)

    def share(self, job_id: str) -> int:
        """The target of ``job_id``; 0 for a job that is unknown or queued."""
        return self.shares.get(job_id, 0)


def rank_key(job: JobDemand) -> tuple[int, int, str]:
    """Sort key of the priority-then-submit order (most important first)."""
    return (-job.priority, job.submit_seq, job.job_id)


def _fifo_key(job: JobDemand) -> tuple[int, int, str]:
    return (job.submit_seq, 0, job.job_id)


def admission_key(policy: Policy) -> Callable[[JobDemand], tuple[int, int, str]]:
    """Sort key of the order in which ``policy`` admits jobs and hands out free devices."""
    return _fifo_key if policy is Policy.FIFO else rank_key


def compute_shares(
    jobs: Sequence[JobDemand],
    capacity: int,
    policy: Policy,
    *,
    now: float = 0.0,
    hold_time: float = 0.0,
    sticky_rounding: bool = True,
    fair_fraction: float = 0.5,
    service_thresholds: Sequence[float] = (),
    service_decay: int = 2,
    rescale_horizon: float = 0.0,
    held: Mapping[str, int] | None = None,
    ordered: bool = False,
) -> Allocation:
    """Target worker counts for ``jobs`` on ``capacity`` devices under ``policy``.

    See the module docstring for admission, water-filling, (sticky) rounding and the
    hold-time rule.
    Deterministic: the same input gives the same output, whatever the order of ``jobs``.

    ``fair_fraction`` is GOODPUT's fairness floor and ``rescale_horizon`` its rescale cost;
    ``service_thresholds`` and ``service_decay`` are the attained-service classes (see the
    module docstring). ``held``, when given, is the learners each job holds now by job id,
    read instead of ``JobDemand.current`` (a job it does not list holds 0): placement passes
    its observed counts this way instead of copying every job. ``ordered``: the caller
    guarantees ``jobs`` is already sorted by ``admission_key(policy)`` (the incremental planner
    keeps it so between job events); the sort is skipped.

    Raises:
        ValueError: capacity < 0, hold_time < 0, fair_fraction outside [0, 1], thresholds not
            positive and increasing, service_decay < 1, or a job id given twice (the message
            names the field and the value). Invalid jobs are rejected when ``JobDemand`` is
            built.
    """
    if capacity < 0:
        raise ValueError(f"capacity ({capacity}) must be >= 0")
    if hold_time < 0:
        raise ValueError(f"hold_time ({hold_time}) must be >= 0")
    if not 0.0 <= fair_fraction <= 1.0:
        raise ValueError(f"fair_fraction ({fair_fraction}) must be in [0, 1]")
    if not (rescale_horizon >= 0 and math.isfinite(rescale_horizon)):
        raise ValueError(f"rescale_horizon ({rescale_horizon}) must be >= 0")
    _check_service_classes(service_thresholds, service_decay)
    seen: set[str] = set()
    for job in jobs:
        if job.job_id in seen:
            raise ValueError(f"job_id ({job.job_id!r}) is given more than once")
        seen.add(job.job_id)

    if held is not None:
        for job_id, count in held.items():
            if count < 0:
                raise ValueError(f"held[{job_id!r}] ({count}) must be >= 0")
        if policy is Policy.GOODPUT:
            # GOODPUT reads current in many places: copy the (few) jobs whose count differs.
            jobs = [
                j if j.current == held.get(j.job_id, 0) else _with_current(j, held.get(j.job_id, 0))
                for j in jobs
            ]
            held = None
    order = list(jobs) if ordered else sorted(jobs, key=admission_key(policy))
    admitted: list[JobDemand] = []
    used = 0
    for i, job in enumerate(order):
        if used + job.min_workers > capacity:
            queue = tuple(j.job_id for j in order[i:])
            break
        admitted.append(job)
        used += job.min_workers
    else:
        queue = ()

    if held is None:
        current = [j.current for j in admitted]
    else:
        current = [held.get(j.job_id, 0) for j in admitted]
    if policy is Policy.FIFO:
        ideal = _fifo_fill(admitted, capacity)
        weights = [1] * len(admitted)
    else:
        by_priority = policy in (Policy.PRIORITY, Policy.GOODPUT)
        weights = [j.priority if by_priority else 1 for j in admitted]
        if service_thresholds:
            top = len(service_thresholds)
            weights = [
                w * service_decay ** (top - service_class(j.attained_service, service_thresholds))
                for w, j in zip(weights, admitted, strict=True)
            ]
        reweighted = by_priority and any(j.priority_changed for j in admitted)
        if policy is Policy.GOODPUT:
            fair = _water_fill(admitted, weights, capacity, False, current)
            ideal = _goodput_fill(admitted, weights, fair, capacity, fair_fraction, rescale_horizon)
        else:
            ideal = _water_fill(
                admitted, weights, capacity, sticky_rounding and not reweighted, current
            )

    final, kept = _apply_holds(admitted, weights, ideal, policy, now, hold_time, current)
    shares = dict.fromkeys(queue, 0)
    shares.update((j.job_id, s) for j, s in zip(admitted, final, strict=True))
    return Allocation(shares=shares, queue=queue, held=frozenset(kept))


def _with_current(job: JobDemand, current: int) -> JobDemand:
    """``replace(job, current=current)`` without validating again (job was validated)."""
    new = object.__new__(JobDemand)
    for name in JobDemand.__slots__:
        object.__setattr__(new, name, getattr(job, name))
    object.__setattr__(new, "current", current)
    return new


def service_class(attained: float, thresholds: Sequence[float]) -> int:
    """The attained-service class of a job: how many of ``thresholds`` it has reached."""
    return sum(1 for t in thresholds if attained >= t)


def _check_service_classes(thresholds: Sequence[float], decay: int) -> None:
    previous = 0.0
    for i, t in enumerate(thresholds):
        if not (math.isfinite(t) and t > previous):
            raise ValueError(
                f"service_thresholds[{i}] ({t}) must be finite, > 0 and greater than the one before"
            )
        previous = t
    if isinstance(decay, bool) or not isinstance(decay, int) or decay < 1:
        raise ValueError(f"service_decay ({decay!r}) must be an integer >= 1")


def _stay_bonus(job: JobDemand, horizon: float) -> float:
    """The log-throughput a running job loses over ``horizon`` seconds if its size changes:
    it runs ``horizon - pause`` of them (0 without a horizon or for a job holding nothing)."""
    if horizon <= 0 or job.current <= 0:
        return 0.0
    return -math.log(max(1.0 - job.rescale_pause_s / horizon, 1e-9))


def _speedups(job: JobDemand, low: int, high: int, bonus: float = 0.0) -> list[float]:
    """log speedup of ``job`` at world sizes low..high (linear speedup without a curve), plus
    ``bonus`` at the size it holds now."""
    curve = job.throughput
    if curve is None:
        values = [math.log(k) for k in range(low, high + 1)]
    else:
        t1 = curve.iteration_time(1)
        values = [math.log(t1 / curve.iteration_time(k)) for k in range(low, high + 1)]
    if bonus and low <= job.current <= high:
        values[job.current - low] += bonus
    return values


def _hull(values: list[float]) -> tuple[list[float], list[int]]:
    """Per-unit gains of the upper concave hull of the points (i, values[i]), and its vertices.

    ``gains[i]`` is the gain of the unit from i to i + 1: non-increasing, so a unit that only
    pays off together with later ones (a sync cost paid once from 2 learners on) is priced at
    the average gain of the whole step.
    """
    hull: list[int] = []
    for i in range(len(values)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is not above the chord from a to i: drop it.
            if (values[b] - values[a]) * (i - a) <= (values[i] - values[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(i)
    gains: list[float] = []
    for a, b in itertools.pairwise(hull):
        slope = (values[b] - values[a]) / (b - a)
        gains.extend([slope] * (b - a))
    return gains, hull


def _floor(job: JobDemand, guaranteed: float, bonus: float) -> int:
    """GOODPUT's fairness floor: the fastest world size from min to ``floor(guaranteed)``
    (the smallest of equals; linear speedup without a curve: the top of the range), counting
    the size the job holds as faster by ``bonus`` (the pause it saves)."""
    top = min(job.max_workers, max(job.min_workers, math.floor(guaranteed)))
    if top == job.min_workers:
        return top
    values = _speedups(job, job.min_workers, top, bonus)
    best = max(range(len(values)), key=lambda i: (round(values[i], 12), -i))
    return job.min_workers + best


def _goodput_fill(
    admitted: list[JobDemand],
    weights: list[int],
    fair: list[int],
    capacity: int,
    fair_fraction: float,
    horizon: float = 0.0,
) -> list[int]:
    """GOODPUT shares: the fairness floor, then each unit to the largest weighted gain.

    Maximises sum(weight_i * log speedup_i(share_i)) greedily over the concave hulls of the
    jobs' curves (weighted proportional fairness: with linear speedups it gives shares in
    proportion to the weights, like PRIORITY), starting from each job's floor (``_floor``).
    A unit whose best gain is <= 0 is left free:
    a job that stops scaling stops growing. A job the devices ran out on in the middle of a
    hull step (its share slower than the step's start) goes back to the step's start and stops
    growing, and what it gave back goes on to the others.
    """
    bonuses = [_stay_bonus(j, horizon) for j in admitted]
    floors = [
        _floor(j, fair_fraction * f, b) for j, f, b in zip(admitted, fair, bonuses, strict=True)
    ]
    shares = list(floors)
    left = capacity - sum(shares)
    if left <= 0:
        return shares
    scale = _ratio_key_scale(weights)
    highs = [min(j.max_workers, floors[i] + left) for i, j in enumerate(admitted)]
    for i, job in enumerate(admitted):
        if job.throughput is not None and highs[i] > floors[i]:
            # Past its fastest size a job's curve only falls: no unit there is ever given
            # (only the size it holds may be worth keeping, for its pause).
            best = job.throughput.best_world_size(highs[i])
            keep = job.current if bonuses[i] else 0
            highs[i] = max(floors[i], min(highs[i], max(best, keep)))

    def hull_of(i: int) -> tuple[list[float], list[int]]:
        if highs[i] <= floors[i]:
            return [], [0]
        return _hull(_speedups(admitted[i], floors[i], highs[i], bonuses[i]))

    gains: list[list[float]] = []
    vertices: list[list[int]] = []
    for i in range(len(admitted)):
        g, v = hull_of(i)
        gains.append(g)
        vertices.append(v)
    frozen: set[int] = set()
    while True:
        heap = [
            _unit_key(gains[i][shares[i] - floors[i]], shares[i], weights[i], scale, job, i)
            for i, job in enumerate(admitted)
            if i not in frozen and shares[i] - floors[i] < len(gains[i])
        ]
        heapq.heapify(heap)
        while left > 0 and heap:
            key = heapq.heappop(heap)
            if key[0] >= 0:
                break  # the best gain left is not positive
            i = key[-1]
            shares[i] += 1
            left -= 1
            step = shares[i] - floors[i]
            if step < len(gains[i]):
                heapq.heappush(
                    heap, _unit_key(gains[i][step], shares[i], weights[i], scale, admitted[i], i)
                )
        stuck = [i for i in range(len(admitted)) if shares[i] - floors[i] not in vertices[i]]
        dropped = [i for i in stuck if bonuses[i]]
        if dropped:
            # These cannot reach the size they hold (that step needs more than is left): they
            # pay the pause anyway, so their curves lose the bonus and the fill starts over.
            for i in dropped:
                bonuses[i] = 0.0
                gains[i], vertices[i] = hull_of(i)
            shares = list(floors)
            left = capacity - sum(shares)
            continue
        for i in stuck:
            step = shares[i] - floors[i]
            back = max(v for v in vertices[i] if v < step)
            left += step - back
            shares[i] = floors[i] + back
            frozen.add(i)
        if not stuck or left <= 0:
            return shares  # every job at a vertex of its hull, or nothing left to give


def _unit_key(
    gain: float, share: int, weight: int, scale: int, job: JobDemand, i: int
) -> tuple[float, int, int, int, str, int]:
    # Largest weighted gain first (rounded so that equal curves tie exactly), then the job
    # least served for its weight (equal jobs differ by at most one), then rank order.
    return (
        -round(gain * weight, 9),
        (share * scale) // weight,
        -job.priority,
        job.submit_seq,
        job.job_id,
        i,
    )


def _fifo_fill(admitted: list[JobDemand], capacity: int) -> list[int]:
    """Mins for all, then the rest in (already sorted) submit order up to each max."""
    shares = [j.min_workers for j in admitted]
    left = capacity - sum(shares)
    for i, job in enumerate(admitted):
        if left <= 0:
            break
        extra = min(left, job.max_workers - job.min_workers)
        shares[i] += extra
        left -= extra
    return shares


def _ratio_key_scale(weights: Sequence[int]) -> int:
    """A factor K such that ``(a * K) // w`` orders the fractions a/w exactly.

    Two distinct fractions a/b < c/d with b, d <= W differ by at least 1 / W**2, so with
    K > W**2 their scaled floors differ and keep the order; equal fractions get equal keys.
    """
    top = max(weights, default=1)
    return top * top + 1


def _water_fill(
    admitted: list[JobDemand],
    weights: list[int],
    capacity: int,
    sticky: bool,
    current: list[int],
) -> list[int]:
    """Weighted max-min water-filling with [min, max] bounds, rounded by largest remainder.

    The continuous share of job i at water level L is clamp(w_i * L, min_i, max_i); the sum is
    piecewise linear and non-decreasing in L. We sweep the breakpoints (min_i / w_i where job i
    starts to grow, max_i / w_i where it is capped) to find the exact L* = num / den whose sum
    equals the capacity (integer arithmetic throughout), then floor the shares and hand out
    the remaining units by largest remainder (first to the jobs holding more than their floor
    when ``sticky``). Requires sum(min) <= capacity (admission guarantees it).
    """
    if sum(j.max_workers for j in admitted) <= capacity:
        return [j.max_workers for j in admitted]

    scale = _ratio_key_scale(weights)
    events: list[tuple[int, int, int]] = []  # (exact order key of the level, kind, index)
    for i, job in enumerate(admitted):
        if job.min_workers < job.max_workers:
            w = weights[i]
            events.append(((job.min_workers * scale) // w, 1, i))  # starts to grow
            events.append(((job.max_workers * scale) // w, 0, i))  # capped
    events.sort()

    fixed = sum(j.min_workers for j in admitted)  # sum of the shares not growing with L
    active = 0  # sum of the weights of the jobs growing with L
    num, den = 0, 1
    for _, kind, i in events:
        job, w = admitted[i], weights[i]
        bound = job.min_workers if kind else job.max_workers  # this breakpoint is L = bound / w
        if fixed * w + active * bound >= capacity * w:
            # The crossing lies before this breakpoint. With active == 0 the sum is flat, which
            # only happens when sum(min) == capacity: every job stays at its min (L = 0).
            if active:
                num, den = capacity - fixed, active
            break
        if kind:
            fixed -= job.min_workers
            active += w
        else:
            fixed += job.max_workers
            active -= w

    shares: list[int] = []
    remainders: list[tuple[bool, int, int, int, str, int]] = []
    for i, job in enumerate(admitted):
        scaled = weights[i] * num  # the exact share is scaled / den
        if scaled <= job.min_workers * den:
            shares.append(job.min_workers)
        elif scaled >= job.max_workers * den:
            shares.append(job.max_workers)
        else:
            whole, rem = divmod(scaled, den)
            shares.append(whole)
            if rem:
                keeps = sticky and current[i] > whole
                remainders.append((not keeps, -rem, -job.priority, job.submit_seq, job.job_id, i))
    left = capacity - sum(shares)
    # The exact shares sum to the capacity, so 0 <= left < len(remainders) + 1.
    for *_, i in sorted(remainders)[:left]:
        shares[i] += 1
    return shares


def _apply_holds(
    admitted: list[JobDemand],
    weights: list[int],
    ideal: list[int],
    policy: Policy,
    now: float,
    hold_time: float,
    current: list[int],
) -> tuple[list[int], list[str]]:
    """Apply the hold-time rule of the module docstring to the water-filling shares
    (``current[i]``: what ``admitted[i]`` holds)."""
    if hold_time <= 0:
        return ideal, []
    # Shrunk within the hold time, and not to grow: none gives to a held job (one that shrank
    # to its share would be shrunk again, one cycle later, for a hold that took from another
    # donor while it was held itself). Held: those whose share is below what they hold.
    covered = [
        i
        for i, job in enumerate(admitted)
        if job.last_shrunk_at is not None
        and now - job.last_shrunk_at < hold_time
        and ideal[i] <= min(current[i], job.max_workers)
    ]
    holders = [i for i in covered if ideal[i] < min(current[i], admitted[i].max_workers)]
    if not holders:
        return ideal, []
    shares = list(ideal)
    holders.sort(key=lambda i: rank_key(admitted[i]))
    not_donors = set(covered)  # (the holders among them)
    scale = _ratio_key_scale(weights)

    def donor_key(i: int) -> tuple[int, int, int, int]:
        job = admitted[i]
        if policy is Policy.FIFO:
            over = job.submit_seq  # the latest submitted gives first
        else:
            over = (shares[i] * scale) // weights[i]  # the most over-served gives first
        return (-over, job.priority, -job.submit_seq, i)

    donors = [
        donor_key(i)
        for i, job in enumerate(admitted)
        if i not in not_donors and shares[i] > job.min_workers
    ]
    heapq.heapify(donors)
    held: list[str] = []
    for h in holders:
        job = admitted[h]
        want = min(current[h], job.max_workers) - shares[h]
        while want > 0 and donors:
            donor = donors[0][-1]
            if admitted[donor].priority > job.priority:
                # Outranks this holder and every later one (visited by priority): never gives.
                heapq.heappop(donors)
                continue
            shares[donor] -= 1
            shares[h] += 1
            want -= 1
            if shares[donor] > admitted[donor].min_workers:
                heapq.heapreplace(donors, donor_key(donor))
            else:
                heapq.heappop(donors)
        if shares[h] > ideal[h]:
            held.append(job.job_id)
    return shares, held
