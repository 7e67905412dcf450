"""The store on etcd v3 (:class:`EtcdStore`): aetcd's generated stubs on its own ``grpc.aio``
channels, with endpoint failover, per-call deadlines and watches that resume from a revision
(see :mod:`shoal.runtime.store` for why not ``aetcd.Client``)."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from aetcd import rpc

from shoal.contract.errors import FencedOut, LeaseExpired, StoreError, StoreUnavailable
from shoal.runtime.retrying import resumed, stream_wait
from shoal.runtime.store.base import Expect, Fence, KeyValue, Op, PutOp, Store, WatchEvent

log = logging.getLogger(__name__)

T = TypeVar("T")


_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)

# What breaks a watch stream and is retried (on the next endpoint) while the store is open.
_WATCH_TRANSIENT = (grpc.aio.AioRpcError, StoreUnavailable)

# Errors that show the request never reached the server, so even a write may go elsewhere.
_NOT_SENT_MARKERS = (
    "failed to connect",
    "connection refused",
    "connect failed",
    "no route to host",
    "dns resolution failed",
    "name resolution",
)


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """etcd's [key, range_end) for every key starting with ``prefix``."""
    key = prefix.encode()
    if not key:
        return b"\0", b"\0"
    end = bytearray(key)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return key, bytes(end[: i + 1])
    return key, b"\0"  # all 0xff: no upper bound


def _kv(pb: rpc.KeyValue) -> KeyValue:
    return KeyValue(
        key=pb.key.decode(),
        value=bytes(pb.value),
        create_revision=pb.create_revision,
        mod_revision=pb.mod_revision,
        lease=pb.lease,
    )


def _put_op(op: PutOp) -> rpc.RequestOp:
    return rpc.RequestOp(
        request_put=rpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease)
    )


def _delete_op(key: str) -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key.encode()))


def _mod_equals(expect: Expect) -> rpc.Compare:
    return rpc.Compare(
        key=expect.key.encode(),
        target=rpc.Compare.MOD,
        result=rpc.Compare.EQUAL,
        mod_revision=expect.mod_revision,
    )


def _strip_scheme(endpoint: str) -> str:
    for scheme in ("http://", "https://", "unix://"):
        if endpoint.startswith(scheme):
            return endpoint[len(scheme) :]
    return endpoint


