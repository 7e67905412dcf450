"""Parameter-server mode: gradients streamed to the shards during backward
(``SHOAL_PS_OVERLAP=on``) against after it (``off``), side by side in one run.

One parameter-sync shard process (loopback, insecure) and W learner processes running
``ElasticTrainer`` with the ``"grpc"`` backend on an MLP (64 -> width x depth -> 10, float32)
over scikit-learn's digits, global batch 256, SGD with momentum, one thread per process. The
learners talk gRPC to the shard (``SHOAL_SHM_LANE=off``: what a learner on another host does;
the same-host lane is not overlapped). Per iteration = the median gap between consecutive
commits in the job's ``metrics/iterations.jsonl`` (after 5 warm-up iterations).

    PYTHONPATH=... python bench/bench_ps_overlap.py [--world 2] [--width 1536] [--depth 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collective import (  # the shared shard/learner harness
    BATCH,
    ENV,
    WARMUP,
    Cluster,
    build_model,
    cpu_model,
    digits,
    gaps,
)


def run_learner(args: argparse.Namespace) -> int:
    import logging

    from torch.utils.data import TensorDataset

    from shoal.learner import ElasticTrainer, create_backend, grpc_backend  # noqa: F401

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    x, y = digits()
    backend = create_backend("grpc")
    trainer = ElasticTrainer(
        build_model(args.width, args.depth),
        lambda: (TensorDataset(x, y), None),
        nn.CrossEntropyLoss(),
        ("SGD", {"lr": 0.05, "momentum": 0.9}),
        backend=backend,
    )
    print("READY", flush=True)
    while not Path(args.gate).exists():
        time.sleep(0.01)
    try:
        trainer.train(epochs=args.epochs, batch_size=BATCH)
    finally:
        backend.close()
    counters = {
        "tensors_sent": getattr(backend, "tensors_sent", None),
        "early_tensors": getattr(backend, "early_tensors", None),
    }
    Path(args.history).write_text(json.dumps(counters))
    return 0


def bench(world: int, width: int, depth: int, iters: int, overlap: bool) -> tuple[float, str]:
    """Per iteration (s) with gradient streaming ``overlap`` on or off, and learner 0's
    ``tensors_sent`` (streamed in backward / in all)."""
    seconds, counters = run_job(world, width, depth, iters, {"SHOAL_PS_OVERLAP": _on(overlap)})
    sent = counters["tensors_sent"]
    return seconds, f"{sent[0]}/{sent[1]}"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def run_job(
    world: int, width: int, depth: int, iters: int, switches: dict[str, str]
) -> tuple[float, dict[str, list[int]]]:
    """One job of ``world`` learner processes with the environment ``switches`` (over gRPC
    unless they say SHOAL_SHM_LANE=on): the median seconds per iteration after the warm-up and
    learner 0's backend counters."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cluster = Cluster(tmp)
        try:
            job = f"ps-{world}-" + "-".join(f"{v}" for v in switches.values())
            epochs = -(-(iters + WARMUP + 1) // 8)  # digits: 8 iterations of 256 per epoch
            cluster.open_job(job, epochs)
            gate = tmp / "gate"
            for i in range(world):
                name = f"l{i}"
                args = [sys.executable, __file__, "--learner", "--epochs", str(epochs)]
                args += ["--width", str(width), "--depth", str(depth), "--gate", str(gate)]
                args += ["--history", str(tmp / f"{name}.json")]
                env = {
                    **ENV,
                    "SHOAL_LOG_LEVEL": "WARNING",
                    "SHOAL_JOB_ID": job,
                    "SHOAL_LEARNER_ID": name,
                    "SHOAL_COORDINATOR": cluster.address,
                    "SHOAL_SYNC_ENDPOINTS": cluster.address,
                    "SHOAL_SYNC_BACKEND": "grpc",
                    "SHOAL_SHM_LANE": "off",
                    **switches,
                }
                out = open(tmp / f"{name}.log", "w")
                cluster.learners.append(
                    subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
                )
            for i in range(world):
                while "READY" not in (tmp / f"l{i}.log").read_text():
                    time.sleep(0.05)
            gate.touch()
            for i, p in enumerate(cluster.learners):
                if p.wait(timeout=600) != 0:
                    raise RuntimeError((tmp / f"l{i}.log").read_text()[-3000:])
            records = cluster.records(job)
            counters = json.loads((tmp / "l0.json").read_text())
            return statistics.median(gaps(records[WARMUP:])), counters
        finally:
            cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--learner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gate", help=argparse.SUPPRESS)
    parser.add_argument("--history", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=1, help="off/on pairs, alternating")
    args = parser.parse_args()
    if args.learner:
        return run_learner(args)
    params = sum(p.numel() for p in build_model(args.width, args.depth).parameters())
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}; MLP 64-{args.width}x{args.depth}-10 ({params:,} params, "
        f"{params * 4 / 2**20:.1f} MiB), global batch {BATCH}, 1 shard, gRPC (lane off); "
        f"load before: {os.getloadavg()[0]:.2f}"
    )
    print(
        "| world | overlap off (ms/iter) | overlap on (ms/iter) | on / off | streamed in backward |"
    )
    print("|---|---|---|---|---|")
    for world in args.world:
        for _ in range(args.repeat):
            off, _ = bench(world, args.width, args.depth, args.iters, False)
            on, sent = bench(world, args.width, args.depth, args.iters, True)
            print(
                f"| {world} | {off * 1e3:.1f} | {on * 1e3:.1f} | {on / off:.2f} | {sent} |",
                flush=True,
            )
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
