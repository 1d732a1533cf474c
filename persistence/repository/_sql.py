"""Statement building shared by the roles: typed array parameters, statements
built once (``_prebuilt``), the columns and statements that fence a host
message, the compare-and-set of a task and its attempt (alone and batched),
device state changes, and the host, device and user statements."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert

from fleetlease.persistence.model import ACTIVE_STATES, WAITING_STATES, TaskState
from fleetlease.persistence.tables import attempts, device_reservations, devices, hosts, tasks

UUIDT = UUID(as_uuid=False)


_ACTIVE = [s.value for s in ACTIVE_STATES]


_WAITING = [s.value for s in WAITING_STATES]


_LEASED = [TaskState.DISPATCHED.value, TaskState.RUNNING.value]


def _arr(values: Sequence[Any], typ: Any) -> sa.ColumnElement[Any]:
    """A typed array parameter (constant SQL text whatever the length)."""
    return sa.cast(sa.literal(list(values), ARRAY(typ)), ARRAY(typ))


def _unnest(name: str, **cols: tuple[Any, Sequence[Any]]) -> Any:
    """``unnest(array, array, ...) AS name(col, col, ...)`` for batch statements."""
    args = [_arr(values, typ) for typ, values in cols.values()]
    return (
        sa.func.unnest(*args)
        .table_valued(*[sa.column(n, typ) for n, (typ, _) in cols.items()])
        .render_derived(name=name)
    )


def _arr_param(name: str, typ: Any) -> sa.ColumnElement[Any]:
    """A typed array bind parameter, for statements built once."""
    return sa.cast(sa.bindparam(name, type_=ARRAY(typ)), ARRAY(typ))


def _unnest_params(name: str, **cols: Any) -> Any:
    """``_unnest`` with bind parameters ``<name>_<col>`` instead of values."""
    args = [_arr_param(f"{name}_{col}", typ) for col, typ in cols.items()]
    return (
        sa.func.unnest(*args)
        .table_valued(*[sa.column(n, typ) for n, typ in cols.items()])
        .render_derived(name=name)
    )


# Statements on the hot paths are built once, with bind parameters, and kept:
# building a SQLAlchemy expression and its cache key anew for every execution
# dominates the control plane's CPU per task. ``_prebuilt(key, build)`` returns the
# statement of that shape, building it on first use.
_PREBUILT: dict[Any, Any] = {}


_PREBUILT_IDS: set[int] = set()


def _prebuilt(key: Any, build: Callable[[], Any]) -> Any:
    stmt = _PREBUILT.get(key)
    if stmt is None:
        stmt = _PREBUILT[key] = build()
        _PREBUILT_IDS.add(id(stmt))
    return stmt


def _is_prebuilt(stmt: Any) -> bool:
    """Whether ``stmt`` is one of ``_prebuilt``'s (kept for the process's life:
    ``DriverConnection`` may keep its compilation)."""
    return id(stmt) in _PREBUILT_IDS


def _live_host(now: datetime, liveness_s: float) -> sa.ColumnElement[bool]:
    return sa.and_(
        hosts.c.revoked_at.is_(None),
        hosts.c.session_generation > 0,
        hosts.c.last_seen > now - timedelta(seconds=liveness_s),
    )


# Columns read when fencing a host message: the task, the referenced attempt and
# the caller's host row, in one locking statement.
_FENCE_COLUMNS: list[sa.ColumnElement[Any]] = [
    tasks.c.id.label("task_id"),
    tasks.c.status,
    tasks.c.attempt,
    tasks.c.kind,
    tasks.c.goal,
    tasks.c.workflow,
    tasks.c.payload,
    tasks.c.project,
    tasks.c.max_attempts,
    tasks.c.backoff_base_s,
    tasks.c.backoff_cap_s,
    tasks.c.eligible_at,
    tasks.c.cancel_requested_at,
    tasks.c.result_fingerprint,
    tasks.c.result_attempt,
    tasks.c.progress_seq,
    attempts.c.number.label("a_number"),
    attempts.c.host_id.label("a_host_id"),
    attempts.c.device_id.label("a_device_id"),
    attempts.c.lease_id.label("a_lease_id"),
    attempts.c.lease_token_hash.label("a_token_hash"),
    attempts.c.session_generation.label("a_generation"),
    attempts.c.claim_deadline.label("a_claim_deadline"),
    attempts.c.ack_deadline.label("a_ack_deadline"),
    attempts.c.lease_expires_at.label("a_lease_expires_at"),
    attempts.c.ended_at.label("a_ended_at"),
    attempts.c.end_reason.label("a_end_reason"),
]


#: What fencing a renewal and answering it read (not the task's payload, a
#: JSON document decoded for every renewal otherwise).
_LEASE_FENCE_COLUMNS: list[sa.ColumnElement[Any]] = [
    c
    for c in _FENCE_COLUMNS
    if c.key
    in {
        "task_id",
        "status",
        "attempt",
        "cancel_requested_at",
        "a_number",
        "a_host_id",
        "a_token_hash",
        "a_generation",
        "a_ack_deadline",
        "a_lease_expires_at",
    }
]


def _load_stmt() -> Any:
    return (
        sa.select(
            *_FENCE_COLUMNS,
            hosts.c.session_generation.label("host_generation"),
            hosts.c.revoked_at.label("host_revoked_at"),
        )
        .select_from(
            tasks.join(
                attempts,
                sa.and_(
                    attempts.c.task_id == tasks.c.id,
                    attempts.c.number == sa.bindparam("attempt", type_=sa.Integer),
                ),
            ).outerjoin(hosts, hosts.c.host_id == sa.bindparam("host_id", type_=sa.Text))
        )
        .where(tasks.c.id == sa.bindparam("task_id", type_=UUIDT))
        .with_for_update(of=[tasks, attempts])
    )


def _load_many_stmt(lock: bool = True, lease_only: bool = False) -> Any:
    u = _unnest_params("k", task_id=UUIDT, number=sa.Integer, host_id=sa.Text)
    stmt = (
        sa.select(
            *(_LEASE_FENCE_COLUMNS if lease_only else _FENCE_COLUMNS),
            u.c.host_id.label("k_host_id"),
            hosts.c.session_generation.label("host_generation"),
            hosts.c.revoked_at.label("host_revoked_at"),
        )
        .select_from(
            u.join(
                attempts,
                sa.and_(attempts.c.task_id == u.c.task_id, attempts.c.number == u.c.number),
            )
            .join(tasks, tasks.c.id == attempts.c.task_id)
            .outerjoin(hosts, hosts.c.host_id == u.c.host_id)
        )
        .order_by(tasks.c.id)
    )
    return stmt.with_for_update(of=[tasks, attempts]) if lock else stmt


def _set_values(table: sa.Table, prefix: str, keys: tuple[tuple[str, bool], ...]) -> dict[str, Any]:
    return {
        k: sa.null() if is_none else sa.bindparam(f"{prefix}{k}", type_=table.c[k].type)
        for k, is_none in keys
    }


def _update_pair_stmt(
    from_states: tuple[str, ...],
    task_keys: tuple[tuple[str, bool], ...],
    attempt_keys: tuple[tuple[str, bool], ...],
) -> Any:
    attempt = sa.bindparam("p_attempt", type_=sa.Integer)
    t = (
        tasks.update()
        .where(
            tasks.c.id == sa.bindparam("p_task_id", type_=UUIDT),
            sa.or_(*[tasks.c.status == s for s in from_states]),
            tasks.c.attempt == attempt,
        )
        .values(_set_values(tasks, "t_", task_keys))
        .returning(tasks.c.id)
        .cte("t")
    )
    return (
        attempts.update()
        .where(
            attempts.c.task_id == t.c.id,
            attempts.c.number == attempt,
            attempts.c.ended_at.is_(None),
        )
        .values(_set_values(attempts, "a_", attempt_keys))
        .returning(attempts.c.number)
    )


def _update_pairs_cte(
    n: int,
    from_states: tuple[str, ...],
    task_keys: tuple[tuple[str, bool], ...],
    attempt_keys: tuple[tuple[str, bool], ...],
) -> tuple[Any, Any]:
    """``_update_pair_stmt`` for many rows of one shape, as the CTEs ``t<n>``
    (tasks written) and ``a<n>`` (their attempts written). The values come as
    arrays (``v<n>_task_id``, ``v<n>_attempt``, ``v<n>_generation``: the
    attempt's session generation as read, ``v<n>_t_<col>``, ``v<n>_a_<col>``;
    JSON columns as JSON text). A pair is written only if the attempt is still
    open and bound to that generation and the task still in one of
    ``from_states`` at that attempt, both rows locked (in task id order) before
    either is written."""

    def item_type(table: sa.Table, k: str) -> Any:
        typ = table.c[k].type
        return sa.Text if isinstance(typ, sa.JSON) else typ

    cols: dict[str, Any] = {"task_id": UUIDT, "attempt": sa.Integer, "generation": sa.BigInteger}
    cols.update({f"t_{k}": item_type(tasks, k) for k, is_none in task_keys if not is_none})
    cols.update({f"a_{k}": item_type(attempts, k) for k, is_none in attempt_keys if not is_none})
    v = _unnest_params(f"v{n}", **cols)

    def value(source: Any, table: sa.Table, prefix: str, k: str, is_none: bool) -> Any:
        """The new value of ``table.k``: SQL NULL, or the array element in
        ``source`` (JSON text cast back to JSON)."""
        if is_none:
            return sa.null()
        col, typ = source.c[f"{prefix}{k}"], table.c[k].type
        return sa.cast(col, typ) if isinstance(typ, sa.JSON) else col

    carried = [c for c in cols if c.startswith(("t_", "a_"))]
    locked = (
        sa.select(v.c.task_id, v.c.attempt, *[v.c[c] for c in carried])
        .select_from(
            v.join(
                attempts,
                sa.and_(attempts.c.task_id == v.c.task_id, attempts.c.number == v.c.attempt),
            ).join(tasks, tasks.c.id == v.c.task_id)
        )
        .where(
            attempts.c.ended_at.is_(None),
            attempts.c.session_generation.is_not_distinct_from(v.c.generation),
            sa.or_(*[tasks.c.status == s for s in from_states]),
            tasks.c.attempt == v.c.attempt,
        )
        # Task and attempt rows locked in task id order, as every batch locks them.
        .order_by(tasks.c.id)
        .with_for_update(of=[tasks, attempts])
        .cte(f"l{n}")
    )
    a_cols = [c for c in carried if c.startswith("a_")]
    t = (
        tasks.update()
        .where(
            tasks.c.id == locked.c.task_id,
            sa.or_(*[tasks.c.status == s for s in from_states]),
            tasks.c.attempt == locked.c.attempt,
        )
        .values({k: value(locked, tasks, "t_", k, null) for k, null in task_keys})
        # The attempt's values ride along, so the statement names the arrays once.
        .returning(tasks.c.id, locked.c.attempt, *[locked.c[c] for c in a_cols])
        .cte(f"t{n}")
    )
    a = (
        attempts.update()
        .where(
            attempts.c.task_id == t.c.id,
            attempts.c.number == t.c.attempt,
            attempts.c.ended_at.is_(None),
        )
        .values({k: value(t, attempts, "a_", k, null) for k, null in attempt_keys})
        .returning(attempts.c.task_id)
        .cte(f"a{n}")
    )
    return t, a


def _write_batch_stmt(shapes: tuple[Any, ...], release: bool) -> Any:
    """A batch's writes as one statement: per shape, the multi-row
    compare-and-set (``_update_pairs_cte``); with ``release``, the device release
    of ``_release_devices_stmt`` (``task_ids``, ``now``) for those of them
    written. Returns the id of each task written. Every data-modifying CTE runs
    whether or not the outer query reads it; they touch disjoint rows (each task
    at most once, reservations and devices apart from tasks and attempts).

    A task row written without its attempt row cannot happen (both rows are
    locked and checked first); should it, the statement fails (a text that
    is not a number cast to one) and writes nothing, rather than leave a pair
    half-written in autocommit."""
    pairs = [_update_pairs_cte(n, *shape) for n, shape in enumerate(shapes)]
    written = sa.union_all(*[sa.select(a.c.task_id) for _, a in pairs]).cte("written")
    tasks_written = sa.union_all(*[sa.select(t.c.id) for t, _ in pairs]).subquery()
    n_tasks = sa.select(sa.func.count()).select_from(tasks_written).scalar_subquery()
    n_pairs = sa.select(sa.func.count()).select_from(written).scalar_subquery()
    guard = sa.cast(
        sa.case(
            (n_tasks == n_pairs, sa.literal_column("'0'")),
            else_=sa.literal_column("'half-written compare-and-set: '") + sa.cast(n_tasks, sa.Text),
        ),
        sa.Integer,
    ).label("guard")
    # One row at least, so that the guard is evaluated when nothing was written.
    checked = sa.select(guard).cte("checked")
    out = sa.select(written.c.task_id, checked.c.guard).select_from(
        checked.outerjoin(written, sa.true())
    )
    if release:
        freed = (
            device_reservations.delete()
            .where(
                device_reservations.c.task_id == sa.any_(_arr_param("task_ids", UUIDT)),
                device_reservations.c.task_id.in_(sa.select(written.c.task_id)),
            )
            .returning(device_reservations.c.host_id, device_reservations.c.device_id)
            .cte("freed")
        )
        released = _set_device_state_stmt(freed, "busy", "idle").returning(hosts.c.host_id)
        out = out.add_cte(released.cte("released"))
    return out


def _set_device_state_stmt(named: Any, from_state: str, to_state: str) -> Any:
    """The devices ``named`` (host_id, device_id columns) that are ``from_state``
    turn ``to_state``, rows locked in (host, device) order, as every statement
    that locks several device rows does (heartbeats, result batches)."""
    locked = (
        sa.select(devices.c.host_id, devices.c.device_id)
        .join(
            named,
            sa.and_(devices.c.host_id == named.c.host_id, devices.c.device_id == named.c.device_id),
        )
        .where(devices.c.state == from_state)
        .order_by(devices.c.host_id, devices.c.device_id)
        .with_for_update(of=devices)
        .cte("locked")
    )
    changed = (
        devices.update()
        .where(
            devices.c.host_id == locked.c.host_id,
            devices.c.device_id == locked.c.device_id,
            devices.c.state == from_state,
        )
        .values(state=to_state, updated_at=sa.bindparam("now", type_=devices.c.updated_at.type))
        .returning(devices.c.host_id)
        .cte("changed")
    )
    # The host's stored snapshot digest no longer describes its rows: its next
    # heartbeat must carry the complete snapshot. (Comparing the rows' times
    # with the digest's cannot tell: a heartbeat that began after this
    # transaction, but read the rows before it committed, would record a later
    # time than this change's.)
    return (
        hosts.update()
        .where(
            hosts.c.host_id.in_(sa.select(changed.c.host_id)),
            hosts.c.devices_digest.is_not(None),
        )
        .values(devices_digest=sa.null())
    )


def _hold_devices_stmt() -> Any:
    """Expired attempts' idle devices turn busy (see ``_apply_endings``)."""
    named = _unnest_params("r", host_id=sa.Text, device_id=sa.Text)
    return _set_device_state_stmt(named, "idle", "busy")


