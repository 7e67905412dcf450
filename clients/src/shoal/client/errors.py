"""Client-side errors: one exception type carrying the status code, reason and message."""

from __future__ import annotations

import re
from typing import Any

import grpc
from grpc import aio

from shoal.contract.errors import decode_rpc_error

_ADDRESS = re.compile(r"(?:ipv4|ipv6|dns):(\[?[^\s\]]*\]?:\d+)")


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
    def from_rpc(
        cls, err: aio.AioRpcError | grpc.RpcError, method: str = "", *, config: Any = None
    ) -> ShoalClientError:
        """The error of a failed call. With the client ``config``, a connection that failed
        because of TLS is explained in one line (``shoal.client.tls.explain_unavailable``)."""
        failed = decode_rpc_error(err)
        code, details, reason = failed.code, failed.message, failed.reason
        if code == grpc.StatusCode.UNAVAILABLE and config is not None and not reason:
            found = _ADDRESS.search(details)
            if found:
                from shoal.client.tls import explain_unavailable

                why = explain_unavailable(
                    found.group(1),
                    details,
                    ca=getattr(config, "tls_ca", None),
                    cert=getattr(config, "tls_cert", None),
                )
                if why:
                    return cls("UNAVAILABLE", why, "", method)
        return cls(failed.code_name, details, reason, method)
