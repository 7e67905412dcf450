"""Client-side errors: one exception type carrying the status code, reason and message."""

from __future__ import annotations

import grpc
from grpc import aio


class ShoalClientError(Exception):
    """A call failed. ``code`` is the gRPC status code name (e.g. "NOT_FOUND"), ``reason`` the
    shoal ErrorReason name when the server sent one, ``message`` the server's words."""

    def __init__(self, code: str, message: str, reason: str = "", method: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.method = method

    @classmethod
    def from_rpc(cls, err: aio.AioRpcError | grpc.RpcError, method: str = "") -> ShoalClientError:
        code = err.code()  # type: ignore[union-attr]
        trailing = dict(err.trailing_metadata() or ())  # type: ignore[union-attr]
        return cls(
            code.name if code else "UNKNOWN",
            err.details() or "",  # type: ignore[union-attr]
            str(trailing.get("shoal-error-reason", "")),
            method,
        )
