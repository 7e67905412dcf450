"""The coordinator core without a network: generations, boundaries, admission, retirement,
eviction, the two-phase commit, loss aggregation, checkpoints and the end of a job."""

from __future__ import annotations

import math
import random

import pytest

from shoal.contract.wire import TensorMeta, pack_layout
from shoal.param_sync.coordinator import (
    Action,
    CheckpointTask,
    Coordinator,
    JobSettings,
    OptimizerConfig,
    ResolveTask,
)
from shoal.param_sync.servicer_common import _progress_proto
from shoal.runtime.errors import FailedPrecondition, InvalidField, StaleGeneration

LAYOUT = pack_layout(
    [
        TensorMeta("w", "float32", (4, 3), 0, 48),
        TensorMeta("b", "float32", (4,), 0, 16),
        TensorMeta("bn.running_mean", "float32", (4,), 0, 16, buffer=True),
    ]
)[0]
SGD = OptimizerConfig("SGD", '{"lr": 0.1}')


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(
    *, n: int = 10, batch: int = 4, epochs: int = 2, every: int = 0, shards: int = 2
) -> Coordinator:
    settings = JobSettings(
        job_id="job-1",
        batch_size=batch,
        epochs=epochs,
        seed=3,
        checkpoint_every=every,
        storage_uri="memory://x",
        shard_addresses=tuple(f"s{i}:1" for i in range(shards)),
    )
    coord = Coordinator(settings, clock=Clock())
    coord.shape.fix_layout(LAYOUT, SGD, n, coord.shape.plan_sharding(LAYOUT, SGD, n))
    coord.shape.dataset_size = n
    return coord


def active(coord: Coordinator) -> list[int]:
    assert coord.shape.sharding is not None
    return [i for i, names in enumerate(coord.shape.sharding.tensors) if names]


def start(coord: Coordinator, *learners: str) -> None:
    """Join ``learners`` (the first initializes) and let the first boundary freeze."""
    for learner in learners:
        coord.join(learner)
    coord.decide(learners[0])


def finish_iteration(coord: Coordinator) -> ResolveTask:
    """All active shards ready -> the commit; delivering it releases the hold."""
    task = None
    for i in active(coord):
        task = coord.shard_ready(i, coord.generation, coord.completed)
    assert isinstance(task, ResolveTask) and task.commit
    assert coord.task_done(task) is None
    return task


def runs(coord: Coordinator, learner: str):
    decision = coord.decide(learner)
    assert decision.action is Action.RUN, decision
    return decision.assignment


def test_the_first_learner_initializes_and_later_ones_do_not():
    coord = make()
    assert coord.join("a") is True
    assert coord.join("b") is False
    assert coord.join("a") is True  # asking again (a retry) gets the same answer


def test_a_join_with_another_layout_optimizer_or_dataset_is_refused_and_changes_nothing():
    coord = make()
    other = [LAYOUT[0], LAYOUT[1].at(LAYOUT[1].offset), LAYOUT[2]]
    other[1] = TensorMeta("b", "float32", (5,), other[1].offset, 20)
    with pytest.raises(InvalidField, match=r"layout\[1\]"):
        coord.shape.plan_sharding(other, SGD, 10)
    with pytest.raises(InvalidField, match="optimizer"):
        coord.shape.plan_sharding(LAYOUT, OptimizerConfig("Adam", "{}"), 10)
    with pytest.raises(InvalidField, match="dataset_size"):
        coord.shape.plan_sharding(LAYOUT, SGD, 11)
    assert coord.shape.layout == tuple(LAYOUT) and coord.known == set()


def test_joiners_wait_until_the_initializer_has_uploaded_then_all_are_admitted():
    coord = make()
    coord.join("a")
    coord.join("b")
    assert coord.decide("b").action is Action.WAIT  # "a" has not uploaded yet
    first = runs(coord, "a")  # a's first boundary: uploaded, so the first freeze
    second = runs(coord, "b")
    assert (first.generation, first.global_iteration) == (second.generation, 0)
    assert (first.rank, second.rank, first.world_size) == (0, 1, 2)


