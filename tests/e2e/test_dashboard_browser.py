"""The web dashboard in a real browser: Debian's chromium driven by Playwright, against the
embedded local cluster (real etcd, every service a real process, two hosts with four simulated
GPUs each, real PyTorch learners of a tiny model) and the dashboard `shoal cluster up` serves.

As a person would: log in with the token on the login page; watch the reference scenario's
allocation change live on the jobs page (job 1 alone on 8 GPUs, job 2 arrives: 4/4, job 2's
priority raised to 10000 *from job 2's page*: 5/3, job 1 cancelled from its page: job 2 on 8),
the stacked GPU chart holding every step; see a job's loss curve with its rescales marked, its
learners with host and device, its logs; be refused another user's job (the admin's), from the
page and from the API behind it; and, as the admin, see every job and drain a host from the
cluster page.

Playwright's own browser download cannot work here: it drives /usr/bin/chromium
(`apt-get install chromium`; .ci/run installs it). With SHOAL_SCREENSHOTS=DIR the main pages are
saved there as PNG (docs/images/ holds the committed ones).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.client import Client
from shoal.cluster.local import ClusterSpec, LocalCluster
from shoal.v1 import job_pb2
from tests.support import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(__file__).resolve().parent / "tiny_model"
CHROMIUM = os.environ.get("SHOAL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STEP_TIMEOUT_MS = 180_000  # learners start slowly on a loaded 2-core machine
SCREENSHOTS = os.environ.get("SHOAL_SCREENSHOTS", "")


def spec(name: str, artifact: str, *, priority: int = 5000) -> job_pb2.JobSpec:
    """A job that would run for long (it is cancelled): 7 iterations an epoch, 400 epochs."""
    return job_pb2.JobSpec(
        name=name,
        entry_point="train.py",
        artifact_id=artifact,
        batch_size=64,
        epochs=400,
        min_workers=1,
        max_workers=8,
        priority=priority,
        sync_mode=job_pb2.SYNC_MODE_PARAMETER_SERVER,
        checkpoint_every=5,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if not Path(CHROMIUM).is_file():
        pytest.fail(
            f"chromium is not installed at {CHROMIUM}: `apt-get install -y chromium` (.ci/run "
            "does it when it is missing)",
            pytrace=False,
        )
    spec_ = ClusterSpec(
        state_dir=tmp_path_factory.mktemp("dashboard") / "cluster",
        hosts=2,
        gpus_per_host=4,
        shards=1,
        replicas=1,
        # Host loss is not what this test is about: a generous grace, so that a loaded machine
        # (heartbeats late) does not take the hosts away in the middle of it.
        host_lost_after_s=30.0,
        dashboard=True,
    )
    with LocalCluster(spec_) as c:
        yield c


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="shoal-chromium-")
    try:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_FLAGS,
                viewport={"width": 1280, "height": 860},
            )
            yield context
            context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def shot(page: Any, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / f"{name}.png"), full_page=True)


def login(page: Any, base: str, token: str) -> None:
    page.goto(base)
    page.wait_for_url("**/login?next=**")
    page.fill("#token", token)
    page.click("#login")
    page.wait_for_url(base)
    page.wait_for_selector("#live.on")


def gpus_shown(page: Any, expected: dict[str, int], client: Client) -> None:
    """Wait until the jobs page's live legend shows exactly these GPUs per job."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        _wait_gpus(page, expected)
    except PlaywrightTimeout:
        legend = page.text_content("#alloc-now")
        jobs = {}
        for job_id in expected:
            j = client.get_job(job_id)
            state = job_pb2.JobState.Name(j.state)
            jobs[job_id] = (state, j.state_reason, j.allocated_workers, j.progress.world_size)
        raise AssertionError(
            f"the page never showed {expected}: legend {legend!r}; the API says (state, "
            f"reason, allocated, world size) {jobs}"
        ) from None


def _wait_gpus(page: Any, expected: dict[str, int]) -> None:
    # Compared as sorted (job, GPUs) pairs: the legend lists jobs in the chart's order.
    page.wait_for_function(
        """(expected) => {
            const shown = [];
            for (const li of document.querySelectorAll('#alloc-now li')) {
                const n = Number(li.dataset.gpus);
                if (n) shown.push([li.dataset.job, n]);
            }
            shown.sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
            return JSON.stringify(shown) === JSON.stringify(expected);
        }""",
        arg=sorted([job_id, gpus] for job_id, gpus in expected.items()),
        timeout=STEP_TIMEOUT_MS,
    )


def chart_steps(page: Any, job1: str, job2: str) -> list[tuple[int, int]]:
    """The (job 1, job 2) GPUs at each x of the stacked chart, as uPlot holds them: the
    cumulative series minus the one below."""
    data = page.evaluate(
        """() => {
            const u = window.shoal.charts.alloc;
            return {labels: u.series.slice(1).map(s => s.label), data: u.data.slice(1)};
        }"""
    )
    index = {label.split(" ")[0]: i for i, label in enumerate(data["labels"])}
    rows = data["data"]

    def own(i: int, k: int) -> int:
        return int(rows[i][k] - (rows[i - 1][k] if i else 0))

    steps = []
    for k in range(len(rows[0])):
        step = (own(index[job1], k), own(index[job2], k) if job2 in index else 0)
        if not steps or steps[-1] != step:
            steps.append(step)
    return steps


