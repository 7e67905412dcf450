"""One shard's slice of one job: the tensors it holds, the weighted gradient sums of the running
iteration, the optimizer, and its checkpoint file.

The shard's parameters and buffers live in one flat byte buffer (each tensor 64-byte aligned),
so the new parameters are sent straight from it, and are encoded once per iteration for all
learners. Gradients are summed into preallocated accumulators as ``sum_i n_i * g_i``; the commit
divides by the total sample count, sets ``p.grad`` and runs the optimizer. A contribution is
applied only once its whole stream has arrived and checked out, so a bad or broken stream
leaves the job's state as it was.

Everything here is synchronous and runs on the service's single compute thread, one call at a
time; ``service.py`` does the waiting and the networking.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shoal.contract.wire import (
    DEFAULT_CHUNK_BYTES,
    BundleError,
    BundleReceiver,
    BundleTooLarge,
    TensorMeta,
    byte_view,
    header_of,
    inline_of,
    pack_layout,
    validate_layout,
)
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.optimizer import (
    FOREACH_SAME,
    PER_PARAMETER_OPTIMIZERS,
    build_optimizer,
    warm_up,
)
from shoal.param_sync.shard_checkpoint import (
    ShardCheckpoints,
    model_from_shard_files,
    shard_file_name,
)
from shoal.param_sync.shard_encoding import Encoded
from shoal.param_sync.shard_replica import Deferred, ReplicaSums, _Pending
from shoal.runtime.errors import (
    FailedPrecondition,
    InvalidField,
    StaleGeneration,
    TooLarge,
)
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

__all__ = [
    "Contribution",
    "ShardJob",
    "build_optimizer",
    "model_from_shard_files",
    "shard_file_name",
    "warm_up",
]

ALIGN = 64
DEFAULT_STEP_GROUP_BYTES = 4 * 1024 * 1024


def groupable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may be stepped a group of parameters at a time: a per-parameter
    class (exactly, not a subclass) with no ``fused`` kernel asked for in any group, nor a
    ``foreach`` one unless the class is in :data:`FOREACH_SAME` (the others' are not ruled out
    to differ). Those of :data:`FOREACH_SAME`, the shard's default for them, step bit for bit
    as the single-tensor code (``tests/unit/test_shard_grouped_step.py``)."""
    kind = type(optimizer)
    return kind in PER_PARAMETER_OPTIMIZERS and not any(
        g.get("fused") or (g.get("foreach") and kind not in FOREACH_SAME)
        for g in optimizer.param_groups
    )


@dataclass
class Contribution:
    """A learner's checked gradient stream, not applied yet."""

    learner: str
    generation: int
    iteration: int
    num_samples: int
    loss_sum: float
    learning_rate: float
    metas: list[tuple[int, TensorMeta]]  # (local index, meta in the stream)
    total_bytes: int
    chunks: list[memoryview] = field(default_factory=list)
    # Local indices of declared tensors the stream's trailer marked as without a gradient:
    # their bytes are received but count as absent (as if the header had left them out).
    absent: frozenset[int] = frozenset()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype == torch.bool:
        return torch.uint8
    return dtype


