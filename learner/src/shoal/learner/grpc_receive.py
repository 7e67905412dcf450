"""How the ``"grpc"`` backend reads the shards' answers (part of
:class:`~shoal.learner.grpc_backend.GrpcBackend`, see there): a parameter bundle from a
stream, a unary answer, a lane answer viewed in place (the learner's own lane's out-region or
the job's read-only answer segment, docs/data-plane.md "One answer per shard"), inline
bundles, early forward's arriving tensors, and the test faults on answers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from grpc import aio

from shoal.contract import faults
from shoal.contract.shm import LaneError
from shoal.contract.wire import BundleReceiver, Frame, TensorMeta, inline_of
from shoal.learner.backend import IterationAborted
from shoal.learner.early_forward import ArrivingTensors
from shoal.learner.grpc_calls import _bytes_of, _copy_sink, _Shard, _why, answer_bytes_of
from shoal.learner.grpc_lane import ClientLane
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.learner.grpc_backend import GrpcBackend as _B

__all__ = ["AnswerReceiving", "answer_of"]

log = logging.getLogger("shoal.learner.grpc")


class AnswerReceiving:
    """Part of :class:`~shoal.learner.grpc_backend.GrpcBackend`: the receive path."""

    async def _receive(
        self: _B, shard: _Shard, frames: AsyncIterator[Frame], *, answer: bool = False
    ) -> ps_pb2.TensorBundleHeader:
        """Read a parameter bundle from ``frames`` into the receive tensors. ``answer``: a
        SyncStep's answer (with early forward, its header and its complete tensors are told
        to the sync's :class:`ArrivingTensors` as they arrive)."""
        tracker: ArrivingTensors | None = None
        header: ps_pb2.TensorBundleHeader | None = None
        receiver: BundleReceiver | None = None
        async for frame in frames:
            if header is None:
                if frame.header is None:
                    raise RuntimeError(f"shard {shard.address} sent a chunk before the header")
                header = frame.header
                # Read at the header: an overlapped stream's call began before its sync.
                tracker = self._arriving_next if answer else None
                receiver, in_lane = self._answer_header(shard, header, tracker)
                if tracker is not None:
                    head = tracker.head(id(shard))
                    if not head.done():
                        head.set_result(header)
                    await self._answer_fault(shard, frames, tracker)
                receiver = self._answer_inline(shard, header, receiver, in_lane)
            elif frame.chunk is not None:
                if header.shared_memory:
                    raise RuntimeError(f"shard {shard.address} sent a chunk after its lane header")
                if header.inline_data:
                    raise RuntimeError(
                        f"shard {shard.address} sent a chunk after a header with inline_data"
                    )
                assert receiver is not None
                receiver.feed(frame.chunk)
        if header is None:
            raise RuntimeError(f"shard {shard.address} closed the stream without a header")
        if receiver is not None:
            receiver.finish()
        if tracker is not None:
            tracker.done(shard.tensors)
        return header

    def _take_answer(self: _B, shard: _Shard, header: ps_pb2.TensorBundleHeader) -> None:
        """A SyncStep's answer that came whole in its one message (the lane's control, read
        on the trainer's thread): :meth:`_receive` of that message."""
        receiver, in_lane = self._answer_header(shard, header, None)
        receiver = self._answer_inline(shard, header, receiver, in_lane)
        if receiver is not None:
            receiver.finish()  # (no chunk follows: incomplete)

    def _answer_header(
        self: _B,
        shard: _Shard,
        header: ps_pb2.TensorBundleHeader,
        tracker: ArrivingTensors | None,
    ) -> tuple[BundleReceiver, bool]:
        """Check a bundle's ``header`` against ``shard``'s tensors; the receiver of its bytes
        and whether they are in the lane (then viewed, not copied)."""
        index = {self._layout[j].name: j for j in shard.tensors}
        targets: list[int] = []
        metas = [TensorMeta.from_proto(t) for t in header.tensors]
        for m in metas:
            j = index.get(m.name)
            if j is None or not self._layout[j].same_tensor(m):
                raise RuntimeError(f"shard {shard.address} sent unexpected {m.name!r}")
            targets.append(j)
        in_lane = bool(header.shared_memory) and not header.inline_data
        if in_lane:  # the bytes are in this learner's lane: view them (no copy)
            if shard.lane is None:
                raise RuntimeError(f"shard {shard.address} answered through no lane")
            try:
                self._view_lane_answer(shard.lane, header, metas, targets)
            except LaneError as exc:
                raise RuntimeError(f"shard {shard.address}: {exc}") from None
        else:
            self._own_receive(targets)
        sink = _copy_sink(self._recv_bytes, targets)
        if tracker is not None:
            sink = _tracking_sink(sink, targets, self._recv_bytes, tracker)
        return BundleReceiver(metas, header.total_bytes, sink), in_lane

    def _answer_inline(
        self: _B,
        shard: _Shard,
        header: ps_pb2.TensorBundleHeader,
        receiver: BundleReceiver,
        in_lane: bool,
    ) -> BundleReceiver | None:
        """Feed ``receiver`` the bytes ``header`` carries inline; it, while chunks must still
        follow (None: the bundle is whole)."""
        try:
            inline = inline_of(header)
        except ValueError as exc:
            raise RuntimeError(f"shard {shard.address}: {exc}") from None
        if inline is not None:  # the whole bundle in this one message
            receiver.feed(inline)
            self.inline_bundles[1] += 1
            return None
        if in_lane:  # already viewed: nothing to copy
            return None
        return receiver

    def _view_lane_answer(
        self: _B,
        lane: ClientLane,
        header: ps_pb2.TensorBundleHeader,
        metas: Sequence[TensorMeta],
        targets: Sequence[int],
    ) -> None:
        """Make the receive tensors ``targets`` views of the lane's answer (``metas``) instead
        of copying it: the trainer copies them into the model before its next contribution,
        and the shard writes the out-region again only after that contribution. Done once per
        lane and layout (the answer's place is the same every iteration); the lists are
        changed in place, as the copy sinks hold them."""
        # The segment's nonce, not the lane object's id: a lane closed (its shard restarted)
        # and a new one opened may get the freed object's id, and the views must follow the
        # new segment (the old one stays mapped while they view it).
        key = (lane.answer_segment.nonce, header.shared_memory_offset, header.total_bytes)
        if all(self._recv_source[j] == key for j in targets):
            lane.rounds += 1
            return
        views = lane.answer_views(header, metas)
        for j, view in zip(targets, views, strict=True):
            self._recv[j] = view
            self._recv_bytes[j] = _bytes_of(view)
            self._recv_source[j] = key

    def _own_receive(self: _B, targets: Sequence[int]) -> None:
        """Receive tensors ``targets`` that view a lane answer get their own memory again
        before bytes are copied into them (the answer segment may be read-only, or the old
        lane's)."""
        for j in targets:
            if self._recv_source[j] is not None:
                m = self._layout[j]
                self._recv[j] = torch.empty(m.shape, dtype=m.torch_dtype)
                self._recv_bytes[j] = _bytes_of(self._recv[j])
                self._recv_source[j] = None

    async def _answer_fault(self: _B, shard: _Shard, frames: Any, tracker: ArrivingTensors) -> None:
        """The test faults ``hold-answer`` and ``drop-answer`` (``shoal.contract.faults``)."""
        dropping = faults.armed(faults.DROP_ANSWER, tracker.step)
        if not (dropping or faults.armed(faults.HOLD_ANSWER, tracker.step)):
            return
        drop = dropping and shard is self._shards[-1]
        log.warning("test fault: holding shard %d's answer of %d", shard.index, tracker.step)
        await asyncio.to_thread(tracker.waited.wait, 60.0)
        if drop:
            log.warning("test fault drop-answer: shard %d's answer is lost", shard.index)
            cancel = getattr(frames, "cancel", None)
            if cancel is not None:
                cancel()
            raise IterationAborted(f"test fault drop-answer: shard {shard.index}")

    def _answers_ended(self: _B) -> None:
        """Wait until the last sync's answers ended (nothing writes into the receive tensors
        any more; the trainer has loaded them, or abandoned them after a failure)."""
        arriving, self._arriving = self._arriving, None
        if arriving is not None:
            arriving.wait_ended()

    def _answer_bytes(self: _B, shard: _Shard) -> int:
        """At least the size of ``shard``'s answer (its whole slice, as it lays it out)."""
        if shard.answer_bytes < 0:
            shard.answer_bytes = answer_bytes_of([self._layout[j].nbytes for j in shard.tensors])
        return shard.answer_bytes

    async def _rest_of_answers(
        self: _B, tasks: Sequence[asyncio.Future[Any]], tracker: ArrivingTensors
    ) -> None:
        """Early forward: the answers after their headers, until each ended; a failure (a
        shard that died while answering) is told to ``tracker`` as IterationAborted."""
        try:
            try:
                await self._watch(asyncio.gather(*tasks))
            except BaseException as exc:
                why = _why(exc, None) if isinstance(exc, aio.AioRpcError) else str(exc)
                tracker.fail(IterationAborted(f"an answer failed after its header: {why}"))
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if not isinstance(exc, Exception):
                    raise
            else:
                tracker.done(range(len(self._layout)))
        finally:
            tracker.end()


async def answer_of(call: Awaitable[Frame]) -> AsyncIterator[Frame]:
    """A unary call's one answer message (gRPC's, or the lane control's) as the frames
    :meth:`GrpcBackend._receive` reads."""
    yield await call


def _tracking_sink(
    sink: Any, targets: Sequence[int], views: Sequence[np.ndarray], tracker: ArrivingTensors
) -> Any:
    """``sink`` telling ``tracker`` each tensor whose bytes are all written."""
    left = [views[j].nbytes for j in targets]
    tracker.done(j for i, j in enumerate(targets) if left[i] == 0)

    def tracking(i: int, off: int, seg: memoryview) -> None:
        sink(i, off, seg)
        left[i] -= seg.nbytes
        if left[i] == 0:
            tracker.done((targets[i],))

    return tracking
