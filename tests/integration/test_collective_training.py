"""Collective mode end to end on real processes: two parameter-sync shard processes (shard 0
coordinates the job and hosts the rendezvous store), learner processes running the digits MLP
through the "collective" backend (a gloo process group per generation, re-formed inside the
running processes), and this test acting as the scheduler (OpenJob, RetireLearners,
EvictLearner).

Every run is compared with plain single-process PyTorch training with the same seed and global
batch (``reference_training``), with the tolerance of the parameter-server tests (the
all-reduce sums ``n_i * g_i`` in another order than one mean over the batch: float summation
order only). Rescales and failures must not restart the survivors: each writes its process id
and the groups it formed to its history, and the test checks them against the process it
started.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.integration._param_sync_cluster import (
    DataPlane,
    Proc,
    assert_user_metrics,
    reference_training,
    running_plane,
)
from tests.integration.test_elastic_training import (
    BATCH,
    assert_each_iteration_recorded_once,
    assert_matches_reference,
    assert_shares_tile_every_batch,
    iterations_per_epoch,
)
from tests.support import make_tokens, wait_until

COLLECTIVE = "collective"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory):
    yield from running_plane(tmp_path_factory, "collective")


def start(plane: DataPlane, job: str, name: str, epochs: int, **hooks) -> Proc:
    return plane.start_learner(job, name, epochs=epochs, batch=BATCH, backend=COLLECTIVE, **hooks)


def assert_not_restarted(plane: DataPlane, name: str, proc: Proc, generations: int) -> dict:
    """The learner ran in one process (the one the test started) through at least
    ``generations`` process groups, each formed in place."""
    history = plane.history(name)
    assert history["pid"] == proc.popen.pid
    formed = [g for g, _, _ in history["formations"]]
    assert len(formed) >= generations and formed == sorted(set(formed)), formed
    return history


@pytest.mark.slow
def test_collective_scripts_log_the_sample_weighted_mean_of_each_iteration(plane: DataPlane):
    job, epochs = "c-user-metrics", 1
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    names = [f"{job}-l{i}" for i in range(3)]
    gate = plane.tmp / f"{job}.gate"
    hooks = {"env": {"SHOAL_MAX_BATCH_PER_DEVICE": "8"}, "log_metrics": 1, "gate": gate}
    procs = [start(plane, job, name, epochs, **hooks) for name in names]
    for proc in procs:
        proc.wait_for("READY", timeout=90)
    gate.touch()
    for proc in procs:
        assert proc.wait() == 0, proc.text()[-3000:]
    assert_user_metrics(assert_each_iteration_recorded_once(plane, job, total))


@pytest.mark.slow
@pytest.mark.parametrize("learners", [1, 3])
def test_collective_learners_match_single_process_training(plane: DataPlane, learners: int):
    job, epochs = f"c-equal-{learners}", 2
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    names = [f"{job}-l{i}" for i in range(learners)]
    gate = plane.tmp / f"{job}.gate"  # all warm before any joins: all are in the job's end
    # No callback reads the model between iterations (watch=0): each update is applied once
    # its vote is sent, the next iteration running while the answer travels.
    procs = [start(plane, job, name, epochs, gate=gate, watch=0) for name in names]
    for proc in procs:
        proc.wait_for("READY", timeout=90)
    gate.touch()
    for proc in procs:
        assert proc.wait() == 0, proc.text()[-3000:]
    assert "gloo group of" in procs[0].text()
    # On the coordinator's host: each learner's vote on every iteration it synced went on a
    # lane's control connection, but for one that waited over watch_after_s there (a member
    # far behind, on a loaded machine) and the next, which goes on gRPC as the lane is asked
    # for again (ShardSession.boundary_direct). (The Boundary a learner sends before its first
    # iteration, which its lane is opened for, goes on gRPC.)
    for name, proc in zip(names, procs, strict=True):
        assert "control connection to shard" in proc.text()
        stalls = proc.text().count("a Boundary goes on gRPC: no answer")
        history = plane.history(name)
        assert history["control_answers"] >= len(history["history"]) - 2 * stalls
        # Most iterations voted ahead (not an epoch's last, nor one after a stall on the
        # lane), and nothing was aborted, so nothing was taken back.
        assert history["applied_ahead"][0] > len(history["history"]) // 2, history
        assert history["applied_ahead"][1] == 0
    assert_matches_reference(plane.final_model(job), epochs)
    records = assert_each_iteration_recorded_once(plane, job, total)
    _, reference_losses = reference_training(epochs, BATCH)
    assert [r["loss"] for r in records] == pytest.approx(list(reference_losses), abs=1e-4)
    assert records[-1]["world_size"] == learners
    assert_shares_tile_every_batch(plane, names, range(total))
    progress = plane.progress(job)
    assert progress.done and progress.progress.completed_iterations == total
    # The final checkpoint was written by a learner, in the parameter-server format.
    latest = (plane.job_dir(job) / "checkpoints" / "latest").read_text()
    manifest = json.loads(
        (plane.job_dir(job) / "checkpoints" / latest / "manifest.json").read_text()
    )
    assert manifest["iteration"] == total and [s["file"] for s in manifest["shards"]] == [
        "shard-0.safetensors"
    ]
    epochs_file = plane.job_dir(job) / "metrics" / "epochs.jsonl"
    reports = [json.loads(line) for line in epochs_file.read_text().splitlines()]
    assert [r["epoch"] for r in reports] == list(range(epochs))
    assert all(0 < r["values"]["accuracy"] <= 1 for r in reports)


@pytest.mark.slow
def test_collective_overlapped_buckets_match_single_process_training(plane: DataPlane):
    # Gradient buckets sent by autograd hooks while backward runs (shoal.learner.overlap):
    # small buckets (many of them out of the MLP), shares accumulated in micro-batches of 8
    # (only the last backward sends), and one learner with overlap off, which issues the same
    # collectives after backward: the job still equals single-process training.
    job, epochs = "c-overlap", 1
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    names = [f"{job}-l{i}" for i in range(3)]
    gate = plane.tmp / f"{job}.gate"
    procs = [
        start(
            plane,
            job,
            name,
            epochs,
            gate=gate,
            bucket_bytes=4096,
            env={
                "SHOAL_MAX_BATCH_PER_DEVICE": "8",
                "SHOAL_COLLECTIVE_OVERLAP": "off" if i == 0 else "on",
            },
        )
        for i, name in enumerate(names)
    ]
    for proc in procs:
        proc.wait_for("READY", timeout=90)
    gate.touch()
    for proc in procs:
        assert proc.wait() == 0, proc.text()[-3000:]
    assert_matches_reference(plane.final_model(job), epochs)
    records = assert_each_iteration_recorded_once(plane, job, total)
    _, reference_losses = reference_training(epochs, BATCH)
    assert [r["loss"] for r in records] == pytest.approx(list(reference_losses), abs=1e-4)
    assert plane.history(names[0])["buckets_sent"] == [0, 0]
    for name in names[1:]:
        in_backward, sent = plane.history(name)["buckets_sent"]
        # (In a group of one, a learner that started before the others, the hooks stay idle.)
        steps = sum(r["world_size"] > 1 for r in plane.history(name)["history"])
        # The MLP's 6 tensors in 4 KiB buckets: 6 buckets (a tensor is never split), each
        # sent by the hooks during backward but the last (the first layer's), which carries
        # the iteration's counts and leaves in sync.
        assert sent == 6 * steps and in_backward >= 5 * steps, (in_backward, sent, steps)


@pytest.mark.slow
def test_collective_clipping_float16_and_param_groups_match_the_single_process_recipe(
    plane: DataPlane,
):
    # Three learners, none clipping its own share: the all-reduced gradient is clipped to 0.15
    # (most iterations' norms are above it) under float16 autocast with GradScaler's dynamic
    # loss scale, as one process's AMP recipe does; the optimizer has three parameter groups
    # (a slower first layer, biases without weight decay, the rest).
    job, epochs, clip, amp = "c-clip-fp16", 1, 0.15, "float16"
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    names = [f"{job}-l{i}" for i in range(3)]
    gate = plane.tmp / f"{job}.gate"
    procs = [
        start(plane, job, name, epochs, gate=gate, clip_grad_norm=clip, amp=amp, param_groups=1)
        for name in names
    ]
    for proc in procs:
        proc.wait_for("READY", timeout=90)
    gate.touch()
    for proc in procs:
        assert proc.wait() == 0, proc.text()[-3000:]
    reference, ref_losses = reference_training(
        epochs, BATCH, clip_grad_norm=clip, amp=amp, param_groups=True
    )
    histories = [plane.history(n) for n in names]
    records = [r for h in histories for r in h["history"]]
    assert sorted({r["step"] for r in records}) == list(range(total))
    assert not any(r["skipped"] for r in records)  # 2**16 does not overflow this model
    assert sum(r["grad_norm"] > clip for r in records) > len(records) // 2
    # Each share's float16 backward pass rounds on its own before the float32 reduction:
    # equal to the single process up to float16's rounding (eps 1e-3), not float32's; a
    # run without clipping is far further off.
    model = plane.final_model(job)
    unclipped, _ = reference_training(epochs, BATCH, amp=amp, param_groups=True)
    for name, value in reference.items():
        torch.testing.assert_close(model[name], value, atol=2e-3, rtol=0, msg=name)
    error = max((model[k] - v).abs().max().item() for k, v in reference.items())
    unclipped_error = max((model[k] - v).abs().max().item() for k, v in unclipped.items())
    assert unclipped_error > 5 * error, (error, unclipped_error)
    committed = assert_each_iteration_recorded_once(plane, job, total)
    assert [r["loss"] for r in committed] == pytest.approx(list(ref_losses), abs=5e-3)
    # One primary at a time: the learner of rank 0, told so by the callbacks; after train()
    # exactly one learner's result says it is the primary.
    for h in histories:
        assert h["primary_steps"] == [r["step"] for r in h["history"] if r["rank"] == 0]
    assert sorted(s for h in histories for s in h["primary_steps"]) == list(range(total))
    assert [h["is_primary"] for h in histories].count(True) == 1


def rescale(plane: DataPlane, job: str, first: list[str], later: list[str], at: int):
    """Start ``first`` (pausing before step ``at``'s all-reduce) and ``later`` (warm, gated)."""
    pauses = plane.tmp / f"{job}-pauses"
    pauses.mkdir()
    gate_first, gate_later = plane.tmp / f"{job}-first.gate", plane.tmp / f"{job}-later.gate"
    # (watch=0: the vote ahead; the rescale's answer comes to an iteration run ahead of it)
    procs = {
        n: start(plane, job, n, 2, gate=gate_first, pause_at=at, pause_dir=pauses, watch=0)
        for n in first
    }
    procs.update({n: start(plane, job, n, 2, gate=gate_later, watch=0) for n in later})
    for proc in procs.values():
        proc.wait_for("READY", timeout=90)
    gate_first.touch()
    for n in first:
        procs[n].wait_for(f"PAUSED at step {at}", timeout=90)
    return procs, pauses / f"release-{at}", gate_later


@pytest.mark.slow
def test_collective_grows_from_two_to_four_without_restarting_the_survivors(plane: DataPlane):
    job, epochs, at = "c-grow", 2, 6
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    first, later = ["g0", "g1"], ["g2", "g3"]
    procs, release, gate_later = rescale(plane, job, first, later, at)
    assert plane.progress(job).progress.world_size == 2
    gate_later.touch()
    for n in later:
        procs[n].wait_for("training", timeout=60)  # joined: admitted at the next boundary
    release.touch()
    for name, proc in procs.items():
        assert proc.wait() == 0, (name, proc.text()[-3000:])

    assert_matches_reference(plane.final_model(job), epochs)
    records = assert_each_iteration_recorded_once(plane, job, total)
    sizes = [r["world_size"] for r in records]
    grown = sizes.index(4)  # at a boundary after the paused iteration, then 4 to the end
    assert sizes[at] == 2 and grown > at and sizes[grown:] == [4] * (total - grown), sizes
    for name in first:
        history = assert_not_restarted(plane, name, procs[name], generations=2)
        steps = [r["step"] for r in history["history"]]
        assert steps == list(range(steps[0], total))  # every step once, in one process
        sizes_seen = [r["world_size"] for r in history["history"]]
        assert 2 in sizes_seen and sizes_seen[-1] == 4  # (1 first, if its peer came late)
    for name in later:  # the joiners got the state by broadcast and ran the rest
        steps = [r["step"] for r in plane.history(name)["history"]]
        assert steps == list(range(grown, total))
    # The grow's answer came to the iteration the first two ran ahead of it: run again.
    for name in first:
        assert "runs again as assigned" in procs[name].text()
    assert_shares_tile_every_batch(plane, first + later, range(total))


@pytest.mark.slow
def test_collective_shrinks_from_four_to_two_without_restarting_the_survivors(plane: DataPlane):
    job, epochs, at = "c-shrink", 2, 6
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    names = ["s0", "s1", "s2", "s3"]
    procs, release, _ = rescale(plane, job, names, [], at)
    assert plane.progress(job).progress.world_size == 4
    plane.retire(job, "s2", "s3")  # they finish iteration 6, then leave at the boundary
    release.touch()
    for name, proc in procs.items():
        assert proc.wait() == 0, (name, proc.text()[-3000:])
    for name in ("s2", "s3"):
        assert plane.history(name)["retired"]

    assert_matches_reference(plane.final_model(job), epochs)
    records = assert_each_iteration_recorded_once(plane, job, total)
    sizes = [r["world_size"] for r in records]
    # 4 through the paused iteration (no iteration lost to the retirement), then 2.
    assert sizes[at] == 4 and sizes[at + 1 :] == [2] * (total - at - 1), sizes
    for name in ("s0", "s1"):
        history = assert_not_restarted(plane, name, procs[name], generations=2)
        steps = [r["step"] for r in history["history"]]
        assert steps == list(range(steps[0], total))
    for name in names:  # the answer came to the iteration run ahead of it: run again as told
        assert "runs again as assigned" in procs[name].text()
    assert_shares_tile_every_batch(plane, names, range(total))


@pytest.mark.slow
def test_collective_job_retired_to_zero_is_checkpointed_first_and_goes_on(plane: DataPlane):
    """A preemption to zero learners: the leaving learners hold the only copy of the state,
    so the coordinator has one of them checkpoint it before they go; the next learners
    restore it. Nothing is lost."""
    job, epochs, at = "c-zero", 2, 8
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    procs, release, _ = rescale(plane, job, ["z0", "z1"], [], at)
    plane.retire(job, "z0", "z1")
    release.touch()
    for name, proc in procs.items():
        assert proc.wait() == 0, (name, proc.text()[-3000:])
        assert plane.history(name)["retired"]
    checkpoints = plane.job_dir(job) / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"iter-{at + 1}"
    assert plane.progress(job).progress.completed_iterations == at + 1
    later = [start(plane, job, n, epochs) for n in ("z2", "z3")]
    for proc in later:
        assert proc.wait() == 0, proc.text()[-3000:]
    assert "state restored from checkpoint" in later[0].text() + later[1].text()
    assert_matches_reference(plane.final_model(job), epochs)
    assert_each_iteration_recorded_once(plane, job, total)


@pytest.mark.slow
def test_collective_learner_sigkilled_mid_all_reduce_costs_only_that_iteration(
    plane: DataPlane,
):
    job, epochs, victim_step = "c-sigkill", 2, 10
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    survivors = ["k0", "k1"]
    gate = plane.tmp / "c-sigkill.gate"
    procs = {n: start(plane, job, n, epochs, gate=gate, delay=0.02) for n in survivors}
    victim = start(plane, job, "k2", epochs, gate=gate, delay=0.02, hang_at_step=victim_step)
    for proc in [*procs.values(), victim]:
        proc.wait_for("READY", timeout=90)
    gate.touch()
    victim.wait_for("HANGING", timeout=90)  # k0 and k1 are blocked in step 10's all-reduce
    assert plane.progress(job).progress.completed_iterations == victim_step
    victim.kill()  # SIGKILL: its gloo sockets close under the survivors' all-reduce
    for name in survivors:
        procs[name].wait_for(f"all-reduce of iteration {victim_step}", timeout=60)
    assert plane.evict(job, "k2") in (victim_step, -1)  # what the scheduler does on the exit
    for name in survivors:
        assert procs[name].wait() == 0, procs[name].text()[-3000:]

    assert_matches_reference(plane.final_model(job), epochs)
    records = assert_each_iteration_recorded_once(plane, job, total)
    assert records[victim_step - 1]["world_size"] == 3
    assert records[victim_step]["world_size"] == 2
    for name in survivors:
        history = assert_not_restarted(plane, name, procs[name], generations=2)
        steps = [r["step"] for r in history["history"]]
        assert steps == list(range(steps[0], total))  # each step once; step 10 ran twice
        aborted = rf"iteration {victim_step} \(generation \d+\) aborted"
        assert re.search(aborted, procs[name].text()), procs[name].text()[-2000:]
        # Both learned of the death from closed sockets (the one next to the victim directly,
        # the other when the first dropped its group), not from the collective's timeout.
        assert "Timed out" not in procs[name].text()
    assert_shares_tile_every_batch(plane, survivors, range(victim_step, total))


@pytest.mark.slow
@pytest.mark.parametrize("vote", ["lane", "grpc"])
def test_collective_update_applied_ahead_is_taken_back_when_its_iteration_aborts(
    plane: DataPlane, vote: str
):
    """The vote ahead: t0 applies iteration k's update once its vote is sent and runs k + 1.
    t1 stops between its all-reduce of k and its vote (a test fault point), is SIGKILLed and
    evicted: the coordinator aborts k, so t0 takes its update back (from its copy of the
    state), forgets it completed k, and runs k again in a group of its own. t0's votes go on
    the control-only lane from its trainer's thread, or (``grpc``: as across hosts) as its
    loop's gRPC call, not awaited until the next iteration's all-reduce."""
    job, epochs, k = f"c-takeback-{vote}", 2, 10
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    gate = plane.tmp / f"{job}.gate"
    lane = {"SHOAL_LANE_CONTROL": "off"} if vote == "grpc" else {}
    # (paced, as the SIGKILL test: both are members well before k on a loaded machine)
    survivor = start(plane, job, f"{job}-t0", epochs, gate=gate, watch=0, env=lane, delay=0.03)
    victim = start(
        plane,
        job,
        f"{job}-t1",
        epochs,
        gate=gate,
        delay=0.03,
        env={"SHOAL_TEST_FAULT": f"stop-before-vote@{k}"},
    )
    for proc in (survivor, victim):
        proc.wait_for("READY", timeout=90)
    gate.touch()
    victim.wait_for("test fault stop-before-vote: SIGSTOP", timeout=90)
    victim.kill()
    assert plane.evict(job, f"{job}-t1") == k  # k was running: aborted
    assert survivor.wait() == 0, survivor.text()[-3000:]

    assert_matches_reference(plane.final_model(job), epochs)
    records = assert_each_iteration_recorded_once(plane, job, total)
    assert records[k - 1]["world_size"] == 2 and records[k]["world_size"] == 1
    history = assert_not_restarted(plane, f"{job}-t0", survivor, generations=2)
    steps = [r["step"] for r in history["history"]]
    # k once. (t0 may have joined after the first iteration on a loaded machine: t1 can
    # start alone.)
    assert steps[0] < k and steps == list(range(steps[0], total)), steps
    applied, taken_back = history["applied_ahead"]
    assert taken_back == 1 and applied > total // 2, history["applied_ahead"]
    if vote == "grpc":  # none went on a lane's connection
        assert history["control_answers"] == 0
    assert f"iteration {k} was aborted: its update is dropped" in survivor.text()
    assert f"(iteration {k} was aborted)" in survivor.text()


@pytest.mark.slow
def test_collective_job_resumes_from_a_learner_written_checkpoint(tmp_path: Path):
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens)
    job, epochs = "c-resume", 3
    ipe = iterations_per_epoch()
    total = epochs * ipe
    try:
        plane.start_shards()
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        stop = ipe + 4
        learners = [start(plane, job, n, epochs, pause_at=stop) for n in ("a0", "a1")]
        checkpoints = plane.job_dir(job) / "checkpoints"
        wait_until(
            lambda: any(f"PAUSED at step {stop}" in proc.text() for proc in learners),
            timeout=120,
            what=f"a learner paused at step {stop}",
        )
        assert (checkpoints / "latest").read_text() == f"iter-{ipe}"
        plane.kill_all()  # the shards and every learner, holders of the state included
        before = {r["global_iteration"]: r for r in plane.iterations(job)}
        assert max(before) == stop - 1

        plane.start_shards()
        reply = plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        assert reply.resumed and reply.progress.completed_iterations == ipe
        procs = [start(plane, job, n, epochs) for n in ("b0", "b1")]
        for proc in procs:
            assert proc.wait(timeout=180) == 0, proc.text()[-3000:]
        assert "state restored from checkpoint" in procs[0].text() + procs[1].text()
    finally:
        plane.kill_all()

    records = assert_each_iteration_recorded_once(plane, job, total)
    for k in range(ipe, max(before) + 1):
        assert records[k]["loss"] == pytest.approx(before[k]["loss"], abs=1e-5), k
    assert_matches_reference(plane.final_model(job), epochs)
    assert (checkpoints / "latest").read_text() == f"iter-{total}"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="needs CUDA and NCCL (CI has neither)",
)
def test_nccl_group_on_gpus_matches_single_process_training(plane: DataPlane):
    """One learner per GPU (NCCL refuses two ranks on one device): with one GPU the group is
    a world of one, still formed, torn down and checkpointed through NCCL."""
    learners = min(torch.cuda.device_count(), 2)
    job, epochs = "c-nccl", 2
    total = epochs * iterations_per_epoch()
    plane.open_job(job, batch=BATCH, epochs=epochs)
    procs = [
        start(plane, job, f"n{i}", epochs, device="cuda", env={"CUDA_VISIBLE_DEVICES": str(i)})
        for i in range(learners)
    ]
    for proc in procs:
        assert proc.wait() == 0, proc.text()[-3000:]
    assert "nccl group of" in procs[0].text()
    reference, _ = reference_training(epochs, BATCH)
    model = plane.final_model(job)
    for name, value in reference.items():  # cuBLAS sums in another order than the CPU
        torch.testing.assert_close(model[name], value, atol=1e-4, rtol=0, msg=name)
    assert_each_iteration_recorded_once(plane, job, total)