def test_every_member_gets_the_same_generation_and_iteration_and_ranges_tile_the_batch():
    coord = make(n=10, batch=4)
    start(coord, "a", "b", "c")
    got = [runs(coord, x) for x in ("c", "a", "b")]
    assert {(a.generation, a.global_iteration, a.world_size) for a in got} == {(1, 0, 3)}
    ranges = sorted((a.sample_start, a.sample_end) for a in got)
    assert ranges == [(0, 1), (1, 2), (2, 4)]  # [r*b//W, (r+1)*b//W) for b=4, W=3


def test_the_first_arrival_freezes_the_next_iteration_for_everyone():
    coord = make()
    start(coord, "a", "b")
    runs(coord, "a")
    runs(coord, "b")
    finish_iteration(coord)
    assert not coord.running
    nxt = runs(coord, "b")  # b arrives first at boundary 1
    assert coord.running and nxt.global_iteration == 1
    assert runs(coord, "a").global_iteration == 1
    assert nxt.generation == 1  # same members: same generation


def test_a_joiner_is_admitted_at_the_next_boundary_appended_and_told_to_pull():
    coord = make()
    start(coord, "a", "b")
    coord.join("c")
    assert coord.decide("c").action is Action.WAIT  # iteration 0 is running without it
    assert runs(coord, "a").world_size == 2
    finish_iteration(coord)
    decision = coord.decide("c")  # the joiner's own arrival may freeze: it is admitted
    assert decision.action is Action.RUN and decision.pull
    assert decision.assignment.rank == 2 and decision.assignment.generation == 2
    a = coord.decide("a")
    assert a.assignment.rank == 0 and not a.pull


def test_a_retired_member_finishes_its_iteration_then_gets_retire():
    coord = make()
    start(coord, "a", "b", "c")
    assert coord.retire(["b"]) == 2
    assert runs(coord, "b").global_iteration == 0  # it finishes iteration 0
    finish_iteration(coord)
    assert coord.decide("b").action is Action.RETIRE
    c = runs(coord, "c")
    assert (c.rank, c.world_size, c.generation, c.global_iteration) == (1, 2, 2, 1)
    assert coord.decide("b").action is Action.RETIRE  # asking again: the same


def test_retiring_a_waiting_joiner_or_an_unknown_learner_never_admits_it():
    coord = make()
    start(coord, "a")
    coord.join("x")
    coord.retire(["x", "later"])
    assert coord.decide("x").action is Action.RETIRE
    coord.join("later")
    assert coord.decide("later").action is Action.RETIRE
    finish_iteration(coord)
    assert runs(coord, "a").world_size == 1


def test_evicting_a_member_mid_iteration_aborts_and_reissues_it_to_the_survivors():
    coord = make()
    start(coord, "a", "b", "c")
    for x in "abc":
        runs(coord, x)
    coord.shard_ready(active(coord)[0], 1, 0)  # one shard already holds every gradient
    aborted, task = coord.evict("a")
    assert aborted == 0 and task == ResolveTask(1, 0, commit=False)
    assert coord.decide("b").action is Action.WAIT  # until every shard dropped its sums
    with pytest.raises(StaleGeneration):
        coord.shard_ready(active(coord)[-1], 1, 0)  # the old generation can't commit
    coord.task_done(task)
    b, c = runs(coord, "b"), runs(coord, "c")
    assert (b.global_iteration, b.generation, b.rank, c.rank, b.world_size) == (0, 2, 0, 1, 2)
    assert (b.sample_start, b.sample_end, c.sample_start, c.sample_end) == (0, 2, 2, 4)
    assert coord.completed == 0  # nothing beyond the in-flight iteration was lost
    finish_iteration(coord)
    assert coord.completed == 1


