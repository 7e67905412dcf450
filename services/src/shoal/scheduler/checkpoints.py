"""A job's checkpoints as the API shows them: listed from their manifests, served file by file.

The data plane writes checkpoints under ``jobs/<job_id>/checkpoints/iter-<k>/`` (shard files,
then ``manifest.json`` last, then ``checkpoints/latest``; see
:mod:`shoal.param_sync.checkpoint`). Only directories with a readable manifest are complete and
listed; the files that can be downloaded are exactly those the manifest names, plus the
manifest itself, so no request can name any other path. The manifest keys read here are the
few that describe a checkpoint (``iteration``, ``epoch``, ``generation``, ``time`` and
``shards[].file|size|sha256``); the rest of the format belongs to the data plane.

No grpc here: :class:`~shoal.scheduler.service.JobApi` calls these and maps the errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from shoal.contract import ids
from shoal.contract.errors import FailedPrecondition, InvalidField, NotFound, ShoalError
from shoal.scheduler.artifacts import Storage
from shoal.scheduler.jobs import timestamp, validate_page_size
from shoal.v1 import job_scheduler_service_pb2 as js_pb2

__all__ = [
    "MANIFEST",
    "checkpoint_file_path",
    "copy_checkpoint",
    "list_checkpoints",
    "page_checkpoints",
    "parse_resume_from",
]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
_NAME = re.compile(r"^iter-(0|[1-9][0-9]{0,17})$")
# A file a manifest names must be a plain name in the checkpoint's directory: whatever the
# manifest says, nothing else is ever listed or served.
_FILE = re.compile(r"^(?!\.)[A-Za-z0-9._-]{1,255}$")


def _parse_name(field_name: str, name: str) -> int:
    """The iteration of a checkpoint name (``iter-<k>``); INVALID_ARGUMENT otherwise."""
    match = _NAME.match(name)
    if match is None:
        raise InvalidField(field_name, name[:80], "must be a checkpoint name like 'iter-120'")
    return int(match.group(1))


def _checkpoints_dir(storage: Storage, job_id: str) -> str:
    return storage.path("jobs", job_id, "checkpoints")


def _read_json(storage: Storage, path: str) -> dict[str, Any] | None:
    try:
        with storage.fs.open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("checkpoint manifest %s unreadable: %s", path, exc)
        return None
    return data if isinstance(data, dict) else None


def _files(manifest: dict[str, Any], manifest_size: int) -> list[js_pb2.JobCheckpointFile]:
    files = [js_pb2.JobCheckpointFile(name=MANIFEST, size_bytes=manifest_size)]
    for shard in manifest.get("shards") or []:
        if not isinstance(shard, dict) or not isinstance(shard.get("file"), str):
            continue
        if not _FILE.match(shard["file"]) or shard["file"] == MANIFEST:
            log.warning("checkpoint manifest names a file %r: not listed", shard["file"][:80])
            continue
        files.append(
            js_pb2.JobCheckpointFile(
                name=shard["file"],
                size_bytes=int(shard.get("size") or 0),
                sha256=str(shard.get("sha256") or ""),
            )
        )
    return files


def _describe(
    storage: Storage, directory: str, name: str, latest: str
) -> js_pb2.JobCheckpoint | None:
    """The checkpoint in ``directory``, or None while it has no manifest (incomplete)."""
    path = f"{directory}/{MANIFEST}"
    manifest = _read_json(storage, path)
    if manifest is None:
        return None
    files = _files(manifest, int(storage.fs.size(path)))
    checkpoint = js_pb2.JobCheckpoint(
        name=name,
        iteration=int(manifest.get("iteration", _parse_name("checkpoint", name))),
        epoch=int(manifest.get("epoch") or 0),
        generation=int(manifest.get("generation") or 0),
        size_bytes=sum(f.size_bytes for f in files),
        files=files,
        latest=name == latest,
    )
    when = manifest.get("time")
    if isinstance(when, int | float):
        checkpoint.create_time.CopyFrom(timestamp(float(when)))
    return checkpoint


def _list(storage: Storage, job_id: str) -> list[js_pb2.JobCheckpoint]:
    root = _checkpoints_dir(storage, job_id)
    try:
        entries = storage.fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    try:
        with storage.fs.open(f"{root}/{LATEST}", "rb") as f:
            latest = f.read().decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        latest = ""
    found: list[tuple[int, js_pb2.JobCheckpoint]] = []
    for entry in entries:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        match = _NAME.match(name)
        if match is None:
            continue  # `latest`, temporary files
        checkpoint = _describe(storage, f"{root}/{name}", name, latest)
        if checkpoint is not None:
            found.append((int(match.group(1)), checkpoint))
    return [c for _, c in sorted(found, key=lambda item: item[0])]


async def list_checkpoints(storage: Storage, job_id: str) -> list[js_pb2.JobCheckpoint]:
    """A job's complete checkpoints, oldest first (the job must have been checked visible)."""
    return await asyncio.to_thread(_list, storage, job_id)


def page_checkpoints(
    checkpoints: Sequence[js_pb2.JobCheckpoint], *, page_size: int, page_token: str
) -> tuple[list[js_pb2.JobCheckpoint], str]:
    """One page, oldest first. The token is the name of the last checkpoint of the page, so a
    checkpoint written between two pages is not skipped and none is repeated."""
    size = validate_page_size(page_size)
    rest = list(checkpoints)
    if page_token:
        after = _parse_name("page_token", page_token)
        rest = [c for c in rest if c.iteration > after]
    page = rest[:size]
    return page, (page[-1].name if len(rest) > size else "")


