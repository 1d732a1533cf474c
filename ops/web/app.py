"""The web console: fleet, tasks and one task's history, live, in a browser.

Every page is built from the user API (``ops/api.py``) called over the ops NATS
subjects with the signed-in user's own token, on a NATS connection of that
user's own (``ops.client.OpsClient``: on a secured broker it connects as
``user:<name>`` with a proof of the token, and may only use the ops subjects
and its own inbox), so the console sees exactly what that user's CLI would
see, through the same safe projection: there is no second path to the data,
and the console itself holds no NATS identity. Live updates are server-sent
events fed by ``ops.client.task_events`` (the control plane's ``events``
long-poll, filtered by the user's roles).

Sign-in, CSRF and the cookie are in ``ops/web/sessions.py``. Status codes:
401 shows the sign-in page, 403 a "not allowed" page, 404 "not found", 503
"the control plane is not answering" (never the NATS URL or any path).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetlease.ops.client import DEFAULT_TIMEOUT_S, OpsClient, OpsError, task_events
from fleetlease.ops.web.sessions import (
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    Session,
    SessionStore,
    new_secret,
    origin_of,
    same_origin,
    tokens_match,
)
from fleetlease.persistence.model import TaskState
from fleetlease.transport.subjects import is_valid_token

log = structlog.get_logger("fleetlease.web")

HERE = Path(__file__).parent
TASK_STATES = tuple(s.value for s in TaskState)
TERMINAL_STATES = frozenset(s.value for s in TaskState if s.is_terminal)
MAX_FORM_BYTES = 16 * 1024
MAX_TOKEN_CHARS = 512
LOG_PAGE = 1000

#: Everything the pages load comes from here; nothing inline, nothing remote.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    # Not no-referrer: with it a browser sends "Origin: null" on our own form
    # posts, and the CSRF origin check could not tell them from a foreign site.
    "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}


@dataclass(frozen=True, kw_only=True)
class WebSettings:
    nats_url: str
    prefix: str = "fleetlease"
    #: Seconds to wait for each reply of the control plane.
    timeout_s: float = DEFAULT_TIMEOUT_S
    session_idle_s: float = 12 * 3600.0
    session_max_age_s: float = 7 * 86400.0
    #: Origins besides the console's own accepted on state-changing requests
    #: (the public origin when it sits behind a reverse proxy).
    allowed_origins: tuple[str, ...] = ()
    #: A comment line on idle event streams, so proxies keep them open.
    keepalive_s: float = 15.0
    #: Log lines shown on a task's page (the newest are kept).
    max_log_lines: int = 5000

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url is required")
        if self.timeout_s <= 0 or self.keepalive_s <= 0:
            raise ValueError("timeout_s and keepalive_s must be positive")


# --- failures a handler can raise --------------------------------------------------------


class SignInRequired(Exception):
    """No (valid) session: answer 401 with the sign-in page."""

    def __init__(self, notice: str | None = None) -> None:
        super().__init__(notice or "sign in required")
        self.notice = notice


class RequestRefused(Exception):
    """A state-changing request failed the CSRF checks, or its form was unreadable."""

    def __init__(self, reason: str, status: int = 403) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


# --- the console ------------------------------------------------------------------------


class Console:
    """The state of one running console: the sign-in sessions, each with its own
    NATS connection, and the signal that ends every event stream at shutdown."""

    def __init__(self, settings: WebSettings) -> None:
        self.settings = settings
        self.sessions = SessionStore(
            idle_s=settings.session_idle_s,
            max_age_s=settings.session_max_age_s,
            on_drop=self._forget,
        )
        self.closing = asyncio.Event()
        self._closers: set[asyncio.Task[None]] = set()

    def _client(self, *, user: str | None, token: str) -> OpsClient:
        return OpsClient(
            nats_url=self.settings.nats_url,
            token=token,
            prefix=self.settings.prefix,
            timeout_s=self.settings.timeout_s,
            user=user,
        )

    async def start(self) -> Console:
        """Checks that NATS answers (``OpsError`` "unavailable" if not). A secured
        broker refuses this anonymous probe, which is an answer too."""
        probe = self._client(user=None, token="")
        try:
            await probe.connect()
        except OpsError as exc:
            if exc.code != "unauthorized":
                raise
        finally:
            await probe.close()
        return self

    async def stop(self) -> None:
        self.closing.set()
        self.sessions.clear()
        if self._closers:
            await asyncio.gather(*self._closers, return_exceptions=True)

    def _forget(self, session: Session) -> None:
        client, session.client = session.client, None
        if client is not None:
            closer = asyncio.get_running_loop().create_task(client.close())
            self._closers.add(closer)
            closer.add_done_callback(self._closers.discard)

    async def sign_in(self, *, user: str, token: str) -> tuple[str, Session]:
        """Connects as ``user`` with ``token`` and asks who that is; the session
        keeps the connection. ``OpsError`` "unauthorized" if either is wrong."""
        client = self._client(user=user, token=token)
        await client.connect()
        try:
            me = await client.call("whoami")
            if me.get("name") != user:
                raise OpsError("the token is not this user's", "unauthorized")
        except BaseException:
            await client.close()
            raise
        session_id, session = self.sessions.create(
            token=token, user=user, platform_admin=bool(me.get("platform_admin"))
        )
        session.client = client
        return session_id, session

    async def client(self, session: Session) -> OpsClient:
        """The session's connection, made again if it was lost (a NATS restart)."""
        async with session.lock:
            client: OpsClient | None = session.client
            if client is None or client.nc is None or client.nc.is_closed:
                client = self._client(user=session.user, token=session.token)
                await client.connect()
                session.client = client
            return client


