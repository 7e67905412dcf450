"""Storage of the scheduler on an fsspec URI: content-addressed artifacts, and the job files the
data plane writes (final model, metrics) that the scheduler serves.

Layout under the storage root (``--storage-uri``; any fsspec URI, a local directory by
default)::

    artifacts/<sha256>.tar.gz       the uploaded bytes (a tar.gz of the model directory); a
                                    host-agent's --artifact-dir can point at artifacts/
    artifacts/<sha256>.json         {"name", "size_bytes", "sha256", "created"}
    artifacts/.uploads/<uuid>       uploads in progress (renamed into place when verified)
    jobs/<job_id>/model.safetensors the final model (written by the parameter-sync shards)
    jobs/<job_id>/metrics/iterations.jsonl  one IterationMetric per line (protobuf JSON)
    jobs/<job_id>/metrics/epochs.jsonl      one EpochMetric per line (protobuf JSON)

fsspec calls are blocking; they run in worker threads (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import fsspec
from google.protobuf import json_format
from google.protobuf.message import Message

from shoal.runtime.errors import InvalidField, TooLarge
from shoal.scheduler.jobs import ArtifactNotFound
from shoal.v1 import job_pb2

__all__ = ["ArtifactInfo", "ArtifactStore", "Storage", "read_jsonl_metrics"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


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

    def metrics_path(self, job_id: str, name: str) -> str:
        return self.path("jobs", job_id, "metrics", name)

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

    def __init__(self, storage: Storage, *, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes ({max_bytes}) must be >= 1")
        self.storage = storage
        self.max_bytes = max_bytes

    def _data(self, artifact_id: str) -> str:
        return self.storage.path("artifacts", f"{artifact_id}.tar.gz")

    def _meta(self, artifact_id: str) -> str:
        return self.storage.path("artifacts", f"{artifact_id}.json")

    @staticmethod
    def check_id(artifact_id: str, field_name: str = "artifact_id") -> None:
        if not _SHA256_HEX.match(artifact_id):
            raise InvalidField(field_name, artifact_id, "must be a sha256 in lowercase hex")

    async def exists(self, artifact_id: str) -> bool:
        if not _SHA256_HEX.match(artifact_id):
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
    ) -> ArtifactInfo:
        """Store the bytes of ``chunks``; verify the declared size and sha256 (when given).

        Raises :class:`TooLarge` (RESOURCE_EXHAUSTED) over the limit, :class:`InvalidField`
        on a mismatch. Nothing is stored unless the upload is complete and verified.
        """
        if declared_size < 0:
            raise InvalidField("header.size_bytes", declared_size, "must be >= 0")
        if declared_size > self.max_bytes:
            raise TooLarge(
                f"header.size_bytes ({declared_size}) is over the artifact size limit "
                f"({self.max_bytes} bytes)"
            )
        if declared_sha256 and not _SHA256_HEX.match(declared_sha256):
            raise InvalidField("header.sha256", declared_sha256, "must be a lowercase hex sha256")
        if len(name) > 255:
            raise InvalidField("header.name", name[:40] + "...", "must be at most 255 characters")
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

            await asyncio.to_thread(publish)
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
