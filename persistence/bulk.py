"""Bulk cancellation of waiting tasks: the write behind ``cancel --state queued
--project P``.

Only waiting tasks (``queued``, ``retrying``) are cancelled here: they hold no
device and no attempt in flight, so cancelling one is one row's update, the
same as ``Repository.request_cancel`` makes for a single waiting task. A task
that the scheduler assigns meanwhile is no longer waiting when the update
re-checks its state under the row lock, and is left alone (cancel it by id: its
host must be told).

A bulk cancel runs in batches, one transaction each. Its ``bound`` (the highest
submission number when it began) keeps later submissions out of it, so it
ends even while tasks keep arriving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Invalid
from fleetlease.persistence.model import WAITING_STATES, TaskState, User
from fleetlease.persistence.repository import Repository, _check_user
from fleetlease.persistence.tables import attempts, tasks

#: The most tasks one batch (one transaction) cancels.
MAX_CANCEL_BATCH = 1000
_WAITING = frozenset(s.value for s in WAITING_STATES)


@dataclass(frozen=True, kw_only=True)
class CancelFilter:
    """Which waiting tasks a bulk cancel takes: of ``project``, in ``states``,
    whose latest attempt ran on ``host_id`` (if given), submitted at least
    ``older_than_s`` seconds ago (if given), and no later than submission
    number ``bound`` (if given)."""

    project: str
    states: Sequence[str] = (TaskState.QUEUED.value,)
    host_id: str | None = None
    older_than_s: float | None = None
    bound: int | None = None

    def check(self) -> None:
        if not isinstance(self.project, str) or not self.project:
            raise Invalid("project is required", field="project")
        if not self.states:
            raise Invalid("states must name at least one waiting state", field="states")
        for s in self.states:
            if s not in _WAITING:
                raise Invalid(
                    f"only waiting tasks ({', '.join(sorted(_WAITING))}) are cancelled in bulk; "
                    f"cancel a {s} task by its id",
                    field="states",
                )
        if self.older_than_s is not None and not 0 <= self.older_than_s <= 10 * 365 * 86400:
            raise Invalid("older_than_s is out of range", field="older_than_s")

    def where(self, user: User, now: datetime, visible: sa.ColumnElement[bool]) -> list[Any]:
        conds: list[Any] = [
            visible,
            tasks.c.project == self.project,
            tasks.c.status.in_(sorted(set(self.states))),
        ]
        if self.older_than_s is not None:
            conds.append(tasks.c.created_at <= now - timedelta(seconds=self.older_than_s))
        if self.bound is not None:
            conds.append(tasks.c.seq <= self.bound)
        if self.host_id is not None:
            conds.append(
                sa.exists().where(
                    attempts.c.task_id == tasks.c.id,
                    attempts.c.number == tasks.c.attempt,
                    attempts.c.host_id == self.host_id,
                )
            )
        return conds


@dataclass(frozen=True, kw_only=True)
class CancelBatch:
    """What one batch did: the tasks it cancelled (with their attempt numbers),
    how many matched before it (with ``dry_run``: without cancelling), and the
    bound to pass to the next batch."""

    cancelled: list[tuple[str, int]]
    matched: int
    bound: int


class BulkCancel:
    """Bulk cancellation over one repository (its engine, clock and retries)."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo

    async def batch(
        self, user: User, f: CancelFilter, *, limit: int = MAX_CANCEL_BATCH, dry_run: bool = False
    ) -> CancelBatch:
        """Cancel up to ``limit`` matching tasks, oldest first, in one
        transaction (``dry_run``: only count them). Tasks locked by another
        transaction (being assigned) are skipped, not waited for."""
        _check_user(user)
        f.check()
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise Invalid("limit must be an integer", field="limit")
        if not 1 <= limit <= MAX_CANCEL_BATCH:
            raise Invalid(f"limit must be in 1..{MAX_CANCEL_BATCH}", field="limit")

        async def run(conn: AsyncConnection, now: datetime) -> CancelBatch:
            bound = f.bound
            if bound is None:
                bound = int((await conn.execute(sa.select(sa.func.max(tasks.c.seq)))).scalar() or 0)
            bounded = CancelFilter(
                project=f.project,
                states=f.states,
                host_id=f.host_id,
                older_than_s=f.older_than_s,
                bound=bound,
            )
            conds = bounded.where(user, now, self.repo._visible(user))
            matched = int(
                (await conn.execute(sa.select(sa.func.count()).where(*conds))).scalar() or 0
            )
            if dry_run or matched == 0:
                return CancelBatch(cancelled=[], matched=matched, bound=bound)
            chosen = (
                sa.select(tasks.c.id)
                .where(*conds)
                .order_by(tasks.c.seq)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            rows = await conn.execute(
                tasks.update()
                .where(tasks.c.id.in_(chosen), tasks.c.status.in_(sorted(_WAITING)))
                .values(
                    status=TaskState.CANCELLED.value,
                    terminal_reason="cancelled",
                    finished_at=now,
                    updated_at=now,
                    cancel_requested_at=now,
                    cancel_requested_by=user.name,
                )
                .returning(tasks.c.id, tasks.c.attempt)
            )
            done = [(str(r.id), int(r.attempt)) for r in rows]
            return CancelBatch(cancelled=done, matched=matched, bound=bound)

        return await self.repo._tx("cancel_many", run)