# --- template helpers ------------------------------------------------------------------


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def fmt_when(value: Any) -> str:
    """``2026-12-02 12:09:40`` (UTC, as the API gives it), or an em dash."""
    at = _parse_time(value)
    if at is None:
        return "—"
    return at.strftime("%Y-%m-%d %H:%M:%S")


def fmt_time(value: Any) -> str:
    at = _parse_time(value)
    return "—" if at is None else at.strftime("%H:%M:%S")


def fmt_span(start: Any, end: Any) -> str:
    a, b = _parse_time(start), _parse_time(end)
    if a is None or b is None:
        return ""
    seconds = max(0.0, (b - a).total_seconds())
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def fmt_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def what(task: Mapping[str, Any]) -> str:
    if task.get("goal"):
        return str(task["goal"])
    if task.get("workflow"):
        return f"workflow {task['workflow']}"
    return "—"


def fmt_size(value: Any) -> str:
    if not isinstance(value, int):
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"


def _templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    env = templates.env
    env.autoescape = True
    env.filters.update(
        when=fmt_when,
        time=fmt_time,
        pretty=fmt_json,
        size=fmt_size,
        urlpart=lambda v: quote(str(v), safe=""),
    )
    env.globals.update(span=fmt_span, what=what, TERMINAL=TERMINAL_STATES, STATES=TASK_STATES)
    return templates


