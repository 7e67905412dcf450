"""The guard against a shard's generation floor drifting above its coordinator's generation
(issue 12; docs/data-plane.md, "Generation floor drift"): the pure decision
(``shoal.param_sync.generation_floor``), the coordinator's re-issue, the floor in a refusal's
trailer, and the servicer's guard on its local path, without servers.

Before the guard, any floor raised above the running generation without the coordinator
knowing livelocked the job: the coordinator re-issued the same generation at every boundary
and the shard refused every SyncStep of it as stale."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest
from grpc import aio

from shoal.contract.errors import GENERATION_FLOOR_METADATA_KEY, decode_rpc_error
from shoal.contract.wire import TensorMeta, pack_layout
from shoal.learner.grpc_calls import _refusal_of, _Shard
from shoal.param_sync.coordinator import (
    Action,
    Coordinator,
    JobSettings,
    OptimizerConfig,
    ResolveTask,
)
from shoal.param_sync.generation_floor import (
    DriftAction,
    FloorDecision,
    decide_on_floors,
    epoch_of,
)
from shoal.param_sync.service import ParameterSyncServicer, ShardOptions
from shoal.param_sync.servicer_common import _CoordinatedJob, _ShardSlice
from shoal.param_sync.shard import ShardJob
from shoal.param_sync.sharding import assign_shards
from shoal.runtime.errors import DEFAULT_TABLE, InvalidField, StaleGeneration
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

E1 = 1 << 32  # the first generation of coordinator epoch 1
E2 = 2 << 32


# -- the decision -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("generation", "epoch", "floors", "expected"),
    [
        # nothing above the coordinator's generation: an older generation was refused
        (5, 0, {}, FloorDecision(DriftAction.NONE)),
        (5, 0, {0: 5, 1: 3}, FloorDecision(DriftAction.NONE)),
        (E1 + 4, 1, {0: E1, 1: E1 + 4}, FloorDecision(DriftAction.NONE)),
        # a floor of its own epoch above it: continue at the floor (the lowest it accepts)
        (5, 0, {0: 5, 1: 6}, FloorDecision(DriftAction.REISSUE, 6, 1, 6)),
        (5, 0, {0: 9, 1: 7}, FloorDecision(DriftAction.REISSUE, 9, 0, 9)),
        (E1 + 23, 1, {1: E1 + 24}, FloorDecision(DriftAction.REISSUE, E1 + 24, 1, E1 + 24)),
        (
            E1 + 1,
            1,
            {0: E1 + 70, 2: E1 + 70},
            FloorDecision(DriftAction.REISSUE, E1 + 70, 0, E1 + 70),
        ),
        # a floor of an earlier epoch above the generation (a coordinator behind its own
        # epoch's base): catch up within the epoch, never past it
        (3, 1, {0: 7}, FloorDecision(DriftAction.REISSUE, 7, 0, 7)),
        # a floor of a later epoch: another coordinator exists; never jump, never re-issue
        (E1 + 4, 1, {1: E2}, FloorDecision(DriftAction.OTHER_EPOCH, -1, 1, E2)),
        (5, 0, {0: 6, 1: E1}, FloorDecision(DriftAction.OTHER_EPOCH, -1, 1, E1)),
        (5, 0, {0: E2 + 3, 1: E1}, FloorDecision(DriftAction.OTHER_EPOCH, -1, 0, E2 + 3)),
        # up to the epoch's last generation, not beyond
        (E2 - 2, 1, {0: E2 - 1}, FloorDecision(DriftAction.REISSUE, E2 - 1, 0, E2 - 1)),
        (E2 - 1, 1, {0: E2}, FloorDecision(DriftAction.OTHER_EPOCH, -1, 0, E2)),
    ],
)
def test_the_coordinator_reissues_above_a_drifted_floor_of_its_own_epoch_only(
    generation, epoch, floors, expected
):
    assert decide_on_floors(generation=generation, epoch=epoch, floors=floors) == expected


def test_a_decision_never_leaves_the_coordinators_epoch():
    for generation in (0, 1, E1 - 2, E1, E1 + 5, E2 - 2):
        epoch = epoch_of(generation)
        for floor in (generation + 1, (epoch << 32) + 0xFFFF_FFFF, (epoch + 1) << 32):
            d = decide_on_floors(generation=generation, epoch=epoch, floors={0: floor})
            if d.action is DriftAction.REISSUE:
                assert epoch_of(d.generation) == epoch and d.generation >= floor
            else:
                assert epoch_of(floor) > epoch and d.action is DriftAction.OTHER_EPOCH


def test_a_negative_generation_or_epoch_is_refused():
    with pytest.raises(ValueError, match=r"generation \(-1\)"):
        decide_on_floors(generation=-1, epoch=0, floors={})


# -- the coordinator's re-issue ---------------------------------------------------------------

METAS = [TensorMeta("w", "float32", (4, 3), 0, 48), TensorMeta("b", "float32", (4,), 0, 16)]
OPT = OptimizerConfig("SGD", '{"lr": 0.1}')


def _running(num_shards: int = 2) -> Coordinator:
    """A parameter-server job of two learners running iteration 0."""
    layout, _ = pack_layout(METAS)
    coord = Coordinator(
        JobSettings(
            "job-floor",
            batch_size=8,
            epochs=1,
            shard_addresses=tuple(f"127.0.0.1:{7300 + i}" for i in range(num_shards)),
        )
    )
    coord.shape.fix_layout(layout, OPT, 32, assign_shards(layout, num_shards))
    coord.set_mode(False)
    assert coord.join("l1")
    coord.join("l2")
    assert coord.decide("l1").action is Action.RUN
    assert coord.decide("l2").action is Action.RUN
    return coord


def test_a_running_iteration_is_aborted_and_reissued_at_the_floor_to_the_same_members():
    coord = _running()
    g = coord.generation
    task = coord.reissue_at(g + 7)
    assert task == ResolveTask(g, 0, commit=False)
    assert coord.generation == g + 7 and coord.running and coord.completed == 0
    assert coord.members == ["l1", "l2"]
    coord.task_done(task)
    a = coord.decide("l2").assignment
    assert a is not None and (a.generation, a.global_iteration, a.rank) == (g + 7, 0, 1)


def test_between_iterations_the_next_freeze_continues_from_the_floor():
    coord = _running()
    g = coord.generation
    coord.shard_ready(0, g, 0)
    commit = coord.shard_ready(1, g, 0)
    assert commit is not None and commit.commit
    coord.task_done(commit)
    assert coord.reissue_at(g + 3) is None and coord.generation == g + 3
    a = coord.decide("l1").assignment
    assert a is not None and (a.generation, a.global_iteration) == (g + 3, 1)


def test_a_reissue_changes_nothing_below_the_generation_in_collective_mode_or_when_all_ready():
    coord = _running()
    g = coord.generation
    assert coord.reissue_at(g) is None and coord.generation == g
    # every shard is ready (the commit waits behind a checkpoint): it commits on them all,
    # nothing to re-issue
    assert coord.begin_checkpoint() is not None
    assert coord.shard_ready(0, g, 0) is None and coord.shard_ready(1, g, 0) is None
    assert coord.running
    held = coord.holds
    assert coord.reissue_at(g + 2) is None and coord.generation == g and coord.holds == held
    collective = Coordinator(
        JobSettings("job-c", batch_size=8, epochs=1, shard_addresses=("127.0.0.1:7300",))
    )
    collective.set_mode(True)
    assert collective.reissue_at(9) is None and collective.generation == 0


# -- the floor in the refusal -----------------------------------------------------------------


class FakeRpcError:
    def __init__(self, trailers):
        self._trailers = trailers

    def code(self):
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self):
        return "stale"

    def trailing_metadata(self):
        return self._trailers


def test_a_shards_stale_refusal_carries_its_floor_in_a_trailer():
    layout, _ = pack_layout(METAS)
    sj = ShardJob("job-floor", 1, layout, OPT)
    sj.initialized = True
    sj.min_generation = E1 + 24
    with pytest.raises(StaleGeneration) as refused:
        sj.check_iteration(E1 + 23, 0)
    assert refused.value.floor == E1 + 24
    assert "generation (4294967319) is stale: shard 1" in str(refused.value)
    mapped = DEFAULT_TABLE.lookup(refused.value)
    assert mapped is not None and mapped.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (GENERATION_FLOOR_METADATA_KEY, str(E1 + 24)) in mapped.metadata
    info = decode_rpc_error(FakeRpcError(mapped.metadata))
    assert (info.reason, info.generation_floor) == ("ERROR_REASON_STALE_GENERATION", E1 + 24)
    # a refusal that knows no floor (not a member, an older shard) sends none
    assert not any(
        key == GENERATION_FLOOR_METADATA_KEY
        for key, _ in DEFAULT_TABLE.lookup(StaleGeneration("not a member")).metadata
    )


@pytest.mark.parametrize("value", ["", "-3", "12a", "\uff11\uff12", "9" * 21, b"\xff"])
def test_a_malformed_floor_trailer_is_no_floor(value):
    info = decode_rpc_error(FakeRpcError(((GENERATION_FLOOR_METADATA_KEY, value),)))
    assert info.generation_floor is None


# -- the servicer's guard (local path, no servers) --------------------------------------------


def _servicer_with_a_drift(
    tmp_path: Path, probe_s: float = 1.0
) -> tuple[ParameterSyncServicer, _CoordinatedJob]:
    """Shard 0 coordinates a one-shard job running iteration 0 in generation g; its own slice
    accepts generations from g (no drift yet)."""
    servicer = ParameterSyncServicer(
        ShardOptions(shard_index=0, storage_uri=tmp_path.as_uri(), shard_probe_s=probe_s)
    )
    coord = _running(num_shards=1)
    job = _CoordinatedJob(coord)
    servicer._coordinated[coord.job_id] = job
    layout, _ = pack_layout(METAS)
    sj = ShardJob(coord.job_id, 0, layout, OPT, active_shards=1)
    sj.initialized = True
    sj.min_generation = coord.generation
    servicer._slices[coord.job_id] = _ShardSlice(sj)
    return servicer, job


def _refusal(floor: int, shard: int = 0) -> ps_pb2.StaleRefusal:
    return ps_pb2.StaleRefusal(shard_index=shard, generation_floor=floor)


async def _settled(job: _CoordinatedJob) -> None:
    for _ in range(200):
        if not job.coord.holds and not job.background:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"tasks still held: {job.coord.holds}")


async def test_a_drifted_floor_reported_by_a_learner_is_checked_and_the_iteration_reissued(
    tmp_path: Path, caplog
):
    servicer, job = _servicer_with_a_drift(tmp_path)
    coord, sj = job.coord, servicer._slices[job.coord.job_id].job
    g = coord.generation
    sj.min_generation = g + 1  # drifted, the coordinator not told
    try:
        with caplog.at_level(logging.WARNING, logger="shoal.param_sync.service"):
            await servicer._stale_refusal(job, _refusal(g + 1), "l1")
            await _settled(job)
            # A second learner's report of the same refusal changes nothing more.
            await servicer._stale_refusal(job, _refusal(g + 1), "l2")
        assert coord.generation == g + 1 and coord.running and coord.completed == 0
        drifts = [r.getMessage() for r in caplog.records if "generation floor" in r.getMessage()]
        assert drifts == [
            f"job job-floor: shard 0's generation floor ({g + 1}) is above this coordinator's "
            f"generation ({g}): it refuses iteration 0 as stale; iteration 0 aborted and "
            f"re-issued at generation {g + 1}"
        ]
        a = coord.decide("l1").assignment
        assert a is not None and a.generation == g + 1
        sj.check_iteration(a.generation, 0)  # the shard takes the re-issued generation
    finally:
        await servicer.close()


async def test_the_watchdog_finds_a_drift_no_learner_reported(tmp_path: Path):
    servicer, job = _servicer_with_a_drift(tmp_path, probe_s=0.1)
    coord, sj = job.coord, servicer._slices[job.coord.job_id].job
    g = coord.generation
    sj.min_generation = g + 5  # drifted; the learners (old ones) send no report
    watchdog = asyncio.create_task(servicer._watch_shards(job))
    try:
        for _ in range(300):
            if coord.generation != g:
                break
            await asyncio.sleep(0.02)
        assert coord.generation == g + 5 and coord.running and coord.completed == 0
        await _settled(job)
    finally:
        watchdog.cancel()
        await servicer.close()


async def test_a_learners_floor_is_only_a_hint_the_shard_is_asked_at_most_every_interval(
    tmp_path: Path, monkeypatch
):
    servicer, job = _servicer_with_a_drift(tmp_path)
    coord = job.coord
    g = coord.generation
    asked = []
    real = servicer._shard_status

    async def counting(settings, index):
        asked.append(index)
        return await real(settings, index)

    monkeypatch.setattr(servicer, "_shard_status", counting)
    try:
        for _ in range(5):  # a lying (or buggy) learner: the shard's floor is g
            await servicer._stale_refusal(job, _refusal(g + 1_000_000), "l1")
        await servicer._stale_refusal(job, _refusal(g - 1), "l1")  # an older generation's
        assert coord.generation == g and not coord.holds
        assert asked == [0]  # one probe in the interval, none for a floor at or below g
    finally:
        await servicer.close()


@pytest.mark.parametrize(
    ("refusal", "needle"),
    [
        (_refusal(5, shard=1), "stale_refusal.shard_index (1) is not a shard of job 'job-floor'"),
        (_refusal(5, shard=-1), "stale_refusal.shard_index (-1)"),
        (_refusal(-4), "stale_refusal.generation_floor (-4) must be >= 0"),
    ],
)
async def test_a_bad_refusal_report_is_refused_naming_the_field_and_changes_nothing(
    tmp_path: Path, refusal, needle
):
    servicer, job = _servicer_with_a_drift(tmp_path)
    g = job.coord.generation
    try:
        with pytest.raises(InvalidField, match=needle.replace("(", r"\(").replace(")", r"\)")):
            await servicer._stale_refusal(job, refusal, "l1")
        assert job.coord.generation == g and not job.coord.holds
    finally:
        await servicer.close()


async def test_a_floor_of_a_later_epoch_is_never_jumped_to_and_said_once(tmp_path: Path, caplog):
    servicer, job = _servicer_with_a_drift(tmp_path)
    coord, sj = job.coord, servicer._slices[job.coord.job_id].job
    g = coord.generation
    sj.min_generation = E1  # a successor coordinator (epoch 1) told this shard
    try:
        with caplog.at_level(logging.WARNING, logger="shoal.param_sync.service"):
            await servicer._apply_floors(job, {0: E1})
            await servicer._apply_floors(job, {0: E1})
        assert coord.generation == g and not coord.holds  # fenced as before; nothing issued
        said = [r.getMessage() for r in caplog.records if "another coordinator" in r.getMessage()]
        assert len(said) == 1 and f"shard 0 is at generation {E1} of coordinator epoch 1" in said[0]
    finally:
        await servicer.close()


def _rpc_error(*trailers: tuple[str, str]) -> aio.AioRpcError:
    return aio.AioRpcError(
        grpc.StatusCode.FAILED_PRECONDITION, aio.Metadata(), aio.Metadata(*trailers), "stale"
    )


def test_a_learner_passes_a_shards_floor_on_with_its_next_boundary():
    shard = _Shard(index=1, address="127.0.0.1:7301", tensors=[])
    stale = ("shoal-error-reason", "ERROR_REASON_STALE_GENERATION")
    floor = (GENERATION_FLOOR_METADATA_KEY, str(E1 + 24))
    assert _refusal_of(_rpc_error(stale, floor), shard) == ps_pb2.StaleRefusal(
        shard_index=1, generation_floor=E1 + 24
    )
    assert _refusal_of(_rpc_error(stale), shard) is None  # no floor said (not a member)
    other = ("shoal-error-reason", "ERROR_REASON_WRONG_STATE")
    assert _refusal_of(_rpc_error(other, floor), shard) is None
    assert _refusal_of(_rpc_error(stale, floor), None) is None  # which shard is not known
