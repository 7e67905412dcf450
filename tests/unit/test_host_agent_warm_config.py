"""--warm-learners: auto (one warm learner process per device), a number, or a clear error."""

from __future__ import annotations

import pytest

from shoal.cluster.local import ClusterSpec, ServiceProcess, service_flags
from shoal.host_agent.main import parse_config
from shoal.host_agent.warm import accepts, local_cluster_default
from shoal.runtime.errors import InvalidField

BASE = ["--host-id", "h1", "--listen", "127.0.0.1:0", "--insecure-no-auth"]


def test_warm_learners_default_to_one_per_device_and_take_a_number():
    assert parse_config(BASE, env={}).warm_learners is None  # auto
    assert parse_config([*BASE, "--warm-learners", "auto"], env={}).warm_learners is None
    assert parse_config([*BASE, "--warm-learners", "0"], env={}).warm_learners == 0
    assert parse_config(BASE, env={"SHOAL_WARM_LEARNERS": "3"}).warm_learners == 3


@pytest.mark.parametrize("value", ["many", "-1", "1025"])
def test_a_bad_warm_learners_value_is_refused_naming_the_field(value):
    with pytest.raises(InvalidField) as info:
        parse_config([*BASE, "--warm-learners", value], env={})
    assert "warm_learners" in str(info.value) and value in str(info.value)


def test_a_job_env_read_at_interpreter_or_torch_start_makes_the_start_cold():
    assert accepts({"FOO": "1", "CUDA_VISIBLE_DEVICES": "0", "SHOAL_TOKEN": "t"})
    for key in ("OMP_NUM_THREADS", "PYTHONPATH", "LD_PRELOAD", "TORCH_HOME", "MKL_NUM_THREADS"):
        assert not accepts({key: "1"})


def test_a_local_cluster_gives_one_warm_process_per_device_while_they_fit_in_memory():
    # 2 hosts x 4 devices at 256 MiB each: 2 GiB, a quarter of 8 GiB.
    assert local_cluster_default(2, 4, environ={}, available_mib=8 * 1024) == "4"
    assert local_cluster_default(2, 4, environ={}, available_mib=4 * 1024) == "2"
    assert local_cluster_default(2, 4, environ={}, available_mib=1024) == "0"
    assert local_cluster_default(2, 4, environ={}, available_mib=None) == "4"  # no figure
    # The agent's own variable, when set, is what every local agent gets (validated there).
    assert local_cluster_default(2, 4, environ={"SHOAL_WARM_LEARNERS": "0"}) == "0"
    assert local_cluster_default(2, 4, environ={"SHOAL_WARM_LEARNERS": "auto"}) == "auto"


def agent_flags(spec: ClusterSpec, tmp_path) -> list[str]:
    agent = ServiceProcess("host-1", "host-agent", "127.0.0.1:1", [], tmp_path / "log")
    return service_flags(
        agent, spec, rms="a:1", shards="b:1", schedulers="c:1", storage="x", work_dir=tmp_path
    )


def test_a_local_cluster_spec_passes_its_warm_learners_to_every_agent(tmp_path, monkeypatch):
    monkeypatch.delenv("SHOAL_WARM_LEARNERS", raising=False)
    flags = {
        warm: agent_flags(ClusterSpec(state_dir=tmp_path, warm_learners=warm), tmp_path)
        for warm in (None, 0, 3)
    }
    assert flags[0][flags[0].index("--warm-learners") + 1] == "0"
    assert flags[3][flags[3].index("--warm-learners") + 1] == "3"
    expected = local_cluster_default(2, 4)
    assert flags[None][flags[None].index("--warm-learners") + 1] == expected


def test_the_agents_declared_settings_parse_as_before() -> None:
    """The host agent's flags come from its declared settings (docs/configuration.md): the
    variables are the defaults, repeated labels add to the variable's, aliases work, and a bad
    label names the field."""
    env = {"SHOAL_HOST_LABELS": "zone=a", "SHOAL_WARM_LEARNERS": "2", "SHOAL_HOST_ID": "gpu7"}
    config = parse_config(
        ["--insecure-no-auth", "--label", "rack=3", "--resource-manager", "rm:7100"], env
    )
    assert config.labels == {"zone": "a", "rack": "3"}
    assert config.resource_managers == ("rm:7100",)
    assert (config.host_id, config.warm_learners) == ("gpu7", 2)
    assert config.work_dir.name == "shoal-host-agent-gpu7"
    with pytest.raises(InvalidField, match="label"):
        parse_config(["--insecure-no-auth", "--label", "no-equals"], {})