def test_an_evicted_or_unknown_learner_and_superseded_generations_are_stale():
    coord = make()
    start(coord, "a", "b")
    coord.evict("a")
    with pytest.raises(StaleGeneration, match="evicted"):
        coord.decide("a")
    with pytest.raises(StaleGeneration, match="evicted"):
        coord.join("a")
    with pytest.raises(StaleGeneration, match="join first"):
        coord.decide("stranger")
    with pytest.raises(StaleGeneration, match="superseded"):
        coord.membership(1)
    with pytest.raises(FailedPrecondition, match="not frozen"):
        coord.membership(coord.generation + 1)


def test_an_evicted_member_between_iterations_is_left_out_of_the_next_freeze():
    coord = make()
    start(coord, "a", "b")
    finish_iteration(coord)
    assert coord.evict("b") == (-1, None)
    a = runs(coord, "a")
    assert (a.world_size, a.rank, a.global_iteration) == (1, 0, 1)


def test_the_loss_of_an_iteration_is_the_sample_weighted_mean_once_all_members_reported():
    coord = make()
    start(coord, "a", "b")
    finish_iteration(coord)
    coord.report("a", 1, 0, loss_sum=3.0, n=1)
    assert coord.take_metrics() == []  # b has not reported
    coord.report("a", 1, 0, loss_sum=99.0, n=9)  # a second report is ignored
    coord.report("b", 1, 0, loss_sum=6.0, n=3)
    [record] = coord.take_metrics()
    assert record["loss"] == pytest.approx(9.0 / 4)
    assert (record["global_iteration"], record["world_size"], record["samples"]) == (0, 2, 4)
    assert coord.progress()["last_loss"] == pytest.approx(2.25)


def test_progress_carries_the_learners_compute_sync_split_at_the_current_world_size():
    coord = make()
    start(coord, "a", "b")
    assert (coord.progress()["compute_seconds"], coord.progress()["sync_seconds"]) == (0, 0)
    finish_iteration(coord)
    # a: 1 sample, 0.3 s compute; b: 3 samples, 0.5 s: the sample-weighted mean is 0.45.
    coord.report("a", 1, 0, 1.0, 1, {"shoal.compute_s": (0.3, 1), "shoal.sync_s": (0.1, 1)})
    coord.report("b", 1, 0, 3.0, 3, {"shoal.compute_s": (1.5, 3), "shoal.sync_s": (0.3, 3)})
    [record] = coord.take_metrics()
    assert record["values"]["shoal.compute_s"] == pytest.approx(0.45)
    progress = coord.progress()
    assert progress["compute_seconds"] == pytest.approx(0.45)
    assert progress["sync_seconds"] == pytest.approx(0.1)
    message = _progress_proto(progress)  # what GetJobProgress answers the scheduler
    assert (message.compute_seconds, message.sync_seconds) == pytest.approx((0.45, 0.1))


def test_an_evicted_member_that_never_reports_does_not_hold_back_the_loss():
    coord = make()
    start(coord, "a", "b")
    finish_iteration(coord)
    coord.report("a", 1, 0, loss_sum=2.0, n=2)
    coord.evict("b")
    [record] = coord.take_metrics()
    assert record["loss"] == pytest.approx(1.0)


def test_the_last_iteration_is_followed_by_the_final_checkpoint_then_done_for_everyone():
    coord = make(n=8, batch=4, epochs=1)
    start(coord, "a", "b")
    coord.join("late")
    finish_iteration(coord)
    runs(coord, "a")
    finish_iteration(coord)
    assert coord.decide("a").action is Action.WAIT
    assert coord.holds == (CheckpointTask(2, 1, final=True),)
    coord.task_done(coord.holds[0])
    assert [coord.decide(x).action for x in ("a", "b", "late")] == [Action.DONE] * 3
    assert coord.progress()["completed_iterations"] == 2


