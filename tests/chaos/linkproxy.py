"""A TCP proxy that makes one link slow or lossy, for the chaos suite (``tc netem`` is not
available on this kernel).

``LinkProxy(upstream)`` listens on 127.0.0.1 and forwards every connection to ``upstream``,
both ways, in an asyncio loop of its own thread. While it runs, the test can set:

* ``latency_s``: every chunk is delivered that much later, in each direction (order kept);
* ``loss``: the probability that a chunk is "lost" and delivered only after ``rto_s`` (a TCP
  retransmission: what packet loss does to a TCP stream; later chunks wait behind it);
* ``partition(True)``: nothing is delivered any more, either way, and new connections are
  accepted but get no answer (the peers see a silent link, as with every packet dropped);
  ``partition(False)`` heals it and what was held is delivered;
* ``cut()``: every open connection is aborted (both peers see a reset).

``stats`` counts connections and the bytes delivered each way. The upstream of new
connections can be changed with ``upstream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from dataclasses import dataclass, field


@dataclass
class LinkStats:
    connections: int = 0
    up_bytes: int = 0  # client -> upstream, delivered
    down_bytes: int = 0  # upstream -> client, delivered
    cuts: int = 0
    delayed_chunks: int = 0  # "lost" and retransmitted


@dataclass(eq=False)  # hashed by identity (kept in a set)
class _Connection:
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)


class LinkProxy:
    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        self.upstream = upstream
        self.latency_s = 0.0
        self.loss = 0.0
        self.rto_s = 0.2
        self.stats = LinkStats()
        self.address = ""
        self._random = random.Random(seed)
        self._healed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()  # type: ignore[var-annotated]
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # -- control (from the test's thread) ----------------------------------------------------

    def start(self) -> str:
        self._thread = threading.Thread(target=self._run, name="link-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the link proxy did not start")
        return self.address

    def stop(self) -> None:
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def partition(self, on: bool) -> None:
        assert self._loop is not None and self._healed is not None
        healed = self._healed
        self._loop.call_soon_threadsafe(healed.clear if on else healed.set)

    @property
    def partitioned(self) -> bool:
        return self._healed is not None and not self._healed.is_set()

    def cut(self) -> None:
        """Abort every open connection (a reset on both sides)."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(10)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._healed = asyncio.Event()
        self._healed.set()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0)
        )
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._cut(count=False)

    async def _cut(self, count: bool = True) -> None:
        for conn in list(self._connections):
            for writer in conn.writers:
                writer.transport.abort()
            for task in conn.tasks:
                task.cancel()
            if count:
                self.stats.cuts += 1
        self._connections.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._healed is not None
        self.stats.connections += 1
        conn = _Connection(writers=[writer])
        self._connections.add(conn)
        try:
            await self._healed.wait()  # a partitioned link answers no new connection
            host, port = self.upstream.rsplit(":", 1)
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except (OSError, asyncio.CancelledError):
            writer.transport.abort()
            self._connections.discard(conn)
            return
        conn.writers.append(up_writer)
        conn.tasks = [
            asyncio.ensure_future(self._pipe(reader, up_writer, "up_bytes")),
            asyncio.ensure_future(self._pipe(up_reader, writer, "down_bytes")),
        ]
        # One direction ending (a reset, or the peer closing) ends the connection.
        await asyncio.wait(conn.tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in conn.tasks:
            task.cancel()
        for w in conn.writers:
            w.transport.abort()
        self._connections.discard(conn)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str
    ) -> None:
        assert self._healed is not None
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        last = 0.0

        async def deliver() -> None:
            while True:
                at, data = await queue.get()
                if not data:
                    writer.write_eof() if writer.can_write_eof() else writer.close()
                    return
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._healed.wait()  # type: ignore[union-attr]
                writer.write(data)
                await writer.drain()
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(65536)
                at = time.monotonic() + self.latency_s
                if data and self.loss and self._random.random() < self.loss:
                    at += self.rto_s
                    self.stats.delayed_chunks += 1
                last = max(last, at)  # TCP keeps the order: nothing overtakes a late chunk
                queue.put_nowait((last, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender
