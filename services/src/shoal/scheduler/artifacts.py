"""Storage of the scheduler on an fsspec URI: content-addressed artifacts, and the job files the
data plane writes (final model, metrics) that the scheduler serves.

Layout under the storage root (``--storage-uri``; any fsspec URI, a local directory by
default)::

    artifacts/<sha256>.tar.gz       the uploaded bytes (a tar.gz of the model directory); a
                                    host-agent's --artifact-dir can point at artifacts/
    artifacts/<sha256>.json         {"name", "size_bytes", "sha256", "created", "owners"}
    artifacts/.uploads/<uuid>       uploads in progress (renamed into place when verified)
    artifacts/.owners/<h>.json      {sha256: size_bytes} of the artifacts one principal
                                    uploaded (``h``: the sha256 of its name): its quota use

Artifacts are content-addressed, so two users who upload the same bytes share one file; each
is an owner. Only an owner (or an admin or a service: the host agents) may download an
artifact or submit a job that runs it; anyone else gets NOT_FOUND, as for an artifact that
does not exist. Each principal may own ``quota_bytes`` of artifacts (admins have no quota);
an upload over it fails with RESOURCE_EXHAUSTED (``ERROR_REASON_QUOTA_EXCEEDED``) saying the
use, the limit and the size, before anything is stored. Uploading bytes one already owns costs
nothing (when the header names their sha256, as the client does).
    jobs/<job_id>/model.safetensors the final model (written by the parameter-sync shards)
    jobs/<job_id>/metrics/iterations.jsonl  one IterationMetric per line (protobuf JSON)
    jobs/<job_id>/metrics/epochs.jsonl      one EpochMetric per line (protobuf JSON)
                                            (on an object store, their appends an object
                                            each in <file>.parts/: shoal.contract.records)

fsspec calls are blocking; they run in worker threads (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import errno
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import fsspec
from google.protobuf import json_format
from google.protobuf.message import Message

from shoal.contract import ids, records
from shoal.contract.errors import InvalidField, QuotaExceeded, StorageFull, TooLarge
from shoal.runtime.auth import Principal, Role
from shoal.scheduler.jobs import ArtifactNotFound
from shoal.v1 import job_pb2

__all__ = ["ArtifactInfo", "ArtifactStore", "Storage", "read_jsonl_metrics"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class ArtifactInfo:
    """A stored artifact."""

    artifact_id: str
    name: str
    size_bytes: int


class Storage:
    """The scheduler's view of the storage URI (see the module docstring for the layout)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.uri)
        self.root = root.rstrip("/")

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def job_uri(self, job_id: str) -> str:
        """Where a job's files are (``<storage>/jobs/<job_id>``)."""
        return f"{self.uri}/jobs/{job_id}"

    def model_path(self, job_id: str) -> str:
        return self.path("jobs", job_id, "model.safetensors")

    async def read_metrics(self, job_id: str, name: str) -> str | None:
        """A job's record file ``metrics/<name>`` as text (on an object store its appends
        joined: ``shoal.contract.records``), or None if there is none."""
        uri = f"{self.job_uri(job_id)}/metrics/{name}"
        data = await asyncio.to_thread(records.read, uri)
        return None if data is None else data.decode("utf-8", errors="replace")

    async def exists(self, path: str) -> bool:
        return bool(await asyncio.to_thread(self.fs.exists, path))

    async def size(self, path: str) -> int:
        return int(await asyncio.to_thread(self.fs.size, path))

    async def read_text(self, path: str) -> str | None:
        """The file's text, or None if it does not exist."""

        def read() -> str | None:
            try:
                with self.fs.open(path, "rb") as f:
                    return f.read().decode("utf-8", errors="replace")
            except FileNotFoundError:
                return None

        return await asyncio.to_thread(read)

    async def read_chunks(self, path: str, chunk_bytes: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
        """The file's bytes in chunks; FileNotFoundError if it does not exist."""
        f = await asyncio.to_thread(self.fs.open, path, "rb")
        try:
            while True:
                chunk = await asyncio.to_thread(f.read, chunk_bytes)
                if not chunk:
                    return
                yield chunk
        finally:
            await asyncio.to_thread(f.close)


class ArtifactStore:
    """Content-addressed artifacts (sha256) on :class:`Storage`, with a size limit."""

    def __init__(self, storage: Storage, *, max_bytes: int, quota_bytes: int | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes ({max_bytes}) must be >= 1")
        if quota_bytes is not None and quota_bytes < 1:
            raise ValueError(f"quota_bytes ({quota_bytes}) must be >= 1")
        self.storage = storage
        self.max_bytes = max_bytes
        self.quota_bytes = quota_bytes
        # Owner and quota records are read-modified-written; uploads run on the leader only.
        self._owners_lock = asyncio.Lock()

    # -- owners and quota -----------------------------------------------------------------------

    def _usage_path(self, owner: str) -> str:
        name = hashlib.sha256(owner.encode()).hexdigest()
        return self.storage.path("artifacts", ".owners", f"{name}.json")

    async def _read_json(self, path: str) -> dict[str, Any]:
        text = await self.storage.read_text(path)
        if not text:
            return {}
        try:
            doc = json.loads(text)
        except ValueError:
            log.warning("%s: unreadable, treated as empty", path)
            return {}
        return doc if isinstance(doc, dict) else {}

    async def _write_json(self, path: str, doc: dict[str, Any]) -> None:
        fs = self.storage.fs

        def write() -> None:
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with fs.open(tmp, "w") as f:
                f.write(json.dumps(doc, sort_keys=True))
            fs.mv(tmp, path)

        await asyncio.to_thread(write)

    async def usage(self, owner: str) -> dict[str, int]:
        """The artifacts ``owner`` uploaded: sha256 -> size."""
        doc = await self._read_json(self._usage_path(owner))
        return {k: int(v) for k, v in doc.items() if ids.is_valid(ids.IdKind.ARTIFACT, k)}

    async def owners(self, artifact_id: str) -> list[str]:
        if not ids.is_valid(ids.IdKind.ARTIFACT, artifact_id):
            return []
        owners = (await self._read_json(self._meta(artifact_id))).get("owners", [])
        return [str(o) for o in owners] if isinstance(owners, list) else []

    async def visible_to(self, principal: Principal, artifact_id: str) -> bool:
        """Whether ``principal`` may download ``artifact_id`` or submit a job running it: its
        owners, admins and services (whether it exists is another question)."""
        if principal.role in (Role.ADMIN, Role.SERVICE):
            return True
        if principal.role is not Role.USER:
            return False
        return principal.name in await self.owners(artifact_id)

    def _check_quota(self, owner: str, used: int, more: int) -> None:
        if self.quota_bytes is not None and used + more > self.quota_bytes:
            raise QuotaExceeded(
                f"artifact quota of {owner!r} exceeded: {used / MiB:.1f} MiB used of "
                f"{self.quota_bytes / MiB:.1f} MiB, and this artifact needs {more / MiB:.1f} "
                "MiB more (an admin can raise --artifact-quota-mb)"
            )

    async def _add_owner(self, owner: str, artifact_id: str, size: int) -> None:
        async with self._owners_lock:
            meta = await self._read_json(self._meta(artifact_id))
            owners = meta.get("owners") if isinstance(meta.get("owners"), list) else []
            if owner not in owners:
                meta["owners"] = [*owners, owner]
                await self._write_json(self._meta(artifact_id), meta)
            usage = await self._read_json(self._usage_path(owner))
            if artifact_id not in usage:
                usage[artifact_id] = size
                await self._write_json(self._usage_path(owner), usage)

    def _data(self, artifact_id: str) -> str:
        return self.storage.path("artifacts", f"{artifact_id}.tar.gz")

    def _meta(self, artifact_id: str) -> str:
        return self.storage.path("artifacts", f"{artifact_id}.json")

    @staticmethod
    def check_id(artifact_id: str, field_name: str = "artifact_id") -> None:
        if not ids.is_valid(ids.IdKind.ARTIFACT, artifact_id):
            raise InvalidField(field_name, artifact_id, ids.describe(ids.IdKind.ARTIFACT))

    async def exists(self, artifact_id: str) -> bool:
        if not ids.is_valid(ids.IdKind.ARTIFACT, artifact_id):
            return False
        return await self.storage.exists(self._data(artifact_id))

    async def info(self, artifact_id: str) -> ArtifactInfo:
        self.check_id(artifact_id)
        if not await self.exists(artifact_id):
            raise ArtifactNotFound(artifact_id)
        size = await self.storage.size(self._data(artifact_id))
        name = ""
        text = await self.storage.read_text(self._meta(artifact_id))
        if text:
            try:
                name = str(json.loads(text).get("name", ""))
            except ValueError:
                log.warning("artifact %s: unreadable metadata", artifact_id)
        return ArtifactInfo(artifact_id, name, size)

    async def upload(
        self,
        *,
        name: str,
        declared_size: int,
        declared_sha256: str,
        chunks: AsyncIterator[bytes],
        owner: Principal | None = None,
    ) -> ArtifactInfo:
        """Store the bytes of ``chunks`` (see :meth:`_upload`). A full storage (ENOSPC, a disk
        quota) is :class:`StorageFull` (RESOURCE_EXHAUSTED), not an internal error; nothing
        partial is kept."""
        try:
            return await self._upload(
                name=name,
                declared_size=declared_size,
                declared_sha256=declared_sha256,
                chunks=chunks,
                owner=owner,
            )
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFull(
                    f"the artifact storage ({self.storage.uri}) is full: "
                    f"{exc.strerror or exc}; artifact {name!r} was not stored"
                ) from exc
            raise

    async def _upload(
        self,
        *,
        name: str,
        declared_size: int,
        declared_sha256: str,
        chunks: AsyncIterator[bytes],
        owner: Principal | None = None,
    ) -> ArtifactInfo:
        """Store the bytes of ``chunks``; verify the declared size and sha256 (when given);
        record ``owner`` as an owner (its quota counts the bytes unless it owns them already).

        Raises :class:`TooLarge` (RESOURCE_EXHAUSTED) over the limit, :class:`QuotaExceeded`
        (RESOURCE_EXHAUSTED) over the owner's quota, :class:`InvalidField` on a mismatch.
        Nothing is stored unless the upload is complete, verified and within the quota.
        """
        if declared_size < 0:
            raise InvalidField("header.size_bytes", declared_size, "must be >= 0")
        if declared_size > self.max_bytes:
            raise TooLarge(
                f"header.size_bytes ({declared_size}) is over the artifact size limit "
                f"({self.max_bytes} bytes)"
            )
        if declared_sha256 and not ids.is_valid(ids.IdKind.ARTIFACT, declared_sha256):
            raise InvalidField("header.sha256", declared_sha256, "must be a lowercase hex sha256")
        if len(name) > 255:
            raise InvalidField("header.name", name[:40] + "...", "must be at most 255 characters")
        quota_owner = owner.name if owner is not None and owner.role is not Role.ADMIN else None
        owned: dict[str, int] = {}
        if quota_owner is not None and self.quota_bytes is not None:
            owned = await self.usage(quota_owner)
            if declared_sha256 not in owned:
                self._check_quota(quota_owner, sum(owned.values()), declared_size)
        used = sum(owned.values())
        fs = self.storage.fs
        tmp = self.storage.path("artifacts", ".uploads", uuid.uuid4().hex)
        await asyncio.to_thread(fs.makedirs, self.storage.path("artifacts", ".uploads"), True)
        digest = hashlib.sha256()
        size = 0
        done = False
        f = await asyncio.to_thread(fs.open, tmp, "wb")
        try:
            try:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise TooLarge(
                            f"artifact ({size}+ bytes received) is over the artifact size "
                            f"limit ({self.max_bytes} bytes)"
                        )
                    if quota_owner is not None and declared_sha256 not in owned:
                        self._check_quota(quota_owner, used, size)
                    digest.update(chunk)
                    await asyncio.to_thread(f.write, chunk)
            finally:
                await asyncio.to_thread(f.close)
            if declared_size and size != declared_size:
                raise InvalidField(
                    "header.size_bytes", declared_size, f"does not match the {size} bytes sent"
                )
            artifact_id = digest.hexdigest()
            if declared_sha256 and declared_sha256 != artifact_id:
                raise InvalidField(
                    "header.sha256",
                    declared_sha256,
                    f"does not match the bytes (sha256 {artifact_id})",
                )
            final = self._data(artifact_id)
            meta = {
                "name": name,
                "size_bytes": size,
                "sha256": artifact_id,
                "created": dt.datetime.now(dt.UTC).isoformat(),
            }

            def publish() -> None:
                if fs.exists(final):
                    fs.rm(tmp)  # same content already stored
                else:
                    fs.mv(tmp, final)
                if not fs.exists(self._meta(artifact_id)):
                    with fs.open(self._meta(artifact_id), "w") as m:
                        m.write(json.dumps(meta))

            if quota_owner is not None and artifact_id not in owned:
                self._check_quota(quota_owner, used, size)
            await asyncio.to_thread(publish)
            if owner is not None:
                await self._add_owner(owner.name, artifact_id, size)
            done = True
            return ArtifactInfo(artifact_id, name, size)
        finally:
            if not done:
                await asyncio.to_thread(_remove_quietly, fs, tmp)

    async def download(self, artifact_id: str) -> tuple[ArtifactInfo, AsyncIterator[bytes]]:
        info = await self.info(artifact_id)
        return info, self.storage.read_chunks(self._data(artifact_id))


def _remove_quietly(fs: Any, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path)
    except OSError as exc:  # best effort
        log.warning("could not remove %s: %s", path, exc)


def _parse_line(line: str, message: Message) -> Message:
    doc = json.loads(line)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    when = doc.get("time")
    if isinstance(when, int | float):  # unix seconds are accepted too
        doc["time"] = dt.datetime.fromtimestamp(when, dt.UTC).isoformat().replace("+00:00", "Z")
    return json_format.ParseDict(doc, message, ignore_unknown_fields=True)


def read_jsonl_metrics(
    text: str | None, kind: type[job_pb2.IterationMetric] | type[job_pb2.EpochMetric]
) -> list[Any]:
    """Parse a metrics file (one JSON object per line, protobuf JSON mapping of ``kind``).

    Blank lines are skipped; an unparsable *last* line is a write in progress and is skipped;
    an unparsable line elsewhere is logged and skipped.
    """
    if not text:
        return []
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(_parse_line(line, kind()))
        except (ValueError, json_format.ParseError) as exc:
            if any(rest.strip() for rest in lines[i + 1 :]):
                log.warning("metrics line %d unreadable: %s", i + 1, exc)
    return out
