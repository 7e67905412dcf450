"""The coordinator core when a parameter-server shard is lost: the running iteration is
aborted, every boundary waits while the shard is recovered, and the job either goes on where it
was (the shard came back with its slice) or rewinds to the latest checkpoint in a new
generation, every member pulling. No learner is evicted and no job fails for it."""

from __future__ import annotations

import pytest

from shoal.param_sync.coordinator import Action, RecoverTask, ResolveTask
from shoal.runtime.errors import InvalidField, StaleGeneration
from tests.unit.test_coordinator import active, finish_iteration, make, runs


def running(*learners: str, epochs: int = 2):
    coord = make(epochs=epochs)
    coord.set_mode(False)
    for learner in learners:
        coord.join(learner)
    coord.decide(learners[0])
    return coord


def test_a_lost_shard_aborts_the_running_iteration_and_holds_every_boundary() -> None:
    coord = running("a", "b")
    for x in "ab":
        runs(coord, x)
    finish_iteration(coord)
    for x in "ab":
        runs(coord, x)  # iteration 1 runs in generation 1
    lost = active(coord)[-1]
    tasks = coord.shard_lost(lost, "lost its state (restarted)")
    assert tasks == [
        ResolveTask(1, 1, commit=False),
        RecoverTask(lost, "lost its state (restarted)"),
    ]
    assert coord.recovering == f"shard {lost} lost its state (restarted) at iteration 1"
    with pytest.raises(StaleGeneration):
        coord.shard_ready(active(coord)[0], 1, 1)  # the aborted generation cannot commit
    coord.task_done(tasks[0])
    assert coord.decide("a").action is Action.WAIT  # until the shard is recovered
    assert coord.shard_lost(lost, "again") == []  # one recovery at a time


def test_a_shard_back_with_its_slice_loses_nothing_and_the_iteration_is_rerun() -> None:
    coord = running("a", "b")
    for x in "ab":
        runs(coord, x)
    abort, recover = coord.shard_lost(active(coord)[0], "unreachable")
    coord.task_done(abort)
    coord.recovered(recover)
    assert coord.recovering == "" and coord.holds == ()
    a = runs(coord, "a")
    assert (a.global_iteration, a.generation) == (0, 2)  # same iteration, new generation
    assert coord.decide("a").pull is False  # nothing was rewound: no pull
    runs(coord, "b")
    finish_iteration(coord)
    assert coord.completed == 1


def test_a_rewind_continues_from_the_checkpoint_in_a_new_generation_and_everyone_pulls() -> None:
    coord = running("a", "b")
    for _ in range(4):
        for x in "ab":
            runs(coord, x)
        finish_iteration(coord)
        for x in "ab":
            coord.report(x, coord.generation, coord.completed - 1, 1.0, 2)
    assert coord.completed == 4
    (recover,) = coord.shard_lost(active(coord)[-1], "lost its state (restarted)")
    coord.rewind(recover, 2, generation=1)
    assert coord.completed == 2 and coord.samples_processed == 8 and coord.recovering == ""
    assert [r["global_iteration"] for r in coord.take_metrics()] == [0, 1]
    a = coord.decide("a")
    assert a.action is Action.RUN and a.pull is True
    assert (a.assignment.global_iteration, a.assignment.generation) == (2, 2)
    assert coord.decide("b").pull is True
    finish_iteration(coord)
    assert coord.completed == 3


def test_shard_loss_is_ignored_in_collective_mode_before_the_start_and_for_empty_shards() -> None:
    coord = make(shards=5)  # 3 tensors on 5 shards: two hold nothing
    coord.set_mode(True)
    assert coord.shard_lost(0, "unreachable") == []
    coord = make(shards=5)
    coord.set_mode(False)
    assert coord.shard_lost(active(coord)[0], "unreachable") == []  # not initialized yet
    coord.join("a")
    coord.decide("a")
    empty = next(i for i in range(5) if i not in active(coord))
    assert coord.shard_lost(empty, "unreachable") == []
    with pytest.raises(InvalidField, match="shard_index"):
        coord.shard_lost(7, "unreachable")


def test_a_final_checkpoint_dropped_by_a_rewind_neither_counts_nor_ends_the_job() -> None:
    coord = running("a", epochs=1)
    while coord.completed < coord.shape.total_iterations:
        runs(coord, "a")
        finish_iteration(coord)
    assert coord.decide("a").action is Action.WAIT  # the final checkpoint is held
    (final,) = coord.holds
    (recover,) = coord.shard_lost(active(coord)[-1], "lost its state (restarted)")
    coord.rewind(recover, 0, generation=0)  # no checkpoint was written before: from 0
    assert final not in coord.holds
    coord.task_done(final, ok=False)  # its writer gives up once the shard is gone
    assert coord.done is False and coord.last_checkpoint == -1
    assert runs(coord, "a").global_iteration == 0


def test_a_promotion_moves_the_lost_slice_to_its_backup_in_layout_order() -> None:
    coord = running("a", "b")
    assert coord.shape.sharding is not None
    before = coord.shape.sharding
    lost, backup = active(coord)[-1], active(coord)[0]
    abort, recover = coord.shard_lost(lost, "unreachable")
    coord.task_done(abort)
    after = coord.promote(lost, backup)
    assert after.tensors[lost] == () and coord.routing_epoch == 1
    assert set(after.tensors[backup]) == set(before.tensors[lost]) | set(before.tensors[backup])
    order = [m.name for m in coord.shape.layout or ()]
    assert list(after.tensors[backup]) == [n for n in order if n in after.tensors[backup]]
    assert active(coord) == [backup] and after.active_shards == 1
    coord.rewind(recover, coord.completed, generation=coord.generation)
    a = coord.decide("a")
    assert a.action is Action.RUN and a.pull is True  # everyone pulls from the new routing
    with pytest.raises(InvalidField, match="backup"):
        coord.promote(backup, backup)
    with pytest.raises(InvalidField, match="backup"):
        coord.promote(backup, lost)  # the lost shard holds nothing any more
