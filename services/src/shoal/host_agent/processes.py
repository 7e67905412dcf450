"""Learner processes on one host: artifacts, start, stop, exits and logs.

Each learner runs in its own directory ``<work_dir>/learners/l-<quoted learner id>/``:

* ``work/`` - the job's artifact (a ``<sha256>.tar.gz`` of the model directory) unpacked; the
  learner's working directory;
* ``output.log`` - what the learner printed, one record per line: ``"1@<ms> "`` (stdout) or
  ``"2@<ms> "`` (stderr), where ``<ms>`` is when the line was written (Unix milliseconds), the
  text, a newline (records without ``@<ms>``, of older agents, read with no time). The agent
  reads both pipes and appends the records, so the two streams keep their relative order and
  one byte offset addresses any line (:func:`read_log`);
* ``train-called`` - touched by the learner library when the script calls ``Trainer.train()``
  (``SHOAL_TRAIN_MARKER``): a learner that exits 0 without it is reported FAILED, with a
  reason saying so (:data:`NO_TRAIN`); a learner that exits non-zero gets its last Python
  traceback in one line appended to its exit reason (:func:`crash_summary`).
* ``learner.json`` - the learner's identity and process group, so that an agent that was killed
  can kill what is left of its learners when it starts again (:func:`reap_orphans`).

A learner is a process group: the entry point is started with ``start_new_session`` (its own
session and group) and with ``PR_SET_PDEATHSIG = SIGKILL`` (``prctl`` through ctypes, in a tiny
wrapper that then execs the entry point: :func:`shoal.runtime.procs.die_with_parent`), so the
learner dies with the
agent. StopLearner sends SIGTERM to the group,
then SIGKILL to the whole group after the grace; when the learner's main process exits, what is
left of its group is killed too. An exit is recorded with its code (negative: the signal) and a
reason in words.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tarfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

from shoal.contract import ids
from shoal.contract.errors import (
    ArtifactNotFound,
    DeviceBusy,
    DeviceNotFound,
    FailedPrecondition,
    FencedOut,
    InvalidField,
    LearnerNotFound,
)
from shoal.host_agent import warm_boot
from shoal.host_agent.artifacts import (
    ARTIFACT_ID_RE,
    ArtifactCache,
    ArtifactSource,
    DirectorySource,
    unpack,
)
from shoal.host_agent.devices import DeviceInfo, cuda_env
from shoal.host_agent.envs import REQUIREMENTS_FILE, JobEnvironments
from shoal.host_agent.groups import (
    group_alive,
    kill_group as _kill_group,
    reap_orphans,
)
from shoal.host_agent.logs import (
    NO_TRAIN,
    STDERR,
    STDOUT,
    TRAIN_MARKER,
    LogRecord,
    _LogWriter,
    crash_summary,
    describe_exit,
    read_log,
)
from shoal.host_agent.prepared import PreparedArtifacts
from shoal.host_agent.records import (
    _PRIVATE_ENV_PREFIXES,
    _RESET_ENV,
    FAILED,
    RUNNING,
    STOPPING,
    SUCCEEDED,
    LaunchRequest,
    Learner,
    _validate_entry_point,
    _validate_id,
)
from shoal.host_agent.warm import BOOT_SOURCE, WarmPool, WarmProcess, accepts as warm_accepts
from shoal.runtime import telemetry
from shoal.runtime.procs import die_with_parent

__all__ = [
    "NO_TRAIN",
    "STDERR",
    "STDOUT",
    "TRAIN_MARKER",
    "ArtifactCache",
    "ArtifactNotFound",
    "ArtifactSource",
    "DeviceBusy",
    "DeviceNotFound",
    "DirectorySource",
    "LaunchRequest",
    "Learner",
    "LearnerNotFound",
    "LogRecord",
    "ProcessManager",
    "crash_summary",
    "describe_exit",
    "group_alive",
    "read_log",
    "reap_orphans",
    "unpack",
]

log = logging.getLogger(__name__)

# DeviceNotFound, LearnerNotFound, ArtifactNotFound and DeviceBusy are defined in
# shoal.contract.errors (imported above, exported here); Learner, LaunchRequest and the checks of
# StartLearner's fields in shoal.host_agent.records.


class ProcessManager:
    """Starts, stops and watches the learners of this host."""

    def __init__(
        self,
        work_dir: Path,
        artifacts: ArtifactCache,
        *,
        host_id: str,
        python: str = sys.executable,
        stop_grace_s: float = 10.0,
        base_env: Mapping[str, str] | None = None,
        on_exit: Callable[[Learner], None] | None = None,
        learner_env: Mapping[str, str] | None = None,
        envs: JobEnvironments | None = None,
        warm_learners: int = 0,
    ) -> None:
        self.work_dir = work_dir
        self.learners_dir = work_dir / "learners"
        self.artifacts = artifacts
        self.host_id = host_id
        self.python = python
        self.stop_grace_s = stop_grace_s
        self.incarnation = 0
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._learner_env = dict(learner_env or {})  # the agent's part of the contract (TLS)
        self._learners: dict[str, Learner] = {}
        self._starting: dict[str, asyncio.Task[Learner]] = {}
        self._starting_jobs: dict[str, str] = {}  # learner id -> job id, while it starts
        # Learners whose environment is being built (STARTING): their log and StopLearner
        # reach them; heartbeats and ListLearners do not list them until they run.
        self._building: dict[str, Learner] = {}
        self._reserved: dict[str, str] = {}  # device id -> learner id being started
        self._background: set[asyncio.Task[None]] = set()
        self._fence_revision: dict[str, int] = {}
        self._on_exit = on_exit
        # Per-job venvs for artifacts that carry requirements.txt (built without the agent's
        # secrets in pip's environment).
        self.envs = (
            envs
            if envs is not None
            else JobEnvironments(
                work_dir / "envs",
                base_python=python,
                env={
                    k: v
                    for k, v in self._base_env.items()
                    if not k.startswith(_PRIVATE_ENV_PREFIXES)
                },
            )
        )

        # Warm learner processes (shoal.host_agent.warm): the same environment a cold learner
        # starts from, minus what is the job's.
        self.warm = WarmPool(
            work_dir / "warm",
            python=python,
            env={
                k: v
                for k, v in self._base_env.items()
                if not k.startswith(_PRIVATE_ENV_PREFIXES) and k not in _RESET_ENV
            },
            size=warm_learners,
        )
        # The jobs' artifacts unpacked ahead of their next learners on this host.
        self.prepared = PreparedArtifacts(work_dir / "prepared", artifacts)

    # -- queries -------------------------------------------------------------------------------

    def get(self, learner_id: str) -> Learner:
        learner = self._learners.get(learner_id) or self._building.get(learner_id)
        if learner is None:
            raise LearnerNotFound(learner_id)
        return learner

    def learners(self, job_id: str = "") -> list[Learner]:
        return [
            learner for learner in self._learners.values() if not job_id or learner.job_id == job_id
        ]

    def busy(self, device_id: str) -> Learner | None:
        return next(
            (
                learner
                for learner in self._learners.values()
                if learner.device.device_id == device_id and not learner.terminal
            ),
            None,
        )

    def adopt_incarnation(self, incarnation: int) -> None:
        """The agent (re-)registered: new learners start under ``incarnation``; learners started
        before the first registration (incarnation 0) belong to it too."""
        self.incarnation = incarnation
        for learner in self._learners.values():
            if learner.host_incarnation == 0:
                learner.host_incarnation = incarnation

    def forget_exited(self, older_than_s: float, *, reported: bool = True) -> list[str]:
        """Forget learners that exited more than ``older_than_s`` ago (and whose exit the
        resource manager acknowledged, if ``reported``); remove their directories. Returns
        their ids."""
        now = time.time()
        gone = [
            learner
            for learner in self._learners.values()
            if learner.terminal
            and (learner.exit_acked or not reported)
            and now - learner.end_time > older_than_s
        ]
        for learner in gone:
            del self._learners[learner.learner_id]
            shutil.rmtree(learner.directory, ignore_errors=True)
        return [learner.learner_id for learner in gone]

    # -- start ---------------------------------------------------------------------------------

    def directory_for(self, learner_id: str) -> Path:
        return self.learners_dir / f"l-{urllib.parse.quote(learner_id, safe='')}"

    async def start(self, request: LaunchRequest, devices: Sequence[DeviceInfo]) -> Learner:
        """Start a learner; a learner id that exists already is returned as it is.

        Raises InvalidField, DeviceNotFound, DeviceBusy, FencedOut, ArtifactNotFound; on any
        error nothing is left behind."""
        _validate_id("learner_id", request.learner_id, ids.IdKind.LEARNER)
        _validate_id("job_id", request.job_id, ids.IdKind.JOB)
        _validate_id("device_id", request.device_id, ids.IdKind.DEVICE)
        _validate_entry_point(request.entry_point)
        if not ARTIFACT_ID_RE.fullmatch(request.artifact_id):
            raise InvalidField("artifact_id", request.artifact_id, "must be a lowercase hex sha256")
        for key in request.env:
            if not key or "=" in key or "\0" in key:
                raise InvalidField("env", key, "keys must be non-empty without '=' or NUL")
        existing = self._learners.get(request.learner_id)
        if existing is not None:
            if (existing.job_id, existing.device.device_id) != (
                request.job_id,
                request.device_id,
            ):
                raise FailedPrecondition(
                    f"learner {request.learner_id!r} already exists for job "
                    f"{existing.job_id!r} on device {existing.device.device_id!r}"
                )
            return existing
        pending = self._starting.get(request.learner_id)
        if pending is not None:
            return await asyncio.shield(pending)
        device = next((d for d in devices if d.device_id == request.device_id), None)
        if device is None:
            raise DeviceNotFound(request.device_id, [d.device_id for d in devices])
        holder = self.busy(request.device_id)
        who = holder.learner_id if holder is not None else self._reserved.get(request.device_id)
        if who is not None:
            raise DeviceBusy(f"device {request.device_id!r} is busy with learner {who!r}")
        self._check_fence(request)
        self._reserved[request.device_id] = request.learner_id
        task = asyncio.get_running_loop().create_task(self._launch(request, device))
        self._starting[request.learner_id] = task
        self._starting_jobs[request.learner_id] = request.job_id

        def done(_: asyncio.Task[Learner]) -> None:
            self._starting.pop(request.learner_id, None)
            self._starting_jobs.pop(request.learner_id, None)
            self._reserved.pop(request.device_id, None)

        task.add_done_callback(done)
        return await asyncio.shield(task)

    def _check_fence(self, request: LaunchRequest) -> None:
        """The scheduler's fencing token must not be older than the newest seen."""
        if not request.fencing_election:
            return
        newest = self._fence_revision.get(request.fencing_election, 0)
        if request.fencing_revision < newest:
            raise FencedOut(
                f"fencing_token (revision {request.fencing_revision}) of "
                f"{request.fencing_election!r} is older than the newest seen ({newest})"
            )
        self._fence_revision[request.fencing_election] = request.fencing_revision

    async def _launch(self, request: LaunchRequest, device: DeviceInfo) -> Learner:
        directory = self.directory_for(request.learner_id)
        learner: Learner | None = None
        try:
            archive = await self.artifacts.get(request.artifact_id)
            if directory.exists():
                await asyncio.to_thread(shutil.rmtree, directory, True)
            work = directory / "work"
            directory.mkdir(parents=True, exist_ok=True)
            # A copy of the job's artifact unpacked ahead (shoal.host_agent.prepared), else now.
            ahead = await self.prepared.take(request.job_id, request.artifact_id, work)
            if not ahead:
                try:
                    await asyncio.to_thread(unpack, archive, work)
                except (tarfile.TarError, OSError, EOFError) as exc:
                    raise FailedPrecondition(
                        f"artifact {request.artifact_id!r} cannot be unpacked: {exc}"
                    ) from exc
            entry = (work / request.entry_point).resolve()
            if not entry.is_relative_to(work.resolve()) or not entry.is_file():
                raise InvalidField(
                    "entry_point",
                    request.entry_point,
                    f"is not a file in artifact {request.artifact_id}",
                )
            if entry.suffix != ".py" and not os.access(entry, os.X_OK):
                raise InvalidField(
                    "entry_point", request.entry_point, "is neither a .py script nor executable"
                )
            learner = Learner(
                learner_id=request.learner_id,
                job_id=request.job_id,
                device=device,
                directory=directory,
                allocation_id=request.allocation_id,
                host_id=self.host_id,
                host_incarnation=self.incarnation,
                unpacked_ahead=ahead,
            )
            python = await self._environment_python(learner, work)
            if learner.stop_reason is not None:  # stopped just as its build ended
                raise FailedPrecondition(
                    f"learner {learner.learner_id!r} was stopped ({learner.stop_reason}) while "
                    "its environment was being built"
                )
            await self._spawn(learner, request, entry, work, python or self.python)
        except BaseException as exc:
            if learner is not None and learner.learner_id in self._building:
                await self._end_build(learner, exc)
            shutil.rmtree(directory, ignore_errors=True)
            self._release_job(request.job_id, starting=request.learner_id)
            raise
        finally:
            self._building.pop(request.learner_id, None)
        self._learners[learner.learner_id] = learner
        # The job is placed on this host: its next learner here (a grow, a replacement) takes
        # a copy unpacked meanwhile instead of waiting for an unpack.
        self.prepared.prepare(request.job_id, request.artifact_id)
        return learner

    def _release_job(self, job_id: str, *, starting: str = "") -> None:
        """The job's copies unpacked ahead go (after a linger) once it has no learner running
        or starting on this host."""
        if any(lr.job_id == job_id and not lr.terminal for lr in self._learners.values()):
            return
        if any(j == job_id and lid != starting for lid, j in self._starting_jobs.items()):
            return
        self.prepared.release(job_id)

    async def _environment_python(self, learner: Learner, work: Path) -> str | None:
        """The job environment's interpreter (``envs.python_for``). While it is built the
        learner is STARTING and known to :meth:`get` (so its log can be followed and
        StopLearner stops the build); the build's progress is written to the learner's log as
        it comes, as ``[shoal env] ...`` lines on stderr, before what the learner prints."""
        if not (work / REQUIREMENTS_FILE).is_file():
            return None
        writer = learner.writer = _LogWriter(learner.log_path)  # _spawn appends to it

        async def progress(text: str) -> None:
            await writer.write(STDERR, f"[shoal env] {text}".encode())

        learner._build = asyncio.get_running_loop().create_task(
            self.envs.python_for(work, progress=progress),
            name=f"env-{learner.learner_id}",
        )
        self._building[learner.learner_id] = learner
        try:
            return await learner._build
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if learner.stop_reason is None or (task is not None and task.cancelling()):
                raise  # the start itself was cancelled (the agent is shutting down)
            raise FailedPrecondition(
                f"learner {learner.learner_id!r} was stopped ({learner.stop_reason}) while "
                "its environment was being built"
            ) from None
        finally:
            learner._build = None

    async def _end_build(self, learner: Learner, exc: BaseException) -> None:
        """A start that failed (or was stopped) while its environment was built: its
        followers are told, read what is left of its log, then it is forgotten."""
        learner.end_time = time.time()
        learner.exit_code = -1
        learner.exit_reason = (
            f"stopped while its environment was being built ({learner.stop_reason})"
            if learner.stop_reason is not None
            else f"did not start: {exc}"
        )
        learner.state = FAILED
        learner.exited.set()
        writer = learner.writer
        if writer is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0), writer.changed:
                writer.changed.notify_all()
                await writer.changed.wait_for(lambda: learner.followers == 0)
        writer.close()

    def _environment(self, learner: Learner, request: LaunchRequest) -> dict[str, str]:
        env = {
            k: v
            for k, v in self._base_env.items()
            if not k.startswith(_PRIVATE_ENV_PREFIXES) and k not in _RESET_ENV
        }
        env["PYTHONUNBUFFERED"] = "1"
        env.update(request.env)
        env.update(cuda_env(learner.device))
        env.update(self._learner_env)
        env.update(
            {
                "SHOAL_JOB_ID": learner.job_id,
                "SHOAL_LEARNER_ID": learner.learner_id,
                "SHOAL_HOST_ID": self.host_id,
                "SHOAL_DEVICE_ID": learner.device.device_id,
                "SHOAL_TRAIN_MARKER": str(learner.directory / TRAIN_MARKER),
            }
        )
        if request.allocation_id:
            env["SHOAL_ALLOCATION_ID"] = request.allocation_id
        telemetry.inject_env(env)
        return env

    async def _spawn(
        self, learner: Learner, request: LaunchRequest, entry: Path, work: Path, python: str
    ) -> None:
        if entry.suffix == ".py":
            argv = [python, str(entry), *request.args]
        else:
            argv = [str(entry), *request.args]
        env = self._environment(learner, request)
        if learner.writer is None:  # else: opened for its environment's build
            learner.writer = _LogWriter(learner.log_path)
        warm: WarmProcess | None = None
        if entry.suffix == ".py" and python == self.python and warm_accepts(request.env):
            warm = self.warm.take()
        if warm is not None and await warm.hand_over(argv, env, str(work)):
            process = warm.process
            learner.warm_token = warm.token
            for line in warm.early_stdout:  # what it printed while importing
                await learner.writer.write(STDOUT, line)
        else:
            warm = None
            command = argv
            if entry.suffix == ".py":  # through the runner: its fast exit (warm_boot)
                command = [python, "-c", BOOT_SOURCE, warm_boot.RUN, str(entry), *request.args]
            process = await self._exec(learner, request, command, env, work)
        learner.process = process
        learner.pid = process.pid
        learner.start_time = time.time()
        learner.state = RUNNING
        (learner.directory / "learner.json").write_text(
            json.dumps(
                {
                    "learner_id": learner.learner_id,
                    "job_id": learner.job_id,
                    "pid": process.pid,
                    "pgid": process.pid,
                    "device_id": learner.device.device_id,
                    "argv": argv,
                    "start_time": learner.start_time,
                    "warm_token": learner.warm_token,
                }
            )
        )
        loop = asyncio.get_running_loop()
        learner._tasks = [
            loop.create_task(learner.writer.pump(STDOUT, process.stdout)),
            loop.create_task(learner.writer.pump(STDERR, process.stderr)),
        ]
        watcher = loop.create_task(self._watch(learner), name=f"watch-{learner.learner_id}")
        self._background.add(watcher)
        watcher.add_done_callback(self._background.discard)
        log.info(
            "learner %r (job %r) started %s on %s: pid %d, %s",
            learner.learner_id,
            learner.job_id,
            ("warm" if warm is not None else "cold")
            + (", its artifact unpacked ahead" if learner.unpacked_ahead else ""),
            learner.device.device_id,
            process.pid,
            " ".join(argv),
        )

    async def _exec(
        self,
        learner: Learner,
        request: LaunchRequest,
        argv: list[str],
        env: dict[str, str],
        work: Path,
    ) -> asyncio.subprocess.Process:
        """A cold start: a new process of the entry point."""
        try:
            return await asyncio.create_subprocess_exec(
                *die_with_parent(argv, any_thread=True),
                cwd=str(work),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            assert learner.writer is not None
            learner.writer.close()
            raise FailedPrecondition(
                f"entry_point {request.entry_point!r} could not be started: {exc.strerror}"
            ) from exc

    async def _watch(self, learner: Learner) -> None:
        assert learner.process is not None
        code = await learner.process.wait()
        # What is left of the group (children of the learner) goes with it.
        _kill_group(learner.pid, signal.SIGKILL)
        pumps = asyncio.gather(*learner._tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(pumps, timeout=5.0)
        except TimeoutError:
            log.warning("learner %r: its output pipes stayed open", learner.learner_id)
        if learner.writer is not None:
            learner.writer.close()
        learner.exit_code = code
        learner.exit_reason = describe_exit(code, learner.stop_reason)
        learner.end_time = time.time()
        learner.state = SUCCEEDED if code == 0 else FAILED
        if learner.stop_reason is None:
            # Explain a failure: the learner's own traceback, or a script that ended without
            # training (counted as a failure, so the job fails instead of restarting it).
            if code != 0:
                summary = await asyncio.to_thread(
                    crash_summary, learner.log_path, (learner.directory / "work").resolve()
                )
                if summary:
                    learner.exit_reason += f": {summary}"
            elif not (learner.directory / TRAIN_MARKER).exists():
                learner.exit_reason = NO_TRAIN
                learner.state = FAILED
        learner.exited.set()
        if learner.writer is not None:
            async with learner.writer.changed:
                learner.writer.changed.notify_all()
        log.info("learner %r %s", learner.learner_id, learner.exit_reason)
        self._release_job(learner.job_id)
        if self._on_exit is not None:
            self._on_exit(learner)

    # -- stop ----------------------------------------------------------------------------------

    async def stop(
        self, learner_id: str, grace_s: float | None = None, reason: str = "stopped by the agent"
    ) -> Learner:
        """SIGTERM to the learner's group; SIGKILL to the whole group after the grace. Returns
        the learner once it exited (at once if it already had). A learner whose environment is
        being built has its build killed and its start failed (it is returned FAILED)."""
        learner = self.get(learner_id)
        if learner.terminal:
            return learner
        if learner.learner_id in self._building:
            # Stopped while it starts with an environment of its own: a build that runs is
            # stopped (pip's process group killed) and the start fails, nothing of it kept;
            # one that just ended has the start fail too, unless the learner was already
            # being spawned: then it is stopped like any running learner, below.
            if learner.stop_reason is None:
                learner.state = STOPPING
                learner.stop_reason = reason
                if learner._build is not None:
                    learner._build.cancel()
            starting = self._starting.get(learner_id)
            if starting is not None:
                await asyncio.wait([starting])
            if learner.exited.is_set() or not learner.pid:
                return learner
        grace = self.stop_grace_s if grace_s is None or grace_s <= 0 else grace_s
        if learner.state != STOPPING:
            learner.state = STOPPING
            learner.stop_reason = reason
            _kill_group(learner.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(learner.exited.wait()), timeout=grace)
        except TimeoutError:
            learner.stop_reason = f"{learner.stop_reason}; SIGKILL after the grace of {grace:g} s"
            _kill_group(learner.pid, signal.SIGKILL)
            await learner.exited.wait()
        return learner

    async def stop_all(self, grace_s: float | None = None) -> None:
        """Stop every learner (the agent is shutting down)."""
        running = [lr.learner_id for lr in self._learners.values() if not lr.terminal]
        for task in list(self._starting.values()):
            task.cancel()
        await asyncio.gather(
            *(self.stop(lid, grace_s, "the host agent shut down") for lid in running),
            return_exceptions=True,
        )

    # -- logs ----------------------------------------------------------------------------------

    async def follow_log(
        self, learner_id: str, offset: int, follow: bool, batch_bytes: int = 256 * 1024
    ) -> AsyncIterator[list[LogRecord]]:
        """Batches of log records from ``offset``; with ``follow``, until the learner exited
        and everything it printed was sent."""
        learner = self.get(learner_id)
        learner.followers += 1
        try:
            async for batch in self._follow(learner, offset, follow, batch_bytes):
                yield batch
        finally:
            learner.followers -= 1
            if learner.writer is not None and learner.exited.is_set():
                async with learner.writer.changed:  # _end_build waits for its followers
                    learner.writer.changed.notify_all()

    async def _follow(
        self, learner: Learner, offset: int, follow: bool, batch_bytes: int
    ) -> AsyncIterator[list[LogRecord]]:
        position = max(offset, 0)
        while True:
            exited = learner.exited.is_set()
            version = learner.writer.version if learner.writer is not None else 0
            records = await asyncio.to_thread(read_log, learner.log_path, position, batch_bytes)
            if records:
                position = records[-1].end
                yield records
                continue
            if not follow or exited:
                return
            writer = learner.writer
            if writer is None:
                return
            if writer.version != version:
                continue  # written while we read
            async with writer.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(writer.changed.wait(), timeout=1.0)
