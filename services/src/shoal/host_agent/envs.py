"""Per-job Python environments: an artifact that carries ``requirements.txt`` runs in a venv
built for it.

The venv is built once per host per content of ``requirements.txt`` (its sha256 names the
directory, ``<work_dir>/envs/<sha256>/``). It inherits the agent's packages (torch,
shoal-learner: the agent usually runs in a venv itself, whose packages ``--system-site-packages``
alone would not reach, so a ``.pth`` file adds the agent's site directories after the job's
own) and only adds what the job asks for; it is kept and reused
by every later learner whose requirements are the same, on this host. Concurrent starts of the
same environment wait for one build. pip runs in the learner's unpacked artifact (so relative
paths in ``requirements.txt``, such as ``./wheels/pkg-1.0-py3-none-any.whl``, resolve there),
with the agent's environment minus its secrets, and writes ``build.log`` beside the venv; the
agent logs every step. A failed build leaves nothing behind and fails the start with
INVALID_ARGUMENT and pip's error (its last lines): the scheduler then fails the job with that
reason (a transient failure, such as an unreachable package index, fails it too: resubmit).
A build that outlasts the scheduler's StartLearner deadline goes on; the retried start waits for
it and reuses it.

Progress: ``python_for(work, progress=...)`` reports each step, every line pip prints (as it
prints it) and the time the build took, or that the environment was reused or is being built
by another learner of this host; the host agent writes these lines, prefixed ``[shoal env]``,
to the learner's log as they come, before the learner's own output (so ``shoal jobs logs -f``
shows them while pip runs, each with the time it was written).

Each step runs in its own process group (and dies with the agent): a build that is cancelled
(StopLearner during the build) or times out has the whole group killed, and what it made is
removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

from shoal.contract.errors import InvalidField
from shoal.runtime.procs import die_with_parent

__all__ = ["REQUIREMENTS_FILE", "JobEnvironments"]

log = logging.getLogger("shoal.host_agent.envs")

REQUIREMENTS_FILE = "requirements.txt"
_READY = ".ready"
_ERROR_TAIL = 2000  # characters of pip's output in the error

Progress = Callable[[str], Awaitable[None]]


# Run by the new venv's python with the agent's python as argument: a .pth file that adds the
# agent's site directories (processing their own .pth files, e.g. editable installs) after the
# venv's own, so the job's packages win and the agent's are found.
_LINK_AGENT_SITE = """
import json, subprocess, sys, sysconfig
from pathlib import Path
query = "import json, site; print(json.dumps(site.getsitepackages()))"
dirs = json.loads(subprocess.check_output([sys.argv[1], "-c", query]))
lines = "".join(f"import site; site.addsitedir({d!r})\\n" for d in dirs)
Path(sysconfig.get_paths()["purelib"], "_shoal_agent_site.pth").write_text(lines)
"""


class JobEnvironments:
    """The venvs of this host's jobs, under ``root``, built from ``base_python``."""

    def __init__(
        self,
        root: Path,
        *,
        base_python: str = sys.executable,
        pip_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        self.root = root
        self.base_python = base_python
        self.pip_args = list(pip_args)
        self.env = dict(os.environ if env is None else env)
        self.timeout_s = timeout_s
        self._locks: dict[str, asyncio.Lock] = {}
        self.builds = 0  # environments built by this agent (reuses do not count)

    @staticmethod
    def key(requirements: bytes) -> str:
        return hashlib.sha256(requirements).hexdigest()

    def python_of(self, key: str) -> Path:
        return self.root / key / "bin" / "python"

    async def python_for(self, work: Path, *, progress: Progress | None = None) -> str | None:
        """The interpreter for an artifact unpacked in ``work``: its environment's when it
        carries ``requirements.txt`` (built now if this host has none yet), else None.
        ``progress`` is told what happens, a line at a time (see the module's docstring)."""
        path = work / REQUIREMENTS_FILE
        if not path.is_file():
            return None
        requirements = path.read_bytes()
        key = self.key(requirements)
        say = _reporter(progress)
        lock = self._locks.setdefault(key, asyncio.Lock())
        if lock.locked():
            await say(f"environment {key[:12]}: waiting for its build by another learner")
        async with lock:
            directory = self.root / key
            if (directory / _READY).is_file():
                log.info("environment %s: reused", key[:12])
                await say(f"environment {key[:12]} ({REQUIREMENTS_FILE}): reused")
                return str(self.python_of(key))
            await self._build(key, directory, work, say)
            return str(self.python_of(key))

    async def _run(
        self, argv: list[str], cwd: Path, log_file: Path, say: Progress | None = None
    ) -> tuple[int, str]:
        with log_file.open("ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            # Its own process group (killed whole when the build is stopped or times out),
            # and it dies with the agent.
            process = await asyncio.create_subprocess_exec(
                *die_with_parent(argv, any_thread=True),
                cwd=str(cwd),
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
            assert process.stdout is not None
            captured = bytearray()
            try:
                async with asyncio.timeout(self.timeout_s):
                    async for line in process.stdout:
                        out.write(line)
                        out.flush()
                        captured += line
                        if say is not None:
                            await say(line.decode(errors="replace").rstrip())
                    code = await process.wait()
            except TimeoutError:
                await _kill(process)
                return (
                    -1,
                    f"timed out after {self.timeout_s:.0f} s\n{captured.decode(errors='replace')}",
                )
            except BaseException:  # the learner was stopped (cancelled) during its build
                await asyncio.shield(_kill(process))
                raise
        return code, captured.decode(errors="replace")

    async def _build(
        self, key: str, directory: Path, work: Path, say: Progress | None = None
    ) -> None:
        say = say or _reporter(None)
        short = key[:12]
        if directory.exists():  # a build that did not finish (the agent died)
            await asyncio.to_thread(shutil.rmtree, directory, True)
        directory.parent.mkdir(parents=True, exist_ok=True)
        build_log = self.root / f"{key}.build.log"
        build_log.unlink(missing_ok=True)
        started = time.monotonic()
        python = str(self.python_of(key))
        venv = [self.base_python, "-m", "venv", "--system-site-packages", "--without-pip"]
        steps = [
            ("creating the venv", [*venv, str(directory)]),
            ("linking the agent's packages", [python, "-c", _LINK_AGENT_SITE, self.base_python]),
            (
                "pip install -r requirements.txt",
                [
                    self.base_python,  # the agent's pip, installing into the job's venv
                    "-m",
                    "pip",
                    "--python",
                    python,
                    "install",
                    "--disable-pip-version-check",
                    "--no-input",
                    *self.pip_args,
                    "-r",
                    str(work / REQUIREMENTS_FILE),
                ],
            ),
        ]
        await say(f"environment {short} ({REQUIREMENTS_FILE}): building")
        for what, argv in steps:
            log.info("environment %s: %s", short, what)
            await say(f"environment {short}: {what}")
            try:
                code, output = await self._run(argv, work, build_log, say)
            except asyncio.CancelledError:  # stopped: nothing of the build is kept
                log.info("environment %s: build stopped during %s", short, what)
                await asyncio.shield(asyncio.to_thread(shutil.rmtree, directory, True))
                build_log.unlink(missing_ok=True)
                raise
            if code != 0:
                await asyncio.to_thread(shutil.rmtree, directory, True)
                tail = output.strip()[-_ERROR_TAIL:]
                log.warning("environment %s: %s failed (exit %d)", short, what, code)
                await say(f"environment {short}: {what} failed (exit {code})")
                raise InvalidField(
                    f"artifact {REQUIREMENTS_FILE}",
                    short,
                    f"could not be installed ({what} exited with {code}): {tail}",
                )
        (directory / _READY).write_text(f"{time.time()}\n")
        shutil.move(str(build_log), str(directory / "build.log"))
        self.builds += 1
        took = time.monotonic() - started
        log.info("environment %s: ready in %.1f s", short, took)
        await say(f"environment {short}: ready in {took:.1f} s")


async def _kill(process: asyncio.subprocess.Process) -> None:
    """SIGKILL to the step's whole process group (pip and what it started), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    await process.wait()


def _reporter(progress: Progress | None) -> Progress:
    """``progress`` made safe: a failure to report never fails a build."""

    async def say(text: str) -> None:
        if progress is None:
            return
        try:
            await progress(text)
        except Exception as exc:  # a full disk, a closed log
            log.debug("environment progress not reported: %s", exc)

    return say
