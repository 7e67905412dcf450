"""Parallel fetching of a share's samples, for datasets whose ``__getitem__`` is slow (decoding,
augmentation, reading files): what a DataLoader's workers do, without changing which samples
an iteration sees.

The trainer still decides every iteration's indices (the epoch's order and the learner's
share, exactly as without workers). :class:`BatchFetcher` only splits each micro-batch's
indices into ``num_workers`` contiguous pieces, has worker processes fetch and collate them
(``fetch_batch``), and concatenates the pieces in order: the result equals
``fetch_batch(dataset, indices)``. All micro-batches of a share are requested at once, so the
workers prefetch the next micro-batches while the model computes on the current one.

Workers are forked once per ``train()``, before the sync backend opens any connection, and
each runs torch with one thread.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

__all__ = ["BatchFetcher"]

_dataset: Any = None


def _init(dataset: Any) -> None:
    global _dataset
    _dataset = dataset
    torch.set_num_threads(1)


def _fetch(indices: torch.Tensor) -> Any:
    from shoal.learner.trainer import fetch_batch

    return fetch_batch(_dataset, indices)


def _concat(parts: Sequence[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    raise ValueError(f"a collated batch of {type(first).__name__} cannot be concatenated")


class BatchFetcher:
    """``num_workers`` forked processes fetching pieces of micro-batches of ``dataset``."""

    def __init__(self, dataset: Dataset[Any], num_workers: int) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers ({num_workers!r}) must be an int >= 1")
        self.num_workers = num_workers
        ctx = multiprocessing.get_context("fork")
        self._pool = ctx.Pool(num_workers, initializer=_init, initargs=(dataset,))

    def batches(self, chunks: Sequence[torch.Tensor]) -> Iterator[Any]:
        """The collated batch of each of ``chunks`` (index tensors), in order; every piece of
        every chunk is requested at once."""
        pending = []
        for chunk in chunks:
            pieces = [p for p in torch.tensor_split(chunk, self.num_workers) if p.numel()]
            pending.append([self._pool.apply_async(_fetch, (p,)) for p in pieces])
        for results in pending:
            yield _concat([r.get() for r in results])

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
