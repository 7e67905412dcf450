"""Parameter-server mode: gradients stream to the shards while backward runs
(docs/data-plane.md, "Overlap in parameter-server mode").

:class:`StreamedGradients` are the :class:`~shoal.learner.overlap.GradientHooks` of a
:class:`~shoal.learner.grpc_backend.GrpcBackend`, driven by
:func:`shoal.learner.steps.compute_contribution` exactly as the collective bucketer is:
:meth:`~StreamedGradients.begin` at the start of a share, :meth:`~StreamedGradients.arm` just
before the **last** micro-batch's backward (earlier micro-batches only accumulate), and
:meth:`~StreamedGradients.finish` after it.

At :meth:`arm` each shard reached over gRPC gets its ``SyncStep`` stream opened at once: a
header that declares **every** tensor of the shard's slice, the parameters in reverse order
(the order backward produces their gradients) and then the buffers, with the share's sample
count; its loss sum and learning rate are not known yet (0 in the header). Each armed
``register_post_accumulate_grad_hook`` copies its parameter's gradient (times the inverse loss
scale under float16 loss scaling: the very operation of the path without overlap) and hands it
to its shard's queue, which the backend's asyncio thread drains into the stream, in declared
order (a tensor ready early waits for the ones declared before it). :meth:`finish` sends what
backward did not produce: a parameter the last micro-batch did not use sends what earlier ones
accumulated, one without any gradient sends zeros. In :meth:`GrpcBackend.sync
<shoal.learner.grpc_backend.GrpcBackend.sync>`, :meth:`seal` sends the buffers and the
trailer: the indices of the declared parameters without a gradient (the shard counts them as
absent, exactly like a parameter a header leaves out), the loss sum and the learning rate.
The shard sums a stream only once it is complete and checked, so the sums, and the
equivalence with one process, are those of the path without overlap.

Shards reached through the same-host shared-memory lane (``grpc_lane.py``) are not
overlapped: the lane carries one bundle written after backward. Clipping, float16 skipping
and the gradient norm an adaptive batch measures are the shards' work, on the summed
gradient, so overlap changes none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shoal.contract import environment
from shoal.contract.wire import (
    TensorMeta,
    byte_view,
    encode_chunks,
    encode_header,
    header_of,
    pack_layout,
)
from shoal.learner.backend import Assignment, Contribution
from shoal.learner.env import switch
from shoal.learner.overlap import without_graph
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.learner.grpc_backend import GrpcBackend
    from shoal.learner.grpc_calls import _Shard

__all__ = ["StreamedGradients", "declared_order", "overlap_enabled"]

log = logging.getLogger("shoal.learner.grpc")

_END = None  # the queue's last item


def declared_order(tensors: Sequence[int], n_params: int) -> list[int]:
    """A shard's layout indices ``tensors`` in the order its overlapped stream declares them:
    the parameters (indices below ``n_params``) in reverse, then the buffers in order."""
    params = [j for j in tensors if j < n_params]
    return [*reversed(params), *(j for j in tensors if j >= n_params)]


@dataclass
class _Stream:
    """One shard's stream of one share."""

    shard: _Shard
    declared: list[int]  # layout indices, in stream order
    metas: list[TensorMeta]  # their packed layout in the stream
    position: dict[int, int]  # layout index -> place in ``declared``
    queue: asyncio.Queue[Any]
    task: asyncio.Task[ps_pb2.TensorBundleHeader] | None = None
    call: Any = None  # the SyncStep call
    ready: dict[int, torch.Tensor] = field(default_factory=dict)  # place -> copy, not sent
    cursor: int = 0  # the next place to send


@dataclass
class _Share:
    assignment: Assignment
    n: int
    inv_scale: torch.Tensor | None
    streams: list[_Stream]
    where: dict[int, _Stream]  # parameter index -> its stream


