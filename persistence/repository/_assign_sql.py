"""The assignment's statements: the free devices, the fair ranking of waiting
tasks, locking the next candidates, reserving devices and binding attempts;
and the reads of a host's pending assignments."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from fleetlease.persistence.errors import Invalid
from fleetlease.persistence.matching import serves_workflow
from fleetlease.persistence.model import Assignment, TaskState
from fleetlease.persistence.repository._sql import _WAITING, UUIDT, _arr_param, _unnest_params
from fleetlease.persistence.repository._validate import _check_int
from fleetlease.persistence.tables import (
    attempts,
    device_drains,
    device_reservations,
    devices,
    hosts,
    projects,
    tasks,
)


def _free_devices_sub(*, caps_text: bool = False) -> Any:
    """Idle devices of live, undrained hosts without a reservation and not
    drained themselves (params ``live_after``); with ``caps_text`` the
    capabilities come as JSON text (see ``_FreeDevice``). The ranking and the
    pairing both read this, so a drained host or device is excluded from both."""
    reserved = sa.exists().where(
        device_reservations.c.host_id == devices.c.host_id,
        device_reservations.c.device_id == devices.c.device_id,
    )
    drained = sa.exists().where(
        device_drains.c.host_id == devices.c.host_id,
        device_drains.c.device_id == devices.c.device_id,
    )
    caps: Any = devices.c.capabilities
    if caps_text:
        caps = sa.cast(devices.c.capabilities, sa.Text).label("caps")
    return (
        sa.select(devices.c.host_id, devices.c.device_id, caps, hosts.c.workflows)
        .join(hosts, hosts.c.host_id == devices.c.host_id)
        .where(
            devices.c.state == "idle",
            hosts.c.revoked_at.is_(None),
            hosts.c.session_generation > 0,
            hosts.c.last_seen > sa.bindparam("live_after", type_=hosts.c.last_seen.type),
            hosts.c.drain_requested_at.is_(None),
            ~reserved,
            ~drained,
        )
    )


def _free_if_waiting_stmt() -> Any:
    """``_free_devices_stmt``, empty at once when no task is waiting (eligible
    now): PostgreSQL evaluates the uncorrelated EXISTS first, with the partial
    index on waiting tasks, and then skips reading the devices."""
    waiting = sa.exists().where(
        sa.text("tasks.status IN ('queued', 'retrying')"),
        tasks.c.eligible_at <= sa.bindparam("now", type_=tasks.c.eligible_at.type),
    )
    return (
        _free_devices_sub(caps_text=True)
        .where(waiting)
        .order_by(devices.c.host_id, devices.c.device_id)
    )


def _free_devices_stmt() -> Any:
    """The free devices for matching in Python, capabilities as JSON text decoded
    once per distinct text (``_FreeDevice.load``): a fleet's devices share a few
    capability sets, and decoding every row's JSONB would dominate an
    assignment's CPU in a large fleet."""
    return _free_devices_sub(caps_text=True).order_by(devices.c.host_id, devices.c.device_id)


@dataclass(frozen=True, slots=True)
class _FreeDevice:
    host_id: str
    device_id: str
    capabilities: dict[str, Any]
    workflows: list[str] | None = None

    @staticmethod
    def load(rows: Sequence[Any]) -> list[_FreeDevice]:
        decoded: dict[str, dict[str, Any]] = {}
        out = []
        for r in rows:
            caps = decoded.get(r.caps)
            if caps is None:
                caps = decoded[r.caps] = json.loads(r.caps) if r.caps else {}
            out.append(_FreeDevice(r.host_id, r.device_id, caps, r.workflows))
        return out


