"""Fencing of host messages: the session current, the task and attempt locked
and read, the lease token, owner, attempt, state and deadline checked, in the
order the module documentation of ``persistence.repository`` gives."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Conflict, Forbidden, Gone, NotFound, Unauthorized
from fleetlease.persistence.model import TERMINAL_STATES, LeaseStatus, Session, TaskState
from fleetlease.persistence.repository._sql import _LEASED, _load_stmt, _prebuilt
from fleetlease.persistence.repository._tx import Transactions
from fleetlease.persistence.repository._validate import (
    MAX_INT32,
    _check_int,
    _check_session,
    _check_str,
    _check_task_id,
)
from fleetlease.persistence.secrets import matches
from fleetlease.persistence.tables import hosts, tasks


def _session_ok(session: Session, generation: int | None, revoked_at: datetime | None) -> bool:
    return (
        generation is not None
        and revoked_at is None
        and session.generation > 0
        and generation == session.generation
    )


def _unauthorized(session: Session) -> Unauthorized:
    return Unauthorized("session is not current", host_id=session.host_id)


class FencingMixin(Transactions):
    """Loading and fencing the rows a host message refers to."""

    async def _load(
        self,
        conn: AsyncConnection,
        session: Session,
        task_id: str,
        attempt: int,
        preloaded: RowMapping | None = None,
    ) -> RowMapping:
        """Lock the task and the referenced attempt and read the caller's host row,
        in one statement (or take that row from ``run_many``'s batch read); raise
        the precise error when there is no such pair."""
        if preloaded is not None:
            row: RowMapping | None = preloaded
        else:
            row = (
                (
                    await conn.execute(
                        _prebuilt("load", _load_stmt),
                        {"task_id": task_id, "attempt": attempt, "host_id": session.host_id},
                    )
                )
                .mappings()
                .first()
            )
        if row is not None:
            if not _session_ok(session, row["host_generation"], row["host_revoked_at"]):
                raise _unauthorized(session)
            return row
        await self._check_session_row(conn, session)
        exists = (await conn.execute(sa.select(tasks.c.id).where(tasks.c.id == task_id))).first()
        if exists is None:
            raise NotFound("no such task", task_id=task_id)
        raise Conflict("no such attempt", reason="unknown_attempt", task_id=task_id)

    async def _check_session_row(
        self, conn: AsyncConnection, session: Session, *, lock: bool = False
    ) -> None:
        stmt = sa.select(hosts.c.session_generation, hosts.c.revoked_at).where(
            hosts.c.host_id == session.host_id
        )
        if lock:
            stmt = stmt.with_for_update(read=True)
        host = (await conn.execute(stmt)).first()
        if host is None or not _session_ok(session, host.session_generation, host.revoked_at):
            raise _unauthorized(session)

    @staticmethod
    def _fence_owner(row: RowMapping, session: Session, attempt: int) -> None:
        if row["a_host_id"] != session.host_id:
            raise Forbidden("the attempt belongs to another host", task_id=row["task_id"])
        if attempt != row["attempt"]:
            raise Conflict(
                "stale attempt",
                reason="stale_attempt",
                task_id=row["task_id"],
                current_attempt=row["attempt"],
            )

    @staticmethod
    def _fence_lease(row: RowMapping, session: Session, attempt: int, lease_token: str) -> None:
        """Checks 2-5 of model.md "Fencing" except the deadline (check 1 is done by
        ``_load``). The token is checked first: a lease the caller does not hold is
        a conflict whoever owns it (host-agent.md "Lease is stale or foreign"); valid
        lease evidence presented by another host is forbidden (durable-scheduling.md
        "Invalid endpoint or session")."""
        tid = row["task_id"]
        if not matches(lease_token, row["a_token_hash"]):
            raise Conflict("lease token does not match", reason="wrong_lease", task_id=tid)
        FencingMixin._fence_owner(row, session, attempt)
        if row["a_generation"] != session.generation:
            raise Conflict(
                "the attempt is bound to an older session: reconcile first",
                reason="session_not_bound",
                task_id=tid,
            )
        if row["status"] in TERMINAL_STATES:
            raise Gone("the task is terminal", reason="terminal", task_id=tid, state=row["status"])
        if row["status"] not in _LEASED:
            raise Conflict(
                "the task state does not accept this message",
                reason="wrong_state",
                task_id=tid,
                state=row["status"],
            )

    @staticmethod
    def _check_lease_args(session: Session, task_id: str, attempt: int, lease_token: str) -> str:
        _check_session(session)
        tid = _check_task_id(task_id)
        _check_int(attempt, "attempt", 1, MAX_INT32)
        _check_str(lease_token, "lease_token", max_len=512)
        return tid

    @staticmethod
    def _deadline(row: RowMapping) -> datetime:
        if row["status"] == TaskState.DISPATCHED.value:
            return row["a_ack_deadline"]  # type: ignore[no-any-return]
        return row["a_lease_expires_at"]  # type: ignore[no-any-return]

    def _status(
        self, row: RowMapping, state: str, expires: datetime, *, moved: bool = False
    ) -> LeaseStatus:
        return LeaseStatus(
            task_id=row["task_id"],
            attempt=row["attempt"],
            state=TaskState(state),
            lease_expires_at=expires,
            cancel_requested=row["cancel_requested_at"] is not None,
            moved=moved,
        )