def _release_devices_stmt() -> Any:
    """Delete the reservations of ``task_ids``; their reported-busy devices turn idle."""
    freed = (
        device_reservations.delete()
        .where(device_reservations.c.task_id == sa.any_(_arr_param("task_ids", UUIDT)))
        .returning(device_reservations.c.host_id, device_reservations.c.device_id)
        .cte("freed")
    )
    return _set_device_state_stmt(freed, "busy", "idle")


def _host_row_stmt() -> Any:
    return sa.select(hosts.c.session_generation, hosts.c.revoked_at).where(
        hosts.c.host_id == sa.bindparam("host_id", type_=sa.Text)
    )


def _host_seen_stmt() -> Any:
    """A complete heartbeat: last_seen, and the tag of the snapshot it carries."""
    return (
        hosts.update()
        .where(
            hosts.c.host_id == sa.bindparam("p_host_id", type_=sa.Text),
            hosts.c.session_generation == sa.bindparam("p_generation", type_=sa.Integer),
            hosts.c.session_generation > 0,
            hosts.c.revoked_at.is_(None),
        )
        .values(
            last_seen=sa.bindparam("p_now", type_=hosts.c.last_seen.type),
            devices_digest=sa.bindparam("p_digest", type_=sa.Text),
            devices_synced_at=sa.bindparam("p_now", type_=hosts.c.last_seen.type),
        )
        .returning(hosts.c.host_id)
    )


