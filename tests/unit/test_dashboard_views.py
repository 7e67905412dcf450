"""The dashboard's pure parts: the views built from API messages (jobs table, the stacked
GPU chart, the cluster with other users' jobs hidden, learners, generic metric series and
rescale markers), the session store with an injected clock, and the settings' validation."""

from __future__ import annotations

import math

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from shoal.client.config import ConfigError
from shoal.dashboard import views
from shoal.dashboard.config import DashboardConfig, parse_args
from shoal.dashboard.sessions import SessionStore
from shoal.v1 import job_pb2, resources_pb2


def ts(seconds: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(round(seconds * 1e9))
    return t


def job(
    job_id: str, name: str = "digits", state: int = job_pb2.JOB_STATE_RUNNING, **kw
) -> job_pb2.Job:
    j = job_pb2.Job(job_id=job_id, owner="alice", state=state)
    j.spec.name = name
    j.spec.epochs = kw.pop("epochs", 5)
    j.spec.max_workers = kw.pop("max_workers", 8)
    j.spec.priority = kw.pop("priority", 5000)
    for key, value in kw.items():
        setattr(j.progress, key, value)
    return j


def alloc(t: float, job_id: str, workers: int, reason: str = "") -> job_pb2.AllocationEvent:
    return job_pb2.AllocationEvent(time=ts(t), job_id=job_id, workers=workers, reason=reason)


def it(
    epoch: int, iteration: int, world: int, loss: float, t: float = 0.0
) -> job_pb2.IterationMetric:
    return job_pb2.IterationMetric(
        epoch=epoch,
        iteration=iteration,
        world_size=world,
        loss=loss,
        samples=64,
        samples_per_second=100.0 * world,
        generation=world,
        time=ts(t),
    )


# -- jobs ---------------------------------------------------------------------------------------


def test_a_job_row_has_the_columns_of_jobs_list_and_its_progress():
    row = views.job_row(
        job("job-1", epoch=1, iterations_per_epoch=10, completed_iterations=15, last_loss=0.25)
    )
    assert row["job_id"] == "job-1" and row["state"] == "running" and not row["final"]
    assert (row["epoch"], row["epochs"]) == (2, 5)
    assert (row["completed_iterations"], row["total_iterations"]) == (15, 50)
    assert row["progress"] == pytest.approx(0.3)
    assert row["last_loss"] == 0.25
    done = views.job_row(job("job-2", state=job_pb2.JOB_STATE_COMPLETED))
    assert done["final"] and done["last_loss"] is None  # no iteration: no loss to show


def test_a_loss_that_is_not_finite_becomes_null_for_json():
    row = views.job_row(job("job-1", completed_iterations=3, last_loss=math.nan))
    assert row["last_loss"] is None


# -- GPUs per job over time ---------------------------------------------------------------------


def test_the_allocation_chart_replays_the_reference_scenario_as_stacked_steps():
    jobs = {"job-1": job("job-1", "one"), "job-2": job("job-2", "two")}
    events = [
        alloc(10, "job-1", 8),
        alloc(20, "job-2", 4),
        alloc(20, "job-1", 4),
        alloc(30, "job-1", 3),
        alloc(30.5, "job-2", 5),
        alloc(40, "job-1", 0, "job completed"),
        alloc(41, "job-2", 8),
    ]
    chart = views.allocation_chart(events, jobs, now=50, capacity=8)
    assert chart["t"] == [10, 20, 30, 30.5, 40, 41, 50]
    rows = {s["job_id"]: s["values"] for s in chart["jobs"]}
    assert rows["job-1"] == [8, 4, 3, 3, 0, 0, 0]
    assert rows["job-2"] == [0, 4, 4, 5, 5, 8, 8]
    assert [s["job_id"] for s in chart["jobs"]] == ["job-1", "job-2"]  # first seen, first drawn
    assert chart["capacity"] == 8
    assert all(a + b <= 8 for a, b in zip(rows["job-1"], rows["job-2"], strict=True))


def test_the_allocation_chart_leaves_out_jobs_the_caller_was_not_shown():
    chart = views.allocation_chart(
        [alloc(1, "job-1", 2), alloc(2, "job-x", 6)], {"job-1": job("job-1")}
    )
    assert [s["job_id"] for s in chart["jobs"]] == ["job-1"]
    assert chart["t"] == [1]
    assert views.allocation_chart([], {})["jobs"] == []


# -- the cluster --------------------------------------------------------------------------------


def host(host_id: str, holders: list[str], **kw) -> resources_pb2.Host:
    h = resources_pb2.Host(host_id=host_id, state=resources_pb2.HOST_STATE_READY, **kw)
    for i, holder in enumerate(holders):
        d = h.devices.add(device_id=f"gpu{i}", index=i, simulated=True)
        if holder:
            d.allocation.allocation_id = f"a-{host_id}-{i}"
            d.allocation.job_id = holder
            d.allocation.learner_id = f"{holder}-l{i}"
            d.allocation.host_id = host_id
            d.allocation.device_id = d.device_id
    return h


def test_the_cluster_view_shows_the_callers_jobs_and_hides_other_users_jobs():
    hosts = [
        host("h2", ["job-2", ""], draining=True, cordoned=True),
        host("h1", ["job-1", "job-9"]),
    ]
    view = views.cluster_view(hosts, {"job-1": job("job-1", "mine")})
    assert [h["host_id"] for h in view["hosts"]] == ["h1", "h2"]
    assert [h["state"] for h in view["hosts"]] == ["ready", "draining"]
    h1 = view["hosts"][0]["devices"]
    assert h1[0]["job_id"] == "job-1" and h1[0]["job_name"] == "mine"
    assert h1[0]["learner_id"] == "job-1-l0"
    assert h1[1]["busy"] and h1[1]["job_id"] == "" and h1[1]["learner_id"] == ""
    assert (view["gpus_total"], view["gpus_busy"]) == (4, 3)


def test_a_lost_host_is_shown_lost_and_not_counted_as_capacity():
    lost = host("h3", ["", ""])
    lost.state = resources_pb2.HOST_STATE_LOST
    view = views.cluster_view([lost, host("h1", [""])], {})
    assert {h["host_id"]: h["state"] for h in view["hosts"]} == {"h1": "ready", "h3": "lost"}
    assert view["gpus_total"] == 1


def test_the_learners_of_a_job_come_with_their_host_and_device():
    hosts = [host("h1", ["job-1", "job-2"]), host("h2", ["job-1"])]
    rows = views.learners_of("job-1", hosts)
    assert [(r["learner_id"], r["host_id"], r["device_id"]) for r in rows] == [
        ("job-1-l0", "h1", "gpu0"),
        ("job-1-l0", "h2", "gpu0"),
    ]


# -- metrics --------------------------------------------------------------------------------------


def test_iteration_series_draw_every_numeric_metric_the_api_returns():
    series = views.iteration_series([it(0, 0, 2, 2.0), it(0, 1, 2, 1.5), it(1, 0, 4, 1.0)], 2)
    assert series["x"] == [1, 2, 3]
    assert series["world_size"] == [2, 2, 4]
    assert set(series["series"]) == {"loss", "samples_per_second"}  # coordinates are not series
    assert series["series"]["loss"] == [2.0, 1.5, 1.0]
    later = views.iteration_series([it(1, 1, 4, 0.5)], 2, offset=3)
    assert later["x"] == [4] and later["count"] == 1


def test_epoch_series_have_one_series_per_metric_name_with_gaps_where_one_is_missing():
    epochs = [
        job_pb2.EpochMetric(epoch=0, values={"accuracy": 0.5, "test_loss": 1.0}),
        job_pb2.EpochMetric(epoch=1, values={"accuracy": 0.8}),
        job_pb2.EpochMetric(epoch=2, values={"accuracy": 0.9, "f1": 0.7}),
    ]
    got = views.epoch_series(epochs)
    assert got["x"] == [1, 2, 3]
    assert got["series"] == {
        "accuracy": [0.5, 0.8, 0.9],
        "test_loss": [1.0, None, None],
        "f1": [None, None, 0.7],
    }


def test_rescale_markers_sit_at_the_first_iteration_of_each_new_world_size():
    metrics = [it(0, 0, 8, 2.0, 1), it(0, 1, 8, 1.9, 2), it(0, 2, 4, 1.8, 3), it(1, 0, 4, 1.7, 4)]
    events = [alloc(0.5, "job-1", 8, "started"), alloc(2.5, "job-1", 4, "job-2 submitted")]
    markers = views.rescale_markers(metrics, 3, events)
    assert [(m["x"], m["from"], m["to"], m["reason"]) for m in markers] == [
        (3, 8, 4, "job-2 submitted")
    ]
    assert markers[0]["epoch_x"] == pytest.approx(2 / 3)
    # Incremental: the caller had world size 4; the next batch starts with 5.
    more = views.rescale_markers([it(1, 1, 5, 1.6, 5)], 3, previous_world=4, offset=4)
    assert [(m["x"], m["from"], m["to"]) for m in more] == [(5, 4, 5)]


# -- sessions -------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_lives_while_used_and_expires_when_idle_or_too_old():
    clock = Clock()
    store = SessionStore(idle_s=60, max_age_s=300, clock=clock)
    s = store.create(principal="alice", role="user", token="t0k3n")
    assert store.get(s.session_id) is s
    for _ in range(4):
        clock.now += 50  # used every 50 s: never idle for 60
        assert store.get(s.session_id) is s
    clock.now += 101  # 301 s after login: too old, however used
    assert store.get(s.session_id) is None
    assert store.expire() == [s] and len(store) == 0
    idle = store.create(principal="bob", role="user", token="x")
    clock.now += 61
    assert store.get(idle.session_id) is None
    assert store.get("") is None and store.get("forged") is None


def test_session_ids_and_csrf_tokens_are_random_and_the_token_is_never_in_repr():
    store = SessionStore()
    a = store.create(principal="alice", role="user", token="secret-token")
    b = store.create(principal="alice", role="user", token="secret-token")
    assert a.session_id != b.session_id and a.csrf != b.csrf
    assert len(a.session_id) >= 40
    assert "secret-token" not in repr(a) and a.csrf not in repr(a)
    assert a.check_csrf(a.csrf) and not a.check_csrf(b.csrf) and not a.check_csrf(None)


def test_the_oldest_sessions_go_beyond_the_bound():
    clock = Clock()
    store = SessionStore(max_sessions=2, clock=clock)
    first = store.create(principal="a", role="user", token="1")
    clock.now += 1
    store.create(principal="b", role="user", token="2")
    clock.now += 1
    store.create(principal="c", role="user", token="3")
    assert store.expire() == [first] and len(store) == 2


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"scheduler": ()}, "scheduler (()) must name at least one"),
        ({"scheduler": ("nohost",)}, "scheduler ('nohost') must be HOST:PORT"),
        ({"listen": "127.0.0.1:99999"}, "listen ('127.0.0.1:99999') must be HOST:PORT"),
        ({"tls_cert": "/nonexistent.pem"}, "tls_cert ('/nonexistent.pem') and tls_key (None)"),
        ({"tls_ca": "/nonexistent-ca.pem"}, "tls_ca ('/nonexistent-ca.pem') is not a readable"),
        ({"poll_interval_s": 0.0}, "poll_interval_s (0.0) must be between"),
    ],
)
def test_bad_settings_are_refused_naming_the_field_and_the_value(kwargs, needle):
    args = {"scheduler": ("127.0.0.1:7000",), **kwargs}
    with pytest.raises(ConfigError) as caught:
        DashboardConfig(**args)
    assert needle in str(caught.value)


