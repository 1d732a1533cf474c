"""Signing in and out of the console. Sign-in attempts are limited per user
name and per client address (``ratelimit.py``): over a limit the sign-in page
answers 429 with ``Retry-After``, the same whoever the name is."""

from __future__ import annotations

import structlog
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from fleetlease.ops.client import OpsError
from fleetlease.ops.web.pages import Pages, RequestRefused, local_path
from fleetlease.ops.web.ratelimit import SignInThrottled
from fleetlease.ops.web.sessions import (
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    SessionsFull,
    tokens_match,
)
from fleetlease.transport.subjects import is_valid_token

log = structlog.get_logger("fleetlease.web")

MAX_TOKEN_CHARS = 512


class SignInRoutes(Pages):
    """``/login`` (the form and its post) and ``/logout``."""

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
        address = request.client.host if request.client else "unknown"
        try:
            session_id, _ = await self.console.sign_in(user=user, token=token, address=address)
        except SignInThrottled as exc:
            log.info("web_sign_in_throttled", retry_after_s=exc.retry_after_s)
            response = self.sign_in_page(
                request,
                status=429,
                error=(
                    "Too many sign-in attempts. Wait "
                    f"{exc.retry_after_s} second{'s' if exc.retry_after_s != 1 else ''}"
                    " and try again."
                ),
            )
            response.headers["Retry-After"] = str(exc.retry_after_s)
            return response
        except SessionsFull:
            log.warning("web_sessions_full", sessions=len(self.console.sessions))
            response = self.sign_in_page(
                request,
                status=503,
                error="The console has too many open sessions right now. Try again later.",
            )
            response.headers["Retry-After"] = "60"
            return response
        except OpsError as exc:
            if exc.code in ("unauthorized", "forbidden", "bad_request"):
                return self.sign_in_page(
                    request, status=401, error="That user name and token were not accepted."
                )
            raise
        log.info("web_sign_in", user=user)
        response = RedirectResponse(local_path(data.get("next")), status_code=303)
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
