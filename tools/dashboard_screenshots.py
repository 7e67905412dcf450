"""Screenshots of the dashboard for docs/: the reference scenario (digits, 2 hosts x 4 GPUs) on
an embedded local cluster, photographed with Debian's chromium (driven by Playwright) while it
runs and when it is done.

    .venv/bin/python tools/dashboard_screenshots.py [--out docs/images] [--chromium PATH]

Writes dashboard-jobs.png (GPUs per job over time after the whole scenario), dashboard-cluster.png
(the hosts during step 3, 5/3), dashboard-job.png (job 2: loss with its rescales marked, accuracy
per epoch, learners, checkpoints, logs) and dashboard-login.png. Takes about as long as `make
demo`.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from shoal.client import Client
from shoal.cluster.local import ClusterSpec, LocalCluster
from shoal.cluster.scenario import ScenarioResult, run_scenario

ROOT = Path(__file__).resolve().parents[1]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="shoal-screens-"))
    spec = ClusterSpec(
        state_dir=state / "cluster", hosts=2, gpus_per_host=4, host_lost_after_s=30.0,
        dashboard=True,
    )  # fmt: skip
    with LocalCluster(spec) as cluster, Client(cluster.client_config()) as client:
        base = cluster.dashboard_url
        result = ScenarioResult()
        done = threading.Event()

        def scenario() -> None:
            try:
                found = run_scenario(
                    client, ROOT / "examples" / "digits", job1_epochs=6, job2_epochs=12
                )
                result.job1, result.job2 = found.job1, found.job2
            finally:
                done.set()

        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                tempfile.mkdtemp(prefix="shoal-chromium-"),
                executable_path=ns.chromium,
                headless=True,
                args=FLAGS,
                viewport={"width": 1280, "height": 800},
                device_scale_factor=1,
            )
            page = context.new_page()
            page.goto(base)
            page.wait_for_url("**/login?next=**")
            page.screenshot(path=str(ns.out / "dashboard-login.png"))
            page.fill("#token", cluster.tokens["user"])
            page.click("#login")
            page.wait_for_url(base)
            threading.Thread(target=scenario, daemon=True).start()
            # Step 3 (5/3): the cluster page with both jobs on the devices.
            cluster_page = context.new_page()
            cluster_page.goto(base + "cluster")
            while not done.is_set():
                shares = sorted(
                    j.allocated_workers
                    for j in client.list_jobs()
                    if j.state == 2  # RUNNING
                )
                if shares == [3, 5]:
                    time.sleep(3)
                    cluster_page.screenshot(
                        path=str(ns.out / "dashboard-cluster.png"), full_page=True
                    )
                    break
                time.sleep(0.5)
            done.wait()
            time.sleep(3)
            page.screenshot(path=str(ns.out / "dashboard-jobs.png"), full_page=True)
            page.goto(f"{base}jobs/{result.job2}")
            page.wait_for_selector('#epoch-charts [data-metric="accuracy"] canvas')
            time.sleep(3)
            page.screenshot(path=str(ns.out / "dashboard-job.png"), full_page=True)
            context.close()
    print(f"screenshots in {ns.out}")


if __name__ == "__main__":
    main()
