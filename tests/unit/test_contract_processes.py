"""shoal.contract.processes.pid_alive: the one liveness check of a recorded pid (the lane's
sweep of stale segments, `shoal cluster status/down`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shoal.contract.processes import pid_alive
from tests.support import wait_until


def test_this_process_is_alive_and_a_pid_that_names_a_group_is_not() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(0)
    assert not pid_alive(-1)


def test_a_child_that_exited_is_gone_before_and_after_it_is_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_until(lambda: not pid_alive(child.pid), what="the exited child (a zombie) counted gone")
    child.wait()
    assert not pid_alive(child.pid)


@pytest.mark.skipif(not os.path.exists("/proc/1/stat"), reason="needs /proc")
def test_a_process_of_another_user_counts_as_alive() -> None:
    assert pid_alive(1)  # init: another user's process for a non-root test run
