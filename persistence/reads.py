"""The user-facing read model: what ``tasks``, ``task show``, ``artifacts`` and the
``events`` verb read, as the ops API returns it.

Every read here names the columns it returns and nothing more: a task list never
loads a task's payload or selector (a payload may be hundreds of KB; a page of a
thousand of them would pass through the serving process only to be dropped).
Lists are pages in a fixed order with a cursor: each listed task carries its
``cursor``, and passing the last one back returns the tasks listed after it.
The order is newest first by submission (``tasks.seq``, unique and increasing),
so a task submitted while a client pages is never listed twice and never moves a
task that was already there from one page to another.

Authorization is the repository's: a task is readable by its owner, an owner or
admin of its project, or a platform admin (``Repository._visible`` for lists,
``Repository._authorize_task`` for one task).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Forbidden, Invalid, NotFound
from fleetlease.persistence.matching import waiting_reason
from fleetlease.persistence.model import TaskState, User
from fleetlease.persistence.repository import Repository, _check_task_id, _check_user, _iso
from fleetlease.persistence.tables import artifacts, attempts, tasks

#: The longest page a list read returns.
MAX_PAGE = 1000
#: The longest request id (the ops API's idempotency key).
MAX_REQUEST_ID = 100

_LIST_COLUMNS = (
    tasks.c.id,
    tasks.c.seq,
    tasks.c.status,
    tasks.c.kind,
    tasks.c.goal,
    tasks.c.workflow,
    tasks.c.project,
    tasks.c.owner,
    tasks.c.priority,
    tasks.c.attempt,
    tasks.c.max_attempts,
    tasks.c.eligible_at,
    tasks.c.cancel_requested_at,
    tasks.c.cancel_requested_by,
    tasks.c.result,
    tasks.c.terminal_reason,
    tasks.c.reconcile_outcome,
    tasks.c.reconciled_at,
    tasks.c.created_at,
    tasks.c.updated_at,
    tasks.c.finished_at,
    tasks.c.request_id,
)


def encode_cursor(seq: int) -> str:
    """The cursor of a listed task (opaque to clients)."""
    return f"s{seq}"


def decode_cursor(cursor: object, field: str = "cursor") -> int:
    """The submission number a cursor names; ``Invalid`` for anything else."""
    if not isinstance(cursor, str) or not cursor.startswith("s") or not cursor[1:].isdigit():
        raise Invalid(f"{field} must be a cursor returned by a list", field=field)
    if len(cursor) > 20:
        raise Invalid(f"{field} must be a cursor returned by a list", field=field)
    return int(cursor[1:])


#: A listed task's size beyond its variable-length fields: ids, times, keys.
_ROW_OVERHEAD = 640


def _within(page: Any, max_bytes: int) -> Any:
    """``page`` (a select of ``_LIST_COLUMNS`` in list order, limited) cut
    where the running total of its rows' estimated sizes passes ``max_bytes``.
    The estimate is the JSON text of the variable-length fields (msgpack is
    no larger) plus ``_ROW_OVERHEAD``."""
    inner = page.subquery("page")

    def text_bytes(col: Any) -> Any:
        return sa.func.coalesce(sa.func.octet_length(col), 0)

    size = (
        text_bytes(sa.cast(inner.c.result, sa.Text))
        + text_bytes(inner.c.goal)
        + text_bytes(inner.c.workflow)
        + text_bytes(inner.c.terminal_reason)
        + text_bytes(inner.c.request_id)
        + text_bytes(inner.c.cancel_requested_by)
        + _ROW_OVERHEAD
    )
    sized = sa.select(
        *inner.c,
        size.label("_size"),
        sa.func.sum(size).over(order_by=inner.c.seq.desc()).label("_total"),
    ).subquery("sized")
    keep = [sized.c[c.name] for c in _LIST_COLUMNS]
    return (
        sa.select(*keep)
        .where(sized.c._total - sized.c._size < max_bytes)
        .order_by(sized.c.seq.desc())
    )


def request_id_matches(request_id: str) -> sa.ColumnElement[bool]:
    """The tasks one submit made: its key itself (one task), or the keys the
    ``--count`` batches derive from it (``KEY@OFFSET#I`` from the CLI,
    ``KEY#I`` from one ``count`` request)."""
    return sa.or_(
        tasks.c.request_id == request_id,
        tasks.c.request_id.startswith(request_id + "@", autoescape=True),
        tasks.c.request_id.startswith(request_id + "#", autoescape=True),
    )


#: States of a task waiting for a device.
_WAITING_NOW = frozenset({TaskState.QUEUED.value, TaskState.RETRYING.value})


def task_summary(row: Any) -> dict[str, Any]:
    """The task fields every read returns (the list shape), from a row of
    ``_LIST_COLUMNS`` (or a whole task row)."""
    return {
        "id": row["id"],
        "state": row["status"],
        "kind": row["kind"],
        "goal": row["goal"],
        "workflow": row["workflow"],
        "project": row["project"],
        "owner": row["owner"],
        "priority": row["priority"],
        "attempt": row["attempt"],
        "max_attempts": row["max_attempts"],
        "retry_at": (
            _iso(row["eligible_at"]) if row["status"] == TaskState.RETRYING.value else None
        ),
        "cancel": {
            "requested": row["cancel_requested_at"] is not None,
            "by": row["cancel_requested_by"],
            "at": _iso(row["cancel_requested_at"]),
        },
        "result": row["result"],
        "terminal_reason": row["terminal_reason"],
        "reconcile": {
            "outcome": row["reconcile_outcome"],
            "at": _iso(row["reconciled_at"]),
        },
        "created_at": _iso(row["created_at"]),
        "updated_at": _iso(row["updated_at"]),
        "finished_at": _iso(row["finished_at"]),
        "request_id": row["request_id"],
        "cursor": encode_cursor(int(row["seq"])),
    }


async def attempt_history(conn: AsyncConnection, task_id: str) -> list[dict[str, Any]]:
    """A task's attempts, oldest first, as every task view shows them:
    ``started_at`` is when the host acknowledged the attempt (it began running)."""
    rows = (
        await conn.execute(
            sa.select(
                attempts.c.number,
                attempts.c.host_id,
                attempts.c.device_id,
                attempts.c.lease_id,
                attempts.c.assigned_at,
                attempts.c.claimed_at,
                attempts.c.acked_at,
                attempts.c.lease_expires_at,
                attempts.c.ended_at,
                attempts.c.end_reason,
            )
            .where(attempts.c.task_id == task_id)
            .order_by(attempts.c.number)
        )
    ).all()
    return [
        {
            "number": a.number,
            "host_id": a.host_id,
            "device_id": a.device_id,
            "lease_id": a.lease_id,
            "assigned_at": _iso(a.assigned_at),
            "claimed_at": _iso(a.claimed_at),
            "acked_at": _iso(a.acked_at),
            "started_at": _iso(a.acked_at),
            "lease_expires_at": _iso(a.lease_expires_at),
            "ended_at": _iso(a.ended_at),
            "end_reason": a.end_reason,
        }
        for a in rows
    ]


class Reads:
    """The read model over one repository (its engine, clock and retry rules)."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo

    async def list_tasks(
        self,
        user: User,
        *,
        states: Sequence[str] = (),
        host_id: str | None = None,
        project: str | None = None,
        request_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
        max_bytes: int | None = None,
    ) -> list[dict[str, Any]]:
        """One page of the tasks the user may read, newest first: at most
        ``limit`` (1..``MAX_PAGE``), after the task that carried ``cursor``.
        ``states`` filters by state, ``host_id`` by the host of the current
        attempt, ``project`` by project, ``request_id`` by the submit that made
        the task. Payloads and selectors are not read. ``max_bytes``: the page
        ends before the task that would take its estimated size past it (the
        first task always comes), measured in the database, so large results
        or goals never reach this process beyond it."""
        _check_user(user)
        try:
            wanted = [TaskState(s).value for s in states]
        except ValueError:
            raise Invalid("unknown task state", field="states") from None
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise Invalid(f"limit must be in 1..{MAX_PAGE}", field="limit")
        before = None if cursor is None else decode_cursor(cursor)
        for name, value in (("host", host_id), ("project", project), ("request_id", request_id)):
            if value is not None and (not isinstance(value, str) or not value):
                raise Invalid(f"{name} must be a non-empty string", field=name)
        if request_id is not None and len(request_id) > MAX_REQUEST_ID:
            raise Invalid(f"request_id must be 1..{MAX_REQUEST_ID} characters", field="request_id")

        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            stmt = sa.select(*_LIST_COLUMNS).where(self.repo._visible(user))
            if wanted:
                stmt = stmt.where(tasks.c.status.in_(wanted))
            if project is not None:
                stmt = stmt.where(tasks.c.project == project)
            if request_id is not None:
                stmt = stmt.where(request_id_matches(request_id))
            if before is not None:
                stmt = stmt.where(tasks.c.seq < before)
            if host_id is not None:
                stmt = stmt.where(
                    sa.exists().where(
                        attempts.c.task_id == tasks.c.id,
                        attempts.c.number == tasks.c.attempt,
                        attempts.c.host_id == host_id,
                    )
                )
            stmt = stmt.order_by(tasks.c.seq.desc()).limit(limit)
            if max_bytes is not None:
                stmt = _within(stmt, max_bytes)
            rows = (await conn.execute(stmt)).mappings().all()
            return [task_summary(r) for r in rows]

        return await self.repo._tx("list_tasks", run)

    async def task_view(self, task_id: str, user: User) -> dict[str, Any]:
        """One task with its payload, selector and attempts (the ``task show``
        shape). ``NotFound`` when missing, ``Forbidden`` without a role. An
        attempt's ``started_at`` is when its host acknowledged it (it started
        running); ``null`` before that."""
        tid = _check_task_id(task_id)
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> dict[str, Any]:
            row = await self.repo._authorize_task(conn, tid, user)
            view = task_summary(row)
            view["payload"] = row["payload"]
            view["selector"] = row["selector"]
            view["waiting_reason"] = (
                await waiting_reason(conn, now, self.repo.timings.liveness_s, row["workflow"])
                if row["status"] in _WAITING_NOW
                else None
            )
            view["attempts"] = await attempt_history(conn, tid)
            return view

        return await self.repo._tx("task_view", run)

    async def _authorize(
        self, conn: AsyncConnection, task_id: str, user: User, *columns: Any
    ) -> Any:
        """The task's ``columns`` if the user may read it (its owner and project
        only otherwise: never its payload); ``NotFound`` / ``Forbidden`` as
        ``Repository._authorize_task``."""
        row = (
            await conn.execute(
                sa.select(tasks.c.owner, tasks.c.project, *columns).where(tasks.c.id == task_id)
            )
        ).first()
        if row is None:
            raise NotFound("no such task", task_id=task_id)
        if not await self.repo._may_access(conn, user, row.owner, row.project):
            raise Forbidden("not allowed to read this task", task_id=task_id)
        return row

    async def task_state(self, task_id: str, user: User) -> str:
        """The task's state, authorized like ``task_view`` (what a log page
        reports, read without the task's payload)."""
        tid = _check_task_id(task_id)
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> str:
            return str((await self._authorize(conn, tid, user, tasks.c.status)).status)

        return await self.repo._tx("task_state", run)

    async def list_artifacts(self, task_id: str, user: User) -> list[dict[str, Any]]:
        """A task's artifacts, ``[{task_id, attempt, name, size, sha256,
        object_name, created_at}]``, authorized like ``task_view``.
        ``object_name`` is the control plane's object-store key (never
        returned to a user)."""
        tid = _check_task_id(task_id)
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            await self._authorize(conn, tid, user)
            rows = (
                await conn.execute(
                    sa.select(
                        artifacts.c.task_id,
                        artifacts.c.attempt,
                        artifacts.c.name,
                        artifacts.c.size,
                        artifacts.c.sha256,
                        artifacts.c.object_name,
                        artifacts.c.created_at,
                    )
                    .where(artifacts.c.task_id == tid)
                    .order_by(artifacts.c.attempt, artifacts.c.name)
                )
            ).all()
            return [
                {
                    "task_id": str(r.task_id),
                    "attempt": r.attempt,
                    "name": r.name,
                    "size": r.size,
                    "sha256": r.sha256,
                    "object_name": r.object_name,
                    "created_at": _iso(r.created_at),
                }
                for r in rows
            ]

        return await self.repo._tx("list_artifacts", run)
