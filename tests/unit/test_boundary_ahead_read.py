"""The reply to a Boundary sent ahead is read on the trainer's thread when it has come already
(``GrpcBackend._answered_ahead``): no hop to the session's loop for it. A backend that never
connects; the futures are real ones of its session's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shoal.learner.backend import TrainingPlan
from shoal.learner.grpc_backend import GrpcBackend
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2


@pytest.fixture
def backend() -> Iterator[GrpcBackend]:
    b = GrpcBackend(job_id="j", learner_id="l", coordinator="127.0.0.1:9")
    try:
        yield b
    finally:
        b.close()


def _on_loop(backend: GrpcBackend, settle: Callable[[asyncio.Future[Any]], None] | None) -> Any:
    """A future of the session's loop, settled there by ``settle`` (None: left pending)."""

    async def make() -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if settle is not None:
            settle(future)
        return future

    return asyncio.run_coroutine_threadsafe(make(), backend.session.loop).result(timeout=10)


RETIRE = ps_pb2.BoundaryResponse(action=ps_pb2.BOUNDARY_ACTION_RETIRE)


def test_an_answered_ahead_boundary_is_read_without_the_loop(backend: GrpcBackend) -> None:
    backend._plan = TrainingPlan(epochs=1, batch_size=4, num_samples=40)
    backend._report = (3, 7, 1.5, 4)
    backend._ahead = _on_loop(backend, lambda f: f.set_result(RETIRE))

    def no_hop(coro: Any) -> Any:
        coro.close()
        raise AssertionError("next_assignment went to the loop for an answered Boundary")

    backend.session.run = no_hop  # type: ignore[method-assign]
    a = backend.next_assignment()
    assert a is not None and a.retire and (a.generation, a.step) == (3, 8)
    assert backend.ahead_boundaries == [1, 0]
    assert backend._ahead is None  # taken: the next Boundary is a new one


@pytest.mark.parametrize(
    "settle",
    [
        None,  # not answered yet: awaited on the loop
        lambda f: f.set_exception(RuntimeError("the shard went away")),  # asked again there
        lambda f: f.cancel(),
        lambda f: f.set_result(  # re-routes the shards: the session's state, on the loop
            ps_pb2.BoundaryResponse(
                action=ps_pb2.BOUNDARY_ACTION_RETIRE,
                routing_epoch=1,
                shards=[ps_pb2.ShardSlice(address="127.0.0.1:10")],
            )
        ),
    ],
    ids=["pending", "failed", "cancelled", "re-routing"],
)
def test_other_ahead_boundaries_are_left_to_the_loop(
    backend: GrpcBackend, settle: Callable[[asyncio.Future[Any]], None] | None
) -> None:
    ahead = _on_loop(backend, settle)
    assert backend._answered_ahead(ahead) is None
    assert backend.ahead_boundaries == [0, 0]
    if settle is None:
        backend.session.loop.call_soon_threadsafe(ahead.cancel)
    elif not ahead.cancelled():
        ahead.exception()  # (retrieved: no "never retrieved" warning at exit)


def test_no_ahead_boundary(backend: GrpcBackend) -> None:
    assert backend._answered_ahead(None) is None
