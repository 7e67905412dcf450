"""Chaos: the checkpoint storage fills up while the shards write a checkpoint (issue 14).

A real full disk, not a patched exception: the local cluster's storage directory (the
``file://`` storage URI every shard writes checkpoints to, and where the coordinator appends the
iteration records) is a tmpfs of a few MiB mounted for this test. A parameter-server job with two
shards checkpoints every epoch; after its first checkpoint commits the test fills the tmpfs to
the last byte (a filler file written until ENOSPC), so that the next checkpoint's shard files
fail with ENOSPC. Then it frees the space.

What must hold:

* nothing partial is committed: ``latest`` keeps naming the checkpoint before the fill, whose
  manifest and shard files (sizes, sha256) are whole and load back as the model;
* a failed write leaves no temporary file and no manifest-less checkpoint directory behind;
* training goes on (iterations commit past the failed checkpoint) and the job says why its
  checkpoints fail: state RUNNING, reason "checkpoint after K iterations failed: storage full:
  ... No space left on device ... (storage file://...)";
* once the space is freed a later checkpoint commits (the reason says so), the job COMPLETES
  (its final checkpoint and model written), every iteration is recorded exactly once (the
  iteration records a full disk refused are written later, not lost), and its model equals the
  single-process reference.

Mounting needs root (CAP_SYS_ADMIN); where it is not possible the test skips with the reason.
RLIMIT_FSIZE would be another real mechanism but gives EFBIG per process and would not fill
the storage the other shard and the coordinator share, so it is not used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.v1 import job_pb2
from tests.chaos.harness import (
    TERMINAL,
    TINY_MODEL,
    ChaosCluster,
    job_spec,
    model_difference,
    wait_for,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]

TMPFS_SIZE = "16m"
EPOCHS = 40  # 7 iterations an epoch, a checkpoint every epoch
FAILED = re.compile(r"checkpoint after (\d+) iterations failed: storage full: ")


def _mount_tmpfs(where: Path) -> str | None:
    """Mount a small tmpfs on ``where``; None when done, else why not."""
    if os.geteuid() != 0:
        return f"mounting a tmpfs needs root (CAP_SYS_ADMIN); this runs as uid {os.geteuid()}"
    where.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0755", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run mount: {exc}"
    if done.returncode != 0:
        return f"cannot mount a tmpfs on {where}: {done.stderr.strip() or done.returncode}"
    return None


def _unmount(where: Path) -> None:
    for flags in ([], ["-l"]):
        if subprocess.run(["umount", *flags, str(where)], capture_output=True).returncode == 0:
            return


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[ChaosCluster, Path]]:
    state = tmp_path / "cluster"
    storage = state / "storage"  # LocalCluster's storage directory (its file:// storage URI)
    why = _mount_tmpfs(storage)
    if why is not None:
        pytest.skip(why)
    try:
        chaos = ChaosCluster.start(
            state, hosts=1, gpus_per_host=1, shards=2, replicas=1, etcd_members=1
        )
        try:
            yield chaos, storage
        finally:
            chaos.close()
    finally:
        _unmount(storage)


def _fill(storage: Path) -> Path:
    """Write a file until the filesystem refuses (ENOSPC): the disk is then full."""
    filler = storage / "filler"
    with filler.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == 28, exc  # ENOSPC
    return filler


def _latest(checkpoints: Path) -> str:
    try:
        return (checkpoints / "latest").read_text().strip()
    except FileNotFoundError:
        return ""


def _assert_whole(directory: Path) -> dict:
    """The checkpoint's manifest and every shard file it names, sizes and sha256 checked,
    and its model loads back (what a restore reads)."""
    from shoal.param_sync.shard import model_from_shard_files

    manifest = json.loads((directory / "manifest.json").read_text())
    for shard in manifest["shards"]:
        data = (directory / shard["file"]).read_bytes()
        assert len(data) == shard["size"], f"{directory}/{shard['file']}: size"
        assert hashlib.sha256(data).hexdigest() == shard["sha256"], f"{directory}: sha256"
    model = model_from_shard_files(directory.as_uri(), manifest)
    assert model, f"{directory}: no tensors"
    return manifest


def _leftovers(storage: Path) -> list[str]:
    """Temporary files, and checkpoint directories without a manifest (a failed write's)."""
    found = [str(p) for p in storage.rglob("*.tmp-*")]
    for directory in storage.glob("jobs/*/checkpoints/iter-*"):
        if not (directory / "manifest.json").exists():
            found.append(str(directory))
    return found


@pytest.mark.parametrize(
    "mode",
    [job_pb2.SYNC_MODE_PARAMETER_SERVER, job_pb2.SYNC_MODE_COLLECTIVE],
    ids=["parameter-server", "collective"],
)
def test_a_full_disk_during_a_checkpoint_commits_nothing_partial(
    small_disk, tmp_path, record, mode
):
    """In collective mode the learner holding the state writes the checkpoint file: a write
    the storage refuses is reported to the coordinator (CheckpointFile.error) instead of
    ending the learner, and the coordinator treats it as a shard's refused write."""
    chaos, storage = small_disk
    client = chaos.client
    artifact = client.upload_directory(TINY_MODEL)
    spec = job_spec(
        "disk-full", artifact, max_workers=1, epochs=EPOCHS, checkpoint_every=1, sync_mode=mode
    )
    job = client.submit_job(spec).job_id
    checkpoints = storage / "jobs" / job / "checkpoints"

    # 1. a checkpoint commits; then the disk fills up
    wait_for(lambda: _latest(checkpoints), 300, f"{job}'s first checkpoint", period=0.2)
    filler = _fill(storage)
    before = _latest(checkpoints)
    filled_at = time.monotonic()

    # 2. the next checkpoint fails, the job says why, and training goes on
    def failure() -> tuple[int, job_pb2.Job] | None:
        got = client.get_job(job)
        match = FAILED.search(got.state_reason)
        return (int(match.group(1)), got) if match else None

    failed_at, seen = wait_for(failure, 300, f"{job} to report its failed checkpoint", period=0.3)
    reason_s = time.monotonic() - filled_at
    assert seen.state == job_pb2.JOB_STATE_RUNNING, seen
    assert "No space left on device" in seen.state_reason, seen.state_reason
    assert storage.as_uri() in seen.state_reason, seen.state_reason
    # training goes on past the failed checkpoint (or reaches its final one, retried)
    final = EPOCHS * 7
    wait_for(
        lambda: client.get_job(job).progress.completed_iterations >= min(failed_at + 14, final),
        300,
        f"{job} to train past its failed checkpoint at {failed_at}",
        period=0.3,
    )
    # nothing partial: ``latest`` still names the checkpoint before the fill, whole
    latest = _latest(checkpoints)
    assert latest == before, f"latest moved to {latest} on a full disk"
    manifest = _assert_whole(checkpoints / latest)
    assert manifest["iteration"] < failed_at
    # no disk leak: the failed writes' temporary files and directories are gone
    wait_for(lambda: not _leftovers(storage), 60, "no leftovers of the failed writes")

    # 3. space back: a later checkpoint commits (or, when the failure first seen was the
    # final one's, that one retried: nothing comes after it), and the job says so
    filler.unlink()
    freed_at = time.monotonic()

    def committed_again() -> bool:
        at = int(_latest(checkpoints).removeprefix("iter-") or -1)
        return at > failed_at or at == final

    wait_for(
        committed_again,
        300,
        f"{job} to commit a checkpoint after the space was freed",
        period=0.3,
    )
    recovered_s = time.monotonic() - freed_at
    wait_for(
        lambda: (
            "checkpoints commit again" in client.get_job(job).state_reason
            or client.get_job(job).state == job_pb2.JOB_STATE_COMPLETED
        ),
        120,
        f"{job}'s reason to say its checkpoints commit again",
        period=0.3,
    )
    _assert_whole(checkpoints / _latest(checkpoints))

    # 4. the job completes, nothing lost, the same model as plain training
    wait_for(
        lambda: client.get_job(job).state in TERMINAL,
        600,
        f"{job} to end",
        period=0.5,
    )
    ended = client.get_job(job)
    assert ended.state == job_pb2.JOB_STATE_COMPLETED, ended
    assert chaos.assert_iterations_exact(job) == final
    diff = model_difference(chaos, job, EPOCHS, tmp_path)
    assert diff <= 1e-5, f"{job}: model differs from the single-process reference by {diff}"
    assert not _leftovers(storage), _leftovers(storage)
    record.update(
        scenario=f"disk full during a checkpoint write (tmpfs), {job_pb2.SyncMode.Name(mode)}",
        failed_checkpoint=failed_at,
        reason_s=round(reason_s, 1),
        commit_after_free_s=round(recovered_s, 1),
        iterations_lost=0,
    )
