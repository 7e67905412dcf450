"""shoal.contract.files.atomic_write: the one write of checkpoint files (shards and collective
learners) -- a reader sees the old file or the new one, and a failed write leaves nothing."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from shoal.contract.files import atomic_write


def test_a_local_write_replaces_the_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "shard-0.safetensors"
    atomic_write(target.as_uri(), b"old")
    atomic_write(str(target), b"new")  # a plain path works too
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["shard-0.safetensors"]


def test_until_the_rename_a_reader_sees_the_old_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    target.write_bytes(b"old")
    seen: list[tuple[str, bytes, int]] = []

    def before_rename(path: str) -> None:
        temporaries = [p for p in tmp_path.iterdir() if p.name.startswith("manifest.json.tmp-")]
        seen.append((path, target.read_bytes(), len(temporaries)))

    atomic_write(target.as_uri(), b"new", before_rename=before_rename)
    assert seen == [(str(target), b"old", 1)]
    assert target.read_bytes() == b"new"


def test_a_failed_write_raises_the_storage_error_and_removes_its_temporary_file(
    tmp_path: Path,
) -> None:
    target = tmp_path / "shard-0.safetensors"
    target.write_bytes(b"old")

    def refuse(path: str) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target.as_uri(), b"new", before_rename=refuse)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["shard-0.safetensors"]


def test_an_object_store_gets_a_single_put() -> None:
    uri = "memory://shoal-contract-files/jobs/j/iter-1/shard-0.safetensors"
    atomic_write(uri, b"payload")
    fs, path = fsspec.core.url_to_fs(uri)
    assert fs.cat_file(path) == b"payload"
    assert fs.ls(path.rsplit("/", 1)[0], detail=False) == [path]
    fs.rm("/shoal-contract-files", recursive=True)
