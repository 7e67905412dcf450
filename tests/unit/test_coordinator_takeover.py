"""The coordinator core taking a job over from a lost coordinator (issue 12, item 2): it
continues at the shards' iteration, in generations above the lost coordinator's, everyone
pulling; the lost shard's slice is recovered as for any lost shard; the loss report of the lost
coordinator's last iteration is recorded once, from whoever re-sends it."""

from __future__ import annotations

import pytest

from shoal.param_sync.coordinator import Action, Coordinator, JobSettings, RecoverTask
from shoal.param_sync.takeover import sharding_after_takeover
from shoal.runtime.errors import InvalidField
from tests.unit.test_coordinator import LAYOUT, SGD, Clock, active, finish_iteration, runs


def successor(*, completed: int = 3, collect_last: bool = True) -> Coordinator:
    settings = JobSettings(
        job_id="job-1",
        batch_size=4,
        epochs=2,
        seed=3,
        storage_uri="memory://x",
        shard_addresses=("s0:1", "s1:1"),
    )
    coord = Coordinator(settings, clock=Clock())
    tasks = coord.take_over(
        layout=LAYOUT,
        optimizer=SGD,
        dataset_size=10,
        completed=completed,
        generation=(1 << 32) - 1,
        last_checkpoint=-1,
        lost_shard=0,
        collect_last=collect_last,
    )
    assert tasks == [RecoverTask(0, "lost (it was the coordinator)")]
    return coord


def test_a_successor_waits_for_the_lost_slice_then_continues_at_the_shards_iteration() -> None:
    coord = successor()
    assert coord.completed == 3 and coord.samples_processed == 4 + 4 + 2  # N=10, B=4
    assert "shard 0 lost (it was the coordinator) at iteration 3" in coord.recovering
    assert coord.join("a") is False  # nobody initializes: the shards hold the parameters
    coord.join("b")
    assert coord.decide("a").action is Action.WAIT  # until the slice is recovered
    (recover,) = coord.holds
    coord.promote(0, 1)
    coord.rewind(recover, 3, generation=coord.generation)
    a, b = coord.decide("a"), coord.decide("b")
    assert a.action is Action.RUN and a.pull and b.pull  # everyone pulls
    assert a.assignment.global_iteration == 3 and a.assignment.generation > 1 << 32
    assert active(coord) == [1]


def test_the_last_iteration_is_recorded_once_from_the_reports_re_sent() -> None:
    coord = successor()
    for x in "ab":
        coord.join(x)
    (recover,) = coord.holds
    coord.rewind(recover, 3, generation=coord.generation)
    coord.report("a", 7, 2, 3.0, 2)  # generation of the lost coordinator: any is taken
    coord.report("a", 7, 2, 9.0, 2)  # twice: ignored
    for x in "ab":
        runs(coord, x)
    coord.report("b", 7, 2, 5.0, 2)
    assert coord.take_metrics() == []  # finished at the next commit
    finish_iteration(coord)
    (record,) = coord.take_metrics()
    assert record["global_iteration"] == 2 and record["loss"] == 2.0 and record["world_size"] == 2


def test_nothing_is_recorded_again_when_the_lost_coordinator_recorded_it() -> None:
    coord = successor(collect_last=False)
    coord.join("a")
    (recover,) = coord.holds
    coord.rewind(recover, 3, generation=coord.generation)
    coord.report("a", 7, 2, 3.0, 2)
    runs(coord, "a")
    finish_iteration(coord)
    assert coord.take_metrics() == []


def test_a_successor_takes_the_sharding_the_shards_hold_after_an_earlier_promotion() -> None:
    """Three shards; shard 2's slice had been promoted onto shard 0, then shard 0 was lost:
    the successor's sharding is what the shards left hold, shard 0 holding the rest."""
    settings = JobSettings(
        job_id="job-1",
        batch_size=4,
        epochs=2,
        seed=3,
        storage_uri="memory://x",
        shard_addresses=("s0:1", "s1:1", "s2:1"),
    )
    held = sharding_after_takeover(LAYOUT, {1: ("b",)}, 0, 3)
    coord = Coordinator(settings, clock=Clock())
    tasks = coord.take_over(
        layout=LAYOUT,
        optimizer=SGD,
        dataset_size=10,
        completed=3,
        generation=(1 << 32) - 1,
        last_checkpoint=-1,
        lost_shard=0,
        sharding=held,
    )
    assert tasks == [RecoverTask(0, "lost (it was the coordinator)")]
    assert coord.shape.sharding == held
    assert coord.shape.sharding.tensors == (("w", "bn.running_mean"), ("b",), ())
    assert coord.promote(0, 1).tensors == ((), ("w", "b", "bn.running_mean"), ())
    with pytest.raises(InvalidField, match="must have 3 shards"):
        Coordinator(settings, clock=Clock()).take_over(
            layout=LAYOUT,
            optimizer=SGD,
            dataset_size=10,
            completed=3,
            generation=1,
            last_checkpoint=-1,
            lost_shard=0,
            sharding=sharding_after_takeover(LAYOUT, {1: ("b",)}, 0, 2),
        )
