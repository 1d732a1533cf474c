"""The platform-admin verbs of the user API (``ADMIN_VERBS``): host credentials
(``host_add``, ``host_revoke``, ``host_list``), ``user_add``, ``project_add``,
``project_set_retention`` and ``gc`` (retention: ``persistence.retention``).
The only secrets the API ever returns are the one-time token of ``user_add``
and the one-time credential of ``host_add``, which is what those verbs are for."""

from __future__ import annotations

from typing import Any

import structlog

from fleetlease.ops.gc import PASS_BATCHES
from fleetlease.ops.userapi.args import Args
from fleetlease.ops.userapi.context import ApiContext
from fleetlease.ops.userapi.projection import plain, project_host
from fleetlease.persistence.errors import Unavailable
from fleetlease.persistence.model import User
from fleetlease.persistence.retention import check_retention, format_retention

log = structlog.get_logger("fleetlease.ops")


ADMIN_VERBS = frozenset(
    {
        "user_add",
        "project_add",
        "project_set_retention",
        "gc",
        "host_add",
        "host_revoke",
        "host_list",
    }
)


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

    def _collector(self) -> Any:
        gc = getattr(self.service, "gc", None)
        if gc is None:
            raise Unavailable("retention is not served by this process")
        return gc

    async def project_set_retention(self, user: User, args: Any) -> dict[str, Any]:
        """``retain_s``: seconds to keep the project's finished tasks (0:
        forever); absent or None: the control plane's default."""
        a = Args(args, ("name", "retain_s"))
        name = a.name("name", required=True)
        retain_s = args.get("retain_s")
        if retain_s is not None:
            check_retention(retain_s)
        gc = self._collector()
        await gc.retention.set_project(name, retain_s)
        log.info("project_retention_set", project=name, retain_s=retain_s, by=user.name)
        default_s = gc.retention.default_s
        return {
            "name": name,
            "retain_s": retain_s,
            "retain": format_retention(retain_s),
            "effective": format_retention(default_s if retain_s is None else retain_s),
        }

    async def gc(self, user: User, args: Any) -> dict[str, Any]:
        """A retention pass now, of at most ``PASS_BATCHES`` batches so that it
        answers within a client's timeout (``complete`` false: ask again);
        ``dry_run``: what it would delete, nothing deleted. Counts and bytes
        per project, and the batches committed."""
        a = Args(args, ("dry_run",))
        dry_run = a.flag("dry_run")
        gc = self._collector()
        report = await gc.run(dry_run=dry_run, max_batches=PASS_BATCHES)
        if not dry_run:
            log.info("gc_requested", by=user.name, batches=report.batches)
        out: dict[str, Any] = report.as_dict()
        out["default_retain"] = format_retention(gc.retention.default_s)
        return out
