"""The fleet health page: small charts of the fleet's last hour (queue depth,
tasks finished per minute by outcome, dispatch latency p50/p99, devices by
state), drawn in the browser by ``static/charts.js`` from ``/health/data``.

The data is the control plane's own history (``ops/observe/history.py``),
read with the signed-in user's connection through the ``fleet_history`` verb
like every other page's data; the page polls it at the history's interval.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleetlease.ops.web.pages import Pages


class HealthRoutes(Pages):
    """``/health`` and its data ``/health/data``."""

    async def health(self, request: Request) -> Response:
        self.session(request)
        return self.render(request, "health.html", nav="health")

    async def health_data(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        history = await self.call(session, "fleet_history")
        return JSONResponse(history)
