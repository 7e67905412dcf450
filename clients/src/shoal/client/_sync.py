"""The synchronous client: the asyncio client driven on a private event-loop thread, so both
flavours share one implementation (retries, leader discovery, deadlines)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from shoal.client._async import AsyncClient
from shoal.client.config import ClientConfig

T = TypeVar("T")


class Client:
    """``Client(load_config())``: every method of :class:`AsyncClient`, blocking.

    Streaming methods (``list_jobs``, ``watch_job``, ``stream_logs``) return iterators.
    """

    def __init__(self, config: ClientConfig, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="shoal-client"
        )
        self._thread.start()
        self._async = self._run(self._make(config, kwargs))

    @staticmethod
    async def _make(config: ClientConfig, kwargs: dict[str, Any]) -> AsyncClient:
        return AsyncClient(config, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._async, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            if hasattr(result, "__anext__"):
                return self._iterate(result)
            return self._run(result)

        return call

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
