"""Artifacts on one host: ``<sha256>.tar.gz`` files fetched once from the first source that has
them, verified by their sha256, kept in a cache, unpacked safely into a learner's ``work/``."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import shutil
import tarfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import fsspec

from shoal.contract import ids
from shoal.contract.errors import ArtifactNotFound, InvalidField

__all__ = [
    "ARTIFACT_ID_RE",
    "ArtifactCache",
    "ArtifactNotFound",
    "ArtifactSource",
    "DirectorySource",
    "unpack",
]

log = logging.getLogger("shoal.host_agent.processes")

ARTIFACT_ID_RE = ids.PATTERNS[ids.IdKind.ARTIFACT]  # use with fullmatch


class ArtifactSource(ABC):
    """Somewhere artifacts can be fetched from."""

    @abstractmethod
    async def fetch(self, artifact_id: str, dest: Path) -> bool:
        """Write the artifact's bytes to ``dest``; False if this source does not have it."""

    @abstractmethod
    def describe(self) -> str: ...


class DirectorySource(ArtifactSource):
    """A directory or fsspec URI holding ``<sha256>.tar.gz`` files (``--artifact-dir``)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")

    def describe(self) -> str:
        return self.uri

    async def fetch(self, artifact_id: str, dest: Path) -> bool:
        return await asyncio.to_thread(self._copy, f"{self.uri}/{artifact_id}.tar.gz", dest)

    @staticmethod
    def _copy(url: str, dest: Path) -> bool:
        try:
            with fsspec.open(url, "rb") as src, dest.open("wb") as out:
                shutil.copyfileobj(src, out, 1024 * 1024)  # type: ignore[misc]
        except FileNotFoundError:
            return False
        return True


class ArtifactCache:
    """Artifacts fetched once per host, verified by their sha256, kept under ``cache_dir``."""

    def __init__(self, cache_dir: Path, sources: Sequence[ArtifactSource]) -> None:
        self.cache_dir = cache_dir
        self.sources = list(sources)
        self._locks: dict[str, asyncio.Lock] = {}

    def path(self, artifact_id: str) -> Path:
        return self.cache_dir / f"{artifact_id}.tar.gz"

    async def get(self, artifact_id: str) -> Path:
        """The local path of the artifact, fetched from the first source that has it."""
        if not ARTIFACT_ID_RE.fullmatch(artifact_id):
            raise InvalidField("artifact_id", artifact_id, "must be a lowercase hex sha256")
        lock = self._locks.setdefault(artifact_id, asyncio.Lock())
        async with lock:
            final = self.path(artifact_id)
            if final.is_file():
                return final
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            problems: list[str] = []
            for source in self.sources:
                tmp = self.cache_dir / f".{artifact_id}.{secrets.token_hex(4)}.part"
                try:
                    found = await source.fetch(artifact_id, tmp)
                    if not found:
                        problems.append(f"not in {source.describe()}")
                        continue
                    digest = await asyncio.to_thread(_sha256, tmp)
                    if digest != artifact_id:
                        problems.append(f"{source.describe()} sent bytes with sha256 {digest}")
                        continue
                    tmp.replace(final)
                    log.info("artifact %s fetched from %s", artifact_id, source.describe())
                    return final
                except (OSError, ConnectionError) as exc:
                    problems.append(f"{source.describe()} failed: {exc}")
                finally:
                    tmp.unlink(missing_ok=True)
            where = "; ".join(problems) or "no artifact source is configured"
            raise ArtifactNotFound(artifact_id, where)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def unpack(archive: Path, dest: Path) -> None:
    """Unpack a tar.gz safely (no absolute paths, no escaping links, no devices)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:*") as tar:
        tar.extractall(dest, filter="data")
