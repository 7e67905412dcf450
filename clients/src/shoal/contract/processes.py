"""Whether a process of this machine is still alive, by its pid.

Two places ask it of pids they recorded: the shared-memory lane sweeps the segments of shards
that are gone (``shoal.contract.shm.sweep_stale``), and the local cluster's CLI (``shoal
cluster``) tells which of the processes it started still run. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited: a zombie (exited, not yet reaped)
    counts as gone, and so does a pid <= 0 (those name process groups, not a process). A
    process of another user counts as alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # it has just gone, or there is no /proc (macOS): kill decides
        return not Path("/proc/self").exists()
    except OSError:
        return True
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
    return stat.rpartition(")")[2].split()[0] != "Z"
