"""Child processes that never outlive their creator; processes whose memory other processes of
the same user cannot read.

:func:`die_with_parent` wraps a command so that Linux SIGKILLs it when the process that
started it dies (``PR_SET_PDEATHSIG``). The prctl runs in a tiny fresh interpreter that then
execs the command (same pid, same process group), not in a ``preexec_fn``: running Python in
the forked child of a process with gRPC threads can crash (seen here: aborts with "epoll_wait
error: Bad file descriptor" and segfaults in threading's after-fork handler).

The signal fires when the creating *thread* exits, so the wrapper is only applied from the
main thread; elsewhere the command runs unwrapped and the caller must clean up (atexit).

:func:`set_dumpable` (``PR_SET_DUMPABLE``) makes this process non-dumpable: another process of
the same user can then neither ptrace it nor open its ``/proc/<pid>/mem`` or ``/proc/<pid>/fd``
entries (only root, with CAP_SYS_PTRACE, can); no core dump is written either. The
parameter-sync shards do it by default (``--dumpable``; docs/data-plane.md, "Isolation").
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Sequence

_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4

_PDEATHSIG_WRAPPER = """\
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    sys.exit("shoal: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    sys.exit("shoal: the parent process died before the child started")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_parent(argv: Sequence[str], *, any_thread: bool = False) -> list[str]:
    """``argv`` wrapped so that it gets SIGKILL when this process dies (Linux only).

    ``any_thread``: wrap even off the main thread (the caller's thread outlives the child).
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    if not any_thread and threading.current_thread() is not threading.main_thread():
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_WRAPPER, str(os.getpid()), *argv]


def set_dumpable(dumpable: bool) -> None:
    """Make this process dumpable or not (``prctl(PR_SET_DUMPABLE)``; Linux only: elsewhere
    an OSError). The flag is kept across fork and reset to dumpable by execve."""
    if not sys.platform.startswith("linux"):
        raise OSError("PR_SET_DUMPABLE is Linux only")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, int(dumpable), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_DUMPABLE, {int(dumpable)}): {os.strerror(errno)}")


def is_dumpable() -> bool:
    """Whether this process is dumpable (``prctl(PR_GET_DUMPABLE)``; True off Linux)."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0))
