"""The fleet page's drain buttons: ``POST /hosts/{host_id}/drain`` and
``/hosts/{host_id}/undrain`` (a platform admin's; the user API refuses anyone
else, ``forbidden``), each a CSRF-checked form that redirects back to the fleet."""

from __future__ import annotations

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from fleetlease.ops.web.pages import Pages
from fleetlease.transport.subjects import is_valid_token

log = structlog.get_logger("fleetlease.web")


def host_id_of(request: Request) -> str:
    host_id = str(request.path_params["host_id"])
    if not is_valid_token(host_id):
        raise HTTPException(404, "no such host")
    return host_id


class DrainRoutes(Pages):
    """Drain and undrain a host from the fleet page."""

    async def host_drain(self, request: Request) -> Response:
        session = self.session(request)
        host_id = host_id_of(request)
        await self.checked_form(request, session)
        out = await self.call(session, "host_drain", host_id=host_id)
        session.flash(
            "ok",
            f"Host {host_id} drained: it takes no new task; "
            f"{out.get('active', 0)} running attempt(s) finish where they are.",
        )
        log.info("web_host_drain", user=session.user, host_id=host_id)
        return RedirectResponse("/", status_code=303)

    async def host_undrain(self, request: Request) -> Response:
        session = self.session(request)
        host_id = host_id_of(request)
        await self.checked_form(request, session)
        await self.call(session, "host_undrain", host_id=host_id)
        session.flash("ok", f"Host {host_id} takes tasks again.")
        log.info("web_host_undrain", user=session.user, host_id=host_id)
        return RedirectResponse("/", status_code=303)
