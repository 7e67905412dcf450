"""``make demo``: the reference scenario on an embedded local cluster.

Starts etcd and every service (2 hosts x 4 simulated GPUs, 2 parameter-sync shards, leader +
standby for the scheduler and the resource manager), submits the digits example twice and
replays the scenario (8 -> 4/4 -> 5/3 -> 8), prints the allocation timeline, writes the
allocation chart and both loss curves as PNG files, downloads job 2's model, and stops the
cluster. Output goes to ``demo-out/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shoal.client import Client, charts
from shoal.cluster.local import ClusterSpec, LocalCluster
from shoal.cluster.scenario import ScenarioFailed, run_scenario

ROOT = Path(__file__).resolve().parents[4]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--model-dir", type=Path, default=ROOT / "examples" / "digits")
    parser.add_argument("--job1-epochs", type=int, default=12)
    parser.add_argument("--job2-epochs", type=int, default=30)
    parser.add_argument("--kill-host", action="store_true", help="also SIGKILL a host agent")
    ns = parser.parse_args(argv)
    out: Path = ns.out
    out.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec(
        state_dir=out / "cluster", hosts=2, gpus_per_host=4, shards=2, dashboard=True
    )
    print(
        f"starting a local cluster: {spec.hosts} hosts x {spec.gpus_per_host} simulated GPUs, "
        f"{spec.shards} parameter-sync shards (logs in {out / 'cluster' / 'logs'})"
    )
    started = time.monotonic()
    with LocalCluster(spec) as cluster:
        print(f"cluster up in {time.monotonic() - started:.1f} s")
        print(
            f'watch it live: {cluster.dashboard_url} (log in with the "token" in '
            f"{cluster.state_dir / 'cluster.json'})"
        )
        with Client(cluster.client_config()) as client:
            try:
                result = run_scenario(
                    client,
                    ns.model_dir,
                    capacity=spec.capacity,
                    job1_epochs=ns.job1_epochs,
                    job2_epochs=ns.job2_epochs,
                    kill_host=(lambda: (cluster.kill("host-2"), "host-2")[1])
                    if ns.kill_host
                    else None,
                )
            except ScenarioFailed as exc:
                print(f"demo failed: {exc} (logs: {out / 'cluster' / 'logs'})", file=sys.stderr)
                return 1
            events = client.allocation_history("")
            print("\nallocation timeline (GPUs per job):")
            t0 = min(e.time.ToNanoseconds() for e in events)
            for e in sorted(events, key=lambda e: e.time.ToNanoseconds()):
                print(
                    f"  +{(e.time.ToNanoseconds() - t0) / 1e9:7.2f}s  {e.job_id:>8}  "
                    f"{e.workers} learners  ({e.reason})"
                )
            names = {
                result.job1: "job 1 (priority 5000)",
                result.job2: "job 2 (priority 5000 -> 10000)",
            }
            chart = charts.draw_allocation_chart(
                charts.allocation_series(events),
                out / "allocation.png",
                capacity=spec.capacity,
                labels=names,
            )
            curves = {}
            for job_id in (result.job1, result.job2):
                job = client.get_job(job_id)
                metrics = client.get_metrics(job_id)
                per_epoch = job.progress.iterations_per_epoch or 1
                points = charts.loss_points(metrics.iterations, per_epoch)
                curves[names[job_id]] = points
                charts.draw_loss_curves(
                    {names[job_id]: points},
                    out / f"loss-{job_id}.png",
                    title=f"{names[job_id]}: training loss",
                )
                if metrics.epochs:
                    acc = metrics.epochs[-1].values.get("accuracy")
                    if acc is not None:
                        print(f"{job_id}: final test accuracy {acc:.3f}")
            charts.draw_loss_curves(curves, out / "loss.png", title="training loss")
            size = client.download_model(result.job2, out / "job-2-model.safetensors")
            print(
                f"\nwrote {chart}, {out / 'loss.png'}, per-job loss curves, and job 2's model "
                f"({size} bytes) to {out}/"
            )
    print(f"cluster stopped; demo took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
