"""The local cluster's supervisor: crashed service processes are restarted with a bounded
backoff (shoal.cluster.local.Supervision, RestartPolicy, LocalCluster.supervise_once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shoal.cluster.local import (
    ClusterSpec,
    LocalCluster,
    RestartPolicy,
    ServiceProcess,
    Supervision,
)
from shoal.runtime.errors import InvalidField
from tests.support import wait_until

POLICY = RestartPolicy(
    initial_backoff_s=1.0, max_backoff_s=8.0, max_restarts=3, window_s=100.0, stable_after_s=50.0
)


def test_restarts_back_off_doubling_up_to_the_maximum_and_reset_once_stable() -> None:
    sup = Supervision()
    delays = []
    now = 0.0
    for _ in range(3):
        sup.exited(1, now, POLICY)
        assert sup.due_at is not None
        delays.append(sup.due_at - now)
        assert not sup.due(sup.due_at - 0.01) and sup.due(sup.due_at)
        now = sup.due_at
        sup.restarted(now)
        now += 0.5  # crashes again at once
    assert delays == [1.0, 2.0, 4.0]
    # Up for longer than stable_after_s: the next crash starts from the initial backoff again.
    sup2 = Supervision()
    sup2.exited(1, 0.0, POLICY)
    sup2.restarted(1.0)
    sup2.exited(1, 1.5, POLICY)
    sup2.restarted(3.5)
    assert "restarting in 1 s" in sup2.exited(1, 3.5 + 60.0, POLICY)


def test_the_backoff_never_exceeds_its_maximum() -> None:
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=3.0, max_restarts=100)
    sup = Supervision()
    now = 0.0
    for _ in range(6):
        sup.exited(1, now, policy)
        now = sup.due_at or now
        sup.restarted(now)
    assert sup.backoff_s == 3.0


def test_too_many_restarts_within_the_window_gives_up_and_says_so() -> None:
    sup = Supervision()
    now = 0.0
    for _ in range(3):
        sup.exited(1, now, POLICY)
        now = sup.due_at or now
        sup.restarted(now)
    said = sup.exited(137, now + 0.1, POLICY)
    assert sup.gave_up and sup.due_at is None
    assert "not restarted again" in said and "code 137" in said
    assert sup.state(alive=False, now=now) == "gave up"
    assert sup.restarts == 3 and sup.last_exit == 137


def test_restarts_older_than_the_window_do_not_count() -> None:
    sup = Supervision()
    for start in (0.0, 200.0, 400.0, 600.0, 800.0):
        sup.exited(1, start, POLICY)
        assert not sup.gave_up
        sup.restarted(start + 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [("initial_backoff_s", -1.0), ("initial_backoff_s", 60.0), ("max_restarts", -1)],
)
def test_a_bad_restart_policy_is_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(InvalidField, match=field):
        RestartPolicy(**{field: value})  # type: ignore[arg-type]


def test_supervise_once_restarts_a_crashed_process_after_its_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a real (short-lived) child process: it exits 3, is noticed, restarted when due, and
    the status says so."""
    spec = ClusterSpec(state_dir=tmp_path, restart_policy=POLICY)
    cluster = LocalCluster(spec)
    svc = ServiceProcess("parameter-sync-1", "parameter-sync", "127.0.0.1:1", [], tmp_path / "l")
    cluster.services[svc.name] = svc
    spawned: list[int] = []

    def spawn(s: ServiceProcess) -> None:
        s.proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
        spawned.append(s.proc.pid)

    monkeypatch.setattr(cluster, "_spawn", spawn)
    spawn(svc)
    wait_until(lambda: not svc.alive(), what="the child exits")
    events = cluster.supervise_once(now=10.0)
    assert events == ["parameter-sync-1: exited (code 3); restarting in 1 s"]
    assert cluster.services_status()[svc.name]["state"].startswith("restarting in")  # type: ignore[union-attr]
    assert cluster.supervise_once(now=10.5) == []  # not due yet
    events = cluster.supervise_once(now=11.0)
    assert len(spawned) == 2 and events[0].startswith("parameter-sync-1: restarted (pid ")
    status = cluster.services_status()[svc.name]
    assert status["restarts"] == 1 and status["last_exit_code"] == 3
    wait_until(lambda: not svc.alive(), what="it exits again")
    assert "restarting in 2 s" in cluster.supervise_once(now=11.5)[0]


def test_cluster_status_shows_each_process_state_restarts_and_last_exit(tmp_path: Path) -> None:
    import json
    import os

    from typer.testing import CliRunner

    from shoal.cluster.cli import cluster_app

    state = {
        "supervisor_pid": os.getpid(),
        "pids": {"parameter-sync-0": os.getpid(), "parameter-sync-1": 0},
        "metrics": {"parameter-sync-0": "http://127.0.0.1:9/metrics"},
        "scheduler": ["127.0.0.1:1"],
        "supervised": True,
        "services": {
            "parameter-sync-0": {"pid": 1, "state": "running", "restarts": 2, "last_exit_code": -9},
            "parameter-sync-1": {
                "pid": None,
                "state": "gave up",
                "restarts": 10,
                "last_exit_code": 1,
            },
        },
    }
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    result = CliRunner().invoke(
        cluster_app, ["status", "--state-dir", str(tmp_path)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in result.output.splitlines()
        if line.startswith("│")
    ]
    assert ["parameter-sync-0", "running", "2", "-9"] in rows
    assert ["parameter-sync-1", "gave up", "10", "1"] in rows
    assert "http://127.0.0.1:9/metrics" in result.output
