"""The platform-admin verbs of the user API (``ADMIN_VERBS``): host credentials
(``host_add``, ``host_revoke``, ``host_list``), ``user_add`` and ``project_add``.
The only secrets the API ever returns are the one-time token of ``user_add``
and the one-time credential of ``host_add``, which is what those verbs are for."""

from __future__ import annotations

from typing import Any

import structlog

from fleetlease.ops.userapi.args import Args
from fleetlease.ops.userapi.context import ApiContext
from fleetlease.ops.userapi.projection import plain, project_host
from fleetlease.persistence.model import User

log = structlog.get_logger("fleetlease.ops")

ADMIN_VERBS = frozenset({"user_add", "project_add", "host_add", "host_revoke", "host_list"})


class AdminVerbs(ApiContext):
    """Hosts, users and projects, for a platform admin (``OpsApi.handle``
    refuses these verbs to anyone else)."""

    async def host_list(self, user: User, args: Any) -> list[dict[str, Any]]:
        Args(args, ())
        return [project_host(h) for h in await self.repo.list_hosts()]

    async def host_add(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("host_id",))
        host_id = a.name("host_id", required=True)
        credential = await self.repo.add_host(host_id)
        log.info("host_added", host_id=host_id, by=user.name)
        return {"host_id": host_id, "token": credential}

    async def host_revoke(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("host_id",))
        host_id = a.name("host_id", required=True)
        ended = await self.repo.revoke_host(host_id)
        log.info("host_revoked", host_id=host_id, by=user.name, ended=len(ended))
        disconnected = await self._disconnect_host(host_id)
        return {
            "host_id": host_id,
            "revoked": True,
            "disconnected": disconnected,
            "ended": [
                {
                    "task_id": plain(e.task_id),
                    "attempt": e.attempt,
                    "state": plain(e.new_state),
                    "end_reason": plain(e.reason),
                }
                for e in ended
            ],
        }

    async def _disconnect_host(self, host_id: str) -> int:
        """Kick the revoked host's live NATS connections (broker security on; the
        revocation is already durable, so the callout refuses the reconnects).
        A failure is logged, not raised: the revocation stands either way and
        the application layer already refuses the host's every request."""
        broker_auth = getattr(self.service, "broker_auth", None)
        if broker_auth is None:
            return 0
        try:
            return int(await broker_auth.disconnect_host(host_id))
        except Exception as exc:
            log.warning("host_disconnect_failed", host_id=host_id, error=repr(exc))
            return 0

    async def user_add(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("name", "platform_admin"))
        name = a.name("name", required=True)
        admin = a.flag("platform_admin")
        token = await self.repo.add_user(name, platform_admin=admin)
        log.info("user_added", user=name, platform_admin=admin, by=user.name)
        return {"name": name, "platform_admin": admin, "token": token}

    async def project_add(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("name", "owner", "admins"))
        name = a.name("name", required=True)
        owner = a.name("owner", required=True)
        admins = a.names("admins")
        await self.repo.add_project(name, owner=owner, admins=admins)
        log.info("project_added", project=name, owner=owner, by=user.name)
        return {"name": name, "owner": owner, "admins": admins}
