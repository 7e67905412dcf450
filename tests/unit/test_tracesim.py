"""Tests of the workload replay (shoal.scheduler.tracesim) and of `shoal simulate`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shoal.cli.main import app
from shoal.cli.simulate import throughput_lines
from shoal.scheduler.goodput import describe
from shoal.scheduler.policy import Policy
from shoal.scheduler.throughput import ThroughputModel
from shoal.scheduler.tracesim import (
    PolicyRun,
    TraceJob,
    parse_policies,
    read_trace,
    replay,
)
from shoal.v1 import job_pb2

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "bench" / "traces" / "synthetic-16gpu.csv"
HEADER = (
    "job_id,submit_s,iterations,batch,min_workers,max_workers,priority,"
    "overhead_s,compute_s,sync_s,sync_per_worker_s,rescale_pause_s"
)
# A job that slows down past 3 learners (sync per peer), alone at first, then one that scales
# (compute-bound) arrives; both ask for 8.
TWO = f"""# two jobs
{HEADER}
poor,0,3000,32,1,8,5000,0.0,1.0,0.1,0.1,10
scales,120,2000,256,1,8,5000,0.0,1.0,0.01,0.0,10
"""


def test_read_trace() -> None:
    jobs = read_trace(TWO)
    assert [j.job_id for j in jobs] == ["poor", "scales"]
    assert jobs[0].curve.iteration_time(2) == pytest.approx(0.7) and jobs[0].curve.batch == 32
    assert jobs[1].max_workers == 8 and jobs[1].rescale_pause_s == 10.0 and jobs[1].submit_s == 120


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("job_id,submit_s\na,0\n", "the header lacks column(s) iterations"),
        (f"{HEADER}\n", "the trace has no jobs"),
        (f"{HEADER}\na,0,x,1,1,1,1,0,1,0,0,0\n", "line 2: iterations ('x') must be a number"),
        (f"{HEADER}\na,0,0,1,1,1,1,0,1,0,0,0\n", "line 2: iterations (0) must be >= 1"),
        (f"{HEADER}\na,-1,1,1,1,1,1,0,1,0,0,0\n", "line 2: submit_s (-1.0) must be >= 0"),
        (f"{HEADER}\na,0,1,1,2,1,1,0,1,0,0,0\n", "line 2: max_workers (1) must be >= min_workers"),
        (f"{HEADER}\na,0,1,1,1,1,2000000,0,1,0,0,0\n", "priority (2000000) must be <= 1000000"),
        (f"{HEADER}\na,0,1,1,1,1,1,0,0,0,0,0\n", "line 2: overhead + compute (0.0 + 0.0) must"),
        (f"{HEADER}\na,0,1,1,1,1,1,0,inf,0,0,0\n", "line 2: compute_s ('inf') must be finite"),
        (
            f"{HEADER}\na,0,1,1,1,1,1,0,1,0,0,0\na,0,1,1,1,1,1,0,1,0,0,0\n",
            "line 3: job_id ('a') is given twice",
        ),
    ],
)
def test_bad_traces_name_the_line_the_column_and_the_value(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        read_trace(text)


def test_parse_policies() -> None:
    runs = parse_policies("fifo, goodput+las", (100.0,))
    assert runs == [
        PolicyRun("fifo", Policy.FIFO),
        PolicyRun("goodput+las", Policy.GOODPUT, (100.0,)),
    ]
    for bad, message in (
        ("fast", "policies ('fast') must name fifo"),
        ("fifo+las", "only +las may follow"),
        ("goodput+x", "only +las may follow"),
        ("", "must name at least one policy"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_policies(bad, (100.0,))
    with pytest.raises(ValueError, match="needs service thresholds"):
        parse_policies("priority+las", ())


def test_one_job_alone_runs_at_its_best_size() -> None:
    jobs = read_trace(f"{HEADER}\na,10,100,1,1,4,5000,0,4.0,0,0,5\n")
    result = replay(jobs, PolicyRun("fairshare", Policy.FAIRSHARE), gpus=8)
    # 4 learners: 1 s per iteration, after a 5 s start pause.
    assert result.jct == {"a": pytest.approx(105.0)}
    assert result.makespan == pytest.approx(115.0)
    assert result.worst_slowdown == pytest.approx(1.0)
    assert result.rescales == 0


def test_goodput_gives_the_devices_to_the_job_that_scales() -> None:
    jobs = read_trace(TWO)
    fair = replay(jobs, PolicyRun("fairshare", Policy.FAIRSHARE), gpus=8)
    good = replay(jobs, PolicyRun("goodput", Policy.GOODPUT), gpus=8)
    # 'poor' runs alone on 8 (the prior says it scales), then on 4 once 'scales' arrives:
    # FAIRSHARE keeps 4 and 4. GOODPUT learns from T(8) > T(4) that 'poor' is faster on fewer
    # devices, shrinks it and gives the rest to 'scales': both finish sooner.
    assert fair.jct["scales"] == pytest.approx(10 + 2000 * 0.26)
    assert good.jct["scales"] < fair.jct["scales"] * 0.9
    assert good.jct["poor"] < fair.jct["poor"] * 0.8


def test_replay_is_deterministic_and_every_job_finishes() -> None:
    jobs = read_trace(SHIPPED.read_text())
    run = PolicyRun("goodput+las", Policy.GOODPUT, (3600.0, 36000.0))
    one = replay(jobs[:15], run, gpus=16)
    two = replay(jobs[:15], run, gpus=16)
    assert one == two
    assert set(one.jct) == {j.job_id for j in jobs[:15]}
    for job in jobs[:15]:
        assert one.jct[job.job_id] >= job.alone_s(16) - 1e-6  # never faster than alone
    assert 0 < one.utilisation <= 1


def test_replay_rejects_bad_clusters() -> None:
    jobs = read_trace(TWO)
    run = PolicyRun("fifo", Policy.FIFO)
    with pytest.raises(ValueError, match=r"gpus \(0\) must be >= 1"):
        replay(jobs, run, gpus=0)
    with pytest.raises(ValueError, match=r"interval_s \(0.0\) must be > 0"):
        replay(jobs, run, gpus=4, interval_s=0.0)
    big = [TraceJob("big", 0.0, 1, 9, 9, 5000, jobs[0].curve, 0.0)]
    with pytest.raises(ValueError, match="job 'big' needs more than the 8 gpus"):
        replay(big, run, gpus=8)


# --- the CLI -----------------------------------------------------------------------------------


def test_shoal_simulate_prints_the_policies_side_by_side(tmp_path: Path) -> None:
    trace = tmp_path / "two.csv"
    trace.write_text(TWO)
    result = CliRunner().invoke(app, ["simulate", str(trace), "--gpus", "8"])
    assert result.exit_code == 0, result.output
    for name in ("fifo", "fairshare", "priority", "goodput", "priority+las", "goodput+las"):
        assert f"\n{name} " in result.output
    assert "MEAN JCT" in result.output


def test_shoal_simulate_json(tmp_path: Path) -> None:
    trace = tmp_path / "two.csv"
    trace.write_text(TWO)
    result = CliRunner().invoke(
        app,
        ["simulate", str(trace), "--gpus", "8", "--policies", "fairshare,goodput", "-o", "json"],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    by = {r["policy"]: r for r in doc["results"]}
    assert by["goodput"]["mean_jct_s"] < by["fairshare"]["mean_jct_s"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "fast"], "policies ('fast') must name"),
        (["--gpus", "0"], "gpus (0) must be >= 1"),
        (["--service-thresholds", "a"], "service_thresholds ('a') must be numbers"),
    ],
)
def test_shoal_simulate_refuses_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    trace = tmp_path / "two.csv"
    trace.write_text(TWO)
    result = CliRunner().invoke(app, ["simulate", str(trace), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_shoal_simulate_refuses_a_bad_trace(tmp_path: Path) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text("job_id\n")
    result = CliRunner().invoke(app, ["simulate", str(trace)])
    assert result.exit_code == 2 and "the header lacks column(s)" in result.output
    result = CliRunner().invoke(app, ["simulate", str(tmp_path / "missing.csv")])
    assert result.exit_code == 2 and "cannot be read" in result.output


def test_jobs_get_lines_show_measured_and_predicted_throughput() -> None:
    model = ThroughputModel(batch=64)
    for _ in range(3):
        model.observe(2, 0.5)
    job = job_pb2.Job(job_id="j", throughput=describe(model, 8, attained=120.0))
    lines = throughput_lines(job)
    assert lines[0].startswith("samples/s by learners (?: predicted): 1: ")
    assert "2: 128," in lines[0]  # measured: 64 samples / 0.5 s, no '?'
    assert "8: " in lines[0] and "?" in lines[0]
    assert "rescale pause 10 s (prior)" in lines[1] and "attained 120 device-s" in lines[1]
    assert len(lines) == 2  # no split reported by the learners
    assert throughput_lines(job_pb2.Job(job_id="j")) == []
    model.observe(2, 0.5, compute_s=0.125, sync_s=0.25)
    lines = throughput_lines(job_pb2.Job(job_id="j", throughput=describe(model, 8)))
    assert lines[2] == "learners' compute/sync s per iteration: 2: 0.125/0.25"


def test_the_rescale_horizon_saves_rescales() -> None:
    jobs = read_trace(SHIPPED.read_text())[:20]
    run = PolicyRun("goodput", Policy.GOODPUT)
    free = replay(jobs, run, gpus=16)
    costed = replay(jobs, run, gpus=16, rescale_horizon_s=1800.0)
    assert costed.rescales < free.rescales
    assert costed.mean_jct <= free.mean_jct * 1.02
