"""What every page of the console shares: the signed-in session of a request,
calls to the user API with its user's connection, reading a form and the CSRF
checks of a state-changing request (the checks themselves are in
``sessions.py``), rendering a template, the sign-in page and the error page."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import parse_qs

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from fleetlease.ops.client import OpsError
from fleetlease.ops.web.console import Console
from fleetlease.ops.web.sessions import (
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    Session,
    new_secret,
    origin_of,
    same_origin,
    tokens_match,
)
from fleetlease.ops.web.templating import templates

MAX_FORM_BYTES = 16 * 1024


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


def local_path(value: str | None) -> str:
    """A redirect target after sign-in: a path on this site only."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    return value


def task_id_of(request: Request) -> str:
    raw = str(request.path_params.get("task_id", ""))
    try:
        return str(uuid.UUID(raw))
    except ValueError:
        raise HTTPException(404, "no such task") from None


def own_origin(request: Request) -> str:
    return origin_of(str(request.url)) or ""


class Pages:
    """The base of the console's route groups: the signed-in session, calls to
    the user API as its user, CSRF-checked forms, rendering and the error page."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.templates = templates()

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
            own=own_origin(request),
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
                "next": local_path(target),
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

    def _fragment(self, request: Request) -> bool:
        return bool(getattr(request.state, "fragment", False))

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
