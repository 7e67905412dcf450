"""The checkpoint storage on a really full filesystem (a 1 MiB tmpfs filled to the last byte):
a failed write raises StorageError(full=True) and leaves nothing behind, an append is whole or
absent, and an incomplete checkpoint directory is deleted while a committed one never is.
Mounting needs root: elsewhere these skip with the reason (tests/chaos/test_checkpoint_disk_full.py
has the same fault end to end)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.param_sync import checkpoint as ckpt


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root; this runs as uid {os.geteuid()}")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(where: Path) -> None:
    with (where / "filler").open("wb", buffering=0) as f:
        for chunk in (1 << 16, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(full_disk: Path) -> None:
    target = full_disk / "checkpoints" / "latest"
    ckpt.atomic_write(target.as_uri(), b"iter-7")
    fill(full_disk)
    with pytest.raises(ckpt.StorageError, match="No space left on device") as caught:
        ckpt.atomic_write(target.as_uri(), b"iter-14" * 10_000)
    assert caught.value.full
    assert target.read_bytes() == b"iter-7"
    assert sorted(p.name for p in target.parent.iterdir()) == ["latest"]


def test_an_append_is_whole_or_absent(full_disk: Path) -> None:
    records = full_disk / "metrics" / "iterations.jsonl"
    ckpt.append_line(records.as_uri(), '{"iteration": 0}')
    fill(full_disk)
    # longer than what is left of the file's last page: part of it would fit
    with pytest.raises(ckpt.StorageError) as caught:
        ckpt.append_line(records.as_uri(), '{"iteration": 1, "pad": "' + "x" * 9000 + '"}')
    assert caught.value.full
    assert records.read_text() == '{"iteration": 0}\n'
    (full_disk / "filler").unlink()
    ckpt.append_line(records.as_uri(), '{"iteration": 1}')
    assert records.read_text().splitlines() == ['{"iteration": 0}', '{"iteration": 1}']


def test_discard_incomplete_deletes_only_an_uncommitted_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "jobs" / "j" / "checkpoints"
    ckpt.atomic_write((root / "iter-7" / "shard-0.safetensors").as_uri(), b"whole")
    ckpt.write_manifest_and_latest((root / "iter-7").as_uri(), {"iteration": 7})
    ckpt.atomic_write((root / "iter-14" / "shard-1.safetensors").as_uri(), b"one of two")
    assert ckpt.discard_incomplete((root / "iter-14").as_uri())
    assert not (root / "iter-14").exists()
    assert not ckpt.discard_incomplete((root / "iter-7").as_uri())  # committed: kept
    assert (root / "iter-7" / "shard-0.safetensors").read_bytes() == b"whole"
    assert not ckpt.discard_incomplete((root / "iter-21").as_uri())  # absent: nothing to do


def test_a_commit_cut_between_the_manifest_and_latest_is_finished_later(tmp_path: Path) -> None:
    root = tmp_path / "jobs" / "j" / "checkpoints"
    ckpt.write_manifest_and_latest((root / "iter-7").as_uri(), {"iteration": 7})
    # iter-14's manifest was written, its ``latest`` write failed
    ckpt.atomic_write((root / "iter-14" / "manifest.json").as_uri(), b"{}")
    assert ckpt.advance_latest((root / "iter-14").as_uri())
    assert (root / "latest").read_text() == "iter-14"
    # never backwards, never twice
    assert not ckpt.advance_latest((root / "iter-7").as_uri())
    assert not ckpt.advance_latest((root / "iter-14").as_uri())
    assert (root / "latest").read_text() == "iter-14"
    with pytest.raises(ckpt.StorageError, match="not a checkpoint directory"):
        ckpt.advance_latest((root / "elsewhere").as_uri())


def test_a_collective_learners_refused_write_is_reported_and_leaves_nothing(
    full_disk: Path,
) -> None:
    """The collective-mode learner's checkpoint file: on a full disk it is described with the
    error (the coordinator then gives that checkpoint up or asks again) instead of raising
    out of the learner, and no part of it is left."""
    from shoal.learner.collective_checkpoint import CHECKPOINT_FILE, write_checkpoint_file

    directory = full_disk / "jobs" / "job-1" / "checkpoints" / "iter-14"
    written = write_checkpoint_file(directory.as_uri(), b"x" * 1000, 14)
    assert not written.error and written.sha256 and written.size_bytes == 1000
    assert sorted(p.name for p in directory.iterdir()) == [CHECKPOINT_FILE]
    fill(full_disk)
    again = full_disk / "jobs" / "job-1" / "checkpoints" / "iter-21"
    again.mkdir()
    refused = write_checkpoint_file(again.as_uri(), b"y" * 100_000, 21)
    assert "No space left on device" in refused.error, refused
    assert refused.storage_full and not refused.sha256 and refused.size_bytes == 0
    assert refused.global_iteration == 21 and refused.file == CHECKPOINT_FILE
    assert list(again.iterdir()) == [], "a refused write leaves no temporary file"
