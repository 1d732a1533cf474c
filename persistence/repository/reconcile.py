"""Reconciliation: a host's journal after a new registration, confirming and
rebinding what it still holds and ending what it lost."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Invalid
from fleetlease.persistence.model import (
    TERMINAL_STATES,
    EndReason,
    JournalEntry,
    ReconcileReport,
    ReconcileVerdict,
    Session,
    TaskState,
)
from fleetlease.persistence.repository._sql import _FENCE_COLUMNS, _LEASED, UUIDT, _arr, _unnest
from fleetlease.persistence.repository._tx import log
from fleetlease.persistence.repository._validate import MAX_INT32, _check_session
from fleetlease.persistence.repository.expiry import _EXPIRY_REASON
from fleetlease.persistence.repository.fencing import FencingMixin, _unauthorized
from fleetlease.persistence.repository.hosts import HostMixin
from fleetlease.persistence.secrets import matches
from fleetlease.persistence.tables import attempts, hosts, tasks


class ReconcileMixin(HostMixin, FencingMixin):
    """A host's reconciliation."""

    async def reconcile(self, session: Session, entries: Sequence[JournalEntry]) -> ReconcileReport:
        """Confirm and rebind (to this generation) matching active attempts; verdict
        'discard' for stale/unknown/foreign/wrong-lease/terminal entries; active
        attempts of this host that the host did not report: cancel or retry policy,
        end reason ``reconcile_lost``. Records the outcome on each task.

        Only dispatched/running attempts can be lost (an assigned one was never
        claimed, so the host cannot have journaled it). A confirmed running attempt
        gets a fresh lease; a reported attempt whose deadline already passed is
        discarded (reason ``expired``) and ends as an expiry. Discarded entries
        write nothing."""
        _check_session(session)
        if isinstance(entries, str | bytes) or not isinstance(entries, Sequence):
            raise Invalid("entries must be a sequence of JournalEntry", field="entries")
        for e in entries:
            if not isinstance(e, JournalEntry):
                raise Invalid("entries must be a sequence of JournalEntry", field="entries")
            if isinstance(e.attempt, bool) or not isinstance(e.attempt, int):
                raise Invalid("attempt must be an integer", field="entries.attempt")
            if not isinstance(e.lease_token, str) or not isinstance(e.task_id, str):
                raise Invalid("entries must carry strings", field="entries")

        async def run(conn: AsyncConnection, now: datetime) -> ReconcileReport:
            refreshed = (
                await conn.execute(
                    hosts.update()
                    .where(
                        hosts.c.host_id == session.host_id,
                        hosts.c.session_generation == session.generation,
                        hosts.c.session_generation > 0,
                        hosts.c.revoked_at.is_(None),
                    )
                    .values(last_seen=now)
                    .returning(hosts.c.host_id)
                )
            ).first()
            if refreshed is None:
                raise _unauthorized(session)
            keys: list[tuple[str, int]] = []
            parsed: list[tuple[JournalEntry, str | None]] = []
            for e in entries:
                try:
                    tid: str | None = str(uuid.UUID(e.task_id))
                except ValueError:
                    tid = None
                if tid is not None and 1 <= e.attempt <= MAX_INT32:
                    keys.append((tid, e.attempt))
                else:
                    tid = None
                parsed.append((e, tid))
            active = await self._lock_active_of_host(conn, session.host_id, _LEASED)
            rows = await self._load_many(conn, sorted(set(keys)))
            lease_expiry = now + timedelta(seconds=self.timings.lease_s)
            verdicts: list[ReconcileVerdict] = []
            confirmed: dict[str, tuple[int, str]] = {}
            expired_rows: dict[str, RowMapping] = {}
            for e, tid in parsed:
                row = rows.get((tid, e.attempt)) if tid is not None else None
                reason = self._reconcile_reason(row, session, e, now)
                if reason == "expired" and row is not None:
                    expired_rows[row["task_id"]] = row
                if reason != "confirmed" or row is None:
                    verdicts.append(
                        ReconcileVerdict(
                            task_id=e.task_id, attempt=e.attempt, verdict="discard", reason=reason
                        )
                    )
                    continue
                expires = lease_expiry
                if row["status"] == TaskState.DISPATCHED.value:
                    expires = row["a_ack_deadline"]
                confirmed[row["task_id"]] = (e.attempt, row["status"])
                verdicts.append(
                    ReconcileVerdict(
                        task_id=e.task_id,
                        attempt=e.attempt,
                        verdict="confirmed",
                        reason="confirmed",
                        state=TaskState(row["status"]),
                        cancel_requested=row["cancel_requested_at"] is not None,
                        lease_expires_at=expires,
                    )
                )
            if confirmed:
                ids = sorted(confirmed)
                r = _unnest(
                    "r",
                    id=(UUIDT, ids),
                    number=(sa.Integer, [confirmed[i][0] for i in ids]),
                )
                await conn.execute(
                    attempts.update()
                    .where(attempts.c.task_id == r.c.id, attempts.c.number == r.c.number)
                    .values(
                        session_generation=session.generation,
                        lease_expires_at=sa.case(
                            (attempts.c.acked_at.is_(None), attempts.c.lease_expires_at),
                            else_=lease_expiry,
                        ),
                    )
                )
                await conn.execute(
                    tasks.update()
                    .where(tasks.c.id == sa.any_(_arr(ids, UUIDT)))
                    .values(reconcile_outcome="confirmed", reconciled_at=now)
                )
            lost = [
                self._ending(r, now, EndReason.RECONCILE_LOST, "reconcile_lost")
                for r in active
                if r["task_id"] not in confirmed and r["task_id"] not in expired_rows
            ]
            await self._apply_endings(conn, now, lost, reconcile_outcome="lost")
            late = [
                self._ending(r, now, _EXPIRY_REASON[r["status"]], "lease_expired")
                for r in expired_rows.values()
            ]
            await self._apply_endings(conn, now, late, reconcile_outcome="expired")
            log.info(
                "host.reconciled",
                host_id=session.host_id,
                generation=session.generation,
                confirmed=len(confirmed),
                discarded=len(verdicts) - len(confirmed),
                lost=len(lost) + len(late),
            )
            return ReconcileReport(
                generation=session.generation,
                verdicts=verdicts,
                lost=[x.expired() for x in (*lost, *late)],
            )

        return await self._tx("reconcile", run)

    @staticmethod
    def _reconcile_reason(
        row: RowMapping | None, session: Session, entry: JournalEntry, now: datetime
    ) -> str:
        if row is None:
            return "unknown"
        if row["a_host_id"] != session.host_id:
            return "foreign"
        if row["attempt"] != entry.attempt:
            return "stale_attempt"
        if not matches(entry.lease_token, row["a_token_hash"]):
            return "wrong_lease"
        if row["status"] in TERMINAL_STATES:
            return "terminal"
        if row["status"] not in _LEASED:
            return "not_active"
        if not FencingMixin._deadline(row) > now:
            return "expired"
        return "confirmed"

    async def _load_many(
        self, conn: AsyncConnection, keys: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], RowMapping]:
        """Lock tasks and their referenced attempts for a batch, in task id order."""
        if not keys:
            return {}
        u = _unnest(
            "k",
            task_id=(UUIDT, [k[0] for k in keys]),
            number=(sa.Integer, [k[1] for k in keys]),
        )
        rows = (
            (
                await conn.execute(
                    sa.select(*_FENCE_COLUMNS)
                    .select_from(
                        u.join(
                            attempts,
                            sa.and_(
                                attempts.c.task_id == u.c.task_id,
                                attempts.c.number == u.c.number,
                            ),
                        ).join(tasks, tasks.c.id == attempts.c.task_id)
                    )
                    .order_by(tasks.c.id)
                    .with_for_update(of=[tasks, attempts])
                )
            )
            .mappings()
            .all()
        )
        return {(r["task_id"], r["a_number"]): r for r in rows}
