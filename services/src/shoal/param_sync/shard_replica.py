# mypy: disable-error-code="misc"
# (the methods annotate self as ShardJob, the class they are part of)
"""A slice's replication (part of :class:`~shoal.param_sync.shard.ShardJob`): the running
iteration's sums as the primary sends them to its backup, and the backup's replica taking
them, applying them at the commit (or deferring them until a snapshot of the primary's state
makes them unneeded), or settling to the coordinator's count."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shoal.runtime.errors import FailedPrecondition, InvalidField

if TYPE_CHECKING:
    from shoal.param_sync.shard import ShardJob


@dataclass
class _Pending:
    generation: int
    iteration: int
    contributed: set[str] = field(default_factory=set)
    total_samples: int = 0
    loss_sum: float = 0.0
    learning_rate: float = 0.0
    got_grad: list[bool] = field(default_factory=list)
    buffer_weight: list[float] = field(default_factory=list)


@dataclass
class Deferred:
    """A committed iteration's sums a replica keeps instead of stepping them (its
    accumulators, as taken, and the global norm the iteration was committed with)."""

    pending: _Pending
    acc: list[torch.Tensor]
    acc_np: list[np.ndarray]
    grad_norm: float


class ReplicaSums:
    """Part of :class:`~shoal.param_sync.shard.ShardJob` (see there)."""

    # -- replication --------------------------------------------------------------------------

    def pending_frames(
        self: ShardJob, generation: int, iteration: int
    ) -> tuple[bytes, list[np.ndarray]]:
        """The running iteration's sums, exactly as accumulated (before the commit divides
        them), for the backup: it keeps them and applies the very same :meth:`commit`, so its
        replica stays bit-identical. Returned as a safetensors blob in two parts, without a
        copy of the tensors: the header (its 8-byte length and JSON, with the sums' metadata)
        and uint8 views of the accumulators, in order, that follow it. The views read the
        accumulators as they are when sent; they stay unchanged until this iteration is
        committed or aborted (an aborted iteration's sums are never applied by the backup)."""
        pending = self.pending
        if pending is None or (pending.generation, pending.iteration) != (generation, iteration):
            raise FailedPrecondition(
                f"shard {self.shard_index} of job {self.job_id!r} holds no sums for "
                f"iteration {iteration} of generation {generation}"
            )
        entries: dict[str, Any] = {
            "__metadata__": {
                "generation": str(generation),
                "iteration": str(iteration),
                "total_samples": str(pending.total_samples),
                "loss_sum": repr(pending.loss_sum),
                "learning_rate": repr(pending.learning_rate),
                "got_grad": json.dumps(pending.got_grad),
                "buffer_weight": json.dumps(pending.buffer_weight),
                # The global norm the previous iteration was committed with: a replica that
                # still holds that iteration's sums commits them with it.
                "previous_grad_norm": repr(self.last_grad_norm),
            }
        }
        views: list[np.ndarray] = []
        offset = 0
        for j, m in enumerate(self.metas):
            if not (pending.got_grad[j] or pending.buffer_weight[j] > 0):
                continue
            acc = self.acc[j]
            view = self._acc_np[j].view(np.uint8)
            entries[f"acc/{m.name}"] = {
                "dtype": _st_dtype(acc.dtype),
                "shape": [acc.numel()],
                "data_offsets": [offset, offset + view.nbytes],
            }
            offset += view.nbytes
            views.append(view)
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # safetensors aligns the data to 8 bytes
        return len(header).to_bytes(8, "little") + header, views

    def pending_bytes(self: ShardJob, generation: int, iteration: int) -> bytes:
        """:meth:`pending_frames` joined into one safetensors blob."""
        header, views = self.pending_frames(generation, iteration)
        return b"".join([header, *views])

    def apply_replicated(self: ShardJob, generation: int, iteration: int, grad_norm: float) -> bool:
        """A replica's sums of (generation, iteration) committed now: the coordinator
        committed that iteration job-wide (this shard's own slice was just committed with the
        same ``grad_norm``), so the replica steps at once (or defers the step: :meth:`_committed`)
        instead of when the next sums come, off the next iteration's critical path. Returns
        whether it applied them."""
        pending = self.pending
        if (
            pending is None
            or (pending.generation, pending.iteration) != (generation, iteration)
            or not self.initialized
            or self.completed != iteration
        ):
            return False
        self._committed(pending, grad_norm)
        return True

    def settle(self: ShardJob, completed: int, grad_norm: float = 0.0) -> None:
        """A replica brought to ``completed`` iterations, ready to be used (its deferred sums
        stepped): sums it keeps of iteration ``completed - 1`` were committed (the coordinator
        says so) with the global ``grad_norm``, so they are applied now with it; any others
        were aborted, so they are dropped."""
        self._settle_pending(completed, grad_norm)
        self.flush()

    def _settle_pending(self: ShardJob, completed: int, grad_norm: float) -> None:
        pending = self.pending
        if pending is not None:
            if pending.iteration == completed - 1 == self.completed:
                self._committed(pending, grad_norm)
            else:
                self.pending = None

    # -- deferred steps -----------------------------------------------------------------------
    #
    # A replica whose primary sends snapshots of its state (``defer_limit`` > 0, set by the
    # backup for sums taken from a primary on its host) does not step each committed
    # iteration's sums: it keeps them (``deferred``, oldest first) and counts the iteration
    # as completed; a snapshot of the primary's state at iteration s replaces the replica's
    # state and drops the kept sums of iterations before s (they are in it). Anything that
    # uses the replica's state steps what is kept first (:meth:`flush`: settle, state_parts),
    # so it is the same state, bit for bit, as stepping each at its commit; and when more
    # than ``defer_limit`` are kept (the snapshots stopped coming), the oldest is stepped.

    def _committed(self: ShardJob, pending: _Pending, grad_norm: float) -> None:
        """``pending`` (of iteration ``completed``) was committed job-wide with
        ``grad_norm``: step it, or keep it for later."""
        if self.defer_limit <= 0:
            self.flush()
            self.commit(pending.generation, pending.iteration, grad_norm)
            return
        self.deferred.append(Deferred(pending, self.acc, self._acc_np, grad_norm))
        self.pending = None
        self.completed = pending.iteration + 1
        self.last_grad_norm = grad_norm
        self.last_generation = pending.generation
        if self.spare_acc:
            self.acc, self._acc_np = self.spare_acc.pop()
        else:
            self.acc = [torch.empty_like(a) for a in self.acc]
            self._acc_np = [a.numpy() for a in self.acc]
        while len(self.deferred) > self.defer_limit:
            self._step_deferred()

    def _step_deferred(self: ShardJob) -> None:
        """Step the oldest deferred sums, on the state the ones before left."""
        entry = self.deferred.pop(0)
        kept = (self.pending, self.acc, self._acc_np, self.completed)
        latest = (self.encoded, self.last_grad_norm, self.last_generation)
        self.pending, self.acc, self._acc_np = entry.pending, entry.acc, entry.acc_np
        self.completed = entry.pending.iteration
        try:
            self.commit(entry.pending.generation, entry.pending.iteration, entry.grad_norm)
        finally:
            self.pending, self.acc, self._acc_np, self.completed = kept
            self.encoded, self.last_grad_norm, self.last_generation = latest
            self.spare_acc.append((entry.acc, entry.acc_np))

    def flush(self: ShardJob) -> None:
        """Step every deferred sum, oldest first: the state is then that of ``completed``."""
        while self.deferred:
            self._step_deferred()

    def drop_deferred(self: ShardJob) -> None:
        """Forget the deferred sums (the state was replaced: a load, a snapshot)."""
        self.spare_acc += [(entry.acc, entry.acc_np) for entry in self.deferred]
        self.deferred = []
        del self.spare_acc[self.defer_limit :]

    # -- snapshots ----------------------------------------------------------------------------

    def state_frames(self: ShardJob, global_iteration: int) -> tuple[bytes, list[np.ndarray]]:
        """The slice's state (:meth:`state_bytes`'s tensors and metadata, plus the
        generation of the last commit) as a safetensors blob in parts, without a copy: the
        header and uint8 views of the tensors, larger items first (each tensor aligned). The
        views read the state as it is when written: write them before the next commit."""
        tensors, metadata = self.state_parts(global_iteration)
        metadata = {**metadata, "generation": str(self.last_generation)}
        entries: dict[str, Any] = {"__metadata__": metadata}
        views: list[np.ndarray] = []
        offset = 0
        ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
        for name, t in ordered:
            view = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            entries[name] = {
                "dtype": _st_dtype(t.dtype),
                "shape": list(t.shape),
                "data_offsets": [offset, offset + view.nbytes],
            }
            offset += view.nbytes
            views.append(view)
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        return len(header).to_bytes(8, "little") + header, views

    def take_snapshot(
        self: ShardJob,
        data: bytes | bytearray | memoryview,
        still_there: Callable[[], bool] | None = None,
    ) -> bool:
        """Take a primary's :meth:`state_frames` blob (of its state at iteration s) as this
        replica's state: the deferred sums of iterations before s are dropped (they are in
        it), later ones and the running iteration's sums kept. Taken only when s is one the
        replica counts as completed and has not stepped (or the one after, when it holds that
        iteration's sums of the same generation: the primary committed them); anything else
        (older, or a snapshot from before a rewind) is ignored. Returns whether it was
        taken. ``still_there`` as for :meth:`keep_pending`: asked after the copy."""
        raw = memoryview(data).cast("B")
        try:
            loaded, meta = _read_tensors(raw)
            iteration, generation = int(meta["global_iteration"]), int(meta["generation"])
            groups = json.loads(meta.get("param_groups", "[]"))
            plain = json.loads(meta.get("optimizer_plain_state", "{}"))
        except Exception as exc:
            raise InvalidField("chunk", f"{len(raw)} bytes", f"is not a slice: {exc}") from None
        if still_there is not None and not still_there():
            raise FailedPrecondition(
                f"replica of shard {self.shard_index} of job {self.job_id!r}: the snapshot of "
                f"iteration {iteration} was rewritten in the primary's segment as it was taken"
            )
        pending = self.pending
        applied = self.completed - len(self.deferred)
        holds_next = (
            pending is not None
            and pending.iteration == self.completed == iteration - 1
            and pending.generation == generation
        )
        if not self.initialized or not (applied < iteration <= self.completed or holds_next):
            return False
        self.check_loaded(loaded, "the primary's snapshot")  # before anything changes
        kept = [entry for entry in self.deferred if entry.pending.iteration >= iteration]
        self.deferred = [entry for entry in self.deferred if entry.pending.iteration < iteration]
        self._restore(loaded, groups, plain, iteration, "the primary's snapshot")
        self.deferred = kept
        self.completed = iteration + len(kept)
        if pending is not None and pending.iteration >= iteration:
            self.pending = pending
        if not kept:
            self.last_generation = generation
        self.snapshots_taken += 1
        return True

    def keep_pending(
        self: ShardJob,
        data: bytes | bytearray | memoryview,
        still_there: Callable[[], bool] | None = None,
        defer_limit: int | None = None,
    ) -> int:
        """Take a primary's :meth:`pending_bytes` as this replica's sums (``defer_limit``:
        how many committed ones it may keep unstepped from now on). Returns the
        iteration. The replica's previous sums, if it still holds them (they are normally
        applied at the commit by :meth:`apply_replicated`), are applied first when these are
        of the next iteration (the primary sends those only after it committed the previous
        one), and replaced when of the same iteration (that one was aborted and is run
        again). ``still_there``: ``data`` lies in memory the primary may write (its
        segment's slot), so it is asked after the copy whether the bytes were still those
        sent; if not, the replica keeps no sums and :class:`FailedPrecondition` says so."""
        raw = memoryview(data).cast("B")
        try:
            size = int.from_bytes(raw[:8], "little")
            entries = json.loads(bytes(raw[8 : 8 + size]))
            meta = dict(entries.pop("__metadata__"))
            generation, iteration = int(meta["generation"]), int(meta["iteration"])
            got_grad = [bool(x) for x in json.loads(meta["got_grad"])]
            weights = [float(x) for x in json.loads(meta["buffer_weight"])]
            total = int(meta["total_samples"])
            loss_sum, lr = float(meta["loss_sum"]), float(meta["learning_rate"])
            previous_norm = float(meta.get("previous_grad_norm", "0.0"))
            spans = {
                name: (entry["dtype"], int(entry["data_offsets"][0]), int(entry["data_offsets"][1]))
                for name, entry in entries.items()
            }
        except Exception as exc:
            raise InvalidField("chunk", f"{len(raw)} bytes", f"is not a sum: {exc}") from None
        if len(got_grad) != len(self.metas) or len(weights) != len(self.metas):
            raise InvalidField("chunk", len(got_grad), f"must list {len(self.metas)} tensors")
        base = 8 + size
        targets = []
        for name, (dtype, begin, stop) in spans.items():
            j = self.index.get(name.removeprefix("acc/"))
            if (
                j is None
                or dtype != _st_dtype(self.acc[j].dtype)
                or not 0 <= begin <= stop
                or stop - begin != self._acc_np[j].nbytes
                or base + stop > len(raw)
            ):
                raise InvalidField("chunk", name, "does not match the slice")
            targets.append((j, base + begin, base + stop))
        if defer_limit is not None:
            self.defer_limit = defer_limit
        if self.initialized and self.pending is not None:
            self._settle_pending(iteration, previous_norm)
        if not self.initialized or iteration != self.completed:
            raise FailedPrecondition(
                f"replica of shard {self.shard_index} of job {self.job_id!r} is at iteration "
                f"{self.completed}, not {iteration}"
            )
        for j, begin, stop in targets:
            self._acc_np[j].view(np.uint8)[:] = np.frombuffer(raw[begin:stop], dtype=np.uint8)
        if still_there is not None and not still_there():
            self.pending = None  # the previous sums were applied above; these are lost
            raise FailedPrecondition(
                f"replica of shard {self.shard_index} of job {self.job_id!r}: the sums of "
                f"iteration {iteration} were rewritten in the primary's segment as they were taken"
            )
        self.min_generation = max(self.min_generation, generation)
        self.pending = _Pending(
            generation,
            iteration,
            total_samples=total,
            loss_sum=loss_sum,
            learning_rate=lr,
            got_grad=got_grad,
            buffer_weight=weights,
        )
        return iteration


#: safetensors' dtype names of the accumulators' dtypes.
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}


_TORCH_DTYPES = {name: dtype for dtype, name in _ST_DTYPES.items()}


def _st_dtype(dtype: torch.dtype) -> str:
    return _ST_DTYPES.get(dtype) or str(dtype)


def _read_tensors(raw: memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a safetensors blob, copied out of ``raw``, and its metadata."""
    size = int.from_bytes(raw[:8], "little")
    entries = json.loads(bytes(raw[8 : 8 + size]))
    meta = dict(entries.pop("__metadata__", {}))
    base = 8 + size
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        dtype = _TORCH_DTYPES[entry["dtype"]]
        shape = [int(n) for n in entry["shape"]]
        begin, stop = (int(n) for n in entry["data_offsets"])
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= stop or stop - begin != nbytes or base + stop > len(raw):
            raise ValueError(f"{name} lies outside the blob or has another size")
        copy = np.frombuffer(raw, dtype=np.uint8, count=nbytes, offset=base + begin).copy()
        tensors[name] = torch.from_numpy(copy).view(dtype).view(shape)
    return tensors, meta