async def checkpoint_file_path(
    storage: Storage, job_id: str, checkpoint: str, file: str
) -> tuple[str, str]:
    """(storage path, sha256 as the manifest records it or "") of one file of a complete
    checkpoint. The checkpoint name must be well-formed (INVALID_ARGUMENT), the checkpoint
    complete and the file one that it lists (NOT_FOUND otherwise)."""
    _parse_name("checkpoint", checkpoint)
    directory = f"{_checkpoints_dir(storage, job_id)}/{checkpoint}"

    def names() -> dict[str, str] | None:
        manifest = _read_json(storage, f"{directory}/{MANIFEST}")
        if manifest is None:
            return None
        return {f.name: f.sha256 for f in _files(manifest, 0)}

    listed = await asyncio.to_thread(names)
    if listed is None:
        raise NotFound(f"checkpoint of job {job_id!r}", checkpoint)
    if file not in listed:
        raise NotFound(f"file of checkpoint {checkpoint!r}", file[:200])
    return f"{directory}/{file}", listed[file]


class CheckpointNotFound(NotFound):
    """NOT_FOUND for a checkpoint of a job, saying why or which ones there are."""

    def __init__(self, job_id: str, name: str, why: str) -> None:
        ShoalError.__init__(self, f"checkpoint {name!r} of job {job_id!r} not found ({why})")


def parse_resume_from(value: str) -> tuple[str, str]:
    """``JobSpec.resume_from`` -> (job id, checkpoint name or "" for the newest):
    "JOB_ID" or "JOB_ID/iter-K"; INVALID_ARGUMENT naming the field otherwise."""
    job_id, _, name = value.partition("/")
    if not ids.is_valid(ids.IdKind.JOB, job_id):
        raise InvalidField(
            "spec.resume_from", value[:200], "must be JOB_ID or JOB_ID/iter-K (a job id first)"
        )
    if name:
        _parse_name("spec.resume_from", name)
    return job_id, name


async def choose_checkpoint(
    storage: Storage, job_id: str, name: str
) -> tuple[js_pb2.JobCheckpoint, dict[str, Any]]:
    """The complete checkpoint ``name`` of ``job_id`` (the newest with "") and its manifest;
    NOT_FOUND naming the checkpoints there are otherwise."""
    listed = await list_checkpoints(storage, job_id)
    chosen = [c for c in listed if c.name == name] if name else listed[-1:]
    if not chosen:
        there = ", ".join(c.name for c in listed) or "none"
        raise CheckpointNotFound(job_id, name or "newest", f"it has: {there}")
    directory = f"{_checkpoints_dir(storage, job_id)}/{chosen[0].name}"
    manifest = await asyncio.to_thread(_read_json, storage, f"{directory}/{MANIFEST}")
    if manifest is None:  # deleted by the job's retention since it was listed
        raise CheckpointNotFound(job_id, chosen[0].name, "deleted by the job's retention")
    return chosen[0], manifest


def _copy(storage: Storage, source_job: str, checkpoint: js_pb2.JobCheckpoint, job_id: str) -> int:
    src = f"{_checkpoints_dir(storage, source_job)}/{checkpoint.name}"
    root = _checkpoints_dir(storage, job_id)
    dst = f"{root}/{checkpoint.name}"
    fs = storage.fs
    fs.makedirs(dst, exist_ok=True)
    copied = 0
    try:
        # Shard files first, each checked against the manifest; the manifest, then
        # ``latest``, last: the commit order of the data plane, so a copy cut short is an
        # incomplete checkpoint that nothing resumes from.
        for f in checkpoint.files:
            if f.name == MANIFEST:
                continue
            data = fs.cat_file(f"{src}/{f.name}")
            if len(data) != f.size_bytes or (
                f.sha256 and hashlib.sha256(data).hexdigest() != f.sha256
            ):
                raise FailedPrecondition(
                    f"checkpoint {checkpoint.name} of job {source_job!r}: {f.name} does not "
                    "match its manifest"
                )
            fs.pipe_file(f"{dst}/{f.name}", data)
            copied += len(data)
        manifest = fs.cat_file(f"{src}/{MANIFEST}")
        fs.pipe_file(f"{dst}/{MANIFEST}", manifest)
        fs.pipe_file(f"{root}/{LATEST}", checkpoint.name.encode())
    except FileNotFoundError:
        fs.rm(root, recursive=True)
        raise CheckpointNotFound(
            source_job, checkpoint.name, "deleted by the job's retention while it was copied"
        ) from None
    except BaseException:
        with contextlib.suppress(OSError):
            fs.rm(root, recursive=True)
        raise
    return copied + len(manifest)


async def copy_checkpoint(
    storage: Storage, source_job: str, checkpoint: js_pb2.JobCheckpoint, job_id: str
) -> int:
    """Copy a complete checkpoint of ``source_job`` into the new job ``job_id``'s checkpoints
    and point its ``latest`` at it, so that the new job starts as if it had recovered from it.
    Returns the bytes copied."""
    return await asyncio.to_thread(_copy, storage, source_job, checkpoint, job_id)
