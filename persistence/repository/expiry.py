"""Expiry: attempts whose claim, ack or lease deadline passed end, and how any
active attempt ends (expiry, loss, revocation)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Conflict
from fleetlease.persistence.model import TERMINAL_STATES, EndReason, Expired, TaskState
from fleetlease.persistence.repository._retry import _after_failure
from fleetlease.persistence.repository._sql import (
    _ACTIVE,
    _FENCE_COLUMNS,
    _LEASED,
    UUIDT,
    _arr,
    _hold_devices_stmt,
    _prebuilt,
    _unnest,
)
from fleetlease.persistence.repository._tx import Transactions, log
from fleetlease.persistence.repository._validate import _check_int
from fleetlease.persistence.tables import attempts, device_reservations, tasks

_EXPIRY_REASON = {
    TaskState.ASSIGNED.value: EndReason.CLAIM_EXPIRED,
    TaskState.DISPATCHED.value: EndReason.ACK_EXPIRED,
    TaskState.RUNNING.value: EndReason.LEASE_EXPIRED,
}


@dataclass(frozen=True, kw_only=True)
class _Ending:
    """How one active attempt ends (expiry, loss, revocation)."""

    task_id: str
    attempt: int
    host_id: str
    device_id: str
    old_state: str
    reason: EndReason
    new_state: TaskState
    eligible_at: datetime | None
    terminal_reason: str | None

    def expired(self) -> Expired:
        return Expired(
            task_id=self.task_id,
            attempt=self.attempt,
            host_id=self.host_id,
            device_id=self.device_id,
            reason=self.reason,
            new_state=self.new_state,
            retry_at=self.eligible_at if self.new_state is TaskState.RETRYING else None,
        )


class ExpiryMixin(Transactions):
    """Ending attempts whose deadline passed, and the next deadline."""

    async def expire_due(self, *, limit: int = 500) -> list[Expired]:
        """Attempts whose claim, ack or lease deadline passed: retrying with capped
        exponential backoff (queued at once if base is 0), failed ``lease_expired``
        at the limit, cancelled when a cancel is pending. Reservation released,
        attempt kept with its end reason."""
        _check_int(limit, "limit", 1, 100_000)

        async def run(conn: AsyncConnection, now: datetime) -> list[Expired]:
            due = sa.or_(
                sa.and_(
                    tasks.c.status == TaskState.ASSIGNED.value, attempts.c.claim_deadline <= now
                ),
                sa.and_(tasks.c.status.in_(_LEASED), attempts.c.lease_expires_at <= now),
            )
            # Locking the attempt too makes the deadline recheck see a renewal that
            # committed after our snapshot.
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
                            )
                        )
                        .where(due)
                        .order_by(tasks.c.id)
                        .limit(limit)
                        .with_for_update(of=[tasks, attempts], skip_locked=True)
                    )
                )
                .mappings()
                .all()
            )
            endings = [
                self._ending(r, now, _EXPIRY_REASON[r["status"]], "lease_expired") for r in rows
            ]
            await self._apply_endings(conn, now, endings, hold_devices=True)
            if endings:
                log.info("attempts.expired", count=len(endings))
            return [e.expired() for e in endings]

        return await self._tx("expire_due", run)

    @staticmethod
    def _ending(row: RowMapping, now: datetime, reason: EndReason, terminal_reason: str) -> _Ending:
        state, eligible_at, term = _after_failure(row, now, terminal_reason)
        return _Ending(
            task_id=row["task_id"],
            attempt=row["attempt"],
            host_id=row["a_host_id"],
            device_id=row["a_device_id"],
            old_state=row["status"],
            reason=reason,
            new_state=state,
            eligible_at=eligible_at,
            terminal_reason=term,
        )

    async def _apply_endings(
        self,
        conn: AsyncConnection,
        now: datetime,
        endings: Sequence[_Ending],
        *,
        reconcile_outcome: str | None = None,
        hold_devices: bool = False,
    ) -> None:
        """End a batch of locked active attempts: task state (compare-and-set on the
        old state and attempt), attempt end, reservation release: three statements.
        ``hold_devices`` (expiries): see below."""
        if not endings:
            return
        TS = sa.DateTime(timezone=True)
        r = _unnest(
            "r",
            id=(UUIDT, [e.task_id for e in endings]),
            old_status=(sa.Text, [e.old_state for e in endings]),
            number=(sa.Integer, [e.attempt for e in endings]),
            status=(sa.Text, [e.new_state.value for e in endings]),
            eligible_at=(TS, [e.eligible_at for e in endings]),
            terminal_reason=(sa.Text, [e.terminal_reason for e in endings]),
            finished_at=(TS, [now if e.new_state in TERMINAL_STATES else None for e in endings]),
            end_reason=(sa.Text, [e.reason.value for e in endings]),
        )
        values: dict[str, Any] = {
            "status": r.c.status,
            "eligible_at": sa.func.coalesce(r.c.eligible_at, tasks.c.eligible_at),
            "terminal_reason": r.c.terminal_reason,
            "finished_at": r.c.finished_at,
            "updated_at": now,
        }
        if reconcile_outcome is not None:
            values["reconcile_outcome"] = reconcile_outcome
            values["reconciled_at"] = now
        updated = await conn.execute(
            tasks.update()
            .where(
                tasks.c.id == r.c.id,
                tasks.c.status == r.c.old_status,
                tasks.c.attempt == r.c.number,
            )
            .values(**values)
        )
        if updated.rowcount != len(endings):
            raise Conflict("tasks changed underneath", reason="cas_failed")
        await conn.execute(
            attempts.update()
            .where(
                attempts.c.task_id == r.c.id,
                attempts.c.number == r.c.number,
                attempts.c.ended_at.is_(None),
            )
            .values(ended_at=now, end_reason=r.c.end_reason)
        )
        await conn.execute(
            device_reservations.delete().where(
                device_reservations.c.task_id == sa.any_(_arr([e.task_id for e in endings], UUIDT))
            )
        )
        # An expiry: a host that claimed the device and then fell silent may
        # still be running on it, so the device stays out of use, as "busy", until
        # its host reports it again (its next heartbeat). Hosts do not report their
        # own leases' busy/idle flips; the reservation covered it until now. (A
        # reconcile is the host's own report that it no longer holds the attempt.)
        held = sorted({(e.host_id, e.device_id) for e in endings if e.old_state in _LEASED})
        if hold_devices and held:
            await conn.execute(
                _prebuilt("hold_devices", _hold_devices_stmt),
                {
                    "r_host_id": [h for h, _ in held],
                    "r_device_id": [d for _, d in held],
                    "now": now,
                },
            )

    async def next_deadline(self) -> datetime | None:
        """The earliest claim/ack/lease deadline of any active attempt, or the
        earliest ``eligible_at`` of a retrying task, or None."""

        async def run(conn: AsyncConnection, now: datetime) -> datetime | None:
            deadline = sa.case(
                (tasks.c.status == TaskState.ASSIGNED.value, attempts.c.claim_deadline),
                else_=attempts.c.lease_expires_at,
            )
            active = (
                sa.select(sa.func.min(deadline))
                .select_from(
                    tasks.join(
                        attempts,
                        sa.and_(
                            attempts.c.task_id == tasks.c.id, attempts.c.number == tasks.c.attempt
                        ),
                    )
                )
                .where(tasks.c.status.in_(_ACTIVE))
                .scalar_subquery()
            )
            retry = (
                sa.select(sa.func.min(tasks.c.eligible_at))
                .where(tasks.c.status == TaskState.RETRYING.value)
                .scalar_subquery()
            )
            value = (await conn.execute(sa.select(sa.func.least(active, retry)))).scalar()
            return value

        return await self._tx("next_deadline", run)
