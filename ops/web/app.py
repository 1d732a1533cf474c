"""The web console: fleet, tasks and one task's history, live, in a browser.

Every page is built from the user API (``ops/userapi``) called over the ops NATS
subjects with the signed-in user's own token, on a NATS connection of that
user's own (``ops.client.OpsClient``: on a secured broker it connects as
``user:<name>`` with a proof of the token, and may only use the ops subjects
and its own inbox), so the console sees exactly what that user's CLI would
see, through the same safe projection: there is no second path to the data,
and the console itself holds no NATS identity. Live updates are server-sent
events (``live.py``).

``create_app`` assembles the console: the routes of each page (``signin.py``,
``fleet.py``, ``tasks.py``, ``live.py``, ``health.py``, sharing ``pages.py``), the error
pages (``errors.py``), the security headers (``headers.py``) and the running
state (``console.py``). Sign-in sessions, CSRF and the cookie are in
``sessions.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fleetlease.ops.client import OpsError
from fleetlease.ops.web.console import Console, WebSettings
from fleetlease.ops.web.drain import DrainRoutes
from fleetlease.ops.web.errors import ErrorHandlers
from fleetlease.ops.web.fleet import FleetRoutes
from fleetlease.ops.web.headers import SECURITY_HEADERS, SecurityHeaders
from fleetlease.ops.web.health import HealthRoutes
from fleetlease.ops.web.live import LiveRoutes
from fleetlease.ops.web.pages import RequestRefused, SignInRequired
from fleetlease.ops.web.signin import SignInRoutes
from fleetlease.ops.web.tasks import TaskRoutes

STATIC = Path(__file__).parent / "static"


class Web(
    SignInRoutes, FleetRoutes, DrainRoutes, TaskRoutes, LiveRoutes, HealthRoutes, ErrorHandlers
):
    """The routes of the console, one group per page (``signin.py``,
    ``fleet.py``, ``tasks.py``, ``live.py``, ``health.py``) and the error handlers."""


def create_app(settings: WebSettings, *, console: Console | None = None) -> Starlette:
    """The console as an ASGI app. Its lifespan starts the console (a check
    that NATS answers) and stops it (closing every session's connection)."""
    console = console or Console(settings)
    web = Web(console)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await console.start()
        try:
            yield
        finally:
            await console.stop()

    routes = [
        Route("/", web.fleet),
        Route("/fleet/part", web.fleet_part),
        Route("/hosts/{host_id}/drain", web.host_drain, methods=["POST"]),
        Route("/hosts/{host_id}/undrain", web.host_undrain, methods=["POST"]),
        Route("/login", web.login_page, methods=["GET"]),
        Route("/login", web.login, methods=["POST"]),
        Route("/logout", web.logout, methods=["POST"]),
        Route("/tasks", web.tasks),
        Route("/tasks/part", web.tasks_part),
        Route("/tasks/{task_id}", web.task),
        Route("/tasks/{task_id}/part", web.task_part),
        Route("/tasks/{task_id}/row", web.task_row),
        Route("/tasks/{task_id}/cancel", web.cancel_confirm, methods=["GET"]),
        Route("/tasks/{task_id}/cancel", web.cancel, methods=["POST"]),
        Route("/tasks/{task_id}/artifacts/{attempt:int}/{name:path}", web.artifact),
        Route("/events", web.events),
        Route("/health", web.health),
        Route("/health/data", web.health_data),
        Mount("/static", StaticFiles(directory=str(STATIC)), name="static"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            SignInRequired: web.on_sign_in,
            RequestRefused: web.on_refused,
            OpsError: web.on_ops_error,
            HTTPException: web.on_http,
        },
    )
    app.state.console = console
    app.add_middleware(SecurityHeaders)
    return app


__all__ = ["SECURITY_HEADERS", "Console", "Web", "WebSettings", "create_app"]
