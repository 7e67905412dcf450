"""TLS for shoal's gRPC channels, and a plain-words diagnosis of a failed TLS handshake.

One place builds channel credentials for the CLI, the Python client, the learners and the
services (``shoal.runtime.channels``): :func:`channel_credentials`. When a call fails with
UNAVAILABLE because of TLS (no client certificate, a certificate the server's CA did not sign,
a server that speaks TLS to a plaintext client or the other way round), gRPC says only
"failed to connect to all addresses"; :func:`explain_unavailable` turns that into one line that
says what is wrong and what to set.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import grpc

__all__ = ["TLSFiles", "channel_credentials", "explain_unavailable", "probe_tls"]


class TLSFiles:
    """Paths of a CA bundle and, for mutual TLS, a certificate and its key (PEM)."""

    def __init__(self, ca: str | None, cert: str | None = None, key: str | None = None) -> None:
        if (cert is None) != (key is None):
            raise ValueError(f"tls cert ({cert!r}) and key ({key!r}) must be given together")
        self.ca, self.cert, self.key = ca, cert, key

    def __repr__(self) -> str:
        return f"TLSFiles(ca={self.ca!r}, cert={self.cert!r}, key={self.key!r})"


def _read(what: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} ({path}) cannot be read: {exc.strerror}") from exc


def channel_credentials(
    ca: str | None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials:
    """Credentials trusting ``ca`` (the system roots when None), presenting ``cert``/``key``
    when given (mutual TLS). ValueError naming the file when one cannot be read."""
    if (cert is None) != (key is None):
        raise ValueError(f"tls_cert ({cert!r}) and tls_key ({key!r}) must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read("tls_ca", ca),
        private_key=_read("tls_key", key),
        certificate_chain=_read("tls_cert", cert),
    )


def probe_tls(address: str, timeout: float = 2.0) -> bool | None:
    """Whether the server at ``host:port`` answers a TLS handshake (without verifying it):
    True, False (it answered, not with TLS), None (no connection at all)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as raw:
            try:
                with context.wrap_socket(raw, server_hostname=host) as tls:
                    tls.do_handshake()
                    return True
            except ssl.SSLError as exc:
                # A server that wants a client certificate may fail the handshake after its
                # hello: it still speaks TLS.
                text = str(exc).lower()
                return "certificate" in text or "alert" in text
            except (ConnectionError, TimeoutError, OSError):
                return False
    except (OSError, ValueError):
        return None


def explain_unavailable(
    address: str,
    details: str,
    *,
    ca: str | None,
    cert: str | None,
    probe: bool = True,
) -> str | None:
    """One line saying why a call to ``address`` could not connect, when the reason is TLS;
    None when it is not (or cannot be told)."""
    text = details.lower()
    configured = ca is not None or cert is not None
    if "certificate_verify_failed" in text or "certificate verify failed" in text:
        return (
            f"TLS: the certificate of the server at {address} is not signed by the CA in "
            f"tls_ca ({ca or 'the system roots'}); use the cluster's CA file"
        )
    if "wrong_version_number" in text or "packet_length_too_long" in text:
        return (
            f"TLS: the server at {address} does not speak TLS; remove tls_ca/tls_cert/tls_key "
            "from the client config (or start the cluster with --tls)"
        )
    if "certificate_required" in text or "alert_handshake_failure" in text:
        return (
            f"TLS: the server at {address} requires a client certificate; set tls_cert and "
            "tls_key in the client config (SHOAL_TLS_CERT / SHOAL_TLS_KEY)"
        )
    if "unknown_ca" in text or "bad_certificate" in text or "decrypt_error" in text:
        return (
            f"TLS: the server at {address} refused the client certificate ({cert}); it is not "
            "signed by the cluster's CA"
        )
    if not probe:
        return None
    speaks_tls = probe_tls(address)
    if speaks_tls and not configured:
        return (
            f"TLS: the server at {address} speaks TLS but the client has no tls_ca: set tls_ca, "
            "tls_cert and tls_key (SHOAL_TLS_CA, SHOAL_TLS_CERT, SHOAL_TLS_KEY; `shoal cluster "
            "up --tls` writes them into .shoal/cluster.json)"
        )
    if speaks_tls and cert is None:
        return (
            f"TLS: the server at {address} requires a client certificate; set tls_cert and "
            "tls_key in the client config (SHOAL_TLS_CERT / SHOAL_TLS_KEY)"
        )
    if speaks_tls:
        return (
            f"TLS: the server at {address} refused the client certificate ({cert}): it is not "
            "signed by the cluster's CA"
        )
    if speaks_tls is False and configured:
        return (
            f"TLS: the server at {address} does not speak TLS; remove tls_ca/tls_cert/tls_key "
            "from the client config (or start the cluster with --tls)"
        )
    return None