def _host_alive_stmt() -> Any:
    """A heartbeat "unchanged since <digest>": last_seen only, and only if the
    stored tag is that digest and no device row of the host changed since it
    was written (the control plane changes some: an expiry holds a device).
    One statement, atomic by itself; no row: refused (``heartbeat_unchanged``
    tells why)."""
    host_id = sa.bindparam("p_host_id", type_=sa.Text)
    changed_since = sa.exists().where(
        devices.c.host_id == host_id, devices.c.updated_at > hosts.c.devices_synced_at
    )
    return (
        hosts.update()
        .where(
            hosts.c.host_id == host_id,
            hosts.c.session_generation == sa.bindparam("p_generation", type_=sa.Integer),
            hosts.c.session_generation > 0,
            hosts.c.revoked_at.is_(None),
            hosts.c.devices_digest == sa.bindparam("p_digest", type_=sa.Text),
            hosts.c.devices_synced_at.is_not(None),
            ~changed_since,
        )
        .values(last_seen=sa.bindparam("p_now", type_=hosts.c.last_seen.type))
        .returning(hosts.c.host_id)
    )


def _devices_gone_stmt() -> Any:
    return devices.delete().where(
        devices.c.host_id == sa.bindparam("p_host_id", type_=sa.Text),
        devices.c.device_id != sa.all_(_arr_param("p_ids", sa.Text)),
    )


