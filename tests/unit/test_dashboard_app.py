"""The dashboard's web application served by uvicorn on a loopback port, in front of a real
JobSchedulerService (port 0, MemoryStore, real auth), spoken to over HTTP: the token login and
its session cookie, 401s and the login redirect, another user's job refused, the owner's
actions guarded by the CSRF token and the origin, checkpoint downloads, the security headers,
the first event of a live stream, and the vendored chart library."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from shoal.dashboard.app import COOKIE, create_app
from shoal.dashboard.config import DashboardConfig
from shoal.v1 import job_scheduler_service_pb2 as js
from tests.support import async_wait_until
from tests.unit.test_scheduler_checkpoints import write_checkpoint
from tests.unit.test_scheduler_service import Bed, bed, submit, upload

__all__ = ["bed"]

STATIC = Path(__file__).resolve().parents[2] / "clients/src/shoal/dashboard/static"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Browser:
    """A minimal HTTP client with one cookie jar (what a browser tab does, over urllib)."""

    base: str
    cookies: dict[str, str] = field(default_factory=dict)

    def _request(self, method: str, path: str, body: Any, headers: dict[str, str]) -> Reply:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("content-type", "application/json")
        if self.cookies:
            request.add_header("cookie", "; ".join(f"{k}={v}" for k, v in self.cookies.items()))
        for key, value in headers.items():
            request.add_header(key, value)

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args: Any, **kwargs: Any) -> None:
                return None

        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(request, timeout=10) as reply:
                status, raw_headers, content = reply.status, reply.headers, reply.read()
        except urllib.error.HTTPError as err:
            status, raw_headers, content = err.code, err.headers, err.read()
        for value in raw_headers.get_all("set-cookie") or []:
            jar = SimpleCookie()
            jar.load(value)
            for key, morsel in jar.items():
                if morsel.value:
                    self.cookies[key] = morsel.value
                else:
                    self.cookies.pop(key, None)
        return Reply(status, {k.lower(): v for k, v in raw_headers.items()}, content)

    async def get(self, path: str, **headers: str) -> Reply:
        return await asyncio.to_thread(self._request, "GET", path, None, headers)

    async def post(self, path: str, body: Any = None, **headers: str) -> Reply:
        return await asyncio.to_thread(
            self._request, "POST", path, {} if body is None else body, headers
        )

    def first_event(self, path: str) -> tuple[str, Any]:
        request = urllib.request.Request(self.base + path)
        request.add_header("cookie", "; ".join(f"{k}={v}" for k, v in self.cookies.items()))
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            name = ""
            for raw in reply:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("event:"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and name:
                    return name, json.loads(line.split(":", 1)[1])
        raise AssertionError("the stream ended without an event")


@dataclass
class Site:
    bed: Bed
    base: str

    def browser(self) -> Browser:
        return Browser(self.base)

    async def login(self, who: str = "user") -> tuple[Browser, dict[str, Any]]:
        browser = self.browser()
        reply = await browser.post("/api/login", {"token": self.bed.tokens[who]})
        assert reply.status == 200, reply.body
        me = await browser.get("/api/me")
        return browser, me.json()


@pytest.fixture
async def site(bed: Bed) -> AsyncIterator[Site]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    config = DashboardConfig(
        scheduler=(bed.server.address,), listen=f"{host}:{port}", poll_interval_s=0.1
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), log_config=None, timeout_graceful_shutdown=1)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))

    def started() -> bool:
        assert not task.done(), task.exception()
        return server.started

    await async_wait_until(started, timeout=30, what="the dashboard to listen")
    yield Site(bed, f"http://{host}:{port}")
    server.should_exit = True
    await asyncio.wait_for(task, 10)
    sock.close()


# -- login and sessions ---------------------------------------------------------------------------


async def test_a_token_login_opens_a_session_that_names_the_user(site: Site) -> None:
    _, me = await site.login("user")
    assert (me["principal"], me["role"], me["admin"]) == ("alice", "user", False)
    assert len(me["csrf"]) >= 40
    _, admin = await site.login("admin")
    assert (admin["principal"], admin["admin"]) == ("root", True)


async def test_the_session_cookie_is_http_only_same_site_strict_and_holds_no_token(
    site: Site,
) -> None:
    browser = site.browser()
    reply = await browser.post("/api/login", {"token": site.bed.tokens["user"]})
    cookie = reply.headers["set-cookie"]
    assert f"{COOKIE}=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert site.bed.tokens["user"] not in cookie and site.bed.tokens["user"] not in str(reply.body)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"token": "0" * 64}, 401, "not accepted"),
        ({"token": ""}, 400, "token must be a non-empty string"),
        ({"token": 7}, 400, "token must be a non-empty string"),
        ({"token": "x" * 5000}, 400, "at most 4096"),
        ([], 400, "token must be"),
    ],
)
async def test_a_bad_login_is_refused_and_opens_no_session(
    site: Site, body: Any, status: int, needle: str
) -> None:
    browser = site.browser()
    reply = await browser.post("/api/login", body)
    assert reply.status == status and needle in reply.json()["message"]
    assert COOKIE not in browser.cookies
    assert (await browser.get("/api/me")).status == 401


async def test_without_a_session_the_api_is_401_and_pages_redirect_to_the_login(
    site: Site,
) -> None:
    browser = site.browser()
    for path in ("/api/jobs", "/api/cluster", "/api/jobs/job-1", "/api/stream/overview"):
        assert (await browser.get(path)).status == 401, path
    page = await browser.get("/jobs/job-1")
    assert page.status == 303 and page.headers["location"] == "/login?next=/jobs/job-1"
    forged = Browser(site.base, {COOKIE: "forged-session-id"})
    assert (await forged.get("/api/me")).status == 401
    login = await browser.get("/login")
    assert login.status == 200 and b'id="token"' in login.body


async def test_logout_ends_the_session(site: Site) -> None:
    browser, _ = await site.login()
    session = browser.cookies[COOKIE]
    assert (await browser.post("/api/logout")).status == 200
    assert (await Browser(site.base, {COOKIE: session}).get("/api/me")).status == 401


async def test_a_cross_site_login_is_refused(site: Site) -> None:
    reply = await site.browser().post(
        "/api/login", {"token": site.bed.tokens["user"]}, origin="https://evil.example"
    )
    assert reply.status == 403


# -- what a user sees -----------------------------------------------------------------------------


async def test_a_user_sees_their_jobs_and_another_users_job_is_not_found(site: Site) -> None:
    mine = await submit(site.bed, await upload(site.bed), who="user")
    theirs = await submit(site.bed, await upload(site.bed, who="other"), who="other")
    alice, _ = await site.login("user")
    listed = (await alice.get("/api/jobs")).json()
    assert [j["job_id"] for j in listed["jobs"]] == [mine.job_id]
    assert (await alice.get(f"/api/jobs/{mine.job_id}")).json()["job"]["owner"] == "alice"
    for path in (
        f"/api/jobs/{theirs.job_id}",
        f"/api/jobs/{theirs.job_id}/metrics",
        f"/api/jobs/{theirs.job_id}/checkpoints",
        f"/api/jobs/{theirs.job_id}/model",
    ):
        reply = await alice.get(path)
        assert reply.status == 404 and reply.json()["error"] == "NOT_FOUND", path
    root, _ = await site.login("admin")
    everyone = (await root.get("/api/jobs")).json()["jobs"]
    assert {j["job_id"] for j in everyone} == {mine.job_id, theirs.job_id}


async def test_a_live_stream_sends_the_jobs_at_once(site: Site) -> None:
    job = await submit(site.bed, await upload(site.bed))
    alice, _ = await site.login()
    name, data = await asyncio.to_thread(alice.first_event, "/api/stream/overview")
    assert name == "overview"
    assert [j["job_id"] for j in data["jobs"]] == [job.job_id]
    name, data = await asyncio.to_thread(alice.first_event, f"/api/stream/jobs/{job.job_id}")
    assert name == "job" and data["job"]["job_id"] == job.job_id


async def test_a_stream_of_another_users_job_ends_with_not_found(site: Site) -> None:
    theirs = await submit(site.bed, await upload(site.bed, who="other"), who="other")
    alice, _ = await site.login()
    name, data = await asyncio.to_thread(alice.first_event, f"/api/stream/jobs/{theirs.job_id}")
    assert (name, data["error"]) == ("fatal", "NOT_FOUND")


# -- actions --------------------------------------------------------------------------------------


async def test_the_owner_changes_priority_and_max_workers_with_the_csrf_token(site: Site) -> None:
    job = await submit(site.bed, await upload(site.bed))
    alice, me = await site.login()
    path = f"/api/jobs/{job.job_id}/update"
    reply = await alice.post(path, {"priority": 10000}, **{"x-csrf-token": me["csrf"]})
    assert reply.status == 200 and reply.json()["priority"] == 10000
    reply = await alice.post(path, {"max_workers": 2}, **{"x-csrf-token": me["csrf"]})
    assert reply.json()["max_workers"] == 2
    stored = await site.bed.stub().GetJob(js.GetJobRequest(job_id=job.job_id))
    assert (stored.job.spec.priority, stored.job.spec.max_workers) == (10000, 2)


async def test_an_action_without_the_csrf_token_or_from_another_site_changes_nothing(
    site: Site,
) -> None:
    job = await submit(site.bed, await upload(site.bed))
    alice, me = await site.login()
    path = f"/api/jobs/{job.job_id}/update"
    assert (await alice.post(path, {"priority": 9})).status == 403
    assert (await alice.post(path, {"priority": 9}, **{"x-csrf-token": "guess"})).status == 403
    cross = await alice.post(
        path, {"priority": 9}, origin="https://evil.example", **{"x-csrf-token": me["csrf"]}
    )
    assert cross.status == 403
    assert (await alice.post(f"/api/jobs/{job.job_id}/cancel")).status == 403
    stored = await site.bed.stub().GetJob(js.GetJobRequest(job_id=job.job_id))
    assert stored.job.spec.priority == 5000 and stored.job.state == job.state


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"priority": "high"}, "priority ('high') must be a whole number"),
        ({"priority": 1.5}, "priority (1.5) must be a whole number"),
        ({"max_workers": True}, "max_workers (True) must be a whole number"),
        ({}, "priority or max_workers must be set"),
        ({"priority": 0}, "priority (0)"),  # the API's own check, passed through
    ],
)
async def test_a_bad_update_is_refused_naming_the_field_and_the_value(
    site: Site, body: dict[str, Any], needle: str
) -> None:
    job = await submit(site.bed, await upload(site.bed))
    alice, me = await site.login()
    reply = await alice.post(f"/api/jobs/{job.job_id}/update", body, **{"x-csrf-token": me["csrf"]})
    assert reply.status == 400 and needle in reply.json()["message"]


async def test_another_users_job_cannot_be_changed_or_cancelled(site: Site) -> None:
    theirs = await submit(site.bed, await upload(site.bed, who="other"), who="other")
    alice, me = await site.login()
    token = {"x-csrf-token": me["csrf"]}
    update = await alice.post(f"/api/jobs/{theirs.job_id}/update", {"priority": 9}, **token)
    cancel = await alice.post(f"/api/jobs/{theirs.job_id}/cancel", **token)
    assert (update.status, cancel.status) == (404, 404)
    stored = await site.bed.stub("other").GetJob(js.GetJobRequest(job_id=theirs.job_id))
    assert stored.job.spec.priority == 5000 and stored.job.state == theirs.state


async def test_the_owner_cancels_a_job(site: Site) -> None:
    job = await submit(site.bed, await upload(site.bed))
    alice, me = await site.login()
    reply = await alice.post(f"/api/jobs/{job.job_id}/cancel", **{"x-csrf-token": me["csrf"]})
    assert reply.status == 200 and reply.json()["state"] == "cancelled"


async def test_draining_a_host_needs_the_admin_role(site: Site) -> None:
    alice, me = await site.login()
    reply = await alice.post("/api/hosts/host-1/drain", **{"x-csrf-token": me["csrf"]})
    assert reply.status == 403 and "admin" in reply.json()["message"]


# -- downloads, headers, static files -------------------------------------------------------------


async def test_a_checkpoint_file_and_its_list_are_served_to_the_owner(site: Site) -> None:
    job = await submit(site.bed, await upload(site.bed))
    files = write_checkpoint(site.bed, job.job_id, 12)
    alice, _ = await site.login()
    listed = (await alice.get(f"/api/jobs/{job.job_id}/checkpoints")).json()
    assert [c["name"] for c in listed] == ["iter-12"]
    reply = await alice.get(f"/api/jobs/{job.job_id}/checkpoints/iter-12/shard-0.safetensors")
    assert reply.status == 200 and reply.body == files["shard-0.safetensors"]
    assert reply.headers["content-disposition"] == (
        f'attachment; filename="{job.job_id}-iter-12-shard-0.safetensors"'
    )
    missing = await alice.get(f"/api/jobs/{job.job_id}/checkpoints/iter-12/shard-7.safetensors")
    assert missing.status == 404
    assert (await alice.get(f"/api/jobs/{job.job_id}/model")).status == 404  # no model yet


async def test_every_answer_carries_a_strict_content_security_policy(site: Site) -> None:
    browser = site.browser()
    for path in ("/login", "/api/me", "/static/app.js"):
        reply = await browser.get(path)
        csp = reply.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp, path
        assert reply.headers["x-content-type-options"] == "nosniff"
    assert (await browser.get("/api/me")).headers["cache-control"] == "no-store"
    # Pages too: one shown from the cache after logout would run without a session.
    assert (await browser.get("/login")).headers["cache-control"] == "no-store"


async def test_the_chart_library_is_served_from_the_package_with_its_licence(site: Site) -> None:
    browser = site.browser()
    script = await browser.get("/static/vendor/uPlot.iife.min.js")
    assert (
        script.status == 200 and script.body == (STATIC / "vendor/uPlot.iife.min.js").read_bytes()
    )
    assert b"MIT License" in (STATIC / "vendor/uPlot.LICENSE").read_bytes()
    for page in ("jobs.html", "cluster.html", "job.html", "login.html"):
        html = (STATIC / page).read_text()
        assert "http://" not in html and "https://" not in html, page  # nothing from outside


def test_the_vendored_chart_library_is_the_npm_release_package_json_pins() -> None:
    root = Path(__file__).resolve().parents[2]
    pinned = json.loads((root / "package.json").read_text())["devDependencies"]["uplot"]
    dist = root / "node_modules" / "uplot" / "dist"
    if not dist.is_dir():
        pytest.skip("node_modules/uplot is not installed (npm install; make lint does it)")
    installed = json.loads((dist.parent / "package.json").read_text())["version"]
    assert installed == pinned
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        assert (STATIC / "vendor" / name).read_bytes() == (dist / name).read_bytes(), name
