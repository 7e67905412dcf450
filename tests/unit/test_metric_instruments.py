"""Service metrics without a network: the --metrics-port flag, the rescale timing of the
scheduler, the sync-round timing of a shard, and the scrape-time reader wrapper.

The real endpoints of real processes are tested in tests/integration/test_metrics.py."""

from __future__ import annotations

import logging
import socket

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader

from shoal.param_sync.metrics import SyncMetrics
from shoal.runtime.config import ServerConfig, parse_server_config
from shoal.runtime.errors import InvalidField
from shoal.runtime.metrics import observer, setup_metrics
from shoal.scheduler.metrics import RescaleTracker

# -- the flag ---------------------------------------------------------------------------------


def test_metrics_are_off_unless_a_port_is_given():
    assert parse_server_config("svc", ["--insecure-no-auth"], {}).metrics_port is None
    empty = parse_server_config("svc", ["--insecure-no-auth", "--metrics-port", ""], {})
    assert empty.metrics_port is None


def test_metrics_port_comes_from_the_flag_or_the_environment_and_zero_means_any():
    env = {"SHOAL_METRICS_PORT": "9464"}
    assert parse_server_config("svc", ["--insecure-no-auth"], env).metrics_port == 9464
    flags = ["--insecure-no-auth", "--metrics-port", "0"]
    assert parse_server_config("svc", flags, env).metrics_port == 0


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("-1", "metrics_port (-1) must be in 0..65535 (0: any free port; leave it unset"),
        ("70000", "metrics_port (70000) must be in 0..65535"),
        ("ninety", "metrics_port ('ninety') must be an integer"),
        ("9.5", "metrics_port ('9.5') must be an integer"),
    ],
)
def test_a_bad_metrics_port_is_rejected_naming_the_flag_and_the_value(value, needle):
    with pytest.raises(InvalidField) as info:
        parse_server_config("svc", ["--insecure-no-auth", "--metrics-port", value], {})
    assert needle in str(info.value)


def test_a_metrics_port_in_use_is_an_error_naming_the_flag_and_the_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = ServerConfig("svc", allow_no_auth=True, metrics_port=port)
        with pytest.raises(InvalidField) as info:
            setup_metrics("svc", config)
    assert f"metrics_port ({port}) cannot be bound on 127.0.0.1" in str(info.value)


# -- rescale timing ---------------------------------------------------------------------------


def tracker(active: set[str] | None = None) -> tuple[RescaleTracker, list[tuple[float, str]]]:
    recorded: list[tuple[float, str]] = []
    t = RescaleTracker(
        lambda seconds, direction: recorded.append((seconds, direction)),
        (lambda job: job in active) if active is not None else (lambda job: True),
    )
    return t, recorded


def test_a_grow_is_timed_from_the_decision_to_the_coordinator_reporting_the_new_size():
    t, recorded = tracker()
    t.target_changed("j1", 2, 4, now=100.0)
    t.world_size("j1", 2, now=101.0)
    t.world_size("j1", 3, now=102.0)
    assert recorded == []
    t.world_size("j1", 4, now=103.5)
    assert recorded == [(3.5, "grow")]
    t.world_size("j1", 4, now=104.0)  # already recorded: once per rescale
    assert recorded == [(3.5, "grow")]


def test_a_shrink_is_timed_the_same_way():
    t, recorded = tracker()
    t.target_changed("j1", 8, 3, now=10.0)
    t.world_size("j1", 3, now=12.0)
    assert recorded == [(2.0, "shrink")]


def test_starting_and_requeueing_a_job_are_not_rescales():
    t, recorded = tracker()
    t.target_changed("j1", 0, 4, now=0.0)
    t.world_size("j1", 4, now=5.0)
    t.target_changed("j2", 4, 4, now=0.0)
    t.target_changed("j3", 4, 2, now=0.0)
    t.target_changed("j3", 2, 0, now=1.0)  # preempted entirely before the shrink happened
    t.world_size("j3", 2, now=2.0)
    assert recorded == []
    assert t.pending == {}


def test_a_target_changed_again_keeps_the_first_decision_time_and_one_back_cancels():
    t, recorded = tracker()
    t.target_changed("j1", 2, 4, now=0.0)
    t.target_changed("j1", 4, 6, now=1.0)
    assert t.pending == {"j1": (2, 6)}
    t.world_size("j1", 6, now=5.0)
    assert recorded == [(5.0, "grow")]
    t.target_changed("j2", 4, 3, now=0.0)
    t.target_changed("j2", 3, 4, now=1.0)  # back where it was: nothing to time
    t.world_size("j2", 4, now=2.0)
    assert recorded == [(5.0, "grow")]


def test_rescales_of_jobs_that_ended_are_dropped():
    active = {"j1", "j2"}
    t, _ = tracker(active)
    t.target_changed("j1", 2, 4, now=0.0)
    active.discard("j1")
    t.target_changed("j2", 1, 2, now=1.0)
    assert t.pending == {"j2": (1, 2)}


# -- sync rounds ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def collect(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    out: dict[str, list] = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


def test_a_sync_round_is_timed_from_its_first_stream_to_its_commit_and_aborts_are_not():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    clock = Clock()
    m = SyncMetrics(clock=clock, otel_meter=provider.get_meter("test"))
    m.round_started("j1", 1, 0)
    clock.now = 0.2
    m.round_started("j1", 1, 0)  # a second learner's stream: the round began earlier
    clock.now = 0.5
    m.round_committed("j1", 1, 0)
    m.iteration_committed("j1")
    m.round_started("j1", 1, 1)
    m.round_aborted("j1", 1)  # evicted member: iteration 1 re-runs in generation 2
    clock.now = 1.0
    m.round_started("j1", 2, 1)
    clock.now = 1.25
    m.round_committed("j1", 2, 1)
    m.iteration_committed("j1")
    m.lane_stream("j1")
    m.lane_handoff_refused()
    m.generation_drift("j1")
    m.replica_snapshot("j1")
    points = collect(reader)
    (hist,) = points["shoal_sync_round_duration"]
    assert isinstance(hist, HistogramDataPoint)
    assert hist.attributes == {"job_id": "j1"}
    assert hist.count == 2 and hist.sum == pytest.approx(0.75)
    (counter,) = points["shoal_sync_iterations_committed"]
    assert counter.value == 2 and counter.attributes == {"job_id": "j1"}
    (lane,) = points["shoal_sync_lane_streams"]
    assert lane.value == 1 and lane.attributes == {"job_id": "j1"}
    (refused,) = points["shoal_sync_lane_handoffs_refused"]
    assert refused.value == 1 and not refused.attributes
    (drift,) = points["shoal_sync_generation_drifts"]
    assert drift.value == 1 and drift.attributes == {"job_id": "j1"}
    (snapshots,) = points["shoal_sync_replica_snapshots"]
    assert snapshots.value == 1 and snapshots.attributes == {"job_id": "j1"}
    provider.shutdown()


# -- the scrape-time reader -------------------------------------------------------------------


def test_an_observer_reads_again_when_the_state_changes_under_it_and_logs_other_errors(caplog):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return [(2.0, {"host": "h1"})]

    (obs,) = observer(flaky)(None)  # type: ignore[arg-type]
    assert obs.value == 2.0 and obs.attributes == {"host": "h1"}

    def broken():
        raise KeyError("gone")

    with caplog.at_level(logging.ERROR):
        assert list(observer(broken, what="shoal_x")(None)) == []  # type: ignore[arg-type]
    assert "reading shoal_x failed" in caplog.text
