"""The cluster's certificate authority and per-process certificates (``cryptography``).

``shoal cluster up --tls`` and ``compose/init-certs.sh`` use it to make one CA per cluster and
one certificate per process, so that every hop is mutually authenticated: the client CLI,
every service (as a server and as a client of the others), etcd, and the learners.

A certificate's common name is ``KIND:NAME``; the services read the kind of the certificate a
call came over (``shoal.runtime.interceptors``):

=========  ==================================================================================
kind       held by, and what it may carry
=========  ==================================================================================
service    one service process (``service:job-scheduler-0``); the only kind over which a
           service token is accepted
learner    the learners of one host (``learner:host-1``), given to them by their host agent;
           it carries learner credentials only
user       a person's client (``user:alice``); any user or admin token
admin      an operator's client (``admin:root``)
etcd       the etcd members (server and peer)
=========  ==================================================================================

Keys are ECDSA P-256 (what gRPC's BoringSSL and etcd's Go TLS both serve fast); every
certificate is valid for both server and client authentication, for the host names and IP
addresses given. Private keys are written with mode 0600.

Command line (what compose/init-certs.sh runs)::

    python -m shoal.runtime.pki init DIR                       # DIR/ca.pem, DIR/ca-key.pem
    python -m shoal.runtime.pki issue DIR KIND NAME [--host H ...] [--out PREFIX]
    python -m shoal.runtime.pki batch DIR < LINES              # "KIND NAME PREFIX [HOST ...]"

``batch`` makes the CA if DIR has none, then issues one certificate per line of its input whose
files do not exist yet (one process for all of them: the shell scripts use it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["KINDS", "CertificateAuthority", "Issued", "main"]

KINDS = ("service", "learner", "user", "admin", "etcd")
DEFAULT_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Issued:
    """A certificate and its key on disk (and the CA that signed it)."""

    cert: Path
    key: Path
    ca: Path


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path.chmod(0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


class CertificateAuthority:
    """A cluster CA in a directory: ``ca.pem`` (public) and ``ca-key.pem`` (0600)."""

    def __init__(self, directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate):
        self.directory = directory
        self._key = key
        self.certificate = cert

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @classmethod
    def create(
        cls, directory: Path, *, name: str = "shoal cluster CA", days: int = 3650
    ) -> CertificateAuthority:
        """A new CA (replacing any in ``directory``)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        _write_private(directory / "ca-key.pem", _key_pem(key))
        (directory / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(directory, key, cert)

    @classmethod
    def load(cls, directory: Path) -> CertificateAuthority:
        key = serialization.load_pem_private_key(
            (directory / "ca-key.pem").read_bytes(), password=None
        )
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{directory / 'ca-key.pem'} is not an EC key")
        cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        return cls(directory, key, cert)

    @classmethod
    def open_or_create(cls, directory: Path) -> CertificateAuthority:
        if (directory / "ca.pem").is_file() and (directory / "ca-key.pem").is_file():
            return cls.load(directory)
        return cls.create(directory)

    def issue(
        self,
        kind: str,
        name: str,
        *,
        hosts: Sequence[str] = DEFAULT_HOSTS,
        days: int = 825,
        out: Path | None = None,
    ) -> Issued:
        """A certificate with common name ``KIND:NAME`` for ``hosts``, written to
        ``OUT.pem`` and ``OUT-key.pem`` (default ``DIR/KIND-NAME``)."""
        if kind not in KINDS:
            raise ValueError(f"kind ({kind!r}) must be one of {', '.join(KINDS)}")
        if not name or any(c in name for c in "/\\:\0") or name.startswith("."):
            raise ValueError(f"name ({name!r}) must be a plain name without '/', ':' or NUL")
        if len(f"{kind}:{name}") > 64:
            raise ValueError(f"name ({name!r}) is too long: '{kind}:{name}' must fit in 64")
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        ca_key_id = x509.SubjectKeyIdentifier.from_public_key(self._key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{kind}:{name}")]))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(_san(hosts), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_key_id),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        prefix = out if out is not None else self.directory / f"{kind}-{name}"
        cert_path = prefix.with_name(prefix.name + ".pem")
        key_path = prefix.with_name(prefix.name + "-key.pem")
        cert_path.parent.mkdir(parents=True, exist_ok=True)
        _write_private(key_path, _key_pem(key))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Issued(cert_path, key_path, self.ca_file)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shoal.runtime.pki", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="make the cluster CA (kept if DIR has one)")
    init.add_argument("dir", type=Path)
    issue = sub.add_parser("issue", help="issue a certificate signed by DIR's CA")
    issue.add_argument("dir", type=Path)
    issue.add_argument("kind", choices=KINDS)
    issue.add_argument("name")
    issue.add_argument("--host", action="append", default=[], help="DNS name or IP (repeat)")
    issue.add_argument("--out", type=Path, help="file prefix (default DIR/KIND-NAME)")
    batch = sub.add_parser("batch", help="issue each 'KIND NAME PREFIX [HOST ...]' of stdin")
    batch.add_argument("dir", type=Path)
    ns = parser.parse_args(argv)
    try:
        if ns.command == "init":
            ca = CertificateAuthority.open_or_create(ns.dir)
            print(f"CA: {ca.ca_file}")
            return 0
        if ns.command == "batch":
            ca = CertificateAuthority.open_or_create(ns.dir)
            for line in sys.stdin.read().splitlines():
                if not line.strip():
                    continue
                kind, name, prefix, *hosts = line.split()
                out = Path(prefix)
                cert = out.with_name(out.name + ".pem")
                key = out.with_name(out.name + "-key.pem")
                if cert.is_file() and key.is_file():
                    continue
                ca.issue(kind, name, hosts=[*DEFAULT_HOSTS, *hosts], out=out)
                print(f"{kind}:{name}: {cert}")
            return 0
        ca = CertificateAuthority.load(ns.dir)
        issued = ca.issue(ns.kind, ns.name, hosts=[*DEFAULT_HOSTS, *ns.host], out=ns.out)
        print(f"{ns.kind}:{ns.name}: {issued.cert} {issued.key}")
        return 0
    except (OSError, ValueError) as exc:
        print(f"pki: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