def _read_file(path: str | Path | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


@dataclass
class _Stubs:
    channel: grpc.aio.Channel
    kv: rpc.KVStub
    lease: rpc.LeaseStub
    watch: rpc.WatchStub


class EtcdStore(Store):
    """The store on etcd v3 (one member or a cluster).

    ``endpoints`` are ``"host:port"`` (an ``http://``/``https://`` prefix is accepted). Calls go
    to the endpoint that answered last; on connection failure the next one is tried: reads and
    lease refreshes on any transient failure, writes only when the request cannot have reached
    the server (otherwise :class:`StoreUnavailable` is raised, because the write may have been
    applied). ``timeout`` bounds every call (seconds). TLS: ``ca_cert`` (server CA), and
    ``cert_cert``/``cert_key`` for a client certificate (mTLS); paths to PEM files.

    The gRPC channels reconnect with a backoff of at most ``reconnect_backoff_max`` seconds, so
    the store is usable soon after etcd comes back. :meth:`list` reads in pages of
    ``list_page_size`` keys, all at one revision. Channels are created on first use and belong
    to that event loop: use one store from one loop.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        ca_cert: str | Path | None = None,
        cert_key: str | Path | None = None,
        cert_cert: str | Path | None = None,
        timeout: float = 5.0,
        reconnect_backoff_max: float = 1.0,
        watch_backoff_max: float = 1.0,
        list_page_size: int = 1000,
    ) -> None:
        if not endpoints:
            raise ValueError("endpoints ([]) must name at least one etcd member")
        if timeout <= 0:
            raise ValueError(f"timeout ({timeout}) must be > 0")
        if (cert_key is None) != (cert_cert is None):
            raise ValueError(
                f"cert_key ({cert_key!r}) and cert_cert ({cert_cert!r}) must be given together"
            )
        if list_page_size < 1:
            raise ValueError(f"list_page_size ({list_page_size}) must be >= 1")
        self._list_page = list_page_size
        self._endpoints = [_strip_scheme(e) for e in endpoints]
        self._timeout = timeout
        self._watch_backoff_max = watch_backoff_max
        self._credentials: grpc.ChannelCredentials | None = None
        if ca_cert is not None or cert_cert is not None:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_file(ca_cert),
                private_key=_read_file(cert_key),
                certificate_chain=_read_file(cert_cert),
            )
        backoff_ms = max(int(reconnect_backoff_max * 1000), 100)
        self._options: list[tuple[str, int]] = [
            ("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
            ("grpc.min_reconnect_backoff_ms", min(100, backoff_ms)),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
            # Detect a dead or frozen server under a long-lived watch; etcd refuses pings more
            # often than every 5 s (--grpc-keepalive-min-time).
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            # Only while calls are open: etcd treats pings on an idle connection as abuse.
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
        ]
        self._stubs: dict[str, _Stubs] = {}
        self._preferred = 0
        self._closed = False

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    # -- plumbing ------------------------------------------------------------------------------

    def _stubs_for(self, endpoint: str) -> _Stubs:
        if self._closed:
            raise StoreError("the etcd store is closed")
        stubs = self._stubs.get(endpoint)
        if stubs is None:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(endpoint, self._credentials, self._options)
            else:
                channel = grpc.aio.insecure_channel(endpoint, self._options)
            stubs = _Stubs(
                channel, rpc.KVStub(channel), rpc.LeaseStub(channel), rpc.WatchStub(channel)
            )
            self._stubs[endpoint] = stubs
        return stubs

    def _error(self, exc: grpc.aio.AioRpcError, what: str, endpoint: str) -> StoreError:
        details = exc.details() or ""
        if exc.code() in _TRANSIENT_CODES:
            return StoreUnavailable(
                f"{what}: etcd at {endpoint} unavailable ({exc.code().name}: {details})"
            )
        return StoreError(f"{what}: etcd at {endpoint} failed ({exc.code().name}: {details})")

    async def _call(
        self, what: str, fn: Callable[[_Stubs], Awaitable[T]], *, idempotent: bool
    ) -> T:
        """Run ``fn`` against the preferred endpoint, failing over as the class doc says."""
        n = len(self._endpoints)
        last: tuple[StoreError, grpc.aio.AioRpcError] | None = None
        # Iteration, not a retry: each endpoint is tried once, at once (a member that is down
        # says nothing about the next one); callers retry outages with their own backoff.
        for attempt in range(n):
            index = (self._preferred + attempt) % n
            endpoint = self._endpoints[index]
            try:
                result = await fn(self._stubs_for(endpoint))
            except grpc.aio.AioRpcError as exc:
                error = self._error(exc, what, endpoint)
                if not isinstance(error, StoreUnavailable):
                    raise error from exc
                self._preferred = (index + 1) % n
                details = (exc.details() or "").lower()
                not_sent = exc.code() == grpc.StatusCode.UNAVAILABLE and any(
                    marker in details for marker in _NOT_SENT_MARKERS
                )
                if not (idempotent or not_sent):
                    raise error from exc
                last = (error, exc)
                continue
            self._preferred = index
            return result
        assert last is not None
        raise last[0] from last[1]

    async def _txn(
        self,
        what: str,
        compares: list[rpc.Compare],
        success: list[rpc.RequestOp],
        fence: Fence | None,
    ) -> rpc.TxnResponse:
        failure: list[rpc.RequestOp] = []
        if fence is not None:
            compares = [
                rpc.Compare(
                    key=fence.key.encode(),
                    target=rpc.Compare.CREATE,
                    result=rpc.Compare.EQUAL,
                    create_revision=fence.create_revision,
                ),
                *compares,
            ]
            # On failure, read the fence key in the same transaction to tell "fenced out"
            # from "a comparison failed".
            failure = [rpc.RequestOp(request_range=rpc.RangeRequest(key=fence.key.encode()))]
        request = rpc.TxnRequest(compare=compares, success=success, failure=failure)

        async def call(stubs: _Stubs) -> rpc.TxnResponse:
            return await stubs.kv.Txn(request, timeout=self._timeout)

        try:
            response = await self._call(what, call, idempotent=False)
        except StoreError as exc:
            cause = exc.__cause__
            if (
                isinstance(cause, grpc.aio.AioRpcError)
                and cause.code() == grpc.StatusCode.NOT_FOUND
                and "lease not found" in (cause.details() or "")
            ):
                lease = next((op.request_put.lease for op in success if op.request_put.lease), 0)
                raise LeaseExpired(lease, what) from cause
            raise
        if not response.succeeded and fence is not None:
            found = response.responses[0].response_range.kvs
            actual = found[0].create_revision if found else None
            if actual != fence.create_revision:
                raise FencedOut.of_fence(fence, actual)
        return response

    # -- Store ---------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        request = rpc.RangeRequest(key=key.encode())

        async def call(stubs: _Stubs) -> rpc.RangeResponse:
            return await stubs.kv.Range(request, timeout=self._timeout)

        response = await self._call(f"get {key!r}", call, idempotent=True)
        return _kv(response.kvs[0]) if response.kvs else None

    async def put(
        self, key: str, value: bytes, *, lease: int = 0, fence: Fence | None = None
    ) -> int:
        response = await self._txn(
            f"put {key!r}", [], [_put_op(PutOp(key, bytes(value), lease))], fence
        )
        return int(response.header.revision)

    async def compare_and_set(
        self,
        key: str,
        value: bytes,
        expected_revision: int,
        *,
        lease: int = 0,
        fence: Fence | None = None,
    ) -> bool:
        response = await self._txn(
            f"compare_and_set {key!r}",
            [_mod_equals(Expect(key, expected_revision))],
            [_put_op(PutOp(key, bytes(value), lease))],
            fence,
        )
        return bool(response.succeeded)

    async def delete(
        self, key: str, *, expected_revision: int | None = None, fence: Fence | None = None
    ) -> bool:
        compares = (
            [] if expected_revision is None else [_mod_equals(Expect(key, expected_revision))]
        )
        response = await self._txn(f"delete {key!r}", compares, [_delete_op(key)], fence)
        if not response.succeeded:
            return False
        return response.responses[0].response_delete_range.deleted > 0

    async def transaction(
        self,
        ops: Sequence[Op],
        *,
        expect: Sequence[Expect] = (),
        fence: Fence | None = None,
    ) -> int | None:
        success = [_put_op(op) if isinstance(op, PutOp) else _delete_op(op.key) for op in ops]
        response = await self._txn(
            f"transaction on {[op.key for op in ops]!r}",
            [_mod_equals(e) for e in expect],
            success,
            fence,
        )
        return int(response.header.revision) if response.succeeded else None

    async def list(self, prefix: str) -> tuple[list[KeyValue], int]:
        key, range_end = _prefix_range(prefix)
        for _ in range(3):  # restart if the snapshot revision is compacted between pages
            kvs: list[KeyValue] = []
            revision = 0
            start = key
            try:
                while True:
                    request = rpc.RangeRequest(
                        key=start, range_end=range_end, limit=self._list_page, revision=revision
                    )

                    async def call(
                        stubs: _Stubs, request: rpc.RangeRequest = request
                    ) -> rpc.RangeResponse:
                        return await stubs.kv.Range(request, timeout=self._timeout)

                    response = await self._call(f"list {prefix!r}", call, idempotent=True)
                    if revision == 0:
                        revision = int(response.header.revision)
                    kvs.extend(_kv(pb) for pb in response.kvs)
                    if not response.more or not response.kvs:
                        return kvs, revision
                    start = response.kvs[-1].key + b"\0"
            except StoreError as exc:
                if "compacted" not in str(exc):
                    raise
        raise StoreUnavailable(f"list {prefix!r}: history compacted while paging, 3 times")

    async def watch(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        key, range_end = _prefix_range(prefix)
        next_revision = start_revision
        if next_revision <= 0:
            _, current = await self.list(prefix)
            next_revision = current + 1
        index = self._preferred

        async def session() -> AsyncGenerator[WatchEvent | None, None]:
            """One watch stream from ``next_revision`` on the endpoint at ``index``; yields None
            once etcd created it (so the backoff starts over, as after an event), then the
            events. A failure moves ``index`` to the next endpoint."""
            nonlocal index, next_revision
            endpoint = self._endpoints[index % len(self._endpoints)]
            call = self._stubs_for(endpoint).watch.Watch()
            try:
                await call.write(
                    rpc.WatchRequest(
                        create_request=rpc.WatchCreateRequest(
                            key=key,
                            range_end=range_end,
                            start_revision=next_revision,
                            progress_notify=True,
                        )
                    )
                )
                created = False
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        if created:
                            return  # reopened at once, on the same endpoint
                        raise StoreUnavailable(f"watch {prefix!r}: {endpoint} ended the stream")
                    if response.compact_revision:
                        log.info(
                            "watch %r: revision %d compacted (at %d); resyncing",
                            prefix,
                            next_revision,
                            response.compact_revision,
                        )
                        kvs, revision = await self.list(prefix)
                        next_revision = revision + 1
                        yield WatchEvent("resync", prefix, b"", revision, tuple(kvs))
                        return  # reopened at once from the listing's revision
                    if response.canceled:
                        log.warning(
                            "watch %r canceled by etcd at %s: %s",
                            prefix,
                            endpoint,
                            response.cancel_reason,
                        )
                        raise StoreUnavailable(
                            f"watch {prefix!r} canceled by etcd at {endpoint}: "
                            f"{response.cancel_reason}"
                        )
                    if response.created:
                        created = True
                        yield None
                        continue
                    if not response.events:
                        # A progress notification: everything up to header.revision was sent.
                        next_revision = max(next_revision, response.header.revision + 1)
                        continue
                    last = next_revision - 1
                    for event in response.events:
                        revision = event.kv.mod_revision
                        if revision < next_revision:
                            continue  # already delivered before a reconnect
                        last = max(last, revision)
                        if event.type == rpc.Event.DELETE:
                            yield WatchEvent("delete", event.kv.key.decode(), b"", revision)
                        else:
                            yield WatchEvent(
                                "put", event.kv.key.decode(), bytes(event.kv.value), revision
                            )
                    next_revision = last + 1
            except _WATCH_TRANSIENT as exc:
                log.debug("watch %r on %s interrupted: %s", prefix, endpoint, exc)
                index += 1
                raise
            finally:
                call.cancel()

        # Retried (tenacity, shoal.contract.retrying.resumed) while the store is open: any RPC
        # error or outage, on the next endpoint, 0.05 s doubling to watch_backoff_max apart;
        # the waits start over once a stream is created. Once closed, the watch just ends.
        try:
            async for event in resumed(
                session,
                retry=lambda exc: isinstance(exc, _WATCH_TRANSIENT) and not self._closed,
                wait=stream_wait(self._watch_backoff_max),
                reopen_on_end=True,
            ):
                if event is not None:
                    yield event
        except (*_WATCH_TRANSIENT, StoreError):
            if self._closed:
                return
            raise

    async def grant_lease(self, ttl: float) -> int:
        if ttl <= 0:
            raise ValueError(f"ttl ({ttl}) must be > 0")
        request = rpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl)))

        async def call(stubs: _Stubs) -> rpc.LeaseGrantResponse:
            return await stubs.lease.LeaseGrant(request, timeout=self._timeout)

        response = await self._call(f"grant lease ttl={ttl}", call, idempotent=False)
        if response.error:
            raise StoreError(f"grant lease ttl={ttl}: {response.error}")
        return int(response.ID)

    async def refresh_lease(self, lease_id: int) -> float:
        async def call(stubs: _Stubs) -> rpc.LeaseKeepAliveResponse:
            stream = stubs.lease.LeaseKeepAlive(timeout=self._timeout)
            try:
                await stream.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                response = await stream.read()
            finally:
                stream.cancel()
            if response is grpc.aio.EOF:
                raise StoreUnavailable(f"refresh lease {lease_id:x}: keep-alive stream closed")
            return response

        response = await self._call(f"refresh lease {lease_id:x}", call, idempotent=True)
        if response.TTL <= 0:
            raise LeaseExpired(lease_id)
        return float(response.TTL)

    async def revoke_lease(self, lease_id: int) -> None:
        request = rpc.LeaseRevokeRequest(ID=lease_id)

        async def call(stubs: _Stubs) -> rpc.LeaseRevokeResponse:
            return await stubs.lease.LeaseRevoke(request, timeout=self._timeout)

        try:
            await self._call(f"revoke lease {lease_id:x}", call, idempotent=True)
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == (
                grpc.StatusCode.NOT_FOUND
            ):
                return
            raise

    async def compact(self, revision: int) -> None:
        request = rpc.CompactionRequest(revision=revision, physical=True)

        async def call(stubs: _Stubs) -> rpc.CompactionResponse:
            return await stubs.kv.Compact(request, timeout=self._timeout)

        try:
            await self._call(f"compact to {revision}", call, idempotent=True)
        except StoreError as exc:
            if "has been compacted" in str(exc):
                return  # already compacted at or past this revision
            raise

    async def close(self) -> None:
        self._closed = True
        stubs, self._stubs = list(self._stubs.values()), {}
        for s in stubs:
            await s.channel.close()
