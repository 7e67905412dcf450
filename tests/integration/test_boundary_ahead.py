"""A Boundary sent beside its SyncStep (``BoundaryRequest.ahead``, ``SHOAL_BOUNDARY_AHEAD``;
docs/data-plane.md, "The Boundary sent ahead").

Against two in-process shard servers (real gRPC, with auth; ``test_param_sync.Cluster``): a
Boundary marked ``ahead`` that reports the iteration still running is held until that iteration
commits, then answered with the next one, its report recorded; held while the iteration is
aborted, it is answered with the re-issue; one that reports anything but the running iteration
is answered at once, as a plain Boundary; one whose caller gives up while it is held changes
nothing.

With real processes (two shard processes, two learner processes per job of the digits MLP), a
job whose learners send every Boundary ahead (the default) trains to the very same parameters
and iteration records as one whose learners send it after the sync (``off``), and so does one
on the same-host lanes, whose syncs go on the trainer's thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from shoal.v1 import parameter_sync_service_pb2 as ps_pb2
from tests.integration._param_sync_cluster import (
    DataPlane,
    reference_training,
    release,
    running_plane,
)
from tests.integration.test_elastic_training import (
    ATOL,
    BATCH,
    assert_each_iteration_recorded_once,
    iterations_per_epoch,
)
from tests.integration.test_param_sync import (
    Cluster,
    cluster,  # noqa: F401 - the fixture
    contribute,
    grads,
    initial,
    started,
)
from tests.support import async_wait_until

BUFFERS = {k: v for k, v in initial().items() if k.startswith("bn.")}


def ahead(c: Cluster, learner: str, a: Any, loss_sum: float, n: int) -> asyncio.Future[Any]:
    """A Boundary marked ahead, reporting ``a`` (sent now, answered whenever)."""
    call = c.boundary(
        "j",
        learner,
        generation=a.generation,
        completed=a.global_iteration,
        loss_sum=loss_sum,
        n=n,
        ahead=True,
    )
    return asyncio.ensure_future(call)


async def still_waiting(call: asyncio.Future[Any]) -> bool:
    """Whether ``call`` is unanswered after the server had ample time to answer a call it
    does not hold (a plain Boundary here is answered in milliseconds)."""
    await asyncio.wait([call], timeout=0.5)
    return not call.done()


async def test_a_boundary_sent_ahead_is_held_until_the_commit_and_its_report_is_recorded(cluster):  # noqa: F811
    c = cluster
    a1, a2 = await started(c, "j", ["l1", "l2"], batch=4)
    coordinator = c.servicers[0]._coordinated["j"].coord
    early = ahead(c, "l1", a1, loss_sum=3.0, n=2)
    l1 = asyncio.ensure_future(contribute(c, "j", "l1", a1, grads(1), BUFFERS, n=2))
    assert await still_waiting(early)  # l2 has not contributed: iteration 0 is running
    assert coordinator.running and coordinator.completed == 0
    await contribute(c, "j", "l2", a2, grads(2), BUFFERS, n=2)
    await l1
    answer = await asyncio.wait_for(early, timeout=30)
    assert answer.action == ps_pb2.BOUNDARY_ACTION_RUN
    nxt = answer.assignment
    assert (nxt.global_iteration, nxt.generation) == (1, a1.generation)
    assert not answer.pull_parameters
    # l1's loss came with the held Boundary: the record is finished by l2's plain one.
    reply = await c.boundary("j", "l2", generation=a2.generation, completed=0, loss_sum=1.0, n=2)
    assert reply.assignment.global_iteration == 1
    await async_wait_until(lambda: coordinator.last_loss == pytest.approx(1.0), what="the record")


async def test_a_boundary_held_ahead_is_answered_with_the_reissue_when_its_iteration_aborts(
    cluster,  # noqa: F811
):
    c = cluster
    a1, _a2 = await started(c, "j", ["l1", "l2"], batch=4)
    early = ahead(c, "l1", a1, loss_sum=3.0, n=2)
    assert await still_waiting(early)
    reply = await c.call(
        "EvictLearner", ps_pb2.EvictLearnerRequest(job_id="j", learner_id="l2"), role="service"
    )
    assert reply.aborted_iteration == 0
    answer = await asyncio.wait_for(early, timeout=30)
    a = answer.assignment
    assert answer.action == ps_pb2.BOUNDARY_ACTION_RUN
    assert (a.global_iteration, a.generation, a.rank, a.world_size) == (0, 2, 0, 1)


async def test_a_held_boundary_whose_learner_gives_up_changes_nothing(cluster):  # noqa: F811
    """A learner that dies (or cancels the call) while its Boundary is held: the iteration
    commits as it would have, and the learner's next Boundary is answered as usual."""
    c = cluster
    a1, a2 = await started(c, "j", ["l1", "l2"], batch=4)
    coordinator = c.servicers[0]._coordinated["j"].coord
    early = ahead(c, "l1", a1, loss_sum=3.0, n=2)
    l1 = asyncio.ensure_future(contribute(c, "j", "l1", a1, grads(1), BUFFERS, n=2))
    assert await still_waiting(early)
    early.cancel()  # the call ends on the learner's side: gRPC cancels its handler
    await asyncio.gather(early, return_exceptions=True)
    await contribute(c, "j", "l2", a2, grads(2), BUFFERS, n=2)
    await l1
    await async_wait_until(lambda: coordinator.completed == 1, what="iteration 0 committed")
    # Its report never arrived: the plain Boundary after carries it, and gets iteration 1.
    for learner, a in (("l1", a1), ("l2", a2)):
        reply = await c.boundary(
            "j", learner, generation=a.generation, completed=0, loss_sum=1.0, n=2
        )
        assert reply.assignment.global_iteration == 1, learner
    await async_wait_until(lambda: coordinator.last_loss == pytest.approx(0.5), what="the record")


