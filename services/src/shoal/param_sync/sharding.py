"""Which shard holds which of a job's tensors: whole tensors, balanced by bytes.

Greedy largest-first (LPT scheduling): tensors in decreasing size, each onto the shard with the
fewest bytes so far (the lowest index on a tie). LPT is within 4/3 of the optimal makespan, and
with the many small and few large tensors of real models it is near-perfect once the largest
tensor is smaller than a shard's share. The assignment is a pure function of the layout and the
number of shards, so a resumed job recomputes the same one.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.contract.wire import TensorMeta

__all__ = ["Sharding", "assign_shards"]


@dataclass(frozen=True)
class Sharding:
    """``tensors[i]``: the names shard ``i`` holds, in layout order; ``loads[i]``: its bytes."""

    tensors: tuple[tuple[str, ...], ...]
    loads: tuple[int, ...]

    @property
    def num_shards(self) -> int:
        return len(self.tensors)

    @property
    def active_shards(self) -> int:
        """Shards that hold at least one tensor (the ones that take part in iterations)."""
        return sum(1 for names in self.tensors if names)

    def shard_of(self) -> dict[str, int]:
        return {name: i for i, names in enumerate(self.tensors) for name in names}

    @property
    def imbalance(self) -> float:
        """Largest load over the mean load (1.0 is perfect)."""
        total = sum(self.loads)
        if not total:
            return 1.0
        return max(self.loads) / (total / len(self.loads))


def assign_shards(layout: Sequence[TensorMeta], num_shards: int) -> Sharding:
    """Assign each tensor of ``layout`` to one of ``num_shards`` shards (see module doc)."""
    if num_shards < 1:
        raise ValueError(f"num_shards ({num_shards}) must be >= 1")
    order = sorted(range(len(layout)), key=lambda j: (-layout[j].nbytes, j))
    heap = [(0, i) for i in range(num_shards)]
    owner: dict[int, int] = {}
    loads = [0] * num_shards
    for j in order:
        load, i = heapq.heappop(heap)
        owner[j] = i
        loads[i] = load + layout[j].nbytes
        heapq.heappush(heap, (loads[i], i))
    tensors = tuple(
        tuple(layout[j].name for j in range(len(layout)) if owner[j] == i)
        for i in range(num_shards)
    )
    return Sharding(tensors, tuple(loads))
