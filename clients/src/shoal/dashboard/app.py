"""The dashboard's web application (Starlette): pages, a JSON API for them, server-sent event
streams for the live views, actions and downloads.

Every request after the login is served with the logged-in user's own API client (their token,
kept server-side in the session): what a page shows is exactly what the API shows that user,
and an action is the API call the CLI would make. The pages are static files (HTML, one
script, uPlot vendored in ``static/vendor/``); nothing is fetched from outside at run time, and
the Content-Security-Policy allows nothing but this origin.

Routes::

    GET  /login /  /cluster  /jobs/{job_id}          pages (the last three need a session)
    POST /api/login {"token"} | /api/logout          a session cookie | none
    GET  /api/me                                     principal, role, CSRF token
    GET  /api/jobs | /api/cluster | /api/jobs/{id}   snapshots (what the streams send first)
    GET  /api/jobs/{id}/metrics | /checkpoints
    GET  /api/stream/overview | /cluster | /jobs/{id} | /jobs/{id}/logs     text/event-stream
    GET  /api/jobs/{id}/model | /checkpoints/{name}/{file}                   downloads
    POST /api/jobs/{id}/cancel | /update {"priority"?, "max_workers"?}        owner actions
    POST /api/hosts/{id}/drain                                               admin action
    GET  /healthz

Mutating calls need the session's CSRF token in ``X-CSRF-Token`` and a same-origin ``Origin``;
the session cookie is HttpOnly and SameSite=Strict (and Secure over HTTPS).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any
from urllib.parse import quote, urlsplit

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from shoal.client import AsyncClient, ClientConfig, ShoalClientError
from shoal.dashboard import views
from shoal.dashboard.config import DashboardConfig
from shoal.dashboard.sessions import Session, SessionStore
from shoal.v1 import auth_pb2, job_pb2

__all__ = ["COOKIE", "create_app"]

log = logging.getLogger(__name__)

COOKIE = "shoal_session"
CSRF_HEADER = "x-csrf-token"
TOKEN_MAX = 4096
LOG_TAIL = 1000
CHECKPOINT_EVERY_POLLS = 5
PAGES = ("jobs.html", "cluster.html", "job.html", "login.html")
# gRPC status (as ShoalClientError names it) -> HTTP status.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "FAILED_PRECONDITION": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}
_SAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]+")

ClientFactory = Callable[[str], AsyncClient]


class _Unauthorized(Exception):
    """No live session (API routes answer 401, pages redirect to the login)."""


def _json_error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status)


class _SecurityHeaders(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        for key, value in SECURITY_HEADERS.items():
            response.headers.setdefault(key, value)
        if request.url.path.startswith("/api/"):
            response.headers.setdefault("cache-control", "no-store")
        return response


def _static_dir() -> Any:
    return resources.files("shoal.dashboard") / "static"


class Dashboard:
    """The application's state: sessions, how to make API clients, the settings."""

    def __init__(
        self,
        config: DashboardConfig,
        *,
        client_factory: ClientFactory | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.sessions = SessionStore(
            idle_s=config.session_idle_s, max_age_s=config.session_max_age_s
        )
        self.client_factory = client_factory or self._client
        self.clock = clock

    def _client(self, token: str) -> AsyncClient:
        return AsyncClient(
            ClientConfig(
                scheduler=self.config.scheduler,
                resource_manager=self.config.resource_manager,
                token=token,
                tls_ca=self.config.tls_ca,
                tls_cert=self.config.client_cert,
                tls_key=self.config.client_key,
                source="dashboard",
            ),
            timeout=self.config.call_timeout_s,
            retries=2,
        )

    # -- sessions -------------------------------------------------------------------------------

    async def expire(self) -> None:
        for session in self.sessions.expire():
            await _close(session)

    def session(self, request: Request) -> Session:
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is None:
            raise _Unauthorized()
        return session

    async def end(self, session: Session) -> None:
        self.sessions.remove(session.session_id)
        await _close(session)

    async def call(self, session: Session, fn: Callable[[AsyncClient], Awaitable[Any]]) -> Any:
        """An API call as the session's user; a revoked token ends the session."""
        try:
            return await fn(session.client)
        except ShoalClientError as exc:
            if exc.code == "UNAUTHENTICATED":
                await self.end(session)
            raise

    # -- reads ----------------------------------------------------------------------------------

    async def visible_jobs(self, client: AsyncClient) -> dict[str, job_pb2.Job]:
        return {j.job_id: j async for j in client.list_jobs()}

    async def overview(self, session: Session) -> dict[str, Any]:
        async def read(client: AsyncClient) -> dict[str, Any]:
            jobs, events, hosts = await asyncio.gather(
                self.visible_jobs(client),
                client.allocation_history(""),
                self._hosts(client),
            )
            cluster = views.cluster_view(hosts, jobs)
            return {
                "jobs": [views.job_row(j) for j in jobs.values()],
                "allocation": views.allocation_chart(events, jobs, capacity=cluster["gpus_total"]),
                "gpus_total": cluster["gpus_total"],
                "gpus_busy": cluster["gpus_busy"],
            }

        return dict(await self.call(session, read))

    async def cluster(self, session: Session) -> dict[str, Any]:
        async def read(client: AsyncClient) -> dict[str, Any]:
            jobs, hosts = await asyncio.gather(
                self.visible_jobs(client), client.list_hosts(include_lost=True)
            )
            return views.cluster_view(hosts, jobs)

        return dict(await self.call(session, read))

    async def _hosts(self, client: AsyncClient) -> list[Any]:
        if not self.config.resource_manager:
            return []
        return list(await client.list_hosts(include_lost=True))

    async def job(self, session: Session, job_id: str) -> dict[str, Any]:
        async def read(client: AsyncClient) -> dict[str, Any]:
            job = await client.get_job(job_id)  # NOT_FOUND for a job the user may not see
            events, hosts = await asyncio.gather(
                client.allocation_history(job_id), self._hosts(client)
            )
            return {
                "job": views.job_row(job),
                "spec": {
                    "entry_point": job.spec.entry_point,
                    "batch_size": job.spec.batch_size,
                    "seed": job.spec.seed,
                    "checkpoint_every": job.spec.checkpoint_every,
                },
                "learners": views.learners_of(job_id, hosts),
                "allocations": [
                    {
                        "time": views.seconds(e.time),
                        "workers": e.workers,
                        "target_workers": e.target_workers,
                        "reason": e.reason,
                    }
                    for e in events
                ],
                "can_act": True,  # a job a user can see is theirs (or they are an admin)
            }

        return dict(await self.call(session, read))

    async def checkpoints(self, session: Session, job_id: str) -> list[dict[str, Any]]:
        async def read(client: AsyncClient) -> list[dict[str, Any]]:
            return [
                {
                    "name": c.name,
                    "iteration": c.iteration,
                    "epoch": c.epoch,
                    "generation": c.generation,
                    "time": views.seconds(c.create_time),
                    "size_bytes": c.size_bytes,
                    "latest": c.latest,
                    "files": [{"name": f.name, "size_bytes": f.size_bytes} for f in c.files],
                }
                for c in await client.list_checkpoints(job_id)
            ]

        return list(await self.call(session, read))


async def _close(session: Session) -> None:
    if session.client is not None:
        with contextlib.suppress(Exception):
            await session.client.close()


def _attachment(name: str) -> str:
    return f'attachment; filename="{_SAFE_FILENAME.sub("_", name)[:200] or "download"}"'


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None  # a non-browser client, or an opaque origin (refused)
    return urlsplit(origin).netloc == request.headers.get("host", "")


def _local_path(value: str | None) -> str:
    """A redirect target after login: a path on this site only."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    return value


def create_app(
    config: DashboardConfig,
    *,
    client_factory: ClientFactory | None = None,
    clock: Callable[[], float] = time.time,
) -> Starlette:
    """The ASGI application (serve it with uvicorn: :func:`shoal.dashboard.__main__.main`)."""
    dash = Dashboard(config, client_factory=client_factory, clock=clock)
    static = _static_dir()
    poll = config.poll_interval_s

    def page(name: str) -> FileResponse:
        # Never from a cache: a page shown after logout would run without a session.
        return FileResponse(
            str(static / name), media_type="text/html", headers={"cache-control": "no-store"}
        )

    # -- pages ------------------------------------------------------------------------------

    def page_route(name: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if dash.sessions.get(request.cookies.get(COOKIE)) is None:
                target = quote(request.url.path, safe="/")
                return RedirectResponse(f"/login?next={target}", status_code=303)
            return page(name)

        return endpoint

    async def login_page(request: Request) -> Response:
        return page("login.html")

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    # -- session API ------------------------------------------------------------------------

    async def login(request: Request) -> Response:
        if not _same_origin(request):
            return _json_error(403, "CROSS_ORIGIN", "login must come from this site")
        try:
            body = await request.json()
        except ValueError:
            return _json_error(400, "INVALID_ARGUMENT", 'the body must be JSON: {"token": ...}')
        token = body.get("token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token.strip() or len(token) > TOKEN_MAX:
            return _json_error(
                400, "INVALID_ARGUMENT", f"token must be a non-empty string of at most {TOKEN_MAX}"
            )
        token = token.strip()
        await dash.expire()
        client = dash.client_factory(token)
        try:
            me = await client.whoami()  # the services verify the token, as for any call
        except ShoalClientError as exc:
            await client.close()
            status = HTTP_STATUS.get(exc.code, 502)
            message = "the token was not accepted" if exc.code == "UNAUTHENTICATED" else exc.message
            return _json_error(status, exc.code, message)
        role = role_name(me.role)
        session = dash.sessions.create(
            principal=me.principal, role=role, token=token, client=client
        )
        log.info("login: %s (%s)", me.principal, role)
        response = JSONResponse({"principal": me.principal, "role": role})
        response.set_cookie(
            COOKIE,
            session.session_id,
            httponly=True,
            samesite="strict",
            secure=config.https,
            path="/",
        )
        return response

    async def logout(request: Request) -> Response:
        session = dash.sessions.get(request.cookies.get(COOKIE))
        if session is not None:
            await dash.end(session)
        response = JSONResponse({"ok": True})
        response.delete_cookie(COOKIE, path="/")
        return response

    async def me(request: Request) -> Response:
        s = dash.session(request)
        return JSONResponse(
            {"principal": s.principal, "role": s.role, "admin": s.is_admin, "csrf": s.csrf}
        )

    # -- snapshots --------------------------------------------------------------------------

    async def jobs_snapshot(request: Request) -> Response:
        return JSONResponse(await dash.overview(dash.session(request)))

    async def cluster_snapshot(request: Request) -> Response:
        return JSONResponse(await dash.cluster(dash.session(request)))

    async def job_snapshot(request: Request) -> Response:
        return JSONResponse(await dash.job(dash.session(request), request.path_params["job_id"]))

    async def job_metrics(request: Request) -> Response:
        session = dash.session(request)
        job_id = request.path_params["job_id"]
        return JSONResponse(await _metrics_payload(dash, session, job_id, 0, 0))

    async def job_checkpoints(request: Request) -> Response:
        session = dash.session(request)
        return JSONResponse(await dash.checkpoints(session, request.path_params["job_id"]))

    # -- live streams -----------------------------------------------------------------------

    def stream(
        request: Request, produce: Callable[[Session], AsyncIterator[dict[str, Any]]]
    ) -> Response:
        session = dash.session(request)

        async def events() -> AsyncIterator[dict[str, Any]]:
            async for event in produce(session):
                yield {"event": event["event"], "data": json.dumps(event["data"])}

        return EventSourceResponse(events(), ping=15, send_timeout=30)

    def polled(
        name: str, read: Callable[[Session], Awaitable[dict[str, Any]]]
    ) -> Callable[[Session], AsyncIterator[dict[str, Any]]]:
        """Read every poll interval; send when it changed (and at least every 15 s)."""

        async def produce(session: Session) -> AsyncIterator[dict[str, Any]]:
            last, last_sent = "", 0.0
            while True:
                try:
                    data = await read(session)
                except ShoalClientError as exc:
                    if exc.code in ("UNAUTHENTICATED", "NOT_FOUND", "PERMISSION_DENIED"):
                        yield {"event": "fatal", "data": {"error": exc.code, "message": str(exc)}}
                        return
                    yield {"event": "problem", "data": {"error": exc.code, "message": str(exc)}}
                    await asyncio.sleep(max(poll, 1.0))
                    continue
                key = json.dumps(data, sort_keys=True)
                now = time.monotonic()
                if key != last or now - last_sent > 15:
                    data["server_time"] = dash.clock()
                    yield {"event": name, "data": data}
                    last, last_sent = key, now
                await asyncio.sleep(poll)

        return produce

    async def overview_stream(request: Request) -> Response:
        return stream(request, polled("overview", dash.overview))

    async def cluster_stream(request: Request) -> Response:
        return stream(request, polled("cluster", dash.cluster))

    async def job_stream(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        return stream(request, lambda s: _job_events(dash, s, job_id, poll))

    async def logs_stream(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        follow = request.query_params.get("follow", "1") != "0"

        async def produce(session: Session) -> AsyncIterator[dict[str, Any]]:
            try:
                async for line in session.client.stream_logs(
                    job_id, follow=follow, tail_lines=LOG_TAIL
                ):
                    yield {
                        "event": "line",
                        "data": {
                            "learner_id": line.learner_id,
                            "text": line.text,
                            "time": views.seconds(line.time),
                            "stderr": line.stream == 2,
                        },
                    }
            except ShoalClientError as exc:
                yield {"event": "fatal", "data": {"error": exc.code, "message": str(exc)}}
                return
            yield {"event": "end", "data": {}}

        return stream(request, produce)

    # -- downloads --------------------------------------------------------------------------

    async def _serve(agen: AsyncIterator[Any], filename: str) -> Response:
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            return _json_error(502, "EMPTY", "the download stream was empty")
        header = first.header

        async def body() -> AsyncIterator[bytes]:
            try:
                async for message in agen:
                    yield message.chunk
            finally:
                await agen.aclose()  # type: ignore[attr-defined]

        headers = {"content-disposition": _attachment(filename)}
        if header.size_bytes:
            headers["content-length"] = str(header.size_bytes)
        if header.sha256:
            headers["x-shoal-sha256"] = header.sha256
        return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)

    async def download_model(request: Request) -> Response:
        session = dash.session(request)
        job_id = request.path_params["job_id"]
        return await _serve(session.client.stream_model(job_id), f"{job_id}-model.safetensors")

    async def download_checkpoint(request: Request) -> Response:
        session = dash.session(request)
        p = request.path_params
        agen = session.client.stream_checkpoint_file(p["job_id"], p["name"], p["file"])
        return await _serve(agen, f"{p['job_id']}-{p['name']}-{p['file']}")

    # -- actions ----------------------------------------------------------------------------

    async def acting(request: Request) -> Session:
        session = dash.session(request)
        if not _same_origin(request):
            raise HTTPException(403, "the request must come from this site")
        if not session.check_csrf(request.headers.get(CSRF_HEADER)):
            raise HTTPException(403, f"the {CSRF_HEADER} header is missing or wrong")
        return session

    async def cancel(request: Request) -> Response:
        session = await acting(request)
        job_id = request.path_params["job_id"]
        job = await dash.call(session, lambda c: c.cancel_job(job_id))
        return JSONResponse(views.job_row(job))

    async def update(request: Request) -> Response:
        session = await acting(request)
        job_id = request.path_params["job_id"]
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _json_error(400, "INVALID_ARGUMENT", "the body must be a JSON object")
        changes: dict[str, int] = {}
        for name in ("priority", "max_workers"):
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                return _json_error(
                    400, "INVALID_ARGUMENT", f"{name} ({value!r}) must be a whole number"
                )
            changes[name] = value
        if not changes:
            return _json_error(400, "INVALID_ARGUMENT", "priority or max_workers must be set")
        job = await dash.call(session, lambda c: c.update_job(job_id, **changes))
        return JSONResponse(views.job_row(job))

    async def drain(request: Request) -> Response:
        session = await acting(request)
        if not session.is_admin:  # the resource manager refuses it too; say why at once
            raise HTTPException(403, "draining a host needs the admin role")
        host_id = request.path_params["host_id"]
        host = await dash.call(session, lambda c: c.drain_host(host_id))
        return JSONResponse({"host_id": host.host_id, "state": views.host_state(host)})

    # -- errors -----------------------------------------------------------------------------

    async def on_unauthorized(request: Request, exc: Exception) -> Response:
        return _json_error(401, "UNAUTHENTICATED", "log in first")

    async def on_client_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ShoalClientError)
        return _json_error(HTTP_STATUS.get(exc.code, 502), exc.code, exc.message)

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _json_error(exc.status_code, "REFUSED", str(exc.detail))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(60)
                await dash.expire()

        task = asyncio.create_task(sweep())
        try:
            yield
        finally:
            task.cancel()
            for session in dash.sessions.all():
                await dash.end(session)

    routes = [
        Route("/", page_route("jobs.html")),
        Route("/cluster", page_route("cluster.html")),
        Route("/jobs/{job_id}", page_route("job.html")),
        Route("/login", login_page),
        Route("/healthz", healthz),
        Route("/api/login", login, methods=["POST"]),
        Route("/api/logout", logout, methods=["POST"]),
        Route("/api/me", me),
        Route("/api/jobs", jobs_snapshot),
        Route("/api/cluster", cluster_snapshot),
        Route("/api/jobs/{job_id}", job_snapshot),
        Route("/api/jobs/{job_id}/metrics", job_metrics),
        Route("/api/jobs/{job_id}/checkpoints", job_checkpoints),
        Route("/api/jobs/{job_id}/model", download_model),
        Route("/api/jobs/{job_id}/checkpoints/{name}/{file}", download_checkpoint),
        Route("/api/jobs/{job_id}/cancel", cancel, methods=["POST"]),
        Route("/api/jobs/{job_id}/update", update, methods=["POST"]),
        Route("/api/hosts/{host_id}/drain", drain, methods=["POST"]),
        Route("/api/stream/overview", overview_stream),
        Route("/api/stream/cluster", cluster_stream),
        Route("/api/stream/jobs/{job_id}", job_stream),
        Route("/api/stream/jobs/{job_id}/logs", logs_stream),
        Mount("/static", StaticFiles(directory=str(static)), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(_SecurityHeaders)],
        exception_handlers={
            _Unauthorized: on_unauthorized,
            ShoalClientError: on_client_error,
            HTTPException: on_http,
        },
        lifespan=lifespan,
    )
    app.state.dashboard = dash
    return app


def role_name(role: int) -> str:
    """PrincipalRole -> "user" | "service" | "admin" ("" when the API names none)."""
    try:
        name = str(auth_pb2.PrincipalRole.Name(role))  # type: ignore[arg-type]
    except ValueError:
        return ""
    return "" if role == 0 else name.removeprefix("PRINCIPAL_ROLE_").lower()


async def _metrics_payload(
    dash: Dashboard, session: Session, job_id: str, have: int, world: int
) -> dict[str, Any]:
    """The job's metrics after the first ``have`` iterations (all when 0), with the rescale
    markers among them (``world``: the world size of the last iteration the caller has)."""

    async def read(client: AsyncClient) -> dict[str, Any]:
        job, metrics, events = await asyncio.gather(
            client.get_job(job_id),
            client.get_metrics(job_id, after_iteration=have),
            client.allocation_history(job_id),
        )
        per_epoch = job.progress.iterations_per_epoch
        its = list(metrics.iterations)
        return {
            "offset": have,
            "iterations": views.iteration_series(its, per_epoch, offset=have),
            "epochs": views.epoch_series(list(metrics.epochs)),
            "markers": views.rescale_markers(
                its, per_epoch, list(events), previous_world=world, offset=have
            ),
        }

    return dict(await dash.call(session, read))


async def _job_events(
    dash: Dashboard, session: Session, job_id: str, poll: float
) -> AsyncIterator[dict[str, Any]]:
    """One job, live: its state and learners when they change, new iterations' metrics (and
    rescale markers) as they come, the epoch metrics when a new epoch is evaluated, and the
    checkpoint list when it changes."""
    have = world = epochs_seen = 0
    last_job = last_checkpoints = ""
    polls = 0
    while True:
        try:
            job = await dash.job(session, job_id)
            key = json.dumps(job, sort_keys=True)
            if key != last_job:
                yield {"event": "job", "data": job}
                last_job = key
            metrics = await _metrics_payload(dash, session, job_id, have, world)
            its = metrics["iterations"]
            if its["count"] or len(metrics["epochs"]["x"]) != epochs_seen:
                yield {"event": "metrics", "data": metrics}
                have += its["count"]
                if its["world_size"]:
                    world = its["world_size"][-1]
                epochs_seen = len(metrics["epochs"]["x"])
            if polls % CHECKPOINT_EVERY_POLLS == 0 or job["job"]["final"]:
                checkpoints = await dash.checkpoints(session, job_id)
                key = json.dumps(checkpoints, sort_keys=True)
                if key != last_checkpoints:
                    yield {"event": "checkpoints", "data": {"checkpoints": checkpoints}}
                    last_checkpoints = key
        except ShoalClientError as exc:
            if exc.code in ("UNAUTHENTICATED", "NOT_FOUND", "PERMISSION_DENIED"):
                yield {"event": "fatal", "data": {"error": exc.code, "message": str(exc)}}
                return
            yield {"event": "problem", "data": {"error": exc.code, "message": str(exc)}}
            await asyncio.sleep(max(poll, 1.0))
            continue
        polls += 1
        await asyncio.sleep(poll)
