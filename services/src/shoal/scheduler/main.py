"""``shoal-service job-scheduler`` / ``python -m shoal.scheduler``: the job-scheduler process.

Flags (each also an environment variable; flags win), beside the server flags of
``shoal.runtime.config``; declared in :data:`SETTINGS`, from which docs/configuration.md is
generated:

==========================  =========================  ===========================================
flag                        variable                   meaning (default)
==========================  =========================  ===========================================
--resource-managers         SHOAL_RESOURCE_MANAGERS    resource-manager replicas, host:port,...
--sync-shards               SHOAL_SYNC_SHARDS          parameter-sync shards in shard order
                                                       (default: the registry the shards keep
                                                       in etcd)
--storage-uri               SHOAL_STORAGE_URI          fsspec URI of artifacts, models, metrics
                                                       (file://<cwd>/.shoal/storage)
--policy                    SHOAL_POLICY               FIFO, FAIRSHARE, PRIORITY, GOODPUT (PRIORITY)
--fair-fraction             SHOAL_FAIR_FRACTION        GOODPUT: least share of PRIORITY's (0.5)
--service-thresholds        SHOAL_SERVICE_THRESHOLDS   attained-service classes, device-s ("")
--service-decay             SHOAL_SERVICE_DECAY        weight divisor per class reached (2)
--rescale-horizon           SHOAL_RESCALE_HORIZON_S    GOODPUT: resize if gain beats pause, s (0)
--hold-time                 SHOAL_HOLD_TIME_S          anti-thrash hold after a shrink, s (30)
--resync-interval           SHOAL_RESYNC_INTERVAL_S    periodic reconcile and progress poll, s (1)
--incremental-placement     SHOAL_INCREMENTAL_PLACEMENT on (default): a cycle after an event
                                                       observes the jobs that changed and
                                                       decides with the incremental planner,
                                                       the full cycle every check interval as
                                                       the safety net; off: full cycle always
--placement-check-interval  SHOAL_PLACEMENT_CHECK_INTERVAL_S  the safety net's full cycle, s (10)
--election-ttl              SHOAL_ELECTION_TTL_S       leader lease TTL, s (5)
--max-artifact-mb           SHOAL_MAX_ARTIFACT_MB      artifact size limit, MiB (1024)
--max-user-priority         SHOAL_MAX_USER_PRIORITY    highest priority a user may set (1000000)
--history-limit             SHOAL_HISTORY_LIMIT        allocation events kept per job (1000)
--max-learner-failures      SHOAL_MAX_LEARNER_FAILURES failures without progress before FAILED (3)
--stop-grace                SHOAL_STOP_GRACE_S         SIGTERM-to-SIGKILL grace of StopLearner (10)
--retire-timeout            SHOAL_RETIRE_TIMEOUT_S     retiring learner is stopped after, s (600)
--finish-grace              SHOAL_FINISH_GRACE_S       learners of a finished job stopped after (30)
--call-timeout              SHOAL_CALL_TIMEOUT_S       deadline of calls to other services (10)
--stall-timeout             SHOAL_STALL_TIMEOUT_S      a RUNNING/RECOVERING job with no committed
                                                       iteration for this long is retried from
                                                       its latest checkpoint, s (300; 0: never)
--stall-notice              SHOAL_STALL_NOTICE_S       a RUNNING job with no committed iteration
                                                       this long says "stalled" in its reason,
                                                       s (30; 0: never)
--max-recoveries            SHOAL_MAX_RECOVERIES       such automatic retries before FAILED (3)
--coordinator-grace         SHOAL_COORDINATOR_GRACE_S  a job whose coordinator shard is
                                                       unreachable this long is RECOVERING, s (2)
--coordinator-failover      SHOAL_COORDINATOR_FAILOVER on (default): then the next shard takes
                                                       a parameter-server job's coordinator role
                                                       over, no rewind; off: latest checkpoint
--learner-signing-key       SHOAL_LEARNER_SIGNING_KEY  Ed25519 private key (PEM) that signs each
                                                       learner's credential (default: a new key
                                                       per process, published in etcd)
--learner-token-ttl         SHOAL_LEARNER_TOKEN_TTL_S  longest life of a learner credential, s
                                                       (2592000: 30 days)
--artifact-quota-mb         SHOAL_ARTIFACT_QUOTA_MB    bytes of artifacts one user may store, MiB
                                                       (10240; admins have no quota)
--trace-every               SHOAL_TRACE_EVERY          learners trace their first iteration and
                                                       every N-th (0: only the first; default:
                                                       the learners' own, 100)
--collective-timeout        SHOAL_COLLECTIVE_TIMEOUT_S collective-mode learners abort a collective
                                                       after, s (default: the learners' own, 30)
==========================  =========================  ===========================================

Without ``--etcd`` the state is kept in memory (one replica, nothing survives a restart).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.contract import environment
from shoal.contract.errors import InvalidField
from shoal.runtime import metrics, telemetry
from shoal.runtime.auth import (
    DEFAULT_LEARNER_TOKEN_TTL_S,
    LearnerTokenSigner,
    publish_learner_key,
)
from shoal.runtime.config import (
    MiB,
    ServerConfig,
    add_server_flags,
    etcd_store,
    parse_host_port,
    parse_number,
    server_config_from_args,
)
from shoal.runtime.election import LeaderElection, Leadership
from shoal.runtime.server import RunningServer
from shoal.runtime.service import follow_leader, lead_forever, run_service
from shoal.runtime.settings import Setting, add_settings
from shoal.runtime.store import MemoryStore, Store
from shoal.scheduler.artifacts import ArtifactStore, Storage
from shoal.scheduler.health import HealthConfig
from shoal.scheduler.jobs import MAX_PRIORITY
from shoal.scheduler.metrics import SchedulerMetrics
from shoal.scheduler.placement import PlacementConfig
from shoal.scheduler.policy import Policy
from shoal.scheduler.reconcile import ELECTION, Peers, ReconcileConfig, Reconciler
from shoal.scheduler.service import ERRORS, ApiConfig, JobApi, binding
from shoal.scheduler.store import JobTable

__all__ = ["SETTINGS", "SchedulerConfig", "build_parser", "config_from_args", "main", "serve"]

log = logging.getLogger(__name__)

SERVICE = "job-scheduler"


def _on_off(name: str, value: str) -> bool:
    text = (value or "").strip().lower()
    if text not in ("on", "off"):
        raise InvalidField(name, value, "must be 'on' or 'off'")
    return text == "on"


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the job-scheduler process needs; validated on construction."""

    server: ServerConfig
    resource_managers: tuple[str, ...]
    sync_shards: tuple[str, ...]
    storage_uri: str
    policy: Policy = Policy.PRIORITY
    hold_time_s: float = 30.0
    fair_fraction: float = 0.5
    service_thresholds: tuple[float, ...] = ()
    service_decay: int = 2
    rescale_horizon_s: float = 0.0
    resync_interval_s: float = 1.0
    incremental_placement: bool = True
    placement_check_interval_s: float = 10.0
    election_ttl_s: float = 5.0
    max_artifact_bytes: int = 1024 * MiB
    max_user_priority: int = MAX_PRIORITY
    history_limit: int = 1000
    max_learner_failures: int = 3
    stop_grace_s: float = 10.0
    retire_timeout_s: float = 600.0
    finish_grace_s: float = 30.0
    call_timeout_s: float = 10.0
    stall_timeout_s: float = 300.0
    stall_notice_s: float = 30.0
    max_recoveries: int = 3
    coordinator_grace_s: float = 2.0
    coordinator_failover: bool = True
    learner_signing_key: str | None = None
    learner_token_ttl_s: float = DEFAULT_LEARNER_TOKEN_TTL_S
    artifact_quota_bytes: int = 10 * 1024 * MiB
    trace_every: int | None = None
    collective_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not self.resource_managers:
            raise InvalidField("resource_managers", "", "must name at least one host:port")
        for address in self.resource_managers:
            parse_host_port("resource_managers", address)
        if not self.sync_shards and not self.server.etcd_endpoints:
            raise InvalidField(
                "sync_shards", "", "must name at least one host:port (or use --etcd: registry)"
            )
        for address in self.sync_shards:
            parse_host_port("sync_shards", address)
        if self.learner_signing_key is not None and not Path(self.learner_signing_key).is_file():
            raise InvalidField(
                "learner_signing_key", self.learner_signing_key, "is not a readable file"
            )
        if len(set(self.sync_shards)) != len(self.sync_shards):
            raise InvalidField("sync_shards", ",".join(self.sync_shards), "has duplicates")
        if not self.storage_uri:
            raise InvalidField("storage_uri", self.storage_uri, "must not be empty")
        if not 0.0 <= self.fair_fraction <= 1.0:
            raise InvalidField("fair_fraction", self.fair_fraction, "must be in 0..1")
        previous = 0.0
        for t in self.service_thresholds:
            if not (math.isfinite(t) and t > previous):
                raise InvalidField(
                    "service_thresholds",
                    ",".join(f"{x:g}" for x in self.service_thresholds),
                    "must be finite device-seconds > 0, each greater than the one before",
                )
            previous = t
        if not 1 <= self.service_decay <= 1000:
            raise InvalidField("service_decay", self.service_decay, "must be in 1..1000")
        for name, low, high in (
            ("hold_time_s", 0.0, 86400.0),
            ("rescale_horizon_s", 0.0, 7 * 86400.0),
            ("resync_interval_s", 0.01, 3600.0),
            ("placement_check_interval_s", 0.01, 86400.0),
            ("election_ttl_s", 1.0, 600.0),
            ("stop_grace_s", 0.0, 3600.0),
            ("retire_timeout_s", 1.0, 86400.0),
            ("finish_grace_s", 0.0, 86400.0),
            ("call_timeout_s", 0.1, 600.0),
            ("stall_timeout_s", 0.0, 7 * 86400.0),
            ("stall_notice_s", 0.0, 7 * 86400.0),
            ("coordinator_grace_s", 0.0, 3600.0),
            ("collective_timeout_s", 1.0, 3600.0),
            ("learner_token_ttl_s", 60.0, 366 * 86400.0),
        ):
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise InvalidField(name, value, f"must be in {low:g}..{high:g}")
        for name, low, high in (
            ("max_artifact_bytes", 1, 1 << 40),
            ("artifact_quota_bytes", 1, 1 << 50),
            ("max_user_priority", 1, MAX_PRIORITY),
            ("history_limit", 1, 1_000_000),
            ("max_learner_failures", 1, 1_000_000),
            ("max_recoveries", 0, 1000),
            ("trace_every", 0, 1 << 40),
        ):
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise InvalidField(name, value, f"must be in {low}..{high}")


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in (text or "").split(",") if a.strip())


