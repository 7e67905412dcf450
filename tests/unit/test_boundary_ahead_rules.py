"""The Boundary sent ahead (docs/data-plane.md, "The Boundary sent ahead"): which reports the
coordinator holds (``Coordinator.reported_running``: the running iteration's, and the
committed one's while its commit is being delivered) and the learner's switch
``SHOAL_BOUNDARY_AHEAD``."""

from __future__ import annotations

import pytest

from shoal.learner.grpc_calls import boundary_ahead_enabled
from tests.unit.test_coordinator import active, make, runs, start


def test_only_a_members_report_of_the_running_uncommitted_iteration_is_held():
    coord = make()
    start(coord, "a", "b")
    a = runs(coord, "a")
    runs(coord, "b")
    g, k = a.generation, a.global_iteration
    assert coord.reported_running("a", g, k) and coord.reported_running("b", g, k)
    assert not coord.reported_running("a", g, k + 1)  # not the running iteration
    assert not coord.reported_running("a", g + 1, k)  # another generation
    assert not coord.reported_running("stranger", g, k)  # not a member
    for i in active(coord):  # every shard ready: the commit, still being delivered
        task = coord.shard_ready(i, g, k)
    assert task is not None and coord.completed == k + 1
    assert coord.reported_running("a", g, k)  # held until the shards have it
    assert coord.task_done(task) is None
    assert not coord.reported_running("a", g, k)  # committed and delivered: answered at once
    assert runs(coord, "a").global_iteration == k + 1
    assert coord.reported_running("a", g, k + 1)


def test_a_collective_job_never_holds_a_boundary():
    coord = make()
    coord.set_mode(collective=True)
    start(coord, "a")
    a = runs(coord, "a")
    assert not coord.reported_running("a", a.generation, a.global_iteration)


def test_shoal_boundary_ahead_is_on_by_default_and_refuses_other_values(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.delenv("SHOAL_BOUNDARY_AHEAD", raising=False)
    assert boundary_ahead_enabled()
    for raw, expected in (("on", True), (" OFF ", False), ("off", False)):
        monkeypatch.setenv("SHOAL_BOUNDARY_AHEAD", raw)
        assert boundary_ahead_enabled() is expected
    for raw in ("yes", "1", ""):
        monkeypatch.setenv("SHOAL_BOUNDARY_AHEAD", raw)
        with pytest.raises(ValueError, match=f"SHOAL_BOUNDARY_AHEAD \\({raw!r}\\)"):
            boundary_ahead_enabled()
