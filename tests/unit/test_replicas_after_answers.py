"""After a commit, a shard steps the replicas it keeps only once its lane answers of that
commit are written (``PeerHandlers._apply_replicas_after``; they share one compute thread and
the learners wait for the answers), at most ``_ANSWERS_FIRST_S`` later; the answers of a
commit are taken once and those of earlier iterations forgotten (``_lane_answers_of``)."""

from __future__ import annotations

import asyncio
from typing import Any

from shoal.param_sync import servicer_peers
from shoal.param_sync.servicer_peers import PeerHandlers


class FakeShard:
    """Just what the two methods use: the compute thread (recorded) and the answers."""

    def __init__(self) -> None:
        self.computed: list[tuple[Any, ...]] = []
        self._lane_answers: dict[tuple[str, int, int], list[asyncio.Future[None]]] = {}

    async def _compute(self, fn: Any, *args: Any) -> None:
        self.computed.append((fn, *args))


async def test_the_replicas_step_after_the_lane_answers_of_their_commit() -> None:
    shard = FakeShard()
    answers = [asyncio.get_running_loop().create_future() for _ in range(3)]
    step = asyncio.ensure_future(
        PeerHandlers._apply_replicas_after(shard, answers, ["replica"], (2, 7), 0.5)  # type: ignore[arg-type]
    )
    for future in answers[:2]:
        future.set_result(None)
        await asyncio.sleep(0.01)
        assert shard.computed == []  # one answer is still being written
    answers[2].set_result(None)
    await asyncio.wait_for(step, 5.0)
    assert shard.computed == [(servicer_peers._apply_replicated, ["replica"], 2, 7, 0.5)]


async def test_an_answer_that_never_ends_holds_the_replicas_only_so_long(monkeypatch) -> None:
    monkeypatch.setattr(servicer_peers, "_ANSWERS_FIRST_S", 0.05)
    shard = FakeShard()
    stuck = asyncio.get_running_loop().create_future()
    await asyncio.wait_for(
        PeerHandlers._apply_replicas_after(shard, [stuck], ["r"], (1, 1), 0.0),  # type: ignore[arg-type]
        5.0,
    )
    assert len(shard.computed) == 1 and not stuck.done()
    await PeerHandlers._apply_replicas_after(shard, [], ["r"], (1, 2), 0.0)  # type: ignore[arg-type]
    assert len(shard.computed) == 2  # no lane answers: at once


def test_the_answers_of_a_commit_are_taken_once_and_older_ones_forgotten() -> None:
    shard = FakeShard()
    loop = asyncio.new_event_loop()
    try:
        a, b, c, d = (loop.create_future() for _ in range(4))
        shard._lane_answers = {
            ("job", 1, 4): [a],  # an aborted try of iteration 4
            ("job", 2, 4): [b, c],
            ("job", 2, 5): [d],  # the next iteration's, already waiting
            ("other", 1, 3): [a],
        }
        taken = PeerHandlers._lane_answers_of(shard, "job", 2, 4)  # type: ignore[arg-type]
        assert taken == [b, c]
        assert set(shard._lane_answers) == {("job", 2, 5), ("other", 1, 3)}
        assert PeerHandlers._lane_answers_of(shard, "job", 2, 4) == []  # type: ignore[arg-type]
    finally:
        loop.close()
