"""Parameter-server mode: the next iteration's forward starts on the parameters already
received (docs/data-plane.md, "Overlap in parameter-server mode", early forward).

With ``SHOAL_PS_EARLY_FORWARD=on`` :meth:`GrpcBackend.sync
<shoal.learner.grpc_backend.GrpcBackend.sync>` returns once every shard's answer **header**
arrived (the iteration is committed: its loss, norm and skip decision are known, nothing can
abort it any more). The rest of each answer keeps arriving on the backend's asyncio thread into
the receive tensors; :class:`ArrivingTensors` says, per tensor, when its bytes are complete.

:class:`EarlyForward` is the trainer's half. Just before the next forward it copies every
complete tensor into the model and registers a forward pre-hook on each module that directly
owns a tensor still pending (a tied parameter owned by several modules gets a hook on each):
the hook waits for that module's tensors and copies them in, on the trainer's thread. After
the **first** micro-batch's forward, :meth:`EarlyForward.check` settles (waits for the whole
answer and loads the rest), so the overlap window is that forward, and backward (and the
gradient streams of ``ps_overlap.py``, armed later) always runs on the complete state. Anything
else that reads the model settles first (the trainer: callbacks, evaluation, a retire, a pull,
the next sync, the end of training).

**The equivalence guard.** A parameter that was pending when forward started, was not loaded
by a hook, and yet is in the first micro-batch's autograd graph was read without its module's
hook (e.g. ``x @ other.weight`` where ``other`` is never called): it was read stale. The check
finds it by walking the loss's graph to its leaves (before any backward). And every
floating-point tensor pending when forward starts is NaN until its hook loads it: a read that
bypasses the hooks without a gradient (a buffer, a read under ``no_grad``, a parameter read
before its own module ran) makes the loss NaN; such a loss is computed again on the complete
model, and if it is finite then, a read bypassed the hooks. Either way the check reloads the
whole answer into the model (parameters and the buffers that forward updated), turns early
forward off for the rest of the run with one warning, and the trainer runs that micro-batch's
forward again. Not caught: a read that bypasses the hooks and whose value does not reach the
loss as a number (a comparison, an index, masked away): that is why the switch is opt-in.

**Failure.** A shard's answer failing after ``sync`` returned (the shard died while answering)
makes the waiting hook or settle raise :class:`~shoal.learner.backend.IterationAborted`; the
trainer abandons the iteration it started and pulls the parameters at its next assignment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from shoal.contract import environment
from shoal.learner.backend import IterationAborted
from shoal.learner.env import switch
from shoal.learner.steps import ModelTensors

__all__ = ["ArrivingTensors", "EarlyForward", "early_forward_enabled"]

log = logging.getLogger("shoal.learner.early_forward")


def early_forward_enabled() -> bool:
    """``SHOAL_PS_EARLY_FORWARD``: ``on`` or ``off`` (the default)."""
    return switch(environment.PS_EARLY_FORWARD, "off")


class ArrivingTensors:
    """Which tensors (job layout indices) of the answers still arriving after ``sync``
    returned are complete in the backend's receive tensors. Written by the backend's asyncio
    thread (and the lane's reading thread), waited on by the trainer's."""

    def __init__(self, count: int) -> None:
        self._cond = threading.Condition()
        self._done = [False] * count
        self._error: IterationAborted | None = None
        self._ended = False
        #: Set when the trainer first waits for a tensor (the test faults' hold ends there).
        self.waited = threading.Event()
        self._heads: dict[int, asyncio.Future[Any]] = {}  # the backend's loop thread only
        self.step = -1  # the global iteration answered
        #: The backend's counters (``GrpcBackend.early_tensors``): not complete when sync
        #: returned, pending when the next forward started, loaded by a module's hook.
        self.stats = [0, 0, 0]

    def head(self, key: int) -> asyncio.Future[Any]:
        """The future of shard ``key``'s answer header (made on first use, on the loop)."""
        future = self._heads.get(key)
        if future is None:
            future = self._heads[key] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_retrieve)
        return future

    def done(self, indices: Iterable[int]) -> None:
        with self._cond:
            for j in indices:
                self._done[j] = True
            self._cond.notify_all()

    def fail(self, error: IterationAborted) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def end(self) -> None:
        """Every answer ended: nothing writes into the receive tensors any more."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def is_done(self, j: int) -> bool:
        return self._done[j]

    @property
    def ended(self) -> bool:
        return self._ended

    def wait(self, indices: Sequence[int]) -> None:
        """Until every tensor of ``indices`` is complete; IterationAborted when an answer
        failed (or ended without them)."""
        self.waited.set()
        with self._cond:
            while True:
                if self._error is not None:
                    raise IterationAborted(str(self._error))
                if all(self._done[j] for j in indices):
                    return
                if self._ended:
                    raise IterationAborted("a shard's answer ended without every tensor")
                self._cond.wait()

    def wait_ended(self) -> IterationAborted | None:
        """Until every answer ended; the failure, if one failed."""
        self.waited.set()
        with self._cond:
            while not self._ended:
                self._cond.wait()
            if self._error is None and not all(self._done):
                return IterationAborted("a shard's answer ended without every tensor")
            return self._error


class EarlyForward:
    """The trainer's half (see the module docstring): ``model`` and its ``tensors`` (the
    layout's order: parameters, then persistent buffers), ``names`` of the parameters."""

    def __init__(self, model: nn.Module, tensors: ModelTensors, names: Sequence[str]) -> None:
        self.enabled = True
        self._targets = [*tensors.params, *tensors.buffers]
        self._n_params = len(tensors.params)
        self._names = list(names)
        index = {id(t): j for j, t in enumerate(self._targets)}
        self._owned: dict[nn.Module, list[int]] = {}
        self._owners: dict[int, list[nn.Module]] = {}
        for module in model.modules():
            mine: list[int] = []
            direct = (*module._parameters.values(), *module._buffers.values())
            for t in direct:
                j = index.get(id(t)) if t is not None else None
                if j is not None and j not in mine:
                    mine.append(j)
                    self._owners.setdefault(j, []).append(module)
            if mine:
                self._owned[module] = mine
        self._arriving: ArrivingTensors | None = None
        self._sources: list[torch.Tensor] = []
        self._snapshot: list[torch.Tensor] = []
        self._pending: set[int] = set()
        self._at_start: set[int] = set()
        self._by_hook: set[int] = set()
        self._handles: list[Any] = []
        self._poisoned_loss = False  # the first forward's loss was not finite: run again

    @property
    def unsettled(self) -> bool:
        """Whether an answer is still being loaded (the model is not whole yet)."""
        return self._arriving is not None

    def begin(
        self,
        arriving: ArrivingTensors,
        sources: Sequence[torch.Tensor],
        snapshot: Sequence[torch.Tensor],
    ) -> None:
        """A sync returned with its answers still arriving into ``sources`` (the receive
        tensors, layout order); ``snapshot`` gets the buffers once they are complete."""
        self._arriving = arriving
        self._sources = list(sources)
        self._snapshot = list(snapshot)
        self._pending = set(range(len(self._sources)))
        self._by_hook = set()
        self._load_complete()

    def before_forward(self) -> None:
        """Just before the first forward: load what is complete, hook the rest."""
        if self._arriving is None:
            return
        if not self.enabled:
            self.settle()
            return
        self._load_complete()
        if not self._pending:
            self.settle()
            return
        self._at_start = set(self._pending)
        self._arriving.stats[1] += len(self._at_start)
        # Poisoned until loaded: a read that bypasses the hooks makes the loss NaN (check()).
        with torch.no_grad():
            for j in self._pending:
                if self._targets[j].is_floating_point():
                    self._targets[j].fill_(math.nan)
        modules: dict[int, nn.Module] = {}
        for j in self._pending:
            for module in self._owners.get(j, ()):
                modules[id(module)] = module
        self._handles = [m.register_forward_pre_hook(self._hook) for m in modules.values()]

    def check(self, loss: torch.Tensor) -> bool:
        """After the first micro-batch's forward (before its backward): settle, and say
        whether a parameter pending at forward start was read without its module's hook (the
        whole answer is then reloaded, early forward is off for the rest of the run, and that
        forward must run again)."""
        if self._arriving is None:
            if self._poisoned_loss and _finite(loss):  # the forward run again (below)
                self._turn_off(
                    "a tensor still arriving was read outside its module's forward (the "
                    "first forward's loss was not finite with the pending tensors set to NaN, "
                    "and is finite on the complete model)"
                )
            self._poisoned_loss = False
            return False
        suspects = {j for j in self._at_start - self._by_hook if j < self._n_params}
        read: list[int] = []
        if suspects and loss.grad_fn is not None:
            leaves = graph_leaves(loss.grad_fn)
            read = sorted(j for j in suspects if id(self._targets[j]) in leaves)
        # Not finite: maybe a poisoned tensor was read; run the forward again on the whole
        # model and compare (compute_contribution calls check() again with that loss).
        self._poisoned_loss = not read and bool(self._at_start) and not _finite(loss)
        self.settle(reload=bool(read) or self._poisoned_loss)
        if read:
            self._turn_off(
                f"parameter(s) {', '.join(repr(self._names[j]) for j in read)} read in forward "
                "without its module's forward (pre-hook) running"
            )
        return bool(read) or self._poisoned_loss

    def _turn_off(self, why: str) -> None:
        self.enabled = False
        log.warning(
            "early forward turned off for the rest of the run: %s; this iteration's forward "
            "runs again on the complete parameters",
            why,
        )

    def settle(self, *, reload: bool = False) -> None:
        """Wait for the whole answer and load what is not loaded yet (everything with
        ``reload``); IterationAborted when an answer failed (the model is then not whole:
        the trainer pulls the parameters)."""
        arriving = self._arriving
        if arriving is None:
            return
        try:
            error = arriving.wait_ended()
            if error is not None:
                raise IterationAborted(str(error))
            self._copy(range(len(self._sources)) if reload else sorted(self._pending))
            with torch.no_grad():
                for dst, src in zip(self._snapshot, self._sources[self._n_params :], strict=True):
                    dst.copy_(src)
        finally:
            self._finish()

    def abandon(self, *, wait: bool = True) -> None:
        """Drop the answer being loaded (after a failure, before a pull): remove the hooks,
        after waiting (``wait``) until nothing writes into the receive tensors any more."""
        arriving = self._arriving
        if arriving is not None and wait:
            arriving.wait_ended()
        self._finish()

    # -- internals ----------------------------------------------------------------------------

    def _hook(self, module: nn.Module, args: Any) -> None:
        want = [j for j in self._owned.get(module, ()) if j in self._pending]
        if not want or self._arriving is None:
            return
        self._arriving.wait(want)
        self._copy(want)
        self._by_hook.update(want)
        self._arriving.stats[2] += len(want)

    def _load_complete(self) -> None:
        arriving = self._arriving
        assert arriving is not None
        self._copy([j for j in sorted(self._pending) if arriving.is_done(j)])

    @torch.no_grad()
    def _copy(self, indices: Iterable[int]) -> None:
        for j in indices:
            self._targets[j].copy_(self._sources[j])
            self._pending.discard(j)

    def _finish(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._arriving = None
        self._sources = []
        self._snapshot = []
        self._pending = set()
        self._at_start = set()


def _finite(loss: torch.Tensor) -> bool:
    return bool(torch.isfinite(loss.detach()).all())


def graph_leaves(root: Any) -> set[int]:
    """``id`` of every leaf tensor (a parameter) the autograd graph from ``root`` reaches."""
    seen: set[Any] = set()
    stack = [root]
    leaves: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(f for f, _ in fn.next_functions)
    return leaves


def _retrieve(future: asyncio.Future[Any]) -> None:
    with contextlib.suppress(asyncio.CancelledError, Exception):
        future.exception()
