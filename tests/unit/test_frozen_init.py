"""fast_frozen_init: a frozen dataclass keeps its whole behaviour with the faster __init__."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field

import pytest

from shoal.learner import Assignment, Contribution, IterationRecord, SyncResult
from shoal.learner.frozen_init import fast_frozen_init


def _point_class(fast: bool) -> type:
    @dataclass(frozen=True)
    class Point:
        x: int
        y: int = 2
        tags: list[str] = field(default_factory=list)

        def __post_init__(self) -> None:
            if self.x < 0:
                raise ValueError(f"x ({self.x}) must be >= 0")

    return fast_frozen_init(Point) if fast else Point


Plain, Fast = _point_class(False), _point_class(True)


def test_the_fast_init_has_the_dataclass_signature_and_builds_equal_instances() -> None:
    assert str(inspect.signature(Fast)) == str(inspect.signature(Plain))
    for args, kwargs in [((1,), {}), ((1, 5), {}), ((), {"x": 1, "tags": ["a"]}), ((3,), {"y": 4})]:
        plain, fast = Plain(*args, **kwargs), Fast(*args, **kwargs)
        assert dataclasses.asdict(fast) == dataclasses.asdict(plain)
        assert repr(fast).replace("Point", "") == repr(plain).replace("Point", "")
    assert (
        Fast(1) == Fast(1) and hash(Fast(1, 2, ())) == hash(Fast(1, 2, ())) and Fast(1) != Fast(2)
    )


def test_the_fast_init_keeps_factories_post_init_frozenness_replace_and_pickling() -> None:
    a, b = Fast(1), Fast(1)
    assert a.tags == [] and a.tags is not b.tags  # a fresh default per instance
    with pytest.raises(ValueError, match=r"x \(-1\) must be >= 0"):
        Fast(-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.x = 3  # type: ignore[misc]
    assert dataclasses.replace(a, y=7) == Fast(1, 7)
    with pytest.raises(ValueError):
        dataclasses.replace(a, x=-5)
    with pytest.raises(TypeError):
        Fast()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Fast(1, z=3)  # type: ignore[call-arg]


def test_the_per_iteration_types_round_trip_through_pickle_and_validate() -> None:
    a = Assignment(0, 1, 2, 3, 0, 1, 0, 32)
    assert pickle.loads(pickle.dumps(a)) == a
    assert a == Assignment(
        generation=0,
        epoch=1,
        iteration=2,
        step=3,
        rank=0,
        world_size=1,
        batch_start=0,
        batch_stop=32,
    )
    with pytest.raises(ValueError, match=r"rank \(2\) must be in \[0, world_size \(1\)\)"):
        Assignment(0, 1, 2, 3, 2, 1, 0, 32)
    assert Contribution([None], 0, 0.0, []).n_samples == 0
    assert SyncResult([], [], 4).loss is None and not SyncResult([], [], 4).in_place
    record = IterationRecord(1, 0, 1, 0, 0, 1, 32, 32, 0.5, 0.5, None)
    assert record.metrics == {} and record.metrics is not IterationRecord(*[0] * 11).metrics
    assert record.best_loss == 0.5


def test_classes_it_cannot_speed_up_are_refused() -> None:
    @dataclass
    class Mutable:
        x: int

    @dataclass(frozen=True, slots=True)
    class Slotted:
        x: int

    @dataclass(frozen=True, kw_only=True)
    class KeywordOnly:
        x: int

    for cls in (Mutable, Slotted, KeywordOnly, int):
        with pytest.raises(TypeError):
            fast_frozen_init(cls)
