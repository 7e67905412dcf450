"""Parameter-server mode: the next forward started on the parameters already received
(``SHOAL_PS_EARLY_FORWARD=on``) against after the whole answer (``off``), in interleaved
off/on pairs of one run.

The harness of ``bench_ps_overlap.py`` (``run_job``: one parameter-sync shard process on
loopback, W learner processes running ``ElasticTrainer`` with the ``"grpc"`` backend on an
MLP 64 -> width x depth -> 10 over scikit-learn's digits, global batch 256, SGD with momentum,
one thread per process, gradient streaming on). ``--lane on`` uses the same-host shared-memory
lane, ``off`` (default) gRPC as a learner on another host. Per iteration = the median gap
between consecutive commits in the job's ``metrics/iterations.jsonl`` after 5 warm-up
iterations. "Pending at forward": learner 0's ``GrpcBackend.early_tensors`` (tensors not
complete when sync returned / still pending when the next forward started / loaded by a
module's forward pre-hook), summed.

    PYTHONPATH=... python bench/bench_early_forward.py [--world 2] [--repeat 2] [--lane off]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collective import BATCH, build_model, cpu_model
from bench_ps_overlap import run_job


def bench(
    world: int, width: int, depth: int, iters: int, early: bool, lane: bool
) -> tuple[float, str]:
    """Per iteration (s) with early forward on or off, and learner 0's ``early_tensors``."""
    switches = {
        "SHOAL_SHM_LANE": "on" if lane else "off",
        "SHOAL_PS_EARLY_FORWARD": "on" if early else "off",
    }
    seconds, counters = run_job(world, width, depth, iters, switches)
    return seconds, "/".join(map(str, counters["early_tensors"]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=2, help="off/on pairs, alternating")
    parser.add_argument("--lane", choices=("on", "off"), default="off")
    args = parser.parse_args()
    params = sum(p.numel() for p in build_model(args.width, args.depth).parameters())
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}; MLP 64-{args.width}x{args.depth}-10 ({params:,} params, "
        f"{params * 4 / 2**20:.1f} MiB), global batch {BATCH}, W={args.world}, 1 shard, lane "
        f"{args.lane}; load before: {os.getloadavg()[0]:.2f}"
    )
    print("| pair | early off (ms/iter) | early on (ms/iter) | on / off | pending at forward |")
    print("|---|---|---|---|---|")
    lane = args.lane == "on"
    for i in range(args.repeat):
        off, _ = bench(args.world, args.width, args.depth, args.iters, False, lane)
        on, counts = bench(args.world, args.width, args.depth, args.iters, True, lane)
        print(
            f"| {i + 1} (load {os.getloadavg()[0]:.1f}) | {off * 1e3:.1f} | {on * 1e3:.1f} | "
            f"{on / off:.2f} | {counts} |",
            flush=True,
        )
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
