"""The assignment's statements: the free devices, the fair ranking of waiting
tasks, locking the next candidates, reserving devices and binding attempts;
and the reads of a host's pending assignments."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
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

# A literal, not a parameter: the plan of a prepared statement may then use the
# partial index of idle devices (``ix_devices_idle``).
_IDLE = devices.c.state == sa.literal_column("'idle'")


def _not_reserved_or_drained() -> list[sa.ColumnElement[bool]]:
    """A device row (of ``devices``) without a reservation and not drained."""
    reserved = sa.exists().where(
        device_reservations.c.host_id == devices.c.host_id,
        device_reservations.c.device_id == devices.c.device_id,
    )
    drained = sa.exists().where(
        device_drains.c.host_id == devices.c.host_id,
        device_drains.c.device_id == devices.c.device_id,
    )
    return [~reserved, ~drained]


def _serving_host() -> list[sa.ColumnElement[bool]]:
    """A host (of ``hosts``) that is live and not drained (params ``live_after``)."""
    return [
        hosts.c.revoked_at.is_(None),
        hosts.c.session_generation > 0,
        hosts.c.last_seen > sa.bindparam("live_after", type_=hosts.c.last_seen.type),
        hosts.c.drain_requested_at.is_(None),
    ]


def _waiting_now() -> sa.ColumnElement[bool]:
    """Some task is waiting and eligible now (params ``now``): the partial index
    on waiting tasks answers it."""
    return sa.exists().where(
        sa.text("tasks.status IN ('queued', 'retrying')"),
        tasks.c.eligible_at <= sa.bindparam("now", type_=tasks.c.eligible_at.type),
    )


def _free_devices_sub() -> Any:
    """Idle devices of live, undrained hosts without a reservation and not
    drained themselves (params ``live_after``). The ranking, the count and the
    sample all apply these conditions, so a drained host or device is excluded
    from each."""
    return (
        sa.select(devices.c.host_id, devices.c.device_id, devices.c.capabilities, hosts.c.workflows)
        .join(hosts, hosts.c.host_id == devices.c.host_id)
        .where(_IDLE, *_serving_host(), *_not_reserved_or_drained())
    )


#: The counts of free devices a pass may ask for (see ``_free_count_stmt``).
FREE_COUNT_CAPS = (64, 256, 1024, 10_000)


def _free_count_stmt(cap: int) -> Any:
    """How many devices are free, counting no further than ``cap``; 0 at once
    when no task is waiting (PostgreSQL evaluates the uncorrelated EXISTS
    first, and then reads no device). Bounds how many candidates a pass locks:
    a pass never holds more waiting tasks than it could place. ``cap`` is a
    literal (one statement per cap, ``FREE_COUNT_CAPS``): with a parameter
    there, PostgreSQL would plan the prepared statement anew on every run,
    which costs more than running it when nothing waits."""
    free = (
        _free_devices_sub()
        .with_only_columns(devices.c.device_id)
        .where(_waiting_now())
        .limit(sa.literal_column(str(int(cap))))
        .subquery("free")
    )
    return sa.select(sa.func.count()).select_from(free)


def _free_sample_stmt() -> Any:
    """For each requirement ``q`` (a selector as JSON text, a workflow or
    NULL, how many devices ``want``, at most ``per_host`` of each host): up to
    ``want`` free devices matching it, hosts in id order. Rows: the
    requirement's ``i``, the device, its capabilities as JSON text and its
    host's workflows.

    Each requirement walks the live hosts by primary key and looks at each
    one's devices by primary key, stopping at ``want``: the rows read grow
    with the devices asked for, not with the fleet (a requirement that only a
    few devices meet walks further to find them). One device per host first
    spreads a pass over many hosts, and so over many parked long-polls."""
    q = _unnest_params(
        "q", i=sa.Integer, selector=sa.Text, workflow=sa.Text, want=sa.Integer, per_host=sa.Integer
    )
    # The host's own conditions are checked inside ``dev``, once per host, not
    # as a filter of the walk: the statistics of ``hosts`` lag behind a fleet
    # that just registered or heartbeated (``last_seen`` always moves past
    # them), and a walk estimated to meet one serving host was planned as a
    # sort of every free device of the fleet (0.6 s a pass at 100,000
    # devices). Unfiltered, the walk is all the hosts in key order, and the
    # limit stops it.
    dev = (
        sa.select(devices.c.device_id, sa.cast(devices.c.capabilities, sa.Text).label("caps"))
        .where(
            *_serving_host(),
            serves_workflow(q.c.workflow, hosts.c.workflows),
            devices.c.host_id == hosts.c.host_id,
            _IDLE,
            devices.c.capabilities.contains(sa.cast(q.c.selector, JSONB)),
            *_not_reserved_or_drained(),
        )
        .order_by(devices.c.device_id)
        .limit(q.c.per_host)
        .correlate_except(devices)
        .lateral("dev")
    )
    pick = (
        sa.select(hosts.c.host_id, dev.c.device_id, dev.c.caps, hosts.c.workflows)
        .select_from(hosts.join(dev, sa.true()))
        .order_by(hosts.c.host_id, dev.c.device_id)
        .limit(q.c.want)
        .lateral("pick")
    )
    return sa.select(
        q.c.i, pick.c.host_id, pick.c.device_id, pick.c.caps, pick.c.workflows
    ).select_from(q.join(pick, sa.true()))


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


def _rank_candidates_stmt(*, filtered: bool = True) -> Any:
    """The first ``scan`` waiting tasks that match some free device, fair across
    projects (round-robin by project, priority then FIFO within one), as ids in
    rank order; nothing locked.

    Only the first few waiting tasks of each project can rank within the first
    n: a short scan of ix_tasks_waiting_project per project (the literal state
    list lets PostgreSQL use the partial index), each scanned task checked
    against the free devices, instead of ranking every waiting task on each
    assignment. The slack (``scan`` = 2n + excluded) covers tasks this
    transaction already holds and those other assigners have locked.

    Unfiltered (``filtered=False``): the same ranking without the check against
    the free devices, with each task's selector (JSON text) and workflow. When
    every task it returns has a free device, it is the filtered ranking, and
    it reads no device (see ``AssignMixin._rank``)."""
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
    conds: list[Any] = [
        tasks.c.project == projects.c.name,
        sa.text("tasks.status IN ('queued', 'retrying')"),
        tasks.c.eligible_at <= now,
    ]
    if filtered:
        conds.append(
            sa.exists().where(
                free_caps.c.capabilities.contains(tasks.c.selector),
                serves_workflow(tasks.c.workflow, free_caps.c.workflows),
            )
        )
    top = (
        sa.select(
            tasks.c.id,
            tasks.c.priority,
            tasks.c.seq,
            sa.cast(tasks.c.selector, sa.Text).label("selector"),
            tasks.c.workflow,
        )
        .where(*conds)
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
        sa.select(top.c.id, top.c.priority, top.c.seq, top.c.selector, top.c.workflow, rn)
        .select_from(projects.join(top, sa.true()))
        .subquery("ranked")
    )
    # No overall limit: every project's first ``scan`` stay candidates, so that
    # concurrent assigners skipping each other's locked tasks still find enough.
    cols = [ranked.c.id] if filtered else [ranked.c.id, ranked.c.selector, ranked.c.workflow]
    return sa.select(*cols).order_by(ranked.c.rn, ranked.c.priority.desc(), ranked.c.seq)


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
