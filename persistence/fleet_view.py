"""The fleet view: what each device is doing, and the fleet's totals.

A device's state in the view comes from the control plane's own record first:
a device that holds an active reservation is ``busy`` with that reservation's
task, one that holds none is ``idle`` or ``offline``. The host's last snapshot
(``reported``) lags behind the reservations by up to a heartbeat period (an
agent sends no heartbeat for the flips of its own leases), so it only decides
between ``idle`` and ``offline``. Where the snapshot and the reservation
disagree (a reserved device reported ``idle`` or ``offline``, an unreserved one
reported ``busy``) the row says so in ``disagreement`` instead of silently
picking one side.

The counts are totals over the whole fleet (devices) and over the tasks a user
may read, computed in the database, never from a page of rows.

Every user may see every device and whether it is busy, but which task keeps
it busy (``task_id`` and its ``attempt``) only if that user may read the task
(its owner, an owner or admin of its project, a platform admin): for anyone
else the row is ``busy`` with ``task_id`` and ``attempt`` None.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.tables import (
    device_drains,
    device_reservations,
    devices,
    hosts,
    tasks,
)

#: The states a device can have in the view.
VIEW_STATES: tuple[str, ...] = ("idle", "busy", "offline")


def device_view_state(reported: str, task_id: str | None) -> tuple[str, str | None]:
    """The view's state of a device from the host's ``reported`` state and the
    task of its active reservation (None without one), and the disagreement
    between the two (None when they agree)."""
    if task_id is not None:
        if reported == "busy":
            return "busy", None
        return "busy", f"reserved for a task, host reports {reported}"
    if reported == "busy":
        return "idle", "no reservation, host reports busy"
    return ("offline" if reported == "offline" else "idle"), None


def _joined() -> sa.Join:
    return devices.outerjoin(
        device_reservations,
        sa.and_(
            device_reservations.c.host_id == devices.c.host_id,
            device_reservations.c.device_id == devices.c.device_id,
        ),
    )


async def read_devices(
    conn: AsyncConnection,
    *,
    visible: sa.ColumnElement[bool],
    host_id: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Devices in (host, device) order, as the view shows them to a user whose
    readable tasks the ``visible`` clause (over ``tasks``) admits: the task of
    a reservation outside it is withheld (``task_id`` and ``attempt`` None);
    ``drained``: the device or its host is drained (takes no new assignment)."""
    readable = sa.case((sa.and_(tasks.c.id.is_not(None), visible), sa.true()), else_=sa.false())
    drained = sa.or_(
        sa.exists().where(
            device_drains.c.host_id == devices.c.host_id,
            device_drains.c.device_id == devices.c.device_id,
        ),
        sa.exists().where(
            hosts.c.host_id == devices.c.host_id, hosts.c.drain_requested_at.is_not(None)
        ),
    )
    stmt = (
        sa.select(
            devices.c.host_id,
            devices.c.device_id,
            devices.c.state,
            devices.c.capabilities,
            device_reservations.c.task_id,
            device_reservations.c.attempt,
            readable.label("readable"),
            drained.label("drained"),
        )
        .select_from(_joined().outerjoin(tasks, tasks.c.id == device_reservations.c.task_id))
        .order_by(devices.c.host_id, devices.c.device_id)
    )
    if host_id is not None:
        stmt = stmt.where(devices.c.host_id == host_id)
    if limit is not None:
        stmt = stmt.limit(limit)
    out: list[dict[str, Any]] = []
    for r in (await conn.execute(stmt)).all():
        task_id = str(r.task_id) if r.task_id is not None else None
        state, disagreement = device_view_state(r.state, task_id)
        shown = r.readable and task_id is not None
        out.append(
            {
                "host_id": r.host_id,
                "device_id": r.device_id,
                "state": state,
                "reported": r.state,
                "disagreement": disagreement,
                "capabilities": r.capabilities,
                "task_id": task_id if shown else None,
                "attempt": r.attempt if shown else None,
                "drained": bool(r.drained),
            }
        )
    return out


async def read_counts(
    conn: AsyncConnection, *, visible: sa.ColumnElement[bool], host_id: str | None = None
) -> dict[str, Any]:
    """The fleet's totals: devices by view state (and how many disagree with
    their host's report), tasks the ``visible`` clause admits by state."""
    reserved = device_reservations.c.task_id.is_not(None)
    view_state = sa.case(
        (reserved, sa.literal("busy")),
        (devices.c.state == "offline", sa.literal("offline")),
        else_=sa.literal("idle"),
    )
    disagrees = sa.case(
        (reserved, devices.c.state != "busy"),
        else_=devices.c.state == "busy",
    )
    dev_stmt = (
        sa.select(
            view_state.label("state"),
            sa.func.count().label("n"),
            sa.func.count().filter(disagrees).label("disagree"),
        )
        .select_from(_joined())
        .group_by(view_state)
    )
    if host_id is not None:
        dev_stmt = dev_stmt.where(devices.c.host_id == host_id)
    device_counts = dict.fromkeys(VIEW_STATES, 0)
    disagreements = 0
    for r in (await conn.execute(dev_stmt)).all():
        device_counts[str(r.state)] = int(r.n)
        disagreements += int(r.disagree)
    task_rows = (
        await conn.execute(
            sa.select(tasks.c.status, sa.func.count().label("n"))
            .where(visible)
            .group_by(tasks.c.status)
        )
    ).all()
    task_counts = {str(r.status): int(r.n) for r in task_rows}
    return {
        "devices": device_counts,
        "devices_total": sum(device_counts.values()),
        "disagreements": disagreements,
        "tasks": task_counts,
        "tasks_total": sum(task_counts.values()),
    }


__all__ = ["VIEW_STATES", "device_view_state", "read_counts", "read_devices"]