SETTINGS: tuple[Setting, ...] = (
    Setting("--resource-managers", "SHOAL_RESOURCE_MANAGERS", "", "resource-manager addresses"),
    Setting("--sync-shards", "SHOAL_SYNC_SHARDS", "", "parameter-sync shard addresses, in order"),
    Setting(
        "--storage-uri",
        "SHOAL_STORAGE_URI",
        lambda: (Path.cwd() / ".shoal" / "storage").as_uri(),
        "fsspec storage URI",
        shown_default="file://<cwd>/.shoal/storage",
    ),
    Setting("--policy", "SHOAL_POLICY", "PRIORITY", "FIFO, FAIRSHARE, PRIORITY or GOODPUT"),
    Setting("--fair-fraction", "SHOAL_FAIR_FRACTION", "0.5", "GOODPUT: least share of fair, 0..1"),
    Setting(
        "--service-thresholds",
        "SHOAL_SERVICE_THRESHOLDS",
        "",
        "attained-service class thresholds, device-seconds, increasing (empty: off)",
    ),
    Setting("--service-decay", "SHOAL_SERVICE_DECAY", "2", "weight divisor per service class"),
    Setting(
        "--rescale-horizon",
        "SHOAL_RESCALE_HORIZON_S",
        "0",
        "GOODPUT: resize a job only if the gain over this many seconds beats its pause (0: off)",
    ),
    Setting("--hold-time", "SHOAL_HOLD_TIME_S", "30", "anti-thrash hold time, seconds"),
    Setting("--resync-interval", "SHOAL_RESYNC_INTERVAL_S", "1", "resync interval, seconds"),
    Setting(
        "--incremental-placement",
        "SHOAL_INCREMENTAL_PLACEMENT",
        "on",
        "on: after an event observe only the jobs that changed and decide with the "
        "incremental planner, the full cycle every --placement-check-interval as the safety "
        "net (a divergence is logged, the full plan wins); off: the full cycle every cycle",
    ),
    Setting(
        "--placement-check-interval",
        "SHOAL_PLACEMENT_CHECK_INTERVAL_S",
        "10",
        "with --incremental-placement on: seconds between the safety net's full cycles "
        "(observe every record, the full plan, compared with the incremental view)",
    ),
    Setting("--election-ttl", "SHOAL_ELECTION_TTL_S", "5", "leader lease TTL, seconds"),
    Setting("--max-artifact-mb", "SHOAL_MAX_ARTIFACT_MB", "1024", "artifact size limit, MiB"),
    Setting("--max-user-priority", "SHOAL_MAX_USER_PRIORITY", str(MAX_PRIORITY), "user limit"),
    Setting("--history-limit", "SHOAL_HISTORY_LIMIT", "1000", "allocation events kept per job"),
    Setting("--max-learner-failures", "SHOAL_MAX_LEARNER_FAILURES", "3", "failures before FAILED"),
    Setting("--stop-grace", "SHOAL_STOP_GRACE_S", "10", "StopLearner grace, seconds"),
    Setting("--retire-timeout", "SHOAL_RETIRE_TIMEOUT_S", "600", "retire timeout, seconds"),
    Setting("--finish-grace", "SHOAL_FINISH_GRACE_S", "30", "finished job's learners, seconds"),
    Setting("--call-timeout", "SHOAL_CALL_TIMEOUT_S", "10", "deadline of outgoing calls, seconds"),
    Setting(
        "--stall-timeout",
        "SHOAL_STALL_TIMEOUT_S",
        "300",
        "no committed iteration this long: retry from the checkpoint, seconds (0: never)",
    ),
    Setting(
        "--stall-notice",
        "SHOAL_STALL_NOTICE_S",
        "30",
        "no committed iteration this long while the coordinator answers: the RUNNING job's "
        "reason says it is stalled, seconds (0: never)",
    ),
    Setting("--max-recoveries", "SHOAL_MAX_RECOVERIES", "3", "automatic retries before FAILED"),
    Setting(
        "--coordinator-grace",
        "SHOAL_COORDINATOR_GRACE_S",
        "2",
        "coordinator unreachable this long: RECOVERING, seconds",
    ),
    Setting(
        "--coordinator-failover",
        "SHOAL_COORDINATOR_FAILOVER",
        "on",
        "on: another shard takes a lost coordinator's role over; off: latest checkpoint",
    ),
    Setting(
        "--learner-signing-key",
        "SHOAL_LEARNER_SIGNING_KEY",
        "",
        "Ed25519 private key (PEM) signing learner credentials",
    ),
    Setting(
        "--learner-token-ttl",
        "SHOAL_LEARNER_TOKEN_TTL_S",
        str(int(DEFAULT_LEARNER_TOKEN_TTL_S)),
        "longest life of a learner credential, seconds",
    ),
    Setting(
        "--artifact-quota-mb", "SHOAL_ARTIFACT_QUOTA_MB", "10240", "artifact bytes per user, MiB"
    ),
    Setting("--trace-every", environment.TRACE_EVERY, "", "learners trace every N-th iteration"),
    Setting(
        "--collective-timeout",
        environment.COLLECTIVE_TIMEOUT_S,
        "",
        "collective-mode learners abort a collective after, seconds",
    ),
)
"""The job-scheduler's settings (docs/configuration.md is generated from them)."""


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal-service job-scheduler",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_flags(parser, env)
    add_settings(parser.add_argument_group("job-scheduler"), SETTINGS, env)
    return parser