def test_endpoints_come_from_the_flags_or_from_the_clis_config_without_its_token(tmp_path):
    config = parse_args(["--scheduler", "a:1,b:2", "--resource-manager", "c:3"], env={})
    assert config.scheduler == ("a:1", "b:2") and config.resource_manager == ("c:3",)
    assert (config.host, config.port) == ("127.0.0.1", 8480)
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"scheduler": ["s:7000"], "resource_manager": ["r:7100"], "token": "T"}')
    from_file = parse_args(["--listen", "0.0.0.0:9000"], env={"SHOAL_CONFIG": str(cluster)})
    assert from_file.scheduler == ("s:7000",) and from_file.resource_manager == ("r:7100",)
    assert "T" not in repr(from_file)  # the dashboard holds no credential
    with pytest.raises(ConfigError):
        parse_args([], env={"SHOAL_CONFIG": str(tmp_path / "missing.json")})


def test_a_finished_job_holds_no_gpu_in_the_chart_even_before_its_release_is_recorded():
    done = job("job-1", state=job_pb2.JOB_STATE_COMPLETED)
    done.end_time.CopyFrom(ts(30))
    chart = views.allocation_chart(
        [alloc(10, "job-1", 4), alloc(20, "job-2", 4)], {"job-1": done, "job-2": job("job-2")}
    )
    assert chart["t"] == [10, 20, 30]
    rows = {s["job_id"]: s["values"] for s in chart["jobs"]}
    assert rows == {"job-1": [4, 4, 0], "job-2": [0, 4, 4]}
