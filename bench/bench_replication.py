"""The cost of primary-backup replication on the learners' critical path: one synchronization
round of a ResNet-18-sized gradient (44.6 MiB, bench_sync.py's workload) on two parameter-sync
shard processes with ``--replication on`` and ``--replication off``, side by side in one run,
for 1 learner (the framework's 1-learner overhead) and 2 learners.

With replication on, each primary sends its summed slice to its backup before it reports
ready, and the coordinator commits the replicas with the primaries, so a round grows by the
sums' hop and one more optimizer step per shard; the learners send and receive the same bytes.
Rounds of the two variants are interleaved (``--repeats``) so that drifts of a shared machine
hit both; each number is the median round in milliseconds after two warm-up rounds.

    .venv/bin/python bench/bench_replication.py [--learners 1 2] [--rounds 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sync import bench_shoal, cpu_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-mb", type=float, default=1.0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; 2 shards; ResNet-18-sized gradient")
    rounds: dict[tuple[int, str], list[float]] = {}
    cpu: dict[tuple[int, str], list[float]] = {}
    started = time.monotonic()
    for _ in range(args.repeats):
        for world in args.learners:
            for mode in ("off", "on"):
                # (the learners drop bench_sync's two warm-up rounds themselves)
                times = bench_shoal(
                    world,
                    2,
                    args.rounds,
                    args.chunk_mb,
                    ("--replication", mode),
                    cpu.setdefault((world, mode), []),
                )
                rounds.setdefault((world, mode), []).extend(times)
    results: dict[str, dict[str, float]] = {}
    for world in args.learners:
        off = statistics.median(rounds[(world, "off")]) * 1000
        on = statistics.median(rounds[(world, "on")]) * 1000
        cpu_off = statistics.median(cpu[(world, "off")]) * 1000
        cpu_on = statistics.median(cpu[(world, "on")]) * 1000
        results[f"W={world}"] = {
            "off_ms": off,
            "on_ms": on,
            "ratio": on / off,
            "shard_cpu_off_ms": cpu_off,
            "shard_cpu_on_ms": cpu_on,
        }
        print(
            f"W={world}: round {off:.0f} ms with replication off, {on:.0f} ms on "
            f"({on / off:.2f}x; {len(rounds[(world, 'on')])} rounds each); shard CPU per round "
            f"{cpu_off:.0f} ms off, {cpu_on:.0f} ms on ({cpu_on / cpu_off:.2f}x)",
            flush=True,
        )
    print(f"took {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
