"""Elastic training end to end on real processes: two parameter-sync shard processes, learner
processes running the digits MLP of examples/digits/train.py through the "grpc" backend, and
this test acting as the scheduler (OpenJob, RetireLearners, EvictLearner).

Every run is compared with plain single-process PyTorch training with the same seed and global
batch (``reference_training``). Tolerance: ``atol=1e-5`` on the final parameters. The shards
compute ``sum_i n_i g_i / sum_i n_i`` in float32 where the reference computes one mean over the
batch, so the two differ only by float summation order (about 1e-7 relative per step); over
the 46-69 SGD steps here the measured difference stays below 1e-6 (one learner is bit-exact).
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from shoal.learner import partition
from tests.integration._param_sync_cluster import (
    DataPlane,
    assert_user_metrics,
    digits_data,
    reference_training,
    release,
    running_plane,
)
from tests.support import make_tokens, wait_until

BATCH = 64
ATOL = 1e-5


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory):
    yield from running_plane(tmp_path_factory, "elastic")


def num_samples() -> int:
    return len(digits_data()[1])


def iterations_per_epoch() -> int:
    return partition.iterations_per_epoch(num_samples(), BATCH)


def assert_matches_reference(model: dict[str, torch.Tensor], epochs: int) -> None:
    reference, _ = reference_training(epochs, BATCH)
    assert set(model) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(model[name], value, atol=ATOL, rtol=0, msg=name)


def assert_each_iteration_recorded_once(plane: DataPlane, job: str, total: int) -> list[dict]:
    records = plane.iterations(job)
    steps = [r["global_iteration"] for r in records]
    assert sorted(steps) == list(range(total)), steps
    assert len(steps) == len(set(steps))
    return sorted(records, key=lambda r: r["global_iteration"])


def assert_shares_tile_every_batch(plane: DataPlane, learners: list[str], steps: range) -> None:
    """From what the learners actually ran: each committed iteration's shares are disjoint and
    cover its global batch exactly (no sample skipped or repeated across rescales)."""
    n = num_samples()
    shares: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for learner in learners:
        for r in plane.history(learner)["history"]:
            start, stop = partition.shard_range(
                r["iteration"], BATCH, n, r["rank"], r["world_size"]
            )
            shares[r["step"]].append((start, stop))
    assert set(steps) <= set(shares)
    for step in steps:
        ranges = shares[step]
        start, stop = partition.batch_range(step % iterations_per_epoch(), BATCH, n)
        positions = sorted(p for a, b in ranges for p in range(a, b))
        assert positions == list(range(start, stop)), (step, ranges)


@pytest.mark.slow
def test_what_scripts_log_is_the_sample_weighted_mean_of_each_iteration(plane: DataPlane):
    """trainer.log on 3 learners over 2 shards, micro-batches of 8 (several per share)."""
    job, epochs = "user-metrics", 1
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    names = [f"{job}-l{i}" for i in range(3)]
    gate = plane.tmp / f"{job}.gate"
    procs = [
        plane.start_learner(
            job,
            n,
            epochs=epochs,
            batch=BATCH,
            env={"SHOAL_MAX_BATCH_PER_DEVICE": "8"},
            log_metrics=1,
            gate=gate,
        )
        for n in names
    ]
    release(procs, gate)
    for proc in procs:
        assert proc.wait() == 0, proc.text()[-3000:]
    records = assert_each_iteration_recorded_once(plane, job, total)
    assert_user_metrics(records)
    # Each learner's own record: its share's mean.
    for name in names:
        for h in plane.history(name)["history"]:
            if h["n_samples"]:
                assert set(h["metrics"]) >= {"loss_x2"}


@pytest.mark.slow
@pytest.mark.parametrize("learners", [1, 3])
def test_learners_on_two_shards_match_single_process_training(plane: DataPlane, learners: int):
    job, epochs = f"equal-{learners}", 2
    total = epochs * iterations_per_epoch()
    reply = plane.open_job(job, batch=BATCH, epochs=epochs)
    assert not reply.resumed
    names = [f"{job}-l{i}" for i in range(learners)]
    procs = [plane.start_learner(job, name, epochs=epochs, batch=BATCH) for name in names]
    for proc in procs:
        assert proc.wait() == 0, proc.text()[-3000:]
    assert_matches_reference(plane.final_model(job), epochs)
    records = assert_each_iteration_recorded_once(plane, job, total)
    _, reference_losses = reference_training(epochs, BATCH)
    assert [r["loss"] for r in records] == pytest.approx(list(reference_losses), abs=1e-4)
    assert_shares_tile_every_batch(plane, names, range(total))
    progress = plane.progress(job)
    assert progress.done and progress.progress.completed_iterations == total
    epochs_file = plane.job_dir(job) / "metrics" / "epochs.jsonl"
    reports = [json.loads(line) for line in epochs_file.read_text().splitlines()]
    assert [r["epoch"] for r in reports] == list(range(epochs))  # by rank 0, once each
    assert all(0 < r["values"]["accuracy"] <= 1 for r in reports)


@pytest.mark.slow
def test_global_clipping_on_two_shards_matches_clip_grad_norm_in_one_process(plane: DataPlane):
    # Each shard holds a slice of the parameters: it reports its slice's squared gradient
    # norm with ShardReady, the coordinator commits with the global norm, and every shard
    # scales its slice by the same min(1, 0.15 / norm), as clip_grad_norm_ does on one process.
    # Clipping each slice (or each learner's share) by its own norm would differ at once.
    job, epochs, clip = "clip-3", 1, 0.15
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    names = [f"{job}-l{i}" for i in range(3)]
    procs = [
        plane.start_learner(job, name, epochs=epochs, batch=BATCH, clip_grad_norm=clip)
        for name in names
    ]
    for proc in procs:
        assert proc.wait() == 0, proc.text()[-3000:]
    reference, reference_losses = reference_training(epochs, BATCH, clip_grad_norm=clip)
    model = plane.final_model(job)
    for name, value in reference.items():
        torch.testing.assert_close(model[name], value, atol=ATOL, rtol=0, msg=name)
    unclipped, _ = reference_training(epochs, BATCH)
    assert max((model[k] - v).abs().max().item() for k, v in unclipped.items()) > 100 * ATOL
    records = assert_each_iteration_recorded_once(plane, job, total)
    assert [r["loss"] for r in records] == pytest.approx(list(reference_losses), abs=1e-4)
    assert [plane.history(n)["is_primary"] for n in names].count(True) == 1


@pytest.mark.slow
def test_float16_loss_scaling_on_two_shards_skips_and_steps_exactly_as_grad_scaler(
    plane: DataPlane,
):
    # One learner (its share is the whole batch, so float16 overflows exactly where one
    # process does) and two shards: a loss scale of 2**24 overflows the first backward passes;
    # each shard's slice norm is inf there, the coordinator's global norm is inf, and both
    # shards skip the step while the learner's scale backs off, as GradScaler does.
    job, epochs, clip, scale = "fp16-1", 1, 0.15, 2.0**24
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    proc = plane.start_learner(
        job,
        f"{job}-l0",
        epochs=epochs,
        batch=BATCH,
        clip_grad_norm=clip,
        amp="float16",
        init_scale=scale,
    )
    assert proc.wait() == 0, proc.text()[-3000:]
    reference, reference_losses = reference_training(
        epochs, BATCH, clip_grad_norm=clip, amp="float16", init_scale=scale
    )
    history = plane.history(f"{job}-l0")["history"]
    skipped = [r["skipped"] for r in history]
    assert 0 < sum(skipped) < total - 1
    scales = [r["loss_scale"] for r in history]
    assert scales[0] == scale and scales[1] == scale / 2  # backed off after the first skip
    assert all(r["grad_norm"] == float("inf") for r in history if r["skipped"])
    model = plane.final_model(job)
    for name, value in reference.items():
        torch.testing.assert_close(model[name], value, atol=ATOL, rtol=0, msg=name)
    records = assert_each_iteration_recorded_once(plane, job, total)
    assert [r["loss"] for r in records] == pytest.approx(list(reference_losses), abs=1e-4)


@pytest.mark.slow
def test_three_learners_shrink_to_two_then_grow_to_four_mid_epoch_and_match(plane: DataPlane):
    job, epochs = "rescale", 2
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    pauses = plane.tmp / "rescale-pauses"
    pauses.mkdir()
    first, later = ["r0", "r1", "r2"], ["r3", "r4"]
    gates = {
        n: plane.tmp / f"rescale-{'first' if n in first else 'later'}.gate" for n in first + later
    }
    hooks = {"pause_at": "6,12", "pause_dir": pauses}
    procs = {
        n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, gate=gates[n], **hooks)
        for n in first + later
    }
    for proc in procs.values():  # all warm (imports done), waiting to join
        proc.wait_for("READY", timeout=90)
    gates["r0"].touch()
    for n in first:  # iteration 6 is in flight: its members wait before sending gradients
        procs[n].wait_for("PAUSED at step 6")
    assert plane.progress(job).progress.world_size == 3
    plane.retire(job, "r2")  # it finishes iteration 6, then leaves at the boundary
    (pauses / "release-6").touch()
    for n in first[:2]:
        procs[n].wait_for("PAUSED at step 12")
    assert procs["r2"].wait(timeout=30) == 0 and plane.history("r2")["retired"]
    gates["r3"].touch()
    for n in later:
        procs[n].wait_for("training", timeout=30)  # joined: admitted at the next boundary
    (pauses / "release-12").touch()
    for name in ["r0", "r1", *later]:
        assert procs[name].wait() == 0, procs[name].text()[-3000:]

    assert_matches_reference(plane.final_model(job), epochs)
    records = assert_each_iteration_recorded_once(plane, job, total)
    sizes = [r["world_size"] for r in records]
    # 3 until the retire took effect at boundary 7 (no iteration lost), 2 until the joiners
    # were admitted at boundary 13, then 4: both mid-epoch (23 iterations per epoch).
    assert sizes[6] == 3 and sizes[7:13] == [2] * 6 and sizes[13:] == [4] * (total - 13), sizes
    assert_shares_tile_every_batch(plane, ["r0", "r1", "r2", *later], range(total))


@pytest.mark.slow
def test_a_learner_killed_mid_iteration_costs_only_that_iteration(plane: DataPlane):
    job, epochs = "sigkill", 2
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    survivors = ["k0", "k1"]
    gate = plane.tmp / "sigkill.gate"
    procs = {
        n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02, gate=gate)
        for n in survivors
    }
    victim = plane.start_learner(
        job, "k2", epochs=epochs, batch=BATCH, delay=0.02, gate=gate, hang_at_step=10
    )
    release([*procs.values(), victim], gate)
    victim.wait_for("HANGING", timeout=60)  # k0 and k1 are blocked in step 10's SyncStep
    before = plane.progress(job).progress.completed_iterations
    assert before == 10
    victim.kill()
    assert plane.evict(job, "k2") == 10  # what the scheduler does when it sees the exit
    for name in survivors:
        assert procs[name].wait() == 0, procs[name].text()[-3000:]

    assert_matches_reference(plane.final_model(job), epochs)
    records = assert_each_iteration_recorded_once(plane, job, total)
    assert records[10]["world_size"] == 2 and records[9]["world_size"] == 3
    for name in survivors:
        steps = [r["step"] for r in plane.history(name)["history"]]
        assert steps == list(range(steps[0], total))  # each step completed once
        # and step 10 was run twice
        assert re.search(r"iteration 10 \(generation \d+\) aborted", procs[name].text())
    assert_shares_tile_every_batch(plane, survivors, range(10, total))  # k2 left no history


@pytest.mark.slow
def test_a_job_resumes_from_its_latest_checkpoint_after_its_whole_data_plane_died(
    tmp_path: Path,
):
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens)
    job, epochs = "resume", 3
    ipe = iterations_per_epoch()
    total = epochs * ipe
    try:
        plane.start_shards()
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        stop = ipe + 4  # epoch 1 under way; the job freezes in that iteration
        learners = [
            plane.start_learner(job, n, epochs=epochs, batch=BATCH, pause_at=stop)
            for n in ("a0", "a1")
        ]
        checkpoints = plane.job_dir(job) / "checkpoints"
        # One paused learner freezes the job in iteration `stop`. The other may be paused too,
        # or (when it joined late, on a loaded machine) waiting to be admitted at a boundary
        # that the pause holds back: either way nothing completes past `stop` - 1.
        wait_until(
            lambda: any(f"PAUSED at step {stop}" in proc.text() for proc in learners),
            timeout=120,
            what=f"a learner paused at step {stop}",
        )
        assert (checkpoints / "latest").read_text() == f"iter-{ipe}"
        plane.kill_all()  # every shard and every learner, at once
        before = {r["global_iteration"]: r for r in plane.iterations(job)}
        assert max(before) == stop - 1
        # An interrupted checkpoint: shard files written, the manifest never was.
        partial = checkpoints / f"iter-{stop}"
        partial.mkdir()
        (partial / "shard-0.safetensors").write_bytes(b"half a file")

        plane.start_shards()
        reply = plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        assert reply.resumed and reply.progress.completed_iterations == ipe
        assert (checkpoints / "latest").read_text() == f"iter-{ipe}"
        started = time.monotonic()
        procs = [plane.start_learner(job, n, epochs=epochs, batch=BATCH) for n in ("b0", "b1")]
        for proc in procs:
            assert proc.wait(timeout=180 - (time.monotonic() - started)) == 0, proc.text()[-3000:]
    finally:
        plane.kill_all()

    records = assert_each_iteration_recorded_once(plane, job, total)
    # The loss curve continues where it left: the re-run iterations see the same parameters
    # and the same data as before the crash.
    for k in range(ipe, max(before) + 1):
        assert records[k]["loss"] == pytest.approx(before[k]["loss"], abs=1e-5), k
    assert_matches_reference(plane.final_model(job), epochs)
    assert (checkpoints / "latest").read_text() == f"iter-{total}"
    epochs_file = plane.job_dir(job) / "metrics" / "epochs.jsonl"
    reports = [json.loads(line) for line in epochs_file.read_text().splitlines()]
    assert [r["epoch"] for r in reports] == list(range(epochs))
