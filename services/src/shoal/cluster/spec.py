"""What a local cluster starts: :class:`ClusterSpec` (validated), one :class:`ServiceProcess`
per process, and the service-specific flags each gets (:func:`service_flags`).

Part of the local cluster: :mod:`shoal.cluster.local` re-exports every name here.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from shoal.cluster.supervision import RestartPolicy, Supervision
from shoal.contract.errors import InvalidField
from shoal.host_agent.warm import local_cluster_default

SERVICE_NAMES = {
    "resource-manager": "shoal.v1.ResourceManagerService",
    "job-scheduler": "shoal.v1.JobSchedulerService",
    "parameter-sync": "shoal.v1.ParameterSyncService",
    "host-agent": "shoal.v1.HostAgentService",
}


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. Validated: bad values raise InvalidField naming the field."""

    state_dir: Path
    hosts: int = 2
    gpus_per_host: int = 4
    shards: int = 2
    replicas: int = 2  # of resource-manager and job-scheduler (leader + standby)
    heartbeat_interval_s: float = 0.5
    host_lost_after_s: float = 3.0
    election_ttl_s: float = 3.0
    policy: str = "PRIORITY"
    extra_env: dict[str, str] = field(default_factory=dict)
    dashboard: bool = False  # also serve the web dashboard (`shoal cluster up` does)
    tls: bool = False  # mutual TLS on every hop (a cluster CA in <state_dir>/tls)
    etcd_members: int = 1  # 3 for a real quorum (the chaos suite: member and quorum loss)
    supervise: bool = False  # restart crashed service processes (`shoal cluster up` does)
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    scheduler_flags: tuple[str, ...] = ()  # extra job-scheduler flags (--stall-timeout 30)
    # Warm learner processes per host agent (--warm-learners). None: SHOAL_WARM_LEARNERS if set,
    # else one per device while they fit in a quarter of the free memory
    # (shoal.host_agent.warm.local_cluster_default).
    warm_learners: int | None = None

    def __post_init__(self) -> None:
        for name, low, high in (
            ("hosts", 1, 64),
            ("gpus_per_host", 1, 16),
            ("shards", 1, 16),
            ("replicas", 1, 3),
            ("etcd_members", 1, 5),
        ):
            value = getattr(self, name)
            if not low <= value <= high:
                raise InvalidField(name, value, f"must be in {low}..{high}")
        if self.policy not in ("FIFO", "FAIRSHARE", "PRIORITY"):
            raise InvalidField("policy", self.policy, "must be FIFO, FAIRSHARE or PRIORITY")

    @property
    def capacity(self) -> int:
        return self.hosts * self.gpus_per_host


@dataclass
class ServiceProcess:
    name: str
    kind: str
    address: str
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    metrics_url: str = ""  # http://127.0.0.1:PORT/metrics
    supervision: Supervision = field(default_factory=Supervision)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def service_flags(
    svc: ServiceProcess,
    spec: ClusterSpec,
    *,
    rms: str,
    shards: str,
    schedulers: str,
    storage: str,
    work_dir: Path,
) -> list[str]:
    """The service-specific flags of each process of the local cluster."""
    if svc.kind == "resource-manager":
        return [
            "--heartbeat-interval",
            str(spec.heartbeat_interval_s),
            "--host-lost-after",
            str(spec.host_lost_after_s),
            "--election-ttl",
            str(spec.election_ttl_s),
        ]
    if svc.kind == "parameter-sync":
        index = svc.name.rsplit("-", 1)[1]
        return ["--shard-index", index, "--storage-uri", storage]
    if svc.kind == "job-scheduler":
        return [
            "--resource-managers",
            rms,
            "--sync-shards",
            shards,
            "--storage-uri",
            storage,
            "--policy",
            spec.policy,
            "--election-ttl",
            str(spec.election_ttl_s),
            *spec.scheduler_flags,
        ]
    if svc.kind == "host-agent":
        return [
            "--host-id",
            svc.name,
            "--resource-managers",
            rms,
            "--schedulers",
            schedulers,
            "--simulate-gpus",
            str(spec.gpus_per_host),
            "--work-dir",
            str(work_dir / svc.name),
            "--warm-learners",
            (
                local_cluster_default(spec.hosts, spec.gpus_per_host)
                if spec.warm_learners is None
                else str(spec.warm_learners)
            ),
        ]
    raise ValueError(svc.kind)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
