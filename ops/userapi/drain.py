"""The drain verbs of the user API (``DRAIN_VERBS``, platform admins only):
``host_drain``, ``host_undrain``, ``device_drain`` and ``device_undrain``.

A drained host or device takes no new assignment; its active attempts run on
and, past a host drain's deadline, are handed back by the Reaper and retried
elsewhere (``persistence/repository/drain.py``). Drain state is read back
through ``hosts`` (``drain``) and ``devices`` (``drained``)."""

from __future__ import annotations

import contextlib
from typing import Any

import structlog

from fleetlease.ops.userapi.args import Args
from fleetlease.ops.userapi.context import ApiContext
from fleetlease.persistence.model import User
from fleetlease.persistence.repository.drain import MAX_DRAIN_DEADLINE_S

log = structlog.get_logger("fleetlease.ops")

DRAIN_VERBS = frozenset({"host_drain", "host_undrain", "device_drain", "device_undrain"})

#: The longest device id the verbs accept (as a heartbeat's device snapshot).
_MAX_DEVICE_ID = 256


class DrainVerbs(ApiContext):
    """Draining and undraining hosts and devices, for a platform admin
    (``OpsApi.handle`` refuses these verbs to anyone else)."""

    async def host_drain(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("host_id", "deadline_s"))
        host_id = a.name("host_id", required=True)
        deadline_s = a.number("deadline_s", lo=0, hi=MAX_DRAIN_DEADLINE_S)
        out = await self.repo.drain_host(host_id, deadline_s=deadline_s)
        log.info("host_drain", host_id=host_id, deadline_s=deadline_s, by=user.name)
        if deadline_s is not None:
            # The Reaper reads the new deadline now (and hands back at once
            # when it is zero); otherwise it would at its next wake-up.
            self._poke("poke_reaper")
        return out

    async def host_undrain(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("host_id",))
        host_id = a.name("host_id", required=True)
        out = await self.repo.undrain_host(host_id)
        log.info("host_undrain", host_id=host_id, by=user.name)
        self._poke("wake_scheduler")
        return out

    async def device_drain(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("host_id", "device_id"))
        host_id = a.name("host_id", required=True)
        device_id = a.text("device_id", required=True, max_len=_MAX_DEVICE_ID)
        out = await self.repo.drain_device(host_id, device_id)
        log.info("device_drain", host_id=host_id, device_id=device_id, by=user.name)
        return out

    async def device_undrain(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("host_id", "device_id"))
        host_id = a.name("host_id", required=True)
        device_id = a.text("device_id", required=True, max_len=_MAX_DEVICE_ID)
        out = await self.repo.undrain_device(host_id, device_id)
        log.info("device_undrain", host_id=host_id, device_id=device_id, by=user.name)
        self._poke("wake_scheduler")
        return out

    def _poke(self, name: str) -> None:
        """Nudge the control plane's actor (an in-process stand-in may lack it:
        the drain is durable either way, and the actors read it on their own)."""
        method = getattr(self.cp, name, None)
        if callable(method):
            with contextlib.suppress(Exception):
                method()
