"""A non-dumpable process (``shoal.runtime.procs.set_dumpable``, what a parameter-sync shard
does unless ``--dumpable on``): the flag is set, and another process of the same user can then
no longer open its descriptors or read its memory through /proc (real processes; the second
part runs them as an unprivileged user, so it needs root to start them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="prctl: Linux only")

HOLDER = """
import os, sys
from shoal.runtime.procs import is_dumpable, set_dumpable
dumpable = sys.argv[1] == "on"
if len(sys.argv) > 2:
    os.setgid(65534); os.setuid(65534)
before = is_dumpable()
set_dumpable(dumpable)
fd = os.memfd_create("shoal-lane", os.MFD_CLOEXEC)
os.write(fd, b"secret")
print(before, is_dumpable(), os.getpid(), fd, flush=True)
sys.stdin.read()  # until the test is done
"""

PEEKER = """
import os, sys
os.setgid(65534); os.setuid(65534)
pid, fd = sys.argv[1], sys.argv[2]
for path in (f"/proc/{pid}/fd/{fd}", f"/proc/{pid}/mem"):
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as exc:
        print(path, "refused", exc.errno)
    else:
        print(path, "opened")
"""


def start_holder(dumpable: str, *, as_nobody: bool = False) -> tuple[subprocess.Popen, list[str]]:
    argv = [sys.executable, "-c", HOLDER, dumpable] + (["nobody"] if as_nobody else [])
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()


def test_set_dumpable_off_makes_the_process_non_dumpable() -> None:
    proc, line = start_holder("off")
    try:
        assert line[:2] == ["True", "False"], line
    finally:
        proc.communicate("", timeout=60)
    proc, line = start_holder("on")
    try:
        assert line[:2] == ["True", "True"], line
    finally:
        proc.communicate("", timeout=60)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run both processes as nobody")
@pytest.mark.parametrize(("dumpable", "outcome"), [("on", "opened"), ("off", "refused")])
def test_a_same_user_process_reads_a_non_dumpable_ones_fds_and_memory_only_if_dumpable(
    dumpable: str, outcome: str
) -> None:
    proc, line = start_holder(dumpable, as_nobody=True)
    try:
        pid, fd = line[2], line[3]
        peek = subprocess.run(
            [sys.executable, "-c", PEEKER, pid, fd],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        proc.communicate("", timeout=60)
    lines = peek.stdout.splitlines()
    assert len(lines) == 2 and all(f" {outcome}" in x for x in lines), peek.stdout
