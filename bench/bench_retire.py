"""Retire -> device free: where the time of a shrink goes, old exit against new, in one run.

A ``LocalCluster`` (1 host x 2 simulated GPUs, 1 parameter-sync shard, 1 replica of each
service, one warm learner process per device) in a temporary directory. A job of a small MLP on
synthetic data (no dataset download, no sklearn) trains on 2 learners; then ``UpdateJob
max_workers=1`` makes the scheduler retire one of them. Every time is an event's own stamp or
the moment this process received an event, never a poll:

* **decision**: job's allocation event with 1 worker (the scheduler's clock);
* **retired**: the retired learner's ``retired at step N`` log line (its own clock: when it
  learnt RETIRE at its iteration boundary);
* **exited**: the learner's ``end_time`` in the LEARNER_EXITED event (the agent's clock, when
  it reaped the process);
* **reported**: when this process received LEARNER_EXITED on the resource manager's
  ``WatchInventory`` stream (agent heartbeat -> resource manager -> watchers);
* **free**: when it received RELEASED for that learner's allocation (the scheduler's
  ReleaseDevices, after it processed the exit).

All on one host (one clock). Each repeat runs one job of each kind, in turns, on the same
cluster: **old** sets ``LEARNER_FULL_EXIT=1`` in the job's env (the interpreter's full teardown
at exit, as every learner ended before issue 16), **new** is the default fast exit.

    .venv/bin/python bench/bench_retire.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

TRAIN = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shoal.learner import ElasticTrainer


def datasets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return TensorDataset(x, y), TensorDataset(x[:512], y[:512])


if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    trainer = ElasticTrainer(model, datasets, nn.CrossEntropyLoss(), ("SGD", {"lr": 0.05}))
    trainer.train(epochs=10000, batch_size=64, max_workers=2)
"""


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def ts(t: Any) -> float:
    return t.seconds + t.nanos / 1e9


