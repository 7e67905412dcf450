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
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tarfile
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from google.protobuf import timestamp_pb2

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
from shoal.host_agent.devices import DeviceInfo, cuda_env
from shoal.host_agent.envs import JobEnvironments
from shoal.runtime import telemetry
from shoal.runtime.procs import die_with_parent
from shoal.v1 import resources_pb2

__all__ = [
    "ArtifactCache",
    "ArtifactNotFound",
    "ArtifactSource",
    "DeviceBusy",
    "DeviceNotFound",
    "DirectorySource",
    "LaunchRequest",
    "Learner",
    "LearnerNotFound",
    "ProcessManager",
    "read_log",
    "reap_orphans",
]

log = logging.getLogger(__name__)

STDOUT, STDERR = 1, 2
ARTIFACT_ID_RE = ids.PATTERNS[ids.IdKind.ARTIFACT]  # use with fullmatch
MAX_RECORD_TEXT = 64 * 1024  # longer lines are split into several records

STARTING = resources_pb2.LEARNER_STATE_STARTING
RUNNING = resources_pb2.LEARNER_STATE_RUNNING
STOPPING = resources_pb2.LEARNER_STATE_STOPPING
SUCCEEDED = resources_pb2.LEARNER_STATE_SUCCEEDED
FAILED = resources_pb2.LEARNER_STATE_FAILED
TERMINAL = frozenset({SUCCEEDED, FAILED})


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


# DeviceNotFound, LearnerNotFound, ArtifactNotFound and DeviceBusy are defined in
# shoal.contract.errors (imported above, exported here).


# --------------------------------------------------------------------------------------------
# Artifacts
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogRecord:
    offset: int  # byte offset of the record in output.log
    stream: int  # STDOUT or STDERR
    text: str
    end: int  # offset just after the record
    time: float = 0.0  # when the learner wrote it (Unix seconds; 0: unknown)


def read_log(path: Path, offset: int, max_bytes: int = 1024 * 1024) -> list[LogRecord]:
    """Complete records of ``path`` from ``offset``. An offset inside a record starts at the
    next record, so "resume after a line" is ``line.offset + 1``."""
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return []
    with fh:
        if offset > 0:
            fh.seek(offset - 1)
            if fh.read(1) != b"\n":
                fh.readline()  # skip the rest of the record we landed in
        position = fh.tell()
        data = fh.read(max_bytes)
    records: list[LogRecord] = []
    start = 0
    while True:
        newline = data.find(b"\n", start)
        if newline < 0:
            break
        raw = data[start:newline]
        stream = STDERR if raw[:1] == b"2" else STDOUT
        header, _, rest = raw.partition(b" ")
        written = 0.0
        if header[1:2] == b"@" and header[2:].isdigit():
            written = int(header[2:]) / 1000
            text = rest.decode(errors="replace")
        else:
            text = raw[2:].decode(errors="replace")
        records.append(LogRecord(position + start, stream, text, position + newline + 1, written))
        start = newline + 1
    return records


class _LogWriter:
    """Appends the records of both pipes to output.log and wakes followers."""

    def __init__(self, path: Path) -> None:
        self._fh = path.open("ab", buffering=0)
        self.changed = asyncio.Condition()
        self.version = 0  # bumped on every write

    async def write(self, stream: int, line: bytes) -> None:
        written = int(time.time() * 1000)
        for i in range(0, max(len(line), 1), MAX_RECORD_TEXT):
            chunk = line[i : i + MAX_RECORD_TEXT].replace(b"\n", b" ")
            self._fh.write(b"%d@%d %s\n" % (stream, written, chunk))
        self.version += 1
        async with self.changed:
            self.changed.notify_all()

    async def pump(self, stream: int, reader: asyncio.StreamReader | None) -> None:
        if reader is None:
            return
        pending = b""
        while True:
            chunk = await reader.read(64 * 1024)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                await self.write(stream, line.rstrip(b"\r"))
            while len(pending) > MAX_RECORD_TEXT:
                await self.write(stream, pending[:MAX_RECORD_TEXT])
                pending = pending[MAX_RECORD_TEXT:]
        if pending:
            await self.write(stream, pending)

    def close(self) -> None:
        self._fh.close()


