"""Cancellation requested by a user."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Forbidden, NotFound
from fleetlease.persistence.model import (
    TERMINAL_STATES,
    WAITING_STATES,
    CancelRecord,
    TaskState,
    User,
)
from fleetlease.persistence.repository._validate import _check_task_id, _check_user
from fleetlease.persistence.repository.transitions import TransitionRunner
from fleetlease.persistence.repository.users import UserMixin
from fleetlease.persistence.tables import tasks


class CancelMixin(TransitionRunner, UserMixin):
    """A user's cancel request."""

    async def request_cancel(self, task_id: str, user: User) -> CancelRecord:
        """Authorized (owner, project admin, platform admin; else ``Forbidden`` and
        nothing written). queued/retrying -> cancelled at once; in flight -> durable
        intent on the task and its current attempt; repeated requests return the
        first intent; a task that ended otherwise (done, failed) returns its
        terminal state with ``ended_before``; nothing is written but the first
        request."""
        tid = _check_task_id(task_id)
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> CancelRecord:
            row = (
                await conn.execute(
                    sa.select(
                        tasks.c.status,
                        tasks.c.attempt,
                        tasks.c.owner,
                        tasks.c.project,
                        tasks.c.cancel_requested_at,
                        tasks.c.cancel_requested_by,
                    )
                    .where(tasks.c.id == tid)
                    .with_for_update()
                )
            ).first()
            if row is None:
                raise NotFound("no such task", task_id=tid)
            if not await self._may_access(conn, user, row.owner, row.project):
                raise Forbidden("not allowed to cancel this task", task_id=tid)
            status = TaskState(row.status)
            if row.cancel_requested_at is not None or status in TERMINAL_STATES:
                requested = row.cancel_requested_at is not None
                return CancelRecord(
                    task_id=tid,
                    state=status,
                    requested_at=row.cancel_requested_at,
                    requested_by=row.cancel_requested_by,
                    completed=status is TaskState.CANCELLED,
                    ended_before=status in TERMINAL_STATES
                    and not (requested and status is TaskState.CANCELLED),
                    repeated=requested,
                )
            intent = {"cancel_requested_at": now, "cancel_requested_by": user.name}
            if status in WAITING_STATES:
                await conn.execute(
                    tasks.update()
                    .where(tasks.c.id == tid, tasks.c.status == status.value)
                    .values(
                        status=TaskState.CANCELLED.value,
                        terminal_reason="cancelled",
                        finished_at=now,
                        updated_at=now,
                        **intent,
                    )
                )
                return CancelRecord(
                    task_id=tid,
                    state=TaskState.CANCELLED,
                    requested_at=now,
                    requested_by=user.name,
                    completed=True,
                )
            await self._update_pair(
                conn,
                tid,
                row.attempt,
                [status.value],
                {**intent, "updated_at": now},
                {"cancel_requested_at": now},
            )
            return CancelRecord(
                task_id=tid,
                state=status,
                requested_at=now,
                requested_by=user.name,
                completed=False,
            )

        return await self._tx("request_cancel", run)
