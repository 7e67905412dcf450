"""trainer.log: what a training script records per iteration, weighted by samples on the learner
(micro-batches), aggregated by the coordinator (learners) and averaged per epoch by the client."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shoal.learner import Callback, ElasticTrainer, LearnerEnv
from shoal.learner.user_metrics import MAX_NAMES, MetricLog, means, with_timings
from shoal.param_sync.coordinator import check_user_metrics
from shoal.param_sync.coordinator_records import IterationSplit
from shoal.runtime.errors import InvalidField
from shoal.v1 import job_pb2
from tests.unit.test_trainer_standalone import DATASETS, SGD, make_model


def test_values_logged_during_a_step_are_weighted_by_micro_batch_samples() -> None:
    log = MetricLog()
    log.begin_step()
    log.chunk = 3
    log.log({"acc": 1.0})
    log.chunk = 1
    log.log({"acc": 0.0, "other": torch.tensor(2.0)})  # a one-element tensor is a number
    log.chunk = None
    step = log.end_step(4)
    assert step == {"acc": (3.0, 4), "other": (2.0, 1)}
    assert means(step) == {"acc": 0.75, "other": 2.0}


def test_values_logged_between_steps_count_for_the_next_step_with_its_share() -> None:
    log = MetricLog()
    log.log({"prev": 7})  # between steps
    log.begin_step()
    assert log.end_step(0) == {}  # an empty share carries nothing: kept for the next
    log.begin_step()
    assert log.end_step(5) == {"prev": (35.0, 5)}
    log.begin_step()
    assert log.end_step(5) == {}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"": 1.0}, "metric name"),
        ({"a b": 1.0}, "metric name"),
        ({"x" * 65: 1.0}, "metric name"),
        ({"acc": float("nan")}, "finite"),
        ({"acc": "high"}, "must be a number"),
        ({"acc": torch.ones(2)}, "must be a number"),
        ({f"m{i}": 1.0 for i in range(MAX_NAMES + 1)}, f"at most {MAX_NAMES}"),
        ([("acc", 1.0)], "mapping"),
        ({"shoal.compute_s": 1.0}, "must not begin with 'shoal.'"),
    ],
)
def test_bad_values_are_refused_naming_them_and_nothing_is_recorded(
    values: Any, message: str
) -> None:
    log = MetricLog()
    log.begin_step()
    log.chunk = 2
    with pytest.raises(ValueError, match=message):
        log.log(values)
    log.chunk = None
    assert log.end_step(2) == {}


def test_the_coordinator_checks_what_learners_send() -> None:
    assert check_user_metrics({"acc": 3.0}, {"acc": 4}) == {"acc": (3.0, 4)}
    for sums, samples, field in [
        ({"acc": 1.0}, {}, "metric_samples"),
        ({"a b": 1.0}, {"a b": 1}, "metric_sums"),
        ({"acc": float("inf")}, {"acc": 1}, "metric_sums[acc]"),
        ({"acc": 1.0}, {"acc": 0}, "metric_sums[acc]"),
        ({f"m{i}": 1.0 for i in range(33)}, {f"m{i}": 1 for i in range(33)}, "metric_sums"),
    ]:
        with pytest.raises(InvalidField) as refused:
            check_user_metrics(sums, samples)
        assert field in str(refused.value)


def test_standalone_records_carry_the_sample_weighted_mean_of_what_the_loss_logged() -> None:
    torch.set_num_threads(1)
    ce = nn.CrossEntropyLoss()
    seen: list[tuple[int, float]] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = ce(out, target)
        acc = (out.argmax(1) == target).float().mean().item()
        seen.append((len(target), acc))
        trainer.log({"accuracy": acc, "loss_x2": 2 * loss.item()})
        return loss

    class Between(Callback):
        def on_iteration_end(self, record: Any) -> None:
            self.trainer.log({"prev_step": record.step})

    trainer = ElasticTrainer(
        make_model(),
        lambda: DATASETS,
        loss_fn,
        SGD,
        seed=3,
        device="cpu",
        env=LearnerEnv(),
        callbacks=[Between()],
        max_batch_per_device=100,  # 256 samples: micro-batches of 100, 100, 56
    )
    result = trainer.train(epochs=1, batch_size=256)
    assert len(seen) > len(result.history)  # several micro-batches per iteration
    for record in result.history:
        assert record.metrics["loss_x2"] == pytest.approx(2 * record.share_loss, rel=1e-6)
        assert 0.0 <= record.metrics["accuracy"] <= 1.0
        if record.step:
            assert record.metrics["prev_step"] == record.step - 1
        else:
            assert "prev_step" not in record.metrics


def test_the_client_averages_each_epoch_and_keeps_a_script_metric_named_like_a_field() -> None:
    from shoal.client.metrics import epoch_rows, iteration_rows

    its = [
        job_pb2.IterationMetric(epoch=0, iteration=0, samples=30, loss=1.0, values={"acc": 0.5}),
        job_pb2.IterationMetric(epoch=0, iteration=1, samples=10, loss=1.0, values={"acc": 1.0}),
        job_pb2.IterationMetric(epoch=1, iteration=0, samples=40, values={"loss": 9.0}),
    ]
    rows = epoch_rows([job_pb2.EpochMetric(epoch=0, values={"accuracy": 0.9})], its)
    assert rows[0]["accuracy"] == 0.9 and rows[0]["mean_acc"] == pytest.approx(0.625)
    assert rows[1]["epoch"] == 2 and rows[1]["mean_loss"] == 9.0
    third = iteration_rows(its, 2)[2]
    assert third["loss"] == 0.0 and third["values.loss"] == 9.0


def test_the_compute_sync_split_is_added_weighted_by_the_share_and_never_overflows() -> None:
    step = {"acc": (3.0, 4)}
    assert with_timings(step, 4, 0.5, 0.25) == {
        "acc": (3.0, 4),
        "shoal.compute_s": (2.0, 4),
        "shoal.sync_s": (1.0, 4),
    }
    assert with_timings(step, 4, 0.5, None) == {"acc": (3.0, 4), "shoal.compute_s": (2.0, 4)}
    assert with_timings(step, 0, 0.5, 0.25) == step  # no samples: nothing to weigh
    full = {f"m{i}": (1.0, 1) for i in range(MAX_NAMES - 1)}
    assert with_timings(full, 1, 0.5, 0.25) == full  # would pass the limit: left out
    assert set(with_timings(full, 1, 0.5, None)) == set(full) | {"shoal.compute_s"}
    assert "shoal.sync_s" not in with_timings(step, 4, 0.5, float("nan"))


def test_the_coordinator_keeps_a_recent_split_per_world_size() -> None:
    split = IterationSplit()
    assert split.at(2) == (0.0, 0.0)
    split.add(2, {"acc": 1.0})  # no split reported: nothing
    assert split.at(2) == (0.0, 0.0)
    split.add(2, {"shoal.compute_s": 0.4})
    split.add(2, {"shoal.compute_s": 0.6, "shoal.sync_s": 0.2})
    assert split.at(2) == pytest.approx((0.5, 0.2))
    assert split.at(3) == (0.0, 0.0)  # reported for another world size
    split.add(3, {"shoal.compute_s": 0.3, "shoal.sync_s": float("nan")})
    assert split.at(3) == pytest.approx((0.3, 0.0)) and split.at(2) == (0.0, 0.0)
