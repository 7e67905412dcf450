"""The same-host lane against gRPC streams: one parameter-server round (1 learner, 1 shard, on
one host) for models of 1 MB .. 100 MB of float32 parameters, side by side in one run.

* **grpc**: the shard runs with ``--shm-lane off`` and the learner with ``shm_lane=False``:
  the gradient goes to the shard, and the new parameters come back, in 1 MiB gRPC chunks.
* **shm**: the default: the gradient and the new parameters move through the learner's
  shared-memory segment; the SyncStep stream carries only the two headers.

A round is the learner's ``GrpcBackend.sync()`` (send, the shard's sum, commit and SGD step
with momentum, receive), timed in the learner; the median of ``--rounds`` after two warm-up
rounds. Each model is 10 tensors of equal size.

    .venv/bin/python bench/bench_lane.py [--sizes-mb 1 10 100] [--rounds 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync import cpu_model, start_shards

WARMUP = 2
TENSORS = 10


def learner(size_mb: float, rounds: int, job: str, coordinator: str, lane: bool, out: Any) -> None:
    torch.set_num_threads(1)
    from shoal.learner.backend import (
        Contribution,
        OptimizerSpec,
        TensorSpec,
        TrainingPlan,
        TrainingSetup,
    )
    from shoal.learner.grpc_backend import GrpcBackend

    numel = int(size_mb * 2**20 / 4 / TENSORS)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(numel, generator=g) * 0.01 for _ in range(TENSORS)]
    grads = [torch.randn(numel, generator=g) * 0.01 for _ in range(TENSORS)]
    setup = TrainingSetup(
        plan=TrainingPlan(epochs=1, batch_size=1, num_samples=100_000),
        optimizer=OptimizerSpec("SGD", {"lr": 0.01, "momentum": 0.9}),
        param_specs=tuple(TensorSpec.of(f"p{i}", p) for i, p in enumerate(params)),
        buffer_specs=(),
        params=params,
        buffers=[],
    )
    backend = GrpcBackend(job_id=job, learner_id="l0", coordinator=coordinator, shm_lane=lane)
    backend.initialize(setup)
    times = []
    for _ in range(rounds + WARMUP):
        a = backend.next_assignment()
        assert a is not None and not a.retire
        if a.pull_parameters:
            backend.pull_parameters()
        start = time.perf_counter()
        result = backend.sync(a, Contribution(grads, 1, 1.0, []))
        times.append(time.perf_counter() - start)
    used = sum(s.lane.rounds for s in backend._shards if s.lane is not None)
    final = hashlib.sha256(torch.cat([p.reshape(-1) for p in result.params]).numpy()).hexdigest()
    backend.close()
    out.put((times[WARMUP:], used, final))


def run(size_mb: float, rounds: int, lane: bool) -> tuple[list[float], int, str]:
    import grpc

    from shoal.v1 import (
        job_pb2,
        parameter_sync_service_pb2 as ps_pb2,
        parameter_sync_service_pb2_grpc as ps_grpc,
    )

    extra = () if lane else ("--shm-lane", "off")
    procs, addresses = start_shards(1, 1.0, extra)
    job = f"lane-{size_mb}-{lane}-{time.time_ns()}"
    try:
        with grpc.insecure_channel(addresses[0]) as channel:
            ps_grpc.ParameterSyncServiceStub(channel).OpenJob(
                ps_pb2.OpenJobRequest(
                    job_id=job,
                    spec=job_pb2.JobSpec(batch_size=1, epochs=1),
                    shard_addresses=addresses,
                )
            )
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=learner, args=(size_mb, rounds, job, addresses[0], lane, out))
        p.start()
        result = out.get(timeout=600)
        p.join(timeout=60)
        return result
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 10, 100])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}")
    results: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "sizes": {}}
    print("| parameters | gRPC round (median, min) | shm round (median, min) | gRPC / shm |")
    print("|---|---|---|---|")
    for size in args.sizes_mb:
        rounds = args.rounds if size < 50 else max(3, args.rounds // 2)
        grpc_t, grpc_used, grpc_final = run(size, rounds, lane=False)
        shm_t, shm_used, shm_final = run(size, rounds, lane=True)
        assert grpc_used == 0 and shm_used == rounds + WARMUP, (grpc_used, shm_used)
        same = grpc_final == shm_final  # same inputs, same rounds: same parameters
        g, s = statistics.median(grpc_t) * 1e3, statistics.median(shm_t) * 1e3
        results["sizes"][str(size)] = {
            "grpc_s": grpc_t,
            "shm_s": shm_t,
            "grpc_median_ms": g,
            "shm_median_ms": s,
            "bit_identical": same,
        }
        print(
            f"| {size:g} MB | {g:.1f} ms ({min(grpc_t) * 1e3:.1f}) | {s:.1f} ms "
            f"({min(shm_t) * 1e3:.1f}) | {g / s:.1f}x |"
            + ("" if same else " (parameters differ!)"),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