def _policy(text: str) -> Policy:
    try:
        return Policy(text.strip().lower())
    except ValueError:
        raise InvalidField("policy", text, "must be FIFO, FAIRSHARE, PRIORITY or GOODPUT") from None


def _thresholds(text: str) -> tuple[float, ...]:
    parts = [p.strip() for p in (text or "").split(",") if p.strip()]
    return tuple(float(parse_number("service_thresholds", p, float)) for p in parts)


def config_from_args(ns: argparse.Namespace) -> SchedulerConfig:
    server = server_config_from_args(SERVICE, ns)
    return SchedulerConfig(
        server=server,
        resource_managers=_addresses(ns.resource_managers),
        sync_shards=_addresses(ns.sync_shards),
        storage_uri=ns.storage_uri,
        policy=_policy(ns.policy),
        hold_time_s=float(parse_number("hold_time_s", ns.hold_time, float)),
        fair_fraction=float(parse_number("fair_fraction", ns.fair_fraction, float)),
        service_thresholds=_thresholds(ns.service_thresholds),
        service_decay=int(parse_number("service_decay", ns.service_decay, int)),
        rescale_horizon_s=float(parse_number("rescale_horizon_s", ns.rescale_horizon, float)),
        resync_interval_s=float(parse_number("resync_interval_s", ns.resync_interval, float)),
        incremental_placement=_on_off("incremental_placement", ns.incremental_placement),
        placement_check_interval_s=float(
            parse_number("placement_check_interval_s", ns.placement_check_interval, float)
        ),
        election_ttl_s=float(parse_number("election_ttl_s", ns.election_ttl, float)),
        max_artifact_bytes=int(parse_number("max_artifact_mb", ns.max_artifact_mb, float) * MiB),
        max_user_priority=int(parse_number("max_user_priority", ns.max_user_priority, int)),
        history_limit=int(parse_number("history_limit", ns.history_limit, int)),
        max_learner_failures=int(
            parse_number("max_learner_failures", ns.max_learner_failures, int)
        ),
        stop_grace_s=float(parse_number("stop_grace_s", ns.stop_grace, float)),
        retire_timeout_s=float(parse_number("retire_timeout_s", ns.retire_timeout, float)),
        finish_grace_s=float(parse_number("finish_grace_s", ns.finish_grace, float)),
        call_timeout_s=float(parse_number("call_timeout_s", ns.call_timeout, float)),
        stall_timeout_s=float(parse_number("stall_timeout_s", ns.stall_timeout, float)),
        stall_notice_s=float(parse_number("stall_notice_s", ns.stall_notice, float)),
        max_recoveries=int(parse_number("max_recoveries", ns.max_recoveries, int)),
        coordinator_grace_s=float(parse_number("coordinator_grace_s", ns.coordinator_grace, float)),
        coordinator_failover=_on_off("coordinator_failover", ns.coordinator_failover),
        learner_signing_key=(ns.learner_signing_key or "").strip() or None,
        learner_token_ttl_s=float(parse_number("learner_token_ttl_s", ns.learner_token_ttl, float)),
        artifact_quota_bytes=int(
            parse_number("artifact_quota_mb", ns.artifact_quota_mb, float) * MiB
        ),
        trace_every=(
            int(parse_number("trace_every", ns.trace_every, int))
            if (ns.trace_every or "").strip()
            else None
        ),
        collective_timeout_s=(
            float(parse_number("collective_timeout_s", ns.collective_timeout, float))
            if (ns.collective_timeout or "").strip()
            else None
        ),
    )


