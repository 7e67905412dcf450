"""--warm-learners: auto (one warm learner process per device), a number, or a clear error."""

from __future__ import annotations

import pytest

from shoal.host_agent.main import parse_config
from shoal.host_agent.warm import accepts
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
