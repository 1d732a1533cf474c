"""Logs and artifacts: their own channels, never on the job path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import (
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    NotFound,
    QuotaExceeded,
)
from fleetlease.persistence.model import Session, User
from fleetlease.persistence.repository._sql import UUIDT, _unnest
from fleetlease.persistence.repository._validate import (
    MAX_INT32,
    SHA256_RE,
    _check_int,
    _check_session,
    _check_str,
    _check_task_id,
    _check_user,
)
from fleetlease.persistence.repository.fencing import FencingMixin
from fleetlease.persistence.repository.views import ViewMixin, _iso
from fleetlease.persistence.tables import artifacts, attempts, log_lines, tasks

if TYPE_CHECKING:
    from fleetlease.persistence.repository import Repository


@dataclass(frozen=True, kw_only=True)
class LogLimits:
    """The caps on one attempt's log (``Repository.append_logs``). With at most
    one running attempt per device, a host's share of the log table is bounded
    by its devices times these caps."""

    #: Lines of one attempt.
    max_lines: int = 100_000
    #: UTF-8 bytes of one attempt's lines (10 MiB).
    max_bytes: int = 10 * 1024 * 1024
    #: Seconds after an attempt ended that its lines are still taken.
    grace_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_lines < 1 or self.max_bytes < 1:
            raise ValueError("max_lines and max_bytes must be at least 1")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")

    def marker(self) -> str:
        """The one line that ends a truncated log."""
        return (
            f"[fleetlease: log truncated: this attempt reached its cap of "
            f"{self.max_lines} lines or {self.max_bytes} bytes; later lines were dropped]"
        )


class SideChannelMixin(FencingMixin, ViewMixin):
    """Log lines and artifacts of attempts."""

    async def _own_attempt(
        self, conn: AsyncConnection, session: Session, task_id: str, attempt: int
    ) -> None:
        await self._check_session_row(conn, session)
        row = (
            await conn.execute(
                sa.select(attempts.c.host_id).where(
                    attempts.c.task_id == task_id, attempts.c.number == attempt
                )
            )
        ).first()
        if row is None:
            exists = (
                await conn.execute(sa.select(tasks.c.id).where(tasks.c.id == task_id))
            ).first()
            if exists is None:
                raise NotFound("no such task", task_id=task_id)
            raise NotFound("no such attempt", task_id=task_id, attempt=attempt)
        if row.host_id != session.host_id:
            raise Forbidden("the attempt belongs to another host", task_id=task_id)

    #: The caps on each attempt's log; replace on an instance to change them.
    log_limits: LogLimits = LogLimits()

    async def _log_target(
        self, conn: AsyncConnection, session: Session, task_id: str, attempt: int
    ) -> Any:
        """The attempt's row (host, end, log counters), locked for this append:
        the task row ``FOR KEY SHARE`` first (what the log lines' foreign key
        takes anyway), then the attempt row ``FOR NO KEY UPDATE`` (appends to one
        attempt queue here, so the counters stay exact)."""
        await self._check_session_row(conn, session)
        task = (
            await conn.execute(
                sa.select(tasks.c.id)
                .where(tasks.c.id == task_id)
                .with_for_update(read=True, key_share=True)
            )
        ).first()
        if task is None:
            raise NotFound("no such task", task_id=task_id)
        row = (
            await conn.execute(
                sa.select(
                    attempts.c.host_id,
                    attempts.c.ended_at,
                    attempts.c.log_lines,
                    attempts.c.log_bytes,
                    attempts.c.log_truncated,
                )
                .where(attempts.c.task_id == task_id, attempts.c.number == attempt)
                .with_for_update(key_share=True)
            )
        ).first()
        if row is None:
            raise NotFound("no such attempt", task_id=task_id, attempt=attempt)
        if row.host_id != session.host_id:
            raise Forbidden("the attempt belongs to another host", task_id=task_id)
        return row

    async def append_logs(
        self, session: Session, task_id: str, attempt: int, first_seq: int, lines: Sequence[str]
    ) -> int:
        """Store log lines of an attempt the host owns: while it runs, and for
        ``log_limits.grace_s`` after it ended (lines queued before the result
        still land); after that ``Gone`` (reason ``log_closed``). Duplicate
        (task, attempt, seq) lines are ignored (retries are safe).

        Each attempt's log is capped (``log_limits``: lines and UTF-8 bytes). The
        batch that reaches the cap is stored up to it, followed by one marker
        line saying the log was truncated (at the seq of the first line left
        out); every later line of the attempt is dropped without an error.
        Returns the number of the host's lines stored by this call (not the
        marker). ``Forbidden`` for another host's attempt."""
        _check_session(session)
        tid = _check_task_id(task_id)
        _check_int(attempt, "attempt", 1, MAX_INT32)
        _check_int(first_seq, "first_seq", 0, 2**62)
        if isinstance(lines, str) or not isinstance(lines, Sequence) or len(lines) > 10_000:
            raise Invalid("lines must be a sequence of at most 10000 strings", field="lines")
        for line in lines:
            _check_str(line, "lines", max_len=65536, empty=True)
        limits = self.log_limits

        async def run(conn: AsyncConnection, now: datetime) -> int:
            # Fenced even for an empty batch: a revoked or foreign host gets its error.
            target = await self._log_target(conn, session, tid, attempt)
            if target.ended_at is not None and now >= target.ended_at + timedelta(
                seconds=limits.grace_s
            ):
                raise Gone(
                    f"the attempt ended more than {limits.grace_s:g} s ago; its log is closed",
                    reason="log_closed",
                    task_id=tid,
                    attempt=attempt,
                )
            if not lines or target.log_truncated:
                return 0
            last_seq = first_seq + len(lines) - 1
            stored = {
                seq
                for (seq,) in (
                    await conn.execute(
                        sa.select(log_lines.c.seq).where(
                            log_lines.c.task_id == tid,
                            log_lines.c.attempt == attempt,
                            log_lines.c.seq.between(first_seq, last_seq),
                        )
                    )
                ).all()
            }
            count, size = target.log_lines, target.log_bytes
            seqs: list[int] = []
            kept: list[str] = []
            marker_seq: int | None = None
            for seq, line in enumerate(lines, start=first_seq):
                if seq in stored:
                    continue
                n = len(line.encode("utf-8", "replace"))
                if count + 1 > limits.max_lines or size + n > limits.max_bytes:
                    marker_seq = seq
                    break
                seqs.append(seq)
                kept.append(line)
                count += 1
                size += n
            rows_seq, rows_line = list(seqs), list(kept)
            if marker_seq is not None:
                rows_seq.append(marker_seq)
                rows_line.append(limits.marker())
            if not rows_seq:
                return 0
            r = _unnest("r", seq=(sa.BigInteger, rows_seq), line=(sa.Text, rows_line))
            await conn.execute(
                pg_insert(log_lines)
                .from_select(
                    ["task_id", "attempt", "seq", "ts", "line"],
                    sa.select(
                        sa.cast(sa.literal(tid), UUIDT),
                        sa.literal(attempt, sa.Integer),
                        r.c.seq,
                        sa.literal(now, sa.DateTime(timezone=True)),
                        r.c.line,
                    ),
                )
                .on_conflict_do_nothing()
            )
            await conn.execute(
                attempts.update()
                .where(attempts.c.task_id == tid, attempts.c.number == attempt)
                .values(
                    log_lines=count,
                    log_bytes=size,
                    log_truncated=marker_seq is not None,
                )
            )
            return len(kept)

        return await self._tx("append_logs", run)

    async def read_logs(
        self, task_id: str, user: User, *, after_id: int = 0, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Lines in order (id, attempt, seq, ts, line), authorized like task_view."""
        tid = _check_task_id(task_id)
        _check_user(user)
        _check_int(after_id, "after_id", 0, 2**63 - 1)
        _check_int(limit, "limit", 1, 100_000)

        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            await self._authorize_task(conn, tid, user)
            rows = (
                await conn.execute(
                    sa.select(
                        log_lines.c.id,
                        log_lines.c.attempt,
                        log_lines.c.seq,
                        log_lines.c.ts,
                        log_lines.c.line,
                    )
                    .where(log_lines.c.task_id == tid, log_lines.c.id > after_id)
                    .order_by(log_lines.c.id)
                    .limit(limit)
                )
            ).all()
            return [
                {"id": r.id, "attempt": r.attempt, "seq": r.seq, "ts": _iso(r.ts), "line": r.line}
                for r in rows
            ]

        return await self._tx("read_logs", run)

    async def record_artifact(
        self,
        session: Session,
        task_id: str,
        attempt: int,
        *,
        name: str,
        size: int,
        sha256: str,
        object_name: str,
        quota: ArtifactQuota | None = None,
    ) -> bool:
        """Record an uploaded artifact of an attempt the host owns. Recording the same
        (name, size, sha256) again is a no-op (returns False); a different one under
        the same name is ``Conflict``. With ``quota``, a new artifact that would take
        the attempt or the host beyond it is ``QuotaExceeded`` and nothing is
        recorded (see ``ArtifactQuota``). Returns True when a row was added."""
        _check_session(session)
        tid = _check_task_id(task_id)
        _check_int(attempt, "attempt", 1, MAX_INT32)
        _check_str(name, "name", max_len=255)
        _check_int(size, "size", 0, 2**62)
        if not isinstance(sha256, str) or not SHA256_RE.match(sha256):
            raise Invalid("sha256 must be 64 lowercase hex digits", field="sha256")
        _check_str(object_name, "object_name", max_len=1024)

        async def existing(conn: AsyncConnection) -> bool:
            row = (
                await conn.execute(
                    sa.select(artifacts.c.size, artifacts.c.sha256).where(
                        artifacts.c.task_id == tid,
                        artifacts.c.attempt == attempt,
                        artifacts.c.name == name,
                    )
                )
            ).first()
            if row is None:
                return False
            if (row.size, row.sha256) != (size, sha256):
                raise Conflict("a different artifact has this name", reason="exists", name=name)
            return True

        async def run(conn: AsyncConnection, now: datetime) -> bool:
            await self._own_attempt(conn, session, tid, attempt)
            if await existing(conn):
                return False
            if quota is not None:
                await _check_quota(conn, session.host_id, tid, attempt, size, quota)
            inserted = (
                await conn.execute(
                    pg_insert(artifacts)
                    .values(
                        task_id=tid,
                        attempt=attempt,
                        name=name,
                        size=size,
                        sha256=sha256,
                        object_name=object_name,
                        created_at=now,
                    )
                    .on_conflict_do_nothing()
                    .returning(artifacts.c.name)
                )
            ).first()
            if inserted is not None:
                return True
            await existing(conn)
            return False

        return bool(await self._tx("record_artifact", run))

    async def forget_artifact(
        self, session: Session, task_id: str, attempt: int, *, name: str, sha256: str
    ) -> None:
        """Remove the record of an artifact of the host's attempt whose object
        could not be stored (the commit failed: nothing of it stays)."""
        _check_session(session)
        tid = _check_task_id(task_id)
        _check_int(attempt, "attempt", 1, MAX_INT32)
        _check_str(name, "name", max_len=255)

        async def run(conn: AsyncConnection, now: datetime) -> None:
            await self._own_attempt(conn, session, tid, attempt)
            await conn.execute(
                sa.delete(artifacts).where(
                    artifacts.c.task_id == tid,
                    artifacts.c.attempt == attempt,
                    artifacts.c.name == name,
                    artifacts.c.sha256 == sha256,
                )
            )

        await self._tx("forget_artifact", run)

    async def list_artifacts(self, task_id: str, user: User) -> list[dict[str, Any]]:
        """A task's artifacts, authorized like ``task_view``: the one read of
        :meth:`fleetlease.persistence.reads.Reads.list_artifacts`."""
        from fleetlease.persistence.reads import Reads

        return await Reads(cast("Repository", self)).list_artifacts(task_id, user)


@dataclass(frozen=True, kw_only=True)
class ArtifactQuota:
    """Bounds on committed artifacts: per attempt, at most ``attempt_artifacts``
    artifacts of ``attempt_bytes`` bytes in all; per host, at most ``host_bytes``
    over the artifacts of the attempts it holds now (not ended)."""

    attempt_bytes: int
    attempt_artifacts: int
    host_bytes: int


async def _check_quota(
    conn: AsyncConnection, host_id: str, tid: str, attempt: int, size: int, quota: ArtifactQuota
) -> None:
    """``QuotaExceeded`` unless one more artifact of ``size`` bytes fits. The
    host's commits are serialized by a transaction-scoped advisory lock, so two
    concurrent commits cannot both take the last of a quota."""
    key = sa.func.hashtextextended(sa.literal(f"fleetlease.artifacts.{host_id}"), 0)
    await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(key)))
    count, used = (
        await conn.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(artifacts.c.size), 0)).where(
                artifacts.c.task_id == tid, artifacts.c.attempt == attempt
            )
        )
    ).one()
    if count + 1 > quota.attempt_artifacts:
        raise QuotaExceeded(
            f"an attempt commits at most {quota.attempt_artifacts} artifacts",
            reason="attempt_quota",
        )
    if used + size > quota.attempt_bytes:
        raise QuotaExceeded(
            f"an attempt commits at most {quota.attempt_bytes} bytes of artifacts"
            f" ({used} committed)",
            reason="attempt_quota",
        )
    host_used = (
        await conn.execute(
            sa.select(sa.func.coalesce(sa.func.sum(artifacts.c.size), 0))
            .select_from(
                artifacts.join(
                    attempts,
                    sa.and_(
                        attempts.c.task_id == artifacts.c.task_id,
                        attempts.c.number == artifacts.c.attempt,
                    ),
                )
            )
            .where(attempts.c.host_id == host_id, attempts.c.ended_at.is_(None))
        )
    ).scalar_one()
    if host_used + size > quota.host_bytes:
        raise QuotaExceeded(
            f"the attempts a host holds commit at most {quota.host_bytes} bytes of artifacts"
            f" ({host_used} committed)",
            reason="host_quota",
        )
