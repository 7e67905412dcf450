"""The opt-in adaptive batch: the spec's validation, the scheduler's choice of the batch
(shoal.scheduler.adaptive_batch), the sample positions across batch changes and the
learning-rate rules (shoal.contract.batch_schedule)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from shoal.contract.batch_schedule import (
    BatchRule,
    BatchSchedule,
    Segment,
    scaled_learning_rate,
)
from shoal.learner import partition
from shoal.param_sync.coordinator import (
    Action,
    CheckpointTask,
    Coordinator,
    JobSettings,
    ScheduleTask,
)
from shoal.runtime.auth import Principal, Role
from shoal.runtime.errors import FailedPrecondition, InvalidField
from shoal.scheduler.adaptive_batch import (
    AdaptiveBounds,
    choose_batch,
    efficiency,
    goodput,
    iteration_time,
)
from shoal.scheduler.goodput import GoodputTracker
from shoal.scheduler.jobs import validate_spec
from shoal.scheduler.throughput import ThroughputCurve
from shoal.v1 import job_pb2

ALICE = Principal("alice", Role.USER)
LINEAR = job_pb2.BATCH_SCALING_RULE_LINEAR
SQRT = job_pb2.BATCH_SCALING_RULE_SQRT


def spec(batch: int = 64, lo: int = 32, hi: int = 512, rule: int = LINEAR) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(
        name="mnist",
        entry_point="train.py",
        artifact_id="ab" * 32,
        batch_size=batch,
        epochs=2,
        max_workers=4,
        adaptive_batch=job_pb2.AdaptiveBatch(min_global_batch=lo, max_global_batch=hi, rule=rule),
    )


# -- validation at submit ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field_name", "value_text"),
    [
        ({"lo": 0}, "spec.adaptive_batch.min_global_batch", "(0)"),
        ({"lo": -4}, "spec.adaptive_batch.min_global_batch", "(-4)"),
        ({"lo": 64, "hi": 48}, "spec.adaptive_batch.max_global_batch", "(48)"),
        ({"hi": (1 << 20) + 1}, "spec.adaptive_batch.max_global_batch", "(1048577)"),
        ({"batch": 16}, "spec.batch_size", "(16)"),
        ({"batch": 1024}, "spec.batch_size", "(1024)"),
        ({"rule": job_pb2.BATCH_SCALING_RULE_UNSPECIFIED}, "spec.adaptive_batch.rule", "(0)"),
        ({"rule": 9}, "spec.adaptive_batch.rule", "(9)"),
    ],
)
def test_a_bad_adaptive_batch_is_refused_naming_the_field_and_value(
    kwargs: dict[str, int], field_name: str, value_text: str
) -> None:
    raw = spec(**kwargs)
    before = raw.SerializeToString(deterministic=True)
    with pytest.raises(InvalidField) as caught:
        validate_spec(raw, principal=ALICE)
    assert caught.value.field_name == field_name
    assert str(caught.value).startswith(f"{field_name} {value_text}")
    assert raw.SerializeToString(deterministic=True) == before  # nothing changed


def test_a_valid_adaptive_batch_is_kept_and_a_spec_without_one_stays_without() -> None:
    clean = validate_spec(spec(batch=64, lo=64, hi=64, rule=SQRT), principal=ALICE)
    assert clean.HasField("adaptive_batch")
    assert (clean.adaptive_batch.min_global_batch, clean.adaptive_batch.max_global_batch) == (
        64,
        64,
    )
    plain = job_pb2.JobSpec()
    plain.CopyFrom(spec())
    plain.ClearField("adaptive_batch")
    assert not validate_spec(plain, principal=ALICE).HasField("adaptive_batch")
    assert AdaptiveBounds.of(plain) is None


# -- the scheduler's choice -------------------------------------------------------------------

SYNC_BOUND = ThroughputCurve(overhead=0.01, compute=0.1, sync=0.3, sync_per_worker=0.05, batch=64)
COMPUTE_BOUND = ThroughputCurve(overhead=0.0, compute=1.0, sync=0.0, sync_per_worker=0.0, batch=64)


def test_iteration_time_scales_only_the_divided_part_with_the_batch() -> None:
    assert iteration_time(SYNC_BOUND, 2, 64) == pytest.approx(SYNC_BOUND.iteration_time(2))
    assert iteration_time(SYNC_BOUND, 2, 128) == pytest.approx(0.01 + 0.2 / 2 + 0.3 + 0.05)
    with pytest.raises(ValueError, match=r"batch \(0\)"):
        iteration_time(SYNC_BOUND, 1, 0)


def test_efficiency_is_one_at_the_declared_batch_and_two_thirds_at_twice_it() -> None:
    assert efficiency(64, 64) == 1.0
    assert efficiency(128, 64) == pytest.approx(2 / 3)
    assert efficiency(128, 64, noise_scale=1e9) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="noise_scale"):
        efficiency(1, 1, noise_scale=math.nan)


def test_the_batch_grows_with_the_world_size_of_a_sync_bound_job() -> None:
    bounds = AdaptiveBounds(64, 32, 4096)
    picks = [choose_batch(SYNC_BOUND, w, bounds) for w in (1, 2, 4, 8)]
    assert picks == sorted(picks) and picks[-1] > picks[0]
    assert picks[-1] > 64
    # The pick is the best of its candidates, within a quarter octave of the model's optimum.
    for w, b in zip((1, 2, 4, 8), picks, strict=True):
        a = SYNC_BOUND.overhead + (SYNC_BOUND.sync + SYNC_BOUND.sync_per_worker * (w - 1)) * (w > 1)
        optimum = 64 * math.sqrt(w * a / SYNC_BOUND.compute)
        clipped = min(max(optimum, 32), 4096)
        assert clipped / 2**0.25 <= b <= clipped * 2**0.25
        assert goodput(SYNC_BOUND, w, b, 64) >= goodput(SYNC_BOUND, w, 64, 64)


def test_a_compute_bound_job_never_gains_from_a_larger_batch() -> None:
    # No overhead, no sync: throughput does not depend on the batch, efficiency falls with it.
    bounds = AdaptiveBounds(64, 64, 1024)
    assert [choose_batch(COMPUTE_BOUND, w, bounds) for w in (1, 4, 16)] == [64, 64, 64]


def test_the_batch_in_use_is_kept_unless_the_best_is_clearly_better() -> None:
    bounds = AdaptiveBounds(64, 32, 4096)
    best = choose_batch(SYNC_BOUND, 8, bounds)
    near = next(b for b in range(best - 1, 31, -1) if b != best)
    # A batch in use just below the best is within 5% of it: kept.
    assert goodput(SYNC_BOUND, 8, near, 64) * 1.05 >= goodput(SYNC_BOUND, 8, best, 64)
    assert choose_batch(SYNC_BOUND, 8, bounds, current=near) == near
    # Far away (the declared batch at 8 learners of a sync-bound job): the best is taken.
    assert goodput(SYNC_BOUND, 8, 64, 64) * 1.05 < goodput(SYNC_BOUND, 8, best, 64)
    assert choose_batch(SYNC_BOUND, 8, bounds, current=64) == best
    assert choose_batch(SYNC_BOUND, 8, bounds, current=64, min_gain=10.0) == 64
    assert choose_batch(SYNC_BOUND, 8, bounds, current=8192) == best  # out of bounds: not kept


def test_the_pick_stays_within_the_bounds() -> None:
    assert choose_batch(SYNC_BOUND, 16, AdaptiveBounds(64, 64, 100)) == 100
    assert choose_batch(COMPUTE_BOUND, 1, AdaptiveBounds(64, 1, 64)) == 1
    assert choose_batch(SYNC_BOUND, 8, AdaptiveBounds(64, 64, 64)) == 64
    with pytest.raises(ValueError, match="min 65"):
        AdaptiveBounds(64, 65, 100)


def test_jobs_get_shows_the_batch_the_scheduler_picks_only_for_jobs_that_opt_in() -> None:
    tracker = GoodputTracker()
    job = job_pb2.Job(job_id="job-1", spec=spec(batch=64, lo=64, hi=4096), target_workers=8)
    plain = job_pb2.Job(job_id="job-2", spec=spec(), target_workers=8)
    plain.spec.ClearField("adaptive_batch")
    for j in (job, plain):
        for i in range(6):
            t = 100.0 + i
            progress = job_pb2.JobProgress(
                completed_iterations=10 * (i + 1),
                world_size=8,
                generation=1,
                global_batch=j.adaptive_batch_size or 64,
                compute_seconds=0.01,  # of the 0.1 s per iteration: sync-bound
                sync_seconds=0.09,
            )
            progress.update_time.FromSeconds(int(t))
            tracker.observe_job(j, progress, t)
            if i == 0:  # nothing measured yet: the declared batch, not the prior's pick
                assert j is plain or j.adaptive_batch_size == 64
    assert job.HasField("throughput") and plain.HasField("throughput")
    # Reviewed after 3 measured iterations at 8 learners: the model's pick for a sync-bound
    # job is a larger batch, and it is final at this world size.
    assert job.adaptive_batch_size > 64
    plan = tracker._jobs["job-1"].batch_plan
    assert plan is not None and plan.final and plan.batch == job.adaptive_batch_size
    assert plain.adaptive_batch_size == 0


# -- sample positions across batch changes ----------------------------------------------------


def visited(schedule: BatchSchedule, epochs: int) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = {}
    for k in range(schedule.total_iterations(epochs)):
        p = schedule.locate(k)
        assert p.batch == schedule.batch_at(k)
        out.setdefault(p.epoch, []).append((p.start, p.stop))
    return out


def test_a_fixed_schedule_is_exactly_the_fixed_batch_protocol() -> None:
    n, b = 103, 10
    s = BatchSchedule.fixed(n, b)
    ipe = partition.iterations_per_epoch(n, b)
    assert s.total_iterations(3) == 3 * ipe
    for k in range(3 * ipe):
        p = s.locate(k)
        assert (p.epoch, p.iteration) == divmod(k, ipe)
        assert (p.start, p.stop) == partition.batch_range(p.iteration, b, n)
        for r in range(4):
            assert p.share(r, 4) == partition.shard_range(p.iteration, b, n, r, 4)
        assert s.is_last_of_epoch(k) == (p.iteration == ipe - 1)


@pytest.mark.parametrize("seed", range(30))
def test_no_sample_is_skipped_or_repeated_across_batch_changes(seed: int) -> None:
    rng = random.Random(seed)
    n, epochs = rng.randint(1, 200), rng.randint(1, 4)
    s = BatchSchedule.fixed(n, rng.randint(1, 64))
    for _ in range(rng.randint(0, 6)):
        total = s.total_iterations(epochs)
        s = s.change(rng.randrange(total), rng.randint(1, 64))
    per_epoch = visited(s, epochs)
    assert sorted(per_epoch) == list(range(epochs))
    for ranges in per_epoch.values():
        # Consecutive, tiling [0, n): every position once, in order.
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert all(stop > start for start, stop in ranges)
    # Every rank's shares tile each iteration's range, whatever the world size.
    k = rng.randrange(s.total_iterations(epochs))
    p, w = s.locate(k), rng.randint(1, 9)
    shares = [p.share(r, w) for r in range(w)]
    assert shares[0][0] == p.start and shares[-1][1] == p.stop
    assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))


def test_a_change_keeps_the_past_and_starts_where_the_old_batch_would_have() -> None:
    s = BatchSchedule.fixed(100, 10).change(3, 25)  # epoch 0: 0-10, 10-20, 20-30, then 25s
    assert [(s.locate(k).start, s.locate(k).stop) for k in range(7)] == [
        (0, 10),
        (10, 20),
        (20, 30),
        (30, 55),
        (55, 80),
        (80, 100),  # the epoch's last, short
        (0, 25),  # the next epoch, at the new batch
    ]
    assert s.locate(6).epoch == 1 and s.locate(5).iteration == 5
    assert s.samples_before(6) == 100
    assert s.total_iterations(2) == 6 + 4
    assert s.change(3, 25) is s  # no change
    # A change at an epoch boundary starts the next epoch at position 0.
    t = BatchSchedule.fixed(100, 10).change(10, 40)
    assert t.segments[-1] == Segment(10, 1, 0, 0, 40)
    assert t.total_iterations(2) == 10 + 3


def test_a_schedule_survives_json_and_bad_json_is_refused() -> None:
    s = BatchSchedule.fixed(100, 10).change(3, 25).change(8, 7)
    assert BatchSchedule.from_json(s.to_json()) == s
    for bad, match in [
        ("not json", "not JSON"),
        ("[]", "object"),
        ('{"num_samples": 100, "segments": [[0, 0, 0, 0, 0]]}', r"batch \(0\)"),
        ('{"num_samples": 100, "segments": [[0, 0, 0, 5, 10]]}', "must start at step 0"),
        ('{"num_samples": 100, "segments": [[0,0,0,0,10],[3,0,3,31,25]]}', "does not start"),
        ('{"num_samples": 100, "segments": [[0,0,0,0,10],[0,0,0,0,25]]}', r"step \(0\)"),
        ('{"num_samples": 100, "segments": [[0,0,0,0,"x"]]}', "must be an int"),
        ('{"num_samples": 100, "segments": [[0,0,0,0]]}', "5 integers"),
        ('{"num_samples": 0, "segments": [[0,0,0,0,1]]}', "num_samples"),
    ]:
        with pytest.raises(ValueError, match=match):
            BatchSchedule.from_json(bad)


# -- the learning-rate rules ------------------------------------------------------------------


def test_the_learning_rate_follows_the_batch_by_the_rule() -> None:
    assert scaled_learning_rate(0.1, 64, 64, BatchRule.LINEAR) == pytest.approx(0.1)
    assert scaled_learning_rate(0.1, 256, 64, BatchRule.LINEAR) == pytest.approx(0.4)
    assert scaled_learning_rate(0.1, 32, 64, BatchRule.LINEAR) == pytest.approx(0.05)
    assert scaled_learning_rate(0.1, 256, 64, BatchRule.SQRT) == pytest.approx(0.2)
    assert scaled_learning_rate(0.1, 16, 64, BatchRule.SQRT) == pytest.approx(0.05)
    for bad, match in [
        ((math.inf, 1, 1, BatchRule.LINEAR), "lr"),
        ((0.1, 0, 1, BatchRule.LINEAR), "batch"),
        ((0.1, 1, 0, BatchRule.SQRT), "declared"),
        ((0.1, 1, 1, "linear"), "rule"),
    ]:
        with pytest.raises(ValueError, match=match):
            scaled_learning_rate(*bad)  # type: ignore[arg-type]


# -- the coordinator applies the batch at a boundary ------------------------------------------


def adaptive_coordinator(
    n: int = 10, batch: int = 4, lo: int = 2, hi: int = 8, epochs: int = 2, every: int = 1
) -> Coordinator:
    from tests.unit.test_coordinator import LAYOUT, SGD, Clock

    settings = JobSettings(
        job_id="job-1",
        batch_size=batch,
        epochs=epochs,
        checkpoint_every=every,
        storage_uri="memory://x",
        shard_addresses=("s0:1",),
        min_batch=lo,
        max_batch=hi,
    )
    coord = Coordinator(settings, clock=Clock())
    coord.shape.fix_layout(LAYOUT, SGD, n, coord.shape.plan_sharding(LAYOUT, SGD, n))
    return coord


def run_to_end(
    coord: Coordinator,
    learners: list[str],
    changes: dict[int, int],
    stored: list[ScheduleTask] | None = None,
) -> list[tuple]:
    """Drive every boundary (changing the batch before the iterations in ``changes``) until
    DONE; the assignments each learner ran, as (epoch, global_iteration, rank, start, end,
    batch_start, batch_samples, global_batch)."""
    from tests.unit.test_coordinator import finish_iteration

    stored = [] if stored is None else stored
    for learner in learners:
        coord.join(learner)
    ran: list[tuple] = []
    for _ in range(1000):
        if coord.completed in changes:
            coord.set_global_batch(changes.pop(coord.completed))
        decisions = {m: coord.decide(m) for m in learners}
        if all(d.action is Action.DONE for d in decisions.values()):
            return ran
        held = next((t for t in coord.holds if isinstance(t, (CheckpointTask, ScheduleTask))), None)
        if held is not None:
            if isinstance(held, ScheduleTask):  # nobody runs before it is stored
                assert all(d.action is Action.WAIT for d in decisions.values()), decisions
                stored.append(held)
            coord.task_done(held)
            continue
        for d in decisions.values():
            if d.action is Action.RUN:
                a = d.assignment
                ran.append(
                    (
                        a.epoch,
                        a.global_iteration,
                        a.rank,
                        a.sample_start,
                        a.sample_end,
                        a.batch_start,
                        a.batch_samples,
                        a.global_batch,
                    )
                )
        if coord.running:
            finish_iteration(coord)
    raise AssertionError("the job did not end")


def test_the_coordinator_changes_the_batch_at_a_boundary_for_every_member() -> None:
    coord = adaptive_coordinator(n=10, batch=4, lo=2, hi=8, epochs=2, every=1)
    stored: list[ScheduleTask] = []
    ran = run_to_end(coord, ["a", "b"], {1: 8, 3: 2}, stored)
    # Each change was stored (for a successor coordinator) before anyone ran at it.
    assert [t.iteration for t in stored] == [1, 3]
    assert BatchSchedule.from_json(stored[-1].schedule_json) == coord.shape.schedule
    # Every member of an iteration got the same batch, and the ranks' shares tile it.
    by_iteration: dict[int, list[tuple]] = {}
    for row in ran:
        by_iteration.setdefault(row[1], []).append(row)
    batches = [rows[0][7] for _, rows in sorted(by_iteration.items())]
    assert batches[:3] == [4, 8, 8] and set(batches[3:]) == {2}
    for rows in by_iteration.values():
        assert len({r[5:] for r in rows}) == 1  # same batch range and batch for all
        shares = sorted((r[3], r[4]) for r in rows)
        assert shares[0][0] == rows[0][5] and shares[-1][1] == rows[0][5] + rows[0][6]
    # Each epoch's positions are covered exactly once.
    for epoch in (0, 1):
        covered = sorted(p for r in ran if r[0] == epoch for p in range(r[3], r[4]))
        assert covered == list(range(10))
    assert coord.samples_processed == 20
    assert coord.progress()["global_batch"] == 2
    assert coord.done


def test_set_global_batch_refuses_a_fixed_job_and_a_batch_out_of_bounds() -> None:
    coord = adaptive_coordinator(lo=2, hi=8)
    with pytest.raises(InvalidField, match=r"global_batch \(9\).*\[2, 8\]"):
        coord.set_global_batch(9)
    with pytest.raises(InvalidField, match=r"global_batch \(1\)"):
        coord.set_global_batch(1)
    assert coord.shape.pending_batch is None and coord.shape.global_batch == 4  # nothing changed
    from tests.unit.test_coordinator import make

    fixed = make()
    with pytest.raises(FailedPrecondition, match="no adaptive batch"):
        fixed.set_global_batch(4)
    with pytest.raises(InvalidField, match=r"spec\.adaptive_batch"):
        JobSettings(
            job_id="j", batch_size=4, epochs=1, shard_addresses=("s:1",), min_batch=5, max_batch=8
        )


def test_a_fixed_job_runs_exactly_the_fixed_batch_protocol() -> None:
    from tests.unit.test_coordinator import make

    coord = make(n=10, batch=4, epochs=2, shards=1)
    ran = run_to_end(coord, ["a", "b"], {})
    expected = []
    for k in range(6):
        epoch, i = divmod(k, 3)
        start, stop = partition.batch_range(i, 4, 10)
        for r in range(2):
            s0, s1 = partition.shard_range(i, 4, 10, r, 2)
            expected.append((epoch, k, r, s0, s1, start, stop - start, 4))
    assert sorted(ran) == sorted(expected)


def test_a_restored_adaptive_job_takes_the_checkpoints_schedule_and_stores_it_again() -> None:
    from tests.unit.test_coordinator import LAYOUT, SGD

    saved = BatchSchedule.fixed(10, 4).change(1, 8)  # iterations: [0,4) [4,10) | [0,8) ...
    coord = adaptive_coordinator()
    coord.restore(
        layout=LAYOUT,
        optimizer=SGD,
        dataset_size=10,
        completed=2,
        samples_processed=10,
        generation=3,
        schedule=saved,
    )
    assert coord.shape.schedule == saved and coord.shape.position(2).epoch == 1
    assert ScheduleTask(2, saved.to_json()) in coord.holds
    with pytest.raises(InvalidField, match="num_samples"):
        adaptive_coordinator().restore(
            layout=LAYOUT,
            optimizer=SGD,
            dataset_size=11,
            completed=2,
            samples_processed=10,
            generation=3,
            schedule=saved,
        )


# -- the command line ---------------------------------------------------------------------------


def test_submit_parses_adaptive_batch_bounds_and_refuses_malformed_ones() -> None:
    import typer

    from shoal.cli import jobs as cli_jobs

    ab = cli_jobs.adaptive_batch_spec("32:256", cli_jobs.BatchRuleOption.sqrt)
    assert (ab.min_global_batch, ab.max_global_batch, ab.rule) == (32, 256, SQRT)
    for bad in ("32", "a:b", "32:", ":64", "-1:4", "1:2:3"):
        with pytest.raises(typer.BadParameter, match=r"--adaptive-batch \("):
            cli_jobs.adaptive_batch_spec(bad, cli_jobs.BatchRuleOption.linear)


def test_jobs_get_shows_the_batch_in_use_only_for_an_adaptive_job() -> None:
    from shoal.cli import jobs as cli_jobs

    job = job_pb2.Job(job_id="job-1", spec=spec(batch=64, lo=32, hi=512, rule=SQRT))
    job.progress.global_batch, job.progress.world_size, job.adaptive_batch_size = 128, 4, 256
    assert cli_jobs.batch_line(job) == (
        "batch: 128 in use (declared 64, adaptive 32..512, lr rule sqrt; goodput pick at 4 "
        "learners: 256; gradient noise scale not measured yet (0 iterations))"
    )
    job.progress.gradient_noise_scale, job.progress.gradient_noise_samples = 412.5, 12
    assert cli_jobs.batch_line(job) == (
        "batch: 128 in use (declared 64, adaptive 32..512, lr rule sqrt; goodput pick at 4 "
        "learners: 256; gradient noise scale 412.5 samples (over 12 iterations))"
    )
    job.spec.ClearField("adaptive_batch")
    assert cli_jobs.batch_line(job) is None


# -- the learner --------------------------------------------------------------------------------


def test_the_learner_checks_an_adaptive_assignment_and_scales_its_learning_rate() -> None:
    from torch import nn

    from shoal.learner import env as learner_env
    from shoal.learner.sync_types import Assignment, TrainingPlan
    from shoal.learner.trainer import ElasticTrainer

    plan = TrainingPlan(epochs=2, batch_size=4, num_samples=10)

    def assignment(start: int, stop: int, batch: int) -> Assignment:
        return Assignment(1, 0, 1, 1, 0, 2, start, stop, global_batch=batch)

    last = assignment(4, 10, 8)  # the epoch's last iteration, short of its batch of 8
    plan.check_assignment(last, adaptive=True)
    plan.check_assignment(assignment(2, 10, 8), adaptive=True)
    with pytest.raises(RuntimeError, match="no adaptive batch"):
        plan.check_assignment(last)  # a fixed job refuses another batch
    for bad in (assignment(0, 5, 8), assignment(0, 9, 8), assignment(4, 11, 8)):
        with pytest.raises(RuntimeError, match="does not match the plan"):
            plan.check_assignment(bad, adaptive=True)

    trainer = ElasticTrainer(
        nn.Linear(1, 1), lambda: (None, None), nn.MSELoss(), ("SGD", {"lr": 0.1})
    )
    assert trainer._lr(last) is None  # a fixed batch: the optimizer's own rate
    trainer._batch_rule, trainer._declared_batch = BatchRule.SQRT, 4
    assert trainer._lr(last) == pytest.approx(0.1 * math.sqrt(2))
    assert trainer._lr(assignment(0, 4, 4)) == pytest.approx(0.1)  # back at B0: B0's rate

    assert learner_env.batch_rule({"SHOAL_BATCH_RULE": "sqrt"}) == "sqrt"
    assert learner_env.batch_rule({}) is None
    assert learner_env.batch_rule({"SHOAL_BATCH_RULE": "adascale"}) == "adascale"
    with pytest.raises(ValueError, match=r"SHOAL_BATCH_RULE \('cubic'\)"):
        learner_env.batch_rule({"SHOAL_BATCH_RULE": "cubic"})


def test_the_parameter_sync_server_serves_every_rpc_of_its_service() -> None:
    """SetGlobalBatch was first missing from the hand-written handler table (the e2e test
    saw 'Method not found'): every method of the proto service must be served."""
    from shoal.param_sync.service import ParameterSyncServicer, add_servicer
    from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

    class Server:
        methods: set[str] = set()

        def add_generic_rpc_handlers(self, handlers: object) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
            Server.methods = set(handlers)

    add_servicer(ParameterSyncServicer.__new__(ParameterSyncServicer), Server())  # type: ignore[arg-type]
    wanted = {m.name for m in ps_pb2.DESCRIPTOR.services_by_name["ParameterSyncService"].methods}
    assert wanted == Server.methods


def test_the_batch_changes_at_most_twice_per_world_size_whatever_the_noise() -> None:
    """The scheduler picks the batch when the world size changes (from the prediction) and
    reviews it once after measuring there; noisy iteration times never move it again."""
    rng = random.Random(7)
    tracker = GoodputTracker()
    job = job_pb2.Job(job_id="job-1", spec=spec(batch=64, lo=32, hi=4096))
    t, done, in_use = 1000.0, 0, 64
    picks: dict[int, list[int]] = {}
    for world, polls in ((1, 30), (4, 30), (2, 30)):
        job.target_workers = world
        for _ in range(polls):
            step = iteration_time(SYNC_BOUND, world, in_use) * rng.uniform(0.7, 1.3)
            t, done = t + 5 * step, done + 5
            progress = job_pb2.JobProgress(
                completed_iterations=done,
                world_size=world,
                generation=world,
                global_batch=in_use,
                compute_seconds=SYNC_BOUND.compute * in_use / 64 / world,
            )
            progress.update_time.FromNanoseconds(int(t * 1e9))
            tracker.observe_job(job, progress, t)
            in_use = job.adaptive_batch_size  # the coordinator applies it at the boundary
            picks.setdefault(world, [])
            if not picks[world] or picks[world][-1] != in_use:
                picks[world].append(in_use)
    assert all(len(p) <= 2 for p in picks.values()), picks
    assert picks[4][-1] > picks[1][-1], picks  # the sync-bound job's batch grew with w


def test_a_successor_reads_the_stored_schedule_and_ignores_a_corrupt_one(tmp_path) -> None:
    from shoal.param_sync import checkpoint as ckpt
    from shoal.param_sync.servicer_tasks import read_schedule, schedule_uri

    settings = JobSettings(
        job_id="job-1",
        batch_size=4,
        epochs=2,
        storage_uri=tmp_path.as_uri(),
        shard_addresses=("s0:1",),
        min_batch=2,
        max_batch=8,
    )
    assert read_schedule(settings) is None  # nothing stored yet
    saved = BatchSchedule.fixed(10, 4).change(1, 8)
    ckpt.atomic_write(schedule_uri(settings), saved.to_json().encode())
    assert read_schedule(settings) == saved
    ckpt.atomic_write(schedule_uri(settings), b'{"num_samples": 10, "segments": [[0,0,0,3,4]]}')
    assert read_schedule(settings) is None  # not trusted: logged and ignored
    fixed = JobSettings(
        job_id="job-1",
        batch_size=4,
        epochs=2,
        storage_uri=tmp_path.as_uri(),
        shard_addresses=("s0:1",),
    )
    ckpt.atomic_write(schedule_uri(settings), saved.to_json().encode())
    assert read_schedule(fixed) is None  # a fixed job never reads one


def test_a_schedule_full_of_changes_keeps_its_batch_instead_of_failing() -> None:
    import shoal.param_sync.coordinator_shape as coordinator_module

    coord = adaptive_coordinator(n=10, batch=4, lo=2, hi=8, epochs=50)
    original = coordinator_module.MAX_SEGMENTS
    coordinator_module.MAX_SEGMENTS = 2
    try:
        ran = run_to_end(coord, ["a"], {1: 8, 2: 2, 3: 6})
    finally:
        coordinator_module.MAX_SEGMENTS = original
    assert len(coord.shape.schedule.segments) == 2 and coord.shape.global_batch == 8
    assert {r[7] for r in ran} == {4, 8} and coord.done
