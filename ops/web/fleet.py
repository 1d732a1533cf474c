"""The fleet page: hosts, their devices and the fleet's totals."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from fleetlease.ops.web.pages import Pages
from fleetlease.ops.web.sessions import Session


class FleetRoutes(Pages):
    """``/`` and its live part ``/fleet/part``."""

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
