"""Job artifacts unpacked ahead of the learners that need them (issue 16).

A start that unpacks its artifact waits for it: for a model directory with its data that is
seconds. So as soon as a job is placed on this host (its first StartLearner here), the agent
unpacks one more copy of the job's artifact in the background, and the job's next learner on
this host (a grow, a replacement after a failure or a preemption) takes that copy by a rename
instead of unpacking: its start no longer waits for the unpack. Each take starts the next
copy at once.

Safety:

* **per job**: the copies live in ``<work-dir>/prepared/j-<quoted job id>/<artifact id>``; a
  copy is taken only by a learner of the same job with the same artifact id, never by another
  job (a job never sees another job's files, nor a copy another learner already used: the
  learner's ``work/`` is the copy itself, moved, never shared);
* **verified**: before each copy is unpacked, the archive's sha256 is computed again and must
  equal the artifact id (the cache verified it when it was fetched; this also catches a file
  changed on disk since); a mismatch removes the cached archive, so that the next start fetches
  it again, and no copy is made;
* **complete or absent**: a copy is unpacked into a hidden ``.<artifact>.<random>.part``
  directory and renamed to its final name only when complete (same filesystem as the learner
  directories: the take is a rename), with the same safe unpack (tarfile's ``data`` filter);
* **bounded**: at most one ready copy per (job, artifact); a job's copies are removed
  :data:`LINGER_S` after its last learner on this host exited (a replacement that comes back
  within that time still finds one; a drop that finds an unpack running waits for it, since a
  thread cannot be cancelled), and all of them when the agent starts or shuts down (an unpack
  still running at shutdown may leave files, removed at the next start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import tarfile
import urllib.parse
from pathlib import Path

from shoal.host_agent.artifacts import ArtifactCache, _sha256, unpack

__all__ = ["LINGER_S", "PreparedArtifacts"]

log = logging.getLogger(__name__)

LINGER_S = 60.0  # a job's copies outlive its last learner on this host by this much
_RECHECK_S = 0.2  # a drop that found an unpack running looks again this much later


class PreparedArtifacts:
    """Unpacked copies of job artifacts kept ready for the jobs' next learners (module doc)."""

    def __init__(self, directory: Path, artifacts: ArtifactCache, *, enabled: bool = True) -> None:
        self.directory = directory
        self.artifacts = artifacts
        self.enabled = enabled
        self.linger_s = LINGER_S
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._lingering: dict[str, asyncio.TimerHandle] = {}
        self._removing: set[asyncio.Task[None]] = set()
        self.made = 0  # copies unpacked
        self.taken = 0  # starts that took a copy instead of unpacking

    def job_dir(self, job_id: str) -> Path:
        return self.directory / f"j-{urllib.parse.quote(job_id, safe='')}"

    def ready(self, job_id: str, artifact_id: str) -> bool:
        return (self.job_dir(job_id) / artifact_id).is_dir()

    def reset(self) -> None:
        """Remove every copy (a previous agent's leftovers)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- the start path ---------------------------------------------------------------------------

    async def take(self, job_id: str, artifact_id: str, dest: Path) -> bool:
        """Move a ready copy of the job's artifact to ``dest`` (which must not exist); False if
        there is none (the caller unpacks). A copy being made now is waited for: it is ahead of
        an unpack that would start now."""
        if not self.enabled:
            return False
        self._keep(job_id)
        pending = self._tasks.get((job_id, artifact_id))
        if pending is not None and not self.ready(job_id, artifact_id):
            await asyncio.wait([pending])
        ready = self.job_dir(job_id) / artifact_id
        try:
            ready.rename(dest)
        except OSError:
            return False
        self.taken += 1
        return True

    def prepare(self, job_id: str, artifact_id: str) -> None:
        """Make a copy of the job's artifact ready in the background (none if one is ready or
        being made)."""
        if not self.enabled:
            return
        self._keep(job_id)
        key = (job_id, artifact_id)
        if key in self._tasks or self.ready(job_id, artifact_id):
            return
        task = asyncio.get_running_loop().create_task(
            self._make(job_id, artifact_id), name=f"prepare-{job_id}"
        )
        self._tasks[key] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._tasks.get(key) is t:
                del self._tasks[key]

        task.add_done_callback(done)

    async def _make(self, job_id: str, artifact_id: str) -> None:
        archive = self.artifacts.path(artifact_id)
        digest = await asyncio.to_thread(_sha256_or_empty, archive)
        if digest != artifact_id:
            log.warning(
                "artifact %s: the cached archive's sha256 is %s; removed (fetched again by the "
                "next start), no copy prepared for job %r",
                artifact_id,
                digest or "(unreadable)",
                job_id,
            )
            archive.unlink(missing_ok=True)
            return
        parent = self.job_dir(job_id)
        part = parent / f".{artifact_id}.{secrets.token_hex(4)}.part"
        try:
            await asyncio.to_thread(parent.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(unpack, archive, part)
            part.rename(parent / artifact_id)
        except (tarfile.TarError, OSError, EOFError) as exc:
            log.warning("artifact %s: no copy prepared for job %r: %s", artifact_id, job_id, exc)
            return
        finally:
            if part.exists():
                await asyncio.to_thread(shutil.rmtree, part, True)
        self.made += 1

    # -- lifetime ---------------------------------------------------------------------------------

    def _keep(self, job_id: str) -> None:
        handle = self._lingering.pop(job_id, None)
        if handle is not None:
            handle.cancel()

    def release(self, job_id: str) -> None:
        """The job has no learner left on this host: drop its copies after ``linger_s`` (a
        start of the job meanwhile keeps them)."""
        self._keep(job_id)
        loop = asyncio.get_running_loop()
        self._lingering[job_id] = loop.call_later(self.linger_s, self._drop, job_id)

    def _drop(self, job_id: str) -> None:
        self._lingering.pop(job_id, None)
        if any(key[0] == job_id for key in self._tasks):
            # An unpack of the job's runs in a thread, which cancelling would not stop (it
            # would go on writing under the job's directory): look again when it has ended,
            # unless a start of the job comes first (it keeps the copies).
            loop = asyncio.get_running_loop()
            self._lingering[job_id] = loop.call_later(_RECHECK_S, self._drop, job_id)
            return
        # Moved aside first (atomic), then removed off the event loop: a start of the job that
        # comes now finds either its whole copy (taken before) or none (it unpacks), never a
        # copy half removed.
        trash = self.directory / f".removed-{secrets.token_hex(4)}"
        try:
            self.job_dir(job_id).rename(trash)
        except OSError:
            return  # nothing there
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(shutil.rmtree, trash, True), name=f"unprepare-{job_id}"
        )
        self._removing.add(task)
        task.add_done_callback(self._removing.discard)

    async def close(self) -> None:
        for handle in self._lingering.values():
            handle.cancel()
        self._lingering.clear()
        tasks = [*self._tasks.values(), *self._removing]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.reset()


def _sha256_or_empty(path: Path) -> str:
    with contextlib.suppress(OSError):
        if os.path.isfile(path):
            return _sha256(path)
    return ""