class ShardJob(ReplicaSums, ShardCheckpoints):
    """Shard ``shard_index``'s part of job ``job_id``: ``tensors`` are the job-layout metas
    of the tensors it holds (in layout order)."""

    def __init__(
        self,
        job_id: str,
        shard_index: int,
        tensors: Sequence[TensorMeta],
        optimizer: OptimizerConfig,
        *,
        coordinator_address: str = "",
        active_shards: int = 1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        step_group_bytes: int = DEFAULT_STEP_GROUP_BYTES,
    ) -> None:
        try:
            validate_layout(
                sorted(tensors, key=lambda m: m.offset),
                max((m.end for m in tensors), default=0),
                what="tensors",
            )
        except BundleError as exc:
            raise InvalidField("tensors", len(tensors), str(exc)) from None
        self.job_id = job_id
        self.shard_index = shard_index
        self.job_metas = tuple(tensors)
        self.optimizer_config = optimizer
        self.coordinator_address = coordinator_address
        self.active_shards = active_shards
        self.chunk_bytes = chunk_bytes
        self.metas, self.total_bytes = pack_layout(self.job_metas, align=ALIGN)
        self.index = {m.name: j for j, m in enumerate(self.metas)}
        self.flat = torch.zeros(max(self.total_bytes, 1), dtype=torch.uint8)
        self.tensors = [self._view(m) for m in self.metas]
        # The tensors' bytes (views of ``flat``, which they never leave) and the header every
        # encoding of them starts from: made once, not at every commit.
        self._bytes = [byte_view(t) if t.numel() else np.empty(0, np.uint8) for t in self.tensors]
        self._header = header_of(
            job_id=job_id,
            sender_id=f"shard-{shard_index}",
            metas=self.metas,
            total_bytes=self.total_bytes,
        )
        self.param_indices = [j for j, m in enumerate(self.metas) if not m.buffer]
        self.params = [self.tensors[j] for j in self.param_indices]
        self.optimizer = build_optimizer(
            optimizer, self.params, [self.metas[j].name for j in self.param_indices]
        )
        # The optimizer's parameter order (its state's keys) as positions in ``params``: the
        # same unless the job has parameter groups.
        position = {id(p): local for local, p in enumerate(self.params)}
        self._optimizer_order = [
            position[id(p)]
            for g in self.optimizer.param_groups
            for p in g["params"]
            if id(p) in position
        ]
        self.step_groups = self._step_groups(step_group_bytes)
        self.acc = [torch.empty(m.numel, dtype=_acc_dtype(m.torch_dtype)) for m in self.metas]
        self._acc_np = [a.numpy() for a in self.acc]
        self._scratch = np.empty(0, dtype=np.float64)
        self.initialized = False
        self.completed = 0
        self.last_grad_norm = 0.0  # the global norm the last commit used (replicas need it)
        self.min_generation = 0
        self.pending: _Pending | None = None
        # A replica's committed sums not stepped yet (shard_replica.py, "deferred"), at most
        # ``defer_limit`` of them, and accumulator sets to reuse.
        self.defer_limit = 0
        self.deferred: list[Deferred] = []
        self.spare_acc: list[tuple[list[torch.Tensor], list[np.ndarray]]] = []
        self.last_generation = 0  # the generation of the last iteration committed
        self.restores = 0  # how many times the state was restored (a load, a snapshot)
        self.snapshots_taken = 0  # a replica's snapshots of its primary's state
        self.encoded: Encoded | None = None
        # A test seam: called on the compute thread after each group a commit stepped (with
        # the group's number), e.g. to hold the commit there (tests/integration).
        self.group_stepped: Callable[[int], None] | None = None

    def _step_groups(self, group_bytes: int) -> list[tuple[list[int], int]]:
        """The commit's groups: consecutive tensors in layout order of about ``group_bytes``
        each (``<= 0``, or an optimizer not :func:`groupable`: one group), each with the byte
        offset below which the bundle is final once the group is stepped."""
        everything = list(range(len(self.metas)))
        if group_bytes <= 0 or not groupable(self.optimizer):
            return [(everything, self.total_bytes)] if everything else []
        groups: list[tuple[list[int], int]] = []
        current: list[int] = []
        size = 0
        for j, m in enumerate(self.metas):
            current.append(j)
            size += m.nbytes
            if size >= group_bytes:
                following = self.metas[j + 1].offset if j + 1 < len(self.metas) else None
                groups.append((current, self.total_bytes if following is None else following))
                current, size = [], 0
        if current:
            groups.append((current, self.total_bytes))
        return groups

    def _view(self, m: TensorMeta) -> torch.Tensor:
        if m.numel == 0:
            return torch.empty(m.shape, dtype=m.torch_dtype)
        return self.flat[m.offset : m.end].view(m.torch_dtype).view(m.shape)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    def same_configuration(self, tensors: Sequence[TensorMeta], optimizer: OptimizerConfig) -> bool:
        return tuple(tensors) == self.job_metas and optimizer == self.optimizer_config

    # -- checking streams -------------------------------------------------------------------

    def check_stream(
        self, header: ps_pb2.TensorBundleHeader, *, everything: bool, max_bytes: int
    ) -> list[tuple[int, TensorMeta]]:
        """Match a stream header's tensors with this shard's. ``everything``: all tensors must
        be present (uploads); otherwise parameters without a gradient may be left out."""
        metas = [TensorMeta.from_proto(t) for t in header.tensors]
        try:
            validate_layout(metas, header.total_bytes, what="header.tensors")
        except BundleError as exc:
            raise InvalidField("header.tensors", len(metas), str(exc)) from None
        matched: list[tuple[int, TensorMeta]] = []
        for i, m in enumerate(metas):
            j = self.index.get(m.name)
            if j is None:
                raise InvalidField(
                    f"header.tensors[{i}].name",
                    m.name,
                    f"is not held by shard {self.shard_index} of job {self.job_id!r}",
                )
            mine = self.metas[j]
            if not mine.same_tensor(m):
                raise InvalidField(
                    f"header.tensors[{i}]",
                    f"{m.name} {m.dtype} {list(m.shape)} {m.nbytes} bytes"
                    f"{' buffer' if m.buffer else ''}",
                    f"does not match the job's layout ({mine.dtype} {list(mine.shape)} "
                    f"{mine.nbytes} bytes{' buffer' if mine.buffer else ''})",
                )
            matched.append((j, m))
        present = {j for j, _ in matched}
        missing = [
            self.metas[j].name
            for j in range(len(self.metas))
            if j not in present and (everything or self.metas[j].buffer)
        ]
        if missing and (everything or header.num_samples > 0):
            raise InvalidField(
                "header.tensors", f"{len(metas)} tensors", f"lacks {', '.join(missing[:5])}"
            )
        limit = min(max_bytes, self.total_bytes + ALIGN * (len(self.metas) + 1))
        if header.total_bytes > limit:
            raise TooLarge(
                f"header.total_bytes ({header.total_bytes}) exceeds the limit ({limit}) of "
                f"shard {self.shard_index} for job {self.job_id!r}"
            )
        try:  # bytes inline: exactly total_bytes (so within the limit above), no lane
            inline_of(header)
        except BundleTooLarge as exc:
            raise TooLarge(str(exc)) from None
        except BundleError as exc:
            raise InvalidField("header.inline_data", len(header.inline_data), str(exc)) from None
        return matched

    @staticmethod
    def take_inline(contribution: Contribution, header: ps_pb2.TensorBundleHeader) -> bool:
        """Keep the bytes a header checked by :meth:`check_stream` carries inline (no copy);
        whether it carried any (then no chunk may follow)."""
        if not header.inline_data:
            return False
        if contribution.chunks:
            raise InvalidField("header.inline_data", "...", "the stream already has chunks")
        contribution.chunks.append(memoryview(header.inline_data))
        return True

    @staticmethod
    def take_chunk(contribution: Contribution, chunk: memoryview) -> None:
        """Keep a received chunk (no copy) after checking it does not overflow the stream."""
        received = sum(c.nbytes for c in contribution.chunks)
        if received + chunk.nbytes > contribution.total_bytes:
            raise TooLarge(
                f"stream sends more than its header.total_bytes ({contribution.total_bytes}): "
                f"{received + chunk.nbytes} bytes"
            )
        contribution.chunks.append(chunk)

    @staticmethod
    def check_complete(contribution: Contribution) -> None:
        received = sum(c.nbytes for c in contribution.chunks)
        if received != contribution.total_bytes:
            raise InvalidField(
                "header.total_bytes",
                contribution.total_bytes,
                f"was not reached: the stream ended after {received} bytes",
            )

    @staticmethod
    def take_trailer(contribution: Contribution, trailer: ps_pb2.TensorBundleTrailer) -> None:
        """Check a SyncStep trailer against its stream and apply it to ``contribution`` (not
        yet added to anything): it must follow the last byte the header declared, and name
        each declared parameter at most once (never a buffer). Refused: INVALID_ARGUMENT
        naming the field and the value, ``contribution`` unchanged."""
        received = sum(c.nbytes for c in contribution.chunks)
        if received != contribution.total_bytes:
            raise InvalidField(
                "trailer",
                f"after {received} bytes",
                f"must follow the last chunk (header.total_bytes is {contribution.total_bytes})",
            )
        declared = len(contribution.metas)
        absent: set[int] = set()
        for position, i in enumerate(trailer.absent_tensors):
            where = f"trailer.absent_tensors[{position}]"
            if not 0 <= i < declared:
                raise InvalidField(
                    where, i, f"is not an index of the header's {declared} declared tensors"
                )
            j, m = contribution.metas[i]
            if j in absent:
                raise InvalidField(where, i, f"repeats {m.name}")
            if m.buffer:
                raise InvalidField(where, i, f"names buffer {m.name}: buffers are never absent")
            absent.add(j)
        contribution.absent = frozenset(absent)
        contribution.loss_sum = trailer.loss_sum
        contribution.learning_rate = trailer.learning_rate

    def _feed(self, contribution: Contribution, sink: Any) -> None:
        metas = [m for _, m in contribution.metas]
        local = [j for j, _ in contribution.metas]
        receiver = BundleReceiver(
            metas, contribution.total_bytes, lambda i, off, seg: sink(local[i], off, seg)
        )
        try:
            for chunk in contribution.chunks:
                receiver.feed(chunk)
            receiver.finish()
        except BundleTooLarge as exc:
            raise TooLarge(str(exc)) from None
        except BundleError as exc:
            raise InvalidField("chunk", "...", str(exc)) from None

    # -- initial upload -----------------------------------------------------------------------

    def initialize(self, contribution: Contribution) -> bool:
        """Apply a checked initial upload; False (and nothing changes) when already
        initialized."""
        if self.initialized:
            return False
        views = self._bytes

        def copy(j: int, off: int, seg: memoryview) -> None:
            views[j][off : off + seg.nbytes] = np.frombuffer(seg, dtype=np.uint8)

        self._feed(contribution, copy)
        self.initialized = True
        self._encode()
        return True

    # -- gradients ----------------------------------------------------------------------------

    def check_iteration(self, generation: int, iteration: int) -> None:
        """Refuse a contribution of a superseded generation or of another iteration."""
        if not self.initialized:
            raise FailedPrecondition(
                f"shard {self.shard_index} of job {self.job_id!r} has no parameters yet"
            )
        if generation < self.min_generation:
            raise StaleGeneration(
                f"generation ({generation}) is stale: shard {self.shard_index} of job "
                f"{self.job_id!r} is at generation {self.min_generation}",
                floor=self.min_generation,
            )
        if iteration != self.completed:
            raise StaleGeneration(
                f"iteration ({iteration}) is not the one shard {self.shard_index} of job "
                f"{self.job_id!r} runs ({self.completed})"
            )

    def pending_for(self, generation: int, iteration: int) -> _Pending:
        """The running iteration's sums for (generation, iteration); a newer generation drops
        an older one's (it was superseded, which the caller learned from the coordinator)."""
        pending = self.pending
        if pending is not None and (pending.generation, pending.iteration) == (
            generation,
            iteration,
        ):
            return pending
        if pending is not None:
            self.abort(pending.generation, pending.iteration)
        self.min_generation = max(self.min_generation, generation)
        self.pending = _Pending(
            generation,
            iteration,
            got_grad=[False] * len(self.metas),
            buffer_weight=[0.0] * len(self.metas),
        )
        return self.pending

    def accumulate(self, contribution: Contribution, members: frozenset[str]) -> bool:
        """Add a checked, complete contribution to the running iteration's sums (a repeated
        one from the same learner is ignored). Returns True exactly once per iteration: when
        this contribution completes the set of ``members``."""
        self.check_iteration(contribution.generation, contribution.iteration)
        pending = self.pending_for(contribution.generation, contribution.iteration)
        if contribution.learner in pending.contributed:
            return False
        n = contribution.num_samples
        if n > 0:
            absent = contribution.absent
            self._feed(
                contribution,
                lambda j, off, seg: None if j in absent else self._add(j, off, seg, n),
            )
            for j, m in contribution.metas:
                if j in absent:
                    continue  # marked by the trailer: no gradient, as if left out
                if m.buffer:
                    pending.buffer_weight[j] += n
                else:
                    pending.got_grad[j] = True
        pending.contributed.add(contribution.learner)
        pending.total_samples += n
        pending.loss_sum += contribution.loss_sum
        if contribution.learning_rate > 0 and pending.learning_rate <= 0:
            pending.learning_rate = contribution.learning_rate
        return members <= pending.contributed

    def _add(self, j: int, off: int, seg: memoryview, n: int) -> None:
        m = self.metas[j]
        acc = self._acc_np[j]
        e0 = off // m.itemsize
        if m.dtype == "bfloat16":
            src = (np.frombuffer(seg, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif m.dtype == "bool":
            src = np.frombuffer(seg, dtype=np.uint8)
        else:
            src = np.frombuffer(seg, dtype=acc.dtype if m.dtype not in ("float16",) else np.float16)
        dst = acc[e0 : e0 + src.size]
        pending = self.pending
        assert pending is not None
        # The first contribution to a tensor writes it (no accumulator needs zeroing); later
        # ones add (integer buffers: take the maximum). Contributions are applied one at a
        # time, each whole, so "first" is known per tensor.
        first = pending.buffer_weight[j] == 0 if m.buffer else not pending.got_grad[j]
        if m.buffer and not np.issubdtype(acc.dtype, np.inexact):
            if first:
                np.copyto(dst, src, casting="unsafe")
            else:
                np.maximum(dst, src, out=dst, casting="unsafe")
            return
        if first:
            np.multiply(src, n, out=dst, casting="unsafe")
            return
        if n == 1:
            np.add(dst, src, out=dst, casting="unsafe")
            return
        if self._scratch.dtype != acc.dtype or self._scratch.size < src.size:
            self._scratch = np.empty(max(src.size, 1 << 20), dtype=acc.dtype)
        tmp = self._scratch[: src.size]
        np.multiply(src, n, out=tmp, casting="unsafe")
        np.add(dst, tmp, out=dst)

    # -- resolving ----------------------------------------------------------------------------

    def grad_sq_norm(self) -> float:
        """The squared 2-norm of this shard's slice of the pending iteration's mean gradient
        (per tensor in float32, as ``clip_grad_norm_`` computes norms; summed in float64)."""
        pending = self.pending
        if pending is None or pending.total_samples <= 0:
            return 0.0
        total = 0.0
        with torch.no_grad():
            for j in self.param_indices:
                if pending.got_grad[j]:
                    mean = self.acc[j].to(torch.float32) / pending.total_samples
                    total += float(torch.linalg.vector_norm(mean, 2.0)) ** 2
        return total

    def commit(
        self,
        generation: int,
        iteration: int,
        grad_norm: float = 0.0,
        publish: Callable[[Encoded], None] | None = None,
    ) -> Encoded | None:
        """Apply (generation, iteration): mean gradient, clipped to the job's
        ``clip_grad_norm`` by the global ``grad_norm`` the coordinator summed from every
        shard, learning rate, optimizer step, averaged buffers; returns the new parameters'
        encoding. A commit of an iteration already applied returns None.

        The slice is stepped group by group (``step_groups``; one optimizer step per group,
        equal to one step of all for the optimizers :func:`groupable` allows). ``publish``
        gets the encoding before the first group is stepped, its header final: its
        ``stepped`` offset advances after each group (:meth:`Encoded.advance`)."""
        pending = self.pending
        if pending is None or (pending.generation, pending.iteration) != (generation, iteration):
            if iteration < self.completed:
                return None
            raise FailedPrecondition(
                f"shard {self.shard_index} of job {self.job_id!r} holds no sums for "
                f"iteration {iteration} of generation {generation}"
            )
        total = pending.total_samples
        config = self.optimizer_config
        skipped = config.skip_nonfinite and not math.isfinite(grad_norm)
        clip = config.clip_grad_norm
        coef = None
        if clip > 0 and not skipped:  # as clip_grad_norm_: g *= min(1, max / (norm + 1e-6))
            norm = torch.tensor(grad_norm, dtype=torch.float32)
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        if pending.learning_rate > 0:
            for group in self.optimizer.param_groups:
                group["lr"] = pending.learning_rate * group.get("lr_scale", 1.0)
        encoded = self._encode(
            stepped=0,
            generation=generation,
            iteration=iteration,
            num_samples=total,
            loss_sum=pending.loss_sum,
            grad_norm=grad_norm if config.needs_norm else 0.0,
            step_skipped=skipped,
        )
        if publish is not None:
            publish(encoded)
        try:
            with torch.no_grad():
                for number, (indices, final_below) in enumerate(self.step_groups):
                    self._step_group(indices, pending, coef, skipped)
                    encoded.advance(final_below)
                    if self.group_stepped is not None:
                        self.group_stepped(number)
        except BaseException as exc:
            encoded.fail(exc)
            raise
        self.pending = None
        self.completed = iteration + 1
        self.last_grad_norm = grad_norm
        self.last_generation = generation
        return encoded

    def _step_group(
        self, indices: list[int], pending: _Pending, coef: torch.Tensor | None, skipped: bool
    ) -> None:
        """Step the parameters ``indices`` holds (one optimizer step: the others have no
        gradient, so it leaves them as they are) and average its buffers."""
        total = pending.total_samples
        stepping: list[torch.Tensor] = []
        for j in indices:
            m = self.metas[j]
            if m.buffer:
                weight = pending.buffer_weight[j]
                if weight > 0:
                    acc = self.acc[j]
                    value = acc.div_(weight) if acc.is_floating_point() or acc.is_complex() else acc
                    self.tensors[j].copy_(value.view(m.shape))
                continue
            if not (pending.got_grad[j] and total > 0):
                continue
            p = self.tensors[j]
            grad = self.acc[j].div_(total)
            p.grad = (grad if grad.dtype == p.dtype else grad.to(p.dtype)).view(p.shape)
            if coef is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
            stepping.append(p)
        try:
            if stepping and not skipped:
                self.optimizer.step()
        finally:
            for p in stepping:
                p.grad = None

    def abort(self, generation: int, iteration: int) -> bool:
        """Drop (generation, iteration)'s sums; later contributions of that generation are
        refused. Returns whether there were sums to drop."""
        self.min_generation = max(self.min_generation, generation + 1)
        pending = self.pending
        if pending is None or (pending.generation, pending.iteration) != (generation, iteration):
            return False
        self.pending = None  # the sums are garbage now; the next contribution overwrites them
        return True

    # -- the parameters on the wire -----------------------------------------------------------

    def _encode(self, *, stepped: int | None = None, **fields: Any) -> Encoded:
        """Encode the current parameters and buffers once, for every learner that asks
        (``stepped``: final below that byte only, see :class:`Encoded`)."""
        header = ps_pb2.TensorBundleHeader()
        header.CopyFrom(self._header)
        for name, value in fields.items():
            setattr(header, name, value)
        self.encoded = Encoded(
            header, self.metas, self._bytes, self.total_bytes, self.chunk_bytes, stepped=stepped
        )
        return self.encoded

    def current(self, inline_cls: type[Any] | None = None) -> Encoded:
        """The current parameters, fully encoded (call on the compute thread); with
        ``inline_cls`` as that one message (:meth:`Encoded.inline_message`) instead of
        chunks."""
        if not self.initialized:
            raise FailedPrecondition(
                f"shard {self.shard_index} of job {self.job_id!r} has no parameters yet"
            )
        encoded = self._encode(iteration=self.completed)
        if inline_cls is not None:
            encoded.inline_message(inline_cls)
            return encoded
        return encoded.materialized()

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {m.name: t for m, t in zip(self.metas, self.tensors, strict=True)}


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