def _local_path(value: str | None) -> str:
    """A redirect target after sign-in: a path on this site only."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    return value


def _task_id(request: Request) -> str:
    raw = str(request.path_params.get("task_id", ""))
    try:
        return str(uuid.UUID(raw))
    except ValueError:
        raise HTTPException(404, "no such task") from None


def _own_origin(request: Request) -> str:
    return origin_of(str(request.url)) or ""


# --- the application --------------------------------------------------------------------


class Web:
    """The routes of the console."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.templates = _templates()

    # --- sessions ----------------------------------------------------------------------
    def session(self, request: Request) -> Session:
        session = self.console.sessions.get(request.cookies.get(SESSION_COOKIE))
        if session is None:
            raise SignInRequired()
        request.state.session = session
        return session

    async def call(self, session: Session, verb: str, **args: Any) -> Any:
        try:
            client = await self.console.client(session)
            return await client.call(verb, **args)
        except OpsError as exc:
            if exc.code == "unauthorized":
                # The token was revoked (or the user removed): this session is over.
                self.console.sessions.drop_token(session.token)
                raise SignInRequired("Your sign-in is no longer valid. Sign in again.") from None
            raise

    async def form(self, request: Request) -> dict[str, str]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/x-www-form-urlencoded":
            raise RequestRefused("expected a form", 400)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                raise RequestRefused("the form is too large", 413)
        try:
            parsed = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=16)
        except (UnicodeDecodeError, ValueError):
            raise RequestRefused("the form is unreadable", 400) from None
        return {k: v[0] for k, v in parsed.items() if v}

    def check_origin(self, request: Request) -> None:
        if not same_origin(
            origin=request.headers.get("origin"),
            referer=request.headers.get("referer"),
            own=_own_origin(request),
            allowed=self.console.settings.allowed_origins,
        ):
            raise RequestRefused("the request did not come from this console")

    async def checked_form(self, request: Request, session: Session) -> dict[str, str]:
        """The form of a state-changing request, after the CSRF checks."""
        self.check_origin(request)
        data = await self.form(request)
        if not tokens_match(session.csrf, data.get("csrf")):
            raise RequestRefused("the form expired or did not come from this console")
        return data

    # --- rendering ---------------------------------------------------------------------
    def render(
        self,
        request: Request,
        name: str,
        context: dict[str, Any] | None = None,
        *,
        status: int = 200,
        nav: str = "",
    ) -> Response:
        session: Session | None = getattr(request.state, "session", None)
        ctx: dict[str, Any] = {
            "user": session.user if session else None,
            "platform_admin": session.platform_admin if session else False,
            "csrf": session.csrf if session else None,
            "flashes": session.take_flashes() if session and not name.startswith("_") else [],
            "nav": nav,
        }
        ctx.update(context or {})
        return self.templates.TemplateResponse(request, name, ctx, status_code=status)

    def sign_in_page(
        self, request: Request, *, status: int, notice: str | None = None, error: str | None = None
    ) -> Response:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if request.url.path in ("/login", "/logout") or request.method != "GET":
            target = "/"
        login_csrf = request.cookies.get(LOGIN_CSRF_COOKIE) or new_secret()
        request.state.session = None
        response = self.render(
            request,
            "login.html",
            {
                "next": _local_path(target),
                "login_csrf": login_csrf,
                "notice": notice,
                "error": error,
            },
            status=status,
        )
        self._set_cookie(request, response, LOGIN_CSRF_COOKIE, login_csrf)
        return response

    def _set_cookie(self, request: Request, response: Response, name: str, value: str) -> None:
        response.set_cookie(
            name,
            value,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )

    # --- sign-in -----------------------------------------------------------------------
    async def login_page(self, request: Request) -> Response:
        if self.console.sessions.get(request.cookies.get(SESSION_COOKIE)) is not None:
            return RedirectResponse("/", status_code=303)
        return self.sign_in_page(request, status=200)

    async def login(self, request: Request) -> Response:
        self.check_origin(request)
        data = await self.form(request)
        if not tokens_match(request.cookies.get(LOGIN_CSRF_COOKIE), data.get("login_csrf")):
            raise RequestRefused("the sign-in form expired; reload the page and try again")
        user = (data.get("user") or "").strip()
        token = (data.get("token") or "").strip()
        if (
            not is_valid_token(user)
            or not token
            or len(token) > MAX_TOKEN_CHARS
            or not token.isprintable()
        ):
            return self.sign_in_page(
                request, status=401, error="Enter your user name and your token."
            )
        try:
            session_id, _ = await self.console.sign_in(user=user, token=token)
        except OpsError as exc:
            if exc.code in ("unauthorized", "forbidden", "bad_request"):
                return self.sign_in_page(
                    request, status=401, error="That user name and token were not accepted."
                )
            raise
        log.info("web_sign_in", user=user)
        response = RedirectResponse(_local_path(data.get("next")), status_code=303)
        self._set_cookie(request, response, SESSION_COOKIE, session_id)
        response.delete_cookie(LOGIN_CSRF_COOKIE, path="/")
        return response

    async def logout(self, request: Request) -> Response:
        session = self.session(request)
        await self.checked_form(request, session)
        self.console.sessions.drop(request.cookies.get(SESSION_COOKIE))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    # --- fleet -------------------------------------------------------------------------
    async def _fleet(self, session: Session) -> dict[str, Any]:
        hosts, devices, totals = await asyncio.gather(
            self.call(session, "hosts"),
            self.call(session, "devices"),
            self.call(session, "fleet_counts"),
        )
        by_host: dict[str, list[dict[str, Any]]] = {}
        for d in devices:
            by_host.setdefault(str(d.get("host_id")), []).append(d)
        for ds in by_host.values():
            ds.sort(key=lambda d: str(d.get("device_id")))
        # The fleet's totals from the control plane, not a count of the rows here.
        counts: dict[str, int] = dict(totals.get("devices") or {})
        hosts = sorted(hosts, key=lambda h: str(h.get("host_id")))
        known = {str(h.get("host_id")) for h in hosts}
        return {
            "hosts": hosts,
            "devices_by_host": by_host,
            "orphans": sorted(h for h in by_host if h not in known),
            "device_counts": counts,
            "disagreements": int(totals.get("disagreements") or 0),
            "live_hosts": sum(1 for h in hosts if h.get("live")),
        }

    async def fleet(self, request: Request) -> Response:
        session = self.session(request)
        return self.render(request, "fleet.html", await self._fleet(session), nav="fleet")

    async def fleet_part(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        return self.render(request, "_fleet.html", await self._fleet(session))

    # --- tasks -------------------------------------------------------------------------
    def _filters(self, request: Request) -> dict[str, Any]:
        q = request.query_params
        states = [s for s in q.getlist("state") if s in TASK_STATES]
        host = (q.get("host") or "").strip() or None
        try:
            limit = min(1000, max(1, int(q.get("limit") or 100)))
        except ValueError:
            limit = 100
        return {"states": states, "host": host, "limit": limit}

    async def _tasks(self, session: Session, filters: dict[str, Any]) -> list[dict[str, Any]]:
        tasks: list[dict[str, Any]] = await self.call(
            session,
            "tasks",
            states=filters["states"] or None,
            host=filters["host"],
            limit=filters["limit"],
        )
        return tasks

    async def tasks(self, request: Request) -> Response:
        session = self.session(request)
        filters = self._filters(request)
        tasks = await self._tasks(session, filters)
        query = urlencode(
            [("state", s) for s in filters["states"]]
            + ([("host", filters["host"])] if filters["host"] else [])
            + [("limit", filters["limit"])]
        )
        return self.render(
            request,
            "tasks.html",
            {"tasks": tasks, "filters": filters, "query": query},
            nav="tasks",
        )

    async def tasks_part(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        tasks = await self._tasks(session, self._filters(request))
        return self.render(request, "_task_rows.html", {"tasks": tasks})

    async def task_row(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        task = await self.call(session, "task_show", id=_task_id(request))
        return self.render(request, "_task_rows.html", {"tasks": [task]})

    async def _task(self, session: Session, task_id: str) -> dict[str, Any]:
        task = await self.call(session, "task_show", id=task_id)
        artifacts = await self.call(session, "artifacts", id=task_id)
        lines: list[dict[str, Any]] = []
        after = 0
        while True:
            page = await self.call(session, "logs", id=task_id, after_id=after, limit=LOG_PAGE)
            lines.extend(page["lines"])
            after = page["next_after_id"]
            if len(page["lines"]) < LOG_PAGE:
                break
            lines = lines[-self.console.settings.max_log_lines :]
        return {"task": task, "artifacts": artifacts, "lines": lines}

    async def task(self, request: Request) -> Response:
        session = self.session(request)
        return self.render(
            request, "task.html", await self._task(session, _task_id(request)), nav="tasks"
        )

    async def task_part(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        return self.render(request, "_task.html", await self._task(session, _task_id(request)))

    async def cancel_confirm(self, request: Request) -> Response:
        session = self.session(request)
        task = await self.call(session, "task_show", id=_task_id(request))
        return self.render(request, "cancel.html", {"task": task}, nav="tasks")

    async def cancel(self, request: Request) -> Response:
        session = self.session(request)
        task_id = _task_id(request)
        await self.checked_form(request, session)
        try:
            record = await self.call(session, "cancel", id=task_id)
        except OpsError as exc:
            if exc.code not in ("conflict", "gone"):
                raise
            session.flash("error", f"Not cancelled: {exc.args[0]}")
        else:
            cancel = record.get("cancel") or {}
            by, at = cancel.get("by"), fmt_when(cancel.get("at"))
            if record.get("already_ended"):
                session.flash("error", f"Not cancelled: the task is already {record.get('state')}.")
            elif record.get("completed"):
                text = f"Task cancelled (requested by {by} at {at})."
                if by != session.user:
                    text = f"This task was already cancelled by {by} at {at}."
                session.flash("ok", text)
            else:
                session.flash(
                    "ok",
                    f"Cancel requested by {by} at {at}: the task is {record.get('state')} and "
                    "its host is stopping the attempt; this page shows when it ends.",
                )
            log.info("web_cancel", user=session.user, task_id=task_id)
        return RedirectResponse(f"/tasks/{task_id}", status_code=303)

    async def artifact(self, request: Request) -> Response:
        session = self.session(request)
        task_id = _task_id(request)
        name = str(request.path_params["name"])
        attempt = int(request.path_params["attempt"])
        first = await self.call(
            session, "artifact_get", id=task_id, name=name, attempt=attempt, offset=0
        )
        client = await self.console.client(session)

        async def body() -> AsyncIterator[bytes]:
            meta = first
            offset = len(meta["data"])
            yield bytes(meta["data"])
            while not meta["eof"] and meta["data"]:
                meta = await client.call(
                    "artifact_get", id=task_id, name=name, attempt=attempt, offset=offset
                )
                offset += len(meta["data"])
                yield bytes(meta["data"])

        filename = name.rsplit("/", 1)[-1] or "artifact"
        headers = {
            "content-disposition": f"attachment; filename*=UTF-8''{quote(filename, safe='')}",
        }
        if isinstance(first.get("size"), int):
            headers["content-length"] = str(first["size"])
        return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)

    # --- live --------------------------------------------------------------------------
    async def events(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        only = request.query_params.get("task")
        if only is not None:
            try:
                only = str(uuid.UUID(only))
            except ValueError:
                raise HTTPException(404, "no such task") from None
            await self.call(session, "task_show", id=only)  # 403/404 before streaming
        return StreamingResponse(
            self._stream(session, only),
            media_type="text/event-stream",
            headers={"x-accel-buffering": "no"},
        )

    async def _stream(self, session: Session, only: str | None) -> AsyncIterator[str]:
        """``ready`` once subscribed, then ``task`` events (the allow-listed fields
        of ``ops.client.normalize_event``), a comment line when idle, and ``end``
        when the console stops or the session's token stops being accepted."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=10_000)
        client = await self.console.client(session)
        keepalive = self.console.settings.keepalive_s

        subscribed = asyncio.Event()

        async def pump() -> None:
            try:
                async for event in task_events(client, subscribed=subscribed):
                    if only is None or event["task_id"] == only:
                        with contextlib.suppress(asyncio.QueueFull):
                            queue.put_nowait(event)
            except OpsError:
                pass
            finally:
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(None)

        pumping = asyncio.create_task(pump())
        closing = asyncio.create_task(self.console.closing.wait())
        try:
            # "ready" (the page then says "live" and re-reads what it shows)
            # only once the subscription is in place: no later event is missed.
            ready = asyncio.create_task(subscribed.wait())
            await asyncio.wait({ready, pumping, closing}, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            if not subscribed.is_set():
                yield "event: end\ndata: {}\n\n"
                return
            yield "retry: 2000\nevent: ready\ndata: {}\n\n"
            while True:
                getting = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait(
                    {getting, closing}, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED
                )
                if getting not in done:
                    getting.cancel()
                    if closing in done:
                        yield "event: end\ndata: {}\n\n"
                        return
                    yield ": idle\n\n"
                    continue
                event = getting.result()
                if event is None:
                    yield "event: end\ndata: {}\n\n"
                    return
                yield f"event: task\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
        finally:
            for t in (pumping, closing):
                t.cancel()
            await asyncio.gather(pumping, closing, return_exceptions=True)

    # --- errors ------------------------------------------------------------------------
    def _fragment(self, request: Request) -> bool:
        return bool(getattr(request.state, "fragment", False))

    async def on_sign_in(self, request: Request, exc: Exception) -> Response:
        notice = exc.notice if isinstance(exc, SignInRequired) else None
        if self._fragment(request):
            return PlainTextResponse("sign in required", status_code=401)
        response = self.sign_in_page(request, status=401, notice=notice)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    async def on_refused(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestRefused)
        log.info("web_request_refused", reason=exc.reason, path=request.url.path)
        return self.error_page(
            request, exc.status, "Request refused", f"{exc.reason}. Reload the page and try again."
        )

    async def on_ops_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpsError)
        if exc.code == "unauthorized":
            return await self.on_sign_in(request, SignInRequired())
        message = str(exc.args[0]) if exc.args else exc.code
        if exc.code == "forbidden":
            who = getattr(getattr(request.state, "session", None), "user", None)
            return self.error_page(
                request,
                403,
                "Not allowed",
                f"You are signed in as {who}, who may not do this. A task can be seen and "
                "cancelled by its owner, an owner or admin of its project, or a platform admin.",
                detail=message,
            )
        if exc.code == "not_found":
            return self.error_page(request, 404, "Not found", message)
        if exc.code == "bad_request":
            return self.error_page(request, 400, "Bad request", message)
        if exc.code in ("conflict", "gone"):
            return self.error_page(request, 409, "Conflict", message)
        if exc.code == "unavailable":
            log.warning("web_control_plane_unavailable", error=message)
            return self.error_page(
                request,
                503,
                "Control plane unavailable",
                "The control plane is not answering right now. Try again in a moment.",
            )
        log.warning("web_ops_error", code=exc.code)
        return self.error_page(request, 502, "Unexpected reply", "The control plane failed.")

    async def on_http(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        titles = {404: "Not found", 405: "Method not allowed"}
        return self.error_page(
            request, exc.status_code, titles.get(exc.status_code, "Error"), str(exc.detail)
        )

    def error_page(
        self, request: Request, status: int, title: str, message: str, *, detail: str | None = None
    ) -> Response:
        if self._fragment(request):
            return PlainTextResponse(f"{title}: {message}", status_code=status)
        return self.render(
            request,
            "error.html",
            {"status": status, "title": title, "message": message, "detail": detail},
            status=status,
        )


class SecurityHeaders:
    """Adds the security headers (and ``Cache-Control: no-store`` outside
    ``/static``) to every response, error pages included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = str(scope.get("path", "")).startswith("/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if k.decode().lower() not in SECURITY_HEADERS
                ]
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                if not static:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


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
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
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
