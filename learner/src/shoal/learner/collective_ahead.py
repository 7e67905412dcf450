"""Collective mode: the update applied ahead of its commit, and taken back when the
coordinator does not commit it (docs/data-plane.md, "The vote ahead").

A collective learner votes for iteration ``k`` once its all-reduce succeeded, and the
coordinator commits ``k`` once every member voted. Waiting for that answer before applying
``k``'s update puts a round trip to the coordinator between every two iterations. With the
vote ahead, the learner sends its vote, applies the update at once, and runs the next
iteration's forward and backward while the answer travels; it reads the answer before the
next all-reduce. When the answer does not commit ``k`` (a member's collective failed), the
learner takes the update back from a :class:`StateCopy` made just before it, so the state is
bitwise what it was: the coordinator's protocol, and what a learner tells a successor
coordinator (``CollectiveLearnerState``), are those of the update kept pending.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["AHEAD_MAX_BYTES", "StateCopy", "state_bytes"]

#: The largest state (parameters, buffers, the optimizer's state) copied every iteration to
#: apply an update ahead, by device type: a copy on the host costs about what the vote's
#: round trip saves at a few MiB (~10 GB/s), one on a GPU's memory ~100 times less. A larger
#: state votes the usual way (its update applied once the answer came).
AHEAD_MAX_BYTES = {"cpu": 4 << 20, "cuda": 1 << 30}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v
        for group in optimizer.param_groups
        for p in group["params"]
        for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    ]


def state_bytes(
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> int:
    """Bytes of the state a :class:`StateCopy` copies."""
    return sum(
        t.numel() * t.element_size() for t in (*params, *buffers, *_optimizer_tensors(optimizer))
    )


class StateCopy:
    """The learner's state before an update applied ahead: its parameters' and buffers'
    values, the optimizer's per-parameter state (tensors copied, other values kept, keys not
    there yet remembered as absent) and its parameter groups' settings (the learning rate the
    update set). :meth:`take` copies into tensors kept from the last time when the shapes
    match, so a steady run allocates nothing; :meth:`restore` puts it all back."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self._live = [*params, *buffers]
        self._optimizer = optimizer
        self._saved: list[torch.Tensor] = []
        # (param, its state's entries: a tensor one as (the tensor, its copy))
        self._state: list[tuple[Any, dict[str, Any]]] = []
        self._groups: list[dict[str, Any]] = []
        self._sources: list[torch.Tensor] = []  # the tensors _saved was made for

    def _copies_fit(self, live: list[torch.Tensor]) -> bool:
        """Whether the copies kept fit ``live``: the same tensors as last time (a steady run:
        an identity test each, ~30 ns, where comparing shapes, dtypes and devices costs ~1 us a
        tensor), else ones of the same shapes, dtypes and devices (an optimizer that replaces
        its state's tensors instead of updating them in place)."""
        if len(self._sources) != len(live):
            return False
        return all(a is b for a, b in zip(self._sources, live, strict=True)) or all(
            s.shape == t.shape and s.dtype == t.dtype and s.device == t.device
            for s, t in zip(self._saved, live, strict=True)
        )

    def take(self) -> None:
        optimizer = self._optimizer
        state_tensors: list[torch.Tensor] = []
        self._state = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                entries = dict(optimizer.state.get(p, {}))
                self._state.append((p, entries))
                state_tensors += [v for v in entries.values() if isinstance(v, torch.Tensor)]
        live = self._live + state_tensors
        if not self._copies_fit(live):
            self._saved = [torch.empty_like(t) for t in live]
        self._sources = live
        with torch.no_grad():
            if live:
                torch._foreach_copy_(self._saved, live)
        # The state's entries now name the copies (restore puts their values back).
        saved = iter(self._saved[len(self._live) :])
        for _, entries in self._state:
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    entries[key] = (value, next(saved))
        self._groups = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]

    def restore(self) -> None:
        optimizer = self._optimizer
        with torch.no_grad():
            if self._live:
                torch._foreach_copy_(self._live, self._saved[: len(self._live)])
            for p, entries in self._state:
                live = optimizer.state.get(p)
                if not entries:
                    optimizer.state.pop(p, None)
                    continue
                if live is None:
                    live = optimizer.state[p] = {}
                for key in [k for k in live if k not in entries]:
                    del live[key]
                for key, value in entries.items():
                    if isinstance(value, tuple):
                        original, copy = value
                        original.copy_(copy)
                        live[key] = original
                    else:
                        live[key] = value
        for group, settings in zip(optimizer.param_groups, self._groups, strict=True):
            group.update(settings)