def _rank_candidates_stmt() -> Any:
    """The first ``scan`` waiting tasks that match some free device, fair across
    projects (round-robin by project, priority then FIFO within one), as ids in
    rank order; nothing locked.

    Only the first few waiting tasks of each project can rank within the first
    n: a short scan of ix_tasks_waiting_project per project (the literal state
    list lets PostgreSQL use the partial index), each scanned task checked
    against the free devices, instead of ranking every waiting task on each
    assignment. The slack (``scan`` = 2n + excluded) covers tasks this
    transaction already holds and those other assigners have locked."""
    now = sa.bindparam("now", type_=tasks.c.eligible_at.type)
    # The distinct capability sets of the free devices, computed once for the
    # statement: each scanned task is checked against those few sets. Checked
    # against the free devices themselves, each task's EXISTS would walk the
    # reserved devices (an anti-join probe each) before finding a free one, so
    # a ranking's cost would grow with the reserved part of the fleet.
    free_caps = (
        _free_devices_sub()
        .with_only_columns(devices.c.capabilities, hosts.c.workflows)
        .distinct()
        .cte("free_caps")
        .prefix_with("MATERIALIZED")
    )
    top = (
        sa.select(tasks.c.id, tasks.c.priority, tasks.c.seq)
        .where(
            tasks.c.project == projects.c.name,
            sa.text("tasks.status IN ('queued', 'retrying')"),
            tasks.c.eligible_at <= now,
            sa.exists().where(
                free_caps.c.capabilities.contains(tasks.c.selector),
                serves_workflow(tasks.c.workflow, free_caps.c.workflows),
            ),
        )
        .order_by(tasks.c.priority.desc(), tasks.c.seq)
        .limit(sa.bindparam("scan", type_=sa.Integer))
        .lateral("top")
    )
    rn = (
        sa.func.row_number()
        .over(partition_by=projects.c.name, order_by=(top.c.priority.desc(), top.c.seq))
        .label("rn")
    )
    ranked = (
        sa.select(top.c.id, top.c.priority, top.c.seq, rn)
        .select_from(projects.join(top, sa.true()))
        .subquery("ranked")
    )
    # No overall limit: every project's first ``scan`` stay candidates, so that
    # concurrent assigners skipping each other's locked tasks still find enough.
    return sa.select(ranked.c.id).order_by(ranked.c.rn, ranked.c.priority.desc(), ranked.c.seq)


def _lock_candidates_stmt() -> Any:
    """The first ``n`` of the ranked tasks ``ids`` that are still waiting, locked
    (SKIP LOCKED: a task another assigner holds drops out). The WHERE is
    rechecked on the locked row, so a task another assigner took meanwhile drops
    out too."""
    ids = _arr_param("ids", UUIDT)
    return (
        sa.select(
            tasks.c.id,
            tasks.c.status,
            tasks.c.attempt,
            tasks.c.selector,
            tasks.c.project,
            tasks.c.workflow,
        )
        .where(
            tasks.c.id == sa.any_(ids),
            sa.or_(*[tasks.c.status == w for w in _WAITING]),
            tasks.c.eligible_at <= sa.bindparam("now", type_=tasks.c.eligible_at.type),
        )
        # In rank order, locking rows one by one until n are held (the limit is
        # above the row locking: skipped rows do not count, the rest stay free).
        .order_by(sa.func.array_position(ids, tasks.c.id))
        .limit(sa.bindparam("n", type_=sa.Integer))
        .with_for_update(of=tasks, skip_locked=True)
    )