def test_the_dashboard_shows_the_reference_scenario_live_and_acts_for_its_user(
    cluster: LocalCluster, browser: Any
) -> None:
    base = cluster.dashboard_url
    page = browser.new_page()
    page.set_default_timeout(STEP_TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", lambda dialog: dialog.accept())
    with Client(cluster.client_config()) as client, Client(cluster.client_config("admin")) as root:
        artifact = client.upload_directory(MODEL)
        jobs: list[str] = []
        try:
            # Log in on the login page, as a person would (the page asked for it).
            login(page, base, cluster.tokens["user"])
            assert page.text_content("#whoami") == (os.environ.get("USER", "you") or "you")

            # 1. Job 1 alone: all 8 GPUs, shown live.
            job1 = client.submit_job(spec("job-1", artifact)).job_id
            jobs.append(job1)
            gpus_shown(page, {job1: 8}, client)
            page.wait_for_selector(f'#jobs tr[data-job="{job1}"][data-state="running"]')

            # 2. Job 2 (same priority) arrives: fairshare 4/4.
            job2 = client.submit_job(spec("job-2", artifact)).job_id
            jobs.append(job2)
            gpus_shown(page, {job1: 4, job2: 4}, client)

            # 3. Job 2's priority to 10000 from its page: 10000/15000 of 8 -> 5, job 1 3.
            page.click(f'#jobs a[href="/jobs/{job2}"]')
            page.wait_for_selector("#job-actions:not([hidden])")
            page.fill("#priority", "10000")
            page.click("#set-priority")
            page.wait_for_selector("#action-result.ok")
            assert "priority 10000" in page.text_content("#action-result")
            page.wait_for_selector('[data-fact="priority"] >> text=10000')
            assert client.get_job(job2).spec.priority == 10000
            page.go_back()
            gpus_shown(page, {job1: 3, job2: 5}, client)
            # Job 2 runs an iteration with its 5 learners before job 1 goes: under load its
            # fifth learner may still be starting when job 1's three devices come free, and
            # job 2 would then grow from 4 straight past 5 (no rescale to 5 to mark below).
            wait_until(
                lambda: any(m.world_size == 5 for m in client.get_metrics(job2).iterations),
                timeout=STEP_TIMEOUT_MS / 1000,
                interval=0.5,
                what="an iteration of job 2 with 5 learners",
            )

            # 4. Job 1 cancelled from its page (the dialog is accepted): job 2 gets all 8.
            page.goto(f"{base}jobs/{job1}")
            page.wait_for_selector("#job-actions:not([hidden])")
            page.click("#cancel")
            page.wait_for_selector("#action-result.ok")
            page.goto(base)
            gpus_shown(page, {job2: 8}, client)
            steps = chart_steps(page, job1, job2)
            wanted = [(8, 0), (4, 4), (3, 5), (0, 8)]
            it = iter(steps)
            assert all(step in it for step in wanted), steps  # in this order, live
            shot(page, "jobs")

            # Job 2's page: loss per iteration with its rescales marked, learners, logs.
            page.goto(f"{base}jobs/{job2}")
            page.wait_for_selector('#iteration-charts [data-metric="loss"] canvas')
            # What the script logs itself (trainer.log, tiny_model's "mae") has its own chart.
            page.wait_for_selector(
                '#iteration-charts [data-metric="mae"] canvas', timeout=STEP_TIMEOUT_MS
            )
            # The rescales to 5 and to 8 learners are marked once their iterations' metrics
            # are flushed (the data plane writes them in batches).
            page.wait_for_function(
                """() => {
                    const to = new Set(window.shoal.state.metrics.markers().map(m => m.to));
                    return to.has(5) && to.has(8);
                }""",
                timeout=STEP_TIMEOUT_MS,
            )
            page.wait_for_function(
                "() => document.querySelectorAll('#learners tr[data-learner]').length === 8",
                timeout=STEP_TIMEOUT_MS,
            )
            hosts = page.eval_on_selector_all(
                "#learners tr[data-learner] td:nth-child(2)", "tds => tds.map(td => td.textContent)"
            )
            assert sorted(set(hosts)) == ["host-1", "host-2"]
            page.wait_for_selector("#logs .who")
            page.wait_for_selector(
                "#checkpoints tr[data-checkpoint] a[download]", timeout=STEP_TIMEOUT_MS
            )
            shot(page, "job")

            # Another user's job: the admin's is refused, on the page and by the API.
            theirs = root.submit_job(spec("admins-job", artifact, priority=1)).job_id
            jobs.append(theirs)
            page.goto(f"{base}jobs/{theirs}")
            page.wait_for_selector("#problem:not([hidden])")
            assert "Not found, or not yours." in page.text_content("#problem")
            assert page.is_hidden("#job-actions")
            status = page.evaluate(
                """async (id) => {
                    const r = await fetch(`/api/jobs/${id}/update`, {method: 'POST',
                        headers: {'content-type': 'application/json',
                                  'x-csrf-token': window.shoal.me.csrf},
                        body: JSON.stringify({priority: 1000000})});
                    return r.status;
                }""",
                theirs,
            )
            assert status == 404
            assert root.get_job(theirs).spec.priority == 1
            page.goto(base)
            page.wait_for_selector(f'#jobs tr[data-job="{job2}"]')
            assert page.query_selector(f'#jobs tr[data-job="{theirs}"]') is None

            # The admin sees every job, and drains a host from the cluster page.
            page.click("#logout")
            page.wait_for_url("**/login")
            login(page, base, cluster.tokens["admin"])
            page.wait_for_selector(f'#jobs tr[data-job="{theirs}"]')
            page.goto(f"{base}cluster")
            page.wait_for_selector('.host[data-host="host-1"] .device[data-job]')
            shot(page, "cluster")
            page.click('button[data-drain="host-2"]')
            page.wait_for_selector('.host[data-host="host-2"][data-state="draining"]')
            assert root.list_hosts()[1].draining
            assert errors == [], errors
        finally:
            for job_id in jobs:
                root.cancel_job(job_id)
            page.close()