def _devices_changed_stmt() -> Any:
    """The host's device rows whose state or capabilities differ from the
    snapshot, rewritten; the others are neither written nor locked. Rows locked
    in device order, as every statement that locks several device rows does."""
    host_id = sa.bindparam("p_host_id", type_=sa.Text)
    r = _unnest_params("r", device_id=sa.Text, state=sa.Text, capabilities=sa.Text)
    caps = sa.cast(r.c.capabilities, devices.c.capabilities.type)
    changed = (
        sa.select(devices.c.device_id, r.c.state, caps.label("capabilities"))
        .select_from(devices.join(r, r.c.device_id == devices.c.device_id))
        .where(
            devices.c.host_id == host_id,
            sa.or_(devices.c.state != r.c.state, devices.c.capabilities != caps),
        )
        .order_by(devices.c.device_id)
        .with_for_update(of=devices)
        .cte("changed")
    )
    return (
        devices.update()
        .where(devices.c.host_id == host_id, devices.c.device_id == changed.c.device_id)
        .values(
            state=changed.c.state,
            capabilities=changed.c.capabilities,
            updated_at=sa.bindparam("p_now", type_=devices.c.updated_at.type),
        )
    )


def _devices_new_stmt() -> Any:
    """The snapshot's devices the host has no row for yet, inserted (existing
    rows are left alone, unlocked)."""
    r = _unnest_params("r", device_id=sa.Text, state=sa.Text, capabilities=sa.Text)
    stmt = pg_insert(devices).from_select(
        ["host_id", "device_id", "state", "capabilities", "updated_at"],
        sa.select(
            sa.bindparam("p_host_id", type_=sa.Text),
            r.c.device_id,
            r.c.state,
            sa.cast(r.c.capabilities, devices.c.capabilities.type),
            sa.bindparam("p_now", type_=devices.c.updated_at.type),
        ),
    )
    return stmt.on_conflict_do_nothing(index_elements=[devices.c.host_id, devices.c.device_id])


#: The user of a token hash (``authenticate_user``, on the driver's connection).
_USER_BY_TOKEN_SQL = "SELECT name, platform_admin FROM users WHERE token_hash = $1"


#: The submitting user's role on a project ($1 the project, $2 the user).
_PROJECT_ROLE_SQL = """
SELECT p.owner,
       EXISTS (SELECT 1 FROM project_admins a
               WHERE a.project = p.name AND a.user_name = $2) AS is_admin
FROM projects p
WHERE p.name = $1
"""