def _reserve_and_bind_stmt() -> Any:
    """Reserve devices for tasks (ON CONFLICT DO NOTHING), insert an attempt for
    each reservation made (lease id drawn by PostgreSQL), and move those tasks to
    assigned, in one statement. Returns one row per reservation made: task id,
    lease id, and ``bound``, the number of tasks moved (equal to the row count
    unless a locked task changed, which would be a bug)."""
    r = _unnest_params("r", host_id=sa.Text, device_id=sa.Text, task_id=UUIDT, attempt=sa.Integer)
    now = sa.bindparam("p_now", type_=device_reservations.c.reserved_at.type)
    reserved = (
        pg_insert(device_reservations)
        .from_select(
            ["host_id", "device_id", "task_id", "attempt", "reserved_at"],
            sa.select(r.c.host_id, r.c.device_id, r.c.task_id, r.c.attempt, now),
        )
        .on_conflict_do_nothing()
        .returning(
            device_reservations.c.host_id,
            device_reservations.c.device_id,
            device_reservations.c.task_id,
            device_reservations.c.attempt,
        )
        .cte("reserved")
    )
    inserted = (
        attempts.insert()
        .from_select(
            [
                "task_id",
                "number",
                "host_id",
                "device_id",
                "lease_id",
                "assigned_at",
                "claim_deadline",
            ],
            sa.select(
                reserved.c.task_id,
                reserved.c.attempt,
                reserved.c.host_id,
                reserved.c.device_id,
                sa.func.gen_random_uuid(),
                now,
                sa.bindparam("p_deadline", type_=attempts.c.claim_deadline.type),
            ),
        )
        .returning(attempts.c.task_id, attempts.c.lease_id)
        .cte("inserted")
    )
    bound = (
        tasks.update()
        .where(
            tasks.c.id == reserved.c.task_id,
            sa.or_(*[tasks.c.status == w for w in _WAITING]),
            tasks.c.attempt == reserved.c.attempt - 1,
        )
        .values(
            status=TaskState.ASSIGNED.value,
            attempt=reserved.c.attempt,
            progress_seq=0,
            updated_at=now,
        )
        .returning(tasks.c.id)
        .cte("bound")
    )
    n_bound = sa.select(sa.func.count()).select_from(bound).scalar_subquery().label("bound")
    return sa.select(inserted.c.task_id, inserted.c.lease_id, n_bound)


def _assignment(r: Any) -> Assignment:
    return Assignment(
        task_id=r.id,
        attempt=r.number,
        host_id=r.host_id,
        device_id=r.device_id,
        lease_id=r.lease_id,
        claim_deadline=r.claim_deadline,
        project=r.project,
    )


def _pending_stmt(on_devices: bool) -> Any:
    conds = [
        tasks.c.status == TaskState.ASSIGNED.value,
        attempts.c.host_id == sa.bindparam("host_id", type_=sa.Text),
        attempts.c.claim_deadline > sa.bindparam("now", type_=attempts.c.claim_deadline.type),
    ]
    if on_devices:
        conds.append(attempts.c.device_id == sa.any_(_arr_param("device_ids", sa.Text)))
    return _assignments_select(*conds).limit(sa.bindparam("lim", type_=sa.Integer))


def _pending_params(host_id: str, device_ids: Sequence[str], limit: int | None) -> dict[str, Any]:
    """Checked parameters of ``_pending_stmt`` (``device_ids`` only when given)."""
    if isinstance(device_ids, str) or not all(isinstance(d, str) for d in device_ids):
        raise Invalid("device_ids must be a sequence of strings", field="device_ids")
    if limit is not None:
        _check_int(limit, "limit", 1, 100_000)
    params: dict[str, Any] = {"host_id": host_id, "lim": limit}
    if device_ids:
        params["device_ids"] = list(device_ids)
    return params


def _session_pending_stmt(on_devices: bool) -> Any:
    """The host's session row with its pending assignments (``_pending_stmt``)
    beside it: one row with NULL assignment columns when none is pending, no row
    for an unknown host."""
    p = _pending_stmt(on_devices).lateral("p")
    return (
        sa.select(
            hosts.c.session_generation,
            hosts.c.revoked_at,
            p.c.id,
            p.c.project,
            p.c.number,
            p.c.host_id.label("host_id"),
            p.c.device_id,
            p.c.lease_id,
            p.c.claim_deadline,
        )
        .select_from(hosts.outerjoin(p, sa.true()))
        .where(hosts.c.host_id == sa.bindparam("host_id", type_=sa.Text))
        .order_by(p.c.claim_deadline)
    )


def _assignments_select(*conds: sa.ColumnElement[bool]) -> Any:
    """Current attempts with their task, oldest assignment first."""
    return (
        sa.select(
            tasks.c.id,
            tasks.c.project,
            attempts.c.number,
            attempts.c.host_id,
            attempts.c.device_id,
            attempts.c.lease_id,
            attempts.c.claim_deadline,
        )
        .join(
            attempts,
            sa.and_(attempts.c.task_id == tasks.c.id, attempts.c.number == tasks.c.attempt),
        )
        .where(*conds)
        .order_by(attempts.c.assigned_at, tasks.c.seq)
    )