class Inventory:
    """The resource manager's WatchInventory stream, with the time each event arrived."""

    def __init__(self, address: str, token: str) -> None:
        self.address, self.token = address, token
        self.exited: dict[str, tuple[float, Any]] = {}  # learner id -> (received, Learner)
        self.released: dict[str, float] = {}  # allocation id -> received
        self.allocation_of: dict[str, str] = {}  # learner id -> allocation id
        self.job_of: dict[str, str] = {}  # learner id -> job id
        self.changed = asyncio.Event()

    async def run(self) -> None:
        import grpc

        from shoal.runtime.channels import connect
        from shoal.v1 import resource_manager_service_pb2 as rm, resource_manager_service_pb2_grpc

        channel = connect(self.address, token=self.token, trace=False)
        stub = resource_manager_service_pb2_grpc.ResourceManagerServiceStub(channel)
        try:
            while True:
                try:
                    async for event in stub.WatchInventory(rm.WatchInventoryRequest()):
                        self._apply(rm, event, time.time())
                except grpc.aio.AioRpcError as exc:  # no leader elected yet: ask again
                    print(f"  (inventory watch: {exc.code().name}; again)", flush=True)
                    await asyncio.sleep(0.5)
        finally:
            await channel.close()

    def _apply(self, rm: Any, event: Any, now: float) -> None:
        for a in event.allocations:
            self.allocation_of.setdefault(a.learner_id, a.allocation_id)
            self.job_of.setdefault(a.learner_id, a.job_id)
        if event.kind == rm.INVENTORY_EVENT_KIND_LEARNER_EXITED:
            self.exited.setdefault(event.learner.learner_id, (now, event.learner))
        elif event.kind == rm.INVENTORY_EVENT_KIND_RELEASED:
            for a in event.allocations:
                self.released.setdefault(a.allocation_id, now)
        self.changed.set()

    async def until(self, check: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not (value := check()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {what} within {timeout:.0f} s")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                pass  # also re-checks what is not an inventory event (the caller's check)
        return value


async def one_retire(
    client: Any, inventory: Inventory, artifact: str, name: str, env: dict
) -> dict:
    from shoal.cluster.scenario import job_spec

    spec = job_spec(name, artifact, epochs=10000, batch_size=64, max_workers=2)
    spec.env.update(env)
    job = (await client.submit_job(spec)).job_id
    try:

        async def on_two() -> bool:
            return (await client.get_job(job)).progress.world_size == 2

        deadline = time.monotonic() + 300
        while not await on_two():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} never trained on 2 learners")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # some iterations at 2 (the iteration time)
        before = {
            lid for lid, j in inventory.job_of.items() if j == job and lid not in inventory.exited
        }
        t0 = time.time()
        await client.update_job(job, max_workers=1)
        gone = await inventory.until(
            lambda: [lid for lid in before if lid in inventory.exited], 120, "learner exit"
        )
        learner_id = gone[0]
        allocation = inventory.allocation_of.get(learner_id, "")
        await inventory.until(lambda: allocation in inventory.released, 60, "release")
        history = await client.allocation_history(job)
        decision = min(
            (ts(e.time) for e in history if e.workers == 1 and ts(e.time) >= t0 - 1),
            default=float("nan"),
        )
        retired = float("nan")
        async for line in client.stream_logs(job, learner_id=learner_id):
            if "retired at step" in line.text:
                retired = ts(line.time)
        metrics = (await client.get_metrics(job)).iterations
        at_two = sorted(ts(m.time) for m in metrics if m.world_size == 2 and ts(m.time) < t0)[-20:]
        gaps = [b - a for a, b in itertools.pairwise(at_two)]
        received, learner = inventory.exited[learner_id]
        return {
            "iteration": statistics.median(gaps) if gaps else float("nan"),
            "decision": decision - t0,
            "retired": retired - t0,
            "exited": ts(learner.end_time) - t0,
            "reported": received - t0,
            "free": inventory.released[allocation] - t0,
        }
    finally:
        await client.cancel_job(job)


async def main_async(repeats: int) -> list[tuple[str, dict]]:
    from shoal.client import AsyncClient
    from shoal.cluster.local import ClusterSpec, LocalCluster

    rows: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="shoal-retire-") as tmp:
        root = Path(tmp)
        model = root / "model"
        model.mkdir()
        (model / "train.py").write_text(TRAIN)
        spec = ClusterSpec(
            state_dir=root / "cluster",
            hosts=1,
            gpus_per_host=2,
            shards=1,
            replicas=1,
            warm_learners=2,
        )
        started = time.monotonic()
        cluster = await asyncio.to_thread(LocalCluster(spec).__enter__)
        try:
            print(f"cluster up in {time.monotonic() - started:.1f} s", flush=True)
            inventory = Inventory(
                cluster.addresses("resource-manager")[0], cluster.tokens["service"]
            )
            watch = asyncio.get_running_loop().create_task(inventory.run())
            async with AsyncClient(cluster.client_config()) as client:
                artifact = await client.upload_directory(model)
                for r in range(repeats):
                    for kind, env in (("old", {"LEARNER_FULL_EXIT": "1"}), ("new", {})):
                        row = await one_retire(client, inventory, artifact, f"{kind}-{r}", env)
                        rows.append((kind, row))
                        print(
                            f"  [{r}] {kind}: "
                            + ", ".join(f"{k} {v:+.3f}" for k, v in row.items())
                            + f" (load {os.getloadavg()[0]:.1f})",
                            flush=True,
                        )
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        finally:
            await asyncio.to_thread(cluster.__exit__, None, None, None)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}",
        flush=True,
    )
    rows = asyncio.run(main_async(args.repeats))
    print()
    print(
        "| exit | iteration (ms) | decision (s) | retired (s) | exited (s) | reported (s) | "
        "free (s) | retired -> exited (s) | exited -> free (s) | free - decision, in iterations |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, row in rows:
        print(
            f"| {kind} | {row['iteration'] * 1e3:.0f} | {row['decision']:.3f} | "
            f"{row['retired']:.3f} | {row['exited']:.3f} | {row['reported']:.3f} | "
            f"{row['free']:.3f} | {row['exited'] - row['retired']:.3f} | "
            f"{row['free'] - row['exited']:.3f} | "
            f"{(row['free'] - row['decision']) / row['iteration']:.1f} |"
        )
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
