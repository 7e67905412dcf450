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
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from shoal.client import Client
from shoal.cluster.local import ClusterSpec, LocalCluster
from shoal.cluster.scenario import job_spec

ROOT = Path(__file__).resolve().parents[1]
PAUSE_S = 20.0
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

        def wait(what: str, check, timeout: float = 600.0):  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + timeout
            while not (value := check()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out waiting for {what}")
                time.sleep(0.5)
            print(f"[{time.strftime('%X')}] {what}", flush=True)
            return value

        def held(*job_ids: str) -> tuple[int, ...]:
            return tuple(client.get_job(j).allocated_workers for j in job_ids)

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
            # The reference scenario (shoal.cluster.scenario), its steps seen by allocation.
            artifact = client.upload_directory(ROOT / "examples" / "digits")
            job1 = client.submit_job(job_spec("job-1", artifact, epochs=8, batch_size=64,
                                              max_workers=8)).job_id  # fmt: skip
            wait("1. job 1 on 8 GPUs", lambda: held(job1) == (8,))
            time.sleep(PAUSE_S)  # each step a visible plateau on the chart
            job2 = client.submit_job(job_spec("job-2", artifact, epochs=12, batch_size=64,
                                              max_workers=8)).job_id  # fmt: skip
            wait("2. fairshare 4/4", lambda: held(job1, job2) == (4, 4))
            time.sleep(PAUSE_S)
            client.update_job(job2, priority=10000)
            wait("3. priority: 3/5", lambda: held(job1, job2) == (3, 5))
            cluster_page = context.new_page()
            cluster_page.goto(base + "cluster")
            cluster_page.wait_for_selector(".device[data-job]")
            time.sleep(3)
            cluster_page.screenshot(path=str(ns.out / "dashboard-cluster.png"), full_page=True)
            final = {4, 5, 6}
            wait("job 1 done", lambda: client.get_job(job1).state in final)
            wait("4. job 2 on 8 GPUs", lambda: held(job2) == (8,) or
                 client.get_job(job2).state in final)  # fmt: skip
            wait("job 2 done", lambda: client.get_job(job2).state in final)
            time.sleep(4)
            page.screenshot(path=str(ns.out / "dashboard-jobs.png"), full_page=True)
            page.goto(f"{base}jobs/{job2}")
            page.wait_for_selector('#epoch-charts [data-metric="accuracy"] canvas')
            time.sleep(3)
            page.screenshot(path=str(ns.out / "dashboard-job.png"), full_page=True)
            context.close()
    print(f"screenshots in {ns.out}")


if __name__ == "__main__":
    main()
