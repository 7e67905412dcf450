"""The scheduler learns each job's throughput model from its progress polls (the reconcile
loop's hook into shoal.scheduler.goodput) and shows it in the Job."""

from __future__ import annotations

from tests.integration.test_scheduler import ALICE, Loop, loop, spec

__all__ = ["loop"]  # the fixture, shared with test_scheduler.py


async def test_a_running_job_gets_a_throughput_model_from_its_progress(loop: Loop) -> None:
    j = (await loop.api.submit(ALICE, "g1", spec(loop.artifact))).job_id
    await loop.shares({j: 8}, "the job on 8 learners")

    def measured_at_8() -> bool:
        model = loop.job(j).throughput
        return any(p.world_size == 8 and p.observed for p in model.points)

    await loop.until(measured_at_8, "an iteration time measured at world size 8")
    model = loop.job(j).throughput
    assert [p.world_size for p in model.points] == list(range(1, 9))  # 1 .. max_workers
    at8 = next(p for p in model.points if p.world_size == 8)
    assert at8.samples_per_second > 0
    assert model.compute_seconds + model.overhead_seconds > 0
    await loop.until(
        lambda: loop.job(j).throughput.attained_device_seconds > 0, "attained service counted"
    )
    # The policy sees the model too (every active job's demand carries a curve).
    demands = loop.reconciler.goodput.annotate([])
    assert demands == []  # and a job that left the demands is forgotten
    assert loop.reconciler.goodput.model(j) is None
