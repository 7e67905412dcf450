"""Parameter groups in parameter-server mode, end to end on real processes: two
parameter-sync shard processes, two learner processes running the digits MLP through the
"grpc" backend with three parameter groups (a slower first layer, biases without weight
decay, the rest with weight decay), compared with plain single-process PyTorch training with
the same groups, seed and global batch (``reference_training``) at ``atol=1e-5``; the same
job without the groups is far off, so the shards did step per group."""

from __future__ import annotations

import pytest
import torch

from shoal.learner import partition
from tests.integration._param_sync_cluster import (
    DataPlane,
    digits_data,
    reference_training,
    running_plane,
)

BATCH = 64
ATOL = 1e-5


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory):
    yield from running_plane(tmp_path_factory, "ps-groups")


@pytest.mark.slow
def test_param_groups_on_two_shards_match_the_same_groups_in_one_process(plane: DataPlane):
    job, epochs = "ps-groups", 1
    total = epochs * partition.iterations_per_epoch(len(digits_data()[1]), BATCH)
    plane.open_job(job, batch=BATCH, epochs=epochs)
    names = [f"{job}-l{i}" for i in range(2)]
    procs = [
        plane.start_learner(job, name, epochs=epochs, batch=BATCH, param_groups=1) for name in names
    ]
    for proc in procs:
        assert proc.wait() == 0, proc.text()[-3000:]
    model = plane.final_model(job)
    reference, _ = reference_training(epochs, BATCH, param_groups=True)
    assert set(model) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(model[name], value, atol=ATOL, rtol=0, msg=name)
    # Without the groups (one rate, weight decay everywhere) the result is far from this run.
    plain, _ = reference_training(epochs, BATCH)
    assert max((model[k] - v).abs().max().item() for k, v in plain.items()) > 100 * ATOL
    steps = {r["step"] for n in names for r in plane.history(n)["history"]}
    assert steps == set(range(total))
