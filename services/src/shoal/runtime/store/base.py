"""The state store's data model (revisions, fences, operations, watch events) and the
:class:`Store` interface both implementations pass one contract suite against
(``tests/integration/test_store_contract.py``). See :mod:`shoal.runtime.store`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self

# --------------------------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyValue:
    """One key as stored. ``lease`` is the id of the lease the key is attached to (0: none)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class WatchEvent:
    """A change under a watched prefix.

    ``put``: ``key`` now holds ``value`` since ``mod_revision``. ``delete``: ``key`` was deleted
    at ``mod_revision`` (``value`` is empty). ``resync``: the watch could not resume (the
    history it needed was compacted); ``kvs`` is the full listing of the prefix at revision
    ``mod_revision`` (``key`` is the prefix); the consumer replaces its view with it and the
    watch goes on with changes after ``mod_revision``.
    """

    kind: Literal["put", "delete", "resync"]
    key: str
    value: bytes
    mod_revision: int
    kvs: tuple[KeyValue, ...] = ()


@dataclass(frozen=True)
class Fence:
    """A fencing token: the leader key and the ``create_revision`` it had when leadership was won.

    A fenced write succeeds only if ``key`` still exists with that ``create_revision``; it
    fails with :class:`FencedOut` once the key is gone or was re-created by another leader.
    """

    key: str
    create_revision: int


@dataclass(frozen=True)
class PutOp:
    """Put ``value`` under ``key`` (attached to ``lease`` unless 0) in :meth:`Store.transaction`."""

    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class DeleteOp:
    """Delete ``key`` (a no-op if absent) in :meth:`Store.transaction`."""

    key: str


@dataclass(frozen=True)
class Expect:
    """A condition of :meth:`Store.transaction`: ``key``'s ``mod_revision`` equals
    ``mod_revision`` (``0``: the key must not exist)."""

    key: str
    mod_revision: int


Op = PutOp | DeleteOp


# The store's errors live with every other shoal error in shoal.contract.errors (imported
# above and re-exported here): StoreError, FencedOut, StoreUnavailable, LeaseExpired.


# --------------------------------------------------------------------------------------------
# Interface
# --------------------------------------------------------------------------------------------


class Store(ABC):
    """A revisioned key-value store with compare-and-set, fencing, watches and leases.

    Keys are ``str`` (UTF-8 in etcd), values ``bytes``. Revisions start at 1 for an empty store
    and every write that changes something bumps the revision by one (all ops of one
    transaction share one revision), as in etcd.
    """

    @abstractmethod
    async def get(self, key: str) -> KeyValue | None:
        """The key, or None if it does not exist."""

    @abstractmethod
    async def put(
        self, key: str, value: bytes, *, lease: int = 0, fence: Fence | None = None
    ) -> int:
        """Write ``key`` unconditionally (but fenced, if ``fence``); returns the new revision.

        Raises :class:`FencedOut`, or :class:`LeaseExpired` if ``lease`` does not exist.
        """

    @abstractmethod
    async def compare_and_set(
        self,
        key: str,
        value: bytes,
        expected_revision: int,
        *,
        lease: int = 0,
        fence: Fence | None = None,
    ) -> bool:
        """Write ``key`` only if its ``mod_revision`` is ``expected_revision`` (0: only if the key
        does not exist). Returns whether it was written. :class:`FencedOut` takes precedence
        over a failed comparison."""

    @abstractmethod
    async def delete(
        self, key: str, *, expected_revision: int | None = None, fence: Fence | None = None
    ) -> bool:
        """Delete ``key`` (only if its ``mod_revision`` is ``expected_revision``, when given).
        Returns whether a key was deleted."""

    @abstractmethod
    async def transaction(
        self,
        ops: Sequence[Op],
        *,
        expect: Sequence[Expect] = (),
        fence: Fence | None = None,
    ) -> int | None:
        """Apply ``ops`` atomically (one revision) if every :class:`Expect` holds.

        Returns the store revision after the transaction, or None if an expectation failed
        (nothing was written). Raises :class:`FencedOut` if the fence failed.
        """

    @abstractmethod
    async def list(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys starting with ``prefix`` (sorted by key) and the revision they were read at.

        Watch from ``revision + 1`` to follow changes after the listing without a gap.
        """

    @abstractmethod
    def watch(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        """Changes to keys starting with ``prefix`` with ``mod_revision >= start_revision``
        (``start_revision <= 0``: from now on), in revision order.

        Never ends by itself: it resumes after connection loss and store restarts, and emits a
        ``"resync"`` event when the needed history was compacted. Stop it by breaking out of
        the loop and closing the generator (``contextlib.aclosing``) or cancelling the task.
        """

    @abstractmethod
    async def grant_lease(self, ttl: float) -> int:
        """A new lease that expires ``ttl`` seconds from now unless refreshed; returns its id.

        etcd counts whole seconds (``ttl`` is rounded up) and enforces a minimum (about 2 s
        with default settings)."""

    @abstractmethod
    async def refresh_lease(self, lease_id: int) -> float:
        """Restart the lease's TTL; returns the remaining TTL in seconds.

        Raises :class:`LeaseExpired` if it no longer exists."""

    @abstractmethod
    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease and delete its keys now (no error if it is already gone)."""

    @abstractmethod
    async def compact(self, revision: int) -> None:
        """Discard the history before ``revision``; watches from earlier revisions then resync."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections; running watches end."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
