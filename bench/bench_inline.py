"""A small bundle as one message each way (``SHOAL_INLINE_KB``), against chunks, side by side.

One real parameter-sync shard process (``python -m shoal.param_sync``, loopback, no auth, the
same-host lane off) and, in this process, one ``GrpcBackend`` learner of the digits MLP of
examples/digits (Adam): every iteration is the backend's ``next_assignment`` (Boundary) and
``sync`` (SyncStep: the gradient out, the new parameters back) with a fixed gradient, no
model compute, so that only the data plane's fixed cost is timed (the path without overlap).
The backend's ``inline_bytes`` alternates between 0 (header, chunk, end of stream; the answer
header and chunk) and 256 KiB (one message each way) in blocks of ``--block`` iterations, in the
same job and processes, so drifts of the machine hit both alike. Prints the median wall time of
``sync`` and of a whole iteration per mode.

    PYTHONPATH=... .venv/bin/python bench/bench_inline.py [--blocks 8] [--block 100]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def digits_model() -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("digits_train", REPO / "examples/digits/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.build_model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks per mode")
    parser.add_argument("--block", type=int, default=100, help="iterations per block")
    args = parser.parse_args()

    import grpc

    from shoal.learner.backend import Contribution, OptimizerSpec, TensorSpec, TrainingPlan
    from shoal.learner.grpc_backend import GrpcBackend
    from shoal.learner.sync_types import TrainingSetup
    from shoal.v1 import (
        job_pb2,
        parameter_sync_service_pb2 as ps_pb2,
        parameter_sync_service_pb2_grpc as ps_grpc,
    )

    torch.set_num_threads(1)
    model = digits_model()
    params = [p.detach() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    iterations = 2 * args.blocks * args.block + 10
    batch = 32
    plan = TrainingPlan(epochs=1, batch_size=batch, num_samples=iterations * batch, seed=0)
    setup = TrainingSetup(
        plan=plan,
        optimizer=OptimizerSpec("Adam", {"lr": 1e-3}),
        param_specs=tuple(TensorSpec.of(n, p) for n, p in zip(names, params, strict=True)),
        buffer_specs=(),
        params=params,
        buffers=[],
    )
    grads = [torch.full_like(p, 1e-3) for p in params]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHOAL_LOG_LEVEL": "WARNING"}
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        storage = Path(tmp).as_uri()
        shard = subprocess.Popen(
            [
                *(sys.executable, "-m", "shoal.param_sync", "--shard-index", "0"),
                *("--listen", address, "--insecure-no-auth", "--storage-uri", storage),
                *("--shm-lane", "off"),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert shard.stdout is not None
            for line in shard.stdout:
                if line.startswith("LISTENING"):
                    break
            job = f"inline-{time.time_ns()}"
            with grpc.insecure_channel(address) as channel:
                ps_grpc.ParameterSyncServiceStub(channel).OpenJob(
                    ps_pb2.OpenJobRequest(
                        job_id=job,
                        spec=job_pb2.JobSpec(batch_size=batch, epochs=1, seed=0),
                        storage_uri=storage,
                        shard_addresses=[address],
                    ),
                    timeout=30,
                )
            backend = GrpcBackend(job_id=job, learner_id="l0", coordinator=address, shm_lane=False)
            backend.initialize(setup)
            times: dict[int, tuple[list[float], list[float]]] = {0: ([], []), 256: ([], [])}
            modes = [0, 256] * args.blocks
            for block, kib in enumerate([0, 256, *modes]):  # the first two: warm-up
                backend.inline_bytes = kib * 1024
                for _ in range(args.block if block >= 2 else 5):
                    t0 = time.perf_counter()
                    a = backend.next_assignment()
                    assert a is not None and not a.retire
                    t1 = time.perf_counter()
                    backend.sync(a, Contribution(grads, batch, 1.0, []))
                    t2 = time.perf_counter()
                    if block >= 2:
                        times[kib][0].append(t2 - t1)
                        times[kib][1].append(t2 - t0)
            backend.close()
        finally:
            shard.kill()
            shard.wait()
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| mode | sync (SyncStep) median ms | p90 | iteration (Boundary + SyncStep) median ms |")
    print("|---|---|---|---|")
    for kib, label in ((0, "chunks (SHOAL_INLINE_KB=0)"), (256, "inline (256 KiB)")):
        sync, whole = times[kib]
        p90 = statistics.quantiles(sync, n=10)[-1]
        print(
            f"| {label} | {statistics.median(sync) * 1e3:.2f} | {p90 * 1e3:.2f} | "
            f"{statistics.median(whole) * 1e3:.2f} |"
        )


if __name__ == "__main__":
    main()
