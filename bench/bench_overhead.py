"""Framework overhead: training throughput of the two examples with ONE learner, three ways.

* **plain**: a hand-written PyTorch loop of the same model (same seed), the same optimizer and
  learning-rate schedule, the same data order (``partition.epoch_order``) and global batch.
* **local**: ``ElasticTrainer`` standalone (the ``local`` backend, in this process).
* **grpc**: ``ElasticTrainer`` in ONE learner process (the ``grpc`` backend) against ONE real
  parameter-sync shard process (``python -m shoal.param_sync``) on loopback: every iteration
  streams the gradient to the shard, which steps the optimizer and streams the parameters back.

Workloads: the digits MLP of examples/digits (1437 samples, batch 32, Adam) and the tiny
ResNet of examples/cifar10 (``--tiny``: width 8, one block per stage; SGD + nesterov + cosine)
on a fake ``cifar-10-batches-py`` directory written by examples/cifar10/make_fake_cifar.py into
a temporary directory (nothing is downloaded). Throughput = training samples / training seconds
of an epoch (evaluation excluded), median over the epochs after each run's first (warm-up), over
``--repeats`` rounds of all the variants (interleaved, so drifts hit all of them). Every variant
runs with one intra-op thread (the learner processes get OMP_NUM_THREADS=1).

    .venv/bin/python bench/bench_overhead.py [--epochs 4] [--digits-epochs 11] [--repeats 2]

``--paired`` compares only the local backend with the plain loop, epoch by epoch in turns in
one process (each local epoch, then the same epoch of the plain loop's own model), and reports
the median of the epochs' ratios: a drift of the machine's speed during a run, which the
interleaved rounds above only average out, hits each pair alike.

    .venv/bin/python bench/bench_overhead.py --paired --workloads digits --digits-epochs 60
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
DIGITS_BATCH = 32
CIFAR_BATCH = 256
CIFAR_LR = 0.2


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"{name}_train", REPO / "examples" / name / "train.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workload(name: str, data_dir: str, epochs: int) -> dict[str, Any]:
    """Everything one run needs: the model (built after seeding), the datasets function, the
    loss, the optimizer spec, the per-epoch learning rate (or None) and the batch."""
    torch.manual_seed(0)
    if name == "digits":
        ex = load_example("digits")
        return {
            "model": ex.build_model(),
            "datasets": ex.get_datasets,
            "optimizer": ("Adam", {"lr": 0.01}),
            "schedule": None,
            "batch": DIGITS_BATCH,
        }
    ex = load_example("cifar10")
    return {
        "model": ex.resnet18(8, (1, 1, 1, 1)),
        "datasets": partial(ex.get_datasets, data_dir, None),
        "optimizer": (
            "SGD",
            {"lr": CIFAR_LR, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": True},
        ),
        "schedule": partial(ex.cosine, base_lr=CIFAR_LR, epochs=epochs),
        "batch": CIFAR_BATCH,
    }


# ------------------------------------------------------------------------------------------
# (a) plain PyTorch
# ------------------------------------------------------------------------------------------


def plain_loop(name: str, data_dir: str, epochs: int) -> Callable[[int], float]:
    """The plain loop, set up once: each call trains the epoch it is given and returns its
    samples/s."""
    from shoal.learner import partition

    w = workload(name, data_dir, epochs)
    model: nn.Module = w["model"]
    train, _ = w["datasets"]()
    x, y = train.tensors
    n = len(y)
    opt_name, opt_args = w["optimizer"]
    optimizer = getattr(torch.optim, opt_name)(model.parameters(), **opt_args)
    loss_fn = nn.CrossEntropyLoss()
    batch = w["batch"]

    def epoch(e: int) -> float:
        if w["schedule"] is not None:
            for group in optimizer.param_groups:
                group["lr"] = w["schedule"](e)
        model.train()
        t0 = time.monotonic()
        order = partition.epoch_order(n, 0, e)
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
        return n / (time.monotonic() - t0)

    return epoch


def run_plain(name: str, data_dir: str, epochs: int) -> list[float]:
    epoch = plain_loop(name, data_dir, epochs)
    return [epoch(e) for e in range(epochs)]


def run_paired(name: str, data_dir: str, epochs: int) -> tuple[list[float], list[float]]:
    """``ElasticTrainer`` with the local backend and the plain loop in turns, epoch by epoch,
    in this process: after each of the trainer's epochs (in its ``on_epoch_end``, outside
    its timed epoch) the plain loop trains the same epoch of its own model. A drift of the
    machine's speed then hits both alike (the plain loop's epochs alone vary by 25 % over a
    run on the 2-core VMs). Returns (local samples/s, plain samples/s), epoch by epoch."""
    plain = plain_loop(name, data_dir, epochs)
    plain_rates: list[float] = []
    local_rates = run_trainer(
        name, data_dir, epochs, "local", after_epoch=lambda e: plain_rates.append(plain(e))
    )
    return local_rates, plain_rates


# ------------------------------------------------------------------------------------------
# (b) ElasticTrainer standalone, (c) ElasticTrainer as a learner of a real shard
# ------------------------------------------------------------------------------------------


def run_trainer(
    name: str,
    data_dir: str,
    epochs: int,
    backend: str | None,
    after_epoch: Callable[[int], Any] | None = None,
) -> list[float]:
    from shoal.learner import ElasticTrainer

    def on_epoch_end(result: Any) -> None:
        seconds.append(result.seconds)
        if after_epoch is not None:
            after_epoch(result.epoch)

    if backend == "grpc":
        from shoal.learner import grpc_backend  # noqa: F401 - registers the "grpc" backend

    w = workload(name, data_dir, epochs)
    n = len(w["datasets"]()[0])
    seconds: list[float] = []
    trainer = ElasticTrainer(
        w["model"],
        w["datasets"],
        nn.CrossEntropyLoss(),
        w["optimizer"],
        lr_schedule=w["schedule"],
        lr_schedule_unit="epoch",
        seed=0,
        backend=backend,
        on_epoch_end=on_epoch_end,
    )
    trainer.train(epochs=epochs, batch_size=w["batch"], max_workers=1)
    return [n / s for s in seconds]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_grpc(name: str, data_dir: str, epochs: int, tmp: Path, lane: bool = False) -> list[float]:
    """One shard process, OpenJob as the scheduler would call it, one learner process; with
    ``lane`` the tensors go through the same-host shared-memory lane, else as gRPC chunks."""
    import grpc

    from shoal.v1 import (
        job_pb2,
        parameter_sync_service_pb2 as ps_pb2,
        parameter_sync_service_pb2_grpc as ps_grpc,
    )

    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "SHOAL_LOG_LEVEL": "WARNING",
    }
    address = f"127.0.0.1:{free_port()}"
    storage = (tmp / f"storage-{name}").as_uri()
    shard_log = open(tmp / f"shard-{name}.log", "w")
    shard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoal.param_sync",
            "--shard-index",
            "0",
            "--listen",
            address,
            "--insecure-no-auth",
            "--storage-uri",
            storage,
            "--shm-lane",
            "on" if lane else "off",
        ],
        stdout=subprocess.PIPE,
        stderr=shard_log,
        text=True,
        env=env,
    )
    learner = None
    try:
        assert shard.stdout is not None
        for line in shard.stdout:
            if line.startswith("LISTENING"):
                break
        else:
            raise RuntimeError(f"shard exited: {(tmp / f'shard-{name}.log').read_text()[-2000:]}")
        job = f"overhead-{name}-{time.time_ns()}"
        batch = DIGITS_BATCH if name == "digits" else CIFAR_BATCH
        with grpc.insecure_channel(address) as channel:
            ps_grpc.ParameterSyncServiceStub(channel).OpenJob(
                ps_pb2.OpenJobRequest(
                    job_id=job,
                    spec=job_pb2.JobSpec(batch_size=batch, epochs=epochs, seed=0),
                    storage_uri=storage,
                    shard_addresses=[address],
                ),
                timeout=30,
            )
        learner = subprocess.run(
            [
                sys.executable,
                __file__,
                "--learner",
                name,
                "--data-dir",
                data_dir,
                "--epochs",
                str(epochs),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={
                **env,
                "SHOAL_JOB_ID": job,
                "SHOAL_LEARNER_ID": "learner-0",
                "SHOAL_SYNC_ENDPOINTS": address,
                "SHOAL_COORDINATOR": address,
                "SHOAL_SYNC_BACKEND": "grpc",
                "SHOAL_SHM_LANE": "on" if lane else "off",
            },
        )
        for line in learner.stdout.splitlines():
            if line.startswith("RESULT "):
                return list(json.loads(line[len("RESULT ") :]))
        raise RuntimeError(f"learner failed ({learner.returncode}):\n{learner.stderr[-3000:]}")
    finally:
        shard.kill()
        shard.wait()
        shard_log.close()


# ------------------------------------------------------------------------------------------


VARIANTS = {
    "plain": "plain PyTorch loop",
    "local": "ElasticTrainer, local backend",
    "grpc": "ElasticTrainer, 1 learner + 1 shard (gRPC)",
    "lane": "ElasticTrainer, 1 learner + 1 shard (shm lane)",
}


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def paired(args: argparse.Namespace) -> int:
    """``--paired``: :func:`run_paired` ``--repeats`` times per workload (each run's first
    epoch dropped: warm-up); each epoch's ratio is the local epoch's samples/s over the plain
    epoch's right after it."""
    print(
        "| workload | run | plain samples/s (median) | local samples/s (median) "
        "| local / plain, epoch by epoch: median (min-max) |"
    )
    print("|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-overhead-") as tmp_name:
        sys.path.insert(0, str(REPO / "examples" / "cifar10"))
        from make_fake_cifar import make_fake_cifar

        data_dir = str(make_fake_cifar(Path(tmp_name) / "cifar", args.cifar_per_batch, 64))
        for repeat in range(args.repeats):
            for name in args.workloads:
                epochs = args.digits_epochs if name == "digits" else args.epochs
                local, plain = run_paired(name, data_dir, epochs)
                pairs = [a / b for a, b in zip(local[1:], plain[1:], strict=True)]
                ratios.setdefault(name, []).extend(pairs)
                print(
                    f"| {name} | {repeat + 1} | {statistics.median(plain[1:]):.0f} | "
                    f"{statistics.median(local[1:]):.0f} | {statistics.median(pairs):.3f}x "
                    f"({min(pairs):.3f}-{max(pairs):.3f}) |",
                    flush=True,
                )
    for name, values in ratios.items():
        median = statistics.median(values)
        print(f"{name}: local / plain over all {len(values)} epochs: median {median:.3f}x")
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4, help="CIFAR; the first is a warm-up")
    parser.add_argument("--digits-epochs", type=int, default=11, help="the first is a warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of all the variants")
    parser.add_argument("--cifar-per-batch", type=int, default=512, help="fake images per file")
    parser.add_argument("--workloads", nargs="+", default=["digits", "cifar10"])
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="which variants to run (plain is always run: it is the anchor)",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="only the local backend against the plain loop, epoch by epoch in turns in one "
        "process (run_paired); the median of the epochs' ratios",
    )
    parser.add_argument("--learner", help=argparse.SUPPRESS)  # internal: the learner process
    parser.add_argument("--data-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.learner:
        rates = run_trainer(args.learner, args.data_dir, args.epochs, None)
        print("RESULT " + json.dumps(rates), flush=True)
        return 0

    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; torch {torch.__version__}, 1 thread"
    )
    if args.paired:
        return paired(args)
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        sys.path.insert(0, str(REPO / "examples" / "cifar10"))
        from make_fake_cifar import make_fake_cifar

        data_dir = str(make_fake_cifar(tmp / "cifar-10-batches-py", args.cifar_per_batch, 64))
        for repeat in range(args.repeats):
            for name in args.workloads:
                epochs = args.digits_epochs if name == "digits" else args.epochs
                runs = {
                    "plain": partial(run_plain, name, data_dir, epochs),
                    "local": partial(run_trainer, name, data_dir, epochs, "local"),
                    "grpc": partial(run_grpc, name, data_dir, epochs, tmp),
                    "lane": partial(run_grpc, name, data_dir, epochs, tmp, lane=True),
                }
                chosen = ["plain", *(v for v in args.variants if v != "plain")]
                for variant, fn in ((VARIANTS[v], runs[v]) for v in chosen):
                    t0 = time.monotonic()
                    rates = fn()
                    # drop each run's first epoch (warm-up)
                    results.setdefault(name, {}).setdefault(variant, []).extend(rates[1:])
                    print(
                        f"  [{repeat}] {name:8s} {variant:44s} "
                        + " ".join(f"{r:6.0f}" for r in rates)
                        + f"  ({time.monotonic() - t0:.1f} s)",
                        flush=True,
                    )
    print()
    print("| workload | variant | samples/s (median) | min | max | vs plain | ms per batch |")
    print("|---|---|---|---|---|---|---|")
    for name, by_variant in results.items():
        batch = DIGITS_BATCH if name == "digits" else CIFAR_BATCH
        base = statistics.median(by_variant["plain PyTorch loop"])
        for variant, timed in by_variant.items():
            med = statistics.median(timed)
            print(
                f"| {name} | {variant} | {med:.0f} | {min(timed):.0f} | {max(timed):.0f} | "
                f"{med / base:.2f}x | {batch / med * 1e3:.2f} |"
            )
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if any(math.isnan(r) for v in results.values() for rs in v.values() for r in rs):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