def test_a_checkpoint_is_held_at_the_boundary_that_starts_each_checkpointed_epoch():
    coord = make(n=8, batch=4, epochs=3, every=1)
    start(coord, "a")
    finish_iteration(coord)
    runs(coord, "a")
    finish_iteration(coord)  # epoch 0 done
    assert coord.decide("a").action is Action.WAIT
    [task] = coord.holds
    assert task == CheckpointTask(2, 1)
    coord.task_done(task)
    assert runs(coord, "a").global_iteration == 2


def test_a_commit_is_deferred_while_a_checkpoint_is_written():
    coord = make()
    start(coord, "a")
    task = coord.begin_checkpoint()
    assert task == CheckpointTask(0, 0)
    for i in active(coord):
        assert coord.shard_ready(i, 1, 0) is None
    assert coord.completed == 0
    follow = coord.task_done(task)
    assert follow == ResolveTask(1, 0, commit=True) and coord.completed == 1


def test_a_job_left_without_members_freezes_at_once_for_the_next_joiner():
    coord = make()
    start(coord, "a")
    coord.retire(["a"])
    finish_iteration(coord)
    assert coord.decide("a").action is Action.RETIRE
    assert not coord.running and coord.members == []
    coord.join("b")
    b = coord.decide("b")
    assert b.action is Action.RUN and b.pull and b.assignment.global_iteration == 1


def test_a_restored_job_continues_its_iterations_and_generations_and_everyone_pulls():
    coord = make()
    coord.restore(
        layout=LAYOUT,
        optimizer=SGD,
        dataset_size=10,
        completed=4,
        samples_processed=14,
        generation=6,
    )
    assert coord.join("a") is False
    decision = coord.decide("a")
    assert decision.pull and decision.assignment.global_iteration == 4
    assert decision.assignment.generation == 8  # after the checkpoint's 6: no zombie matches
    assert coord.progress()["samples_processed"] == 14


def test_no_sample_is_skipped_or_repeated_whatever_the_membership_changes():
    rng = random.Random(1)
    n, batch = 23, 5
    coord = make(n=n, batch=batch, epochs=3, shards=1)
    start(coord, "l0", "l1")
    next_id = 2
    covered: dict[int, list[tuple[int, int]]] = {}
    while True:
        if not coord.members:
            coord.join(f"l{next_id}")
            next_id += 1
        first = coord.members[0] if coord.members else coord.ready[0]
        decision = coord.decide(first)  # the first arrival freezes
        if decision.action is Action.WAIT and coord.holds:
            for task in coord.holds:
                coord.task_done(task)
            continue
        if decision.action is Action.DONE:
            break
        running = [(m, coord.decide(m).assignment) for m in coord.members]
        assert all(a is not None for _, a in running)
        k = running[0][1].global_iteration
        if rng.random() < 0.3:  # a member dies mid-iteration
            _, task = coord.evict(rng.choice(running)[0])
            coord.task_done(task)
            continue
        assert {a.generation for _, a in running} == {coord.generation}
        covered[k] = [(a.sample_start, a.sample_end) for _, a in running]
        finish_iteration(coord)
        change = rng.random()
        if change < 0.3:
            coord.join(f"l{next_id}")
            next_id += 1
        elif change < 0.5 and len(coord.members) > 1:
            coord.retire([rng.choice(coord.members)])
    ipe = math.ceil(n / batch)
    assert sorted(covered) == list(range(3 * ipe))
    for k, ranges in covered.items():
        i = k % ipe
        start_, stop = i * batch, min((i + 1) * batch, n)
        positions = sorted(p for a, b in ranges for p in range(a, b))
        assert positions == list(range(start_, stop)), (k, ranges)


# --------------------------------------------------------------------------------------------
# Collective mode: the learners vote, hold the state and write the checkpoints
# --------------------------------------------------------------------------------------------


def collective(*learners: str, **kwargs) -> Coordinator:
    coord = make(**kwargs)
    coord.set_mode(True)
    for learner in learners:
        coord.join(learner)
    return coord


