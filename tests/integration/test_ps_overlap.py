"""Parameter-server overlap end to end on real processes: two parameter-sync shard processes
and two learner processes training the digits MLP with a parameter it never uses, in
micro-batches of 8 (only the last micro-batch's backward streams). One learner streams its
gradients while backward runs (``SHOAL_PS_OVERLAP=on``, declared slices and a trailer), the
other sends after backward as before (``off``: no trailer; its small bundles as one message
each, ``SHOAL_INLINE_KB``'s default, which the streaming learner turns off). The job must
equal plain single-process PyTorch training (``reference_training``) within 1e-5, the unused
parameter must never be stepped, and the overlapped learner's hooks must have streamed the
MLP's gradients during backward."""

from __future__ import annotations

import pytest
import safetensors.torch
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
    yield from running_plane(tmp_path_factory, "ps-overlap")


@pytest.mark.slow
def test_streaming_gradients_during_backward_matches_single_process_training(plane: DataPlane):
    job, epochs = "ps-overlap", 1
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    names = [f"{job}-l{i}" for i in range(2)]
    gate = plane.tmp / f"{job}.gate"
    procs = [
        plane.start_learner(
            job,
            name,
            epochs=epochs,
            batch=BATCH,
            gate=gate,
            unused_param=1,
            env={
                "SHOAL_MAX_BATCH_PER_DEVICE": "8",
                "SHOAL_SHM_LANE": "off",  # the lane is not overlapped (docs/data-plane.md)
                "SHOAL_PS_OVERLAP": "off" if i == 0 else "on",
                # A slice of at most SHOAL_INLINE_KB goes whole as one message, not streamed:
                # the overlapped learner sends chunks only; the other sends inline.
                **({"SHOAL_INLINE_KB": "0"} if i == 1 else {}),
            },
        )
        for i, name in enumerate(names)
    ]
    release(procs, gate)
    for proc in procs:
        assert proc.wait(timeout=240) == 0, proc.text()[-3000:]
    reference, reference_losses = reference_training(epochs, BATCH)
    model = plane.final_model(job)
    assert set(model) == {"unused", *(f"net.{k}" for k in reference)}
    for name, value in reference.items():
        torch.testing.assert_close(model[f"net.{name}"], value, atol=ATOL, rtol=0, msg=name)
    assert torch.equal(model["unused"], torch.ones(5))  # never got a gradient: never stepped
    # ... and not stepped with a zero gradient either (that leaves SGD's value, not its state):
    # the trailer marked it absent, so the final checkpoint holds no momentum for it.
    latest = (plane.job_dir(job) / "checkpoints" / "latest").read_text().strip()
    optim_keys = {
        key
        for path in (plane.job_dir(job) / "checkpoints" / latest).glob("shard-*.safetensors")
        for key in safetensors.torch.load_file(path)
        if key.startswith("optim/")
    }
    assert "optim/net.0.weight/momentum_buffer" in optim_keys, sorted(optim_keys)
    assert not any(key.startswith("optim/unused/") for key in optim_keys), sorted(optim_keys)
    records = assert_each_iteration_recorded_once(plane, job, total)
    assert [r["loss"] for r in records] == pytest.approx(list(reference_losses), abs=1e-4)
    assert plane.history(names[0])["tensors_sent"] == [0, 0]
    assert plane.history(names[0])["inline_bundles"][0] > 0
    assert plane.history(names[1])["inline_bundles"] == [0, 0]
    history = plane.history(names[1])
    steps = len(history["history"])
    assert steps == total
    in_backward, sent = history["tensors_sent"]
    mlp = sum(1 for k in reference if not k.endswith(("running_mean", "running_var", "tracked")))
    # Every parameter of every step went through the stream; the MLP's by the hooks during
    # backward (the unused one, declared last, by finish(): zeros the trailer marks absent).
    assert sent == (mlp + 1) * steps, (sent, steps)
    assert in_backward == mlp * steps, (in_backward, steps)
