"""A bundle ready to stream from a shard (:class:`Encoded`): its header, its chunk messages
encoded on first use and shared by every learner, the whole bundle as one message for a small
one, and, for a commit's encoding, how far the slice is stepped (a commit publishes its encoding
before it steps, and readers wait for the bytes they send)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from shoal.contract.wire import TensorMeta, chunk_ranges, encode_chunks, inline_bytes
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

__all__ = ["Encoded"]


class Encoded:
    """A bundle ready to stream: its header and its chunk messages, encoded on first use and
    shared by every learner that streams it (so the first chunk leaves while the next ones are
    still being copied, and W learners cost one copy).

    It reads the shard's parameters as they are when a chunk is first asked for. That is safe
    for the members of an iteration: the next commit needs every member's next contribution,
    which each sends only after receiving all of these chunks. Pulls materialize a copy first
    (:meth:`materialized`), on the compute thread.

    A commit's encoding is published before the slice is stepped (its header is known at the
    commit's start): ``stepped`` is the byte offset below which the bundle is final, advanced
    by the compute thread after each group of tensors it stepped (:meth:`advance`); a reader
    on the event loop awaits :meth:`ready` before asking for a chunk, so no chunk reads a
    tensor before it is stepped. Any other encoding is final at once.
    """

    def __init__(
        self,
        header: ps_pb2.TensorBundleHeader,
        metas: Sequence[TensorMeta],
        views: Sequence[np.ndarray],
        total_bytes: int,
        chunk_bytes: int,
        *,
        stepped: int | None = None,
    ) -> None:
        self.header = header
        self.total_bytes = total_bytes
        self.ranges = chunk_ranges(metas, total_bytes, chunk_bytes) if total_bytes else []
        self.count = len(self.ranges)
        self._source = encode_chunks(metas, views, total_bytes, chunk_bytes)
        self._chunks: list[bytes] = []
        self._metas = metas
        self._views = views
        # The whole bundle as one header message, by message class (inline_message).
        self._inline: dict[type, bytes] = {}
        # Written by the compute thread (an int assignment: atomic), read by the event loop.
        self.stepped = total_bytes if stepped is None else stepped
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def chunk(self, index: int) -> bytes:
        if self.ranges and self.ranges[index][1] > self.stepped:
            raise RuntimeError(
                f"chunk {index} (bytes {self.ranges[index]}) asked for before it was stepped "
                f"(stepped through byte {self.stepped})"
            )
        while len(self._chunks) <= index:
            self._chunks.append(next(self._source))
        return self._chunks[index]

    @property
    def chunks(self) -> list[bytes]:
        return [self.chunk(i) for i in range(self.count)]

    def materialized(self) -> Encoded:
        self.chunks  # noqa: B018 - encodes every chunk now
        return self

    def inline_message(self, message_cls: type[Any]) -> bytes:
        """The serialized stream message ``{header: header + inline_data}``: the whole bundle
        in one message (encoded once per message class, shared by every learner). Ask only
        once every byte is stepped (:meth:`whole`)."""
        message = self._inline.get(message_cls)
        if message is None:
            if self.stepped < self.total_bytes:
                raise RuntimeError(
                    f"inline bundle asked for before it was stepped (stepped through byte "
                    f"{self.stepped} of {self.total_bytes})"
                )
            header = ps_pb2.TensorBundleHeader()
            header.CopyFrom(self.header)
            header.inline_data = inline_bytes(self._metas, self._views, self.total_bytes)
            message = message_cls(header=header).SerializeToString()
            self._inline[message_cls] = message
        return message

    # -- progress of a commit (compute thread -> event loop) ------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the readers awaiting :meth:`ready` on ``loop`` (call before publishing)."""
        self._loop = loop

    def advance(self, offset: int) -> None:
        """The bundle is final below byte ``offset`` (compute thread)."""
        self.stepped = offset
        self._notify()

    def fail(self, exc: BaseException) -> None:
        """The commit failed part way: the readers still waiting get ``exc`` (compute thread)."""
        self._error = exc
        self._notify()

    def _notify(self) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed (the server stopped): no reader is left
            self._loop = None

    def _wake(self) -> None:
        waiting = []
        for end, future in self._waiters:
            if future.done():
                continue
            if self._error is not None and self.stepped < end:
                future.set_exception(self._error)
            elif self.stepped >= end:
                future.set_result(None)
            else:
                waiting.append((end, future))
        self._waiters = waiting

    async def _until(self, end: int) -> None:
        if self.stepped >= end:
            return
        if self._error is not None:
            raise self._error
        if self._loop is None:
            raise RuntimeError("an encoding being stepped is not bound to an event loop")
        future = self._loop.create_future()
        self._waiters.append((end, future))
        await future

    async def ready(self, index: int) -> None:
        """Return once chunk ``index``'s bytes are stepped (event loop)."""
        await self._until(self.ranges[index][1])

    async def whole(self) -> None:
        """Return once every byte is stepped (event loop)."""
        await self._until(self.total_bytes)
