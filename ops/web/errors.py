"""How the console answers a failure: 401 shows the sign-in page, 403 a "not
allowed" page, 404 "not found", 503 "the control plane is not answering"
(never the NATS URL or any path)."""

from __future__ import annotations

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from fleetlease.ops.client import OpsError
from fleetlease.ops.web.pages import Pages, RequestRefused, SignInRequired
from fleetlease.ops.web.sessions import SESSION_COOKIE

log = structlog.get_logger("fleetlease.web")


class ErrorHandlers(Pages):
    """The exception handlers ``create_app`` installs."""

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
