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

Anti-thrash (hold time): the exact rule
    A job is *held* when ``last_shrunk_at`` is set, ``now - last_shrunk_at < hold_time`` and its
    water-filling share is below ``min(current, max_workers)``. Held jobs are visited in rank
    order (priority, then submit order); each takes back units, one at a time, until it reaches
    ``min(current, max_workers)``, from *donors*: admitted jobs that are not held, whose
    priority is lower than or equal to the held job's priority, and that are above their
    ``min_workers``. The donor taken from is the most over-served one (highest share / weight;
    FIFO: the latest submitted), ties to the lower priority, then the later submit. Hence a held
    job is shrunk again within its hold time only as far as
      * jobs of strictly higher priority need the devices for their water-filling shares, or
      * other admitted jobs need their ``min_workers`` (a hold never blocks admission), or
      * other held jobs ranked before it keep their own devices.
    Holds never change which jobs are admitted, and a preempted job (not admitted) is not held.
    ``hold_time == 0`` disables the rule. A job whose share is not below what it holds is never
    held; the rule only makes it wait as a donor.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Allocation", "JobDemand", "Policy", "admission_key", "compute_shares", "rank_key"]


class Policy(enum.Enum):
    """How the capacity is shared among admitted jobs."""

    FIFO = "fifo"
    """Jobs in submit order get as many workers as they want (up to max) before the next one."""
    FAIRSHARE = "fairshare"
    """Equal weights: max-min fair shares."""
    PRIORITY = "priority"
    """Weights proportional to the jobs' priorities."""


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
    """

    job_id: str
    priority: int
    submit_seq: int
    max_workers: int
    min_workers: int = 1
    current: int = 0
    last_shrunk_at: float | None = None
    previous_priority: int | None = None

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
) -> Allocation:
    """Target worker counts for ``jobs`` on ``capacity`` devices under ``policy``.

    See the module docstring for admission, water-filling, (sticky) rounding and the
    hold-time rule.
    Deterministic: the same input gives the same output, whatever the order of ``jobs``.

    Raises:
        ValueError: capacity < 0, hold_time < 0, or a job id given twice (the message names
            the field and the value). Invalid jobs are rejected when ``JobDemand`` is built.
    """
    if capacity < 0:
        raise ValueError(f"capacity ({capacity}) must be >= 0")
    if hold_time < 0:
        raise ValueError(f"hold_time ({hold_time}) must be >= 0")
    seen: set[str] = set()
    for job in jobs:
        if job.job_id in seen:
            raise ValueError(f"job_id ({job.job_id!r}) is given more than once")
        seen.add(job.job_id)

    order = sorted(jobs, key=admission_key(policy))
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

    if policy is Policy.FIFO:
        ideal = _fifo_fill(admitted, capacity)
        weights = [1] * len(admitted)
    else:
        weights = [j.priority if policy is Policy.PRIORITY else 1 for j in admitted]
        reweighted = policy is Policy.PRIORITY and any(j.priority_changed for j in admitted)
        ideal = _water_fill(admitted, weights, capacity, sticky_rounding and not reweighted)

    final, held = _apply_holds(admitted, weights, ideal, policy, now, hold_time)
    shares = dict.fromkeys(queue, 0)
    shares.update((j.job_id, s) for j, s in zip(admitted, final, strict=True))
    return Allocation(shares=shares, queue=queue, held=frozenset(held))


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
    admitted: list[JobDemand], weights: list[int], capacity: int, sticky: bool
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
                keeps = sticky and job.current > whole
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
) -> tuple[list[int], list[str]]:
    """Apply the hold-time rule of the module docstring to the water-filling shares."""
    if hold_time <= 0:
        return ideal, []
    holders = [
        i
        for i, job in enumerate(admitted)
        if job.last_shrunk_at is not None
        and now - job.last_shrunk_at < hold_time
        and ideal[i] < min(job.current, job.max_workers)
    ]
    if not holders:
        return ideal, []
    shares = list(ideal)
    holders.sort(key=lambda i: rank_key(admitted[i]))
    held_set = set(holders)
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
        if i not in held_set and shares[i] > job.min_workers
    ]
    heapq.heapify(donors)
    held: list[str] = []
    for h in holders:
        job = admitted[h]
        want = min(job.current, job.max_workers) - shares[h]
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