async def _lead_forever(election: LeaderElection, table: JobTable, reconciler: Reconciler) -> None:
    """Campaign; lead until the leadership is lost; step down; campaign again."""

    async def term(leadership: Leadership) -> None:
        await table.become_leader(leadership.fence)
        reconciler.trigger("became leader")
        await reconciler.lead(leadership)

    await lead_forever(election, term, step_down=lambda _: table.step_down(), pause_s=0.2)


def _set_leader(table: JobTable) -> Callable[[str | None], None]:
    def on_leader(leader: str | None) -> None:
        table.leader_address = leader

    return on_leader


async def serve(config: SchedulerConfig, *, store: Store | None = None) -> None:
    """Run the job-scheduler until SIGTERM/SIGINT."""
    telemetry.setup_tracing(SERVICE)
    server = config.server
    endpoint = metrics.setup_metrics(SERVICE, server)
    own_store = store is None
    if store is None:
        if server.etcd_endpoints:
            store = etcd_store(server)
        else:
            log.warning("no --etcd: job state is kept in memory only (single replica)")
            store = MemoryStore()
    storage = Storage(config.storage_uri)
    artifacts = ArtifactStore(
        storage, max_bytes=config.max_artifact_bytes, quota_bytes=config.artifact_quota_bytes
    )
    table = JobTable(store, history_limit=config.history_limit)
    scheduler_metrics = SchedulerMetrics(table) if endpoint is not None else None
    peers = Peers(
        config.resource_managers, config.sync_shards, token=server.service_token, tls=server.tls
    )
    if config.learner_signing_key:
        signer = LearnerTokenSigner.load(config.learner_signing_key)
    else:
        signer = LearnerTokenSigner.generate()
        log.info("learner credentials are signed with a new key (id %s)", signer.kid)
    ttl = config.learner_token_ttl_s

    def mint(job_id: str, learner_id: str, start: str) -> str:
        return signer.mint(job_id=job_id, learner_id=learner_id, start=start, ttl_s=ttl)

    reconciler = Reconciler(
        table,
        peers,
        storage,
        ReconcileConfig(
            sync_shards=config.sync_shards,
            placement=PlacementConfig(
                policy=config.policy,
                hold_time=config.hold_time_s,
                fair_fraction=config.fair_fraction,
                service_thresholds=config.service_thresholds,
                service_decay=config.service_decay,
                rescale_horizon=config.rescale_horizon_s,
            ),
            resync_interval_s=config.resync_interval_s,
            incremental_placement=config.incremental_placement,
            placement_check_interval_s=config.placement_check_interval_s,
            call_timeout_s=config.call_timeout_s,
            stop_grace_s=config.stop_grace_s,
            retire_timeout_s=config.retire_timeout_s,
            finish_grace_s=config.finish_grace_s,
            max_learner_failures=config.max_learner_failures,
            learner_credentials=mint,
            trace_every=config.trace_every,
            collective_timeout_s=config.collective_timeout_s,
            health=HealthConfig(
                stall_timeout_s=config.stall_timeout_s,
                stall_notice_s=config.stall_notice_s,
                max_recoveries=config.max_recoveries,
                unreachable_grace_s=config.coordinator_grace_s,
                coordinator_failover=config.coordinator_failover,
            ),
        ),
        metrics=scheduler_metrics,
    )
    api = JobApi(
        table,
        artifacts,
        trigger=reconciler.trigger,
        peers=peers,
        config=ApiConfig(
            user_priority_limit=config.max_user_priority, call_timeout_s=config.call_timeout_s
        ),
    )
    tasks: list[asyncio.Task[None]] = []

    def started(running: RunningServer) -> None:
        candidate = server.advertise or running.address
        if running.credentials is not None:
            running.credentials.add_learner_key(signer.public_key_raw)
        election = LeaderElection(
            store, ELECTION, candidate_id=candidate, ttl=config.election_ttl_s
        )
        tasks[:] = [
            # Every service verifies learner credentials with the keys published here.
            asyncio.create_task(
                publish_learner_key(store, signer.public_key_raw, publisher=candidate),
                name="publish-learner-key",
            ),
            asyncio.create_task(_lead_forever(election, table, reconciler), name="scheduler-lead"),
            asyncio.create_task(
                follow_leader(election, _set_leader(table)), name="scheduler-observe"
            ),
        ]

    async def on_stop() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def closed() -> None:
        await peers.close()
        if own_store:
            await store.close()

    await run_service(
        server,
        [binding(api)],
        errors=ERRORS,
        credentials_store=store,
        started=started,
        stopping=on_stop,
        closed=closed,
        announce=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    env = os.environ
    parser = build_parser(env)
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = config_from_args(ns)
    except InvalidField as exc:
        print(f"shoal-service {SERVICE}: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        from shoal.runtime.main import configure_logging

        configure_logging(SERVICE)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
