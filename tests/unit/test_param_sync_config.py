"""The shard's replication and probe flags: defaults, the environment, and refusals that name
the flag and the value."""

from __future__ import annotations

import pytest

from shoal.param_sync.main import parse_config
from shoal.runtime.errors import InvalidField

BASE = ["--insecure-no-auth"]


def test_replication_is_on_by_default_and_the_probe_and_promotion_have_defaults() -> None:
    config = parse_config(BASE, env={})
    assert config.replication is True
    assert (config.shard_probe_s, config.promote_after_s) == (1.0, 2.0)


def test_flags_and_environment_turn_replication_off_and_set_the_times() -> None:
    config = parse_config([*BASE, "--replication", "off", "--shard-probe", "0.5"], env={})
    assert config.replication is False and config.shard_probe_s == 0.5
    config = parse_config(BASE, env={"SHOAL_REPLICATION": "OFF", "SHOAL_PROMOTE_AFTER_S": "30"})
    assert config.replication is False and config.promote_after_s == 30.0


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--replication", "maybe"], "replication ('maybe')"),
        (["--shard-probe", "0"], "shard_probe_s (0.0)"),
        (["--shard-probe", "soon"], "shard_probe ('soon')"),
        (["--promote-after", "-1"], "promote_after_s (-1.0)"),
        (["--shm-lane", "sometimes"], "shm_lane ('sometimes')"),
        (["--dumpable", "yes please"], "dumpable ('yes please')"),
        (["--step-group-mb", "lots"], "step_group_mb ('lots')"),
        (["--step-group-mb", "-1"], "step_group_mb ('-1')"),
        (["--step-group-mb", "nan"], "step_group_mb ('nan')"),
        (["--step-group-mb", "2048"], "step_group_mb ('2048')"),
    ],
)
def test_bad_values_are_refused_naming_the_flag_and_the_value(argv: list[str], names: str) -> None:
    with pytest.raises(InvalidField) as info:
        parse_config([*BASE, *argv], env={})
    assert names in str(info.value)


def test_the_shared_memory_lane_is_on_by_default_and_turned_off_per_cluster() -> None:
    assert parse_config(BASE, env={}).shm_lane is True
    assert parse_config([*BASE, "--shm-lane", "off"], env={}).shm_lane is False
    assert parse_config(BASE, env={"SHOAL_SHM_LANE": "off"}).shm_lane is False


def test_the_shard_is_not_dumpable_unless_asked_for_debugging() -> None:
    assert parse_config(BASE, env={}).dumpable is False
    assert parse_config([*BASE, "--dumpable", "on"], env={}).dumpable is True
    assert parse_config(BASE, env={"SHOAL_SHARD_DUMPABLE": "on"}).dumpable is True


def test_the_commit_steps_in_4_mib_groups_by_default_and_0_steps_whole() -> None:
    assert parse_config(BASE, env={}).step_group_bytes == 4 * 1024 * 1024
    assert parse_config([*BASE, "--step-group-mb", "0"], env={}).step_group_bytes == 0
    config = parse_config(BASE, env={"SHOAL_STEP_GROUP_MB": "0.5"})
    assert config.step_group_bytes == 512 * 1024