def run_all(coord: Coordinator, *learners: str) -> dict[str, object]:
    """Every learner asks its boundary (the rendezvous barrier lets them all through once
    the last has asked); returns their decisions."""
    out = {learner: coord.decide(learner) for learner in learners}
    return {learner: coord.decide(learner) for learner in learners} | {
        k: v for k, v in out.items() if v.action is not Action.WAIT
    }


def vote(coord: Coordinator, *learners: str) -> None:
    g, k = coord.generation, coord.completed
    for learner in learners:
        coord.report(learner, g, k, 1.0, 2)


def test_collective_mode_is_fixed_by_the_first_join():
    coord = collective("a")
    with pytest.raises(InvalidField, match="sync_mode"):
        coord.set_mode(False)
    coord.set_mode(True)  # the same mode again is fine


def test_collective_barrier_then_votes_commit_without_any_shard_task():
    coord = collective("a", "b")
    first = coord.decide("a")
    assert first.action is Action.WAIT  # b has not reached the boundary of generation 1
    decisions = run_all(coord, "a", "b")
    assert {d.action for d in decisions.values()} == {Action.RUN}
    assert decisions["b"].pull and not decisions["a"].pull
    vote(coord, "a")
    assert coord.completed == 0 and coord.decide("a").action is Action.WAIT  # voted: waits
    vote(coord, "b")
    assert coord.completed == 1 and coord.holds == ()  # no shard to tell
    assert coord.synced == {"a", "b"}
    assert coord.decide("a").assignment.global_iteration == 1


def test_collective_failure_aborts_and_re_forms_the_same_members():
    coord = collective("a", "b")
    run_all(coord, "a", "b")
    g = coord.generation
    vote(coord, "a")
    assert coord.fail("b", g)
    assert coord.generation == g + 1 and coord.members == ["a", "b"] and coord.completed == 0
    assert not coord.fail("b", g)  # a stale report changes nothing
    assert coord.decide("a").action is Action.WAIT  # the new group's barrier
    d = coord.decide("b")
    assert d.action is Action.RUN and d.assignment.global_iteration == 0
    assert d.assignment.generation == g + 1


def test_collective_eviction_mid_iteration_re_freezes_the_survivors():
    coord = collective("a", "b", "c")
    run_all(coord, "a", "b", "c")
    aborted, task = coord.evict("c")
    assert (aborted, task) == (0, None) and coord.members == ["a", "b"]
    decisions = run_all(coord, "a", "b")
    assert decisions["a"].assignment.world_size == 2


def test_collective_checkpoints_are_written_by_a_learner_holding_the_state():
    coord = collective("a", "b", n=8, batch=4, epochs=2, every=1)
    run_all(coord, "a", "b")
    vote(coord, "a", "b")
    run_all(coord, "a", "b")
    vote(coord, "a", "b")  # epoch 0 done: a checkpoint at the next freeze
    d = coord.decide("b")
    assert d.action is Action.CHECKPOINT and d.checkpoint == CheckpointTask(2, 1)
    assert coord.decide("a").action is Action.WAIT  # one writer
    assert not coord.checkpoint_file_written("a", 2)  # not the writer
    assert coord.checkpoint_file_written("b", 2)
    assert coord.decide("b").action is Action.WAIT  # written: waits for the manifest
    coord.task_done(d.checkpoint)
    assert coord.last_checkpoint == 2
    decisions = run_all(coord, "a", "b")
    assert decisions["a"].assignment.global_iteration == 2


def test_collective_writer_that_dies_is_replaced():
    coord = collective("a", "b", n=8, batch=4, epochs=1)
    for _ in range(2):
        run_all(coord, "a", "b")
        vote(coord, "a", "b")
    d = coord.decide("a")  # the job is done: the final checkpoint
    assert d.action is Action.CHECKPOINT and d.checkpoint.final
    coord.evict("a")
    d = coord.decide("b")
    assert d.action is Action.CHECKPOINT and d.checkpoint.final
    assert coord.checkpoint_file_written("b", 2)
    coord.task_done(d.checkpoint)
    assert coord.decide("b").action is Action.DONE


