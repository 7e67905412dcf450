"""The embedded local cluster: etcd, resource-manager and job-scheduler (leader + standby each),
S parameter-sync shards and N host agents with simulated GPUs, all as real processes on
loopback, for development, demos and end-to-end tests.

    with LocalCluster(ClusterSpec(state_dir=Path(".shoal"))) as cluster:
        client = Client(cluster.client_config())

Every process logs to ``<state_dir>/logs/<name>.log`` and serves Prometheus metrics on a port of
its own (``--metrics-port``; the URLs are in ``metrics_urls()`` and under ``"metrics"`` in
``cluster.json``, and ``shoal cluster status`` shows them). Credentials are generated into
``<state_dir>/tokens`` (mode 0600): a user token for you, a service token for the services, an
admin token. ``<state_dir>/cluster.json`` is the client config file the CLI picks up.

With ``ClusterSpec(tls=True)`` (``shoal cluster up --tls``) every hop is mutual TLS: a cluster
CA and one certificate per process are made in ``<state_dir>/tls/`` (``shoal.runtime.pki``):
etcd serves its client API over TLS and requires client certificates; every service serves
mTLS and presents its own ``service:<name>`` certificate to the services and to etcd; each host
agent gives its learners a ``learner:<host>`` certificate; ``cluster.json`` names your
``user:<you>`` certificate (``tls_ca``, ``tls_cert``, ``tls_key``).

With ``ClusterSpec(supervise=True)`` (what ``shoal cluster up`` runs) a service process that
exits while the cluster is up is started again, same flags and address, after a backoff that
doubles from ``RestartPolicy.initial_backoff_s`` to ``max_backoff_s`` (back to the initial one
once a process stayed up ``stable_after_s``); after ``max_restarts`` restarts within
``window_s`` it is left down ("gave up"). Each exit and restart is logged
(``shoal.cluster.local``) and counted in ``cluster.json`` (``"services"``), which
``shoal cluster status`` shows. etcd and the dashboard are not restarted.

Layout: the spec and each process's flags are in :mod:`shoal.cluster.spec`, the restart
bookkeeping in :mod:`shoal.cluster.supervision`, the port reservations in
:mod:`shoal.cluster.ports`; all are re-exported here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal.cluster.ports import PortReservations, free_port
from shoal.cluster.spec import (
    SERVICE_NAMES,
    ClusterSpec,
    ServiceProcess,
    service_flags,
    tail,
)
from shoal.cluster.supervision import RestartPolicy, Supervision
from shoal.contract import environment
from shoal.runtime.auth import Role, new_token, write_tokens_file
from shoal.runtime.etcd_server import EtcdCluster, EtcdServer, EtcdTLS
from shoal.runtime.pki import CertificateAuthority
from shoal.runtime.procs import die_with_parent

__all__ = [
    "SERVICE_NAMES",
    "ClusterSpec",
    "LocalCluster",
    "PortReservations",
    "RestartPolicy",
    "ServiceProcess",
    "Supervision",
    "free_port",
    "service_flags",
    "tail",
]

log = logging.getLogger(__name__)


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.state_dir = spec.state_dir.resolve()
        self.logs = self.state_dir / "logs"
        self.storage = self.state_dir / "storage"
        self.etcd: EtcdCluster | None = None
        self.services: dict[str, ServiceProcess] = {}
        self.tokens: dict[str, str] = {}
        self.ports = PortReservations()  # held from planning until everything listens
        self.dashboard: subprocess.Popen[bytes] | None = None
        self.dashboard_url = ""  # http://127.0.0.1:PORT/ when spec.dashboard
        self.tls_dir = self.state_dir / "tls"
        self.certs: dict[str, tuple[Path, Path]] = {}  # "kind:name" -> (cert, key)
        self.supervisor_pid: int | None = None  # the `shoal cluster up` process, if any
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 90.0) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.storage.mkdir(parents=True, exist_ok=True)
        self.tokens = {"user": new_token(), "service": new_token(), "admin": new_token()}
        write_tokens_file(
            self.state_dir / "tokens",
            [
                (self.tokens["user"], os.environ.get("USER", "you") or "you", Role.USER),
                (self.tokens["service"], "shoal-services", Role.SERVICE),
                (self.tokens["admin"], "admin", Role.ADMIN),
            ],
        )
        (self.state_dir / "service-token").write_text(self.tokens["service"])
        (self.state_dir / "service-token").chmod(0o600)
        try:
            etcd_tls = self._make_certificates() if self.spec.tls else None
            if self.spec.etcd_members > 1:
                self.etcd = EtcdCluster(
                    self.spec.etcd_members,
                    data_dir=self.state_dir / "etcd",
                    log_dir=self.logs,
                    unsafe_no_fsync=True,
                    tls=etcd_tls,
                )
            else:
                self.etcd = EtcdServer(
                    data_dir=self.state_dir / "etcd",
                    log_dir=self.logs,
                    unsafe_no_fsync=True,
                    tls=etcd_tls,
                )
            self.etcd.start()
            self._plan()
            order = ("resource-manager", "parameter-sync", "job-scheduler", "host-agent")
            for kind in order:
                for svc in self.services.values():
                    if svc.kind == kind:
                        self._spawn(svc)
                for svc in self.services.values():
                    if svc.kind == kind:
                        self.wait_healthy(svc, timeout=timeout)
            if self.spec.dashboard:
                self._start_dashboard(timeout)
            self.write_client_config(self.state_dir / "cluster.json")
            if self.spec.supervise:
                self._stopping.clear()
                self._supervisor = threading.Thread(
                    target=self._supervise_loop, name="shoal-cluster-supervisor", daemon=True
                )
                self._supervisor.start()
        except BaseException:
            self.stop()
            raise
        finally:
            self.ports.release()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every service (agents first, so learners stop), then etcd; nothing is left."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=30)
            self._supervisor = None
        self._stop_dashboard(grace)
        order = ("host-agent", "job-scheduler", "parameter-sync", "resource-manager")
        for kind in order:
            procs = [s for s in self.services.values() if s.kind == kind and s.alive()]
            for svc in procs:
                with contextlib.suppress(ProcessLookupError):
                    svc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            deadline = time.monotonic() + grace
            for svc in procs:
                try:
                    svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(svc.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
                    svc.proc.wait(timeout=10)  # type: ignore[union-attr]
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    # -- TLS ---------------------------------------------------------------------------------

    @property
    def ca_file(self) -> Path:
        return self.tls_dir / "ca.pem"

    def _issue(self, ca: CertificateAuthority, kind: str, name: str) -> tuple[Path, Path]:
        issued = ca.issue(kind, name)
        self.certs[f"{kind}:{name}"] = (issued.cert, issued.key)
        return issued.cert, issued.key

    def _make_certificates(self) -> EtcdTLS:
        """A fresh CA and every certificate this cluster needs; returns etcd's TLS."""
        ca = CertificateAuthority.create(self.tls_dir, name="shoal local cluster CA")
        cert, key = self._issue(ca, "etcd", "etcd")
        self._issue(ca, "user", os.environ.get("USER", "you") or "you")
        self._issue(ca, "admin", "admin")
        return EtcdTLS(cert, key, client_ca_file=ca.ca_file)

    def _tls_flags(self, svc: ServiceProcess) -> list[str]:
        ca = CertificateAuthority.load(self.tls_dir)
        cert, key = self._issue(ca, "service", svc.name)
        flags = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(self.ca_file)]
        flags += ["--etcd-ca", str(self.ca_file), "--etcd-cert", str(cert), "--etcd-key", str(key)]
        if svc.kind == "host-agent":
            lcert, lkey = self._issue(ca, "learner", svc.name)
            flags += ["--learner-tls-cert", str(lcert), "--learner-tls-key", str(lkey)]
        return flags

    def user_certificate(self, role: str = "user") -> tuple[Path, Path] | None:
        """The client certificate of ``role`` ("user" or "admin"), with TLS."""
        kind = "admin" if role == "admin" else "user"
        return next((v for k, v in self.certs.items() if k.startswith(kind + ":")), None)

    # -- processes ---------------------------------------------------------------------------

    def _common(self, svc_name: str, address: str) -> list[str]:
        assert self.etcd is not None
        return [
            "--listen",
            address,
            "--advertise",
            address,
            "--etcd",
            ",".join(self.etcd.endpoints),
            "--tokens-file",
            str(self.state_dir / "tokens"),
            "--service-token",
            "@" + str(self.state_dir / "service-token"),
        ]

    def addresses(self, kind: str) -> list[str]:
        return [s.address for s in self.services.values() if s.kind == kind]

    def metrics_urls(self) -> dict[str, str]:
        """Process name -> its Prometheus endpoint."""
        return {n: s.metrics_url for n, s in self.services.items() if s.metrics_url}

    def _plan(self) -> None:
        spec = self.spec

        def add(name: str, kind: str, extra: list[str]) -> None:
            address = f"127.0.0.1:{self.ports.take()}"
            metrics_port = self.ports.take()
            self.services[name] = ServiceProcess(
                name,
                kind,
                address,
                [kind, *self._common(name, address), "--metrics-port", str(metrics_port), *extra],
                self.logs / f"{name}.log",
                metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            )

        for i in range(spec.replicas):
            add(f"resource-manager-{i}", "resource-manager", [])
        for i in range(spec.shards):
            add(f"parameter-sync-{i}", "parameter-sync", [])
        for i in range(spec.replicas):
            add(f"job-scheduler-{i}", "job-scheduler", [])
        for i in range(spec.hosts):
            add(f"host-{i + 1}", "host-agent", [])
        rms = ",".join(self.addresses("resource-manager"))
        shards = ",".join(self.addresses("parameter-sync"))
        schedulers = ",".join(self.addresses("job-scheduler"))
        storage = self.storage.as_uri()
        for svc in self.services.values():
            if spec.tls:
                svc.args += self._tls_flags(svc)
            svc.args += service_flags(
                svc,
                spec,
                rms=rms,
                shards=shards,
                schedulers=schedulers,
                storage=storage,
                work_dir=self.state_dir / "hosts",
            )

    def _spawn(self, svc: ServiceProcess) -> None:
        env = {
            **os.environ,
            **self.spec.extra_env,
            "PYTHONUNBUFFERED": "1",
            environment.LOG_LEVEL: os.environ.get(environment.LOG_LEVEL, "INFO"),
        }
        log = svc.log.open("ab")
        svc.proc = subprocess.Popen(
            die_with_parent([sys.executable, "-m", "shoal.runtime.main", *svc.args]),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        log.close()

    def wait_healthy(self, svc: ServiceProcess, timeout: float = 60.0) -> None:
        """Wait until the process answers health checks (a standby answers too)."""
        deadline = time.monotonic() + timeout
        with self._health_channel(svc.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if not svc.alive():
                    raise RuntimeError(f"{svc.name} exited: see {svc.log}\n{tail(svc.log)}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{svc.name} not healthy after {timeout} s: see {svc.log}")
                time.sleep(0.1)

    def _health_channel(self, address: str) -> grpc.Channel:
        pair = self.user_certificate()
        if not self.spec.tls or pair is None:
            return grpc.insecure_channel(address)
        from shoal.client.tls import channel_credentials

        creds = channel_credentials(str(self.ca_file), str(pair[0]), str(pair[1]))
        return grpc.secure_channel(address, creds)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Chaos: signal one service process (its learners, for an agent, die with it)."""
        svc = self.services[name]
        if svc.alive():
            os.kill(svc.pid, sig)  # type: ignore[arg-type]
            if sig == signal.SIGKILL:
                svc.proc.wait(timeout=10)  # type: ignore[union-attr]

    def restart(self, name: str, timeout: float = 60.0) -> None:
        svc = self.services[name]
        with self._lock:
            if svc.alive():
                self.kill(name)
            self._spawn(svc)
        self.wait_healthy(svc, timeout=timeout)

    # -- supervision (ClusterSpec.supervise) ---------------------------------------------------

    def supervise_once(self, now: float | None = None) -> list[str]:
        """Notice exited service processes and restart those that are due (see the module
        docstring). Returns what happened, one line per event (also logged)."""
        now = time.monotonic() if now is None else now
        events = []
        policy = self.spec.restart_policy
        with self._lock:
            for svc in self.services.values():
                sup = svc.supervision
                if svc.proc is None or sup.gave_up:
                    continue
                if svc.alive():
                    sup.due_at = None  # restarted by someone else (restart())
                    continue
                if sup.due_at is None:
                    events.append(f"{svc.name}: {sup.exited(svc.proc.returncode, now, policy)}")
                elif sup.due(now):
                    self._spawn(svc)
                    sup.restarted(now)
                    events.append(
                        f"{svc.name}: restarted (pid {svc.pid}, restart {sup.restarts}); "
                        f"see {svc.log}"
                    )
        for event in events:
            log.warning("%s", event)
        return events

    def _supervise_loop(self) -> None:
        while not self._stopping.wait(0.2):
            try:
                events = self.supervise_once()
                if events:
                    self.write_client_config(self.state_dir / "cluster.json")
            except Exception:
                log.exception("supervising the services failed")

    def services_status(self) -> dict[str, dict[str, object]]:
        """Process name -> pid, state (running, restarting in N s, gave up), restarts and the
        last exit code: what ``shoal cluster status`` shows."""
        now = time.monotonic()
        return {
            name: {
                "pid": svc.pid,
                "state": svc.supervision.state(svc.alive(), now),
                "restarts": svc.supervision.restarts,
                "last_exit_code": svc.supervision.last_exit,
            }
            for name, svc in self.services.items()
        }

    # -- the web dashboard (shoal.dashboard) ----------------------------------------------------

    def _start_dashboard(self, timeout: float) -> None:
        """Serve the dashboard on a free loopback port; wait until it answers /healthz. It holds
        no credential: users log in with their own token (``"token"`` in cluster.json)."""
        import urllib.request

        address = f"127.0.0.1:{self.ports.take()}"
        log_path = self.logs / "dashboard.log"
        with log_path.open("ab") as log:
            self.dashboard = subprocess.Popen(
                die_with_parent(
                    [
                        sys.executable,
                        "-m",
                        "shoal.dashboard",
                        "--listen",
                        address,
                        "--scheduler",
                        ",".join(self.addresses("job-scheduler")),
                        "--resource-manager",
                        ",".join(self.addresses("resource-manager")),
                        *self._dashboard_tls_flags(),
                    ]
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.spec.extra_env, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        url = f"http://{address}/"
        deadline = time.monotonic() + timeout
        while True:
            if self.dashboard.poll() is not None:
                raise RuntimeError(f"the dashboard exited: see {log_path}\n{tail(log_path)}")
            try:
                with urllib.request.urlopen(url + "healthz", timeout=1.0) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the dashboard did not answer in {timeout} s: see {log_path}")
            time.sleep(0.1)
        self.dashboard_url = url

    def _dashboard_tls_flags(self) -> list[str]:
        """With TLS: the cluster's CA, and a user certificate of the dashboard's own to reach the
        services with (it carries each logged-in user's token, never a credential of its own)."""
        if not self.spec.tls:
            return []
        cert, key = self._issue(CertificateAuthority.load(self.tls_dir), "user", "dashboard")
        return ["--tls-ca", str(self.ca_file), "--client-cert", str(cert), "--client-key", str(key)]

    def _stop_dashboard(self, grace: float) -> None:
        proc, self.dashboard = self.dashboard, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    # -- client side -------------------------------------------------------------------------

    def client_config_dict(self, role: str = "user") -> dict[str, object]:
        config: dict[str, object] = {
            "scheduler": self.addresses("job-scheduler"),
            "resource_manager": self.addresses("resource-manager"),
            "token": self.tokens[role],
            # Whoever started the cluster is its admin from the CLI (`shoal hosts drain`).
            "admin_token": self.tokens["admin"],
            "state_dir": str(self.state_dir),
            "pids": {n: s.pid for n, s in self.services.items()}
            | ({"dashboard": self.dashboard.pid} if self.dashboard else {}),
            "metrics": self.metrics_urls(),
            "dashboard": self.dashboard_url,
            "etcd": self.etcd.endpoints if self.etcd else [],
            "services": self.services_status(),
            "supervised": self.spec.supervise,
        }
        if self.supervisor_pid is not None:
            config["supervisor_pid"] = self.supervisor_pid
        pair = self.user_certificate(role) if self.spec.tls else None
        if pair is not None:
            config.update(tls_ca=str(self.ca_file), tls_cert=str(pair[0]), tls_key=str(pair[1]))
        return config

    def client_config(self, role: str = "user"):  # type: ignore[no-untyped-def]
        from shoal.client import ClientConfig

        pair = self.user_certificate(role) if self.spec.tls else None
        return ClientConfig(
            scheduler=tuple(self.addresses("job-scheduler")),
            resource_manager=tuple(self.addresses("resource-manager")),
            token=self.tokens[role],
            source=str(self.state_dir / "cluster.json"),
            tls_ca=str(self.ca_file) if pair else None,
            tls_cert=str(pair[0]) if pair else None,
            tls_key=str(pair[1]) if pair else None,
        )

    def write_client_config(self, path: Path) -> None:
        """Write the file atomically (readers, such as ``shoal cluster status``, never see half
        of it while the supervisor rewrites it after a restart)."""
        with self._lock:
            text = json.dumps(self.client_config_dict(), indent=2) + "\n"
        tmp = path.with_name(path.name + ".tmp")
        tmp.touch(mode=0o600, exist_ok=True)
        tmp.chmod(0o600)
        tmp.write_text(text)
        os.replace(tmp, path)