class StreamedGradients:
    """See the module docstring. ``backend`` is the learner's backend (its loop, shards and
    layout), ``params`` the model's parameters in spec order."""

    def __init__(self, backend: GrpcBackend, params: Sequence[torch.Tensor]) -> None:
        self._backend = backend
        self._params = list(params)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook_for(j))
            for j, p in enumerate(self._params)
            if p.requires_grad
        ]
        self._assignment: Assignment | None = None
        self._share: _Share | None = None
        self._armed = False
        # Parameters streamed by the hooks while backward ran, and in all (overlapped shards).
        self.tensors_sent = [0, 0]

    # -- the trainer's side (GradientHooks) ---------------------------------------------------

    def assigned(self, assignment: Assignment | None) -> None:
        """The backend's latest assignment (the iteration the next share is computed for)."""
        self._assignment = assignment

    def begin(self) -> None:
        self.discard()

    def arm(self, n: int, inv_scale: torch.Tensor | None) -> None:
        a = self._assignment
        if a is None or a.retire or n <= 0:
            return
        backend = self._backend
        n_params = len(self._params)
        picked = [
            s
            for s in backend._shards
            if s.streams is not None
            and s.lane is None
            and (s.lane_tried or not backend._shm_lane)
            and any(j < n_params for j in s.tensors)
            and not self._inline(s)
        ]
        if not picked:
            # Every shard is on the lane (or unknown yet), or its bundle is small enough to go
            # whole as one message: the path without overlap.
            return
        share = asyncio.run_coroutine_threadsafe(
            self._open(a, n, inv_scale, picked, backend._md()), backend.session.loop
        ).result()
        self._share = share
        self._armed = True

    def _inline(self, shard: _Shard) -> bool:
        """Whether ``shard``'s whole slice is at most the backend's ``inline_bytes``: then its
        bundle is not streamed while backward runs but sent whole, as one message, by sync
        (a few KiB gain nothing from overlap; one message saves several)."""
        limit = self._backend.inline_bytes
        if limit <= 0:
            return False
        if shard.slice_bytes < 0:
            layout = self._backend._layout
            shard.slice_bytes = pack_layout([layout[j] for j in shard.tensors])[1]
        return shard.slice_bytes <= limit

    def finish(self) -> None:
        self._armed = False
        share = self._share
        if share is None:
            return
        with torch.no_grad():
            for stream in share.streams:
                for place in range(stream.cursor, len(stream.declared)):
                    j = stream.declared[place]
                    if j < len(self._params) and place not in stream.ready:
                        stream.ready[place] = self._copy(self._params[j], share.inv_scale)
                self._send_ready(stream, until_buffers=True)

    def remove(self) -> None:
        self.discard()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- the backend's side -------------------------------------------------------------------

    def seal(
        self, assignment: Assignment, contribution: Contribution, lr: float | None
    ) -> dict[int, asyncio.Task[ps_pb2.TensorBundleHeader]]:
        """End the share's streams (buffers, then the trailer) and hand over their calls, by
        ``id`` of their shard; {} when nothing was streamed for this share (the caller sends
        everything itself)."""
        share, self._share = self._share, None
        if share is None:
            return {}
        a = share.assignment
        if (a.generation, a.step) != (assignment.generation, assignment.step) or (
            share.n != contribution.n_samples
        ):
            self._cancel(share)
            log.warning(
                "gradients streamed for iteration %d (%d samples) dropped: sync is for %d (%d)",
                a.step,
                share.n,
                assignment.step,
                contribution.n_samples,
            )
            return {}
        n_params = len(self._params)
        loop = self._backend.session.loop
        calls = {}
        for stream in share.streams:
            absent = []
            for place, j in enumerate(stream.declared):
                if j >= n_params:
                    stream.ready[place] = _cpu(contribution.buffers[j - n_params])
                elif contribution.grads[j] is None:
                    absent.append(place)
            self._send_ready(stream, until_buffers=False)
            trailer = ps_pb2.SyncStepRequest(
                trailer=ps_pb2.TensorBundleTrailer(
                    absent_tensors=absent,
                    loss_sum=contribution.loss_sum,
                    learning_rate=lr or 0.0,
                )
            ).SerializeToString()
            loop.call_soon_threadsafe(stream.queue.put_nowait, trailer)
            loop.call_soon_threadsafe(stream.queue.put_nowait, _END)
            assert stream.task is not None
            calls[id(stream.shard)] = stream.task
        return calls

    def discard(self) -> None:
        """Drop a share that was not sealed (its streams are cancelled: the shards keep
        nothing of an incomplete stream)."""
        self._armed = False
        share, self._share = self._share, None
        if share is not None:
            self._cancel(share)

    # -- internals ----------------------------------------------------------------------------

    def _cancel(self, share: _Share) -> None:
        loop = self._backend.session.loop
        if loop.is_closed():
            return
        for stream in share.streams:
            loop.call_soon_threadsafe(stream.queue.put_nowait, _END)
            if stream.call is not None:
                loop.call_soon_threadsafe(stream.call.cancel)
            if stream.task is not None:
                loop.call_soon_threadsafe(stream.task.cancel)

    async def _open(
        self,
        a: Assignment,
        n: int,
        inv_scale: torch.Tensor | None,
        shards: list[_Shard],
        md: Any,
    ) -> _Share:
        backend = self._backend
        n_params = len(self._params)
        streams = []
        where: dict[int, _Stream] = {}
        for shard in shards:
            declared = declared_order(shard.tensors, n_params)
            metas, total = pack_layout([backend._layout[j] for j in declared])
            stream = _Stream(
                shard,
                declared,
                metas,
                {j: place for place, j in enumerate(declared)},
                asyncio.Queue(),
            )
            header = header_of(
                job_id=backend.job_id,
                sender_id=backend.learner_id,
                metas=metas,
                total_bytes=total,
                generation=a.generation,
                iteration=a.step,
                num_samples=n,
            )
            header.inline_answer_max_bytes = backend.inline_bytes
            assert shard.streams is not None
            call = shard.streams["SyncStep"](
                self._requests(stream, header), metadata=md or backend._metadata
            )
            stream.call = call
            stream.task = asyncio.ensure_future(backend._receive(shard, call, answer=True))
            # Not awaited until sync(): a failure (ABORTED, a lost shard) is raised there.
            stream.task.add_done_callback(_retrieve)
            streams.append(stream)
            for j in declared:
                if j < n_params:
                    where[j] = stream
        return _Share(a, n, inv_scale, streams, where)

    async def _requests(
        self, stream: _Stream, header: ps_pb2.TensorBundleHeader
    ) -> AsyncIterator[bytes]:
        """The stream's messages: the header, then the tensors as the trainer's thread hands
        them over (in declared order), coalesced into chunks, then the trailer."""
        yield encode_header(ps_pb2.SyncStepRequest, header)
        chunk_bytes = self._backend._chunk_bytes
        while True:
            items = [await stream.queue.get()]
            while not stream.queue.empty():
                items.append(stream.queue.get_nowait())
            run: list[tuple[int, torch.Tensor]] = []
            for item in items:
                if isinstance(item, tuple):
                    run.append(item)
                    continue
                for chunk in _encode_run(stream.metas, run, chunk_bytes):
                    yield chunk
                run = []
                if item is _END:
                    return
                yield item  # the trailer
            for chunk in _encode_run(stream.metas, run, chunk_bytes):
                yield chunk

    def _hook_for(self, j: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self._armed:
                without_graph(self._ready, j, param)

        return hook

    def _ready(self, j: int, param: torch.Tensor) -> None:
        share = self._share
        if share is None or param.grad is None:
            return
        stream = share.where.get(j)
        if stream is None:
            return  # a shard without overlap (the lane): sent by sync
        place = stream.position[j]
        if place < stream.cursor:
            return  # already sent (a second backward in the armed window): not resent
        stream.ready[place] = self._copy(param, share.inv_scale)
        self.tensors_sent[0] += self._send_ready(stream, until_buffers=True)

    @staticmethod
    def _copy(param: torch.Tensor, inv_scale: torch.Tensor | None) -> torch.Tensor:
        """The gradient as the path without overlap sends it: unscaled, on the CPU."""
        grad = param.grad
        if grad is None:
            return torch.zeros(param.shape, dtype=param.dtype)
        if inv_scale is not None:  # a new tensor: the trainer unscales p.grad in place next
            return _cpu(grad.detach().mul(inv_scale.to(grad.dtype)))
        # No copy on the CPU: nothing writes p.grad again before sync() returns (the share's
        # backward is over for this parameter; the trainer sets p.grad to None after sync).
        return _cpu(grad)

    def _send_ready(self, stream: _Stream, *, until_buffers: bool) -> int:
        """Hand the ready tensors at the stream's cursor to its queue; how many parameters."""
        n_params = len(self._params)
        batch: list[tuple[int, torch.Tensor]] = []
        while stream.cursor in stream.ready:
            if until_buffers and stream.declared[stream.cursor] >= n_params:
                break
            batch.append((stream.cursor, stream.ready.pop(stream.cursor)))
            stream.cursor += 1
        if not batch:
            return 0
        loop = self._backend.session.loop
        for item in batch:
            loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        sent = sum(1 for place, _ in batch if stream.declared[place] < n_params)
        self.tensors_sent[1] += sent
        return sent


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


def _encode_run(
    metas: Sequence[TensorMeta], run: list[tuple[int, torch.Tensor]], chunk_bytes: int
) -> list[bytes]:
    """The chunk messages of consecutive declared tensors ``run`` ((place, tensor) each)."""
    if not run:
        return []
    base = metas[run[0][0]].offset
    local = [metas[place].at(metas[place].offset - base) for place, _ in run]
    total = metas[run[-1][0]].end - base
    sources = [byte_view(t) if t.numel() else _EMPTY for _, t in run]
    return list(encode_chunks(local, sources, total, chunk_bytes))


_EMPTY = byte_view(torch.empty(0, dtype=torch.uint8))


def _retrieve(task: asyncio.Future[Any]) -> None:
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.exception()


def overlap_enabled() -> bool:
    """``SHOAL_PS_OVERLAP``: ``on`` (the default) or ``off``."""
    return switch(environment.PS_OVERLAP, "on")
