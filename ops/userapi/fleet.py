"""The fleet verbs of the user API: ``hosts``, ``devices``, ``fleet_counts`` and
``fleet_history``, readable by every user. ``devices`` names the task of a busy
device only to a user who may read that task; anyone else sees the device busy
with ``task_id`` null."""

from __future__ import annotations

from typing import Any

from fleetlease.ops.userapi.args import Args
from fleetlease.ops.userapi.context import ApiContext
from fleetlease.ops.userapi.projection import plain, project_device, project_host
from fleetlease.persistence.model import User


class FleetVerbs(ApiContext):
    """The hosts and devices of the fleet, and their totals."""

    async def hosts(self, user: User, args: Any) -> list[dict[str, Any]]:
        Args(args, ())
        return [h for h in map(project_host, await self.repo.list_hosts()) if not h["revoked"]]

    async def devices(self, user: User, args: Any) -> list[dict[str, Any]]:
        a = Args(args, ("host",))
        host = a.name("host")
        return [project_device(d) for d in await self.repo.fleet_devices(user, host_id=host)]

    async def fleet_counts(self, user: User, args: Any) -> dict[str, Any]:
        """Totals: devices by state (as the fleet view shows them) and the tasks
        this user may read by state, however few rows a list shows."""
        a = Args(args, ("host",))
        counts: dict[str, Any] = plain(await self.repo.fleet_counts(user, host_id=a.name("host")))
        return counts

    async def fleet_history(self, user: User, args: Any) -> dict[str, Any]:
        """The fleet's last hour (``ops/observe/history.py``): fleet-wide totals
        only, no task, user or project in them. Without a running history
        (an API outside ``ControlPlaneService``), no points."""
        Args(args, ())
        history = getattr(self.service, "history", None)
        if history is None:
            return {"interval_s": None, "window_s": None, "points": []}
        snapshot: dict[str, Any] = history.snapshot()
        return snapshot