def test_collective_final_checkpoint_the_storage_refused_is_asked_for_again():
    """The writer's file was refused (a full disk): the final checkpoint stays held and the
    next learner holding the state that asks writes it again; the job is done only then."""
    coord = collective("a", "b", n=8, batch=4, epochs=1)
    for _ in range(2):
        run_all(coord, "a", "b")
        vote(coord, "a", "b")
    d = coord.decide("a")
    assert d.action is Action.CHECKPOINT and d.checkpoint.final
    assert coord.checkpoint_file_written("a", 2)  # its report: refused by the storage
    assert coord.decide("b").action is Action.WAIT
    coord.checkpoint_write_failed(d.checkpoint)
    assert not coord.done
    again = coord.decide("b")
    assert again.action is Action.CHECKPOINT and again.checkpoint == d.checkpoint
    assert coord.decide("a").action is Action.WAIT  # one writer at a time
    assert coord.checkpoint_file_written("b", 2)
    coord.task_done(again.checkpoint)
    assert coord.done and coord.decide("a").action is Action.DONE


def test_collective_last_holders_retiring_are_checkpointed_first():
    coord = collective("a", n=40, batch=4, epochs=1)
    run_all(coord, "a")
    vote(coord, "a")  # one iteration done, no checkpoint yet
    coord.retire(["a"])
    coord.join("b")  # a joiner holds nothing
    d = coord.decide("a")
    assert d.action is Action.CHECKPOINT and d.checkpoint == CheckpointTask(1, 0)
    assert coord.checkpoint_file_written("a", 1)
    coord.task_done(d.checkpoint)
    assert coord.decide("a").action is Action.RETIRE
    d = coord.decide("b")
    assert d.action is Action.RUN and d.restore == 1  # b restores from that checkpoint


def test_collective_failed_checkpoint_is_not_taken_for_written():
    coord = collective("a", n=40, batch=4, epochs=1)
    run_all(coord, "a")
    vote(coord, "a")
    coord.retire(["a"])
    d = coord.decide("a")
    assert coord.checkpoint_file_written("a", 1)
    coord.task_done(d.checkpoint, ok=False)  # e.g. the manifest could not be written
    assert coord.last_checkpoint == -1
    assert coord.decide("a").action is Action.CHECKPOINT  # tried again, never lost


def test_collective_checkpoint_nobody_can_write_any_more_is_dropped():
    coord = collective("a", n=8, batch=4, epochs=2, every=1)
    for _ in range(2):
        run_all(coord, "a")
        vote(coord, "a")
    d = coord.decide("a")
    assert d.action is Action.CHECKPOINT
    coord.join("b")
    coord.evict("a")  # the only holder dies before writing: b restarts from scratch
    assert not any(isinstance(t, CheckpointTask) for t in coord.holds)
    assert coord.completed == 0 and coord.checkpoint_writer is None


def test_collective_rewinds_to_the_checkpoint_when_every_holder_died():
    coord = collective("a", "b", n=8, batch=4, epochs=2, every=1)
    for _ in range(2):
        run_all(coord, "a", "b")
        vote(coord, "a", "b")
    d = coord.decide("a")
    coord.checkpoint_file_written("a", 2)
    coord.task_done(d.checkpoint)
    run_all(coord, "a", "b")
    vote(coord, "a", "b")  # 3 iterations done, the checkpoint holds 2
    run_all(coord, "a", "b")
    coord.join("c")
    coord.evict("a")
    assert coord.completed == 3 and coord.holds == ()  # b still holds the state
    coord.evict("b")  # c, admitted in its place, holds nothing: back to the checkpoint
    d = coord.decide("c")
    assert d.action is Action.WAIT  # the rewind (records of iteration 2 dropped) first
    (rewind,) = coord.holds
    assert rewind.iteration == 2 and coord.completed == 2
    coord.task_done(rewind)
    d = coord.decide("c")
    assert d.action is Action.RUN and d.restore == 2 and d.assignment.global_iteration == 2
