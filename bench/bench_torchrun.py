"""torchrun (TorchElastic) on the same model as bench_collective.py, for the rescale comparison.

Two elastic agents on this machine stand for two nodes (``--nnodes 1:2``, c10d rendezvous,
default settings otherwise), 2 workers each, DDP over gloo, the MLP and global batch of
``bench_collective.py``. The workers checkpoint every 10 iterations (what a torchrun user must
do: a membership change restarts every worker, which resumes from its checkpoint).

* **grow**: agent A trains alone; agent B is started (a node joins). Reported: the time from
  B's start to the first iteration of the 4-worker group, and the pause of training (the gap
  between the last iteration at 2 workers and the first at 4, minus one normal iteration).
* **node loss**: agent B and its workers are SIGKILLed. Reported: the time from the kill to
  the first iteration of the re-formed 2-worker group, and the iterations redone (those since
  the last checkpoint).

    .venv/bin/python bench/bench_torchrun.py [--width 1024]
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collective import BATCH, build_model, cpu_model, digits

CHECKPOINT_EVERY = 10
TOTAL = 3000


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    path = Path(args.checkpoint)
    if path.exists():
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    ddp = nn.parallel.DistributedDataParallel(model)
    loss_fn = nn.CrossEntropyLoss()
    x, y = digits()
    n = len(y)
    for step in range(start, TOTAL):
        first = (step * BATCH) % (n - BATCH)
        lo, hi = first + rank * BATCH // world, first + (rank + 1) * BATCH // world
        optimizer.zero_grad()
        loss_fn(ddp(x[lo:hi]), y[lo:hi]).backward()
        optimizer.step()
        if rank == 0:
            print(f"STEP {step} {world} {time.time():.6f}", flush=True)
            if (step + 1) % CHECKPOINT_EVERY == 0:
                tmp = path.with_suffix(".tmp")
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "step": step + 1,
                    },
                    tmp,
                )
                os.replace(tmp, path)
    dist.destroy_process_group()
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent(port: int, width: int, checkpoint: Path, log: Path) -> subprocess.Popen:
    torchrun = Path(sys.executable).parent / "torchrun"
    return subprocess.Popen(
        [
            str(torchrun),
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "bench",
            "--max-restarts",
            "10",
            __file__,
            "--worker",
            "--width",
            str(width),
            "--checkpoint",
            str(checkpoint),
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


def steps(*logs: Path) -> list[tuple[int, int, float]]:
    out = []
    for log in logs:
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0].endswith("STEP"):
                out.append((int(parts[1]), int(parts[2]), float(parts[3])))
    return sorted(out, key=lambda s: s[2])


def wait_for(what: str, check: Callable[[], Any], timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        port, checkpoint = free_port(), tmp / "checkpoint.pt"
        log_a, log_b = tmp / "a.log", tmp / "b.log"
        a = agent(port, args.width, checkpoint, log_a)
        b = None
        try:
            wait_for("A trains", lambda: len(steps(log_a)) >= 25)
            normal = statistics.median(
                t2 - t1 for (_, _, t1), (_, _, t2) in itertools.pairwise(steps(log_a))
            )
            joined = time.time()
            b = agent(port, args.width, checkpoint, log_b)
            first4 = wait_for(
                "a group of 4",
                lambda: next((s for s in steps(log_a, log_b) if s[1] == 4), None),
            )
            before = [s for s in steps(log_a, log_b) if s[1] == 2 and s[2] < first4[2]]
            grow_to_first = first4[2] - joined
            grow_pause = first4[2] - before[-1][2] - normal
            redone_grow = before[-1][0] + 1 - first4[0]
            wait_for("4 trains", lambda: sum(s[1] == 4 for s in steps(log_a, log_b)) >= 25)
            last4 = max(s for s in steps(log_a, log_b) if s[1] == 4)
            killed = time.time()
            os.killpg(b.pid, signal.SIGKILL)  # the node is lost: its agent and its workers
            b.wait()
            after = wait_for(
                "a group of 2 again",
                lambda: next((s for s in steps(log_a) if s[1] == 2 and s[2] > killed), None),
                timeout=600,
            )
            loss_to_first = after[2] - killed
            redone_loss = last4[0] + 1 - after[0]
        finally:
            for p in (a, b):
                if p is not None and p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    params = sum(p.numel() for p in build_model(args.width).parameters())
    print(
        f"# {time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}; torchrun --nnodes 1:2 --nproc-per-node 2 (c10d, defaults), DDP "
        f"gloo; MLP {params:,} params, global batch {BATCH}, checkpoint every "
        f"{CHECKPOINT_EVERY} iterations"
    )
    print(f"normal iteration (2 workers): {normal * 1e3:.1f} ms")
    print(
        f"grow 2 -> 4 (a node joins): first iteration at 4 after {grow_to_first:.2f} s; "
        f"training paused {grow_pause:.2f} s; iterations redone {redone_grow}"
    )
    print(
        f"node loss 4 -> 2 (SIGKILL): first iteration at 2 after {loss_to_first:.2f} s; "
        f"iterations redone {redone_loss}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
