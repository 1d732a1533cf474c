"""Read models for users and operators: the safe projections of tasks, hosts
and devices."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence import fleet_view
from fleetlease.persistence.errors import Invalid
from fleetlease.persistence.model import TaskState, User
from fleetlease.persistence.repository._sql import _live_host
from fleetlease.persistence.repository._validate import _check_int, _check_task_id, _check_user
from fleetlease.persistence.repository.users import UserMixin
from fleetlease.persistence.tables import attempts, device_reservations, devices, hosts, tasks


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


class ViewMixin(UserMixin):
    """Task, host and device views."""

    @staticmethod
    def _task_summary(row: RowMapping) -> dict[str, Any]:
        """The safe projection of a task row: no token hash, no session, no
        credential ever (the columns are picked one by one, in
        :func:`fleetlease.persistence.reads.task_summary`), without the list's
        request id and cursor."""
        from fleetlease.persistence.reads import task_summary

        summary = task_summary(row)
        del summary["request_id"], summary["cursor"]
        return summary

    async def task_view(self, task_id: str, user: User) -> dict[str, Any]:
        """The safe projection of one task with its attempts (see ops JSON in the
        README). ``NotFound`` when missing, ``Forbidden`` without a role."""
        tid = _check_task_id(task_id)
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> dict[str, Any]:
            row = await self._authorize_task(conn, tid, user)
            view = self._task_summary(row)
            view["request_id"] = row["request_id"]
            from fleetlease.persistence.reads import attempt_history

            view["attempts"] = await attempt_history(conn, tid)
            return view

        return await self._tx("task_view", run)

    async def readable_task_ids(self, user: User, task_ids: Sequence[str]) -> set[str]:
        """Which of ``task_ids`` the user may read (one read-only query; the same
        rule as ``list_tasks``). Ids that are not UUIDs are simply not readable."""
        _check_user(user)
        wanted: set[str] = set()
        for task_id in task_ids:
            try:
                wanted.add(str(uuid.UUID(str(task_id))))
            except ValueError:
                continue
        if not wanted:
            return set()
        if user.platform_admin:
            return wanted

        async def run(conn: AsyncConnection, now: datetime) -> set[str]:
            rows = await conn.execute(
                sa.select(tasks.c.id).where(tasks.c.id.in_(sorted(wanted)), self._visible(user))
            )
            return {str(r[0]) for r in rows}

        return await self._tx("readable_task_ids", run)

    async def list_tasks(
        self,
        user: User,
        *,
        states: Sequence[str] = (),
        host_id: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Tasks the user may see, newest first; ``states`` filters by state and
        ``host_id`` by the host of the current attempt."""
        _check_user(user)
        if isinstance(states, str):
            states = [states]
        try:
            wanted = [TaskState(s).value for s in states]
        except ValueError:
            raise Invalid("unknown task state", field="states") from None
        if host_id is not None and not isinstance(host_id, str):
            raise Invalid("host_id must be a string", field="host_id")
        _check_int(limit, "limit", 1, 10_000)

        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            stmt = sa.select(tasks).where(self._visible(user))
            if wanted:
                stmt = stmt.where(tasks.c.status.in_(wanted))
            if host_id is not None:
                stmt = stmt.where(
                    sa.exists().where(
                        attempts.c.task_id == tasks.c.id,
                        attempts.c.number == tasks.c.attempt,
                        attempts.c.host_id == host_id,
                    )
                )
            rows = (
                (await conn.execute(stmt.order_by(tasks.c.seq.desc()).limit(limit)))
                .mappings()
                .all()
            )
            return [self._task_summary(r) for r in rows]

        return await self._tx("list_tasks", run)

    async def list_hosts(self) -> list[dict[str, Any]]:
        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            count = (
                sa.select(sa.func.count())
                .where(devices.c.host_id == hosts.c.host_id)
                .scalar_subquery()
            )
            rows = (
                await conn.execute(
                    sa.select(
                        hosts.c.host_id,
                        hosts.c.last_seen,
                        hosts.c.session_generation,
                        hosts.c.revoked_at,
                        hosts.c.workflows,
                        hosts.c.goal_runner,
                        hosts.c.drain_requested_at,
                        hosts.c.drain_deadline,
                        _live_host(now, self.timings.liveness_s).label("live"),
                        count.label("devices"),
                    ).order_by(hosts.c.host_id)
                )
            ).all()
            return [
                {
                    "host_id": r.host_id,
                    "live": bool(r.live),
                    "last_seen": _iso(r.last_seen),
                    "session_generation": r.session_generation,
                    "revoked": r.revoked_at is not None,
                    "devices": r.devices,
                    "workflows": r.workflows,
                    "goal_runner": r.goal_runner,
                    "drain": (
                        {
                            "requested_at": _iso(r.drain_requested_at),
                            "deadline": _iso(r.drain_deadline),
                        }
                        if r.drain_requested_at is not None
                        else None
                    ),
                }
                for r in rows
            ]

        return await self._tx("list_hosts", run)

    async def list_devices(self) -> list[dict[str, Any]]:
        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            rows = (
                await conn.execute(
                    sa.select(
                        devices.c.host_id,
                        devices.c.device_id,
                        devices.c.state,
                        devices.c.capabilities,
                        device_reservations.c.task_id,
                    )
                    .outerjoin(
                        device_reservations,
                        sa.and_(
                            device_reservations.c.host_id == devices.c.host_id,
                            device_reservations.c.device_id == devices.c.device_id,
                        ),
                    )
                    .order_by(devices.c.host_id, devices.c.device_id)
                )
            ).all()
            return [
                {
                    "host_id": r.host_id,
                    "device_id": r.device_id,
                    "state": r.state,
                    "capabilities": r.capabilities,
                    "task_id": r.task_id,
                }
                for r in rows
            ]

        return await self._tx("list_devices", run)

    async def fleet_devices(
        self, user: User, *, host_id: str | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Devices as the fleet view shows them to ``user`` (:mod:`fleet_view`):
        the task of a busy device only where ``user`` may read that task."""
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            return await fleet_view.read_devices(
                conn, visible=self._visible(user), host_id=host_id, limit=limit
            )

        return await self._tx("fleet_devices", run)

    async def fleet_counts(self, user: User, *, host_id: str | None = None) -> dict[str, Any]:
        """The fleet's device totals and the totals of the tasks ``user`` may read."""
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> dict[str, Any]:
            return await fleet_view.read_counts(conn, visible=self._visible(user), host_id=host_id)

        return await self._tx("fleet_counts", run)
