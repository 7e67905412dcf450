"""The exact, pure data partitioning of shoal's iteration protocol (DESIGN.md).

Everything here is a pure function of integers, so that the coordinator, every learner and the
tests compute the same answer without talking to each other:

* epoch ``e`` visits the training set in the order
  ``torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))``;
* iteration ``i`` of the epoch takes the positions ``[i*B, min((i+1)*B, N))`` of that order
  (``b`` samples; only the last batch of an epoch may be short);
* the learner of rank ``r`` in a world of ``W`` takes the positions
  ``[i*B + r*b//W, i*B + (r+1)*b//W)``.

The ranks' ranges tile the batch whatever ``W`` is, so the world may change between any two
iterations without a sample being skipped or repeated. When ``b < W`` some ranks get an empty
share; they still take part in the iteration with a weight of zero.

A learner whose share is larger than what its device holds splits it with
:func:`micro_batches` and accumulates the gradients (see ``trainer.py``).
"""

from __future__ import annotations

import torch

from shoal.contract.batch_schedule import check_int as _check_int

__all__ = [
    "batch_range",
    "epoch_order",
    "iterations_per_epoch",
    "learner_indices",
    "micro_batches",
    "shard_range",
]

# torch.Generator.manual_seed accepts seeds in [-2**63, 2**64); shoal keeps seeds non-negative so
# that ``seed + epoch`` is the same number in every language the protocol is implemented in.
_MAX_SEED = 2**63 - 1


def iterations_per_epoch(num_samples: int, batch_size: int) -> int:
    """Number of iterations of one epoch: ``ceil(num_samples / batch_size)``."""
    _check_int("num_samples", num_samples, 1)
    _check_int("batch_size", batch_size, 1)
    return -(-num_samples // batch_size)


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order (an int64 permutation of ``range(num_samples)``) in which epoch ``epoch``
    visits the training set: ``torch.randperm`` seeded with ``seed + epoch``."""
    _check_int("num_samples", num_samples, 1)
    _check_int("seed", seed, 0)
    _check_int("epoch", epoch, 0)
    if seed + epoch > _MAX_SEED:
        raise ValueError(f"seed + epoch ({seed + epoch}) must be <= {_MAX_SEED}")
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)


def batch_range(iteration: int, batch_size: int, num_samples: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of the epoch order that iteration ``iteration`` processes."""
    n_iter = iterations_per_epoch(num_samples, batch_size)
    _check_int("iteration", iteration, 0)
    if iteration >= n_iter:
        raise ValueError(
            f"iteration ({iteration}) must be < iterations_per_epoch ({n_iter}) "
            f"for num_samples={num_samples}, batch_size={batch_size}"
        )
    start = iteration * batch_size
    return start, min(start + batch_size, num_samples)


def shard_range(
    iteration: int, batch_size: int, num_samples: int, rank: int, world_size: int
) -> tuple[int, int]:
    """Positions ``[start, stop)`` of the epoch order that rank ``rank`` of ``world_size``
    processes in iteration ``iteration``: ``[i*B + r*b//W, i*B + (r+1)*b//W)``."""
    start, stop = batch_range(iteration, batch_size, num_samples)
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank ({rank}) must be < world_size ({world_size})")
    b = stop - start
    return start + rank * b // world_size, start + (rank + 1) * b // world_size


def learner_indices(
    num_samples: int,
    batch_size: int,
    seed: int,
    epoch: int,
    iteration: int,
    rank: int,
    world_size: int,
    *,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dataset indices (int64) of the share of rank ``rank`` of ``world_size`` in iteration
    ``iteration`` of epoch ``epoch``.

    ``order`` may pass the epoch's :func:`epoch_order` when the caller already has it (it is
    O(N) to compute); it is then trusted to be that order.
    """
    start, stop = shard_range(iteration, batch_size, num_samples, rank, world_size)
    if order is None:
        order = epoch_order(num_samples, seed, epoch)
    elif order.shape != (num_samples,):
        raise ValueError(f"order (shape {tuple(order.shape)}) must have shape ({num_samples},)")
    return order[start:stop]


def micro_batches(indices: torch.Tensor, max_per_device: int | None) -> list[torch.Tensor]:
    """Split a learner's share into the fewest micro-batches of at most ``max_per_device``
    samples, balanced in size (sizes differ by at most one), in order.

    ``max_per_device=None`` means no limit (one micro-batch). An empty share gives no
    micro-batch. The concatenation of the result is ``indices``.
    """
    if indices.dim() != 1:
        raise ValueError(f"indices (shape {tuple(indices.shape)}) must be one-dimensional")
    n = indices.numel()
    if max_per_device is None:
        return [indices] if n else []
    _check_int("max_per_device", max_per_device, 1)
    if n == 0:
        return []
    count = -(-n // max_per_device)
    return list(torch.tensor_split(indices, count))