async def test_a_boundary_ahead_of_anything_but_the_running_iteration_is_answered_at_once(
    cluster,  # noqa: F811
):
    c = cluster
    [a] = await started(c, "j", ["l1"], batch=4)
    for generation, iteration in ((a.generation, 7), (a.generation + 5, 0), (0, -1)):
        call = c.boundary("j", "l1", generation=generation, completed=iteration, ahead=True)
        answer = await asyncio.wait_for(call, timeout=30)
        # Nothing recorded, nothing moved: the running iteration again.
        assert answer.assignment.global_iteration == 0, (generation, iteration)
        assert answer.assignment.generation == a.generation


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory):
    yield from running_plane(tmp_path_factory, "boundary-ahead")


@pytest.mark.slow
def test_learners_sending_boundaries_ahead_train_exactly_as_ones_sending_them_after(
    plane: DataPlane,
):
    epochs = 1
    total = epochs * iterations_per_epoch()
    # (lane: on the same-host lanes, where the trainer's thread sends the SyncStep and the
    # Boundary beside it on the lanes' control connections and reads both answers itself)
    jobs = {"ahead": ("off", "on"), "after": ("off", "off"), "lane": ("on", "on")}
    gate = plane.tmp / "ahead.gate"
    procs = []
    for job, (lane, switch) in jobs.items():
        plane.open_job(job, batch=BATCH, epochs=epochs)
        procs += [
            plane.start_learner(
                job,
                f"{job}-l{i}",
                epochs=epochs,
                batch=BATCH,
                gate=gate,
                env={"SHOAL_SHM_LANE": lane, "SHOAL_BOUNDARY_AHEAD": switch},
            )
            for i in range(2)
        ]
    release(procs, gate)
    for proc in procs:
        assert proc.wait(timeout=240) == 0, proc.text()[-3000:]
    on, off, lane = (
        plane.final_model("ahead"),
        plane.final_model("after"),
        plane.final_model("lane"),
    )
    assert set(on) == set(off) == set(lane)
    for name, value in off.items():
        assert torch.equal(on[name], value), name  # bit for bit
        assert torch.equal(lane[name], value), name
    reference, _ = reference_training(epochs, BATCH)
    for name, value in reference.items():
        torch.testing.assert_close(on[name], value, atol=ATOL, rtol=0, msg=name)
    # Every iteration recorded once, with the same loss (the reports came with the held
    # Boundaries).
    records_on = assert_each_iteration_recorded_once(plane, "ahead", total)
    records_off = assert_each_iteration_recorded_once(plane, "after", total)
    records_lane = assert_each_iteration_recorded_once(plane, "lane", total)
    assert [r["loss"] for r in records_on] == [r["loss"] for r in records_off]
    assert [r["loss"] for r in records_lane] == [r["loss"] for r in records_off]
    for i in range(2):
        h_on, h_off = plane.history(f"ahead-l{i}"), plane.history(f"after-l{i}")
        h_lane = plane.history(f"lane-l{i}")
        assert len(h_on["history"]) == total
        # Each Boundary after a sync was answered ahead, none asked again.
        answered, again = h_on["ahead_boundaries"]
        assert (answered, again) == (len(h_on["history"]), 0), h_on["ahead_boundaries"]
        assert h_off["ahead_boundaries"] == [0, 0]
        assert h_on["direct_syncs"] == h_off["direct_syncs"] == 0  # (gRPC: on the loop)
        # On the lanes, every sync but the first (which opens them, on the loop) went on the
        # trainer's thread, its Boundary beside it.
        assert len(h_lane["history"]) == total
        assert h_lane["direct_syncs"] == total - 1, h_lane["direct_syncs"]
        assert h_lane["ahead_boundaries"] == [total, 0], h_lane["ahead_boundaries"]
