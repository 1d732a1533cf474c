"""The lease of an attempt: claim (assigned -> dispatched), ack (-> running),
renew and progress."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import (
    Conflict,
    Gone,
    Invalid,
    NotFound,
    RepositoryError,
    Unavailable,
)
from fleetlease.persistence.model import (
    TERMINAL_STATES,
    Claimed,
    LeaseStatus,
    Session,
    TaskKind,
    TaskState,
)
from fleetlease.persistence.repository._lease_sql import (
    _RENEW_READ_SQL,
    _RENEW_WRITE_SQL,
    _extend_leases_stmt,
)
from fleetlease.persistence.repository._sql import _FENCE_COLUMNS, _LEASED, UUIDT, _arr, _prebuilt
from fleetlease.persistence.repository._validate import (
    MAX_INT32,
    _check_int,
    _check_session,
    _check_task_id,
)
from fleetlease.persistence.repository.fencing import FencingMixin, _session_ok, _unauthorized
from fleetlease.persistence.repository.transitions import (
    Transition,
    TransitionRunner,
    _Batch,
    verb_of,
)
from fleetlease.persistence.secrets import hash_secret, new_token
from fleetlease.persistence.tables import attempts, hosts, tasks


@dataclass(frozen=True, kw_only=True)
class Renewal:
    """One renewal in a batch (``renew_many``)."""

    session: Session
    task_id: str
    attempt: int
    lease_token: str


class LeaseMixin(TransitionRunner, FencingMixin):
    """Claim, ack, renew and progress."""

    def claim_op(self, session: Session, task_id: str, attempt: int) -> Transition:
        """assigned -> dispatched, only by the owning host with its current session
        before the claim deadline. Generates the lease token (returned once), stores
        only its SHA-256, sets ack deadline and the session generation on the
        attempt. Concurrent claims: exactly one wins, the others get ``Conflict``.

        ``claim_op`` builds it as a :class:`Transition`, validated now and run
        later (alone, or sharing a transaction in ``run_many``); ``claim``
        runs it in a transaction of its own."""
        _check_session(session)
        tid = _check_task_id(task_id)
        _check_int(attempt, "attempt", 1, MAX_INT32)

        async def run(conn: AsyncConnection, now: datetime, batch: _Batch | None) -> Claimed:
            pre = batch.row(tid, attempt, session.host_id) if batch is not None else None
            row = await self._load(conn, session, tid, attempt, pre)
            self._fence_owner(row, session, attempt)
            return await self._claim_row(conn, row, session, now, batch)

        return Transition("claim", tid, attempt, session.host_id, run)

    claim = verb_of(claim_op, Claimed)

    async def _claim_row(
        self,
        conn: AsyncConnection,
        row: RowMapping,
        session: Session,
        now: datetime,
        batch: _Batch | None = None,
    ) -> Claimed:
        tid = row["task_id"]
        if row["status"] in TERMINAL_STATES:
            raise Gone("the task is terminal", reason="terminal", task_id=tid)
        if row["status"] != TaskState.ASSIGNED.value:
            raise Conflict(
                "the assignment is not claimable",
                reason="already_claimed" if row["status"] in _LEASED else "wrong_state",
                task_id=tid,
                state=row["status"],
            )
        if not row["a_claim_deadline"] > now:
            raise Gone("the claim deadline has passed", reason="deadline_passed", task_id=tid)
        token = new_token()
        ack_deadline = now + timedelta(seconds=self.timings.ack_s)
        await self._update_pair(
            conn,
            tid,
            row["attempt"],
            [TaskState.ASSIGNED.value],
            {"status": TaskState.DISPATCHED.value, "updated_at": now},
            {
                "lease_token_hash": hash_secret(token),
                "session_generation": session.generation,
                "claimed_at": now,
                "ack_deadline": ack_deadline,
                "lease_expires_at": ack_deadline,
            },
            batch,
        )
        return Claimed(
            task_id=tid,
            attempt=row["attempt"],
            host_id=row["a_host_id"],
            device_id=row["a_device_id"],
            lease_id=row["a_lease_id"],
            lease_token=token,
            kind=TaskKind(row["kind"]),
            payload=row["payload"],
            goal=row["goal"],
            workflow=row["workflow"],
            ack_deadline=ack_deadline,
            lease_s=self.timings.lease_s,
        )

    async def claim_next(
        self, session: Session, *, device_ids: Sequence[str] = ()
    ) -> Claimed | None:
        """Claim the oldest unexpired assigned attempt of this host (optionally only
        on the given devices), or None. SKIP LOCKED among candidates."""
        _check_session(session)
        if isinstance(device_ids, str) or not all(isinstance(d, str) for d in device_ids):
            raise Invalid("device_ids must be a sequence of strings", field="device_ids")
        wanted = list(device_ids)

        async def run(conn: AsyncConnection, now: datetime) -> Claimed | None:
            await self._check_session_row(conn, session)
            conds = [
                tasks.c.status == TaskState.ASSIGNED.value,
                attempts.c.host_id == session.host_id,
                attempts.c.claim_deadline > now,
            ]
            if wanted:
                conds.append(attempts.c.device_id.in_(wanted))
            row = (
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
                        .where(*conds)
                        .order_by(attempts.c.assigned_at, tasks.c.seq)
                        .limit(1)
                        .with_for_update(of=[tasks, attempts], skip_locked=True)
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                return None
            return await self._claim_row(conn, row, session, now)

        return await self._tx("claim_next", run, driver=True)

    def ack_op(self, session: Session, task_id: str, attempt: int, lease_token: str) -> Transition:
        """dispatched -> running before the ack deadline; starts the execution lease.
        Repeated ack of a running attempt returns the current status.

        ``ack_op`` builds it as a :class:`Transition`, validated now and run
        later (alone, or sharing a transaction in ``run_many``); ``ack``
        runs it in a transaction of its own."""
        tid = self._check_lease_args(session, task_id, attempt, lease_token)

        async def run(conn: AsyncConnection, now: datetime, batch: _Batch | None) -> LeaseStatus:
            pre = batch.row(tid, attempt, session.host_id) if batch is not None else None
            row = await self._load(conn, session, tid, attempt, pre)
            self._fence_lease(row, session, attempt, lease_token)
            if row["status"] == TaskState.RUNNING.value:
                if not row["a_lease_expires_at"] > now:
                    raise Conflict("the lease has expired", reason="lease_expired", task_id=tid)
                return self._status(row, row["status"], row["a_lease_expires_at"])
            if not row["a_ack_deadline"] > now:
                raise Gone("the ack deadline has passed", reason="deadline_passed", task_id=tid)
            expires = now + timedelta(seconds=self.timings.lease_s)
            await self._update_pair(
                conn,
                tid,
                attempt,
                [TaskState.DISPATCHED.value],
                {"status": TaskState.RUNNING.value, "updated_at": now},
                {"acked_at": now, "lease_expires_at": expires},
                batch,
            )
            return self._status(row, TaskState.RUNNING.value, expires, moved=True)

        return Transition("ack", tid, attempt, session.host_id, run)

    ack = verb_of(ack_op, LeaseStatus)

    async def renew(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> LeaseStatus:
        """Extend the lease of a dispatched/running attempt (now + lease_s), same
        attempt and device; reports ``cancel_requested``. Expired, replaced or
        foreign lease: ``Conflict`` (or ``Gone`` when terminal) and nothing changes.
        In ``dispatched`` the deadline stays the ack deadline (see the package
        documentation, ``persistence.repository``)."""
        result = (
            await self.renew_many(
                [
                    Renewal(
                        session=session, task_id=task_id, attempt=attempt, lease_token=lease_token
                    )
                ]
            )
        )[0]
        if isinstance(result, Exception):
            raise result
        return result

    async def renew_many(self, renewals: Sequence[Renewal]) -> list[LeaseStatus | Exception]:
        """Many renewals at once; each entry gets its own outcome (an error for
        one never rolls back the others).

        The usual batch takes two statements in autocommit on the driver's
        connection (``_renew_unlocked``): an unlocked read that every renewal
        fences itself against, and one conditional write of the running leases
        it accepted. A renewal the read cannot decide (no such row) or whose row
        changed before the write runs again in a locked transaction
        (``_renew_locked``), which gives its precise answer."""
        if isinstance(renewals, str | bytes) or not isinstance(renewals, Sequence):
            raise Invalid("renewals must be a sequence of Renewal", field="renewals")
        checked: list[str | Exception] = []
        for r in renewals:
            try:
                if not isinstance(r, Renewal):
                    raise Invalid("renewals must be a sequence of Renewal", field="renewals")
                checked.append(
                    self._check_lease_args(r.session, r.task_id, r.attempt, r.lease_token)
                )
            except RepositoryError as exc:
                checked.append(exc)
        out: list[LeaseStatus | Exception | None] = [
            c if isinstance(c, Exception) else None for c in checked
        ]
        todo = [i for i, c in enumerate(checked) if isinstance(c, str)]
        if todo:
            await self._renew_unlocked(renewals, checked, todo, out)
        rest = [i for i in todo if out[i] is None]
        if rest:
            try:
                again = await self._renew_locked(
                    [renewals[i] for i in rest], [checked[i] for i in rest]
                )
            except Unavailable as exc:
                again = [exc] * len(rest)
            for i, o in zip(rest, again, strict=True):
                out[i] = o
        return [o if o is not None else RuntimeError("renewal without outcome") for o in out]

    async def _renew_unlocked(
        self,
        renewals: Sequence[Renewal],
        checked: Sequence[str | Exception],
        todo: Sequence[int],
        out: list[LeaseStatus | Exception | None],
    ) -> None:
        """Decide what the unlocked read can (see ``renew_many``), in ``out``.

        The read is a committed state: a refusal fenced against it is that
        renewal's answer, and so is a dispatched lease's unchanged deadline (no
        write). A running lease is extended by the write only if its rows are
        still as read: the attempt open, bound to the session generation read
        and not expired, the task running at that attempt (both rows locked, in
        task id order, as every batch locks them), and the host's session that
        generation and not revoked."""

        # What the read decided, kept when the write's fate is unknown.
        before_write: dict[int, LeaseStatus | Exception] = {}

        async def run(conn: Any, now: datetime) -> dict[int, LeaseStatus | Exception]:
            before_write.clear()
            rows = {
                (r["task_id"], r["a_number"], r["k_host_id"]): r
                for r in await conn.fetch(
                    _RENEW_READ_SQL,
                    [checked[i] for i in todo],
                    [renewals[i].attempt for i in todo],
                    [renewals[i].session.host_id for i in todo],
                )
            }
            decided: dict[int, LeaseStatus | Exception] = {}
            extend: dict[tuple[str, int], tuple[int, list[tuple[int, Any]]]] = {}
            for i in todo:
                r, tid = renewals[i], checked[i]
                assert isinstance(tid, str)
                row = rows.get((tid, r.attempt, r.session.host_id))
                if row is None:
                    continue  # the locked path decides (a wrong attempt or task)
                try:
                    deadline = self._fence_renewal(row, r, now)
                    if row["status"] == TaskState.RUNNING.value:
                        # Answered once written (the same lease twice: both).
                        extend.setdefault((tid, r.attempt), (r.session.generation, []))[1].append(
                            (i, row)
                        )
                    else:
                        decided[i] = self._status(row, row["status"], deadline)
                except RepositoryError as exc:
                    decided[i] = exc
            if not extend:
                return decided
            keys = sorted(extend)
            new_expiry = now + timedelta(seconds=self.timings.lease_s)
            before_write.update(decided)
            written = await self._extend_unlocked(
                conn, keys, [extend[k][0] for k in keys], now, new_expiry
            )
            for k in written:
                for i, row in extend[k][1]:
                    decided[i] = self._status(row, TaskState.RUNNING.value, new_expiry)
            return decided

        try:
            decided = await self._raw("renew", run)
        except Unavailable as exc:
            # Nothing is decided without the read; a refusal it gave stands; the
            # write's fate is unknown.
            decided = {i: before_write.get(i, exc) for i in todo}
        for i, o in decided.items():
            out[i] = o

    def _fence_renewal(self, row: Any, r: Renewal, now: datetime) -> datetime:
        """Fence a renewal against its rows (session, token, owner, attempt,
        state, deadline): its lease's current deadline, or the refusal raised."""
        if not _session_ok(r.session, row["host_generation"], row["host_revoked_at"]):
            raise _unauthorized(r.session)
        self._fence_lease(row, r.session, r.attempt, r.lease_token)
        deadline = self._deadline(row)
        if not deadline > now:
            raise Conflict("the lease has expired", reason="lease_expired", task_id=row["task_id"])
        return deadline

    async def _extend_unlocked(
        self,
        conn: Any,
        keys: Sequence[tuple[str, int]],
        generations: Sequence[int],
        now: datetime,
        new_expiry: datetime,
    ) -> list[tuple[str, int]]:
        """``_RENEW_WRITE_SQL``: the (task, attempt) leases it extended."""
        rows = await conn.fetch(
            _RENEW_WRITE_SQL,
            [k[0] for k in keys],
            [k[1] for k in keys],
            list(generations),
            now,
            new_expiry,
        )
        return [(r["task_id"], r["number"]) for r in rows]

    async def _renew_locked(
        self, renewals: Sequence[Renewal], checked: Sequence[str | Exception]
    ) -> list[LeaseStatus | Exception]:
        """Renewals in one locked transaction (``renew_many``'s slow path)."""

        async def run(conn: AsyncConnection, now: datetime) -> list[LeaseStatus | Exception]:
            keys = [
                (t, r.attempt, r.session.host_id)
                for t, r in zip(checked, renewals, strict=True)
                if isinstance(t, str)
            ]
            rows = await self._load_fenced_many(conn, sorted(set(keys)), lease_only=True)
            new_expiry = now + timedelta(seconds=self.timings.lease_s)
            out: list[LeaseStatus | Exception | None] = []
            extend: set[tuple[str, int]] = set()
            missing: list[int] = []
            for tid, r in zip(checked, renewals, strict=True):
                if isinstance(tid, Exception):
                    out.append(tid)
                    continue
                row = rows.get((tid, r.attempt, r.session.host_id))
                if row is None:
                    missing.append(len(out))
                    out.append(None)  # decided below (rare: a wrong attempt or task)
                    continue
                try:
                    deadline = self._fence_renewal(row, r, now)
                    if row["status"] == TaskState.RUNNING.value:
                        extend.add((tid, r.attempt))
                        deadline = new_expiry
                    out.append(self._status(row, row["status"], deadline))
                except RepositoryError as exc:
                    out.append(exc)
            if missing:
                await self._renewals_without_row(conn, renewals, checked, missing, out)
            if extend:
                ex = sorted(extend)
                await conn.execute(
                    _prebuilt("extend_leases", _extend_leases_stmt),
                    {
                        "r_task_id": [k[0] for k in ex],
                        "r_number": [k[1] for k in ex],
                        "p_exp": new_expiry,
                    },
                )
            return [o if o is not None else RuntimeError("renewal without outcome") for o in out]

        return await self._tx("renew", run, driver=True)

    async def check_holds(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> LeaseStatus:
        """Read only: whether the session's host holds this lease now, fenced
        exactly as a renewal is (session, token, owner, attempt, state,
        deadline) and with the renewal's errors, but extending nothing. For the
        side channels that must take data only for a lease held now."""
        tid = self._check_lease_args(session, task_id, attempt, lease_token)
        r = Renewal(session=session, task_id=tid, attempt=attempt, lease_token=lease_token)

        async def run(conn: Any, now: datetime) -> LeaseStatus | None:
            rows = await conn.fetch(_RENEW_READ_SQL, [tid], [attempt], [session.host_id])
            if not rows:
                return None
            deadline = self._fence_renewal(rows[0], r, now)
            return self._status(rows[0], rows[0]["status"], deadline)

        status = await self._raw("check_holds", run)
        if status is not None:
            return status
        out: list[LeaseStatus | Exception | None] = [None]

        async def refusal(conn: AsyncConnection, now: datetime) -> None:
            await self._renewals_without_row(conn, [r], [tid], [0], out)

        await self._tx("check_holds", refusal)
        raise out[0] if isinstance(out[0], Exception) else Conflict("no such attempt")

    async def _renewals_without_row(
        self,
        conn: AsyncConnection,
        renewals: Sequence[Renewal],
        checked: Sequence[str | Exception],
        missing: Sequence[int],
        out: list[LeaseStatus | Exception | None],
    ) -> None:
        """Outcomes of renewals whose (task, attempt) has no row: ``Unauthorized``
        for a stale session, else ``NotFound`` (no such task) or ``Conflict``
        (no such attempt)."""
        host_ids = {renewals[i].session.host_id for i in missing}
        host_rows = {
            h.host_id: h
            for h in await conn.execute(
                sa.select(hosts.c.host_id, hosts.c.session_generation, hosts.c.revoked_at).where(
                    hosts.c.host_id == sa.any_(_arr(sorted(host_ids), sa.Text))
                )
            )
        }
        tids = sorted({str(checked[i]) for i in missing})
        known = {
            str(x)
            for x in (
                await conn.execute(
                    sa.select(tasks.c.id).where(tasks.c.id == sa.any_(_arr(tids, UUIDT)))
                )
            ).scalars()
        }
        for i in missing:
            r, tid = renewals[i], str(checked[i])
            h = host_rows.get(r.session.host_id)
            if h is None or not _session_ok(r.session, h.session_generation, h.revoked_at):
                out[i] = _unauthorized(r.session)
            elif tid not in known:
                out[i] = NotFound("no such task", task_id=tid)
            else:
                out[i] = Conflict("no such attempt", reason="unknown_attempt", task_id=tid)

    def progress_op(
        self, session: Session, task_id: str, attempt: int, lease_token: str, seq: int
    ) -> Transition:
        """A progress report: counts as a renewal; ``progress_seq`` only grows (an
        older or equal seq is accepted as a renewal but does not move it back).

        ``progress_op`` builds it as a :class:`Transition`, validated now and run
        later (alone, or sharing a transaction in ``run_many``); ``progress``
        runs it in a transaction of its own."""
        tid = self._check_lease_args(session, task_id, attempt, lease_token)
        _check_int(seq, "seq", 0, 2**63 - 1)

        async def run(conn: AsyncConnection, now: datetime, batch: _Batch | None) -> LeaseStatus:
            pre = batch.row(tid, attempt, session.host_id) if batch is not None else None
            row = await self._load(conn, session, tid, attempt, pre)
            self._fence_lease(row, session, attempt, lease_token)
            deadline = self._deadline(row)
            if not deadline > now:
                raise Conflict("the lease has expired", reason="lease_expired", task_id=tid)
            if seq > row["progress_seq"]:
                await conn.execute(tasks.update().where(tasks.c.id == tid).values(progress_seq=seq))
            if row["status"] == TaskState.RUNNING.value:
                deadline = now + timedelta(seconds=self.timings.lease_s)
                await conn.execute(
                    attempts.update()
                    .where(attempts.c.task_id == tid, attempts.c.number == attempt)
                    .values(lease_expires_at=deadline)
                )
            return self._status(row, row["status"], deadline)

        return Transition("progress", tid, attempt, session.host_id, run)

    progress = verb_of(progress_op, LeaseStatus)
