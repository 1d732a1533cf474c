"""Drain: hosts and devices that take no new assignment.

A drained host (``hosts.drain_requested_at`` set) or device (a row of
``device_drains``) is left out of the free devices that the assignment reads
(``_serving_host`` and ``_not_reserved_or_drained`` in ``_assign_sql``), so the
count, the ranking and the sample all skip it; its active
attempts run on. A host drain may carry a deadline: past it the Reaper hands the
host's active attempts back (``hand_back_drained``, end reason ``drained``).

A handback follows the task's retry policy like a lease expiry, with one
difference: the task is queued at once, without backoff (the operator, not the
task, ended the attempt). It still counts as an attempt: a task at its attempt
limit fails, with terminal reason ``drained``.

Drain state is durable and survives restarts and heartbeats (the heartbeat
replaces ``devices`` rows, never ``device_drains``). An assignment transaction
that had already read the free devices when a drain committed may still bind
one task to the host; that attempt is an active attempt like any other.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Invalid, NotFound
from fleetlease.persistence.model import EndReason, Expired, TaskState
from fleetlease.persistence.repository._sql import _ACTIVE, _FENCE_COLUMNS
from fleetlease.persistence.repository._tx import log
from fleetlease.persistence.repository._validate import _check_host_id, _check_int, _check_str
from fleetlease.persistence.repository.expiry import _Ending
from fleetlease.persistence.repository.hosts import HostMixin
from fleetlease.persistence.tables import (
    attempts,
    device_drains,
    device_reservations,
    devices,
    hosts,
    tasks,
)

#: The longest drain deadline accepted, in seconds (thirty days).
MAX_DRAIN_DEADLINE_S = 30 * 86400


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


class DrainMixin(HostMixin):
    """Draining and undraining hosts and devices; handing back the attempts of
    hosts whose drain deadline passed."""

    async def drain_host(self, host_id: str, *, deadline_s: float | None = None) -> dict[str, Any]:
        """Drain a host: no new assignment from now on. ``deadline_s`` (seconds
        from now, or None for none): past it, the host's active attempts are
        handed back. Draining a drained host keeps its request time and replaces
        its deadline. Returns ``{host_id, requested_at, deadline, active}``
        (``active``: the host's attempts still assigned, dispatched or running).
        ``NotFound`` for an unknown host."""
        _check_host_id(host_id)
        if deadline_s is not None:
            if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float):
                raise Invalid("deadline_s must be a number of seconds", field="deadline_s")
            if not 0 <= deadline_s <= MAX_DRAIN_DEADLINE_S:
                raise Invalid(
                    f"deadline_s must be between 0 and {MAX_DRAIN_DEADLINE_S}", field="deadline_s"
                )

        async def run(conn: AsyncConnection, now: datetime) -> dict[str, Any]:
            deadline = now + timedelta(seconds=deadline_s) if deadline_s is not None else None
            row = (
                await conn.execute(
                    hosts.update()
                    .where(hosts.c.host_id == host_id)
                    .values(
                        drain_requested_at=sa.func.coalesce(hosts.c.drain_requested_at, now),
                        drain_deadline=deadline,
                    )
                    .returning(hosts.c.drain_requested_at, hosts.c.drain_deadline)
                )
            ).first()
            if row is None:
                raise NotFound("no such host", host_id=host_id)
            active = await self._active_on(conn, host_id, None)
            log.info("host.drained", host_id=host_id, deadline=_iso(deadline), active=active)
            return {
                "host_id": host_id,
                "requested_at": _iso(row.drain_requested_at),
                "deadline": _iso(row.drain_deadline),
                "active": active,
            }

        return await self._tx("drain_host", run)

    async def undrain_host(self, host_id: str) -> dict[str, Any]:
        """End a host's drain: it takes assignments again. Undraining a host
        that is not drained changes nothing. Returns ``{host_id, was_drained}``."""
        _check_host_id(host_id)

        async def run(conn: AsyncConnection, now: datetime) -> dict[str, Any]:
            before = (
                await conn.execute(
                    sa.select(hosts.c.drain_requested_at)
                    .where(hosts.c.host_id == host_id)
                    .with_for_update()
                )
            ).first()
            if before is None:
                raise NotFound("no such host", host_id=host_id)
            await conn.execute(
                hosts.update()
                .where(hosts.c.host_id == host_id)
                .values(drain_requested_at=None, drain_deadline=None)
            )
            was = before.drain_requested_at is not None
            log.info("host.undrained", host_id=host_id, was_drained=was)
            return {"host_id": host_id, "was_drained": was}

        return await self._tx("undrain_host", run)

    async def drain_device(self, host_id: str, device_id: str) -> dict[str, Any]:
        """Drain one device: no new assignment on it; its active attempt runs on.
        The device must be known (reported by its host, or drained already):
        ``NotFound`` otherwise. Returns ``{host_id, device_id, requested_at, active}``."""
        _check_host_id(host_id)
        _check_str(device_id, "device_id", max_len=256)

        async def run(conn: AsyncConnection, now: datetime) -> dict[str, Any]:
            known = (
                await conn.execute(
                    sa.select(
                        sa.exists().where(
                            devices.c.host_id == host_id, devices.c.device_id == device_id
                        )
                        | sa.exists().where(
                            device_drains.c.host_id == host_id,
                            device_drains.c.device_id == device_id,
                        )
                    )
                )
            ).scalar()
            if not known:
                raise NotFound("no such device", host_id=host_id, device_id=device_id)
            await conn.execute(
                pg_insert(device_drains)
                .values(host_id=host_id, device_id=device_id, requested_at=now)
                .on_conflict_do_nothing()
            )
            requested_at = (
                await conn.execute(
                    sa.select(device_drains.c.requested_at).where(
                        device_drains.c.host_id == host_id, device_drains.c.device_id == device_id
                    )
                )
            ).scalar()
            active = await self._active_on(conn, host_id, device_id)
            log.info("device.drained", host_id=host_id, device_id=device_id, active=active)
            return {
                "host_id": host_id,
                "device_id": device_id,
                "requested_at": _iso(requested_at),
                "active": active,
            }

        return await self._tx("drain_device", run)

    async def undrain_device(self, host_id: str, device_id: str) -> dict[str, Any]:
        """End a device's drain. Undraining a device that is not drained changes
        nothing. Returns ``{host_id, device_id, was_drained}``."""
        _check_host_id(host_id)
        _check_str(device_id, "device_id", max_len=256)

        async def run(conn: AsyncConnection, now: datetime) -> dict[str, Any]:
            deleted = await conn.execute(
                device_drains.delete().where(
                    device_drains.c.host_id == host_id, device_drains.c.device_id == device_id
                )
            )
            was = deleted.rowcount > 0
            log.info("device.undrained", host_id=host_id, device_id=device_id, was_drained=was)
            return {"host_id": host_id, "device_id": device_id, "was_drained": was}

        return await self._tx("undrain_device", run)

    async def _active_on(self, conn: AsyncConnection, host_id: str, device_id: str | None) -> int:
        """The attempts that hold a device of the host (or that one device)."""
        stmt = (
            sa.select(sa.func.count())
            .select_from(device_reservations)
            .where(device_reservations.c.host_id == host_id)
        )
        if device_id is not None:
            stmt = stmt.where(device_reservations.c.device_id == device_id)
        return int((await conn.execute(stmt)).scalar() or 0)

    async def hand_back_drained(self, *, limit: int = 500) -> list[Expired]:
        """End the active attempts of drained hosts whose drain deadline has
        passed (end reason ``drained``): queued again at once, or failed at the
        attempt limit, or cancelled with a pending cancel; the reservation is
        released and the device held busy until its host reports it again."""
        _check_int(limit, "limit", 1, 100_000)

        async def run(conn: AsyncConnection, now: datetime) -> list[Expired]:
            rows = (
                (
                    await conn.execute(
                        sa.select(*_FENCE_COLUMNS)
                        .select_from(
                            tasks.join(
                                attempts,
                                sa.and_(
                                    attempts.c.task_id == tasks.c.id,
                                    attempts.c.number == tasks.c.attempt,
                                ),
                            ).join(hosts, hosts.c.host_id == attempts.c.host_id)
                        )
                        .where(
                            tasks.c.status.in_(_ACTIVE),
                            hosts.c.drain_requested_at.is_not(None),
                            hosts.c.drain_deadline <= now,
                        )
                        .order_by(tasks.c.id)
                        .limit(limit)
                        .with_for_update(of=[tasks, attempts], skip_locked=True)
                    )
                )
                .mappings()
                .all()
            )
            endings: list[_Ending] = []
            for r in rows:
                e = self._ending(r, now, EndReason.DRAINED, "drained")
                if e.new_state is TaskState.RETRYING:
                    # No backoff: the operator ended the attempt, not the task.
                    e = _requeued(e, now)
                endings.append(e)
            await self._apply_endings(conn, now, endings, hold_devices=True)
            if endings:
                log.info("attempts.drained", count=len(endings))
            return [e.expired() for e in endings]

        return await self._tx("hand_back_drained", run)

    async def next_drain_deadline(self) -> datetime | None:
        """The earliest drain deadline of a drained host that still has an
        active attempt, or None."""

        async def run(conn: AsyncConnection, now: datetime) -> datetime | None:
            active = sa.exists().where(
                attempts.c.host_id == hosts.c.host_id,
                attempts.c.task_id == tasks.c.id,
                attempts.c.number == tasks.c.attempt,
                tasks.c.status.in_(_ACTIVE),
            )
            value: datetime | None = (
                await conn.execute(
                    sa.select(sa.func.min(hosts.c.drain_deadline)).where(
                        hosts.c.drain_requested_at.is_not(None),
                        hosts.c.drain_deadline.is_not(None),
                        active,
                    )
                )
            ).scalar()
            return value

        return await self._tx("next_drain_deadline", run, autocommit=True)


def _requeued(e: _Ending, now: datetime) -> _Ending:
    return replace(e, new_state=TaskState.QUEUED, eligible_at=now)