# --------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------


def _kill_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False if it no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def group_alive(pgid: int) -> bool:
    """Whether any process of the group exists (zombies included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_pgid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[2])  # field 5: pgrp
    except (IndexError, ValueError):
        return None


def _proc_has_env(pid: int, name: str, value: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{name}={value}".encode() in environ.split(b"\0")


def reap_orphans(learners_dir: Path) -> int:
    """Kill what is left of learners a previous agent started (their ``learner.json``), then
    remove their directories. Only processes in the recorded process group whose environment
    names the learner are killed, so a reused pid is never hit. Returns how many were killed."""
    if not learners_dir.is_dir():
        return 0
    recorded: dict[int, str] = {}
    for meta in learners_dir.glob("*/learner.json"):
        try:
            info = json.loads(meta.read_text())
            recorded[int(info["pgid"])] = str(info["learner_id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    killed = 0
    if recorded and Path("/proc").is_dir():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            pgid = _proc_pgid(pid)
            if pgid in recorded and _proc_has_env(pid, "SHOAL_LEARNER_ID", recorded[pgid]):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
    if killed:
        log.warning("killed %d leftover process(es) of learners of a previous agent", killed)
    for child in learners_dir.iterdir():
        shutil.rmtree(child, ignore_errors=True)
    return killed


# --------------------------------------------------------------------------------------------
# Learners
# --------------------------------------------------------------------------------------------


def _ts(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    if seconds:
        ts.FromNanoseconds(int(seconds * 1e9))
    return ts


TRAIN_MARKER = "train-called"  # the learner library touches it when the script calls train()
NO_TRAIN = (
    "exited with code 0 without calling Trainer.train() (nothing was trained: does the "
    'script call train() when run on the cluster, e.g. under `if __name__ == "__main__"`?)'
)


def crash_summary(log_path: Path, work_dir: Path | None = None, frames: int = 3) -> str:
    """The last Python traceback a learner printed, in one line: the exception type and
    message, then its last ``frames`` frames (``file:line in function``, paths relative to
    the learner's working directory); empty when its log has none."""
    try:
        size = log_path.stat().st_size
    except OSError:
        return ""
    records = read_log(log_path, max(0, size - 64 * 1024), 64 * 1024)
    lines = [r.text for r in records]
    start = max(
        (i for i, t in enumerate(lines) if t.startswith("Traceback (most recent call last):")),
        default=-1,
    )
    if start < 0:
        return ""
    block = lines[start:]
    exception = ""
    where: list[str] = []
    for text in block[1:]:
        stripped = text.strip()
        if text.startswith("  File "):
            # '  File "/x/work/train.py", line 12, in forward'
            try:
                quoted, _, rest = stripped[len("File ") :].partition(", line ")
                path = quoted.strip('"')
                number, _, func = rest.partition(", in ")
                if work_dir is not None and path.startswith(str(work_dir) + os.sep):
                    path = path[len(str(work_dir)) + 1 :]
                elif "site-packages" in path or path.startswith(sys.prefix):
                    path = Path(path).name
                where.append(f"{path}:{number} in {func}")
            except ValueError:
                continue
        elif text and not text.startswith((" ", "\t")):
            exception = stripped
            if not exception.startswith(("During handling", "The above exception")):
                break
    if not exception:
        return ""
    if len(exception) > 300:
        exception = exception[:297] + "..."
    trail = ", ".join(where[-frames:])
    return f"{exception} (at {trail})" if trail else exception


def describe_exit(code: int, stop: str | None) -> str:
    if code >= 0:
        text = f"exited with code {code}"
    else:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"killed by {name}"
    return f"{text} ({stop})" if stop else text


@dataclass
class Learner:
    """One learner this agent started (kept until forgotten)."""

    learner_id: str
    job_id: str
    device: DeviceInfo
    directory: Path
    allocation_id: str = ""
    host_id: str = ""
    host_incarnation: int = 0
    state: resources_pb2.LearnerState.ValueType = STARTING
    pid: int = 0
    exit_code: int = 0
    exit_reason: str = ""
    start_time: float = 0.0
    end_time: float = 0.0
    stop_reason: str | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    # Heartbeat bookkeeping: the sequence that first carried the exit, and whether the
    # resource manager acknowledged it.
    exit_sent_seq: int | None = None
    exit_acked: bool = False
    process: asyncio.subprocess.Process | None = None
    writer: _LogWriter | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.directory / "output.log"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def to_proto(self) -> resources_pb2.Learner:
        return resources_pb2.Learner(
            learner_id=self.learner_id,
            job_id=self.job_id,
            host_id=self.host_id,
            device_id=self.device.device_id,
            state=self.state,
            pid=self.pid if not self.terminal else 0,
            exit_code=self.exit_code,
            exit_reason=self.exit_reason,
            start_time=_ts(self.start_time),
            end_time=_ts(self.end_time),
            host_incarnation=self.host_incarnation,
        )


@dataclass(frozen=True)
class LaunchRequest:
    """What StartLearner asks for."""

    learner_id: str
    job_id: str
    device_id: str
    artifact_id: str
    entry_point: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    allocation_id: str = ""
    fencing_election: str = ""
    fencing_revision: int = 0


def _validate_id(field_name: str, value: str, kind: ids.IdKind) -> None:
    if not value:
        raise InvalidField(field_name, value, "must not be empty")
    if not ids.is_valid(kind, value):
        raise InvalidField(field_name, value, ids.describe(kind))


def _validate_entry_point(entry_point: str) -> None:
    if not entry_point:
        raise InvalidField("entry_point", entry_point, "must not be empty")
    parts = Path(entry_point).parts
    if Path(entry_point).is_absolute() or ".." in parts:
        raise InvalidField(
            "entry_point", entry_point, "must be a relative path inside the artifact"
        )


# Variables of the agent that learners do not inherit (its configuration and secrets).
_PRIVATE_ENV_PREFIXES = ("SHOAL_",)
_RESET_ENV = ("TRACEPARENT", "TRACESTATE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


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

    # -- queries -------------------------------------------------------------------------------

    def get(self, learner_id: str) -> Learner:
        learner = self._learners.get(learner_id)
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

        def done(_: asyncio.Task[Learner]) -> None:
            self._starting.pop(request.learner_id, None)
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
        try:
            archive = await self.artifacts.get(request.artifact_id)
            if directory.exists():
                await asyncio.to_thread(shutil.rmtree, directory, True)
            work = directory / "work"
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
            python = await self.envs.python_for(work)
            learner = Learner(
                learner_id=request.learner_id,
                job_id=request.job_id,
                device=device,
                directory=directory,
                allocation_id=request.allocation_id,
                host_id=self.host_id,
                host_incarnation=self.incarnation,
            )
            await self._spawn(learner, request, entry, work, python or self.python)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self._learners[learner.learner_id] = learner
        return learner

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
        learner.writer = _LogWriter(learner.log_path)
        try:
            process = await asyncio.create_subprocess_exec(
                *die_with_parent(argv, any_thread=True),
                cwd=str(work),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            learner.writer.close()
            raise FailedPrecondition(
                f"entry_point {request.entry_point!r} could not be started: {exc.strerror}"
            ) from exc
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
            "learner %r (job %r) started on %s: pid %d, %s",
            learner.learner_id,
            learner.job_id,
            learner.device.device_id,
            process.pid,
            " ".join(argv),
        )

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
        if self._on_exit is not None:
            self._on_exit(learner)

    # -- stop ----------------------------------------------------------------------------------

    async def stop(
        self, learner_id: str, grace_s: float | None = None, reason: str = "stopped by the agent"
    ) -> Learner:
        """SIGTERM to the learner's group; SIGKILL to the whole group after the grace. Returns
        the learner once it exited (at once if it already had)."""
        learner = self.get(learner_id)
        if learner.terminal:
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
