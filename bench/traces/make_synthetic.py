"""Generate bench/traces/synthetic-16gpu.csv, the workload `shoal simulate` ships with.

Deterministic (seeded). Three kinds of jobs, in equal numbers, by their true iteration-time
curve T(w) = overhead + compute / w + (w > 1) * (sync + sync_per_worker * (w - 1)):
  scales  compute-bound: a sync cost of a few percent, still speeding up at 16 learners;
  poor    sync grows per peer: the best world size is 3 to 5;
  flat    sync-bound tiny model: one learner is fastest.
Arrivals are a Poisson process (mean gap 150 s); a job's run time alone on one GPU is
log-uniform between 6 minutes and 3 hours; max_workers is drawn from 1, 2, 4, 8, 16 (what the
user asked for, whether or not the job scales); one job in six has priority 10000, the rest
5000; the rescale pause is 10 to 30 s.

    python bench/traces/make_synthetic.py > bench/traces/synthetic-16gpu.csv
    python bench/traces/make_synthetic.py --kinds scales > bench/traces/scales-16gpu.csv
    python bench/traces/make_synthetic.py --kinds poor > bench/traces/poor-16gpu.csv
    python bench/traces/make_synthetic.py --kinds flat > bench/traces/flat-16gpu.csv
"""

from __future__ import annotations

import argparse
import math
import random
import sys

COLUMNS = (
    "job_id,submit_s,iterations,batch,min_workers,max_workers,priority,"
    "overhead_s,compute_s,sync_s,sync_per_worker_s,rescale_pause_s"
)


KINDS = ("scales", "poor", "flat")


def main(seed: int = 17, jobs: int = 60, kinds: tuple[str, ...] = KINDS) -> None:
    rng = random.Random(seed)
    out = sys.stdout
    out.write(
        f"# synthetic workload, seed {seed}, kinds {','.join(kinds)}: "
        "bench/traces/make_synthetic.py\n"
    )
    out.write(COLUMNS + "\n")
    t = 0.0
    for i in range(jobs):
        kind = kinds[i % len(kinds)]
        if kind == "scales":
            overhead, compute = 0.01, rng.uniform(1.0, 3.0)
            sync, per = 0.03 * compute, 0.001 * compute
            batch = 256
        elif kind == "poor":
            overhead, compute = 0.01, rng.uniform(0.3, 0.8)
            sync, per = 0.1 * compute, compute / rng.uniform(9.0, 25.0)
            batch = 128
        else:
            overhead, compute = 0.005, rng.uniform(0.02, 0.05)
            sync, per = rng.uniform(0.05, 0.15), 0.005
            batch = 32
        alone = math.exp(rng.uniform(math.log(360.0), math.log(3 * 3600.0)))
        iterations = max(1, round(alone / (overhead + compute)))
        max_workers = rng.choice((1, 2, 4, 8, 16))
        priority = 10000 if rng.random() < 1 / 6 else 5000
        pause = rng.uniform(10.0, 30.0)
        out.write(
            f"{kind}-{i:02d},{t:.1f},{iterations},{batch},1,{max_workers},{priority},"
            f"{overhead:.4f},{compute:.4f},{sync:.4f},{per:.4f},{pause:.1f}\n"
        )
        t += rng.expovariate(1 / 150.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a seeded synthetic workload for shoal simulate")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--kinds", default="scales,poor,flat", help="comma list of kinds")
    ns = parser.parse_args()
    chosen = tuple(k.strip() for k in ns.kinds.split(",") if k.strip())
    unknown = [k for k in chosen if k not in ("scales", "poor", "flat")]
    if unknown or not chosen:
        parser.error(f"--kinds ({ns.kinds!r}) must name scales, poor or flat")
    main(ns.seed, ns.jobs, chosen)
