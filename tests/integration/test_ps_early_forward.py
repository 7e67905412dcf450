"""Early forward in parameter-server mode end to end on real processes
(``SHOAL_PS_EARLY_FORWARD=on``, ``shoal.learner.early_forward``): two parameter-sync shard
processes and learner processes training the digits MLP in micro-batches of 8, two jobs at
once on the same shards.

* Job ``early-fwd``, two learners: one on the same-host lane, held at iteration 2 (the test
  fault ``hold-answer``: the rest of each answer after its header waits until the trainer first
  waits for a tensor, so the next forward deterministically starts with tensors pending); the
  other over gRPC with gradient streaming, whose answer of iteration 4 is lost after its header
  (``drop-answer``: the last shard's answer fails as if the shard died while answering). The job
  must equal single-process PyTorch within 1e-5, the held learner's forward pre-hooks must have
  loaded tensors that were pending when forward started, and the other learner must have
  abandoned the iteration it had started, pulled the parameters and gone on.
* Job ``early-guard``, one learner whose model reads its last Linear functionally (never calls
  it): the guard must notice the stale read, turn early forward off with one warning naming
  the parameter, and the job must still equal single-process PyTorch.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration._param_sync_cluster import (
    DataPlane,
    reference_training,
    release,
    running_plane,
)
from tests.integration.test_elastic_training import (
    ATOL,
    BATCH,
    assert_each_iteration_recorded_once,
    iterations_per_epoch,
)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory):
    yield from running_plane(tmp_path_factory, "ps-early-forward")


def _equal_to_reference(plane: DataPlane, job: str, epochs: int, prefix: str = "") -> None:
    reference, reference_losses = reference_training(epochs, BATCH)
    model = plane.final_model(job)
    assert set(model) == {f"{prefix}{k}" for k in reference}
    for name, value in reference.items():
        torch.testing.assert_close(model[f"{prefix}{name}"], value, atol=ATOL, rtol=0, msg=name)
    records = assert_each_iteration_recorded_once(plane, job, epochs * iterations_per_epoch())
    assert [r["loss"] for r in records] == pytest.approx(list(reference_losses), abs=1e-4)


@pytest.mark.slow
def test_early_forward_matches_single_process_and_survives_a_lost_answer(plane: DataPlane):
    epochs = 1
    common = {"SHOAL_MAX_BATCH_PER_DEVICE": "8", "SHOAL_PS_EARLY_FORWARD": "on"}
    gate = plane.tmp / "early.gate"
    plane.open_job("early-fwd", batch=BATCH, epochs=epochs)
    plane.open_job("early-guard", batch=BATCH, epochs=epochs)
    held, dropped, guarded = "early-fwd-held", "early-fwd-dropped", "early-guard-l0"
    procs = [
        plane.start_learner(
            "early-fwd",
            held,
            epochs=epochs,
            batch=BATCH,
            gate=gate,
            watch=0,
            env={**common, "SHOAL_TEST_FAULT": "hold-answer@2"},
        ),
        plane.start_learner(
            "early-fwd",
            dropped,
            epochs=epochs,
            batch=BATCH,
            gate=gate,
            watch=0,
            env={**common, "SHOAL_SHM_LANE": "off", "SHOAL_TEST_FAULT": "drop-answer@4"},
        ),
        plane.start_learner(
            "early-guard",
            guarded,
            epochs=epochs,
            batch=BATCH,
            gate=gate,
            watch=0,
            functional_read=1,
            env={**common, "SHOAL_TEST_FAULT": "hold-answer@1"},
        ),
    ]
    release(procs, gate)
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.text()[-3000:]

    _equal_to_reference(plane, "early-fwd", epochs)
    total = epochs * iterations_per_epoch()
    history = plane.history(held)
    assert history["completed"] and len(history["history"]) == total
    assert history["early_forward"] is True
    not_complete, pending_at_forward, by_hook = history["early_tensors"]
    # The held answer (6 tensors of the MLP) was pending when the next forward started, and
    # forward pre-hooks loaded its tensors as their modules ran.
    assert not_complete >= 6 and pending_at_forward >= 6 and by_hook >= 6, history
    text = procs[0].text()
    assert "test fault: holding shard" in text, text[-3000:]

    history = plane.history(dropped)
    assert history["completed"] and len(history["history"]) == total
    text = procs[1].text()
    assert "test fault drop-answer" in text, text[-3000:]
    assert "iteration 5 abandoned" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]

    _equal_to_reference(plane, "early-guard", epochs, prefix="net.")
    text = procs[2].text()
    assert text.count("early forward turned off") == 1, text[-3000:]
    assert "'net.4.weight'" in text, text[-3000:]
