"""Warm learner processes: interpreters with torch and the learner package already imported,
waiting to become a job's learner (``--warm-learners``).

A cold learner start pays for a new interpreter and ``import torch`` (~2.5 s on an idle 2-core
machine, 8-10 s under load) before the user's code runs. The pool keeps up to ``size``
processes of :mod:`shoal.host_agent.warm_boot` ready; :meth:`WarmPool.take` hands one to
:class:`~shoal.host_agent.processes.ProcessManager`, which sends it the learner's argv,
environment and working directory on stdin. The process then runs the script as ``__main__``.

Safety: **a warm process serves one learner, never another** (a process per learner, never
reused). It is started with the agent's environment minus the agent's own configuration and
secrets (the ``SHOAL_`` variables), in an empty directory, before any job is known; it gets the
job's environment (and with it any credential), working directory and artifact only when it is
taken, and exits with its learner.

A retired learner "goes back to the pool" as a fresh process, not as itself: a process that ran
a job holds that job's modules, objects, threads, open files and credential (in ``os.environ``
and wherever the script copied it), and CPython offers no way to scrub them all, so reusing it
for another job is never safe. Instead the pool is refilled as soon as a process is taken, while
the learner runs: by the time the learner retires, its device already has a ready process
waiting, and the next learner there (of any job) starts warm within tens of milliseconds of the
retirement. Refilling at the retirement itself would be too late: the scheduler starts the
device's next learner within tens of milliseconds, and a warm process takes seconds to import
torch. The cost: while all devices are busy, ``size`` idle processes (~256 MiB each) wait.

It is a child of the agent like a cold learner: its own
session and process group, ``PR_SET_PDEATHSIG`` through the same wrapper, the agent waits for
its exit code and reads its stdout and stderr into the learner's log, so stopping, logs and exit
codes are exactly those of a cold start.

Refilling: one process is started at a time (the pool must not starve the learners of CPU), as
soon as one was taken or died. A warm process that dies before it was taken is dropped and
replaced; if processes keep dying before they are ready (a broken torch), refilling backs off
(1 s doubling to 60 s) and learners start cold meanwhile. A start never waits for the pool: with
no ready process it is a cold start.

Cold starts remain for what a warm process cannot give: an artifact with its own environment
(``requirements.txt``: another interpreter), an entry point that is not a ``.py`` script, and a
job environment that sets variables read when the interpreter or torch start
(:data:`IMPORT_TIME_ENV_PREFIXES`, e.g. ``OMP_NUM_THREADS``, ``PYTHONPATH``, ``LD_PRELOAD``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tenacity

from shoal.host_agent import warm_boot
from shoal.host_agent.groups import kill_marked
from shoal.runtime.procs import die_with_parent
from shoal.runtime.retrying import backoff

__all__ = [
    "BOOT_SOURCE",
    "IMPORT_TIME_ENV_PREFIXES",
    "TOKEN_ENV",
    "WARM_PROCESS_MIB",
    "WarmPool",
    "WarmProcess",
    "local_cluster_default",
    "reap_warm",
]

log = logging.getLogger(__name__)

TOKEN_ENV = "SHOAL_WARM_TOKEN"  # names a warm process (and its learner) in /proc/<pid>/environ
# Variables read when the interpreter, the C libraries or torch start: a job that sets one of
# them starts cold, so that it gets exactly what it asked for.
IMPORT_TIME_ENV_PREFIXES = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO",
    "TORCH",
    "PYTORCH",
)
HAND_OVER_TIMEOUT_S = 30.0  # a taken process must acknowledge the job's line by then
READY_TIMEOUT_S = 300.0  # a warm process that is not ready by then is killed and replaced
_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 1.0, 60.0
BOOT_SOURCE = Path(warm_boot.__file__).read_text()  # also runs cold .py learners
# What one idle warm process holds (torch and shoal.learner imported): max RSS 222 MiB measured
# with torch 2.13.0+cpu on Linux x86-64; rounded up.
WARM_PROCESS_MIB = 256
WARM_ENV = "SHOAL_WARM_LEARNERS"  # the host agent's --warm-learners variable


def _available_mib() -> int | None:
    """MemAvailable of /proc/meminfo in MiB (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def local_cluster_default(
    hosts: int,
    devices_per_host: int,
    *,
    environ: Mapping[str, str] | None = None,
    available_mib: int | None = -1,
) -> str:
    """The ``--warm-learners`` a local cluster gives each of its host agents when its spec
    says nothing (``ClusterSpec.warm_learners = None``): ``SHOAL_WARM_LEARNERS`` when set
    (passed as it is: the agent validates it), else one per device, as on a real host, as long
    as all of them together take at most a quarter of the memory available now (its simulated
    hosts share one machine); fewer if they would not fit, 0 if not even one per host does.
    ``available_mib=-1``: read /proc/meminfo (no figure there: one per device)."""
    env = os.environ if environ is None else environ
    if env.get(WARM_ENV, "").strip():
        return env[WARM_ENV].strip()
    mib = _available_mib() if available_mib == -1 else available_mib
    if mib is None:
        return str(devices_per_host)
    fit = (mib // 4) // (WARM_PROCESS_MIB * max(hosts, 1))
    return str(max(0, min(devices_per_host, fit)))


@dataclass
class WarmProcess:
    """One warm interpreter, ready (its READY line read) and not yet taken."""

    process: asyncio.subprocess.Process
    token: str
    started: float
    ready_at: float = 0.0
    early_stdout: list[bytes] = field(default_factory=list)  # lines before READY

    @property
    def pid(self) -> int:
        return self.process.pid

    async def hand_over(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> bool:
        """Send the learner's spec and wait for the process to acknowledge it; False if it is
        gone or does not answer (it is killed: start cold instead)."""
        stdin, stdout = self.process.stdin, self.process.stdout
        if stdin is None or stdout is None or self.process.returncode is not None:
            return False
        line = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode() + b"\n"
        answer = b""
        try:
            stdin.write(line)
            await stdin.drain()
            stdin.close()
            answer = await asyncio.wait_for(stdout.readline(), timeout=HAND_OVER_TIMEOUT_S)
        except (BrokenPipeError, ConnectionResetError, TimeoutError, ValueError):
            pass
        if answer.rstrip(b"\r\n") == warm_boot.TAKEN.encode():
            return True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        return False


def accepts(env: Mapping[str, str]) -> bool:
    """Whether a job environment can be given to a warm process (none of its variables is
    read at interpreter or torch start)."""
    return not any(key.startswith(IMPORT_TIME_ENV_PREFIXES) for key in env)


def reap_warm(warm_dir: Path) -> int:
    """Kill warm processes a previous agent left (their ``<token>.json``); remove the files."""
    if not warm_dir.is_dir():
        return 0
    recorded: dict[int, list[tuple[str, str]]] = {}
    for meta in warm_dir.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            info = json.loads(meta.read_text())
            recorded[int(info["pgid"])] = [(TOKEN_ENV, str(info["token"]))]
        meta.unlink(missing_ok=True)
    killed = kill_marked(recorded)
    if killed:
        log.warning("killed %d warm learner process(es) of a previous agent", killed)
    return killed


class WarmPool:
    """Up to ``size`` ready warm processes (see the module doc)."""

    def __init__(self, directory: Path, *, python: str, env: Mapping[str, str], size: int) -> None:
        self.directory = directory
        self.python = python
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        self.size = max(size, 0)
        self._ready: list[WarmProcess] = []
        self._starting: WarmProcess | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Task[None]] = set()
        self.started = 0  # processes started by the pool
        self.taken = 0  # learners that started warm
        self.died = 0  # warm processes that died before they were taken

    def ready(self) -> int:
        return sum(1 for w in self._ready if w.process.returncode is None)

    def start(self) -> None:
        if self.size <= 0 or self._task is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.get_running_loop().create_task(self._fill(), name="warm-pool")

    def take(self) -> WarmProcess | None:
        """A ready warm process (removed from the pool), or None: start cold. Whatever it
        removes, taken or found dead, the pool replaces: a process found dead here is no
        longer in the pool when its watcher (``_watch_idle``) sees it die, so that one does
        not wake the pool for it (before 2026-11-27 nothing did, and the pool stayed empty)."""
        while self._ready:
            warm = self._ready.pop(0)
            (self.directory / f"{warm.token}.json").unlink(missing_ok=True)
            self._wake.set()
            if warm.process.returncode is None:
                self.taken += 1
                return warm
            self.died += 1
        return None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        idle = list(self._ready)
        self._ready.clear()
        if self._starting is not None:
            idle.append(self._starting)
        for warm in idle:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(warm.pid, signal.SIGKILL)
        for warm in idle:
            with contextlib.suppress(Exception):
                await warm.process.wait()
            (self.directory / f"{warm.token}.json").unlink(missing_ok=True)
        for task in list(self._watchers):
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    # -- filling -------------------------------------------------------------------------------

    async def _fill(self) -> None:
        """Keep ``size`` ready processes: spawn one whenever fewer are ready. A process that
        dies before it is ready is spawned again after 1 s, doubling to 60 s (tenacity); the
        waits start over once one comes up."""

        def died(state: tenacity.RetryCallState) -> None:
            assert state.next_action is not None
            log.warning(
                "a warm learner process died before it was ready; retry in %g s",
                state.next_action.sleep,
            )

        while True:
            self._ready = [w for w in self._ready if w.process.returncode is None]
            if len(self._ready) >= self.size:
                self._wake.clear()
                await self._wake.wait()
                continue
            async for attempt in tenacity.AsyncRetrying(
                retry=tenacity.retry_if_result(lambda warm: warm is None),
                wait=backoff(_BACKOFF_FIRST_S, _BACKOFF_MAX_S),
                before_sleep=died,
            ):
                with attempt:
                    warm = await self._spawn_one()
                if not attempt.retry_state.outcome.failed:  # type: ignore[union-attr]
                    attempt.retry_state.set_result(warm)

    async def _spawn_one(self) -> WarmProcess | None:
        token = secrets.token_hex(8)
        try:
            process = await asyncio.create_subprocess_exec(
                *die_with_parent([self.python, "-c", BOOT_SOURCE], any_thread=True),
                cwd=str(self.directory),
                env={**self.env, TOKEN_ENV: token},
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            log.warning("cannot start a warm learner process: %s", exc)
            return None
        self.started += 1
        warm = WarmProcess(process=process, token=token, started=time.time())
        self._starting = warm
        (self.directory / f"{token}.json").write_text(
            json.dumps({"pgid": process.pid, "token": token})
        )
        try:
            ok = await asyncio.wait_for(self._await_ready(warm), timeout=READY_TIMEOUT_S)
        except TimeoutError:
            ok = False
        finally:
            self._starting = None
        if not ok:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            stderr = b""
            if process.stderr is not None:
                with contextlib.suppress(Exception):
                    stderr = await asyncio.wait_for(process.stderr.read(4096), timeout=1.0)
            await process.wait()
            (self.directory / f"{token}.json").unlink(missing_ok=True)
            self.died += 1
            if stderr:
                log.warning("warm learner process said: %s", stderr.decode(errors="replace"))
            return None
        warm.ready_at = time.time()
        self._ready.append(warm)
        watcher = asyncio.get_running_loop().create_task(self._watch_idle(warm))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        log.info(
            "warm learner process %d ready in %.1f s", process.pid, warm.ready_at - warm.started
        )
        return warm

    @staticmethod
    async def _await_ready(warm: WarmProcess) -> bool:
        stdout = warm.process.stdout
        assert stdout is not None
        marker = warm_boot.READY.encode()
        while True:
            try:
                line = await stdout.readline()
            except (ValueError, asyncio.LimitOverrunError):
                return False  # a line over 64 KiB: not ours
            if not line:
                return False  # exited before it was ready
            if line.rstrip(b"\r\n") == marker:
                return True
            warm.early_stdout.append(line.rstrip(b"\r\n"))

    async def _watch_idle(self, warm: WarmProcess) -> None:
        """Drop a ready process that dies before it is taken (the pool replaces it)."""
        await warm.process.wait()
        if warm in self._ready:
            self._ready.remove(warm)
            (self.directory / f"{warm.token}.json").unlink(missing_ok=True)
            self.died += 1
            log.warning(
                "warm learner process %d died while idle (%s); replacing it",
                warm.pid,
                warm.process.returncode,
            )
            self._wake.set()
