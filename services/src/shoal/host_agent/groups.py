"""Process groups of learners: signalling them, and killing what a previous agent left."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
from pathlib import Path

__all__ = [
    "group_alive",
    "kill_group",
    "kill_marked",
    "proc_has_env",
    "proc_pgid",
    "reap_orphans",
]

log = logging.getLogger("shoal.host_agent.processes")


def kill_group(pgid: int, sig: int) -> bool:
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


def proc_pgid(pid: int) -> int | None:
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


def proc_has_env(pid: int, name: str, value: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{name}={value}".encode() in environ.split(b"\0")


def kill_marked(recorded: dict[int, list[tuple[str, str]]]) -> int:
    """SIGKILL every process whose process group is a key of ``recorded`` and whose initial
    environment (``/proc/<pid>/environ``) holds one of that group's ``NAME=VALUE`` marks, so
    that a reused pid or process group is never hit. Returns how many were killed."""
    killed = 0
    if recorded and Path("/proc").is_dir():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            pgid = proc_pgid(pid)
            marks = recorded.get(pgid) if pgid is not None else None
            if marks and any(proc_has_env(pid, name, value) for name, value in marks):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
    return killed


def reap_orphans(learners_dir: Path) -> int:
    """Kill what is left of learners a previous agent started (their ``learner.json``), then
    remove their directories. Only processes in the recorded process group whose environment
    names the learner (``SHOAL_LEARNER_ID``, or for a learner that started warm the token of
    its warm process, ``SHOAL_WARM_TOKEN``) are killed, so a reused pid is never hit. Returns
    how many were killed."""
    if not learners_dir.is_dir():
        return 0
    recorded: dict[int, list[tuple[str, str]]] = {}
    for meta in learners_dir.glob("*/learner.json"):
        try:
            info = json.loads(meta.read_text())
            marks = [("SHOAL_LEARNER_ID", str(info["learner_id"]))]
            if info.get("warm_token"):
                marks.append(("SHOAL_WARM_TOKEN", str(info["warm_token"])))
            recorded[int(info["pgid"])] = marks
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    killed = kill_marked(recorded)
    if killed:
        log.warning("killed %d leftover process(es) of learners of a previous agent", killed)
    for child in learners_dir.iterdir():
        shutil.rmtree(child, ignore_errors=True)
    return killed
