"""`shoal jobs metrics` (table, json, csv) and `shoal jobs tensorboard`, run as the real CLI
against a JobSchedulerService in process (port 0, MemoryStore, real auth) whose storage holds a
job's metrics files and whose table holds its allocation history. The event files are read back
with TensorBoard's own reader (event_accumulator)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import sys
import time
from pathlib import Path

import pytest

from shoal.client.metrics import metric_values
from tests.unit.test_scheduler_service import Bed, bed, submit, upload

__all__ = ["bed"]

SHOAL = str(Path(sys.executable).parent / "shoal")
PER_EPOCH = 4
# TensorBoard's own reader, installed by the Makefile beside the venv's site-packages (where
# it would switch on the parameter-sync shards' TensorBoard writer) and run in a subprocess.
TB_READER = Path(sys.prefix) / "tensorboard-reader"
READ_EVENTS = """
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
print(json.dumps({
    "scalars": {t: [[e.step, e.value, e.wall_time] for e in acc.Scalars(t)]
                for t in tags["scalars"]},
    "texts": {t: [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(t)]
              for t in tags["tensors"]},
}))
"""


async def read_events(run: Path) -> dict:
    """The run's scalars and texts, as TensorBoard's event_accumulator reads them."""
    if not (TB_READER / "tensorboard").is_dir():
        pytest.fail(f"TensorBoard's reader is not installed in {TB_READER} (make install)")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", READ_EVENTS, str(run),
        env={**os.environ, "PYTHONPATH": str(TB_READER)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


async def shoal(bed: Bed, *args: str, who: str = "user") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        SHOAL,
        "--endpoint",
        bed.server.address,
        "--token",
        bed.tokens[who],
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def job_with_metrics(bed: Bed) -> tuple[str, float]:
    """A job that ran 8 iterations (2 epochs of 4): 4 learners, then 2 from iteration 6 on,
    with a user metric ("grad_norm") in its epoch records too. Returns (job id, t0)."""
    job = await submit(bed, await upload(bed))
    record = await bed.table.get(job.job_id)
    assert record is not None
    await bed.table.add_allocation_event(record, 4, 4, "4 learner(s) started")
    t0 = time.time()
    folder = Path(bed.storage.path("jobs", job.job_id, "metrics"))
    folder.mkdir(parents=True)
    lines = []
    for k in range(8):
        world = 4 if k < 5 else 2
        lines.append(
            json.dumps(
                {
                    "epoch": k // PER_EPOCH,
                    "iteration": k % PER_EPOCH,
                    "generation": 1 if world == 4 else 2,
                    "world_size": world,
                    "loss": 2.0 / (k + 1),
                    "samples": 64,
                    "samples_per_second": 100.0 * world,
                    "time": t0 + 1 + k,
                }
            )
        )
    (folder / "iterations.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "epochs.jsonl").write_text(
        json.dumps({"epoch": 0, "values": {"accuracy": 0.5, "grad_norm": 3.0}, "time": t0 + 5})
        + "\n"
        + json.dumps({"epoch": 1, "values": {"accuracy": 0.75}, "time": t0 + 9})
        + "\n"
    )
    # The shrink happened after iteration 5 completed (t0 + 5.5), by the wall clock of the
    # scheduler's table: set it to that instant for the event.
    bed.table.clock = lambda: t0 + 5.5
    await bed.table.add_allocation_event(record, 2, 2, "priority of job-x changed to 10000")
    # The iteration metrics' iterations_per_epoch comes from the job's progress.
    record.job.progress.iterations_per_epoch = PER_EPOCH
    await bed.table.update(record, lambda r: None)
    return job.job_id, t0


async def test_jobs_metrics_prints_every_metric_as_json_and_csv(bed: Bed) -> None:
    job_id, _ = await job_with_metrics(bed)
    code, out, err = await shoal(bed, "-o", "json", "jobs", "metrics", job_id)
    assert code == 0, err
    data = json.loads(out)
    assert [r["global_iteration"] for r in data["iterations"]] == list(range(1, 9))
    assert data["iterations"][7]["loss"] == pytest.approx(0.25)
    assert data["iterations"][7]["world_size"] == 2
    assert data["epochs"][0] == {
        "epoch": 1,
        "time": data["epochs"][0]["time"],
        "accuracy": 0.5,
        "grad_norm": 3.0,
    }

    code, out, err = await shoal(bed, "-o", "csv", "jobs", "metrics", job_id)
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 8 and float(rows[0]["loss"]) == pytest.approx(2.0)
    assert {"global_iteration", "world_size", "loss", "samples_per_second"} <= set(rows[0])

    code, out, err = await shoal(bed, "-o", "csv", "jobs", "metrics", job_id, "--per", "epoch")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert rows[1]["grad_norm"] == ""  # not reported that epoch: an empty cell

    code, out, err = await shoal(bed, "jobs", "metrics", job_id, "--tail", "3")
    assert code == 0 and "per epoch" in out and "last 3 of 8" in out and "ACCURACY" in out


async def test_jobs_metrics_of_another_users_job_fails_in_one_line(bed: Bed) -> None:
    job_id, _ = await job_with_metrics(bed)
    code, out, err = await shoal(bed, "jobs", "metrics", job_id, who="other")
    assert code == 1 and out == ""
    assert err.strip().startswith("error: NOT_FOUND") and len(err.strip().splitlines()) == 1


async def test_csv_output_is_refused_by_commands_that_have_no_table_of_rows(bed: Bed) -> None:
    code, _, err = await shoal(bed, "-o", "csv", "jobs", "list")
    assert code == 2 and "--output csv is for `shoal jobs metrics` only" in err


async def test_tensorboard_reads_back_the_jobs_metrics_and_rescales(
    bed: Bed, tmp_path: Path
) -> None:
    job_id, t0 = await job_with_metrics(bed)
    logdir = tmp_path / "tb"
    for _ in range(2):  # written twice: the run holds every point once
        code, out, err = await shoal(bed, "jobs", "tensorboard", job_id, "--logdir", str(logdir))
        assert code == 0, err
    assert f"wrote 8 iterations of {job_id}" in out
    events = await read_events(logdir / job_id)
    scalars = events["scalars"]
    assert {
        "train/loss",
        "train/samples_per_second",
        "epoch/accuracy",
        "epoch/grad_norm",
        "allocation/workers",
    } <= set(scalars)
    loss = scalars["train/loss"]
    assert [step for step, _, _ in loss] == list(range(1, 9))
    assert [value for _, value, _ in loss] == pytest.approx([2.0 / k for k in range(1, 9)])
    assert loss[0][2] == pytest.approx(t0 + 1, abs=1e-3)  # the iteration's wall time
    assert [value for _, value, _ in scalars["train/world_size"]] == [4, 4, 4, 4, 4, 2, 2, 2]
    assert [(s, v) for s, v, _ in scalars["epoch/accuracy"]] == [(1, 0.5), (2, 0.75)]
    workers = [(s, v) for s, v, _ in scalars["allocation/workers"]]
    assert workers[-1] == (5, 2)  # after iteration 5 completed: where the rescale shows
    reasons = [r for tag, texts in events["texts"].items() if tag.startswith("allocation/reason")
               for r in texts]  # fmt: skip
    assert any("priority of job-x changed to 10000" in r for r in reasons), events["texts"]


async def test_tensorboard_of_an_unknown_job_writes_nothing(bed: Bed, tmp_path: Path) -> None:
    logdir = tmp_path / "tb"
    code, _, err = await shoal(bed, "jobs", "tensorboard", "job-nope", "--logdir", str(logdir))
    assert code == 1 and "NOT_FOUND" in err
    assert not logdir.exists()


def test_metric_values_take_every_number_of_a_message_including_maps_it_does_not_know():
    """A message the API may return tomorrow (user metrics in a map on the iteration record):
    its numbers are metrics without a change to the code that draws them."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fd = descriptor_pb2.FileDescriptorProto(name="future.proto", package="future", syntax="proto3")
    entry = descriptor_pb2.DescriptorProto(
        name="ValuesEntry", options=descriptor_pb2.MessageOptions(map_entry=True)
    )
    entry.field.add(name="key", number=1, type=9, label=1)
    entry.field.add(name="value", number=2, type=1, label=1)
    msg = fd.message_type.add(name="IterationMetric")
    msg.nested_type.append(entry)
    msg.field.add(name="epoch", number=1, type=5, label=1)
    msg.field.add(name="loss", number=5, type=1, label=1)
    msg.field.add(
        name="values", number=9, type=11, label=3, type_name=".future.IterationMetric.ValuesEntry"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("future.IterationMetric"))
    m = cls(epoch=2, loss=0.5, values={"grad_norm": 1.25, "lr": 0.1})
    assert metric_values(m, {"epoch"}) == {"loss": 0.5, "grad_norm": 1.25, "lr": 0.1}
