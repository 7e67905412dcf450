"""Where a job's data plane keeps its files, and how checkpoints are made crash-safe.

Storage layout under the storage URI (any fsspec URI; ``file://`` by default)::

    jobs/<job_id>/
        checkpoints/
            iter-<k>/                 the state after k completed iterations
                shard-<i>.safetensors one per active shard (written by the shard)
                manifest.json         written LAST by the coordinator
            latest                    the name of the newest complete checkpoint directory
        metrics/iterations.jsonl      one line per iteration (IterationMetric fields)
        metrics/epochs.jsonl          one line per epoch evaluation (EpochMetric fields)
        metrics/<file>.parts/         on an object store: the appends to <file>, an object
                                      each (shoal.contract.records: read them with its read)
        model.safetensors             the whole final model (parameters and buffers by name)

Retention (:func:`prune_checkpoints`, after each commit): a job keeps its newest
``keep_checkpoints`` complete checkpoints (default :data:`DEFAULT_KEEP`); older directories,
complete or interrupted, are deleted. The one ``latest`` names and any newer directory (a
checkpoint being written) are never touched.

Crash safety: every file is written to a temporary name and renamed into place (on object
stores, where rename is not atomic, one ``put`` of the whole object is). The manifest names
every shard file with its size and sha256 and is written only after all of them; ``latest`` is
updated only after the manifest. A directory without a manifest is never pointed at, so an
interrupted checkpoint is ignored (and overwritten if the same iteration is checkpointed
again).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from shoal.contract import faults, files, ids, records

__all__ = [
    "DEFAULT_KEEP",
    "LATEST",
    "MANIFEST",
    "StorageError",
    "advance_latest",
    "atomic_write",
    "checkpoint_name",
    "discard_incomplete",
    "is_local",
    "job_uri",
    "join_uri",
    "latest_checkpoint",
    "prune_checkpoints",
    "read_bytes",
    "read_manifest",
    "read_records",
    "rewrite_records",
    "sha256_hex",
    "write_manifest_and_latest",
]

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = 1
# How many complete checkpoints a job keeps when its spec says 0 (JobSpec.keep_checkpoints).
DEFAULT_KEEP = 3
_ITER_NAME = re.compile(r"iter-(0|[1-9][0-9]{0,17})")


class StorageError(RuntimeError):
    """Storage could not be read or written, or a file is not what the manifest says.
    ``full``: the write failed because the storage is full (ENOSPC, EDQUOT, or EFBIG: a file
    size limit)."""

    def __init__(self, message: str, *, full: bool = False) -> None:
        super().__init__(message)
        self.full = full


_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _write_error(what: str, exc: OSError) -> StorageError:
    return StorageError(f"{what}: {exc}", full=exc.errno in _FULL_ERRNOS)


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def job_uri(storage_uri: str, job_id: str, *parts: str) -> str:
    return join_uri(storage_uri, "jobs", job_id, *parts)


def checkpoint_name(iteration: int) -> str:
    return f"iter-{iteration}"


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(uri: str, data: bytes) -> None:
    """Write ``data`` at ``uri`` so that readers see the old file or the new one, never a
    partial one (``shoal.contract.files.atomic_write``: temp file, fsync and rename locally, a
    single put elsewhere; a failed write leaves no temporary file behind), with the
    ``stop-before-rename`` test fault point (tests/chaos). A refusal is a StorageError."""
    try:
        files.atomic_write(uri, data, before_rename=faults.stop_before_rename)
    except OSError as exc:
        raise _write_error(f"cannot write {uri}", exc) from exc


@functools.lru_cache(maxsize=256)
def _local_path(uri: str) -> str | None:
    """``uri``'s path when fsspec resolves it to the local filesystem, else None. Cached: the
    coordinator appends a record and reads its storage mark at every commit (collective mode:
    every iteration), where resolving the URI again costs more than the write itself."""
    fs, path = fsspec.core.url_to_fs(uri)
    return str(path) if isinstance(fs, LocalFileSystem) else None


def is_local(uri: str) -> bool:
    """Whether ``uri`` is on the local filesystem."""
    return _local_path(uri) is not None


def append_line(uri: str, line: str, *, before_write: Callable[[], None] | None = None) -> None:
    """Append one line to a record file (on an object store, which cannot append, as an object
    of its own: :mod:`shoal.contract.records`, whose ``read`` joins them).
    ``before_write`` (the storage fence's check, holder.py) runs just before the bytes go: on
    the local filesystem after the file is opened, so that a writer stopped between the check
    and the write writes into the file it opened, which a successor that took the job over
    meanwhile has replaced (:func:`renew_local`): the line lands in no file anyone reads."""
    local = _local_path(uri)
    if local is not None:
        data = (line + "\n").encode()
        try:
            try:
                fd = _open_append(local)
            except FileNotFoundError:  # its directory is not there yet
                os.makedirs(local.rsplit("/", 1)[0], exist_ok=True)
                fd = _open_append(local)
            try:
                if before_write is not None:
                    before_write()
                _append_whole(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _write_error(f"cannot append to {uri}", exc) from exc
        return
    try:  # an object store: the line is an object of its own (shoal.contract.records)
        records.append(uri, (line + "\n").encode(), before_write=before_write)
    except OSError as exc:
        raise _write_error(f"cannot append to {uri}", exc) from exc


def _open_append(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` or nothing: a write cut short (a full disk) is truncated away, so the
    file never ends in half a line."""
    size = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise


def renew_local(uri: str, before_replace: Callable[[], None] | None = None) -> None:
    """Replace the local file at ``uri`` by a copy of itself (a new inode, atomically): a
    writer that opened the old one before a takeover and was stopped there writes into a file
    no one reads any more (:func:`append_line`). Nothing to do elsewhere, nor when there is no
    such file. The copies an earlier renewal left (``<file>.renew-<pid>``: its process died
    between the copy and the replace, or was superseded meanwhile) are removed first;
    ``before_replace`` is called just before the copy replaces the file (it raises to leave
    the file as it is: the copy is removed)."""
    local = _local_path(uri)
    if local is None:
        return
    for stale in glob.glob(f"{glob.escape(local)}.renew-*"):
        with contextlib.suppress(OSError):
            os.unlink(stale)
    if not os.path.exists(local):
        return
    tmp = f"{local}.renew-{os.getpid()}"
    try:
        shutil.copyfile(local, tmp)  # (in the kernel where it can: a long job's records)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, local)
        tmp = ""
    except OSError as exc:
        raise _write_error(f"cannot renew {uri}", exc) from exc
    finally:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def discard_incomplete(directory: str) -> bool:
    """Delete a checkpoint directory that has no manifest (a write that failed: its shard
    files are never used, and on a full disk they hold the space a retry needs). Returns
    whether it deleted one; a directory with a manifest is never touched."""
    fs, path = fsspec.core.url_to_fs(directory)
    try:
        if not fs.exists(path) or fs.exists(f"{path}/{MANIFEST}"):
            return False
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StorageError(f"cannot delete {directory}: {exc}") from exc
    return True


def read_bytes(uri: str) -> bytes | None:
    """The file's bytes, or None when it does not exist."""
    local = _local_path(uri)
    if local is not None:  # one open (the coordinator reads its mark before every write)
        try:
            with open(local, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StorageError(f"cannot read {uri}: {exc}") from exc
    fs, path = fsspec.core.url_to_fs(uri)
    try:
        if not fs.exists(path):
            return None
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(f"cannot read {uri}: {exc}") from exc


def read_records(uri: str) -> bytes | None:
    """A record file's bytes (``metrics/*.jsonl``; on an object store its appends joined:
    :func:`shoal.contract.records.read`), or None when there is none."""
    try:
        return records.read(uri)
    except OSError as exc:
        raise StorageError(f"cannot read {uri}: {exc}") from exc


def rewrite_records(uri: str, data: bytes) -> None:
    """Make ``data`` the whole record file ``uri`` (:func:`atomic_write` locally; on an object
    store one object that covers its appends: :func:`shoal.contract.records.rewrite`)."""
    if is_local(uri):
        atomic_write(uri, data)
        return
    try:
        records.rewrite(uri, data)
    except OSError as exc:
        raise _write_error(f"cannot write {uri}", exc) from exc


def read_manifest(directory: str) -> dict[str, Any] | None:
    data = read_bytes(join_uri(directory, MANIFEST))
    if data is None:
        return None
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise StorageError(f"{join_uri(directory, MANIFEST)} is not JSON: {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise StorageError(f"checkpoint format ({manifest.get('format')!r}) is not {FORMAT}")
    return manifest


def latest_checkpoint(storage_uri: str, job_id: str) -> tuple[str, dict[str, Any]] | None:
    """(directory URI, manifest) of the checkpoint ``latest`` names, or None. ``latest`` only
    ever names a directory whose manifest was written, but it is checked anyway."""
    root = job_uri(storage_uri, job_id, "checkpoints")
    name = read_bytes(join_uri(root, LATEST))
    if name is None:
        return None
    text = name.decode(errors="replace").strip()
    if not ids.is_valid(ids.IdKind.CHECKPOINT, text):
        # ``latest`` is in storage that collective-mode learners write too: never follow a
        # name out of the job's checkpoints directory.
        raise StorageError(f"{join_uri(root, LATEST)} names {text!r}, not a checkpoint name")
    directory = join_uri(root, text)
    manifest = read_manifest(directory)
    if manifest is None:
        raise StorageError(f"{join_uri(root, LATEST)} names {directory}, which has no manifest")
    return directory, manifest


def write_manifest_and_latest(directory: str, manifest: Mapping[str, Any]) -> None:
    """The commit point of a checkpoint: the manifest (after every shard file), then
    ``latest``."""
    body = json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=True).encode()
    atomic_write(join_uri(directory, MANIFEST), body)
    root, name = directory.rstrip("/").rsplit("/", 1)
    atomic_write(join_uri(root, LATEST), name.encode())


def advance_latest(directory: str) -> bool:
    """Make ``latest`` name ``directory`` (a committed checkpoint: its manifest is written)
    unless it already names it or a newer one: a commit whose ``latest`` write failed (a full
    disk) is finished when that checkpoint is written again. Returns whether it wrote."""
    root, name = directory.rstrip("/").rsplit("/", 1)
    mine = _ITER_NAME.fullmatch(name)
    if mine is None:
        raise StorageError(f"{directory} is not a checkpoint directory")
    current = (read_bytes(join_uri(root, LATEST)) or b"").decode(errors="replace").strip()
    found = _ITER_NAME.fullmatch(current)
    if found is not None and int(found.group(1)) >= int(mine.group(1)):
        return False
    atomic_write(join_uri(root, LATEST), name.encode())
    return True


def _every_nth(fs: Any, path: str, name: str, every: int) -> bool:
    """Whether checkpoint ``name`` is one of the job's every ``every``-th (its manifest's
    epoch is a multiple of ``every`` x checkpoint_every); False when unreadable or unset."""
    if every <= 0:
        return False
    try:
        with fs.open(f"{path}/{name}/{MANIFEST}", "rb") as fh:
            manifest = json.loads(fh.read())
        epoch, period = int(manifest["epoch"]), int(manifest.get("checkpoint_every") or 0)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return period > 0 and epoch > 0 and epoch % (period * every) == 0


def prune_checkpoints(
    storage_uri: str, job_id: str, keep: int, every: int = 0
) -> tuple[list[str], int]:
    """Delete the job's checkpoint directories older than its newest ``keep`` complete ones
    (``keep`` <= 0: :data:`DEFAULT_KEEP`), except every ``every``-th checkpoint (> 0), kept
    for good: the complete ones whose manifest says they were written at an epoch that is a
    multiple of ``every`` x its ``checkpoint_every`` (the Nth, 2Nth, ... checkpoint of the
    job, counted the same after any deletion). Never deletes the checkpoint ``latest`` names
    (the one a restarted job resumes from) nor anything newer than the oldest one kept (a
    checkpoint being written has no manifest yet but a higher iteration). Returns the names
    deleted and the bytes reclaimed. A directory that vanishes meanwhile is skipped."""
    keep = keep if keep > 0 else DEFAULT_KEEP
    root = job_uri(storage_uri, job_id, "checkpoints")
    fs, path = fsspec.core.url_to_fs(root)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return [], 0
    latest = (read_bytes(join_uri(root, LATEST)) or b"").decode(errors="replace").strip()
    found: list[tuple[int, str]] = []
    for entry in entries:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        match = _ITER_NAME.fullmatch(name)
        if match is not None:
            found.append((int(match.group(1)), name))
    complete = sorted(
        ((k, n) for k, n in found if fs.exists(f"{path}/{n}/{MANIFEST}")), reverse=True
    )
    kept = {n for _, n in complete[:keep]} | {latest}
    if len(complete) <= keep:
        return [], 0
    oldest_kept = min(k for k, n in complete if n in kept)
    archived = {n for k, n in complete if k < oldest_kept and _every_nth(fs, path, n, every)}
    deleted: list[str] = []
    reclaimed = 0
    for k, name in sorted(found):
        if k >= oldest_kept or name in kept or name in archived:
            continue
        directory = f"{path}/{name}"
        try:
            size = int(fs.du(directory))
            # The manifest first: a half-deleted checkpoint is never listed as complete.
            if fs.exists(f"{directory}/{MANIFEST}"):
                fs.rm(f"{directory}/{MANIFEST}")
            fs.rm(directory, recursive=True)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StorageError(f"cannot delete {join_uri(root, name)}: {exc}") from exc
        deleted.append(name)
        reclaimed += size
    return deleted, reclaimed
